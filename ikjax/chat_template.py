"""Chat templates: a conversation (OpenAI-style messages) -> the prompt text the model was trained on,
and DeepSeek R1's `<think>…</think>` split back out of what it answers.

A GGUF carries its template as Jinja source in `tokenizer.chat_template` (copied from the model's
`tokenizer_config.json` by the converter). It is rendered here the way transformers'
`apply_chat_template` renders it, so a template behaves as its authors tested it: jinja2's
`ImmutableSandboxedEnvironment` (the template comes from a downloaded file: no attribute access to
Python internals, no mutation of the inputs) with `trim_blocks` and `lstrip_blocks`, the
`loopcontrols` extension and a pass-through `{% generation %}` block, and the same globals:
`raise_exception(msg)`, `strftime_now(fmt)`, a `tojson` filter that does not HTML-escape (json.dumps,
ensure_ascii off), `dict`, and a `namespace` that refuses underscore attributes. The variables are
`messages`, `tools`, `documents`, `add_generation_prompt`, `bos_token`, `eos_token` and any extra
keyword; messages are passed as plain JSON data with the reasoning field aliases transformers adds
(`reasoning_content` / `thinking`). One difference, on purpose: a key whose value is None is kept
(transformers 5 drops it), because R1's template tells an assistant tool-call message by
`message['content'] is none`, as llama.cpp's renderer sees it.

A file without a template gets a named fallback chosen from its pre-tokenizer
(`tokenizer.ggml.pre`): deepseek-v3 -> `deepseek3` (DeepSeek-R1's own template, byte for byte: the
V3/R1 turn format; its generation prompt opens a `<think>` block), deepseek-llm -> `deepseek2`
(DeepSeek-V2-Chat's), kimi-k2 -> `kimi-k2` (Kimi K2 / Moonlight turns: `<|im_user|>user<|im_middle|>
... <|im_end|>`), glm4 -> `chatglm4` (`[gMASK]<sop><|user|>\n...`, GLM-4.x; files from GLM's
converter add no BOS, the template writes `[gMASK]<sop>`), anything else -> `chatml`. The kimi-k2
and chatglm4 texts are llama.cpp's builtins of those names. The names are llama-server's `--chat-template`
names; `--chat-template` also takes a FILE holding a Jinja template (or the template text itself,
as llama-server does with --jinja).

`split_reasoning` / `ReasoningSplitter` are llama-server's `--reasoning-format deepseek`: the text
of a `<think>…</think>` block is returned apart (`reasoning_content`), stripped, and the answer
after it (`content`) without the spaces that follow `</think>`.

Tool calls (OpenAI's `tools` / `tool_calls`, as llama-server --jinja gives them): `tool_messages`
prepares a conversation with tools for a template (the tool list in the system prompt where the
template does not render `tools` itself, as none of the DeepSeek, Kimi and GLM templates shipped here
does; earlier calls written in the model family's own call syntax where the template has no
`tool_calls` branch), and `parse_tool_calls` / `ToolCallSplitter` take the calls back out of an
answer. The call syntaxes recognised, whatever the template: DeepSeek V3/R1's
`<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` + a json fence, DeepSeek V3.1's
`<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS`, Kimi K2's `<|tool_call_begin|>functions.NAME:i
<|tool_call_argument_begin|>ARGS`, GLM-4.5+'s `<tool_call>NAME<arg_key>k</arg_key><arg_value>v
</arg_value></tool_call>`, and the Hermes / Qwen `<tool_call>{"name": ..., "arguments": ...}</tool_call>`.
"""
from __future__ import annotations

import json
import logging
import os
import re
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Mapping

from ikjax.errors import OptionError

log = logging.getLogger("ikjax")

_TEMPLATES = Path(__file__).resolve().parent / "templates"
# llama-server's names -> the template files shipped in ikjax/templates
BUILTINS: dict[str, str] = {"deepseek3": "deepseek3.jinja", "deepseek2": "deepseek2.jinja",
                            "chatml": "chatml.jinja", "kimi-k2": "kimi-k2.jinja", "chatglm4": "chatglm4.jinja"}
