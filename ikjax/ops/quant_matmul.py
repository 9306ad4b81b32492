"""Quantized products: x @ W^T with W in its GGUF blocks (`quant_linear`), per-head products for MLA's
absorbed matrices (`head_linear`), and the load-time repack the Pallas kernels read (`prepare_weight`).

Implementations: `xla` = pallas_kernels/quant_matmul/reference.py (dequantize, then one dot);
`pallas`/`interpret` = pallas_kernels/quant_matmul/kernel.py on the planar repack (`PackedWeight`);
`cpu` = the C++ kernels on the GGUF blocks as stored (pallas_kernels/quant_matmul/cpu.py).
"""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

import pallas_kernels
from ikjax import env, programs
from ikjax.ops import registry
from ikjax.ops.norm import rms_norm
from ikjax.placement.host import HostStack
from ikjax.quant import by_name
from ikjax.quant.array import LayerSlice, QuantArray
from pallas_kernels.quant_matmul import cpu as _qm_cpu
from pallas_kernels.quant_matmul import kernel as _qm
from pallas_kernels.quant_matmul import packing as _qm_packing
from pallas_kernels.quant_matmul.packing import PackedWeight, prepare as _prepare
from pallas_kernels.quant_matmul.reference import quant_matmul_ref

# -- weights --------------------------------------------------------------------------------------

def _repackable(qa) -> bool:
    if isinstance(qa, PackedWeight) or not isinstance(qa, QuantArray):
        return False
    if not _qm_packing.supported(qa.qtype.name):
        return False
    G, P, L, R = _qm_packing.GEOMETRY[qa.qtype.name]
    return qa.shape[-1] % (G * R) == 0


def prepare_weight(qa):
    """Load-time repack for the Pallas kernels; returns `qa` unchanged when its type has no kernel layout."""
    return _prepare(qa) if _repackable(qa) else qa


def prepare_weights(tensors: dict, keys) -> dict:
    """`prepare_weight` of tensors[k] for each k in `keys`, in one compiled program per device set
    (packing.prepare_many: one compile-cache read a layer, not one a weight shape)."""
    groups: dict = {}
    for k in keys:
        v = tensors.get(k)
        if _repackable(v):
            devs = getattr(v.data, "sharding", None)
            groups.setdefault(frozenset(devs.device_set) if devs is not None else None, []).append(k)
    out = dict(tensors)
    for ks in groups.values():
        for k, pw in zip(ks, _qm_packing.prepare_many([tensors[k] for k in ks], run=programs.runner("repack"))):
            out[k] = pw
    return out


def needs_repack(backend: str | None = None) -> bool:
    """Whether weights should be repacked at load (only the Pallas kernels read a repacked layout)."""
    return registry.resolve_backend(backend) in ("pallas", "interpret")


def pallas_stack_limit() -> int | None:
    """The largest stacked weight (bytes) the Pallas kernels read in place, None for no limit: with
    the lowering's offsets 64-bit wherever an operand passes 2^31 elements
    (`pallas_kernels.WIDE_OFFSETS`) any size; without, below 2^31 bytes (32-bit offsets wrap)."""
    return None if pallas_kernels.WIDE_OFFSETS else 2**31 - 1


def layer_view(tensors: dict, j) -> dict:
    """Layer j of a scanned group's stacked tensors (ikjax.model.groups), as the ops read it: each
    quantized weight a LayerSlice (the kernels read it in place, the XLA forms slice it; under the
    C++ kernels the F32 router too, loaded as an F32 QuantArray: ikjax.model.weights), each norm's
    weight a LayerSlice too (a decode product that folds the norm in reads it in place,
    `norm_linear`; `rms_norm` slices it), each other float array (biases: small) sliced, each
    host-resident expert tensor (a HostStack) a view whose host calls pick layer j at run time."""
    out = {}
    for k, v in tensors.items():
        if isinstance(v, (QuantArray, PackedWeight)) or k.endswith("_norm") and isinstance(v, jax.Array):
            out[k] = LayerSlice(v, j)
        elif isinstance(v, HostStack):
            out[k] = v.at(j)
        else:
            out[k] = jax.tree_util.tree_map(lambda a: jax.lax.dynamic_index_in_dim(a, j, 0, keepdims=False), v)
    return out


