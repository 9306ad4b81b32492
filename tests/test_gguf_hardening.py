"""A damaged GGUF never opens as a different model: each way a header can lie is refused with one
line naming the file and the problem (issue 8). Files are the tiny synthetic model, taken apart and
rebuilt with one field changed (tests/gguf_craft.py), so nothing here needs ../shared."""
from __future__ import annotations

import math
import os
import signal
import struct
import time

import numpy as np
import pytest

import gguf_craft as gc
import ikjax
from ikjax.gguf_io.config import ModelConfig
from ikjax.gguf_io.reader import GGUFModelFile
from ikjax.quant.types import UnsupportedQuantType
from ikjax.tokenizer import GGUFTokenizer

A = "deepseek2"


def _one_line(exc: BaseException, path) -> str:
    msg = str(exc)
    assert msg and "\n" not in msg, f"error message should be one line: {msg!r}"
    assert str(path) in msg, f"error should name the file: {msg!r}"
    return msg


def _variant(tmp_path, src: str, edit, name: str = "bad.gguf") -> str:
    """A copy of `src` with `edit(g)` applied to its parsed form; `edit` may return raw bytes instead."""
    g = gc.parse(open(src, "rb").read())
    raw = edit(g)
    p = tmp_path / name
    p.write_bytes(raw if raw is not None else gc.build(g))
    return str(p)


def _refused(path, needle: str, *, load: bool = False, named=None) -> str:
    with pytest.raises(ikjax.ModelFileError) as e:
        ikjax.load(path, ctx=64) if load else GGUFModelFile(path)
    msg = _one_line(e.value, named or path)
    assert needle in msg, msg
    return msg


def test_unchanged_rebuild_opens(tiny_model, tmp_path):
    """The craft helper round-trips: the same bytes open, so every refusal below is the edit's doing."""
    p = _variant(tmp_path, tiny_model, lambda g: None)
    assert open(p, "rb").read() == open(tiny_model, "rb").read()
    assert GGUFModelFile(p).tensors.keys() == GGUFModelFile(tiny_model).tensors.keys()


# --- alignment ---------------------------------------------------------------------------------

@pytest.mark.parametrize("value,needle", [
    (gc.u32(0), "general.alignment 0 is not a positive power of two"),
    (gc.u32(48), "general.alignment 48 is not a positive power of two"),
    (gc.i32(-32), "general.alignment -32 is not a positive power of two"),
    (gc.string("32"), "general.alignment: expected an integer, got string"),
    (gc.f32(32.0), "general.alignment: expected an integer, got float32"),
])
def test_alignment(tiny_model, tmp_path, value, needle):
    p = _variant(tmp_path, tiny_model, lambda g: gc.set_kv(g, "general.alignment", value))
    _refused(p, needle, load=True)


# --- counts and lengths checked against the bytes left, before anything is allocated -------------

def _array_count_at(g: gc.Gguf, key: str, count: int) -> None:
    kv = g.kv(key)
    kv.payload = kv.payload[:4] + struct.pack("<Q", count) + kv.payload[12:]


@pytest.mark.parametrize("edit,needle", [
    (lambda g: _array_count_at(g, "tokenizer.ggml.tokens", 1 << 34), "tokenizer.ggml.tokens: array of string count 17179869184"),
    (lambda g: _array_count_at(g, "tokenizer.ggml.token_type", 1 << 61), "array of int32 count"),
    (lambda g: _array_count_at(g, "tokenizer.ggml.merges", (1 << 64) - 1), "array of string count"),
    (lambda g: gc.build(g, n_kv=1 << 60), "metadata count 1152921504606846976"),
    (lambda g: gc.build(g, n_tensors=1 << 40), "tensor count 1099511627776"),
    (lambda g: gc.build(g, n_tensors=len(g.tensors) + 1), "empty tensor name"),  # reads the padding
    (lambda g: setattr(g.kvs[3], "payload", struct.pack("<Q", 1 << 62) + g.kvs[3].payload[8:]), "runs past the end"),
    (lambda g: g.kvs.insert(0, gc.KV("x.nested", gc.ARRAY, struct.pack("<IQ", gc.ARRAY, 1 << 50))),
     "x.nested: array of array count"),
    (lambda g: g.kvs.insert(0, gc.KV("x.bad_item", gc.ARRAY, struct.pack("<IQ", 77, 0))), "unknown GGUF array item type 77"),
    (lambda g: g.kvs.insert(0, gc.KV("x.bad_type", 13, b"")), "unknown GGUF metadata value type 13"),
])
def test_counts_fail_before_allocating(tiny_model, tmp_path, edit, needle):
    p = _variant(tmp_path, tiny_model, edit)
    t0 = time.perf_counter()
    _refused(p, needle)
    assert time.perf_counter() - t0 < 1.0


