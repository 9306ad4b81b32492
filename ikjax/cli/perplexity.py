"""`ikjax perplexity`: ik_llama.cpp's llama-perplexity (PPL over a text, and KL divergence
against a base model's saved log-probabilities).

Why its output is ik's byte for byte where it can be: users paste these lines beside ik's numbers
for every quant. Stdout carries what llama-perplexity prints on stdout (the `[1]5.4321,[2]...`
progress line and `Final estimate: PPL over N chunks for n_ctx=C = X +/- Y`; with --kl-divergence
its table and statistics block); stderr carries ik's `perplexity:` lines, the memory plan and what
compiling cost. The rules (chunking, BOS, scoring, the base file) live in ikjax.runtime.perplexity.
"""
from __future__ import annotations

import sys
import time
from typing import Annotated, Optional

import typer

from ikjax import interrupt
from ikjax.cli.common import (Escape, app, compiled_line, handle, load_engine, log, process_escapes, read_text_file,
                              setup_compile_cache)
from ikjax.cli.parser import ExactCommand
from ikjax.cli.run_options import RunArgs, check_options, model_context_length, takes_run_options
from ikjax.errors import OptionError

PPL_CTX = 512  # llama-perplexity's default -c


@app.command("perplexity", cls=ExactCommand)
@handle
@takes_run_options(after={"text_file": "model", "ctx": "text_file", "dtype": "threads_batch",
                          "chunks": "fit"})
def perplexity_cmd(
    run: RunArgs,
    text_file: Annotated[Optional[str], typer.Option(
        "-f", "--file", help="the text to score (read whole, one trailing newline dropped, as ik)")] = None,
    ctx: Annotated[int, typer.Option("-c", "--ctx", "--ctx-size", help="tokens per chunk (each chunk scores its "
                                     "second half); default 512 as llama-perplexity")] = PPL_CTX,
    dtype: Annotated[str, typer.Option("--dtype", help="activation dtype of the matmuls; default f32 here (a "
                                       "measurement: bf16 activations move PPL on their own); auto, bf16, f16 for "
                                       "speed (not an ik flag)")] = "f32",
    chunks: Annotated[int, typer.Option("--chunks", help="score at most N chunks (-1: all)")] = -1,
    kl_divergence_base: Annotated[Optional[str], typer.Option(
        "--kl-divergence-base", metavar="FILE", help="without --kl-divergence: write the base log-probabilities "
        "here (ik's file format); with it: read them")] = None,
    kl_divergence: Annotated[bool, typer.Option("--kl-divergence", help="KL divergence against "
                                                "--kl-divergence-base FILE (its tokens; -f not needed)")] = False,
    ppl_output_type: Annotated[int, typer.Option("--ppl-output-type", help="0: ik's [1]x,[2]y, line; 1: a line "
                                                 "a chunk: token offset, PPL, mean NLL, its error (ik's)")] = 0,
    ppl_stride: Annotated[int, typer.Option("--ppl-stride", help="ik's strided perplexity: 0 (its default, off) "
                                            "only; another stride is refused")] = 0,
    escape: Escape = True,
) -> None:
    """Perplexity of a text, as llama-perplexity: chunks of -c tokens, each scoring its second half
    (`[1]x,[2]y,...` then `Final estimate: PPL ...`); --kl-divergence-base FILE saves the base
    log-probabilities in ik's format, and with --kl-divergence compares this model against them."""
    from ikjax.runtime import perplexity as ppl
    if kl_divergence and not kl_divergence_base:
        raise OptionError("kl-divergence: needs --kl-divergence-base FILE (the base model's log-probabilities)")
    if ppl_stride != 0:
        raise OptionError(f"ppl-stride: {ppl_stride}: the strided perplexity is not supported here (0, ik's default: "
                          f"chunks of -c tokens, each scoring its second half)")
    if ppl_output_type not in (0, 1):
        raise OptionError(f"ppl-output-type: 0 or 1, got {ppl_output_type}")
    if chunks == 0 or chunks < -1:
        raise OptionError(f"chunks: need a count >= 1 (or -1 for all), got {chunks}")
    base = None
    if ctx == 0:  # ik's -c 0: chunks of the model's training context
        ctx = model_context_length(run.model)
        log(f"note: -c 0: the model's training context, {ctx} tokens a chunk")
    if kl_divergence:
        base = ppl.BaseLogits.open(kl_divergence_base)  # its n_ctx decides the chunks, before anything loads
        text = None
        if text_file:
            log(f"note: -f {text_file} is not read with --kl-divergence: the tokens come from {kl_divergence_base}")
        if ctx < base.n_ctx:
            raise OptionError(f"kl-divergence-base {kl_divergence_base}: computed with n_ctx {base.n_ctx}, while the "
                              f"current context is {ctx}: increase it with -c {base.n_ctx} and retry")
    else:
        if not text_file:
            raise OptionError("perplexity: needs -f FILE, the text to score")
        text = _read_text(text_file, escape)
        ppl.check_ctx(ctx, ctx)
        if kl_divergence_base:  # the base file to write: its place checked before anything loads
            from ikjax.atomic_file import check_target
            check_target(kl_divergence_base, 0, "kl-divergence-base", parent_exists=True)
    run = RunArgs({**run, "ctx": ctx, "dtype": dtype})
    run_opts, _ = check_options(run, "perplexity")
    # the text and the base file are checked against the model's header before it loads
    from ikjax.cli.common import resolve_model
    from ikjax.gguf_io.reader import GGUFModelFile
    path = resolve_model(run.model)
    header = GGUFModelFile(path)
    if base is not None:
        ppl.check_base_vocab(base, ppl.logits_width(header))
        n_ctx = base.n_ctx
    else:
        t0 = time.perf_counter()
        ids = _tokenize(header, text)
        n_ctx = ctx
        n_chunk = ppl.chunk_count(len(ids), n_ctx, chunks)
        log(f"perplexity: tokenization took {1e3 * (time.perf_counter() - t0):g} ms ({len(ids)} tokens)")
    del header
    setup_compile_cache(run.compile_cache_dir)
    eng = load_engine(path, run.verbose, **run_opts)
    if base is not None:
        ppl.check_base(eng, base)
    n_seq = ppl.sequences_per_step(eng.options, n_ctx)
    count0, hits0 = eng.compile_count, eng.compile_cache_hits
    t0 = time.perf_counter()
    n_steps = ppl.precompile(eng, n_ctx)
    log(compiled_line(eng, count0, hits0, time.perf_counter() - t0) + f" ({n_steps} steps a chunk)")
    if base is not None:
        _run_kld(eng, base, chunks, n_seq)
    else:
        _run_ppl(eng, ids, n_ctx, n_chunk, n_seq, kl_divergence_base, ppl_output_type)


