"""pallas_kernels/prompt_attention (interpret mode) against its jnp reference: causal by position
(a prompt chunk at any start), odd T and S (padded to whole blocks), several heads and sequences,
f32 and bf16, the rope part read from a wider row."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.prompt_attention import attention_kv_flash, attention_kv_ref, supports


@pytest.mark.parametrize("B,T,S,H,nope,R,dv,start,dtype", [
    (1, 7, 40, 2, 16, 16, 16, 30, jnp.float32),      # a chunk late in the bucket, T < one block
    (2, 33, 100, 3, 32, 16, 32, 0, jnp.float32),     # the first chunk, odd T and S
    (1, 80, 200, 2, 16, 32, 16, 100, jnp.float32),   # two query blocks, keys past the last position unread
    (2, 20, 64, 2, 32, 16, 32, 11, jnp.bfloat16),
])
def test_flash_matches_reference(B, T, S, H, nope, R, dv, start, dtype):
    rng = np.random.default_rng(T + S)
    q = jnp.asarray(rng.standard_normal((B, T, H, nope + R)), dtype)
    kv = jnp.asarray(rng.standard_normal((B, S, H, nope + dv)), dtype)
    k_rope = jnp.asarray(rng.standard_normal((B, S, R + 8)), dtype)
    # the second sequence starts 3 later: each row is causal by its own positions
    q_pos = jnp.minimum(start + np.arange(T)[None] + 3 * np.arange(B)[:, None], S - 1).astype(np.int32)
    ref = attention_kv_ref(q, kv, k_rope, q_pos, 0.3, nope)
    got = attention_kv_flash(q, kv, k_rope, q_pos, 0.3, nope, interpret=True)
    assert got.shape == (B, T, H, dv) and got.dtype == jnp.float32
    tol = 2e-6 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=tol, atol=tol)


def test_blocks_past_the_last_position_are_never_read():
    """NaN in every key block after the one holding the chunk's last position changes nothing:
    the loop stops there (the rest of that block is masked; cache rows are always finite)."""
    rng = np.random.default_rng(1)
    B, T, S, H, nope, R, dv = 1, 16, 256, 2, 16, 16, 16
    q = jnp.asarray(rng.standard_normal((B, T, H, nope + R)), jnp.float32)
    kv = rng.standard_normal((B, S, H, nope + dv)).astype(np.float32)
    k_rope = rng.standard_normal((B, S, R)).astype(np.float32)
    q_pos = (40 + np.arange(T))[None].astype(np.int32)
    clean = attention_kv_flash(q, jnp.asarray(kv), jnp.asarray(k_rope), q_pos, 0.2, nope, interpret=True)
    kv[:, 64:] = np.nan   # position 55 is in block 0 of 64 rows
    k_rope[:, 64:] = np.nan
    poisoned = attention_kv_flash(q, jnp.asarray(kv), jnp.asarray(k_rope), q_pos, 0.2, nope, interpret=True)
    np.testing.assert_array_equal(np.asarray(poisoned), np.asarray(clean))


def test_supports_power_of_two_heads_only():
    assert supports(128, 64, 128) and supports(16, 16, 16)
    assert not supports(96, 64, 128) and not supports(128, 8, 128)


@pytest.mark.gpu
@pytest.mark.skipif(__import__("jax").default_backend() != "gpu", reason="the compiled (Triton) kernel needs a GPU")
@pytest.mark.parametrize("H,T,S,start", [(16, 512, 4096, 1000), (128, 64, 8192, 8000), (4, 100, 300, 150)])
def test_compiled_kernel_on_gpu(H, T, S, start):
    """On a GPU: the Triton-compiled kernel at DeepSeek's head dimensions (128 / 64 / 128) against
    the reference, bf16, a chunk deep in its bucket."""
    rng = np.random.default_rng(H + T)
    q = jnp.asarray(rng.standard_normal((1, T, H, 192)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((1, S, H, 256)) * 0.5, jnp.bfloat16)
    k_rope = jnp.asarray(rng.standard_normal((1, S, 64)), jnp.bfloat16)
    q_pos = jnp.asarray(np.minimum(start + np.arange(T), S - 1)[None], jnp.int32)
    ref = attention_kv_ref(q, kv, k_rope, q_pos, 0.07, 128)
    got = attention_kv_flash(q, kv, k_rope, q_pos, 0.07, 128)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=3e-2, atol=3e-2)
