"""f32 -> bf16 as XLA's convert rounds it, over the C++ pool's threads (CPU)."""
