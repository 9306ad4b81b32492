"""A/B of the load on shapes alone recording a layer group's zeroed stacks and its put (issue 22's
cold start, RESULTS §22ai): `new` as it is (both compiled ahead of the load, beside the steps),
`old` with the two left out of the recording (the load compiles them itself, under the steps'
lowering lock, as before).

    python bench/stack_programs_ab.py old|new sweep-bench -m F -mla 3 -fa 1 -c 16384 -ub 2048 -n 128
"""
from __future__ import annotations

import sys


def main() -> None:
    form, argv = sys.argv[1], sys.argv[2:]
    if form not in ("old", "new"):
        raise SystemExit("first argument: old or new")
    from ikjax import programs
    if form == "old":
        orig = programs.run

        def run(name, jitted, args, static=()):
            if programs.is_abstract() and name in ("zeros", "put_layer"):
                return programs._shapes_of(jitted, args, static)
            return orig(name, jitted, args, static)
        programs.run = run
    import ikjax.cli
    sys.argv = ["ikjax", *argv]
    ikjax.cli.main()


if __name__ == "__main__":
    main()
