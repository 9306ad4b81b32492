"""Who holds the lowering lock, and when, in a cold command (issue 22's deep first row: the steps'
tracing and the load's programs share `compile_cache._LOWERING` and the GIL).

Runs an `ikjax` command in this process with `compile_cache._LOWERING` replaced by a lock that
records, per acquisition, the thread, what it lowered, when it asked, when it got the lock and when
it let go; each load program's call (`compile_cache._program`: compiled or read by the load itself,
not served by `precompile_programs`) and each XLA compile (`Lowered.compile`, per thread) too.
Prints them in time order after the command.

    python bench/lowering_timeline.py sweep-bench -m F -mla 3 -fa 1 -c 16384 -ub 2048 -n 128
"""
from __future__ import annotations

import sys
import threading
import time

T0 = time.perf_counter()


# the main thread's phases before and around the steps' compile: (module, attribute) timed as events
PHASES = [("ikjax.runtime.engine", "GGUFModelFile"), ("ikjax.runtime.engine", "plan_placement"),
          ("ikjax.runtime.engine", "layer_spans"), ("ikjax.runtime.engine", "process_memory"),
          ("ikjax.runtime.engine", "runtime_ready"), ("ikjax.runtime.engine", "executor_for"),
          ("ikjax.runtime.engine", "check_fits"), ("ikjax.runtime.engine.Engine", "__init__"),
          ("ikjax.runtime.engine.Engine", "_dry_shapes"), ("ikjax.runtime.engine.Engine", "_prefetch_steps"),
          ("ikjax.runtime.engine.Engine", "_static_plan"), ("ikjax.runtime.engine.Engine", "wait_loaded"),
          ("ikjax.runtime.engine.Engine", "prepare_cache"), ("ikjax.runtime.compile_cache", "precompile_programs"),
          ("ikjax.tools.sweep_bench", "precompile")]


def main() -> None:
    # as the console script (before ikjax is imported): the early backend thread starts as it does for `ikjax`
    sys.argv = ["ikjax", *sys.argv[1:]]
    import importlib

    import jax._src.stages as stages

    from ikjax.runtime import compile_cache as cc

    events: list[tuple] = []  # (start, end, thread, what)
    ev_lock = threading.Lock()
    current = threading.local()

    def note(t0: float, what: str) -> None:
        with ev_lock:
            events.append((t0 - T0, time.perf_counter() - T0, threading.current_thread().name, what))

    class TimedLock:
        """The lowering lock, recording each wait and each hold."""

        def __init__(self) -> None:
            self._lock = threading.Lock()

        def __enter__(self):
            t = time.perf_counter()
            self._lock.acquire()
            current.asked, current.got = t, time.perf_counter()
            return self

        def __exit__(self, *exc):
            what = getattr(current, "what", "?")
            note(current.asked, f"waited for the lock ({what})") if current.got - current.asked > 0.02 else None
            note(current.got, f"holds the lock: lowering {what}")
            self._lock.release()
            return False

    cc._LOWERING = TimedLock()
    orig_lower = cc.lower

    def lower(jitted, *args, _serialized: bool = True, **kwargs):
        current.what = getattr(jitted, "__name__", None) or getattr(getattr(jitted, "fun", None), "__name__", "?")
        t = time.perf_counter()
        try:
            return orig_lower(jitted, *args, _serialized=_serialized, **kwargs)
        finally:
            if not _serialized:
                note(t, f"lowering {current.what} (no lock)")
    cc.lower = lower

    orig_program = cc._program

    def program(key, jitted, args, static, signature, serialized=True):
        t = time.perf_counter()
        try:
            return orig_program(key, jitted, args, static, signature, serialized)
        finally:
            note(t, f"program {'ahead' if not serialized else 'by the load'}: "
                    f"{getattr(jitted, '__name__', '?')}")
    cc._program = program

    orig_compile = stages.Lowered.compile

    def compile_(self, *a, **k):
        t = time.perf_counter()
        try:
            return orig_compile(self, *a, **k)
        finally:
            note(t, f"XLA compile {getattr(self, '_name', '') or ''}")
    stages.Lowered.compile = compile_

    def timed(owner, attr: str, label: str) -> None:
        orig = getattr(owner, attr)

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                note(t, f"phase {label}")
        setattr(owner, attr, wrapper)
    for mod, attr in PHASES:
        path, _, cls = mod.rpartition(".") if mod.endswith(".Engine") else (mod, "", "")
        owner = importlib.import_module(path)
        owner = getattr(owner, cls) if cls else owner
        timed(owner, attr, f"{cls + '.' if cls else ''}{attr}")

    import ikjax.cli
    code = 0
    try:
        ikjax.cli.app(standalone_mode=False)
    except SystemExit as e:
        code = e.code
    finally:
        print(f"\n# lowering timeline (rc {code}): start - end s, thread, what", file=sys.stderr)
        for s, e, th, what in sorted(events):
            if e - s >= 0.03 or "compile" in what or what.startswith("phase"):
                print(f"  {s:6.2f} - {e:6.2f} ({e - s:5.2f}) {th:26s} {what}", file=sys.stderr)
        by: dict[str, float] = {}
        for s, e, th, what in events:
            k = what.split(":")[0].split(" (")[0]
            by[k] = by.get(k, 0.0) + e - s
        print("  summed: " + ", ".join(f"{k} {v:.2f} s" for k, v in sorted(by.items(), key=lambda kv: -kv[1])),
              file=sys.stderr)


if __name__ == "__main__":
    main()
