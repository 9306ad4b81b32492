"""Tool calls: OpenAI's `tools` offered to a model in its own call syntax, and the calls it writes
taken back out of its answer as OpenAI's `tool_calls` (what llama-server --jinja does per template).

`tool_messages` prepares a conversation with tools for a template: the tool list goes into the
system prompt where the template does not render `tools` itself (none of the DeepSeek, Kimi and GLM
templates shipped in ikjax/templates does, nor R1's own), earlier calls are written in the model
family's syntax where the template has no `tool_calls` branch, and `tool` results become user
turns where it knows no `tool` role. `parse_tool_calls` / `ToolCallSplitter` take the calls back
out of an answer, whole or streamed. The syntaxes recognised, whatever the template: DeepSeek
V3/R1's `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` + a json fence, DeepSeek V3.1's
`<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS`, Kimi K2's `<|tool_call_begin|>functions.NAME:i
<|tool_call_argument_begin|>ARGS`, GLM-4.5+'s `<tool_call>NAME<arg_key>k</arg_key><arg_value>v
</arg_value></tool_call>`, and the Hermes / Qwen `<tool_call>{"name": ..., "arguments": ...}</tool_call>`.
Their markers are control tokens in DeepSeek's and Kimi's vocabularies (the converter types
`<｜...｜>` and `<|...|>` as control), which plain detokenizing hides: `TOOL_MARKERS` are the texts a
detokenizer must show when tools are offered (llama-server's preserved tokens).
"""
from __future__ import annotations

import functools
import json
import re
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ikjax.errors import OptionError

DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_SEP, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
KIMI_CALLS_BEGIN, KIMI_CALLS_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN, KIMI_ARG, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
XML_CALL_BEGIN, XML_CALL_END = "<tool_call>", "</tool_call>"
# every marker a call syntax has: the tokens a detokenizer must show when tools are offered
TOOL_MARKERS = (DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, DS_SEP, DS_CALL_END, KIMI_CALLS_BEGIN, KIMI_CALLS_END,
                KIMI_CALL_BEGIN, KIMI_ARG, KIMI_CALL_END, XML_CALL_BEGIN, XML_CALL_END,
                "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")  # GLM-4.5+'s argument tags
_FENCED = re.compile(r"\s*([^\n`]+?)\s*\n?```(?:json)?\s*\n?(.*?)\n?```\s*$", re.S)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
TOOL_CHOICES = ("none", "auto", "required")


@dataclass
class ToolCall:
    """One call: the function's name and its arguments as JSON text (OpenAI's form: a string the
    client parses), with the id OpenAI's messages carry (Kimi's own id where the model wrote one)."""
    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


# DeepSeek V3.1's template writes a call as NAME<sep>ARGS (V3 / R1's: function<sep>NAME + fenced JSON)
_DS31_CALL = re.compile(r"""\[\s*['"]name['"]\s*\]\s*\+\s*['"]""" + re.escape(DS_SEP))


def tool_family(source: str) -> str:
    """The call syntax a template's model writes: deepseek (V3 / R1), deepseek-v3.1, kimi, glm or
    hermes (the rest)."""
    if "tool▁call" in source or "｜Assistant｜" in source or "Assistant:" in source:
        return "deepseek-v3.1" if _DS31_CALL.search(source) else "deepseek"
    if "<|im_middle|>" in source or "tool_calls_section" in source:
        return "kimi"
    if "[gMASK]" in source or "<arg_key>" in source:
        return "glm"
    return "hermes"


