"""ikjax against Hugging Face transformers' DeepSeek V2/V3 (an oracle nobody here wrote).

Each test builds a tiny seeded HF model (tests/hf_models.py), writes it with our GGUF writer, loads
it with ``ikjax.load(path, mla=0, ctk="f32")`` and compares all-position logits of a fresh sequence:
relative L2 error ``||got - ref|| / ||ref||`` <= 1e-4.
"""
from __future__ import annotations

import numpy as np
import pytest

from hf_models import gguf_state_dict, hf_logits, make_model, rel_err, set_weights
from ikjax.gguf_io.writer import LAYOUTS, write_deepseek2_gguf

TOL = 1e-4
N_TOKENS = 64


def token_ids(vocab_size: int, n: int = N_TOKENS, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab_size, size=n)
    ids[0] = 0  # BOS
    return ids.astype(np.int32)


_MODELS: dict = {}


def model(variant: str):
    """(hf_model, cfg, sd), built once per session."""
    if variant not in _MODELS:
        _MODELS[variant] = make_model(variant, seed=0)
    return _MODELS[variant]


def ikjax_logits(path, ids, **opts) -> np.ndarray:
    import ikjax
    eng = ikjax.load(str(path), **{"mla": 0, "ctk": "f32", **opts})
    got = np.asarray(eng.logits(ids), dtype=np.float32)
    return got


def check(got: np.ndarray, ref: np.ndarray, what: str, tol: float = TOL) -> float:
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    assert np.isfinite(got).all(), f"{what}: non-finite logits"
    err = rel_err(got, ref)
    worst = int(np.argmax(np.linalg.norm(got - ref, axis=-1)))
    print(f"{what}: rel err {err:.3e} (worst position {worst})")
    assert err <= tol, f"{what}: relative L2 error {err:.3e} > {tol:g} (worst position {worst})"
    return err


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("variant", ["v2lite", "v3"])
def test_f32_matches_hf(tmp_path, variant, layout):
    hf, cfg, sd = model(variant)
    (path,) = write_deepseek2_gguf(tmp_path / f"{variant}-{layout}.gguf", cfg, sd, layout=layout)
    ids = token_ids(cfg["vocab_size"])
    check(ikjax_logits(path, ids), hf_logits(hf, ids), f"{variant}/{layout}/F32")


@pytest.mark.parametrize("variant,layout", [("v2group", "kvb"), ("v3dense2", "mainline"), ("v3h128", "all")])
def test_f32_other_configs(tmp_path, variant, layout):
    """V2 group-limited softmax routing; two leading dense layers; 128 heads."""
    hf, cfg, sd = model(variant)
    (path,) = write_deepseek2_gguf(tmp_path / f"{variant}-{layout}.gguf", cfg, sd, layout=layout)
    ids = token_ids(cfg["vocab_size"], seed=1)
    check(ikjax_logits(path, ids), hf_logits(hf, ids), f"{variant}/{layout}/F32")


@pytest.mark.parametrize("variant,layout", [("v3", "all"), ("v2lite", "mainline")])
def test_q8_0_matches_hf_on_dequantized_weights(tmp_path, variant, layout):
    """Q8_0 file; the reference is HF run on the file's weights (gguf.quants.dequantize; attn_kv_b
    from the file, or rebuilt from attn_k_b/attn_v_b where the file has none)."""
    _, cfg, _ = model(variant)
    hf, _, sd = make_model(variant, seed=0)  # a private copy: its weights get replaced
    (path,) = write_deepseek2_gguf(tmp_path / f"{variant}-{layout}-q8.gguf", cfg, sd, layout=layout, qtype="Q8_0")
    set_weights(hf, gguf_state_dict([path], cfg))
    ids = token_ids(cfg["vocab_size"], seed=2)
    ref = hf_logits(hf, ids)
    assert rel_err(ref, hf_logits(model(variant)[0], ids)) > 1e-3, "quantization did not change the model?"
    check(ikjax_logits(path, ids), ref, f"{variant}/{layout}/Q8_0")


def test_split_file_matches_hf(tmp_path):
    hf, cfg, sd = model("v3")
    paths = write_deepseek2_gguf(tmp_path / "v3-split.gguf", cfg, sd, layout="all", split_max_tensors=8)
    assert len(paths) > 1
    ids = token_ids(cfg["vocab_size"], seed=3)
    check(ikjax_logits(paths[0], ids), hf_logits(hf, ids), "v3/all/F32 split")


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["v3", "v2lite"])
def test_long_prompt_matches_hf(tmp_path, variant):
    """> 1000 tokens: past YaRN's original context (1024) for v3."""
    hf, cfg, sd = model(variant)
    (path,) = write_deepseek2_gguf(tmp_path / f"{variant}-long.gguf", cfg, sd, layout="all")
    ids = token_ids(cfg["vocab_size"], n=1100, seed=4)
    check(ikjax_logits(path, ids), hf_logits(hf, ids), f"{variant}/all/F32 1100 tokens")


@pytest.mark.parametrize("opts", [{"mla": 1}, {"mla": 3, "fa": True}], ids=["mla1", "mla3-fa"])
def test_absorbed_mla_on_derived_tensors(tmp_path, opts):
    """A "kvb" file has no attn_k_b/attn_v_b: the absorbed paths run on tensors derived at load."""
    hf, cfg, sd = model("v3")
    (path,) = write_deepseek2_gguf(tmp_path / "v3-kvb.gguf", cfg, sd, layout="kvb")
    ids = token_ids(cfg["vocab_size"], seed=5)
    check(ikjax_logits(path, ids, **opts), hf_logits(hf, ids), f"v3/kvb/F32 {opts}")
