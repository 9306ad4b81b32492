"""Generation: the on-device decode loop, what `generate` / `generate_batch` return, and their
scheduling (prompt in ubatch chunks, then decode chunks or one token per dispatch, the stopping
rules).

The scheduling functions take the engine (`ikjax.runtime.engine.Engine`, passed in, never imported:
this module sits below it) and drive it only through its public steps: `prefill`, `step`, `decode`,
`new_cache`, `decode_loop`, `token_bucket`, and its `config` / `options`.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import numbers
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ikjax.errors import ContextFullError, OptionError
from ikjax.gguf_io.config import ModelConfig
from ikjax.model import moe
from ikjax.model.deepseek2 import StepPlan, forward
from ikjax.runtime import buckets as kv_buckets
from ikjax.runtime.sampling import (Penalties, check_count, check_finite_logits, check_penalty,
                                    check_sampling, effective_top_k, row_params, sample_device, sample_next, sample_rows,
                                    top_k_bucket)

log = logging.getLogger("ikjax")

DECODE_CHUNK = 16  # tokens per dispatch in generate (a stop mid-chunk wastes the rest of it)

STOP_EOS, STOP_MAX_TOKENS, STOP_CONTEXT = "eos", "max_tokens", "context"


def decode_steps(weights, cache, tok, start, n, key, *, cfg: ModelConfig, plan: StepPlan, chunk: int,
                 sampling: tuple):
    """n <= chunk decode steps in one dispatch: tok [B] sits at positions start [B]; each step
    feeds the current token, appends its latent to the cache and picks the next one on the device
    (`sample_device` with `sampling`, a static tuple of its keyword items). Returns (tokens
    [B, chunk] int32, the first n of them produced, cache).

    Why: a batch-1 decode step is ~700 small kernels; dispatched one step at a time the host's
    launches (~5 us each) set the pace, and a per-step CUDA graph is re-recorded whenever a
    buffer moves. A loop with a trip count read on the device is one executable whose body XLA
    captures as one CUDA graph (a WHILE command, see ikjax.runtime.executables._DECODE_GPU_OPTIONS)."""
    # token -1: an idle row (the server's free slots, Engine.decode's `idle`): it computes a
    # throw-away token at its position, as any row, but routes to no expert (`forward`'s last
    # -1) and stays -1. sampling's ("rows", True): `key` holds a key per row (sample_rows)
    B = tok.shape[0]
    filters = {k: v for k, v in sampling if k != "rows"}
    per_row = dict(sampling).get("rows", False)
    if per_row and "bucket" in filters:  # key: (a key per row, their settings: sampling.row_params)
        key, params = key
        filters = dict(filters, params=params)
    live = tok >= 0
    last = jnp.where(live, 0, -1).astype(jnp.int32)

    # expert statistics (plan.expert_stats): each step's counts summed in the loop's carry and handed
    # to the host once a dispatch, not once a step (a host call stalls the device's stream)
    sink = plan.expert_stats
    moe_layers = [i for i in range(cfg.n_layer) if cfg.is_moe_layer(i)] if sink is not None else []

    def step(i, cache, tok):
        if not moe_layers:
            return forward(weights, cache, jnp.maximum(tok, 0)[:, None], start + i, last, cfg=cfg, plan=plan), None
        with moe.counting() as (pending, _):  # run_layers adds to it and leaves the host call to the loop
            res = forward(weights, cache, jnp.maximum(tok, 0)[:, None], start + i, last, cfg=cfg, plan=plan)
        layers, counts = moe.stacked_counts(pending, sink.n_expert)
        # the scanned groups' layer indices come out of their scans: order them as moe_layers
        return res, jnp.zeros((cfg.n_layer, sink.n_expert), jnp.int32).at[layers].add(counts)[jnp.asarray(moe_layers)]

    def body(i, carry):
        cache, tok, out, key, acc = carry
        (logits, cache), counted = step(i, cache, tok)
        if counted is not None:
            acc = acc + counted
        # the draw for the token after position p uses key folded with p: the same tokens whether
        # they come 16 to a dispatch or one at a time (a streaming caller), for one seed
        if per_row:
            drawn = sample_rows(logits, key, start + i, **filters)
        else:
            drawn = sample_device(logits, jax.random.fold_in(key, start[0] + i), **filters)
        nxt = jnp.where(live, drawn, -1)
        return cache, nxt, jax.lax.dynamic_update_slice(out, nxt[:, None], (0, i)), key, acc

    out = jnp.zeros((B, chunk), jnp.int32)
    acc = jnp.zeros((len(moe_layers), sink.n_expert if sink is not None else 0), jnp.int32)
    cache, _, out, _, acc = jax.lax.fori_loop(0, n, body, (cache, tok, out, key, acc))
    if moe_layers:
        moe.flush_counts(sink, [(jnp.asarray(moe_layers, jnp.int32), acc)], n * jnp.sum(live.astype(jnp.int32)),
                         plan.tp.axis if plan.tp is not None else None)
    return out, cache


@functools.partial(jax.jit, donate_argnums=0)
def _put_leaf(big, one, b):
    # cache leaves are [layers of the group, batch, rows, ...]: the batch is axis 1
    return jax.lax.dynamic_update_index_in_dim(big, one[:, 0].astype(big.dtype), b, 1)


def _put_row(cache, one, b: int):
    """`cache` (batch B, donated) with row b replaced by the batch-1 cache `one`: leaf by leaf,
    each where it lives (the -sm layer pipeline keeps each layer's entries on its own device)."""
    return jax.tree.map(lambda big, o: _put_leaf(big, o, np.int32(b)), cache, one)


@jax.jit
def _take_leaf(big, b):
    return jax.lax.dynamic_slice_in_dim(big, b, 1, 1)


def _take_row(cache, b: int):
    """Row b of the batch cache `cache` as a new batch-1 cache (`cache` is kept): what `_put_row`
    puts back. The server's scheduler continues a slot's sequence in it (a prompt fed on top of
    the tokens the row already holds, ikjax.runtime.scheduler)."""
    return jax.tree.map(lambda big: _take_leaf(big, np.int32(b)), cache)


def sampling_key(sampling: dict | None) -> tuple:
    """The static sampling setting of a decode executable; every greedy setting is one (banned
    ids, `ban`, apart: --ignore-eos bans EOS). With a key per row ("rows": the server's sampled
    streams) only the top_k bucket is static (sampling.top_k_bucket): the values come with the
    keys, as step arguments, so a new temperature or top_k compiles nothing."""
    p = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)
    if (sampling or {}).get("rows") and ("bucket" in sampling or sampling.get("temperature", 0.0) > 0.0):
        p = {"bucket": sampling["bucket"] if "bucket" in sampling else top_k_bucket(int(sampling.get("top_k", 0)))}
    elif sampling and sampling.get("temperature", 0.0) > 0.0:
        p.update({k: sampling[k] for k in p if k in sampling})
    ban = tuple(sorted({int(t) for t in (sampling or {}).get("ban", ())}))
    if ban:
        p["ban"] = ban
    if (sampling or {}).get("rows"):  # a key per row (sampling.sample_rows): the server's sampled streams
        p["rows"] = True
    return tuple(sorted(p.items()))


