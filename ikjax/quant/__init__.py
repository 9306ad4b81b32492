"""GGUF quantized blocks kept as they are, dequantized inside the jitted graph."""
from .types import QUANT_TYPES, QuantType, UnsupportedQuantType, by_name, lookup, register
from .dequant import DECODERS, dequantize, supports
from . import ik_types  # noqa: F401  (registers ik_llama.cpp's types and decoders)
from .array import QuantArray

__all__ = ["QUANT_TYPES", "QuantType", "UnsupportedQuantType", "by_name", "lookup", "register",
           "DECODERS", "dequantize", "supports", "QuantArray"]
