"""Micro-benchmark of moe_matmul: the 'moe' part of bench/gpu_check.py (checks + timings vs jnp).

    PYTHONPATH=$PWD python -m pallas_kernels.moe_matmul.bench [--quick] [--small --interpret]
"""
import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    script = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"
    sys.argv = [str(script), "--only", "moe"] + sys.argv[1:]
    runpy.run_path(str(script), run_name="__main__")
