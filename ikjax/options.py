"""RunOptions: ik_llama.cpp's run flags as one validated, hashable value.

Names follow ik's flags (`-mla`, `-fa`, `-amb`, `-ctk`, `-ctv`, `-fmoe`, `-ser`, `-ot`, `-c`, `-ub`,
`-b`, `-t`, `-tb`, `--cpu-moe`, `--n-cpu-moe`) so the Python API, the CLI and JSON configs share one
vocabulary. Every bad value or impossible combination is refused here, at load, with one line naming
the option; a value that is valid but changes nothing here is reported by `RunOptions.notes()`.
Defaults are ik_llama.cpp's where they change results or speed (`-mla 3`, `-fa` on, fused MoE on).
"""
from __future__ import annotations

import dataclasses
import numbers
import re
import warnings
from dataclasses import dataclass
from typing import Any

from ikjax.errors import OptionError


CACHE_TYPES = ("f32", "f16", "bf16", "q8_0")
COMPUTE_DTYPES = ("auto", "f32", "bf16", "f16")
INT32_MAX = 2**31 - 1
# the tensors `--cpu-moe` / `--n-cpu-moe N` keep in host memory (ik: ffn_{up,down,gate}_exps)
ROUTED_EXPERTS = r"ffn_(up|down|gate)_exps"


def parse_tensor_split(value: Any) -> tuple[float, ...]:
    """`-ts 3,1` (also `3/1`, `3;1` or a list): non-negative shares per device, at least one > 0;
    None / "" = () (equal shares)."""
    if value is None or value == "" or value == ():
        return ()
    if not isinstance(value, (str, list, tuple)):
        raise OptionError(f"-ts: expected shares like 3,1 or a list of numbers, got {value!r}")
    parts = [p for p in re.split(r"[,/;]", value) if p.strip()] if isinstance(value, str) else list(value)
    try:
        shares = tuple(float(p) for p in parts)
    except (ValueError, TypeError):
        raise OptionError(f"-ts: expected shares like 3,1, got {value!r}") from None
    if not shares or any(not (x >= 0) or x == float("inf") for x in shares) or not any(shares):
        raise OptionError(f"-ts: expected non-negative shares like 3,1 (at least one > 0), got {value!r}")
    return shares


def cpu_moe_rules(cpu_moe: bool, n_cpu_moe: int) -> tuple["TensorOverride", ...]:
    """`--cpu-moe` / `--n-cpu-moe N` as the `-ot` rules ik expands them to (routed experts of all
    layers / of layers 0..N-1 on the CPU)."""
    if cpu_moe:
        return (TensorOverride(ROUTED_EXPERTS, "CPU"),)
    if n_cpu_moe > 0:
        layers = "|".join(str(i) for i in range(n_cpu_moe))
        return (TensorOverride(rf"blk\.({layers})\.{ROUTED_EXPERTS}", "CPU"),)
    return ()


@dataclass(frozen=True)
class SmartExpertReduction:
    """`-ser Kmin,t`: keep the top Kmin experts; experts Kmin..K only where p_i > t * p_0."""
    min_experts: int
    threshold: float

    @classmethod
    def parse(cls, value: Any) -> "SmartExpertReduction | None":
        if value is None or value == "" or value is False:
            return None
        if isinstance(value, SmartExpertReduction):
            return value
        try:
            if isinstance(value, str):
                k, t = value.split(",")
            else:
                k, t = value
            k, t = int(k), float(t)
        except (ValueError, TypeError):
            raise OptionError(f"ser: expected 'Kmin,t' (e.g. '6,0.5'), got {value!r}") from None
        if k < 1 or not 0.0 <= t <= 1.0:
            raise OptionError(f"ser: need Kmin >= 1 and 0 <= t <= 1, got {value!r}")
        return cls(k, t)


