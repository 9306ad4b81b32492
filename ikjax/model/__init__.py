"""The deepseek2 graph as pure functions of (weights, cache, tokens, positions)."""
