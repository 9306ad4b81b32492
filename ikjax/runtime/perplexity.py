"""Perplexity and KL divergence as ik_llama.cpp's `llama-perplexity` computes them.

Why a module of its own: users compare a quant's PPL and KLD with the numbers ik prints, so every
rule here is ik's (examples/perplexity/perplexity.cpp), and the engine only gains two thin methods.

- Chunking: the whole text's tokens (BOS first where the model adds one), `n_chunk = len // n_ctx`
  chunks of `n_ctx` tokens (`--chunks` caps it); at least `2 * n_ctx` tokens. A chunk's first token
  is replaced by BOS (where the model adds one) before it is fed; each chunk is a fresh sequence at
  positions 0..n_ctx-1 and scores only its second half: the logits at positions
  `first = n_ctx // 2` .. `n_ctx - 2` predict tokens `first + 1` .. `n_ctx - 1` (`n_ctx - 1 - first`
  tokens a chunk).
- Scoring: f32 log-softmax over the whole vocabulary, on the device the logits are on (only a few
  numbers a token come back to the host, or the 16-bit rows of a base file). PPL = exp(mean NLL),
  its uncertainty `ppl * sqrt(var(NLL) / (count - 1))` as ik.
- `--kl-divergence-base FILE` without `--kl-divergence` writes ik's base file: `_logits_`, int32
  n_ctx, int32 n_vocab, int32 n_chunk, the int32 tokens of the chunks (as tokenized, not
  BOS-replaced), then per chunk per scored token a row of `2 * ((n_vocab + 1) // 2) + 4` uint16:
  two f32 (scale, min_log_prob) and each token's log-probability quantized to 16 bits over
  [max(min_logit, max_logit - 24), max_logit]. ik reads ikjax's files and ikjax reads ik's: the
  same bytes up to the last bit of a float rounding (checked beside ik, bench/RESULTS.md §27).
- With `--kl-divergence` the base file supplies the tokens and the base log-probabilities; the
  statistics and their printed block are ik's `kl_divergence`.

The sequences of `n_seq = -b // n_ctx` chunks share a step as in ik, but a step never holds more
than `-ub` tokens (`ub // n_ctx` sequences, else one sequence in ub-sized steps): the results do
not depend on it (each sequence only sees its own cache rows).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ikjax.errors import ModelFileError, OptionError
from ikjax.tokenizer import add_bos_default  # ik's BOS rule: llama-perplexity's chunks start with BOS where it holds

MAGIC = b"_logits_"
HEADER_BYTES = len(MAGIC) + 3 * 4


def row_words(n_vocab: int) -> int:
    """uint16 words a scored token takes in a base file (ik's `nv`): 2 floats, the vocabulary,
    padded to an even count."""
    return 2 * ((n_vocab + 1) // 2) + 4


def n_scored(n_ctx: int) -> int:
    """Tokens a chunk scores: positions n_ctx/2 .. n_ctx-2 predict the next token."""
    return n_ctx - 1 - n_ctx // 2


# -- what ik does with BOS ---------------------------------------------------------------------
def bos_token(metadata: dict) -> int | None:
    """BOS id of the file, or None when the file names none."""
    v = metadata.get("tokenizer.ggml.bos_token_id")
    return None if v is None else int(v)


# -- ik's base log-probability file ------------------------------------------------------------
@dataclasses.dataclass
class BaseLogits:
    """A `--kl-divergence-base` file, memory-mapped (a wikitext-2 run at -c 512 and a 129k vocab
    is ~38 GB: never read whole). `tokens`: the n_chunk * n_ctx tokens (not BOS-replaced);
    `chunk(i)`: its [n_scored, row_words] uint16 rows."""
    path: str
    n_ctx: int
    n_vocab: int
    n_chunk: int
    tokens: np.ndarray
    rows: np.ndarray  # memmap [n_chunk, n_scored, row_words] uint16

    @classmethod
    def open(cls, path) -> BaseLogits:
        path = str(path)
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                head = f.read(HEADER_BYTES)
        except OSError as e:
            raise OptionError(f"kl-divergence-base {path}: cannot read it ({e.strerror or e})") from None
        if len(head) < HEADER_BYTES or head[:8] != MAGIC:
            raise ModelFileError(f"kl-divergence-base {path}: does not look like a file containing log-probabilities "
                                 f"(no {MAGIC.decode()} header, as llama-perplexity --kl-divergence-base writes)")
        n_ctx, n_vocab, n_chunk = (int(v) for v in np.frombuffer(head[8:], "<i4"))
        if n_ctx < 4 or n_vocab < 1 or n_chunk < 1:
            raise ModelFileError(f"kl-divergence-base {path}: bad header (n_ctx {n_ctx}, n_vocab {n_vocab}, "
                                 f"n_chunk {n_chunk})")
        tok_bytes = 4 * n_ctx * n_chunk
        nv, ns = row_words(n_vocab), n_scored(n_ctx)
        need = HEADER_BYTES + tok_bytes + 2 * nv * ns * n_chunk
        if size < need:
            raise ModelFileError(f"kl-divergence-base {path}: truncated ({size} bytes, its header (n_ctx {n_ctx}, "
                                 f"n_vocab {n_vocab}, {n_chunk} chunks) needs {need})")
        if size > need:  # the rows would be read from the tokens' bytes: a mean KLD of inf, said as a number
            raise ModelFileError(f"kl-divergence-base {path}: {size} bytes, more than its header (n_ctx {n_ctx}, "
                                 f"n_vocab {n_vocab}, {n_chunk} chunks) describes ({need}): a damaged header")
        tokens = np.fromfile(path, "<i4", n_ctx * n_chunk, offset=HEADER_BYTES)
        rows = np.memmap(path, "<u2", "r", offset=HEADER_BYTES + tok_bytes, shape=(n_chunk, ns, nv))
        return cls(path, n_ctx, n_vocab, n_chunk, tokens, rows)

    def chunk(self, i: int) -> np.ndarray:
        return np.asarray(self.rows[i])


def split_rows(rows: np.ndarray, n_vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Base rows [R, nv] uint16 -> (scale [R] f32, min_log_prob [R] f32, q [R, n_vocab] uint16)."""
    head = np.ascontiguousarray(rows[:, :4]).view("<f4")
    return head[:, 0], head[:, 1], rows[:, 4:4 + n_vocab]


def join_rows(scale: np.ndarray, min_log_prob: np.ndarray, q: np.ndarray) -> np.ndarray:
    """The inverse of `split_rows`: [R, row_words] uint16 as ik writes them (pad word 0)."""
    R, V = q.shape
    out = np.zeros((R, row_words(V)), np.uint16)
    out[:, :4] = np.stack([scale, min_log_prob], -1).astype("<f4").view("<u2")
    out[:, 4:4 + V] = q
    return out


def _is_base_file(p: Path) -> bool:
    with open(p, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


class BaseLogitsWriter:
    """Writes a base file as the run goes (chunk by chunk, as ik), under a temporary name that
    becomes `path` only when every chunk is in: an interrupted run leaves no half file for a later
    --kl-divergence to read."""

    def __init__(self, path, n_ctx: int, n_vocab: int, n_chunk: int, tokens: np.ndarray):
        from ikjax.atomic_file import _make_parent, check_target, keep_foreign
        what = "kl-divergence-base"
        self.path = check_target(path, HEADER_BYTES + 4 * n_ctx * n_chunk
                                 + 2 * row_words(n_vocab) * n_scored(n_ctx) * n_chunk, what, parent_exists=True)
        # (it replaced a loaded GGUF named by mistake)
        keep_foreign(self.path, what, _is_base_file, "a base logits file")
        _make_parent(self.path, what)  # (a missing directory was a FileNotFoundError after the run's load)
        self.tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.part")
        self.n_vocab = n_vocab
        self.f = None
        self._io(lambda: setattr(self, "f", open(self.tmp, "wb")))
        self._write(MAGIC + np.array([n_ctx, n_vocab, n_chunk], "<i4").tobytes())
        self._write(np.asarray(tokens[:n_chunk * n_ctx], "<i4").tobytes())

    def _io(self, fn) -> None:
        """A failed write (a full disk, a file size limit) named with the file, its part removed
        (it was the generic `OSError: [Errno 27] File too large`, naming nothing)."""
        try:
            fn()
        except OSError as e:
            if self.f is not None:
                try:
                    self.f.close()
                except OSError:
                    pass
            Path(self.tmp).unlink(missing_ok=True)
            raise OptionError(f"kl-divergence-base {self.path}: cannot write it ({e.strerror or e})") from None

    def _write(self, data: bytes) -> None:
        self._io(lambda: self.f.write(data))

    def write(self, scale, min_log_prob, q) -> None:
        self._write(join_rows(scale, min_log_prob, q).tobytes())

    def close(self, ok: bool) -> None:
        if self.f.closed:  # (a failed write closed it and removed the part)
            return
        if not ok:
            self.f.close()
            Path(self.tmp).unlink(missing_ok=True)
            return
        self._io(self.f.close)  # (the buffer's last bytes are written here)
        os.replace(self.tmp, self.path)


# -- scoring on the device (f32 over the whole vocabulary) --------------------------------------
@functools.partial(jax.jit, static_argnames=("quantize",))
def _score(logits, targets, quantize: bool):
    """Per row: ik's NLL `max + log(sum(exp(l - max))) - l[target]` in f32, whether the row is
    finite, and (quantize) ik's 16-bit log-probability row of a base file."""
    l = logits.astype(jnp.float32)
    mx = l.max(-1)
    lse = jnp.log(jnp.exp(l - mx[:, None]).sum(-1))
    tgt = jnp.take_along_axis(l, targets[:, None], -1)[:, 0]
    out = {"nll": mx + lse - tgt, "finite": jnp.isfinite(l).all()}
    if quantize:
        mn = jnp.maximum(l.min(-1), mx - 24)
        scale = (mx - mn) / jnp.float32(65535)
        inv = jnp.where(scale != 0, 1 / jnp.where(scale != 0, scale, 1), 0)
        q = jnp.where(l > mn[:, None], jnp.round(inv[:, None] * (l - mn[:, None])), 0)
        out.update(q=q.astype(jnp.uint16), scale=scale, min_log_prob=mn - mx - lse)
    return out


@jax.jit
def _kld_rows(logits, targets, scale, min_log_prob, q):
    """Per row, ik's `log_softmax(..., base_log_prob, tok, kld)`: NLL under this model and under
    the base, KL(base || this) over the base's log-probabilities above -16, whether the top
    tokens agree (first maximum of each), p(target) - p_base(target)."""
    l = logits.astype(jnp.float32)
    mx = l.max(-1)
    lse = jnp.log(jnp.exp(l - mx[:, None]).sum(-1))
    tgt = jnp.take_along_axis(l, targets[:, None], -1)[:, 0]
    nll = mx + lse - tgt
    plb = scale[:, None] * q.astype(jnp.float32) + min_log_prob[:, None]
    nll_base = -jnp.take_along_axis(plb, targets[:, None], -1)[:, 0]
    t = (mx + lse)[:, None]
    kld = jnp.where(plb > -16, jnp.exp(plb) * (plb - l + t), 0).sum(-1)
    same = jnp.argmax(l, -1) == jnp.argmax(plb, -1)
    return {"nll": nll, "nll_base": nll_base, "kld": kld, "same": same,
            "p_diff": jnp.exp(-nll) - jnp.exp(-nll_base), "finite": jnp.isfinite(l).all()}


# -- running the chunks ------------------------------------------------------------------------
def check_ctx(n_ctx, engine_ctx: int) -> int:
    """A chunk length the engine can hold; odd ones too, as ik takes them (positions
    floor(c/2)..c-2 scored: the second half is one token longer than the first)."""
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, (int, np.integer)) or n_ctx < 4:
        raise OptionError(f"ctx: need an integer context of at least 4 tokens for perplexity, got {n_ctx!r}")
    if n_ctx > engine_ctx:
        raise OptionError(f"ctx: chunks of {n_ctx} tokens exceed the engine's context {engine_ctx} (load with ctx >= "
                          f"{n_ctx})")
    return int(n_ctx)


def sequences_per_step(options, n_ctx: int) -> int:
    """Chunks a step runs side by side: ik's n_seq = -b // n_ctx, at most -ub // n_ctx (a step
    holds at most ub tokens), at least 1."""
    return max(1, min(options.batch // n_ctx, options.ubatch // n_ctx))


def step_shapes(engine, n_ctx: int, n_seq: int) -> list[tuple[int, int, int, bool]]:
    """(c0, tokens fed, step length, all logits) of each step of a chunk: ub-sized pieces of the
    chunk from position 0; a step returns every position's logits only if it holds a scored one."""
    first, last = n_ctx // 2, n_ctx - 2
    ub = min(engine.options.ubatch, n_ctx)
    out = []
    for c0 in range(0, n_ctx, ub):
        n = min(ub, n_ctx - c0)
        out.append((c0, n, engine.prompt_tokens(n, c0), c0 + n - 1 >= first and c0 <= last))
    return out


def precompile(engine, n_ctx: int) -> int:
    """Compile every step a run at this n_ctx takes (no execution); returns how many shapes."""
    n_seq = sequences_per_step(engine.options, n_ctx)
    shapes = step_shapes(engine, n_ctx, n_seq)
    for c0, _, T, all_logits in shapes:
        engine.precompile(n_seq, T, c0 + T, all_logits)
    return len(shapes)


def _chunk_scores(engine, cache, toks: np.ndarray, n_ctx: int, bos: int | None, score: Callable,
                  real: int | None = None):
    """Feed chunks toks [B, n_ctx] (BOS first where given) and call `score(b_slice_logits [B, k, V],
    targets [B, k], p0)` for each step's scored rows at chunk positions p0..p0+k-1. Returns the cache.
    Rows from `real` on pad the last group (copies whose scores are dropped): idle (last -1), they
    route to no expert and count in no expert statistics."""
    first, last = n_ctx // 2, n_ctx - 2
    B = toks.shape[0]
    real = B if real is None else real
    feed = toks.copy()
    if bos is not None:
        feed[:, 0] = bos
    for c0, n, T, all_logits in step_shapes(engine, n_ctx, B):
        tokens = np.zeros((B, T), np.int32)
        tokens[:, :n] = feed[:, c0:c0 + n]
        logits, cache = engine.step(cache, tokens, np.full(B, c0, np.int32),
                                    np.where(np.arange(B) < real, n - 1, -1).astype(np.int32), all_logits)
        if all_logits:
            p0, p1 = max(first, c0), min(c0 + n - 1, last)
            score(logits[:, p0 - c0:p1 - c0 + 1], toks[:, p0 + 1:p1 + 2], p0)
    return cache


def _groups(n_chunk: int, n_seq: int, chunk_tokens: Callable[[int], np.ndarray]):
    """(first chunk index, real chunks, tokens [n_seq, n_ctx]) per step group; the last group is
    padded with copies of its last chunk (one compiled shape; the copies' scores are dropped)."""
    for i in range(0, n_chunk, n_seq):
        real = min(n_seq, n_chunk - i)
        rows = [chunk_tokens(i + s) for s in range(real)]
        rows += [rows[-1]] * (n_seq - real)
        yield i, real, np.stack(rows).astype(np.int32)


def _check_finite(engine, out, chunk: int) -> None:
    if not bool(out["finite"]):
        raise engine._non_finite(f" in perplexity chunk {chunk + 1}")


@dataclasses.dataclass
class PerplexityResult:
    """What llama-perplexity prints: `ppl` and its uncertainty `ppl_err` over `n_chunk` chunks
    of `n_ctx`; `chunk_ppl[i]`: the running PPL after chunk i (the `[i]x,` progress values);
    `nll`: every scored token's negative log-likelihood, chunk after chunk."""
    ppl: float
    ppl_err: float
    n_ctx: int
    n_chunk: int
    count: int
    chunk_ppl: list
    nll: np.ndarray

    def final_line(self) -> str:
        return final_line(self.nll, self.n_chunk, self.n_ctx)


def ppl_stats(nll: np.ndarray) -> tuple[float, float]:
    """(PPL, its uncertainty) from the NLLs, ik's formulas in double precision; the
    uncertainty is NaN where ik prints "Unexpected negative standard deviation"."""
    nll = np.asarray(nll, np.float64)
    count = nll.size
    mean = float(nll.sum()) / count
    var = float((nll * nll).sum()) / count - mean * mean
    ppl = math.exp(mean)
    return ppl, (math.sqrt(var / (count - 1)) * ppl if var > 0 and count > 1 else float("nan"))


def progress_item(i: int, nll_so_far: np.ndarray) -> str:
    """ik's progress entry after chunk i (1-based): `[i]PPL,`."""
    nll = np.asarray(nll_so_far, np.float64)
    return f"[{i}]{math.exp(float(nll.sum()) / nll.size):.4f},"


def progress_row(first_token: int, nll_so_far: np.ndarray) -> str:
    """ik's `--ppl-output-type 1` line: `%8d  %.4lf  %4lf  %4lf` (the token offset ik prints,
    PPL, mean NLL, its standard error)."""
    nll = np.asarray(nll_so_far, np.float64)
    count = nll.size
    av = float(nll.sum()) / count
    av2 = float((nll * nll).sum()) / count - av * av
    if av2 > 0:
        av2 = math.sqrt(av2 / (count - 1)) if count > 1 else float("inf")
    return f"{first_token:8d}  {math.exp(av):.4f}  {av:4f}  {av2:4f}"


def final_line(nll: np.ndarray, n_chunk: int, n_ctx: int) -> str:
    ppl, err = ppl_stats(nll)
    if math.isnan(err):
        return "Unexpected negative standard deviation of log(prob)"
    return f"Final estimate: PPL over {n_chunk} chunks for n_ctx={n_ctx} = {ppl:.4f} +/- {err:.5f}"


def chunk_count(n_tokens: int, n_ctx: int, n_chunks: int | None) -> int:
    if n_tokens < 2 * n_ctx:
        raise OptionError(f"perplexity: you need at least {2 * n_ctx} tokens to evaluate perplexity with a context of "
                          f"{n_ctx}; the text tokenizes to only {n_tokens} tokens")
    if n_chunks is not None and (isinstance(n_chunks, bool) or not isinstance(n_chunks, (int, np.integer))
                                 or (n_chunks < 1 and n_chunks != -1)):
        raise OptionError(f"chunks: need a count >= 1 (or -1 for all), got {n_chunks!r}")
    most = n_tokens // n_ctx
    return most if n_chunks is None or n_chunks < 0 else min(int(n_chunks), most)


def perplexity(engine, ids, ctx: int | None = None, *, n_chunks: int | None = None, save_base=None,
               on_chunk: Callable[[int, np.ndarray], None] | None = None) -> PerplexityResult:
    """llama-perplexity on the token ids of a whole text (BOS first where the model adds one, as
    the tokenizer gives them): chunks of `ctx` (default: the engine's -c). `save_base`: also write
    ik's --kl-divergence-base file there. `on_chunk(i, nll so far)` after each chunk (the CLI's
    progress line)."""
    from ikjax.runtime import generation
    meta = engine.file.metadata
    ids = generation.check_ids(ids, engine.config.vocab_size, "ids")
    n_ctx = check_ctx(engine.options.ctx if ctx is None else ctx, engine.options.ctx)
    n_chunk = chunk_count(len(ids), n_ctx, n_chunks)
    bos = bos_token(meta) if add_bos_default(meta) else None
    n_seq = sequences_per_step(engine.options, n_ctx)
    ns = n_scored(n_ctx)
    writer = None
    from ikjax.runtime import distributed
    if save_base is not None and distributed.is_primary():  # several processes: process 0 writes it
        V = _vocab_of_logits(engine)
        writer = BaseLogitsWriter(save_base, n_ctx, V, n_chunk, ids)
    nll = np.zeros((n_chunk, ns), np.float64)
    chunk_ppl = []
    ok = False
    try:
        cache = engine.new_cache(n_seq)
        for i, real, toks in _groups(n_chunk, n_seq, lambda c: ids[c * n_ctx:(c + 1) * n_ctx]):
            parts = {}

            def score(logits, targets, p0, parts=parts):
                B, k, V = logits.shape
                out = _score(logits.reshape(B * k, V), jnp.asarray(targets.reshape(-1)), writer is not None)
                parts[p0] = (k, out)

            cache = _chunk_scores(engine, cache, toks, n_ctx, bos, score, real)
            for p0 in sorted(parts):
                k, out = parts[p0]
                _check_finite(engine, out, i)
                v = np.asarray(out["nll"], np.float64).reshape(n_seq, k)
                nll[i:i + real, p0 - n_ctx // 2:p0 - n_ctx // 2 + k] = v[:real]
            for s in range(real):
                if writer is not None:
                    qs = [(np.asarray(parts[p0][1]["scale"]).reshape(n_seq, -1)[s],
                           np.asarray(parts[p0][1]["min_log_prob"]).reshape(n_seq, -1)[s],
                           np.asarray(parts[p0][1]["q"]).reshape(n_seq, parts[p0][0], -1)[s]) for p0 in sorted(parts)]
                    writer.write(*(np.concatenate(x) for x in zip(*qs)))
                done = nll[:i + s + 1].reshape(-1)
                chunk_ppl.append(math.exp(float(done.sum()) / done.size))
                if on_chunk is not None:
                    on_chunk(i + s, done)
        ok = True
    finally:
        if writer is not None:
            writer.close(ok)
    flat = nll.reshape(-1)
    ppl, err = ppl_stats(flat)
    return PerplexityResult(ppl, err, n_ctx, n_chunk, flat.size, chunk_ppl, flat)


def logits_width(file) -> int:
    """Width of the logits of a model file (its output tensor's rows, else the embedding's):
    ik's n_vocab. Read from the tensor table, so it is known before the model loads."""
    out = file.tensors.get("output.weight") or file.tensors.get("token_embd.weight")
    if out is None:
        raise ModelFileError(f"{file.path}: no output.weight or token_embd.weight tensor")
    return int(out.shape[0])


def _vocab_of_logits(engine) -> int:
    return logits_width(engine.file)


# -- KL divergence -----------------------------------------------------------------------------
@dataclasses.dataclass
class KLDResult:
    """Per scored token (chunk after chunk): NLL under this model and the base, KLD, p diff,
    same top token; `lines()` / `chunk_line(i)` print them as ik."""
    n_ctx: int
    n_chunk: int
    nll: np.ndarray
    nll_base: np.ndarray
    kld: np.ndarray
    p_diff: np.ndarray
    same_top: np.ndarray

    @property
    def count(self) -> int:
        return int(self.nll.size)

    def _upto(self, n: int) -> KLDResult:
        return KLDResult(self.n_ctx, self.n_chunk, *(a[:n] for a in (self.nll, self.nll_base, self.kld,
                                                                       self.p_diff, self.same_top)))

    def chunk_line(self, i: int) -> str:
        """ik's table row after chunk i (0-based), from the tokens of chunks 0..i."""
        return _chunk_line(self._upto((i + 1) * n_scored(self.n_ctx)), i)

    @property
    def mean_kld(self) -> float:
        return _mean_unc(*_sums(self.kld), self.count)[0]

    @property
    def ppl(self) -> float:
        return math.exp(_mean_unc(*_sums(self.nll), self.count)[0])

    @property
    def ppl_base(self) -> float:
        return math.exp(_mean_unc(*_sums(self.nll_base), self.count)[0])

    @property
    def same_top_fraction(self) -> float:
        return float(self.same_top.mean())

    def lines(self) -> list[str]:
        return summary_lines(self)


KLD_HEADER = ("chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS"
              "            Same top p")


def _sums(x) -> tuple[float, float]:
    x = np.asarray(x, np.float64)
    return float(x.sum()), float((x * x).sum())


def _mean_unc(s: float, s2: float, count: int) -> tuple[float, float]:
    """ik's mean_and_uncertainty: the mean and the standard error (0 for 10 values or fewer)."""
    if count < 1:
        return 0.0, 0.0
    f = s / count
    df = s2 / count - f * f
    return f, (math.sqrt(df / (count - 1)) if df > 0 and count > 10 else 0.0)


def _cov(sa: float, sb: float, sab: float, count: int) -> float:
    if count < 10:
        return 0.0
    return (sab / count - (sa / count) * (sb / count)) / (count - 1)


def _div(a: float, b: float) -> float:
    """a / b as C computes it for doubles (inf or nan, never an exception)."""
    with np.errstate(all="ignore"):
        return float(np.float64(a) / np.float64(b))


def _sqrt(x: float) -> float:
    with np.errstate(all="ignore"):
        return float(np.sqrt(np.float64(x)))


def _stats(r: KLDResult) -> dict:
    n = r.count
    s_nll, s_nll2 = _sums(r.nll)
    s_b, s_b2 = _sums(r.nll_base)
    s_nb = float((np.asarray(r.nll, np.float64) * np.asarray(r.nll_base, np.float64)).sum())
    log_ppl = _mean_unc(s_nll, s_nll2, n)
    log_base = _mean_unc(s_b, s_b2, n)
    cov = _cov(s_nll, s_b, s_nb, n)
    pd = np.asarray(r.p_diff, np.float64)
    pd2 = pd * pd
    mse = _mean_unc(float(pd2.sum()), float((pd2 * pd2).sum()), n)
    rms = _sqrt(mse[0])
    top = float(np.count_nonzero(r.same_top)) / n
    return dict(n=n, log_ppl=log_ppl, log_base=log_base, cov=cov, kld=_mean_unc(*_sums(r.kld), n),
                p_diff=_mean_unc(float(pd.sum()), float(pd2.sum()), n), rms=rms,
                rms_unc=_div(0.5, rms) * mse[1], top=top, top_unc=_sqrt(_div(top * (1 - top), n - 1)))


def _chunk_line(r: KLDResult, i: int) -> str:
    st = _stats(r)
    (lp, lpu), (lb, lbu), cov = st["log_ppl"], st["log_base"], st["cov"]
    ppl = math.exp(lp)
    ratio_unc = _sqrt(lpu * lpu + lbu * lbu - 2.0 * cov)
    kl, klu = st["kld"]
    return (f"{i + 1:4d}" + f"    {ppl:9.4f} ± {ppl * lpu:9.4f}" + f"    {lp - lb:10.5f} ± {ratio_unc:10.5f}"
            + f"    {kl:10.5f} ± {klu:10.5f}" + f"    {100.0 * st['rms']:6.3f} ± {100.0 * st['rms_unc']:6.3f} %"
            + f"    {100.0 * st['top']:6.3f} ± {100.0 * st['top_unc']:6.3f} %")


def _percentile(values: np.ndarray, fraction: float) -> float:
    """ik's percentile over sorted float values, in float arithmetic as its lambda."""
    f = np.float32(fraction)
    if f <= 0:
        return float(values[0])
    if f >= 1:
        return float(values[-1])
    p = np.float32(f * np.float32(len(values) - 1))
    ip = int(p)
    p = np.float32(p - np.float32(ip))
    return float((np.float32(1) - p) * values[ip] + p * values[min(ip + 1, len(values) - 1)])


def _median(values: np.ndarray) -> float:
    n = len(values)
    return float(np.float32(0.5) * (values[n // 2] + values[n // 2 - 1])) if n % 2 == 0 else float(values[n // 2])


def summary_lines(r: KLDResult) -> list[str]:
    """The block ik prints after the table (nothing under 100 scored tokens, as ik)."""
    if r.count < 100:
        return []
    st = _stats(r)
    (lp, lpu), (lb, lbu), cov = st["log_ppl"], st["log_base"], st["cov"]
    ppl, base = math.exp(lp), math.exp(lb)
    ppl_unc, base_unc = ppl * lpu, base * lbu
    cor = _div(cov, lpu * lbu)
    ratio, ratio_unc = lp - lb, _sqrt(lpu * lpu + lbu * lbu - 2.0 * cov)
    ppl_cov = ppl * base * cov
    kv = np.sort(np.asarray(r.kld, np.float32))
    pv = np.sort(np.asarray(r.p_diff, np.float32))
    kl, klu = st["kld"]
    pdm, pdu = st["p_diff"]
    out = ["====== Perplexity statistics ======",
           f"Mean PPL(Q)                   : {ppl:10.6f} ± {ppl_unc:10.6f}",
           f"Mean PPL(base)                : {base:10.6f} ± {base_unc:10.6f}",
           f"Cor(ln(PPL(Q)), ln(PPL(base))): {100.0 * cor:6.2f}%",
           f"Mean ln(PPL(Q)/PPL(base))     : {ratio:10.6f} ± {ratio_unc:10.6f}",
           f"Mean PPL(Q)/PPL(base)         : {math.exp(ratio):10.6f} ± {math.exp(ratio) * ratio_unc:10.6f}",
           f"Mean PPL(Q)-PPL(base)         : {ppl - base:10.6f} ± "
           f"{_sqrt(ppl_unc * ppl_unc + base_unc * base_unc - 2.0 * ppl_cov):10.6f}",
           "",
           "====== KL divergence statistics ======",
           f"Mean    KLD: {kl:10.6f} ± {klu:10.6f}",
           f"Maximum KLD: {float(kv[-1]):10.6f}"]
    for frac, name in ((0.999, "99.9%"), (0.990, "99.0%"), (0.950, "95.0%"), (0.900, "90.0%")):
        out.append(f"{name}   KLD: {_percentile(kv, frac):10.6f}")
    out.append(f"Median  KLD: {_median(kv):10.6f}")
    for frac, name in ((0.100, "10.0%"), (0.050, " 5.0%"), (0.010, " 1.0%"), (0.001, " 0.1%")):
        out.append(f"{name}   KLD: {_percentile(kv, frac):10.6f}")
    out += [f"Minimum KLD: {float(kv[0]):10.6f}", "",
            "====== Token probability statistics ======",
            f"Mean    Δp: {100.0 * pdm:6.3f} ± {100.0 * pdu:5.3f} %",
            f"Maximum Δp: {100.0 * float(pv[-1]):6.3f}%"]
    for frac, name in ((0.999, "99.9%"), (0.990, "99.0%"), (0.950, "95.0%"), (0.900, "90.0%"), (0.750, "75.0%")):
        out.append(f"{name}   Δp: {100.0 * _percentile(pv, frac):6.3f}%")
    out.append(f"Median  Δp: {100.0 * _median(pv):6.3f}%")
    for frac, name in ((0.250, "25.0%"), (0.100, "10.0%"), (0.050, " 5.0%"), (0.010, " 1.0%"), (0.001, " 0.1%")):
        out.append(f"{name}   Δp: {100.0 * _percentile(pv, frac):6.3f}%")
    out += [f"Minimum Δp: {100.0 * float(pv[0]):6.3f}%",
            f"RMS Δp    : {100.0 * st['rms']:6.3f} ± {100.0 * st['rms_unc']:5.3f} %",
            f"Same top p: {100.0 * st['top']:6.3f} ± {100.0 * st['top_unc']:5.3f} %"]
    return out


def check_base_vocab(base: BaseLogits, n_vocab: int) -> None:
    """ik prints "inconsistent vocabulary" and reads on (garbage); here it is refused."""
    if base.n_vocab != n_vocab:
        raise OptionError(f"kl-divergence-base {base.path}: inconsistent vocabulary ({base.n_vocab} in the file vs "
                          f"{n_vocab} in the model): the base was computed with another model's vocabulary")


def check_base(engine, base: BaseLogits) -> None:
    """The base file fits this model and engine: its vocabulary (ik only warns, then reads garbage)
    and a context the engine can hold (ik: "Increase it with -c and retry")."""
    check_base_vocab(base, _vocab_of_logits(engine))
    if base.n_ctx > engine.options.ctx:
        raise OptionError(f"kl-divergence-base {base.path}: computed with n_ctx {base.n_ctx}, while the current "
                          f"context is {engine.options.ctx}: increase it with -c {base.n_ctx} and retry")
    if base.tokens.size and (base.tokens.min() < 0 or base.tokens.max() >= engine.config.vocab_size):
        raise OptionError(f"kl-divergence-base {base.path}: holds token ids outside this model's vocabulary "
                          f"[0, {engine.config.vocab_size})")


def kld(engine, base, *, n_chunks: int | None = None,
        on_chunk: Callable[[int, KLDResult], None] | None = None) -> KLDResult:
    """llama-perplexity --kl-divergence: this model against the base log-probabilities of `base`
    (a path or `BaseLogits`), over the base's own tokens and n_ctx. `on_chunk(i, result so far)`
    after each chunk (the CLI's table row)."""
    base = base if isinstance(base, BaseLogits) else BaseLogits.open(base)
    check_base(engine, base)
    n_ctx, V = base.n_ctx, base.n_vocab
    n_chunk = base.n_chunk
    if n_chunks is not None:
        if isinstance(n_chunks, bool) or not isinstance(n_chunks, (int, np.integer)) or (n_chunks < 1
                                                                                          and n_chunks != -1):
            raise OptionError(f"chunks: need a count >= 1 (or -1 for all), got {n_chunks!r}")
        n_chunk = n_chunk if n_chunks < 0 else min(n_chunk, int(n_chunks))
    meta = engine.file.metadata
    bos = bos_token(meta) if add_bos_default(meta) else None
    n_seq = sequences_per_step(engine.options, n_ctx)
    ns, first = n_scored(n_ctx), n_ctx // 2
    keys = ("nll", "nll_base", "kld", "p_diff", "same")
    acc = {k: np.zeros((n_chunk, ns), np.bool_ if k == "same" else np.float64) for k in keys}
    cache = engine.new_cache(n_seq)
    res = None
    for i, real, toks in _groups(n_chunk, n_seq, lambda c: base.tokens[c * n_ctx:(c + 1) * n_ctx]):
        rows = np.stack([base.chunk(min(i + s, n_chunk - 1)) for s in range(n_seq)])  # [B, ns, nv]
        parts = {}

        def score(logits, targets, p0, parts=parts, rows=rows):
            B, k, _ = logits.shape
            r = rows[:, p0 - first:p0 - first + k].reshape(B * k, -1)
            scale, mlp, q = split_rows(r, V)
            parts[p0] = (k, _kld_rows(logits.reshape(B * k, -1), jnp.asarray(targets.reshape(-1)),
                                      jnp.asarray(scale), jnp.asarray(mlp), jnp.asarray(q)))

        cache = _chunk_scores(engine, cache, toks, n_ctx, bos, score, real)
        for p0 in sorted(parts):
            k, out = parts[p0]
            _check_finite(engine, out, i)
            for key in keys:
                acc[key][i:i + real, p0 - first:p0 - first + k] = np.asarray(out[key]).reshape(n_seq, k)[:real]
        res = KLDResult(n_ctx, n_chunk, *(acc[k].reshape(-1) for k in keys))
        for s in range(real):
            if on_chunk is not None:
                on_chunk(i + s, res._upto((i + s + 1) * ns))
    return res