@dataclass(frozen=True)
class TensorOverride:
    """One `-ot REGEX=DEVICE` rule; the first rule whose regex matches a tensor name wins."""
    pattern: str
    device: str

    def matches(self, name: str) -> bool:
        return re.search(self.pattern, name) is not None

    @classmethod
    def parse_list(cls, value: Any) -> tuple["TensorOverride", ...]:
        if not value:
            return ()
        if not isinstance(value, (str, list, tuple)):
            raise OptionError(f"ot: expected REGEX=DEVICE rules (a string or a list of strings), got {value!r}")
        items = value.split(",") if isinstance(value, str) else list(value)
        rules = []
        for item in items:
            if isinstance(item, TensorOverride):
                rules.append(item)
                continue
            if not isinstance(item, str):
                raise OptionError(f"ot: expected a REGEX=DEVICE string, got {type(item).__name__} {item!r}")
            if "=" not in item:
                raise OptionError(f"ot: expected REGEX=DEVICE, got {item!r}")
            pat, dev = item.split("=", 1)  # at the first "=", as ik (`exps=CPU=CPU`: the device "CPU=CPU")
            if not pat:
                raise OptionError(f"ot: empty regex in {item!r} (REGEX=DEVICE)")
            try:
                with warnings.catch_warnings():  # ("Possible nested set": a FutureWarning, not the user's error)
                    warnings.simplefilter("ignore")
                    re.compile(pat)
            except re.error as e:
                raise OptionError(f"ot: bad regex {pat!r}: {e}") from None
            dev = dev.strip()
            if not re.fullmatch(r"(?i)cpu|gpu\d*|cuda\d*|device\d*", dev):
                raise OptionError(f"ot: unknown device {dev!r} in {item!r} (use CPU, GPU, CUDA0, ...)")
            rules.append(cls(pat, dev.upper()))
        return tuple(rules)


def parse_gpu_experts(value) -> str:
    """`--gpu-experts`: "auto" or a count of experts per layer (>= 0); "" = off."""
    if value is None or value == "" or value is False:
        return ""
    v = str(value).strip().lower()
    if v == "auto" or re.fullmatch(r"[0-9]{1,6}", v):  # ASCII digits ("٣".isdigit() is true)
        return v
    raise OptionError(f"gpu-experts: expected auto or a number of experts per layer, got {value!r}")


