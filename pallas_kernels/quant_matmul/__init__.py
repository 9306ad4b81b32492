"""y = x @ W^T with W in a GGUF quant type, dequantized on the fly."""
from .packing import PackedWeight, prepare, dequantize_packed, KERNEL_TYPES, supported
from .reference import quant_matmul_ref
from .kernel import quant_matmul

__all__ = ["PackedWeight", "prepare", "dequantize_packed", "KERNEL_TYPES", "supported",
           "quant_matmul_ref", "quant_matmul"]
