"""`ikjax serve`: an OpenAI- and llama-server-compatible HTTP server (like llama-server).

    ikjax serve -m model.gguf -c 32768 -np 4 --host 127.0.0.1 --port 8080 [--api-key KEY]

Every run option the other commands take (-mla -fa -ctk -ot -ub ...), and llama-server's server
flags: `-c` is the context of all slots together (each of the `-np` slots gets c/np tokens, as
llama-server splits it), `--chat-template` a builtin name or a Jinja file, `-to` the read/write
timeout, `--temp --top-k --top-p --min-p -s -n` the defaults of requests that do not set them.
The endpoints and the scheduling are ikjax.server and ikjax.runtime.scheduler.
"""
from __future__ import annotations

import gc
import os
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from ikjax.cli.common import app, batch_invariance, handle, load_engine, log, setup_compile_cache, template_choice
from ikjax.cli.parser import ExactCommand
from ikjax.cli.run_options import RunArgs, check_options, takes_run_options
from ikjax import interrupt
from ikjax.errors import OptionError


@app.command("serve", cls=ExactCommand)
@handle
@takes_run_options(after={"host": "model"})
def serve(
    run: RunArgs,
    host: Annotated[str, typer.Option("--host", help="address to listen on (127.0.0.1: this machine only)")
                    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="port to listen on (0: any free port, printed)")] = 8080,
    parallel: Annotated[int, typer.Option("-np", "--parallel", help="slots: requests decoded together; -c is "
                                          "shared by them (c/np tokens each); default 1, as ik's llama-server "
                                          "(a prompt may then use all of -c)")] = 1,
    api_key: Annotated[Optional[str], typer.Option("--api-key", help="require 'Authorization: Bearer KEY' "
                                                   "(401 otherwise; /health and /v1/models stay open)")] = None,
    api_key_file: Annotated[Optional[Path], typer.Option(
        "--api-key-file", help="a file of API keys, one a line: any of them passes (with --api-key too)")] = None,
    chat_template: Annotated[Optional[str], typer.Option(
        "--chat-template", help="chat template: a builtin name (deepseek3, deepseek-r1, deepseek2, chatml, kimi-k2, chatglm4), a Jinja file, "
        "or Jinja text; default: the model file's own (tokenizer.chat_template)")] = None,
    chat_template_file: Annotated[Optional[str], typer.Option(
        "--chat-template-file", help="a Jinja chat template file (llama-server's flag; --chat-template takes "
        "one too)")] = None,
    no_webui: Annotated[bool, typer.Option("--no-webui", help="no chat page at / (a 404 there)")] = False,
    slots: Annotated[bool, typer.Option("--slots", help="/slots: always on (accepted)")] = False,
    timeout: Annotated[float, typer.Option("-to", "--timeout", help="seconds a request body may take to arrive, "
                                           "and a write of the answer to a slow reader (llama-server's "
                                           "read/write timeout)")] = 600.0,
    reasoning_format: Annotated[str, typer.Option(
        "--reasoning-format", help="deepseek: R1's <think> block as reasoning_content (auto = deepseek); none: "
        "left in content; deepseek-legacy: as deepseek, but inline in content when streamed")] = "deepseek",
    reasoning_budget: Annotated[int, typer.Option(
        "--reasoning-budget", help="tokens a chat answer may think inside <think> before its end is forced: -1 "
        "unrestricted (a request's thinking_budget_tokens may set one), 0 immediate end")] = -1,
    reasoning_budget_message: Annotated[str, typer.Option(
        "--reasoning-budget-message", help="text forced before </think> when the budget runs out")] = "",
    alias: Annotated[Optional[str], typer.Option("-a", "--alias", help="the model's name in the API "
                                                 "(default: the file's name)")] = None,
    n_predict: Annotated[int, typer.Option("-n", "--n-predict", help="default tokens to generate (-1: until "
                                           "the slot's context is full)")] = -1,
    temp: Annotated[float, typer.Option("--temp", "--temperature", help="default temperature")] = 0.8,
    top_k: Annotated[int, typer.Option("--top-k", help="default top-k (0 = off)")] = 40,
    top_p: Annotated[float, typer.Option("--top-p", help="default top-p (1 = off)")] = 0.95,
    min_p: Annotated[float, typer.Option("--min-p", help="default min-p (0 = off)")] = 0.05,
    seed: Annotated[int, typer.Option("-s", "--seed", help="default seed (-1: random)")] = -1,
    prompt_cache: Annotated[str, typer.Option(
        "--prompt-cache", help="reuse of a slot's cached tokens: auto (a conversation's next turn reuses the whole "
        "common prefix, as llama-server; other prompts whole -ub chunks, so their answers equal a fresh run), "
        "exact (whole -ub chunks only), prefix (always the whole common prefix), off (not an ik flag)")] = "auto",
    context_shift: Annotated[Optional[str], typer.Option(
        "--context-shift", help="on (or 1, auto): a prompt longer than a slot is cut and a generation that fills "
        "its slot drops half of the tokens after --keep and goes on, as llama-server; off (or 0, the default "
        "here; ik's is on): a 400 and finish_reason length, as vLLM")] = None,
    no_context_shift: Annotated[bool, typer.Option("--no-context-shift", help="--context-shift off")] = False,
    keep: Annotated[int, typer.Option("--keep", help="the context shift's n_keep of a request that gives none: "
                                      "prompt tokens kept (-1: all of them; BOS always)")] = 0,
    max_queue: Annotated[int, typer.Option("--max-queue", help="requests that may wait for a slot; more get "
                                           "503 (not an ik flag)")] = 64,
    cont_batching: Annotated[bool, typer.Option("-cb", "--cont-batching", help="continuous batching: always "
                                                "on (accepted for llama-server's command lines)")] = False,
    jinja: Annotated[bool, typer.Option("--jinja", help="Jinja chat templates: always on (accepted)")] = False,
    metrics: Annotated[bool, typer.Option("--metrics", help="/metrics: always on (accepted)")] = False,
    batch_invariant: Annotated[Optional[bool], typer.Option(
        "--batch-invariant/--no-batch-invariant", help="decode every slot's row as the request alone would be "
        "(greedy answers equal generate's under IKJAX_BATCH_INVARIANT=1; default on, or as that variable "
        "says); off: ~8 % faster GPU decode, rows may differ in the last bits (not an ik flag)")] = None,
) -> None:
    """Serve the model over HTTP: OpenAI's /v1/chat/completions, /v1/completions, /v1/models and
    llama-server's /completion, /tokenize, /detokenize, /props, /health, /metrics, a chat page at /."""
    from ikjax.runtime.scheduler import PROMPT_CACHE_MODES, Scheduler
    from ikjax.server.app import REASONING_FORMATS, Server, ServerConfig
    from ikjax.server.transport import LoadingResponder, bind, run as run_server
    from ikjax.server.openai import Defaults

    if parallel < 1:
        raise OptionError(f"-np: need at least 1 slot, got {parallel}")
    if not 0 <= port <= 65535:
        raise OptionError(f"--port: expected 0..65535, got {port}")
    if not timeout > 0:
        raise OptionError(f"--timeout: expected seconds > 0, got {timeout}")
    if reasoning_format not in REASONING_FORMATS:
        raise OptionError(f"--reasoning-format: expected one of {', '.join(REASONING_FORMATS)}, got "
                          f"{reasoning_format!r}")
    if prompt_cache not in PROMPT_CACHE_MODES:
        raise OptionError(f"--prompt-cache: expected one of {', '.join(PROMPT_CACHE_MODES)}, got {prompt_cache!r}")
    if max_queue < 0:
        raise OptionError(f"--max-queue: need >= 0, got {max_queue}")
    shift = context_shift_choice(context_shift, no_context_shift)
    if keep < -1:
        raise OptionError(f"--keep: need >= -1 (-1 = the whole prompt), got {keep}")
    chat_template = template_choice(chat_template, chat_template_file)
    keys = [api_key] if api_key else []
    if api_key_file is not None:
        try:
            keys += [k.strip() for k in api_key_file.read_text(encoding="utf-8").splitlines() if k.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise OptionError(f"--api-key-file {api_key_file}: cannot read ({getattr(e, 'strerror', None) or e})") \
                from None
        if len(keys) == (1 if api_key else 0):
            raise OptionError(f"--api-key-file {api_key_file}: no key in it")
    if chat_template:  # a name, file or Jinja text: checked before a long load, not after it
        from ikjax.chat_template import template_for
        template_for({}, chat_template)
    run_opts, opts = check_options(run, "serve")
    per_slot = opts.ctx // parallel
    if per_slot < 2:
        raise OptionError(f"-c {opts.ctx} over -np {parallel} slots leaves {per_slot} tokens a slot")
    run_opts["ctx"] = per_slot  # the engine's ctx is one sequence's: each slot's row of the batch cache
    if reasoning_budget < -1:
        raise OptionError(f"--reasoning-budget: need >= -1 (-1 = unrestricted), got {reasoning_budget}")
    defaults = Defaults(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, n_predict=n_predict,
                        reasoning_budget=reasoning_budget, reasoning_budget_message=reasoning_budget_message,
                        n_keep=keep)
    _check_defaults(defaults)
    sock = bind(host, port)  # taken now: a port in use is one line before the model loads
    invariant = batch_invariance(batch_invariant, default=True)
    setup_compile_cache(run.compile_cache_dir)
    made: dict = {}

    def warm_up(eng) -> None:
        """The template, the scheduler and its steps, compiled while the weights stream in (where
        the engine loads them in a thread, Engine._overlaps_load)."""
        made["template"] = eng.chat_template(chat_template)
        made["scheduler"] = scheduler = Scheduler(eng, parallel, max_queue=max_queue, prompt_cache=prompt_cache,
                                                  context_shift=shift)
        if not run.no_warmup:
            t0 = time.perf_counter()
            n = scheduler.warmup(sampling=_default_sampling(defaults))
            sizes = "/".join(str(t) for t in eng.prompt_step_sizes()) if eng.compile_in_parallel() \
                else str(eng.options.ubatch)
            log(f"warm-up: compiled {n} steps (decode of {parallel} slots, prompt chunks of {sizes} tokens) in "
                f"{time.perf_counter() - t0:.1f}s")

    # 503 "Loading model" until the server proper answers; the model's id where known before the load
    known = alias or (Path(run.model).name if run.model and os.path.isfile(run.model) else None)
    loading = LoadingResponder(sock, known).start()
    try:
        eng = load_engine(run.model, run.verbose, while_loading=warm_up, plan_batch=parallel, **run_opts)
        interrupt.check()  # a Ctrl-C / SIGTERM swallowed during the load: not a server that comes up
    except BaseException:
        loading.stop()
        raise
    tok, template, scheduler = eng.tokenizer, made["template"], made["scheduler"]
    path = str(eng.file.path)
    config = ServerConfig(model_name=alias or Path(path).name, model_path=path, n_slots=parallel,
                          api_key=tuple(keys) or None, timeout=timeout, webui=not no_webui,
                          reasoning_format="deepseek" if reasoning_format == "auto" else reasoning_format,
                          defaults=defaults)
    # everything alive now (weights' Python objects, compiled steps, the tokenizer) lives as long
    # as the server: out of the collector's reach, a full collection no longer walks it, which
    # on a loaded server showed as a stall of every stream at once
    gc.collect()
    gc.freeze()
    server = Server(eng, tok, template, scheduler.start(), config)
    loading.stop()
    log(f"{parallel} slots of {per_slot} tokens (-c {opts.ctx}), chat template {template.name}, "
        f"prompt cache {prompt_cache}, batch-invariant decode {'on' if invariant else 'off'}, "
        f"context shift {'on' if shift else 'off'}")
    run_server(server, sock, on_listening=lambda url: log(f"listening on {url}"),
               on_stopping=lambda sig: log(f"{sig}: shutting down ({scheduler.slots_busy()} requests in flight "
                                           f"cancelled, {scheduler.queue_length()} queued)"))


def _default_sampling(d) -> dict:
    """The sampling a request that sets none gets (the flags' defaults, as check_sampling gives
    them): the scheduler warms up its decode loop."""
    from ikjax.runtime.sampling import check_sampling
    return check_sampling(d.temperature, max(d.top_k, 0), d.top_p if d.top_p > 0 else 1.0, d.min_p,
                          None if d.seed < 0 else d.seed)


def _check_defaults(d) -> None:
    """The sampling defaults as a request would give them (one line naming the flag)."""
    try:
        _default_sampling(d)
    except OptionError as e:
        raise OptionError(f"sampling default: {e}") from None
    if d.n_predict < -1:
        raise OptionError(f"-n: expected >= -1 (-1 = until the context is full), got {d.n_predict}")


def context_shift_choice(value: str | None, off: bool) -> bool:
    """--context-shift VALUE / --no-context-shift (ik's spellings) as on or off: off unless told."""
    if value is None:
        return False
    v = value.strip().lower()
    if v not in ("on", "off", "auto", "1", "0"):
        raise OptionError(f"--context-shift: expected on, off, auto, 1 or 0, got {value!r}")
    if off and v in ("on", "auto", "1"):
        raise OptionError(f"--context-shift {value} and --no-context-shift: give one of them")
    return v in ("on", "auto", "1")
