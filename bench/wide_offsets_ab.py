"""A/B of one layer group per run of identical layers on the GPU (issue 22's cold start, RESULTS
§22ai): runs an `ikjax` command in this process as it is (`new`: Pallas's offsets 64-bit where an
operand passes 2^31 elements, so a group stacks any number of layers) or with the groups stopped
below 2^31 bytes a stack (`old`: V2-Lite's MoE layers as groups of 20 and 6, each traced, lowered
and compiled).

    python bench/wide_offsets_ab.py old|new sweep-bench -m F -mla 3 -fa 1 -c 16384 -ub 2048 -n 128
"""
from __future__ import annotations

import sys


def main() -> None:
    form, argv = sys.argv[1], sys.argv[2:]
    if form not in ("old", "new"):
        raise SystemExit("first argument: old or new")
    import ikjax.cli
    if form == "old":
        from ikjax import ops
        ops.pallas_stack_limit = lambda: 2**31 - 1
    sys.argv = ["ikjax", *argv]
    ikjax.cli.main()


if __name__ == "__main__":
    main()
