"""Routed experts that live in host RAM, computed by the host CPU from inside a GPU step.

The FFI target `ikjax_host_moe_experts` (cuda_host.cc, platform "CUDA") is enqueued on XLA's
stream: it copies x, the routing weights and the expert ids to pinned host memory, runs the C++
fused-experts kernel (cpu_kernel.cc, the same function as `reference.moe_experts_ref`) on its own
thread pool from a `cudaLaunchHostFunc` callback, and copies the [N, d] result back. Only
activations, ids and weights cross PCIe; the expert tensors stay where the GGUF file's memory map
has them, never copied to the device nor duplicated in RAM.

Expert tensors are duck-typed QuantArray-likes with `.qtype.type_id` and `.shape` whose bytes
are in host memory, C-contiguous: either `.data` is a host NumPy array (the memory map's bytes),
or the object says where they are with `host_address()` and `nbytes` (ikjax's pinned-host experts,
whose `.data` may be a tracer inside the step: the same bytes the big-batch path streams to the
GPU). The compiled step names them by a slot number (`host_slot`), which this process maps to their
address in the C++ handler when it builds the call: the caller keeps the bytes alive as long as the
step (the engine's weight tree does). A scanned group of layers (one loop body for all of them)
passes a view that names every layer's tensor (`host_layers`) and the layer the body computes
(`layer_index`, a traced int32): the call carries a table of slots and the index as a device value,
which the host reads with the call's other inputs. A slot, not the address, so that the same model's steps have
the same HLO in every process and JAX's persistent cache serves them (RESULTS §25h). Built by `pip install` wherever a CUDA
toolkit is found at build time (IKJAX_BUILD_CUDA=AUTO, pallas_kernels/CMakeLists.txt).
"""
from __future__ import annotations

import functools
import hashlib
import threading

import jax
import jax.numpy as jnp
import numpy as np

TARGET = "ikjax_host_moe_experts"
COMPUTE = {"f32": 0, "bf16": 1}  # quant_matmul/cpu_kernel.h QmCompute

_IMPORT_ERROR: str | None = None
try:
    from pallas_kernels import _cuda_host  # built where a CUDA toolkit was found at build time
except ImportError as e:
    _cuda_host = None
    _IMPORT_ERROR = str(e)


def available() -> bool:
    return _cuda_host is not None


def unavailable_reason() -> str:
    return ("" if _cuda_host is not None else
            f"the CUDA host-experts handler pallas_kernels._cuda_host is not built ({_IMPORT_ERROR}); "
            f"`pip install -e '.[cuda13]'` (or cuda12) builds it where a CUDA toolkit is found (nvcc on PATH, "
            f"or CUDAToolkit_ROOT / CUDA_PATH / /usr/local/cuda): install one and reinstall; "
            f"add -Ccmake.define.IKJAX_BUILD_CUDA=ON to make a missing toolkit a build error")


@functools.cache
def register() -> None:
    if _cuda_host is None:
        raise RuntimeError(unavailable_reason())
    for name, capsule in _cuda_host.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")


def is_host_array(a) -> bool:
    """A host NumPy array (e.g. a memory map's bytes): what this op reads in place."""
    return isinstance(a, np.ndarray)


def _layers_of(t) -> tuple:
    """The per-layer tensors a call may read for `t`: a scanned group's view names one a layer
    (`host_layers`), anything else is its own one."""
    return tuple(getattr(t, "host_layers", None) or (t,))


def _has_host_bytes(t) -> bool:
    return all(hasattr(a, "host_address") or is_host_array(a.data) for a in _layers_of(t))


def _slot_table(t, rows: int, what: str) -> tuple[np.ndarray, int]:
    """(int64 slots of each layer's host bytes, bytes a layer) for a call's slot-table attribute."""
    slots, size = [], None
    for a in _layers_of(t):
        addr, n = _host_bytes(a, rows, what)
        if size is not None and n != size:
            raise ValueError(f"moe_experts (host): {what} differs in size between the layers of its group")
        size = n
        slots.append(host_slot(a, addr, n))
    return np.asarray(slots, np.int64), size


