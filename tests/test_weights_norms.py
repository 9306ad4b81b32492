"""Norms and biases load through NumPy (ikjax.model.weights._dense_float): the same float32 values the
dequantizer gives, for every dense-float tensor of the shared fixtures (f32 and bf16 files) and
for f16 bytes."""
from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
import pytest

from ikjax.quant.array import QuantArray
from ikjax.quant.types import by_name
from ikjax.gguf_io.tensors import layer_specs, model_specs
from ikjax.model.weights import _dense_float


def test_f16_and_f32_bytes_match_the_dequantizer():
    vals = np.random.default_rng(0).standard_normal(96).astype(np.float32)
    for name, raw in (("F32", vals.view(np.uint8)), ("F16", vals.astype(np.float16).view(np.uint8))):
        info = types.SimpleNamespace(qtype=by_name(name), shape=(96,))
        got = _dense_float(raw, info)
        want = np.asarray(QuantArray.from_bytes(raw, info.qtype, info.shape).dequantize(jnp.float32))
        assert got.dtype == np.float32 and got.shape == (96,)
        np.testing.assert_array_equal(got, want)
    # unaligned f32 bytes (a 32-byte GGUF alignment need not suit NumPy's view): still exact
    buf = np.zeros(4 * 96 + 1, np.uint8)
    buf[1:] = vals.view(np.uint8)
    np.testing.assert_array_equal(_dense_float(buf[1:], types.SimpleNamespace(qtype=by_name("F32"), shape=(96,))),
                                  vals)


@pytest.mark.parametrize("name", ["v3dense-all-Q8_0.gguf", "v3dense-all-BF16.gguf", "v2lite_tiny-kvb-Q5_1.gguf"])
def test_fixture_norms_match_the_dequantizer(name):
    from conftest import fixtures_dir
    from ikjax.gguf_io.config import ModelConfig
    from ikjax.gguf_io.reader import GGUFModelFile
    path = fixtures_dir() / name
    if not path.exists():
        pytest.skip(f"fixture {path} not present")
    gf = GGUFModelFile(str(path))
    cfg = ModelConfig.from_metadata(gf.metadata, source=str(path))
    specs = [s for s in model_specs(cfg) + [s for i in range(cfg.n_layer) for s in layer_specs(cfg, i)]
             if s.dense_float and s.gguf_name in gf.tensors]
    assert specs
    for s in specs:
        info, raw = gf.tensors[s.gguf_name], gf.tensor_bytes(s.gguf_name)
        want = np.asarray(QuantArray.from_bytes(raw, info.qtype, info.shape).dequantize(jnp.float32))
        np.testing.assert_array_equal(_dense_float(raw, info), want, err_msg=s.gguf_name)