# tokenizer.ggml.pre -> the fallback for a file without tokenizer.chat_template
FALLBACKS: dict[str, str] = {"deepseek-v3": "deepseek3", "deepseek-llm": "deepseek2", "kimi-k2": "kimi-k2",
                             "glm4": "chatglm4", "chatglm-bpe": "chatglm4"}
DEFAULT_FALLBACK = "chatml"
GGUF_KEY = "tokenizer.chat_template"

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# reasoning fields, the first the one templates read (transformers' aliases)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(OptionError):
    """A template that does not compile, or that refuses these messages (raise_exception, a
    missing field): the request's fault or the template's, one line either way."""


class ChatTemplate:
    """A compiled chat template. `name` says where it came from (a builtin name, a file path, or
    "gguf" for the model file's own); `source` is its Jinja text."""

    def __init__(self, source: str, name: str = "custom"):
        if not isinstance(source, str):
            raise OptionError(f"chat template {name}: expected Jinja text, got {type(source).__name__}")
        self.name = name
        self.source = source
        self._template = _compile(source, name)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text for `messages` (dicts with role and content), ending with the assistant's
        turn header when `add_generation_prompt`. Extra keywords are template variables
        (bos_token, eos_token, tools, documents, ...)."""
        import jinja2

        if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)):
            raise ChatTemplateError(f"messages: expected a list of messages, got {type(messages).__name__}")
        chat = []
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping):
                raise ChatTemplateError(f"messages[{i}]: expected an object with role and content, got "
                                        f"{type(m).__name__}")
            chat.append(_alias_reasoning(_plain(m)))
        variables = {"tools": None, "documents": None, **_plain(kwargs)}
        try:
            return self._template.render(messages=chat, add_generation_prompt=bool(add_generation_prompt),
                                         **variables)
        except jinja2.TemplateError as e:  # raise_exception, undefined fields, sandbox refusals
            raise ChatTemplateError(f"chat template {self.name}: {_one_line(e)}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:  # e.g. str + list content
            raise ChatTemplateError(f"chat template {self.name}: cannot render these messages "
                                    f"({type(e).__name__}: {_one_line(e)})") from None

    def __repr__(self) -> str:
        return f"ChatTemplate({self.name!r})"


def builtin(name: str) -> ChatTemplate:
    """A shipped template by its llama-server name."""
    if name not in BUILTINS:
        raise OptionError(f"chat template {name!r}: unknown name (builtin: {', '.join(BUILTINS)}; or give a file "
                          f"holding a Jinja template)")
    return ChatTemplate((_TEMPLATES / BUILTINS[name]).read_text(encoding="utf-8"), name)


def fallback_name(metadata: Mapping[str, Any]) -> str:
    """The builtin a file without a template gets, from its pre-tokenizer."""
    return FALLBACKS.get(str(metadata.get("tokenizer.ggml.pre", "")), DEFAULT_FALLBACK)


def template_for(metadata: Mapping[str, Any], choice: str | None = None, *, bos_token: str = "",
                 eos_token: str = "") -> ChatTemplate:
    """The template for a model: `choice` None -> the file's `tokenizer.chat_template`, else the
    fallback for its pre-tokenizer (with a one-line note saying which); `choice` a builtin name
    (BUILTINS), a FILE with a Jinja template, or Jinja text itself (it holds `{{` or `{%`).
    `bos_token` / `eos_token` are the model's special-token texts, given to every render."""
    return _Bound(_choose(metadata, choice), bos_token, eos_token)


def check_choice(choice: str | None) -> None:
    """Refuse a bad `--chat-template` (unknown name, unreadable file, Jinja that does not compile)
    before a model is loaded."""
    if choice:
        _choose({}, choice)


