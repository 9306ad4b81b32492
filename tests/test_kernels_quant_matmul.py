"""pallas_kernels.quant_matmul: lossless packing, interpret-mode kernel vs the jnp reference,
Triton lowering of every type and schedule (on CPU, through jax.export), GPU at real sizes."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.quant_matmul import KERNEL_TYPES, dequantize_packed, prepare, quant_matmul, quant_matmul_ref
from pallas_kernels.quant_matmul.kernel import invariant_config, pick_config, quant_matmul_experts, quant_matmul_live
from pallas_kernels.testing import cuda_lowering, random_quant_array

TYPES = list(KERNEL_TYPES)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("name", TYPES + ["Q8_0"])
def test_packing_bit_exact(name):
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    for shape in [(5, 512), (3, 7, 256)]:
        qa = random_quant_array(name, shape, rng)
        pw = prepare(qa)
        assert pw.shape == shape
        a, b = np.asarray(qa.dequantize()), np.asarray(dequantize_packed(pw))
        assert np.array_equal(a, b, equal_nan=True), name
        assert np.array_equal(np.asarray(qa.dequantize(jnp.bfloat16)), np.asarray(pw.dequantize(jnp.bfloat16)))
        assert abs(pw.nbytes - qa.nbytes) <= qa.nbytes // 20      # same bits, a few unpacked scales


@pytest.mark.parametrize("name", TYPES)
def test_kernel_interpret_matches_reference(name):
    rng = np.random.default_rng(abs(hash(name + "k")) % 2**32)
    N, K = 48, 768                                  # 3 column tiles of 16, K = 3 super-blocks
    pw = prepare(random_quant_array(name, (N, K), rng))
    for M in (1, 3, 7):                              # rows schedule (1, 3) and dot schedule (7)
        x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
        y = quant_matmul(x, pw, jnp.bfloat16, interpret=True)
        r = quant_matmul_ref(x, pw, jnp.bfloat16)
        exact = quant_matmul_ref(x.astype(jnp.bfloat16).astype(jnp.float32), pw, jnp.float32)
        assert y.shape == (M, N) and y.dtype == jnp.float32
        assert np.isfinite(np.asarray(y)).all()
        if M <= 4:   # rows schedule: float32 weights, bf16-rounded x (more exact than the bf16 reference)
            assert rel(y, exact) < 1e-5, (name, M, rel(y, exact))
        else:        # dot schedule: bf16 tiles, as the reference
            assert rel(y, r) < 1e-5, (name, M, rel(y, r))
        assert rel(y, r) < 5e-3


def test_kernel_split_k_f32_and_leading_dims():
    rng = np.random.default_rng(3)
    pw = prepare(random_quant_array("Q4_0", (32, 1024), rng))
    x = jnp.asarray(rng.standard_normal((2, 1, 1024)), jnp.float32)
    cfg = dict(mode="rows", bm=2, bn=16, bk=128, split=4, num_warps=4, num_stages=3)
    y = quant_matmul(x, pw, jnp.float32, interpret=True, config=cfg)
    r = quant_matmul_ref(x, pw, jnp.float32)
    assert y.shape == (2, 1, 32)
    assert rel(y, r) < 1e-6
    y = quant_matmul(x, pw, jnp.bfloat16, interpret=True, config=cfg)
    assert rel(y, quant_matmul_ref(x.astype(jnp.bfloat16).astype(jnp.float32), pw, jnp.float32)) < 1e-6
    # splits that do not divide the 8 k-steps (3, 3, 2), as pick_config makes for K = 11 * 2^n
    cfg3 = dict(cfg, split=3)
    assert rel(quant_matmul(x, pw, jnp.float32, interpret=True, config=cfg3), r) < 1e-6
    c = pick_config("Q4_0", 1, 2048, 10944)
    assert c["split"] > 1 and (10944 // c["bk"]) % c["split"] != 0
    cfg = dict(mode="dot", bm=16, bn=16, bk=64, split=1, num_warps=4, num_stages=2)
    x = jnp.asarray(rng.standard_normal((19, 1024)), jnp.float32)
    assert rel(quant_matmul(x, pw, jnp.bfloat16, interpret=True, config=cfg), quant_matmul_ref(x, pw)) < 1e-5


def test_split_k_swiglu_experts():
    """Gate and up in one pass with split-K (the SiLU waits for the splits' sum), dead tiles too."""
    rng = np.random.default_rng(8)
    g = prepare(random_quant_array("Q4_0", (4, 32, 1024), rng))
    u = prepare(random_quant_array("Q4_0", (4, 32, 1024), rng))
    x = jnp.asarray(rng.standard_normal((3, 1024)), jnp.float32)
    e = jnp.array([2, -1, 0], jnp.int32)
    want = []
    for r, ei in enumerate(np.asarray(e)):
        if ei < 0:
            want.append(np.zeros(32))
            continue
        a = np.asarray(quant_matmul_ref(x[r:r + 1], g.take(int(ei)), jnp.float32))[0]
        b = np.asarray(quant_matmul_ref(x[r:r + 1], u.take(int(ei)), jnp.float32))[0]
        want.append(a / (1 + np.exp(-a)) * b)
    want = np.stack(want)
    for split in (1, 3, 8):
        cfg = dict(mode="rows", bm=1, bn=16, bk=128, split=split, num_warps=4, num_stages=3)
        y = quant_matmul_experts(x, (g, u), e, jnp.float32, tile_rows=1, swiglu=True, interpret=True, config=cfg)
        assert y.shape == (3, 32) and rel(y, want) < 1e-5, (split, rel(y, want))
    assert pick_config("Q4_0", 6, 1408, 2048, tile_rows=1)["split"] > 1  # V2-Lite's gate|up GEMV splits


@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "Q4_K"])
def test_live_rows_interpret(name):
    """quant_matmul_live: each sequence's rows below `live` equal the dot schedule's product; rows
    at or past it are not written (the output buffer keeps what XLA gave it), whatever tile they
    start. Odd live counts, inside and at the edges of tiles, one and two sequences, a stacked
    layer read in place."""
    rng = np.random.default_rng(abs(hash(name + "live")) % 2**32)
    N, K, S = 48, 512, 64                            # tiles of 16 rows: four a sequence
    layers = [random_quant_array(name, (N, K), rng) for _ in range(3)]
    stack = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *[prepare(qa) for qa in layers])
    one = prepare(random_quant_array(name, (N, K), rng))
    for B in (1, 2):
        x = jnp.asarray(rng.standard_normal((B, S, K)), jnp.float32)
        want = quant_matmul_ref(x, one, jnp.bfloat16)
        for live in (1, 15, 16, 17, 40, S):
            cfg = dict(pick_config(name, B * S, N, K), bm=16)
            y = quant_matmul_live(x, one, jnp.int32(live), jnp.bfloat16, interpret=True, config=cfg)
            assert y.shape == (B, S, N) and y.dtype == jnp.bfloat16
            got = np.asarray(y[:, :live], np.float32)
            assert rel(got, np.asarray(want[:, :live], np.float32)) < 1e-2, (name, B, live)
            assert np.isfinite(got).all()
    x = jnp.asarray(rng.standard_normal((1, S, K)), jnp.float32)
    y = quant_matmul_live(x, stack, jnp.int32(S), jnp.bfloat16, interpret=True, layer=jnp.int32(1))
    want = quant_matmul_ref(x, layers[1], jnp.bfloat16)
    assert rel(np.asarray(y, np.float32), np.asarray(want, np.float32)) < 1e-2


