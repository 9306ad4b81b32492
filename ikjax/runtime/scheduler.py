"""Continuous batching for `ikjax serve`: one thread drives the Engine for `-np` slots.

The shape is llama-server's (slots, a prompt cache per slot) run the way nano-vllm runs it (one
loop, no locks around the model). The slots are the rows of one batch KV cache
(`Engine.new_cache(n_slots)`), each `ctx` tokens long. Every iteration of the loop:

  1. admits waiting requests to free slots (requests join at step boundaries), each on the free
     slot whose cached tokens share the longest usable prefix with its prompt (the prompt cache:
     llama-server's `cache_prompt`), the least recently used slot otherwise;
  2. feeds ONE ubatch chunk of the oldest unfinished prompt, in a batch-1 cache taken out of its
     slot's row (`generation._take_row`) and put back when the prompt is done (`_put_row`), so a
     long prompt delays the other streams by one chunk per token, never by the whole prompt;
  3. runs one decode step of every slot that is generating (one compiled [n_slots, 1] step; the
     rows of idle slots compute a throw-away token just past their cached tokens, where the causal
     mask keeps it out of any later read, and route to no expert: `Engine.step`'s last -1), and
     samples each row's next token on the host with its own request's settings; or, where nothing
     waits (no prompt to feed, no request queued) and every stream is plain greedy, up to
     LOOP_STEPS tokens of every slot in one dispatch of the engine's decode loop (`_decode_loop`:
     on a GPU one CUDA graph for them all, under every split mode), as many as fit
     IKJAX_SERVE_BURST_MS at the last dispatch's pace, each stream's tokens emitted when the
     dispatch ends. A stream generating alone with nothing else to do decodes as a batch of one
     (`_sync_solo`: its row taken out as in 2, put back when anything else happens), so the idle
     slots cost it nothing.

A request that finishes, or is cancelled (its client went away, a stop string matched upstream),
leaves at the next step boundary and frees its slot; the slot keeps its tokens' KV for the prompt
cache.

Greedy output equals `Engine.generate` for the same prompt alone (with this engine's options:
`ctx` is one slot's context): a prompt is fed alone, chunk by chunk as `Engine.prefill` feeds it,
and the decode step computes every row as batch 1 does (ikjax.ops.registry.decode_groups, the
property `generate_batch` relies on; on a GPU with IKJAX_BATCH_INVARIANT=1, which `serve` sets by
default, see registry.batch_invariant). The prompt cache keeps that wherever a fresh run is the
question: mode `exact` reuses a slot's cached prefix only in whole ubatch chunks that were fed as
prompt chunks from a chunk boundary (their KV then holds the very bits a fresh prefill writes);
mode `prefix` reuses the whole common prefix as llama-server does (generated tokens' KV included,
computed by decode steps: the continuation may then differ from a fresh run in the last bits);
the default `auto` is `prefix` for a conversation's next turn (a prompt that goes on past the
slot's last prompt into the tokens it generated: only the new turn is fed) and `exact` otherwise
(the same prompt again, or one sharing a system prompt: the answer stays generate's, bit for
bit); `off` never reuses.

IKJAX_SERVE_TRACE=FILE records each iteration's prompt chunk and decode step (start, end) and writes
them when the scheduler stops (bench/serve_trace.py): the server's side of a stream's delay, to
hold against what a client measures.
"""
from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace as _replace

import jax
import jax.numpy as jnp
import numpy as np

from ikjax import env
from ikjax.chat_template import THINK_CLOSE, THINK_OPEN
from ikjax.errors import IkjaxError, OptionError
from ikjax.model import cache as kvcache
from ikjax.runtime import generation
from ikjax.runtime.executables import compile_side_by_side
from ikjax.runtime.generation import STOP_CONTEXT, STOP_EOS, STOP_MAX_TOKENS, _put_row, _take_row
from ikjax.runtime.reasoning_budget import ReasoningBudget
from ikjax.runtime.sampling import (LOGIT_BAN, NON_FINITE, NonFiniteLogitsError, Penalties, check_count,
                                    check_logit_bias, check_penalty, check_sampling, check_top_logprobs, row_params,
                                    sample_next, sample_rows, token_logprobs)

log = logging.getLogger("ikjax")

# tokens per dispatch when every stream is plain greedy and nothing waits (`_decode_loop`): a
# request that arrives meanwhile waits at most this many steps, a stream gets its tokens this many
# at a time (fewer where IKJAX_SERVE_BURST_MS says so: `_loop_steps`)
LOOP_STEPS = 8

STOP_CANCELLED = "cancelled"
STOP_STRING = "stop"  # the caller matched a stop string and cancelled with this reason
PROMPT_CACHE_MODES = ("auto", "exact", "prefix", "off")
FINISH_REASONS = (STOP_EOS, STOP_STRING, STOP_MAX_TOKENS, STOP_CONTEXT, STOP_CANCELLED, "error")


class QueueFullError(IkjaxError):
    """More requests waiting for a slot than the queue holds (the server answers 503)."""


_ids = itertools.count(1)


@dataclass(eq=False)
class Request:
    """One generation: token ids in, token ids out through `on_event` (called on the scheduler's
    thread: ("token", id) per new token, then ("done", finish reason) or ("error", message))."""
    prompt: np.ndarray
    max_tokens: int | None  # None: until the slot's context is full
    sampling: dict  # check_sampling's result
    stop_ids: frozenset[int]
    on_event: Callable[[str, object], None]
    cache_prompt: bool = True
    ban: frozenset[int] = frozenset()  # ids never drawn (ignore_eos bans EOS, as llama-server does)
    penalties: Penalties = Penalties()  # llama.cpp's repeat / frequency / presence penalties
    logit_bias: tuple[tuple[int, float], ...] = ()  # (id, added to its logit), before the penalties
    budget: ReasoningBudget | None = None  # a reasoning budget (--reasoning-budget, thinking_budget_tokens)
    # each new token's log-probability and this many alternatives (`token_logprobs`); None: none
    top_logprobs: int | None = None
    want_slot: int | None = None  # run on this slot only (llama-server's id_slot); None: any
    n_ctx: int = 0  # a slot's context (its `timings` say it, as llama-server's do)
    # the context shift (Scheduler's context_shift): tokens after the first n_keep (-1: the whole prompt;
    # BOS kept beside them) of which n_discard (0: half of those after n_keep) go when the slot is full
    n_keep: int = 0
    n_discard: int = 0
    shifted: int = 0  # tokens of its sequence dropped from the slot's cache by context shifts
    truncated: bool = False  # its prompt was cut to fit, or its context shifted (llama-server's `truncated`)
    id: int = field(default_factory=lambda: next(_ids))
    # the scheduler's bookkeeping, readable by the caller once "done" arrived
    slot: int | None = None
    n_cached: int = 0  # prompt tokens taken from the slot's cache (not computed)
    generated: list[int] = field(default_factory=list)
    # with top_logprobs: (logprob, ((id, logprob), ...)) of generated[i], filled before its event
    token_logprobs: list[tuple] = field(default_factory=list)
    finish_reason: str | None = None
    t_submit: float = 0.0
    t_start: float = 0.0  # its prompt's first chunk
    t_first: float = 0.0  # its first token
    t_end: float = 0.0
    cancelled: str | None = None  # the reason it was cancelled with, once it was
    _pos: int = 0  # prompt tokens in the cache so far
    _fed_from: int = 0  # where feeding its prompt started
    _rng: np.random.Generator | None = None
    _key: object = None  # its PRNG key for device draws (Scheduler._start_device_draws), after its first token
    _setting: tuple | None = None  # with _key: the static sampling setting of those draws

    def timings(self, n_generated: int | None = None) -> dict:
        """llama-server's `timings` object: prompt and generation, counts and milliseconds. As there,
        the generation's rate is its tokens over the time after the prompt (the first token, drawn
        from the prompt step's logits, counted with no time of its own): predicted_per_second x
        predicted_ms / 1000 = predicted_n, and the figures compare with llama-server's as they are.
        `n_generated`: the tokens the answer holds (a stop string's end: the tokens decoded past it
        in the same burst are not the answer's, and llama-server's predicted_n is its n_decoded)."""
        prompt_n = len(self.prompt) - self.n_cached
        prompt_ms = max(self.t_first - self.t_start, 0.0) * 1e3 if self.t_first else 0.0
        n = len(self.generated) if n_generated is None else min(n_generated, len(self.generated))
        # (while it still generates, as llama-server's timings_per_token: up to now)
        pred_ms = max((self.t_end or time.perf_counter()) - self.t_first, 0.0) * 1e3 if self.t_first else 0.0
        return {"cache_n": self.n_cached, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
                "prompt_per_second": prompt_n / prompt_ms * 1e3 if prompt_ms else 0.0,
                "predicted_n": n, "predicted_ms": pred_ms,
                "predicted_per_token_ms": pred_ms / n if n else 0.0,
                "predicted_per_second": n / pred_ms * 1e3 if pred_ms and n else 0.0,
                "n_ctx": self.n_ctx, "n_past": len(self.prompt) - self.shifted + max(n - 1, 0)}  # (the last token is not in the cache yet)


