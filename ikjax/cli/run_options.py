"""The run options that sweep-bench, bench, generate and info share, declared once.

ik_llama.cpp's tools take the same block of flags (-c -b -ub -mla -fa -amb -ctk -ctv -fmoe -ser -ot
-ngl -t -tb -cmoe -ncmoe, the switches -sm -mg -ts -rtr ...), and so do these commands. That block
used to be re-declared, parameter by parameter, in each command; now it is the signature of
`_shared` below, written once, and a command says it takes it:

    @app.command("sweep-bench", cls=ExactCommand)
    @handle
    @takes_run_options(after={"n_gen": "ubatch", "output_format": "wb"})
    def sweep_bench(run: RunArgs, n_gen: ... = None, output_format: ... = "md", ...):

`takes_run_options` splices the shared `inspect.Parameter`s (each an `Annotated[..., typer.Option]`
with its default) into the command's `__signature__`, so typer, `--help` and `ikjax run --config`
see one flat list of options, and hands their values to the function as one `RunArgs` (`run.ctx`,
`run.model`, or the dict itself for `check_options`). How the command's own parameters are laid
out among the shared ones is explicit in `after` (the help lists options in signature order); a
command parameter named like a shared option replaces it — bench's comma-list variants do that,
visibly, in bench's own signature.

`check_options` turns the values into `RunOptions` (validated, one note per option that has no
effect here) before anything is loaded.
"""
import dataclasses
import functools
import inspect
import logging
import typing
from typing import Annotated, Any, Callable, Iterable, Optional

import typer

from ikjax import env
from ikjax.cli.common import backend, log
from ikjax.cli.parser import given_options
from ikjax.errors import OptionError
from ikjax.options import RunOptions, switch_notes

_D = RunOptions()
# ik's common default -amb (common.h attn_max_batch = 256) for the commands that mirror its common-argument
# tools (sweep-bench, generate, info); llama-bench's default is 0 and bench keeps it. Only -fa 0 uses it.
AMB_DEFAULT = 256

# ik switches that change nothing here: accepted with a one-line note (or refused), see options.switch_notes
_NOTE = "accepted; a note says why it has no effect here"
_ONE = "; with one device a note says it has no effect"


