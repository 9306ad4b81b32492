"""Choosing the next token from logits: greedy, or temperature with top-k / top-p / min-p filters
(llama.cpp's order: top-k, top-p, min-p, then temperature).

`check_sampling` holds the rules for the parameters (the API and the CLI both go through it), so
a bad value is refused up front naming the parameter, not found later as an IndexError or NaN
probabilities in the middle of a generation.
"""
from __future__ import annotations

import math
import re
import numbers
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ikjax.errors import ModelFileError, OptionError


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def check_count(name: str, value) -> int:
    """A token count (`max_tokens`, `n_predict`): an integer >= 0 — not a bool, not a string."""
    if not _is_int(value):
        raise OptionError(f"{name}: expected an integer >= 0, got {value!r}")
    if value < 0:
        raise OptionError(f"{name}: need >= 0, got {value}")
    return int(value)


def check_sampling(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=None, vocab: int | None = None) -> dict:
    """Validate the sampling parameters; return them as plain Python numbers.

    temperature: finite, >= 0 (0 = greedy). top_k: integer >= 0 (0 = off; one at or past the
    vocabulary, `vocab` where the caller knows it, else 2^31, keeps every id: returned as 0, so it
    compiles no loop of its own and never overflows the device's int32). top_p: 0 < p <= 1
    (1 = off). min_p: 0 <= p <= 1 (0 = off). seed: None or -1 (random, llama.cpp's convention)
    or an integer >= 0.
    """
    if not _is_real(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise OptionError(f"temperature: expected a finite number >= 0, got {temperature!r}")
    if not _is_int(top_k) or top_k < 0:
        raise OptionError(f"top_k: expected an integer >= 0 (0 = off), got {top_k!r}")
    if not _is_real(top_p) or not (0.0 < top_p <= 1.0):  # NaN fails both comparisons
        raise OptionError(f"top_p: expected a number in (0, 1] (1 = off), got {top_p!r}")
    if not _is_real(min_p) or not (0.0 <= min_p <= 1.0):
        raise OptionError(f"min_p: expected a number in [0, 1] (0 = off), got {min_p!r}")
    if seed is not None and (not _is_int(seed) or seed < -1):
        raise OptionError(f"seed: expected an integer >= 0, or -1 / None for a random seed, got {seed!r}")
    # past float32's range the device's temperature was inf (and NumPy warned in the cast); logits over
    # 1e30 are all ~0, every id equally likely, as at any larger temperature
    return dict(temperature=min(float(temperature), 1e30), top_k=effective_top_k(int(top_k), vocab),
                top_p=float(top_p), min_p=float(min_p), seed=None if seed is None or seed == -1 else int(seed))


def effective_top_k(top_k: int, vocab: int | None = None) -> int:
    """top_k as the samplers take it: 0 (off) where it keeps every id, at or past the vocabulary
    (`vocab`) or 2^31 (a top_k of 3e9 from one client overflowed the device's int32 and ended every
    stream of the server's batch; each power of two past the vocabulary compiled a loop of its own)."""
    return 0 if top_k >= min(vocab or 2**31, 2**31) else top_k


@dataclass(frozen=True)
class Penalties:
    """llama.cpp's penalties sampler (llama-server's `repeat_penalty`, `frequency_penalty`,
    `presence_penalty`, `repeat_last_n`) over the last `last_n` tokens of prompt and answer (0: off,
    -1: the whole context): `apply`. The newline token is left out of them unless `penalize_nl`
    (ik_llama.cpp's default and --penalize-nl, llama-server's `penalize_nl`): text with line
    breaks (markdown, code) would otherwise be pushed to run its lines together."""
    repeat: float = 1.0
    last_n: int = 64
    frequency: float = 0.0
    presence: float = 0.0
    penalize_nl: bool = False
    newline: int | None = None  # the model's newline token (Engine.newline_token), set where it is known

    @property
    def active(self) -> bool:
        return self.last_n != 0 and (self.repeat != 1.0 or self.frequency != 0.0 or self.presence != 0.0)

    def window(self, ctx: int) -> int:
        """How many of the latest tokens it looks at in a context of `ctx`."""
        return ctx if self.last_n == -1 else self.last_n

    def apply(self, logits: np.ndarray, recent) -> np.ndarray:
        """The penalized logits (a copy); the newline token (`newline`; None: not known or none)
        keeps its logit unless `penalize_nl`, as ik_llama.cpp puts it back after the penalties."""
        out = apply_penalties(logits, recent, self.repeat, self.frequency, self.presence)
        if self.newline is not None and not self.penalize_nl:
            out[self.newline] = np.asarray(logits)[self.newline]
        return out


def _penalty_value(name: str, v, lo: float, hi: float, what: str) -> float:
    if not _is_real(v) or not math.isfinite(v) or not lo <= v <= hi:
        raise OptionError(f"{name}: expected {what}, got {v!r}")
    return float(v)


def check_penalty(repeat_penalty=1.0, repeat_last_n=64, frequency_penalty=0.0, presence_penalty=0.0,
                  penalize_nl=False) -> Penalties:
    """The penalties' rules: `repeat_penalty` a finite number > 0 (1 = off), `frequency_penalty` and
    `presence_penalty` in [-2, 2] (OpenAI's range; 0 = off), `repeat_last_n` how many of the latest
    tokens they look at (0 = off, -1 = the whole context)."""
    if not _is_real(repeat_penalty) or not math.isfinite(repeat_penalty) or repeat_penalty <= 0:
        raise OptionError(f"repeat_penalty: expected a finite number > 0 (1 = off), got {repeat_penalty!r}")
    if not _is_int(repeat_last_n) or repeat_last_n < -1:
        raise OptionError(f"repeat_last_n: expected an integer >= -1 (0 = off, -1 = the context), got "
                          f"{repeat_last_n!r}")
    freq = _penalty_value("frequency_penalty", frequency_penalty, -2.0, 2.0, "a number in [-2, 2] (0 = off)")
    pres = _penalty_value("presence_penalty", presence_penalty, -2.0, 2.0, "a number in [-2, 2] (0 = off)")
    if not isinstance(penalize_nl, (bool, np.bool_)):
        raise OptionError(f"penalize_nl: expected true or false, got {penalize_nl!r}")
    return Penalties(float(repeat_penalty), int(repeat_last_n), freq, pres, bool(penalize_nl))


def apply_penalties(logits: np.ndarray, recent, repeat: float = 1.0, frequency: float = 0.0,
                    presence: float = 0.0) -> np.ndarray:
    """llama.cpp's penalties (llama_sampler_penalties): each distinct id among the `recent` tokens,
    seen c times there, has its logit divided by `repeat` where positive (multiplied where not), then
    c * `frequency` + `presence` taken off it."""
    out = np.array(logits, np.float64, copy=True)
    ids, counts = np.unique(np.asarray(list(recent), np.int64), return_counts=True)
    if ids.size == 0:
        return out
    v = out[ids]
    if repeat != 1.0:
        v = np.where(v > 0, v / repeat, v * repeat)
    out[ids] = v - counts * frequency - presence
    return out


MAX_TOP_LOGPROBS = 20  # OpenAI's top_logprobs bound


LOGIT_BAN = -100.0  # a bias this low bans the token (OpenAI: "-100 should result in a ban")


MAX_LOGIT_BIAS = 1e30  # |bias| past it: refused (times any penalty factor it stays finite in float32)


def check_logit_bias(bias, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's / llama-server's `logit_bias` as (token id, bias) pairs: a mapping of ids (or their
    decimal strings) to numbers, or llama-server's list of [id, number | false] pairs (false: never
    drawn, as a bias of -100 or less). Ids must be in the vocabulary, biases finite."""
    if bias is None:
        return ()
    if isinstance(bias, Mapping):
        items = list(bias.items())
    elif isinstance(bias, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in bias):
        items = [tuple(p) for p in bias]
    else:
        raise OptionError(f"logit_bias: expected an object of token id -> bias or a list of [id, bias] pairs, "
                          f"got {type(bias).__name__}")
    out = {}
    for k, v in items:
        tok = int(k) if _is_int(k) or (isinstance(k, str) and re.fullmatch(r"\s*-?[0-9]+\s*", k)) else None
        if tok is None or not 0 <= tok < vocab_size:
            raise OptionError(f"logit_bias: {k!r} is not a token id of this model (0..{vocab_size - 1})")
        if v is False:
            v = LOGIT_BAN
        if not _is_real(v) or not math.isfinite(v) or abs(v) > MAX_LOGIT_BIAS:
            # bounded: a bias of 1e308 divided by a repeat penalty below 1 overflowed to Inf, and the
            # request ended blaming the model's weights (an outside review, stop 68)
            raise OptionError(f"logit_bias[{k!r}]: expected a finite number in [-{MAX_LOGIT_BIAS:g}, "
                              f"{MAX_LOGIT_BIAS:g}] (or false), got {v!r}")
        out[tok] = float(v)
    return tuple(sorted(out.items()))


def check_top_logprobs(k, name: str = "top_logprobs") -> int | None:
    """None (no log-probabilities) or how many alternatives to report beside each token, 0..20."""
    if k is None:
        return None
    if not _is_int(k) or not 0 <= k <= MAX_TOP_LOGPROBS:
        raise OptionError(f"{name}: expected an integer in [0, {MAX_TOP_LOGPROBS}], got {k!r}")
    return int(k)


def token_logprobs(logits, tok: int, k: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The log-probability of `tok` under the model's distribution (log-softmax of the raw logits,
    before penalties, filters and temperature: what OpenAI's `logprobs` and llama-server report by
    default) and the `k` most likely ids with theirs, most likely first."""
    x = np.asarray(logits, np.float64).ravel()
    m = x.max()
    lp = x - (m + math.log(float(np.exp(x - m).sum())))
    k = min(k, lp.size)
    top = np.argpartition(-lp, k - 1)[:k] if k else np.zeros(0, np.int64)
    top = top[np.argsort(-lp[top], kind="stable")]
    return float(lp[tok]), tuple((int(i), float(lp[i])) for i in top)


NON_FINITE = -1  # sample_device's token for a row whose logits are not all finite


class NonFiniteLogitsError(ModelFileError):
    """Logits that hold NaN or Inf: no distribution to sample from (the weights or the
    arithmetic went non-finite). A ModelFileError: in practice the file's weights hold them."""


def check_finite_logits(logits: np.ndarray, where: str = "") -> None:
    """Refuse a logits array that holds NaN / Inf (one line, how many of which), instead of argmax
    picking the NaN's index (token 0: BOS, over and over) or the probabilities going NaN."""
    logits = np.asarray(logits)
    if np.isfinite(logits).all():
        return
    n_nan = int(np.isnan(logits).sum())
    n_inf = int(np.isinf(logits).sum())
    what = ", ".join(f"{n} {k}" for n, k in ((n_nan, "NaN"), (n_inf, "Inf")) if n)
    raise NonFiniteLogitsError(f"non-finite logits{where}: {what} of {logits.size} values; the model's weights "
                               f"(or its arithmetic) produced NaN/Inf, no token can be chosen")


def sample_next(logits: np.ndarray, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                min_p: float = 0.0, rng: np.random.Generator | None = None) -> int:
    """One token id from a logits row. Parameters as `check_sampling` accepts them."""
    logits = np.asarray(logits, np.float64)
    check_finite_logits(logits)
    if temperature <= 0.0:
        return int(np.argmax(logits))
    order = np.argsort(-logits, kind="stable")
    if top_k > 0:
        order = order[:top_k]
    probs = np.exp(logits[order] - logits[order[0]])
    probs /= probs.sum()
    if top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), top_p) + 1)
        order, probs = order[:keep], probs[:keep]
    if min_p > 0.0:
        keep = probs >= min_p * probs[0]  # min_p <= 1 always keeps the most likely token
        order, probs = order[keep], probs[keep]
    with np.errstate(over="ignore"):  # a tiny temperature: -Inf past the first, exp 0 (only the most likely)
        scaled = np.exp((logits[order] - logits[order[0]]) / temperature)
    scaled /= scaled.sum()
    rng = rng or np.random.default_rng()
    return int(order[rng.choice(len(order), p=scaled)])