def call_text(calls: Iterable[ToolCall], family: str) -> str:
    """`calls` written as the family's model writes them (earlier turns, and the prompt's example)."""
    calls = list(calls)
    if family == "deepseek":
        return DS_CALLS_BEGIN + "\n".join(
            f"{DS_CALL_BEGIN}function{DS_SEP}{c.name}\n```json\n{c.arguments}\n```{DS_CALL_END}" for c in calls
        ) + DS_CALLS_END
    if family == "deepseek-v3.1":
        return DS_CALLS_BEGIN + "".join(f"{DS_CALL_BEGIN}{c.name}{DS_SEP}{c.arguments}{DS_CALL_END}" for c in calls
                                        ) + DS_CALLS_END
    if family == "kimi":
        return KIMI_CALLS_BEGIN + "".join(
            f"{KIMI_CALL_BEGIN}functions.{c.name}:{i}{KIMI_ARG}{c.arguments}{KIMI_CALL_END}" for i, c in enumerate(calls)
        ) + KIMI_CALLS_END
    if family == "glm":
        out = []
        for c in calls:
            try:
                args = json.loads(c.arguments)
            except ValueError:
                args = None
            pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v)}"
                            f"</arg_value>\n" for k, v in args.items()) if isinstance(args, dict) else ""
            out.append(f"{XML_CALL_BEGIN}{c.name}\n{pairs}{XML_CALL_END}")
        return "\n".join(out)
    return "\n".join(f'{XML_CALL_BEGIN}\n{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}\n{XML_CALL_END}'
                     for c in calls)


def tools_prompt(tools: list, family: str, tool_choice: Any = None) -> str:
    """The system prompt's part that lists the tools, for a template that does not render `tools`
    (llama-server does the same for such templates): the tools' JSON and the call syntax, and for
    `tool_choice` "required" or one function, the instruction to call (the answer is also made to
    start with the call: `forced_call`)."""
    example = call_text([ToolCall("function_name", '{"argument": "value"}')], family)
    return ("You can call the following tools. Each is described by a JSON schema in OpenAI's format:\n"
            + json.dumps(tools, ensure_ascii=False) + "\n\nTo call tools, answer with the calls alone, in "
            "this form (one call per tool, the arguments a JSON object):\n" + example
            + "\nA tool's result comes back in the next message." + _must_call(tool_choice))


def _must_call(tool_choice: Any) -> str:
    if tool_choice == "required":
        return "\nAnswer with at least one tool call."
    if isinstance(tool_choice, Mapping):
        return f"\nAnswer with a call of {tool_choice['function']['name']}."
    return ""


def forced_call(tool_choice: Any, family: str) -> str:
    """The start of a call section in the family's syntax, for an answer that `tool_choice` requires
    to call: "required" opens the section up to the function's name (the model writes which), one
    function (`{"type": "function", "function": {"name": ...}}`) up to its arguments. "" for
    "auto", "none" and None. Why: llama-server forces such calls with a grammar; here the prompt
    ends with the section's opening (the answer starts with it), so the model's next tokens can
    only be a call's rest, whatever it would have written first."""
    if tool_choice == "required":
        name = None
    elif isinstance(tool_choice, Mapping):
        name = tool_choice["function"]["name"]
    else:
        return ""
    if family == "deepseek":
        return DS_CALLS_BEGIN + DS_CALL_BEGIN + "function" + DS_SEP + (f"{name}\n```json\n" if name else "")
    if family == "deepseek-v3.1":
        return DS_CALLS_BEGIN + DS_CALL_BEGIN + (f"{name}{DS_SEP}" if name else "")
    if family == "kimi":
        return KIMI_CALLS_BEGIN + KIMI_CALL_BEGIN + "functions." + (f"{name}:0{KIMI_ARG}" if name else "")
    if family == "glm":
        return XML_CALL_BEGIN + (f"{name}\n" if name else "")
    return XML_CALL_BEGIN + '\n{"name": "' + (f'{name}", "arguments": ' if name else "")


