"""RMSNorm over the last axis, one row per program (the batch-invariant decode step's norm)."""
from .reference import rms_norm_ref
from .kernel import rms_norm_rows

__all__ = ["rms_norm_ref", "rms_norm_rows"]
