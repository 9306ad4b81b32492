"""Output files that appear whole or not at all (make-model, the GGUF writer, plot).

The target is checked before a byte is written (not a directory or other non-regular file, a
writable place, enough free space for what is about to be written); the data goes to a hidden
temporary file in the same directory, which is renamed over the target only after the last byte,
and removed on any failure or interrupt (KeyboardInterrupt included). A killed process (SIGKILL)
can still leave a `.NAME.*.part` file behind; nothing ever leaves a truncated file under NAME.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from ikjax.errors import OptionError

# Room kept free beyond the bytes a write needs (file system metadata, other writers).
FREE_MARGIN = 16 << 20


def free_margin(needed_bytes: int) -> int:
    """The room kept free beside a write: FREE_MARGIN for big files, a quarter of the file plus a
    page for small ones (a 200-byte statistics file was refused on a file system with 2 MiB free)."""
    return min(FREE_MARGIN, 4096 + needed_bytes // 4)


def _fmt(n: int) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n / (1 << 10):.1f} KiB"


def _existing_ancestor(p: Path) -> Path:
    for a in (p, *p.parents):
        if a.exists():
            return a
    return Path("/")


def keep_foreign(path: str | os.PathLike, what: str, ours: Callable[[Path], bool], kind: str) -> None:
    """Refuse, in one line, to write over an existing non-empty file that `ours` says is not one of
    this output's own (`kind`): a mistyped output path named the loaded model, the -f text or a config,
    and replaced it (outside probes: the expert statistics', stop 63; perplexity's base file, stop 67)."""
    p = Path(os.path.expanduser(str(path)))
    try:
        foreign = p.is_file() and p.stat().st_size > 0 and not ours(p)
    except OSError:
        return  # unreadable: check_target says what is wrong with it
    if foreign:
        raise OptionError(f"{what}: {path} exists and is not {kind}: it is kept; give another file name")


def check_target(path: str | os.PathLike, needed_bytes: int = 0, what: str = "output", *,
                 parent_exists: bool = False) -> Path:
    """Refuse, with one line naming `what` and the path, a target that cannot take the file:
    an existing directory or non-regular file, a parent that is not a directory or not writable,
    or a file system with less than `needed_bytes` free. `parent_exists`: a user's output path,
    whose directory must exist (as ik's tools open their files): a mistyped path is refused,
    not made. Returns the absolute target path."""
    if not isinstance(path, (str, os.PathLike)):  # (an API's save_base=5 wrote a file named ./5)
        raise OptionError(f"{what}: expected a file path, got {type(path).__name__}")
    if not str(path).strip():  # ("" is the current directory to abspath)
        raise OptionError(f"{what}: empty path (give a file name)")
    p = Path(os.path.abspath(os.path.expanduser(str(path))))
    if p.exists() or p.is_symlink():
        try:
            mode = p.stat().st_mode
        except OSError as e:
            raise OptionError(f"{what}: {path}: {e.strerror}") from None
        if stat.S_ISDIR(mode):
            raise OptionError(f"{what}: {path} is a directory (give a file name)")
        if not stat.S_ISREG(mode):
            raise OptionError(f"{what}: {path} exists and is not a regular file")
    if parent_exists and not p.parent.is_dir():
        raise OptionError(f"{what}: cannot create {path}: the directory {p.parent} does not exist")
    base = _existing_ancestor(p.parent)
    if not base.is_dir():
        raise OptionError(f"{what}: cannot create {path}: {base} is not a directory")
    try:
        st = os.statvfs(base)
    except OSError:
        st = None
    # writability before space: a read-only mount often reports little free space, and "needs
    # 3.30 MiB but has 1.00 MiB free" would send the user to free space that cannot be used anyway
    if st is not None and st.f_flag & getattr(os, "ST_RDONLY", 1):
        raise OptionError(f"{what}: cannot write {path}: {base} is on a read-only file system")
    if not os.access(base, os.W_OK | os.X_OK):
        raise OptionError(f"{what}: cannot write {path}: {base} is not writable")
    if st is not None and getattr(st, "f_blocks", 1) == 0 and st.f_bavail == 0:  # /proc, /sys: no room for any file
        raise OptionError(f"{what}: cannot write {path}: {base} is a virtual file system that holds no files")
    if needed_bytes and st is not None:
        free = st.f_bavail * st.f_frsize
        margin = free_margin(needed_bytes)
        if free < needed_bytes + margin:
            raise OptionError(f"{what}: {path} needs {_fmt(needed_bytes)} (plus {_fmt(margin)} kept free "
                              f"for the file system) but {base} has {_fmt(free)} free")
    return p


def _make_parent(p: Path, what: str) -> None:
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OptionError(f"{what}: cannot create the directory {p.parent}: {e.strerror}") from None


def _publish_mode(tmp: Path) -> None:
    """mkstemp makes 0600 files; the finished file gets the usual 0666 & ~umask."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, needed_bytes: int = 0, what: str = "output") -> Iterator[Path]:
    """`with atomic_write(p, n) as tmp:` write the file at `tmp`; on a clean exit it becomes `p`.

    Any exception or interrupt inside the block removes `tmp` and re-raises."""
    target = check_target(path, needed_bytes, what)
    _make_parent(target, what)
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        _publish_mode(tmp)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


@contextlib.contextmanager
def atomic_write_dir(path: str | os.PathLike, needed_bytes: int = 0, what: str = "output") -> Iterator[Path]:
    """For writers that make several files named after `path` (split GGUF shards): yields a
    temporary directory beside the target; on a clean exit every file written in it is moved
    next to `path` (each rename atomic), on any failure the directory is removed."""
    target = check_target(path, needed_bytes, what)
    _make_parent(target, what)
    tmpdir = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part"))
    try:
        yield tmpdir
        for f in sorted(tmpdir.iterdir()):
            check_target(target.parent / f.name, 0, what)
        for f in sorted(tmpdir.iterdir()):
            _publish_mode(f)
            os.replace(f, target.parent / f.name)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
