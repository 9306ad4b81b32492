"""RunOptions: ik_llama.cpp's run flags as one validated, hashable value.

Names follow ik's flags (`-mla`, `-fa`, `-amb`, `-ctk`, `-fmoe`, `-ser`, `-ot`, `-c`, `-ub`, `-b`)
so the Python API, the CLI and JSON configs share one vocabulary. Every bad value or impossible
combination is refused here, at load, with one line naming the option.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from ikjax.errors import OptionError

CACHE_TYPES = ("f32", "f16", "bf16", "q8_0")
COMPUTE_DTYPES = ("auto", "f32", "bf16", "f16")


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
        items = value.split(",") if isinstance(value, str) else list(value)
        rules = []
        for item in items:
            if isinstance(item, TensorOverride):
                rules.append(item)
                continue
            if "=" not in item:
                raise OptionError(f"ot: expected REGEX=DEVICE, got {item!r}")
            pat, dev = item.rsplit("=", 1)
            try:
                re.compile(pat)
            except re.error as e:
                raise OptionError(f"ot: bad regex {pat!r}: {e}") from None
            dev = dev.strip()
            if not re.fullmatch(r"(?i)cpu|gpu\d*|cuda\d*|device\d*", dev):
                raise OptionError(f"ot: unknown device {dev!r} in {item!r} (use CPU, GPU, CUDA0, ...)")
            rules.append(cls(pat, dev.upper()))
        return tuple(rules)


@dataclass(frozen=True)
class RunOptions:
    mla: int = 3
    fa: bool = True
    amb: int = 0
    ctk: str = "f16"
    fmoe: bool = False
    ser: SmartExpertReduction | None = None
    ot: tuple[TensorOverride, ...] = ()
    ctx: int = 4096
    ubatch: int = 512
    batch: int = 2048
    dtype: str = "auto"  # matmul input dtype; not an ik flag. auto: f32 on CPU, bf16 on accelerators
    ngl: int = 99
    threads: int = 0
    kv_block: int = 256  # KV chunk of the blocked (flash) attention; bucket granularity of the KV length

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "RunOptions":
        known = {f.name for f in dataclasses.fields(cls)}
        aliases = {"c": "ctx", "ub": "ubatch", "b": "batch", "n_ctx": "ctx", "flash_attn": "fa",
                   "cache_type_k": "ctk", "t": "threads", "n_gpu_layers": "ngl"}
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
            if isinstance(x, bool) or not isinstance(x, (int, str)) or not str(x).lstrip("-").isdigit():
                raise OptionError(f"{name}: expected an integer, got {x!r}")
            x = int(x)
            if x < lo or (hi is not None and x > hi):
                raise OptionError(f"{name}: {x} out of range [{lo}, {hi if hi is not None else 'inf'}]")
            v[name] = x

        def boolean(name: str) -> None:
            if name not in v:
                return
            x = v[name]
            if isinstance(x, str) and x.lower() in ("1", "0", "true", "false", "on", "off"):
                x = x.lower() in ("1", "true", "on")
            if isinstance(x, int) and x in (0, 1):
                x = bool(x)
            if not isinstance(x, bool):
                raise OptionError(f"{name}: expected 0/1 or true/false, got {v[name]!r}")
            v[name] = x

        integer("mla", 0, 3)
        integer("amb", 0)
        integer("ctx", 1)
        integer("ubatch", 1)
        integer("batch", 1)
        integer("ngl", 0)
        integer("threads", 0)
        integer("kv_block", 1)
        boolean("fa")
        boolean("fmoe")
        for name, allowed in (("ctk", CACHE_TYPES), ("dtype", COMPUTE_DTYPES)):
            if name in v:
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
        return opts

    def with_model(self, n_expert_used: int, has_moe: bool) -> "RunOptions":
        """Checks that need the model (and the backend): refuse what cannot run, never ignore it."""
        if self.dtype == "auto":
            import jax
            return dataclasses.replace(self, dtype="f32" if jax.default_backend() == "cpu" else "bf16"
                                       ).with_model(n_expert_used, has_moe)
        if self.ser is not None:
            if not has_moe:
                raise OptionError("ser: the model has no routed experts")
            if self.ser.min_experts > n_expert_used:
                raise OptionError(f"ser: Kmin {self.ser.min_experts} exceeds the model's {n_expert_used} experts per token")
        return self