def check_tools(tools: Any, tool_choice: Any) -> None:
    """OpenAI's `tools` (a list of {"type": "function", "function": {"name": ...}}) and `tool_choice`
    ("none", "auto", "required" or {"type": "function", "function": {"name": ...}}), or OptionError."""
    if tools is not None:
        if not isinstance(tools, list):
            raise OptionError(f"tools: expected a list of function tools, got {type(tools).__name__}")
        try:  # they go into the prompt as JSON: a set, an object or NaN there would not be JSON
            json.dumps(tools, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise OptionError(f"tools: not JSON ({str(e).splitlines()[0][:120]})") from None
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, Mapping) else None
            if not isinstance(t, Mapping) or t.get("type", "function") != "function" or not isinstance(fn, Mapping) \
                    or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise OptionError(f"tools[{i}]: expected {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
    if tool_choice == "required" or isinstance(tool_choice, Mapping):
        if not tools:  # (OpenAI's and vLLM's 400: a call is asked for and nothing can be called)
            raise OptionError(f"tool_choice: {json.dumps(tool_choice)[:80]} asks for a call, but no tools are given")
    if tool_choice is None or tool_choice in TOOL_CHOICES:
        return
    fn = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or tool_choice.get("type", "function") != "function":
        raise OptionError(f"tool_choice: expected one of {', '.join(TOOL_CHOICES)} or {{\"type\": \"function\", "
                          f"\"function\": {{\"name\": ...}}}}, got {_json_text(tool_choice)}")
    if not any(isinstance(t, Mapping) and t["function"]["name"] == fn["name"] for t in tools or ()):
        raise OptionError(f"tool_choice: no tool named {fn['name']!r} in tools")


def _json_text(v: Any) -> str:
    """A request's value as JSON shows it (a client sent JSON, not a Python repr), cut short."""
    try:
        return json.dumps(v, ensure_ascii=False)[:200]
    except (TypeError, ValueError):
        return repr(v)[:200]


@functools.lru_cache(maxsize=64)  # a server asks the same few of its one template on every request
def _template_uses(source: str, word: str) -> bool:
    """Whether a Jinja template's code (its `{% %}` / `{{ }}` blocks, not its text or comments)
    names `word`: a template renders `tools` / `tool_calls` / a 'tool' role only where its code reads
    them."""
    return any(re.search(rf"(?<!\w){re.escape(word)}(?!\w)", block)
               for block in re.findall(r"\{[{%].*?[%}]\}", source, re.S))


@functools.lru_cache(maxsize=64)
def _object_arguments(source: str) -> bool:
    """Whether a template reads a call's arguments as an object (`arguments | tojson`, `.items()`:
    Qwen's, GLM-4.5's), as transformers' templates are written to, where DeepSeek's and Kimi's print
    them as they are: the former get the JSON text parsed (llama-server's minja and vLLM do the
    same), the latter the text."""
    return bool(re.search(r"arguments\s*\|\s*tojson|arguments\s*\|\s*items|arguments\.items\(\)", source))


def tool_messages(messages: list[dict], tools: list | None, source: str, tool_choice: Any = None, *,
                  keep_text: bool = False) -> list[dict]:
    """`messages` made ready for a template whose Jinja text is `source`: assistant `tool_calls`
    with their arguments as JSON text (a client may send an object), or as an object where the
    template reads one (`_object_arguments`), and, where the template has a
    `tool_calls` branch, the turn's text kept where the template renders text and calls together
    (`keep_text`: V3-0324's, V3.1's, as transformers and llama-server keep it), else content None
    as R1's first template expects (it renders the calls only for a turn without text); where it
    has none, the calls appended to the content in the family's own syntax; `tool`
    results as user turns where the template knows no `tool` role; and the tool list in the system
    prompt when `tools` is given and the template does not render them."""
    family = tool_family(source)
    wants_objects = _object_arguments(source)
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and calls:
            if not isinstance(calls, list):
                raise OptionError(f"messages[{i}].tool_calls: expected a list of calls")
            norm = []
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, Mapping) else None
                if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                    raise OptionError(f"messages[{i}].tool_calls[{j}]: expected {{\"function\": {{\"name\": ..., "
                                      f"\"arguments\": ...}}}}")
                args = fn.get("arguments", "{}")
                if not isinstance(args, str):
                    try:
                        args = json.dumps(args, ensure_ascii=False)
                    except (TypeError, ValueError, RecursionError) as e:  # (a Python set or bytes, from the API)
                        raise OptionError(f"messages[{i}].tool_calls[{j}].function.arguments: not JSON "
                                          f"({e})"[:300]) from None
                if wants_objects:  # (`arguments | tojson` of a string wrote it twice encoded)
                    try:
                        args = json.loads(args)
                    except (ValueError, RecursionError):
                        pass
                norm.append({**c, "type": c.get("type", "function"), "function": {**fn, "arguments": args}})
            if _template_uses(source, "tool_calls"):
                m.update(tool_calls=norm, content=m.get("content") if keep_text and m.get("content") else None)
            else:
                text = call_text([ToolCall(c["function"].get("name", ""), c["function"]["arguments"]) for c in norm],
                                 family)
                m.pop("tool_calls")
                m["content"] = ((m.get("content") or "") + ("\n" if m.get("content") else "") + text)
        elif m.get("role") == "tool" and not _template_uses(source, "'tool'") and not _template_uses(source, '"tool"'):
            m = {"role": "user", "content": f"Tool result ({m.get('name') or m.get('tool_call_id') or 'tool'}):\n"
                                            f"{m.get('content') or ''}"}
        out.append(m)
    if tools and not _template_uses(source, "tools"):
        text = tools_prompt(tools, family, tool_choice)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": (out[0].get("content") or "") + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _json_object(text: str) -> bool:
    """Whether a call's arguments are a JSON object (OpenAI's `arguments`: the text of one). A call
    whose arguments are not ("{", "", "not json") is not a call: a client's json.loads of them
    failed (an outside probe, stop 67)."""
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


