"""Every `IKJAX_*` environment variable, in one table, read in one place.

Why one module: the knobs grew one per issue and were read in thirteen modules, each with its own
parsing and its own idea of a bad value. Here each variable is declared once (default, the values it
takes, what it does, who reads it), and the accessors below are the only Python code that touches
`os.environ` for them. A value outside a variable's set is refused naming the variable
(`OptionError`), never read as the default.

Values are read when asked for, not cached at import: a test or a user may set a variable between
two runs in one process (the CPU kernels' ISA cap is exercised that way), and each read is a dict
lookup, far below anything a step costs. The C++ runtime reads its own (`IKJAX_CPU_ISA`, `IKJAX_SPIN`,
the AMX and AVX-VNNI switches...) itself, so that a cap set in Python holds for kernels already
registered; they are listed here so the table is complete, and `check_native` refuses a bad value of
theirs when an engine loads (the C++ side would run its default). `markdown_table()` renders the
README's table.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ikjax.errors import OptionError


@dataclass(frozen=True)
class Variable:
    name: str
    default: str            # "" = unset
    choices: tuple[str, ...]  # the accepted values (lower case); () = free text, a number or a path
    meaning: str
    read_by: str            # the module (or C++ file) whose behaviour it changes


_VARS = (
    Variable("IKJAX_KERNELS", "auto", ("auto", "xla", "pallas", "cpu", "interpret", "jnp"),
             "kernel implementation for every op (`jnp` = `xla`); auto: `pallas` on a GPU, `cpu` on a CPU",
             "ikjax.ops.registry"),
    Variable("IKJAX_DTYPE", "", ("f32", "bf16", "f16"),
             "what `--dtype auto` means (default: bf16 where kernels run, f32 on the XLA path)",
             "ikjax.ops.registry"),
    Variable("IKJAX_LAYERS", "auto", ("auto", "scan", "halves", "unroll"),
             "runs of identical layers as one `lax.scan` (compile time independent of depth), every layer "
             "unrolled, or `auto`: scanned, GPU decode steps with up to 4 layers an iteration (fewer loop "
             "iterations, compile still independent of depth); `halves`: GPU decode in two iterations of half "
             "a group (the form before, its compile growing with depth)", "ikjax.model.groups"),
    Variable("IKJAX_HOST_LAYERS", "scan", ("scan", "unroll"),
             "layers whose routed experts stay in host memory next to a GPU (`-ot exps=CPU`): scanned like the "
             "others (the host calls pick the layer's bytes by a traced index; compile time independent of depth), "
             "or each unrolled, its bytes named in the step (the form before)", "ikjax.model.groups"),
    Variable("IKJAX_GPU_AUTOTUNE", "auto", ("auto", "1", "0"),
             "XLA's GPU autotuning when a step compiles; auto: off where the Pallas kernels do the products (it "
             "then spends 3-4 s of a cold start choosing emitters for small fusions, for 1-2 % of S_PP; RESULTS "
             "§22q), on for the XLA path, whose dequantized GEMMs it tunes", "ikjax.runtime.executables"),
    Variable("IKJAX_DECODE_UNROLL", "auto", (),
             "layers an iteration of a GPU decode step's scan over a layer group, at most (IKJAX_LAYERS=auto); "
             "auto: 1 where XLA unrolls the decode graph's loops (IKJAX_DECODE_GRAPH_UNROLL=1: a quarter of the "
             "kernels to compile, S_TG unchanged), else 4 (each iteration of a loop in the graph ~6-10 us a token)",
             "ikjax.model.groups"),
    Variable("IKJAX_DECODE_GRAPH_UNROLL", "1", ("0", "1"),
             "1: XLA unrolls the layer loops of the GPU decode loop's CUDA graph (`xla_gpu_command_buffer_unroll_loops`), "
             "the HLO one layer an iteration: H200, V2-Lite, cold start 14.0 s against 17.1 s, the deep shape's first "
             "row at 9.8 s against 12.7 s, S_TG +1.2-1.6 % (RESULTS §22s); 0: the loops stay conditional nodes",
             "ikjax.runtime.executables"),
    Variable("IKJAX_PROMPT_ATTN", "pallas", ("pallas", "xla"),
             "GPU prompt attention of -mla 2/3 (-fa): the Pallas flash kernel that reads keys up to each "
             "query's position (H200, V2-Lite -ub 2048: 1.09-1.49x XLA's S_PP, RESULTS §25c), or XLA's "
             "blocked form", "ikjax.ops.attn"),
    Variable("IKJAX_TOPK", "rank", ("rank", "lax"),
             "router top-k form: `rank` (compare-and-count, fast at decode) or `lax.top_k`", "ikjax.model.moe"),
    Variable("IKJAX_STREAM", "auto", ("auto", "active", "chunks", "layer"),
             "host experts of a big batch: stream only the routed experts (ik's -ooae), every expert a run at a "
             "time (`chunks`), the whole layer at once, or `auto`: chunks once the batch's picks would touch "
             "nearly every expert (no `--gpu-experts`)",
             "ikjax.ops.moe"),
    Variable("IKJAX_STREAM_AHEAD", "2", (), "runs of streamed experts held on the GPU at once (`IKJAX_STREAM=chunks`)",
             "ikjax.ops.moe"),
    Variable("IKJAX_STREAM_COPY", "auto", ("auto", "engine", "xla"),
             "how `IKJAX_STREAM=chunks` copies a run: the copy engine on a side stream (auto where the CUDA handler "
             "is built) or slices that XLA moves", "ikjax.ops.moe"),
    Variable("IKJAX_STREAM_ORDER", "prev", ("prev", "self", "free"),
             "when a streamed layer's host-to-device copy may start (`IKJAX_STREAM=layer`)", "ikjax.ops.moe"),
    Variable("IKJAX_STREAM_MIB", "512", (), "MiB of expert blocks per streaming round", "ikjax.ops.moe"),
    Variable("IKJAX_HOST_EXPERTS", "pinned", ("pinned", "mmap"),
             "host experts next to a GPU: a pinned copy, or the memory map's own pages", "ikjax.placement.host"),
    Variable("IKJAX_MIN_OFFLOAD_BATCH", "32", (),
             "ik's rule for host experts: batches of at least this x n_expert / n_expert_used tokens "
             "stream them to the GPU", "ikjax.placement.host"),
    Variable("IKJAX_PROMPT_BUCKETS", "one", ("one", "many"),
             "GPU -mla 2/3 -fa prompt steps (one device, Pallas prompt attention): one compiled step over the "
             "whole cache, its kv_b expansion bounded by the step's last position at run time, or one step per "
             "KV bucket (the form before)", "ikjax.runtime.engine"),
    Variable("IKJAX_FLASH_LOOP", "context", ("context", "bucket"),
             "XLA's blocked attention: loop over the KV blocks up to the last query's, or over the whole bucket",
             "ikjax.ops.attn"),
    Variable("IKJAX_SHORT_STEPS", "absorbed", ("absorbed", "expanded"),
             "-mla 3 steps of few tokens (T < 171 at DeepSeek's dims): attention over the latent cache as "
             "decode's, or expanded by kv_b as prompts'", "ikjax.model.deepseek2"),
    Variable("IKJAX_FOLD_NORM", "1", ("1", "0"),
             "GPU decode: the RMSNorm before a product folded into the Pallas product (its weight times x, the "
             "1/rms on the sum), or its own kernels", "ikjax.ops.quant_matmul"),
    Variable("IKJAX_PREFETCH", "1", ("1", "0"),
             "fault in the next layer's file pages on a thread while a layer loads", "ikjax.model.weights"),
    Variable("IKJAX_LOAD_OVERLAP", "auto", ("auto", "1", "0"),
             "load the weights in a thread while the first steps compile from their shapes; `auto`: where "
             "steps compile side by side (one accelerator, weights all on it)", "ikjax.runtime.engine"),
    Variable("IKJAX_JOIN_TIMEOUT", "300", (), "seconds a process of a several-process run (--coordinator) waits "
             "for the others to join before it ends with one line", "ikjax.runtime.distributed"),
    Variable("IKJAX_EARLY_BACKEND", "1", ("1", "0"),
             "start JAX's backend on a thread as the command line starts (beside its imports and parsing)",
             "ikjax.early_backend"),
    Variable("IKJAX_WEIGHTS", "", ("copy",),
             "`copy`: copy CPU weights out of the memory map instead of aliasing its pages", "ikjax.model.weights"),
    Variable("IKJAX_BATCH_INVARIANT", "0", ("1", "0"),
             "`1`: decode steps in batch-invariant form (GPU kernels in one-row tiles, order-fixed sums, "
             "RMSNorm one row per program): a batched row gets the bits it gets alone, so greedy answers "
             "do not depend on the batch (RESULTS §23c); `serve` sets it unless told otherwise "
             "(`--no-batch-invariant`), `generate --batch-invariant` too; costs ~8 % of GPU S_TG at batch 1", "ikjax.ops.registry"),
    Variable("IKJAX_INVARIANT_FORM", "rows", ("rows", "dot"),
             "batch-invariant decode products (IKJAX_BATCH_INVARIANT=1): `rows`, a program per row; `dot`, the "
             "dense and per-head products on the matrix unit in tiles of 16 rows (faster at 8 rows, slower at 1: "
             "RESULTS §23l, §23aa)", "ikjax.ops.registry"),
    Variable("IKJAX_SERVE_BURST_MS", "40", (),
             "`serve`: a decode dispatch makes as many tokens (up to 8) as fit this many ms at the last "
             "dispatch's pace; its tokens reach the streams together, and a request arriving meanwhile "
             "waits for its end (RESULTS §23m)", "ikjax.runtime.scheduler"),
    Variable("IKJAX_SERVE_SOLO", "1", ("1", "0"),
             "`serve`: a lone decoding stream runs as a batch of one (its slot's row taken out of the slots' "
             "cache until anything else happens), not as one live row among idle ones (RESULTS §23n)",
             "ikjax.runtime.scheduler"),
    Variable("IKJAX_SERVE_TRACE", "", (),
             "a file: `serve` writes every prompt chunk and decode step's start and end there (JSON lines) "
             "when it stops, to see where a stream's token waited", "ikjax.runtime.scheduler"),
    Variable("IKJAX_DECODE_LOOP", "1", ("1", "0"),
             "`0`: one dispatch per generated token instead of the on-device decode loop", "ikjax.runtime.engine"),
    Variable("IKJAX_PIPELINE_MB", "auto", ("auto", "1", "2", "4", "8"),
             "`-sm layer` prompt steps as this many micro-batches in flight (stage k on one while stage "
             "k+1 runs the one before); auto: on GPUs, up to 4 of at least 256 tokens, one where a stage's "
             "experts are in host RAM (each micro-batch would move them over the link again)", "ikjax.runtime.pipeline"),
    Variable("IKJAX_MESH_GRAPH", "0", ("0", "1"),
             "`1`: on GPUs the `-sm graph` decode loop's command buffers also capture its collectives "
             "(NCCL inside the CUDA graph: the whole loop one graph, as on one device)", "ikjax.runtime.executors"),
    Variable("IKJAX_STORE_STEPS", "auto", ("auto", "1", "0"),
             "store compiled steps as executables beside JAX's cache (auto: on accelerators only)",
             "ikjax.runtime.executables"),
    Variable("IKJAX_STORE_PROGRAMS", "1", ("1", "0"),
             "keep a load's small programs (repacks, stacks) whole where steps are stored (0: never)",
             "ikjax.runtime.compile_cache"),
    Variable("IKJAX_DRY_SHAPES", "auto", ("auto", "1", "0"),
             "compile steps from the weights' shapes computed before the load, not after its first layers (auto: on accelerators; 0: after)",
             "ikjax.runtime.engine"),
    Variable("IKJAX_PROGRAMS_AHEAD", "1", ("1", "0"),
             "with the dry shapes (IKJAX_DRY_SHAPES), compile the load's programs side by side ahead of the load "
             "that runs them (0: the load compiles each as it comes)", "ikjax.runtime.compile_cache"),
    Variable("IKJAX_PREFETCH_STEPS", "1", ("1", "0"),
             "read the stored steps the last run of the same model and options used while the weights load (0: off)",
             "ikjax.runtime.compile_cache"),
    Variable("IKJAX_COMPILE_CACHE", "", (),
             "directory of the persistent compilation cache (`0` turns it off; default ~/.cache/ikjax/xla)",
             "ikjax.runtime.compile_cache"),
    Variable("IKJAX_CACHE", "", (), "directory of the built-in and `synthetic:` models (default ~/.cache/ikjax)",
             "ikjax.tools.synthetic"),
    Variable("IKJAX_DEBUG", "", (), "any value: the CLI prints a traceback where an unexpected error would be one line (an error ikjax names, "
             "such as a missing file, stays one line)",
             "ikjax.cli"),
    Variable("IKJAX_CPU_ISA", "", ("generic", "avx2", "avx512", "amx"),
             "cap the C++ kernels' instruction-set level (read by the C++ runtime per call)",
             "pallas_kernels/cpu/runtime.cc"),
    Variable("IKJAX_AVXVNNI", "1", ("1", "0"),
             "`0`: the avx2 level's int8 products without AVX-VNNI where the CPU has it (vpmaddubsw + "
             "vpmaddwd instead of vpdpbusd; the same integers)", "pallas_kernels/cpu/runtime.cc"),
    Variable("IKJAX_AMX", "bf16", ("bf16", "int8"),
             "the amx level's prompt products on its tiles (IKJAX_AMX_MIN_ROWS): bf16 tiles (tdpbf16ps, f32 sums over the whole row, "
             "where the CPU has amx_bf16) or int8 tiles (tdpbusd, each block's sums scaled on the vector unit)",
             "pallas_kernels/cpu/runtime.cc"),
    Variable("IKJAX_AMX_FUSED", "1", ("1", "0"),
             "`0`: the amx level's bf16 tile panels built in two passes (int8 panel, then bf16) as before "
             "the one-pass builder; the same bits", "pallas_kernels/cpu/runtime.cc"),
    Variable("IKJAX_AMX_VSCALE", "1", ("1", "0"),
             "`0`: the avx512 / amx levels' prompt panels read their weights' scales row by row, as before they were "
             "gathered 16 rows at once; the same bits", "pallas_kernels/quant_matmul/cpu_kernel.cc"),
    Variable("IKJAX_MALLOC", "1", ("1", "0"),
             "`0`: a CPU-only run keeps glibc malloc's defaults (else its step buffers are kept between steps: "
             "mmap threshold 32 MiB, 1 GiB of free heap kept; not where a MALLOC_* variable is set)",
             "ikjax/runtime/host_malloc.py"),
    Variable("IKJAX_ATTN_KEYS_ONCE", "1", ("1", "0"),
             "`0`: the f32 CPU prompt attention (avx2, generic levels) converts each token tile's keys itself, not "
             "each head's keys once a call", "pallas_kernels/mla_decode/cpu_kernel.cc"),
    Variable("IKJAX_AMX_ATTN", "1", ("1", "0"),
             "`0`: the amx level's prompt attention (per-head K / V, bf16) on AVX-512 BF16 pairs, not on its bf16 tiles",
             "pallas_kernels/mla_decode/cpu_kernel.cc"),
    Variable("IKJAX_AMX_PREFETCH", "1", ("1", "0"),
             "`0`: the amx level's bf16 tile loop without its prefetch of x's rows two blocks ahead; the same bits",
             "pallas_kernels/quant_matmul/cpu_kernel.cc"),
    Variable("IKJAX_IQ4XS_K256", "0", ("0", "1"),
             "`1`: the avx2 level's IQ4_XS prompt products quantize x per 256 values (Q8_K's grouping) and scale "
             "each block's sums in integers, as before x per 32 became the default", "pallas_kernels/quant_matmul/cpu_kernel.cc"),
    Variable("IKJAX_Q8X2", "1", ("1", "0"),
             "`0`: the avx2 level's prompt products take their weight panels one at a time, as before two "
             "panels shared each x load; the same bits", "pallas_kernels/quant_matmul/cpu_kernel.cc"),
    Variable("IKJAX_NIB4", "1", ("1", "0"),
             "`0`: the avx2 level's decode of Q4_0 / Q4_1 / Q5_0 / Q5_1 one block at a time (a convert and an "
             "FMA a block), as before 4 blocks shared them; other bits (the same integers, summed in another order)",
             "pallas_kernels/quant_matmul/cpu_kernel.cc"),
    Variable("IKJAX_Q8_PINNED", "1", ("1", "0"),
             "`0`: the avx2 level's int8 prompt loops as GCC laid them out before each accumulator was pinned "
             "to its register (a register copy, under AVX-VNNI also a stack store, per product); the same bits",
             "pallas_kernels/quant_matmul/cpu_kernel.cc"),
    Variable("IKJAX_CPU_ROW_SPLIT", "1", ("1", "0"),
             "`0`: a CPU prompt product with fewer column units than twice the threads (a router, a 576-column "
             "kv_a at -t 16) splits its columns only, not x's rows too; the same bits",
             "pallas_kernels/quant_matmul/cpu_kernel.cc"),
    Variable("IKJAX_CPU_PART_ROWS", "", (),
             "an integer >= 64: every CPU prompt product's x in parts of at most that many rows, each run against "
             "the whole weight (its panels converted again per part; a tuning knob); unset: only IKJAX_CPU_ROW_SPLIT's",
             "pallas_kernels/quant_matmul/cpu_kernel.cc"),
    Variable("IKJAX_AMX_MIN_ROWS", "", (),
             "rows from which the amx level's prompt products run on its tiles (an integer >= 16; fewer rows: "
             "AVX-512 VNNI on the same panels); unset: the default `ikjax info` names", "pallas_kernels/cpu/runtime.cc"),
    Variable("IKJAX_SPIN", "", (), "microseconds a C++ pool worker spins before sleeping (read once)",
             "pallas_kernels/cpu/runtime.cc"),
    Variable("IKJAX_MOE_ONE_JOB", "1", ("0", "1"), "a decode-sized routed-experts call as one C++ pool job "
             "(gate / up, a wait, down: one wake-up of the pool a layer); 0: two jobs (read once)",
             "pallas_kernels/moe_matmul/cpu_kernel.cc"),
    Variable("IKJAX_HOST_CALL", "flag", ("flag", "hostfunc"), "how a GPU step hands routed experts in host RAM "
             "to the CPU and gets them back: `flag`, the stream writes a number to pinned memory and waits for the "
             "host's (CUDA stream memory operations, one worker thread a stream); `hostfunc`, a CUDA host function "
             "(read once)", "pallas_kernels/moe_matmul/cuda_host.cc"),
    Variable("IKJAX_SPIN_LONG", "", (), "microseconds a C++ pool worker spins after a part of 1 ms or more "
             "(default 50, at most IKJAX_SPIN; read once): XLA's own ops run next, on the same cores",
             "pallas_kernels/cpu/runtime.cc"),
    Variable("IKJAX_FIXTURES", "", (), "directory of the real-converter GGUF fixtures (tests only)", "tests/"),
)
VARIABLES: dict[str, Variable] = {v.name: v for v in _VARS}


def _var(name: str) -> Variable:
    try:
        return VARIABLES[name]
    except KeyError:  # a programming error: every variable is declared above
        raise KeyError(f"{name} is not declared in ikjax.env") from None


def raw(name: str) -> str | None:
    """The variable's value as set (None when unset)."""
    _var(name)
    return os.environ.get(name)


