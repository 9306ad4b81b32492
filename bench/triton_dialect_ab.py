"""A/B of pallas_kernels' Triton dialect registration (issue 22's cold start, RESULTS §22ag): runs an
`ikjax` command in this process with the registration (`new`) or without it (`old`: the entry
removed after `pallas_kernels` imported, before anything lowers, so MLIR's Python bindings look
the `tt` dialect's module up and fail ~230 times a kernel, as before).

    python bench/triton_dialect_ab.py old|new sweep-bench -m F -mla 3 -fa 1 -c 16384 -ub 2048 -n 128
"""
from __future__ import annotations

import sys


def main() -> None:
    form, argv = sys.argv[1], sys.argv[2:]
    if form not in ("old", "new"):
        raise SystemExit("first argument: old or new")
    import pallas_kernels  # noqa: F401 - registers the module (new)
    if form == "old":
        sys.modules.pop("jaxlib.mlir.dialects.tt", None)
    import ikjax.cli
    sys.argv = ["ikjax", *argv]
    ikjax.cli.main()


if __name__ == "__main__":
    main()