def device_sampling(eng, sp: dict, ban: tuple = ()) -> dict:
    """The decode loop's sampling argument for `generate` with these filters (`check_sampling`'s
    temperature, top_k, top_p, min_p) and banned ids: what it compiles (and what a caller compiles
    ahead, cli generate). A draw on one device takes the rows form (a batch of one): its values are
    step arguments, so another temperature or top_k in the bucket compiles no loop; the same tokens
    (sample_rows draws row b as sample_device draws it alone)."""
    out = {**sp, "ban": tuple(ban)} if ban else dict(sp)
    if "top_k" in out:  # (as generate checks it: one past the vocabulary is off)
        out["top_k"] = effective_top_k(int(out["top_k"]), eng.config.vocab_size)
    if sp.get("temperature", 0.0) > 0.0 and eng.row_sampling():
        out["rows"] = True
    return out


class Generation:
    """What `Engine.generate` returns: an iterator of new token ids. `stop_reason` is None while
    more may come and, from the moment the last token is yielded, "eos" (EOS or a stop id),
    "max_tokens", or "context" (the sequence reached `ctx` tokens). `prompt_tokens`: the prompt's
    length; `cached_tokens`: how many of them a `KVSession` already held (not fed again)."""

    def __init__(self):
        self.stop_reason: str | None = None
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self._it: Iterator[int] = iter(())

    def __iter__(self) -> "Generation":
        return self

    def __next__(self) -> int:
        return next(self._it)

    def close(self) -> None:
        """Stop here (a cancelled stream): a `KVSession` keeps what the cache holds so far."""
        close = getattr(self._it, "close", None)
        if close is not None:
            close()

    @property
    def running(self) -> bool:
        """A thread is inside its `next` right now (not merely suspended between tokens)."""
        return bool(getattr(self._it, "gi_running", False))