def f32_view(a) -> QuantArray:
    """A float32 matrix [N, K] as an F32 QuantArray of its bytes (XLA:CPU copies them: a router
    built by hand; a loaded one is already an F32 QuantArray under the C++ kernels)."""
    data = jax.lax.bitcast_convert_type(a, jnp.uint8)  # [N, K, 4]
    return QuantArray(data.reshape(data.shape[:-2] + (data.shape[-2] * 4,)), by_name("F32"), tuple(a.shape[-2:]))


def base(w):
    """The weight a LayerSlice slices (its stack: type and per-layer shape), or w itself."""
    return w.stack if isinstance(w, LayerSlice) else w


def one_layer(w):
    """w as a weight of its own: a LayerSlice sliced (for the XLA forms), anything else as it is."""
    return w.get() if isinstance(w, LayerSlice) else w


def pallas_weight(w):
    """(PackedWeight, layer index or None) for the Pallas kernels: a LayerSlice of a repacked stack
    is read in place at its index."""
    if isinstance(w, LayerSlice):
        # without 64-bit offsets, a stack of 2^31 bytes or more (which the layer groups then avoid:
        # `pallas_stack_limit`) is read as its one layer (a copy)
        limit = pallas_stack_limit()
        if isinstance(w.stack, PackedWeight) and (limit is None or max(a.size for a in w.stack.arrays.values()) <= limit):
            return w.stack, w.index
        return packed(w.get()), None
    return packed(w), None


def packed(w):
    if isinstance(w, PackedWeight):
        return w
    warnings.warn(f"ikjax.ops: repacking {w!r} inside the step; call prepare_weight() at load",
                  stacklevel=3)
    return _prepare(w)


def pallas_ok(w) -> bool:
    b = base(w)
    name = b.qtype if isinstance(b, PackedWeight) else b.qtype.name
    return _qm.kernel_supports(name, w.shape[-2], w.shape[-1])


def cpu_ok(w) -> bool:
    return isinstance(base(w), QuantArray) and _qm_cpu.supported(w.qtype.name)





# -- quantized matmul -----------------------------------------------------------------------------

# Under `auto`, the Pallas matmul serves decode (up to this many rows of x); larger batches
# (prompt processing) take XLA's dequantize-then-cuBLAS path, measured faster there (bench/RESULTS.md).
AUTO_MAX_ROWS = 4


def _qm_pallas_supported(auto: bool):
    def supported(x, w, dtype) -> bool:
        rows = registry.rows(x)
        if auto and rows > AUTO_MAX_ROWS and not (registry.batch_invariant() and rows <= registry.INVARIANT_MAX_ROWS):
            return False
        # f32 mode: prompt-sized products on XLA's HIGHEST path (the Pallas tile products at f32 are
        # IEEE too, pallas_kernels.flash.tile_dot, but a 128-row f32 tile overflows shared memory)
        if rows > AUTO_MAX_ROWS and jnp.dtype(dtype) == jnp.float32:
            return False
        return pallas_ok(w)
    return supported


def _qm_cpu_supported(x, w, dtype) -> bool:
    return cpu_ok(w) and jnp.dtype(dtype) in (jnp.float32, jnp.bfloat16)


def _in_decode_groups(fn, x, lead: int):
    """fn over x's rows in the groups `registry.decode_groups` gives (x [..., *tail], the first
    `lead` dims being the rows), or in one call where it gives none."""
    n = 1
    for d in x.shape[:lead]:
        n *= d
    groups = registry.decode_groups(n)
    if groups is None:
        return fn(x)
    flat = x.reshape((-1,) + x.shape[lead:])
    y = jnp.concatenate([fn(flat[a:b]) for a, b in groups], axis=0)
    return y.reshape(x.shape[:lead] + y.shape[1:])


