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
(`tokenizer.ggml.pre`): deepseek-v3 -> `deepseek-r1` where the file names itself R1
(`general.name` / `general.basename`), else `deepseek3`. `deepseek-r1` is DeepSeek-R1's own template,
byte for byte, whose generation prompt opens a `<think>` block; `deepseek3` is ikjax's own text of
the V3 turn format with the plain generation prompt `<｜Assistant｜>` (a V3 answer would otherwise all
be read as reasoning): every system message kept (joined by blank lines, where R1's first template
kept the last), an assistant turn's text before its calls, every calls section closed, and a second
call turn and its outputs opened again (R1's first template wrote neither), as DeepSeek's later V3
templates render them. deepseek-llm -> `deepseek2`
(DeepSeek-V2-Chat's), kimi-k2 -> `kimi-k2` (Kimi K2 / Moonlight turns: `<|im_user|>user<|im_middle|>
... <|im_end|>`), glm4 -> `chatglm4` (`[gMASK]<sop><|user|>\n...`, GLM-4.x; files from GLM's
converter add no BOS, the template writes `[gMASK]<sop>`), anything else -> `chatml`. The kimi-k2
and chatglm4 texts are llama.cpp's builtins of those names. The names are llama-server's `--chat-template`
names; `--chat-template` also takes a FILE holding a Jinja template (or the template text itself,
as llama-server does with --jinja).

`split_reasoning` / `ReasoningSplitter` are llama-server's `--reasoning-format deepseek`: the text
of a `<think>…</think>` block is returned apart (`reasoning_content`), stripped, and the answer
after it (`content`) without the spaces that follow `</think>`.

`AnswerSplitter` splits a chat answer into reasoning, content and tool calls (ikjax.tool_calls) on
a stream, the same way for a whole answer.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Mapping

from ikjax.errors import OptionError
from ikjax.tool_calls import ToolCall, ToolCallSplitter, forced_call, partial_suffix, tool_family

log = logging.getLogger("ikjax")

_TEMPLATES = Path(__file__).resolve().parent / "templates"
# llama-server's names -> the template files shipped in ikjax/templates
BUILTINS: dict[str, str] = {"deepseek3": "deepseek3.jinja", "deepseek-r1": "deepseek-r1.jinja", "deepseek2": "deepseek2.jinja",
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
            chat.append(_alias_reasoning(_plain(m, f"messages[{i}]")))
        variables = {"tools": None, "documents": None, **_plain(kwargs, "the template's variables")}
        try:
            return _bounded(self._template, self.name, messages=chat,
                            add_generation_prompt=bool(add_generation_prompt), **variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:  # raise_exception, undefined fields, sandbox refusals
            raise ChatTemplateError(f"chat template {self.name}: {_one_line(e)}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError,
                RecursionError) as e:  # e.g. str + list content; range(10**9); {{ 1/0 }} in a template
            raise ChatTemplateError(f"chat template {self.name}: cannot render these messages "
                                    f"({type(e).__name__}: {_one_line(e)})") from None

    def __repr__(self) -> str:
        return f"ChatTemplate({self.name!r})"


# What one render may make and take: a model file's template is untrusted text, and nested loops
# (`range(99999)` in `range(99999)`) passed the sandbox's range cap and grew the process by
# ~125 MB/s until it was killed (an outside probe, stop 67); loops that print nothing, and strings
# doubled in a namespace, passed a check made only at each piece of output (stop 69). A prompt that
# fits any context is far below these.
MAX_RENDER_CHARS = 32 << 20
MAX_RENDER_SECONDS = 10.0
MAX_RENDER_GROWTH = 1 << 30  # bytes the process may grow by while one template renders


def _refuse(name: str, what: str):
    return ChatTemplateError(f"chat template {name}: {what}; refused (a template that loops without end?)")


def _peak_rss() -> int:
    """The process's peak resident bytes (one system call: cheap enough for every few lines)."""
    import resource
    import sys
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib if sys.platform == "darwin" else kib * 1024


def _bounded(template, name: str, **variables) -> str:
    """`template.render(**variables)`, refused (ChatTemplateError) past MAX_RENDER_CHARS of output,
    MAX_RENDER_SECONDS, or MAX_RENDER_GROWTH of the process's memory. Why a trace function: a
    template's loops are Python loops in its compiled code, and only a check inside them (at each
    line that code runs; other code runs untraced) stops one that never writes output. Strings a
    single operation would make too long are refused by the environment (`_Environment`)."""
    import sys
    import time
    parts, size, t0, rss0 = [], 0, time.monotonic(), _peak_rss()
    ticks = [0]

    def line(frame, event, arg):
        ticks[0] += 1
        if ticks[0] & 7 == 0:  # every 8th line: a loop's iteration runs 3 or more
            if time.monotonic() - t0 > MAX_RENDER_SECONDS:
                raise _refuse(name, f"rendering took over {MAX_RENDER_SECONDS:g} s")
            if _peak_rss() - rss0 > MAX_RENDER_GROWTH:
                raise _refuse(name, f"rendering grew the process by over {MAX_RENDER_GROWTH >> 30} GiB")
        return line

    def call(frame, event, arg):
        return line if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(call)
    try:
        for piece in template.generate(**variables):
            parts.append(piece)
            size += len(piece)
            if size > MAX_RENDER_CHARS:
                raise _refuse(name, f"its output passed {MAX_RENDER_CHARS >> 20} Mi characters")
    except MemoryError:
        raise _refuse(name, "out of memory while rendering") from None
    finally:
        sys.settrace(previous)
    return "".join(parts)


def builtin(name: str) -> ChatTemplate:
    """A shipped template by its llama-server name."""
    if name not in BUILTINS:
        raise OptionError(f"chat template {name!r}: unknown name (builtin: {', '.join(BUILTINS)}; or give a file "
                          f"holding a Jinja template)")
    return ChatTemplate((_TEMPLATES / BUILTINS[name]).read_text(encoding="utf-8"), name)


def fallback_name(metadata: Mapping[str, Any]) -> str:
    """The builtin a file without a template gets, from its pre-tokenizer (and, for DeepSeek-V3's,
    whether the file names itself R1: R1 opens its answer with reasoning, V3 does not)."""
    name = FALLBACKS.get(str(metadata.get("tokenizer.ggml.pre", "")), DEFAULT_FALLBACK)
    if name == "deepseek3" and _names_r1(metadata):
        return "deepseek-r1"
    return name


def _names_r1(metadata: Mapping[str, Any]) -> bool:
    """`general.name` or `general.basename` names an R1 ("DeepSeek-R1-0528", "deepseek_r1", "R1")."""
    return any(re.search(r"(?:^|[^a-z0-9])r1(?:$|[^a-z0-9])", str(metadata.get(k, "")).lower())
               for k in ("general.name", "general.basename"))


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


@functools.lru_cache(maxsize=16)  # one probe a template text
def renders_text_beside_calls(source: str) -> bool:
    """Whether the template renders an assistant turn's text and its tool calls together (DeepSeek
    V3-0324's and V3.1's do; R1's first renders the calls only where the content is none, the text
    only where it is not). Found by rendering a probe turn with both; a template that fails on it
    counts as no (its turn then goes with content None, as before)."""
    probe = [{"role": "user", "content": "u"},
             {"role": "assistant", "content": "ikjaxprobetext",
              "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "ikjaxprobefn", "arguments": "{}"}}]}]
    try:
        out = _bounded(_compile(source, "probe"), "probe", messages=probe, add_generation_prompt=False, tools=None,
                       documents=None, bos_token="", eos_token="")
    except Exception:  # noqa: BLE001 - any failure of the probe means: do not rely on it
        return False
    return "ikjaxprobetext" in out and "ikjaxprobefn" in out


def developer_as_system(messages: list[dict], source: str) -> list[dict]:
    """OpenAI's `developer` role (its newer name for system instructions) as `system`, for a
    template that knows no `developer` (DeepSeek's, Kimi's, GLM's: they would drop the message and
    its text with it)."""
    if "developer" in source:
        return messages
    return [dict(m, role="system") if m.get("role") == "developer" else m for m in messages]


def join_text_parts(texts: Iterable[str]) -> str:
    """A message's text parts as one string, as llama-server joins a text-only model's parts: a
    newline before a part once text has gathered (an empty first part adds none)."""
    out = ""
    for t in texts:
        out = out + "\n" + t if out else t
    return out


def text_of_parts(parts: list, i: int) -> str:
    """messages[i]'s content parts (OpenAI's `{"type": "text", "text": ...}`) as one string
    (`join_text_parts`); ChatTemplateError naming the first part that is not text, or a text part
    without its text. The one check of the Python API (`flatten_content`) and the server."""
    texts = []
    for j, part in enumerate(parts):
        if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
            continue
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        if kind == "text":  # (stop 64's probe: "only text parts are supported, got 'text'")
            raise ChatTemplateError(f"messages[{i}].content[{j}]: a text part needs a string 'text'")
        raise ChatTemplateError(f"messages[{i}].content[{j}]: only text parts are supported, got {kind!r}")
    return join_text_parts(texts)


# the roles a chat message may have (OpenAI's; `developer` is read as `system`): the templates drop
# any other role's message without a word, so the answer would come as if it had not been sent
ROLES = ("system", "developer", "user", "assistant", "tool")


def flatten_content(messages: Iterable[Mapping[str, Any]]) -> list[dict]:
    """Messages whose `content` is a list of OpenAI content parts (`{"type": "text", "text": ...}`)
    with the text parts joined by newlines, as llama-server does for a text-only model: DeepSeek's
    templates concatenate `content` as a string. A part of another type is refused by name, and so
    is a message that is not an object or has no role (a template renders nothing for it)."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):  # ("hi" as a message was a ValueError from dict())
            raise ChatTemplateError(f"messages[{i}]: expected an object with role and content, got {type(m).__name__}")
        m = dict(m)
        if not isinstance(m.get("role"), str) or not m["role"]:  # (a template drops it: the text vanished)
            raise ChatTemplateError(f"messages[{i}].role: expected a string such as \"user\", got {m.get('role')!r}")
        if m["role"] not in ROLES:  # a template drops a role it does not know: the message would vanish unseen
            raise ChatTemplateError(f"messages[{i}].role: expected one of {', '.join(ROLES)}, got {m['role']!r}"[:300])
        c = m.get("content")
        if isinstance(c, list):
            m["content"] = text_of_parts(c, i)
        elif c is None:  # absent or null: empty text, as the server reads it (the template failed on it), but
            # kept None beside tool_calls: R1's template tells an assistant's call turn by it
            m["content"] = None if m["role"] == "assistant" and m.get("tool_calls") else ""
        elif not isinstance(c, str):
            raise ChatTemplateError(f"messages[{i}].content: expected a string or a list of text parts, got "
                                    f"{type(c).__name__}")
        out.append(m)
    return out


def forced_answer_start(prompt: str, source: str, tool_choice: Any) -> str:
    """What a chat prompt (rendered with the generation prompt by the template of Jinja text
    `source`) is followed by when `tool_choice` requires a call (`tool_calls.forced_call`): the
    call section's opening, after a closed `</think>` where the prompt opened R1's reasoning (a
    call comes after the thinking, and a forced one leaves none). "" when nothing is forced."""
    call = forced_call(tool_choice, tool_family(source))
    if not call:
        return ""
    return f"{THINK_CLOSE}\n\n{call}" if opens_reasoning(prompt) else call


def opens_reasoning(prompt: str, prefill: str = "") -> bool:
    """Whether a rendered prompt ends inside an open `<think>` block (R1's generation prompt
    `<｜Assistant｜><think>\\n`): the answer then starts with reasoning and has no opening tag.
    `prefill`: the end of `prompt` that is an assistant prefill (`split_prefill`), whose own tags
    say where it leaves the block (its text is the model's, so a tag there is one)."""
    if prefill:
        o, c = prefill.rfind(THINK_OPEN), prefill.rfind(THINK_CLOSE)
        if o >= 0 or c >= 0:
            return o > c
        prompt = prompt[:len(prompt) - len(prefill)]
    return prompt.rstrip().endswith(THINK_OPEN)


def answer_opening(text: str, source: str, tools, tool_choice: Any, add_generation_prompt: bool,
                   prefill: str | None) -> str:
    """What a rendered chat prompt ends with after the template's text: a prefill as given (the
    answer continues it), else the opening of a call `tool_choice` forces (`forced_answer_start`),
    else nothing. One rule for the server and `eng.chat`."""
    if prefill is not None:
        return prefill
    return forced_answer_start(text, source, tool_choice) if tools and add_generation_prompt else ""


def split_prefill(messages: list, continue_final: bool | None = None) -> tuple[list, str | None]:
    """llama-server's assistant prefill (ik_llama.cpp's too): a final assistant message without
    tool calls is the start of the answer, continued, not a closed turn. Returns (the messages
    before it, its text), to be rendered with the generation prompt and the text appended; the
    answer then holds only what follows it. (messages, None) where there is nothing to continue,
    or `continue_final` is False (vLLM's `continue_final_message: false`: the message stays a turn
    and a new answer follows it). Two assistant messages at the end are refused, as there."""
    if continue_final is False or not messages or messages[-1].get("role") != "assistant" \
            or messages[-1].get("tool_calls"):
        return messages, None
    if len(messages) > 1 and messages[-2].get("role") == "assistant":
        raise ChatTemplateError("messages: two assistant messages at the end; the last one is continued as the "
                                "answer's start (a prefill), so the one before it has no turn to end")
    text = messages[-1].get("content")
    return messages[:-1], text if isinstance(text, str) else ""


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
                keep = partial_suffix(buf, (THINK_CLOSE,))
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


class AnswerSplitter:
    """A chat answer as the endpoints return it, from its text deltas: R1's reasoning
    (`ReasoningSplitter`, when `opened` is not None: whether the prompt opened the `<think>` block),
    then the content with the tool calls taken out (`ToolCallSplitter`, when `tools`: in the syntax
    of `family` only and calling only `names`, where given). `forced`: the opening of a call the
    prompt ended with (`forced_answer_start`), read as the answer's first text; if no call comes of
    it, it is not content either (the model never wrote it).
    `feed(delta) -> (reasoning_delta, content_delta)`; `finish() -> (reasoning_delta,
    content_delta, calls)`. A whole answer is the deltas joined: one code path for both."""

    def __init__(self, opened: bool | None, tools: bool, *, family: str | None = None, names=None,
                 forced: str = ""):
        self._reasoning = ReasoningSplitter(opened=opened) if opened is not None else None
        self._tools = ToolCallSplitter(family, names) if tools else None
        self._forced = forced.split(THINK_CLOSE)[-1].lstrip() if tools else ""
        # the forced text is the prompt's, never the model's: nothing of it shows (its call markers are
        # held as a call; with reasoning_format "none" its `</think>` would otherwise come out as content)
        self.opening = (self.feed(forced)[0], "") if forced else ("", "")

    @classmethod
    def for_chat(cls, opened: bool | None, tools: list | None, source: str, forced: str = "") -> "AnswerSplitter":
        """The splitter of a chat answer whose prompt the template of Jinja text `source` rendered
        with `tools` offered (None: none): calls in its family's syntax, of those tools only."""
        return cls(opened, tools=bool(tools), family=tool_family(source),
                   names=[t["function"]["name"] for t in tools or ()], forced=forced)

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
        if self._forced and not calls and self._forced in rest:  # a forced call left unfinished
            rest = rest.replace(self._forced, "", 1)
        return r, c + rest, calls


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

    class _Environment(ImmutableSandboxedEnvironment):
        """The sandbox, with `*`, `+`, `**` and `~` refused where one would make a string or list
        past MAX_RENDER_CHARS (`'x' * 10**10` was a raw MemoryError; `2 ** 10**10` holds the CPU in
        one C call no trace function sees)."""
        intercepted_binops = frozenset({"*", "+", "**"})

        def call_binop(self, context, operator, left, right):
            if operator == "**":
                if isinstance(right, int) and isinstance(left, (int, float)) and abs(right) > 4096 \
                        and abs(left) not in (0, 1):
                    raise jinja2.exceptions.SecurityError(f"{left!r} ** {right}: a power too large to compute")
                return super().call_binop(context, operator, left, right)
            if operator == "*":
                n, seq = (right, left) if isinstance(right, int) else (left, right)
                if isinstance(n, int) and isinstance(seq, (str, list, tuple)) and len(seq) * n > MAX_RENDER_CHARS:
                    raise jinja2.exceptions.SecurityError(f"a repetition of {len(seq)} x {n}: too long")
            out = super().call_binop(context, operator, left, right)
            if isinstance(out, (str, list, tuple)) and len(out) > MAX_RENDER_CHARS:
                raise jinja2.exceptions.SecurityError(f"a result of {len(out)} items: too long")
            return out

        def from_string(self, source, *args, **kwargs):
            template = super().from_string(source, *args, **kwargs)
            namespace = template.root_render_func.__globals__  # the compiled module's names
            for join in ("str_join", "markup_join"):
                if join in namespace:
                    namespace[join] = _bounded_join(namespace[join])
            return template

    def _bounded_filter(f, name):
        @functools.wraps(f)  # (keeps jinja's pass_context / pass_eval_context mark)
        def bounded(*args, **kwargs):
            out = f(*args, **kwargs)
            if isinstance(out, (str, list, tuple)) and len(out) > MAX_RENDER_CHARS:
                raise jinja2.exceptions.SecurityError(f"|{name}: a result of {len(out)} items: too long")
            return out
        return bounded

    def _bounded_join(join):
        def bounded(seq):
            out = join(seq)
            if len(out) > MAX_RENDER_CHARS:
                raise jinja2.exceptions.SecurityError(f"a concatenation of {len(out)} characters: too long")
            return out
        return bounded

    env = _Environment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
    env.globals.pop("lipsum", None)  # (lipsum(300000) took 36 s in one call)
    for name, f in list(env.filters.items()):  # `|replace('a', 'aa')` in a loop doubles a string too
        env.filters[name] = _bounded_filter(f, name)
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


# what a template may see nests at most this deep (a tool's JSON schema: a few levels): deeper data is
# refused by name, where the copy below recursed until Python's limit and the server answered a 500
# with a 2,900-line traceback in its log
MAX_DEPTH = 64


def _plain(value: Any, where: str = "value", depth: int = 0) -> Any:
    """What a template may see: JSON-like data only (str, int, float, bool, None, lists, dicts);
    subclasses lose their extra methods, anything else becomes a placeholder "<TypeName>".
    Nested deeper than MAX_DEPTH: a ChatTemplateError naming `where`."""
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
    if isinstance(value, (Mapping, tuple, list)) and depth >= MAX_DEPTH:
        raise ChatTemplateError(f"{where}: nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, Mapping):
        return {_plain(k, where, depth + 1): _plain(v, where, depth + 1) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain(v, where, depth + 1) for v in value)
    if isinstance(value, list):
        return [_plain(v, where, depth + 1) for v in value]
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item) and type(value).__module__ == "numpy":
        return _plain(item(), where, depth)
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
