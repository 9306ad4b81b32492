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
XLA_FLAGS, the devices, and the step's own key (the whole argument tree: weights, KV cache and
inputs with every leaf's shape, dtype and placement; the run options, the model config, the step
plan, JAX's type settings, the IKJAX_* variables a trace may read;
ikjax.runtime.executables.Executables._stored_step). A later run loads it by that key before
tracing anything (the native FFI targets registered first), and checks the loaded executable's
argument tree and types against those the step is made for: anything unreadable, stored under
another key or made for other arguments is a miss (the step is compiled; the entry removed, and
replaced where this process compiled it), never an error. A loaded step whose first call JAX
refuses all the same (its arguments are not the ones the key described) is compiled then and
there and the call made with it (executables.StoredStep): never a failed run. Only executables
compiled in this process are stored (one JAX loaded from its own cache does not serialize again
whole on XLA:CPU), and on a CPU only with IKJAX_STORE_STEPS=1 (ikjax.runtime.executables).

The load's small programs (the kernels' repacks, a group's stacks: ikjax.programs) are kept whole
the same way under `programs/`, keyed by their name, arguments and static arguments (`run_program`,
the runner `setup` installs): a warm load then traces none of them (IKJAX_STORE_PROGRAMS=0: never).

Damaged entries of JAX's own cache (random bytes, truncated, empty): JAX warns on each read and
never rewrites the file, so `setup` guards its reads (`_guard_reads`): in our directory such an
entry is deleted and read as absent, JAX compiles and writes it afresh, one line notes it.

Counting: JAX records '/jax/compilation_cache/cache_hits' for an executable loaded from disk and
'/jax/compilation_cache/cache_misses' for one compiled and written (names as in jax 0.10.2's
jax/_src/compiler.py and compilation_cache.py); `hits()` and `writes()` count them in this process
(a stored step loaded whole counts as a hit, and in `step_loads()`).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import threading
from pathlib import Path
from typing import Any

import jax

from ikjax import env, programs
from ikjax.errors import OptionError
from ikjax.version import __version__

log = logging.getLogger("ikjax")

ENV = "IKJAX_COMPILE_CACHE"
OFF = ("0", "off", "false", "no", "none")
HIT_EVENT = "/jax/compilation_cache/cache_hits"
WRITE_EVENT = "/jax/compilation_cache/cache_misses"

STEP_LOAD = "ikjax/stored_step_loads"  # ours: steps loaded whole by load_step (also counted as hits)

_counts = {HIT_EVENT: 0, WRITE_EVENT: 0, STEP_LOAD: 0}
# the same counts for the calling thread alone: steps compile side by side in threads (on an
# accelerator), and a hit in one thread must not read as a hit of the step another is compiling
_thread_counts = threading.local()
_listening = False
_configured: tuple[str | None, Path | None, bool] | None = None  # (the spec set up, the directory used, ours)


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


_LOWERING = threading.Lock()


