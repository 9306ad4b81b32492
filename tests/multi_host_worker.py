"""One of several processes started by tests/test_multi_host.py: joins the others through
jax.distributed on localhost (2 fake CPU devices each, gloo collectives), loads each case with
-sm graph over every process's devices, and writes its logits and generated tokens to
OUT/p{process}.npz plus one JSON line per check on stdout.

usage: python multi_host_worker.py SPEC.json PROCESS_ID   — SPEC: {"coordinator", "num_processes",
"out", "cases": [{"model", "mla"}...], "generate": case}
"""
from __future__ import annotations

import json
import sys


def main(spec_path: str, pid: int) -> None:
    spec = json.loads(open(spec_path).read())
    from ikjax.runtime import distributed
    distributed.initialize(spec["coordinator"], spec["num_processes"], pid)
    import jax
    import numpy as np
    import ikjax
    from ikjax.placement import devices as sharding
    from ikjax.errors import OptionError
    print(json.dumps({"check": "devices", "global": len(jax.devices()), "local": len(jax.local_devices()),
                      "processes": jax.process_count()}), flush=True)
    ids = np.array(spec["ids"], np.int32)
    out = {}
    for k, c in enumerate(spec["cases"]):
        sharding.BYTES_READ[0] = 0
        eng = ikjax.load(c["model"], ctx=64, ubatch=16, mla=c["mla"], sm="graph")
        out[f"logits{k}"] = eng.logits(ids)
        print(json.dumps({"check": "case", "k": k, "read": sharding.BYTES_READ[0],
                          "file_bytes": eng.placement.total_bytes, "per_device": eng.memory_plan().per_device}),
              flush=True)
        if k == spec.get("generate_case"):
            out["generated"] = np.array(list(eng.generate(ids, 8)), np.int32)
        del eng
        jax.clear_caches()
    try:
        ikjax.load(spec["cases"][0]["model"], ctx=64, ubatch=16, sm="layer")
        refusal = ""
    except OptionError as e:
        refusal = str(e)
    print(json.dumps({"check": "refusal", "message": refusal}), flush=True)
    np.savez(f"{spec['out']}/p{pid}.npz", **out)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
