"""The C++ CPU fused routed experts (cpu_kernel.cc) as a JAX op: one call per MoE layer and step.

out[n] = sum_j weights[n, j] * down_e(silu(gate_e x_n) * up_e x_n), e = ids[n, j] — the same
function as `reference.moe_experts_ref` / `moe_experts_grouped_ref` with f32 activations. The kernel
buckets the assignments by expert, so each selected expert's GGUF blocks are read once per call
however many tokens picked it; assignments with weight exactly 0 (smart expert reduction) are
skipped. Expert tensors are QuantArrays (duck-typed: `.data`, `.qtype.type_id`, `.shape`); gate, up
and down may each be of a different type (Q4_K_M files mix Q4_K gate/up with Q6_K down).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ikjax.quant.array import stacked_operands
from pallas_kernels import cpu as _cpu

TARGET = "ikjax_cpu_moe_experts"
COMPUTE = {"f32": 0, "bf16": 1}  # quant_matmul/cpu_kernel.h QmCompute


def type_supported(type_id: int) -> bool:
    """Whether the C++ quant core has a path for this ggml type id (asked of the extension at the
    current ISA level, so the answer follows the core as it gains types)."""
    return _cpu.available() and bool(_cpu._cpu.quant_type_supported(int(type_id)))


def _shapes(gate, up, down):
    E, F, d = gate.shape
    return E, F, d, tuple(up.shape) == (E, F, d) and tuple(down.shape) == (E, d, F)


def supported(gate, up, down) -> bool:
    """The C++ path takes these expert tensors: 3-D [E, F, d] / [E, d, F] of types the core supports."""
    if not _cpu.available() or any(len(t.shape) != 3 for t in (gate, up, down)):
        return False
    return _shapes(gate, up, down)[3] and all(type_supported(t.qtype.type_id) for t in (gate, up, down))


def moe_experts(x, weights, ids, gate, up, down, *, n_threads: int = 0, compute: str = "f32"):
    """x [N, d] float, weights [N, k] float32, ids [N, k] int in [0, E), gate/up [E, F, d],
    down [E, d, F] QuantArrays (or LayerSlices of stacks of them, all of the same layer, read in
    place) -> [N, d] float32. n_threads: the -t / -tb count (0 = all cores).
    compute "f32" matches the references at dtype=float32; "bf16" is the fast mode of the model's
    default dtype: the quantized products take the C++ core's QM_BF16 path (quant_matmul/cpu_kernel.h
    says per type and level: int8 activations on the weights' own quants for most types at the avx2,
    avx512 and amx levels, x and the weights rounded to bf16 with f32 accumulation elsewhere)."""
    if compute not in COMPUTE:
        raise ValueError(f"moe_experts (cpu): compute must be one of {sorted(COMPUTE)}, not {compute!r}")
    if not supported(gate, up, down):
        raise ValueError(f"moe_experts (cpu): no C++ path for gate {gate.qtype.name} {tuple(gate.shape)}, "
                         f"up {up.qtype.name} {tuple(up.shape)}, down {down.qtype.name} {tuple(down.shape)}")
    E, F, d, _ = _shapes(gate, up, down)
    if x.ndim != 2 or x.shape[1] != d or weights.shape != ids.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(f"moe_experts (cpu): x {x.shape}, weights {weights.shape}, ids {ids.shape} "
                         f"do not fit experts of d={d}")
    _cpu.register()

    def data(t, rows):  # [L, E, rows, row_bytes]: a LayerSlice's whole stack, or one layer's as a stack of one
        stack, _ = stacked_operands(t)
        return stack.reshape(stack.shape[0], E, rows, -1)
    layer = stacked_operands(gate)[1]
    out = jax.ShapeDtypeStruct((x.shape[0], d), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(
        x.astype(jnp.float32), weights.astype(jnp.float32), ids.astype(jnp.int32),
        data(gate, F), data(up, F), data(down, d), layer,
        gate_type=np.int64(gate.qtype.type_id), up_type=np.int64(up.qtype.type_id),
        down_type=np.int64(down.qtype.type_id), n_threads=np.int64(n_threads),
        compute=np.int64(COMPUTE[compute]))
