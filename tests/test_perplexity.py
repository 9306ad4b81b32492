"""`ikjax perplexity` / `Engine.perplexity` / `Engine.kld` against references nobody here wrote.

Why: users compare these numbers with llama-perplexity's for every quant, so the chunking (second
half of each chunk scored, BOS first where the model adds one), the f32 scoring, ik's base-logits
file and ik's KLD statistics must be ik's. The references: transformers' logits of the same tiny
DeepSeek V3 model (tests/hf_models.py) chunked as ik does, and the formulas of ik's
examples/perplexity/perplexity.cpp rewritten here in NumPy.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
from hf_models import gguf_state_dict, hf_logits, make_model, set_weights
from typer.testing import CliRunner

from ikjax.gguf_io.writer import write_deepseek2_gguf
from ikjax.tokenizer import add_bos_default

N_CTX = 64
N_TOKENS = 3 * N_CTX + 20  # 3 chunks and a tail no chunk reads
_CACHE: dict = {}


def _model():
    if "m" not in _CACHE:
        _CACHE["m"] = make_model("v3", seed=0)
    return _CACHE["m"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tiny V3 at F32 and F16, a perturbed copy at F32, and HF models matching each file."""
    d = tmp_path_factory.mktemp("ppl")
    hf, cfg, sd = _model()
    (f32,) = write_deepseek2_gguf(d / "v3-f32.gguf", cfg, sd, layout="all")
    (f16,) = write_deepseek2_gguf(d / "v3-f16.gguf", cfg, sd, layout="all", qtype="F16")
    hf16, _, _ = make_model("v3", seed=0)
    set_weights(hf16, gguf_state_dict([f16], cfg))  # HF on the file's f16-rounded weights
    rng = np.random.default_rng(7)
    sd_p = {k: (v + rng.normal(0, 0.1 * (float(v.std()) or 0.01), v.shape)).astype(np.float32) for k, v in sd.items()}
    (pert,) = write_deepseek2_gguf(d / "v3-perturbed.gguf", cfg, sd_p, layout="all")
    hfp, _, _ = make_model("v3", seed=0)
    set_weights(hfp, gguf_state_dict([pert], cfg))
    return dict(dir=d, cfg=cfg, f32=f32, f16=f16, pert=pert, hf=hf, hf16=hf16, hfp=hfp)


def _ids(vocab: int, n: int = N_TOKENS, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, vocab, size=n).astype(np.int32)


def _load(path, **opts):
    import ikjax
    return ikjax.load(str(path), **{"ctx": N_CTX, **opts})


# -- NumPy references (ik's perplexity.cpp) --------------------------------------------------------
def ref_chunks(ids, n_ctx, bos=None):
    n_chunk = len(ids) // n_ctx
    for c in range(n_chunk):
        toks = ids[c * n_ctx:(c + 1) * n_ctx].copy()
        feed = toks.copy()
        if bos is not None:
            feed[0] = bos
        yield toks, feed


def ref_nll(hf, ids, n_ctx=N_CTX, bos=None) -> np.ndarray:
    """Every scored token's NLL: positions n_ctx/2 .. n_ctx-2 of each chunk, float64 log-softmax."""
    out = []
    first = n_ctx // 2
    for toks, feed in ref_chunks(ids, n_ctx, bos):
        lg = hf_logits(hf, feed).astype(np.float64)
        m = lg.max(-1, keepdims=True)
        lse = (m + np.log(np.exp(lg - m).sum(-1, keepdims=True)))[:, 0]
        pos = np.arange(first, n_ctx - 1)
        out.append(lse[pos] - lg[pos, toks[pos + 1]])
    return np.concatenate(out)


def ref_ppl(nll) -> tuple[float, float]:
    n = len(nll)
    mean = nll.sum() / n
    var = (nll * nll).sum() / n - mean * mean
    ppl = np.exp(mean)
    return float(ppl), float(np.sqrt(var / (n - 1)) * ppl)


