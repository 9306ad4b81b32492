"""pallas_kernels.mla_decode: split-KV flash decoding (interpret mode) vs the reference and vs the
model's attention on bf16, f16 and q8_0 latent caches, ragged lengths."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ikjax.model import cache as kvcache
from ikjax.ops.attn import attend_materialized
from pallas_kernels.mla_decode import mla_decode, mla_decode_ref


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def make(B, H, S, rng, ctk):
    q = jnp.asarray(rng.standard_normal((B, H, 576)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((B, S, 576)), jnp.float32)
    cache = kvcache.quantize_q8_0(c) if ctk == "q8_0" else c.astype({"bf16": jnp.bfloat16, "f16": jnp.float16}[ctk])
    return q, cache


@pytest.mark.parametrize("ctk", ["bf16", "f16", "q8_0"])
def test_decode_matches_reference_and_model(ctk):
    rng = np.random.default_rng(11)
    B, H, S = 3, 16, 80
    q, cache = make(B, H, S, rng, ctk)
    lengths = jnp.array([1, 47, 80], jnp.int32)
    r = mla_decode_ref(q, cache, lengths, 0.06, dtype=jnp.float32)
    for cfg in (None, dict(bh=16, bs=16, split=5, num_warps=4, num_stages=2)):
        y = mla_decode(q, cache, lengths, 0.06, dtype=jnp.float32, interpret=True, config=cfg)
        assert y.shape == (B, H, 512) and np.isfinite(np.asarray(y)).all()
        assert rel(y, r) < 1e-5, (ctk, cfg, rel(y, r))
    yb = mla_decode(q, cache, lengths, 0.06, dtype=jnp.bfloat16, interpret=True)
    assert rel(yb, mla_decode_ref(q, cache, lengths, 0.06)) < 1e-2
    # the model's own attention (absorbed form: k = latent entry, v = its first 512)
    lat = kvcache.read(jax.tree.map(lambda a: a[None], cache), 0, S, 576, jnp.float32)
    m = attend_materialized(q[:, None], lat[:, :, None], lat[:, :, None, :512], (lengths - 1)[:, None], 0.06)
    assert rel(y, m[:, 0]) < 1e-5


@pytest.mark.parametrize("ctk", ["bf16", "q8_0"])
def test_layer_of_a_stack_read_in_place(ctk):
    """A scanned layer group passes its cache stack [L, B, S, W] and the scan's (traced) index:
    every implementation reads that layer, the same as given the layer's own cache."""
    from ikjax import ops
    from pallas_kernels.mla_decode import cpu as mla_cpu
    rng = np.random.default_rng(13)
    B, H, S, L = 2, 16, 64, 3
    q = jnp.asarray(rng.standard_normal((B, H, 576)), jnp.float32)
    per_layer = [make(B, H, S, rng, ctk)[1] for _ in range(L)]
    stack = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
    lengths = jnp.array([5, 64], jnp.int32)
    backends = ["xla", "interpret"] + (["cpu"] if mla_cpu.supported((B, H, 576), per_layer[0], 512) else [])
    for backend in backends:
        f = jax.jit(lambda q, c, l, i, b=backend: ops.mla_decode_attention(q, c, l, 0.06, dtype=jnp.float32,
                                                                          backend=b, layer=i))
        for li in range(L):
            want = mla_decode_ref(q, per_layer[li], lengths, 0.06, dtype=jnp.float32)
            got = f(q, stack, lengths, jnp.int32(li))
            assert rel(got, want) < 1e-5, (backend, li, rel(got, want))


def test_decode_32_heads_split():
    rng = np.random.default_rng(12)
    q, cache = make(1, 32, 64, rng, "bf16")
    lengths = jnp.array([64], jnp.int32)
    cfg = dict(bh=16, bs=16, split=4, num_warps=4, num_stages=2)
    y = mla_decode(q, cache, lengths, 0.1, dtype=jnp.float32, interpret=True, config=cfg)
    assert rel(y, mla_decode_ref(q, cache, lengths, 0.1, dtype=jnp.float32)) < 1e-5


def test_triton_lowering():
    from pallas_kernels.testing import cuda_lowering
    lengths = jnp.ones((2,), jnp.int32)
    q = jnp.zeros((2, 128, 576), jnp.bfloat16)
    cuda_lowering(lambda q, c, l: mla_decode(q, c, l, 0.1), q, jnp.zeros((2, 1024, 576), jnp.bfloat16), lengths)
    cuda_lowering(lambda q, c, l: mla_decode(q, c, l, 0.1), q, kvcache.quantize_q8_0(jnp.zeros((2, 1024, 576))),
                  lengths)


@pytest.mark.gpu
@pytest.mark.parametrize("ctk", ["bf16", "q8_0"])
def test_gpu_real_size(ctk):
    assert jax.default_backend() == "gpu"
    rng = np.random.default_rng()
    for B, H, S in [(1, 16, 16384), (4, 128, 4096)]:
        q, cache = make(B, H, S, rng, ctk)
        lengths = jnp.asarray(rng.integers(1, S + 1, B), jnp.int32)
        assert rel(mla_decode(q, cache, lengths, 0.07), mla_decode_ref(q, cache, lengths, 0.07)) < 1e-2


@pytest.mark.parametrize("H", [4, 8, 24])
def test_fewer_heads_than_a_block_are_padded(H):
    """A device's share of the heads under -sm graph (16 / 4 = 4): the registry pads the queries to
    the kernel's 16-head blocks and drops the padded outputs."""
    from ikjax import ops
    rng = np.random.default_rng(H)
    q, cache = make(2, H, 64, rng, "bf16")
    lengths = jnp.array([5, 64], jnp.int32)
    assert ops.mla_decode_supported(H, 64, 576, 512, backend="interpret")
    y = ops.mla_decode_attention(q, cache, lengths, 0.1, dtype=jnp.float32, backend="interpret")
    assert ops.selected("mla_decode") == "interpret"
    assert y.shape == (2, H, 512)
    assert rel(y, mla_decode_ref(q, cache, lengths, 0.1, dtype=jnp.float32)) < 1e-5