class LoweringTurns:
    """The order in which the jobs of one `compile_side_by_side` batch lower, by turn number.

    Why: the lowerings run one at a time (`lower`), and each step's XLA compile starts when its
    lowering ends; so the step whose compile is longest should lower first, its compile running
    while the others lower. Left to the threads' race, the first-submitted job tended to win (the
    deep V2-Lite shape's decode loop: 1.35 s of lowering, then 0.92 s for the prompt step, whose
    3.1 s XLA compile, the longest, started 2.3 s after the batch; RESULTS §22al). A job's turn
    ends when its first lowering does, or when it ends without lowering (a step served by the
    cache); later lowerings of the same job take the lock as anyone else does."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next = 0
        self._ended: set[int] = set()

    def wait(self, turn: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._next >= turn)

    def end(self, turn: int) -> None:
        with self._cond:
            self._ended.add(turn)
            while self._next in self._ended:
                self._next += 1
            self._cond.notify_all()


_turn = threading.local()


def in_turn(turns: LoweringTurns, turn: int, fn):
    """Run `fn()` on this thread with its first lowering at `turn` of `turns`; the turn ends by the
    time it returns or raises."""
    _turn.current = (turns, turn)
    try:
        return fn()
    finally:
        _turn.current = None
        turns.end(turn)


def lower(jitted, *args, _serialized: bool = True, **kwargs):
    """`jitted.lower(*args, **kwargs)`, one at a time in this process.

    Why: steps compile side by side (`compile_side_by_side`), and two threads tracing at once race
    to fill JAX's trace cache, so a function every layer calls came out as one jaxpr in one run and
    as two in the next; the lowered module then differs (a private function per jaxpr), and so does
    JAX's persistent-cache key, which hashes that module. Every step JAX's cache serves (`-ot`
    host experts, several devices) missed on a GPU for it (RESULTS §25j). Tracing holds the GIL
    anyway: XLA's compile, after the lowering, still runs side by side.

    The arrays among the arguments go in as ShapeDtypeStructs of their shape, dtype and sharding:
    on a GPU the same weights came out of the load with avals that print alike and still differ
    (arrays made by a stored program against arrays a traced one made), and every nested jit
    called with both was traced, and lowered, twice (RESULTS §25j)."""
    args, kwargs = jax.tree.map(_abstract, (args, kwargs))
    if not _serialized:  # precompile_programs: programs keyed without tracing, beside the steps
        return jitted.lower(*args, **kwargs)
    turn = getattr(_turn, "current", None)
    if turn is None:
        with _LOWERING:
            return jitted.lower(*args, **kwargs)
    turns, k = turn
    _turn.current = None  # (this job's later lowerings take no turn)
    try:
        turns.wait(k)
        with _LOWERING:
            return jitted.lower(*args, **kwargs)
    finally:
        turns.end(k)


def _abstract(a):
    """A jax.Array as the ShapeDtypeStruct lowering needs (anything else as it is)."""
    if isinstance(a, jax.Array):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding, weak_type=a.weak_type)
    return a


def _stable_locations() -> None:
    """Source locations in lowered modules that do not depend on the call path or install
    directory. Why: JAX's cache key strips the module's debug info, but a Pallas GPU kernel is a
    Triton module serialized into an attribute with its locations in it; with full tracebacks those
    name every frame up to the caller (engine, CLI, thread), which differ between two runs of one
    command, so no step holding a Pallas kernel was ever served by JAX's cache on a GPU (RESULTS
    §25j). The innermost frame alone, with the path cut at the package, is the same in every run."""
    jax.config.update("jax_include_full_tracebacks_in_locations", False)
    jax.config.update("jax_hlo_source_file_canonicalization_regex", r".*/(?=(?:ikjax|pallas_kernels)/)")
    _strip_triton_locations()


def _strip_triton_locations() -> None:
    """No source locations at all in a Pallas GPU kernel's Triton module. Why: even the innermost
    frame is not stable. An op of a jitted helper that JAX inlines (many `jnp` functions are such
    helpers) keeps the traceback of the trace that first filled JAX's trace cache, so which
    kernel's file and line it names follows the order a process traced its steps in: the 8-layer
    R1's -ot steps named `flash.py` in one run and not in the next, and compiled again on every
    warm run (RESULTS §25k). JAX strips the outer module's locations for its cache key, but not
    the Triton module serialized inside the custom call; this strips those too (MLIR's
    strip-debuginfo pass on the module Pallas lowered). Triton's own error messages then name no
    line of the kernel; a kernel's Python frames still show in JAX's errors."""
    try:
        from jax._src.lib.mlir import passmanager
        from jax._src.pallas.triton import lowering
    except ImportError:  # pragma: no cover - a jaxlib without Pallas' Triton lowering
        return
    lower = lowering.lower_jaxpr_to_triton_module
    if getattr(lower, "_ikjax_stripped", False):
        return

    @functools.wraps(lower)
    def stripped(*args, **kwargs):
        result = lower(*args, **kwargs)
        with result.module.context:
            passmanager.PassManager.parse("builtin.module(strip-debuginfo)").run(result.module.operation)
        return result

    stripped._ikjax_stripped = True
    lowering.lower_jaxpr_to_triton_module = stripped


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
        _stable_locations()
        _configured = (spec, d, False)
        return d
    root = resolve(spec)
    from jax.experimental.compilation_cache import compilation_cache as cc
    if root is None:
        programs.install(None)
        jax.config.update("jax_enable_compilation_cache", False)
        cc.reset_cache()
        _configured = (spec, None, False)
        log.info("compilation cache: off")
        return None
    d = root / _build_tag_once()
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)  # JAX runs what it finds there: the user's own
        if not os.access(d, os.W_OK):
            raise PermissionError("not writable")
    except OSError as e:
        what = "--compile-cache" if spec is not None else (ENV if env.raw(ENV) else "the compilation cache")
        raise OptionError(f"{what}: cannot use {d} ({e.strerror or e}); give another directory "
                          f"({ENV}=DIR) or turn it off ({ENV}=0)") from None
    programs.install(run_program)  # the load's small programs kept whole too (ikjax.programs)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(d))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    _stable_locations()
    cc.reset_cache()
    _guard_reads()
    _configured = (spec, d, True)
    log.info("compilation cache: %s", d)
    return d


_replaced = 0  # unreadable entries of our directory replaced in this process


def _guard_reads() -> None:
    """Make an unreadable entry of ikjax's cache directory a plain miss that gets rewritten.

    Why: JAX's cache never replaces an entry (its LRUCache.put returns when the file exists) and
    warns on every read it cannot use (compiler._cache_read: a two-line UserWarning, then a
    compile), so one damaged file (random bytes, truncated, empty, or left 0 bytes by a full
    disk: its put writes in place) cost every later run a warning and a compile per step, for
    good. Here JAX's read goes through a guard: in our directory an entry that fails to read,
    decompress or deserialize is deleted, the read answers "absent", JAX compiles and writes the
    fresh entry; the first one a process replaces is noted in one line (the rest at -v). A
    directory the user gave JAX themselves, and `jax_raise_persistent_cache_errors`, keep JAX's
    own behaviour. Patched on the module JAX's compiler calls through (jax 0.10.2's
    jax/_src/compilation_cache.py `get_executable_and_time`); a JAX without it keeps its own."""
    from jax._src import compilation_cache as jcc
    read = getattr(jcc, "get_executable_and_time", None)
    if read is None or getattr(read, "_ikjax_guard", False):
        return

    @functools.wraps(read)
    def guarded(cache_key, *args, **kwargs):
        try:
            return read(cache_key, *args, **kwargs)
        except Exception as e:  # what JAX itself turns into a warning
            d = _own_directory()
            if d is None or getattr(jax.config, "jax_raise_persistent_cache_errors", False):
                raise
            _replace_entry(d, cache_key, e)
            return None, None
    guarded._ikjax_guard = True
    jcc.get_executable_and_time = guarded
    write = getattr(jcc, "put_executable_and_time", None)
    if write is None or getattr(write, "_ikjax_guard", False):
        return

    @functools.wraps(write)
    def guarded_write(*args, **kwargs):
        try:
            return write(*args, **kwargs)
        except Exception as e:  # a full disk, a directory removed under the run: one line, not JAX's warning
            if _own_directory() is None or getattr(jax.config, "jax_raise_persistent_cache_errors", False):
                raise
            _not_written(e)
    guarded_write._ikjax_guard = True
    jcc.put_executable_and_time = guarded_write


_unwritten = 0  # entries of our directory this process could not write


def _not_written(error: Exception) -> None:
    """An entry JAX could not write in our directory: the run goes on (the step is compiled; the
    next run compiles it again); the first one said in one line, the rest at -v (JAX printed a
    two-line UserWarning naming site-packages for each, an outside probe found)."""
    global _unwritten
    _unwritten += 1
    why = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:200]
    if _unwritten == 1:
        log.warning("compilation cache: an entry was not written in %s (%s); the run goes on", describe(), why)
    else:
        log.info("compilation cache: an entry was not written (%s)", why)


def _own_directory() -> Path | None:
    """Our build directory while JAX's cache points at it (None: off, or a directory the user
    configured for JAX themselves)."""
    d = _configured[1] if _configured is not None and _configured[2] else None
    return d if d is not None and getattr(jax.config, "jax_compilation_cache_dir", None) == str(d) else None


def _replace_entry(d: Path, cache_key: str, error: Exception) -> None:
    global _replaced
    for suffix in ("-cache", "-atime"):  # jax/_src/lru_cache.py's file names
        try:
            (d / f"{cache_key}{suffix}").unlink()
        except OSError:
            pass
    _replaced += 1
    why = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    if _replaced == 1:
        log.warning("compilation cache: replacing an unreadable entry in %s (%s); it is compiled again",
                    describe(), why[:200])
    else:
        log.info("compilation cache: replacing unreadable entry %s (%s)", cache_key, why[:200])


def _count(event: str) -> None:
    _counts[event] += 1
    mine = getattr(_thread_counts, "counts", None)
    if mine is None:
        mine = _thread_counts.counts = dict.fromkeys(_counts, 0)
    mine[event] += 1


def _listen() -> None:
    global _listening
    if not _listening:
        def on_event(event: str, **_):
            if event in _counts:
                _count(event)
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


@functools.cache
def _build_tag_once() -> str:
    return build_tag()


def _step_key(parts: tuple) -> str:
    """A stored step's key: its parts, the sources, JAX's versions and flags, the devices, and
    `build_tag` (the kernel libraries' bytes, the CPU): the directory already holds the tag where
    ikjax chose it, not where the user pointed JAX's own cache (jax_compilation_cache_dir), which
    another build or another CPU may share."""
    import jaxlib
    return repr((parts, _source_hash(), jax.__version__, jaxlib.__version__, os.environ.get("XLA_FLAGS", ""),
                 [(dev.platform, dev.device_kind, dev.id) for dev in jax.devices()], _build_tag_once()))


def _step_path(key: str) -> Path | None:
    d = directory()
    if d is None:
        return None
    return d / "steps" / (hashlib.sha256(key.encode()).hexdigest() + ".pkl")


def _drop(path: Path, why: str) -> None:
    """A stored step that cannot serve this run: removed, so that no later run reads it again
    (the step compiled now takes its place where it can be stored)."""
    log.info("compilation cache: replacing %s (%s)", path.name, why)
    try:
        path.unlink()
    except OSError:
        pass


# A stored entry's file: MAGIC, the BLAKE2b digest of the body, the body (the pickled entry). Why
# the digest: a few flipped bytes inside a serialized executable deserialize quietly and run as
# machine code (an outside probe: segfaults, illegal instructions, and once a wrong perplexity,
# on every later run of the command, the entry never removed); a damaged entry is now a miss.
_MAGIC = b"IKJXSTP2"
_DIGEST = 32


def _framed(body: bytes) -> bytes:
    return _MAGIC + hashlib.blake2b(body, digest_size=_DIGEST).digest() + body


def _checked_body(data: bytes) -> bytes | None:
    """The body of a framed entry (`_framed`); None for another format; ValueError for a body whose
    digest does not match (damaged on disk)."""
    if not data.startswith(_MAGIC):
        return None
    digest, body = data[len(_MAGIC):len(_MAGIC) + _DIGEST], data[len(_MAGIC) + _DIGEST:]
    if hashlib.blake2b(body, digest_size=_DIGEST).digest() != digest:  # (a short file: a short digest)
        raise DamagedEntry("damaged: its checksum does not match its bytes")
    return body


class DamagedEntry(ValueError):
    """A stored entry whose bytes changed on disk after it was written whole."""


def _unreadable(path: Path, e: BaseException) -> None:
    """An entry that could not be read: removed; a damaged one said without -v (the bytes changed
    on disk under the cache), a stale or partial one only in the log."""
    if isinstance(e, DamagedEntry):
        log.warning("compilation cache: stored entry %s is damaged (its checksum does not match its bytes); "
                    "compiled again", path.name)
    _drop(path, f"unreadable: {type(e).__name__}: {e}")


def _read_step(path: Path) -> tuple[str | None, Any]:
    """(the full key an entry was stored under, its executable) of a stored step's file; (None,
    None) for an entry that is not a stored step at all. Raises what reading or deserializing it
    raised."""
    # a stored step names our C++ kernels by FFI target only: they must be registered with XLA
    # before it is deserialized (tracing registers them, and a stored step is never traced)
    from ikjax import ops
    ops.register_native_targets()
    import pickle
    from jax.experimental.serialize_executable import deserialize_and_load
    body = _checked_body(path.read_bytes())
    if body is None:
        return None, None  # another format (an earlier version's entry)
    entry = pickle.loads(body)
    if not (isinstance(entry, tuple) and len(entry) == 5 and isinstance(entry[0], str)):
        return None, None  # not ours, or stored before entries named their devices
    stored_key, payload, in_tree, out_tree, device_ids = entry
    # deserialize_and_load binds an executable to every device of the backend unless told which: a
    # one-device program (a -sm layer stage's, or the default device's in a process that sees two
    # GPUs) then refuses its own arguments ("expected 2 shards"). The ids are those it was compiled
    # for, in its device assignment's order (a mesh's order too); the key names the devices.
    by_id = {d.id: d for d in jax.devices()}
    if any(i not in by_id for i in device_ids):
        raise ValueError(f"stored for devices {device_ids}, this process has {sorted(by_id)}")
    return stored_key, deserialize_and_load(payload, in_tree, out_tree,
                                            execution_devices=[by_id[i] for i in device_ids])


def load_step(parts: tuple, signature: tuple | None = None, *, label: str | None = None):
    """The executable stored under `parts` by `store_step` (counted as a cache hit), or None.

    None (a miss, never an error) for anything that cannot serve this call (`_load_entry`: an
    unreadable or partial entry, one stored under another key, one whose argument tree and types
    differ from `signature`); such an entry is removed. One `prefetch_steps` already read is taken
    from there, with the same checks. `label`: the run's `recent_label`, under which the step is
    noted as used (`note_used`)."""
    key = _step_key(parts)
    path = _step_path(key)
    if path is None or not path.is_file():
        return None
    try:
        ahead = _take_prefetched(path)
    except Exception as e:  # noqa: BLE001 - its read failed on the prefetch thread: as if read here
        _unreadable(path, e)
        return None
    exe = _load_entry(path, key, signature, ahead)
    if exe is None:
        return None
    _count(HIT_EVENT)
    _count(STEP_LOAD)
    if ahead is not None:
        _count(STEP_PREFETCHED)
    note_used(label, path)
    return exe


def _load_entry(path: Path, key: str, signature: tuple | None, read: tuple | None = None):
    """The executable of the stored entry at `path` (`read`: its (key, executable), already read)
    if it was stored under `key` and takes arguments of `signature` ((tree, ((shape, dtype), ...)),
    `signature_of`); else None, the entry removed (unreadable, stored for other arguments or by
    another version, compiled for other argument types)."""
    try:
        stored_key, exe = read if read is not None else _read_step(path)
    except Exception as e:  # noqa: BLE001 - a stale, partial or damaged entry: compile as if absent
        _unreadable(path, e)
        return None
    if stored_key != key:
        _drop(path, "stored for other arguments or by another version")
        return None
    if signature is not None and executable_signature(exe) != signature:
        _drop(path, "compiled for other argument types")
        return None
    return exe


def describe_leaf(a) -> tuple:
    """A leaf as a stored step's or program's key sees it: shape, dtype, and for an array its
    placement (a host scalar: none)."""
    sharding = getattr(a, "sharding", None)
    return (tuple(a.shape), str(a.dtype), str(sharding) if sharding is not None else None,
            getattr(sharding, "memory_kind", None))


def signature_of(tree, leaves: list) -> tuple:
    """(tree, ((shape, dtype), ...)) of a call's arguments, as `executable_signature` gives an
    executable's."""
    return tree, tuple((tuple(a.shape), str(a.dtype)) for a in leaves)


