"""The -mla prompt's query with its rope part rotated and cast to the products' dtype in one pass (CPU)."""