def test_huge_key_length(tiny_model, tmp_path):
    def edit(g):
        raw = bytearray(gc.build(g))
        struct.pack_into("<Q", raw, 24, 1 << 63)  # length of the first key
        return bytes(raw)
    _refused(_variant(tmp_path, tiny_model, edit), "metadata key of 9223372036854775808 bytes at byte 24 runs past")


@pytest.mark.parametrize("ne,needle", [
    ([256, 0], "impossible dimensions [256, 0]"),
    ([256, 1 << 62, 4], "impossible dimensions"),
    ([256, 1, 1, 1, 1], "has 5 dimensions"),
    ([256, (1 << 64) - 1], "impossible dimensions"),
])
def test_tensor_dimensions(tiny_model, tmp_path, ne, needle):
    p = _variant(tmp_path, tiny_model, lambda g: setattr(g.tensor("blk.0.attn_output.weight"), "ne", ne))
    _refused(p, needle)


def test_zero_dims(tiny_model, tmp_path):
    p = _variant(tmp_path, tiny_model, lambda g: setattr(g.tensor("blk.0.attn_norm.weight"), "ne", []))
    _refused(p, "has 0 dimensions")


# --- tensor offsets: aligned, inside the file, packed, not overlapping ---------------------------

def test_misaligned_offset(tiny_model, tmp_path):
    p = _variant(tmp_path, tiny_model, lambda g: setattr(g.tensors[5], "rel", g.tensors[5].rel + 4))
    _refused(p, f"tensor {gc.parse(open(p, 'rb').read()).tensors[5].name} data offset", load=True)
    align = gc.parse(open(tiny_model, "rb").read()).alignment  # make-model writes 64
    assert f"is not a multiple of the alignment {align}" in _refused(p, "data offset")


def test_overlapping_tensors(tiny_model, tmp_path):
    def edit(g):
        g.tensors[7].rel = g.tensors[6].rel
    p = _variant(tmp_path, tiny_model, edit)
    g = gc.parse(open(p, "rb").read())
    _refused(p, f"tensors {g.tensors[6].name}", load=True)
    assert "overlap" in _refused(p, g.tensors[7].name)


def test_overlap_by_a_grown_shape_is_named_as_a_shape(tiny_model, tmp_path):
    """A tensor table ne made larger: the model's own shape check names the tensor and both shapes."""
    name = "blk.0.attn_q.weight"
    p = _variant(tmp_path, tiny_model, lambda g: g.tensor(name).ne.__setitem__(1, g.tensor(name).ne[1] + 32))
    _refused(p, f"tensor {name} has shape")


def test_gap_from_a_shrunk_type(tiny_model, tmp_path):
    """An F32 norm retyped F16 (half the bytes, still a valid shape): the data it leaves behind is a
    gap the packed layout does not allow, so it is not read as a different (F16) weight."""
    name = "blk.0.attn_norm.weight"
    p = _variant(tmp_path, tiny_model, lambda g: setattr(g.tensor(name), "type_id", 1))
    assert gc.parse(open(tiny_model, "rb").read()).tensor(name).type_id == 0
    msg = _refused(p, "the tensor table is damaged", load=True)
    assert f"after tensor {name}" in msg


def test_offset_past_end(tiny_model, tmp_path):
    p = _variant(tmp_path, tiny_model, lambda g: setattr(g.tensors[-1], "rel", g.tensors[-1].rel + (1 << 40)))
    _refused(p, "truncated: tensor")


def test_first_tensor_not_at_data_start(tiny_model, tmp_path):
    def edit(g):  # one alignment unit of padding before the first tensor
        for t in g.tensors:
            t.rel += g.alignment
        g.data = bytes(g.alignment) + g.data
    _refused(_variant(tmp_path, tiny_model, edit), "at the start of the data section")


def test_truncated_data(tiny_model, tmp_path):
    p = _variant(tmp_path, tiny_model, lambda g: gc.build(g)[:-5000])
    _refused(p, "truncated: tensor output.weight", load=True)


# --- duplicates ----------------------------------------------------------------------------------