def _choose(metadata: Mapping[str, Any], choice: str | None) -> ChatTemplate:
    if choice is None or choice == "":
        src = metadata.get(GGUF_KEY)
        if isinstance(src, str) and src.strip():
            return ChatTemplate(src, "gguf")
        name = fallback_name(metadata)
        pre = metadata.get("tokenizer.ggml.pre")
        log.warning("no chat template in the model file (%s); using the builtin %r for pre-tokenizer %s",
                    GGUF_KEY, name, pre if pre is not None else "(none)")
        return builtin(name)
    if not isinstance(choice, str):
        raise OptionError(f"chat template: expected a name or a file, got {type(choice).__name__}")
    if choice in BUILTINS:
        return builtin(choice)
    if "{{" in choice or "{%" in choice:  # the template text itself (llama-server --chat-template with --jinja)
        return ChatTemplate(choice, "custom")
    path = Path(os.path.expanduser(choice))
    if path.is_file():
        try:
            return ChatTemplate(path.read_text(encoding="utf-8"), str(path))
        except OSError as e:
            raise OptionError(f"chat template {choice}: cannot read the file ({e.strerror or e})") from None
        except UnicodeDecodeError:
            raise OptionError(f"chat template {choice}: the file is not UTF-8 text") from None
    if path.exists():
        raise OptionError(f"chat template {choice}: not a file")
    raise OptionError(f"chat template {choice!r}: no such builtin name ({', '.join(BUILTINS)}) and no such file")


class _Bound(ChatTemplate):
    """A template with the model's bos_token / eos_token filled in (a caller may still pass them)."""

    def __init__(self, t: ChatTemplate, bos_token: str, eos_token: str):
        self.name, self.source, self._template = t.name, t.source, t._template
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        kwargs.setdefault("bos_token", self.bos_token)
        kwargs.setdefault("eos_token", self.eos_token)
        return super().render(messages, add_generation_prompt, **kwargs)


def flatten_content(messages: Iterable[Mapping[str, Any]]) -> list[dict]:
    """Messages whose `content` is a list of OpenAI content parts (`{"type": "text", "text": ...}`)
    with the text parts joined by newlines, as llama-server does for a text-only model: DeepSeek's
    templates concatenate `content` as a string. A part of another type is refused by name."""
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        c = m.get("content")
        if isinstance(c, list):
            texts = []
            for j, part in enumerate(c):
                if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
                    texts.append(part["text"])
                else:
                    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                    raise ChatTemplateError(f"messages[{i}].content[{j}]: only text parts are supported, got {kind!r}")
            m["content"] = "\n".join(texts)
        out.append(m)
    return out