def stores_whole(on_cpu_only: bool) -> bool:
    """IKJAX_STORE_STEPS: executables kept whole (steps, and the load's programs) always (1),
    never (0), or (auto) where the run is on an accelerator (a CPU step traces and compiles in
    about a second, and a CPU load runs none of the programs)."""
    store = env.choice("IKJAX_STORE_STEPS")
    return store == "1" or store == "auto" and not on_cpu_only


# -- stored steps read ahead: a warm run's steps deserialized while its weights load ---------------
#
# Why: a stored step is looked up by a key made of the whole argument tree, which a run knows only
# once the weights' shapes are in (the first layer of each group loaded), and its deserialization
# then took 1.1-1.3 s on an H200 (the decode loop's executable: ~130 kernel modules), in line
# before the first row (RESULTS §22n: a warm V2-Lite sweep-bench's main thread waited 0.85 s for
# the shapes, then 1.26 s for the steps). So each run notes which stored steps it used under a
# label of the model file and the run options (`recent_label`: no tracing, known before the
# load), and the next run with that label starts reading those entries on a thread before its load
# begins. Nothing is trusted for being read ahead: `load_step` checks the full key stored in the
# entry and the executable's argument types exactly as for an entry it reads itself; an entry
# read ahead that no step asks for is only work lost.

