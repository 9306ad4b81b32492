"""Where the peak RSS of a CPU sweep-bench comes from (issue 9's "file + KV cache + 10 %" target).

    python bench/cpu_rss.py -m /work/models/v2l4-q8_0.gguf [--compile-cache DIR|0] [--maps] [--trim] [--embed-rows]
    python bench/cpu_rss.py -m /work/models/v2l4-q8_0.gguf --profile-decode

Runs `ikjax sweep-bench -m FILE -c 1024 -ub 512 -n 32 -mla 3 -fa 1 -t 2` in this process (the same
CLI code `bench/cpu_sweep.py` runs in a fresh interpreter) with a sampler thread reading
/proc/self/status every 5 ms, and marks the phases: after `import jax`, after the load, after the
compiles, each TG and PP step. For each phase it prints the largest RSS seen and its split into
file-backed pages (RssFile: the GGUF memory map, the .so text) and anonymous memory (RssAnon:
copies, the JAX runtime, compiled code, step buffers), and VmHWM at the phase's end: the phase
where VmHWM grows is the one that sets the peak `cpu_sweep.py` reports. `--maps` also prints, at
each mark, the largest mappings from /proc/self/smaps (which file, or anonymous) by resident bytes.
Why a sampler and not only VmHWM: VmHWM is exact but says nothing of what the pages are; RssFile
and RssAnon are the split, and the sampler catches their high points inside a step.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

FLAGS = ["-c", "1024", "-ub", "512", "-n", "32", "-mla", "3", "-fa", "1", "-t", "2"]
KB = 1024


def status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile, RssShmem in bytes (one read of /proc/self/status)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[k] = int(v.split()[0]) * KB
    return out


def anon_maps(min_rss: int = 2 << 20) -> list[tuple[int, int]]:
    """The anonymous mappings with more than `min_rss` resident: (size, Rss) in bytes, largest first."""
    out, cur = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5 and not parts[0].endswith(":"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                cur = [hi - lo, 0] if len(parts) == 5 else None
                if cur is not None:
                    out.append(cur)
            elif parts[0] == "Rss:" and cur is not None:
                cur[1] = int(parts[1]) * KB
    return sorted(((a, b) for a, b in out if b > min_rss), key=lambda x: -x[1])


def top_maps(n: int = 8) -> list[tuple[int, int, str]]:
    """The `n` largest mappings by resident bytes: (Rss, Anonymous, name); the anonymous ones and
    the ones of one file are summed under one name."""
    by: dict[str, list[int]] = {}
    name = "?"
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5 and not parts[0].endswith(":"):
                name = parts[5] if len(parts) > 5 else "[anon]"
                by.setdefault(name, [0, 0])
            elif parts[0] == "Rss:":
                by[name][0] += int(parts[1]) * KB
            elif parts[0] == "Anonymous:":
                by[name][1] += int(parts[1]) * KB
    rows = sorted(((r, a, k) for k, (r, a) in by.items()), reverse=True)
    return rows[:n]


class Sampler:
    """Max VmRSS / RssAnon / RssFile per phase, sampled every `period` seconds."""

    def __init__(self, period: float = 0.005, maps: bool = False, trim: bool = False):
        self.period, self.maps, self.trim = period, maps, trim
        self.phase = "start"
        self.order: list[str] = []
        self.peak: dict[str, dict[str, int]] = {}
        self.hwm_end: dict[str, int] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> "Sampler":
        self.mark("start")
        self._thread.start()
        return self

    def _record(self, s: dict[str, int]) -> None:
        with self._lock:
            p = self.peak.setdefault(self.phase, {})
            for k in ("VmRSS", "RssAnon", "RssFile"):
                p[k] = max(p.get(k, 0), s[k])
            self.hwm_end[self.phase] = s["VmHWM"]

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            self._record(status())

    def mark(self, phase: str) -> None:
        """End the current phase (a last sample) and start `phase` (phases of one name add up)."""
        self._record(status())
        if self.trim:  # what of RssAnon is free memory malloc keeps (reported as a phase of its own)
            import ctypes
            with self._lock:
                self.phase = f"{self.phase} (after malloc_trim)"
                if self.phase not in self.order:
                    self.order.append(self.phase)
            ctypes.CDLL(None).malloc_trim(0)
            self._record(status())
        with self._lock:
            self.phase = phase
            if phase not in self.order:
                self.order.append(phase)
        self._record(status())
        if self.maps and phase in ("jax", "loaded", "compiled", "done"):
            print(f"--- mappings at '{phase}' (Rss MiB, of which anonymous MiB):", file=sys.stderr)
            for rss, anon, name in top_maps():
                print(f"    {rss / 2**20:8.1f} {anon / 2**20:8.1f}  {name}", file=sys.stderr)
            print("    anonymous mappings over 2 MiB resident (size MiB, Rss MiB): " + ", ".join(
                f"{size / 2**20:.0f}/{rss / 2**20:.1f}" for size, rss in anon_maps()), file=sys.stderr)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._record(status())

    def table(self) -> str:
        lines = ["| phase | max VmRSS MiB | max RssFile MiB | max RssAnon MiB | VmHWM at end MiB |",
                 "|---|---:|---:|---:|---:|"]
        for ph in self.order:
            p = self.peak.get(ph, {})
            lines.append(f"| {ph} | {p.get('VmRSS', 0) / 2**20:.0f} | {p.get('RssFile', 0) / 2**20:.0f} | "
                         f"{p.get('RssAnon', 0) / 2**20:.0f} | {self.hwm_end.get(ph, 0) / 2**20:.0f} |")
        return "\n".join(lines)


def patch_embed_rows() -> None:
    """The model's embedding gather through the C++ embed_rows op (pread from the file, no
    fault-around pages): the change proposed for ikjax/model/deepseek2.embed (RESULTS §9e), patched
    in for measurement only; -sm graph (an `axis`) and non-byte tables keep the model's own path."""
    import jax.numpy as jnp
    from ikjax.model import deepseek2
    from ikjax.quant.array import QuantArray
    from pallas_kernels.embed_rows.cpu import embed_rows, supported
    embed = deepseek2.embed

    def embed_pread(token_embd, tokens, dtype=jnp.float32, axis=None):
        if axis is not None or not supported(token_embd.data, tokens):
            return embed(token_embd, tokens, dtype, axis)
        rows = QuantArray(embed_rows(token_embd.data, tokens), token_embd.qtype,
                          tokens.shape + (token_embd.shape[-1],))
        return rows.dequantize(jnp.float32)
    deepseek2.embed = embed_pread


