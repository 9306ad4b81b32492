"""llama-bench style runs: pp512 / tg128 / tg64@pp8192, comma lists swept as a Cartesian product.

Each parameter combination loads the model once (a combination that fails to load or run becomes an
error row and the sweep goes on); each test runs one untimed warm-up (it compiles) and `-r`
timed repetitions, reported as mean ± sd of tokens/s.
"""
from __future__ import annotations

import csv
import io
import itertools
import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

# bench parameter -> RunOptions name; these may be comma lists
SWEPT = {"mla": "mla", "fa": "fa", "ubatch": "ubatch", "batch": "batch", "ctk": "ctk", "amb": "amb",
         "fmoe": "fmoe", "ser": "ser", "ot": "ot", "ngl": "ngl", "threads": "threads", "dtype": "dtype"}
# markdown column names (llama-bench's)
COLUMN = {"mla": "mla", "fa": "fa", "ubatch": "n_ubatch", "batch": "n_batch", "ctk": "type_k", "amb": "amb",
          "fmoe": "fmoe", "ser": "ser", "ot": "ot", "ngl": "ngl", "threads": "threads", "dtype": "dtype"}


@dataclass(frozen=True)
class Test:
    name: str
    n_prompt: int
    n_gen: int
    n_depth: int

    @property
    def n_tokens(self) -> int:
        return self.n_prompt + self.n_gen + self.n_depth


def make_tests(n_prompt: list[int], n_gen: list[int], gp: list[tuple[int, int]], depth: list[int]) -> list[Test]:
    tests = []
    for d in depth:
        suffix = f"@d{d}" if d else ""
        tests += [Test(f"pp{p}{suffix}", p, 0, d) for p in n_prompt if p > 0]
        tests += [Test(f"tg{n}{suffix}", 0, n, d) for n in n_gen if n > 0]
    tests += [Test(f"tg{tg}@pp{pp}", 0, tg, pp) for pp, tg in gp]
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


@dataclass
class Result:
    model: str
    params: dict[str, str]
    test: Test | None
    samples_ts: list[float] = field(default_factory=list)
    samples_ns: list[int] = field(default_factory=list)
    error: str | None = None
    model_info: dict[str, Any] = field(default_factory=dict)

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
        r: dict[str, Any] = {"model_filename": self.model, **self.model_info}
        r.update({COLUMN[k]: v for k, v in self.params.items()})
        if self.test is not None:
            r.update(test=self.test.name, n_prompt=self.test.n_prompt, n_gen=self.test.n_gen,
                     n_depth=self.test.n_depth)
        else:
            r.update(test=None, n_prompt=None, n_gen=None, n_depth=None)
        r.update(avg_ts=round(self.avg_ts, 6), stddev_ts=round(self.stddev_ts, 6),
                 samples_ts=[round(x, 6) for x in self.samples_ts], samples_ns=self.samples_ns,
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
    return {"model_type": f"{f.architecture} {label} {main_type}", "model_size": size, "model_n_params": n_params}


def _random_ids(rng, vocab: int, n: int) -> np.ndarray:
    return rng.integers(0, vocab, n).astype(np.int32)


def run_test(eng, test: Test, reps: int, rng) -> tuple[list[float], list[int]]:
    """Warm-up (untimed, compiles) then `reps` timed runs; (tokens/s per rep, ns per rep)."""
    vocab = eng.config.vocab_size
    ts, ns = [], []
    for rep in range(reps + 1):
        cache = eng.new_cache(1)
        if test.n_depth:
            _, cache = eng.prefill(cache, _random_ids(rng, vocab, test.n_depth), 0)
        if test.n_prompt:
            ids = _random_ids(rng, vocab, test.n_prompt)
            t0 = time.perf_counter_ns()
            _, cache = eng.prefill(cache, ids, test.n_depth)  # returns host logits: synchronized
            dt = time.perf_counter_ns() - t0
            n = test.n_prompt
        else:
            pos = test.n_depth
            tok = np.array([[int(rng.integers(0, vocab))]], np.int32)
            t0 = time.perf_counter_ns()
            for i in range(test.n_gen):
                out, cache = eng.step(cache, tok, np.array([pos + i]))
                out.block_until_ready()
            dt = time.perf_counter_ns() - t0
            n = test.n_gen
        if rep > 0:
            ns.append(dt)
            ts.append(n / (dt / 1e9))
    return ts, ns


def run_bench(models: list[str], params: dict[str, Any], tests: list[Test], reps: int,
              on_result: Callable[[Result], None], on_status: Callable[[str], None] | None = None,
              extra_options: dict[str, Any] | None = None, seed: int = 0) -> list[Result]:
    import ikjax
    results = []
    ctx_needed = max((t.n_tokens for t in tests), default=1)
    for model in models:
        try:
            info = model_info(model)
        except ikjax.IkjaxError as e:
            r = Result(model, {}, None, error=str(e))
            results.append(r)
            on_result(r)
            continue
        for combo in combinations(params):
            opts = dict(extra_options or {})
            opts.update({SWEPT[k]: v for k, v in combo.items()})
            opts["ctx"] = max(int(opts.get("ctx") or 0), ctx_needed)
            if on_status:
                on_status(f"loading {os.path.basename(model)} " + " ".join(f"{COLUMN[k]}={v}" for k, v in combo.items()))
            try:
                eng = ikjax.load(model, **opts)
            except Exception as e:  # noqa: BLE001 - a config that cannot load is a row, not the end
                r = Result(model, combo, None, error=_one_line(e), model_info=info)
                results.append(r)
                on_result(r)
                continue
            rng = np.random.default_rng(seed)
            for test in tests:
                if on_status:
                    on_status(f"{test.name} " + " ".join(f"{COLUMN[k]}={v}" for k, v in combo.items()))
                try:
                    ts, ns = run_test(eng, test, reps, rng)
                    r = Result(model, combo, test, ts, ns, model_info=info)
                except Exception as e:  # noqa: BLE001 - e.g. out of device memory: report, go on
                    r = Result(model, combo, test, error=_one_line(e), model_info=info)
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
    return json.dumps([r.record() for r in results], indent=2, ensure_ascii=False)


def to_csv(results: list[Result]) -> str:
    recs = [r.record() for r in results]
    keys: list[str] = []
    for rec in recs:
        keys += [k for k in rec if k not in keys]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=keys, lineterminator="\n")
    w.writeheader()
    for rec in recs:
        w.writerow({k: (";".join(map(str, v)) if isinstance(v, list) else ("" if v is None else v))
                    for k, v in rec.items()})
    return buf.getvalue()