STEP_PREFETCHED = "ikjax/stored_steps_read_ahead"  # of STEP_LOAD: loads taken from prefetch_steps
_counts[STEP_PREFETCHED] = 0
_RECENT_KEEP = 6          # step names a label's list keeps (most recently used first)
_prefetch_lock = threading.Lock()
_prefetched: dict[Path, Any] = {}  # entry path -> Future of _read_step(path)
_used: dict[str, list[str]] = {}   # label -> entry names this process used, in order


def recent_label(model_path: str, options: Any) -> str:
    """A run's label for its list of used steps: the model file (path, size, modification time)
    and the run options; the same command on the same file finds the list of its last run."""
    try:
        st = os.stat(model_path)
        ident = (os.path.realpath(model_path), st.st_size, st.st_mtime_ns)
    except OSError:
        ident = (model_path,)
    return hashlib.sha256(repr((ident, repr(options))).encode()).hexdigest()[:32]


def _recent_path(label: str) -> Path | None:
    d = directory()
    return None if d is None else d / "recent" / f"{label}.txt"


def note_used(label: str | None, path: Path | None) -> None:
    """Put a stored step's entry at the front of `label`'s list (written whole each time: a list
    a crash cut short is only a shorter list)."""
    if label is None or path is None:
        return
    rp = _recent_path(label)
    if rp is None:
        return
    with _prefetch_lock:
        mine = _used.setdefault(label, [])
        if path.name in mine:
            return
        mine.append(path.name)
        try:
            old = [n for n in rp.read_text().split() if n not in mine] if rp.is_file() else []
        except (OSError, ValueError):  # unreadable, or not text (a damaged cache): written anew
            old = []
        names = (mine + old)[:_RECENT_KEEP]
        try:
            from ikjax.atomic_file import atomic_write
            data = "\n".join(names) + "\n"
            rp.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with atomic_write(rp, len(data), "list of recent steps") as tmp:
                tmp.write_text(data)
        except Exception as e:  # noqa: BLE001 - a list not written costs the next run its head start
            log.info("compilation cache: list of recent steps not written (%s)", e)