def profile_decode(model: str, steps: int = 30) -> None:
    """Where a decode step's time goes (RESULTS §9e): `steps` decode steps at N_KV 512 under
    jax.profiler, the executor threads' events summed by kind (custom calls vs XLA's own ops), and
    the host dispatch (the call until it returns) without the profiler."""
    import collections
    import glob
    import tempfile

    import jax
    import numpy as np

    import ikjax
    from ikjax.runtime import compile_cache
    compile_cache.setup()
    eng = ikjax.load(model, ctx=1024, ubatch=512, mla=3, fa=True, threads=2)
    cache = eng.new_cache(1)
    rng = np.random.default_rng(0)
    disp, tot = [], []

    def step(i: int) -> None:
        nonlocal cache
        tok = rng.integers(0, eng.config.vocab_size, (1, 1))
        t0 = time.perf_counter()
        out, cache = eng.step(cache, tok, np.array([512 + i % 256]))
        t1 = time.perf_counter()
        out.block_until_ready()
        disp.append(t1 - t0)
        tot.append(time.perf_counter() - t0)
    for i in range(5):
        step(i)
    disp.clear(), tot.clear()
    for i in range(40):
        step(i)
    print(f"without the profiler: step median {np.median(tot) * 1e3:.2f} ms, dispatch median "
          f"{np.median(disp) * 1e3:.3f} ms ({len(jax.tree_util.tree_leaves(eng.weights))} weight buffers)")
    d = tempfile.mkdtemp(prefix="ikjax-prof-")
    with jax.profiler.trace(d):
        for i in range(steps):
            step(i)
    from jax.profiler import ProfileData
    pd = ProfileData.from_file(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
    ms, n = collections.Counter(), collections.Counter()
    for plane in pd.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLAPjRtCpuClient"):
                continue
            for ev in line.events:
                k = ("executable (all)" if ev.name.startswith("ThunkExecutor") else
                     "custom calls (ffi)" if ev.name.startswith("ffi_call") else "XLA op " + ev.name.split(".")[0])
                ms[k] += ev.duration_ns / 1e6 / steps
                n[k] += 1 / steps
    for k, v in ms.most_common(12):
        print(f"{v:8.3f} ms/step {n[k]:6.1f}/step  {k}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--compile-cache", default=None, help="a directory, or 0 for none (default: ikjax's own)")
    ap.add_argument("--maps", action="store_true", help="print the largest mappings at each phase")
    ap.add_argument("--embed-rows", action="store_true",
                    help="patch the model's embedding gather to the C++ embed_rows op (pread from the file; "
                         "the one-line change proposed for ikjax/model/deepseek2.embed, RESULTS §9e)")
    ap.add_argument("--trim", action="store_true", help="malloc_trim(0) at each phase's end: the free memory "
                                                         "malloc kept is what RssAnon drops by")
    ap.add_argument("--profile-decode", action="store_true",
                    help="instead of the RSS phases: where a decode step's time goes (jax.profiler)")
    a = ap.parse_args()
    if a.profile_decode:
        return profile_decode(a.model)
    sampler = Sampler(maps=a.maps, trim=a.trim).start()
    import jax  # noqa: F401  (what the runtime costs before anything of ours)
    sampler.mark("jax")
    import ikjax  # noqa: F401  (timed: the import itself is a phase of the profile)
    from ikjax.runtime import engine
    from ikjax.tools import sweep_bench
    sampler.mark("import ikjax")

    load = engine.load  # the CLI reads it from ikjax.runtime.engine when a command runs

    engines = []

    def marked_load(*args, **kw):
        sampler.mark("load")
        out = load(*args, **kw)
        sampler.mark("loaded")
        engines.append(out)
        return out
    engine.load = marked_load
    pre = sweep_bench.precompile

    def marked_precompile(*args, **kw):
        sampler.mark("compile")
        out = pre(*args, **kw)
        sampler.mark("compiled")
        return out
    sweep_bench.precompile = marked_precompile
    step = engine.Engine.step

    seen = set()

    def marked_step(self, cache, tokens, *args, **kw):
        kind = "TG" if tokens.shape[-1] == 1 else "PP"
        sampler.mark(f"{kind} steps" if kind in seen else f"first {kind} step")
        seen.add(kind)
        return step(self, cache, tokens, *args, **kw)
    engine.Engine.step = marked_step

    if a.embed_rows:
        patch_embed_rows()

    from ikjax import cli
    argv = ["sweep-bench", "-m", a.model, *FLAGS, "--output-format", "jsonl"]
    if a.compile_cache is not None:
        argv += ["--compile-cache", a.compile_cache]
    try:
        cli.app(argv, standalone_mode=False)
    finally:
        sampler.mark("done")
        sampler.stop()
    size = Path(a.model).stat().st_size
    print(f"file {size / 2**30:.3f} GiB; VmHWM {status()['VmHWM'] / 2**30:.3f} GiB", file=sys.stderr)
    print(sampler.table(), file=sys.stderr)
    for key, exe in getattr(engines[0], "_executables", {}).items() if engines else ():
        ma = exe.memory_analysis()
        print(f"step {key[:2]} kv {key[2].kv_len}: temp {ma.temp_size_in_bytes / 2**20:.1f} MiB, output "
              f"{ma.output_size_in_bytes / 2**20:.1f} MiB (aliased {ma.alias_size_in_bytes / 2**20:.1f}), "
              f"generated code {ma.generated_code_size_in_bytes / 2**20:.1f} MiB", file=sys.stderr)


if __name__ == "__main__":
    main()
