"""Faults the engine must catch with one line (issue 21): non-finite weights, arguments that do
not fit the engine, a model file changed under a loaded engine, a context past the training one,
and the memory limits the plan must respect. Each case crafts its bad input from the tiny
synthetic model (tests/conftest.py) and runs on the XLA and the C++ CPU kernels backends."""
from __future__ import annotations

import logging
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import time
import tracemalloc

import numpy as np
import pytest

import ikjax
from ikjax.errors import ModelFileError, OptionError
from ikjax.gguf_io.reader import GGUFModelFile
from ikjax.runtime import buckets, memory_plan
from ikjax.runtime.sampling import NonFiniteLogitsError, sample_next

F16_NAN = struct.pack("<H", 0x7E00)


def _poke(src: str, dst, name: str, fill: bytes, count: int | None = None) -> str:
    """A copy of `src` whose tensor `name` has its first `count` bytes (all by default) replaced by
    `fill` repeated: the file's header and every other tensor as they were."""
    shutil.copy(src, dst)
    info = GGUFModelFile(src).tensors[name]
    n = info.nbytes if count is None else count
    with open(dst, "r+b") as f:
        f.seek(info.offset)
        f.write((fill * (n // len(fill) + 1))[:n])
    return str(dst)


def _nan_q8_block(src, dst, name: str) -> str:
    """One Q8_0 block of `name` with a NaN scale (f16 0x7E00): 32 NaN weights."""
    return _poke(src, dst, name, F16_NAN, 2)


BACKENDS = ["xla", "cpu"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("IKJAX_KERNELS", request.param)
    return request.param


# every case on the default CPU path; on the XLA path the case whose failure differed there (BOS
# silently), the two others in the slow run (the check itself is the same code on both paths)
_SLOW = pytest.mark.slow
@pytest.mark.parametrize("backend,case", [
    ("cpu", "inf_output_norm"), ("cpu", "nan_output_block"), ("cpu", "nan_before_router"),
    ("xla", "nan_before_router"),
    pytest.param("xla", "inf_output_norm", marks=_SLOW), pytest.param("xla", "nan_output_block", marks=_SLOW),
], indirect=["backend"])
def test_non_finite_weights_stop_with_one_line(tiny_model, tmp_path, backend, case):
    """Inf in output_norm, a NaN block in output.weight, NaN before a router: greedy generate used
    to print BOS four times (argmax of NaN), host sampling raised IndexError, and a NaN router
    score named expert 120 of 16. Now every path stops with one error naming the tensor."""
    if case == "inf_output_norm":
        path, tensor = _poke(tiny_model, tmp_path / "m.gguf", "output_norm.weight", struct.pack("<f", np.inf)), \
            "output_norm.weight"
    elif case == "nan_output_block":
        path, tensor = _nan_q8_block(tiny_model, tmp_path / "m.gguf", "output.weight"), "output.weight"
    else:
        path, tensor = _poke(tiny_model, tmp_path / "m.gguf", "blk.1.ffn_norm.weight",
                             struct.pack("<f", np.nan)), "blk.1.ffn_norm.weight"
    eng = ikjax.load(path, ctx=64, ubatch=16)
    prompt = [0, 5, 9, 17]
    for kwargs in (dict(temperature=0.0), dict(temperature=0.8, seed=1)):
        with pytest.raises(NonFiniteLogitsError, match=f"non-finite logits.*tensor {tensor}"):
            list(eng.generate(prompt, 4, **kwargs))
    with pytest.raises(NonFiniteLogitsError, match=tensor):
        eng.logits(prompt)
    # the decode loop alone (the tokens come back as -1, refused on the host)
    with pytest.raises(NonFiniteLogitsError, match=f"decode step 0 .*{tensor}"):
        eng.decode(eng.new_cache(1), [5], [0], 4, chunk=4)
    # the host sampler, the path without the decode loop
    logits, _ = eng.step(eng.new_cache(1), np.array([[5]]), np.array([0]))
    with pytest.raises(NonFiniteLogitsError):
        sample_next(np.asarray(logits)[0], temperature=0.7)


def test_nan_router_scores_pick_experts_in_range():
    """The rank top-k (the decode router) ranks NaN last: ids stay inside [0, e)."""
    import jax.numpy as jnp

    from ikjax.model.moe import top_k
    x = jnp.array([[np.nan] * 16, [0.5, np.nan, 2.0, np.nan] + [0.0] * 12], jnp.float32)
    vals, ids = top_k(x, 6)
    ids = np.asarray(ids)
    assert ids.min() >= 0 and ids.max() < 16
    assert ids[1, :2].tolist() == [2, 0]
    assert len(set(ids[0].tolist())) == 6


def test_finite_model_generates_as_before(tiny_model):
    """The checks leave a healthy model's output alone (decode loop and host sampling agree)."""
    eng = ikjax.load(tiny_model, ctx=64, ubatch=16)
    a = list(eng.generate([0, 5, 9, 17], 6))
    assert len(a) >= 1 and all(0 <= t < eng.config.vocab_size for t in a)


# -- arguments --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def eng(tiny_model):
    return ikjax.load(tiny_model, ctx=256, ubatch=16)


def test_step_refuses_foreign_caches(eng, tiny_model, tiny4_model):
    """A cache of another batch, another -ctk or another model: one line naming `cache`, not a
    JAX TypeError from inside the executable."""
    toks, start = np.array([[5]]), np.array([0])
    with pytest.raises(OptionError, match="^cache: "):
        eng.step(eng.new_cache(2), toks, start)
    other_ctk = ikjax.load(tiny_model, ctx=256, ubatch=16, ctk="q8_0")
    with pytest.raises(OptionError, match="^cache: "):
        eng.step(other_ctk.new_cache(1), toks, start)
    other_model = ikjax.load(tiny4_model, ctx=256, ubatch=16)
    with pytest.raises(OptionError, match="^cache: "):
        eng.step(other_model.new_cache(1), toks, start)
    cache = eng.new_cache(1)
    _, cache2 = eng.step(cache, toks, start)
    with pytest.raises(OptionError, match="already consumed"):
        eng.step(cache, toks, start)
    with pytest.raises(OptionError, match="^cache: "):
        eng.decode(eng.new_cache(2), [5], [0], 2)


@pytest.mark.parametrize("kw,match", [
    (dict(start=np.array([-5])), "^start: positions must be >= 0"),
    (dict(start=np.array([1000])), "^start: .*past the cache"),
    (dict(tokens=np.array([[5000]])), "^tokens: token id 5000"),
    (dict(tokens=np.array([[-1]])), "^tokens: token id -1"),
    (dict(tokens=np.array([[5.0]])), "^tokens: expected integers"),
    (dict(tokens=np.array([5])), "^tokens: expected a non-empty 2-D"),
    (dict(start=np.array([0, 0])), "^start: expected 1 entries"),
    (dict(start=np.array([0.5])), "^start: expected integers"),
    (dict(last=np.array([3])), "^last: indices must lie in"),
])
def test_step_validates_its_inputs(eng, kw, match):
    args = dict(tokens=np.array([[5]]), start=np.array([0]), last=None) | kw
    cache = eng.new_cache(1)
    with pytest.raises(OptionError, match=match):
        eng.step(cache, **args)
    logits, _ = eng.step(cache, np.array([[5]]), np.array([0]))  # the cache is untouched by a refusal
    assert np.isfinite(np.asarray(logits)).all()


def test_decode_prefill_validate_their_inputs(eng):
    with pytest.raises(OptionError, match="^start: positions must be >= 0"):
        eng.decode(eng.new_cache(1), [5], [-5], 2)
    with pytest.raises(OptionError, match="^start: .*past the cache"):
        eng.decode(eng.new_cache(1), [5], [1000], 2)
    with pytest.raises(OptionError, match="^tokens: token id 99999"):
        eng.decode(eng.new_cache(1), [99999], [0], 2)
    with pytest.raises(OptionError, match="^tokens: expected integers"):
        eng.decode(eng.new_cache(1), [5.5], [0], 2)
    with pytest.raises(OptionError, match="^decode: need integers"):
        eng.decode(eng.new_cache(1), [5], [0], 2.0)
    with pytest.raises(OptionError, match="^ids: token id 4096"):
        eng.prefill(eng.new_cache(1), [1, 4096])
    with pytest.raises(OptionError, match="^ids: must be a non-empty 1-D integer"):
        eng.prefill(eng.new_cache(1), [1.0, 2.0])
    with pytest.raises(OptionError, match="^start: expected an integer position"):
        eng.prefill(eng.new_cache(1), [1, 2], start=-5)
    with pytest.raises(OptionError, match="^token ids: token id -3"):
        eng.logits([1, -3])


# -- the model file changed under a loaded engine -----------------------------------------------------

def test_rewritten_file_is_refused(tiny_model, tmp_path):
    """Rewritten in place (same inode, new bytes): the next step refuses, naming the file."""
    path = shutil.copy(tiny_model, tmp_path / "m.gguf")
    eng = ikjax.load(path, ctx=64, ubatch=16)
    first = eng.logits([0, 5, 9])
    data = bytearray(open(path, "rb").read())
    info = eng.file.tensors["output_norm.weight"]
    data[info.offset:info.offset + 4] = struct.pack("<f", 3.0)
    time.sleep(0.01)  # a coarse-grained mtime still moves: the size stays, so mtime is what tells
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    with pytest.raises(ModelFileError, match="modified since it was loaded"):
        eng.logits([0, 5, 9])
    with pytest.raises(ModelFileError, match="modified since it was loaded"):
        list(eng.generate([0, 5, 9], 3))
    assert np.isfinite(first).all()


TRUNCATE = textwrap.dedent("""
    import os, sys
    import ikjax
    from ikjax.errors import IkjaxError
    path = sys.argv[1]
    eng = ikjax.load(path, ctx=64, ubatch=16)
    eng.logits([0, 5, 9])
    os.truncate(path, os.path.getsize(path) // 2)
    for call in (lambda: eng.logits([0, 5, 9]), lambda: list(eng.generate([0, 5], 3))):
        try:
            call()
        except IkjaxError as e:
            print("REFUSED", e)
""")


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_truncated_file_is_refused_before_the_mapping_is_read(tiny_model, tmp_path, backend_name):
    """Truncated under a loaded engine: refused before any step reads the mapping (which would be
    SIGBUS: the test runs it in a child so a crash shows as its exit status)."""
    path = shutil.copy(tiny_model, tmp_path / "m.gguf")
    env = dict(os.environ, IKJAX_KERNELS=backend_name)
    r = subprocess.run([sys.executable, "-c", TRUNCATE, str(path)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("REFUSED")]
    assert len(lines) == 2 and all("truncated from" in ln for ln in lines), r.stdout


# -- context past the training one -----------------------------------------------------------------

def test_context_past_training_context_warns(tiny_model, tmp_path, caplog, monkeypatch):
    from gguf_craft import build, parse, set_kv, u32
    # a library imported by an earlier test may have configured logging with
    # disable_existing_loggers (logging.config.dictConfig): the note must still reach caplog
    monkeypatch.setattr(logging.getLogger("ikjax"), "disabled", False)
    monkeypatch.setattr(logging.getLogger("ikjax"), "propagate", True)
    g = parse(open(tiny_model, "rb").read())
    set_kv(g, "deepseek2.context_length", u32(16))
    path = tmp_path / "m.gguf"
    path.write_bytes(build(g))
    with caplog.at_level(logging.WARNING, logger="ikjax"):
        ikjax.load(str(path), ctx=256, ubatch=16)
    notes = [r.getMessage() for r in caplog.records if "training context" in r.getMessage()]
    assert len(notes) == 1 and "-c 256" in notes[0] and "context_length 16" in notes[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ikjax"):
        ikjax.load(str(path), ctx=16, ubatch=16)
    assert not [r for r in caplog.records if "training context" in r.getMessage()]


# -- the KV-bucket rule at huge contexts ---------------------------------------------------------------

def _quadratic_best_units(M: int, budget: int) -> tuple[int, ...]:
    """The former rule, every ratio enumerated and every (i, j) tried: the oracle for the linear one."""
    k_max = min(budget, M)
    if k_max == 1:
        return (M,)

    def fits(rho):
        b, k = 1, 1
        while b < M:
            nxt = min(M, int(rho * (b + 1) + 1e-9))
            if nxt <= b or k == k_max:
                return False
            b, k = nxt, k + 1
        return True

    i, j = np.triu_indices(M + 1, 1)
    ratios = np.unique(j / (i + 1.0))
    lo, hi = 0, len(ratios) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(ratios[mid]) else (mid + 1, hi)
    rho = ratios[lo] + 1e-9
    H = np.concatenate([[0.0], np.cumsum(1.0 / np.arange(1, M + 1))])
    f = np.full((k_max + 1, M + 1), np.inf)
    arg = np.zeros((k_max + 1, M + 1), np.int64)
    f[1, 1] = 1.0
    prev = np.arange(M + 1)
    for k in range(2, k_max + 1):
        for j in range(k, M + 1):
            cand = np.where(j <= rho * (prev[:j] + 1), f[k - 1, :j] + j * (H[j] - H[:j]), np.inf)
            i = int(np.argmin(cand))
            f[k, j], arg[k, j] = cand[i], i
    k = int(np.argmin(f[1:, M])) + 1
    units, j = [], M
    while k > 0:
        units.append(j)
        j, k = int(arg[k, j]), k - 1
    return tuple(sorted(units))


@pytest.mark.parametrize("M", list(range(1, 41)) + [64, 100, 127, 128, 129, 300, 512])
def test_linear_bucket_rule_places_buckets_as_the_quadratic_one(M):
    for budget in range(1, 12):
        assert buckets._best_units(M, budget) == _quadratic_best_units(M, budget), (M, budget)


def test_huge_context_builds_its_buckets_fast_and_small():
    """-c 1000000 -ub 64: the old table was (ctx/ub)^2 (4.5 GiB, 19 s before the first step)."""
    buckets.prompt_buckets.cache_clear()
    buckets._best_units.cache_clear()
    tracemalloc.start()
    t0 = time.perf_counter()
    got = buckets.prompt_buckets(1_000_000, 64, 256, 1_000_192)
    dt = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert dt < 0.5 and peak < 64 << 20, (dt, peak)
    assert got[0] == 256 and got[-1] == 1_000_192 and list(got) == sorted(set(got))
    assert buckets.kv_bucket(500_000, 1_000_000, 64, 256, 1_000_192) >= 500_000


# -- memory limits ----------------------------------------------------------------------------------

def test_available_memory_respects_rlimit_as():
    """Under an address-space limit the plan sees that limit less the address space in use, named."""
    code = textwrap.dedent("""
        import resource
        from ikjax.runtime import memory_plan
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, resource.RLIM_INFINITY))
        avail, src = memory_plan.available_memory()
        print(avail, "|", src)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    avail, src = r.stdout.strip().rsplit("\n", 1)[-1].split(" | ")
    assert "RLIMIT_AS 3072 MiB" in src, r.stdout + r.stderr
    assert 0 < int(avail) < 3 << 30


def test_available_memory_respects_the_process_cgroup(tmp_path, monkeypatch):
    limit, usage = tmp_path / "memory.max", tmp_path / "memory.current"
    limit.write_text(str(1 << 30))
    usage.write_text(str(256 << 20))
    monkeypatch.setattr(memory_plan, "_own_cgroups", lambda: [(str(limit), str(usage))])
    avail, src = memory_plan.available_memory()
    assert avail == (1 << 30) - (256 << 20) and "cgroup memory limit 1024 MiB" in src
    limit.write_text("max")  # v2's "no limit"
    assert memory_plan.available_memory()[1] in ("MemAvailable",) or "RLIMIT_AS" in memory_plan.available_memory()[1]


def test_own_cgroups_walks_up_from_the_process_cgroup(monkeypatch, tmp_path):
    fake = tmp_path / "cgroup"
    fake.write_text("0::/user.slice/job.scope\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: real_open(fake if p == "/proc/self/cgroup" else p,
                                                                          *a, **k))
    files = [lim for lim, _ in memory_plan._own_cgroups()]
    assert files[:3] == ["/sys/fs/cgroup/user.slice/job.scope/memory.max", "/sys/fs/cgroup/user.slice/memory.max",
                         "/sys/fs/cgroup/memory.max"]


def test_plan_refuses_a_step_past_rlimit_as(tiny_model):
    """`generate -c 1000000 -ub 4096` under `prlimit --as=2G` died in the first step with
    RESOURCE_EXHAUSTED; the fit check now refuses it first, naming RLIMIT_AS."""
    code = textwrap.dedent("""
        import resource, sys
        import ikjax
        from ikjax.errors import DoesNotFitError
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, resource.RLIM_INFINITY))
        try:
            eng = ikjax.load(sys.argv[1], ctx=1000000, ubatch=4096)
            list(eng.generate([0, 5, 9], 2))
        except DoesNotFitError as e:
            print("REFUSED", e)
    """)
    r = subprocess.run([sys.executable, "-c", code, tiny_model], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "REFUSED" in r.stdout and "RLIMIT_AS" in r.stdout, r.stdout + r.stderr[-2000:]