def values(names: tuple[str, ...]) -> tuple:
    """(name, effective value) of these registered variables now: the value set, or the default
    where unset or empty; a choice in lower case (as `choice` reads it). One pass over os.environ,
    cheap enough for every step call (the StepPlan's settings, a stored step's key): a variable left
    unset and one set to its default trace the same step, so they must key it the same (RESULTS
    §22k: IKJAX_LAYERS unset and `auto` were two keys, and a warm run recompiled)."""
    get = os.environ.get
    out = []
    for n in names:
        v = VARIABLES[n]
        value = get(n) or v.default
        out.append((n, value.lower() if v.choices else value))
    return tuple(out)


def is_set(name: str) -> bool:
    return bool(raw(name))


def set_choice(name: str, value: str) -> None:
    """Set a choice variable for this process and the ones it starts (a surface's default for a
    setting the traces read: the stored compiled steps are keyed on these variables)."""
    if value not in _var(name).choices:
        raise OptionError(f"{name} must be one of {', '.join(_var(name).choices)}, got {value!r}")
    os.environ[name] = value


def choice(name: str) -> str:
    """A variable with a fixed set of values, case-insensitive; unset = its default."""
    v = _var(name)
    value = (os.environ.get(name) or v.default).lower()
    if value not in v.choices and not (value == "" and v.default == ""):
        raise OptionError(f"{name} must be one of {', '.join(v.choices)}, got {value!r}")
    return value