def test_live_rows_bound_at_a_tile_edge():
    """Live rows read nothing past the bound: with x's rows from `live` on made NaN (as unwritten
    cache rows could be), the live rows are finite and exact, at a bound on a tile edge and inside
    a tile (the tile that straddles the bound computes its dead rows; nothing leaks across rows)."""
    rng = np.random.default_rng(7)
    N, K, S = 32, 256, 64
    w = prepare(random_quant_array("Q4_0", (N, K), rng))
    for live in (32, 40):
        x = np.asarray(rng.standard_normal((1, S, K)), np.float32)
        x[:, live:] = np.nan
        cfg = dict(pick_config("Q4_0", S, N, K), bm=16)
        y = np.asarray(quant_matmul_live(jnp.asarray(x), w, jnp.int32(live), jnp.bfloat16, interpret=True,
                                         config=cfg), np.float32)
        want = np.asarray(quant_matmul_ref(jnp.asarray(x[:, :live]), w, jnp.bfloat16), np.float32)
        assert np.isfinite(y[:, :live]).all() and rel(y[:, :live], want) < 1e-2, live


@pytest.mark.parametrize("name", ["Q4_0", "Q8_0"])
def test_live_rows_triton_lowering(name):
    """The bounded kernel lowers to Triton (the live test and the skipped tiles' branch)."""
    rng = np.random.default_rng(3)
    pw = prepare(random_quant_array(name, (256, 512), rng, fast=True))
    cuda_lowering(lambda x, w, n: quant_matmul_live(x, w, n), jnp.zeros((1, 1024, 512), jnp.bfloat16), pw,
                  jnp.int32(5))


