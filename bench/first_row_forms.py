"""A/B forms of one `ikjax` command run in this process (issue 22's cold start: `lease_x4.sh`'s
`first_row_ab`). FORM is one of:

  new             the code as it is
  old-triton      without pallas_kernels' Triton dialect registration (~230 failed imports a
                  kernel's lowering, RESULTS §22ag)
  old-groups      the layer groups stopped below 2^31 bytes a stack (V2-Lite's MoE layers as groups
                  of 20 and 6, each traced, lowered and compiled: before the 64-bit offsets, §22ai)
  old-order       sweep-bench's first-row steps lowered decode loop first (before §22al: the
                  prompt step, whose XLA compile is the longest, lowered second)
  old-check       the decode loop's XLA option checked after its lowering (a trivial compile between its
                  lowering and its compile, before §22am)
  old-threads     the load's programs compiled ahead on four threads (before §22am)
  old-stacks      the load on shapes alone without the groups' zeroed stacks and put (the load then
                  compiles both itself, under the steps' lowering lock, §22ai)
  NAME            a set of environment variables in AB_FORMS (`name=VAR=value,VAR2=value2;name2=...`,
                  an empty list: the environment as it is; a value for XLA_FLAGS is appended to it),
                  set before anything imports JAX

    python bench/first_row_forms.py old-groups sweep-bench -m F -mla 3 -fa 1 -c 16384 -ub 2048 -n 128
"""
from __future__ import annotations

import os
import sys


def env_forms(text: str) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, rest = part.partition("=")
        out[name] = dict(kv.split("=", 1) for kv in filter(None, rest.split(",")))
    return out


def old_triton() -> None:
    import pallas_kernels  # noqa: F401 - registers the module; then it is taken away again
    sys.modules.pop("jaxlib.mlir.dialects.tt", None)


def old_groups() -> None:
    from ikjax import ops
    ops.pallas_stack_limit = lambda: 2**31 - 1


def old_stacks() -> None:
    from ikjax import programs
    orig = programs.run

    def run(name, jitted, args, static=()):
        if programs.is_abstract() and name in ("zeros", "put_layer"):
            return programs._shapes_of(jitted, args, static)
        return orig(name, jitted, args, static)
    programs.run = run


def old_order() -> None:
    from ikjax.tools import sweep_bench
    sweep_bench.lowering_order = lambda jobs: list(jobs)


def old_check() -> None:
    from ikjax.runtime import compile_cache, executables
    orig = compile_cache.lower

    def lower(jitted, *args, **kwargs):
        out = orig(jitted, *args, **kwargs)
        if jitted is executables._jitted_decode:  # the check's trivial compile again, where it was
            executables._check_option.cache_clear()
            executables._check_option("xla_gpu_command_buffer_unroll_loops", True, "IKJAX_DECODE_GRAPH_UNROLL=1")
        return out
    compile_cache.lower = lower


def old_threads() -> None:
    from ikjax.runtime import compile_cache
    compile_cache.precompile_programs.__defaults__ = (4,)


FORMS = {"old-check": old_check, "old-threads": old_threads, "old-order": old_order, "new": lambda: None, "old-triton": old_triton, "old-groups": old_groups, "old-stacks": old_stacks}


def main() -> None:
    form, argv = sys.argv[1], sys.argv[2:]
    # as the console script: ikjax/__init__ starts the backend's thread only for the command line's own
    # process (ikjax.early_backend.is_cli), so the forms import the package as `ikjax` does
    sys.argv = ["ikjax", *argv]
    table = env_forms(os.environ.get("AB_FORMS", ""))
    if form in table:
        for k, v in table[form].items():
            os.environ[k] = (os.environ.get(k, "") + " " + v).strip() if k == "XLA_FLAGS" else v
    elif form in FORMS:
        FORMS[form]()
    else:
        raise SystemExit(f"form {form!r}: expected one of {', '.join(FORMS)} or a name in AB_FORMS "
                         f"({', '.join(table) or 'empty'})")
    import ikjax.cli
    ikjax.cli.main()


if __name__ == "__main__":
    main()
