"""`python -m ikjax.cli ...`: the same as the `ikjax` console script (multi-process launches use it)."""
from ikjax.cli import main

main()
