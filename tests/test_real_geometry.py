"""The real DeepSeek attention geometry (kv_lora_rank 512, rope 64, nope 128, v 128: a 576-wide
latent) in every MLA mode against transformers, on the layouts that need derived tensors."""
from __future__ import annotations

import numpy as np
import pytest

import ikjax
from hf_models import hf_logits, make_model, rel_err
from ikjax.gguf_io.writer import write_deepseek2_gguf

GEOMETRY = dict(num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, qk_rope_head_dim=64,
                qk_nope_head_dim=128, v_head_dim=128, hidden_size=256)


@pytest.mark.parametrize("variant,layout", [("v3", "mainline"), ("v2lite", "kvb")])
def test_real_latent_geometry_every_mode(tmp_path, variant, layout):
    model, cfg, sd = make_model(variant, seed=9, **GEOMETRY)
    tokens = np.random.default_rng(1).integers(2, 500, 50)
    want = hf_logits(model, tokens)
    path = tmp_path / f"{variant}-{layout}.gguf"
    write_deepseek2_gguf(path, cfg, sd, layout=layout, qtype="F32")
    for mla in range(4):
        eng = ikjax.load(path, mla=mla, ctk="f32", ubatch=16)
        assert eng.config.latent_dim == 576
        assert rel_err(eng.logits(tokens), want) < 1e-5, f"mla={mla}"
