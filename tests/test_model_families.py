"""The deepseek2-GGUF families beyond DeepSeek V2/V3/R1 (issue 27): Kimi K2, GLM-4.7-Flash,
Moonlight, DeepSeek V2 / V2.5, V3.2 and GigaChat3, each against transformers (an oracle nobody here
wrote) on a tiny random model of its shape, written with our GGUF writer and compared at f32 like
tests/test_hf_oracle.py (relative L2 error of all-position logits <= 1e-4).

What sets each family apart is what the test keeps real: per-head sizes and head counts the kernels
see (GLM's nope 192 / v 256 / rope 64 over the 512 + 64 latent, 20 heads; K2's 64 heads), expert
counts, group layouts, scoring (softmax / sigmoid + bias), norm and scale, YaRN's betas. GLM runs
transformers' own Glm4MoeLite class, V3.2 its DeepseekV32 class with the indexer (exactly dense for
fewer tokens than its top-k). Files carrying parts ikjax does not run (an MTP layer, V3.2's
indexer) load with a one-line note naming them. Also here: the families' pre-tokenizers against an
independent regex engine (the `regex` module) on the same patterns, their BOS rules and chat
template fallbacks, the `make-model` presets' metadata and their routers' spread.
"""
from __future__ import annotations

import logging
import types

import numpy as np
import pytest

from hf_models import hf_logits, make_model, rel_err
from ikjax.gguf_io.writer import write_deepseek2_gguf

TOL = 1e-4
N_TOKENS = 48

_MODELS: dict = {}


def model(variant: str):
    """(hf_model, cfg, sd), built once per session."""
    if variant not in _MODELS:
        _MODELS[variant] = make_model(variant, seed=0)
    return _MODELS[variant]


def token_ids(vocab: int, n: int = N_TOKENS, seed: int = 0) -> np.ndarray:
    ids = np.random.default_rng(seed).integers(3, vocab, size=n)
    ids[0] = 0
    return ids.astype(np.int32)


