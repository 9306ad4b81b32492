"""RESULTS-ready markdown from what bench/multi_gpu.sh left under $OUT (issue 13).

    python3 bench/multi_gpu_table.py OUT_DIR            # prints the tables (multi_gpu.sh writes OUT/table.md)
    python3 bench/multi_gpu_table.py --hlo DUMP_DIR     # collectives in XLA's optimized step modules

Reads OUT/runs.log (every job's whole output between `=== BEGIN kind name` and
`=== END kind name {json}` lines), OUT/mem.csv (nvidia-smi samples: t,gpu,used_mib,jobs) and
OUT/hlo.txt. One row per measured sweep-bench: S_PP and S_TG at N_KV 0 / mid / last, TG and PP
against the 1-GPU run of the same model (at N_KV 0 and at the last N_KV both runs have), the
per-GPU memory peak (nvidia-smi, only samples where this run was the only job on that GPU; `*`
where other jobs shared it), the memory plan's weights per GPU, and compile time (cold, from the
warm-up pass, and in the measured run, where it came from JAX's persistent cache).
"""
from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

ROW = re.compile(r"^\|\s*(\d+) \|\s*(\d+) \|\s*(\d+) \|\s*([\d.]+) \|\s*([\d.]+) \|\s*([\d.]+) \|\s*([\d.]+) \|\s*$")
# the CLI's compile line, before and after the persistent compilation cache came in
COMPILED = re.compile(r"compiled (\d+) step(?: shape)?s(?:, (\d+) from the cache)? in ([\d.]+)s")
LOADED = re.compile(r"^loaded (\S+) in ([\d.]+)s")
PLAN_DEV = re.compile(r"^\s*on (\S+)\s+([\d.]+) MiB weights, ([\d.]+) MiB KV cache")
PLAN_DEV1 = re.compile(r"^\s*on device (\S+)\s+([\d.]+) MiB")
PLAN_HOST = re.compile(r"^\s*on host\s+([\d.]+) MiB")
PLAN_W = re.compile(r"^\s*weights\s+([\d.]+) MiB")
PLAN_KV = re.compile(r"^\s*KV cache\s+([\d.]+) MiB")
# sweep-bench's -sm graph line (ikjax.runtime.mesh.Collectives.line) for the decode loop
LOOP_COLL = re.compile(r"^-sm graph decode loop, batch 1\b.*?: (\d+) collectives a step \(([^)]*)\)")
BEGIN = re.compile(r"^=== BEGIN (\S+) (\S+)\s*$")
END = re.compile(r"^=== END (\S+) (\S+) (\{.*\})\s*$")
GIB = 1024.0


# -- runs.log ----------------------------------------------------------------------------------------

def read_blocks(path: Path) -> list[dict]:
    """Every finished job: {kind, name, meta, lines}. A block cut off by a kill (no END) is kept
    with meta {"rc": None, "cut": True}."""
    blocks, cur = [], None
    if not path.exists():
        return blocks
    for line in path.read_text(errors="replace").splitlines():
        m = BEGIN.match(line)
        if m:
            if cur:
                cur["meta"] = {"rc": None, "cut": True}
                blocks.append(cur)
            cur = {"kind": m.group(1), "name": m.group(2), "lines": []}
            continue
        m = END.match(line)
        if m and cur and m.group(2) == cur["name"]:
            try:
                cur["meta"] = json.loads(m.group(3))
            except json.JSONDecodeError:
                cur["meta"] = {}
            blocks.append(cur)
            cur = None
            continue
        if cur is not None:
            cur["lines"].append(line)
    if cur:
        cur["meta"] = {"rc": None, "cut": True}
        blocks.append(cur)
    return blocks