def _shared(
    # ik_llama.cpp names first, long names beside
    model: Annotated[Optional[str], typer.Option(
        "-m", "--model", help="GGUF file (any shard of a split model), or synthetic:PRESET[:TYPE[:LAYERS]] "
        "(made once, cached in ~/.cache/ikjax). Default: the built-in tiny synthetic model.")] = None,
    ctx: Annotated[int, typer.Option("-c", "--ctx", "--ctx-size", help="context size in tokens (KV cache length; "
                                     "0 = the model's training context, as ik)")
                   ] = _D.ctx,
    batch: Annotated[int, typer.Option("-b", "--batch", "--batch-size", help="logical batch size")] = _D.batch,
    ubatch: Annotated[int, typer.Option("-ub", "--ubatch", "--ubatch-size",
                                        help="micro-batch: tokens per prompt-processing step")] = _D.ubatch,
    mla: Annotated[int, typer.Option("-mla", "--mla", "--mla-use", help="MLA mode: 0 standard attention (per-head "
                                     "K/V cache), 1 absorbed, 2 PP decompressed + TG absorbed, 3 as 2 with the "
                                     "flash kernel for TG (best)")] = _D.mla,
    fa: Annotated[str, typer.Option("-fa", "--fa", "--flash-attn", help="flash attention on|off|auto|1|0 (bare -fa "
                                    "= 1; auto = on, as ik). On: blocked attention over --kv-block rows at a time; "
                                    "off: the scores in memory, in head chunks capped by -amb")
                  ] = str(int(_D.fa)),
    no_fa: Annotated[Optional[str], typer.Option("-no-fa", "--no-flash-attn",
                                                 help="flash attention off (same as -fa 0)")] = None,
    amb: Annotated[int, typer.Option("-amb", "--amb", "--attention-max-batch",
                                     help="without FA: cap the K*Q buffer at N MiB (attention in head chunks); 0 = "
                                     "off; no effect with FA. Default 256, ik's common default")
                   ] = AMB_DEFAULT,
    ctk: Annotated[str, typer.Option("-ctk", "--ctk", "--cache-type-k", help="KV cache type: f32, f16, bf16, q8_0")
                   ] = _D.ctk,
    ctv: Annotated[Optional[str], typer.Option(
        "-ctv", "--ctv", "--cache-type-v", help="V cache type (default: the -ctk type). With -mla 1-3 there is no V "
        "cache: a different type is noted and has no effect; with -mla 0 it must equal -ctk")] = None,
    fmoe: Annotated[str, typer.Option("-fmoe", "--fmoe", "--fused-moe", help="fused MoE 0|1 (bare -fmoe = 1; "
                                      "default on, as ik)")] = str(int(_D.fmoe)),
    no_fmoe: Annotated[Optional[str], typer.Option("-no-fmoe", "--no-fused-moe",
                                                   help="fused MoE off (same as -fmoe 0)")] = None,
    ser: Annotated[Optional[str], typer.Option("-ser", "--ser", "--smart-expert-reduction",
                                               help="smart expert reduction 'Kmin,t'")] = None,
    ot: Annotated[Optional[list[str]], typer.Option("-ot", "--ot", "--override-tensor",
                                                    help="tensor placement REGEX=DEVICE[,...], first match wins "
                                                    "(e.g. exps=CPU); may repeat")] = None,
    cpu_moe: Annotated[Optional[str], typer.Option(
        "-cmoe", "--cpu-moe", help="routed experts of all layers in host memory (shorthand for -ot "
        "'ffn_(up|down|gate)_exps=CPU')")] = None,
    n_cpu_moe: Annotated[int, typer.Option(
        "-ncmoe", "--n-cpu-moe", help="routed experts of the first N layers in host memory (shorthand for -ot "
        "'blk\\.(0|...|N-1)\\.ffn_(up|down|gate)_exps=CPU')")] = _D.n_cpu_moe,
    ngl: Annotated[int, typer.Option("-ngl", "--ngl", "--n-gpu-layers", "--gpu-layers",
                                     help="layers on accelerators")] = _D.ngl,
    threads: Annotated[int, typer.Option("-t", "--threads", help="CPU threads for generation (0 = all cores)")
                       ] = _D.threads,
    threads_batch: Annotated[int, typer.Option("-tb", "--threads-batch",
                                               help="CPU threads for prompt processing (0 = same as -t)")
                             ] = _D.threads_batch,
    dtype: Annotated[str, typer.Option("--dtype", help="dtype of the activations fed to the matmuls: auto (bf16 "
                                       "where the kernels run them, the C++ kernels on a CPU and Pallas on a GPU; f32 "
                                       "on the XLA path; $IKJAX_DTYPE overrides auto), f32, bf16, f16. "
                                       "Weights stay in their GGUF types; the KV cache type is -ctk (not an ik flag)")
                   ] = _D.dtype,
    kv_block: Annotated[int, typer.Option("--kv-block", help="KV rows per block of the blocked (-fa) attention, and "
                                          "the granularity of the KV lengths steps are compiled for (not an ik flag)")
                        ] = _D.kv_block,
    nrep: Annotated[Optional[str], typer.Option("-nrep", "--n-repetitions", help="sweep-bench: repetitions of the "
                                                "first row, averaged (ik's -nrep); noted elsewhere")] = None,
    split_mode: Annotated[Optional[str], typer.Option(
        "-sm", "--split-mode", help="none|layer|graph: one device, whole layers per device (pipeline), or every "
        "layer split over a mesh" + _ONE)] = None,
    main_gpu: Annotated[Optional[str], typer.Option("-mg", "--main-gpu", help="the device of -sm none" + _ONE)] = None,
    ts: Annotated[Optional[str], typer.Option("-ts", "--ts", "--tensor-split", help="shares per device for -sm layer, "
                                              "e.g. 3,1 (equal if not given)" + _ONE)] = None,
    rtr: Annotated[Optional[str], typer.Option("-rtr", "--run-time-repack", help="run-time repack: " + _NOTE)] = None,
    thp: Annotated[Optional[str], typer.Option("-thp", "--transparent-huge-pages", help="huge pages: " + _NOTE)] = None,
    no_mmap: Annotated[Optional[str], typer.Option("--no-mmap", help=_NOTE)] = None,
    numa: Annotated[Optional[str], typer.Option("--numa", help="distribute|isolate|numactl: " + _NOTE)] = None,
    nkvo: Annotated[Optional[str], typer.Option("-nkvo", "--no-kv-offload", help="KV cache in host memory: no effect "
                                                "on CPU; refused on an accelerator (not implemented)")] = None,
    ooae: Annotated[Optional[str], typer.Option("-ooae", "--offload-only-active-experts", help=_NOTE)] = None,
    no_ooae: Annotated[Optional[str], typer.Option("-no-ooae", "--no-offload-only-active-experts", help=_NOTE)] = None,
    op: Annotated[Optional[str], typer.Option("-op", "--offload-policy", help="per-op offload policy: " + _NOTE)] = None,
    cuda: Annotated[Optional[str], typer.Option("-cuda", "--cuda-params", help="ggml-cuda tuning: " + _NOTE)] = None,
    muge: Annotated[Optional[str], typer.Option("-muge", "--merge-up-gate-experts", help=_NOTE)] = None,
    mqkv: Annotated[Optional[str], typer.Option("-mqkv", "--merge-qkv", help=_NOTE)] = None,
    ger: Annotated[Optional[str], typer.Option("-ger", "--grouped-expert-routing",
                                               help=_NOTE + " (expert groups are always applied)")] = None,
    wb: Annotated[Optional[str], typer.Option("-wb", "--warmup-batch",
                                              help=_NOTE + " (steps are always warmed up)")] = None,
    no_warmup: Annotated[Optional[str], typer.Option("--no-warmup", help="sweep-bench, bench: no untimed first run "
                                                     "of each step (its first-run costs land in the first timings); "
                                                     "noted elsewhere")] = None,
    gr: Annotated[Optional[str], typer.Option("-gr", "--graph-reuse", help="graph reuse: always on here; -gr 0 "
                                              "is noted")] = None,
    no_gr: Annotated[Optional[str], typer.Option("-no-gr", "--no-graph-reuse", help=_NOTE)] = None,
    khad: Annotated[Optional[str], typer.Option("-khad", "--k-cache-hadamard", help=_NOTE)] = None,
    no_fug: Annotated[Optional[str], typer.Option("-no-fug", "--no-fused-up-gate", help=_NOTE)] = None,
    no_mmad: Annotated[Optional[str], typer.Option("-no-mmad", "--no-fused-mul-multiadd", help=_NOTE)] = None,
    rcache: Annotated[Optional[str], typer.Option("-rcache", "--rope-cache", help=_NOTE)] = None,
    smgs: Annotated[Optional[str], typer.Option("-smgs", "--split-mode-graph-scheduling", help=_NOTE)] = None,
    sas: Annotated[Optional[str], typer.Option("-sas", "--scheduler-async", help=_NOTE)] = None,
    grt: Annotated[Optional[str], typer.Option("-grt", "--graph-reduce-type", help=_NOTE)] = None,
    cram: Annotated[Optional[str], typer.Option("-cram", "--cache-ram", help=_NOTE)] = None,
    dt: Annotated[Optional[str], typer.Option("-dt", "--defrag-thold", help=_NOTE)] = None,
    minilog: Annotated[Optional[str], typer.Option("--minilog", help=_NOTE)] = None,
    mlock: Annotated[Optional[str], typer.Option("--mlock", help=_NOTE)] = None,
    color: Annotated[Optional[str], typer.Option("-co", "--color", help=_NOTE)] = None,
    fit: Annotated[Optional[str], typer.Option("--fit", help="fit the model to device memory: " + _NOTE
                                               + " (the memory plan refuses what does not fit)")] = None,
    expert_stats: Annotated[Optional[str], typer.Option(
        "--expert-stats", metavar="FILE.json", help="count the tokens each MoE layer routes to each expert over "
        "the whole run (prompt and generation; not bench's and sweep-bench's warm-ups) and write them to FILE.json "
        "when it ends, also after Ctrl-C or SIGTERM (not an ik flag)")] = None,
    gpu_experts: Annotated[Optional[str], typer.Option(
        "--gpu-experts", metavar="auto|N", help="with routed experts in host memory (-ot exps=CPU, --cpu-moe, "
        "--n-cpu-moe): also keep the most used ones on the GPU, chosen from the --expert-stats FILE.json of an "
        "earlier run (which this run then adds its own counts to): auto = as many as the memory plan leaves "
        "room for, N = the top N of each layer (not an ik flag)")] = None,
    # how the run is carried out, not what it computes
    verbose: Annotated[bool, typer.Option("-v", "--verbose", help="log loading and compilation")] = False,
    compile_cache_dir: Annotated[Optional[str], typer.Option(
        "--compile-cache", metavar="DIR", help="keep compiled steps in DIR across runs (0: off); default "
        "$IKJAX_COMPILE_CACHE, else ~/.cache/ikjax/xla (not an ik flag)")] = None,
    # several processes (hosts) on jax.distributed: ikjax.runtime.distributed
    coordinator: Annotated[Optional[str], typer.Option(
        "--coordinator", help="HOST:PORT of process 0's coordinator: run this command on every process (hosts) "
        "with -sm graph; the mesh spans all their devices, process 0 prints (see README)")] = None,
    num_processes: Annotated[Optional[int], typer.Option("--num-processes",
                                                         help="processes in all (with --coordinator)")] = None,
    process_id: Annotated[Optional[int], typer.Option("--process-id",
                                                      help="this process's index 0..N-1 (with --coordinator)")] = None,
) -> None:
    """Never called: its signature is the declaration of the shared options, in their help order."""


