"""Persistent compilation cache: a step compiled once on this machine is loaded, not compiled, later.

Why: the same model and options compile the same steps on every run (68 s on an H200 before the
first sweep-bench row, issue 11). JAX's persistent compilation cache writes each compiled
executable to disk under a key of its HLO, the jaxlib version, the backend, the XLA flags, the
compile options and the devices, and later processes load it instead of compiling.

What that key misses, and how it is covered here: our C++ kernels are XLA FFI custom calls that a
step's HLO names only by target (`ikjax_...`), so a rebuilt `pallas_kernels/_cpu*.so` (or
`_cuda_host*.so`) with a changed attribute layout would run a stale executable; and XLA:CPU
generates code for the host CPU's features, which the key does not name (a home directory shared
by machines with different CPUs). So the entries live in a subdirectory named by a hash of ikjax's
version, the bytes of the native libraries and the CPU's model and feature flags: a new build or
another CPU starts an empty subdirectory (old ones can simply be deleted).

Where: `$IKJAX_COMPILE_CACHE` (a directory; `0` or `off` turns the cache off), else
`$XDG_CACHE_HOME/ikjax/xla`, else `~/.cache/ikjax/xla`; the CLI's `--compile-cache` sets the same.
A user who set JAX's own `jax_compilation_cache_dir` and no `IKJAX_COMPILE_CACHE` keeps it as is.

When: JAX decides whether a process uses a persistent cache at its first compile and does not look
again, so `setup()` runs before ikjax compiles (ikjax.load, executables.Executables.get, the CLI) and, when
it changes the configuration, resets JAX's cache state (JAX's `reset_cache`) so that the next
compile sees it. Every compile is cached (no minimum compile time or size): a CPU step of a small
model compiles in well under a second, and those are what short runs repeat.

Steps without tracing: JAX's key is a hash of the lowered module, so even a cache hit first traces
the whole model in Python and lowers it (3.3 s of a 27-layer V2-Lite warm start for two steps, on
the device's host, RESULTS §13b). So ikjax also keeps each single-device step it compiled whole
(`jax.experimental.serialize_executable`) under `steps/`, keyed by everything the executable is
made from without tracing: ikjax's and pallas_kernels' source files, jax/jaxlib versions,
XLA_FLAGS, the devices, and the step's own key (weight tree with shapes, dtypes and placement,
the model config, the step plan). A later run loads it by that key before tracing anything;
anything unreadable there is ignored (the step then comes from JAX's cache), never an error.
Only executables compiled in this process are stored (one JAX loaded from its own cache does not
serialize again whole on XLA:CPU), and on a CPU only with IKJAX_STORE_STEPS=1 (ikjax.runtime.executables).

Counting: JAX records '/jax/compilation_cache/cache_hits' for an executable loaded from disk and
'/jax/compilation_cache/cache_misses' for one compiled and written (names as in jax 0.10.2's
jax/_src/compiler.py and compilation_cache.py); `hits()` and `writes()` count them in this process.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
from pathlib import Path

import jax

from ikjax import env
from ikjax.errors import OptionError
from ikjax.version import __version__

log = logging.getLogger("ikjax")

ENV = "IKJAX_COMPILE_CACHE"
OFF = ("0", "off", "false", "no", "none")
HIT_EVENT = "/jax/compilation_cache/cache_hits"
WRITE_EVENT = "/jax/compilation_cache/cache_misses"

_counts = {HIT_EVENT: 0, WRITE_EVENT: 0}
_listening = False
_configured: tuple[str | None, Path | None] | None = None  # (the spec set up, the directory used)


def default_root() -> Path:
    return env.xdg_cache_home() / "ikjax" / "xla"


def build_tag() -> str:
    """The subdirectory for this build on this CPU: ikjax's version and a hash of what JAX's key
    does not see (the native kernel libraries' bytes, the CPU's model and feature flags)."""
    h = hashlib.sha256(__version__.encode())
    spec = importlib.util.find_spec("pallas_kernels")
    for d in sorted(spec.submodule_search_locations or []) if spec else []:
        for lib in sorted(Path(d).glob("_*.so")) + sorted(Path(d).glob("_*.pyd")):
            h.update(lib.name.encode())
            h.update(lib.read_bytes())
    h.update(_cpu_signature().encode())
    return f"ikjax-{__version__}-{h.hexdigest()[:16]}"


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [l for l in f if l.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:  # not Linux: what Python knows of the processor
        return f"{platform.machine()} {platform.processor()}"


def resolve(spec: str | None = None) -> Path | None:
    """The cache directory for `spec` (the CLI option), else $IKJAX_COMPILE_CACHE, else the
    default; None when the value is 0/off. The build subdirectory is not included."""
    what = "--compile-cache" if spec is not None else ENV
    value = spec if spec is not None else env.raw(ENV) or None
    if value is None:
        return default_root()
    if value.strip().lower() in OFF:
        return None
    if not value.strip():
        raise OptionError(f"{what}: empty; give a directory, or 0 to turn the compilation cache off")
    return Path(value).expanduser()


def setup(spec: str | None = None) -> Path | None:
    """Point JAX's persistent cache at this build's subdirectory (or turn it off); the directory used.

    Called with no spec it configures once from the environment and is then a no-op; a spec (the
    CLI option) overrides the environment. Refuses (OptionError) a directory it cannot create or
    write, naming the setting."""
    global _configured
    if _configured is not None and (spec is None or _configured[0] == spec):
        return _configured[1]
    _listen()
    theirs = getattr(jax.config, "jax_compilation_cache_dir", None)
    if spec is None and not env.raw(ENV) and theirs:  # the user configured JAX's cache: it stays
        d = Path(theirs)
        log.info("compilation cache: JAX's own, %s (jax_compilation_cache_dir)", d)
        _configured = (spec, d)
        return d
    root = resolve(spec)
    from jax.experimental.compilation_cache import compilation_cache as cc
    if root is None:
        jax.config.update("jax_enable_compilation_cache", False)
        cc.reset_cache()
        _configured = (spec, None)
        log.info("compilation cache: off")
        return None
    d = root / build_tag()
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)  # JAX runs what it finds there: the user's own
        if not os.access(d, os.W_OK):
            raise PermissionError("not writable")
    except OSError as e:
        what = "--compile-cache" if spec is not None else (ENV if env.raw(ENV) else "the compilation cache")
        raise OptionError(f"{what}: cannot use {d} ({e.strerror or e}); give another directory "
                          f"({ENV}=DIR) or turn it off ({ENV}=0)") from None
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(d))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    cc.reset_cache()
    _configured = (spec, d)
    log.info("compilation cache: %s", d)
    return d


def _listen() -> None:
    global _listening
    if not _listening:
        def on_event(event: str, **_):
            if event in _counts:
                _counts[event] += 1
        jax.monitoring.register_event_listener(on_event)
        _listening = True


@functools.cache
def _source_hash() -> str:
    """ikjax's and pallas_kernels' Python sources: what a traced step is made of."""
    h = hashlib.sha256()
    for pkg in ("ikjax", "pallas_kernels"):
        spec = importlib.util.find_spec(pkg)
        for d in sorted(spec.submodule_search_locations or []) if spec else []:
            for f in sorted(Path(d).rglob("*.py")):
                h.update(str(f.relative_to(d)).encode())
                h.update(f.read_bytes())
    return h.hexdigest()


def _step_path(parts: tuple) -> Path | None:
    d = directory()
    if d is None:
        return None
    import jaxlib
    key = repr((parts, _source_hash(), jax.__version__, jaxlib.__version__, os.environ.get("XLA_FLAGS", ""),
                [(dev.platform, dev.device_kind, dev.id) for dev in jax.devices()]))
    return d / "steps" / (hashlib.sha256(key.encode()).hexdigest() + ".pkl")


def load_step(parts: tuple):
    """The executable stored under `parts` by `store_step` (counted as a cache hit), or None."""
    path = _step_path(parts)
    if path is None or not path.is_file():
        return None
    try:
        import pickle
        from jax.experimental.serialize_executable import deserialize_and_load
        payload, in_tree, out_tree = pickle.loads(path.read_bytes())
        exe = deserialize_and_load(payload, in_tree, out_tree)
    except Exception as e:  # noqa: BLE001 - a stale or partial entry: compile as if absent
        log.info("compilation cache: ignoring %s (%s)", path.name, e)
        return None
    _counts[HIT_EVENT] += 1
    return exe


def store_step(parts: tuple, exe) -> None:
    """Keep a compiled step for `load_step` (best effort: a step that cannot be serialized, or a
    full disk, only costs the next run its tracing)."""
    path = _step_path(parts)
    if path is None:
        return
    try:
        import pickle
        from jax.experimental.serialize_executable import serialize
        from ikjax.atomic_file import atomic_write
        data = pickle.dumps(serialize(exe))
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with atomic_write(path, len(data), "compiled step") as tmp:  # whole or not at all
            tmp.write_bytes(data)
    except Exception as e:  # noqa: BLE001
        log.info("compilation cache: step not stored (%s)", e)


def hits() -> int:
    """Executables this process loaded from the persistent cache."""
    return _counts[HIT_EVENT]


def writes() -> int:
    """Executables this process compiled and wrote to the persistent cache."""
    return _counts[WRITE_EVENT]


def directory() -> Path | None:
    """The directory in use (None: off or not set up yet)."""
    return _configured[1] if _configured else None


def describe() -> str:
    """The directory in use for a message (~ for the home directory), or "off"."""
    d = directory()
    if d is None:
        return "off"
    home, s = str(Path.home()), str(d)
    return "~" + s[len(home):] if s.startswith(home + os.sep) else s
