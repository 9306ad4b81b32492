"""Text in, text out: `Engine.complete(prompt)` and `Engine.chat(messages)` over the token-id API.

A prompt is encoded with the model's tokenizer (ikjax.tokenizer; a chat first rendered by its chat
template, ikjax.chat_template), generated with `Engine.generate`, and the new ids decoded one token
at a time (`Detokenizer`: a character split over several tokens waits for its last byte, so no
delta ever holds half a character). Stop strings (`stop`) end the answer where they begin; the
text that could still become one is held back until it cannot, so no part of a stop string ever
reaches a stream (llama-server's partial-stop rule). Non-streaming calls return a `Completion`;
`stream=True` returns a `TextStream`, an iterator of text deltas whose `finish_reason`, `usage`,
`tokens` and `text` are set once it is exhausted. Streaming asks the engine for one token per
dispatch (`generate(stream=True)`), so deltas come token by token.

finish_reason is OpenAI's: "stop" (EOS, a stop id, a stop string) or "length" (max_tokens, or the
context full). Control tokens (EOS, BOS) are not text: they add nothing to it, as in llama-server.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ikjax.chat_template import (AnswerSplitter, ChatTemplate, ReasoningSplitter, answer_opening, developer_as_system,
                                 flatten_content, opens_reasoning, renders_text_beside_calls, split_prefill)
from ikjax.errors import OptionError
from ikjax.runtime.generation import STOP_EOS, Generation, KVSession
from ikjax.tokenizer import check_text
from ikjax.tool_calls import TOOL_MARKERS, check_tools, partial_suffix, tool_messages

# "cancelled": a stream closed before its end (the server counts such requests under that name)
FINISH_STOP, FINISH_LENGTH, FINISH_CANCELLED = "stop", "length", "cancelled"


@dataclasses.dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens a session's cache already held (not fed again)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclasses.dataclass
class Completion:
    """A finished answer. `text` is everything generated (stop string excluded); for a chat,
    `content` and `reasoning_content` are it split at R1's `</think>` (`reasoning_format`), and
    for a plain completion `content` is `text`."""
    text: str
    tokens: list[int]
    finish_reason: str
    usage: Usage
    content: str = ""
    reasoning_content: str | None = None
    prompt: str | None = None  # the rendered chat prompt (chat only)
    tool_calls: list = dataclasses.field(default_factory=list)  # chat with tools: ikjax.tool_calls.ToolCall each


class StopStrings:
    """Finds stop strings in streamed text: `feed(delta) -> (text to pass on, stopped)`. Text that
    could be the start of a stop string is held back until the next delta decides; `flush()`
    gives it at the end (no stop came). After a stop, nothing more passes."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        text = self._held + delta
        if not self.stops:
            self._held = ""
            return text, False
        hit = min(((i, s) for s in self.stops if (i := text.find(s)) >= 0), default=None)
        if hit is not None:
            self.stopped, self.matched, self._held = True, hit[1], ""
            return text[:hit[0]], True
        keep = partial_suffix(text, self.stops)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self) -> str:
        out, self._held = ("" if self.stopped else self._held), ""
        return out


class TextStream:
    """An iterator of text deltas (str) of one generation; see the module docstring. After the
    last delta: `text`, `tokens`, `finish_reason`, `usage`; `close()` stops it early (a cancelled
    request, finish_reason "cancelled": a session keeps what its cache holds). `reasoning_opened`
    says whether the prompt opened R1's `<think>` block (`ReasoningSplitter(opened=...)` splits the
    deltas); `forced_start` is the opening of a call the chat's `tool_choice` forced, which ends the
    prompt and is the answer's first text (`AnswerSplitter(..., forced=stream.forced_start)` takes both)."""

    def __init__(self, gen: Generation, detok, stops: Sequence[str], *, prompt: str | None = None,
                 reasoning_opened: bool = False, forced_start: str = ""):
        self._gen = gen
        self._detok = detok
        self._stops = StopStrings(stops)
        self.prompt = prompt
        self.reasoning_opened = reasoning_opened
        self.forced_start = forced_start
        self.tokens: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stopping_word = ""  # the stop string that ended it, once it has
        self.usage: Usage | None = None
        self._it = self._run()

    def __iter__(self) -> "TextStream":
        return self

    def __next__(self) -> str:
        return next(self._it)

    def close(self) -> None:
        self._it.close()
        self._gen.close()
        if self.finish_reason is None:  # stopped before its end: not "stop" (a stop string or EOS)
            self.finish_reason = FINISH_CANCELLED
            self._set_usage()

    def _set_usage(self) -> None:
        self.usage = Usage(self._gen.prompt_tokens, len(self.tokens), self._gen.cached_tokens)

    def _run(self) -> Iterator[str]:
        stops = self._stops
        stopped = False
        for tok in self._gen:
            self.tokens.append(tok)
            piece = self._detok.feed(tok)
            if not piece:
                continue
            out, stopped = stops.feed(piece)
            if out:
                self.text += out
                yield out
            if stopped:
                break
        if not stopped:
            out, stopped = stops.feed(self._detok.finish())
            out += stops.flush()
            if out:
                self.text += out
                yield out
        self._gen.close()
        reason = self._gen.stop_reason
        # no reason: the generation was ended from outside (another call took its session over)
        self.stopping_word = (stops.matched or "") if stopped else ""
        self.finish_reason = (FINISH_STOP if stopped or reason == STOP_EOS else
                              FINISH_CANCELLED if reason is None else FINISH_LENGTH)
        self._set_usage()


