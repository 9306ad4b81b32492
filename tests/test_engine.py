"""The engine as users drive it: generate (greedy = transformers' greedy), batches of sequences
with their own lengths, no recompilation inside a bucket, and the memory plan's formulas."""
from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

import ikjax
from conftest import fixtures_dir, rel_err
from hf_models import make_model
from ikjax.model.cache import CacheLayout
from ikjax.gguf_io.config import ModelConfig
from ikjax.gguf_io.writer import write_deepseek2_gguf
from ikjax.model.groups import layer_tensors


class CompileCounter:
    """Counts XLA backend compilations (JAX's own monitoring event), not our bookkeeping."""

    def __init__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1


COUNTER = CompileCounter()


@pytest.fixture(scope="module")
def hf_v3(tmp_path_factory):
    model, cfg, sd = make_model("v3", seed=11)
    path = tmp_path_factory.mktemp("gen") / "v3-F32.gguf"
    write_deepseek2_gguf(path, cfg, sd, layout="all", qtype="F32")
    # transformers' greedy continuation, once for the modes below
    prompt = np.random.default_rng(1).integers(2, 500, 40)
    with torch.no_grad():
        hf = model.generate(torch.tensor(prompt[None]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                            pad_token_id=0)
    return prompt, hf[0, len(prompt):].tolist(), str(path)


@pytest.mark.parametrize("mla,fa", [(0, False), (3, True)])
def test_greedy_generate_matches_transformers(hf_v3, mla, fa):
    prompt, want, path = hf_v3
    eng = ikjax.load(path, mla=mla, fa=fa, ctk="f32", ubatch=16)
    got = list(eng.generate(prompt, 20, stop=()))
    # EOS (id 1) would stop us early: transformers was told to ignore it, so compare up to there
    assert got == want[:len(got)] and (len(got) == 20 or got[-1] == 1)


def test_batch_generate_equals_single_sequences():
    eng = ikjax.load(fixtures_dir() / "v3dense-all-BF16.gguf", mla=3, ctk="f32", ubatch=16, ctx=128)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(2, 1000, n) for n in (7, 30, 19)]
    batched = eng.generate_batch(prompts, 6)
    for p, out in zip(prompts, batched):
        assert out == list(eng.generate(p, 6))


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_last_token_step_trims_the_last_layer(dtype):
    """A CPU prompt step that keeps one token's logits runs the last layer's FFN on that token of
    each sequence only (ik's inp_out_ids; deepseek2.trims_last_layer): its logits are the
    all-logits step's rows at `last`, the trimmed FFN's rows in the decode form (f32 1e-5; bf16
    mode, where that form takes 8-bit x and the full step the bf16 / int8 prompt products: 1e-2,
    measured 2.3e-3)."""
    from ikjax.model.deepseek2 import trims_last_layer
    eng = ikjax.load(fixtures_dir() / "v3dense-all-BF16.gguf", mla=3, ctk="f32", ubatch=16, ctx=128, dtype=dtype)
    if eng.backend != "cpu":
        pytest.skip("the trim is the C++ CPU kernels' steps'")
    toks = np.random.default_rng(7).integers(2, 1000, (2, 16)).astype(np.int32)
    start, last = np.zeros(2, np.int32), np.array([15, 9], np.int32)
    assert trims_last_layer(eng._plan(eng.kv_bucket(16, 16), False, 16), 16)
    assert not trims_last_layer(eng._plan(eng.kv_bucket(16, 16), True, 16), 16)
    one, _ = eng.step(eng.new_cache(2), toks, start, last)
    every, _ = eng.step(eng.new_cache(2), toks, start, last, all_logits=True)
    want = np.asarray(every)[np.arange(2), last]
    assert rel_err(one, want) < (1e-5 if dtype == "f32" else 1e-2), rel_err(one, want)