def prefetch_steps(label: str) -> int:
    """Start reading, on a thread, the stored steps `label`'s last runs used (at most
    `_RECENT_KEEP`, most recent first); the number of entries started. IKJAX_PREFETCH_STEPS=0:
    none."""
    if env.choice("IKJAX_PREFETCH_STEPS") == "0":
        return 0
    rp = _recent_path(label)
    if rp is None or not rp.is_file():
        return 0
    try:
        names = rp.read_text().split()[:_RECENT_KEEP]
    except (OSError, ValueError):  # unreadable, or not text (a damaged cache): nothing read ahead
        return 0
    paths = [rp.parent.parent / "steps" / n for n in names if n.endswith(".pkl") and "/" not in n]
    paths = [p for p in paths if p.is_file()]
    if not paths:
        return 0
    from concurrent.futures import ThreadPoolExecutor
    pool = ThreadPoolExecutor(min(2, len(paths)), thread_name_prefix="ikjax-step-prefetch")
    with _prefetch_lock:
        for p in paths:
            if p not in _prefetched:
                _prefetched[p] = pool.submit(_read_step, p)
    pool.shutdown(wait=False)
    return len(paths)


def _take_prefetched(path: Path):
    """The (key, executable) read ahead for `path` (waiting for it if under way), or None."""
    with _prefetch_lock:
        fut = _prefetched.pop(path, None)
    return None if fut is None else fut.result()