def _stop_strings(stop) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise OptionError(f"stop: expected a string or a list of strings, got {stop!r}")


def encode_prompt(eng, prompt) -> list[int]:
    """A prompt as ids: text (encoded with BOS as the model asks; a text that already starts with
    the BOS token's text does not get a second one) or a list of ids (as they are)."""
    if isinstance(prompt, str):
        check_text(prompt, "prompt")
        tok = eng.tokenizer
        bos = tok.token_text(tok.bos_id)
        ids = tok.encode(prompt, add_bos=False if bos and prompt.startswith(bos) else None)
        if not ids:
            raise OptionError("prompt: empty (and this model's file adds no BOS token to a prompt)")
        return ids
    if isinstance(prompt, np.ndarray) and prompt.ndim == 1:  # (as generate and logits take them)
        if not np.issubdtype(prompt.dtype, np.integer):  # (5.7 ran as 5, True as 1)
            raise OptionError(f"prompt: token ids must be integers, got an array of {prompt.dtype}")
        return [int(t) for t in prompt]
    if isinstance(prompt, (bytes, Mapping)) or not isinstance(prompt, Sequence):
        raise OptionError(f"prompt: expected text or a list of token ids, got {type(prompt).__name__}")
    return list(prompt)


def complete(eng, prompt, max_tokens: int | None = None, *, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None, stop=None, stream: bool = False,
             repeat_penalty: float = 1.0, repeat_last_n: int = 64, frequency_penalty: float = 0.0,
             presence_penalty: float = 0.0, penalize_nl: bool = False, ignore_eos: bool = False,
             session: KVSession | None = None, _prompt_text: str | None = None,
             _reasoning_opened: bool = False, _keep: frozenset[int] = frozenset(), _forced_start: str = ""):
    """`Engine.complete` (its docstring)."""
    stops = _stop_strings(stop)
    ids = encode_prompt(eng, prompt)
    if max_tokens is None:  # until EOS or the context's end, as llama-server's n_predict -1
        max_tokens = max(eng.options.ctx - len(ids), 0)
    gen = eng.generate(ids, max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                       stream=stream, repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n,
                       frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                       penalize_nl=penalize_nl, ignore_eos=ignore_eos, session=session)
    ts = TextStream(gen, eng.tokenizer.detokenizer(keep=_keep), stops, prompt=_prompt_text,
                    reasoning_opened=_reasoning_opened, forced_start=_forced_start)
    if stream:
        return ts
    for _ in ts:
        pass
    return Completion(ts.text, ts.tokens, ts.finish_reason, ts.usage, content=ts.text, prompt=_prompt_text)


def render_chat(eng, messages, chat_template=None, add_generation_prompt: bool = True,
                template_kwargs: Mapping[str, Any] | None = None, tools: list | None = None,
                tool_choice: Any = None) -> str:
    """The prompt text of a conversation (`_render_chat`'s, with a forced call's opening)."""
    return _render_chat(eng, messages, chat_template, add_generation_prompt, template_kwargs, tools, tool_choice)[0]