TOP_K_MIN_BUCKET = 64  # the smallest candidate set the device sampler sorts (top_k_bucket)


def top_k_bucket(top_k: int) -> int:
    """The static width of the device sampler's candidate set for `top_k`: 0 (every id) when top_k
    is off, else the next power of two >= top_k, at least TOP_K_MIN_BUCKET (capped by the vocabulary
    where used). Why: the sort's width must be known when the step compiles, but top_k itself need
    not: a request's own top_k masks the ranks past it at run time, so every top_k in a bucket, and
    every temperature, top_p and min_p, share one executable (each new value compiled a decode loop
    before, seconds a value on a server, RESULTS §23p). A function of top_k alone: a row's draw never
    depends on what else a batch holds."""
    if top_k <= 0:
        return 0
    b = TOP_K_MIN_BUCKET
    while b < top_k:
        b *= 2
    return b


def inverse_temperature(temperature) -> np.float32:
    """1 / temperature, rounded once, on the host: the device sampler multiplies by it. Why not a
    division on the device: a constant's division is folded on the host and a traced one runs on the
    device, where a GPU may not round it as IEEE does; a product rounds alike everywhere, so a
    stream drawn with its setting as a step argument (the server) and one with it compiled in
    (`generate`) draw the same tokens."""
    with np.errstate(divide="ignore", over="ignore"):  # a temperature under float32's range: 1/0
        inv = np.float32(1.0) / np.float32(temperature)
    # (the largest float32, not Inf: Inf times a logit of 0 is NaN; the draw is the most likely token)
    return inv if np.isfinite(inv) else np.finfo(np.float32).max