def executable_signature(exe) -> tuple:
    """(argument tree, ((shape, dtype), ...)) of what a compiled executable takes: what JAX checks
    a call's arguments against before it runs anything ("Function compiled with input pytree does
    not match", "Argument types differ"), in the form `load_step`'s `signature` has."""
    return exe.in_tree, tuple((tuple(a.shape), str(a.dtype)) for a in jax.tree.leaves(exe.in_avals))


def drop_step(parts: tuple, why: str) -> None:
    """Remove the entry stored under `parts` (one that loaded but did not fit its call)."""
    path = _step_path(_step_key(parts))
    if path is not None and path.is_file():
        _drop(path, why)


def store_step(parts: tuple, exe, *, label: str | None = None) -> None:
    """Keep a compiled step for `load_step` (best effort: a step that cannot be serialized, or a
    full disk, only costs the next run its tracing). An entry already there is replaced; `label`
    as for `load_step`."""
    key = _step_key(parts)
    path = _step_path(key)
    if path is not None and _store(path, key, exe, "step"):
        note_used(label, path)


def _store(path: Path, key: str, exe, what: str) -> bool:
    """Write `exe` whole under `path` with its full key (whole or not at all); best effort."""
    try:
        import pickle
        from jax.experimental.serialize_executable import serialize
        from ikjax.atomic_file import atomic_write
        devices = [d.id for d in exe.runtime_executable().local_devices()]
        data = _framed(pickle.dumps((key, *serialize(exe), devices)))
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with atomic_write(path, len(data), f"compiled {what}") as tmp:
            tmp.write_bytes(data)
        return True
    except Exception as e:  # noqa: BLE001
        log.info("compilation cache: %s not stored (%s)", what, e)
        return False


def hits() -> int:
    """Executables this process loaded from the persistent cache."""
    return _counts[HIT_EVENT]