class _Notes(logging.Handler):
    """The ikjax logger's records, read from the logger itself (another test's logging config
    may have turned its propagation off)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def load_with_notes(path, **opts):
    import ikjax
    log = logging.getLogger("ikjax")
    h, level, disabled = _Notes(), log.level, log.disabled
    log.addHandler(h)
    log.setLevel(logging.DEBUG)
    log.disabled = False
    try:
        eng = ikjax.load(str(path), **{"mla": 0, "ctk": "f32", **opts})
    finally:
        log.removeHandler(h)
        log.setLevel(level)
        log.disabled = disabled
    return eng, h.lines


def check(got, ref, what, tol=TOL):
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    assert np.isfinite(got).all(), what
    err = rel_err(got, ref)
    print(f"{what}: rel err {err:.3e}")
    assert err <= tol, f"{what}: relative L2 error {err:.3e} > {tol:g}"
    return err


def with_mtp_layer(cfg: dict, sd: dict, seed: int = 1):
    """The config and state dict with one MTP layer appended as real checkpoints have it
    (`model.layers.N` for N = num_hidden_layers: a full MoE layer plus eh_proj, enorm, hnorm and
    shared_head.norm), its weights random: a model that read them would not match the reference."""
    n = int(cfg["num_hidden_layers"])
    rng = np.random.default_rng(seed)
    d = int(cfg["hidden_size"])
    out = dict(sd)
    for k, v in sd.items():
        pre = f"model.layers.{n - 1}."
        if k.startswith(pre):
            out[f"model.layers.{n}." + k[len(pre):]] = (rng.standard_normal(v.shape) * 0.05).astype(np.float32)
    out[f"model.layers.{n}.eh_proj.weight"] = (rng.standard_normal((d, 2 * d)) * 0.05).astype(np.float32)
    for name in ("enorm", "hnorm", "shared_head.norm"):
        out[f"model.layers.{n}.{name}.weight"] = np.ones(d, np.float32)
    return dict(cfg, num_nextn_predict_layers=1), out


# (variant, layout, tokenizer.ggml.pre, write an MTP layer)
FAMILIES = [
    ("kimi", "all", "kimi-k2", False),
    ("glm47", "mainline", "glm4", True),
    ("moonlight", "kvb", "kimi-k2", False),
    ("v2full", "all", "deepseek-llm", False),
    ("v32", "all", "deepseek-v3", False),
    ("gigachat", "mainline", "gigachat", True),
]


@pytest.mark.parametrize("variant,layout,pre,mtp", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_family_matches_hf(tmp_path, variant, layout, pre, mtp):
    """-mla 0 at f32: every dimension, expert count, group layout and scoring rule read from the
    file reproduces transformers' logits; MTP layers and V3.2's indexer are named, not run."""
    hf, cfg, sd = model(variant)
    if mtp:
        cfg, sd = with_mtp_layer(cfg, sd)
    (path,) = write_deepseek2_gguf(tmp_path / f"{variant}.gguf", cfg, sd, layout=layout, mtp_layers=mtp, pre=pre)
    eng, notes = load_with_notes(path)
    ids = token_ids(cfg["vocab_size"])
    check(np.asarray(eng.logits(ids), np.float32), hf_logits(hf, ids), f"{variant}/{layout}/F32")
    c = eng.config
    assert (c.n_head, c.nope_dim, c.rope_dim, c.v_dim) == (cfg["num_attention_heads"], cfg["qk_nope_head_dim"],
                                                          cfg["qk_rope_head_dim"], cfg["v_head_dim"])
    assert (c.n_expert, c.n_expert_used) == (cfg["n_routed_experts"], cfg["num_experts_per_tok"])
    mtp_notes = [n for n in notes if "MTP layer" in n]
    idx_notes = [n for n in notes if "indexer" in n]
    assert len(mtp_notes) == (1 if mtp else 0), notes
    assert len(idx_notes) == (1 if variant == "v32" else 0), notes
    if mtp:
        assert c.n_nextn == 1 and c.n_layer == cfg["num_hidden_layers"]
        assert f"layer {c.n_layer}" in mtp_notes[0] and "ignored" in mtp_notes[0]
    if variant == "v32":
        assert f"in {cfg['num_hidden_layers']} layers" in idx_notes[0] and "dense attention" in idx_notes[0]


def decode_logits(eng, ids, n_prompt: int) -> np.ndarray:
    """Logits of a prompt of `n_prompt` tokens (one prompt step) followed by the rest fed one token
    a step (the decode path: absorbed attention on the latent cache under -mla 1/3)."""
    out, cache = eng.prefill(eng.new_cache(1), ids[:n_prompt], 0, all_logits=True)
    rows = [np.asarray(out, np.float32)]
    for p in range(n_prompt, len(ids)):
        logit, cache = eng.step(cache, np.asarray([[ids[p]]], np.int32), np.asarray([p], np.int32), all_logits=True)
        rows.append(np.asarray(logit, np.float32).reshape(1, -1))
    return np.concatenate(rows)


@pytest.mark.parametrize("opts", [{"mla": 3, "fa": True}, {"mla": 3, "fa": True, "short": "expanded"},
                                  {"mla": 1, "fa": True}, {"mla": 2, "fa": False}, {"mla": 0, "fa": False}],
                         ids=["mla3-fa", "mla3-fa-expanded", "mla1-fa", "mla2", "mla0-nofa"])
def test_glm_head_sizes_every_mla_mode(tmp_path, opts, monkeypatch):
    """GLM-4.7-Flash's nope 192 / v 256 / rope 64, 20 heads, through every attention path: the
    prompt step's decompressed K/V (nope != v), the absorbed prompt, and decode on the latent cache
    (C++ kernels on the CPU backend), on a file with attn_kv_b only ("kvb": the absorbed paths run
    on attn_k_b / attn_v_b derived at load). The 24-token prompt is a short step: -mla 3 runs it
    absorbed (deepseek2.absorbed_pays: T < 398 at GLM's dims), or expanded when told."""
    from ikjax import ops
    from ikjax.ops import registry
    opts = dict(opts)
    short = opts.pop("short", "absorbed")
    monkeypatch.setenv("IKJAX_SHORT_STEPS", short)
    hf, cfg, sd = model("glm47")
    (path,) = write_deepseek2_gguf(tmp_path / "glm-kvb.gguf", cfg, sd, layout="kvb", pre="glm4")
    eng, _ = load_with_notes(path, **opts)
    ids = token_ids(cfg["vocab_size"], n=24, seed=3)
    registry._SELECTED.clear()
    check(decode_logits(eng, ids, 16), hf_logits(hf, ids), f"glm47/kvb {opts}")
    if eng.backend == "cpu" and opts["fa"]:  # the C++ kernels took these head sizes (no XLA fallback)
        assert ops.selected("mla_decode") == "cpu"
        absorbed = opts["mla"] == 1 or opts["mla"] == 3 and short == "absorbed"
        assert ops.selected("mla_prompt" if absorbed else "attention") == "cpu"


@pytest.mark.parametrize("H", [20, 64])
def test_pallas_decode_family_head_counts(H):
    """The Pallas decode kernel (interpret mode) on GLM-4.7-Flash's 20 heads (padded to its 16-head
    blocks) and Kimi K2's 64, over the 512 + 64 latent every family shares."""
    import jax.numpy as jnp

    from ikjax import ops
    from pallas_kernels.mla_decode.reference import mla_decode_ref
    rng = np.random.default_rng(H)
    q = jnp.asarray(rng.standard_normal((2, H, 576)), jnp.float32)
    cache = jnp.asarray(rng.standard_normal((2, 64, 576)), jnp.bfloat16)
    lengths = jnp.array([7, 64], jnp.int32)
    assert ops.mla_decode_supported(H, 64, 576, 512, backend="interpret")
    y = ops.mla_decode_attention(q, cache, lengths, 0.07, v_dim=512, dtype=jnp.float32, backend="interpret")
    assert ops.selected("mla_decode") == "interpret" and y.shape == (2, H, 512)
    assert rel_err(np.asarray(y), np.asarray(mla_decode_ref(q, cache, lengths, 0.07, v_dim=512,
                                                            dtype=jnp.float32))) < 1e-5


def test_kimi_decode_64_heads(tmp_path):
    """Kimi K2's 64 heads (not a multiple of the 128 R1 has) on the decode kernel path, with its
    YaRN betas (1, 1) read from the file."""
    hf, cfg, sd = model("kimi")
    (path,) = write_deepseek2_gguf(tmp_path / "kimi.gguf", cfg, sd, layout="all", pre="kimi-k2")
    eng, _ = load_with_notes(path, mla=3, fa=True)
    assert (eng.config.yarn.beta_fast, eng.config.yarn.beta_slow) == (1.0, 1.0)
    ids = token_ids(cfg["vocab_size"], n=20, seed=4)
    check(decode_logits(eng, ids, 12), hf_logits(hf, ids), "kimi/all mla3-fa decode")


def test_yarn_betas_matter(tmp_path):
    """The file's YaRN betas are what make Kimi K2 match: the same file with the default betas
    (32, 1) in their place is another model (so the keys are written and read, not defaulted)."""
    import gguf
    hf, cfg, sd = model("kimi")
    (path,) = write_deepseek2_gguf(tmp_path / "kimi.gguf", cfg, sd, layout="all", pre="kimi-k2")
    fields = gguf.GGUFReader(path).fields
    assert float(fields["deepseek2.rope.scaling.yarn_beta_fast"].contents()) == 1.0
    assert "deepseek2.rope.scaling.yarn_beta_slow" not in fields  # 1: YaRN's default, not written
    cfg32 = dict(cfg, rope_scaling=dict(cfg["rope_scaling"], beta_fast=32.0, beta_slow=1.0))
    cfg32.pop("rope_parameters", None)
    # (another pre-tokenizer: a kimi-k2 file without the keys would get K2's betas back, see below)
    (p32,) = write_deepseek2_gguf(tmp_path / "kimi32.gguf", cfg32, sd, layout="all", pre="deepseek-v3")
    ids = token_ids(cfg["vocab_size"], n=32, seed=6)
    eng, _ = load_with_notes(p32)
    assert rel_err(np.asarray(eng.logits(ids), np.float32), hf_logits(hf, ids)) > 1e-3


def test_v2_group_routing_is_used(tmp_path):
    """DeepSeek V2's 8 expert groups (top 3) change its routing: the same file saying one group
    (every expert competes) gives other logits, and the file with its groups matches (above)."""
    import gguf_craft as gc
    hf, cfg, sd = model("v2full")
    (path,) = write_deepseek2_gguf(tmp_path / "v2.gguf", cfg, sd, layout="all", pre="deepseek-llm")
    flat = _rewrite(path, tmp_path / "v2-flat.gguf", lambda g: (
        gc.set_kv(g, "deepseek2.expert_group_count", gc.u32(1)), gc.set_kv(g, "deepseek2.expert_group_used_count", gc.u32(1))))
    eng, _ = load_with_notes(flat)
    assert eng.config.n_expert_group == 1
    ids = token_ids(cfg["vocab_size"], seed=7)
    assert rel_err(np.asarray(eng.logits(ids), np.float32), hf_logits(hf, ids)) > 1e-3


def test_unknown_indexer_tensor_still_refused(tmp_path):
    """Only V3.2's own indexer tensors, of layers the file has, are loaded past: another name under
    blk.N.indexer, or an indexer tensor of a layer past block_count, is refused naming it."""
    import ikjax
    from ikjax.gguf_io.config import ModelConfig
    from ikjax.gguf_io.reader import GGUFModelFile
    hf, cfg, sd = model("v32")
    (path,) = write_deepseek2_gguf(tmp_path / "v32.gguf", cfg, sd, layout="all")
    gf = GGUFModelFile(path)
    ModelConfig.from_metadata(gf.metadata, tensors=gf.tensors)  # as written: accepted
    some = gf.tensors["blk.0.indexer.proj.weight"]
    for bad in ("blk.0.indexer.bogus.weight", f"blk.{cfg['num_hidden_layers']}.indexer.proj.weight"):
        with pytest.raises(ikjax.ModelFileError, match=bad.replace(".", "\\.")):
            ModelConfig.from_metadata(gf.metadata, tensors={**gf.tensors, bad: some})


def test_family_pre_tokenizers_match_regex_module():
    """kimi-k2 and glm4 split text as the `regex` module splits it with the same pattern (an
    independent engine: Oniguruma in `tokenizers` takes K2's class intersections as written), K2
    keeping Han runs whole and cutting words at case changes as Moonshot's tokenizer does."""
    import regex
    from tokenizers import Regex, pre_tokenizers

    from ikjax.tokenizer import PRE_REGEXES
    text = ("getUserName iPhone 你好世界abc 12345  x\n\n y HELLO's 々中 I'm don'T résumé Ωmega\t\tz 3.14!!\n"
            "Привет, мир! مرحبا 😀 emoji\r\n  tail   ")
    for pre in ("kimi-k2", "glm4"):
        (rx,) = PRE_REGEXES[pre]
        split = pre_tokenizers.Split(Regex(rx), behavior="isolated")
        got = [w for w, _ in split.pre_tokenize_str(text)]
        assert got == regex.findall(rx, text, flags=regex.V1), pre
        assert "".join(got) == text
    k2 = [w for w, _ in pre_tokenizers.Split(Regex(PRE_REGEXES["kimi-k2"][0]), "isolated").pre_tokenize_str(
        "getUserName你好abc")]
    assert k2 == ["get", "User", "Name", "你好", "abc"]


def _tok_metadata(pre: str, add_bos=None):
    from ikjax.gguf_io.writer import tokenizer_metadata
    md = {k: v for k, v, _ in tokenizer_metadata(600, pre=pre)}
    if add_bos is not None:
        md["tokenizer.ggml.add_bos_token"] = add_bos
    return md


@pytest.mark.parametrize("pre,bos", [("kimi-k2", False), ("glm4", False), ("gigachat", False),
                                     ("deepseek-v3", False), ("deepseek-llm", False)])
def test_family_tokenizers_load_and_bos_rule(pre, bos):
    """Each family's pre-tokenizer builds; without tokenizer.ggml.add_bos_token no BPE file gets a
    BOS (llama.cpp's and ik's default: DeepSeek's got one here once, and so ids ik never gives,
    RESULTS §23s; GLM's template writes [gMASK]<sop>); the key, where present, decides (DeepSeek's
    own files carry true)."""
    from ikjax.tokenizer import GGUFTokenizer
    tok = GGUFTokenizer(_tok_metadata(pre))
    ids = tok.encode("Hello world 123")
    assert (ids[0] == tok.bos_id) == bos
    assert tok.decode(ids, skip_special=True) == "Hello world 123"
    assert GGUFTokenizer(_tok_metadata(pre, add_bos=True)).encode("x")[0] == tok.bos_id
    assert GGUFTokenizer(_tok_metadata(pre, add_bos=False)).encode("x")[0] != tok.bos_id


@pytest.mark.parametrize("pre,name,start", [("kimi-k2", "kimi-k2", "<|im_user|>user<|im_middle|>Hi<|im_end|>"),
                                            ("glm4", "chatglm4", "[gMASK]<sop><|user|>\nHi")])
def test_family_chat_template_fallbacks(pre, name, start):
    """A file without tokenizer.chat_template gets its family's turn format (llama.cpp's builtins
    of those names), ending with the assistant's header."""
    from ikjax.chat_template import template_for
    t = template_for({"tokenizer.ggml.pre": pre})
    assert t.name == name
    text = t.render([{"role": "user", "content": "Hi"}])
    assert text.startswith(start)
    assert text.endswith("<|im_assistant|>assistant<|im_middle|>" if pre == "kimi-k2" else "<|assistant|>\n")
    own = "{{ 'OWN' }}"
    assert template_for({"tokenizer.ggml.pre": pre, "tokenizer.chat_template": own}).render([]) == "OWN"


@pytest.mark.parametrize("preset", ["kimi-k2", "glm-4.7-flash", "moonlight", "v2"])
def test_preset_metadata_reads_back(preset):
    """Each family preset's metadata and tensor table (no file written: the real shapes are GBs)
    read back through ModelConfig as the family's published dims, glm-4.7-flash's MTP layer named."""
    from types import SimpleNamespace

    from ikjax.gguf_io import writer as gw
    from ikjax.gguf_io.config import ModelConfig, load_notes
    from ikjax.tools import synthetic
    cfg = synthetic.preset_config(preset, layers=2)
    plans = synthetic.plan_tensors(cfg, "Q4_0")
    md = {k: v for k, v, _ in gw.deepseek2_metadata(cfg, mtp_layers=True) + gw._trailing_metadata(cfg, "all", True)}
    md["general.architecture"] = "deepseek2"
    md["tokenizer.ggml.pre"] = cfg["tokenizer_pre"]
    tensors = {t.name: SimpleNamespace(shape=t.shape, qtype=t.qtype) for t in plans}
    c = ModelConfig.from_metadata(md, vocab_from_tensor=cfg["vocab_size"], tensors=tensors)
    want = {"kimi-k2": (64, 128, 128, 384, 8, 1, 1, 2, 2.827), "glm-4.7-flash": (20, 192, 256, 64, 4, 1, 1, 2, 1.8),
            "moonlight": (16, 128, 128, 64, 6, 2, 1, 2, 2.446), "v2": (128, 128, 128, 160, 6, 2, 8, 1, 16.0)}[preset]
    got = (c.n_head, c.nope_dim, c.v_dim, c.n_expert, c.n_expert_used, c.n_expert_shared, c.n_expert_group, c.gating,
           round(c.expert_weights_scale, 4))
    assert got == want, (preset, got)
    assert c.n_layer == 2 and c.n_nextn == (1 if preset == "glm-4.7-flash" else 0)
    assert len(load_notes(c, tensors, md)) == c.n_nextn
    assert (c.q_lora_rank == 0) == (preset == "moonlight")
    if c.gating == 2:  # sigmoid routing without its norm key: taken as false (llama.cpp's), and said so
        md.pop("deepseek2.expert_weights_norm", None)
        c2 = ModelConfig.from_metadata(md, vocab_from_tensor=cfg["vocab_size"], tensors=tensors)
        notes = load_notes(c2, tensors, md)
        assert not c2.expert_weights_norm and any("expert_weights_norm not in the file" in n for n in notes), notes


@pytest.mark.parametrize("preset", ["kimi-k2", "glm-4.7-flash"])
def test_family_presets_spread_tokens(tmp_path, monkeypatch, preset):
    """The routers of a synthetic model with the family's routing (K2: 8 of 384 experts in one
    group; GLM: 4 of 64, its MTP layer in the file) at a small width spread 512 random tokens over
    >= 90 % of the experts of every MoE layer, none above 4x the mean, as tests/test_synthetic.py
    asks of R1's; the file loads and runs (the MTP layer noted, not run)."""
    from test_synthetic import _routing

    from ikjax.tools import synthetic
    monkeypatch.setenv("IKJAX_LAYERS", "unroll")  # each MoE layer traced on its own: one count each
    small = dict(synthetic.PRESETS[preset], num_hidden_layers=6, hidden_size=256, num_attention_heads=4,
                 num_key_value_heads=4, q_lora_rank=96, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=48,
                 v_head_dim=64, moe_intermediate_size=32, intermediate_size=512, vocab_size=2048)
    name = f"{preset}-small-test"
    monkeypatch.setitem(synthetic.PRESETS, name, small)
    monkeypatch.setitem(synthetic.PRESET_NAMES, name, name)
    path = tmp_path / f"{preset}.gguf"
    synthetic.make_model(path, name, "Q4_0")
    counts = _routing(str(path))
    assert len(counts) == 6 - small["first_k_dense_replace"]
    for li, c in enumerate(counts):
        used = np.count_nonzero(c) / len(c)
        assert used >= 0.9 and c.max() <= 4 * c.mean(), (li, used, c.max() / c.mean())


@pytest.mark.parametrize("variant,pre", [("glm47", "glm4"), ("v2full", "deepseek-llm")])
def test_missing_gating_key_read_from_content(tmp_path, variant, pre):
    """Files without expert_gating_func: GLM-4.7-Flash ones from early converters (sigmoid) and
    DeepSeek V2 / V2.5 ones from before the key (softmax). ik tells them apart by layer count;
    ikjax by the file's content (selection biases exp_probs_b come only with sigmoid scores), so a
    tiny GLM of 3 layers still matches transformers, and V2 stays softmax."""
    import gguf_craft as gc
    hf, cfg, sd = model(variant)
    (path,) = write_deepseek2_gguf(tmp_path / f"{variant}.gguf", cfg, sd, layout="all", pre=pre)
    g = gc.parse(path.read_bytes())
    g.kvs = [kv for kv in g.kvs if kv.key != "deepseek2.expert_gating_func"]
    bare = tmp_path / f"{variant}-nogating.gguf"
    bare.write_bytes(gc.build(g))
    eng, _ = load_with_notes(bare)
    assert eng.config.gating == (2 if variant == "glm47" else 1)
    ids = token_ids(cfg["vocab_size"], n=32, seed=8)
    check(np.asarray(eng.logits(ids), np.float32), hf_logits(hf, ids), f"{variant} without expert_gating_func")


def _rewrite(src, dst, edit):
    """A copy of GGUF `src` with `edit(g)` applied to its parsed form (tests/gguf_craft.py)."""
    import gguf_craft as gc
    g = gc.parse(src.read_bytes())
    edit(g)
    dst.write_bytes(gc.build(g))
    return dst


def test_key_length_of_transformers_head_dim_is_repaired(tmp_path):
    """ik's converter writes key_length = config's head_dim where there is one, and transformers 5
    saves DeepSeek configs with head_dim = the rope size: such a file's key_length leaves no nope
    part. The per-head size is then taken from the query projection's rows, with a note, and the
    model matches transformers (measured on ik's own converter: the same 1e-6 as our writer)."""
    import gguf_craft as gc
    hf, cfg, sd = model("moonlight")
    (path,) = write_deepseek2_gguf(tmp_path / "m.gguf", cfg, sd, layout="all", pre="kimi-k2")
    bad = _rewrite(path, tmp_path / "m-headdim.gguf",
                   lambda g: gc.set_kv(g, "deepseek2.attention.key_length", gc.u32(cfg["qk_rope_head_dim"])))
    eng, notes = load_with_notes(bad)
    assert eng.config.nope_dim == cfg["qk_nope_head_dim"]
    assert any("key_length 16 leaves no room" in n and "per-head key size 48" in n for n in notes), notes
    ids = token_ids(cfg["vocab_size"], n=32, seed=9)
    check(np.asarray(eng.logits(ids), np.float32), hf_logits(hf, ids), "moonlight key_length = rope")


def test_kimi_file_without_betas_gets_kimis(tmp_path):
    """A Kimi K2 file without YaRN beta keys (ik's converter drops them) runs with K2's betas (1, 1),
    with a note, and matches transformers; a file of another pre-tokenizer keeps YaRN's 32 / 1."""
    hf, cfg, sd = model("kimi")
    (path,) = write_deepseek2_gguf(tmp_path / "k.gguf", cfg, sd, layout="all", pre="kimi-k2")

    def drop_betas(g):
        g.kvs = [kv for kv in g.kvs if "yarn_beta" not in kv.key]
    bare = _rewrite(path, tmp_path / "k-nobetas.gguf", drop_betas)
    eng, notes = load_with_notes(bare)
    assert (eng.config.yarn.beta_fast, eng.config.yarn.beta_slow) == (1.0, 1.0)
    assert sum("YaRN betas not in the file" in n for n in notes) == 1, notes
    ids = token_ids(cfg["vocab_size"], n=32, seed=10)
    check(np.asarray(eng.logits(ids), np.float32), hf_logits(hf, ids), "kimi without beta keys")
    (other,) = write_deepseek2_gguf(tmp_path / "v3.gguf", cfg, sd, layout="all", pre="deepseek-v3")
    eng, notes = load_with_notes(_rewrite(other, tmp_path / "v3-nobetas.gguf", drop_betas))
    assert eng.config.yarn.beta_fast == 32.0 and not any("YaRN betas" in n for n in notes)


@pytest.mark.parametrize("case", [
    (1, 64, 130, 20, 192, 64, 256, "bf16", "f32"),   # GLM-4.7-Flash's prompt: bf16 q, the f32 kv_b product
    (2, 9, 40, 20, 192, 64, 256, "f32", "f32"),       # exact mode
    (1, 33, 70, 64, 128, 64, 128, "bf16", "bf16")],   # Kimi K2's 64 heads
    ids=lambda c: "B{}-T{}-S{}-H{}-nope{}-R{}-v{}-q{}-kv{}".format(*c))
def test_cpu_attention_kv_family_sizes(case, monkeypatch):
    """The C++ prompt kernel of -mla 2/3 (K = k_nope ++ shared rope key, V = v, read in place) at
    GLM-4.7-Flash's nope 192 / v 256 / rope 64 with 20 heads and at K2's 64 heads, every
    instruction-set level, against the XLA flash reference (tests/test_cpu_mla.py's)."""
    import jax.numpy as jnp
    import zlib

    from pallas_kernels import cpu as _cpu
    if not _cpu.available():
        pytest.skip(_cpu.unavailable_reason() or "no C++ kernels")
    from pallas_kernels.mla_decode import cpu as mla_cpu
    from test_cpu_mla import FLOAT, ISAS, _kv_reference, positions
    B, T, S, H, nope, R, Dv, qd, kvd = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    q = jnp.asarray(rng.standard_normal((B, T, H, nope + R)), FLOAT[qd])
    kv = jnp.asarray(rng.standard_normal((B, S, H, nope + Dv)), FLOAT[kvd])
    kr = jnp.asarray(rng.standard_normal((B, S, R)), FLOAT[qd])
    q_pos = positions(rng, B, T, S)
    ref = np.asarray(_kv_reference(q, kv, kr, q_pos, 0.06, nope), np.float64)
    for isa in ISAS:
        monkeypatch.setenv("IKJAX_CPU_ISA", isa)
        y = np.asarray(mla_cpu.attention_kv(q, kv, kr, q_pos, 0.06, nope=nope, n_threads=2), np.float64)
        assert y.shape == (B, T, H, Dv)
        rel = np.linalg.norm(y - ref) / np.linalg.norm(ref)
        assert np.isfinite(y).all() and rel < (1e-5 if qd == "f32" else 5e-3), (isa, rel)


@pytest.mark.parametrize("H", [20, 64])
@pytest.mark.parametrize("ctk", ["f32", "bf16", "q8_0"])
def test_cpu_decode_family_heads(H, ctk, monkeypatch):
    """The C++ absorbed decode kernel at 20 and 64 heads over the 512 + 64 latent, every cache type,
    against mla_decode_ref on the same stored values."""
    import jax.numpy as jnp

    from pallas_kernels import cpu as _cpu
    if not _cpu.available():
        pytest.skip(_cpu.unavailable_reason() or "no C++ kernels")
    from pallas_kernels.mla_decode import cpu as mla_cpu
    from pallas_kernels.mla_decode.reference import mla_decode_ref
    from test_cpu_mla import ISAS, make_cache, stored_values
    rng = np.random.default_rng(H)
    q = jnp.asarray(rng.standard_normal((2, H, 576)), jnp.float32)
    cache = make_cache(jnp.asarray(rng.standard_normal((2, 96, 576)), jnp.float32), ctk)
    lengths = jnp.array([5, 96], jnp.int32)
    ref = np.asarray(mla_decode_ref(q, stored_values(cache, 576), lengths, 0.07, v_dim=512, dtype=jnp.float32))
    for isa in ISAS:
        monkeypatch.setenv("IKJAX_CPU_ISA", isa)
        y = np.asarray(mla_cpu.mla_decode(q, cache, lengths, 0.07, v_dim=512, n_threads=2))
        assert y.shape == (2, H, 512)
        assert rel_err(y, ref) < 1e-5, (isa, rel_err(y, ref))


@pytest.mark.parametrize("variant,experts,groups", [("v2full", 160, (8, 3)), ("v3", 256, (8, 4))])
def test_group_layout_of_files_without_group_keys(tmp_path, variant, experts, groups):
    """V2 / V2.5 (160 softmax experts) and V3 / R1 (256 sigmoid experts) files without
    expert_group_count (ik's converter writes none) route over their known groups, with a note,
    and match transformers; the same shapes with the keys present take the keys."""
    import gguf_craft as gc
    overrides = dict(n_routed_experts=experts, n_group=groups[0], topk_group=groups[1], num_experts_per_tok=6,
                     moe_intermediate_size=16)
    hf, cfg, sd = make_model(variant, seed=0, **overrides)
    pre = "deepseek-llm" if variant == "v2full" else "deepseek-v3"
    (path,) = write_deepseek2_gguf(tmp_path / f"{variant}.gguf", cfg, sd, layout="all", pre=pre)

    def drop_groups(g):
        g.kvs = [kv for kv in g.kvs if "expert_group" not in kv.key]
    bare = _rewrite(path, tmp_path / f"{variant}-nogroups.gguf", drop_groups)
    eng, notes = load_with_notes(bare)
    assert (eng.config.n_expert_group, eng.config.n_expert_group_used) == groups
    assert sum("expert groups not in the file" in n for n in notes) == 1, notes
    ids = token_ids(cfg["vocab_size"], n=32, seed=11)
    check(np.asarray(eng.logits(ids), np.float32), hf_logits(hf, ids), f"{variant} {experts} experts without group keys")
    one = _rewrite(path, tmp_path / f"{variant}-1group.gguf", lambda g: (
        gc.set_kv(g, "deepseek2.expert_group_count", gc.u32(1)), gc.set_kv(g, "deepseek2.expert_group_used_count", gc.u32(1))))
    eng, notes = load_with_notes(one)
    assert eng.config.n_expert_group == 1 and not any("expert groups" in n for n in notes)


@pytest.mark.parametrize("pre,add_bos,bos", [("kimi-k2", None, False), ("glm4", None, False),
                                             ("deepseek-v3", None, False), ("deepseek-v3", True, True)])
def test_server_prompts_follow_the_bos_rule(pre, add_bos, bos):
    """llama-server's prompts (a completion's text, a chat's rendered template) get a BOS only where
    the model's tokenizer adds one: none for Kimi / GLM files (their templates open the turn
    themselves) nor for a file without the key, a DeepSeek file's where it carries
    add_bos_token = true; never a second one after a template that writes it."""
    import asyncio

    from ikjax.chat_template import ChatTemplate
    from ikjax.server.app import Server
    from ikjax.tokenizer import GGUFTokenizer
    tok = GGUFTokenizer(_tok_metadata(pre, add_bos))
    srv = object.__new__(Server)  # only the tokenizer, template and a slot's context are read by these two paths
    srv.tok, srv.template = tok, ChatTemplate("{{ messages[0]['content'] }}", "test")
    srv.scheduler = types.SimpleNamespace(ctx=4096)
    ids = asyncio.run(srv._prompt_ids("Hello"))
    assert (ids[0] == tok.bos_id) == bos and ids[int(bos):] == tok.encode("Hello", add_bos=False)
    chat, _, _, _ = asyncio.run(srv._chat_prompt({"messages": [{"role": "user", "content": "Hi"}]}))
    assert (chat[0] == tok.bos_id) == bos
    srv.template = ChatTemplate("{{ bos }}{{ messages[0]['content'] }}".replace("{{ bos }}", tok.token_text(tok.bos_id)),
                                "test")
    chat, _, _, _ = asyncio.run(srv._chat_prompt({"messages": [{"role": "user", "content": "Hi"}]}))
    assert chat[0] == tok.bos_id and chat[1] != tok.bos_id