@dataclass(frozen=True)
class RunOptions:
    mla: int = 3
    fa: bool = True
    amb: int = 0
    ctk: str = "f16"
    ctv: str = ""  # V cache type; "" = the -ctk type (the only V type the caches store, see _checked)
    fmoe: bool = True  # ik's default: fused MoE on
    ser: SmartExpertReduction | None = None
    ot: tuple[TensorOverride, ...] = ()
    ctx: int = 4096  # 0: the model's training context (ik's -c 0), read from the file when it loads
    ubatch: int = 512
    batch: int = 2048
    dtype: str = "auto"  # matmul input dtype; not an ik flag. auto: f32 on CPU, bf16 on accelerators
    ngl: int = 99
    threads: int = 0  # -t: CPU threads for generation (0 = all cores)
    threads_batch: int = 0  # -tb: CPU threads for prompt processing (0 = same as -t)
    cpu_moe: bool = False  # --cpu-moe: routed experts of every layer in host memory (an -ot shorthand)
    n_cpu_moe: int = 0  # --n-cpu-moe N: routed experts of layers 0..N-1 in host memory (an -ot shorthand)
    kv_block: int = 256  # KV chunk of the blocked (flash) attention; bucket granularity of the KV length
    # -sm / -ts / -mg: how a model spreads over several devices (ikjax.placement.splits); with one device they
    # change nothing (a note says so). none: one device (-mg picks which); layer: whole layers and
    # their KV cache per device in -ts proportions (a pipeline); graph: every layer split over a mesh.
    split_mode: str = "none"
    tensor_split: tuple[float, ...] = ()  # -ts shares per device; () = equal shares
    main_gpu: int = 0  # -mg: the device of -sm none
    # count the tokens each MoE layer routes to each expert over every step (Engine.expert_stats);
    # steps then call back to the host once a layer (not an ik flag: --expert-stats FILE.json)
    expert_stats: bool = False
    # --gpu-experts auto|N: the most used routed experts of host-resident layers also on the GPU,
    # chosen from `expert_counts` (an --expert-stats JSON file of an earlier run; ikjax.placement.hot)
    gpu_experts: str = ""
    expert_counts: str = ""

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "RunOptions":
        known = {f.name for f in dataclasses.fields(cls)}
        aliases = {"c": "ctx", "ub": "ubatch", "b": "batch", "n_ctx": "ctx", "flash_attn": "fa",
                   "cache_type_k": "ctk", "cache_type_v": "ctv", "t": "threads", "tb": "threads_batch",
                   "n_gpu_layers": "ngl", "cmoe": "cpu_moe", "ncmoe": "n_cpu_moe", "fused_moe": "fmoe",
                   "sm": "split_mode", "ts": "tensor_split", "mg": "main_gpu"}
        values: dict[str, Any] = {}
        for key, value in kwargs.items():
            name = aliases.get(key, key)
            if name not in known:
                raise OptionError(f"unknown option {key!r} (known: {', '.join(sorted(known))})")
            values[name] = value
        return cls._checked(values)

    @classmethod
    def _checked(cls, v: dict[str, Any]) -> "RunOptions":
        def integer(name: str, lo: int, hi: int | None = None) -> None:
            if name not in v:
                return
            x = v[name]
            if isinstance(x, numbers.Integral) and not isinstance(x, bool):  # (NumPy's integers too)
                x = int(x)
            if isinstance(x, bool) or not isinstance(x, (int, str)) or not re.fullmatch(r"\s*-?[0-9]+\s*", str(x)):
                raise OptionError(f"{name}: expected an integer, got {x!r}")  # ("--5", "²": int() refused them)
            x = int(x)
            if x < lo or (hi is not None and x > hi):
                raise OptionError(f"{name}: {x} out of range [{lo}, {hi if hi is not None else 'inf'}]")
            v[name] = x

        def boolean(name: str) -> None:
            if name not in v:
                return
            x = v[name]
            if isinstance(x, str) and x.lower() in ("1", "0", "true", "false", "on", "off", "yes", "no"):
                x = x.lower() in ("1", "true", "on", "yes")
            elif name == "fa" and isinstance(x, str) and x.lower() == "auto":  # ik's -fa auto: on where it can run
                x = True
            if isinstance(x, int) and x in (0, 1):
                x = bool(x)
            if not isinstance(x, bool):
                raise OptionError(f"{name}: expected 0/1 or true/false, got {v[name]!r}")
            v[name] = x

        integer("mla", 0, 3)
        integer("amb", 0)
        # token counts index int32 positions (-c 10^23 planned a KV cache of 1.2e20 MiB)
        integer("ctx", 0, INT32_MAX)
        integer("ubatch", 1, INT32_MAX)
        integer("batch", 1, INT32_MAX)
        if str(v.get("ngl", "")).strip() == "-1":  # llama.cpp's -ngl -1: its default, every layer (as 99 here)
            v["ngl"] = 99
        integer("ngl", 0)
        for name in ("threads", "threads_batch"):  # ik's -t -1 / -tb -1: every core, as 0 here
            if str(v.get(name, "")).strip() == "-1":
                v[name] = 0
        integer("threads", 0)
        integer("threads_batch", 0)
        integer("n_cpu_moe", 0)
        integer("kv_block", 1)
        if "main_gpu" in v:
            if v["main_gpu"] is None:
                v.pop("main_gpu")
            else:
                integer("main_gpu", 0)
        if "split_mode" in v:
            m = "none" if v["split_mode"] is None else str(v["split_mode"]).strip().lower()
            if m not in SPLIT_MODES:
                raise OptionError(f"-sm: expected none, layer or graph, got {v['split_mode']!r}")
            v["split_mode"] = m
        if "tensor_split" in v:
            v["tensor_split"] = parse_tensor_split(v["tensor_split"])
        boolean("fa")
        boolean("fmoe")
        boolean("cpu_moe")
        boolean("expert_stats")
        if "gpu_experts" in v:
            v["gpu_experts"] = parse_gpu_experts(v["gpu_experts"])
        if v.get("expert_counts") is None:
            v.pop("expert_counts", None)
        elif "expert_counts" in v:
            v["expert_counts"] = str(v["expert_counts"])
            if v["expert_counts"] and not v.get("gpu_experts"):  # read only to place hot experts: never unused
                raise OptionError("expert_counts: only with gpu_experts (it chooses which experts go to the GPU)")
        if v.get("ctv") is None:
            v.pop("ctv", None)
        for name, allowed in (("ctk", CACHE_TYPES), ("ctv", CACHE_TYPES), ("dtype", COMPUTE_DTYPES)):
            if name in v and not (name == "ctv" and v[name] == ""):
                x = str(v[name]).lower()
                if x not in allowed:
                    raise OptionError(f"{name}: {v[name]!r} is not one of {', '.join(allowed)}")
                v[name] = x
        if "ser" in v:
            v["ser"] = SmartExpertReduction.parse(v["ser"])
        if "ot" in v:
            v["ot"] = TensorOverride.parse_list(v["ot"])
        opts = cls(**v)
        if opts.ubatch > opts.batch:  # as llama.cpp: a micro-batch is never larger than the batch
            opts = dataclasses.replace(opts, ubatch=opts.batch)
        if opts.cpu_moe and opts.n_cpu_moe:
            raise OptionError(f"cpu-moe: give either --cpu-moe (all layers) or --n-cpu-moe {opts.n_cpu_moe}, not both")
        if opts.mla == 0 and opts.ctv and opts.ctv != opts.ctk:
            # mla 0 keeps per-head K and V rows, both stored in one cache type (ikjax/model/cache.py)
            raise OptionError(f"ctv: with -mla 0 the V cache is stored in the -ctk type ({opts.ctk}); a different "
                              f"V type ({opts.ctv}) is not supported: give -ctv {opts.ctk} or leave -ctv out")
        # --cpu-moe / --n-cpu-moe: ik's -ot shorthands, after the user's rules (first match wins)
        extra = tuple(r for r in cpu_moe_rules(opts.cpu_moe, opts.n_cpu_moe) if r not in opts.ot)
        if extra:
            opts = dataclasses.replace(opts, ot=opts.ot + extra)
        return opts

    @property
    def v_cache_type(self) -> str:
        return self.ctv or self.ctk

    @property
    def prompt_threads(self) -> int:
        """Threads for prompt processing: -tb, or -t when -tb is 0."""
        return self.threads_batch or self.threads

    def notes(self) -> list[str]:
        """One line per option that is valid but has no effect here, and why (the CLI prints them)."""
        out = []
        if self.mla != 0 and self.ctv and self.ctv != self.ctk:
            out.append(f"-ctv {self.ctv} has no effect with -mla {self.mla}: MLA caches one latent entry per token "
                       f"(V is part of it, stored as -ctk {self.ctk}); there is no V cache")
        return out

    def with_model(self, n_expert_used: int, has_moe: bool, auto_dtype: str) -> "RunOptions":
        """Checks that need the model (and the backend): refuse what cannot run, never ignore it.
        `auto_dtype` is what `dtype="auto"` means on the backend that will run (ikjax.ops.auto_dtype:
        the backend is the ops layer's to resolve, above this one)."""
        if self.dtype == "auto":
            return dataclasses.replace(self, dtype=auto_dtype).with_model(n_expert_used, has_moe, auto_dtype)
        if self.ser is not None:
            if not has_moe:
                raise OptionError("ser: the model has no routed experts")
            if self.ser.min_experts > n_expert_used:
                raise OptionError(f"ser: Kmin {self.ser.min_experts} exceeds the model's {n_expert_used} experts per token")
        return self