def _one_call(kind: str, body: str) -> ToolCall | None:
    """The call between one form's begin and end markers, or None when it is not one (no name, or
    arguments that are not a JSON object)."""
    call = _call_of(kind, body)
    return call if call is not None and _json_object(call.arguments) else None


def _call_of(kind: str, body: str) -> ToolCall | None:
    if kind == DS_CALL_BEGIN:
        if DS_SEP not in body:
            return None
        head, rest = body.split(DS_SEP, 1)
        m = _FENCED.match(rest)
        if m:  # V3 / R1: function<sep>NAME\n```json\nARGS\n```
            return ToolCall(m.group(1), m.group(2).strip())
        return ToolCall(head.strip(), rest.strip()) if head.strip() else None  # V3.1: NAME<sep>ARGS
    if kind == KIMI_CALL_BEGIN:
        if KIMI_ARG not in body:
            return None
        ident, args = body.split(KIMI_ARG, 1)
        ident = ident.strip()
        name = ident.removeprefix("functions.").rsplit(":", 1)[0]
        return ToolCall(name, args.strip(), id=ident) if name else None
    body = body.strip()  # <tool_call>: Hermes JSON, or GLM's NAME + arg_key / arg_value pairs
    if body.startswith("{"):
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
    name = body.split("<arg_key>", 1)[0].strip()
    if not name or "\n" in name:
        return None
    args = {}
    for k, v in _GLM_ARG.findall(body):
        try:
            args[k.strip()] = json.loads(v)
        except ValueError:
            args[k.strip()] = v
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


# each family's call syntax: where a call section can start, each call's (begin, end) markers, and
# the marker that closes the section (None: the section is its calls)
_SYNTAX = {
    "deepseek": ((DS_CALLS_BEGIN, DS_CALL_BEGIN), ((DS_CALL_BEGIN, DS_CALL_END),), DS_CALLS_END),
    "deepseek-v3.1": ((DS_CALLS_BEGIN, DS_CALL_BEGIN), ((DS_CALL_BEGIN, DS_CALL_END),), DS_CALLS_END),
    "kimi": ((KIMI_CALLS_BEGIN, KIMI_CALL_BEGIN), ((KIMI_CALL_BEGIN, KIMI_CALL_END),), KIMI_CALLS_END),
    "glm": ((XML_CALL_BEGIN,), ((XML_CALL_BEGIN, XML_CALL_END),), None),
    "hermes": ((XML_CALL_BEGIN,), ((XML_CALL_BEGIN, XML_CALL_END),), None),
}


@functools.lru_cache(maxsize=None)
def _syntax(family: str | None):
    """(where a call section can start: what `ToolCallSplitter` holds back once it appears, each
    call's (begin, end), the section's closing markers) of a family, or of every family (None: a
    caller that does not know the template)."""
    families = list(_SYNTAX) if family is None else [family]
    starts = tuple(dict.fromkeys(w for f in families for w in _SYNTAX[f][0]))
    forms = tuple(dict.fromkeys(x for f in families for x in _SYNTAX[f][1]))
    return starts, forms, tuple(_SYNTAX[f][2] for f in families if _SYNTAX[f][2])


