"""Every real-converter fixture through the public API, in every MLA mode, against its reference.

As in ik_llama.cpp, mla=0 and the prompt path of mla=2/3 read attn_kv_b (-> `ref`); mla=1 reads
attn_k_b/attn_v_b (-> `ref_kbvb` where the file has both). Files lacking a form exercise the
derivation from the other one (mainline: no attn_kv_b; kvb: no attn_k_b/attn_v_b).
"""
from __future__ import annotations

import pytest

import ikjax
from conftest import fixtures_dir, load_ref, manifest, rel_err

ENTRIES = manifest()
# mla 2/3 on the files whose layout forces derivation, plus one carrying all three tensors
DERIVING = [e for e in ENTRIES if e["layout"] in ("mainline", "kvb")] + \
    [e for e in ENTRIES if e["file"] == "v3dense-all-Q8_0.gguf"]


def _check(entry: dict, mla: int, fa: bool) -> float:
    key = "ref_kbvb" if mla == 1 else "ref"
    tokens, ref = load_ref(entry, key)
    eng = ikjax.load(fixtures_dir() / entry["file"], mla=mla, fa=fa, ctk="f32")
    err = rel_err(eng.logits(tokens), ref)
    assert err <= entry["tol"], f"{entry['file']} mla={mla} fa={fa}: rel err {err:.2e} > {entry['tol']}"
    return err


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e["file"])
def test_fixture_standard_attention(entry):
    _check(entry, mla=0, fa=False)


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e["file"])
def test_fixture_absorbed_mla1(entry):
    _check(entry, mla=1, fa=True)


@pytest.mark.parametrize("entry", DERIVING, ids=lambda e: e["file"])
@pytest.mark.parametrize("mla", [2, 3])
def test_fixture_mla23_prompt_path(entry, mla):
    _check(entry, mla=mla, fa=True)


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e["file"])
@pytest.mark.parametrize("mla,fa", [(0, True), (1, False), (2, False), (3, True)])
def test_fixture_every_mode(entry, mla, fa):
    _check(entry, mla=mla, fa=fa)