def test_duplicate_tensor_name(tiny_model, tmp_path):
    def edit(g):
        # same-size tensors, so only the name is wrong: blk.0's attn_norm is renamed to blk.0 ffn_norm's
        g.tensor("blk.0.attn_norm.weight").name = "blk.0.ffn_norm.weight"
    _refused(_variant(tmp_path, tiny_model, edit), "tensor blk.0.ffn_norm.weight appears twice", load=True)


def test_duplicate_metadata_key(tiny_model, tmp_path):
    p = _variant(tmp_path, tiny_model, lambda g: g.kvs.append(gc.KV(f"{A}.block_count", *gc.u32(3))))
    _refused(p, f"metadata key {A}.block_count appears twice", load=True)


def test_key_not_utf8(tiny_model, tmp_path):
    p = _variant(tmp_path, tiny_model, lambda g: setattr(g.kvs[2], "key", b"general.na\xffme"))
    _refused(p, "metadata key at byte")


def test_bool_not_0_or_1(tiny_model, tmp_path):
    p = _variant(tmp_path, tiny_model, lambda g: setattr(g.kv(f"{A}.expert_weights_norm"), "payload", b"\x02"))
    _refused(p, f"metadata {A}.expert_weights_norm: bool byte 2")


def test_empty_and_long_tensor_names(tiny_model, tmp_path):
    p = _variant(tmp_path, tiny_model, lambda g: setattr(g.tensors[3], "name", ""))
    _refused(p, "empty tensor name")
    p = _variant(tmp_path, tiny_model, lambda g: setattr(g.tensors[3], "name", "x" * 64), "long.gguf")
    _refused(p, "longer than ggml's 63 bytes")


# --- non-regular files are refused before they are opened --------------------------------------

def _no_hang(seconds: int):
    def on_alarm(*_):
        raise TimeoutError("hung")
    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)


