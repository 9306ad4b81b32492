"""pallas_kernels.moe_matmul: gather and grouped expert FFN (interpret mode) vs the reference and
vs the model's own op (ikjax.ops.moe_experts, XLA path) on the unpacked QuantArrays."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ikjax import ops
from pallas_kernels.moe_matmul import moe_experts_gather, moe_experts_grouped, moe_experts_ref, moe_experts_grouped_ref
from pallas_kernels.quant_matmul import prepare
from pallas_kernels.testing import random_quant_array


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def experts(name, E, F, d, rng):
    g = random_quant_array(name, (E, F, d), rng)
    u = random_quant_array(name, (E, F, d), rng)
    dn = random_quant_array(name, (E, d, F), rng)
    return (g, u, dn), tuple(prepare(t) for t in (g, u, dn))


def routing(N, E, k, rng):
    ids = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(N)]), jnp.int32)
    w = jnp.asarray(rng.uniform(0.1, 1.0, (N, k)), jnp.float32)
    return w, ids


@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "IQ4_XS", "BF16"])
def test_gather_matches_model(name):
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    E, F, d, k = 6, 256, 256, 3
    qas, pws = experts(name, E, F, d, rng)
    for N in (1, 3):
        x = jnp.asarray(rng.standard_normal((N, d)), jnp.float32)
        w, ids = routing(N, E, k, rng)
        y = moe_experts_gather(x, w, ids, *pws, interpret=True)
        r = moe_experts_ref(x, w, ids, *pws)
        m = ops.moe_experts(x, w, ids, *qas, jnp.bfloat16, fused=True, backend="xla")
        assert np.isfinite(np.asarray(y)).all()
        assert rel(y, r) < 2e-2 and rel(r, m) < 1e-6, (name, N, rel(y, r), rel(r, m))
        y32 = moe_experts_gather(x, w, ids, *pws, dtype=jnp.float32, interpret=True)
        assert rel(y32, moe_experts_ref(x, w, ids, *pws, dtype=jnp.float32)) < 1e-5


@pytest.mark.parametrize("name", ["Q4_0", "Q4_K"])
def test_grouped_matches_reference(name):
    rng = np.random.default_rng(7)
    E, F, d, k, N = 5, 256, 256, 2, 11
    _, pws = experts(name, E, F, d, rng)
    x = jnp.asarray(rng.standard_normal((N, d)), jnp.float32)
    w, ids = routing(N, E, k, rng)
    y = moe_experts_grouped(x, w, ids, *pws, interpret=True, bm=16)
    r = moe_experts_grouped_ref(x, w, ids, *pws)
    assert rel(y, r) < 1e-3
    assert rel(moe_experts_ref(x, w, ids, *pws), r) < 1e-3


@pytest.mark.gpu
def test_gpu_v2_lite_experts():
    assert jax.default_backend() == "gpu"
    from pallas_kernels.moe_matmul import moe_experts
    rng = np.random.default_rng()
    E, F, d, k = 64, 1408, 2048, 6
    _, pws = experts("Q4_0", E, F, d, rng)
    for N in (1, 4, 512):
        x = jnp.asarray(rng.standard_normal((N, d)), jnp.float32)
        w, ids = routing(N, E, k, rng)
        ref = moe_experts_ref if N * k <= 2 * E else moe_experts_grouped_ref
        assert rel(moe_experts(x, w, ids, *pws), ref(x, w, ids, *pws)) < 6e-3


@pytest.mark.parametrize("N", [1, 3, 11])
def test_zero_weight_slots_are_skipped(N):
    """Slots of weight 0 (-ser, or another device's experts under -sm graph) become dead tiles
    (expert -1) in both forms: the result equals the reference that computes them times 0."""
    from pallas_kernels.moe_matmul.kernel import moe_experts as pallas_moe
    rng = np.random.default_rng(N)
    E, F, d, k = 6, 256, 256, 3
    _, pws = experts("Q4_0", E, F, d, rng)
    x = jnp.asarray(rng.standard_normal((N, d)), jnp.float32)
    w, ids = routing(N, E, k, rng)
    w = w.at[:, 1].set(0.0).at[0, 0].set(0.0)  # a token may keep a single live slot
    y = pallas_moe(x, w, ids, *pws, dtype=jnp.float32, interpret=True)
    assert rel(y, moe_experts_ref(x, w, ids, *pws, dtype=jnp.float32)) < 1e-5
    w0 = jnp.zeros_like(w)  # every slot dead: zeros, no weight read
    assert not np.asarray(pallas_moe(x, w0, ids, *pws, dtype=jnp.float32, interpret=True)).any()
    dead = jnp.where(w != 0, ids, -1)  # the forms take -1 directly
    g = moe_experts_grouped(x, w, dead, *pws, dtype=jnp.float32, interpret=True, bm=16)
    assert rel(g, moe_experts_grouped_ref(x, w, ids, *pws, dtype=jnp.float32)) < 1e-5


@pytest.mark.parametrize("N", [20, 40])
def test_grouped_form_tile_height_follows_tokens_per_expert(N):
    """The grouped form takes 16-row tiles where an expert gets at most 8 tokens on average (a
    short prompt step), 64 otherwise; either way the reference's result."""
    from pallas_kernels.moe_matmul.kernel import grouped_tile_rows, moe_experts as pallas_moe
    assert grouped_tile_rows(64 * 6, 64) == 16 and grouped_tile_rows(256 * 6, 64) == 64
    assert grouped_tile_rows(512 * 8, 256) == 64 and grouped_tile_rows(64 * 8, 256) == 16
    rng = np.random.default_rng(N)
    E, F, d, k = 8, 256, 256, 2
    _, pws = experts("Q4_0", E, F, d, rng)
    x = jnp.asarray(rng.standard_normal((N, d)), jnp.float32)
    w, ids = routing(N, E, k, rng)
    assert grouped_tile_rows(N * k, E) == (16 if N == 20 else 64)
    y = pallas_moe(x, w, ids, *pws, dtype=jnp.float32, interpret=True)
    assert rel(y, moe_experts_grouped_ref(x, w, ids, *pws, dtype=jnp.float32)) < 1e-5