def thread_counts() -> tuple[int, int]:
    """(hits, writes) of the calling thread alone (see `hits`, `writes`): what a compile in this
    thread did, whatever steps compile beside it in other threads."""
    mine = getattr(_thread_counts, "counts", None) or {}
    return mine.get(HIT_EVENT, 0), mine.get(WRITE_EVENT, 0)


def step_loads() -> int:
    """Steps this process loaded whole from `steps/` (no tracing); a part of `hits()`."""
    return _counts[STEP_LOAD]


# -- the load's small programs kept whole (ikjax.programs: the runner installed by `setup`) ---------

PROGRAM_LOAD = "ikjax/stored_program_loads"  # ours: load programs read whole from programs/
_counts[PROGRAM_LOAD] = 0
_programs: dict[str, Any] = {}  # full key -> executable, this process (a layer's program, once a run)
_programs_lock = threading.Lock()
_programs_pending: dict[str, Any] = {}  # full key -> Future of a program compiling ahead (precompile_programs)
_programs_ahead: set[str] = set()  # keys compiled ahead and not yet asked for by the load
PROGRAM_AHEAD = "ikjax/load_programs_compiled_ahead"  # ours: the load's calls served by precompile_programs
_counts[PROGRAM_AHEAD] = 0


def _stores_programs() -> bool:
    """As steps (IKJAX_STORE_STEPS): 1 always, 0 never, auto on accelerators (on a CPU a load
    runs none of these programs: its stacks are the file's bytes, and no kernel reads a repack);
    IKJAX_STORE_PROGRAMS=0: never."""
    return env.choice("IKJAX_STORE_PROGRAMS") != "0" and stores_whole(jax.default_backend() == "cpu")


def run_program(name: str, jitted, args: tuple, static: tuple):
    """ikjax.programs' runner: `jitted(*args, *static)` through an executable kept whole under
    `programs/` of the cache directory, keyed (like a stored step, with no tracing) by the
    program's name, its arguments' tree, shapes, dtypes and shardings, its static arguments, and
    the sources, versions, XLA_FLAGS and devices (`_step_key`). A stored program is checked as a
    stored step is (its full key, its argument types) and a call it refuses runs the jitted
    function; an unreadable or stale entry is a miss, removed and replaced."""
    leaves, tree = jax.tree.flatten((args, {}))
    if directory() is None or not _stores_programs():
        return jitted(*args, *static)
    key = _program_key(name, tree, leaves, static)
    with _programs_lock:
        exe = _programs.get(key)
        pending = _programs_pending.get(key) if exe is None else None
    if pending is not None:  # compiling ahead: wait for it rather than compile it twice
        exe = pending.result()
    with _programs_lock:
        if key in _programs_ahead and exe is not None:
            _programs_ahead.discard(key)
            _count(PROGRAM_AHEAD)
    if exe is None:
        exe = _program(key, jitted, args, static, signature_of(tree, leaves))
        with _programs_lock:
            _programs[key] = exe
    try:
        return exe(*args)
    except (TypeError, ValueError):
        if any(isinstance(a, jax.Array) and a.is_deleted() for a in leaves):
            raise  # it ran far enough to consume a donated argument: not a refusal at the door
        with _programs_lock:
            _programs.pop(key, None)
        path = _program_path(key)
        if path is not None and path.is_file():
            _drop(path, "did not fit its call")
        return jitted(*args, *static)


# XLA's GPU autotuning off: with the Pallas kernels doing the products it measured ~240 small fusions'
# emitters and the router's GEMM, 3-4 s of a ~10 s cold compile, for 1-2 % of S_PP (RESULTS §22q);
# the steps' options (ikjax.runtime.executables.gpu_options) and the load's programs use it
NO_GPU_AUTOTUNE = {"xla_gpu_autotune_level": 0}


def _program_key(name: str, tree, leaves: list, static: tuple, host: frozenset = frozenset()) -> str:
    """A program's full key from its call (arrays, or ShapeDtypeStructs with the same placement);
    the leaves numbered in `host` described as host arrays (no placement)."""
    described = tuple((*describe_leaf(a)[:2], None, None) if i in host else describe_leaf(a)
                      for i, a in enumerate(leaves))
    return _step_key(("program", name, str(tree), described, repr(static)))


def _host_variants(leaves: list) -> list[frozenset]:
    """Which leaves a real load may pass as host arrays (NumPy: the file's bytes) where the load on
    shapes alone had them placed on one device: every subset of the single-device leaves (a
    program takes a few). The executable compiled for the placed form runs the host form too (JAX
    moves a host argument to the device the executable expects)."""
    single = [i for i, a in enumerate(leaves)
              if len(getattr(getattr(a, "sharding", None), "device_set", ())) == 1]
    if len(single) > 4:
        return [frozenset()]
    out = []
    for mask in range(1 << len(single)):
        out.append(frozenset(i for b, i in enumerate(single) if mask >> b & 1))
    return out


