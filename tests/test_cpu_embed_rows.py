"""The C++ row gather (pallas_kernels/embed_rows): the same bytes as `table[tokens]`, and reading a
memory-mapped table through it does not map the file's pages into the process."""
from __future__ import annotations

import mmap
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu as _cpu
from pallas_kernels.embed_rows.cpu import embed_rows, supported

pytestmark = pytest.mark.skipif(not _cpu.available(), reason="C++ CPU kernels not built")


def _rss_file_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("RssFile"))


@pytest.mark.parametrize("shape", [(1,), (3,), (17,), (2, 512)])
def test_matches_gather_anonymous(shape):
    rng = np.random.default_rng(len(shape) * 100 + shape[-1])
    table = rng.integers(0, 256, (1000, 34), dtype=np.uint8)
    tokens = rng.integers(-5, 1010, shape).astype(np.int32)  # negative / out-of-range ids as jnp indexing
    got = jax.jit(embed_rows)(jnp.asarray(table), jnp.asarray(tokens))
    want = jnp.asarray(table)[jnp.asarray(tokens)]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux only (/proc/self/status)")
def _aliased(host: np.ndarray):
    """`host` as a CPU array on the same memory (the kernel then sees the mapping's pages); a skip
    where this JAX cannot alias or the client copied it."""
    try:
        dev = jax.device_put(host, may_alias=True)
    except TypeError:
        pytest.skip("this JAX has no device_put(may_alias=)")
    if dev.unsafe_buffer_pointer() != host.ctypes.data:
        pytest.skip("the CPU client copied the table (not aliased): nothing to measure")
    return dev


def test_mapped_table_same_bytes_without_mapping_pages(tmp_path):
    V, R = 40000, 1088  # ~41 MiB, rows not page-aligned
    head = 4096 + 64  # the table at a 64-byte aligned offset of the file, like a GGUF tensor
    rng = np.random.default_rng(0)
    table = rng.integers(0, 256, (V, R), dtype=np.uint8)
    path = tmp_path / "table.bin"
    with open(path, "wb") as f:
        f.write(b"\0" * head)
        f.write(table.tobytes())
        f.write(b"\0" * 4096)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    host = np.frombuffer(m, np.uint8, count=V * R, offset=head).reshape(V, R)
    dev = _aliased(host)
    tokens = rng.integers(0, V, (1, 600)).astype(np.int32)
    fn = jax.jit(embed_rows)
    fn(dev, jnp.asarray(tokens[:, :1])).block_until_ready()  # compile, register
    before = _rss_file_kib()
    got = np.asarray(fn(dev, jnp.asarray(tokens)))
    grew = _rss_file_kib() - before
    np.testing.assert_array_equal(got, table[tokens])
    # XLA's gather maps ~64 KiB around each of these 600 rows (tens of MiB); pread maps none
    assert grew < 2048, f"RssFile grew {grew} KiB reading 600 rows"


def test_supported_refuses_non_bytes():
    assert not supported(jnp.zeros((4, 4), jnp.float32), jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="embed_rows"):
        embed_rows(jnp.zeros((4, 4), jnp.float32), jnp.zeros((2,), jnp.int32))


def test_empty_table_refused():
    """No row to clamp an id to: the C++ op refuses (it read before the table, found by fuzzing)."""
    from pallas_kernels.embed_rows import cpu as embed_cpu
    table = jnp.zeros((0, 16), jnp.uint8)
    assert not embed_cpu.supported(table, jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="unsupported"):
        embed_cpu.embed_rows(table, jnp.zeros((3,), jnp.int32))


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux only (/proc)")
def test_a_truncated_file_is_an_error_not_sigbus_and_its_descriptor_can_go(tmp_path):
    """A mapped table whose file was truncated under it (an outside probe, stop 65: a model file rewritten
    while in use killed the process with SIGBUS, the gather reading the rows past the new end through
    the mapping when pread came back short): the call fails with an error naming the file's change,
    and the process lives on. `forget_file` lets go of the gather's descriptor (Engine.close). In a
    child process: a SIGBUS there must not take the test run with it."""
    import subprocess
    import sys
    script = """
import mmap, os, sys
import jax, jax.numpy as jnp, numpy as np
from pallas_kernels import cpu as _cpu
from pallas_kernels.embed_rows.cpu import embed_rows
path = sys.argv[1]
V, R = 4096, 256
with open(path, "wb") as f:
    f.write(np.arange(V * R, dtype=np.uint32).astype(np.uint8).tobytes())
with open(path, "rb") as f:
    m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
host = np.frombuffer(m, np.uint8).reshape(V, R)
dev = jax.device_put(host, may_alias=True)
if dev.unsafe_buffer_pointer() != host.ctypes.data:
    print("copied"); sys.exit(0)
fn = jax.jit(embed_rows)
ids = jnp.asarray(np.array([[5, V - 1]], np.int32))
assert (np.asarray(fn(dev, ids)) == host[[5, V - 1]][None]).all()
st = os.stat(path)
def fds():
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") == path
        except OSError:
            pass
    return n
before = fds()
if before == 0:  # no PROCMAP_QUERY (Linux < 6.11): the gather reads through the mapping, as XLA's would
    print("no-procmap"); sys.exit(0)
os.truncate(path, R * 16)
try:
    np.asarray(fn(dev, ids))
    print("no error")
except Exception as e:
    print("error:", "truncated" in str(e))
print("forget", _cpu.forget_file(st.st_dev, st.st_ino), before - fds())
"""
    res = subprocess.run([sys.executable, "-c", script, str(tmp_path / "t.bin")], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, (res.returncode, res.stderr[-1500:])
    if res.stdout.strip() == "copied":
        pytest.skip("the CPU client copied the table (not aliased): nothing to read through the mapping")
    if res.stdout.strip() == "no-procmap":
        pytest.skip("this kernel has no PROCMAP_QUERY (Linux < 6.11): rows are read through the mapping, and a "
                    "truncated file's SIGBUS is not caught there")
    assert res.stdout.split() == ["error:", "True", "forget", "True", "1"], res.stdout


def test_a_private_writable_mapping_gives_its_own_pages(tmp_path):
    """A table mapped copy-on-write and written in memory: its rows are the mapping's bytes, not the
    file's (the kernel read every file-backed row with pread, and returned the file's old bytes;
    ikjax maps GGUF files read-only, so only such a mapping handed to the kernel saw it)."""
    path = tmp_path / "tab.bin"
    np.zeros(4096 * 64, np.uint8).tofile(path)
    m = np.memmap(path, dtype=np.uint8, mode="c", shape=(4096, 64))
    m[5] = 0xAB
    tab = _aliased(m)
    got = np.asarray(embed_rows(tab, jnp.asarray([[5, 6]], jnp.int32)))
    np.testing.assert_array_equal(got[0, 0], np.full(64, 0xAB, np.uint8))
    np.testing.assert_array_equal(got[0, 1], np.zeros(64, np.uint8))
