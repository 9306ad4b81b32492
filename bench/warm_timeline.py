"""Where a whole `ikjax` command's time goes, thread by thread (issue 22's warm start: 7.4 s from
command to end on an H200, of which the sweep is ~2 s).

Runs the command in this process (`python bench/warm_timeline.py sweep-bench -m F ...`, the same
arguments as `ikjax`) with a thread that samples every thread's stack every 5 ms from the moment
this script starts (before `import jax`), then prints, per thread, the runs of consecutive samples
that share a label (the innermost ikjax / pallas_kernels frame, else the innermost frame's module,
`import` while the import system is on the stack), longest first within a thread's timeline, and
the second each run began. Interpreter start before this script runs is not seen: `python -c pass`
gives it.

    python bench/warm_timeline.py [--min-ms 40] [--interval-ms 5] -- sweep-bench -m F -c 4096 ...
"""
from __future__ import annotations

import collections
import sys
import threading
import time

T0 = time.perf_counter()


def _label(frame) -> str:
    """The sample's label: the innermost frame of our code, or what the thread is doing outside it."""
    f, inner, importing = frame, None, False
    while f is not None:
        fn = f.f_code.co_filename
        if inner is None and ("/ikjax/" in fn or "/pallas_kernels/" in fn):
            inner = f"{fn.rsplit('/', 2)[-2]}/{fn.rsplit('/', 1)[-1]}:{f.f_code.co_name}"
        if "importlib._bootstrap" in fn or fn.startswith("<frozen importlib"):
            importing = True
        f = f.f_back
    if importing:
        return f"import ({inner})" if inner else "import"
    if inner:
        return inner
    fn = frame.f_code.co_filename
    return f"{fn.rsplit('/', 1)[-1]}:{frame.f_code.co_name}"


def main() -> None:
    argv = sys.argv[1:]
    min_ms, every = 40.0, 0.005
    while argv and argv[0] != "--":
        opt = argv.pop(0)
        if opt == "--min-ms":
            min_ms = float(argv.pop(0))
        elif opt == "--interval-ms":
            every = float(argv.pop(0)) / 1000
        else:
            raise SystemExit(f"unknown option {opt} (options before --: --min-ms, --interval-ms)")
    argv = argv[1:]
    samples: dict[str, list] = collections.defaultdict(list)  # thread name -> [(t, label)]
    stop = threading.Event()
    sampler_id: list = [None]  # the sampler's own thread, left out of its samples

    def sample() -> None:
        while not stop.is_set():
            t = time.perf_counter() - T0
            names = {th.ident: th.name for th in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident != sampler_id[0]:
                    samples[names.get(ident, str(ident))].append((t, _label(frame)))
            time.sleep(every)

    th = threading.Thread(target=sample, daemon=True, name="sampler")
    th.start()
    sampler_id[0] = th.ident
    rc = 0
    sys.argv = ["ikjax"] + argv
    try:
        from ikjax.cli import main as cli_main
        cli_main()
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    end = time.perf_counter() - T0
    stop.set()
    th.join()
    out = sys.stderr
    print(f"\n# timeline: {end:.2f} s in this process (rc {rc}); runs of >= {min_ms:.0f} ms per thread", file=out)
    for name, rows in samples.items():
        runs: list[list] = []  # [start, end, label]
        for t, lab in rows:
            if runs and runs[-1][2] == lab and t - runs[-1][1] < 3 * every:
                runs[-1][1] = t
            else:
                runs.append([t, t, lab])
        shown = [r for r in runs if (r[1] - r[0]) * 1000 >= min_ms]
        if not shown:
            continue
        print(f"## thread {name}: first seen {rows[0][0]:.2f} s, last {rows[-1][0]:.2f} s", file=out)
        for a, b, lab in shown:
            print(f"  {a:6.2f} - {b:6.2f} s ({(b - a) * 1000:6.0f} ms)  {lab}", file=out)
        tot: collections.Counter = collections.Counter()
        for a, b, lab in runs:
            tot[lab] += b - a + every
        top = ", ".join(f"{lab} {sec:.2f} s" for lab, sec in tot.most_common(6))
        print(f"  most time: {top}", file=out)
        if name == "MainThread":  # what the short runs add up to, a quarter second at a time
            win: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
            for t, lab in rows:
                win[int(t / 0.25)][lab] += 1
            for w in sorted(win):
                c, n = win[w], sum(win[w].values())
                print(f"  [{w * 0.25:5.2f} s] " + ", ".join(f"{lab} {k * 100 // n}%" for lab, k in c.most_common(3)),
                      file=out)
    sys.exit(rc)


if __name__ == "__main__":
    main()
