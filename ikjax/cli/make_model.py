"""`ikjax make-model`: write a synthetic deepseek2 GGUF with real shapes and random quantized weights.

For benchmarks and tests without downloading a model: the presets and the writer are
`ikjax.tools.synthetic`; this command checks the free space first and streams the file to disk
with a progress bar on stderr.
"""
from __future__ import annotations

import time
from typing import Annotated, Optional

import typer

from ikjax.atomic_file import check_target
from ikjax.cli.common import app, fmt_bytes, handle, note_long_make, stderr_console
from ikjax.cli.parser import ExactCommand
from ikjax.errors import OptionError


@app.command("make-model", cls=ExactCommand)
@handle
def make_model(
    preset: Annotated[str, typer.Option("--preset", help="tiny, v2-lite, v3, r1, kimi-k2, "
                                                       "glm-4.7-flash, moonlight or v2")] = "tiny",
    qtype: Annotated[str, typer.Option("--type", help="weight type: Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K "
                                       "Q5_K Q6_K IQ4_NL IQ4_XS IQ2_XXS IQ2_XS IQ2_S IQ3_XXS IQ3_S IQ1_S BF16 F16 F32")] = "Q8_0",
    output: Annotated[Optional[str], typer.Option("-o", "--output", help="GGUF file to write")] = None,
    layers: Annotated[Optional[int], typer.Option("--layers", help="override the layer count")] = None,
    experts: Annotated[Optional[int], typer.Option("--experts", help="override the routed expert count")] = None,
    q_lora_rank: Annotated[Optional[int], typer.Option("--q-lora-rank", help="low-rank q projection of this width "
                                                       "(attn_q_a/attn_q_b, as V3/R1); 0 = direct attn_q")] = None,
    seed: Annotated[int, typer.Option("-s", "--seed")] = 0,
) -> None:
    """Write a synthetic deepseek2 model with real shapes and random quantized weights (streamed to disk)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    from ikjax.tools import synthetic
    if output is None:
        raise OptionError("output: give -o FILE.gguf")
    if not 0 <= seed < 2**32:  # (NumPy's "expected non-negative integer" as an unexpected error before)
        raise OptionError(f"seed: need 0 to {2**32 - 1}, got {seed}")
    cfg = synthetic.preset_config(preset, layers, experts, q_lora_rank)
    plans = synthetic.plan_tensors(cfg, qtype.upper()) if qtype.upper() in synthetic.SUPPORTED_TYPES else None
    if plans is None:
        raise OptionError(f"type: {qtype!r} is not one of {', '.join(synthetic.SUPPORTED_TYPES)}")
    total = sum(t.nbytes for t in plans)
    # the writer's own check (writable first, then the space with its margin), before the bar starts
    check_target(output, total, "output", parent_exists=True)
    note_long_make(total)  # as a synthetic: spec's first use says
    t0 = time.perf_counter()
    console = stderr_console()
    # a bar on a terminal only: stopped on a log file, rich left a blank line (before "error: interrupted")
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=console, transient=True, disable=not console.is_terminal) as prog:
        task = prog.add_task(f"{preset} {qtype.upper()}", total=total)
        synthetic.make_model(output, preset, qtype, layers=layers, experts=experts, q_lora_rank=q_lora_rank, seed=seed,
                             progress=lambda name, done, tot: prog.update(task, completed=done))
    typer.echo(f"wrote {output}: {preset}, {cfg['num_hidden_layers']} layers, {qtype.upper()}, "
               f"{fmt_bytes(total)} in {time.perf_counter() - t0:.1f}s")

