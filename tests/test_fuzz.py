"""Fuzz: hundreds of seeded byte flips and truncations of a small GGUF. Each damaged file either
loads and runs (`ikjax.load` + one `logits` call) or is refused with an `IkjaxError` — never
another exception, a hang, or a silently different model (issue 8).

"Different model" is judged by what the damage touched (tests/gguf_craft.py labels every header
byte): a flip in tensor data or in a metadata *value* (a hyper-parameter, a token string) makes a
valid file of another model, which no reader can tell; a flip anywhere else in the header (magic,
counts, lengths, keys, value types, tensor names, dims, types, offsets) must be refused or leave
the model exactly as it was: same config and the same tensors at the same bytes, or, where those
differ, the same logits. Runs on the self-made tiny model, so it needs no ../shared.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import traceback

import numpy as np
import pytest

import gguf_craft as gc
import ikjax
from ikjax.gguf_io.config import ModelConfig
from ikjax.gguf_io.reader import GGUFModelFile

SEED = 20260808
N_FLIP_CASES = 320
N_TRUNCATIONS = 40
IDS = [0, 5, 17, 300, 1000]
CASE_SECONDS = 60  # a hang fails the case; the rare case that compiles a new step takes ~5 s
MAX_NEW_SHAPE_RUNS = 3  # forward passes for files that load as a (legitimately) different config


class _Hang(Exception):
    pass


def _alarm(*_):
    raise _Hang()


def _identity(path: str) -> tuple:
    """What decides the logits: the config (less the fields that do not: context length, BOS/EOS)
    and every tensor's name, type, shape and bytes (offset + size: the data bytes are untouched
    when only the header was damaged)."""
    gf = GGUFModelFile(path)
    emb = gf.tensors.get("token_embd.weight")
    cfg = ModelConfig.from_metadata(gf.metadata, source=path, vocab_from_tensor=emb.shape[0] if emb else None)
    cfg = dataclasses.replace(cfg, context_length=0, bos_token_id=None, eos_token_id=None)
    table = sorted((t.name, t.type_id, t.shape, t.offset, t.nbytes) for t in gf.tensors.values())
    return cfg, tuple(table)


def _cases(raw: bytes, g: gc.Gguf) -> list[tuple[str, list[tuple[int, int]] | int]]:
    """(label, [(position, new byte), ...]) flips, or (label, length) truncations; seeded."""
    rng = np.random.default_rng(SEED)
    struct_pos = np.concatenate([np.arange(a, b) for a, b, k in g.spans if k == "struct"])
    value_pos = np.concatenate([np.arange(a, b) for a, b, k in g.spans if k == "value"])
    # the tensor table and the small metadata keys, where one flip does the most damage
    table_start = min(a for a, b, k in g.spans if k == "struct" and a > 24 and
                      raw[a + 8:b].startswith(b"token_embd.weight"))
    table_pos = struct_pos[struct_pos >= table_start]
    scalar_kv_pos = struct_pos[struct_pos < 2000]

    def new_byte(p: int) -> int:
        if rng.random() < 0.5:
            return raw[p] ^ (1 << int(rng.integers(8)))  # one bit
        return (raw[p] + int(rng.integers(1, 256))) % 256  # any other byte

    # hyper-parameter values (before the vocabulary): a valid other model, or refused
    scalar_values = value_pos[value_pos < raw.find(b"tokenizer.ggml.tokens")]
    pools = [(0.30, table_pos), (0.20, scalar_kv_pos), (0.15, struct_pos), (0.05, value_pos),
             (0.05, scalar_values), (0.10, np.arange(g.data_start)), (0.15, np.arange(g.data_start, len(raw)))]
    weights = np.array([w for w, _ in pools])
    cases: list = []
    for i in range(N_FLIP_CASES):
        pool = pools[rng.choice(len(pools), p=weights / weights.sum())][1]
        n = 1 if rng.random() < 0.8 else int(rng.integers(2, 5))
        flips = [(int(p), new_byte(int(p))) for p in rng.choice(pool, size=n, replace=False)]
        cases.append((f"flip#{i}", flips))
    for i in range(N_TRUNCATIONS):
        cut = int(rng.integers(0, g.data_start)) if i % 2 else int(rng.integers(g.data_start, len(raw)))
        cases.append((f"truncate#{i}", cut))
    cases.append(("truncate-padding", len(raw) - 1))  # only the final padding goes: still the model
    return cases


def _kind(g: gc.Gguf, positions: list[int]) -> str:
    """'header' if any byte is header structure, else 'value' / 'pad' / 'data'."""
    kinds = set()
    for p in positions:
        if p >= g.data_start:
            kinds.add("data")
            continue
        kinds.add(next(k for a, b, k in g.spans if a <= p < b))
    for k in ("struct", "value", "pad", "data"):
        if k in kinds:
            return "header" if k == "struct" else k
    raise AssertionError(positions)


@pytest.fixture(scope="module")
def original(tiny_model):
    eng = ikjax.load(tiny_model, ctx=64)
    logits = np.asarray(eng.logits(IDS))
    assert np.isfinite(logits).all()
    return logits, _identity(tiny_model)


def test_fuzz_flips_and_truncations(tiny_model, original, tmp_path):
    ref_logits, ref_identity = original
    raw = open(tiny_model, "rb").read()
    g = gc.parse(raw)
    work = str(tmp_path / "fuzz.gguf")
    shutil.copy(tiny_model, work)
    failures: list[str] = []
    counts = {"refused": 0, "loaded": 0, "forward": 0, "same-model": 0}
    new_shape_runs = 0
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        for label, change in _cases(raw, g):
            if isinstance(change, int):  # truncation: a fresh copy (a live map of a shrunk file faults)
                kind = "data" if change >= g.data_start else "header"
                path = str(tmp_path / f"{label}.gguf")
                with open(path, "wb") as f:
                    f.write(raw[:change])
                restore = None
            else:
                kind = _kind(g, [p for p, _ in change])
                path = work
                with open(work, "r+b") as f:
                    for p, b in change:
                        f.seek(p)
                        f.write(bytes([b]))
                restore = change
            what = f"{label} ({kind}: {change if restore else f'cut at {change}'})"
            signal.alarm(CASE_SECONDS)
            try:
                outcome = _run_case(path, kind, ref_identity, ref_logits, new_shape_runs < MAX_NEW_SHAPE_RUNS)
                if outcome == "new-shape":
                    new_shape_runs += 1
                counts["loaded" if outcome != "refused" else "refused"] += 1
                if outcome in ("forward", "new-shape"):
                    counts["forward"] += 1
                if outcome.startswith("same"):
                    counts["same-model"] += 1
            except _Hang:
                failures.append(f"{what}: still running after {CASE_SECONDS}s")
            except _DifferentModel as e:
                failures.append(f"{what}: {e}")
            except Exception as e:  # noqa: BLE001 - any non-IkjaxError is the failure we look for
                tb = traceback.extract_tb(e.__traceback__)[-1]
                failures.append(f"{what}: {type(e).__name__}: {e} (at {tb.filename}:{tb.lineno})")
            finally:
                signal.alarm(0)
            if restore:
                with open(work, "r+b") as f:
                    for p, _ in restore:
                        f.seek(p)
                        f.write(raw[p:p + 1])
            elif path != work:
                os.unlink(path)
    finally:
        signal.signal(signal.SIGALRM, old)
    assert not failures, f"{len(failures)} damaged files misbehaved:\n" + "\n".join(failures[:20])
    # the fuzz must have exercised both outcomes, and run the model on damaged files that loaded
    assert counts["refused"] >= 150 and counts["loaded"] >= 40 and counts["forward"] >= 20, counts


class _DifferentModel(AssertionError):
    pass


def _run_case(path: str, kind: str, ref_identity, ref_logits, may_compile: bool) -> str:
    try:
        eng = ikjax.load(path, ctx=64)
    except ikjax.IkjaxError as e:
        msg = str(e)
        assert msg and "\n" not in msg, f"error is not one line: {msg!r}"
        return "refused"
    ident = _identity(path)
    same = ident == ref_identity
    if kind in ("header", "pad") and same:
        return "same-model"  # same config, same tensors at the same bytes: same logits by construction
    if kind == "header":  # the header structure changed and the model did too: only equal logits excuse it
        logits = np.asarray(eng.logits(IDS))
        if not np.allclose(logits, ref_logits, rtol=1e-4, atol=1e-4, equal_nan=False):
            raise _DifferentModel(f"loaded as a different model (config or tensor table changed: "
                                  f"{_diff(ident, ref_identity)})")
        return "same-logits"
    if same:  # tensor data or a metadata value changed, config and tensor table intact: one compiled shape
        logits = np.asarray(eng.logits(IDS))
        assert logits.shape == ref_logits.shape
        return "forward"
    if may_compile:  # a valid file of another model (a hyper-parameter value changed): it must still run
        logits = np.asarray(eng.logits(IDS))
        assert logits.shape[0] == len(IDS)
        return "new-shape"
    return "loaded"


def _diff(a, b) -> str:
    (ca, ta), (cb, tb) = a, b
    if ca != cb:
        fields = [f.name for f in dataclasses.fields(ca) if getattr(ca, f.name) != getattr(cb, f.name)]
        return "config fields " + ", ".join(f"{n}: {getattr(cb, n)} -> {getattr(ca, n)}" for n in fields)
    changed = sorted(set(ta) ^ set(tb))
    return "tensors " + "; ".join(map(str, changed[:4]))