class KVSession:
    """One sequence's KV cache kept between generations, with the ids whose entries it holds: a
    prompt that starts with them (the next turn of a chat: the conversation so far, re-rendered)
    feeds only the tokens after the longest common prefix, as llama.cpp's prompt cache does.

    `Engine.generate(..., session=s)` takes the cache for the generation and gives it back when
    the generation ends or is closed (then the prompt and every token yielded but the last are in
    it: the last is fed by the step after it); an error inside a step (the cache it was given is
    consumed) empties the session, so the next prompt is fed whole. One generation at a time: a
    new one (or `reset`) in the thread that started the unfinished one ends that one first, as
    closing it would (a `for` loop left with `break` leaves its stream open until the garbage
    collector finds it, and the session was refused until then); from another thread, an
    unfinished generation is an error."""

    def __init__(self, eng):
        self.engine = eng
        self.cache = None
        self.ids: list[int] = []
        self._busy = False
        self._holder: tuple | None = None  # (weakref to the Generation holding the cache, its thread)
        # the busy check, the flag and the cache's hand-over in one step: two threads' check-then-set
        # both passed now and then (3 in 1500 trials of an outside probe), one cache given to both
        self._lock = threading.Lock()

    def reset(self) -> None:
        self._end_abandoned()
        with self._lock:
            if self._busy:
                raise OptionError("session: in use by an unfinished generation in another thread")
            self.cache, self.ids = None, []

    def _end_abandoned(self) -> None:
        """Close the unfinished generation holding the cache if this thread started it and no one is
        inside it (its `finally` gives the cache back)."""
        if not self._busy or self._holder is None:
            return
        gen = self._holder[0]()
        if gen is not None and self._holder[1] == threading.get_ident() and not gen.running:
            gen.close()

    def common_prefix(self, ids: Sequence[int]) -> int:
        """How many leading tokens of `ids` the cache holds."""
        n = 0
        for a, b in zip(self.ids, ids):
            if a != b:
                break
            n += 1
        return n

    def _acquire(self, eng, ids: np.ndarray, gen: "Generation"):
        """(cache, position to feed from) for a prompt: what the cache holds of it is not fed
        again, but at least its last two tokens are (the last one's logits pick the first new
        token), and a prompt the cache holds whole (a request sent again) has its last prefill
        chunk fed again as a fresh prefill feeds it (from the same ubatch boundary). Why: the
        kernels' numbers follow a step's row count (a one- to three-token step runs their decode
        form; on an AMX CPU a chunk padded to 32 rows or more their bf16 tiles), so the last token
        fed in a step of another size got other logits (and, greedy, another answer: the CPU's
        2-token re-feed differed at the 21st token) than the same prompt fed fresh."""
        if eng is not self.engine:
            raise OptionError("session: made for another engine (use eng.session())")
        self._end_abandoned()
        with self._lock:
            if self._busy:
                raise OptionError("session: already in use by an unfinished generation in another thread (close it "
                                  "first)")
            self._busy = True
            self._holder = (weakref.ref(gen), threading.get_ident())
            cache, self.cache = self.cache, None
        if cache is None:
            try:
                return self.engine.new_cache(1), 0
            except BaseException:  # (a refused or failed allocation must not leave the session busy)
                self._release(None, [])
                raise
        n, common = len(ids), self.common_prefix(ids.tolist())
        if common >= n - 1:  # held whole (or all but its last token): its last chunk, as a fresh prefill's
            ub = self.engine.options.ubatch
            return cache, (n - 1) // ub * ub
        return cache, max(0, min(common, n - 2))

    def _release(self, cache, ids: list[int]) -> None:
        with self._lock:  # (an empty cache: the step consumed it; the next prompt is fed whole)
            self.cache, self.ids = (None, []) if cache is None else (cache, ids)
            self._busy, self._holder = False, None