def precompile_programs(calls: list, threads: int = 8) -> int:
    """Compile (or read whole) the load's programs `calls` (ikjax.programs.recording's, traced on
    shapes alone) side by side on threads, ahead of the load that will run them; returns how many
    distinct ones were started. Why: a cold load compiled its programs one after another in its
    own thread, 2.2 s of the deep V2-Lite shape's cold start, and the first row waited 0.6 s for
    that load after its steps had compiled (RESULTS §22z). The load finds each program here by the
    same key (`run_program` waits for one still compiling); a call whose key differs is compiled
    by the load as before. Off where programs are not kept (`run_program` would not look).

    Eight threads, not four: the deep V2-Lite shape's eight programs then all lower (Python, under
    the GIL) before the steps' lowering starts, where four threads left a second round of four
    lowering beside the prompt step's (RESULTS §22am)."""
    if directory() is None or not _stores_programs() or not calls:
        return 0
    from concurrent.futures import ThreadPoolExecutor
    todo = {}
    for name, jitted, args, static in calls:
        leaves, tree = jax.tree.flatten((args, {}))
        keys = [_program_key(name, tree, leaves, static, host) for host in _host_variants(leaves)]
        with _programs_lock:
            if keys[0] in _programs or keys[0] in _programs_pending or keys[0] in todo:
                continue
        todo[keys[0]] = (keys[1:], jitted, args, static, signature_of(tree, leaves))
    if not todo:
        return 0
    pool = ThreadPoolExecutor(min(threads, len(todo), max(2, os.cpu_count() or 1)), thread_name_prefix="ikjax-programs")

    def one(key, others, jitted, args, static, signature):
        try:
            # not under the steps' lowering lock: these are keyed without tracing, and the steps
            # compiling beside them (a load that overlaps them stores its steps whole) are too
            exe = _program(key, jitted, args, static, signature, serialized=False)
        except Exception as e:  # noqa: BLE001 - the load then compiles it itself, and raises if it must
            log.info("a load program did not compile ahead (%s: %s)", type(e).__name__, e)
            exe = None
        with _programs_lock:
            for k in (key, *others):
                if exe is not None and k not in _programs:
                    _programs[k] = exe
                    _programs_ahead.add(k)
                _programs_pending.pop(k, None)
        return exe
    with _programs_lock:
        for key, (others, jitted, args, static, signature) in todo.items():
            future = pool.submit(one, key, others, jitted, args, static, signature)
            for k in (key, *others):
                _programs_pending.setdefault(k, future)
    pool.shutdown(wait=False)
    return len(todo)


def _program_path(key: str) -> Path | None:
    d = directory()
    return None if d is None else d / "programs" / (hashlib.sha256(key.encode()).hexdigest() + ".pkl")


def _program(key: str, jitted, args: tuple, static: tuple, signature: tuple, serialized: bool = True):
    """The stored executable for `key` where it serves, else one compiled here (and stored)."""
    path = _program_path(key)
    if path is not None and path.is_file():
        exe = _load_entry(path, key, signature)
        if exe is not None:
            _count(PROGRAM_LOAD)
            return exe
    hits0 = thread_counts()[0]
    # the load's programs move and repack bytes: nothing for XLA's GPU autotuner to choose (the
    # runner is installed on accelerators only: setup)
    exe = lower(jitted, *args, *static, _serialized=serialized).compile(
        dict(NO_GPU_AUTOTUNE) if jax.default_backend() == "gpu" else None)
    if path is not None and thread_counts()[0] == hits0:  # compiled here, not JAX's cache's (XLA:CPU)
        _store(path, key, exe, "program")
    return exe


def programs_ahead() -> int:
    """The load's program calls this process served from programs compiled ahead of it."""
    return _counts[PROGRAM_AHEAD]


def program_loads() -> int:
    """Load programs this process read whole from `programs/` (ikjax.programs)."""
    return _counts[PROGRAM_LOAD]


def steps_read_ahead() -> int:
    """Of `step_loads()`, the steps taken from `prefetch_steps`'s reads."""
    return _counts[STEP_PREFETCHED]


def replaced() -> int:
    """Unreadable entries of our directory this process deleted so JAX writes them afresh."""
    return _replaced


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
