"""Hot experts: the most used routed experts of host-resident MoE layers kept in spare VRAM
(`--gpu-experts auto|N`), chosen from expert statistics (`--expert-stats FILE.json` of an earlier
run, ikjax.model.moe.ExpertCounts).

Why: with `-ot exps=CPU` a decode step reads every routed expert it picks from host RAM (an R1
token: 8 experts x 58 layers x ~25 MB at Q4_0), so generation runs at the host's memory bandwidth,
ik's and ours alike. A trained router is uneven (some experts take several times the mean), and
whatever fraction of the routed tokens the GPU's copies cover is host traffic saved. ik's and
ktransformers' users do this by hand with `-ot` rules per expert; here the statistics pick them.

The choice is global across layers: every (layer, expert) pair ranked by its share of that layer's
routed tokens, the top ones taken while their bytes fit the budget (`auto`: the device memory the
memory plan leaves), or the top N of every layer (`N`).
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np

from ikjax.errors import OptionError
from ikjax.gguf_io.tensors import is_routed_expert, layer_of


def read_counts(path: str, n_expert: int) -> dict[int, np.ndarray]:
    """Per-layer token counts from an `--expert-stats` JSON file ({"tokens": N, "layers": {"3":
    [...], ...}}), each list `n_expert` long (the model's)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise OptionError(f"gpu-experts: no expert statistics at {path} (write them with --expert-stats {path} "
                          f"on an earlier run: generate, bench, sweep-bench or serve)") from None
    except (OSError, ValueError) as e:
        raise OptionError(f"gpu-experts: cannot read the expert statistics {path}: {e}") from None
    layers = data.get("layers") if isinstance(data, dict) else None
    if not isinstance(layers, dict) or not layers:
        raise OptionError(f"gpu-experts: {path} has no per-layer counts (expected {{\"layers\": {{\"3\": [...]}}}})")
    out = {}
    for k, v in layers.items():
        # ASCII digits only (str.isdigit takes "²" and "٣", which int() then refuses or reads as 3);
        # counts are non-negative ints of int64 range, never JSON's true / false
        if not re.fullmatch(r"[0-9]{1,9}", str(k)) or not isinstance(v, list) or len(v) != n_expert or not all(
                type(c) is int and 0 <= c < 2**62 for c in v):
            raise OptionError(f"gpu-experts: {path}: layer {k!r} must map to {n_expert} token counts "
                              f"(this model's experts), got {str(v)[:60]}")
        out[int(k)] = np.asarray(v, np.int64)
    return out


def choose(counts: dict[int, np.ndarray], layers: list[int], expert_bytes: dict[int, int], *,
           per_layer: int | None = None, budget: int | None = None) -> dict[int, tuple[int, ...]]:
    """Expert ids to keep on the GPU, by layer (sorted; layers without statistics get none).
    `per_layer`: the top N of each layer; else `budget` bytes over all layers, the pairs with the
    largest share of their layer's tokens first (`expert_bytes[layer]`: one expert's gate + up +
    down bytes)."""
    pairs = []
    for i in layers:
        c = counts.get(i)
        if c is None or c.sum() == 0:
            continue
        share = c / c.sum()
        order = np.argsort(-share, kind="stable")
        if per_layer is not None:
            order = order[:per_layer]
        pairs += [(float(share[e]), i, int(e)) for e in order if c[e] > 0]
    if per_layer is None:
        pairs.sort(key=lambda p: -p[0])
        left, kept = int(budget or 0), []
        for p in pairs:
            if expert_bytes[p[1]] <= left:
                kept.append(p)
                left -= expert_bytes[p[1]]
        pairs = kept
    out: dict[int, list[int]] = {}
    for _, i, e in pairs:
        out.setdefault(i, []).append(e)
    return {i: tuple(sorted(v)) for i, v in sorted(out.items())}


def coverage(counts: dict[int, np.ndarray], hot: dict[int, tuple[int, ...]]) -> float:
    """The fraction of the statistics' routed tokens (over the layers with hot experts' host
    layers counted) that the chosen experts take."""
    total = sum(int(c.sum()) for c in counts.values())
    got = sum(int(counts[i][list(e)].sum()) for i, e in hot.items() if i in counts)
    return got / total if total else 0.0


EXPERT_TENSORS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


def plan(placement, n_expert: int, tensors: dict, gpu_experts: str, counts_path: str,
         free_bytes: int | None):
    """The placement with `hot_experts` set for --gpu-experts (`free_bytes`: what the device has
    left after the memory plan, for `auto`), and a line saying what was kept. Refuses a run with
    no host-resident routed experts, a split over several devices (-sm layer / graph), or no
    statistics."""
    # -sm none on a machine with several GPUs runs on one of them (-mg): the copies go there
    # (a check on the devices present refused every run on a 2-GPU lease, RESULTS §25f)
    if placement.split_mode != "none":
        raise OptionError(f"gpu-experts: one GPU only for now (this run: -sm {placement.split_mode} over "
                          f"{len(placement.devices)} devices; give -sm none)")
    layers = sorted({layer_of(t.name) for t in placement.tensors if t.on_host and is_routed_expert(t.name)})
    if not layers:
        raise OptionError("gpu-experts: no routed experts are in host memory (give -ot exps=CPU, --cpu-moe or "
                          "--n-cpu-moe N; without them every expert is on the GPU already)")
    if not counts_path:
        raise OptionError("gpu-experts: needs expert statistics: --expert-stats FILE.json written by an earlier "
                          "run (generate, bench, sweep-bench or serve with --expert-stats FILE.json)")
    counts = read_counts(counts_path, n_expert)
    foreign = sorted(i for i in counts if f"blk.{i}.ffn_gate_exps.weight" not in tensors)
    if foreign:
        raise OptionError(f"gpu-experts: {counts_path} counts layer {foreign[0]}, which is not a MoE layer of this "
                          f"model (statistics of another model?)")
    ebytes = {i: sum(tensors[f"blk.{i}.{n}"].nbytes for n in EXPERT_TENSORS) // n_expert for i in layers}
    if gpu_experts == "auto":
        chosen = choose(counts, layers, ebytes, budget=max(0, free_bytes or 0))
    else:
        chosen = choose(counts, layers, ebytes, per_layer=int(gpu_experts))
    nbytes = sum(ebytes[i] * len(e) for i, e in chosen.items())
    n = sum(len(e) for e in chosen.values())
    where = ("; a CPU-only machine: the copies are a second set in the same RAM, computed apart (the "
             "split checked, nothing gained)") if placement.unified else ""
    line = (f"gpu experts: {n} of {n_expert * len(layers)} host-resident experts also on the GPU "
            f"({nbytes / 2**20:.0f} MiB; {100 * coverage({i: counts[i] for i in layers if i in counts}, chosen):.1f} % "
            f"of the routed tokens in {counts_path}){where}")
    return dataclasses.replace(placement, hot_experts=tuple(chosen.items())), line, nbytes
