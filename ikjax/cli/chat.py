"""`ikjax chat`: a conversation on the terminal, as llama-cli -cnv.

Each line read is a user turn; the conversation so far is rendered by the model's chat template
(`--chat-template` picks another) and the answer streamed to stdout token by token. The KV cache
is kept between turns (`Engine.session`): the next prompt repeats the conversation, and only what
follows the longest prefix the cache already holds is fed (R1's template drops an answer's
`<think>` block from the history, so that answer is fed again, as with llama.cpp).

A conversation that outgrows `-c` goes on: before a turn, the oldest exchanges (after a system
prompt) are dropped until the conversation leaves room for an answer (a quarter of `-c`, or `-n`,
at most half), as llama-cli's context shift lets a chat go on; the shortened conversation is then
fed again.

Ctrl-C during an answer stops that answer (what was said stays in the conversation) and returns to
the prompt; Ctrl-C at the prompt, or end of input (Ctrl-D), ends the chat. A line ending in `\\`
continues on the next line. Notes, the template's name and the closing summary go to stderr.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from typing import Annotated, Optional

import typer

from ikjax import interrupt
from ikjax.cli.common import (Escape, FrequencyPenalty, PenalizeNl, MinP, PresencePenalty, RepeatLastN, RepeatPenalty, Seed, Temp, TopK, TopP,
                              app, handle, announce_seed, ik_sampling, ik_seed, load_engine, log, process_escapes, read_prompt_file,
                              setup_compile_cache, template_choice)
from ikjax.cli.parser import EXIT_INTERRUPTED, ExactCommand
from ikjax.cli.run_options import RunArgs, check_options, takes_run_options
from ikjax.errors import ContextFullError, OptionError


@app.command("chat", cls=ExactCommand)
@handle
@takes_run_options(after={"prompt": "model", "n_predict": "wb"})
def chat(
    run: RunArgs,
    prompt: Annotated[str, typer.Option("-p", "--prompt", help="first user message")] = "",
    file: Annotated[Optional[str], typer.Option("-f", "--file", help="first user message from a file")] = None,
    system_prompt: Annotated[str, typer.Option("-sys", "--system-prompt", help="system message")] = "",
    chat_template: Annotated[Optional[str], typer.Option(
        "--chat-template", metavar="NAME|FILE",
        help="chat template: a builtin name (deepseek3, deepseek-r1, deepseek2, chatml, kimi-k2, chatglm4) or "
        "a file holding a Jinja template; default: the model file's own (else a builtin chosen from its "
        "pre-tokenizer)")] = None,
    chat_template_file: Annotated[Optional[str], typer.Option(
        "--chat-template-file", metavar="FILE", help="a Jinja chat template file (llama-cli's flag: always the "
        "file, even one named like a builtin)")] = None,
    conversation: Annotated[bool, typer.Option("-cnv", "--conversation", help="conversation mode (always on)")] = True,
    jinja: Annotated[bool, typer.Option("--jinja", help="Jinja chat templates (always on)")] = True,
    n_predict: Annotated[int, typer.Option("-n", "--n-predict", help="most tokens an answer may have "
                                           "(-1 = until EOS or the context's end)")] = -1,
    temp: Temp = 0.8,
    top_k: TopK = 40,
    top_p: TopP = 0.95,
    min_p: MinP = 0.05,
    seed: Seed = None,
    repeat_penalty: RepeatPenalty = 1.0,
    repeat_last_n: RepeatLastN = 64,
    presence_penalty: PresencePenalty = 0.0,
    frequency_penalty: FrequencyPenalty = 0.0,
    penalize_nl: PenalizeNl = False,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="never end an answer on EOS")] = False,
    reverse_prompt: Annotated[Optional[list[str]], typer.Option(
        "-r", "--reverse-prompt", help="stop an answer at this text (may repeat)")] = None,
    escape: Escape = True,
) -> None:
    """Chat with a model on the terminal (like llama-cli -cnv): streamed answers, multi-turn with the KV cache
    kept, Ctrl-C stops an answer; Ctrl-C at the prompt or Ctrl-D ends."""
    from ikjax.chat_template import check_choice
    from ikjax.runtime.sampling import check_penalty, check_sampling
    from ikjax.tokenizer import check_text
    # every value checked before the model loads
    chat_template = template_choice(chat_template, chat_template_file)
    check_choice(chat_template)
    temp, top_k, top_p = ik_sampling(temp, top_k, top_p)
    seed, drawn = ik_seed(seed)  # (a drawn one is printed once the model loaded: a refused command prints none)
    check_sampling(temp, top_k, top_p, min_p, seed)
    check_penalty(repeat_penalty, repeat_last_n, frequency_penalty, presence_penalty, penalize_nl)
    if n_predict == -2:  # llama-cli's "until the context is filled": what -1 does here (as generate)
        n_predict = -1
    if n_predict < -1:
        raise OptionError(f"n-predict: need >= -1 (-1 = no limit), got {n_predict}")
    first = prompt or None
    if file is not None:
        if prompt:  # (the file won silently; generate refuses the pair the same way)
            raise OptionError("prompt: give -p TEXT or -f FILE, not both")
        first = read_prompt_file(file)
    if escape:  # llama-cli's default (-e)
        first = process_escapes(first) if first else first
        system_prompt = process_escapes(system_prompt)
        reverse_prompt = [process_escapes(r) for r in reverse_prompt] if reverse_prompt else reverse_prompt
    for what, text in (("prompt", first), ("system-prompt", system_prompt)):
        if text:
            check_text(text, what)
    run_opts, _ = check_options(run, "chat")
    setup_compile_cache(run.compile_cache_dir)
    from ikjax.cli import tty_input
    # a terminal raw from here to the end, as llama-cli's: a line typed during the load or an answer
    # is not cut at the tty's 4095 bytes (tty_input's why); its settings restored however this ends
    with tty_input.raw_session(_tty_fd(sys.stdin)):
        eng = load_engine(run.model, run.verbose, **run_opts)
        announce_seed(seed, drawn)
        template = eng.chat_template(chat_template)
        log(f"chat template: {template.name}")
        sampling = dict(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                        repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n,
                        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                        penalize_nl=penalize_nl, ignore_eos=ignore_eos, stop=list(reverse_prompt or []))
        Chat(eng, template, sampling, None if n_predict < 0 else n_predict, system_prompt, run.verbose).run(first)


class Chat:
    """The conversation and its KV session; `run` reads turns until the end of input."""

    def __init__(self, eng, template, sampling: dict, max_tokens: int | None, system_prompt: str, verbose: bool):
        self.eng, self.template, self.sampling, self.max_tokens = eng, template, sampling, max_tokens
        self.session = eng.session()
        self.messages: list[dict] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        if system_prompt:  # llama-cli refuses a start prompt that leaves no room, before any input
            ctx = eng.options.ctx
            try:
                n = self._tokens(self.messages + [{"role": "user", "content": "."}])
            except OptionError:  # (a template that refuses this probe: the turns say so themselves)
                n = 0
            if n > ctx - 4:  # (every message was dropped as "too long" after it, without end)
                raise OptionError(f"system-prompt: it is {n} tokens with the template, more than -c {ctx} holds "
                                  f"(a shorter one, or a larger -c)")
        self.verbose = verbose
        self.turns = self.prompt_tokens = self.cached_tokens = self.generated = 0
        self.gen_seconds = 0.0
        self._stop_requested = False

    def run(self, first: str | None) -> None:
        log("chat: Enter sends a message (a line ending in \\ continues it); Ctrl-C stops an answer; "
            "Ctrl-C at the prompt or Ctrl-D ends")
        try:
            while True:
                interrupt.check()  # a Ctrl-C outside an answer that JAX swallowed ends it (ikjax/interrupt.py)
                if first is not None:
                    user, first = first, None
                    _out(f"> {user}\n")
                else:
                    user = self.read_user()
                    if user is None:
                        break
                if not user.strip():
                    continue
                self.turn(user)
        finally:
            self.summary()

    def read_user(self) -> str | None:
        """One message from stdin (None: end of input, or Ctrl-C at the prompt)."""
        lines: list[str] = []
        while True:
            _out("> " if not lines else "")
            try:  # a closed stdin (`<&-`: sys.stdin is None) is the end of input, as llama-cli reads it
                line = _read_line()
            except KeyboardInterrupt:
                _out("\n")
                raise typer.Exit(EXIT_INTERRUPTED) from None
            if not line:  # EOF
                _out("\n")
                return "\n".join(lines) if lines else None
            line = line.rstrip("\r\n")
            if line.endswith("\\"):
                lines.append(line[:-1])
                continue
            lines.append(line)
            return "\n".join(lines)

    def _tokens(self, messages: list[dict]) -> int:
        """A rendered conversation's length in tokens, as a turn's prompt."""
        from ikjax.runtime.text import encode_prompt, render_chat
        return len(encode_prompt(self.eng, render_chat(self.eng, messages, self.template)))

    def fit(self) -> int:
        """Drop the oldest exchanges (a user message and what follows it up to the next one; a system
        prompt stays) until the conversation leaves room for an answer; how many were dropped."""
        ctx = self.eng.options.ctx
        room = min(self.max_tokens or ctx // 4, ctx // 2)
        head = 1 if self.messages and self.messages[0].get("role") == "system" else 0
        if self._tokens(self.messages) <= ctx - room:  # (the usual turn: one render, nothing dropped)
            return 0
        if self._tokens(self.messages[:head] + self.messages[-1:]) > ctx:
            return 0  # the message cannot fit on its own: `turn` drops it, the conversation stays
        dropped = 0
        while len(self.messages) - head > 1 and self._tokens(self.messages) > ctx - room:
            del self.messages[head]
            while len(self.messages) - head > 1 and self.messages[head].get("role") != "user":
                del self.messages[head]
            dropped += 1
        return dropped

    def turn(self, user: str) -> None:
        """Render the conversation with the new message, stream the answer; Ctrl-C ends it early.
        A message that cannot be sent (bytes that are not UTF-8, a template that fails on it, a
        conversation past -c) is dropped with a note; the conversation goes on (it ended the program)."""
        from ikjax.tokenizer import check_text
        try:
            check_text(user, "message")
        except OptionError as e:
            log(f"[message dropped: {str(e).splitlines()[0]}; send it again]")
            return
        self.messages.append({"role": "user", "content": user})
        try:
            dropped = self.fit()  # (it renders: a template that refuses this message raised out of the chat)
            if dropped:
                log(f"[context: the oldest {dropped} exchange{'s' if dropped > 1 else ''} dropped to fit -c "
                    f"{self.eng.options.ctx}]")
            stream = self.eng.chat(self.messages, self.max_tokens, chat_template=self.template, stream=True,
                                   session=self.session, **self.sampling)
        except ContextFullError as e:  # the turn is dropped, the conversation goes on (it ended the program)
            self.messages.pop()
            log(f"[message dropped: the conversation with it is {e.tokens} tokens, more than -c {e.ctx} holds; "
                f"send a shorter one, or restart with a larger -c]")
            return
        except OptionError as e:  # e.g. the template raised on this conversation
            self.messages.pop()
            log(f"[message dropped: {str(e).splitlines()[0]}]")
            return
        t0 = time.perf_counter()
        interrupted = False
        previous = signal.signal(signal.SIGINT, self._on_sigint)
        self._stop_requested = False
        try:
            for delta in stream:
                _out(delta)
                if self._stop_requested:
                    interrupted = True
                    break
        finally:
            stream.close()
            signal.signal(signal.SIGINT, previous)
        if not interrupted and getattr(stream, "stopping_word", ""):
            _out(stream.stopping_word)  # the reverse prompt shown as generated, as llama-cli shows it
        _out("\n")
        u = stream.usage
        if interrupted:
            log("[answer stopped]")
        elif stream.finish_reason == "length" and (self.max_tokens is None or u.completion_tokens < self.max_tokens):
            # (the answer just stopped, and only -v said why; ik shifts the context and goes on)
            log(f"[answer stopped: the context (-c {self.eng.options.ctx}) is full; later turns drop the oldest "
                f"exchanges]")
        self.messages.append({"role": "assistant", "content": stream.text})
        self.turns += 1
        self.prompt_tokens += u.prompt_tokens
        self.cached_tokens += u.cached_tokens
        self.generated += u.completion_tokens
        self.gen_seconds += time.perf_counter() - t0
        if self.verbose:
            log(f"turn {self.turns}: prompt {u.prompt_tokens} tokens ({u.cached_tokens} from the cache), "
                f"answer {u.completion_tokens} tokens, {stream.finish_reason}")

    def _on_sigint(self, signum, frame) -> None:
        """Ctrl-C during an answer: stop it after the token in flight; a second one ends the program."""
        if self._stop_requested:
            raise KeyboardInterrupt
        self._stop_requested = True

    def summary(self) -> None:
        if not self.turns:
            return
        rate = f", {self.generated / self.gen_seconds:.2f} t/s with the prompts" if self.gen_seconds > 0 else ""
        log(f"chat: {self.turns} turns; prompt tokens {self.prompt_tokens} ({self.cached_tokens} reused from the "
            f"KV cache, {self.prompt_tokens - self.cached_tokens} fed); {self.generated} tokens generated{rate}")


def _read_line() -> str:
    """One line of stdin ("" at its end), its bytes decoded as UTF-8 with any others kept as lone
    surrogates (PEP 383), which `turn` names and drops: a text-mode stdin under a UTF-8 locale
    raised UnicodeDecodeError mid-conversation on a Latin-1 byte, ending the chat."""
    if sys.stdin is None:
        return ""
    raw = getattr(sys.stdin, "buffer", None)
    if raw is None:  # a replaced stdin (tests, embedding): already text
        return sys.stdin.readline()
    fd = _tty_fd(sys.stdin)
    if fd is not None:  # a terminal: read past its 4095-byte line (tty_input's why)
        from ikjax.cli import tty_input
        sys.stdout.flush()
        out = _tty_fd(sys.stdout)
        return tty_input.read_line(fd, out if out is not None else fd).decode("utf-8", errors="surrogateescape")
    return raw.readline().decode("utf-8", errors="surrogateescape")


def _tty_fd(stream) -> int | None:
    """The stream's descriptor where it is a terminal, else None."""
    try:
        fd = stream.fileno()
        return fd if os.isatty(fd) else None
    except (AttributeError, OSError, ValueError):
        return None


def _out(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
