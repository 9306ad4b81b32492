"""sweep-bench's rows through the Python API, for what the CLI cannot separate (issue 24, RESULTS
§24i): `--gpu-experts` from a statistics file *without* counting this run (the CLI's
`--gpu-experts auto --expert-stats FILE` always counts too), or counting without hot experts.
Prints the rows as sweep-bench does, then the host kernel's decode-sized calls over the sweep.

    python3 bench/hybrid_sweep_api.py r1-8.gguf [--gpu-experts auto --expert-counts stats.json] [--count]
"""
from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--ubatch", type=int, default=2048)
    ap.add_argument("--tg", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--gpu-experts", default="")
    ap.add_argument("--expert-counts", default="")
    ap.add_argument("--count", action="store_true", help="count expert statistics (what --expert-stats turns on)")
    ap.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after the compile (is a collection in a callback the cost?)")
    a = ap.parse_args()
    import ikjax
    from ikjax import ops
    from ikjax.tools import sweep_bench as sb
    extra = {"gpu_experts": a.gpu_experts, "expert_counts": a.expert_counts} if a.gpu_experts else {}
    t0 = time.perf_counter()
    eng = ikjax.load(a.model, ctx=a.ctx, ubatch=a.ubatch, batch=a.ubatch, mla=3, fa=True, cpu_moe=True,
                     threads=a.threads, expert_stats=a.count, **extra)
    eng.wait_loaded()
    print(f"loaded in {time.perf_counter() - t0:.1f} s; {eng.gpu_experts_note or 'no gpu experts'}; "
          f"counting {'on' if a.count else 'off'}")
    sb.precompile(eng, a.tg)
    if a.gc_freeze:
        import gc
        gc.collect()
        gc.freeze()
    if a.count:  # the statistics' host callback timed from inside
        from ikjax.model import moe
        spent = [0.0, 0]
        orig = moe.ExpertCounts.record_counts

        def timed(self, *args):
            t = time.perf_counter()
            orig(self, *args)
            spent[0] += time.perf_counter() - t
            spent[1] += 1
        moe.ExpertCounts.record_counts = timed
    ops.host_kernel_stats(reset=True)
    rows = list(sb.run(eng, a.tg))
    print(sb.HEADER)
    print(sb.SEPARATOR)
    for r in rows:
        print(r.markdown())
    line = sb.host_decode_report(eng, rows, ops.host_kernel_stats())
    print(line or "no host calls")
    if a.count:
        print(f"statistics callbacks: {spent[1]} calls, {spent[0] * 1e3:.1f} ms inside record_counts")


if __name__ == "__main__":
    main()
