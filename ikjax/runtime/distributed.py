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

import inspect
import os
import re
import socket
import sys
import threading
import zlib

from ikjax import env
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


def _port_in_use(port: int) -> str | None:
    """Why process 0 cannot serve the coordinator on `port` (None: it can). JAX's coordination
    service, given a port in use, logs a line and the process dies by a segfault (a probe, RESULTS
    §23w); a bind tried first turns that into one line."""
    for family, addr in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr, port))
        except OSError as e:
            if e.errno in (98, 48, 10048):  # EADDRINUSE (Linux, macOS, Windows)
                return f"port {port} is in use"
            continue  # (no IPv6 here, say: the other family decides)
    return None


def _give_up(message: str) -> None:
    """The join watchdog: one line and exit 1, before JAX's client aborts the process with a page of
    C++ log lines (it does, at its own initialization timeout, whatever we catch)."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    os._exit(1)


def join_timeout() -> int:
    """Seconds a process waits for the others to join (IKJAX_JOIN_TIMEOUT, default 300)."""
    return env.positive_int("IKJAX_JOIN_TIMEOUT")


HEARTBEAT_TIMEOUT_S = 20


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, timeout_s: int | None = None) -> None:
    """Join the other processes (no-op when no option is given). Must run before any JAX backend
    starts: a backend already up would see only this process's devices. Process 0 first checks
    that it can serve the coordinator's port; a process whose peers do not all join within
    `timeout_s` (IKJAX_JOIN_TIMEOUT) ends with one line naming the coordinator."""
    if not check_args(coordinator, num_processes, process_id):
        return
    import jax
    if jax.distributed.is_initialized():
        return
    timeout_s = join_timeout() if timeout_s is None else timeout_s
    if process_id == 0:
        why = _port_in_use(int(coordinator.rsplit(":", 1)[1]))
        if why:
            raise OptionError(f"coordinator: process 0 serves the coordinator at {coordinator}, but {why} on this host")
    try:  # CPU processes exchange collectives through gloo (the default may be none)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, ValueError):
        pass
    try:  # JAX's preemption service installs a C++ SIGTERM handler over the CLI's: a `kill` was ignored
        jax.config.update("jax_enable_preemption_service", False)  # (both processes ran to the end, exit 0)
    except (AttributeError, ValueError):
        pass
    watchdog = threading.Timer(timeout_s, _give_up, (
        f"coordinator: {num_processes} processes did not all join at {coordinator} within {timeout_s} s (this is "
        f"process {process_id}; start the same command with --process-id 0..{num_processes - 1} on every host, "
        f"or set IKJAX_JOIN_TIMEOUT)",))
    watchdog.daemon = True
    watchdog.start()
    try:
        # JAX's own limit later than ours: past it, its client aborts the process
        kw = dict(initialization_timeout=timeout_s + 60)
        # a peer that dies (SIGKILL, a lost host) is noticed by its missed heartbeats: 20 s, not
        # JAX's 100 (process 0 sat ~90 s before JAX's client aborted it)
        if "heartbeat_timeout_seconds" in inspect.signature(jax.distributed.initialize).parameters:
            kw["heartbeat_timeout_seconds"] = HEARTBEAT_TIMEOUT_S
        jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id, **kw)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "already been initialized" in first or "backend" in first.lower():
            raise OptionError(f"coordinator: jax.distributed must start before JAX's backend ({first})") from None
        raise OptionError(f"coordinator: could not join {num_processes} processes at {coordinator} as process "
                          f"{process_id} ({first})") from None
    finally:
        watchdog.cancel()


def command_key(command: str, params: dict) -> int:
    """A number for a command that every process of one run shares: its options' parsed values (in
    any order on the command line, spelled short or long) but the process's own id, and the model
    file by name (hosts may mount it at other paths)."""
    items = []
    for name in sorted(params):
        if name == "process_id":
            continue
        value = params[name]
        if name == "model" and value:
            value = os.path.basename(str(value))
        items.append((name, repr(value)))
    return zlib.crc32(repr((command, items)).encode()) & 0x7FFFFFFF


def check_same_command(command: str, params: dict) -> None:
    """Every process must run the same command (a different -n, say, left them waiting on each
    other's collectives until a timeout killed them): the processes compare `command_key`s, and
    each refuses a run whose processes differ, in one line."""
    if not several():
        return
    import numpy as np
    from jax.experimental import multihost_utils
    keys = np.asarray(multihost_utils.process_allgather(np.array([command_key(command, params)], np.int32))).reshape(-1)
    if len(set(keys.tolist())) > 1:
        differ = [i for i, k in enumerate(keys.tolist()) if k != keys[0]]
        raise OptionError(f"coordinator: process(es) {', '.join(map(str, differ))} run another command than process 0 "
                          f"(every process runs the same command and options, but --process-id)")


def same_on_all(value: int) -> int:
    """Process 0's `value` on every process (a drawn seed: each process drew its own, and two
    processes sampled different tokens, then waited on each other forever); `value` where alone."""
    if not several():
        return value
    import numpy as np
    from jax.experimental import multihost_utils
    return int(np.asarray(multihost_utils.broadcast_one_to_all(np.array(value, np.int32))))


def exit_now(code: int, by_sigterm: bool = False) -> None:
    """End a process of a several-process run at once, after its error line: at a normal exit JAX
    waits at a shutdown barrier for the others, and a peer that died or failed turns that into
    ~90 s and an abort with a page of C++ log lines. `by_sigterm`: the death by that signal
    (status 143), as one process's end is."""
    if several():
        sys.stdout.flush()
        sys.stderr.flush()
        if by_sigterm:
            import signal
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        os._exit(code)


def process_count() -> int:
    import jax
    return jax.process_count()


def several() -> bool:
    """This process joined others (--coordinator with N > 1). Asks nothing of a JAX backend that
    has not started (an error path before the load stays as quick as it was)."""
    jax = sys.modules.get("jax")
    if jax is None or not jax.distributed.is_initialized():
        return False
    return jax.process_count() > 1


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