class BatchGeneration(list):
    """What `Engine.generate_batch` returns: one list of new ids per prompt, and `stop_reasons`,
    one of "eos", "max_tokens", "context" per prompt (as `Generation.stop_reason`)."""
    stop_reasons: list[str | None]


# -- argument checks -----------------------------------------------------------------------------

def check_ids(ids, vocab_size: int, what: str = "token ids") -> np.ndarray:
    """A non-empty 1-D integer sequence inside the vocabulary; the error names the bad id."""
    try:
        arr = np.asarray(ids)
    except (ValueError, TypeError, OverflowError) as e:
        raise OptionError(f"{what}: not a sequence of integers ({e})") from None
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise OptionError(f"{what}: must be a non-empty 1-D integer sequence, got shape {arr.shape} "
                          f"of {arr.dtype}")
    V = vocab_size
    bad = (arr < 0) | (arr >= V)
    if bad.any():
        i = int(np.argmax(bad))
        raise OptionError(f"{what}: token id {int(arr[i])} at index {i} is outside the vocabulary [0, {V})")
    return arr.astype(np.int32)


def check_flag(name: str, value) -> bool:
    """A True / False option (numpy's bool too): "no" or 0 were taken as their truth value."""
    if not isinstance(value, (bool, np.bool_)):
        raise OptionError(f"{name}: expected True or False, got {value!r}"[:200])
    return bool(value)


def stop_ids(stop: Iterable[int], eos_token_id: int | None, vocab_size: int | None = None) -> set[int]:
    """The ids that end a sequence: `stop` (checked: integers, inside the vocabulary when it is
    given: an id past it can never come) and the model's EOS."""
    if isinstance(stop, (str, bytes)) or not isinstance(stop, Iterable):
        raise OptionError(f"stop: expected a collection of token ids, got {stop!r}")
    out = set()
    for s in stop:
        if not isinstance(s, numbers.Integral) or isinstance(s, (bool, np.bool_)):
            raise OptionError(f"stop: token ids must be integers, got {s!r}")
        if vocab_size is not None and not 0 <= int(s) < vocab_size:
            raise OptionError(f"stop: token id {int(s)} is outside the vocabulary [0, {vocab_size})")
        out.add(int(s))
    if eos_token_id is not None:
        out.add(eos_token_id)
    return out


def check_prompt_fits(n: int, ctx: int, what: str) -> None:
    if n > ctx:
        raise ContextFullError(f"{what}: {n} tokens exceed the context size ctx={ctx}", n, ctx)


def stop_reason(tok: int, n_new: int, length: int, max_tokens: int, stop: set[int], ctx: int) -> str | None:
    """Why a sequence ends after `tok` (its `n_new`-th new token, `length` tokens in all), or None."""
    if tok in stop:
        return STOP_EOS
    if n_new >= max_tokens:
        return STOP_MAX_TOKENS
    if length >= ctx:
        log.warning("context full (ctx=%d): generation stopped after %d new tokens", ctx, n_new)
        return STOP_CONTEXT
    return None