def _qm_cpu_run(x, w, dtype):
    run = lambda x: _qm_cpu.quant_matmul(x, w, n_threads=registry.threads(), compute=registry.compute(dtype))
    return _in_decode_groups(run, x, x.ndim - 1)


def _qm_pallas(x, w, dtype, interpret: bool):
    pw, layer = pallas_weight(w)
    invariant = registry.batch_invariant() and registry.rows(x) <= registry.INVARIANT_MAX_ROWS
    # row by row: the idle slots' rows of a server's decode batch are skipped (registry.live_rows)
    live = registry.live_rows_mask(registry.rows(x)) if invariant else None
    return _qm.quant_matmul(x, pw, dtype, interpret=interpret, layer=layer, row_invariant=invariant, live_rows=live,
                            matrix_unit=invariant and registry.invariant_matrix_unit())


def quant_linear(x, w, dtype, *, backend: str | None = None):
    """x [..., K] @ W[N, K]^T (W QuantArray or PackedWeight), computed in `dtype`, f32 result."""
    b = registry.resolve_backend(backend)
    auto = backend is None and registry.auto_backend()
    impls = {
        "xla": registry.Impl(lambda *a: True, lambda x, w, d: quant_matmul_ref(x, one_layer(w), d)),
        "pallas": registry.Impl(_qm_pallas_supported(auto), lambda x, w, d: _qm_pallas(x, w, d, False)),
        "interpret": registry.Impl(_qm_pallas_supported(False), lambda x, w, d: _qm_pallas(x, w, d, True)),
        "cpu": registry.Impl(_qm_cpu_supported, _qm_cpu_run),
    }
    return registry.dispatch("quant_linear", impls, b, x, w, dtype)


# -- RMSNorm folded into a decode product -----------------------------------------------------------

def _normed_invariant(x) -> bool:
    """A batch-invariant decode step's product in the row form (a program a row): folded there too,
    each row's norm and product computed by its own programs (quant_matmul_normed's row_invariant).
    The matrix-unit form (IKJAX_INVARIANT_FORM=dot) keeps the two apart."""
    return (registry.batch_invariant() and registry.rows(x) <= registry.INVARIANT_MAX_ROWS
            and not registry.invariant_matrix_unit())


def _normed_pallas_supported(x, norm_w, eps, w, dtype) -> bool:
    # decode products only (prompts take XLA's path); in a batch-invariant step, the row form's only
    invariant = registry.batch_invariant()
    if env.choice("IKJAX_FOLD_NORM") != "1" or (invariant and not _normed_invariant(x)):
        return False
    nw = norm_w.stack if isinstance(norm_w, LayerSlice) else norm_w
    return ((invariant or registry.rows(x) <= AUTO_MAX_ROWS) and nw.shape[-1] == x.shape[-1] and pallas_ok(w))


def _normed_pallas(interpret: bool):
    def run(x, norm_w, eps, w, dtype):
        pw, layer = pallas_weight(w)
        nw, nl = (norm_w.stack, norm_w.index) if isinstance(norm_w, LayerSlice) else (norm_w, None)
        invariant = _normed_invariant(x)
        live = registry.live_rows_mask(registry.rows(x)) if invariant else None
        return _qm.quant_matmul_normed(x, nw, eps, pw, dtype, interpret=interpret, layer=layer, norm_layer=nl,
                                       row_invariant=invariant, live_rows=live)
    return run


def _normed_composed(x, norm_w, eps, w, dtype):
    return quant_linear(rms_norm(x, one_layer(norm_w), eps), w, dtype)