def test_fifo_refused_not_read(tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    _no_hang(10)
    try:
        for opener in (GGUFModelFile, lambda p: ikjax.load(p, ctx=64)):
            with pytest.raises(ikjax.ModelFileError, match="not a regular file \\(a FIFO\\)") as e:
                opener(str(fifo))
            _one_line(e.value, fifo)
    finally:
        signal.alarm(0)


def test_directory_and_device_refused(tmp_path):
    d = tmp_path / "dir.gguf"
    d.mkdir()
    with pytest.raises(ikjax.ModelFileError, match="a directory"):
        GGUFModelFile(d)
    if os.path.exists("/dev/null"):
        with pytest.raises(ikjax.ModelFileError, match="a device"):
            ikjax.load("/dev/null")


def test_split_shard_that_is_a_fifo(tmp_path, tiny_model):
    first = tmp_path / "m-00001-of-00002.gguf"
    first.write_bytes(open(tiny_model, "rb").read())
    os.mkfifo(tmp_path / "m-00002-of-00002.gguf")
    _no_hang(10)
    try:
        with pytest.raises(ikjax.ModelFileError, match="m-00002-of-00002.gguf: not a regular file"):
            GGUFModelFile(first)
    finally:
        signal.alarm(0)


# --- metadata types and values -------------------------------------------------------------------

@pytest.mark.parametrize("key,value,needle", [
    ("block_count", gc.string("3"), f"{A}.block_count: expected an integer, got string"),
    ("block_count", gc.i32(-1), f"{A}.block_count is -1, must be at least 1"),
    ("block_count", gc.u32(0), f"{A}.block_count is 0, must be at least 1"),
    ("block_count", gc.f32(2.0), f"{A}.block_count: expected an integer, got float"),
    ("attention.layer_norm_rms_epsilon", gc.f32(math.nan), "layer_norm_rms_epsilon is nan, must be a finite positive"),
    ("attention.layer_norm_rms_epsilon", gc.f32(0.0), "layer_norm_rms_epsilon is 0.0, must be a finite positive"),
    ("attention.layer_norm_rms_epsilon", gc.u32(1), "layer_norm_rms_epsilon: expected a float, got integer"),
    ("rope.freq_base", gc.f32(math.inf), "rope.freq_base is inf"),
    ("rope.freq_base", gc.f32(-10000.0), "rope.freq_base is -10000.0"),
    ("expert_weights_scale", gc.f32(-1.0), "expert_weights_scale is -1.0"),
    ("expert_weights_scale", gc.f32(math.nan), "expert_weights_scale is nan"),
    ("expert_weights_scale", (12, struct.pack("<d", 1e300)), "expert_weights_scale is 1e+300, must be a finite positive "
     "number (in float32's range)"),  # (a float64: finite, then inf in the step)
    ("expert_weights_norm", gc.u32(1), "expert_weights_norm: expected a bool, got integer"),
    ("attention.head_count", gc.u32(0), "attention.head_count is 0, must be at least 1"),
    ("attention.kv_lora_rank", gc.i32(-128), "kv_lora_rank is -128"),
    ("attention.key_length", gc.string("96"), "key_length: expected an integer, got string"),
    ("embedding_length", gc.u32(0), "embedding_length is 0"),
    ("expert_used_count", gc.u32(0), "expert_used_count 0 of 16 experts"),
    ("expert_used_count", gc.u32(17), "expert_used_count 17 of 16 experts"),
    ("expert_count", gc.i32(-16), "expert_count is -16"),
    ("expert_group_count", gc.u32(3), "16 experts do not split into 3 groups"),
    ("expert_gating_func", gc.u32(7), "unknown expert_gating_func 7"),
    ("context_length", gc.u32(0), "context_length is 0"),
    ("rope.scaling.type", gc.string("linear"), "rope.scaling.type 'linear' is not supported"),
    ("rope.scaling.type", gc.u32(1), "rope.scaling.type: expected a string, got integer"),
    ("rope.scaling.factor", gc.f32(4.0), "rope.scaling.factor is set but"),
    ("nextn_predict_layers", gc.u32(2), "nextn_predict_layers 2 leaves no layers"),
    ("vocab_size", gc.u32(1000), "tokenizer.ggml.tokens has 1024 tokens but deepseek2.vocab_size is 1000"),
])
def test_metadata_checked(tiny_model, tmp_path, key, value, needle):
    p = _variant(tmp_path, tiny_model, lambda g: gc.set_kv(g, f"{A}.{key}", value))
    _refused(p, needle, load=True)


def test_yarn_values(tiny_model, tmp_path):
    def edit(factor):
        def e(g):
            gc.set_kv(g, f"{A}.rope.scaling.type", gc.string("yarn"))
            gc.set_kv(g, f"{A}.rope.scaling.factor", gc.f32(factor))
            gc.set_kv(g, f"{A}.rope.scaling.original_context_length", gc.u32(4096))
        return e
    _refused(_variant(tmp_path, tiny_model, edit(0.0)), "rope.scaling.factor is 0.0, must be a finite positive")
    _refused(_variant(tmp_path, tiny_model, edit(math.nan), "nan.gguf"), "rope.scaling.factor is nan")
    ok = GGUFModelFile(_variant(tmp_path, tiny_model, edit(40.0), "ok.gguf"))
    assert ModelConfig.from_metadata(ok.metadata).yarn.factor == 40.0


def test_missing_required_key(tiny_model, tmp_path):
    p = _variant(tmp_path, tiny_model, lambda g: g.kvs.remove(g.kv(f"{A}.expert_weights_scale")))
    _refused(p, f"missing metadata key {A}.expert_weights_scale")


# --- block_count against the blk.N tensors -------------------------------------------------------

def test_block_count_smaller_than_layers(tiny_model, tmp_path):
    p = _variant(tmp_path, tiny_model, lambda g: gc.set_kv(g, f"{A}.block_count", gc.u32(1)))
    _refused(p, f"{A}.block_count is 1 but the file has tensors of layer 1 (blk.1.", load=True)


def test_block_count_larger_than_layers(tiny_model, tmp_path):
    p = _variant(tmp_path, tiny_model, lambda g: gc.set_kv(g, f"{A}.block_count", gc.u32(3)))
    _refused(p, f"{A}.block_count is 3 but the file has no tensors of layer 2", load=True)


def test_mtp_layer_declared_absent_is_fine(tiny_model, tmp_path):
    """nextn_predict_layers = 1 with block_count 3 and layers 0..1 in the file: the MTP layer (2) was
    not exported. That is the model of the original file: same config, same logits."""
    def edit(g):
        gc.set_kv(g, f"{A}.block_count", gc.u32(3))
        gc.set_kv(g, f"{A}.nextn_predict_layers", gc.u32(1))
    p = _variant(tmp_path, tiny_model, edit)
    cfg = ModelConfig.from_metadata(GGUFModelFile(p).metadata)
    assert (cfg.n_layer, cfg.n_nextn) == (2, 1)
    ids = [0, 5, 17, 300]
    a = ikjax.load(tiny_model, ctx=64).logits(ids)
    b = ikjax.load(p, ctx=64).logits(ids)
    np.testing.assert_array_equal(a, b)


def test_mtp_layer_present_is_not_run(tiny_model, tmp_path):
    """block_count 2 with nextn 1: layer 1 is the MTP layer, present in the file, not part of the
    main stack (ikjax does not run MTP)."""
    p = _variant(tmp_path, tiny_model, lambda g: gc.set_kv(g, f"{A}.nextn_predict_layers", gc.u32(1)))
    gf = GGUFModelFile(p)
    cfg = ModelConfig.from_metadata(gf.metadata)
    assert (cfg.n_layer, cfg.n_nextn) == (1, 1)


def test_layer_tensor_beyond_mtp_range(tiny_model, tmp_path):
    def edit(g):
        g.tensor("blk.1.attn_norm.weight").name = "blk.7.attn_norm.weight"
    _refused(_variant(tmp_path, tiny_model, edit), "has tensors of layer 7 (blk.7.attn_norm.weight)")


def test_unexpected_tensors(tiny_model, tmp_path):
    """A renamed `output` is a missing one (it once tied silently to the embedding); undeclared
    shared experts would be skipped: tensors the model would not read are refused by name."""
    p = _variant(tmp_path, tiny_model, lambda g: setattr(g.tensor("output.weight"), "name", "outpvt.weight"))
    _refused(p, "missing tensor output.weight", load=True)
    p = _variant(tmp_path, tiny_model, lambda g: gc.set_kv(g, f"{A}.expert_shared_count", gc.u32(0)), "shexp.gguf")
    _refused(p, "unexpected tensor blk.1.ffn_gate_shexp.weight")


def test_missing_tensor_named(tiny_model, tmp_path):
    p = _variant(tmp_path, tiny_model, lambda g: setattr(g.tensor("blk.1.ffn_norm.weight"), "name", "blk.1.ffn_nrrm.weight"))
    _refused(p, "missing tensor blk.1.ffn_norm.weight", load=True)
    # the output head too: it loaded quietly and the logits came from token_embd, another model
    # (a probe: 1.41 relative error); ik requires it for deepseek2
    p = _variant(tmp_path, tiny_model, lambda g: g.tensors.remove(g.tensor("output.weight")), "no_output.gguf")
    _refused(p, "missing tensor output.weight", load=True)
    # `ikjax info` refuses it too; a tensor type ikjax cannot dequantize: the header's report, then
    # the load's refusal as its last line and status 1 (a clean report before)
    from typer.testing import CliRunner
    from ikjax.cli import app
    res = CliRunner().invoke(app, ["info", "-m", p])
    assert res.exit_code == 1 and "missing tensor output.weight" in res.stderr
    p = _variant(tmp_path, tiny_model, lambda g: setattr(g.tensor("blk.0.attn_output.weight"), "type_id", 200),
                 "type200.gguf")
    res = CliRunner().invoke(app, ["info", "-m", p])
    assert res.exit_code == 1 and "memory plan" in res.stdout, res.stderr + res.stdout
    assert "blk.0.attn_output.weight" in res.stderr and "cannot dequantize" in res.stderr


# --- tokenizer ids -------------------------------------------------------------------------------

@pytest.mark.parametrize("key,value,needle", [
    ("tokenizer.ggml.bos_token_id", gc.u32(5000), "tokenizer.ggml.bos_token_id 5000 is outside the vocabulary of 1024"),
    ("tokenizer.ggml.eos_token_id", gc.i32(-1), "tokenizer.ggml.eos_token_id -1 is outside the vocabulary"),
    ("tokenizer.ggml.padding_token_id", gc.u32(1024), "tokenizer.ggml.padding_token_id 1024 is outside"),
    ("tokenizer.ggml.bos_token_id", gc.string("0"), "tokenizer.ggml.bos_token_id: expected an integer, got string"),
])
def test_special_token_ids(tiny_model, tmp_path, key, value, needle):
    p = _variant(tmp_path, tiny_model, lambda g: gc.set_kv(g, key, value))
    _refused(p, needle, load=True)


def test_tokenizer_checks_ids_itself(tiny_model):
    md = dict(GGUFModelFile(tiny_model).metadata)
    md["tokenizer.ggml.eos_token_id"] = 4096
    with pytest.raises(ikjax.ModelFileError, match="tokenizer.ggml.eos_token_id 4096 is outside the vocabulary"):
        GGUFTokenizer(md, source="m.gguf")
    del md["tokenizer.ggml.tokens"]
    with pytest.raises(ikjax.ModelFileError, match="tokenizer.ggml.tokens missing"):
        GGUFTokenizer(md, source="m.gguf")


def test_token_type_length(tiny_model, tmp_path):
    def edit(g):
        kv = g.kv("tokenizer.ggml.token_type")
        kv.payload = struct.pack("<IQ", 5, 3) + struct.pack("<3i", 1, 1, 1)
    _refused(_variant(tmp_path, tiny_model, edit), "tokenizer.ggml.token_type has 3 entries for 1024 tokens")


# --- error classes and speed ---------------------------------------------------------------------

def test_unsupported_quant_type_is_an_ikjax_error():
    assert issubclass(UnsupportedQuantType, ikjax.ModelFileError)
    assert issubclass(UnsupportedQuantType, ikjax.IkjaxError)


def test_valid_file_still_opens_fast(tmp_path):
    """All these checks keep a 129k-vocabulary V3 header (1147 tensors) opening in well under a second."""
    from test_reader import _sparse_model
    p = tmp_path / "v3.gguf"
    _sparse_model(p, preset="v3", qtype="Q4_0")
    best = min(_timed_open(p) for _ in range(3))
    assert best < 0.5, f"open took {best:.2f}s"


def _timed_open(p) -> float:
    t0 = time.perf_counter()
    gf = GGUFModelFile(p)
    assert len(gf.metadata["tokenizer.ggml.tokens"]) == 129280
    return time.perf_counter() - t0


# --- damaged key names ---------------------------------------------------------------------------

@pytest.mark.parametrize("key,damaged", [
    (f"{A}.expert_gating_func", f"{A}.expert_gating_fuoc"),  # V3 would fall back to softmax
    (f"{A}.expert_weights_norm", f"{A}.expert_weights_nurm"),
    (f"{A}.rope.freq_base", f"{A}.rope.freq_bAse"),
    ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.bos_token_iD"),  # BOS silently dropped
    (f"{A}.block_count", f"{A.replace('2', '3')}.block_count"),
])
def test_damaged_key_name_is_not_a_missing_key(tiny_model, tmp_path, key, damaged):
    p = _variant(tmp_path, tiny_model, lambda g: setattr(g.kv(key), "key", damaged))
    _refused(p, f"metadata key {damaged!r} is unknown and", load=True)


def test_unknown_but_distinct_key_is_fine(tiny_model, tmp_path):
    """Keys ikjax does not read, far from any it does, are left alone (writers add their own)."""
    p = _variant(tmp_path, tiny_model, lambda g: g.kvs.append(gc.KV("quantize.imatrix.file", *gc.string("x.dat"))))
    assert "quantize.imatrix.file" in GGUFModelFile(p).metadata


def test_other_writers_cls_id_beside_no_bos_id_is_fine(tiny_model, tmp_path):
    """ik_llama.cpp's converter writes tokenizer.ggml.cls_token_id where the tokenizer has one (this gguf
    package no longer names it); 2 characters from bos_token_id, it was refused as damaged in a file
    without a BOS id (an outside review, stop 68)."""
    def edit(g):
        g.kvs[:] = [kv for kv in g.kvs if kv.key != "tokenizer.ggml.bos_token_id"]
        g.kvs.append(gc.KV("tokenizer.ggml.cls_token_id", *gc.u32(3)))
    assert GGUFModelFile(_variant(tmp_path, tiny_model, edit)).metadata["tokenizer.ggml.cls_token_id"] == 3


# --- split models --------------------------------------------------------------------------------

def _shards(src: str, tmp_path, n_first: int = 10, edit=None) -> list[str]:
    """The tiny model as two gguf-split shards: metadata + the first `n_first` tensors, then the rest."""
    g = gc.parse(open(src, "rb").read())
    parts = [g.tensors[:n_first], g.tensors[n_first:]]
    paths = [str(tmp_path / f"m-0000{i + 1}-of-00002.gguf") for i in range(2)]
    for i, tensors in enumerate(parts):
        data, entries = bytearray(), []
        ends = sorted(t.rel for t in g.tensors) + [len(g.data)]
        for t in tensors:
            size = ends[ends.index(t.rel) + 1] - t.rel  # each tensor's bytes with its padding
            entries.append(gc.TensorEntry(t.name, list(t.ne), t.type_id, len(data)))
            data += g.data[t.rel:t.rel + size]
        kvs = (list(g.kvs) if i == 0 else [g.kv("general.architecture")]) + [
            gc.KV("split.no", 2, struct.pack("<H", i)),  # gguf-split: uint16, 0-based
            gc.KV("split.count", 2, struct.pack("<H", 2)),
            gc.KV("split.tensors.count", 3, struct.pack("<h", len(g.tensors)))]
        shard = gc.Gguf(g.version, kvs, entries, bytes(data), g.alignment)
        if edit:
            edit(i, shard)
        open(paths[i], "wb").write(gc.build(shard))
    return paths


def test_split_model_opens_as_one(tiny_model, tmp_path):
    paths = _shards(tiny_model, tmp_path)
    gf = GGUFModelFile(paths[1])
    assert len(gf.shards) == 2 and gf.tensors.keys() == GGUFModelFile(tiny_model).tensors.keys()
    ids = [0, 5, 17, 300]
    np.testing.assert_array_equal(ikjax.load(paths[0], ctx=64).logits(ids), ikjax.load(tiny_model, ctx=64).logits(ids))


def test_split_shards_swapped(tiny_model, tmp_path):
    paths = _shards(tiny_model, tmp_path, edit=lambda i, s: gc.set_kv(s, "split.no", (2, struct.pack("<H", 1 - i)))
                    if i == 1 else None)
    _refused(paths[0], "split.no is 0, expected 1 for shard 2 of 2", named=paths[1])


def test_split_tensor_in_two_shards(tiny_model, tmp_path):
    def edit(i, s):
        if i == 1:
            s.tensors[0].name = "token_embd.weight"
    paths = _shards(tiny_model, tmp_path, edit=edit)
    _refused(paths[0], "tensor token_embd.weight appears twice (in")


def test_split_tensor_count(tiny_model, tmp_path):
    paths = _shards(tiny_model, tmp_path, edit=lambda i, s: gc.set_kv(s, "split.tensors.count", (3, struct.pack("<h", 5)))
                    if i == 0 else None)
    _refused(paths[0], "split.tensors.count is 5 but the shards hold 31 tensors")


def test_q_lora_rank_missing_is_read_from_attn_q_a(tmp_path):
    """A file with the low-rank q (attn_q_a / attn_q_b) but no q_lora_rank key: the rank is attn_q_a's
    rows (the file's content says it), the same model as with the key; it was read as a direct q
    and refused as a missing attn_q tensor."""
    from conftest import fixtures_dir
    src = str(fixtures_dir() / "v3dense-all-Q8_0.gguf")  # (skips, with the reason, where they are absent)
    p = _variant(tmp_path, src, lambda g: g.kvs.remove(g.kv(f"{A}.attention.q_lora_rank")))
    tokens = [3, 17, 42, 99]
    want = ikjax.load(src, ctx=64, dtype="f32").logits(tokens)
    eng = ikjax.load(p, ctx=64, dtype="f32")
    assert eng.config.q_lora_rank == ModelConfig.from_metadata(GGUFModelFile(src).metadata).q_lora_rank > 0
    np.testing.assert_array_equal(eng.logits(tokens), want)
    # expert_count likewise, from the routed experts' tensors (it read as "no experts" and was refused)
    p = _variant(tmp_path, src, lambda g: g.kvs.remove(g.kv(f"{A}.expert_count")), "no_expert_count.gguf")
    np.testing.assert_array_equal(ikjax.load(p, ctx=64, dtype="f32").logits(tokens), want)


# --- an outside probe's damaged files (stop 69): each refused in one line, quickly ---------------

def test_huge_block_count_fails_fast(tiny_model, tmp_path):
    """block_count 2^40 listed every missing layer (9 GB and growing after 40 s)."""
    p = _variant(tmp_path, tiny_model, lambda g: gc.set_kv(g, f"{A}.block_count", (10, struct.pack("<Q", 1 << 40))))
    t0 = time.perf_counter()
    _refused(p, f"{A}.block_count is {1 << 40} but the file has no tensors of layer ")
    assert time.perf_counter() - t0 < 5.0


def test_nested_and_oversized_arrays(tiny_model, tmp_path):
    """Arrays of arrays (3000 levels: a RecursionError) are refused, as ggml's reader does; an array
    count the file's bytes could hold but no model needs (2^29 int32 in a 3 GiB file: 4 GB allocated
    before failing) is refused before anything is read."""
    nested = struct.pack("<IQ", gc.ARRAY, 1) * 3000 + struct.pack("<IQ", 4, 0)
    p = _variant(tmp_path, tiny_model, lambda g: g.kvs.insert(0, gc.KV("x.nested", gc.ARRAY, nested)))
    _refused(p, "x.nested: an array of arrays")

    def big(g):
        _array_count_at(g, "tokenizer.ggml.token_type", 1 << 29)
        raw = gc.build(g)
        return raw
    p = _variant(tmp_path, tiny_model, big, "big.gguf")
    with open(p, "r+b") as f:  # sparse: the count fits the file's bytes
        f.truncate(3 << 30)
    t0 = time.perf_counter()
    _refused(p, f"tokenizer.ggml.token_type: an array of {1 << 29} items")
    assert time.perf_counter() - t0 < 2.0


@pytest.mark.parametrize("key,value,needle", [
    ("rope.scaling.yarn_beta_fast", 0.0, "yarn_beta_fast is 0.0, must be a finite positive"),
    ("rope.scaling.yarn_beta_fast", -1.0, "yarn_beta_fast is -1.0, must be a finite positive"),
    ("rope.scaling.yarn_beta_slow", 0.0, "yarn_beta_slow is 0.0, must be a finite positive"),
    ("rope.freq_base", 1.0, "rope.freq_base is 1.0: YaRN needs a base above 1"),
])
def test_yarn_values_that_divide_by_zero(tiny_model, tmp_path, key, value, needle):
    """(ZeroDivisionError / math domain error at the first step, `ikjax info` silent)"""
    def e(g):
        gc.set_kv(g, f"{A}.rope.scaling.type", gc.string("yarn"))
        gc.set_kv(g, f"{A}.rope.scaling.factor", gc.f32(4.0))
        gc.set_kv(g, f"{A}.rope.scaling.original_context_length", gc.u32(4096))
        gc.set_kv(g, f"{A}.{key}", gc.f32(value))
    _refused(_variant(tmp_path, tiny_model, e), needle)


def test_tokenizer_keys_of_the_wrong_type(tiny_model, tmp_path):
    """token_type as strings (int("x") at the first encode) and add_bos_token as the string "no"
    (read as true: a BOS the file's author did not ask for)."""
    def strings(g):
        n = len(GGUFModelFile(tiny_model).metadata["tokenizer.ggml.tokens"])
        gc.set_kv(g, "tokenizer.ggml.token_type",
                  (gc.ARRAY, struct.pack("<IQ", gc.STRING, n) + b"".join(gc._string("x") for _ in range(n))))
    _refused(_variant(tmp_path, tiny_model, strings), "tokenizer.ggml.token_type: expected an array of integers")
    p = _variant(tmp_path, tiny_model, lambda g: gc.set_kv(g, "tokenizer.ggml.add_bos_token", gc.string("no")), "b.gguf")
    _refused(p, "tokenizer.ggml.add_bos_token: expected a bool, got string")


def test_alignment_that_disagrees_with_the_padding(tiny_model, tmp_path):
    """general.alignment 16 in a file padded to 32: every tensor read 16 bytes early, silently
    (an outside probe: logits off by a relative 1.1): the bytes left past the last tensor give it
    away. A filler key moves the header's end to where the two alignments part."""
    import dataclasses
    for n in range(32):
        g = gc.parse(open(tiny_model, "rb").read())
        gc.set_kv(g, "general.alignment", gc.u32(16))
        gc.set_kv(g, "x.filler", gc.string("f" * n))
        h = len(gc.build(dataclasses.replace(g, data=b"", alignment=1)))  # the header, unpadded
        if -(-h // 16) * 16 != -(-h // 32) * 32:
            break
    else:
        raise AssertionError("no filler length parts the alignments")
    g.alignment = 32  # the padding the data was written with
    raw = gc.build(g)
    p = tmp_path / "a16.gguf"
    p.write_bytes(raw)
    _refused(str(p), "general.alignment (16) or the tensor table is damaged", load=True)


def test_split_name_outside_its_count(tiny_model, tmp_path):
    """-00007-of-00002 opened shards 1 and 2; -00003-of-00002, a whole model file, was passed over."""
    paths = _shards(tiny_model, tmp_path)
    for no in (0, 3, 7):
        name = paths[0].replace("-00001-of-00002", f"-{no:05d}-of-00002")
        _refused(name, f"split file name says shard {no} of 2")
