"""llama-bench style runs: pp512 / tg128 / pp512+tg128 / tg64@pp8192, comma lists swept as a
Cartesian product.

Tests, as ik_llama.cpp's llama-bench runs them: `ppN` processes N prompt tokens (timed); `tgN`
generates N tokens one at a time (timed); `ppP+tgT` (`-pg P,T`) processes P prompt tokens then
generates T, timed together, t/s = (P+T)/time; `tgT@ppP` (`-gp P,T`) processes P prompt tokens
untimed, then times T generated tokens. `-d D` (mainline's depth) puts D untimed tokens in the cache
before a pp/tg test (`pp512@d4096`).

Each parameter combination loads the model once (a combination that fails to load or run becomes an
error row and the sweep goes on); each test runs one untimed warm-up (it compiles) and `-r`
timed repetitions, reported as mean ± sd of tokens/s. JSON/JSONL/CSV records carry llama-bench's
keys and types (`model_size` int bytes, `flash_attn` bool, `mla_attn` int, `avg_ts` float, ...).
"""
from __future__ import annotations

import contextlib
import csv
import io
import itertools
import json
import math
import os
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import numpy as np

# bench parameter -> RunOptions name; these may be comma lists
SWEPT = {"ngl": "ngl", "split_mode": "split_mode", "batch": "batch", "ubatch": "ubatch", "ctk": "ctk", "ctv": "ctv", "fa": "fa", "mla": "mla",
         "amb": "amb", "ser": "ser", "fmoe": "fmoe", "ot": "ot", "dtype": "dtype", "threads": "threads"}
# (in llama-bench's loop order, the first varying slowest: ngl, sm, n_batch, n_ubatch, type_k, type_v,
# fa, mla, amb, ser, threads; fmoe, ot and dtype, which it does not sweep, just before the threads)
# markdown column names (llama-bench's)
COLUMN = {"split_mode": "sm", "mla": "mla", "fa": "fa", "ubatch": "n_ubatch", "batch": "n_batch", "ctk": "type_k", "ctv": "type_v",
          "amb": "amb", "fmoe": "fmoe", "ser": "ser", "ot": "ot", "ngl": "ngl", "threads": "threads", "dtype": "dtype"}


@dataclass(frozen=True)
class Test:
    """One llama-bench test. kind: pp, tg, pg (`ppP+tgT`, timed together) or gp (`tgT@ppP`)."""
    name: str
    n_prompt: int
    n_gen: int
    n_depth: int
    kind: str = ""

    def __post_init__(self):
        if not self.kind:
            object.__setattr__(self, "kind", "pp" if self.n_prompt and not self.n_gen else "tg")

    @property
    def n_tokens(self) -> int:
        """Cache positions the test fills."""
        return self.n_prompt + self.n_gen + self.n_depth

    @property
    def timed_tokens(self) -> int:
        """Tokens per timed run, as ik counts them: the prompt is timed in pp and pg only."""
        return {"pp": self.n_prompt, "tg": self.n_gen, "pg": self.n_prompt + self.n_gen, "gp": self.n_gen}[self.kind]


def make_tests(n_prompt: list[int], n_gen: list[int], gp: list[tuple[int, int]], depth: list[int],
               pg: list[tuple[int, int]] = ()) -> list[Test]:
    """llama-bench's order: pp, tg (for each depth), then -pg, then -gp tests."""
    tests = []
    for d in depth:
        suffix = f"@d{d}" if d else ""
        tests += [Test(f"pp{p}{suffix}", p, 0, d, "pp") for p in n_prompt if p > 0]
        tests += [Test(f"tg{n}{suffix}", 0, n, d, "tg") for n in n_gen if n > 0]
    tests += [Test(f"pp{pp}+tg{tg}", pp, tg, 0, "pg") for pp, tg in pg if pp or tg]
    tests += [Test(f"tg{tg}@pp{pp}", pp, tg, 0, "gp") for pp, tg in gp if pp or tg]
    return tests