def norm_linear(x, norm_w, eps: float, w, dtype, *, backend: str | None = None):
    """quant_linear(rms_norm(x, norm_w, eps), w, dtype), the norm's weight an array [K] or a
    LayerSlice of a scanned group's stack (read in place). `pallas`/`interpret`: a decode product
    with the norm folded in (pallas_kernels' quant_matmul_normed: no kernel of its own for the
    norm; IKJAX_FOLD_NORM=0 keeps them apart), the batch-invariant row form's included. Everywhere
    else (`xla`, the CPU kernels, prompts, the invariant matrix-unit form) the two ops as they are,
    each dispatched by its own registry."""
    impls = {
        "xla": registry.Impl(lambda *a: True, _normed_composed),
        "pallas": registry.Impl(_normed_pallas_supported, _normed_pallas(False)),
        "interpret": registry.Impl(_normed_pallas_supported, _normed_pallas(True)),
    }
    return registry.dispatch("norm_linear", impls, registry.resolve_backend(backend), x, norm_w, eps, w, dtype)


def _live_mask(y, live, dtype):
    rows = jnp.arange(y.shape[1])[None, :, None]
    return jnp.where(rows < live, y, 0).astype(dtype)


def _ql_live_pallas_supported(gpu: bool):
    def supported(x, w, dtype, live) -> bool:
        # f32 on a GPU: XLA's HIGHEST path, as quant_linear's prompt-sized products
        return (x.ndim == 3 and x.shape[1] % 16 == 0 and not (gpu and jnp.dtype(dtype) == jnp.float32)
                and pallas_ok(w))
    return supported


def _ql_live_pallas(interpret: bool):
    def run(x, w, dtype, live):
        pw, layer = pallas_weight(w)
        return _qm.quant_matmul_live(x, pw, live, dtype, interpret=interpret, layer=layer)
    return run


def quant_linear_live(x, w, dtype, live, *, backend: str | None = None):
    """x [B, S, K] @ W[N, K]^T -> [B, S, N] in `dtype`, where only each sequence's first `live` rows
    (an int32 scalar of the step) are needed: the Pallas kernel computes and writes those rows
    alone (pallas_kernels.quant_matmul.kernel.quant_matmul_live), the other forms compute every row
    and zero the rest. Rows at or past `live` are unspecified; callers read the live ones only.
    The prompt step's kv_b expansion over the whole cache (one compiled step for every depth)."""
    impls = {
        "xla": registry.Impl(lambda *a: True,
                             lambda x, w, d, n: _live_mask(quant_matmul_ref(x, one_layer(w), d), n, d)),
        "pallas": registry.Impl(_ql_live_pallas_supported(True), _ql_live_pallas(False)),
        "interpret": registry.Impl(_ql_live_pallas_supported(False), _ql_live_pallas(True)),
        "cpu": registry.Impl(lambda x, w, d, n: _qm_cpu_supported(x, w, d),
                             lambda x, w, d, n: _live_mask(_qm_cpu_run(x, w, d), n, d)),
    }
    return registry.dispatch("quant_linear_live", impls, registry.resolve_backend(backend), x, w, dtype, live)


# -- per-head products (MLA's absorbed W_kb / W_vb) ----------------------------------------------------

def _heads_xla(x, w, dtype):
    prec = registry.precision_for(dtype)
    return jnp.einsum("...hk,hnk->...hn", x.astype(dtype), w.dequantize(dtype), precision=prec,
                      preferred_element_type=jnp.float32)


def _heads_cpu_supported(x, w, dtype) -> bool:
    return cpu_ok(w) and len(w.shape) == 3 and jnp.dtype(dtype) in (jnp.float32, jnp.bfloat16)


def _heads_cpu(x, w, dtype):
    run = lambda x: _qm_cpu.quant_matmul_heads(x, w, n_threads=registry.threads(),
                                                compute=registry.compute(dtype))
    return _in_decode_groups(run, x, x.ndim - 2)


def _heads_pallas_supported(x, w, dtype) -> bool:
    # the decode step's form only (registry.batch_invariant): XLA's batched dot serves prompts
    rows = registry.rows(x)
    return (registry.batch_invariant() and len(w.shape) == 3 and rows <= registry.INVARIANT_MAX_ROWS * w.shape[0]
            and pallas_ok(w))