def test_pick_config_shapes():
    c = pick_config("Q4_0", 1, 2048, 1408)
    assert c["mode"] == "rows" and 1408 % c["bk"] == 0 and c["bk"] % 32 == 0
    c = pick_config("Q4_K", 2048, 2048, 7168)
    assert c["mode"] == "dot" and c["bk"] % 256 == 0 and 7168 % c["bk"] == 0


@pytest.mark.parametrize("name", TYPES)
def test_triton_lowering(name):
    rng = np.random.default_rng(5)
    pw = prepare(random_quant_array(name, (64, 512), rng, fast=True))
    pe = prepare(random_quant_array(name, (3, 64, 512), rng, fast=True))
    for M in (1, 4, 16, 128):
        cuda_lowering(lambda x, w: quant_matmul(x, w), jnp.zeros((M, 512), jnp.bfloat16), pw)
    e = jnp.zeros((6,), jnp.int32)
    cuda_lowering(lambda x, g, u, e: quant_matmul_experts(x, (g, u), e, swiglu=True),
                  jnp.zeros((6, 512), jnp.bfloat16), pe, pe, e)


@pytest.mark.gpu
@pytest.mark.parametrize("name", TYPES)
def test_gpu_real_size(name):
    assert jax.default_backend() == "gpu"
    rng = np.random.default_rng()
    for N, K in [(1408, 2048), (576, 7168)]:
        try:
            pw = prepare(random_quant_array(name, (N, K), rng, fast=True))
        except ValueError:
            continue                                 # K not a multiple of the type's super-block
        for M in (1, 4, 16, 300):
            x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
            assert rel(quant_matmul(x, pw), quant_matmul_ref(x, pw)) < 6e-3, (name, N, K, M)


def v2_lite_matrices(name: str, rng):
    """(N, K, packed weight, 8 rows of x) at V2-Lite's decode matrix sizes that `name` can hold."""
    for N, K in [(2048, 1408), (3072, 2048), (576, 2048), (102400, 2048)]:
        try:
            pw = prepare(random_quant_array(name, (N, K), rng, fast=True))
        except ValueError:
            continue                                 # K not a multiple of the type's super-block
        yield N, K, pw, jnp.asarray(rng.standard_normal((8, K)), jnp.float32)


def each_alone(f, *rows) -> np.ndarray:
    """f of each row alone (its arguments' rows i:i+1), stacked: what a batch's rows must equal."""
    return np.concatenate([np.asarray(f(*(a[i:i + 1] for a in rows))) for i in range(rows[0].shape[0])])


@pytest.mark.gpu
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "Q4_K", "IQ4_XS", "BF16"])
def test_gpu_invariant_rows_bit_for_bit(name, swap):
    """On the hardware (the matrix unit's order, not the interpreter's): each of 8 rows of the
    matrix-unit invariant schedule equals the row alone bit for bit, at V2-Lite's sizes (split-K
    among them), idle rows zeros, near the reference."""
    assert jax.default_backend() == "gpu"
    rng = np.random.default_rng(7)
    for N, K, pw, x in v2_lite_matrices(name, rng):
        cfg = dict(invariant_config(name, N, K), swap=swap)  # both operand orders
        f = functools.partial(quant_matmul, w=pw, row_invariant=True, matrix_unit=True, config=cfg)
        alone = each_alone(f, x)
        assert np.array_equal(np.asarray(f(x)), alone), (name, N, K)
        mask = jnp.asarray([1, 0, 0, 1, 0, 0, 0, 1], jnp.int32)
        got = np.asarray(f(x, live_rows=mask))
        assert np.array_equal(got[[0, 3, 7]], alone[[0, 3, 7]]) and not got[[1, 2, 4, 5, 6]].any(), (name, N, K)
        assert rel(alone, quant_matmul_ref(x, pw)) < 6e-3, (name, N, K)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "Q4_K"])
