"""`ikjax plot`: overlay several sweep-bench JSONL runs in one PNG (like ik's sweep-bench-plot).

It takes no run options (it loads no model); the drawing is `ikjax.tools.plot`.
"""
from __future__ import annotations

from typing import Annotated, Optional

import typer

from ikjax.cli.common import app, handle
from ikjax.cli.parser import ExactCommand
from ikjax.errors import OptionError


@app.command("plot", cls=ExactCommand)
@handle
def plot_cmd(
    files: Annotated[list[str], typer.Argument(help="sweep-bench JSONL files to overlay")],
    output: Annotated[str, typer.Option("-o", "--output", help="PNG to write")] = "sweep-bench.png",
    labels: Annotated[Optional[str], typer.Option("--labels", help="comma-separated legend labels")] = None,
    title: Annotated[Optional[str], typer.Option("--title")] = None,
) -> None:
    """Plot S_PP and S_TG against N_KV for several sweep-bench --output-format jsonl runs (like sweep-bench-plot)."""
    from ikjax.tools.plot import plot_files
    if not output.strip():  # (". is a directory")
        raise OptionError("output: empty path; give -o FILE.png")
    names = labels.split(",") if labels is not None else None
    if names is not None and len(names) != len(files):  # (a PNG with too few or too many names, before)
        raise OptionError(f"--labels: {len(names)} label(s) for {len(files)} file(s); give one a file")
    out = plot_files(files, output, names, title)
    typer.echo(str(out))
