"""Issue 22 probe: -ot host layers scanned (IKJAX_HOST_LAYERS=scan) or unrolled, against the all-GPU
run, at f32, for each streaming form and IKJAX_STREAM_MIB: relative error of a prompt's logits.

    python3 bench/ot_scan_check.py MODEL [--tokens 200] [--mibs 512,0.05] [--streams chunks,active]
"""
from __future__ import annotations

import argparse
import os

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--mibs", default="512,0.05")
    ap.add_argument("--streams", default="chunks,active")
    ap.add_argument("--forms", default="scan,unroll")
    ap.add_argument("--save", help="only write the all-device run's logits here (.npy; run it with JAX_PLATFORMS=cpu)")
    ap.add_argument("--against", help="first compare the all-GPU run, scanned and unrolled (IKJAX_LAYERS), with these")
    a = ap.parse_args()
    import ikjax
    tokens = (np.arange(a.tokens) * 7 + 5) % 1000
    if a.save:
        np.save(a.save, np.asarray(ikjax.load(a.model, ctx=512, ubatch=256, dtype="f32").logits(tokens)))
        return
    if a.against:
        base = np.load(a.against).astype(np.float64)
        for layers in ("scan", "unroll"):
            os.environ["IKJAX_LAYERS"] = layers
            got = np.asarray(ikjax.load(a.model, ctx=512, ubatch=256, dtype="f32").logits(tokens), np.float64)
            rows = np.linalg.norm(got - base, axis=-1) / np.linalg.norm(base, axis=-1)
            print(f"all-GPU IKJAX_LAYERS={layers} against {a.against}: rel "
                  f"{np.linalg.norm(got - base) / np.linalg.norm(base):.2e}, worst row {int(rows.argmax())} {rows.max():.2e}",
                  flush=True)
        os.environ.pop("IKJAX_LAYERS")
    ref = np.asarray(ikjax.load(a.model, ctx=512, ubatch=256, dtype="f32").logits(tokens), np.float64)
    for mib in a.mibs.split(","):
        for stream in a.streams.split(","):
            for form in a.forms.split(","):
                os.environ.update(IKJAX_STREAM_MIB=mib, IKJAX_STREAM=stream, IKJAX_HOST_LAYERS=form)
                eng = ikjax.load(a.model, ctx=512, ubatch=256, dtype="f32", ot="exps=CPU", t=4)
                got = np.asarray(eng.logits(tokens), np.float64)
                err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
                rows = np.linalg.norm(got - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
                print(f"mib {mib:>5} {stream:>6} {form:>6}: rel {err:.2e}, worst row {int(rows.argmax())} "
                      f"{rows.max():.2e}, groups {[(g.first, g.count) for g in eng.weights['groups']]}", flush=True)
                del eng


if __name__ == "__main__":
    main()