ROW_PARAMS = ("inv_temperature", "top_k", "top_p", "min_p")  # row_params' arrays


def row_params(settings) -> dict:
    """The per-row sampling values of a batch, as `sample_rows` takes them: from each row's
    `check_sampling` dict (temperature > 0), [B] arrays inv_temperature, top_k, top_p, min_p."""
    return {"inv_temperature": np.array([inverse_temperature(s["temperature"]) for s in settings], np.float32),
            "top_k": np.array([s["top_k"] for s in settings], np.int32),
            "top_p": np.array([s["top_p"] for s in settings], np.float32),
            "min_p": np.array([s["min_p"] for s in settings], np.float32)}


def row_params_shapes(B: int, sharding=None) -> dict:
    """The ShapeDtypeStructs of `row_params`' arrays for a batch of B (a decode loop's arguments,
    compiled ahead: the split modes' executors)."""
    import jax
    return {n: jax.ShapeDtypeStruct((B,), np.int32 if n == "top_k" else np.float32, sharding=sharding)
            for n in ROW_PARAMS}


def sample_device(logits, key, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                  min_p: float = 0.0, ban: tuple = ()):
    """`sample_next` inside a compiled step: logits [B, V] -> token ids [B] int32, the same filters
    in the same order (top-k, top-p, min-p, then temperature), drawn with a JAX key. It lets
    several decode steps run in one dispatch (Engine.decode) with nothing crossing to the host
    between tokens. The parameters are Python numbers (temperature <= 0: the argmax); the draw is
    the one `sample_rows` makes with them as step arguments.

    A row whose logits are not all finite gets NON_FINITE (-1) instead of a token: the host reads
    the tokens anyway (Engine.decode refuses them there), so the check costs one reduction over
    the logits the step already holds, nothing crosses to the host per step, and the -1 fed to the
    next step of the loop embeds safely (ids index as jnp does: from the end, then clamped).

    `ban`: ids never drawn (their logits -inf after the check; --ignore-eos bans EOS)."""
    import jax.numpy as jnp

    logits, finite = _checked_logits(logits, ban)
    if temperature <= 0.0:
        return jnp.where(finite, jnp.argmax(logits, axis=-1).astype(jnp.int32), NON_FINITE)
    tok = _sample_device(logits, key, inverse_temperature(temperature), top_k, top_p, min_p, top_k_bucket(int(top_k)))
    return jnp.where(finite, tok, NON_FINITE)


