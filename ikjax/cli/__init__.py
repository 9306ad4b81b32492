"""The `ikjax` command line: ik_llama.cpp's flags and tables on a JAX engine.

    ikjax sweep-bench -m model.gguf -c 16384 -ub 2048 -mla 3 -fa
    ikjax bench -m model.gguf -p 512 -n 128 -mla 2,3 -ub 512,2048 -r 3
    ikjax generate -m model.gguf -p "Once upon a time" -n 64
    ikjax perplexity -m model.gguf -f wiki.test.raw -c 512
    ikjax serve -m model.gguf -c 16384 -np 4 --port 8080
    ikjax info model.gguf -c 32768 -ctk q8_0
    ikjax make-model --preset v2-lite --type Q4_0 -o v2lite.gguf
    ikjax run --config configs/tiny-cpu.json

One module per command; `common` holds the typer `app` they register on, `parser` ik's flag
grammar, `run_options` the run options four commands share (declared once). Importing the command
modules here registers them, in the order `ikjax --help` lists them; nothing inside the package
imports this module back. `ikjax = "ikjax.cli:app"` (pyproject.toml) is the console script.
"""
from ikjax import interrupt as _interrupt
# (JAX's backend is already starting on a thread: ikjax/__init__, ikjax.early_backend)
from ikjax.cli.common import app  # noqa: E402
# importing a command module registers its command on `app`: this order is `ikjax --help`'s
from ikjax.cli import sweep_bench, plot, bench, generate, chat, perplexity, info, make_model, serve  # noqa: F401,E402
from ikjax.cli.run import CONFIG_COMMANDS  # noqa: E402 - `run` last

_interrupt.restore()  # from here a command's own handling (KeyboardInterrupt, `common.handle`)

__all__ = ["app", "main", "CONFIG_COMMANDS"]


def main() -> None:
    app()