# the largest value a numeric variable takes (a finite count of MiB, ms, s or steps: `inf` and
# 1e300 passed `> 0` and failed at first use, after a load)
POSITIVE_MAX = 2**31


def _positive(name: str, cast, what: str):
    value = os.environ.get(name) or _var(name).default
    try:
        x = cast(value)
    except (ValueError, OverflowError):
        x = 0
    if not (0 < x <= POSITIVE_MAX):  # (NaN fails it too)
        raise OptionError(f"{name} must be a positive {what} (at most {POSITIVE_MAX}), got {value!r}")
    return x


def positive_int(name: str) -> int:
    return _positive(name, int, "integer")


def positive_float(name: str) -> float:
    """A positive number (of MiB, for IKJAX_STREAM_MIB)."""
    return _positive(name, float, "number of MiB" if name.endswith("_MIB") else "number")


def xdg_cache_home() -> Path:
    """$XDG_CACHE_HOME, else ~/.cache (the freedesktop rule)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def cache_home() -> Path:
    """$IKJAX_CACHE, else $XDG_CACHE_HOME/ikjax, else ~/.cache/ikjax."""
    set_ = raw("IKJAX_CACHE")
    if not set_:
        return xdg_cache_home() / "ikjax"
    p = Path(set_).expanduser()
    if p.exists() and not p.is_dir():  # (named "output: cannot create /dev/null/tiny-...gguf" before)
        raise OptionError(f"IKJAX_CACHE: {set_} is not a directory (the synthetic models' cache)")
    return p


# The C++ runtime's numeric knobs and the least each takes (it reads them itself and, on a value it
# cannot use, runs its default: checked here first, so a typo is an error, not a silent default)
NATIVE_MIN = {"IKJAX_SPIN": 0, "IKJAX_SPIN_LONG": 0, "IKJAX_AMX_MIN_ROWS": 16, "IKJAX_CPU_PART_ROWS": 64}


def check_native() -> None:
    """Refuse (OptionError naming the variable) a value the C++ kernels would not use: their choice
    knobs outside the table's values, their numbers not integers or under NATIVE_MIN. Called when
    an engine loads, before any kernel reads them."""
    for v in VARIABLES.values():
        value = os.environ.get(v.name)
        if not value or not v.read_by.endswith(".cc"):
            continue
        if v.choices:
            # the C++ side compares exactly: `Generic` passed a case-insensitive check and ran the default
            if value not in v.choices:
                choice(v.name)  # (names the values)
                raise OptionError(f"{v.name} must be one of {', '.join(v.choices)} (lower case, as the C++ "
                                  f"kernels read it), got {value!r}")
        elif v.name in NATIVE_MIN:
            # plain digits, as strtoll reads them whole (`3_2` and `32 ` passed int() and ran the default),
            # and no more than POSITIVE_MAX (atoll of 20 digits overflowed)
            lo = NATIVE_MIN[v.name]
            if not (value.isascii() and value.isdigit() and lo <= int(value) <= POSITIVE_MAX):
                raise OptionError(f"{v.name} must be an integer >= {lo} (at most {POSITIVE_MAX}), got {value!r}")


# The numeric variables their modules read as positive numbers (positive_int / positive_float), and
# the word each also takes
POSITIVE = {"IKJAX_DECODE_UNROLL": (int, "auto"), "IKJAX_JOIN_TIMEOUT": (int, None), "IKJAX_STREAM_AHEAD": (int, None),
            "IKJAX_STREAM_MIB": (float, None), "IKJAX_MIN_OFFLOAD_BATCH": (int, None),
            "IKJAX_SERVE_BURST_MS": (float, None)}
_warned_unknown: set[str] = set()


def check_all() -> None:
    """Every IKJAX_* variable set now, checked when an engine loads (before the file is opened):
    a choice outside its values or a number its module cannot use is refused naming it
    (OptionError), the C++ kernels' knobs as `check_native`. Why here: each is otherwise read
    only when its path runs (IKJAX_STREAM_MIB=-5 was refused at the first host-expert step, after
    a minute's load; IKJAX_DECODE_LOOP=yes after the load). A name ikjax does not know (a typo:
    IKJAX_KERNELS misspelt) is named on stderr once, with the closest known one, and left alone."""
    import difflib
    import sys
    for name, value in os.environ.items():
        if not name.startswith("IKJAX_"):
            continue
        v = VARIABLES.get(name)
        if v is None:
            if name not in _warned_unknown:
                _warned_unknown.add(name)
                near = difflib.get_close_matches(name, VARIABLES, n=1)
                print(f"ikjax: {name} is not a variable ikjax reads (ignored)"
                      + (f"; did you mean {near[0]}?" if near else ""), file=sys.stderr)
            continue
        if not value:
            continue
        if v.choices:
            choice(name)
        elif name in POSITIVE:
            cast, word = POSITIVE[name]
            if word is None or value.lower() != word:
                (positive_int if cast is int else positive_float)(name)  # the readers' own check
    check_native()


def markdown_table() -> str:
    """The README's table of every variable (a test keeps the README in step with it)."""
    rows = ["| variable | values | default | what it does | read by |", "|---|---|---|---|---|"]
    for v in _VARS:
        values = " ".join(f"`{c}`" for c in v.choices) or "—"
        rows.append(f"| `{v.name}` | {values} | {f'`{v.default}`' if v.default else 'unset'} | {v.meaning} | "
                    f"`{v.read_by}` |")
    return "\n".join(rows)