def parse_output(lines: list[str]) -> dict:
    """What one sweep-bench process printed: rows, compile, load, plan, error."""
    out: dict = {"rows": [], "compile": None, "load_s": None, "plan_dev": {}, "plan_host_mib": 0.0,
                 "weights_mib": None, "kv_mib": None, "error": None, "loop_collectives": None}
    for line in lines:
        m = ROW.match(line)
        if m:
            pp, tg, n_kv = int(m.group(1)), int(m.group(2)), int(m.group(3))
            out["rows"].append(dict(pp=pp, tg=tg, n_kv=n_kv, t_pp=float(m.group(4)), s_pp=float(m.group(5)),
                                    t_tg=float(m.group(6)), s_tg=float(m.group(7))))
            continue
        m = COMPILED.search(line)
        if m:
            n, hits, s = int(m.group(1)), int(m.group(2)) if m.group(2) else None, float(m.group(3))
            # "compiled N steps, H from the cache": N compiled, H loaded; the older line: N in all
            out["compile"] = dict(compiled=n, hits=hits, seconds=s)
            continue
        m = LOOP_COLL.match(line)
        if m:
            out["loop_collectives"] = f"{m.group(1)} collectives a decode step ({m.group(2)})"
            continue
        m = LOADED.match(line)
        if m:
            out["load_s"] = float(m.group(2))
            continue
        m = PLAN_DEV.match(line)
        if m:
            out["plan_dev"][m.group(1)] = (float(m.group(2)), float(m.group(3)))
            continue
        m = PLAN_DEV1.match(line)
        if m:
            out["plan_dev"][m.group(1)] = (float(m.group(2)), None)
            continue
        m = PLAN_HOST.match(line)
        if m:
            out["plan_host_mib"] = float(m.group(1))
            continue
        m = PLAN_W.match(line)
        if m and out["weights_mib"] is None:
            out["weights_mib"] = float(m.group(1))
            continue
        m = PLAN_KV.match(line)
        if m and out["kv_mib"] is None:
            out["kv_mib"] = float(m.group(1))
            continue
        if line.startswith("error: ") or line.startswith("Traceback") or "Error:" in line[:80]:
            out["error"] = out["error"] or line.strip()
    return out


# -- mem.csv -----------------------------------------------------------------------------------------

def read_mem(path: Path) -> list[tuple[float, int, float, frozenset]]:
    rows = []
    if not path.exists():
        return rows
    for line in path.read_text().splitlines()[1:]:
        parts = line.split(",", 3)
        if len(parts) < 4:
            continue
        try:
            rows.append((float(parts[0]), int(parts[1]), float(parts[2]),
                         frozenset(j for j in parts[3].split(";") if j)))
        except ValueError:
            continue
    return rows


def mem_peaks(samples, job: str, gpus: list[int]) -> dict[int, tuple[float, bool]]:
    """gpu -> (peak MiB, shared?) for one job: the samples where it was alone on that GPU, else
    (shared = True) every sample where it ran there."""
    out = {}
    for g in gpus:
        alone = [mib for _, gi, mib, jobs in samples if gi == g and jobs == {job}]
        if alone:
            out[g] = (max(alone), False)
            continue
        shared = [mib for _, gi, mib, jobs in samples if gi == g and job in jobs]
        if shared:
            out[g] = (max(shared), True)
    return out


# -- HLO dumps ---------------------------------------------------------------------------------------

COLL = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (.+?) (all-reduce|all-gather|reduce-scatter|all-to-all|"
                  r"collective-permute|collective-broadcast)(-start)?\(")
ARR = re.compile(r"\b(pred|s4|u4|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64|f8e4m3fn|f8e5m2)\[([\d,]*)\]")
NBYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
TOKENS = re.compile(r"s32\[(\d+),(\d+)\]")


def _arrays(shape: str) -> list[float]:
    out = []
    for dt, dims in ARR.findall(shape):
        n = 1
        for d in dims.split(","):
            if d:
                n *= int(d)
        out.append(n * NBYTES[dt])
    return out


def hlo_collectives(text: str) -> dict:
    """Collective ops of one optimized HLO module: kind -> [count, bytes]. Bytes: the op's result
    (a combined all-reduce's tuple summed; an async *-start's (operand, result) tuple: its largest
    part), i.e. the payload one device holds after the op, not the wire traffic."""
    out: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for line in text.splitlines():
        m = COLL.match(line)
        if not m:
            continue
        shape, kind, start = m.group(1), m.group(2), m.group(3)
        sizes = _arrays(shape)
        nbytes = (max(sizes) if sizes else 0.0) if (start and shape.startswith("(")) else sum(sizes)
        out[kind][0] += 1
        out[kind][1] += nbytes
    return dict(out)


def step_tokens(text: str) -> str:
    """The step's token batch [B,T] from the ENTRY signature (the only 2-D s32 parameter)."""
    for line in text.splitlines():
        if line.startswith("ENTRY"):
            m = TOKENS.search(line)
            return f"{m.group(1)}x{m.group(2)} tokens" if m else "?"
    return "?"