# -- scheduling ----------------------------------------------------------------------------------

def generate(eng, prompt_ids: Sequence[int], max_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None,
             stop: Iterable[int] = (), stream: bool = False, repeat_penalty: float = 1.0, repeat_last_n: int = 64,
             frequency_penalty: float = 0.0, presence_penalty: float = 0.0, penalize_nl: bool = False,
             ignore_eos: bool = False, session: KVSession | None = None) -> Generation:
    """`Engine.generate` (its docstring): every argument checked here, before anything runs."""
    max_tokens = check_count("max_tokens", max_tokens)
    p = check_sampling(temperature, top_k, top_p, min_p, seed, vocab=eng.config.vocab_size)
    pen = dataclasses.replace(check_penalty(repeat_penalty, repeat_last_n, frequency_penalty, presence_penalty,
                                            penalize_nl), newline=eng.newline_token)
    ids = check_ids(prompt_ids, eng.config.vocab_size, "prompt_ids")
    check_prompt_fits(len(ids), eng.options.ctx, "prompt_ids")
    eos = eng.config.eos_token_id
    stream, ignore_eos = check_flag("stream", stream), check_flag("ignore_eos", ignore_eos)
    stops = stop_ids(stop, None if ignore_eos else eos, eng.config.vocab_size)
    if session is not None and not isinstance(session, KVSession):
        raise OptionError(f"session: expected a KVSession (eng.session()), got {type(session).__name__}")
    gen = Generation()
    gen.prompt_tokens = len(ids)
    ban = (eos,) if ignore_eos and eos is not None else ()
    gen._it = _generate(eng, gen, ids, max_tokens, p, stops, stream=bool(stream), pen=pen, ban=ban, session=session)
    return gen


def _generate(eng, gen: Generation, ids: np.ndarray, max_tokens: int, p: dict, stops: set[int], *,
              stream: bool, pen: Penalties, ban: tuple, session: KVSession | None):
    ctx = eng.options.ctx
    if max_tokens == 0:
        gen.stop_reason = STOP_MAX_TOKENS
        return
    if len(ids) >= ctx:
        log.warning("context full (ctx=%d): the prompt fills it, no token generated", ctx)
        gen.stop_reason = STOP_CONTEXT
        return
    rng = np.random.default_rng(p["seed"])
    sp = {k: p[k] for k in ("temperature", "top_k", "top_p", "min_p")}
    penalize = pen.active
    last_n = pen.window(ctx)
    history = ids.tolist()  # prompt and generated tokens: the penalties' window

    def pick(logits) -> int:  # the host's choice (first token; every token without the device loop)
        logits = np.asarray(logits, np.float32)
        check_finite_logits(logits)
        if penalize:
            logits = pen.apply(logits, history[-last_n:])
        if ban:
            logits = np.array(logits, copy=True)
            logits[list(ban)] = np.finfo(np.float32).min
        return sample_next(logits, rng=rng, **sp)

    device_sp = device_sampling(eng, sp, ban)
    rows = bool(device_sp.get("rows"))
    cache, start = session._acquire(eng, ids, gen) if session is not None else (eng.new_cache(1), 0)
    gen.cached_tokens = start
    new: list[int] = []
    valid = False  # whether `cache` is the live cache (a step consumes the one it is given)
    try:
        logits, cache = eng.prefill(cache, ids[start:], start, all_logits=False)
        valid = True
        length = len(ids)
        pending = [pick(logits)]  # produced, not yet yielded
        n_new = 0
        # the device's draws follow the seed: their key is the generator's next draw, taken only where
        # the device will draw (no penalty; the engine loops), so host draws (penalties) continue
        # the seed's sequence as the server's scheduler continues it (Scheduler._start_device_draws)
        key = jax.random.key(int(rng.integers(0, 2**31 - 1))) if not penalize and eng.decode_loop() else None
        while True:
            for tok in pending:  # a stop id inside a decode chunk drops the tokens after it
                n_new, length = n_new + 1, length + 1
                reason = stop_reason(tok, n_new, length, max_tokens, stops, ctx)
                gen.stop_reason = reason
                new.append(tok)
                history.append(tok)
                yield tok
                if reason is not None:
                    return
            # the last token is not in the cache yet: it goes at position length - 1
            if penalize or not eng.decode_loop():  # one token a dispatch, chosen on the host
                valid = False
                out, cache = eng.step(cache, np.array([[tok]], np.int32), np.array([length - 1]), np.array([0]),
                                      False)
                valid = True
                pending = [pick(np.asarray(out, np.float32)[0])]
                continue
            # up to DECODE_CHUNK tokens in one dispatch, no further than the stopping rules allow;
            # a streaming caller gets each token as it is made: one-step dispatches
            chunk = 1 if stream else DECODE_CHUNK
            n = min(chunk, max_tokens - n_new, ctx - length)
            valid = False
            out, cache = eng.decode(cache, [tok], [length - 1], n, chunk=chunk, sampling=device_sp,
                                    key=(key[None], row_params([sp])) if rows else key)
            valid = True
            pending = [int(t) for t in np.asarray(out)[0, :n]]
    finally:
        if session is not None:
            session._release(cache if valid else None, ids.tolist() + new[:-1])


