"""Tools a user runs beside inference: sweep-bench, llama-bench, plots of their runs, synthetic models."""
