"""GGUF quantized blocks kept as they are, dequantized inside the jitted graph."""