# ---------------------------------------------------------------------------------------------
# ik_llama.cpp switches that are not run options here: each is accepted with a one-line note saying
# why it has no effect, or refused naming itself. One table for the CLI and JSON configs.

ON_VALUES = ("1", "true", "on", "yes")
OFF_VALUES = ("0", "false", "off", "no")
SPLIT_MODES = ("none", "layer", "graph")
NUMA_MODES = ("distribute", "isolate", "numactl")
ONE_DEVICE = "has no effect with one device (-sm/-ts/-mg spread a model over several devices; this process has one)"


def device_count() -> int:
    """Devices the model can spread over: this process's, and under jax.distributed every
    process's (the -sm graph mesh spans them all)."""
    import jax
    return len(jax.devices())

# parameter name -> (ik flag as users type it, how its value is read)
SWITCHES: dict[str, tuple[str, str]] = {
    "split_mode": ("-sm", "split_mode"), "main_gpu": ("-mg", "int"), "ts": ("-ts", "split"),
    "rtr": ("-rtr", "bool"), "thp": ("-thp", "bool"), "no_mmap": ("--no-mmap", "bool"), "numa": ("--numa", "numa"),
    "nkvo": ("-nkvo", "bool"), "ooae": ("-ooae", "bool"), "no_ooae": ("-no-ooae", "bool"),
    "op": ("-op", "text"), "cuda": ("-cuda", "text"), "muge": ("-muge", "bool"), "mqkv": ("-mqkv", "bool"),
    "ger": ("-ger", "bool"), "wb": ("-wb", "bool"), "nrep": ("-nrep", "int"),
    "no_warmup": ("--no-warmup", "bool"), "fit": ("--fit", "bool"), "no_gr": ("-no-gr", "bool"),
    "gr": ("-gr", "bool_on"), "mmp": ("-mmp", "bool_on"),
    # ik's newer switches, accepted so an ik command line runs (an outside probe found each refused)
    "khad": ("-khad", "bool"), "no_fug": ("-no-fug", "bool"), "no_mmad": ("-no-mmad", "bool"),
    "rcache": ("-rcache", "bool"), "smgs": ("-smgs", "bool"), "sas": ("-sas", "bool"), "grt": ("-grt", "text"),
    "cram": ("-cram", "text"), "dt": ("-dt", "text"), "minilog": ("--minilog", "bool"),
    "mlock": ("--mlock", "bool"), "color": ("-co", "bool"),
}
# parameters whose flags may be given bare (`-rtr` = `-rtr 1`), as ik's main programs take them
BARE_PARAMS = frozenset({"fa", "fmoe", "no_fmoe", "no_fa", "cpu_moe"}
                        | {k for k, (_, kind) in SWITCHES.items() if kind in ("bool", "bool_on")})

