"""Choosing the next token from logits: greedy, or temperature with top-k / top-p / min-p filters
(llama.cpp's order: top-k, top-p, min-p, then temperature)."""
from __future__ import annotations

import numpy as np


def sample_next(logits: np.ndarray, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                min_p: float = 0.0, rng: np.random.Generator | None = None) -> int:
    logits = np.asarray(logits, np.float64)
    if temperature <= 0.0:
        return int(np.argmax(logits))
    order = np.argsort(-logits, kind="stable")
    if top_k > 0:
        order = order[:top_k]
    probs = np.exp(logits[order] - logits[order[0]])
    probs /= probs.sum()
    if top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), top_p) + 1)
        order, probs = order[:keep], probs[:keep]
    if min_p > 0.0:
        keep = probs >= min_p * probs[0]
        order, probs = order[keep], probs[keep]
    scaled = np.exp((logits[order] - logits[order[0]]) / temperature)
    scaled /= scaled.sum()
    rng = rng or np.random.default_rng()
    return int(order[rng.choice(len(order), p=scaled)])