def hlo_summary(dump: Path) -> list[str]:
    """One line per optimized step module in an XLA dump folder (`--xla_dump_to`, text): the
    collectives each step (each decode-loop iteration) runs, scan bodies counted once per layer
    (ikjax.runtime.mesh.collectives), and the module's collectives as written (`hlo_collectives`)."""
    from ikjax.runtime.mesh import collectives
    lines = []
    for f in sorted(dump.glob("*after_optimizations.txt")):
        text = f.read_text(errors="replace")
        coll = hlo_collectives(text)
        what = ", ".join(f"{k} {c} ({b / 2**20:.2f} MiB)" for k, (c, b) in sorted(coll.items())) or "no collectives"
        mod = f.name.split(".")[1] if "." in f.name else f.name
        tokens = "decode loop" if "decode" in mod else step_tokens(text)
        lines.append(f"{mod} [{tokens}]: {collectives(text).line()}; as written: {what}")
    return lines


# -- the tables --------------------------------------------------------------------------------------

def _f(x, nd=1) -> str:
    if x is None:
        return "-"
    if x >= 1000:
        return f"{x:.0f}"
    return f"{x:.{nd}f}"


def _pick(rows: list[dict]) -> list[dict]:
    """Rows at N_KV 0, the middle of the sweep and its last row."""
    if not rows:
        return []
    if len(rows) <= 3:
        return rows
    last = rows[-1]["n_kv"]
    mid = min(rows[1:-1], key=lambda r: abs(r["n_kv"] - last / 2))
    return [rows[0], mid, rows[-1]]


def _at(rows: list[dict], n_kv: int) -> dict | None:
    return next((r for r in rows if r["n_kv"] == n_kv), None)


def _ratio(a: dict | None, b: dict | None, key: str) -> str:
    if not a or not b or not b[key]:
        return "-"
    return f"{a[key] / b[key]:.2f}x"


