"""A/B of two kernel settings on a whole prompt step, alternated call by call in one process.

The companion of bench/cpu_moe_ab.py for a model file: `ikjax.load(FILE)` once, then a 512-token
prompt step (`eng.logits`) under setting A and under B in turn (ABBA), process CPU time each, since
this workplace's VMs spread 1.3-2x between processes. Settings are comma lists of NAME=VALUE the
C++ kernels read per call.

    python bench/cpu_step_ab.py m.gguf 8 IKJAX_AMX_FUSED=0,IKJAX_AMX_MIN_ROWS=64 IKJAX_AMX_FUSED=1,IKJAX_AMX_MIN_ROWS=32
"""
import os
import sys
import time
os.environ.setdefault("IKJAX_CPU_ISA", "amx")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import numpy as np  # noqa: E402

import ikjax  # noqa: E402


def main():
    path, rounds = sys.argv[1], int(sys.argv[2])
    forms = {k: dict(kv.split("=") for kv in v.split(",")) for k, v in (("A", sys.argv[3]), ("B", sys.argv[4]))}
    eng = ikjax.load(path, mla=3, fa=True, threads=2)
    toks = np.random.default_rng(0).integers(0, eng.config.vocab_size, 512)

    def run(k):
        os.environ.update(forms[k])
        t = time.process_time()
        np.asarray(eng.logits(toks))
        return time.process_time() - t

    for k in forms:  # each form's first step untimed
        run(k)
    res = {"A": [], "B": []}
    for r in range(rounds):
        for k in ("A", "B") if r % 2 == 0 else ("B", "A"):
            res[k].append(run(k))
    for k in res:
        print(k, forms[k], "best %.0f ms median %.0f ms" % (1e3 * min(res[k]), 1e3 * np.median(res[k])))
    print("A/B best %.3f median %.3f" % (min(res["A"]) / min(res["B"]), np.median(res["A"]) / np.median(res["B"])))


if __name__ == "__main__":
    main()
