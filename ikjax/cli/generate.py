"""`ikjax generate`: text from a prompt, streamed to stdout (like llama-cli -p ... -n ...).

The shared run options plus the prompt and sampling flags. Every step the run will need is compiled
before the timer starts (`_generate_shapes` mirrors how the engine chunks a prompt and the decode
loop), so the speed line on stderr times the prompt and the generated tokens apart, compilation
excluded.
"""
from __future__ import annotations

import sys
import time
from typing import Annotated, Optional

import typer

from ikjax import interrupt
from ikjax.cli.common import (Escape, FrequencyPenalty, PenalizeNl, MinP, PresencePenalty, Progress, RepeatLastN, RepeatPenalty, Seed, Temp,
                              TopK, TopP, app, batch_invariance, compiled_line, handle, load_engine, log,
                              announce_seed, ik_sampling, ik_seed, process_escapes, read_prompt_file, setup_compile_cache)
from ikjax.cli.parser import ExactCommand
from ikjax.cli.run_options import RunArgs, check_options, takes_run_options
from ikjax.errors import OptionError


_EMPTY_PROMPT = "prompt: empty (give -p TEXT or -f FILE; this model adds no BOS token to a prompt)"


@app.command("generate", cls=ExactCommand)
@handle
@takes_run_options(after={"prompt": "model", "file": "prompt", "no_echo": "wb"})
def generate(
    run: RunArgs,
    prompt: Annotated[str, typer.Option("-p", "--prompt", help="prompt text")] = "",
    file: Annotated[Optional[str], typer.Option("-f", "--file", help="prompt text from a file (UTF-8)")] = None,
    n_predict: Annotated[int, typer.Option("-n", "--n-predict", help="tokens to generate (-1 = until EOS or the "
                                           "context's end)")] = 128,
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
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="never stop on EOS (it is never drawn)")] = False,
    reverse_prompt: Annotated[Optional[list[str]], typer.Option(
        "-r", "--reverse-prompt", "--stop", help="stop when the text reaches this string, printed as llama-cli "
        "prints it (may repeat)")] = None,
    no_echo: Annotated[bool, typer.Option("--no-echo", "--no-display-prompt", help="don't print the prompt")] = False,
    escape: Escape = True,
    batch_invariant: Annotated[Optional[bool], typer.Option(
        "--batch-invariant/--no-batch-invariant", help="decode in the batch-invariant form `serve` uses by default "
        "(the same greedy tokens as a server answer, bit for bit; ~8 % slower on a GPU); default off, or as "
        "IKJAX_BATCH_INVARIANT says (not an ik flag)")] = None,
) -> None:
    """Generate text from a prompt, streamed to stdout (like llama-cli -p ... -n ...).

    The steps the run needs are compiled first (progress on stderr); the speed line on stderr times
    the prompt and the generated tokens apart, without compilation."""
    from ikjax.tokenizer import GGUFTokenizer, check_text
    if n_predict == -2:  # llama-cli's "until the context is filled": what -1 does here
        n_predict = -1
    if n_predict < -1:
        raise OptionError(f"n-predict: need >= 0 (or -1 / -2: until EOS or the context's end), got {n_predict}")
    temp, top_k, top_p = ik_sampling(temp, top_k, top_p)
    seed, drawn = ik_seed(seed)  # (a drawn one is printed once the model loaded: a refused command prints none)
    if file is not None:  # llama-cli's -f
        if prompt:
            raise OptionError("prompt: give -p TEXT or -f FILE, not both")
        prompt = read_prompt_file(file)
    if escape:  # llama-cli's default (-e): the prompt's and the reverse prompts' escapes processed
        prompt = process_escapes(prompt)
        reverse_prompt = [process_escapes(r) for r in reverse_prompt] if reverse_prompt else reverse_prompt
    check_text(prompt, "prompt")  # before loading: a prompt that is not UTF-8 is refused at once
    from ikjax.runtime.sampling import check_penalty
    penalties = check_penalty(repeat_penalty, repeat_last_n, frequency_penalty, presence_penalty, penalize_nl)
    run_opts, _ = check_options(run, "generate")
    batch_invariance(batch_invariant, default=False)
    setup_compile_cache(run.compile_cache_dir)
    from ikjax.runtime.sampling import check_sampling  # before loading: a bad value costs no load
    checked = check_sampling(temp, top_k, top_p, min_p, seed)
    sampling = {k: checked[k] for k in ("temperature", "top_k", "top_p", "min_p")}
    if not prompt:  # the BOS alone where the model adds one; else nothing to go on from: said before the load
        from ikjax.cli.common import resolve_model
        from ikjax.gguf_io.reader import GGUFModelFile
        from ikjax.tokenizer import add_bos_default
        if not add_bos_default(GGUFModelFile(resolve_model(run.model)).metadata):
            raise OptionError(_EMPTY_PROMPT)
    prepared: dict = {}

    def prepare(eng) -> None:
        """The prompt's tokens and the run's steps, compiled while the weights stream in (where
        the engine loads them in a thread, Engine._overlaps_load)."""
        count0, hits0 = eng.compile_count, eng.compile_cache_hits
        tok = GGUFTokenizer(eng.file.metadata, source=str(eng.file.path))
        ids = tok.encode(prompt)
        if not ids:
            raise OptionError(_EMPTY_PROMPT)
        room = eng.options.ctx - len(ids)
        if room < 1:
            raise OptionError(f"prompt: {len(ids)} tokens leave no room for a token in the context c={eng.options.ctx}")
        n = room if n_predict == -1 else min(n_predict, room)
        if n < n_predict:  # as llama-cli, which stops at the context's end (no shift here)
            log(f"note: -n {n_predict} past the context: at most {n} tokens after the prompt's {len(ids)} "
                f"(c={eng.options.ctx})")
        eos = eng.config.eos_token_id
        ban = (eos,) if ignore_eos and eos is not None else ()  # as Engine.generate bans it
        # with a penalty every token is chosen on the host after a one-token step (Engine.generate)
        shapes = _generate_shapes(eng, len(ids), n, stream=True, host_steps=penalties.active)
        t0 = time.perf_counter()
        with Progress("steps", total=len(shapes)) as prog:
            for k, (n_tok, kv, chunk) in enumerate(shapes, 1):
                what = f"decode loop of {chunk} steps" if chunk else f"{n_tok} tokens"
                prog.status(f"preparing step {k}/{len(shapes)} ({what}, KV bucket {eng.kv_bucket(kv, n_tok)})")
                _precompile_shape(eng, n_tok, kv, chunk, sampling, ban)
                prog.update(advance=1)
        log(compiled_line(eng, count0, hits0, time.perf_counter() - t0))
        prepared.update(tok=tok, ids=ids, n=n)

    eng = load_engine(run.model, run.verbose, while_loading=prepare, **run_opts)
    announce_seed(seed, drawn)
    tok, ids, n_new = prepared["tok"], prepared["ids"], prepared["n"]
    if not no_echo:
        typer.echo(prompt, nl=False)
    n = 0
    t_first = None
    t0 = time.perf_counter()

    def counted():
        nonlocal n, t_first
        # stream=True: one token per dispatch, printed as it comes (not in bursts of DECODE_CHUNK)
        for t in eng.generate(ids, n_new, temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                              stream=True, repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n,
                              frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                              penalize_nl=penalize_nl, ignore_eos=ignore_eos):
            interrupt.check()  # a Ctrl-C that JAX's gc callback swallowed ends it here
            if t_first is None:
                t_first = time.perf_counter()
            n += 1
            if t == tok.eos_id:
                return
            yield t

    from ikjax.runtime.text import StopStrings
    stops = StopStrings(reverse_prompt or [])
    pieces = tok.stream(counted())
    for piece in pieces:
        out, stopped = stops.feed(piece)
        sys.stdout.write(out + (stops.matched if stopped else ""))
        sys.stdout.flush()
        if stopped:
            pieces.close()  # no token past the stop string is generated
            break
    else:
        sys.stdout.write(stops.flush())
    typer.echo("")
    t_end = time.perf_counter()
    if t_first is not None:
        pp_s, tg_s = t_first - t0, t_end - t_first
        log(f"prompt: {len(ids)} tokens in {pp_s:.3f}s ({len(ids) / pp_s:.2f} t/s, first token included); "
            f"generated {n} tokens" + (f", {n - 1} after the first in {tg_s:.3f}s ({(n - 1) / tg_s:.2f} t/s)"
                                       if n > 1 and tg_s > 0 else "") + " (compilation not included)")


