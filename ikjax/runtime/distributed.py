"""Several processes (hosts) on JAX's multi-controller runtime.

Every process runs the same program: it calls `jax.distributed.initialize` (here: `initialize`,
or the CLI's `--coordinator HOST:PORT --num-processes N --process-id I`) before anything touches a
JAX backend, then `ikjax.load` with `-sm graph`; `jax.devices()` then lists every process's devices
and the mesh spans them all. Each process reads from the GGUF only the parts its own devices hold
(`jax.make_array_from_callback` asks for the addressable shards alone), every step is run by all
processes at once with the same inputs, and XLA's collectives (NCCL between GPUs, gloo between CPU
processes) join the parts. The logits come back replicated on every device, so every process samples
the same tokens from the same seed; only process 0 prints tables and text (`is_primary`).

`-sm layer` over processes would need point-to-point transfers of the activation between hosts at
every stage boundary (a device of another process cannot be the target of `jax.device_put`); it is
refused with the reason, as is one process's `-sm none` model on a multi-process mesh.
"""
from __future__ import annotations

import re

from ikjax.errors import OptionError

_HOSTPORT = re.compile(r"^\[?[A-Za-z0-9_.:-]+\]?:(\d{1,5})$")


def check_args(coordinator: str | None, num_processes: int | None, process_id: int | None) -> bool:
    """Validate the three multi-host options (all or none); True when they ask for several processes."""
    given = [x is not None for x in (coordinator, num_processes, process_id)]
    if not any(given):
        return False
    if not all(given):
        raise OptionError("coordinator: --coordinator HOST:PORT, --num-processes N and --process-id I go together "
                          "(give all three, the same coordinator and N on every process)")
    m = _HOSTPORT.match(coordinator)
    if m is None or not 0 < int(m.group(1)) < 65536:
        raise OptionError(f"coordinator: expected HOST:PORT (e.g. 10.0.0.1:1234), got {coordinator!r}")
    if num_processes < 1:
        raise OptionError(f"num-processes: need >= 1, got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise OptionError(f"process-id: need 0 <= id < {num_processes}, got {process_id}")
    return True


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, timeout_s: int = 300) -> None:
    """Join the other processes (no-op when no option is given). Must run before any JAX backend
    starts: a backend already up would see only this process's devices."""
    if not check_args(coordinator, num_processes, process_id):
        return
    import jax
    if jax.distributed.is_initialized():
        return
    try:  # CPU processes exchange collectives through gloo (the default may be none)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, ValueError):
        pass
    try:
        jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id,
                                   initialization_timeout=timeout_s)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "already been initialized" in first or "backend" in first.lower():
            raise OptionError(f"coordinator: jax.distributed must start before JAX's backend ({first})") from None
        raise OptionError(f"coordinator: could not join {num_processes} processes at {coordinator} as process "
                          f"{process_id} ({first})") from None


def process_count() -> int:
    import jax
    return jax.process_count()


def is_primary() -> bool:
    """Process 0 prints tables and text; every process computes."""
    import jax
    return jax.process_index() == 0


def check_split(split_mode: str) -> None:
    """Several processes run only the mesh split (module docstring)."""
    n = process_count()
    if n > 1 and split_mode != "graph":
        why = ("-sm layer would move the activation between hosts at every stage boundary, which is not "
               "implemented") if split_mode == "layer" else "one process's model would leave the others idle"
        raise OptionError(f"sm: {n} processes (jax.distributed) run the model with -sm graph only: {why}")


def global_input(value, sharding):
    """A host value (the same on every process) as a jax.Array of `sharding`, which may span other
    processes' devices: each process puts its own devices' copies."""
    import jax
    import numpy as np
    arr = np.asarray(value)
    return jax.make_array_from_callback(arr.shape, sharding, lambda idx: arr[idx])


def local_value(x):
    """A replicated result as a value of this process: the copy on its first device (a jax.Array
    spanning other processes cannot be read whole here)."""
    if getattr(x, "is_fully_addressable", True):
        return x
    return x.addressable_data(0)