def _layer_index(t):
    """The layer a call reads, in its slot tables, as an int32 [1] device value (0: one layer)."""
    return jnp.reshape(jnp.asarray(getattr(t, "layer_index", 0), jnp.int32), (1,))


def _ids_and_layer(ids, t):
    """ids [N, k] flattened with the layer index after them: the host reads both in one copy."""
    return jnp.concatenate([ids.astype(jnp.int32).reshape(-1), _layer_index(t)])


def _host_bytes(t, rows: int, what: str) -> tuple[int, int]:
    """(address, size in bytes) of the tensor's host bytes."""
    if hasattr(t, "host_address"):
        addr, size = int(t.host_address()), int(t.nbytes)
    else:
        data = t.data
        if not is_host_array(data) or not data.flags.c_contiguous or data.dtype != np.uint8:
            raise ValueError(f"moe_experts (host): {what} must be C-contiguous uint8 host bytes, got "
                             f"{type(data).__name__} {getattr(data, 'dtype', '')}")
        addr, size = int(data.ctypes.data), int(data.size)
    if not addr or size % rows:
        raise ValueError(f"moe_experts (host): {what} holds {size} bytes at {addr:#x}, not a whole number "
                         f"of {rows} rows")
    return addr, size


# the slots this process handed out: (tensor key, address, size) -> slot, and how many addresses
# each tensor key has so far (a second engine of the same model takes the next ordinal)
_slots: dict[tuple, int] = {}
_ordinals: dict[str, int] = {}
_slots_lock = threading.Lock()


def _tensor_key(t) -> str:
    """What names a host tensor across processes: its GGUF name where the placement carries one,
    its type and shape (hand-made arrays: type and shape alone)."""
    placement = getattr(t, "tensor", None)
    name = getattr(placement, "name", "") or ""
    return f"{name}|{getattr(t.qtype, 'name', t.qtype)}|{tuple(t.shape)}"


def host_slot(t, address: int, size: int) -> int:
    """The slot number a step names `t`'s host bytes by (the C++ handler maps it to `address`).

    The same for the same tensor of the same model in every process (a hash of its name, type,
    shape and the ordinal of its address among this process's tensors of that key: 0 unless two
    engines of one model live here), so a step's HLO, and JAX's cache key, do not depend on where
    the bytes landed. Distinct live tensors never share a slot: each (key, address, size) has its
    own. Idempotent; thread-safe (steps trace side by side)."""
    key = _tensor_key(t)
    with _slots_lock:
        slot = _slots.get((key, address, size))
        if slot is None:
            ordinal = _ordinals.get(key, 0)
            _ordinals[key] = ordinal + 1
            digest = hashlib.blake2b(f"{key}|{ordinal}".encode(), digest_size=8).digest()
            slot = int.from_bytes(digest, "little") >> 1  # a non-negative int64
            _slots[(key, address, size)] = slot
        if _cuda_host is not None:
            _cuda_host.set_host_slot(slot, address, size)
    return slot


def supported(gate, up, down) -> bool:
    """This path takes these experts: built, host NumPy bytes, [E, F, d] / [E, d, F], types the
    C++ core supports."""
    if _cuda_host is None or any(len(t.shape) != 3 or not _has_host_bytes(t) for t in (gate, up, down)):
        return False
    E, F, d = gate.shape
    if tuple(up.shape) != (E, F, d) or tuple(down.shape) != (E, d, F):
        return False
    return all(_cuda_host.quant_type_supported(int(t.qtype.type_id)) for t in (gate, up, down))


