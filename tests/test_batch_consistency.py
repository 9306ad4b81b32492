"""A batch computes each sequence as the same sequence alone (issue 21): `generate_batch` at
temperature 0 gives every prompt exactly the tokens `generate` gives it, at the default dtype (bf16
products on the CPU kernels: 8-bit activation blocks for decode-sized products), with prompts of
equal and unequal lengths. Before, 1-2 rows in 3-4 diverged after a few tokens: a batch's decode
step of 4 rows took the kernels' prompt form (bf16 panels) where one row takes the decode form
(ikjax.ops.registry.decode_groups), and prompts fed together changed each other's row counts."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import ikjax
from ikjax.ops import registry
from conftest import fixtures_dir
from test_cpu_quant_matmul import _weights
from pallas_kernels.quant_matmul import cpu as qm_cpu

DTYPE = "bf16"  # what dtype="auto" means on the CPU kernels (conftest pins IKJAX_DTYPE=f32 for the suite)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q6_K"])
def test_kernel_decode_form_is_row_count_independent(name):
    """What decode_groups relies on: a call of up to CPU_DECODE_MAX_ROWS rows gives each row the
    bits it gets alone; at one row more the kernel takes its other form (so a batch must not)."""
    rng = np.random.default_rng(1)
    w = _weights(name, 64, 512, rng)
    x = jnp.asarray(rng.standard_normal((registry.CPU_DECODE_MAX_ROWS + 1, 512)).astype(np.float32))
    alone = np.stack([np.asarray(qm_cpu.quant_matmul(x[m:m + 1], w, compute="bf16"))[0] for m in range(x.shape[0])])
    n = registry.CPU_DECODE_MAX_ROWS
    np.testing.assert_array_equal(np.asarray(qm_cpu.quant_matmul(x[:n], w, compute="bf16")), alone[:n])
    assert (np.asarray(qm_cpu.quant_matmul(x, w, compute="bf16")) != alone).any()


@pytest.mark.parametrize("form", ["float", "F32 bytes", "layer of a stack"])
def test_cpu_router_decode_rows_equal_alone(form):
    """The MoE router's f32 logits in a CPU decode step go through the C++ kernels' decode form
    (the layer of a stacked F32 router read in place): each of 5 tokens gets the bits it gets
    alone (decode_groups: rows 0-2, 3-4), every form of the router the same bits, within f32
    rounding of the f64 product."""
    from ikjax import ops
    from ikjax.quant import by_name
    from ikjax.quant.array import LayerSlice, QuantArray
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((5, 256)).astype(np.float32))
    stack = rng.standard_normal((3, 32, 256)).astype(np.float32)
    f32 = by_name("F32")
    router = {"float": jnp.asarray(stack[1]),
              "F32 bytes": QuantArray(jnp.asarray(stack[1].view(np.uint8).reshape(32, 1024)), f32, (32, 256)),
              "layer of a stack": LayerSlice(QuantArray(jnp.asarray(stack.view(np.uint8).reshape(3, 32, 1024)), f32,
                                                        (32, 256)), jnp.int32(1))}[form]
    with registry.kernel_context("cpu", 2, seq_tokens=1):
        y = np.asarray(ops.router_logits(x, router))
        assert registry.selected("router_logits") == "cpu"
        alone = np.concatenate([np.asarray(ops.router_logits(x[i:i + 1], router)) for i in range(5)])
        plain = np.asarray(ops.router_logits(x, jnp.asarray(stack[1])))
    np.testing.assert_array_equal(y, alone)
    np.testing.assert_array_equal(y, plain)
    ref = np.asarray(x, np.float64) @ stack[1].astype(np.float64).T
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()


def test_cpu_router_prompt_reads_the_loaded_router_in_place():
    """A prompt step's router under the C++ kernels: a loaded router (an F32 QuantArray, or its
    layer of a stack) goes through the C++ product, a float one built by hand through XLA's dot;
    both within f32 rounding of the f64 product."""
    from ikjax import ops
    from ikjax.quant import by_name
    from ikjax.quant.array import LayerSlice, QuantArray
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((40, 256)).astype(np.float32))
    stack = rng.standard_normal((3, 32, 256)).astype(np.float32)
    layer = LayerSlice(QuantArray(jnp.asarray(stack.view(np.uint8).reshape(3, 32, 1024)), by_name("F32"), (32, 256)),
                       jnp.int32(2))
    ref = np.asarray(x, np.float64) @ stack[2].astype(np.float64).T
    with registry.kernel_context("cpu", 2, seq_tokens=40):
        y = np.asarray(ops.router_logits(x, layer))
        assert registry.selected("router_logits") == "cpu"
        y_float = np.asarray(ops.router_logits(x, jnp.asarray(stack[2])))
        assert registry.selected("router_logits") == "xla"
    for got in (y, y_float):
        assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()


def test_cpu_loads_the_f32_router_as_bytes(tiny4_model, monkeypatch):
    """Under the C++ kernels the F32 router loads as an F32 QuantArray (stacked in a scanned group,
    read in place by the decode step); under the Pallas path (interpret) as a float32 array."""
    from ikjax.model.groups import layer_tensors
    from ikjax.quant.array import QuantArray
    eng = ikjax.load(tiny4_model, ctx=256)
    router = layer_tensors(eng.weights, -1)["gate_inp"]
    assert isinstance(router, QuantArray) and router.qtype.name == "F32"
    moe_group = eng.weights["groups"][-1]
    assert moe_group.stacked and moe_group.tensors["gate_inp"].data.shape[0] == moe_group.count
    monkeypatch.setenv("IKJAX_KERNELS", "interpret")
    eng2 = ikjax.load(tiny4_model, ctx=256)
    assert not isinstance(layer_tensors(eng2.weights, -1)["gate_inp"], QuantArray)


def test_decode_groups_rule():
    assert registry.decode_groups(8) is None  # outside a model step: one call
    with registry.kernel_context(seq_tokens=1):
        assert registry.decode_groups(3) is None
        assert registry.decode_groups(8) == [(0, 3), (3, 6), (6, 8)]
    with registry.kernel_context(seq_tokens=16):
        assert registry.decode_groups(64) is None


def _prompts(V: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(1, V, n)] for n in lengths]


def _check(path: str, sets: list[tuple[int, list[int]]], n_new: int = 10):
    """Each (seed, prompt lengths): the batch's tokens equal each prompt's alone."""
    eng = ikjax.load(path, ctx=256, ubatch=64, dtype=DTYPE)
    V = eng.config.vocab_size
    for seed, lengths in sets:
        prompts = _prompts(V, lengths, seed)
        batch = eng.generate_batch(prompts, n_new)
        for i, p in enumerate(prompts):
            assert batch[i] == list(eng.generate(p, n_new)), (lengths, i)


def test_generate_batch_equals_generate(tiny_model):
    # equal lengths (a decode step of 4 rows; with these prompts row 1 diverged after 6 tokens
    # when the 4-row step took the prompt form), then unequal ones with a 2-token prompt (alone,
    # a decode-sized prompt step; fed together with the others, row 0 diverged after 7 tokens)
    _check(tiny_model, [(2, [9, 9, 9, 9]), (3, [2, 9, 5, 17])])


def test_generate_batch_equals_generate_moe(tiny4_model):
    """Layers 1-3 MoE: no expert picked by 4 or more of a decode step's tokens changes form."""
    _check(tiny4_model, [(0, [9, 9, 9, 9])])


