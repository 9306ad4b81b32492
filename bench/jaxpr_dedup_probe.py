"""Issue 25/22 probe: which nested jits of a step's jaxpr come out as several jaxprs that print the
same (so the lowered module holds several private functions for one, and its JAX cache key varies
between runs, RESULTS §25j). Runs `sweep-bench` in-process with compile_cache.lower wrapped to
keep each step's jaxpr; for every nested jit name with more than one jaxpr object whose text is the
same, prints which params differ between the first two.

    python bench/jaxpr_dedup_probe.py MODEL [sweep-bench options...]
"""
import sys
from collections import defaultdict

from ikjax.runtime import compile_cache

_seen = []
_orig = compile_cache.lower


def _lower(jitted, *args, **kwargs):
    traced = jitted.trace(*args, **kwargs)
    _seen.append(traced.jaxpr)
    return traced.lower()


compile_cache.lower = _lower


def _walk(jaxpr, out):
    for eqn in jaxpr.eqns:
        if "jaxpr" in eqn.params and "name" in eqn.params:
            out[eqn.params["name"]].append(eqn)
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None and hasattr(inner, "eqns"):
                    _walk(inner, out)
                elif hasattr(sub, "eqns"):
                    _walk(sub, out)


def main():
    from ikjax.cli.common import app
    argv = ["sweep-bench", "-m", sys.argv[1]] + sys.argv[2:]
    try:
        app(argv, standalone_mode=False)
    except SystemExit:
        pass
    for n, closed in enumerate(_seen):
        weak = [i for i, v in enumerate(closed.in_avals) if getattr(v, "weak_type", False)]
        spaces = sorted({str(getattr(v, "memory_space", None)) for v in closed.in_avals})
        print(f"step {n}: {len(closed.in_avals)} arguments, weak-typed: {weak[:12]}, memory spaces: {spaces}")
        by_name = defaultdict(list)
        _walk(closed.jaxpr, by_name)
        for name, eqns in sorted(by_name.items()):
            objs = {}
            for e in eqns:
                objs.setdefault(id(e.params["jaxpr"]), e)
            if len(objs) < 2:
                continue
            groups = defaultdict(list)
            for e in objs.values():
                groups[str(e.params["jaxpr"])].append(e)
            for text, es in groups.items():
                if len(es) < 2:
                    continue
                a, b = es[0], es[1]
                diff = [k for k in a.params if k != "jaxpr" and not (a.params[k] == b.params[k])]
                same_avals = [v.aval for v in a.invars] == [v.aval for v in b.invars]
                ja, jb = a.params["jaxpr"], b.params["jaxpr"]
                consts = (len(ja.consts), len(jb.consts))
                print(f"step {n}: {name}: {len(es)} jaxprs print alike; params differing: {diff}; "
                      f"in avals equal: {same_avals}; consts {consts}; "
                      f"effects {ja.effects == jb.effects}; in avals a {[str(v.aval) for v in a.invars][:3]}")
                for i, (va, vb) in enumerate(zip(a.invars, b.invars)):
                    if va.aval != vb.aval:
                        def show(v):
                            x = v.aval
                            return (f"{x!r} weak_type={getattr(x, 'weak_type', None)} "
                                    f"sharding={getattr(x, 'sharding', None)} "
                                    f"memory_space={getattr(x, 'memory_space', None)} vma={getattr(x, 'vma', None)}")
                        print(f"    invar {i}: {show(va)}\n         vs {show(vb)}")
                        break
                for k in diff:
                    print(f"    {k}: {a.params[k]!r:.300}\n    vs {b.params[k]!r:.300}")


if __name__ == "__main__":
    main()
