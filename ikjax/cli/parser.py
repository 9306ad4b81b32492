"""ik_llama.cpp's flag grammar on click: exact option names, bare switches, one-line usage errors.

ik's short flags are words (`-mg`, `-ctv`, `-tb`), which click would read as clustered one-letter
options (`-m g`, `-c tv`); its switches may be given bare (`-fa` means `-fa 1`). `ExactCommand`
is the click command class every `ikjax` subcommand uses for both, and `Group` turns every usage
error into one line on stderr with exit code 1. Nothing here knows about any particular command.
"""
from __future__ import annotations

import re
import sys

import typer
from typer.core import TyperCommand, TyperGroup

from ikjax.options import BARE_PARAMS

try:  # typer >= 0.24 carries its own click
    from typer._click.exceptions import ClickException as _ClickException
except ImportError:  # pragma: no cover
    from click import ClickException as _ClickException
try:
    import click as _click
    _CLICK_ERRORS: tuple = (_ClickException, _click.ClickException)
except ImportError:  # pragma: no cover
    _CLICK_ERRORS = (_ClickException,)

try:  # typer >= 0.24 carries its own click
    from typer._click.exceptions import NoSuchOption as _NoSuchOption
    from typer._click.exceptions import UsageError as _UsageError
    from typer._click.parser import _normalize_opt, _OptionParser
except ImportError:  # pragma: no cover
    from click.exceptions import NoSuchOption as _NoSuchOption
    from click.exceptions import UsageError as _UsageError
    from click.parser import _normalize_opt
    from click.parser import OptionParser as _OptionParser

_FLAG_VALUE = re.compile(r"(?i)^(0|1|on|off|true|false|yes|no|auto)(,(0|1|on|off|true|false|yes|no|auto))*$")
# ik's switches that may be given bare (`-fa`, `-rtr`) on the commands that take them; `_rewrite`'s default
_BARE_FLAGS = {"-fa", "--fa", "--flash-attn", "-fmoe", "--fmoe", "--fused-moe"}


def _rewrite(args: list[str], bare: set[str] | frozenset[str] = frozenset(_BARE_FLAGS),
             has_positional: bool = False) -> list[str]:
    """ik's bare switches: `-fa` alone means `-fa 1`; `auto` means on.

    A bare switch followed by another option (or nothing) gets the value 1. Followed by a word that
    is not 0/1/on/off/auto, it is refused naming the switch (`-fa 2`), unless the command takes a
    positional argument (`ikjax info -fa model.gguf`), where the word is that argument.
    """
    out: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        out.append(a)
        i += 1
        if a == "--":
            out += args[i:]
            break
        if a not in bare:
            continue
        nxt = args[i] if i < len(args) else None
        if nxt is not None and _FLAG_VALUE.match(nxt):
            out.append(re.sub(r"(?i)auto", "1", nxt))
            i += 1
        elif nxt is None or nxt.startswith("-") or (has_positional and not re.fullmatch(r"[\d.,]+", nxt)):
            out.append("1")
        else:
            raise _UsageError(f"{a}: expected 0/1/on/off/auto, got {nxt}")
    return out


class _ExactParser(_OptionParser):
    """click's parser without short-option clustering: a token with one dash and more than one letter
    (`-mg`, `-ctv`, `-tb`) must be a declared option, never `-m g` or `-c tv`."""

    def _process_opts(self, arg: str, state) -> None:
        name = arg.split("=", 1)[0]
        if arg[:1] == "-" and arg[:2] != "--" and len(name) > 2 and _normalize_opt(name, self.ctx) not in self._long_opt:
            import difflib
            close = difflib.get_close_matches(name, list(self._long_opt) + list(self._short_opt), n=3, cutoff=0.75)
            raise _NoSuchOption(name, message=f"unknown option {name}"
                                + (f" (did you mean {', '.join(close)}?)" if close else ""), ctx=self.ctx)
        super()._process_opts(arg, state)


class ExactCommand(TyperCommand):
    """A command whose options are matched exactly (ik's flags) and whose bare switches get 1."""

    def make_parser(self, ctx) -> _OptionParser:
        parser = _ExactParser(ctx)
        for param in self.get_params(ctx):
            param.add_to_parser(parser, ctx)
        return parser

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        bare = {o for p in self.params if p.name in BARE_PARAMS for o in (*p.opts, *p.secondary_opts)}
        has_positional = any(p.param_type_name == "argument" for p in self.params)
        return super().parse_args(ctx, _rewrite(list(args), bare, has_positional))


class Group(TyperGroup):
    """Every usage error as one line on stderr with exit code 1."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            rv = super().main(args=args, prog_name=prog_name, complete_var=complete_var,
                              standalone_mode=False, **extra)
        except _CLICK_ERRORS as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # `ikjax` alone: the help was printed
                sys.exit(0)
            typer.echo(f"error: {e.format_message()}".splitlines()[0], err=True)
            sys.exit(1)
        except typer.Abort:
            typer.echo("aborted", err=True)
            sys.exit(1)
        if not standalone_mode:
            return rv
        sys.exit(rv if isinstance(rv, int) else 0)