def parse_tool_calls(text: str, family: str | None = None,
                     names: Iterable[str] | None = None) -> tuple[str, list[ToolCall]]:
    """(content, calls) of an answer: every complete call of its call section, and the text around
    the section (before it, and any after its end). `family` (`tool_family` of the template) limits
    the syntax to that model family's own: an answer that only shows another family's call form (a
    DeepSeek model explaining Qwen's) is text. `names` (the offered tools): a section that calls
    anything else is text, never a call of a function the client did not offer. An answer with no
    complete call is all content (nothing is lost: a malformed or cut-off call stays text)."""
    starts_of, forms, ends = _syntax(family)
    starts = [i for i in (text.find(w) for w in starts_of) if i >= 0]
    if not starts:
        return text, []
    i = min(starts)
    calls = []
    rest = text[i:]
    last = 0
    for begin, end in forms:
        for m in re.finditer(re.escape(begin) + "(.*?)" + re.escape(end), rest, re.S):
            c = _one_call(begin, m.group(1))
            if c is None:  # a malformed call: the section is text, not some of its calls
                return text, []
            calls.append((m.start(), c))
            last = max(last, m.end())
    offered = None if names is None else set(names)
    if not calls or offered is not None and any(c.name not in offered for _, c in calls):
        return text, []
    tail = rest[last:]
    for e in ends:  # the section's closing marker, then whatever the model wrote after it
        if tail.lstrip().startswith(e):
            tail = tail.lstrip()[len(e):]
            break
    if any(w in tail for w in _markers(family)):  # the section's debris ("}{<｜tool▁call▁end｜>"), not content
        tail = ""
    return text[:i] + (tail if tail.strip() else ""), [c for _, c in sorted(calls, key=lambda p: p[0])]


@functools.lru_cache(maxsize=None)
def _markers(family: str | None) -> tuple[str, ...]:
    """Every marker of a family's call syntax (of every family for None)."""
    starts, forms, ends = _syntax(family)
    seps = {"deepseek": (DS_SEP,), "deepseek-v3.1": (DS_SEP,), "kimi": (KIMI_ARG,), None: (DS_SEP, KIMI_ARG)}.get(family, ())
    return tuple(dict.fromkeys((*starts, *(w for f in forms for w in f), *ends, *seps)))


class ToolCallSplitter:
    """`parse_tool_calls` on a stream: `feed(delta)` returns the content that can go out now (text
    that may still become a call marker waits); once a call section starts everything is held;
    `finish()` gives the rest of the content and the calls. The streamed content plus `finish()`'s
    equals `parse_tool_calls` of the whole text (`family`, `names`: as there)."""

    def __init__(self, family: str | None = None, names: Iterable[str] | None = None):
        self._buf = ""
        self._in_calls = False
        self._family = family
        self._names = None if names is None else tuple(names)
        self._starts = _syntax(family)[0]

    def feed(self, delta: str) -> str:
        text = self._buf + delta
        if self._in_calls:
            self._buf = text
            return ""
        starts = [i for i in (text.find(w) for w in self._starts) if i >= 0]
        if starts:
            i = min(starts)
            self._in_calls, self._buf = True, text[i:]
            return text[:i]
        keep = partial_suffix(text, self._starts)
        self._buf = text[len(text) - keep:]
        return text[:len(text) - keep]

    def finish(self) -> tuple[str, list[ToolCall]]:
        text, self._buf = self._buf, ""
        if not self._in_calls:
            return text, []
        return parse_tool_calls(text, self._family, self._names)


def partial_suffix(text: str, words: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `words`: what a
    stream holds back until the next delta decides (a call marker here, a `<think>` tag in
    chat_template, a stop string in runtime.text)."""
    best = 0
    for w in words:
        for k in range(min(len(w) - 1, len(text)), best, -1):
            if text.endswith(w[:k]):
                best = k
                break
    return best
