"""ikjax.gguf_io.writer: files it writes look like the real converter's (the fixtures), round-trip
their weights exactly, and split correctly."""
from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest

from hf_models import gguf_state_dict, make_model, make_model_from_config
from ikjax.gguf_io.writer import LAYOUTS, write_deepseek2_gguf

FIXTURES = Path(os.environ.get("IKJAX_FIXTURES") or Path(__file__).resolve().parents[2] / "shared" / "fixtures")

# (fixture file, model dir, layout, qtype, general.name)
STRUCTURE_CASES = [
    ("v3tiny-all-Q4_0.gguf", "v3tiny", "all", "Q4_0", "V3Tiny"),
    ("v3tiny-mainline-Q8_0.gguf", "v3tiny", "mainline", "Q8_0", "V3Tiny"),
    ("v2lite_tiny-kvb-Q5_1.gguf", "v2lite_tiny", "kvb", "Q5_1", "V2Lite_Tiny"),
]
# keys whose values legitimately differ between our file and the fixture
VALUE_EXEMPT = {
    "general.file_type",  # the fixtures were quantized from an F32 file by the gguf package: 0
    "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",  # synthesized vocab
    "GGUF.kv_count",  # same keys, checked by name
}


def fixture(name: str) -> Path:
    p = FIXTURES / name
    if not p.exists():
        pytest.skip(f"fixture {p} not found: set IKJAX_FIXTURES to the shared fixtures folder")
    return p


def _fields(reader: gguf.GGUFReader) -> dict[str, tuple[list, object]]:
    out = {}
    for k, f in reader.fields.items():
        if k.startswith("GGUF."):
            continue
        out[k] = ([int(t) for t in f.types], f.contents())
    return out


def _tensors(reader: gguf.GGUFReader) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(t.name, t.tensor_type.name, tuple(int(x) for x in t.shape)) for t in reader.tensors]


@pytest.fixture(scope="module")
def fixture_models():
    cache = {}

    def get(model_dir: str):
        if model_dir not in cache:
            cfg = json.loads(fixture(f"{model_dir}/hf_config.json").read_text())
            cache[model_dir] = make_model_from_config(cfg, seed=1)
        return cache[model_dir]
    return get


@pytest.mark.parametrize("fname,model_dir,layout,qtype,name", STRUCTURE_CASES, ids=[c[0] for c in STRUCTURE_CASES])
def test_structure_matches_real_converter(tmp_path, fixture_models, fname, model_dir, layout, qtype, name):
    """Same metadata keys (in order), value types and values; same tensor names (in order), shapes, types.

    The fixtures were quantized by the gguf package, which also quantizes ``ffn_gate_inp``:
    ``keep_f32=()`` reproduces that; the default (ik's converter) keeps it F32 (checked below)."""
    ref = gguf.GGUFReader(fixture(fname))
    _, cfg, sd = fixture_models(model_dir)
    (path,) = write_deepseek2_gguf(tmp_path / "out.gguf", cfg, sd, layout=layout, qtype=qtype, name=name, keep_f32=())
    got = gguf.GGUFReader(path)

    ref_f, got_f = _fields(ref), _fields(got)
    assert list(got_f) == list(ref_f), "metadata keys / order differ"
    for k in ref_f:
        assert got_f[k][0] == ref_f[k][0], f"{k}: value type {got_f[k][0]} != {ref_f[k][0]}"
        if k in VALUE_EXEMPT:
            continue
        rv, gv = ref_f[k][1], got_f[k][1]
        if isinstance(rv, float):
            assert gv == pytest.approx(rv, rel=1e-6), k
        else:
            assert gv == rv, f"{k}: {gv!r} != {rv!r}"
    assert len(got_f["tokenizer.ggml.tokens"][1]) == len(ref_f["tokenizer.ggml.tokens"][1])

    assert _tensors(got) == _tensors(ref)

    # ik's converter rule (the default): the router stays F32, all else as before
    (path2,) = write_deepseek2_gguf(tmp_path / "default.gguf", cfg, sd, layout=layout, qtype=qtype, name=name)
    for (n, t, s), (n2, t2, s2) in zip(_tensors(ref), _tensors(gguf.GGUFReader(path2))):
        assert (n, s) == (n2, s2)
        assert t2 == ("F32" if ".ffn_gate_inp." in n else t), n


