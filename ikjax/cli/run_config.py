"""`ikjax run --config FILE.json`: a subcommand and all its options as one JSON object.

    {"command": "sweep-bench", "model": "synthetic:tiny", "ctx": 2048, "ubatch": 512, "mla": 3, "fa": 1}

Keys are the subcommand's option names: the Python/RunOptions names (`ctx`, `ubatch`, `ctk`, ...),
any of its CLI long names without dashes (`ctx-size`, `ubatch-size`, `cache-type-k`) or ik's short
names (`c`, `ub`, `ngl`). Unknown keys and badly typed values are refused naming the key; values are
then checked by the same code as the CLI (RunOptions), which names the option too. Keys starting
with `_` (`"_note": "writes 8 GB"`) and `comment` are the reader's, ignored.

A JSON list is an option's comma list only where the command line takes a comma list (every value
of `bench`, as llama-bench; `-ts 3,1`, `-ser 7,1`, `-op`, `-cuda` everywhere): a list given for a
single value (`"prompt": ["Hel", "lo"]`) is refused, not run as "Hel,lo".
"""
from __future__ import annotations

import functools
import inspect
import json
import re
import types
import typing
from pathlib import Path
from typing import Any, Callable

from ikjax.errors import OptionError

COMMAND_KEYS = ("command", "subcommand")
# commands whose every string option is a comma list (llama-bench's grammar), and the options that
# are comma lists on every command
COMMA_LIST_COMMANDS = frozenset({"bench"})
COMMA_LIST_OPTIONS = frozenset({"ts", "ser", "op", "cuda"})


def _option_names(func: Callable) -> dict[str, str]:
    """alias -> parameter name, from the typer Option declarations of the command's parameters."""
    hints = typing.get_type_hints(func, include_extras=True)
    names: dict[str, str] = {}
    for pname in inspect.signature(func).parameters:
        names[pname] = pname
        hint = hints.get(pname)
        for meta in getattr(hint, "__metadata__", ()):
            decls = list(getattr(meta, "param_decls", None) or ())
            first = getattr(meta, "default", None)  # typer keeps the first declaration here with Annotated
            if isinstance(first, str) and first.startswith("-"):
                decls.insert(0, first)
            for decl in decls:
                alias = decl.lstrip("-").replace("-", "_")
                names.setdefault(alias, pname)
    return names


def _base_type(hint: Any) -> Any:
    if typing.get_origin(hint) is typing.Annotated:
        hint = typing.get_args(hint)[0]
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else hint
        origin = typing.get_origin(hint)
    if origin in (list, typing.List):
        return list
    return hint


def _coerce(key: str, value: Any, kind: Any, comma_list: bool = True) -> Any:
    if value is None:  # ("model": null ran the built-in default model, quietly)
        raise OptionError(f"config key {key!r}: null is not a value (leave the key out for the default)")
    if kind is bool:
        if isinstance(value, bool):
            return value
        if value in (0, 1):
            return bool(value)
        raise OptionError(f"config key {key!r}: expected true/false, got {value!r}")
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and re.fullmatch(r"\s*-?[0-9]+\s*", value):  # ("--5", "²": int() refused them)
            return int(value)
        raise OptionError(f"config key {key!r}: expected an integer, got {value!r}")
    if kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and re.fullmatch(r"\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*", value):
            return float(value)  # a number as text, as integers are taken ("0.8" was refused where "512" passed)
        raise OptionError(f"config key {key!r}: expected a number, got {value!r}")
    if kind is list:
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
        raise OptionError(f"config key {key!r}: expected a string or a list of strings, got {value!r}")
    # str (also comma lists of bench): scalars and lists become their CLI spelling
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        return value
    if isinstance(value, list) and not comma_list:
        raise OptionError(f"config key {key!r}: expected a single value, got the list {_short(value)} "
                          f"(this option takes no comma list)")
    if isinstance(value, list) and all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
        return ",".join(str(v) for v in value)
    raise OptionError(f"config key {key!r}: unsupported value {_short(value)}")


def _short(value: Any, limit: int = 60) -> str:
    """A value for a one-line message: its repr, cut to `limit` characters."""
    r = repr(value)
    return r if len(r) <= limit else r[:limit - 3] + "..."


def _no_repeats(path, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different ({"ctx": 512, "ctx": 1024} ran -c 1024 unsaid)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise OptionError(f"{path}: key {k!r} given twice; give it once")
        out[k] = v
    return out


def _load(path: str | Path) -> Any:
    """The JSON of a config file; OptionError naming the file for anything that stops reading it."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise OptionError(f"{path}: cannot read config: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise OptionError(f"{path}: the config is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                          f"{e.start}); save it as UTF-8") from None
    try:
        return json.loads(text, object_pairs_hook=functools.partial(_no_repeats, path))
    except json.JSONDecodeError as e:
        raise OptionError(f"{path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise OptionError(f"{path}: not a config: JSON nested too deeply") from None


def parse_config(path: str | Path, commands: dict[str, Callable]) -> tuple[str, Callable, dict[str, Any]]:
    """(command name, function, keyword arguments) from a JSON config; OptionError naming the bad key."""
    data = _load(path)
    if not isinstance(data, dict):
        raise OptionError(f"{path}: the config must be a JSON object")
    given = [k for k in COMMAND_KEYS if k in data]
    if len(given) > 1:
        raise OptionError(f"{path}: keys 'command' and 'subcommand' both given (they are one key; keep one)")
    if not given:
        raise OptionError(f"{path}: missing key 'command' (one of {', '.join(commands)})")
    cmd = data[given[0]]
    if not isinstance(cmd, str):
        raise OptionError(f"{path}: key {given[0]!r}: expected a command name, got {_short(cmd)} "
                          f"(one of {', '.join(commands)})")
    if cmd not in commands:
        raise OptionError(f"{path}: key 'command': {cmd!r} is not one of {', '.join(commands)}")
    func = commands[cmd]
    names = _option_names(func)
    hints = typing.get_type_hints(func, include_extras=True)
    kwargs: dict[str, Any] = {}
    key_of: dict[str, str] = {}  # each option's key as the file spells it
    for key, value in data.items():
        if key in COMMAND_KEYS or key.startswith("_") or key == "comment":
            continue
        alias = key.lstrip("-").replace("-", "_")
        pname = names.get(alias)
        if pname is None:
            known = sorted(n for n in inspect.signature(func).parameters)
            raise OptionError(f"{path}: unknown key {key!r} for {cmd} (known: {', '.join(known)})")
        if pname in kwargs:
            raise OptionError(f"{path}: keys {key_of[pname]!r} and {key!r} both set {pname!r}; give one")
        key_of[pname] = key
        comma_list = cmd in COMMA_LIST_COMMANDS or pname in COMMA_LIST_OPTIONS
        kwargs[pname] = _coerce(key, value, _base_type(hints.get(pname, str)), comma_list)
    return cmd, func, kwargs