def _checked_logits(logits, ban: tuple):
    import jax.numpy as jnp

    logits = jnp.asarray(logits).astype(jnp.float32)
    finite = jnp.isfinite(logits).all(axis=-1)
    if ban:
        logits = logits.at[:, jnp.asarray(ban, jnp.int32)].set(-jnp.inf)
    return logits, finite


def sample_rows(logits, keys, positions, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                min_p: float = 0.0, ban: tuple = (), params: dict | None = None, bucket: int | None = None):
    """`sample_device` with a key per row: row b's token drawn with fold_in(keys[b], positions[b])
    (positions: the fed token's), from its row alone. Each row then draws what a batch-1 decode
    loop with that key draws at that position (`generation.decode_steps`: fold_in(key, start + i)
    over a [1, V] row), whatever else the batch holds: the server's sampled streams give
    `generate`'s tokens for their seed, in one-step dispatches and in its decode loop alike.

    The setting: Python numbers for every row (temperature <= 0: each row's argmax), or `params`,
    a setting per row (`row_params`: [B] arrays, possibly traced: a step argument, so no value
    compiles anything) with `bucket`, the top_k_bucket of every row's top_k."""
    import jax
    import jax.numpy as jnp

    logits = jnp.asarray(logits)
    B = logits.shape[0]
    if params is None:
        if temperature <= 0.0:
            return sample_device(logits, None, ban=ban)  # (greedy: no key is read)
        params = row_params([dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)] * B)
        bucket = top_k_bucket(int(top_k))
    elif bucket is None:
        raise ValueError("sample_rows: a setting per row needs its top_k bucket")

    def one(row, key, pos, inv_t, k, p, m):
        row, finite = _checked_logits(row[None], ban)
        tok = _sample_device(row, jax.random.fold_in(key, pos), inv_t, k, p, m, bucket)
        return jnp.where(finite, tok, NON_FINITE)[0]
    return jax.vmap(one)(logits, keys, jnp.asarray(positions, jnp.int32), params["inv_temperature"],
                         params["top_k"], params["top_p"], params["min_p"])


