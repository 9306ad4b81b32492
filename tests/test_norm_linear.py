"""The `norm_linear` op: RMSNorm folded into the decode product (pallas_kernels' quant_matmul_normed,
interpret mode here, Triton lowering through jax.export, real sizes on a GPU) against the two
references in a row (rms_norm_ref, then quant_matmul_ref), every kernel type, odd splits, a
stacked norm weight read in place; and the registry's rule for when it folds."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ikjax import ops
from ikjax.ops import registry
from ikjax.quant.array import LayerSlice
from pallas_kernels.quant_matmul import KERNEL_TYPES, prepare, quant_matmul_ref
from pallas_kernels.quant_matmul.kernel import pick_config, quant_matmul_normed
from pallas_kernels.rms_norm import rms_norm_ref
from pallas_kernels.testing import cuda_lowering, random_quant_array

EPS = 1e-6


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _inputs(name, M, N, K, seed, layers=None):
    rng = np.random.default_rng(seed)
    shape = (N, K) if layers is None else (layers, N, K)
    pw = prepare(random_quant_array(name, shape, rng))
    x = jnp.asarray(rng.standard_normal((M, K)) * 4 + 1, jnp.float32)  # not unit rms: the scale matters
    nw = jnp.asarray(rng.uniform(0.2, 2.0, K if layers is None else (layers, K)), jnp.float32)
    return pw, x, nw


def _folded_exact(x, nw, pw, dtype):
    """What the folded kernel computes, in float64 terms: 1/rms times W (x * weight rounded to dtype)."""
    inv = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS)
    return inv * quant_matmul_ref((x * nw).astype(dtype).astype(jnp.float32), pw, jnp.float32)


@pytest.mark.parametrize("name", sorted(KERNEL_TYPES))
def test_folded_norm_matches_the_references(name):
    N, K = 48, 768
    pw, x, nw = _inputs(name, 3, N, K, abs(hash(name + "n")) % 2**32)
    for M in (1, 3):
        for dtype in (jnp.float32, jnp.bfloat16):
            y = quant_matmul_normed(x[:M], nw, EPS, pw, dtype, interpret=True)
            ref = quant_matmul_ref(rms_norm_ref(x[:M], nw, EPS), pw, dtype)
            assert y.shape == (M, N) and y.dtype == jnp.float32 and np.isfinite(np.asarray(y)).all()
            assert rel(y, _folded_exact(x[:M], nw, pw, dtype)) < 1e-5, (name, M, dtype)
            assert rel(y, ref) < (1e-5 if dtype == jnp.float32 else 6e-3), (name, M, dtype, rel(y, ref))


def test_folded_norm_split_k_uneven_and_leading_dims():
    """Splits that do not divide the k-steps (each split sums its own squares; the partial sums of
    products and of squares are added in order), rows in leading dims, a zero row (0/0 never: its
    products are 0, times rsqrt(eps))."""
    pw, x, nw = _inputs("Q4_0", 2, 32, 1024, 3)
    x = x.at[1].set(0.0).reshape(2, 1, 1024)
    want = quant_matmul_ref(rms_norm_ref(x, nw, EPS), pw, jnp.float32)
    for split in (1, 3, 4, 8):
        cfg = dict(mode="rows", bm=2, bn=16, bk=128, split=split, num_warps=4, num_stages=3)
        y = quant_matmul_normed(x, nw, EPS, pw, jnp.float32, interpret=True, config=cfg)
        assert y.shape == (2, 1, 32)
        assert rel(y[0], want[0]) < 1e-6, split
        assert np.array_equal(np.asarray(y[1]), np.zeros((1, 32), np.float32))
    with pytest.raises(ValueError, match="rows schedule"):
        quant_matmul_normed(jnp.ones((16, 1024)), nw, EPS, pw, jnp.float32, interpret=True)


def test_stacked_weights_and_norms_read_in_place():
    """A scanned group's layer: W and the norm's weight both stacks, read at their indices."""
    pw, x, nw = _inputs("Q8_0", 1, 64, 512, 11, layers=3)
    for layer in (0, 2):
        y = quant_matmul_normed(x, nw, EPS, pw, jnp.bfloat16, interpret=True, layer=jnp.int32(layer),
                                norm_layer=jnp.int32(layer))
        want = _folded_exact(x, nw[layer], pw.take(layer), jnp.bfloat16)
        assert rel(y, want) < 1e-5, layer


def _invariant_rows(x, nw, pw, dtype, live=None, interpret=True):
    return quant_matmul_normed(x, nw, EPS, pw, dtype, interpret=interpret, row_invariant=True,
                               live_rows=None if live is None else jnp.asarray(live, jnp.int32))


@pytest.mark.parametrize("name", ["Q4_0", "Q6_K", "IQ4_XS"])
def test_folded_norm_batch_invariant_rows(name):
    """The batch-invariant step's row form, folded (serve's decode): each row of a batch gets the
    bits it gets alone (its products, its sum of squares and its scale are its own programs'),
    whatever the other rows hold or how many there are; an idle slot's row is zeros and changes
    nothing; both within rounding of the references in a row."""
    pw, x, nw = _inputs(name, 6, 48, 1024, abs(hash(name + "i")) % 2**32)
    alone = [np.asarray(_invariant_rows(x[r:r + 1], nw, pw, jnp.bfloat16)) for r in range(6)]
    batch = np.asarray(_invariant_rows(x, nw, pw, jnp.bfloat16))
    for r in range(6):
        assert np.array_equal(batch[r:r + 1], alone[r]), (name, r)
    live = [1, 0, 1, 1, 0, 1]
    some = np.asarray(_invariant_rows(x.at[1].set(1e4), nw, pw, jnp.bfloat16, live))
    for r in range(6):
        assert np.array_equal(some[r:r + 1], alone[r] if live[r] else np.zeros_like(alone[r])), (name, r)
    ref = quant_matmul_ref(rms_norm_ref(x, nw, EPS), pw, jnp.bfloat16)
    assert rel(batch, ref) < 6e-3 and rel(batch, _folded_exact(x, nw, pw, jnp.bfloat16)) < 1e-5


@pytest.mark.parametrize("name", sorted(KERNEL_TYPES))
def test_folded_norm_triton_lowering(name):
    rng = np.random.default_rng(5)
    pw = prepare(random_quant_array(name, (64, 512), rng, fast=True))
    for M in (1, 4):
        cuda_lowering(lambda x, nw, w: quant_matmul_normed(x, nw, EPS, w), jnp.zeros((M, 512), jnp.float32),
                      jnp.ones((2, 512), jnp.float32), pw)
    cuda_lowering(lambda x, nw, w, live: quant_matmul_normed(x, nw, EPS, w, row_invariant=True, live_rows=live),
                  jnp.zeros((8, 512), jnp.float32), jnp.ones((2, 512), jnp.float32), pw, jnp.ones((8,), jnp.int32))


def test_op_folds_only_decode_products_outside_batch_invariant_steps(monkeypatch):
    pw, x, nw = _inputs("Q4_0", 8, 32, 256, 4, layers=2)
    from ikjax.ops.quant_matmul import layer_view
    view = layer_view({"w": pw, "attn_norm": nw}, jnp.int32(1))
    assert isinstance(view["attn_norm"], LayerSlice) and view["attn_norm"].shape == (256,)
    want = quant_matmul_ref(rms_norm_ref(x, nw[1], EPS), pw.take(1), jnp.bfloat16)
    monkeypatch.setenv("IKJAX_BATCH_INVARIANT", "0")
    with ops.kernel_context("interpret", 1, seq_tokens=1):
        y = ops.norm_linear(x[:1], view["attn_norm"], EPS, view["w"], jnp.bfloat16)
        assert registry.selected("norm_linear") == "interpret"
        assert rel(y, want[:1]) < 6e-3
        ops.norm_linear(x, view["attn_norm"], EPS, view["w"], jnp.bfloat16)  # 8 rows: a prompt's
        assert registry.selected("norm_linear") == "xla"
        monkeypatch.setenv("IKJAX_FOLD_NORM", "0")
        y0 = ops.norm_linear(x[:1], view["attn_norm"], EPS, view["w"], jnp.bfloat16)
        assert registry.selected("norm_linear") == "xla" and registry.selected("quant_linear") == "interpret"
        assert rel(y0, want[:1]) < 6e-3
        monkeypatch.setenv("IKJAX_FOLD_NORM", "1")
        monkeypatch.setenv("IKJAX_BATCH_INVARIANT", "1")  # each row as alone: the row form folds, 8 rows too
        y8 = ops.norm_linear(x, view["attn_norm"], EPS, view["w"], jnp.bfloat16)
        assert registry.selected("norm_linear") == "interpret"
        assert rel(y8, want) < 6e-3
        monkeypatch.setenv("IKJAX_INVARIANT_FORM", "dot")  # the matrix-unit form: norm and product kept apart
        ops.norm_linear(x[:1], view["attn_norm"], EPS, view["w"], jnp.bfloat16)
        assert registry.selected("norm_linear") == "xla" and registry.selected("rms_norm") == "interpret"
    monkeypatch.setenv("IKJAX_FOLD_NORM", "2")
    with pytest.raises(Exception, match="IKJAX_FOLD_NORM"), ops.kernel_context("interpret", 1, seq_tokens=1):
        ops.norm_linear(x[:1], view["attn_norm"], EPS, view["w"], jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "IQ4_XS", "BF16"])
def test_gpu_folded_norm_real_size(name):
    """On the hardware, V2-Lite's and R1's norm-fed products (attn_in 2112 x 2048, q_b 3072 x 1536,
    the head 102400 x 2048, R1's attn_in 2112 x 7168) at 1 and 4 rows, against the references."""
    assert jax.default_backend() == "gpu"
    rng = np.random.default_rng(9)
    for N, K in [(2112, 2048), (3072, 1536), (102400, 2048), (2112, 7168)]:
        try:
            pw = prepare(random_quant_array(name, (N, K), rng, fast=True))
        except ValueError:
            continue  # K not a multiple of the type's super-block
        nw = jnp.asarray(rng.uniform(0.2, 2.0, K), jnp.float32)
        for M in (1, 4):
            x = jnp.asarray(rng.standard_normal((M, K)) * 4, jnp.float32)
            assert pick_config(pw.qtype, M, N, K)["mode"] == "rows"
            y = quant_matmul_normed(x, nw, EPS, pw, jnp.bfloat16)
            assert rel(y, _folded_exact(x, nw, pw, jnp.bfloat16)) < 1e-4, (name, N, K, M)
            assert rel(y, quant_matmul_ref(rms_norm_ref(x, nw, EPS), pw, jnp.bfloat16)) < 6e-3, (name, N, K, M)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "Q4_K", "IQ4_XS"])
