"""Routed-expert FFN (gate+up with SiLU·mul, then down) on quantized expert weights."""
from .reference import moe_experts_ref, moe_experts_grouped_ref
from .kernel import moe_experts, moe_experts_gather, moe_experts_grouped

__all__ = ["moe_experts_ref", "moe_experts_grouped_ref", "moe_experts", "moe_experts_gather", "moe_experts_grouped"]
