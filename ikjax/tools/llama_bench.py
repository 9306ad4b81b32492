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
SWEPT = {"mla": "mla", "fa": "fa", "ubatch": "ubatch", "batch": "batch", "ctk": "ctk", "ctv": "ctv", "amb": "amb",
         "fmoe": "fmoe", "ser": "ser", "ot": "ot", "ngl": "ngl", "threads": "threads", "dtype": "dtype"}
# markdown column names (llama-bench's)
COLUMN = {"mla": "mla", "fa": "fa", "ubatch": "n_ubatch", "batch": "n_batch", "ctk": "type_k", "ctv": "type_v",
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
    if name == "ser":  # "Kmin,t" is one value; several are separated by ';'
        return [v for v in str(value).split(";") if v]
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
    return {
        "n_batch": get("batch"), "n_ubatch": get("ubatch"),
        "n_threads": t or cpus if isinstance(t, int) else t,
        "n_threads_batch": (tb or t or cpus) if isinstance(tb, int) and isinstance(t, int) else tb,
        "type_k": get("ctk"), "type_v": (get("ctv") or get("ctk")),
        "n_gpu_layers": get("ngl"), "flash_attn": get("fa"), "mla_attn": get("mla"), "attn_max_batch": get("amb"),
        "ser": (f"{ser.min_experts},{ser.threshold:g}" if ser is not None and not isinstance(ser, str)
                else ser if isinstance(ser, str) else "-1,0"),
        "fused_moe": get("fmoe"),
        "override_tensor": (",".join(f"{r.pattern}={r.device}" for r in ot) if not isinstance(ot, str) else ot),
        "dtype": get("dtype"),
    }


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
        """One llama-bench JSON object: its key names and number types, plus ikjax's `dtype`,
        `n_depth` (mainline's) and `error` (null, or why the row was skipped)."""
        commit, number = build_info()
        r: dict[str, Any] = {"build_commit": commit, "build_number": number, "backend": self.backend,
                             "model_filename": self.model}
        r.update({k: self.model_info.get(k) for k in ("model_type", "model_size", "model_n_params")})
        f = dict(self.fields)
        tb = f.pop("n_threads_batch", None)
        if self.test is not None and self.test.kind == "pp" and tb is not None:
            f["n_threads"] = tb  # llama-bench reports the prompt threads for a pp test
        r.update(f)
        t = self.test
        ns = [int(x) for x in self.samples_ns]
        r.update(n_prompt=t.n_prompt if t else 0, n_gen=t.n_gen if t else 0, n_depth=t.n_depth if t else 0,
                 test_time=self.test_time,
                 avg_ns=int(statistics.fmean(ns)) if ns else 0,
                 stddev_ns=int(statistics.stdev(ns)) if len(ns) > 1 else 0,
                 avg_ts=float(self.avg_ts), stddev_ts=float(self.stddev_ts),
                 test=t.name if t else "", samples_ns=ns, samples_ts=[float(x) for x in self.samples_ts],
                 error=self.error)
        return r


def model_info(path: str) -> dict[str, Any]:
    """model_type ('deepseek2 16B Q4_0'), model_size (bytes), model_n_params, from the header only."""
    from ikjax.gguf_io.reader import GGUFModelFile
    f = GGUFModelFile(path)
    size = sum(t.nbytes for t in f.tensors.values())
    n_params = sum(math.prod(t.shape) for t in f.tensors.values())
    types: dict[str, int] = {}
    for t in f.tensors.values():
        if len(t.shape) >= 2:
            types[t.type_name] = types.get(t.type_name, 0) + t.nbytes
    main_type = max(types, key=types.get) if types else "?"
    label = f.metadata.get("general.size_label") or f"{n_params / 1e9:.1f}B"
    return {"model_type": f"{f.architecture} {label} {main_type}", "model_size": int(size),
            "model_n_params": int(n_params)}


def _random_ids(rng, vocab: int, n: int) -> np.ndarray:
    return rng.integers(0, vocab, n).astype(np.int32)


def run_test(eng, test: Test, reps: int, rng) -> tuple[list[float], list[int]]:
    """Warm-up (untimed, compiles) then `reps` timed runs; (tokens/s per rep, ns per rep)."""
    vocab = eng.config.vocab_size
    ts, ns = [], []
    for rep in range(reps + 1):
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
        dt = time.perf_counter_ns() - t0
        if rep > 0:
            ns.append(dt)
            ts.append(test.timed_tokens / (dt / 1e9))
    return ts, ns


def run_bench(models: list[str], params: dict[str, Any], tests: list[Test], reps: int,
              on_result: Callable[[Result], None], on_status: Callable[[str], None] | None = None,
              extra_options: dict[str, Any] | None = None, seed: int = 0) -> list[Result]:
    import jax

    from ikjax.errors import IkjaxError
    from ikjax.runtime.engine import load
    backend = jax.default_backend().upper()
    results = []
    ctx_needed = max((t.n_tokens for t in tests), default=1)
    for model in models:
        try:
            info = model_info(model)
        except IkjaxError as e:
            r = Result(model, {}, None, error=str(e))
            results.append(r)
            on_result(r)
            continue
        for combo in combinations(params):
            opts = dict(extra_options or {})
            opts.update({SWEPT[k]: v for k, v in combo.items()})
            opts["ctx"] = max(int(opts.get("ctx") or 0), ctx_needed)
            fields = option_fields(opts)
            if on_status:
                on_status(f"loading {os.path.basename(model)} " + " ".join(f"{COLUMN[k]}={v}" for k, v in combo.items()))
            try:
                eng = load(model, **opts)
            except Exception as e:  # noqa: BLE001 - a config that cannot load is a row, not the end
                r = Result(model, combo, None, error=_one_line(e), model_info=info, fields=fields, backend=backend)
                results.append(r)
                on_result(r)
                continue
            fields = option_fields({**opts, "dtype": eng.options.dtype})  # auto resolved by the engine
            rng = np.random.default_rng(seed)
            for test in tests:
                if on_status:
                    on_status(f"{test.name} " + " ".join(f"{COLUMN[k]}={v}" for k, v in combo.items()))
                try:
                    ts, ns = run_test(eng, test, reps, rng)
                    r = Result(model, combo, test, ts, ns, model_info=info, fields=fields, backend=backend)
                except Exception as e:  # noqa: BLE001 - e.g. out of device memory: report, go on
                    r = Result(model, combo, test, error=_one_line(e), model_info=info, fields=fields, backend=backend)
                results.append(r)
                on_result(r)
            del eng
    return results


def _one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    text = msg[0] if msg else type(e).__name__
    if not isinstance(e, Exception) or type(e).__module__.startswith("ikjax"):
        return text
    return f"{type(e).__name__}: {text}"[:300]


# -- output ------------------------------------------------------------------------------------

_LEFT = {"model", "backend"}


class MarkdownTable:
    """llama-bench's markdown table, printed row by row (column widths fixed from the first rows)."""

    def __init__(self, param_keys: list[str], backend: str):
        self.cols = ["model", "size", "params", "backend"] + [COLUMN[k] for k in param_keys] + ["test", "t/s"]
        self.keys = param_keys
        self.backend = backend
        self.widths = {c: max(len(c), 6) for c in self.cols}
        self.widths.update(model=30, size=10, params=10, backend=7, test=13, **{"t/s": 20})
        self.header_done = False

    def _line(self, vals: dict[str, str]) -> str:
        cells = []
        for c in self.cols:
            v = vals.get(c, "")
            w = self.widths[c]
            cells.append(v.ljust(w) if c in _LEFT else v.rjust(w))
        return "| " + " | ".join(cells) + " |"

    def header(self) -> list[str]:
        seps = []
        for c in self.cols:
            w = self.widths[c]
            seps.append("-" * w if c in _LEFT else "-" * (w - 1) + ":")
        return [self._line({c: c for c in self.cols}), "| " + " | ".join(seps) + " |"]

    def row(self, r: Result) -> str:
        mi = r.model_info
        vals = {"model": mi.get("model_type", os.path.basename(r.model)),
                "size": f"{mi['model_size'] / 2**30:.2f} GiB" if mi else "",
                "params": f"{mi['model_n_params'] / 1e9:.2f} B" if mi else "",
                "backend": self.backend,
                "test": r.test.name if r.test else "-", "t/s": r.ts_text()}
        for k in self.keys:
            v = str(r.params.get(k, ""))
            if k == "threads" and v == "0":  # llama-bench shows the thread count used
                v = str(os.cpu_count() or 1)
            vals[COLUMN[k]] = v
        return self._line(vals)


def to_json(results: list[Result]) -> str:
    """llama-bench's `-o json`: one JSON array of records."""
    return json.dumps([r.record() for r in results], indent=2, ensure_ascii=False)


def to_jsonl(result: Result) -> str:
    """llama-bench's `-o jsonl`: one record per line."""
    return json.dumps(result.record(), ensure_ascii=False)


def to_csv(results: list[Result]) -> str:
    recs = [r.record() for r in results]
    keys: list[str] = []
    for rec in recs:
        keys += [k for k in rec if k not in keys]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=keys, lineterminator="\n")
    w.writeheader()
    for rec in recs:
        w.writerow({k: (";".join(map(str, v)) if isinstance(v, list) else ("" if v is None else
                                                                              int(v) if isinstance(v, bool) else v))
                    for k, v in rec.items()})
    return buf.getvalue()