def opens_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt ends inside an open `<think>` block (R1's generation prompt
    `<｜Assistant｜><think>\\n`): the answer then starts with reasoning and has no opening tag."""
    tail = prompt.rstrip()
    return tail.endswith(THINK_OPEN)


# -- reasoning: llama-server's --reasoning-format deepseek ---------------------------------------

def split_reasoning(text: str, opened: bool | None = None) -> tuple[str | None, str]:
    """(reasoning_content, content) of a whole answer.

    `opened`: the prompt already opened the `<think>` block (`opens_reasoning`), so the answer is
    reasoning up to `</think>` (all of it while no `</think>` came). False: only an answer that
    starts with `<think>` has reasoning. None (unknown): as False, and an answer holding a
    `</think>` with no opening tag is taken as opened. Reasoning is stripped and None when empty;
    the content loses the spaces after `</think>`."""
    s = ReasoningSplitter(opened=bool(opened) or (opened is None and THINK_CLOSE in text
                                                  and not text.lstrip().startswith(THINK_OPEN)))
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    reasoning = r1 + r2
    return (reasoning if s.had_reasoning and reasoning else None), c1 + c2


class ReasoningSplitter:
    """`split_reasoning` on a stream: `feed(delta) -> (reasoning_delta, content_delta)`, then
    `finish()` for what was held back. Tags split across deltas are recognised: text that could
    still become `<think>` / `</think>` waits for the next delta, and so do spaces that may turn
    out to be the reasoning's trailing ones (stripped) or the ones after `</think>` (dropped).
    The concatenated deltas equal `split_reasoning` of the whole text."""

    def __init__(self, opened: bool = False):
        self.state = "reasoning" if opened else "start"
        self.had_reasoning = bool(opened)
        self._buf = ""            # undecided text
        self._reasoning_started = False  # leading spaces of the reasoning are dropped

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        return self._step(final=False)

    def finish(self) -> tuple[str, str]:
        return self._step(final=True)

    def _step(self, final: bool) -> tuple[str, str]:
        reasoning, content = [], []
        while True:
            buf = self._buf
            if self.state == "start":
                stripped = buf.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self._buf = stripped[len(THINK_OPEN):]
                    self.state, self.had_reasoning = "reasoning", True
                    continue
                if not final and THINK_OPEN.startswith(stripped):  # "", "<", "<th", ...: wait
                    break
                self.state = "content"
                continue
            if self.state == "reasoning":
                if not self._reasoning_started:
                    buf = self._buf = buf.lstrip()
                    if not buf:
                        break
                i = buf.find(THINK_CLOSE)
                if i >= 0:
                    reasoning.append(buf[:i].rstrip())
                    self._reasoning_started = True
                    self._buf = buf[i + len(THINK_CLOSE):]
                    self.state = "after"
                    continue
                if final:
                    reasoning.append(buf.rstrip())
                    self._buf = ""
                    break
                # hold back a possible start of "</think>" and the trailing spaces
                keep = _partial_suffix(buf, (THINK_CLOSE,))
                body = buf[:len(buf) - keep]
                emit = body.rstrip()
                if emit:
                    reasoning.append(emit)
                    self._reasoning_started = True
                self._buf = buf[len(emit):]
                break
            if self.state == "after":  # spaces after </think> are dropped
                buf = self._buf = buf.lstrip()
                if not buf:
                    break
                self.state = "content"
                continue
            # content: everything passes
            content.append(buf)
            self._buf = ""
            break
        return "".join(reasoning), "".join(content)


# -- tool calls: OpenAI's tools in, tool_calls out ---------------------------------------------------

DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_SEP, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
KIMI_CALLS_BEGIN, KIMI_CALLS_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN, KIMI_ARG, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
XML_CALL_BEGIN, XML_CALL_END = "<tool_call>", "</tool_call>"
# every marker a call syntax has: the tokens a detokenizer must show when tools are offered
TOOL_MARKERS = (DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, DS_SEP, DS_CALL_END, KIMI_CALLS_BEGIN, KIMI_CALLS_END,
                KIMI_CALL_BEGIN, KIMI_ARG, KIMI_CALL_END, XML_CALL_BEGIN, XML_CALL_END,
                "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")  # GLM-4.5+'s argument tags
# where a call section can start: what `ToolCallSplitter` holds back once it appears
_CALL_STARTS = (DS_CALLS_BEGIN, DS_CALL_BEGIN, KIMI_CALLS_BEGIN, KIMI_CALL_BEGIN, XML_CALL_BEGIN)
_CALL_FORMS = ((DS_CALL_BEGIN, DS_CALL_END), (KIMI_CALL_BEGIN, KIMI_CALL_END), (XML_CALL_BEGIN, XML_CALL_END))
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


def tool_family(source: str) -> str:
    """The call syntax a template's model writes: deepseek, kimi, glm or hermes (the rest)."""
    if "tool▁call" in source or "｜Assistant｜" in source or "Assistant:" in source:
        return "deepseek"
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


