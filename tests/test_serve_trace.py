"""IKJAX_SERVE_TRACE (the scheduler's steps written out when it stops) and the GPU prompt
attention's block choice (ikjax.ops.attn.gpu_kv_block): the two diagnostics behind RESULTS §23b."""
from __future__ import annotations

import json
import threading

import jax
import jax.numpy as jnp
import numpy as np

from ikjax.ops import attn


def traced_run(tiny_model, path, prompts: tuple[int, ...], n: int, seed: int) -> list[dict]:
    """The trace (IKJAX_SERVE_TRACE=path, set by the caller) of a 2-slot scheduler that generated `n`
    tokens (ignore_eos) for random prompts of the given lengths, all submitted at once."""
    import ikjax
    from ikjax.runtime.scheduler import Scheduler
    eng = ikjax.load(tiny_model, ctx=256, ubatch=32)
    s = Scheduler(eng, 2).start()
    done = threading.Semaphore(0)
    cb = lambda k, v: done.release() if k in ("done", "error") else None
    rng = np.random.default_rng(seed)
    for m in prompts:
        s.submit(s.make_request(rng.integers(10, eng.config.vocab_size, m), n, ignore_eos=True, on_event=cb))
    for _ in prompts:
        done.acquire()
    s.stop()
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_trace_records_every_chunk_and_decode_step(tiny_model, tmp_path, monkeypatch):
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv("IKJAX_SERVE_TRACE", str(path))
    # one dispatch a token (no decode loop: ignore_eos streams loop too since d0aa682), so every
    # generated token after the first is one decode event
    monkeypatch.setenv("IKJAX_DECODE_LOOP", "0")
    ev = traced_run(tiny_model, path, (40, 7), 5, 0)
    kinds = [e["kind"] for e in ev]
    # 40 tokens in chunks of 32 (2) + 7 (1) = 3 chunks; 5 tokens each: the first from the prompt's
    # logits, 4 from decode steps
    assert kinds.count("chunk") == 3 and kinds.count("decode") >= 4
    assert all(e["t1"] >= e["t0"] for e in ev)
    assert all(a["t1"] <= b["t0"] + 1e-6 for a, b in zip(ev, ev[1:]))  # one thread, in order


def test_no_trace_unless_asked(tiny_model, tmp_path, monkeypatch):
    import ikjax
    from ikjax.runtime.scheduler import Scheduler
    monkeypatch.delenv("IKJAX_SERVE_TRACE", raising=False)
    s = Scheduler(ikjax.load(tiny_model, ctx=128, ubatch=32), 1).start()
    s.stop()
    assert s._trace is None


def test_gpu_kv_block():
    # a prompt step over a cache of up to GPU_LIVE_ROWS rows: one block (no loop)
    assert attn.gpu_kv_block(1, 512, 16, 2048, 256) == 2048 == attn.GPU_LIVE_ROWS
    assert attn.gpu_kv_block(1, 64, 16, 1000, 256) == 1000
    # over a longer cache: blocks of GPU_LIVE_ROWS, so the loop stops at the last query's block (a
    # 64-token step at position 0 of an 8k slot read all 8192 rows in one block before)
    assert attn.gpu_kv_block(1, 64, 16, 8192, 256) == 2048
    assert attn.gpu_kv_block(1, 512, 16, 16384, 256) == 2048
    # smaller where the scores would not fit 256 MiB, never below kv_block
    assert attn.gpu_kv_block(1, 4096, 16, 16384, 256) == 1024
    assert attn.gpu_kv_block(1, 4096, 128, 65536, 256) == 256
    # a one-token step keeps one block of the whole cache
    assert attn.gpu_kv_block(1, 1, 16, 65536, 256) == 65536


def test_attend_on_gpu_path_matches_blocked(monkeypatch):
    """The GPU branch (one block: scores in memory; larger blocks) gives the blocked form's
    result: checked on the CPU by telling `attend` it runs on a GPU."""
    rng = np.random.default_rng(1)
    B, T, H, S, D = 1, 8, 2, 600, 16
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, S, H, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, S, H, D)), jnp.float32)
    q_pos = jnp.asarray([[590 + i for i in range(T)]], jnp.int32)
    ref = attn.attend_flash(q, k, v, q_pos, 0.25, 64)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    one_block = attn.attend(q, k, v, q_pos, 0.25, flash=True, amb_bytes=0, kv_block=64)
    monkeypatch.setattr(attn, "GPU_SCORES_BYTES", B * T * H * 4 * 128)  # 128-row blocks: 5 of them
    blocks = attn.attend(q, k, v, q_pos, 0.25, flash=True, amb_bytes=0, kv_block=64)
    assert np.abs(np.asarray(one_block) - np.asarray(ref)).max() < 1e-5
    assert np.abs(np.asarray(blocks) - np.asarray(ref)).max() < 1e-5
    # a prompt step over a cache longer than GPU_LIVE_ROWS: blocks of that many rows, the loop stopping at
    # the last query's block (queries at 0..7 see the first block only), the same result
    monkeypatch.setattr(attn, "GPU_SCORES_BYTES", 1 << 30)
    monkeypatch.setattr(attn, "GPU_LIVE_ROWS", 128)
    early = jnp.asarray([[i for i in range(T)]], jnp.int32)
    for pos in (q_pos, early):
        got = attn.attend(q, k, v, pos, 0.25, flash=True, amb_bytes=0, kv_block=64)
        assert np.abs(np.asarray(got) - np.asarray(attn.attend_flash(q, k, v, pos, 0.25, 64))).max() < 1e-5


def test_trace_notes_each_decode_loops_ready_time_and_steps(tiny_model, tmp_path, monkeypatch, capsys):
    """With the decode loop (the default), each loop's record says when its tokens reached the host
    ("ready", between its start and end: the rest was the host emitting them) and its steps ("k");
    bench/serve_trace.py sums the two shares."""
    import importlib.util
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv("IKJAX_SERVE_TRACE", str(path))
    monkeypatch.setenv("IKJAX_SERVE_BURST_MS", "1000")
    loops = [e for e in traced_run(tiny_model, path, (9, 5), 20, 1) if "k" in e]
    assert loops and all(e["kind"] == "decode" and e["t0"] <= e["ready"] <= e["t1"] for e in loops)
    assert max(e["k"] for e in loops) > 1 and sum(e["k"] for e in loops) <= 2 * 19
    spec = importlib.util.spec_from_file_location("serve_trace", __file__.replace("tests/test_serve_trace.py",
                                                                                  "bench/serve_trace.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr("sys.argv", ["serve_trace", str(path)])
    mod.main()
    assert f"{len(loops)} decode loops, {sum(e['k'] for e in loops)} steps" in capsys.readouterr().out
