"""Opening a GGUF reads its header only: a multi-GB model opens in well under a second, with no
more memory than its metadata, and every shard of a split model opens as one."""
from __future__ import annotations

import os
import time

import gguf
import numpy as np
import pytest

from ikjax.gguf_io import writer as gw
from ikjax.gguf_io.config import ModelConfig
from ikjax.gguf_io.reader import GGUFModelFile, split_paths
from ikjax.tools.synthetic import plan_tensors, preset_config


def _sparse_model(path, preset="v2-lite", qtype="Q4_0") -> int:
    """A full-size model file whose tensor bytes are a hole (nothing written): header only on disk."""
    cfg = preset_config(preset)
    plans = plan_tensors(cfg, qtype)
    writer = gguf.GGUFWriter(None, gw.ARCH)
    kv = gw.deepseek2_metadata(cfg, layout="all", qtype=gguf.GGMLQuantizationType[qtype], name="sparse")
    kv += gw.tokenizer_metadata(cfg["vocab_size"], None, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    for key, val, vtype in kv:
        writer.add_array(key, val) if vtype == gguf.GGUFValueType.ARRAY else writer.add_key_value(key, val, vtype)
    offset = 0
    for t in plans:
        be, bb = gguf.GGML_QUANT_SIZES[t.qtype]
        writer.add_tensor_info(t.name, (*t.shape[:-1], t.shape[-1] // be * bb), np.dtype(np.uint8), t.nbytes,
                               raw_dtype=t.qtype)
        offset += -(-t.nbytes // 32) * 32
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    fout = writer.fout[0]
    header = -(-fout.tell() // 32) * 32
    writer.close()
    os.truncate(path, header + offset)
    return header + offset


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_multi_gb_file_opens_instantly_without_reading_data(tmp_path):
    path = tmp_path / "v2lite-Q4_0.gguf"
    size = _sparse_model(path)
    assert size > 8 << 30  # the real V2-Lite Q4_0 size
    rss0 = _rss_mib()
    t0 = time.perf_counter()
    gf = GGUFModelFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, source=str(path))
    elapsed = time.perf_counter() - t0
    grown = _rss_mib() - rss0
    assert elapsed < 1.0, f"open took {elapsed:.2f}s"
    assert grown < 64, f"opening grew resident memory by {grown:.0f} MiB"
    assert cfg.n_layer == 27 and cfg.kv_lora_rank == 512 and cfg.n_expert == 64 and cfg.vocab_size == 102400
    assert len(gf.tensors) > 400
    assert sum(t.nbytes for t in gf.tensors.values()) > 8 << 30
    assert len(gf.metadata["tokenizer.ggml.tokens"]) == 102400


def test_split_names():
    assert split_paths("/m/R1-00002-of-00003.gguf") == [f"/m/R1-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert split_paths("/m/plain.gguf") == ["/m/plain.gguf"]


def test_writer_refuses_yarn_mscale_it_cannot_store():
    """A YaRN config whose mscale differs from mscale_all_dim is refused by the writer, naming both:
    GGUF keeps only 0.1 * mscale_all_dim, so the file would compute another model's attention
    (transformers scales cos / sin by their ratio; an outside probe against it measured 0.7 %). Equal
    values, as every released DeepSeek config has, are written; a YaRN config without both is refused
    too (an outside probe: 6 % off transformers, silently)."""
    from ikjax.tools.synthetic import preset_config
    cfg = dict(preset_config("tiny"))
    yarn = dict(type="yarn", factor=4.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=0.707)
    with pytest.raises(ValueError, match=r"mscale 1.0 differs from mscale_all_dim 0.707"):
        gw.deepseek2_metadata({**cfg, "rope_scaling": yarn}, layout="all", qtype="F32")
    # without both keys transformers scales cos / sin by 0.1 ln(factor) + 1, which no GGUF key says
    for drop in ({"mscale": None}, {"mscale_all_dim": None}, {"mscale": None, "mscale_all_dim": None},
                 {"mscale": 0.0, "mscale_all_dim": 0.707}):
        bad = {k: v for k, v in {**yarn, **drop}.items() if v is not None}
        with pytest.raises(ValueError, match=r"YaRN without both mscale and mscale_all_dim"):
            gw.deepseek2_metadata({**cfg, "rope_scaling": bad}, layout="all", qtype="F32")
    kv = dict((k, v) for k, v, _ in gw.deepseek2_metadata({**cfg, "rope_scaling": {**yarn, "mscale": 0.707}},
                                                          layout="all", qtype="F32"))
    assert kv["deepseek2.rope.scaling.yarn_log_multiplier"] == pytest.approx(0.0707)