@dataclass(eq=False)
class Slot:
    index: int
    tokens: list[int] = field(default_factory=list)  # the tokens whose KV the row holds, positions 0..
    exact: int = 0  # leading tokens whose KV is bit for bit what a fresh prefill writes (ubatch multiple)
    prompt_end: int = 0  # leading tokens fed as the last request's prompt (the rest: what it generated)
    # after a context shift: the leading tokens whose KV never moved (the kept part); the rows after them
    # were computed in a context since dropped, so no later prompt reuses them (`_reuse`); None: all
    moved: int | None = None
    req: Request | None = None
    last_used: float = 0.0


@dataclass
class Stats:
    """Counters since start (the metrics endpoint reads them; prometheus-client stays in the server)."""
    requests: dict = field(default_factory=lambda: {r: 0 for r in FINISH_REASONS})
    prompt_tokens: int = 0  # computed
    cached_tokens: int = 0  # taken from a slot's cache
    generated_tokens: int = 0
    prompt_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0


class Scheduler:
    """Start with `start()`; `submit` requests from any thread, `cancel` them, `stop()` at the end."""

    def __init__(self, eng, n_slots: int, *, max_queue: int = 64, prompt_cache: str = "auto",
                 context_shift: bool = False):
        if not isinstance(n_slots, int) or n_slots < 1:
            raise OptionError(f"-np: need at least 1 slot, got {n_slots!r}")
        if prompt_cache not in PROMPT_CACHE_MODES:
            raise OptionError(f"prompt cache: expected one of {', '.join(PROMPT_CACHE_MODES)}, got {prompt_cache!r}")
        if not isinstance(max_queue, int) or max_queue < 0:
            raise OptionError(f"queue size: need an integer >= 0, got {max_queue!r}")
        if context_shift and eng.options.split_mode == "graph":
            raise OptionError("--context-shift: not with -sm graph (ik_llama.cpp turns it off there too)")
        self.eng = eng
        self.n_slots = n_slots
        # llama-server's context shift (ik's --context-shift): a prompt longer than a slot is cut (its
        # first n_keep tokens and its end kept), a generation that fills its slot drops half of the
        # tokens after n_keep and goes on (`_shift`); off: a 400 and finish_reason "length", as vLLM
        self.context_shift = bool(context_shift)
        self.ctx = eng.options.ctx
        self.ubatch = eng.options.ubatch
        self.max_queue = max_queue
        self.prompt_cache = prompt_cache
        self.slots = [Slot(i) for i in range(n_slots)]
        self.stats = Stats()
        self._cache = eng.new_cache(n_slots)
        self._queue: deque[Request] = deque()  # waiting for a slot
        self._erase: set[int] = set()  # slots whose cached tokens the loop forgets next (erase_slot)
        self._prefill: deque[Request] = deque()  # on a slot, prompt not yet in; the head is being fed
        self._one = None  # the head's batch-1 cache while its prompt is fed
        # (slot index, its row as a batch-1 cache) while one stream decodes alone (`_sync_solo`)
        self._solo = None
        self._solo_on = env.choice("IKJAX_SERVE_SOLO") == "1" and n_slots > 1
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="ikjax-scheduler", daemon=True)
        self._row_keys = eng.row_sampling()  # sampled streams draw on the device, a key per row
        self._step_s = 0.0  # the last decode dispatch's time a step (the loop's length follows it)
        self._burst_s = env.positive_float("IKJAX_SERVE_BURST_MS") / 1e3
        self._loop_note = None  # the decode loop's details for the trace (`_record`)
        self._trace_path = env.raw("IKJAX_SERVE_TRACE")
        self._trace = deque(maxlen=100_000) if self._trace_path else None

    # -- the caller's side (any thread) ---------------------------------------------------------
    def start(self) -> "Scheduler":
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join()

    def make_request(self, prompt: Sequence[int], max_tokens: int | None, *, on_event, temperature: float = 0.0,
                     top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None,
                     stop_ids: Sequence[int] = (), ignore_eos: bool = False, cache_prompt: bool = True,
                     repeat_penalty: float = 1.0, repeat_last_n: int = 64, frequency_penalty: float = 0.0,
                     presence_penalty: float = 0.0, penalize_nl: bool = False, top_logprobs: int | None = None,
                     logit_bias=None, slot: int | None = None, reasoning_budget: int = -1,
                     reasoning_budget_message: str = "", n_keep: int = 0, n_discard: int = 0) -> Request:
        """A checked request (OptionError naming the bad field): the prompt inside the vocabulary and
        shorter than a slot's context, the sampling settings as `Engine.generate` takes them.
        `slot`: run on this slot (llama-server's id_slot), waiting for it; None: any.
        `reasoning_budget` >= 0: at most that many tokens inside a `<think>` block (the prompt's
        open one included), then `reasoning_budget_message` and `</think>` forced (ik's rules,
        ikjax.runtime.reasoning_budget); -1: none. `n_keep`, `n_discard`: the context shift's (llama-server's
        fields; with context_shift on, a prompt that does not fit a slot is cut as ik_llama.cpp cuts it)."""
        if slot is not None and (not isinstance(slot, (int, np.integer)) or isinstance(slot, bool)
                                 or not 0 <= slot < self.n_slots):
            raise OptionError(f"slot: expected one of 0..{self.n_slots - 1}, got {slot!r}")
        ids = generation.check_ids(prompt, self.eng.config.vocab_size, "prompt")
        for name, v, lo in (("n_keep", n_keep, -1), ("n_discard", n_discard, 0)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < lo:
                raise OptionError(f"{name}: expected an integer >= {lo}, got {v!r}")
        truncated = False
        if len(ids) >= self.ctx:
            if not self.context_shift:
                raise OptionError(f"prompt: {len(ids)} tokens do not fit a slot's context ({self.ctx} tokens, -c / "
                                  f"-np), which must hold the prompt and at least one new token")
            ids, truncated = self._cut_prompt(ids, int(n_keep), int(n_discard)), True
        if max_tokens is not None:
            max_tokens = check_count("max_tokens", max_tokens)
        sampling = check_sampling(temperature, top_k, top_p, min_p, seed, vocab=self.eng.config.vocab_size)
        if sampling["seed"] is None:  # random: drawn here, so the answer can say which (and be redone)
            sampling["seed"] = int(np.random.default_rng().integers(0, 2**32 - 1))
        pen = check_penalty(repeat_penalty, repeat_last_n, frequency_penalty, presence_penalty, penalize_nl)
        pen = _replace(pen, newline=self.eng.newline_token)
        top_logprobs = check_top_logprobs(top_logprobs)
        eos = self.eng.config.eos_token_id
        stops = generation.stop_ids(stop_ids, None if ignore_eos else eos)
        # a bias of 0 changes nothing: dropped, so it does not move the request to the host sampler
        bias = [(t, b) for t, b in check_logit_bias(logit_bias, self.eng.config.vocab_size) if b != 0]
        # a bias of -100 or less is a ban (the device argmax honours bans; other biases sample on the host)
        ban = frozenset(({eos} if ignore_eos and eos is not None else set()) | {t for t, b in bias if b <= LOGIT_BAN})
        if len(ban) >= self.eng.config.vocab_size:  # nothing left to draw: it drew banned ids before
            raise OptionError(f"logit_bias: bans every token of the vocabulary ({self.eng.config.vocab_size})"
                              f"{' with ignore_eos' if ignore_eos else ''}; leave at least one")
        return Request(prompt=ids, max_tokens=max_tokens, sampling=sampling, stop_ids=frozenset(stops),
                       on_event=on_event, cache_prompt=bool(cache_prompt), ban=ban, penalties=pen,
                       top_logprobs=top_logprobs, logit_bias=tuple((t, b) for t, b in bias if b > LOGIT_BAN),
                       want_slot=None if slot is None else int(slot), n_ctx=self.ctx,
                       budget=self._budget(ids, reasoning_budget, reasoning_budget_message), n_keep=int(n_keep),
                       n_discard=int(n_discard), truncated=truncated)

    def _bos_kept(self, tokens) -> int:
        """1 where the sequence starts with BOS (kept beside n_keep, as ik adds add_bos_token)."""
        bos = self.eng.config.bos_token_id
        return int(len(tokens) > 0 and bos is not None and int(tokens[0]) == bos)

    def _cut_prompt(self, ids: np.ndarray, n_keep: int, n_discard: int) -> np.ndarray:
        """A prompt too long for a slot cut as ik_llama.cpp's context_shift_prompt cuts it: its first
        n_keep tokens (and BOS) kept, then n_discard tokens (0: half of the slot past them) dropped as
        many times as it takes to leave room for one new token."""
        keep = max(0, n_keep) + self._bos_kept(ids)
        step = n_discard or (self.ctx - keep) // 2
        if keep >= self.ctx - 1 or step <= 0:
            raise OptionError(f"prompt: {len(ids)} tokens do not fit a slot's context ({self.ctx} tokens), and n_keep "
                              f"{n_keep} leaves nothing to cut")
        cut = 0
        while len(ids) - cut >= self.ctx:
            cut += step
        # (an n_discard past the prompt's end leaves its last token, or the kept part: never nothing)
        cut = min(cut, len(ids) - max(keep, 1))
        return np.concatenate([ids[:keep], ids[keep + cut:]]).astype(ids.dtype)

    def _budget(self, prompt: np.ndarray, budget, message) -> ReasoningBudget | None:
        """The request's ReasoningBudget (None for -1), fed the prompt from its last opening tag on."""
        if not isinstance(budget, (int, np.integer)) or isinstance(budget, bool) or budget < -1:
            raise OptionError(f"reasoning budget: expected an integer >= -1 (-1 = none), got {budget!r}")
        if not isinstance(message, str):
            raise OptionError(f"reasoning budget message: expected a string, got {type(message).__name__}")
        if budget < 0:
            return None
        tok = self.eng.tokenizer
        ids = [tok.encode(t, add_bos=False, parse_special=True) for t in (THINK_OPEN, THINK_CLOSE, message + THINK_CLOSE)]
        rb = ReasoningBudget(int(budget), *ids, piece=tok.piece)
        start = ids[0]
        # the last opening tag: only where its first id stands (a long prompt is not slid over whole)
        at = next((int(i) for i in np.flatnonzero(np.asarray(prompt) == start[0])[::-1]
                   if np.asarray(prompt[i:i + len(start)]).tolist() == start), None) if start else None
        for t in np.asarray(prompt[at:]).tolist() if at is not None else ():
            rb.accept(t, prompt=True)
        return rb

    def submit(self, req: Request) -> Request:
        with self._cv:
            free = sum(s.req is None for s in self.slots)
            if len(self._queue) - free >= self.max_queue:
                # (queued requests that a free slot will take at the next step do not wait)
                raise QueueFullError(f"server busy: {len(self._queue) - free} requests already wait for one of "
                                     f"{self.n_slots} slots")
            req.t_submit = time.perf_counter()
            self._queue.append(req)
            self._cv.notify()
        return req

    def erase_slot(self, index: int) -> int:
        """Forget slot `index`'s cached tokens (llama-server's /slots/{id}?action=erase): the next
        request there computes its whole prompt. Refused while a request runs on it; done by the
        loop before its next admission (the loop alone touches a slot's tokens). Returns how many
        tokens the slot held."""
        with self._cv:
            slot = self.slots[index]
            if slot.req is not None:
                raise OptionError(f"slot {index} is processing a request; erase it when it is idle")
            self._erase.add(index)
            self._cv.notify()
            return len(slot.tokens)

    def cancel(self, req: Request, reason: str = STOP_CANCELLED) -> None:
        """Stop `req` at the next step boundary (its slot is freed then), finishing it with `reason`
        (STOP_STRING: the caller found a stop string); a no-op once it is done."""
        req.cancelled = reason
        with self._cv:
            self._cv.notify()

    def queue_length(self) -> int:
        return len(self._queue)

    def slots_busy(self) -> int:
        return sum(s.req is not None for s in self.slots)

    def slot_info(self) -> list[dict]:
        """llama-server's /slots: each slot's context, state (ik's `state`: 0 idle, 1 processing, and
        llama.cpp's `is_processing`), cached tokens and `next_token` (decoded so far, left)."""
        out = []
        for s in self.slots:
            r = s.req
            n = len(r.generated) if r is not None else 0
            left = -1 if r is None or r.max_tokens is None else max(r.max_tokens - n, 0)
            out.append({"id": s.index, "n_ctx": self.ctx, "is_processing": r is not None, "state": int(r is not None),
                        "n_cached": len(s.tokens), "id_task": r.id if r is not None else -1,
                        "next_token": {"has_next_token": r is not None, "n_remain": left, "n_decoded": n}})
        return out

    def warmup(self, prompts: bool = True, sampling: dict | None = None) -> int:
        """Compile before the first request arrives (llama-server's warm-up run): the decode step of
        all slots (and of a lone stream's row, `_sync_solo`) at every KV bucket it can meet and,
        with `prompts`, the full-ubatch prompt step at every KV bucket of a prompt's chunks; on an accelerator also the short prompt step
        (Engine.token_bucket: a prompt's tail, a chat turn after a cached history) at every KV
        bucket, all side by side. A step compiled while streams decode stalls them all for the
        compile's time; on the CPU the shapes left to first use are a prompt's last, partial chunk
        (a compile there takes a second or two). `sampling` (the server's request defaults, as
        check_sampling returns them): on an accelerator also the loop of sampled streams with that
        setting, so requests that leave their sampling to the defaults loop without a compile.
        Returns the steps compiled."""
        eng, ub = self.eng, self.ubatch
        before = eng.compile_count
        # the decode batches: all slots, and a lone stream's row (_sync_solo)
        batches = (self.n_slots, 1) if self._solo_on else (self.n_slots,)
        kvs = sorted({eng.kv_bucket(n, 1) for n in range(1, self.ctx + 1, max(1, eng.options.kv_block))}
                     | {eng.kv_bucket(self.ctx, 1)})
        jobs = [(b, 1, kv) for b in batches for kv in kvs]
        # the decode loop of each batch (_decode_loop) at the same buckets: its kv_needed is its
        # last step's (Engine.precompile_decode)
        loops = [(b, LOOP_STEPS, kv) for b, _, kv in jobs if kv >= LOOP_STEPS] \
            if eng.decode_loop() else []
        # and, side by side on an accelerator, its form that bans EOS (ignore_eos streams loop too,
        # _loop_steps; compiled when first asked for, it would stall every stream for its compile)
        eos = eng.config.eos_token_id
        plain = list(loops)
        if plain and eos is not None and eng.compile_in_parallel():
            loops += [(*j, {"ban": [eos]}) for j in plain]
        if plain and sampling and sampling.get("temperature", 0.0) > 0.0 and self._row_keys \
                and eng.compile_in_parallel():
            loops += [(*j, dict(_setting_of(sampling, ()))) for j in plain]
        if prompts:
            seen = set()
            for c0 in range(0, self.ctx - ub + 1, ub):
                T = eng.prompt_tokens(ub, c0)
                key = (T, eng.kv_bucket(c0 + T, T))
                if key not in seen:
                    seen.add(key)
                    jobs.append((1, T, c0 + T))
            parallel = eng.compile_in_parallel()
            for T in eng.prompt_step_sizes() if parallel else ():
                if T == ub:
                    continue
                for p in range(0, self.ctx - T + 1, T):
                    key = (T, eng.kv_bucket(p + T, T))
                    if key not in seen:
                        seen.add(key)
                        jobs.append((1, T, p + T))
        work = [(eng.precompile, j) for j in jobs] + [(eng.precompile_decode, j) for j in loops]
        if eng.compile_in_parallel() and len(work) > 1:  # a family: one kind of step, one token count
            # lowered one at a time in this order: the prompt steps first, the most tokens first, then the
            # decode loops and the one-token steps (the longest XLA compiles start first, RESULTS §22al)
            def order(w) -> tuple[int, int]:  # (kind: prompt step 0, decode loop 1, one-token step 2; tokens)
                fn, (_, tokens, *_) = w
                return (1, 0) if fn == eng.precompile_decode else (2, 0) if tokens == 1 else (0, -tokens)
            work.sort(key=order)
            # (each loop form its own family: they start at once beside the plain one)
            compile_side_by_side([((fn.__name__, j[1], repr(j[3:])), functools.partial(fn, *j)) for fn, j in work])
        else:
            for fn, j in work:
                fn(*j)
        self._warm_helpers()
        return eng.compile_count - before

    def _warm_helpers(self) -> None:
        """Run the loop's small jitted helpers once at their shapes (a slot's row taken out and put
        back, the greedy rows' argmax with and without banned ids, the context shift where it is on):
        compiled on first use, each
        would otherwise stall every stream for its compile when the first prompt or ban arrives."""
        row = _take_row(self._cache, 0)
        if self.context_shift:  # the shift of a slot's row in the slots' cache and in a lone stream's
            # (keep and discard 0: every row where it was, turned by no angle)
            row = kvcache.shift_row(row, self.eng.config, 0, 0, 0)
            self._cache = kvcache.shift_row(self._cache, self.eng.config, 0, 0, 0)
        self._cache = _put_row(self._cache, row, 0)
        logits = jnp.zeros((self.n_slots, self.eng.config.vocab_size), jnp.float32)
        banned = np.full((self.n_slots, 1), self.eng.config.vocab_size, np.int32)
        jax.block_until_ready((_argmax_rows(logits), _argmax_rows(logits, banned)))

    # -- the loop (the scheduler's thread) ----------------------------------------------------------
    def _free_slot_exists(self) -> bool:
        return any(s.req is None for s in self.slots)

    def _busy(self) -> bool:
        return bool(self._prefill) or bool(self._erase) or any(s.req is not None for s in self.slots) or (
            bool(self._queue) and self._free_slot_exists())

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._busy() and not any(r.cancelled for r in self._queue):
                    self._cv.wait()
                if self._stopping:
                    break
            try:
                self._iteration()
            except Exception as e:  # noqa: BLE001 - the loop must outlive any one failure
                log.exception("scheduler: step failed")
                self._reset(_one_line(e))
        for req in list(self._queue) + [s.req for s in self.slots if s.req is not None]:
            self._finish(req, STOP_CANCELLED)
        if self._trace is not None:
            self._write_trace()

    def _iteration(self) -> None:
        self._drop_cancelled()
        with self._cv:
            self._apply_erases()
        self._admit()
        self._sync_solo()
        fed = bool(self._prefill)
        if fed:
            t = time.perf_counter()
            self._prefill_chunk()
            self._record("chunk", t)
            self._sync_solo()  # a prompt just done may leave one stream: its first step alone
        if any(s.req is not None and s.req._pos == len(s.req.prompt) for s in self.slots):
            t = time.perf_counter()
            self._decode_step(single=fed)
            self._record("decode", t)

    @staticmethod
    def _decoding(s: Slot) -> bool:
        """Whether slot `s` holds a request past its prompt, not yet finished: a row the decode feeds."""
        r = s.req
        return r is not None and r._pos == len(r.prompt) and r.finish_reason is None

    def _sync_solo(self) -> None:
        """One stream decoding and nothing else to do: its slot's row decodes as a batch of one
        (IKJAX_SERVE_SOLO), taken out of the slots' cache once and put back when anything else
        happens (a prompt to feed, a request waiting, a second stream, its end). Why: a decode step
        of all the slots costs the idle ones too (their rows, their attention, their tiles): a
        one-row step of the tiny model on this CPU takes a third of an 8-slot step's time, and on
        an H200 the V2-Lite shape's 2.60 against 3.61 ms (RESULTS §23k, §23n). Its bits are the
        row's in the batch (the decode forms are batch-invariant), so answers do not change."""
        want = None
        if self._solo_on and not self._prefill and not self._queue:
            gen = [s for s in self.slots if self._decoding(s)]
            if len(gen) == 1:
                want = gen[0].index
        if self._solo is not None and self._solo[0] != want:
            self._cache = _put_row(self._cache, self._solo[1], self._solo[0])
            self._solo = None
        if want is not None and self._solo is None:
            self._solo = (want, _take_row(self._cache, want))

    def _batch(self) -> list[Slot]:
        """The decode batch's slots in row order: the lone stream's (`_sync_solo`) or every slot."""
        return [self.slots[self._solo[0]]] if self._solo is not None else self.slots

    def _batch_cache(self):
        return self._solo[1] if self._solo is not None else self._cache

    def _set_batch_cache(self, cache) -> None:
        if self._solo is not None:
            self._solo = (self._solo[0], cache)
        else:
            self._cache = cache

    def _record(self, kind: str, t0: float) -> None:
        """IKJAX_SERVE_TRACE: the step's (kind, start, end) in the trace (the last 100,000 kept); a
        decode loop's also when its tokens reached the host ("ready": the rest of it was the host
        emitting them) and its steps ("k")."""
        if self._trace is not None:
            self._trace.append((kind, t0, time.perf_counter(), self._loop_note))
        self._loop_note = None

    def _write_trace(self) -> None:
        import json
        with open(self._trace_path, "w") as f:
            for kind, t0, t1, note in self._trace:
                f.write(json.dumps({"kind": kind, "t0": t0, "t1": t1, **(note or {})}) + "\n")

    def _drop_cancelled(self) -> None:
        with self._cv:
            gone = [r for r in self._queue if r.cancelled]
            for r in gone:
                self._queue.remove(r)
        for r in gone:
            self._finish(r, r.cancelled)
        for s in self.slots:
            r = s.req
            if r is None or not r.cancelled:
                continue
            if self._prefill and self._prefill[0] is r and self._one is not None:
                self._end_prefill(r)  # what was fed so far stays in the slot's cache
            if r in self._prefill:
                self._prefill.remove(r)
            self._finish(r, r.cancelled)

    def _reuse(self, slot: Slot, prompt: np.ndarray, cache_prompt: bool) -> int:
        """Prompt tokens `slot` can keep for this prompt (at least the last one is computed again:
        its logits choose the first new token)."""
        if not cache_prompt or self.prompt_cache == "off" or not slot.tokens:
            return 0
        lcp = self._lcp(slot, prompt)
        if slot.moved is not None:  # (a shifted slot: only its kept part, which a fresh run writes the same)
            lcp = min(lcp, slot.moved)
        if lcp <= 0:
            return 0
        if self.prompt_cache == "prefix" or (self.prompt_cache == "auto" and self._next_turn(slot, prompt, lcp)):
            return lcp
        return min(lcp, slot.exact) // self.ubatch * self.ubatch

    @staticmethod
    def _lcp(slot: Slot, prompt: np.ndarray) -> int:
        """Tokens the slot's cache and `prompt` share from the start (at most all but the prompt's last)."""
        n = min(len(slot.tokens), len(prompt) - 1)
        if n <= 0:
            return 0
        differ = np.nonzero(np.asarray(slot.tokens[:n], np.int64) != prompt[:n])[0]
        return int(differ[0]) if len(differ) else n

    def _similar(self, slot: Slot, prompt: np.ndarray) -> int:
        """The shared prefix when it is at least half the prompt (llama-server's slot choice,
        --slot-prompt-similarity 0.5), else 0: among slots that reuse as much, the one that holds
        this conversation takes it, rather than the least recently used one, whose cache another
        conversation may come back for (a repeated short prompt went to another slot, evicting it)."""
        lcp = self._lcp(slot, prompt) if slot.tokens else 0
        if slot.moved is not None:
            lcp = min(lcp, slot.moved)
        return lcp if 2 * lcp >= len(prompt) else 0

    def _next_turn(self, slot: Slot, prompt: np.ndarray, lcp: int) -> bool:
        """Whether `prompt` goes on from the slot's last request (auto reuses the whole common prefix
        then, as llama-server): it shares more than that request's prompt, or all of it but a
        trailing `<think>` opening (R1's generation prompt, which its template does not render again
        for an earlier turn: every R1 turn fell back to whole -ub chunks, up to 511 tokens fed
        again) in a prompt that is longer (an answer and a new message after it)."""
        if lcp > slot.prompt_end:
            return True
        if lcp < slot.prompt_end - 16 or len(prompt) <= slot.prompt_end:
            return False
        try:
            tail = self.eng.tokenizer.decode(slot.tokens[lcp:slot.prompt_end])
        except Exception:  # noqa: BLE001 - a model without a usable tokenizer: no such turn to tell
            return False
        return tail.strip() == "<think>"

    def _admit(self) -> None:
        now = time.perf_counter()
        while True:
            with self._cv:
                free = [s for s in self.slots if s.req is None]
                if not self._queue or not free:
                    return
                # the first in line that can run now: a request for a busy slot waits for it
                # without holding back the others (llama-server's id_slot)
                req = next((r for r in self._queue if r.want_slot is None or self.slots[r.want_slot].req is None),
                           None)
                if req is None:
                    return
                self._queue.remove(req)
                # under the lock with the slot's taking: an erase_slot answered before it is applied
                # before any reuse is reckoned, one after it is refused (the slot busy); before, an
                # erase between the two was answered, then skipped, the slot's tokens reused
                self._apply_erases()
                best = self.slots[req.want_slot] if req.want_slot is not None else \
                    max(free, key=lambda s: (self._reuse(s, req.prompt, req.cache_prompt),
                                             self._similar(s, req.prompt), -s.last_used))
                req.slot = best.index
                req.n_cached = req._pos = self._reuse(best, req.prompt, req.cache_prompt)
                best.req = req
            req._rng = np.random.default_rng(req.sampling["seed"])
            best.last_used = now
            self._prefill.append(req)

    def _apply_erases(self) -> None:
        """The idle slots' pending erase_slot calls (the caller holds the lock; the loop's thread)."""
        erase, self._erase = self._erase, set()
        for i in erase:
            slot = self.slots[i]
            if slot.req is None:
                slot.tokens, slot.exact, slot.prompt_end, slot.moved = [], 0, 0, None

    def _prefill_chunk(self) -> None:
        req = self._prefill[0]
        slot = self.slots[req.slot]
        if self._one is None:  # its first chunk: continue the slot's sequence after the reused prefix
            self._one = _take_row(self._cache, slot.index)
            req.t_start = time.perf_counter()
            start = req._pos
            slot.exact = min(slot.exact, start) // self.ubatch * self.ubatch
            slot.prompt_end = min(slot.prompt_end, start)
            slot.tokens = slot.tokens[:start]
            slot.moved = None  # (start is within any shifted slot's kept part: `_reuse`)
            req._fed_from = start
            self.stats.cached_tokens += start
        t0 = time.perf_counter()
        chunk = req.prompt[req._pos:req._pos + self.ubatch]
        try:
            logits, self._one = self.eng.prefill(self._one, chunk, start=req._pos)
        except Exception as e:  # noqa: BLE001 - this prompt's failure, not the batch's
            # the batch cache is untouched (the prompt is fed in its own copy of the row): the slot
            # keeps the tokens it held before this prompt, the other requests go on
            log.exception("scheduler: prompt step failed")
            self._one = None
            self._prefill.popleft()
            slot.tokens = slot.tokens[:req._fed_from]
            self._finish(req, "error", _one_line(e))
            return
        req._pos += len(chunk)
        slot.tokens.extend(int(t) for t in chunk)
        self.stats.prompt_tokens += len(chunk)
        self.stats.prompt_seconds += time.perf_counter() - t0
        if req._pos < len(req.prompt):
            return
        self._end_prefill(req)
        self._prefill.popleft()
        if req.max_tokens == 0:
            req.t_first = time.perf_counter()
            self._finish(req, STOP_MAX_TOKENS)
            return
        self._next(req, lambda f: self._sample(req, logits, f))
        self._start_device_draws(req)

    def _end_prefill(self, req: Request) -> None:
        """The head prompt's batch-1 cache back into its slot's row; whole chunks fed from a chunk
        boundary (with an exact prefix before them) count as exact."""
        slot = self.slots[req.slot]
        self._cache = _put_row(self._cache, self._one, slot.index)
        self._one = None
        slot.prompt_end = req._pos
        start = req._fed_from
        if start % self.ubatch == 0 and start <= slot.exact:
            slot.exact = start + (req._pos - start) // self.ubatch * self.ubatch

    def _decode_step(self, single: bool = False) -> None:
        """One decode step of every generating slot, or a loop of them (`_loop_steps`) unless
        `single`: after a prompt chunk the streams have waited a chunk, and their next token comes
        from one step; a loop would hold it until the loop's last (RESULTS §23h: the token after a
        2048-token prompt came a whole dispatch late)."""
        batch = self._batch()
        row = {s.index: i for i, s in enumerate(batch)}  # a slot's row in the batch
        if self.context_shift:
            for s in batch:
                if self._decoding(s) and len(s.tokens) >= self.ctx - 1:
                    self._shift(s, row[s.index])
            if not any(self._decoding(s) for s in batch):
                return
        B = len(batch)
        toks = np.zeros((B, 1), np.int32)
        start = np.zeros(B, np.int32)
        last = np.full(B, -1, np.int32)  # idle rows route to no expert (Engine.step)
        rows = []
        for i, s in enumerate(batch):
            # idle rows write a throw-away entry just past their cached tokens (never read: the
            # causal mask hides it until a later token overwrites it); the row of a prompt being fed
            # is replaced whole when its prompt is done
            start[i] = min(len(s.tokens), self.eng.capacity - 1)
            if self._decoding(s):
                toks[i, 0] = s.req.generated[-1]
                last[i] = 0
                rows.append(s)
        k = 1 if single else self._loop_steps(rows, batch)
        if k > 1:
            self._decode_loop(rows, batch, row, toks[:, 0], k, last)
            return
        t0 = time.perf_counter()
        logits, cache = self.eng.step(self._batch_cache(), toks, start, last)
        self._set_batch_cache(cache)
        # greedy rows take the argmax on the device (a few bytes back, not a [rows, vocab] copy of
        # floats and a host pass over each); rows that sample read their logits on the host
        greedy = [s for s in rows if _plain_greedy(s.req)]
        if greedy:
            top, finite = (np.asarray(a) for a in _argmax_rows(logits, self._banned(greedy, row, B)))
        # sampled rows without penalties or biases (logprobs too) draw on the device with their own
        # key, as the loop draws them (sampling.sample_rows): one call per sampling setting
        drawn: dict[int, int] = {}
        settings = {row[s.index]: s.req._setting for s in rows if s.req._setting is not None}
        if settings:
            for setting in set(settings.values()):
                keys, params = self._keys([s for s in rows if settings.get(row[s.index]) == setting], row, B)
                got = np.asarray(_sample_rows(logits, keys, start, params, setting))
                drawn.update({b: int(got[b]) for b, st in settings.items() if st == setting})
        reports = any(row[s.index] in drawn and s.req.top_logprobs is not None for s in rows)
        host = np.asarray(logits, np.float32) if reports or len(greedy) + len(drawn) < len(rows) else None
        self._step_s = time.perf_counter() - t0
        self.stats.decode_seconds += self._step_s
        self.stats.decode_steps += 1
        for s in rows:
            b, req = row[s.index], s.req
            s.tokens.append(int(toks[b, 0]))
            if _plain_greedy(req):
                self._next(req, lambda f: _checked(int(top[b]) if f is None else f, bool(finite[b])))
            elif b in drawn:
                self._next(req, lambda f: _reported(req, _checked(drawn[b] if f is None else f, drawn[b] != NON_FINITE),
                                                    host, b))
            else:
                self._next(req, lambda f: self._sample(req, host[b], f))

    def _shift(self, s: Slot, b: int) -> None:
        """llama-server's context shift of slot `s` (row b of the decode batch), full with a generating
        request: the tokens after its first n_keep (-1: the whole prompt; BOS beside them) lose
        n_discard of theirs (0: half), the rest move down with their keys' rotation turned back
        (`cache.shift_row`), and the request goes on. Where nothing can go, it ends ("length")."""
        req = s.req
        # (n_keep -1: the whole prompt, which starts the slot's tokens whatever the shifts before dropped)
        keep = len(req.prompt) if req.n_keep < 0 else req.n_keep + self._bos_kept(s.tokens)
        keep = min(self.ctx - 4, keep)
        n_left = len(s.tokens) - keep
        discard = min(req.n_discard or n_left // 2, n_left)
        if discard <= 0:
            self._finish(req, STOP_CONTEXT)
            return
        self._set_batch_cache(kvcache.shift_row(self._batch_cache(), self.eng.config, b, keep, discard))
        s.tokens = s.tokens[:keep] + s.tokens[keep + discard:]
        s.exact, s.prompt_end = min(s.exact, keep), min(s.prompt_end, keep)
        s.moved = keep if s.moved is None else min(s.moved, keep)
        req.shifted += discard
        req.truncated = True
        log.info("slot %d: context shift: kept %d, dropped %d, %d tokens left in the slot", s.index, keep, discard,
                 len(s.tokens))

    def _limits(self, req: Request) -> tuple[int, int]:
        """(tokens `req` may generate, the context its length counts against): max_tokens, else up to
        the slot's context; with the context shift up to the model's training context in all (ik's
        bound on a generation without n_predict), the slot's context never full."""
        if not self.context_shift:
            return (self.ctx if req.max_tokens is None else req.max_tokens), self.ctx
        train = max(self.eng.config.context_length, self.ctx)
        return (max(1, train - len(req.prompt)) if req.max_tokens is None else req.max_tokens), 1 << 62

    def _start_device_draws(self, req: Request) -> None:
        """After `req`'s first token (drawn on the host): whether its later tokens are drawn on the
        device with its own key, in one-step dispatches and in the loop alike (the same tokens,
        `generate`'s for its seed): sampling without a penalty or a logit bias, where the engine's
        loop takes a key per row (one device). The key comes from the request's
        generator right after its first token, where Engine.generate draws it. Banned ids other
        than EOS (a logit_bias of -100) keep the host's draw: the ban set is part of the device
        draw's compiled setting, so each new set compiled a loop while every stream waited."""
        # (log-probabilities only report: read from the logits beside the device's draw, so asking
        # for them does not change the answer; drawn on the host, they once did)
        if self._row_keys and req.sampling["temperature"] > 0.0 and not req.penalties.active and not req.logit_bias \
                and self._loop_ban(req.ban):
            req._key = jax.random.key(int(req._rng.integers(0, 2**31 - 1)))
            req._setting = _setting_of(req.sampling, req.ban)

    def _keys(self, rows: list[Slot], row: dict, B: int):
        """([B] PRNG keys, [B] sampling values: sampling.row_params) of the decode batch: each row's
        request's key and setting, a fixed key and the first row's setting for the others (`row`: a
        slot's row in the batch; `rows` share one top_k bucket: one `_setting`)."""
        mine = {row[s.index]: s.req for s in rows}
        idle = _idle_key()
        keys = jnp.stack([mine[i]._key if i in mine else idle for i in range(B)])
        fill = rows[0].req.sampling
        return keys, row_params([mine[i].sampling if i in mine else fill for i in range(B)])

    def _loop_ban(self, ban) -> bool:
        """A ban set the device's draws take without compiling a program for it: none, or EOS
        (ignore_eos), whose loop `warm_up` compiles; any other set (a logit_bias of -100) is banned by
        the one-step argmax's argument or the host's draw."""
        return set(ban) <= {self.eng.config.eos_token_id}

    def _loop_steps(self, rows: list[Slot], batch: list[Slot]) -> int:
        """How many tokens the next dispatch makes for every generating slot: more than one only
        where the engine loops on the device (`Engine.decode_loop`), no prompt is being fed and no
        request waits (they join at step boundaries), every stream is plain greedy (one compiled
        loop, warmed up ahead), and every slot has the room: its request's token
        limit and context, and every row's cache past its tokens (an idle row's throw-away entries
        must not land on the tokens its slot keeps for the prompt cache). Streams that ban EOS
        (ignore_eos) loop too where they all do: the loop's sampler takes the ban, and that loop is
        compiled with the plain one at start (`warm_up`); before, every such stream ran one
        dispatch a token (bench/serve_load.py asks ignore_eos: its one-stream row measured that,
        RESULTS §23g). Any other ban set (a logit_bias of -100) runs one dispatch a token, whose
        device argmax takes the banned ids as an argument: a loop per set compiled when the set
        first came, a whole model's loop on a GPU while every stream waited."""
        if not rows or self._prefill or self._queue or not self.eng.decode_loop():
            return 1
        if any(s.req.cancelled or s.req.top_logprobs is not None for s in rows):
            return 1  # (the loop hands back tokens, not the logits log-probabilities are read from)
        # a reasoning budget: no token the loop draws may be one it would force (a forced token
        # changes every token after it); its free steps bound the loop, forcing is one step a token
        free = [f for f in (s.req.budget.free_steps() for s in rows if s.req.budget is not None) if f is not None]
        if free and min(free) < 2:
            return 1
        if all(_plain_greedy(s.req) for s in rows):
            bans = {frozenset(s.req.ban) for s in rows}
            if len(bans) > 1 or not self._loop_ban(next(iter(bans))):  # one loop bans one set
                return 1
        elif len({s.req._setting for s in rows}) > 1 or rows[0].req._setting is None:
            return 1  # one loop draws with one setting (each row with its own key)
        # a dispatch's steps within the burst budget at the last dispatch's pace: its tokens reach
        # the streams together, and a prompt arriving meanwhile waits for its end (RESULTS §23m:
        # 8 steps of an 8-stream batch held tokens 75 ms, longer than a 512-token chunk)
        k = LOOP_STEPS if not self._step_s else max(1, min(LOOP_STEPS, int(self._burst_s / self._step_s)))
        if free:
            k = min(k, min(free))
        for s in rows:
            req = s.req
            limit, _ = self._limits(req)
            # (the slot's room: ctx - 1 - len(s.tokens), a context shift's point where it is on)
            k = min(k, limit - len(req.generated), self.ctx - len(req.prompt) - len(req.generated) + req.shifted)
        return min(k, min(self.eng.capacity - len(s.tokens) for s in batch))

    def _decode_loop(self, rows: list[Slot], batch: list[Slot], row: dict, toks: np.ndarray, k: int,
                     last: np.ndarray) -> None:
        """k decode steps of every slot in one dispatch (`_loop_steps` said they fit); each stream's
        tokens then emitted one by one as `_decode_step` emits them, up to its stop or cancel (the
        entries of the tokens fed after that lie past its slot's tokens: never read)."""
        start = np.array([len(s.tokens) for s in batch], np.int32)
        t0 = time.perf_counter()
        req0 = rows[0].req  # every row's setting is the same (_loop_steps)
        if _plain_greedy(req0):
            ban = sorted(req0.ban)
            sampling, key = ({"ban": ban} if ban else None), None
        else:
            sampling, key = dict(req0._setting), self._keys(rows, row, len(batch))  # (the bucket: static)
        out, cache = self.eng.decode(self._batch_cache(), toks, start, k, chunk=LOOP_STEPS, check_finite=False,
                                     idle=last < 0, sampling=sampling, key=key)
        self._set_batch_cache(cache)
        got = np.asarray(out)[:, :k]
        ready = time.perf_counter()
        self._loop_note = {"ready": ready, "k": k}
        dt = ready - t0
        self._step_s = dt / k
        self.stats.decode_seconds += dt
        self.stats.decode_steps += k
        for s in rows:
            b, req, fed = row[s.index], s.req, int(toks[row[s.index]])
            for i in range(k):
                if req.finish_reason is not None or req.cancelled:
                    break
                s.tokens.append(fed)
                fed = int(got[b, i])
                self._next(req, lambda f, t=fed: _checked(t if f is None else f, t != NON_FINITE))

    def _banned(self, rows: list[Slot], row: dict, B: int) -> np.ndarray:
        """[B, k] ids each greedy row of the batch may not pick (--ignore-eos bans EOS), padded with the
        vocabulary size (dropped by the scatter): the ban then costs the device a masked argmax,
        not a copy of every row's logits to the host (3.3 MB a step at V2's vocabulary, with a
        float64 pass over each row: most of a token's time at one stream before)."""
        width = max(1, max(len(s.req.ban) for s in rows))
        out = np.full((B, width), self.eng.config.vocab_size, np.int32)
        for s in rows:
            ids = sorted(s.req.ban)
            out[row[s.index], :len(ids)] = ids
        return out

    def _next(self, req: Request, pick) -> None:
        """Emit the token `pick(forced)` gives: the one the request's reasoning budget forces, else its
        own choice (its log-probabilities recorded for the token emitted, forced or not); logits that
        hold NaN/Inf end this request only."""
        forced = req.budget.forced() if req.budget is not None else None
        try:
            tok = pick(forced)
        except NonFiniteLogitsError as e:
            self._finish(req, "error", _one_line(e))
            return
        if req.budget is not None:
            req.budget.accept(tok)
        self._emit(req, tok)

    @staticmethod
    def _sample(req: Request, logits: np.ndarray, forced: int | None = None) -> int:
        """The next token of `req` from its logits row, on the host: its penalty, its banned ids,
        its filters and its own random generator (per request: a seed gives the same answer whatever
        else the batch holds); with `top_logprobs`, the token's log-probability from the raw row."""
        raw = logits
        if req.logit_bias or req.ban:  # one copy for the biases (first, as llama.cpp's chain) and the bans
            logits = np.array(logits, np.float64, copy=True)
        if req.logit_bias:
            ids, bias = zip(*req.logit_bias)
            logits[list(ids)] += bias
        pen = req.penalties
        if pen.active:
            n = pen.window(len(req.prompt) + len(req.generated))
            gen = req.generated[-n:]
            rest = n - len(gen)
            recent = np.concatenate([req.prompt[max(len(req.prompt) - rest, 0):], np.asarray(gen, np.int32)])
            logits = pen.apply(logits, recent)
        if req.ban:  # (pen.apply returned a copy of the copy: still not the caller's row)
            logits[list(req.ban)] = -1e30  # finite: sample_next refuses non-finite logits
        tok = sample_next(logits, rng=req._rng, **_filters(req.sampling)) if forced is None else forced
        if req.top_logprobs is not None:
            req.token_logprobs.append(token_logprobs(raw, tok, req.top_logprobs))
        return tok

    def _emit(self, req: Request, tok: int) -> None:
        if not req.generated:
            req.t_first = time.perf_counter()
        req.generated.append(tok)
        self.stats.generated_tokens += 1
        n = len(req.generated)
        limit, ctx = self._limits(req)
        reason = generation.stop_reason(tok, n, len(req.prompt) + n, limit, req.stop_ids, ctx)
        if reason == STOP_MAX_TOKENS and req.max_tokens is None:
            reason = STOP_CONTEXT
        if not self._notify(req, "token", tok):  # its caller is gone: it leaves now, its slot freed
            self._finish(req, STOP_CANCELLED)
        elif reason is not None:
            self._finish(req, reason)

    def _notify(self, req: Request, kind: str, value) -> bool:
        """req.on_event(kind, value); False if it raised. Why: the callback is the caller's code (the
        server's hand-over to its event loop raises once that loop is closed); one that raised in a
        step failed every request on every slot through _reset, and one that raised again there
        ended the scheduler's thread, every later request then queued for ever (an outside review,
        stop 68). A failing callback ends its own request only."""
        try:
            req.on_event(kind, value)
            return True
        except Exception as e:  # noqa: BLE001 - the caller's code: its failure is its request's alone
            if req.cancelled is None:
                req.cancelled = f"its callback raised {type(e).__name__}"
                log.warning("scheduler: request %d's callback raised on %r (%s): the request is cancelled",
                            req.id, kind, _one_line(e))
            return False

    def _finish(self, req: Request, reason: str, message: str | None = None) -> None:
        if req.finish_reason is not None:
            return
        req.finish_reason = reason
        req.t_end = time.perf_counter()
        if req.slot is not None and self.slots[req.slot].req is req:
            self.slots[req.slot].req = None
            self.slots[req.slot].last_used = req.t_end
        self.stats.requests[reason] = self.stats.requests.get(reason, 0) + 1
        if message is not None:
            self._notify(req, "error", message)
        else:
            self._notify(req, "done", reason)

    def _reset(self, message: str) -> None:
        """After a failed step (the batch cache may be consumed): fail the requests on slots, start
        the slots empty, keep serving."""
        self._one = None
        self._solo = None
        self._prefill.clear()
        for s in self.slots:
            if s.req is not None:
                self._finish(s.req, "error", message)
            s.tokens, s.exact, s.prompt_end, s.moved = [], 0, 0, None
        self._cache = self.eng.new_cache(self.n_slots)


@functools.lru_cache(maxsize=1)
def _idle_key():
    """The key of a row that draws nothing (idle, greedy, or of another setting); made on first
    use, not at import (that would start the JAX backend before the CLI sets its flags)."""
    return jax.random.key(0)


@functools.partial(jax.jit, static_argnames=("setting",))
def _sample_rows(logits, keys, positions, params, setting: tuple):
    """Every row's draw with its own key and values (`params`, sampling.row_params) at its position
    (sampling.sample_rows) under one static setting (its top_k bucket and bans); the caller keeps
    the rows that use it (one compile per bucket and ban set, not per value or row count)."""
    return sample_rows(logits, keys, positions, params=params, **{k: v for k, v in setting if k != "rows"})


@jax.jit
def _argmax_rows(logits, banned=None):
    """Each row's argmax (after its banned ids, [B, k] padded with an out-of-range id, are set to
    -inf) and whether the row's logits were all finite before the ban."""
    finite = jnp.isfinite(logits).all(axis=-1)
    if banned is not None:
        rows = jnp.arange(logits.shape[0])[:, None]
        logits = logits.at[rows, banned].set(-jnp.inf, mode="drop")
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), finite


def _plain_greedy(req: Request) -> bool:
    """Greedy without a penalty, a logit bias or log-probabilities: the argmax on the device (bans
    included)."""
    return (req.sampling["temperature"] <= 0.0 and not req.penalties.active and req.top_logprobs is None
            and not req.logit_bias)


def _reported(req: Request, tok: int, host, b: int) -> int:
    """`tok`, drawn on the device, with its log-probability recorded where `req` asks for them (from
    the raw logits row, as `Scheduler._sample` records a host draw's)."""
    if req.top_logprobs is not None:
        req.token_logprobs.append(token_logprobs(host[b], tok, req.top_logprobs))
    return tok


def _checked(tok: int, finite: bool) -> int:
    if not finite:
        raise NonFiniteLogitsError("non-finite logits at a decode step: the model's weights (or its arithmetic) "
                                   "produced NaN/Inf, no token can be chosen")
    return tok


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"


def _setting_of(sampling: dict, ban) -> tuple:
    """The decode loop's static setting for sampled streams with these filters and banned ids."""
    return generation.sampling_key({**_filters(sampling), "ban": sorted(ban), "rows": True})


def _filters(sampling: dict) -> dict:
    return {k: sampling[k] for k in ("temperature", "top_k", "top_p", "min_p")}