@pytest.mark.slow
def test_generate_batch_equals_generate_fixture():
    _check(str(fixtures_dir() / "v3dense-all-Q8_0.gguf"), [(0, [9, 9, 9, 9]), (1, [2, 9, 5, 17])])


def test_long_sequence_in_a_big_batch_equals_alone(tiny4_model):
    """8 rows (decode steps of 8 tokens: the C++ MLA kernel splits each sequence's keys over the
    threads by that sequence's own length, never the batch's): a 300-token prompt's greedy tokens in
    the batch equal its tokens alone."""
    eng = ikjax.load(tiny4_model, ctx=512, ubatch=64, dtype=DTYPE)
    long = _prompts(eng.config.vocab_size, [300], 3)[0]
    alone = list(eng.generate(long, 32))
    batch = eng.generate_batch([long] + [[5, 6, 7]] * 7, 32)
    assert batch[0] == alone


def test_k_quant_rows_in_a_batch_equal_alone(tmp_path):
    """The same property on a Q4_K file (the type most users run): its int8 decode at every level
    (decode_kqa at avx2) computes a row in a batch of 2-3 as it computes it alone."""
    from ikjax.tools.synthetic import make_model
    path = tmp_path / "tiny4-Q4_K.gguf"
    make_model(path, "tiny", "Q4_K", layers=4)
    eng = ikjax.load(str(path), ctx=512, ubatch=64, dtype=DTYPE)
    long = _prompts(eng.config.vocab_size, [300], 3)[0]
    alone = list(eng.generate(long, 24))
    assert eng.generate_batch([long] + [[5, 6, 7]] * 7, 24)[0] == alone