def ref_base_rows(logits32: np.ndarray):
    """ik's log_softmax(n_vocab, logits, log_prob, tok): (scale, min_log_prob, q) per row, f32."""
    lg = logits32.astype(np.float32)
    mx = lg.max(-1)
    mn = np.maximum(lg.min(-1), mx - np.float32(24))
    lse = np.log(np.exp((lg - mx[:, None]).astype(np.float64)).sum(-1)).astype(np.float32)
    scale = ((mx - mn) / np.float32(65535)).astype(np.float32)
    inv = np.float32(1) / scale
    q = np.where(lg > mn[:, None], np.rint(inv[:, None] * (lg - mn[:, None])), 0).astype(np.uint16)
    return scale, (mn - mx - lse).astype(np.float32), q


def ref_kld_rows(logits32, targets, scale, minlp, q):
    """ik's log_softmax(n_vocab, logits, base_log_prob, tok, kld) per row, float64 sums."""
    lg = logits32.astype(np.float64)
    mx = lg.max(-1)
    lse = np.log(np.exp(lg - mx[:, None]).sum(-1))
    nll = mx + lse - lg[np.arange(len(lg)), targets]
    plb = scale[:, None].astype(np.float64) * q + minlp[:, None]
    nll_base = -plb[np.arange(len(lg)), targets]
    kld = np.where(plb > -16, np.exp(plb) * (plb - lg + (mx + lse)[:, None]), 0).sum(-1)
    same = lg.argmax(-1) == plb.argmax(-1)
    return nll, nll_base, kld, same, np.exp(-nll) - np.exp(-nll_base)


def ref_scored_logits(hf, ids, n_ctx=N_CTX, n_chunk=None):
    """(logits [n, V] f32, targets [n]) of the scored positions of every chunk."""
    first = n_ctx // 2
    L, T = [], []
    for c, (toks, feed) in enumerate(ref_chunks(ids, n_ctx)):
        if n_chunk is not None and c >= n_chunk:
            break
        lg = hf_logits(hf, feed)
        L.append(lg[first:n_ctx - 1])
        T.append(toks[first + 1:n_ctx])
    return np.concatenate(L), np.concatenate(T)