def _read_text(path: str, escape: bool) -> str:
    """The file as ik reads -f: whole, one trailing newline dropped; UTF-8 (one line if not); its
    escapes processed unless --no-escape (ik's common arguments do so to any -f text: the same
    file must score the same tokens here as there)."""
    text = read_text_file(path)
    text = text[:-1] if text.endswith("\n") else text
    return process_escapes(text) if escape else text


def _tokenize(file, text: str) -> list[int]:
    """The whole text's tokens, BOS first where ik adds one (the file's add_bos_token; ik's
    default for its vocabulary type otherwise), as llama-perplexity's common_tokenize: special
    tokens' texts in it ("<｜User｜>") are plain text there (its parse_special is false)."""
    from ikjax.tokenizer import GGUFTokenizer, add_bos_default
    tok = GGUFTokenizer(file.metadata, source=str(file.path))
    return tok.encode(text, add_bos=add_bos_default(file.metadata), parse_special=False)


def _eta(first_pass: float, n_chunk: int, n_seq: int) -> str:
    total = int(first_pass * n_chunk / n_seq)
    hours = f"{total // 3600} hours " if total >= 3600 else ""
    return f"{hours}{(total % 3600 if total >= 3600 else total) / 60.0:.2f} minutes"


def _run_ppl(eng, ids, n_ctx: int, n_chunk: int, n_seq: int, save_base: Optional[str], output_type: int) -> None:
    from ikjax.runtime import perplexity as ppl
    if save_base:
        log(f"perplexity: saving all logits to {save_base}")
    o = eng.options  # ik's line (its n_seq: -b / n_ctx); a step here holds at most -ub tokens
    ik_seq = max(1, o.batch // n_ctx)  # ik's batch: -b capped to its n_seq whole chunks
    log(f"perplexity: calculating perplexity over {n_chunk} chunks, n_ctx={n_ctx}, "
        f"batch_size={min(o.batch, ik_seq * n_ctx)}, n_seq={ik_seq}")  # ik's line (scripts anchor on it)
    log(f"perplexity: {n_seq} chunks a step of at most -ub {o.ubatch} tokens")
    t0 = time.perf_counter()

    def on_chunk(i: int, nll) -> None:
        interrupt.check()  # (ikjax/interrupt.py: a Ctrl-C JAX swallowed)
        if i == 0:  # after the first pass (n_seq chunks), before its progress, as ik
            dt = time.perf_counter() - t0
            log(f"perplexity: {dt:.2f} seconds per pass - ETA {_eta(dt, n_chunk, n_seq)}")
        if output_type == 0:
            sys.stdout.write(ppl.progress_item(i + 1, nll))
        else:  # ik prints the first chunk of its batch of n_seq chunks times n_ctx (for each of them)
            sys.stdout.write(ppl.progress_row(i // ik_seq * ik_seq * n_ctx, nll) + "\n")
        sys.stdout.flush()

    res = eng.perplexity(ids, n_ctx, n_chunks=n_chunk, save_base=save_base, on_chunk=on_chunk)
    sys.stdout.write("\n")
    typer.echo(res.final_line())
    dt = time.perf_counter() - t0
    log(f"perplexity: {res.count} tokens scored in {dt:.2f}s ({n_chunk * n_ctx / dt:.2f} t/s fed)")


def _run_kld(eng, base, chunks: int, n_seq: int) -> None:
    from ikjax.runtime import perplexity as ppl
    n_chunk = base.n_chunk if chunks < 0 else min(base.n_chunk, chunks)
    t0 = time.perf_counter()

    def on_chunk(i: int, res) -> None:
        interrupt.check()
        if i == 0:
            dt = time.perf_counter() - t0
            log(f"kl_divergence: {dt:.2f} seconds per pass - ETA {_eta(dt, n_chunk, n_seq)}")
            typer.echo("\n" + ppl.KLD_HEADER)
        typer.echo(res.chunk_line(i))

    res = eng.kld(base, n_chunks=chunks, on_chunk=on_chunk)
    typer.echo("")
    for line in res.lines():
        typer.echo(line)
