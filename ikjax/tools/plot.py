"""S_PP and S_TG against N_KV from sweep-bench JSONL runs, overlaid (like ik's sweep-bench-plot.py)."""
from __future__ import annotations

import json
import math
import stat
from pathlib import Path
from typing import Sequence

from ikjax.atomic_file import atomic_write, check_target
from ikjax.errors import IkjaxError, OptionError


REQUIRED = ("n_kv", "speed_pp", "speed_tg")


def _bad(path, lineno: int, problem: str) -> OptionError:
    return OptionError(f"{path}:{lineno}: {problem}")


def _check_row(row, path, lineno: int) -> dict:
    if not isinstance(row, dict):
        raise _bad(path, lineno, "not a JSON object (expected one sweep-bench row per line)")
    missing = [k for k in REQUIRED if k not in row]
    if missing:
        raise _bad(path, lineno, f"missing {', '.join(missing)} (not a sweep-bench --output-format jsonl row)")
    n_kv = row["n_kv"]
    if isinstance(n_kv, bool) or not isinstance(n_kv, int) or n_kv < 0:
        raise _bad(path, lineno, f"n_kv must be an integer >= 0, got {n_kv!r}")
    for key in ("speed_pp", "speed_tg"):
        v = row[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise _bad(path, lineno, f"{key} must be a finite number >= 0, got {v!r}")
    return row


def read_jsonl(path: str | Path) -> list[dict]:
    """The rows of a sweep-bench JSONL file (one JSON object per line, blank lines allowed, as ik's
    sweep-bench-plot.py reads them). A line that is not such a row is refused naming file:line —
    a plot drawn from a half-understood file would be worse than none."""
    p = Path(path)
    try:
        if not stat.S_ISREG(p.stat().st_mode):
            raise OptionError(f"{path}: not a regular file")
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise OptionError(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise OptionError(f"{path}: not a text (UTF-8) file") from None
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            raise _bad(path, lineno, "not a JSON object (expected one sweep-bench row per line)") from None
        rows.append(_check_row(row, path, lineno))
    if not rows:
        raise OptionError(f"{path}: no sweep-bench JSONL rows (run sweep-bench --output-format jsonl)")
    return rows


def plot_runs(runs: Sequence[tuple[str, list[dict]]], out: str | Path, title: str | None = None) -> Path:
    """Write a PNG with two panels (S_PP, S_TG vs N_KV), one line per (label, rows) run.

    The image format follows the output's suffix (.png, .svg, .pdf, ...; none: PNG); the file is
    written whole or not at all."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise IkjaxError("plotting needs matplotlib: pip install 'ikjax[plot]'") from None
    out = Path(out)
    fmt = out.suffix[1:].lower() or "png"
    fig, (ax_pp, ax_tg) = plt.subplots(1, 2, figsize=(12, 4.5))
    try:
        if fmt not in fig.canvas.get_supported_filetypes():
            raise OptionError(f"output: {out}: unknown image format {fmt!r} "
                              f"(one of {', '.join(sorted(fig.canvas.get_supported_filetypes()))})")
        check_target(out, parent_exists=True)  # a mistyped directory is refused, not made
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
        with atomic_write(out) as tmp:
            with open(tmp, "wb") as f:
                fig.savefig(f, format=fmt, dpi=110)
    finally:
        plt.close(fig)
    return out


def plot_files(paths: Sequence[str | Path], out: str | Path, labels: Sequence[str] | None = None,
               title: str | None = None) -> Path:
    runs = []
    for i, p in enumerate(paths):
        label = labels[i] if labels and i < len(labels) else Path(p).stem
        runs.append((label, read_jsonl(p)))
    return plot_runs(runs, out, title)
