"""Run by tests/test_multi_device.py in a subprocess: fake CPU devices exist only if
`--xla_force_host_platform_device_count` is in XLA_FLAGS before JAX starts, which the pytest
process (one device) cannot do. Prints one JSON object per check on stdout.

usage: python multi_device_worker.py SPEC.json  — SPEC: {"cases": [{"model", "mla", "sm", "ts"}...],
"generate": [case...], "refusals": {"model": path}}
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np


def rel(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def load_with(path, kernels: str | None, **opts):
    """Load with IKJAX_KERNELS set for this engine only (the backend is resolved at load)."""
    import ikjax
    old = os.environ.pop("IKJAX_KERNELS", None)
    if kernels:
        os.environ["IKJAX_KERNELS"] = kernels
    try:
        return ikjax.load(path, **{"ctx": 64, "ubatch": 16, **opts})
    finally:
        os.environ.pop("IKJAX_KERNELS", None)
        if old is not None:
            os.environ["IKJAX_KERNELS"] = old


def decode_checks(eng, ids) -> dict:
    """What the decode loop produces on this engine: greedy (n = 19 over two dispatches of the
    16-step loop; then n = 4 < chunk), sampled with one seed, `generate_batch` of two prompts, and
    a batch of two sequences at different positions with banned ids (one-device greedy picks, in both halves of the
    vocabulary: on both devices of a -sm graph mesh)."""
    from ikjax.runtime.generation import _put_row
    out = {"greedy": list(eng.generate(ids, 20)), "short": list(eng.generate(ids, 5)),
           "sampled": list(eng.generate(ids, 12, temperature=0.8, top_k=20, seed=3))}
    # other sampling values (top_k in the same bucket): step arguments, no executable compiled for them
    n_exes = len(eng._executables.items())
    out["resampled"] = list(eng.generate(ids, 12, temperature=0.6, top_k=30, top_p=0.9, seed=4))
    out["resampled_compiles"] = len(eng._executables.items()) - n_exes
    prompts = [ids, ids[:9]]
    cache = eng.new_cache(2)
    first = []
    for b, p in enumerate(prompts):
        logits, one = eng.prefill(eng.new_cache(1), p, 0)
        first.append(int(np.argmax(logits)))
        cache = _put_row(cache, one, b)
    ban = tuple(sorted(set(out["greedy"][1:7])))
    toks, _ = eng.decode(cache, first, [len(p) for p in prompts], 6, chunk=16, sampling={"ban": ban})
    out["batch_banned"] = np.asarray(toks)[:, :6].tolist()
    out["ban"] = list(ban)
    # generate_batch runs the loop over its rows (a 2-row batch, sequences at different positions)
    out["generate_batch"] = [list(r) for r in eng.generate_batch(prompts, 6)]
    return out


def decode_collectives(eng) -> list:
    """The collectives of each compiled decode loop under -sm graph (ikjax.runtime.mesh.collectives)."""
    from ikjax.runtime.mesh import collectives
    rows = []
    for (B, _, _, decode), exe in eng._executables.items():
        if decode is not None and hasattr(exe, "as_text"):
            c = collectives(exe.as_text())
            rows.append(dict(batch=B, sampling=dict(decode[1]), per_step=c.per_step, outside=c.outside,
                             kinds=c.kinds, bytes=c.per_step_bytes))
    return rows


def main(spec_path: str) -> None:
    import jax
    spec = json.loads(open(spec_path).read())
    emit(check="devices", n=len(jax.devices()))
    ids = (np.arange(1, 14) * 37 % 500 + 3).tolist()
    refs: dict = {}

    def reference(model, mla, xla: bool):
        key = (model, mla, xla)
        if key not in refs:
            refs[key] = load_with(model, "xla" if xla else None, mla=mla).logits(ids)
        return refs[key]

    for c in spec.get("cases", []):
        graph = c["sm"] == "graph"
        ref = reference(c["model"], c["mla"], False)
        eng = load_with(c["model"], None, mla=c["mla"], sm=c["sm"], ts=c["ts"])
        got = eng.logits(ids)
        per = eng.memory_plan().per_device
        # how far this model's f32 sums move when only their order changes (one device: the C++
        # kernels vs the XLA path): the scale of -sm graph's partial sums joined by psum
        gap = rel(reference(c["model"], c["mla"], True), ref) if graph else 0.0
        emit(check="logits", case=c, rel=rel(got, ref), order_gap=gap, per_device=per,
             weights=eng.memory_plan().weights_bytes, host=eng.memory_plan().host_weights_bytes,
             stages=eng.executor.describe(),
             lines=eng.memory_plan().lines())
        del eng
        jax.clear_caches()

    for c in spec.get("generate", []):
        one = list(load_with(c["model"], None, mla=c["mla"]).generate(ids, 8))
        many = list(load_with(c["model"], None, mla=c["mla"], sm=c["sm"], ts=c["ts"]).generate(ids, 8))
        emit(check="generate", case=c, one=one, many=many)

    decode_refs: dict = {}
    for c in spec.get("decode", []):
        key = (c["model"], c["mla"])
        if key not in decode_refs:
            decode_refs[key] = decode_checks(load_with(c["model"], None, mla=c["mla"]), ids)
        many = load_with(c["model"], None, mla=c["mla"], sm=c["sm"], ts=c["ts"])
        emit(check="decode", case=c, loops=many.decode_loop(), n_layer=many.config.n_layer, one=decode_refs[key],
             many=decode_checks(many, ids), collectives=decode_collectives(many), stages=many.executor.describe(),
             engine_lines=[f"{what}: {c.line()}" for what, c in many.collectives()])
        del many
        jax.clear_caches()

    for c in spec.get("micro", []):  # -sm layer prompt steps as micro-batches (IKJAX_PIPELINE_MB)
        # the oracle: one device fed the same chunks (ubatch = 16 / mb), which -sm layer's stages
        # must match bit for bit, as they match one device's whole steps
        mb = c["mb"]
        one = load_with(c["model"], None, mla=c["mla"], ubatch=16 // mb)
        toks = np.array([ids + [5, 6, 7], ids[3:] + ids[:3] + [5, 6, 7]], np.int32)
        cache, parts = one.new_cache(2), []
        for j in range(mb):  # rows 0 and 1 end at tokens 3 and 15: in the first and the last chunk
            t = 16 // mb
            out, cache = one.step(cache, toks[:, j * t:(j + 1) * t], np.array([j * t] * 2), np.clip([3 - j * t, 15 - j * t], 0, t - 1))
            parts.append(np.asarray(out))
        ref = dict(logits=one.logits(ids), last=np.stack([parts[0][0], parts[-1][1]]))
        os.environ["IKJAX_PIPELINE_MB"] = str(mb)
        try:
            many = load_with(c["model"], None, mla=c["mla"], sm="layer", ts=c["ts"])
            last, _ = many.step(many.new_cache(2), toks, np.array([0, 0]), np.array([3, 15]))
            got = dict(logits=many.logits(ids), last=np.asarray(last))
            exe = next(e for k, e in many._executables.items() if k[1] == 16)
        finally:
            os.environ.pop("IKJAX_PIPELINE_MB", None)
        emit(check="micro", case=c, micro=exe.micro, rel_logits=rel(got["logits"], ref["logits"]),
             rel_last=rel(got["last"], ref["last"]))
        del many
        jax.clear_caches()

    r = spec.get("refusals")
    if r:
        from ikjax.runtime import memory_plan
        from ikjax.errors import IkjaxError

        def outcome(fn):
            try:
                fn()
                return {"error": None}
            except IkjaxError as e:
                return {"error": type(e).__name__, "message": str(e)}

        emit(check="refuse", what="graph uneven ts",
             **outcome(lambda: load_with(r["model"], None, sm="graph", ts="3,1")))
        emit(check="refuse", what="ts longer than devices",
             **outcome(lambda: load_with(r["model"], None, sm="layer", ts="1,1,1,1,1")))
        emit(check="refuse", what="ot device with sm layer",
             **outcome(lambda: load_with(r["model"], None, sm="layer", ot="exps=CUDA1")))
        emit(check="refuse", what="mg past the devices", **outcome(lambda: load_with(r["model"], None, mg=4)))
        # each device's memory: CPU devices report none; give CPU1 a small one
        real = memory_plan.device_limit
        memory_plan.device_limit = lambda d: (1 << 20) if d.id == 1 else real(d)
        try:
            emit(check="refuse", what="device over its memory",
                 **outcome(lambda: load_with(r["model"], None, sm="layer", ts="1,3")))
            emit(check="refuse", what="device without layers fits",
                 **outcome(lambda: load_with(r["model"], None, sm="layer", ts="1,0,3")))
        finally:
            memory_plan.device_limit = real
        eng = load_with(r["model"], None, sm="layer", ts="1,3", ot="exps=CPU", mla=3)
        emit(check="host experts with sm layer", rel=rel(eng.logits(ids), reference(r["model"], 3, False)),
             host=eng.memory_plan().host_weights_bytes)
        eng = load_with(r["model"], None, sm="graph", ot="exps=CPU", mla=3)
        emit(check="host experts with sm graph", rel=rel(eng.logits(ids), reference(r["model"], 3, True)),
             host=eng.memory_plan().host_weights_bytes)
        eng = load_with(r["model"], None, mg=2, mla=3)
        emit(check="mg", rel=rel(eng.logits(ids), reference(r["model"], 3, False)),
             device=str(eng.weights["output"].data.devices()))


if __name__ == "__main__":
    main(sys.argv[1])
