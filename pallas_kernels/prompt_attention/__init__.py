"""Causal flash attention for prompt steps over decompressed MLA keys and values (-mla 2/3)."""
from .reference import attention_kv_ref
from .kernel import attention_kv_flash, supports

__all__ = ["attention_kv_ref", "attention_kv_flash", "supports"]