def generate_batch(eng, prompts: Sequence[Sequence[int]], max_tokens: int, *, temperature: float = 0.0,
                   top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None,
                   stop: Iterable[int] = ()) -> BatchGeneration:
    """`Engine.generate_batch` (its docstring): each prompt fed alone in ubatch chunks (as
    `generate` does) into its row of the batch's cache, then the decode loop over every row
    (`_batch_loop`, where `Engine.decode_loop`) or one step per token for every unfinished
    sequence, the batch padded to a power of two."""
    max_tokens = check_count("max_tokens", max_tokens)
    p = check_sampling(temperature, top_k, top_p, min_p, seed, vocab=eng.config.vocab_size)
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__") or len(prompts) == 0:
        raise OptionError("prompts: expected a non-empty list of token id sequences")
    ctx, V = eng.options.ctx, eng.config.vocab_size
    seqs = [check_ids(s, V, f"prompts[{i}]") for i, s in enumerate(prompts)]
    for i, s in enumerate(seqs):
        check_prompt_fits(len(s), ctx, f"prompts[{i}]")
    stops = stop_ids(stop, eng.config.eos_token_id, eng.config.vocab_size)
    n = len(seqs)
    out = BatchGeneration([] for _ in range(n))
    if max_tokens == 0:
        out.stop_reasons = [STOP_MAX_TOKENS] * n
        return out
    B = kv_buckets.pow2_at_least(n)
    lengths = np.array([len(s) for s in seqs] + [1] * (B - n))
    rng = np.random.default_rng(p["seed"])
    sp = {k: p[k] for k in ("temperature", "top_k", "top_p", "min_p")}
    # Each prompt is fed alone, exactly as `generate` feeds it, and its entries copied into its row
    # of the batch's cache: fed together, a prompt's products would see other row counts (its
    # padding to the longest prompt, the CPU kernels' decode vs prompt form, the tokens each MoE
    # expert gets), so its logits and cache entries, and then its tokens, could differ from the
    # same prompt alone. The decode steps then compute every row as batch 1 does
    # (ikjax.ops.registry.decode_groups).
    cache = eng.new_cache(B)
    one = None
    last_logits = np.zeros((B, V), np.float32)
    for b, s in enumerate(seqs):
        if len(s) >= ctx:  # no token to generate: its logits are never read
            continue
        logits, one = eng.prefill(eng.new_cache(1) if one is None else one, s, 0, all_logits=False)
        last_logits[b] = logits
        cache = _put_row(cache, one, b)
    reasons: list[str | None] = [None] * n
    for b in range(n):
        if lengths[b] >= ctx:
            log.warning("context full (ctx=%d): prompts[%d] fills it, no token generated", ctx, b)
            reasons[b] = STOP_CONTEXT
    done = np.array([r is not None for r in reasons] + [True] * (B - n))
    if eng.decode_loop():
        _batch_loop(eng, out, reasons, done, last_logits, lengths, cache, max_tokens, stops, rng, sp)
        out.stop_reasons = reasons
        return out
    pos = lengths.copy()  # where each sequence's next token goes; frozen once it is done
    while not done.all():
        toks = np.zeros((B, 1), np.int32)
        for b in range(n):
            if done[b]:
                continue
            tok = sample_next(last_logits[b], rng=rng, **sp)
            out[b].append(tok)
            toks[b, 0] = tok
            reasons[b] = stop_reason(tok, len(out[b]), int(lengths[b]) + len(out[b]), max_tokens, stops, ctx)
        fed = ~done
        done = done | np.array([r is not None for r in reasons] + [True] * (B - n))
        if done.all():  # no step needed after the last token
            break
        # finished rows and the padding rows are idle (last -1): they route to no expert, so they
        # read no expert bytes and count in no expert statistics (a probe counted 25 tokens for 21)
        logits, cache = eng.step(cache, toks, pos, np.where(done, -1, 0).astype(np.int32))
        last_logits = np.asarray(logits, np.float32)
        pos = np.where(fed & ~done, pos + 1, pos)
    out.stop_reasons = reasons
    return out