def test_gpu_folded_norm_batch_invariant_rows(name):
    """On the hardware, the invariant row form folded at V2-Lite's norm-fed shapes: 8 rows (two of
    them idle slots) each equal to the row alone bit for bit, within rounding of the references."""
    assert jax.default_backend() == "gpu"
    rng = np.random.default_rng(13)
    for N, K in [(2112, 2048), (102400, 2048)]:
        pw = prepare(random_quant_array(name, (N, K), rng, fast=True))
        nw = jnp.asarray(rng.uniform(0.2, 2.0, K), jnp.float32)
        x = jnp.asarray(rng.standard_normal((8, K)) * 4, jnp.float32)
        live = [1, 1, 0, 1, 1, 1, 0, 1]
        batch = np.asarray(_invariant_rows(x, nw, pw, jnp.bfloat16, live, interpret=False))
        for r in range(8):
            alone = np.asarray(_invariant_rows(x[r:r + 1], nw, pw, jnp.bfloat16, interpret=False))
            assert np.array_equal(batch[r:r + 1], alone if live[r] else np.zeros_like(alone)), (name, N, r)
        ref = quant_matmul_ref(rms_norm_ref(x, nw, EPS), pw, jnp.bfloat16)
        on = np.asarray(live, bool)
        assert rel(batch[on], np.asarray(ref)[on]) < 6e-3, (name, N, K)