def tools_prompt(tools: list, family: str) -> str:
    """The system prompt's part that lists the tools, for a template that does not render `tools`
    (llama-server does the same for such templates): the tools' JSON and the call syntax."""
    example = call_text([ToolCall("function_name", '{"argument": "value"}')], family)
    return ("You can call the following tools. Each is described by a JSON schema in OpenAI's format:\n"
            + json.dumps(tools, ensure_ascii=False) + "\n\nTo call tools, answer with the calls alone, in "
            "this form (one call per tool, the arguments a JSON object):\n" + example
            + "\nA tool's result comes back in the next message.")


def check_tools(tools: Any, tool_choice: Any) -> None:
    """OpenAI's `tools` (a list of {"type": "function", "function": {"name": ...}}) and `tool_choice`
    ("none", "auto", "required" or {"type": "function", "function": {"name": ...}}), or OptionError."""
    if tools is not None:
        if not isinstance(tools, list):
            raise OptionError(f"tools: expected a list of function tools, got {type(tools).__name__}")
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, Mapping) else None
            if not isinstance(t, Mapping) or t.get("type", "function") != "function" or not isinstance(fn, Mapping) \
                    or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise OptionError(f"tools[{i}]: expected {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
    if tool_choice is None or tool_choice in TOOL_CHOICES:
        return
    fn = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise OptionError(f"tool_choice: expected one of {', '.join(TOOL_CHOICES)} or {{\"type\": \"function\", "
                          f"\"function\": {{\"name\": ...}}}}, got {tool_choice!r}")
    if not any(isinstance(t, Mapping) and t["function"]["name"] == fn["name"] for t in tools or ()):
        raise OptionError(f"tool_choice: no tool named {fn['name']!r} in tools")


def tool_messages(messages: list[dict], tools: list | None, source: str) -> list[dict]:
    """`messages` made ready for a template whose Jinja text is `source`: assistant `tool_calls`
    with their arguments as JSON text (a client may send an object) and, where the template has a
    `tool_calls` branch, content None as R1's template expects (it then renders the calls, not the
    text); where it has none, the calls appended to the content in the family's own syntax; `tool`
    results as user turns where the template knows no `tool` role; and the tool list in the system
    prompt when `tools` is given and the template does not render them."""
    family = tool_family(source)
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and calls:
            norm = []
            for c in calls:
                fn = c.get("function") or {}
                args = fn.get("arguments", "{}")
                args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
                norm.append({**c, "type": c.get("type", "function"), "function": {**fn, "arguments": args}})
            if "tool_calls" in source:
                m.update(tool_calls=norm, content=None)
            else:
                text = call_text([ToolCall(c["function"].get("name", ""), c["function"]["arguments"]) for c in norm],
                                 family)
                m.pop("tool_calls")
                m["content"] = ((m.get("content") or "") + ("\n" if m.get("content") else "") + text)
        elif m.get("role") == "tool" and "'tool'" not in source and '"tool"' not in source:
            m = {"role": "user", "content": f"Tool result ({m.get('name') or m.get('tool_call_id') or 'tool'}):\n"
                                            f"{m.get('content') or ''}"}
        out.append(m)
    if tools and "tools" not in source:
        text = tools_prompt(tools, family)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": (out[0].get("content") or "") + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _one_call(kind: str, body: str) -> ToolCall | None:
    """The call between one form's begin and end markers, or None when it is not one."""
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


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of an answer: the text before the first call section, and every complete
    call in it. An answer with no complete call is all content (nothing is lost: a malformed or
    cut-off call stays text)."""
    starts = [i for i in (text.find(w) for w in _CALL_STARTS) if i >= 0]
    if not starts:
        return text, []
    i = min(starts)
    calls = []
    rest = text[i:]
    for begin, end in _CALL_FORMS:
        for m in re.finditer(re.escape(begin) + "(.*?)" + re.escape(end), rest, re.S):
            c = _one_call(begin, m.group(1))
            if c is not None:
                calls.append((m.start(), c))
    if not calls:
        return text, []
    return text[:i], [c for _, c in sorted(calls, key=lambda p: p[0])]


class ToolCallSplitter:
    """`parse_tool_calls` on a stream: `feed(delta)` returns the content that can go out now (text
    that may still become a call marker waits); once a call section starts everything is held;
    `finish()` gives the rest of the content and the calls. The streamed content plus `finish()`'s
    equals `parse_tool_calls` of the whole text."""

    def __init__(self):
        self._buf = ""
        self._in_calls = False

    def feed(self, delta: str) -> str:
        text = self._buf + delta
        if self._in_calls:
            self._buf = text
            return ""
        starts = [i for i in (text.find(w) for w in _CALL_STARTS) if i >= 0]
        if starts:
            i = min(starts)
            self._in_calls, self._buf = True, text[i:]
            return text[:i]
        keep = _partial_suffix(text, _CALL_STARTS)
        self._buf = text[len(text) - keep:]
        return text[:len(text) - keep]

    def finish(self) -> tuple[str, list[ToolCall]]:
        text, self._buf = self._buf, ""
        if not self._in_calls:
            return text, []
        content, calls = parse_tool_calls(text)
        return content, calls


class AnswerSplitter:
    """A chat answer as the endpoints return it, from its text deltas: R1's reasoning
    (`ReasoningSplitter`, when `opened` is not None: whether the prompt opened the `<think>` block),
    then the content with the tool calls taken out (`ToolCallSplitter`, when `tools`).
    `feed(delta) -> (reasoning_delta, content_delta)`; `finish() -> (reasoning_delta,
    content_delta, calls)`. A whole answer is the deltas joined: one code path for both."""

    def __init__(self, opened: bool | None, tools: bool):
        self._reasoning = ReasoningSplitter(opened=opened) if opened is not None else None
        self._tools = ToolCallSplitter() if tools else None

    @property
    def had_reasoning(self) -> bool:
        return bool(self._reasoning and self._reasoning.had_reasoning)

    def feed(self, delta: str) -> tuple[str, str]:
        r, c = self._reasoning.feed(delta) if self._reasoning else ("", delta)
        return r, self._tools.feed(c) if self._tools else c

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        r, c = self._reasoning.finish() if self._reasoning else ("", "")
        if not self._tools:
            return r, c, []
        c = self._tools.feed(c)
        rest, calls = self._tools.finish()
        return r, c + rest, calls


def _partial_suffix(text: str, words: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `words`."""
    best = 0
    for w in words:
        for k in range(min(len(w) - 1, len(text)), best, -1):
            if text.endswith(w[:k]):
                best = k
                break
    return best


# -- the Jinja environment (transformers' apply_chat_template) ------------------------------------

_ENV = None


def _environment():
    """One sandboxed environment for every template, built as transformers builds its own."""
    global _ENV
    if _ENV is not None:
        return _ENV
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(jinja2.ext.Extension):
        """`{% generation %}…{% endgeneration %}` (transformers marks assistant tokens with it):
        its body rendered as is."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # not jinja's own tojson, which escapes <, >, & and ' for HTML
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    class _Dict:
        """`dict(...)` / `dict.fromkeys(...)` in a template, and nothing else of the type."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class _Namespace(jinja2.utils.Namespace):
        """jinja's namespace, refusing underscore attributes (no reach into Python internals)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for k in attrs:
                _Namespace._check(k)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            _Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    _ENV = env
    return env


def _compile(source: str, name: str):
    import jinja2
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template {name}: Jinja syntax error at line {e.lineno}: "
                                f"{_one_line(e)}") from None


def _plain(value: Any) -> Any:
    """What a template may see: JSON-like data only (str, int, float, bool, None, lists, dicts);
    subclasses lose their extra methods, anything else becomes a placeholder "<TypeName>"."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item) and type(value).__module__ == "numpy":
        return _plain(item())
    return f"<{type(value).__name__}>"


def _alias_reasoning(message: dict) -> dict:
    """transformers fills `reasoning_content` from older names of it (and `thinking` for templates
    that read that one)."""
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _one_line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0]
