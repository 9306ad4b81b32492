"""sweep-bench: ik's table and JSONL, field by field (SPEC §4)."""
from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from ikjax.tools import sweep_bench as sb
from ikjax.cli import app

# ik_llama.cpp's exact lines (examples/sweep-bench/sweep-bench.cpp)
IK_HEADER = "|    PP |     TG |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |"
IK_SEPARATOR = "|-------|--------|--------|----------|----------|----------|----------|"
IK_KEYS = ["n_kv_max", "n_batch", "n_ubatch", "flash_attn", "n_gpu_layers", "n_threads", "n_threads_batch",
           "pp", "tg", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg"]
CELL_WIDTHS = [7, 8, 8, 10, 10, 10, 10]  # "|%6d | %6d | %6d | %8.3f | %8.2f | %8.3f | %8.2f |"


def test_format_constants():
    assert sb.HEADER == IK_HEADER
    assert sb.SEPARATOR == IK_SEPARATOR
    row = sb.SweepRow(512, 128, 0, 1.1, 2.311).markdown()
    assert row == "|   512 |    128 |      0 |    1.100 |   465.45 |    2.311 |    55.39 |"
    assert [len(c) for c in row.split("|")[1:-1]] == CELL_WIDTHS
    assert list(sb.JSONL_KEYS) == IK_KEYS


def test_sweep_points():
    assert sb.sweep_points(512, 128) == [0, 128, 256, 384]
    assert sb.sweep_points(500, 128) == [0, 128, 256]
    assert sb.sweep_points(100, 128) == []


def _invoke(args):
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.stderr + res.stdout
    return res


def test_markdown_table_field_by_field(tiny_model):
    c, ub, tg = 512, 128, 4
    res = _invoke(["sweep-bench", "-m", tiny_model, "-c", str(c), "-ub", str(ub), "-n", str(tg), "-mla", "3", "-fa"])
    lines = [l for l in res.stdout.splitlines() if l.startswith("|")]
    assert lines[0] == IK_HEADER
    assert lines[1] == IK_SEPARATOR
    rows = lines[2:]
    assert len(rows) == c // ub
    banner = [l for l in res.stdout.splitlines() if l.startswith("main: ")]
    assert banner == [f"main: n_kv_max = {c}, n_batch = 2048, n_ubatch = {ub}, flash_attn = 1, n_gpu_layers = 99, "
                      f"n_threads = {banner[0].split('n_threads = ')[1].split(',')[0]}, "
                      f"n_threads_batch = {banner[0].split('n_threads_batch = ')[1]}"]
    for i, row in enumerate(rows):
        cells = row.split("|")[1:-1]
        assert [len(x) for x in cells] == CELL_WIDTHS, row
        assert re.fullmatch(r"\|[ \d]{6} \| [ \d]{6} \| [ \d]{6} \| [ \d.]{8} \| [ \d.]{8} \| [ \d.]{8} \| [ \d.]{8} \|", row), row
        pp, tgv, n_kv = (int(x) for x in cells[:3])
        t_pp, s_pp, t_tg, s_tg = (float(x) for x in cells[3:])
        assert (pp, tgv, n_kv) == (ub, tg, i * ub)
        assert t_pp > 0 and t_tg > 0
        # speeds are tokens / time (time printed with 3 decimals: compare within its rounding)
        # (the true time is within 0.0005 s of the printed one: relative to the smaller end)
        assert s_pp == pytest.approx(pp / t_pp, rel=0.0005 / max(t_pp - 0.0005, 1e-6) + 0.001)
        assert s_tg == pytest.approx(tgv / t_tg, rel=0.0005 / max(t_tg - 0.0005, 1e-6) + 0.001)
    assert "compiled" in res.stderr and "memory plan" in res.stderr  # compile time and plan on stderr


def test_jsonl_keys_order_types_and_plot(tiny_model, tmp_path):
    c, ub = 256, 128
    png = tmp_path / "sweep.png"
    res = _invoke(["sweep-bench", "-m", tiny_model, "-c", str(c), "-ub", str(ub), "-mla", "2", "-fa", "0",
                   "--output-format", "jsonl", "--plot", str(png)])
    lines = [l for l in res.stdout.splitlines() if l.strip()]
    assert len(lines) == c // ub
    for i, line in enumerate(lines):
        obj = json.loads(line)
        assert list(obj) == IK_KEYS
        for k in IK_KEYS[:10]:
            assert type(obj[k]) is int, k
        for k in IK_KEYS[10:]:
            assert type(obj[k]) is float, k
        assert (obj["n_kv_max"], obj["n_ubatch"], obj["flash_attn"]) == (c, ub, 0)
        assert (obj["pp"], obj["tg"], obj["n_kv"]) == (ub, ub // 4, i * ub)
        assert obj["speed_pp"] == pytest.approx(obj["pp"] / obj["t_pp"], rel=1e-4)
        assert obj["speed_tg"] == pytest.approx(obj["tg"] / obj["t_tg"], rel=1e-4)
    assert png.stat().st_size > 1000
    # ik's sweep-bench-plot: several JSONL runs overlaid
    jl = tmp_path / "run.jsonl"
    jl.write_text(res.stdout)
    out = tmp_path / "overlay.png"
    _invoke(["plot", str(jl), str(jl), "-o", str(out), "--labels", "a,b"])
    assert out.stat().st_size > 1000


@pytest.mark.parametrize("loop", ["1", "0"])
def test_every_step_shape_runs_once_untimed_before_its_row(tiny_model, loop, monkeypatch):
    """A new executable's first runs (kernel load, allocator growth) are never inside a row's
    timing: each step shape the sweep uses runs untimed before the first row that uses it (twice on
    a CPU-only engine, whose second run still faults its temporaries in: RESULTS §26ai), and the
    compile hook sees each row before that row."""
    import ikjax
    monkeypatch.setenv("IKJAX_DECODE_LOOP", loop)
    eng = ikjax.load(tiny_model, ctx=512, ubatch=128, mla=3, fa=True)
    tg = 6
    calls, rows_seen, loop_n = [], [], {}
    step, decode = eng.step, eng.decode

    def recording_step(cache, tokens, start, *a, **k):
        calls.append((tokens.shape[1], eng.kv_bucket(int(start[0]) + tokens.shape[1], tokens.shape[1]),
                      len(rows_seen)))
        return step(cache, tokens, start, *a, **k)

    def recording_decode(cache, tokens, start, n, **k):  # the tg tokens in one dispatch (the loop compiled for tg)
        assert k.get("chunk", n) == tg
        loop_n[len(calls)] = n
        calls.append((1, eng.kv_bucket(int(start[0]) + tg, 1), len(rows_seen)))
        return decode(cache, tokens, start, n, **k)

    eng.step, eng.decode = recording_step, recording_decode
    rows = list(sb.run(eng, tg, before_row=rows_seen.append))
    assert rows_seen == sb.sweep_points(512, 128) and len(rows) == 4
    shapes = {(t, eng.kv_bucket(kv, t)) for t, kv in sb.step_shapes(eng, tg)}
    per_row = (1 if loop == "1" else tg) + 1
    timed = len(rows) * per_row
    runs = 2 if eng.executor.on_cpu_only else 1
    assert eng.executor.on_cpu_only  # this test's engine: the CPU's twice
    assert len(calls) == timed + runs * len(shapes)  # the untimed runs of each distinct shape
    first_uses = {}
    for i, (t, bucket, row) in enumerate(calls):
        first_uses.setdefault((t, bucket), [])
        if len(first_uses[(t, bucket)]) < runs:
            first_uses[(t, bucket)].append(i)
    assert set(first_uses) == shapes
    warmups = {i for v in first_uses.values() for i in v}
    # the first calls of each shape are warm-ups: the row's timed steps (tg decode + 1 prompt)
    # come as one uninterrupted run after the row's warm-ups
    for r in range(len(rows)):
        mine = [i for i, c in enumerate(calls) if c[2] == r + 1]
        warm = [i for i in mine if i in warmups]
        assert mine[:len(warm)] == warm and len(mine) - len(warm) == per_row
    # the decode loop warms up on its first few tokens; its timed runs make all tg
    assert {loop_n[i] for i in loop_n if i in warmups} <= {min(tg, sb.WARM_LOOP_TOKENS)}
    assert {loop_n[i] for i in loop_n if i not in warmups} <= {tg}
    assert loop == "0" or any(i in warmups for i in loop_n)


def test_steps_compile_side_by_side(tiny_model):
    """On an accelerator a row's steps compile in threads (sweep_bench.precompile); forced here on
    CPU: every shape is compiled once, counted once, and the sweep then compiles nothing more."""
    import ikjax
    eng = ikjax.load(tiny_model, ctx=512, ubatch=128, mla=3, fa=True)
    eng.compile_in_parallel = lambda: True
    shapes = sb.step_shapes(eng, 4)
    seen = []
    sb.precompile(eng, 4, on_shape=lambda t, kv, s: seen.append((t, kv)))
    assert sorted(seen) == sorted(shapes) and eng.compile_count == len(shapes) == len(eng._executables)
    rows = list(sb.run(eng, 4))
    assert len(rows) == 4 and eng.compile_count == len(shapes)


def test_a_step_compiling_in_one_thread_is_not_compiled_again_in_another(tiny_model, monkeypatch):
    """Two threads asking for one step: the second waits for the first's compile (one compile,
    one count, the same executable); a compile that fails there is done again by the waiter,
    whose caller gets the error."""
    import threading
    import time

    import ikjax
    eng = ikjax.load(tiny_model, ctx=512, ubatch=128, mla=3, fa=True)
    steps = eng._steps
    real, calls, fail = steps.executor.compile, [], []

    def slow(*a, **k):
        calls.append(threading.current_thread().name)
        time.sleep(0.3)
        if fail:
            fail.pop()
            raise RuntimeError("compile failed")
        return real(*a, **k)
    monkeypatch.setattr(steps.executor, "compile", slow)
    out = {}

    def ask(name, kv):
        try:
            out[name] = eng.precompile(1, 128, kv)
        except Exception as e:  # noqa: BLE001
            out[name] = e

    def both(names, kv):  # two threads ask for the same step, the second 50 ms after the first
        threads = [threading.Thread(target=ask, args=(n, kv), name=n) for n in names]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join()
    both(("a", "b"), 256)
    assert len(calls) == 1 and eng.compile_count == 1 and len(eng._executables) == 1
    assert isinstance(out["a"], float) and isinstance(out["b"], float)
    # the first thread's compile fails: the second compiles it again and succeeds
    fail.append(1)
    both(("c", "d"), 512)
    assert calls[1:] == ["c", "d"]
    assert isinstance(out["c"], RuntimeError) and isinstance(out["d"], float)
    assert eng.compile_count == 2 and len(eng._executables) == 2


def test_compile_side_by_side_runs_each_family_first_before_the_rest():
    """The first job of each family runs before the rest of its family starts (they reuse what its
    compile autotuned); the first jobs of different families run at the same time; results come back
    in the jobs' order; an error reaches the caller."""
    import threading
    import time

    from ikjax.runtime.executables import compile_side_by_side
    log, lock = [], threading.Lock()
    both_firsts = threading.Barrier(2, timeout=10)  # the two families' first jobs meet: side by side

    def job(name, first=False):
        def run():
            with lock:
                log.append(("start", name))
            if first:
                both_firsts.wait()
            time.sleep(0.05)
            with lock:
                log.append(("end", name))
            return name
        return run
    work = [("pp", job("pp0", True)), ("pp", job("pp1")), ("loop", job("loop0", True)), ("pp", job("pp2"))]
    assert compile_side_by_side(work) == ["pp0", "pp1", "loop0", "pp2"]
    assert log.index(("end", "pp0")) < log.index(("start", "pp1")) and log.index(("end", "pp0")) < log.index(
        ("start", "pp2"))
    # the followers of one family run side by side too
    assert max(log.index(("start", "pp1")), log.index(("start", "pp2"))) < min(
        log.index(("end", "pp1")), log.index(("end", "pp2")))

    def boom():
        raise ValueError("compile failed")
    with pytest.raises(ValueError, match="compile failed"):
        compile_side_by_side([("a", boom), ("a", job("x"))])


def test_side_by_side_firsts_lower_in_the_order_given():
    """The families' first jobs lower one at a time in `work`'s order whatever order they reach
    `compile_cache.lower` in (the later ones ask first here); a job that ends without lowering (a
    stored step) or fails before it ends its turn, so no one waits for it; a follower lowers after
    its first, without a turn. Each job's XLA compile still runs beside the others' lowerings."""
    import threading
    import time

    import jax
    import jax.numpy as jnp

    from ikjax.runtime import compile_cache
    from ikjax.runtime.executables import compile_side_by_side
    order, lock = [], threading.Lock()
    f = jax.jit(lambda x: jnp.sin(x) * 2)

    def job(name, delay, lowers=True, fails=False):
        def run():
            time.sleep(delay)  # later jobs reach their lowering first
            if fails:
                raise RuntimeError("no such step")
            if lowers:
                compile_cache.lower(f, jax.ShapeDtypeStruct((3,), jnp.float32))
                with lock:
                    order.append(name)
            return name
        return run
    work = [("pp2048", job("pp2048", 0.4)), ("stored", job("stored", 0.3, lowers=False)),
            ("loop", job("loop", 0.2)), ("cache", job("cache", 0.0)), ("pp2048", job("pp2048-follower", 0.0))]
    assert compile_side_by_side(work) == ["pp2048", "stored", "loop", "cache", "pp2048-follower"]
    firsts = [n for n in order if n != "pp2048-follower"]
    assert firsts == ["pp2048", "loop", "cache"], order  # the follower may come anywhere after its first
    assert order.index("pp2048-follower") > order.index("pp2048"), order
    order.clear()
    with pytest.raises(RuntimeError, match="no such step"):
        compile_side_by_side([("a", job("a", 0.2, fails=True)), ("b", job("b", 0.0))])
    assert order == ["b"]
    # outside a batch, lower takes the lock alone as before
    assert compile_cache.lower(f, jax.ShapeDtypeStruct((2,), jnp.float32)).compile()(jnp.ones(2)).shape == (2,)


def test_sweep_lowers_the_prompt_steps_first():
    """sweep_bench's side-by-side compile lowers the prompt steps first, the most tokens first, then
    the decode loops (the longest XLA compile starts first, RESULTS §22al)."""
    jobs = [(1, "loop", 1, 16384), (2, "step", 512, 1024), (3, "step", 2048, 16384), (4, "step", 1, 300)]
    assert [j[0] for j in sb.lowering_order(jobs)] == [3, 2, 4, 1]


def _recorded_sweep(eng, tg: int, rows: int | None = None) -> list[tuple]:
    """Run the sweep (no warm-up runs: their random tokens depend on which shapes are new, so the
    token streams of two -c would differ) and keep what every step returned: ("pp", start, last
    token's logits) and ("tg", start, the tg tokens picked). `rows`: stop after that many rows."""
    import itertools

    import numpy as np
    rec = []
    step, decode = eng.step, eng.decode

    def recording_step(cache, tokens, start, *a, **k):
        out, cache = step(cache, tokens, start, *a, **k)
        rec.append(("pp" if tokens.shape[1] > 1 else "tg", int(start[0]), np.asarray(out, np.float32)))
        return out, cache

    def recording_decode(cache, tokens, start, n, **k):
        out, cache = decode(cache, tokens, start, n, **k)
        rec.append(("tg", int(start[0]), np.asarray(out)[:, :n]))
        return out, cache

    eng.step, eng.decode = recording_step, recording_decode
    got = list(itertools.islice(sb.run(eng, tg, warmup=False), rows))
    assert [r.n_kv for r in got] == sb.sweep_points(sb.sweep_ctx(eng.options), eng.options.ubatch)[:rows]
    return rec


_ROOMY: dict[int, list] = {}


def _roomy_sweep(tiny_model, tg: int) -> list[tuple]:
    """The sweep of a roomy cache (-c 2048), its first 4 rows (N_KV 0..768: as far as a -c 1024
    sweep goes), recorded once per -n for the parametrizations below."""
    import ikjax
    if tg not in _ROOMY:
        _ROOMY[tg] = _recorded_sweep(ikjax.load(tiny_model, ctx=2048, ubatch=256), tg, rows=4)
    return _ROOMY[tg]


@pytest.mark.parametrize("ctx,tg", [(1024, 16), (1000, 16), (1024, 256)])
def test_last_rows_reach_the_context_and_match_a_roomy_cache(tiny_model, ctx, tg):
    """The KV cache is -c (in whole KV blocks), so the last rows of a sweep run up to its end: -c
    1024 -ub 256 -n 16 (its last prompt ends at the cache's last row), -c 1000 (not a multiple of
    ub) and -n 256 (the last row's TG tokens fill rows 768..1023). Every step of every row returns
    what the same row returns with a roomy cache (-c 2048): no write lands clamped on other rows."""
    import ikjax
    import numpy as np
    eng = ikjax.load(tiny_model, ctx=ctx, ubatch=256)
    assert eng.capacity == 1024
    got = _recorded_sweep(eng, tg)
    ref = _roomy_sweep(tiny_model, tg)[:len(got)]
    assert max(start for kind, start, _ in got if kind == "pp") + 256 <= eng.capacity  # ik's padded n_ctx
    if tg == 256:
        assert max(start for kind, start, _ in got if kind == "tg") + tg == eng.capacity
    assert [(k, s) for k, s, _ in got] == [(k, s) for k, s, _ in ref]
    for (kind, start, a), (_, _, b) in zip(got, ref):
        if kind == "tg":
            assert (a == b).all(), (start, a, b)
        else:
            assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max(), start


def test_tg_past_the_cache_is_refused_up_front(tiny_model):
    """-n larger than the last row has room for (N_KV 768 + 257 > 1024 rows) is one line before
    the model loads (ik's sweep-bench would stop at that row with "llama_decode() failed"); the
    library's run refuses it before any step."""
    import ikjax
    from ikjax.errors import OptionError
    res = CliRunner().invoke(app, ["sweep-bench", "-m", tiny_model, "-c", "1024", "-ub", "256", "-n", "257"])
    err = res.stderr.strip().splitlines()
    assert res.exit_code != 0 and len(err) == 1 and "-n 257" in err[0] and "-n 256 or less" in err[0], res.stderr
    assert "loaded" not in res.stderr and res.stdout.strip() == ""
    eng = ikjax.load(tiny_model, ctx=1024, ubatch=256)
    with pytest.raises(OptionError, match="past the KV cache"):
        next(sb.run(eng, 257))
    assert eng.compile_count == 0
    sb.check_tg_room(1024, 1024, 256, 256)  # fills the cache exactly: fine
    sb.check_tg_room(1024, 1024, 256, 300, stride=2)  # only rows 0 and 512 run their TG


@pytest.mark.parametrize("ctx, fa, n_kv_max, rows", [
    (500, True, 512, [0, 128, 256, 384]),   # ik pads n_ctx to 256 with flash attention
    (500, False, 512, [0, 128, 256, 384]),  # and to 32 without
    (300, True, 512, [0, 128, 256, 384]),
    (300, False, 320, [0, 128]),
    (4096, True, 4096, list(range(0, 4096, 128))),
])
def test_sweep_ctx_pads_as_ik(ctx, fa, n_kv_max, rows):
    """The sweep's context is ik's n_ctx (llama_context pads -c: 256 with -fa, 32 without), so its
    rows and the banner's n_kv_max are ik's for a -c that is not a multiple of 256."""
    from ikjax.options import RunOptions
    o = RunOptions.from_kwargs(ctx=ctx, fa=fa, ubatch=128)
    assert sb.sweep_ctx(o) == n_kv_max
    assert sb.measured_points(sb.sweep_ctx(o), 128) == rows
