"""Micro-benchmark of quant_matmul: the 'sweep,qm' part of bench/gpu_check.py (checks + timings vs jnp).

    PYTHONPATH=$PWD python -m pallas_kernels.quant_matmul.bench [--quick] [--small --interpret]
"""
import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    script = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"
    sys.argv = [str(script), "--only", "sweep,qm"] + sys.argv[1:]
    runpy.run_path(str(script), run_name="__main__")