def test_kb_vb_match_ik_converter_values(tmp_path, fixture_models):
    """ik's converter splits ``attn_kv_b`` into ``attn_k_b``/``attn_v_b``; BF16 rounding is
    elementwise, so the fixture's BF16 k_b/v_b must equal our split of its BF16 kv_b exactly."""
    ref = gguf.GGUFReader(fixture("v3dense-all-BF16.gguf"))
    cfg = json.loads(fixture("v3dense/hf_config.json").read_text())
    deq = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in ref.tensors}
    from ikjax.gguf_io.writer import deepseek2_tensors
    for bid in range(cfg["num_hidden_layers"]):
        kv_b = deq[f"blk.{bid}.attn_kv_b.weight"]
        sd = {f"model.layers.{bid}.self_attn.kv_b_proj.weight": kv_b}
        ours = dict(deepseek2_tensors(dict(cfg, num_hidden_layers=bid + 1), sd, layout="all"))
        np.testing.assert_array_equal(ours[f"blk.{bid}.attn_k_b.weight"], deq[f"blk.{bid}.attn_k_b.weight"])
        np.testing.assert_array_equal(ours[f"blk.{bid}.attn_v_b.weight"], deq[f"blk.{bid}.attn_v_b.weight"])
        ours_ml = dict(deepseek2_tensors(dict(cfg, num_hidden_layers=bid + 1), sd, layout="mainline"))
        H, r, nope, v = cfg["num_attention_heads"], cfg["kv_lora_rank"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
        np.testing.assert_array_equal(ours_ml[f"blk.{bid}.attn_k_b.weight"],
                                      deq[f"blk.{bid}.attn_k_b.weight"].reshape(H, r, nope))
        np.testing.assert_array_equal(ours_ml[f"blk.{bid}.attn_v_b.weight"],
                                      deq[f"blk.{bid}.attn_v_b.weight"].reshape(H, v, r))


@pytest.mark.parametrize("variant", ["v2lite", "v3"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_f32_roundtrip_exact(tmp_path, variant, layout):
    """F32 files give back every HF weight bit-exactly (kv_b rebuilt from k_b/v_b where absent)."""
    _, cfg, sd = make_model(variant)
    paths = write_deepseek2_gguf(tmp_path / "m.gguf", cfg, sd, layout=layout)
    back = gguf_state_dict(paths, cfg)
    assert set(back) == set(sd)
    for k in sd:
        np.testing.assert_array_equal(back[k], sd[k], err_msg=k)
    r = gguf.GGUFReader(paths[0])
    f = {k: r.fields[k].contents() for k in r.fields}
    H, nope, rope, v, kvr = (cfg[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim",
                                              "v_head_dim", "kv_lora_rank"))
    if layout == "mainline":
        assert (f["deepseek2.attention.head_count_kv"], f["deepseek2.attention.key_length"],
                f["deepseek2.attention.value_length"]) == (1, kvr + rope, kvr)
        assert (f["deepseek2.attention.key_length_mla"], f["deepseek2.attention.value_length_mla"]) == (nope + rope, v)
    else:
        assert (f["deepseek2.attention.head_count_kv"], f["deepseek2.attention.key_length"],
                f["deepseek2.attention.value_length"]) == (H, nope + rope, v)
        assert "deepseek2.attention.key_length_mla" not in f
    names = {t.name for t in r.tensors}
    assert ("blk.0.attn_kv_b.weight" in names) == (layout != "mainline")
    assert ("blk.0.attn_k_b.weight" in names) == (layout != "kvb")


def test_v3_metadata_values(tmp_path):
    _, cfg, sd = make_model("v3")
    (path,) = write_deepseek2_gguf(tmp_path / "m.gguf", cfg, sd)
    f = {k: v.contents() for k, v in gguf.GGUFReader(path).fields.items()}
    rs = cfg["rope_scaling"]
    assert f["deepseek2.rope.scaling.type"] == "yarn"
    assert f["deepseek2.rope.scaling.factor"] == pytest.approx(rs["factor"])
    assert f["deepseek2.rope.scaling.original_context_length"] == rs["original_max_position_embeddings"]
    assert f["deepseek2.rope.scaling.yarn_log_multiplier"] == pytest.approx(0.1 * rs["mscale_all_dim"])
    assert f["deepseek2.expert_gating_func"] == 2
    assert (f["deepseek2.expert_group_count"], f["deepseek2.expert_group_used_count"]) == (cfg["n_group"], cfg["topk_group"])
    assert f["deepseek2.expert_weights_norm"] is True
    assert f["deepseek2.expert_weights_scale"] == pytest.approx(cfg["routed_scaling_factor"])
    assert f["deepseek2.attention.q_lora_rank"] == cfg["q_lora_rank"]
    assert len(f["tokenizer.ggml.tokens"]) == cfg["vocab_size"]
    np.testing.assert_array_equal(
        gguf_state_dict([path], cfg)["model.layers.1.mlp.gate.e_score_correction_bias"],
        sd["model.layers.1.mlp.gate.e_score_correction_bias"])
    assert np.abs(sd["model.layers.1.mlp.gate.e_score_correction_bias"]).min() > 0


def test_v2lite_metadata_values(tmp_path):
    _, cfg, sd = make_model("v2lite")
    (path,) = write_deepseek2_gguf(tmp_path / "m.gguf", cfg, sd)
    r = gguf.GGUFReader(path)
    f = {k: v.contents() for k, v in r.fields.items()}
    assert "deepseek2.attention.q_lora_rank" not in f and "deepseek2.rope.scaling.type" not in f
    assert "deepseek2.expert_group_count" not in f
    assert f["deepseek2.expert_gating_func"] == 1
    assert f["deepseek2.expert_weights_norm"] is False
    assert "blk.0.attn_q.weight" in {t.name for t in r.tensors}
    assert "blk.1.exp_probs_b.bias" not in {t.name for t in r.tensors}


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_qtypes(tmp_path, qtype):
    """Weight matrices take the type when their rows divide the block; 1-D, norms, router stay F32."""
    _, cfg, sd = make_model("v3")
    (path,) = write_deepseek2_gguf(tmp_path / "m.gguf", cfg, sd, qtype=qtype)
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
    for t in gguf.GGUFReader(path).tensors:
        expect_f32 = (len(t.shape) == 1 or t.name.endswith("_norm.weight") or ".ffn_gate_inp." in t.name
                      or int(t.shape[0]) % block != 0)
        assert t.tensor_type.name == ("F32" if expect_f32 else qtype), t.name


def test_unsupported_qtype_is_refused(tmp_path):
    _, cfg, sd = make_model("v2lite")
    with pytest.raises(ValueError, match="Q4_K"):
        write_deepseek2_gguf(tmp_path / "m.gguf", cfg, sd, qtype="Q4_K")


@pytest.mark.parametrize("max_tensors", [7, 20])
def test_split_roundtrip(tmp_path, max_tensors):
    _, cfg, sd = make_model("v3")
    (single,) = write_deepseek2_gguf(tmp_path / "one.gguf", cfg, sd, qtype="Q8_0")
    paths = write_deepseek2_gguf(tmp_path / "split.gguf", cfg, sd, qtype="Q8_0", split_max_tensors=max_tensors)
    one = gguf.GGUFReader(single)
    n = len(one.tensors)
    assert len(paths) == -(-n // max_tensors) > 1
    for i, p in enumerate(paths):
        assert p.name == f"split-{i + 1:05d}-of-{len(paths):05d}.gguf" and p.exists()
    readers = [gguf.GGUFReader(p) for p in paths]
    for i, r in enumerate(readers):
        assert r.fields["split.no"].contents() == i
        assert r.fields["split.count"].contents() == len(paths)
        assert r.fields["split.tensors.count"].contents() == n
        assert r.fields["split.no"].types == [gguf.GGUFValueType.UINT16]
        assert r.fields["split.tensors.count"].types == [gguf.GGUFValueType.INT32]
        assert 1 <= len(r.tensors) <= max_tensors
        if i > 0:  # as gguf-split writes them: metadata only in the first shard
            assert {k for k in r.fields if not k.startswith("GGUF.")} == {"split.no", "split.count", "split.tensors.count"}
    first = {k: v.contents() for k, v in readers[0].fields.items() if not k.startswith(("GGUF.", "split."))}
    assert first == {k: v.contents() for k, v in one.fields.items() if not k.startswith("GGUF.")}
    split_tensors = [t for r in readers for t in r.tensors]
    assert [t.name for t in split_tensors] == [t.name for t in one.tensors]
    for a, b in zip(split_tensors, one.tensors):
        assert a.tensor_type == b.tensor_type and list(a.shape) == list(b.shape)
        np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
    back = gguf_state_dict(paths, cfg)
    ref = gguf_state_dict([single], cfg)
    assert set(back) == set(ref) == set(sd)


def test_given_vocab(tmp_path):
    _, cfg, sd = make_model("v2lite")
    vocab = {"tokens": ["<s>", "</s>", "a", "b", "ab"], "token_type": [3, 3, 1, 1, 1], "merges": ["a b"]}
    (path,) = write_deepseek2_gguf(tmp_path / "m.gguf", cfg, sd, vocab=vocab)
    f = gguf.GGUFReader(path).fields
    toks = f["tokenizer.ggml.tokens"].contents()
    assert toks[:5] == vocab["tokens"] and len(toks) == cfg["vocab_size"]
    assert f["tokenizer.ggml.merges"].contents() == ["a b"]
    assert f["tokenizer.ggml.model"].contents() == "gpt2"
