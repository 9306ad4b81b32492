"""Summarize an `IKJAX_SERVE_TRACE` file (issue 23's interference): where the server's steps went
while a long prompt was fed among decoding streams.

    python bench/serve_trace.py trace.jsonl

For every run of 3+ prompt chunks with decode steps around them: each chunk's time, the gaps
between the ends of consecutive decode steps (when the streams' tokens leave the scheduler) and
the largest of them in chunks: the server's own share of the delay a client sees.
"""
from __future__ import annotations

import json
import statistics
import sys


def main() -> None:
    ev = [json.loads(line) for line in open(sys.argv[1])]
    runs, cur = [], []
    for i, e in enumerate(ev):
        if e["kind"] == "chunk":
            cur.append(i)
        elif cur and e["kind"] == "decode" and i - cur[-1] > 2:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    steady = [b["t1"] - a["t1"] for a, b in zip(ev, ev[1:]) if a["kind"] == b["kind"] == "decode"]
    print(f"{len(ev)} steps; decode-to-decode gap when no prompt is fed: median {statistics.median(steady) * 1e3:.1f} ms"
          if steady else f"{len(ev)} steps")
    loops = [e for e in ev if e["kind"] == "decode" and "ready" in e]
    if loops:  # decode loops: the device's share (dispatch to tokens read) and the host's emitting them
        wait = sum(e["ready"] - e["t0"] for e in loops)
        emit = sum(e["t1"] - e["ready"] for e in loops)
        steps = sum(e["k"] for e in loops)
        print(f"{len(loops)} decode loops, {steps} steps: waiting for tokens {wait / steps * 1e3:.2f} ms a step, "
              f"emitting them {emit / steps * 1e3:.2f} ms a step ({emit / max(wait + emit, 1e-9):.0%} of the loops' time)")
    for run in runs:
        if len(run) < 3:
            continue
        lo, hi = run[0], run[-1] + 2
        window = ev[max(0, lo - 1):hi]
        decodes = [e["t1"] for e in window if e["kind"] == "decode"]
        if len(decodes) < 2:
            continue
        chunks = [(ev[i]["t1"] - ev[i]["t0"]) * 1e3 for i in run]
        gaps = [(b - a) * 1e3 for a, b in zip(decodes, decodes[1:])]
        c = statistics.median(chunks)
        print(f"{len(run)} chunks of {c:.1f} ms (median; {min(chunks):.1f}-{max(chunks):.1f}); decode-end gaps "
              f"{[round(g, 1) for g in gaps]} ms: largest {max(gaps):.1f} ms = {max(gaps) / c:.2f} chunks")


if __name__ == "__main__":
    main()
