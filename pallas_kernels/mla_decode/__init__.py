"""Flash-decoding for absorbed MLA on the latent cache (K = 576-wide entry, V = its first 512)."""
from .reference import mla_decode_ref
from .kernel import mla_decode

__all__ = ["mla_decode_ref", "mla_decode"]
