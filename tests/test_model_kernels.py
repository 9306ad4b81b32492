"""The model running on the Pallas kernels (interpret mode on CPU): weights repacked at load, the
dequantizing matmul for decode, the fused MoE kernels and the split-KV MLA decode kernel on a real
576-wide latent (16 heads), compared with transformers and with the XLA (jnp) path."""
from __future__ import annotations

import numpy as np
import pytest

import ikjax
from conftest import rel_err
from hf_models import hf_logits, make_model, set_weights, gguf_state_dict
from ikjax.gguf_io.writer import write_deepseek2_gguf
from pallas_kernels.quant_matmul.packing import PackedWeight
from ikjax.model.groups import layer_tensors


@pytest.fixture(scope="module")
def latent576(tmp_path_factory):
    """V3-style, 16 heads, kv_lora_rank 512 + rope 64: the real latent geometry, tiny elsewhere."""
    model, cfg, sd = make_model("v3", seed=21, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512,
                                qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8,
                                num_experts_per_tok=8, n_group=1, topk_group=1)
    path = tmp_path_factory.mktemp("k576") / "k576-Q8_0.gguf"
    write_deepseek2_gguf(path, cfg, sd, layout="all", qtype="Q8_0")
    set_weights(model, gguf_state_dict([path], cfg))  # the oracle sees the file's dequantized weights
    return model, str(path)


def _prompt_then_decode(path, tokens, n_prompt, **opts):
    eng = ikjax.load(path, mla=3, fa=True, ctx=128, ubatch=16, **opts)
    logits, cache = eng.prefill(eng.new_cache(1), tokens[:n_prompt], 0, all_logits=True)
    out = [logits]
    for pos in range(n_prompt, len(tokens)):
        step, cache = eng.step(cache, tokens[None, pos:pos + 1], np.array([pos]))
        out.append(np.asarray(step))
    return eng, np.concatenate(out)


@pytest.mark.parametrize("ctk", ["f32", "q8_0"])
def test_model_on_pallas_kernels_matches_xla_path_and_transformers(latent576, monkeypatch, ctk):
    model, path = latent576
    tokens = np.random.default_rng(4).integers(2, 500, 40)
    want = hf_logits(model, tokens)
    monkeypatch.setenv("IKJAX_KERNELS", "jnp")
    _, xla = _prompt_then_decode(path, tokens, 32, ctk=ctk)
    monkeypatch.setenv("IKJAX_KERNELS", "interpret")
    eng, pallas = _prompt_then_decode(path, tokens, 32, ctk=ctk)
    layer = layer_tensors(eng.weights, 1)
    assert isinstance(layer["gate_exps"], PackedWeight) and isinstance(layer["q_b"], PackedWeight)
    # the prompt path reads attn_kv_b, as transformers does (decode reads the separately quantized
    # attn_k_b/attn_v_b, so only the prompt is held to the oracle)
    assert rel_err(pallas[:32], want[:32]) < (1e-4 if ctk == "f32" else 3e-2)
    # same math: kernels and XLA agree to float rounding, prompt and decode (with a q8_0 cache a
    # last-bit difference can flip a value's rounding into the cache, hence the looser bound)
    tol = 1e-5 if ctk == "f32" else 1e-3
    assert rel_err(pallas[:32], xla[:32]) < tol
    assert rel_err(pallas[32:], xla[32:]) < tol  # the MLA decode kernel, the GEMV, the MoE gather kernel
    from ikjax import ops
    assert ops.selected("norm_linear") == "interpret"  # decode's norms folded into its products


def test_prompt_attention_kernel_in_the_model(latent576, monkeypatch):
    """IKJAX_PROMPT_ATTN=pallas: the -mla 3 prompt attention runs the Pallas flash kernel (keys up
    to each query's position) in both prompt chunks (the second at start 16 of a larger bucket) and
    gives the XLA form's logits. The chunks are short steps, which -mla 3 runs absorbed by default
    (deepseek2.absorbed_pays): here they are held in the expanded form the kernel is for."""
    from ikjax import ops
    _, path = latent576
    tokens = np.random.default_rng(5).integers(2, 500, 32)
    monkeypatch.setenv("IKJAX_SHORT_STEPS", "expanded")
    monkeypatch.setenv("IKJAX_KERNELS", "interpret")
    _, xla = _prompt_then_decode(path, tokens, 32)
    monkeypatch.setenv("IKJAX_PROMPT_ATTN", "pallas")
    _, flash = _prompt_then_decode(path, tokens, 32)
    assert ops.selected("attention") == "interpret"
    assert rel_err(flash, xla) < 1e-5


def test_one_prompt_step_for_every_depth(latent576, monkeypatch):
    """IKJAX_PROMPT_BUCKETS=one (the default with the Pallas prompt attention): every prompt chunk,
    at any depth, runs the one step over the whole cache, its kv_b expansion bounded by the chunk's
    last position (ops.quant_linear_live, interpret mode here), and gives the logits of the steps
    per KV bucket; with `many` the chunks' buckets differ and so do their steps."""
    from ikjax import ops
    _, path = latent576
    tokens = np.random.default_rng(6).integers(2, 500, 56)
    monkeypatch.setenv("IKJAX_SHORT_STEPS", "expanded")
    monkeypatch.setenv("IKJAX_KERNELS", "interpret")
    monkeypatch.setenv("IKJAX_PROMPT_BUCKETS", "many")
    many, want = _prompt_then_decode(path, tokens, 48, kv_block=16)
    assert len({many.kv_bucket(p + 16, 16) for p in (0, 16, 32)}) > 1
    monkeypatch.setenv("IKJAX_PROMPT_BUCKETS", "one")
    one, got = _prompt_then_decode(path, tokens, 48, kv_block=16)
    assert one.prompt_whole_cache and not many.prompt_whole_cache
    assert {one.kv_bucket(p + 16, 16) for p in (0, 16, 32, 100)} == {one.capacity}
    assert ops.selected("quant_linear_live") == "interpret"
    assert rel_err(got, want) < 3e-5  # attention over other lengths: its sums in another order (1.06e-5 on AVX-512)
    # (B, T, plan, decode) keys: three chunks, one prompt step (`many`: one per bucket)
    assert len({k for k in one._compiled if k[1] > 1}) == 1
    assert len({k for k in many._compiled if k[1] > 1}) > 1