def _heads_dot(x, pw, layer, dtype, interpret: bool):
    """The per-head products in the batch-invariant matrix-unit schedule: a head's rows (every
    sequence's, padded to the schedule's tile) one tile with that head as its "expert"; a tile of
    idle rows reads no weight."""
    H, K = x.shape[-2], x.shape[-1]
    n = registry.rows(x) // H
    bm = _qm.INVARIANT_BM
    n_p = -(-n // bm) * bm
    xh = jnp.swapaxes(x.reshape(n, H, K), 0, 1)                           # [H, rows, K]
    xh = jnp.pad(xh, ((0, 0), (0, n_p - n), (0, 0))).reshape(H * n_p, K)
    heads = jnp.repeat(jnp.arange(H, dtype=jnp.int32), n_p // bm)
    live = registry.live_rows_mask(n)  # the padding rows are computed on zeros and dropped
    row_live = None if live is None else jnp.tile(jnp.pad((live != 0).astype(jnp.int32), (0, n_p - n)), H)
    y = _qm.quant_matmul_experts(xh, (pw,), heads, dtype, tile_rows=bm, interpret=interpret, layer=layer,
                                 split_rows=H, config="invariant", live_rows=row_live)
    y = jnp.swapaxes(y.reshape(H, n_p, -1)[:, :n], 0, 1)
    return y.reshape(x.shape[:-1] + (y.shape[-1],))


def _heads_pallas(interpret: bool):
    def run(x, w, dtype):
        """Each (row, head) a one-row tile of the rows kernel with the head as its "expert": every
        row computed by the program it gets alone (XLA's batched dot of 8 rows rounded differently
        from its dot of 1: RESULTS §23b)."""
        pw, layer = pallas_weight(w)
        H, K = x.shape[-2], x.shape[-1]
        if registry.invariant_matrix_unit() and _qm.invariant_dot(pw.qtype, dtype):
            return _heads_dot(x, pw, layer, dtype, interpret)
        x2 = x.reshape(-1, K)
        heads = jnp.tile(jnp.arange(H, dtype=jnp.int32), x2.shape[0] // H)
        live = registry.live_rows_mask(x2.shape[0] // H)
        if live is not None:  # a server's idle slots: their heads are dead tiles (no weight read, zeros)
            heads = jnp.where(jnp.repeat(live != 0, H), heads, -1)
        y = _qm.quant_matmul_experts(x2, (pw,), heads, dtype, tile_rows=1, interpret=interpret, layer=layer,
                                     split_rows=H)
        return y.reshape(x.shape[:-1] + (y.shape[-1],))
    return run


def head_linear(x, w, dtype, *, backend: str | None = None):
    """Per-head products y[..., h, :] = x[..., h, :] @ W[h]^T: x [..., H, K], W [H, N, K] -> [..., H, N]
    float32 (MLA's absorbed form: q_lat = W_kb q_nope and o = W_vb o_lat, head by head)."""
    impls = {
        "xla": registry.Impl(lambda *a: True, _heads_xla),
        "pallas": registry.Impl(_heads_pallas_supported, _heads_pallas(False)),
        "interpret": registry.Impl(_heads_pallas_supported, _heads_pallas(True)),
        "cpu": registry.Impl(_heads_cpu_supported, _heads_cpu),
    }
    return registry.dispatch("head_linear", impls, registry.resolve_backend(backend), x, w, dtype)


# -- the router's logits -----------------------------------------------------------------------------

def _router_reduce(x, router):
    # one reduction per (token, expert): on the CPU each row's logits come out bit for bit as they
    # do alone (XLA's dot of 4 rows rounded differently from its dot of 1, enough to flip a
    # near-tie of two experts: tests/test_batch_consistency.py)
    return (x[:, None, :] * router[None, :, :]).sum(-1)


def _router_pallas_supported(x, router) -> bool:
    E, d = router.shape[-2:]  # (a LayerSlice's shape is its layer's)
    return registry.batch_invariant() and E % 16 == 0 and d % 32 == 0 and x.shape[0] <= registry.INVARIANT_MAX_ROWS


def _router_pallas(interpret: bool):
    def run(x, router):
        """The f32 router as an F32 weight of the rows kernel, one-row tiles: on a GPU an XLA
        reduction's order follows the whole shape, so even one reduction per (token, expert)
        gave a token other bits in a batch (RESULTS §23b)."""
        E, d = router.shape
        pw = PackedWeight({"w": router.reshape(E, d // 32, 32)}, "F32", (E, d))
        return _qm.quant_matmul(x, pw, jnp.float32, interpret=interpret, row_invariant=True)
    return run


def router_f32(router):
    """The router [E, d] as a float32 array: as loaded (float32), a layer of a stack sliced
    (`layer_view`'s LayerSlice), a QuantArray (built by hand, or the F32 view) dequantized."""
    if isinstance(router, LayerSlice):
        router = router.get()
    return router.dequantize(jnp.float32) if hasattr(router, "dequantize") else router.astype(jnp.float32)


def router_logits(x, router):
    """x [N, d] @ router[E, d]^T in float32 -> [N, E]: the MoE router's logits (`router` float32 as
    loaded, a LayerSlice of a stack, or a QuantArray). Prompt steps take XLA's f32 dot (the C++
    product under the C++ kernels, the router loaded as an F32 QuantArray: XLA's dot of the layer's
    slice took the slice's bitcast into its input, 9.3 ms of a 2-thread V2-Lite prompt step against
    the C++ product's 3.4-4.0, RESULTS §26t); a decode step takes a form that gives each token the
    bits it gets alone (registry.batch_invariant): the rows kernel on a GPU, the C++ kernels' decode
    form on a CPU (each row's dot on its own, the layer read in place: XLA's reduction and the
    slice of the layer cost ~0.34 ms a layer and token at 2 threads), one reduction per (token,
    expert) elsewhere."""
    x = x.astype(jnp.float32)
    if registry.decode_step() and (registry.resolve_backend() == "cpu" or registry.batch_invariant()):
        impls = {
            "xla": registry.Impl(lambda *a: True, _on_f32(_router_reduce)),
            "pallas": registry.Impl(_router_pallas_supported, _on_f32(_router_pallas(False))),
            "interpret": registry.Impl(_router_pallas_supported, _on_f32(_router_pallas(True))),
            "cpu": registry.Impl(_router_cpu_supported, _router_cpu),
        }
    else:
        impls = {
            "xla": registry.Impl(lambda *a: True, _on_f32(_router_dot)),
            # a float router (built by hand) keeps XLA's dot: its F32 view would be a copy a step
            "cpu": registry.Impl(lambda x, r: isinstance(r, (QuantArray, LayerSlice)) and _router_cpu_supported(x, r),
                                 _router_cpu),
        }
    return registry.dispatch("router_logits", impls, registry.resolve_backend(), x, router)


def _on_f32(fn):
    """fn(x, router) with the router as a float32 array (the XLA and Pallas forms)."""
    return lambda x, router: fn(x, router_f32(router))


def _router_dot(x, router):
    return jnp.einsum("nd,ed->ne", x, router, precision=registry.HIGHEST)


def _router_cpu_supported(x, router) -> bool:
    if isinstance(router, (QuantArray, LayerSlice)):
        return isinstance(base(router), QuantArray) and cpu_ok(router)
    return getattr(router, "dtype", None) == jnp.float32 and _qm_cpu.supported("F32")


def _router_cpu(x, router):
    # f32 compute: dequantize-and-dot, row by row in the decode form (groups of at most 3 rows in a
    # batch, registry.decode_groups): each token's logits the bits it gets alone
    w = router if isinstance(router, (QuantArray, LayerSlice)) else f32_view(router)
    return _qm_cpu_run(x, w, jnp.float32)