def split_list(value: Any, name: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    if name == "ot":  # REGEX=DEV,REGEX=DEV is one rule list; several lists are separated by ';'
        return [v for v in str(value).split(";") if v]
    if name == "ser":  # "Kmin,t" is one value; several are separated by ';', or, as llama-bench
        # writes them, all by commas ("2,1,3,0.5": two settings)
        out = []
        for v in str(value).split(";"):
            parts = [x for x in v.split(",") if x.strip() != ""]
            if len(parts) > 2 and len(parts) % 2 == 0:
                out += [f"{parts[k]},{parts[k + 1]}" for k in range(0, len(parts), 2)]
            elif v:
                out.append(v)
        return out
    return [v.strip() for v in str(value).split(",") if v.strip() != ""]


def int_list(value: Any, name: str) -> list[int]:
    from ikjax.errors import OptionError
    out = []
    for v in split_list(value, name):
        try:
            out.append(int(v))
        except ValueError:
            raise OptionError(f"{name}: expected integers separated by commas, got {value!r}") from None
    return out


def combinations(params: dict[str, Any]) -> list[dict[str, str]]:
    """Cartesian product of the comma lists, in llama-bench order (first parameter varies slowest)."""
    keys = [k for k in SWEPT if params.get(k) not in (None, "")]
    lists = [split_list(params[k], k) for k in keys]
    return [dict(zip(keys, vals)) for vals in itertools.product(*lists)]


@lru_cache(maxsize=1)
def build_info() -> tuple[str, int]:
    """(short commit, commit count) of the ikjax checkout, as llama-bench's build_commit/build_number;
    ("unknown", 0) outside a git checkout."""
    repo = Path(__file__).resolve().parents[1]
    try:
        run = lambda *a: subprocess.run(["git", "-C", str(repo), *a], capture_output=True, text=True,  # noqa: E731
                                        timeout=5, check=True).stdout.strip()
        return run("rev-parse", "--short", "HEAD"), int(run("rev-list", "--count", "HEAD"))
    except (OSError, subprocess.SubprocessError, ValueError):
        return "unknown", 0


def option_fields(opts: dict[str, Any]) -> dict[str, Any]:
    """llama-bench's parameter fields, typed, from ikjax.load keyword arguments. A value that does not
    validate (the combination could not load) keeps its text, so the error row still shows it."""
    from ikjax.errors import OptionError
    from ikjax.options import RunOptions
    try:
        o = RunOptions.from_kwargs(**opts)
        get = lambda name: getattr(o, name)  # noqa: E731
    except OptionError:
        def get(name):
            try:
                return getattr(RunOptions.from_kwargs(**({name: opts[name]} if name in opts else {})), name)
            except OptionError:
                return str(opts[name])
    cpus = os.cpu_count() or 1
    ser = get("ser")
    ot = get("ot")
    t = get("threads")
    tb = get("threads_batch")
    # -ub as typed (llama-bench's `n_ubatch = inst.n_ubatch`; the context clamps it to -b): the
    # clamped value labelled `-ub 2048,4096` with -b 2048 as two rows of 2048
    ub = opts.get("ubatch", opts.get("ub"))
    ub = int(ub) if isinstance(ub, (int, str)) and not isinstance(ub, bool) and str(ub).strip().isdigit() else None
    return {
        "n_batch": get("batch"), "n_ubatch": ub if ub else get("ubatch"),
        "n_threads": t or cpus if isinstance(t, int) else t,
        "n_threads_batch": (tb or t or cpus) if isinstance(tb, int) and isinstance(t, int) else tb,
        "type_k": get("ctk"), "type_v": (get("ctv") or get("ctk")),
        "n_gpu_layers": get("ngl"), "flash_attn": get("fa"), "mla_attn": get("mla"), "attn_max_batch": get("amb"),
        "ser": (f"{ser.min_experts},{ser.threshold:g}" if ser is not None and not isinstance(ser, str)
                else ser if isinstance(ser, str) else "-1,0"),
        "fused_moe": get("fmoe"),
        "override_tensor": (",".join(f"{r.pattern}={r.device}" for r in ot) if not isinstance(ot, str) else ot),
        "dtype": get("dtype"), "split_mode": get("split_mode"), "main_gpu": get("main_gpu"),
        "tensor_split": _tensor_split_text(get("tensor_split")),
    }


def _tensor_split_text(shares: Any) -> str:
    """ik's tensor_split field: '%.2f' shares joined by '/' up to the last non-zero one ('0.00': none)."""
    if isinstance(shares, str):
        return shares
    shares = list(shares or [0.0])
    last = max([i for i, x in enumerate(shares) if x > 0] or [0])
    return "/".join("%.2f" % x for x in shares[:last + 1])


def backend_name() -> str:
    """The backend column as ik's llama-bench names its build: CUDA on an NVIDIA GPU (ROCm on an
    AMD one), CPU on the CPU; another JAX platform by its own name."""
    import jax
    platform = jax.default_backend()
    if platform == "gpu" or platform == "cuda" or platform == "rocm":
        version = str(getattr(jax.devices()[0].client, "platform_version", "")).lower()
        return "ROCm" if platform == "rocm" or "rocm" in version else "CUDA"
    return platform.upper()


@lru_cache(maxsize=1)
def cpu_info() -> str:
    """ik's cpu_info: the first 'model name' of /proc/cpuinfo ('' elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("model name") and ":" in line:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@lru_cache(maxsize=1)
def gpu_info() -> str:
    """ik's gpu_info: each accelerator's name, joined by '/' ('' on the CPU)."""
    import jax
    return "/".join(d.device_kind for d in jax.devices() if d.platform != "cpu")


@dataclass
class Result:
    model: str
    params: dict[str, str]
    test: Test | None
    samples_ts: list[float] = field(default_factory=list)
    samples_ns: list[int] = field(default_factory=list)
    error: str | None = None
    model_info: dict[str, Any] = field(default_factory=dict)
    fields: dict[str, Any] = field(default_factory=dict)  # option_fields of the run (typed)
    backend: str = ""
    switches: dict[str, Any] = field(default_factory=dict)  # ik's switches as given (noted: no effect here)
    test_time: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))

    @property
    def avg_ts(self) -> float:
        return statistics.fmean(self.samples_ts) if self.samples_ts else 0.0

    @property
    def stddev_ts(self) -> float:
        return statistics.stdev(self.samples_ts) if len(self.samples_ts) > 1 else 0.0

    def ts_text(self) -> str:
        if self.error:
            return f"skipped: {self.error}"
        return f"{self.avg_ts:.2f} ± {self.stddev_ts:.2f}"

    def record(self) -> dict[str, Any]:
        """One llama-bench record: every key ik's llama-bench writes, in its order and JSON types,
        with ikjax's values; then ikjax's own `n_depth` (mainline's -d), `dtype` and `error` (null,
        or why the row was skipped)."""
        commit, number = build_info()
        f = self.fields
        t = self.test
        backend = self.backend or "CPU"
        gen = bool(t and t.n_gen > 0)  # ik: a test that generates reports the generation threads
        ns = [int(x) for x in self.samples_ns]
        r: dict[str, Any] = {
            "build_commit": commit, "build_number": number,
            "cuda": backend == "CUDA", "vulkan": False, "metal": False, "sycl": False, "rpc": "0",
            "gpu_blas": False, "blas": False, "cpu_info": cpu_info(), "gpu_info": gpu_info(),
            "model_filename": self.model,
            **{k: self.model_info.get(k) for k in ("model_type", "model_size", "model_n_params")},
            "n_batch": f.get("n_batch"), "n_ubatch": f.get("n_ubatch"),
            "n_threads": f.get("n_threads") if gen else f.get("n_threads_batch"),
            "type_k": f.get("type_k"), "type_v": f.get("type_v"), "n_gpu_layers": f.get("n_gpu_layers"),
            "split_mode": f.get("split_mode", "none"), "main_gpu": f.get("main_gpu", 0),
            "no_kv_offload": bool(self.switches.get("nkvo")), "flash_attn": f.get("flash_attn"),
            "mla_attn": f.get("mla_attn"), "attn_max_batch": f.get("attn_max_batch"), "ser": f.get("ser"),
            "reuse": True,  # ikjax runs each compiled step again for every call of its shape
            "tensor_split": f.get("tensor_split", "0.00"),
            "use_mmap": True,  # the GGUF is always mapped read-only (-mmp 0 is noted)
            "embeddings": False,
            **{key: bool(self.switches.get(name)) for key, name in (
                ("repack", "rtr"), ("mqkv", "mqkv"), ("muge", "muge"), ("defer_experts", "defer_experts"))},
            "fused_moe": f.get("fused_moe"), "grouped_er": bool(self.switches.get("ger")),
            "no_fused_up_gate": False, "use_thp": bool(self.switches.get("thp")),
            "no_ooae": bool(self.switches.get("no_ooae")), "rcache": False, "sas": False, "max_gpu": 0,
            "cuda_params": str(self.switches.get("cuda") or ""), "override_tensor": f.get("override_tensor"),
            "n_prompt": t.n_prompt if t else 0, "n_gen": t.n_gen if t else 0, "test_time": self.test_time,
            "avg_ns": int(statistics.fmean(ns)) if ns else 0,
            "stddev_ns": int(statistics.stdev(ns)) if len(ns) > 1 else 0,
            "avg_ts": float(self.avg_ts), "stddev_ts": float(self.stddev_ts), "test": t.name if t else "",
            "samples_ns": ns, "samples_ts": [float(x) for x in self.samples_ts],
            "n_depth": t.n_depth if t else 0, "dtype": f.get("dtype"), "error": self.error,
        }
        return r


# llama_ftype (general.file_type) -> ik's llama_model_ftype_name
FTYPE_NAMES = {
    0: "all F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K - Medium",
    11: "Q3_K - Small", 12: "Q3_K - Medium", 13: "Q3_K - Large", 14: "Q4_K - Small", 15: "Q4_K - Medium",
    16: "Q5_K - Small", 17: "Q5_K - Medium", 18: "Q6_K", 19: "IQ2_XXS - 2.0625 bpw", 20: "IQ2_XS - 2.3125 bpw",
    21: "Q2_K - Small", 22: "IQ3_XS - 3.3 bpw", 23: "IQ3_XXS - 3.0625 bpw", 24: "IQ1_S - 1.5625 bpw",
    25: "IQ4_NL - 4.5 bpw", 26: "IQ3_S - 3.4375 bpw", 27: "IQ3_S mix - 3.66 bpw", 28: "IQ2_S - 2.5 bpw",
    29: "IQ2_M - 2.7 bpw", 30: "IQ4_XS - 4.25 bpw", 31: "IQ1_M - 1.75 bpw", 32: "BF16", 33: "Q4_0_4_4",
    34: "Q4_0_4_8", 35: "Q4_0_8_8", 38: "MXFP4 - 4.25 bpw", 41: "Q1_0_G128 - 1.125 bpw", 135: "Q6_0",
    136: "IQ1_BN - 1.625 bpw Bitnet", 137: "IQ2_BN - 2.00 bpw Bitnet", 138: "IQ2_K - 2.375 bpw",
    139: "IQ3_K - 3.4325 bpw", 140: "IQ4_K - 4.5 bpw", 141: "IQ5_K - 5.5 bpw", 142: "IQ6_K - 6.6 bpw",
    145: "IQ4_KS - 4.25 bpw", 146: "IQ3_KL - 4 bpw", 147: "IQ2_KS - 2.1875 bpw", 148: "IQ4_KSS - 4.0 bpw",
    149: "Q8_KV", 150: "IQ5_KS - 5.25 bpw", 151: "IQ2_KT - 2.125 bpw", 152: "IQ3_KT - 3.125 bpw",
    153: "IQ4_KT - 4.0 bpw", 154: "IQ3_KS - 3.1875 bpw", 155: "IQ2_KL - 2.6875 bpw", 156: "IQ1_KT - 1.75 bpw",
    202: "Q4_0_R8 - 4.5 bpw", 207: "Q8_0_R8 - 8.5 bpw", 208: "Q5_0_R4 - 5.5 bpw", 210: "Q2_K_R4", 211: "Q3_K_R4",
    214: "Q4_K_R4", 216: "Q5_K_R4", 218: "Q6_K_R4", 219: "IQ2_XXS_R4 - 2.0625 bpw", 220: "IQ2_XS_R4 - 2.3125 bpw",
    223: "IQ3_XXS_R4 - 3.0625 bpw", 224: "IQ1_S_R4 - 1.5 bpw", 225: "IQ4_NL_R4 - 4.5 bpw",
    226: "IQ3_S_R4 - 3.4375 bpw", 229: "IQ2_M_R4 - 2.7 bpw", 230: "IQ4_XS_R8 - 4.25 bpw", 231: "IQ1_M_R4 - 1.75 bpw",
    232: "BF16_R16", 335: "Q6_0_R4 - 6.5 bpw", 337: "IQ2_BN_R4 - 2.00 bpw Bitnet", 338: "IQ2_K_R4 - 2.375 bpw",
    339: "IQ3_K_R4 - 3.4325 bpw", 340: "IQ4_K_R4 - 4.5 bpw", 341: "IQ5_K_R4 - 5.5 bpw", 345: "IQ4_KS_R4 - 4.25 bpw",
    350: "IQ5_KS_R4 - 5.25 bpw", 398: "Q8_KV_R8", 399: "Q8_K_R8",
}
# without general.file_type ik guesses from the most common tensor type (these differ from the type's name)
GUESSED_FTYPE = {"F32": "all F32", "Q2_K": "Q2_K - Medium", "Q3_K": "Q3_K - Medium", "Q4_K": "Q4_K - Medium",
                 "Q5_K": "Q5_K - Medium", "IQ2_S": "IQ2_M - 2.7 bpw"}
# ik's model type of a deepseek2 file, by its layer count (llm_load_hparams); any other: "?B"
DEEPSEEK2_TYPES = {27: "16B", 36: "119B.A6B", 47: "30B.A3B", 60: "236B", 61: "671B"}


def model_desc(f) -> str:
    """ik's llama_model_desc: '<arch> <model type> <file type>', e.g. 'deepseek2 16B Q4_0' — the
    model type from the layer count (not general.size_label), the file type from general.file_type
    or, missing, guessed from the most common tensor type."""
    arch = f.architecture
    n_layer = f.metadata.get(f"{arch}.block_count")
    mtype = DEEPSEEK2_TYPES.get(int(n_layer), "?B") if arch == "deepseek2" and n_layer is not None else "?B"
    ftype = f.metadata.get("general.file_type")
    if ftype is not None:
        fname = FTYPE_NAMES.get(int(ftype), "unknown, may not work")
    else:
        counts: dict[str, int] = {}
        best, n_best = "F32", 0
        for t in f.tensors.values():
            counts[t.type_name] = counts.get(t.type_name, 0) + 1
            if counts[t.type_name] > n_best:
                best, n_best = t.type_name, counts[t.type_name]
        guess = GUESSED_FTYPE.get(best, best)
        fname = (guess if guess in FTYPE_NAMES.values() else "all F32") + " (guessed)"
    return f"{arch} {mtype} {fname}"


def model_info(path: str) -> dict[str, Any]:
    """model_type ('deepseek2 16B Q4_0', ik's), model_size (bytes), model_n_params, from the header only."""
    from ikjax.gguf_io.reader import GGUFModelFile
    f = GGUFModelFile(path)
    size = sum(t.nbytes for t in f.tensors.values())
    n_params = sum(math.prod(t.shape) for t in f.tensors.values())
    return {"model_type": model_desc(f), "model_size": int(size), "model_n_params": int(n_params)}


def _random_ids(rng, vocab: int, n: int) -> np.ndarray:
    return rng.integers(0, vocab, n).astype(np.int32)


def run_test(eng, test: Test, reps: int, rng, warmup: bool = True) -> tuple[list[float], list[int]]:
    """Warm-up (untimed, compiles) then `reps` timed runs; (tokens/s per rep, ns per rep). Without
    `warmup` (ik's -w 0) the first timed run compiles and loads the steps, as ik's pays its own
    first-run costs."""
    vocab = eng.config.vocab_size
    ts, ns = [], []
    first = 0 if warmup else 1
    for rep in range(first, reps + 1):
        with (eng.uncounted() if rep == 0 else contextlib.nullcontext()):  # a warm-up: not the user's tokens
            ts_ns = _run_once(eng, test, rng, vocab)
        if rep > 0:
            ns.append(ts_ns)
            ts.append(test.timed_tokens / (ts_ns / 1e9))
    return ts, ns


def _run_once(eng, test: Test, rng, vocab: int) -> int:
    """One run of `test`: its untimed context, then the timed part; returns the timed ns."""
    cache = eng.new_cache(1)
    pos = 0
    if test.kind in ("pp", "tg") and test.n_depth:
        _, cache = eng.prefill(cache, _random_ids(rng, vocab, test.n_depth), 0)
        pos = test.n_depth
    if test.kind == "gp":  # the prompt is context, not timed
        _, cache = eng.prefill(cache, _random_ids(rng, vocab, test.n_prompt), 0)
        pos = test.n_prompt
    prompt = _random_ids(rng, vocab, test.n_prompt) if test.kind in ("pp", "pg") else None
    tok = np.array([[int(rng.integers(0, vocab))]], np.int32)
    t0 = time.perf_counter_ns()
    if prompt is not None and len(prompt):
        _, cache = eng.prefill(cache, prompt, pos)  # returns host logits: synchronized
        pos += len(prompt)
    if test.kind != "pp" and test.n_gen and eng.decode_loop():  # the n_gen steps in one dispatch
        out, cache = eng.decode(cache, tok[0], [pos], test.n_gen)
        out.block_until_ready()
    elif test.kind != "pp":
        for i in range(test.n_gen):
            out, cache = eng.step(cache, tok, np.array([pos + i]))
            out.block_until_ready()
    return time.perf_counter_ns() - t0


def run_bench(models: list[str], params: dict[str, Any], tests: list[Test], reps: int,
              on_result: Callable[[Result], None], on_status: Callable[[str], None] | None = None,
              extra_options: dict[str, Any] | None = None, seed: int = 0, warmup: bool = True,
              switches: dict[str, Any] | None = None,
              on_engine: Callable[[Any], None] | None = None) -> list[Result]:
    """Every test of every combination of `params` (comma lists) on every model; `switches`: ik's
    switches as given, recorded in the JSON/CSV fields they have; `warmup`: llama-bench's -w;
    `on_engine(engine)`: each combination's engine once its tests ran (bench --expert-stats)."""
    from ikjax.errors import IkjaxError
    from ikjax.runtime.engine import load
    backend = backend_name()
    results = []
    sw = dict(switches or {})
    ctx_needed = max((t.n_tokens for t in tests), default=1)
    for model in models:
        try:
            info = model_info(model)
        except IkjaxError as e:
            r = Result(model, {}, None, error=str(e), backend=backend, switches=sw)
            results.append(r)
            on_result(r)
            continue
        for combo in combinations(params):
            opts = dict(extra_options or {})
            opts.update({SWEPT[k]: v for k, v in combo.items()})
            if "/" in str(opts.get("threads", "")):  # a -tgb pair: generation / prompt threads
                opts["threads"], opts["threads_batch"] = str(opts["threads"]).split("/", 1)
            opts["ctx"] = max(int(opts.get("ctx") or 0), ctx_needed)
            fields = option_fields(opts)
            if on_status:
                on_status(f"loading {os.path.basename(model)} " + " ".join(f"{COLUMN[k]}={v}" for k, v in combo.items()))
            try:
                eng = load(model, **opts)
            except Exception as e:  # noqa: BLE001 - a config that cannot load is a row, not the end
                r = Result(model, combo, None, error=_one_line(e), model_info=info, fields=fields,
                           backend=backend, switches=sw)
                results.append(r)
                on_result(r)
                continue
            fields = option_fields({**opts, "dtype": eng.options.dtype})  # auto resolved by the engine
            rng = np.random.default_rng(seed)
            for test in tests:
                if on_status:
                    on_status(f"{test.name} " + " ".join(f"{COLUMN[k]}={v}" for k, v in combo.items()))
                try:
                    ts, ns = run_test(eng, test, reps, rng, warmup)
                    r = Result(model, combo, test, ts, ns, model_info=info, fields=fields,
                               backend=backend, switches=sw)
                except Exception as e:  # noqa: BLE001 - e.g. out of device memory: report, go on
                    r = Result(model, combo, test, error=_one_line(e), model_info=info, fields=fields,
                               backend=backend, switches=sw)
                results.append(r)
                on_result(r)
            if on_engine is not None:
                on_engine(eng)
            del eng
    return results


def _one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    text = msg[0] if msg else type(e).__name__
    if not isinstance(e, Exception) or type(e).__module__.startswith("ikjax"):
        return text
    return f"{type(e).__name__}: {text}"[:300]


# -- output ------------------------------------------------------------------------------------

# ik's llama-bench markdown: field -> (column name, width; negative = left-aligned), as its
# get_field_width / get_field_display_name give them
MD_FIELDS = {
    "model": ("model", -30), "size": ("size", 10), "params": ("params", 10), "backend": ("backend", -10),
    "n_gpu_layers": ("ngl", 3), "n_threads": ("threads", 7), "n_batch": ("n_batch", 7),
    "n_ubatch": ("n_ubatch", 8), "type_k": ("type_k", 6), "type_v": ("type_v", 6),
    "main_gpu": ("main_gpu", 10), "split_mode": ("sm", 5), "no_kv_offload": ("nkvo", 13),
    "flash_attn": ("fa", 2), "mla_attn": ("mla", 3), "attn_max_batch": ("amb", 5), "reuse": ("gr", 2),
    "ser": ("ser", 10), "tensor_split": ("ts", -12), "use_mmap": ("mmap", 4), "cuda_params": ("cuda", -11),
    "override_tensor": ("ot", -15), "repack": ("rtr", 3), "mqkv": ("mqkv", 4), "muge": ("muge", 4),
    "use_thp": ("thp", 3), "fused_moe": ("fmoe", 4), "grouped_er": ("ger", 3), "no_ooae": ("no-ooae", 7),
    "dtype": ("dtype", -10),  # ikjax's --dtype (not an ik field): shown only when given
    "test": ("test", 13), "t/s": ("t/s", 16),
}
# the bench parameter behind each swept field, and the fields a switch shows
FIELD_PARAM = {"n_threads": "threads", "n_batch": "batch", "n_ubatch": "ubatch", "type_k": "ctk", "type_v": "ctv",
               "flash_attn": "fa", "mla_attn": "mla", "attn_max_batch": "amb", "ser": "ser",
               "override_tensor": "ot", "fused_moe": "fmoe", "n_gpu_layers": "ngl", "dtype": "dtype"}


def _bool_text(v: Any) -> str:
    return ("1" if v else "0") if isinstance(v, bool) else str(v)


class MarkdownTable:
    """llama-bench's markdown table, printed row by row: `fields` are ik's field names
    (`markdown_fields` picks them as ik does); widths and alignment are ik's."""

    def __init__(self, fields: list[str]):
        self.fields = fields

    def _line(self, cells: list[str]) -> str:
        out = []
        for f, v in zip(self.fields, cells):
            w = MD_FIELDS[f][1]
            out.append(v.ljust(-w) if w < 0 else v.rjust(w))
        return "| " + " | ".join(out) + " |"

    def header(self) -> list[str]:
        seps = ["-" * (abs(MD_FIELDS[f][1]) - 1) + ("-" if MD_FIELDS[f][1] < 0 else ":") for f in self.fields]
        return [self._line([MD_FIELDS[f][0] for f in self.fields]), "| " + " | ".join(seps) + " |"]

    def row(self, r: Result) -> str:
        mi = r.model_info
        rec = r.record()
        cells = []
        for f in self.fields:
            if f == "model":
                v = mi.get("model_type", os.path.basename(r.model))
            elif f == "size":
                v = format_size(mi["model_size"]) if mi else ""
            elif f == "params":
                v = format_params(mi["model_n_params"]) if mi else ""
            elif f == "backend":
                v = r.backend
            elif f == "t/s":
                v = r.ts_text()
            elif f == "test":
                v = r.test.name if r.test else "-"
            else:
                v = rec.get(f)
                if f in FIELD_PARAM and (r.error or v is None) and FIELD_PARAM[f] in r.params:
                    v = r.params[FIELD_PARAM[f]]  # a skipped row shows the value that failed
                v = "" if v is None else _bool_text(v)
            cells.append(v)
        return self._line(cells)

    @staticmethod
    def footer() -> list[str]:
        commit, number = build_info()
        return ["", f"build: {commit} ({number})"]


# llama-bench's defaults of the swept parameters (its cmd_params_defaults), as bench's strings
IK_DEFAULTS = {"batch": ["2048"], "ubatch": ["512"], "ctk": ["f16"], "ctv": ["f16"], "fa": ["1"], "mla": ["3"],
               "amb": ["0"], "fmoe": ["1"]}


def markdown_fields(params: dict[str, Any], switches: dict[str, Any], backend: str,
                    print_overrides: bool = False, default_dtype: str = "auto") -> list[str]:
    """The columns of ik's markdown table: model, size, params, backend; ngl off the CPU; threads
    where given or on the CPU; each other parameter only where it was given a value other than
    llama-bench's default or several values; ot only with --print-overrides 1; test, t/s."""
    def given(name: str) -> list[str]:
        v = params.get(name)
        return [] if v in (None, "") else split_list(v, name)

    def non_default(name: str) -> bool:
        vals = given(name)
        if name == "fa":
            vals = ["1" if str(x).lower() in ("1", "on", "true", "auto") else "0" for x in vals]
        return bool(vals) and (len(vals) > 1 or vals != IK_DEFAULTS.get(name, vals[:0]))

    def on(name: str) -> bool:
        v = switches.get(name)
        return v is not None and v != "" and str(v).lower() not in ("0", "false", "off", "no")
    cpu = backend in ("CPU", "BLAS")
    fields = ["model", "size", "params", "backend"]
    if not cpu:
        fields.append("n_gpu_layers")
    threads = given("threads")
    if cpu or len(threads) > 1 or threads not in ([], ["0"]):
        fields.append("n_threads")
    fields += [f for f, p in (("n_batch", "batch"), ("n_ubatch", "ubatch"), ("type_k", "ctk"), ("type_v", "ctv"))
               if non_default(p)]
    if switches.get("main_gpu") not in (None, "", "0", 0):
        fields.append("main_gpu")
    if len(given("split_mode")) > 1 or (
            switches.get("split_mode") not in (None, "") and str(switches["split_mode"]).lower() != "layer"):
        fields.append("split_mode")
    if on("nkvo"):
        fields.append("no_kv_offload")
    fields += [f for f, p in (("flash_attn", "fa"), ("mla_attn", "mla"), ("attn_max_batch", "amb")) if non_default(p)]
    if switches.get("gr") is not None and not on("gr"):
        fields.append("reuse")
    if given("ser"):
        fields.append("ser")
    if switches.get("ts") not in (None, ""):
        fields.append("tensor_split")
    if switches.get("mmp") is not None and not on("mmp"):
        fields.append("use_mmap")
    if switches.get("cuda") not in (None, ""):
        fields.append("cuda_params")
    if given("ot") and print_overrides:
        fields.append("override_tensor")
    fields += [f for f, p in (("repack", "rtr"), ("mqkv", "mqkv"), ("muge", "muge"), ("use_thp", "thp"))
               if on(p)]
    if non_default("fmoe"):
        fields.append("fused_moe")
    fields += [f for f, p in (("grouped_er", "ger"), ("no_ooae", "no_ooae")) if on(p)]
    dtypes = given("dtype")
    if dtypes and (len(dtypes) > 1 or dtypes != [default_dtype]):
        fields.append("dtype")
    return fields + ["test", "t/s"]


def format_size(n_bytes: int) -> str:
    """ik's size column: MiB below 1 GiB, else GiB, two decimals."""
    return "%.2f MiB" % (n_bytes / 2**20) if n_bytes < 2**30 else "%.2f GiB" % (n_bytes / 2**30)


def format_params(n: int) -> str:
    """ik's params column: millions below 10^9, else billions, two decimals."""
    return "%.2f M" % (n / 1e6) if n < 1_000_000_000 else "%.2f B" % (n / 1e9)


def to_json(results: list[Result]) -> str:
    """llama-bench's `-o json`: one JSON array of records."""
    return json.dumps([r.record() for r in results], indent=2, ensure_ascii=False)


def to_jsonl(result: Result) -> str:
    """llama-bench's `-o jsonl`: one record per line."""
    return json.dumps(result.record(), ensure_ascii=False)


CSV_SKIP = ("samples_ns", "samples_ts")  # ik's CSV has no sample lists


def to_csv(results: list[Result]) -> str:
    """llama-bench's `-o csv`: a header of its field names as they are (unquoted, as llama-bench
    joins them), every value quoted, booleans 0/1 (then ikjax's n_depth, dtype, error)."""
    buf = io.StringIO()
    w = csv.writer(buf, quoting=csv.QUOTE_ALL, lineterminator="\n")
    header = None
    for r in results:
        rec = {k: v for k, v in r.record().items() if k not in CSV_SKIP}
        if header is None:
            header = list(rec)
            buf.write(",".join(header) + "\n")
        w.writerow([_text_value(v) for v in rec.values()])
    if header is None:
        buf.write(",".join(k for k in Result("", {}, None).record() if k not in CSV_SKIP) + "\n")
    return buf.getvalue()


def _text_value(v: Any) -> str:
    """A record value as ik's CSV and SQL printers write it: floats %f, booleans 0 / 1, null empty."""
    return "" if v is None else ("%f" % v if isinstance(v, float) else _bool_text(v))


def _sql_type(v: Any) -> str:
    return "INTEGER" if isinstance(v, (bool, int)) else "REAL" if isinstance(v, float) else "TEXT"


def to_sql(results: list[Result]) -> str:
    """llama-bench's `-o sql`: CREATE TABLE IF NOT EXISTS test (its fields, typed INTEGER / REAL /
    TEXT), a blank line, then one INSERT a test with every value quoted ('' inside), as ik's
    sql_printer writes them (the CSV's fields: no sample lists)."""
    recs = [{k: v for k, v in r.record().items() if k not in CSV_SKIP} for r in results]
    proto = recs[0] if recs else {k: v for k, v in Result("", {}, None).record().items() if k not in CSV_SKIP}
    types = {k: _sql_type(next((r[k] for r in recs if r.get(k) is not None), proto[k])) for k in proto}
    lines = ["CREATE TABLE IF NOT EXISTS test ("]
    lines += [f"  {k} {t}{',' if i < len(types) - 1 else ''}" for i, (k, t) in enumerate(types.items())]
    lines += [");", ""]
    for r in recs:
        values = ", ".join("'" + _text_value(v).replace("'", "''") + "'" for v in r.values())
        lines.append(f"INSERT INTO test ({', '.join(r)}) VALUES ({values});")
    return "\n".join(lines) + "\n"
