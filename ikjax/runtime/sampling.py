"""Choosing the next token from logits: greedy, or temperature with top-k / top-p / min-p filters
(llama.cpp's order: top-k, top-p, min-p, then temperature).

`check_sampling` holds the rules for the parameters (the API and the CLI both go through it), so
a bad value is refused up front naming the parameter, not found later as an IndexError or NaN
probabilities in the middle of a generation.
"""
from __future__ import annotations

import math
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


def check_sampling(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=None) -> dict:
    """Validate the sampling parameters; return them as plain Python numbers.

    temperature: finite, >= 0 (0 = greedy). top_k: integer >= 0 (0 = off). top_p: 0 < p <= 1
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
    return dict(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p), min_p=float(min_p),
                seed=None if seed is None or seed == -1 else int(seed))


@dataclass(frozen=True)
class Penalties:
    """llama.cpp's penalties sampler (llama-server's `repeat_penalty`, `frequency_penalty`,
    `presence_penalty`, `repeat_last_n`) over the last `last_n` tokens of prompt and answer (0: off,
    -1: the whole context): `apply`."""
    repeat: float = 1.0
    last_n: int = 64
    frequency: float = 0.0
    presence: float = 0.0

    @property
    def active(self) -> bool:
        return self.last_n != 0 and (self.repeat != 1.0 or self.frequency != 0.0 or self.presence != 0.0)

    def window(self, ctx: int) -> int:
        """How many of the latest tokens it looks at in a context of `ctx`."""
        return ctx if self.last_n == -1 else self.last_n

    def apply(self, logits: np.ndarray, recent) -> np.ndarray:
        return apply_penalties(logits, recent, self.repeat, self.frequency, self.presence)


def _penalty_value(name: str, v, lo: float, hi: float, what: str) -> float:
    if not _is_real(v) or not math.isfinite(v) or not lo <= v <= hi:
        raise OptionError(f"{name}: expected {what}, got {v!r}")
    return float(v)


def check_penalty(repeat_penalty=1.0, repeat_last_n=64, frequency_penalty=0.0, presence_penalty=0.0) -> Penalties:
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
    return Penalties(float(repeat_penalty), int(repeat_last_n), freq, pres)


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
        tok = int(k) if _is_int(k) or (isinstance(k, str) and k.strip().lstrip("-").isdigit()) else None
        if tok is None or not 0 <= tok < vocab_size:
            raise OptionError(f"logit_bias: {k!r} is not a token id of this model (0..{vocab_size - 1})")
        if v is False:
            v = LOGIT_BAN
        if not _is_real(v) or not math.isfinite(v):
            raise OptionError(f"logit_bias[{k!r}]: expected a finite number (or false), got {v!r}")
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
    scaled = np.exp((logits[order] - logits[order[0]]) / temperature)
    scaled /= scaled.sum()
    rng = rng or np.random.default_rng()
    return int(order[rng.choice(len(order), p=scaled)])


def sample_device(logits, key, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                  min_p: float = 0.0, ban: tuple = ()):
    """`sample_next` inside a compiled step: logits [B, V] -> token ids [B] int32, the same filters
    in the same order (top-k, top-p, min-p, then temperature), drawn with a JAX key. It lets
    several decode steps run in one dispatch (Engine.decode) with nothing crossing to the host
    between tokens. The parameters are static (one executable per setting).

    A row whose logits are not all finite gets NON_FINITE (-1) instead of a token: the host reads
    the tokens anyway (Engine.decode refuses them there), so the check costs one reduction over
    the logits the step already holds, nothing crosses to the host per step, and the -1 fed to the
    next step of the loop embeds safely (ids index as jnp does: from the end, then clamped).

    `ban`: ids never drawn (their logits -inf after the check; --ignore-eos bans EOS)."""
    import jax.numpy as jnp

    logits = jnp.asarray(logits).astype(jnp.float32)
    finite = jnp.isfinite(logits).all(axis=-1)
    if ban:
        logits = logits.at[:, jnp.asarray(ban, jnp.int32)].set(-jnp.inf)
    return jnp.where(finite, _sample_device(logits, key, temperature, top_k, top_p, min_p), NON_FINITE)


def sample_rows(logits, keys, positions, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                min_p: float = 0.0, ban: tuple = ()):
    """`sample_device` with a key per row: row b's token drawn with fold_in(keys[b], positions[b])
    (positions: the fed token's), from its row alone. Each row then draws what a batch-1 decode
    loop with that key draws at that position (`generation.decode_steps`: fold_in(key, start + i)
    over a [1, V] row), whatever else the batch holds: the server's sampled streams give
    `generate`'s tokens for their seed, in one-step dispatches and in its decode loop alike."""
    import jax
    import jax.numpy as jnp

    def one(row, key, pos):
        return sample_device(row[None], jax.random.fold_in(key, pos), temperature=temperature, top_k=top_k,
                             top_p=top_p, min_p=min_p, ban=ban)[0]
    return jax.vmap(one)(jnp.asarray(logits), keys, jnp.asarray(positions, jnp.int32))


def _sample_device(logits, key, temperature, top_k, top_p, min_p):
    import jax
    import jax.numpy as jnp

    if temperature <= 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    V = logits.shape[-1]
    vals, idx = jax.lax.top_k(logits, top_k if 0 < top_k < V else V)  # descending, ties to the lower id
    probs = jnp.exp(vals - vals[:, :1])
    probs = probs / probs.sum(axis=-1, keepdims=True)
    keep = jnp.ones(vals.shape, bool)
    if top_p < 1.0:  # the smallest prefix whose mass reaches top_p
        before = jnp.cumsum(probs, axis=-1) - probs
        keep = keep & (before < top_p)
    if min_p > 0.0:
        keep = keep & (probs >= min_p * probs[:, :1])
    scaled = jnp.where(keep, (vals - vals[:, :1]) / temperature, -jnp.inf)
    pick = jax.random.categorical(key, scaled, axis=-1)
    return jnp.take_along_axis(idx, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