def _batch_loop(eng, out: BatchGeneration, reasons: list, done: np.ndarray, last_logits: np.ndarray,
                lengths: np.ndarray, cache, max_tokens: int, stops: set[int], rng, sp: dict) -> None:
    """`generate_batch`'s decode where the engine loops on the device (`Engine.decode_loop`):
    every unfinished sequence's first token picked on the host from its prompt's logits (as
    `generate` picks it), then up to DECODE_CHUNK tokens of every row per dispatch, each row's
    tokens read once a chunk and cut at its own stop. `out`, `reasons` and `done` are filled in.

    A row that has stopped (and the padding rows) still rides along in the batch: it is fed
    token 0 at position 0 (its cache row is not read again), so the chunk's positions stay inside
    the cache whatever it held. A chunk is as long as the shortest room any unfinished row has
    left (max_tokens, ctx), so no row runs past its own rules."""
    n, B = len(out), len(done)
    ctx = eng.options.ctx
    tok = np.zeros(B, np.int32)
    pending: list[list[int]] = [[] for _ in range(B)]
    for b in range(n):
        if not done[b]:
            pending[b] = [sample_next(last_logits[b], rng=rng, **sp)]
    key = jax.random.key(int(rng.integers(0, 2**31 - 1)))  # the device's draws follow the seed
    while True:
        for b in range(n):
            for t in pending[b]:
                if done[b]:
                    break
                out[b].append(t)
                reasons[b] = stop_reason(t, len(out[b]), int(lengths[b]) + len(out[b]), max_tokens, stops, ctx)
                done[b] = reasons[b] is not None
                tok[b] = t
        if done.all():
            return
        live = ~done
        length = lengths + np.array([len(o) for o in out] + [0] * (B - n))  # prompt + new tokens
        k = min(DECODE_CHUNK, int((ctx - length)[live].min()), max_tokens - max(len(out[b]) for b in range(n) if live[b]))
        # the last token of each row is not in the cache yet: it goes at position length - 1
        toks, cache = eng.decode(cache, np.where(live, tok, 0), np.where(live, length - 1, 0), k, chunk=DECODE_CHUNK,
                                 sampling=sp, key=key, idle=~live)
        got = np.asarray(toks)[:, :k]
        pending = [got[b].tolist() if live[b] else [] for b in range(B)]
