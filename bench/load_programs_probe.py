"""Issue 22: which of the load's programs the load compiled itself on a cold run, rather than
finding them compiled ahead (`compile_cache.precompile_programs`, from the load on shapes alone):
those are lowered under the steps' lowering lock and the GIL, beside the steps. Runs an `ikjax`
command in this process and prints, per program name, how many calls were served ahead, compiled
ahead, compiled by the load (with its seconds), and the argument descriptions of the first few
the load compiled, against the nearest recorded one.

    python bench/load_programs_probe.py sweep-bench -m F -mla 3 -fa 1 -c 16384 -ub 2048 -n 128
"""
from __future__ import annotations

import collections
import sys
import threading
import time


def main() -> None:
    from ikjax.runtime import compile_cache as cc
    rows = collections.defaultdict(lambda: collections.Counter())
    secs = collections.Counter()
    own: list[tuple] = []
    ahead_args: dict[str, list] = collections.defaultdict(list)  # name -> recorded full keys
    local = threading.local()
    lock = threading.Lock()
    orig_run, orig_prog, orig_pre = cc.run_program, cc._program, cc.precompile_programs

    def run_program(name, jitted, args, static):
        local.name = name
        before = cc.programs_ahead()
        try:
            return orig_run(name, jitted, args, static)
        finally:
            if cc.programs_ahead() > before:
                with lock:
                    rows[name]["served ahead"] += 1

    def program(key, jitted, args, static, signature, serialized=True):
        t = time.perf_counter()
        try:
            return orig_prog(key, jitted, args, static, signature, serialized)
        finally:
            dt = time.perf_counter() - t
            name = getattr(local, "name", "?")
            with lock:
                kind = "compiled ahead" if not serialized else "compiled by the load"
                rows[name][kind] += 1
                secs[(name, kind)] += dt
                if serialized and len(own) < 12:
                    own.append((name, key))

    def precompile(calls, threads=4):
        import jax
        for name, _j, args, static in calls:
            leaves, tree = jax.tree.flatten((args, {}))
            ahead_args[name].append(cc._program_key(name, tree, leaves, static))
        return orig_pre(calls, threads)

    cc.run_program, cc._program, cc.precompile_programs = run_program, program, precompile
    import ikjax.cli
    sys.argv = ["ikjax", *sys.argv[1:]]
    try:
        ikjax.cli.main()
    except SystemExit:
        pass
    finally:
        print("\n# the load's programs", file=sys.stderr)
        for name, c in sorted(rows.items()):
            extra = "; ".join(f"{k} {secs[(name, k)]:.2f} s" for k in ("compiled ahead", "compiled by the load")
                              if secs[(name, k)])
            print(f"  {name}: {dict(c)} {extra}; recorded ahead {len(ahead_args.get(name, []))}", file=sys.stderr)
        for name, key in own:
            near = max(ahead_args.get(name, []), key=lambda k: _common(k, key), default=None)
            if near is None:
                print(f"  load compiled {name}: none of that name recorded ahead; key {key[:300]}", file=sys.stderr)
                continue
            i = _common(near, key)
            print(f"  load compiled {name}: the nearest recorded key differs at {i} of {len(key)}:\n"
                  f"     load:     ...{key[max(0, i - 150):i + 250]}\n     recorded: ...{near[max(0, i - 150):i + 250]}",
                  file=sys.stderr)


def _common(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


if __name__ == "__main__":
    main()