SHARED: dict[str, inspect.Parameter] = {
    p.name: p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in inspect.signature(_shared).parameters.values()}
ALL = tuple(SHARED)
# what `info`'s memory plan depends on (-c -b -ub -mla -fa -amb -ctk -ctv -ot ...); `info` takes every
# shared option, so an ik command line pasted after `ikjax info` is accepted as it is
PLAN_OPTIONS = ("model", "ctx", "batch", "ubatch", "mla", "fa", "amb", "ctk", "ctv", "ot", "cpu_moe", "n_cpu_moe",
                "kv_block")

# the shared options that become ikjax.load keyword arguments (RunOptions names), and ik's switches
RUN_OPTION_PARAMS = ("ctx", "batch", "ubatch", "mla", "fa", "amb", "ctk", "ctv", "fmoe", "ser", "ot", "ngl", "threads",
                     "threads_batch", "cpu_moe", "n_cpu_moe", "dtype", "kv_block", "split_mode", "main_gpu", "ts",
                     "gpu_experts")
SWITCH_PARAMS = ("split_mode", "main_gpu", "ts", "rtr", "thp", "no_mmap", "numa", "nkvo", "ooae", "no_ooae", "op",
                 "cuda", "muge", "mqkv", "ger", "wb", "nrep", "no_warmup", "gr", "no_gr", "fit", "mmp", "khad",
                 "no_fug", "no_mmad", "rcache", "smgs", "sas", "grt", "cram", "dt", "minilog", "mlock",
                 "color")