def test_sampling_is_seeded_and_filters():
    eng = ikjax.load(fixtures_dir() / "v3dense-all-BF16.gguf", mla=3, ctk="f32", ctx=128)
    p = [1, 50, 60, 70]
    a = list(eng.generate(p, 8, temperature=1.0, top_k=40, top_p=0.9, seed=3, stop=()))
    b = list(eng.generate(p, 8, temperature=1.0, top_k=40, top_p=0.9, seed=3, stop=()))
    assert a == b
    one = list(eng.generate(p, 8, temperature=1.0, top_k=1, seed=4, stop=()))
    assert one == list(eng.generate(p, 8, stop=()))  # top_k=1 is greedy
    stopped = list(eng.generate(p, 8, stop=(one[2],)))
    assert stopped == one[:3]


def test_a_temperature_under_float32s_range_draws_the_most_likely_token(tiny_model):
    """A positive temperature below float32's smallest (1e-40, 5e-324): 1/t was Inf with a
    RuntimeWarning on the user's terminal, and Inf times a logit difference of 0 is NaN; now the
    largest float32, the draw the most likely token on the device and on the host, no warning."""
    import warnings

    from ikjax.runtime.sampling import inverse_temperature, sample_next
    eng = ikjax.load(tiny_model, ctx=128, ubatch=32)
    p = [5, 6, 7, 8]
    greedy = list(eng.generate(p, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for t in (1e-40, 5e-324):
            assert np.isfinite(inverse_temperature(t))
            assert list(eng.generate(p, 6, temperature=t, seed=1)) == greedy, t
            logits = np.array([1.0, 3.0, 2.0, 3.0 - 1e-9])
            assert sample_next(logits, temperature=t, top_k=0, top_p=1.0, min_p=0.0, rng=np.random.default_rng(0)) == 1


def test_decode_loop_equals_one_token_per_dispatch(monkeypatch):
    """Several decode steps per dispatch (Engine.decode, tokens picked on the device) give the
    tokens of one step per dispatch, through a stop id inside a chunk and the context's end."""
    eng = ikjax.load(fixtures_dir() / "v3tiny-all-Q4_0.gguf", mla=3, ctk="q8_0", ubatch=32, ctx=64)
    assert eng.decode_loop()
    p = list(range(2, 30))
    loop = list(eng.generate(p, 40, stop=()))  # 28 + 36 = ctx: stops on the context
    mid = list(eng.generate(p, 40, stop=(loop[20],)))
    monkeypatch.setenv("IKJAX_DECODE_LOOP", "0")
    assert not eng.decode_loop()
    step = eng.generate(p, 40, stop=())
    assert loop == list(step) and step.stop_reason == "context" and len(loop) == 64 - len(p)
    assert mid == loop[:loop.index(loop[20]) + 1]
    # the loop itself: n < chunk shares the executable, the first n tokens are the greedy ones
    _, cache = eng.prefill(eng.new_cache(1), np.array(p), 0)
    out, cache = eng.decode(cache, [loop[0]], [len(p)], 5, chunk=8)
    assert np.asarray(out)[0, :5].tolist() == loop[1:6]
    with pytest.raises(ikjax.IkjaxError, match="n <= chunk"):
        eng.decode(cache, [1], [0], 9, chunk=8)


def test_decode_rows_take_their_settings_as_arguments():
    """Engine.decode with a key per row ("rows") and a draw: each row's own temperature / top_k /
    top_p / min_p come beside the keys (sampling.row_params), one executable for every value in a
    top_k bucket; each row draws what it draws alone with that setting; keys without their values,
    or a row's top_k outside the bucket, are refused."""
    from ikjax.runtime.sampling import row_params, top_k_bucket
    eng = ikjax.load(fixtures_dir() / "v3tiny-all-Q4_0.gguf", mla=3, ctk="q8_0", ubatch=32, ctx=64)
    p = list(range(2, 30))
    settings = [dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.0), dict(temperature=1.4, top_k=50, top_p=1.0,
                                                                              min_p=0.1)]
    keys = jax.random.split(jax.random.key(3), 2)
    sampling = dict(settings[0], rows=True)

    def run(settings, keys):
        cache = eng.new_cache(len(settings))
        for b in range(len(settings)):
            _, one = eng.prefill(eng.new_cache(1), np.array(p), 0)
            cache = jax.tree.map(lambda big, o: big.at[:, b].set(o[:, 0]), cache, one)
        out, _ = eng.decode(cache, [5] * len(settings), [len(p)] * len(settings), 6, chunk=8, sampling=sampling,
                            key=(keys, row_params(settings)))
        return np.asarray(out)[:, :6]

    both = run(settings, keys)
    assert both[1].tolist() == run(settings[1:], keys[1:])[0].tolist()  # row 1 as alone (batch 1 compiles)
    n = eng.compile_count
    again = run([dict(settings[0], temperature=0.3), settings[1]], keys)  # another value: no compile
    assert eng.compile_count == n and again[1].tolist() == both[1].tolist()
    assert top_k_bucket(20) == top_k_bucket(50) == 64
    with pytest.raises(ikjax.IkjaxError, match="row_params"):
        eng.decode(eng.new_cache(2), [5, 5], [0, 0], 2, chunk=8, sampling=sampling, key=keys)
    with pytest.raises(ikjax.IkjaxError, match="bucket"):
        eng.decode(eng.new_cache(2), [5, 5], [0, 0], 2, chunk=8, sampling=sampling,
                   key=(keys, row_params([settings[0], dict(settings[1], top_k=200)])))


def test_device_sampler_draws_as_the_host_sampler():
    """sample_device (inside the decode loop) applies sample_next's filters: the same tokens
    survive, drawn with the same frequencies (20000 draws each, 0.02 apart at most)."""
    from ikjax.runtime.sampling import sample_device, sample_next
    logits = np.random.default_rng(2).standard_normal(64).astype(np.float32) * 2
    rng = np.random.default_rng(0)
    keys = jax.random.split(jax.random.key(1), 20000)
    for sp in (dict(temperature=0.7), dict(temperature=1.0, top_k=10), dict(temperature=1.3, top_p=0.8),
               dict(temperature=1.0, top_k=20, top_p=0.9, min_p=0.1)):
        host = np.bincount([sample_next(logits, rng=rng, **sp) for _ in range(20000)], minlength=64) / 20000
        dev = jax.vmap(lambda k: sample_device(logits[None], k, **sp)[0])(keys)
        dev = np.bincount(np.asarray(dev), minlength=64) / 20000
        assert ((host > 0) == (dev > 0)).all() or np.abs(host - dev).max() < 0.005, sp
        assert np.abs(host - dev).max() < 0.02, (sp, np.abs(host - dev).max())
    assert int(sample_device(logits[None], keys[0])[0]) == int(np.argmax(logits))


def test_row_sampler_draws_each_row_as_alone():
    """sample_rows (the server's sampled streams): row b drawn with fold_in(keys[b], positions[b])
    gives the token sample_device gives that row alone with that folded key, whatever the other
    rows hold; bans and non-finite rows as sample_device treats them."""
    from ikjax.runtime.sampling import NON_FINITE, sample_device, sample_rows
    logits = np.random.default_rng(3).standard_normal((5, 64)).astype(np.float32) * 2
    logits[3, 7] = np.nan
    keys = jax.random.split(jax.random.key(4), 5)
    pos = np.array([0, 7, 7, 2, 100], np.int32)
    for sp in (dict(temperature=0.8), dict(temperature=1.0, top_k=10, top_p=0.9, min_p=0.05, ban=(5, 9))):
        got = np.asarray(sample_rows(logits, keys, pos, **sp))
        for b in range(5):
            alone = int(sample_device(logits[b:b + 1], jax.random.fold_in(keys[b], int(pos[b])), **sp)[0])
            assert got[b] == alone, (sp, b)
        assert got[3] == NON_FINITE and not set(got.tolist()) & set(sp.get("ban", ()))
        # another row's logits change nothing for row 0
        other = logits.copy()
        other[1:] = -other[1:]
        assert int(np.asarray(sample_rows(other, keys, pos, **sp))[0]) == got[0]


def test_warm_engine_does_not_recompile_inside_a_bucket():
    eng = ikjax.load(fixtures_dir() / "v3tiny-all-Q4_0.gguf", mla=3, ctk="q8_0", ubatch=32, ctx=256, kv_block=64)
    list(eng.generate(np.arange(2, 40), 10, stop=()))  # 38 = 32 + 6 (token buckets 32, 8), kv bucket 64
    before, ours = COUNTER.count, eng.compile_count
    list(eng.generate(np.arange(5, 44), 12, stop=()))  # 39 = 32 + 7, positions < 64: same buckets
    list(eng.generate(np.arange(9, 46), 5, stop=()))
    assert COUNTER.count == before and eng.compile_count == ours
    # a longer context crosses into the next KV bucket: exactly one new decode compile
    list(eng.generate(np.arange(2, 100) % 1000, 1, stop=()))
    assert eng.compile_count > ours


def test_memory_plan_formulas():
    r1 = ModelConfig(n_layer=61, d_model=7168, n_head=128, q_lora_rank=1536, kv_lora_rank=512, rope_dim=64,
                     nope_dim=128, v_dim=128, vocab_size=129280, ffn_dim=18432, expert_ffn_dim=2048, n_expert=256,
                     n_expert_used=8, n_expert_shared=1, n_expert_group=8, n_expert_group_used=4, n_dense_lead=3,
                     expert_weights_scale=2.5, expert_weights_norm=True, gating=2, rms_eps=1e-6, rope_base=1e4,
                     yarn=None, context_length=163840)
    assert CacheLayout.for_model(r1, 3, "f16", 1, 1).bytes_per_token() == 70_272
    assert CacheLayout.for_model(r1, 3, "q8_0", 1, 1).bytes_per_token() == 37_332
    assert CacheLayout.for_model(r1, 1, "f32", 1, 1).bytes_per_token() == 61 * 576 * 4
    # mla=0 caches per-head K (192) and V (128): L*H*(k+v) values per token
    assert CacheLayout.for_model(r1, 0, "f16", 1, 1).bytes_per_token() == 61 * 128 * (192 + 128) * 2

    eng = ikjax.load(fixtures_dir() / "v3tiny-all-Q4_0.gguf", mla=3, ctk="q8_0", ctx=1000, ubatch=24)
    plan = eng.memory_plan()
    per_token = 3 * -(-272 // 32) * 34  # 3 layers, 272-wide latent in 9 q8_0 blocks of 34 bytes
    assert plan.kv_bytes_per_token == per_token
    assert plan.kv_bytes == per_token * eng.capacity and eng.capacity == 1024  # -c in whole KV blocks
    on_device = sum(x.nbytes for x in jax.tree_util.tree_leaves(eng.new_cache(1)))
    assert on_device == plan.kv_bytes
    file_bytes = sum(t.nbytes for t in eng.file.tensors.values())
    loaded = sum(x.nbytes for x in jax.tree_util.tree_leaves(eng.weights))
    assert plan.weights_bytes == file_bytes == loaded  # blocks kept as they are: no dequantized copy
    assert any("KV cache" in line for line in plan.lines())
    # -ot: the plan splits weights by the first matching rule (host and device are one on CPU)
    ot = ikjax.load(fixtures_dir() / "v3tiny-all-Q4_0.gguf", ot="exps=CPU,attn=GPU,.*=CPU").memory_plan()
    exps = sum(t.nbytes for n, t in eng.file.tensors.items() if "exps" in n)
    not_attn = sum(t.nbytes for n, t in eng.file.tensors.items() if "attn" not in n)
    assert exps > 0 and ot.host_weights_bytes == not_attn


def test_same_input_matrices_are_stacked_at_load(monkeypatch):
    """q_a|kv_a_mqa, ffn gate|up and shared-expert gate|up read the same input: stored stacked
    (same blocks, rows concatenated) when their types agree, so a step runs one product each —
    on the accelerator paths (here the XLA path); the C++ CPU kernels read the file's pages as
    they are, unstacked."""
    from ikjax import ops
    if ops.resolve_backend() == "cpu":
        cpu = layer_tensors(ikjax.load(fixtures_dir() / "v3dense-all-Q8_0.gguf", mla=3, ctk="f32").weights, 0)
        assert {"q_a", "kv_a_mqa", "ffn_gate", "ffn_up"} <= cpu.keys() and "attn_in" not in cpu
    monkeypatch.setenv("IKJAX_KERNELS", "xla")
    eng = ikjax.load(fixtures_dir() / "v3dense-all-Q8_0.gguf", mla=3, ctk="f32")
    dense, moe = layer_tensors(eng.weights, 0), layer_tensors(eng.weights, 1)
    assert {"attn_in", "ffn_gate_up"} <= dense.keys() and not {"q_a", "kv_a_mqa", "ffn_gate"} & dense.keys()
    assert "shexp_gate_up" in moe and "gate_shexp" not in moe
    assert dense["attn_in"].shape == (256 + 272, 256)
    # a mixed-type file (Q4_K_M: some of these differ in type) keeps the pairs it cannot stack
    mixed = layer_tensors(ikjax.load(fixtures_dir() / "v3tiny-all-Q4_K_M.gguf", mla=3, ctk="f32").weights, 0)
    assert ("attn_in" in mixed) != ("kv_a_mqa" in mixed)


def test_decode_loop_with_host_weights(monkeypatch):
    """Weights kept in host RAM next to an accelerator (a placement that is not unified): every
    executor loops (its host calls run inside the loop; tests/test_hybrid_gpu.py checks the tokens
    on one GPU and under both split modes on two), and IKJAX_DECODE_LOOP=0 turns it off."""
    import dataclasses
    eng = ikjax.load(fixtures_dir() / "v3tiny-all-Q4_0.gguf", mla=3, ctx=64, cpu_moe=True)
    assert eng.placement.unified and eng.placement.host_bytes > 0 and eng.decode_loop()  # CPU: one RAM
    eng.placement = dataclasses.replace(eng.placement, unified=False)  # as next to a GPU
    assert eng.executor.plain_loop and eng.decode_loop()
    eng.executor.plain_loop = False  # as a split mode's executor
    assert eng.decode_loop()
    monkeypatch.setenv("IKJAX_DECODE_LOOP", "0")
    assert not eng.decode_loop()


@pytest.mark.parametrize("mla,fa,ctk", [(0, False, "f16"), (1, True, "q8_0"), (2, True, "bf16"), (3, False, "f32")])
def test_decode_loop_every_mode(monkeypatch, mla, fa, ctk):
    """The decode loop gives one-token-per-dispatch's greedy tokens in every MLA mode, flash or
    not, every cache type (KV buckets that the loop's last step needs, not its first)."""
    eng = ikjax.load(fixtures_dir() / "v2lite_tiny-kvb-Q5_1.gguf", mla=mla, fa=fa, ctk=ctk, ubatch=16, ctx=96)
    p = list(range(3, 20))
    loop = list(eng.generate(p, 30, stop=()))
    monkeypatch.setenv("IKJAX_DECODE_LOOP", "0")
    assert list(eng.generate(p, 30, stop=())) == loop and len(loop) == 30


def test_prompt_chunk_at_the_end_fits_the_cache(tiny_model):
    """-c 250 -ub 75 (KV blocks of 64): the cache is 256 rows, and the last chunk of a long prompt
    (at 225) has a token bucket (32) that runs past it. That step computes the rows left (31)
    instead: the logits equal those of a roomy cache (-c 512) at every position, every prompt whose
    last chunk overflows shares that one step, and `ikjax generate`'s ahead-of-time list
    (_generate_shapes) names it, so generation compiles nothing more. (The shapes of -c 1000
    -ub 300, a quarter: the same arithmetic at a quarter of the tokens and compiles.)"""
    from ikjax.cli.generate import _generate_shapes, _precompile_shape
    ids = np.random.default_rng(0).integers(0, 1024, 250).astype(np.int32)
    small = ikjax.load(tiny_model, ctx=250, ubatch=75, kv_block=64)
    big = ikjax.load(tiny_model, ctx=512, ubatch=75, kv_block=64)
    assert small.capacity == 256 and small.token_bucket(25) == 32 and small.prompt_tokens(25, 225) == 31
    assert small.prompt_tokens(16, 225) == 16 and big.prompt_tokens(25, 225) == 32
    got, ref = small.logits(ids), big.logits(ids)
    assert got.shape == ref.shape == (250, small.config.vocab_size)
    assert rel_err(got[225:], ref[225:]) < 1e-5 and rel_err(got, ref) < 1e-5
    assert (got.argmax(-1) == ref.argmax(-1)).mean() > 0.99
    # a prompt fed after earlier context (bench -d 200 -p 50): 50 tokens at 200, bucket 64, 56 left
    assert small.prompt_tokens(50, 200) == 56
    _, cache = small.prefill(small.new_cache(1), ids[:200], 0)
    tail, _ = small.prefill(cache, ids[200:], 200, all_logits=True)
    assert rel_err(tail, ref[200:]) < 1e-5
    shapes = _generate_shapes(small, 247, 1)
    assert (31, 256, 0) in shapes  # the last chunk's 22 tokens at 225: rows 225..255
    for n_tok, kv, chunk in shapes:
        _precompile_shape(small, n_tok, kv, chunk, dict(temperature=0.0))
    before = small.compile_count
    for n in (247, 243, 250 - 1):  # last chunks of 22, 18, 24 tokens: each past the cache
        out = list(small.generate(ids[:n], 1))
        assert len(out) == 1
    assert small.compile_count == before
    assert [list(big.generate(ids[:n], 1)) for n in (247, 243)] == [list(small.generate(ids[:n], 1))
                                                                    for n in (247, 243)]


@pytest.mark.parametrize("ctx", [512, 500])
def test_generate_fills_the_context_exactly(tiny_model, ctx):
    """Prompt + generated tokens reach exactly -c (the decode loop's last chunk shortened to the
    rows left, its last step writing row -c - 2, near the cache's end when -c is a whole number
    of KV blocks), with the tokens of a roomy cache; a full prompt generates nothing, and one token more
    is refused with one line, by generate, prefill and step alike."""
    from ikjax.errors import OptionError
    ids = list(np.random.default_rng(1).integers(0, 1024, ctx - 40))
    small = ikjax.load(tiny_model, ctx=ctx, ubatch=128)
    big = ikjax.load(tiny_model, ctx=1024, ubatch=128)
    assert small.capacity == 512
    gen = small.generate(ids, 100)
    got = list(gen)
    assert len(ids) + len(got) == ctx and gen.stop_reason == "context"
    assert got == list(big.generate(ids, 40))
    full = small.generate(list(range(3, 3 + ctx)), 5)
    assert list(full) == [] and full.stop_reason == "context"
    for call in (lambda: small.generate(list(range(3, 4 + ctx)), 5),
                 lambda: small.prefill(small.new_cache(1), ids[:41], ctx - 40),
                 lambda: small.logits(list(range(3, 4 + ctx)))):
        with pytest.raises(OptionError) as e:
            call()
        assert "\n" not in str(e.value) and str(ctx) in str(e.value), str(e.value)
    with pytest.raises(OptionError) as e:  # a step's rows must lie inside the cache
        small.step(small.new_cache(1), np.zeros((1, 2), np.int32), np.array([small.capacity - 1]))
    assert "\n" not in str(e.value) and "run past the cache" in str(e.value)
    with pytest.raises(OptionError):
        small.decode(small.new_cache(1), [5], [small.capacity - 3], 4, chunk=16)


@pytest.mark.parametrize("ctk", ["f16", "q8_0"])
def test_cache_program_compiled_ahead_makes_the_eager_cache(tiny_model, ctk):
    """`prepare_cache` compiles the program `new_cache` runs (one program, beside the first steps'
    compile): its cache equals the eagerly made zeros leaf for leaf (shape, dtype, sharding, all
    zero), and the `new_cache` after it compiles nothing more."""
    from ikjax.model import cache as kvcache
    from ikjax.runtime import executors
    eng = ikjax.load(tiny_model, ctx=256, ubatch=32, mla=3, ctk=ctk)
    layout = eng.cache_layout(2)
    executors._zeroed_cache.cache_clear()
    eng.prepare_cache(2)
    assert executors._zeroed_cache.cache_info().currsize == 1
    with jax.log_compiles():
        hits = executors._zeroed_cache.cache_info().hits
        made = eng.new_cache(2)
    assert executors._zeroed_cache.cache_info().hits == hits + 1
    eager = kvcache.init_cache(layout)
    assert jax.tree.structure(made) == jax.tree.structure(eager)
    for a, b in zip(jax.tree.leaves(made), jax.tree.leaves(eager)):
        assert a.shape == b.shape and a.dtype == b.dtype and a.sharding == b.sharding
        assert not np.asarray(a).any()
    # and it is a cache the engine's steps take
    logits, _ = eng.step(made, np.arange(1, 6)[None].repeat(2, 0), np.zeros(2, np.int32))
    assert np.isfinite(np.asarray(logits)).all()


def test_close_lets_go_of_the_memory_and_the_file(tiny_model, tmp_path):
    """`Engine.close()` / `with ikjax.load(...)`: a notebook loading one model after another kept each one's
    memory and its file open after `del` (an outside probe, stop 65: 937 MiB loaded, 772 MiB after `del`;
    a deleted model file's space held until the process ended by the row gather's descriptor and by the
    map, which the tokenizer's strings kept). After close no descriptor of the file is open, using the
    engine raises one OptionError naming the file, and closing again is a no-op."""
    import os
    import shutil

    import ikjax
    from ikjax.errors import OptionError

    path = tmp_path / "m.gguf"
    shutil.copy(tiny_model, path)

    def open_on_it() -> int:
        n = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                n += os.readlink(f"/proc/self/fd/{fd}").startswith(str(path))
            except OSError:
                pass
        return n

    with ikjax.load(path, ctx=64) as eng:
        want = eng.logits([1, 2, 3])
        assert eng.tokenizer.encode("hi") and open_on_it() >= 1
    assert open_on_it() == 0
    with pytest.raises(OptionError, match=r"m\.gguf: this engine was closed"):
        eng.logits([1, 2, 3])
    with pytest.raises(OptionError, match="closed"):
        list(eng.generate([1, 2], 2))
    eng.close()
    # a second engine of the same file is unaffected by the first one's close
    a, b = ikjax.load(path, ctx=64), ikjax.load(path, ctx=64)
    a.close()
    np.testing.assert_array_equal(b.logits([1, 2, 3]), want)
    b.close()
    assert open_on_it() == 0


def test_close_lets_go_of_a_layer_pipeline(tiny4_model):
    """-sm layer's stages hold every weight (and the head's copies): `close` let go of the engine's own
    references only, and every array stayed alive, the file's map with them (a review, stop 65). In
    a child process with 2 fake CPU devices: after close no JAX array is left and no descriptor of
    the file is open."""
    import os
    import subprocess
    import sys

    from conftest import TEST_XLA_FLAGS
    script = """
import gc, os, sys
import jax, ikjax
eng = ikjax.load(sys.argv[1], ctx=64, sm="layer")
eng.logits([1, 2, 3])
assert len(jax.devices()) == 2 and eng.split_mode == "layer"
live = len(jax.live_arrays())
eng.close()
gc.collect()
fds = 0
for fd in os.listdir("/proc/self/fd"):
    try:
        fds += os.readlink(f"/proc/self/fd/{fd}") == os.path.realpath(sys.argv[1])
    except OSError:
        pass
print(live > 0, len(jax.live_arrays()), fds)
"""
    env = dict(os.environ, XLA_FLAGS=(TEST_XLA_FLAGS + " --xla_force_host_platform_device_count=2").strip())
    res = subprocess.run([sys.executable, "-c", script, str(tiny4_model)], capture_output=True, text=True,
                         timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["True", "0", "0"], res.stdout
