"""The compiled batch-1 decode step's kernels, by kind (issue 11: what a layer launches).

    PYTHONPATH=$PWD python bench/gpu_decode_hlo.py --model /tmp/v2l27-Q4_0.gguf --out $OUT

Writes decode_hlo.txt (XLA's optimized HLO of the step, -mla 3 -fa 1, N_KV bucket of ~1000) and
prints the launched ops of the entry computation grouped by kind: each fusion's kind and root op,
each custom call's target."""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys
from pathlib import Path


def _where(line: str) -> str:
    """The op's source: the last parts of its jax op_name and the source line (what to fuse)."""
    m = re.search(r'op_name="([^"]+)"', line)
    src = re.search(r'source_file="[^"]*?([\w]+\.py)" source_line=(\d+)', line)
    name = "/".join(m.group(1).split("/")[-2:]) if m else ""
    name = re.sub(r"\[.*?\]", "", name)
    return f"{name} @{src.group(1)}:{src.group(2)}" if src else name


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/v2l27-Q4_0.gguf")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import jax
    import jax.numpy as jnp
    import ikjax
    from ikjax.runtime.executables import _jitted_forward
    eng = ikjax.load(args.model, mla=3, fa=True, ctx=4096, ubatch=512, ctk="f16")
    i32 = jax.ShapeDtypeStruct((1,), jnp.int32)
    txt = _jitted_forward.lower(eng.weights, jax.eval_shape(lambda: eng.new_cache(1)),
                                jax.ShapeDtypeStruct((1, 1), jnp.int32), i32, i32, cfg=eng.config,
                                plan=eng._plan(eng.kv_bucket(1001, 1), False)).compile().as_text()
    Path(args.out, "decode_hlo.txt").write_text(txt)
    entry = txt[txt.index("ENTRY"):]
    kinds = collections.Counter()
    for line in entry.splitlines():
        m = re.search(r"= [^ ]+ (fusion|custom-call|copy|while|conditional|all-reduce|sort|dynamic-update-slice|"
                      r"gather|scatter|convert|bitcast|reshape|slice|concatenate|get-tuple-element|parameter|tuple)"
                      r"\(", line)
        if not m:
            continue
        op = m.group(1)
        if op in ("get-tuple-element", "parameter", "tuple", "bitcast"):
            continue
        if op == "fusion":
            kind = re.search(r"kind=(\w+)", line)
            calls = re.search(r"calls=([%\w.\-]+)", line)
            name = calls.group(1) if calls else "?"
            name = re.sub(r"[._]\d+$", "", name.lstrip("%"))
            kinds[f"fusion {kind.group(1) if kind else '?'} {_where(line) or name}"] += 1
        elif op == "custom-call":
            t = re.search(r'custom_call_target="([^"]+)"', line)
            kn = re.search(r'"name":"([^"]+)"', line) or re.search(r"name=([\w.]+)", line)
            kinds[f"custom-call {t.group(1) if t else '?'} {kn.group(1) if kn else ''}"] += 1
        else:
            kinds[op] += 1
    total = sum(kinds.values())
    lines = [f"{total} launched ops in the decode step ({eng.config.n_layer} layers)", ""]
    lines += [f"{n:5d}  {k}" for k, n in kinds.most_common(60)]
    Path(args.out, "decode_kinds.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