class RunArgs(dict):
    """The shared options' values as a command got them: parameter name -> value, also as attributes
    (`run.ctx`). A command's own replacement of a shared option (bench's comma lists) is here too."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def takes_run_options(names: Iterable[str] = ALL, *, after: Optional[dict[str, str]] = None) -> Callable:
    """Give a command the shared options `names` (default: all, in their declared order).

    The command's first parameter, `run`, receives their values as a `RunArgs`; its other
    parameters are its own options. Those keep their order and each follows the one before it in
    the final signature, or comes right after the option `after` names for it; the first goes first
    unless placed. An own parameter named like a shared option replaces that option."""
    names = tuple(names)
    after = dict(after or {})
    missing = [n for n in names if n not in SHARED]
    if missing:
        raise TypeError(f"not shared options: {missing}")

    def decorate(func: Callable) -> Callable:
        hints = typing.get_type_hints(func, include_extras=True)
        params = list(inspect.signature(func).parameters.values())
        if not params or params[0].name != "run":
            raise TypeError(f"{func.__name__}: the first parameter must be `run: RunArgs`")
        own = [p.replace(annotation=hints.get(p.name, p.annotation), kind=inspect.Parameter.KEYWORD_ONLY)
               for p in params[1:]]
        own_names = [p.name for p in own]
        if set(after) - set(own_names):
            stray = sorted(set(after) - set(own_names))
            raise TypeError(f"{func.__name__}: `after` names no parameter of it: {stray}")
        layout = [SHARED[n] for n in names if n not in own_names]
        prev: Optional[str] = None
        for p in own:
            anchor = after.get(p.name, prev)
            pos = 0 if anchor is None else [q.name for q in layout].index(anchor) + 1
            layout.insert(pos, p)
            prev = p.name
        signature = inspect.Signature(layout)

        @functools.wraps(func)
        def wrapper(**kwargs: Any) -> Any:
            for on, off in (("fa", "no_fa"), ("fmoe", "no_fmoe")):
                if on in names and off in names and _given(on, kwargs) and _given(off, kwargs):
                    # (-no-fa won whatever the order, unsaid: `-no-fa -fa 1` ran without flash attention)
                    raise OptionError(f"-{on} and -no-{on} both given; give one")
            bound = signature.bind(**kwargs)
            bound.apply_defaults()  # `ikjax run --config` passes only the keys it was given
            values = bound.arguments
            return func(RunArgs({n: values[n] for n in names}), **{n: values[n] for n in own_names})

        wrapper.__signature__ = signature
        wrapper.__annotations__ = {**{p.name: p.annotation for p in layout}, "return": None}
        return wrapper
    return decorate


def _given(name: str, kwargs: dict[str, Any]) -> bool:
    """Whether the user gave option `name`: on the command line (what the command's parser saw,
    `parser.given_options`), or as a key of a config (`ikjax run` passes only the keys the file has)."""
    params, given = given_options()
    if name in params:
        return name in given
    return kwargs.get(name) is not None


def load_kwargs(params: dict[str, Any]) -> dict[str, Any]:
    """A command's option values -> ikjax.load keyword arguments (RunOptions names)."""
    kw = {k: params[k] for k in RUN_OPTION_PARAMS if k in params}
    ot = kw.pop("ot", None)
    if isinstance(ot, list) and any(not str(o).strip() for o in ot):
        raise OptionError("ot: expected REGEX=DEVICE rules, got an empty value")  # as ik refuses `-ot ''`
    if ot:
        kw["ot"] = ",".join(ot) if isinstance(ot, list) else ot
    if params.get("no_fa") is not None and RunOptions.from_kwargs(fa=params["no_fa"]).fa:  # ik's -no-fa
        kw["fa"] = "0"
    no_fmoe = params.get("no_fmoe")
    if no_fmoe is not None and RunOptions.from_kwargs(fmoe=no_fmoe).fmoe:  # ik's -no-fmoe: fused MoE off
        kw["fmoe"] = "0"
    if params.get("expert_stats") is not None:  # the file (load_engine checks, counts and writes it; "" refused there)
        kw["expert_stats"] = params["expert_stats"]
        if params.get("gpu_experts"):  # --gpu-experts reads it first (ikjax.placement.hot)
            kw["expert_counts"] = params["expert_stats"]
    return {k: v for k, v in kw.items() if v is not None}


