"""S_PP and S_TG against N_KV from sweep-bench JSONL runs, overlaid (like ik's sweep-bench-plot.py)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from ikjax.errors import IkjaxError


def read_jsonl(path: str | Path) -> list[dict]:
    """sweep-bench rows of a JSONL file; other lines (logs, a markdown table) are skipped."""
    rows = []
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise IkjaxError(f"{path}: cannot read: {e.strerror}") from None
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if {"n_kv", "speed_pp", "speed_tg"} <= row.keys():
            rows.append(row)
    if not rows:
        raise IkjaxError(f"{path}: no sweep-bench JSONL rows (run sweep-bench --output-format jsonl)")
    return rows


def plot_runs(runs: Sequence[tuple[str, list[dict]]], out: str | Path, title: str | None = None) -> Path:
    """Write a PNG with two panels (S_PP, S_TG vs N_KV), one line per (label, rows) run."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise IkjaxError("plotting needs matplotlib: pip install 'ikjax[plot]'") from None
    fig, (ax_pp, ax_tg) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, rows in runs:
        rows = sorted(rows, key=lambda r: r["n_kv"])
        x = [r["n_kv"] for r in rows]
        ax_pp.plot(x, [r["speed_pp"] for r in rows], marker="o", label=label)
        ax_tg.plot(x, [r["speed_tg"] for r in rows], marker="o", label=label)
    for ax, what in ((ax_pp, "S_PP (prompt processing) t/s"), (ax_tg, "S_TG (token generation) t/s")):
        ax.set_xlabel("N_KV (tokens in the KV cache)")
        ax.set_ylabel(what)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or "sweep-bench")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_files(paths: Sequence[str | Path], out: str | Path, labels: Sequence[str] | None = None,
               title: str | None = None) -> Path:
    runs = []
    for i, p in enumerate(paths):
        label = labels[i] if labels and i < len(labels) else Path(p).stem
        runs.append((label, read_jsonl(p)))
    return plot_runs(runs, out, title)