_WHY = {
    "rtr": "ikjax lays the weights out for its kernels at load whether or not -rtr is given",
    "thp": "ikjax does not request transparent huge pages (weights live in JAX buffers)",
    "no_mmap": "ikjax maps the GGUF read-only and copies each tensor into its runtime buffers at load either way",
    "ooae": "ikjax never copies host-resident experts to an accelerator, which is what -ooae/-no-ooae tune",
    "no_ooae": "ikjax never copies host-resident experts to an accelerator, which is what -ooae/-no-ooae tune",
    "op": "ikjax has no per-op offload policy: host-resident weights are computed where they live",
    "cuda": "these tune ggml's CUDA backend; ikjax's GPU path is XLA and Pallas",
    "muge": "ikjax keeps the routed experts' up and gate apart in memory; fused MoE (-fmoe, on by default) "
            "already runs them as one pass",
    "mqkv": "ikjax always stacks the attention input matrices (q or q_a with kv_a_mqa) into one product at load "
            "when their types agree",
    "ger": "ikjax always applies the model's expert-group routing, as the reference model does",
    "fit": "ikjax places tensors only as -ngl/-ot/--n-cpu-moe say; the memory plan refuses a run that does not "
           "fit, naming what to change",
    "gr": "ikjax always runs each compiled step again for every call of its shape (graph reuse is always on)",
    "no_gr": "ikjax always runs each compiled step again for every call of its shape (graph reuse is always on)",
    "mmp": "ikjax maps the GGUF read-only and copies each tensor into its runtime buffers at load either way",
    "khad": "ikjax applies no Hadamard transform to the K cache (it stores what -ctk says)",
    "no_fug": "ikjax's fused MoE products run the routed experts' up and gate together (-fmoe decides)",
    "no_mmad": "a ggml graph fusion; XLA fuses ikjax's compiled steps itself",
    "rcache": "ik no longer supports it either; ikjax computes RoPE inside each step",
    "smgs": "-sm graph runs one compiled mesh step whose scheduling is XLA's",
    "sas": "ikjax's compiled steps are always dispatched asynchronously (JAX)",
    "grt": "-sm graph's collectives exchange the step's own types, as XLA lowers them",
    "cram": "the server's prompt cache is each slot's KV cache (--prompt-cache), not a RAM cache",
    "dt": "ikjax's KV cache is one contiguous buffer per sequence: nothing to defragment",
    "minilog": "ikjax's output is brief already (-v for more)",
    "mlock": "ikjax copies the weights into its runtime buffers at load: no mapping stays to lock in RAM",
    "color": "ikjax prints plain text (the answer on stdout, notes on stderr)",
}
# switches a command honours itself (no note there)
HONOURED = {"no_warmup": ("sweep-bench", "bench", "serve")}  # -nrep keeps its own rule below (sweep-bench only)


