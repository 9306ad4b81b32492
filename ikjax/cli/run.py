"""`ikjax run --config FILE.json`: any subcommand with all its options from one JSON object.

`CONFIG_COMMANDS` names the commands a config may run; each is the same function the command line
calls, so a config goes through the same option checks. Reading and type-checking the JSON is
`run_config.parse_config`.
"""
from __future__ import annotations

from typing import Annotated, Callable

import typer

from ikjax.cli.bench import bench
from ikjax.cli.common import app, handle
from ikjax.cli.generate import generate
from ikjax.cli.info import info
from ikjax.cli.make_model import make_model
from ikjax.cli.parser import ExactCommand, repeated_options
from ikjax.cli.perplexity import perplexity_cmd
from ikjax.cli.run_config import parse_config
from ikjax.cli.serve import serve
from ikjax.cli.sweep_bench import sweep_bench
from ikjax.errors import OptionError

CONFIG_COMMANDS: dict[str, Callable] = {"sweep-bench": sweep_bench, "bench": bench, "generate": generate,
                                        "info": info, "make-model": make_model, "serve": serve,
                                        "perplexity": perplexity_cmd}


@app.command("run", cls=ExactCommand)
@handle
def run(
    config: Annotated[str, typer.Option("--config", "-C", help="JSON file: {\"command\": \"sweep-bench\", "
                                        "\"model\": ..., \"ctx\": ..., ...}")],
) -> None:
    """Run a subcommand with every option from a JSON config (keys = option names, e.g. ctx, ubatch, mla, fa, ot)."""
    if not config.strip():  # ("": cannot read config: Is a directory)
        raise OptionError("--config: empty path; give a JSON file")
    if "config" in repeated_options():  # (the last file ran, the others unread and unsaid)
        raise OptionError("--config: given more than once; one config runs one command")
    name, func, kwargs = parse_config(config, CONFIG_COMMANDS)
    func(**kwargs)
