"""`Engine.close()` on an accelerator: device memory in use before the load, loaded (after one
prompt), and after close, from the device's own counters (`memory_stats()["bytes_in_use"]`); the
engine refusing use after close.

    python3 bench/close_probe.py MODEL.gguf [--ctx 4096]
"""
from __future__ import annotations

import argparse
import gc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--ctx", type=int, default=4096)
    a = ap.parse_args()
    import jax

    import ikjax
    dev = jax.devices()[0]

    def used() -> float:
        stats = dev.memory_stats() or {}
        return stats.get("bytes_in_use", 0) / 2**30

    before = used()
    eng = ikjax.load(a.model, ctx=a.ctx, mla=3, fa=True)
    eng.logits(list(range(1, 65)))
    loaded = used()
    eng.close()
    gc.collect()
    after = used()
    try:
        eng.logits([1, 2])
        refused = "no"
    except ikjax.IkjaxError as e:
        refused = str(e)
    print(f"{dev.device_kind}: device memory in use {before:.2f} GiB before, {loaded:.2f} GiB loaded, "
          f"{after:.2f} GiB after close; use after close: {refused}")


if __name__ == "__main__":
    main()
