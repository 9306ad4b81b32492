"""glibc's malloc told to keep a CPU step's buffers between steps, not hand them back to the kernel.

Why (RESULTS §26ad): on the device host's 16 cores a 512-token CPU prompt step's second and third
runs page-faulted 30-48 thousand fresh pages (120-190 MB) and took 175-197 ms against 122-140 in
steady state; sweep-bench times each row's step once, right after its warm-up, so its N_KV 512 row
came out 20-30 % under the step's own speed. XLA:CPU allocates a step's temporaries per run with
malloc, and glibc's defaults give large blocks back (munmap, or a trim of the heap's top past a
threshold that follows the last large free), so the next run faults them in again, 16 threads
queueing on the process's page tables. With the mmap threshold fixed at its maximum (32 MiB), 1 GiB
of free heap top kept and 256 MiB added at each growth, the second run faulted 8-18 thousand pages
and sweep-bench's two rows ran 1.07x / 1.26x faster.

Only for an engine that runs on the CPU alone (its buffers are host memory; a GPU run's host side
keeps the default), once a process, on glibc; not where the user set a MALLOC_* variable of their
own, and IKJAX_MALLOC=0 keeps the defaults."""
from __future__ import annotations

import ctypes
import os
import sys

from ikjax import env

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = ((M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 1 << 30), (M_TOP_PAD, 256 << 20))
_tuned: bool | None = None


def tune() -> bool:
    """Apply SETTINGS with mallopt (once a process); whether they are in force."""
    global _tuned
    if _tuned is not None:
        return _tuned
    _tuned = False
    if env.choice("IKJAX_MALLOC") == "0" or not sys.platform.startswith("linux") \
            or any(k.startswith("MALLOC_") for k in os.environ):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _tuned = all(mallopt(param, value) == 1 for param, value in SETTINGS)
    return _tuned