def model_context_length(model: str | None) -> int:
    """The training context (`<arch>.context_length`) in a model file's header, or the built-in
    default's; the file is not loaded."""
    from ikjax.cli.common import resolve_model
    from ikjax.gguf_io.config import ModelConfig
    from ikjax.gguf_io.reader import GGUFModelFile
    path = resolve_model(model)
    f = GGUFModelFile(path)
    return ModelConfig.from_metadata(f.metadata, source=path, file_tensors=f.tensors).context_length


def check_options(params: dict[str, Any], command: str) -> tuple[dict[str, Any], RunOptions]:
    """Validate a command's run options and ik switches before anything is loaded; print one note per
    option that has no effect here. Returns (ikjax.load keyword arguments, the checked RunOptions)."""
    env.check_all()  # every IKJAX_* set, before the model file is opened (perplexity reads its header first)
    run_opts = load_kwargs(params)
    checked = RunOptions.from_kwargs(**{**run_opts, **({"expert_stats": True} if "expert_stats" in run_opts else {})})
    if checked.ctx == 0:  # ik's -c 0: the model's training context, read now (the commands check rows and slots against it)
        n = model_context_length(params.get("model"))
        log(f"note: -c 0: the model's training context, {n} tokens")
        run_opts["ctx"] = n
        checked = dataclasses.replace(checked, ctx=n)
    switches = {k: params[k] for k in SWITCH_PARAMS if k in params}
    notes = switch_notes(switches, command, backend()) + checked.notes()
    from ikjax.placement.rules import check_ot_devices
    check_ot_devices(checked)
    for line in notes:
        log("note: " + line)
    _drop_repeated_notes(notes)
    return run_opts, checked


class _SaidAlready(logging.Filter):
    """Drops the engine's note that says again what the command line's notes said (`-sm layer has no
    effect with one device`: the placement's note, for the Python API, came out a second time).
    One instance on the "ikjax" logger; each command's check sets what it said."""

    def __init__(self):
        super().__init__()
        self.heads: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.heads:
            return True
        msg = record.getMessage()
        return not (msg.startswith("note: ") and any(msg[6:].startswith(h) for h in self.heads))


_SAID = _SaidAlready()
logging.getLogger("ikjax").addFilter(_SAID)


def _drop_repeated_notes(notes: list[str]) -> None:
    _SAID.heads = {n.split(" (")[0].split(":")[0] for n in notes if "has no effect with one device" in n}