def test_gpu_live_rows_real_size(name):
    """The bounded kv_b expansion at V2-Lite's size on the GPU: live rows as the reference's."""
    assert jax.default_backend() == "gpu"
    rng = np.random.default_rng()
    pw = prepare(random_quant_array(name, (4096, 512), rng, fast=True))
    x = jnp.asarray(rng.standard_normal((1, 4096, 512)), jnp.bfloat16)
    for live in (1, 700, 4096):
        y = np.asarray(quant_matmul_live(x, pw, jnp.int32(live), jnp.bfloat16), np.float32)
        want = np.asarray(quant_matmul_ref(x[:, :live], pw, jnp.bfloat16), np.float32)
        assert rel(y[:, :live], want) < 1e-2, (name, live)


@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "Q4_K"])
def test_row_invariant_skips_dead_rows(name):
    """quant_matmul(row_invariant=True, live_rows=mask): the live rows are bit for bit what the
    product without a mask gives (each row its own program either way), the dead rows (a server's
    idle slots) zeros; with split-K too (a K of several k-steps)."""
    rng = np.random.default_rng(abs(hash(name + "dead")) % 2**32)
    for N, K in [(48, 768), (32, 4096)]:
        pw = prepare(random_quant_array(name, (N, K), rng))
        x = jnp.asarray(rng.standard_normal((6, K)), jnp.float32)
        mask = jnp.asarray([1, 0, 0, 1, 0, 1], jnp.int32)
        full = np.asarray(quant_matmul(x, pw, jnp.bfloat16, interpret=True, row_invariant=True))
        got = np.asarray(quant_matmul(x, pw, jnp.bfloat16, interpret=True, row_invariant=True, live_rows=mask))
        live = np.asarray(mask, bool)
        assert np.array_equal(got[live], full[live]), (name, N, K)
        assert not got[~live].any()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "Q4_K", "IQ4_XS", "BF16"])
def test_gpu_rows_schedule_bit_for_bit(name):
    """On the hardware: the one-row rows schedule (the batch-invariant decode's default form), launched
    row tiles first (each column tile's rows side by side, ROWS_FIRST), gives each of 8 rows the bits
    it gets alone, with the RMSNorm folded in too, and the experts' gather form each token's bits
    alone; at V2-Lite's sizes (split-K among them), near the reference."""
    from pallas_kernels.moe_matmul.kernel import moe_experts_gather
    from pallas_kernels.quant_matmul.kernel import ROWS_FIRST, quant_matmul_normed
    assert jax.default_backend() == "gpu" and ROWS_FIRST
    rng = np.random.default_rng(11)
    for N, K, pw, x in v2_lite_matrices(name, rng):
        f = functools.partial(quant_matmul, w=pw, row_invariant=True)
        alone = each_alone(f, x)
        assert np.array_equal(np.asarray(f(x)), alone), (name, N, K)
        assert rel(alone, quant_matmul_ref(x, pw)) < 6e-3, (name, N, K)
        nw = jnp.asarray(rng.standard_normal(K), jnp.float32)
        g = functools.partial(quant_matmul_normed, norm_weight=nw, eps=1e-6, w=pw, row_invariant=True)
        alone = each_alone(g, x)
        assert np.array_equal(np.asarray(g(x)), alone), (name, N, K)
    E, F, d, k = 64, 1536, 2048, 6  # (V2-Lite's 1408 is no multiple of the K-quants' 256)
    gate, up, down = (prepare(random_quant_array(name, shape, rng, fast=True))
                      for shape in ((E, F, d), (E, F, d), (E, d, F)))
    x = jnp.asarray(rng.standard_normal((8, d)), jnp.float32)
    w = jnp.asarray(rng.random((8, k)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(8)]), jnp.int32)
    h = functools.partial(moe_experts_gather, gate=gate, up=up, down=down, row_invariant=True)
    alone = each_alone(h, x, w, ids)
    assert np.array_equal(np.asarray(h(x, w, ids)), alone), name