def _render_chat(eng, messages, chat_template=None, add_generation_prompt: bool = True,
                 template_kwargs: Mapping[str, Any] | None = None, tools: list | None = None,
                 tool_choice: Any = None) -> tuple[str, str, ChatTemplate, str]:
    """(prompt text, the answer's forced start at its end, the template, the prefill at its end: a
    final assistant message continued, `chat_template.split_prefill`). `chat_template`: a
    ChatTemplate, or a choice for `Engine.chat_template` (None: the model's own); `tools`
    OpenAI's function tools (`chat_template.tool_messages`: in the template's system prompt where
    it does not render them),
    `tool_choice` OpenAI's ("none": the tools are not offered; "required" or one function: the
    text ends with that call's opening, `chat_template.forced_answer_start`)."""
    t = chat_template if isinstance(chat_template, ChatTemplate) else eng.chat_template(chat_template)
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise OptionError("messages: expected a non-empty list of {role, content} objects")
    check_tools(tools, tool_choice)
    if tool_choice == "none":
        tools = None
    if template_kwargs is not None and not isinstance(template_kwargs, Mapping):
        raise OptionError(f"template_kwargs: expected a mapping of names to values, got {type(template_kwargs).__name__}")
    kwargs = dict(template_kwargs or {})
    for k in kwargs:  # (Python's "keywords must be strings" / "got multiple values" before)
        if not isinstance(k, str):
            raise OptionError(f"template_kwargs: names must be strings, got {k!r}")
        if k in ("messages", "add_generation_prompt", "tools"):
            raise OptionError(f"template_kwargs: {k!r} is chat()'s own argument; give it as that")
    if tools:
        kwargs["tools"] = tools
    messages = flatten_content(messages)
    messages, prefill = split_prefill(messages) if add_generation_prompt else (messages, None)
    text = t.render(tool_messages(developer_as_system(messages, t.source), tools, t.source,
                                  tool_choice, keep_text=renders_text_beside_calls(t.source)),
                    add_generation_prompt, **kwargs)
    end = answer_opening(text, t.source, tools, tool_choice, add_generation_prompt, prefill)
    return text + end, ("" if prefill is not None else end), t, prefill or ""


# what chat() passes on to complete(): its sampling and stopping options
_COMPLETE_OPTIONS = frozenset({"temperature", "top_k", "top_p", "min_p", "seed", "stop", "repeat_penalty",
                               "repeat_last_n", "frequency_penalty", "presence_penalty", "penalize_nl", "ignore_eos",
                               "session"})


def chat(eng, messages, max_tokens: int | None = None, *, chat_template=None, reasoning_format: str = "deepseek",
         template_kwargs: Mapping[str, Any] | None = None, stream: bool = False, tools: list | None = None,
         tool_choice: Any = None, **kw):
    """`Engine.chat` (its docstring)."""
    unknown = sorted(set(kw) - _COMPLETE_OPTIONS)
    if unknown:  # (a TypeError naming complete() before)
        raise OptionError(f"chat: unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}")
    if reasoning_format not in ("deepseek", "none"):
        raise OptionError(f"reasoning_format: expected 'deepseek' or 'none', got {reasoning_format!r}")
    prompt, start, t, prefill = _render_chat(eng, messages, chat_template, True, template_kwargs, tools, tool_choice)
    if tool_choice == "none":
        tools = None
    opened = opens_reasoning(prompt[:len(prompt) - len(start)], prefill)
    keep = eng.tokenizer.ids_of(TOOL_MARKERS) if tools else frozenset()  # a call's markers: control tokens
    out = complete(eng, prompt, max_tokens, stream=stream, _prompt_text=prompt, _reasoning_opened=opened,
                   _forced_start=start, _keep=keep, **kw)
    if stream:
        return out
    # the server's split of a chat answer (reasoning, then content without its tool calls)
    answer = AnswerSplitter.for_chat(opened if reasoning_format == "deepseek" else None, tools, t.source, forced=start)
    (r0, c0), (r, c) = answer.opening, answer.feed(out.text)
    r2, c2, out.tool_calls = answer.finish()
    out.content = c0 + c + c2
    out.reasoning_content = (r0 + r + r2) if answer.had_reasoning and r0 + r + r2 else None
    return out


__all__ = ["Completion", "FINISH_LENGTH", "FINISH_STOP", "ReasoningSplitter", "StopStrings", "TextStream", "Usage",
           "chat", "complete", "encode_prompt", "render_chat"]