def _sample_device(logits, key, inv_t, top_k, top_p, min_p, bucket: int):
    """A draw from the `bucket` best ids (0: all), the ranks past top_k (when on) masked, then top-p
    and min-p over the kept ids' renormalized probabilities, then the temperature (times inv_t).
    Every parameter may be traced; none is branched on (top_p >= 1 and min_p <= 0 keep every
    candidate)."""
    import jax
    import jax.numpy as jnp

    V = logits.shape[-1]
    K = V if bucket <= 0 or bucket >= V else bucket
    vals, idx = jax.lax.top_k(logits, K)  # descending, ties to the lower id
    k = jnp.asarray(top_k, jnp.int32)
    rank = jnp.arange(K, dtype=jnp.int32)[None, :]
    keep = rank < jnp.where((k <= 0) | (k >= K), K, k)  # top-k
    probs = jnp.where(keep, jnp.exp(vals - vals[:, :1]), 0.0)
    probs = probs / probs.sum(axis=-1, keepdims=True)
    top_p = jnp.asarray(top_p, jnp.float32)
    before = jnp.cumsum(probs, axis=-1) - probs  # the smallest prefix whose mass reaches top_p
    keep = keep & ((before < top_p) | (top_p >= 1.0))
    keep = keep & (probs >= jnp.asarray(min_p, jnp.float32) * probs[:, :1])
    scaled = jnp.where(keep, (vals - vals[:, :1]) * jnp.asarray(inv_t, jnp.float32), -jnp.inf)
    pick = jax.random.categorical(key, scaled, axis=-1)
    return jnp.take_along_axis(idx, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