def _generate_shapes(eng, n_prompt: int, n_predict: int, stream: bool = False,
                     host_steps: bool = False) -> list[tuple[int, int, int]]:
    """(tokens, KV needed, decode-loop length or 0) of every step `eng.generate` runs for this
    prompt: its ubatch chunks, then the decode loops of DECODE_CHUNK steps (one step each with
    `stream`, as `generate(stream=True)` runs them) from the first generated position (or, without
    the loop or with `host_steps` — a penalty — one-token steps up to the last); the engine's
    prefill and generation chunk the same way."""
    from ikjax.runtime import generation
    chunk_len = 1 if stream else generation.DECODE_CHUNK
    seen: dict[tuple, tuple[int, int, int]] = {}
    ub = eng.options.ubatch
    for c0 in range(0, n_prompt, ub):
        t = eng.prompt_tokens(min(ub, n_prompt - c0), c0)
        seen.setdefault((t, eng.kv_bucket(c0 + t, t)), (t, c0 + t, 0))
    loop = eng.decode_loop() and not host_steps
    for pos in range(n_prompt, n_prompt + max(n_predict - 1, 0), chunk_len if loop else 1):
        kv = pos + chunk_len if loop else pos + 1
        seen.setdefault((1, eng.kv_bucket(kv, 1), loop), (1, kv, chunk_len if loop else 0))
    return list(seen.values())


def _precompile_shape(eng, n_tok: int, kv: int, chunk: int, sampling: dict, ban: tuple = ()) -> float:
    """Compile one of `_generate_shapes`' steps ahead of its use (the decode loop with the sampling
    argument `Engine.generate` gives it: generation.device_sampling; `ban`: --ignore-eos's EOS)."""
    from ikjax.runtime.generation import device_sampling
    if not chunk:
        return eng.precompile(1, n_tok, kv)
    return eng.precompile_decode(1, chunk, kv, device_sampling(eng, sampling, ban))