def _flag_bool(flag: str, value: Any) -> bool:
    """A switch's value: bare (given as 1), 0/1/on/off/true/false, or a comma list of them (llama-bench)."""
    items = [value] if isinstance(value, bool) else str(value).split(",")
    out = False
    for x in items:
        x = str(x).strip().lower() if not isinstance(x, bool) else ("1" if x else "0")
        if x not in ON_VALUES + OFF_VALUES:
            raise OptionError(f"{flag}: expected 0/1/on/off, got {value!r}")
        out |= x in ON_VALUES
    return out


def switch_notes(values: dict[str, Any], command: str, backend: str = "cpu") -> list[str]:
    """Check ik's switches a command was given (parameter name -> value; None = not given).

    Returns the one-line notes to print (each names its flag and says why it has no effect here);
    raises OptionError naming the flag for a bad value or a setting that cannot be met.
    `-nrep` is honoured by sweep-bench (the caller uses it) and only noted elsewhere.
    """
    notes = []
    for name, value in values.items():
        if name not in SWITCHES or value is None or value == "":
            continue
        flag, kind = SWITCHES[name]
        if kind == "bool":
            if not _flag_bool(flag, value):
                continue  # explicitly off: ik's default for all of these, nothing to say
            if name == "nkvo":
                if backend != "cpu":
                    raise OptionError("-nkvo: keeping the KV cache in host memory while the model runs on an "
                                      "accelerator is not implemented")
                notes.append("-nkvo has no effect on CPU: the KV cache is already in host memory")
            elif name == "wb":
                notes.append(f"-wb has no effect: {command} compiles and runs every step shape once before timing")
            elif name == "no_warmup":
                if command not in HONOURED["no_warmup"]:
                    notes.append(f"--no-warmup has no effect in {command}: it times nothing a warm-up run would "
                                 f"change (sweep-bench, bench and serve honour it)")
            else:
                notes.append(f"{flag} has no effect: {_WHY[name]}")
        elif kind == "bool_on":  # ik's default is on: only turning it off asks for something
            if not _flag_bool(flag, value):
                notes.append(f"{flag} 0 has no effect: {_WHY[name]}")
        elif kind == "split_mode":
            modes = [m.strip().lower() for m in str(value).split(",")]
            bad = [m for m in modes if m not in SPLIT_MODES]
            if bad:
                raise OptionError(f"-sm: expected none, layer or graph, got {value!r}")
            if device_count() == 1:
                notes.append(f"-sm {value} {ONE_DEVICE}")
        elif kind == "split":
            parts = [p for p in re.split(r"[,/;]", str(value)) if p.strip()]
            try:
                shares = [float(p) for p in parts]
            except ValueError:
                raise OptionError(f"-ts: expected shares like 3,1, got {value!r}") from None
            if not shares or any(not (x >= 0) for x in shares):
                raise OptionError(f"-ts: expected non-negative shares like 3,1, got {value!r}")
            if device_count() == 1:
                notes.append(f"-ts {value} {ONE_DEVICE}")
        elif kind == "int":
            try:
                ints = [int(str(x).strip()) for x in str(value).split(",")]
            except ValueError:
                raise OptionError(f"{flag}: expected an integer, got {value!r}") from None
            if any(x < (1 if name == "nrep" else 0) for x in ints):
                raise OptionError(f"{flag}: {value} out of range")
            if name == "main_gpu":
                n_dev = device_count()
                if any(x >= n_dev for x in ints):
                    raise OptionError(f"-mg {value}: this machine has {n_dev} device{'s' * (n_dev > 1)} "
                                      f"(use 0{f'..{n_dev - 1}' if n_dev > 1 else ''}; or choose the device with "
                                      f"CUDA_VISIBLE_DEVICES)")
                if n_dev == 1:
                    notes.append(f"-mg {value} {ONE_DEVICE}")
            elif name == "nrep" and command != "sweep-bench":
                notes.append(f"-nrep has no effect in {command}: it repeats sweep-bench's first row"
                             + ("; bench repeats with -r" if command == "bench" else ""))
        elif kind == "numa":
            if str(value).lower() not in NUMA_MODES:
                raise OptionError(f"--numa: expected distribute, isolate or numactl, got {value!r}")
            notes.append(f"--numa {value} has no effect: ikjax does not pin threads or memory to NUMA nodes")
        elif kind == "text":
            notes.append(f"{flag} {value} has no effect: {_WHY[name]}")
    return notes