# -- perplexity --------------------------------------------------------------------------------
@pytest.mark.parametrize("which,opts,tol", [
    ("f32", {"mla": 0, "ctk": "f32"}, 1e-5),
    ("f32", {"ctk": "f32", "ubatch": 16, "batch": 16}, 1e-5),     # 4 steps a chunk, the first without logits
    ("f32", {}, 1e-4),                                            # ik's defaults: -mla 3 -fa, f16 cache
    ("f32", {"mla": 0, "ctk": "f32", "ubatch": 128, "batch": 128}, 1e-5),  # 2 chunks a step, last padded
    ("f16", {"mla": 0, "ctk": "f32"}, 1e-5),
    ("f16", {}, 1e-4),
], ids=["f32-mla0", "f32-ub16", "f32-default", "f32-nseq2", "f16-mla0", "f16-default"])
def test_ppl_matches_transformers(files, which, opts, tol):
    """PPL, its uncertainty and every token's NLL as transformers' logits give them, chunked as ik."""
    hf = files["hf"] if which == "f32" else files["hf16"]
    ids = _ids(files["cfg"]["vocab_size"])
    eng = _load(files[which], **opts)
    res = eng.perplexity(ids, N_CTX)
    nll = ref_nll(hf, ids)
    ppl, err = ref_ppl(nll)
    assert res.n_chunk == 3 and res.count == 3 * (N_CTX - 1 - N_CTX // 2) == len(nll)
    assert abs(res.ppl / ppl - 1) < tol, (res.ppl, ppl)
    assert abs(res.ppl_err / err - 1) < 1e-2, (res.ppl_err, err)
    assert np.abs(res.nll - nll).max() < 50 * tol
    # the running values of the progress line: exp(mean NLL) over the chunks so far
    for i, v in enumerate(res.chunk_ppl):
        upto = nll[:(i + 1) * (N_CTX - 1 - N_CTX // 2)]
        assert abs(v / np.exp(upto.mean()) - 1) < tol


def test_ppl_odd_context_as_ik(files):
    """An odd -c, as llama-perplexity takes it: positions floor(c/2) .. c-2 of each chunk scored
    (the second half one token longer), every NLL as transformers' logits give it."""
    ids = _ids(files["cfg"]["vocab_size"])
    res = _load(files["f32"], mla=0, ctk="f32").perplexity(ids, 63)
    nll = ref_nll(files["hf"], ids, 63)
    assert res.count == res.n_chunk * (63 - 1 - 63 // 2) == len(nll) and res.n_chunk >= 3
    assert abs(res.ppl / ref_ppl(nll)[0] - 1) < 1e-5 and np.abs(res.nll - nll).max() < 5e-4


def test_ppl_bos_replaces_each_chunks_first_token(files):
    """Where the file asks for BOS, every chunk's first token is fed as BOS (ik's rule)."""
    ids = _ids(files["cfg"]["vocab_size"], seed=1)
    eng = _load(files["f32"], mla=0, ctk="f32")
    plain = eng.perplexity(ids, N_CTX).ppl
    eng.file.metadata["tokenizer.ggml.add_bos_token"] = True
    res = eng.perplexity(ids, N_CTX)
    want, _ = ref_ppl(ref_nll(files["hf"], ids, bos=0))
    assert abs(res.ppl / want - 1) < 1e-5
    assert abs(plain / want - 1) > 1e-4, "BOS replacement changed nothing: the test cannot tell"


def test_chunks_caps_the_count(files):
    ids = _ids(files["cfg"]["vocab_size"])
    res = _load(files["f32"], mla=0, ctk="f32").perplexity(ids, N_CTX, n_chunks=2)
    want, _ = ref_ppl(ref_nll(files["hf"], ids[:2 * N_CTX]))
    assert res.n_chunk == 2 and abs(res.ppl / want - 1) < 1e-5


# -- the base file and KL divergence -----------------------------------------------------------------
def test_base_file_is_iks_format_and_self_kld_is_zero(files, tmp_path):
    """The file: `_logits_`, n_ctx, n_vocab, n_chunk, the tokens, then per scored token 2 f32 and
    the 16-bit log-probabilities (rows as ik's quantizer makes them from transformers' logits);
    a model against its own base: KLD ~0, the same top token everywhere, PPL ratio 1."""
    from ikjax.runtime import perplexity as ppl
    cfg = files["cfg"]
    V = cfg["vocab_size"]
    ids = _ids(V, seed=2)
    eng = _load(files["f32"], mla=0, ctk="f32")
    path = tmp_path / "base.kld"
    res = eng.perplexity(ids, N_CTX, save_base=path)
    raw = path.read_bytes()
    ns, nv = N_CTX - 1 - N_CTX // 2, 2 * ((V + 1) // 2) + 4
    assert raw[:8] == b"_logits_"
    assert list(np.frombuffer(raw[8:20], "<i4")) == [N_CTX, V, 3]
    assert np.array_equal(np.frombuffer(raw[20:20 + 4 * 3 * N_CTX], "<i4"), ids[:3 * N_CTX])
    assert len(raw) == 20 + 4 * 3 * N_CTX + 2 * nv * ns * 3
    rows = np.frombuffer(raw[20 + 4 * 3 * N_CTX:], "<u2").reshape(3 * ns, nv)
    head = rows[:, :4].copy().view("<f4")
    lg, _ = ref_scored_logits(files["hf"], ids)
    scale, minlp, q = ref_base_rows(lg)
    np.testing.assert_allclose(head[:, 0], scale, rtol=1e-4)
    np.testing.assert_allclose(head[:, 1], minlp, rtol=1e-4, atol=1e-4)
    assert np.abs(rows[:, 4:4 + V].astype(np.int64) - q).max() <= 2
    base = ppl.BaseLogits.open(path)
    assert (base.n_ctx, base.n_vocab, base.n_chunk) == (N_CTX, V, 3)
    kl = eng.kld(path)
    assert kl.count == res.count
    assert abs(kl.mean_kld) < 1e-6 and np.abs(kl.kld).max() < 1e-5
    assert kl.same_top_fraction == 1.0
    assert abs(kl.ppl / res.ppl - 1) < 1e-5
    # the 16-bit base loses < 24/65535 nats a token: PPL(base) read back agrees with PPL(Q)
    assert abs(kl.ppl_base / res.ppl - 1) < 1e-3


def test_kld_against_perturbed_model_matches_numpy(files, tmp_path):
    """KLD, NLLs, Δp and same-top of a perturbed model against the base, as ik's formulas give
    them from transformers' logits of both models."""
    V = files["cfg"]["vocab_size"]
    ids = _ids(V, n=4 * N_CTX + 5, seed=3)  # 124 scored tokens: ik prints its block from 100
    path = tmp_path / "base.kld"
    _load(files["f32"], mla=0, ctk="f32").perplexity(ids, N_CTX, save_base=path)
    kl = _load(files["pert"], mla=0, ctk="f32").kld(path)
    lb, targets = ref_scored_logits(files["hf"], ids)
    lq, _ = ref_scored_logits(files["hfp"], ids)
    nll, nll_base, kld, same, p_diff = ref_kld_rows(lq, targets, *ref_base_rows(lb))
    assert kld.mean() > 1e-3, "the perturbation changed nothing: the test cannot tell"
    assert abs(kl.mean_kld / kld.mean() - 1) < 1e-3, (kl.mean_kld, kld.mean())
    np.testing.assert_allclose(kl.kld, kld, rtol=1e-2, atol=1e-5)
    np.testing.assert_allclose(kl.nll, nll, atol=1e-4)
    np.testing.assert_allclose(kl.nll_base, nll_base, atol=1e-3)
    np.testing.assert_allclose(kl.p_diff, p_diff, atol=1e-5)
    assert abs(int(kl.same_top.sum()) - int(same.sum())) <= 1
    lines = kl.lines()
    got = {m.group(1): float(m.group(2)) for m in (re.match(r"(Mean    KLD|Median  KLD|Maximum KLD):\s+(\S+)", x)
                                                   for x in lines) if m}
    assert abs(got["Mean    KLD"] - kld.mean()) < 2e-6 + 1e-3 * kld.mean()
    assert abs(got["Maximum KLD"] - kld.max()) < 1e-5 + 1e-2 * kld.max()
    assert abs(got["Median  KLD"] - np.median(kld)) < 1e-5 + 1e-2 * np.median(kld)


def test_kld_statistics_are_iks_on_known_values():
    """The printed block from fixed per-token values: ik's percentile (linear between sorted
    values), its median, its standard errors and its line labels in order."""
    from ikjax.runtime.perplexity import KLDResult, summary_lines
    n = 201
    kld = np.linspace(0, 2, n)
    rng = np.random.default_rng(0)
    nll = rng.uniform(1, 3, n)
    r = KLDResult(64, 7, nll, nll + 0.1, kld, np.linspace(-0.5, 0.5, n), np.arange(n) % 4 != 0)
    lines = summary_lines(r)
    labels = [x.split(":")[0] for x in lines if ":" in x]
    assert labels == ["Mean PPL(Q)                   ", "Mean PPL(base)                ",
                      "Cor(ln(PPL(Q)), ln(PPL(base)))", "Mean ln(PPL(Q)/PPL(base))     ",
                      "Mean PPL(Q)/PPL(base)         ", "Mean PPL(Q)-PPL(base)         ",
                      "Mean    KLD", "Maximum KLD", "99.9%   KLD", "99.0%   KLD", "95.0%   KLD", "90.0%   KLD",
                      "Median  KLD", "10.0%   KLD", " 5.0%   KLD", " 1.0%   KLD", " 0.1%   KLD", "Minimum KLD",
                      "Mean    Δp", "Maximum Δp", "99.9%   Δp", "99.0%   Δp", "95.0%   Δp", "90.0%   Δp",
                      "75.0%   Δp", "Median  Δp", "25.0%   Δp", "10.0%   Δp", " 5.0%   Δp", " 1.0%   Δp",
                      " 0.1%   Δp", "Minimum Δp", "RMS Δp    ", "Same top p"]
    val = {x.split(":")[0].strip(): x.split(":")[1].strip() for x in lines if ":" in x}
    assert val["Mean    KLD"] == f"{1.0:.6f} ± {np.sqrt((kld ** 2).mean() - 1) / np.sqrt(n - 1):10.6f}"
    assert val["99.0%   KLD"] == f"{0.99 * 2:.6f}"  # 0.99 * 200 = 198: exactly a sample
    assert val["Median  KLD"] == f"{1.0:.6f}"
    assert val["Mean ln(PPL(Q)/PPL(base))"].startswith("-0.100000")
    assert val["Same top p"].startswith(f"{100 * (1 - 51 / n):6.3f}")
    assert summary_lines(KLDResult(64, 1, *(a[:99] for a in (nll, nll, kld, kld, kld > 0)))) == []


# -- the command line ------------------------------------------------------------------------------
TEXT = ("The river town sits where two valleys meet, and for most of its history it has lived by the water. "
        "In the spring the snow melts on the high ridges and the river rises, brown and fast. ") * 4


def invoke(args, code=0):
    from ikjax.cli import app
    res = CliRunner().invoke(app, [str(a) for a in args])
    assert res.exit_code == code, f"exit {res.exit_code}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    return res


def test_cli_progress_and_final_line(files, tmp_path):
    """stdout is llama-perplexity's: `[1]x,[2]y,...` then `Final estimate: PPL over N chunks for
    n_ctx=C = X +/- Y`, the same numbers as Engine.perplexity on the file's tokens."""
    from ikjax.tokenizer import GGUFTokenizer
    text = tmp_path / "t.txt"
    text.write_text(TEXT + "\n")
    res = invoke(["perplexity", "-m", files["f32"], "-f", text, "-c", N_CTX, "-mla", "0", "-ctk", "f32", "-t", "1"])
    lines = res.stdout.splitlines()
    assert len(lines) == 2, res.stdout
    items = re.fullmatch(r"((?:\[\d+\]\d+\.\d{4},)+)", lines[0])
    assert items, lines[0]
    vals = [float(v) for v in re.findall(r"\[\d+\](\d+\.\d{4}),", lines[0])]
    assert [int(i) for i in re.findall(r"\[(\d+)\]", lines[0])] == list(range(1, len(vals) + 1))
    fin = re.fullmatch(r"Final estimate: PPL over (\d+) chunks for n_ctx=(\d+) = (\d+\.\d{4}) \+/- (\d+\.\d{5})",
                       lines[1])
    assert fin, lines[1]
    tok = GGUFTokenizer.from_file(str(files["f32"]))
    meta = _load(files["f32"]).file.metadata
    ids = tok.encode(TEXT, add_bos=add_bos_default(meta))  # one trailing newline dropped, as ik
    want = _load(files["f32"], mla=0, ctk="f32").perplexity(ids, N_CTX)
    assert int(fin.group(1)) == len(vals) == want.n_chunk == len(ids) // N_CTX and int(fin.group(2)) == N_CTX
    assert float(fin.group(3)) == pytest.approx(want.ppl, abs=1e-4) and vals[-1] == float(fin.group(3))
    assert float(fin.group(4)) == pytest.approx(want.ppl_err, abs=1e-5)
    assert "perplexity: calculating perplexity over" in res.stderr
    # ik's chunk line ends at n_seq=N (a script anchors on it); ikjax's steps on a line of their own
    assert re.search(r"^perplexity: calculating perplexity over \d+ chunks, n_ctx=\d+, batch_size=\d+, n_seq=\d+$",
                     res.stderr, re.M), res.stderr
    # --ppl-stride 0 is ik's default (taken); another stride is refused in one line
    res0 = invoke(["perplexity", "-m", files["f32"], "-f", text, "-c", N_CTX, "-mla", "0", "-ctk", "f32", "-t", "1",
                   "--ppl-stride", "0"])
    assert res0.stdout == res.stdout
    _assert_one_line_error(invoke(["perplexity", "-m", files["f32"], "-f", text, "--ppl-stride", "32"], 1),
                           "ppl-stride")


def test_cli_ppl_output_type_1(files, tmp_path):
    """--ppl-output-type 1: ik's line a chunk (`%8d  %.4lf  %4lf  %4lf`: offset, PPL, mean NLL, its
    error), the last PPL the final estimate's."""
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    res = invoke(["perplexity", "-m", files["f32"], "-f", text, "-c", N_CTX, "-b", N_CTX, "--ppl-output-type", "1",
                  "-t", "1"])
    lines = res.stdout.splitlines()
    rows = [re.fullmatch(r"\s{0,7}(\d+)  (\d+\.\d{4})  (\d+\.\d{6})  (\d+\.\d{6})", x) for x in lines[:-2]]
    assert rows and all(rows), lines
    assert [int(r.group(1)) for r in rows] == [N_CTX * i for i in range(len(rows))]
    assert lines[-2] == "" and lines[-1].startswith("Final estimate: PPL over ")
    assert f"= {rows[-1].group(2)} +/-" in lines[-1]
    assert abs(np.exp(float(rows[-1].group(3))) - float(rows[-1].group(2))) < 1e-3 * float(rows[-1].group(2))


def test_cli_kl_divergence_block(files, tmp_path):
    """--kl-divergence-base FILE writes the base; with --kl-divergence the table and ik's block."""
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    base = tmp_path / "base.kld"
    invoke(["perplexity", "-m", files["f32"], "-f", text, "-c", N_CTX, "--kl-divergence-base", base, "-t", "1"])
    assert base.read_bytes()[:8] == b"_logits_"
    res = invoke(["perplexity", "-m", files["pert"], "-c", N_CTX, "--kl-divergence-base", base, "--kl-divergence",
                  "-t", "1"])
    out = res.stdout.splitlines()
    head = out.index(next(x for x in out if x.startswith("chunk ")))
    assert "KL Divergence" in out[head] and "Same top p" in out[head]
    rows = [x for x in out[head + 1:] if re.match(r"\s+\d+\s", x)]
    assert rows and all(re.fullmatch(r"\s+\d+(\s+-?\d+\.\d+ ± \s*\d+\.\d+){3}(\s+\d+\.\d{3} ± \s*\d+\.\d{3} %){2}", r)
                        for r in rows), rows
    for label in ("====== Perplexity statistics ======", "Mean PPL(Q)/PPL(base)", "====== KL divergence statistics "
                  "======", "Mean    KLD:", "99.9%   KLD:", "Median  KLD:", " 0.1%   KLD:", "Minimum KLD:",
                  "RMS Δp", "Same top p:"):
        assert any(x.startswith(label) for x in out), label
    mean = float(re.search(r"Mean    KLD:\s+(\S+) ±\s+(\S+)", res.stdout).group(1))
    assert mean > 1e-4  # a perturbed model: a KLD the block reports, not zeros


def _assert_one_line_error(res, *words):
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.stdout + res.stderr
    for w in words:
        assert w in err[0], err[0]


def test_cli_bad_input_is_one_line(files, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Too short.")
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    m = files["f32"]
    _assert_one_line_error(invoke(["perplexity", "-m", m, "-f", tmp_path / "missing.txt"], 1), "missing.txt",
                           "cannot read")
    _assert_one_line_error(invoke(["perplexity", "-m", m, "-f", short, "-c", N_CTX], 1), f"at least {2 * N_CTX} tokens")
    _assert_one_line_error(invoke(["perplexity", "-m", m, "-f", text, "--kl-divergence"], 1), "--kl-divergence-base")
    _assert_one_line_error(invoke(["perplexity", "-m", m, "--kl-divergence", "--kl-divergence-base", text], 1),
                           "log-probabilities")
    # a base file of another vocabulary (ik warns and reads garbage): refused before loading
    hf, cfg, sd = make_model("v3", seed=1, vocab_size=640)
    (other,) = write_deepseek2_gguf(tmp_path / "v640.gguf", dict(cfg), sd, layout="all")
    base = tmp_path / "b640.kld"
    _load(other, mla=0).perplexity(_ids(640), N_CTX, save_base=base)
    _assert_one_line_error(invoke(["perplexity", "-m", m, "-c", N_CTX, "--kl-divergence-base", base,
                                   "--kl-divergence"], 1), "inconsistent vocabulary", "640", "512")
    # a base computed at a larger context than -c
    _assert_one_line_error(invoke(["perplexity", "-m", other, "-c", 32, "--kl-divergence-base", base,
                                   "--kl-divergence"], 1), "-c 64")
    # a truncated base
    cut = tmp_path / "cut.kld"
    cut.write_bytes(base.read_bytes()[:-10])
    _assert_one_line_error(invoke(["perplexity", "-m", other, "-c", N_CTX, "--kl-divergence-base", cut,
                                   "--kl-divergence"], 1), "truncated")
    # a header that claims fewer chunks than the file holds (an outside probe: a mean KLD of inf)
    raw = bytearray(base.read_bytes())
    n_chunk = int.from_bytes(raw[16:20], "little")
    assert n_chunk > 1
    raw[16:20] = (n_chunk - 1).to_bytes(4, "little")
    fewer = tmp_path / "fewer.kld"
    fewer.write_bytes(bytes(raw))
    _assert_one_line_error(invoke(["perplexity", "-m", other, "-c", N_CTX, "--kl-divergence-base", fewer,
                                   "--kl-divergence"], 1), "damaged header")


def test_api_bad_input(files):
    from ikjax.errors import IkjaxError
    eng = _load(files["f32"], mla=0)
    ids = _ids(files["cfg"]["vocab_size"])
    for call, words in [(lambda: eng.perplexity(ids[:100], N_CTX), "at least 128 tokens"),
                        (lambda: eng.perplexity(ids, 2 * N_CTX), "exceed the engine's context"),
                        (lambda: eng.perplexity(ids, N_CTX, n_chunks=0), "chunks")]:
        with pytest.raises(IkjaxError, match=re.escape(words)):
            call()


# -- a base file written by ik_llama.cpp itself ----------------------------------------------------
IK_BASE = "data/ik_base_v3g1_c64.kld"


def test_reads_a_base_file_ik_wrote(tmp_path):
    """tests/data/ik_base_v3g1_c64.kld was written by ik's llama-perplexity (CPU build; -fa 0, its
    path without the flash kernel's f16 rounding; its default f16 latent cache) for
    `make_model("v3", seed=0, n_group=1, topk_group=1)` written by ikjax's GGUF writer at F32, on 2
    chunks of 64 tokens of an English text:
        llama-perplexity -m v3g1-F32.gguf -f text.txt -c 64 --chunks 2 -t 2 -fa 0 \
            --kl-divergence-base tests/data/ik_base_v3g1_c64.kld       (it printed PPL 686.4726)
    ikjax reads it as ik does: the same model run by ikjax with the same cache type writes the
    same rows (each 16-bit log-probability within one unit: the last bits of the logits), its KLD
    against the file is ~0, PPL(base) read back is ik's, and the rows are transformers' log-probs
    up to the f16 cache's rounding. If tests/hf_models.py's v3 model changes, regenerate the file
    with that command."""
    from pathlib import Path

    from ikjax.runtime import perplexity as ppl
    base = ppl.BaseLogits.open(Path(__file__).parent / IK_BASE)
    assert (base.n_ctx, base.n_vocab, base.n_chunk) == (64, 512, 2)
    hf, cfg, sd = make_model("v3", seed=0, n_group=1, topk_group=1)
    scale, minlp, q = ppl.split_rows(base.rows.reshape(-1, base.rows.shape[-1]), 512)
    lg, _ = ref_scored_logits(hf, base.tokens, 64)
    lp = lg.astype(np.float64) - lg.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    ik_lp = scale[:, None].astype(np.float64) * q + minlp[:, None]
    above = ik_lp > minlp[:, None] + 1e-6
    assert np.abs(np.where(above, ik_lp - lp, 0)).max() < 3e-3  # f16 cache rounding, not another model
    (path,) = write_deepseek2_gguf(tmp_path / "v3g1.gguf", cfg, sd, layout="all")
    eng = _load(path, fa=False)  # ik's defaults otherwise: -mla 3, f16 cache
    mine = tmp_path / "mine.kld"
    eng.perplexity(base.tokens, 64, save_base=mine)
    assert Path(mine).read_bytes()[:20 + 4 * 128] == (Path(__file__).parent / IK_BASE).read_bytes()[:20 + 4 * 128]
    _, _, q2 = ppl.split_rows(ppl.BaseLogits.open(mine).rows.reshape(-1, base.rows.shape[-1]), 512)
    diff = np.abs(q.astype(np.int64) - q2)
    assert diff.max() <= 1 and (diff == 0).mean() > 0.7, (diff.max(), (diff == 0).mean())
    kl = eng.kld(base)
    assert kl.count == 2 * 31
    assert abs(kl.mean_kld) < 1e-6 and kl.same_top_fraction == 1.0
    assert abs(kl.ppl_base / 686.4726 - 1) < 1e-4, kl.ppl_base
    assert abs(kl.ppl / 686.4726 - 1) < 1e-4, kl.ppl


@pytest.mark.parametrize("sm", ["layer", "graph"])
def test_cli_split_modes_give_the_one_device_ppl(files, tmp_path, sm):
    """-sm layer / -sm graph over 2 CPU devices (a subprocess: the device count is fixed before JAX
    starts) print the PPL of one device: the chunks' logits come back whole from every executor."""
    import os
    import subprocess
    import sys
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    args = ["perplexity", "-m", str(files["f32"]), "-f", str(text), "-c", str(N_CTX), "-t", "1"]
    one = invoke(args).stdout.splitlines()[-1]
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2")
    out = subprocess.run([sys.executable, "-m", "ikjax.cli", *args, "-sm", sm], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    two = out.stdout.splitlines()[-1]
    assert "on CPU1" in out.stderr and f"(-sm {sm})" in out.stderr, out.stderr  # the split ran over 2 devices
    get = lambda line: float(re.search(r"= (\d+\.\d+) \+/-", line).group(1))
    assert abs(get(two) / get(one) - 1) < 1e-5, (one, two)


def test_cli_reads_the_text_as_ik(files, tmp_path):
    """The -f text as llama-perplexity reads it: escapes processed (its common arguments do that to
    any -f text; `--no-escape` keeps them), a special token's text is plain text (its
    common_tokenize's parse_special is false), and its batch line shows -b capped to n_seq chunks."""
    from ikjax.gguf_io.writer import SPECIAL_TOKENS
    from ikjax.tokenizer import GGUFTokenizer
    m = files["f32"]
    args = ["-c", N_CTX, "-mla", "0", "-ctk", "f32", "-t", "1", "-b", 3 * N_CTX + 8]
    plain = tmp_path / "plain.txt"
    plain.write_text(TEXT.replace(". ", ".\n\t"))
    escaped = tmp_path / "escaped.txt"
    escaped.write_text(TEXT.replace(". ", ".\\n\\t"))
    res = invoke(["perplexity", "-m", m, "-f", plain, *args])
    assert invoke(["perplexity", "-m", m, "-f", escaped, *args]).stdout == res.stdout
    assert invoke(["perplexity", "-m", m, "-f", escaped, "--no-escape", *args]).stdout != res.stdout
    # ik's n_batch = min(-b, n_seq * n_ctx) on its line
    assert f"n_ctx={N_CTX}, batch_size={3 * N_CTX}, n_seq=3\n" in res.stderr, res.stderr
    # special tokens' texts: scored as the text they are
    special = tmp_path / "special.txt"
    text = TEXT.replace(". ", f". {SPECIAL_TOKENS[1]}")
    special.write_text(text)
    got = invoke(["perplexity", "-m", m, "-f", special, *args]).stdout.splitlines()[-1]
    tok = GGUFTokenizer.from_file(str(m))
    eng = _load(m, mla=0, ctk="f32")
    meta = eng.file.metadata
    ids = tok.encode(text, add_bos=add_bos_default(meta), parse_special=False)
    assert len(ids) > len(tok.encode(text, add_bos=add_bos_default(meta)))  # the texts really are special
    want = eng.perplexity(ids, N_CTX)
    fin = re.fullmatch(r"Final estimate: PPL over (\d+) chunks for n_ctx=\d+ = (\S+) \+/- (\S+)", got)
    assert fin and int(fin.group(1)) == want.n_chunk, got
    assert float(fin.group(2)) == pytest.approx(want.ppl, rel=1e-5), (got, want.ppl)


def test_cli_base_file_write_failure_names_the_file(files, tmp_path):
    """A base file that cannot be written whole (here a file size limit; a full disk reads the
    same): one line naming the file, exit 1, neither the file nor its part left."""
    import resource
    import subprocess
    import sys
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    base = tmp_path / "b.kld"

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))
    r = subprocess.run([sys.executable, "-m", "ikjax.cli", "perplexity", "-m", str(files["f32"]), "-f", str(text),
                        "-c", str(N_CTX), "-t", "1", "--kl-divergence-base", str(base)], capture_output=True,
                       text=True, preexec_fn=limit, env={**__import__("os").environ, "IKJAX_COMPILE_CACHE": "0"},
                       timeout=600)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 1 and err[-1].startswith(f"error: kl-divergence-base {base}: cannot write it"), r.stderr
    assert "Traceback" not in r.stderr and sorted(p.name for p in tmp_path.iterdir()) == ["t.txt"]
