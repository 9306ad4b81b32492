"""glibc malloc's settings for CPU-only runs (ikjax/runtime/host_malloc.py): applied once an engine
runs on the CPU, visible as the heap's growth step, and not applied under IKJAX_MALLOC=0 or a
user's own MALLOC_* variable."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = r"""
import ctypes, os, sys
libc = ctypes.CDLL("libc.so.6")
libc.sbrk.restype = ctypes.c_void_p
libc.sbrk.argtypes = (ctypes.c_long,)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
if sys.argv[1] == "engine":
    import ikjax
    ikjax.load(sys.argv[2], ctx=256, ubatch=64, threads=1)
else:
    from ikjax.runtime import host_malloc
    host_malloc.tune()
from ikjax.runtime import host_malloc
# the heap's next growth: with M_TOP_PAD 256 MiB, brk moves by >= 256 MiB at once (by default ~128 KiB)
p0 = libc.sbrk(0)
step = 0
for _ in range(4096):
    libc.malloc(64 << 10)
    p1 = libc.sbrk(0)
    if p1 != p0:
        step = p1 - p0
        break
print(host_malloc._tuned, step)
"""


def _probe(mode, extra_env=None, model=""):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update({"JAX_PLATFORMS": "cpu", **(extra_env or {})})
    out = subprocess.run([sys.executable, "-c", PROBE, mode, model], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    tuned, step = out.stdout.split()[-2:]
    return tuned, int(step)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_cpu_engine_tunes_malloc(tiny_model):
    tuned, step = _probe("engine", model=str(tiny_model))
    assert tuned == "True"
    assert step >= 256 << 20, step  # M_TOP_PAD in force: the heap grows 256 MiB at a time


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
@pytest.mark.parametrize("extra", [{"IKJAX_MALLOC": "0"}, {"MALLOC_ARENA_MAX": "2"}])
def test_malloc_defaults_kept_when_asked(extra):
    tuned, step = _probe("tune", extra)
    assert tuned == "False"
    assert 0 < step < 64 << 20, step  # glibc's default top pad (128 KiB)