def moe_experts(x, weights, ids, gate, up, down, *, n_threads: int = 0, compute: str = "f32"):
    """x [N, d] float (on the GPU), weights [N, k], ids [N, k] in [0, E), gate/up [E, F, d] and
    down [E, d, F] host-resident QuantArray-likes -> [N, d] float32 on the GPU. n_threads: the host
    threads (-t / -tb; 0 = every core). compute as `cpu.moe_experts`."""
    if compute not in COMPUTE:
        raise ValueError(f"moe_experts (host): compute must be one of {sorted(COMPUTE)}, not {compute!r}")
    if not supported(gate, up, down):
        raise ValueError(f"moe_experts (host): no host path for gate {gate.qtype.name} {tuple(gate.shape)}, "
                         f"up {up.qtype.name} {tuple(up.shape)}, down {down.qtype.name} {tuple(down.shape)}"
                         + (f" ({unavailable_reason()})" if _cuda_host is None else ""))
    E, F, d = gate.shape
    if x.ndim != 2 or x.shape[1] != d or weights.shape != ids.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(f"moe_experts (host): x {x.shape}, weights {weights.shape}, ids {ids.shape} "
                         f"do not fit experts of d={d}")
    g, u, dn = _slot_table(gate, E * F, "gate"), _slot_table(up, E * F, "up"), _slot_table(down, E * d, "down")
    register()
    out = jax.ShapeDtypeStruct((x.shape[0], d), jnp.float32)
    i64 = np.int64
    return jax.ffi.ffi_call(TARGET, out)(
        x.astype(jnp.float32), weights.astype(jnp.float32), _ids_and_layer(ids, gate),
        gate_slots=g[0], up_slots=u[0], down_slots=dn[0],
        gate_row_bytes=i64(g[1] // (E * F)), up_row_bytes=i64(u[1] // (E * F)),
        down_row_bytes=i64(dn[1] // (E * d)),
        gate_type=i64(gate.qtype.type_id), up_type=i64(up.qtype.type_id), down_type=i64(down.qtype.type_id),
        n_expert=i64(E), n_ff=i64(F), n_threads=i64(n_threads), compute=i64(COMPUTE[compute]))


STREAM_TARGET = "ikjax_stream_experts"


def stream_supported(gate, up, down) -> bool:
    """This build can stream these host experts' active blocks to the GPU (`stream_experts`)."""
    return _cuda_host is not None and all(len(t.shape) == 3 and all(hasattr(a, "host_address") for a in _layers_of(t))
                                          for t in (gate, up, down))


def _stream_slots(t) -> np.ndarray:
    """`_slot_table`'s slots of a pinned tensor, whole experts a row."""
    return _slot_table(t, t.shape[0], "streamed experts")[0]


def _slot_shapes(slots: int, *tensors) -> tuple:
    """[slots, rows, row_bytes] uint8 per tensor: the blocks of `slots` experts as stored."""
    out = []
    for t in tensors:
        E = t.shape[0]
        if t.nbytes % E:
            raise ValueError(f"stream_experts: {t!r} is not {E} experts of whole bytes")
        rows = t.shape[1]
        out.append(jax.ShapeDtypeStruct((slots, rows, t.nbytes // (E * rows)), jnp.uint8))
    return out


def stream_experts(weights, ids, gate, up, down, *, slots: int, round: int):
    """Round `round` of a batch's experts streamed to the GPU (cuda_host.cc "ikjax_stream_experts"):
    the experts with a non-zero weight in (weights, ids), ranked by id, [round * slots, (round + 1)
    * slots) of them, copied from their pinned host bytes into `slots` device slots. -> (gate, up,
    down uint8 [slots, rows, row_bytes], slot_of int32 [E]: each expert's slot in this round or
    -1). Slot 0 always holds real blocks (zeros when the round copies nothing); other slots not in
    slot_of hold unspecified bytes."""
    if not stream_supported(gate, up, down):
        raise ValueError(f"stream_experts: not available for {gate!r} ({unavailable_reason() or 'no host address'})")
    E = gate.shape[0]
    if not 1 <= slots <= E or round < 0:
        raise ValueError(f"stream_experts: slots must be in [1, {E}] and round >= 0, got {slots}, {round}")
    register()
    outs = (*_slot_shapes(slots, gate, up, down), jax.ShapeDtypeStruct((E,), jnp.int32))
    i64 = np.int64
    return jax.ffi.ffi_call(STREAM_TARGET, outs)(
        weights.astype(jnp.float32), _ids_and_layer(ids, gate),
        gate_slots=_stream_slots(gate), up_slots=_stream_slots(up), down_slots=_stream_slots(down),
        n_expert=i64(E), round=i64(round))


CHUNK_START, CHUNK_DONE = "ikjax_chunk_copy_start", "ikjax_chunk_copy_done"


def chunk_copy_start(after, gate, up, down, *, lo: int, n: int):
    """Experts [lo, lo + n) of the three pinned host tensors copied to the GPU by the copy engine on
    a side stream (cuda_host.cc "ikjax_chunk_copy_start"), ordered in the step after `after` (any
    small device array). -> (gate, up, down uint8 [n, rows, row_bytes]): not to be read before
    `chunk_copy_done` returns them."""
    if not stream_supported(gate, up, down):
        raise ValueError(f"chunk_copy_start: not available for {gate!r} ({unavailable_reason() or 'no host address'})")
    E = gate.shape[0]
    if not (0 <= lo and 1 <= n and lo + n <= E):
        raise ValueError(f"chunk_copy_start: experts [{lo}, {lo + n}) outside [0, {E})")
    register()
    i64 = np.int64
    return jax.ffi.ffi_call(CHUNK_START, _slot_shapes(n, gate, up, down))(
        after, _layer_index(gate), gate_slots=_stream_slots(gate), up_slots=_stream_slots(up),
        down_slots=_stream_slots(down), n_expert=i64(E), lo=i64(lo))


def chunk_copy_done(after, blocks):
    """The blocks of a `chunk_copy_start`, once its copy is done: XLA's stream waits for it here
    (ordered after `after`), so what runs between the two calls overlaps the copy."""
    register()
    return jax.ffi.ffi_call(CHUNK_DONE, [jax.ShapeDtypeStruct(b.shape, b.dtype) for b in blocks],
                            input_output_aliases={1: 0, 2: 1, 3: 2})(after, *blocks)


def stream_experts_ref(weights, ids, gate, up, down, *, slots: int, round: int):
    """`stream_experts` in jnp over device-resident blocks (`.data` [E, rows, row_bytes]): the same
    contract (unfilled slots hold zeros here), what the CPU tests run the round loop with."""
    E = gate.shape[0]
    used = jnp.zeros((E,), bool).at[ids.reshape(-1)].max(weights.reshape(-1) != 0)
    rank = jnp.cumsum(used) - 1
    lo = round * slots
    mine = used & (rank >= lo) & (rank < lo + slots)
    slot_of = jnp.where(mine, rank - lo, -1).astype(jnp.int32)
    # expert of each slot (E = none): scatter the experts to their slots
    expert_of = jnp.full((slots,), E, jnp.int32).at[jnp.where(mine, rank - lo, slots)].set(
        jnp.arange(E, dtype=jnp.int32), mode="drop")
    bufs = []
    for t in (gate, up, down):
        data = t.data.reshape(E, t.shape[1], -1)
        got = jnp.take(data, jnp.minimum(expert_of, E - 1), axis=0)
        bufs.append(jnp.where((expert_of < E)[:, None, None], got, jnp.zeros_like(got)))
    return (*bufs, slot_of)


def stream_stats(reset: bool = False) -> dict:
    """Totals of `stream_experts` calls in this process: calls, active experts per batch (summed),
    experts and bytes copied, copy runs. Empty where the handler is not built."""
    return dict(_cuda_host.stream_stats(reset)) if _cuda_host is not None else {}


def host_stats(reset: bool = False) -> dict:
    """Totals of the host kernel's calls from GPU steps in this process (`ikjax_host_moe_experts`):
    calls, ns in the kernel, expert bytes read, and the same for decode-sized calls (small_*), and
    how calls are handed over (host_call: "flag" or "hostfunc", IKJAX_HOST_CALL and what the driver
    offers). Empty where the handler is not built."""
    if _cuda_host is None:
        return {}
    return {**_cuda_host.host_stats(reset), "host_call": _cuda_host.host_call()}