def test_dead_rows_triton_lowering():
    """The row-by-row product with a live-rows mask lowers to Triton (split-K and not)."""
    rng = np.random.default_rng(4)
    for K in (512, 4096):
        pw = prepare(random_quant_array("Q4_0", (256, K), rng, fast=True))
        cuda_lowering(lambda x, w, m: quant_matmul(x, w, row_invariant=True, live_rows=m),
                      jnp.zeros((8, K), jnp.bfloat16), pw, jnp.ones((8,), jnp.int32))


def test_triton_lowering_imports_nothing_it_cannot_find():
    """Lowering a Pallas kernel for CUDA looks up no module that does not exist: MLIR asked for the
    `tt` dialect's Python module under names jaxlib does not use, ~230 failed imports a kernel
    (a third of its lowering, on a cold start's critical path), until pallas_kernels registered
    it under the first of them (pallas_kernels/__init__.py)."""
    import importlib._bootstrap as bootstrap
    import sys
    from pallas_kernels.quant_matmul.kernel import quant_matmul as qm
    from pallas_kernels.testing import cuda_lowering
    assert sys.modules.get("jaxlib.mlir.dialects.tt") is not None
    rng = np.random.default_rng(0)
    pw = prepare(random_quant_array("Q4_0", (64, 512), rng, fast=True))
    cuda_lowering(lambda x, w: qm(x * 2.5, w), jnp.zeros((1, 512), jnp.float32), pw)  # the lowering's own imports
    asked: list[str] = []
    orig = bootstrap._find_and_load

    def find_and_load(name, import_):
        asked.append(name)
        return orig(name, import_)
    bootstrap._find_and_load = find_and_load
    try:
        exported = cuda_lowering(lambda x, w: qm(x * 1.5, w), jnp.zeros((1, 512), jnp.float32), pw)
    finally:
        bootstrap._find_and_load = orig
    assert "__gpu$xla.gpu.triton" in exported.mlir_module()
    assert not [n for n in asked if n.endswith(".tt")], sorted(set(asked))


def test_triton_offsets_are_64_bit_past_2_31_elements():
    """A stacked weight of more than 2^31 bytes is indexed with 64-bit offsets in the lowered
    kernel (pallas_kernels._wide_offsets_where_needed): Pallas's own rule widens them only past 2^32
    bytes, so a 2.7 GB stack (V2-Lite's 26 MoE layers) wrapped to a negative offset on the GPU, and
    the layer groups had to stop below 2^31 bytes. Lowered for CUDA on abstract shapes (nothing of
    that size is allocated); a small stack keeps 32-bit offsets."""
    import math

    import pallas_kernels
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton import lowering as tl
    from pallas_kernels.quant_matmul.kernel import quant_matmul as qm
    from pallas_kernels.quant_matmul.packing import PackedWeight
    from pallas_kernels.testing import cuda_lowering
    assert pallas_kernels.WIDE_OFFSETS and tl._compute_offsets_from_indices.ikjax_wide
    one = prepare(random_quant_array("Q4_0", (64, 512), np.random.default_rng(0), fast=True))
    per_layer = max(math.prod(a.shape) for a in one.arrays.values())

    def stack(layers):
        return PackedWeight({k: jax.ShapeDtypeStruct((layers,) + a.shape, a.dtype) for k, a in one.arrays.items()},
                            one.qtype, one.shape)

    def widths(layers, offsets):
        seen = []
        patched = tl._compute_offsets_from_indices

        def spy(block_info, nd_indexer):
            out = offsets(block_info, nd_indexer)
            t = out.type
            elt = ir.RankedTensorType(t).element_type if isinstance(t, ir.RankedTensorType) else t
            seen.append((math.prod(block_info.full_shape_dtype.shape), ir.IntegerType(elt).width))
            return out
        tl._compute_offsets_from_indices = spy
        try:
            cuda_lowering(lambda x, w, j: qm(x, w, layer=j), jax.ShapeDtypeStruct((1, 512), jnp.float32), stack(layers),
                          jax.ShapeDtypeStruct((), jnp.int32))
        finally:
            tl._compute_offsets_from_indices = patched
        return {w for n, w in seen if n == layers * per_layer}

    big = 2**31 // per_layer + 1  # the stack's bytes pass 2^31
    assert big * per_layer > 2**31
    assert widths(big, tl._compute_offsets_from_indices) == {64}
    assert widths(big, tl._compute_offsets_from_indices.__wrapped__) == {32}  # Pallas's own rule: the wrap
    assert widths(4, tl._compute_offsets_from_indices) == {32}