def build(out_dir: Path) -> str:
    blocks = read_blocks(out_dir / "runs.log")
    samples = read_mem(out_dir / "mem.csv")
    warm = {b["name"]: b for b in blocks if b["kind"] == "warm"}
    measures = [b for b in blocks if b["kind"] == "measure"]
    md: list[str] = []
    head = out_dir / "multi_gpu.log"
    if head.exists():
        for line in head.read_text(errors="replace").splitlines():
            m = re.match(r"^\[\s*[\d.]+s\] ((?:machine|commit|parts): .*)$", line)
            if m:
                md.append("- " + m.group(1))
        md.append("")
    by_model: dict[str, list] = defaultdict(list)
    for b in sorted(measures, key=lambda b: b["meta"].get("order", 0)):
        by_model[b["meta"].get("model", "?")].append(b)
    refused = [b for b in blocks if b["kind"] == "warm" and b["meta"].get("refused")]
    skipped = [b for b in blocks if b["kind"] == "skip"]
    for model, runs in by_model.items():
        parsed = {b["name"]: parse_output(b["lines"]) for b in runs}
        with_rows = [b for b in runs if parsed[b["name"]]["rows"]]
        base_b = min(with_rows, key=lambda b: (b["meta"].get("n_gpus", 99), b["meta"].get("order", 0)), default=None)
        base_name = base_b["name"] if base_b else None
        base = parsed[base_name]["rows"] if base_name else []
        base_ng = base_b["meta"].get("n_gpus") if base_b else None
        vs = "1 GPU" if base_ng == 1 else f"{base_name} (no 1-GPU run)"
        md.append(f"### {model}: {runs[0]['meta'].get('model_desc', '')}")
        md.append("")
        md.append(f"| run | S_PP t/s at N_KV | S_TG t/s at N_KV | TG vs {vs} (N_KV 0 / last common) | "
                  f"PP vs {vs} (N_KV 0 / last common) | GPU memory peak, GiB (nvidia-smi) | plan: weights + KV per GPU, GiB | "
                  "compile s: cold / in the run | notes |")
        md.append("|---|---|---|---|---|---|---|---|---|")
        for b in runs:
            meta, p = b["meta"], parsed[b["name"]]
            rows = p["rows"]
            sel = _pick(rows)
            pp = " / ".join(f"{_f(r['s_pp'], 0)} ({r['n_kv']})" for r in sel) or "-"
            tg = " / ".join(f"{_f(r['s_tg'])} ({r['n_kv']})" for r in sel) or "-"
            if base and rows and b["name"] != base_name:
                common = sorted({r["n_kv"] for r in rows} & {r["n_kv"] for r in base})
                lastc = common[-1] if common else None
                tgs = f"{_ratio(_at(rows, 0), _at(base, 0), 's_tg')} / " + \
                    (f"{_ratio(_at(rows, lastc), _at(base, lastc), 's_tg')} ({lastc})" if lastc is not None else "-")
                pps = f"{_ratio(_at(rows, 0), _at(base, 0), 's_pp')} / " + \
                    (f"{_ratio(_at(rows, lastc), _at(base, lastc), 's_pp')} ({lastc})" if lastc is not None else "-")
            else:
                tgs = pps = "base" if b["name"] == base_name else "-"
            gpus = [int(g) for g in str(meta.get("gpus", "")).split(",") if g != ""]
            peaks = mem_peaks(samples, f"measure:{b['name']}", gpus)
            mem = " / ".join(f"{peaks[g][0] / GIB:.1f}{'*' if peaks[g][1] else ''}" for g in gpus if g in peaks) or "-"
            plan = " / ".join(f"{w / GIB:.2f}" + (f"+{kv / GIB:.2f}" if kv is not None else "")
                              for w, kv in p["plan_dev"].values())
            if not plan and p["weights_mib"] is not None:
                plan = f"{p['weights_mib'] / GIB:.2f}" + (f"+{p['kv_mib'] / GIB:.2f}" if p["kv_mib"] is not None else "")
            if p["plan_host_mib"]:
                plan += f" (host {p['plan_host_mib'] / GIB:.2f})"
            wc = parse_output(warm[b["name"]]["lines"])["compile"] if b["name"] in warm else None
            rc = p["compile"]
            comp = (f"{wc['seconds']:.0f}" if wc else "-") + " / " + \
                (f"{rc['seconds']:.1f}" + (f" ({rc['hits']} of {rc['compiled'] + rc['hits']} steps from the cache)"
                                           if rc["hits"] is not None else "")
                 if rc else "-")
            notes = []
            if meta.get("timed_out"):
                notes.append(f"cut at {meta.get('timeout_s', '?')} s after {len(rows)} rows")
            if p["error"]:
                notes.append(p["error"][:160])
            if meta.get("concurrent"):
                notes.append("beside: " + ", ".join(meta["concurrent"]))
            if meta.get("note"):
                notes.append(meta["note"])
            if p["loop_collectives"]:
                notes.append(p["loop_collectives"])
            ng = meta.get("n_gpus", "?")
            label = (f"`{meta['flags']}`, " if meta.get("flags") else "") + f"{ng} GPU" + ("s" if ng != 1 else "")
            md.append(f"| {label} | {pp} | {tg} | {tgs} | {pps} | {mem or '-'} | {plan or '-'} | {comp} | "
                      f"{'; '.join(notes)} |")
        md.append("")
        if runs:
            md.append(f"Command: `{runs[0]['meta'].get('cmd_base', '')}` + the flags of each row; "
                      "CUDA_VISIBLE_DEVICES picks the GPUs (`" + "`, `".join(
                          f"{b['name']}: {b['meta'].get('gpus')}" for b in runs) + "`).")
            md.append("")
    if refused or skipped:
        md.append("Not measured:")
        md.append("")
        for b in refused:
            md.append(f"- `{b['meta'].get('flags', b['name'])}` ({b['meta'].get('n_gpus', '?')} GPUs, {b['meta'].get('model')}): "
                      f"{b['meta'].get('refused')}")
        for b in skipped:
            md.append(f"- {b['name']}: {b['meta'].get('why', '')}")
        md.append("")
    hlo = out_dir / "hlo.txt"
    if hlo.exists() and hlo.read_text().strip():
        md.append("Collectives per compiled step (XLA's optimized HLO of the -sm graph warm-up; payload bytes "
                  "per device, not wire traffic):")
        md.append("")
        md.append("```")
        md.append(hlo.read_text().rstrip())
        md.append("```")
        md.append("")
    fx = out_dir / "fixtures.txt"
    if fx.exists():
        summ = [l for l in fx.read_text(errors="replace").splitlines() if l.startswith("summary:")]
        if summ:
            md.append("Fixtures on the mesh: " + summ[-1][len("summary:"):].strip())
            md.append("")
    return "\n".join(md)


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--hlo":
        for line in hlo_summary(Path(argv[1])):
            print(line)
        return 0
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    print(build(Path(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
