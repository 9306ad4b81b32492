"""Shared test helpers: where the real-converter fixtures are, and the error measure they use."""
from __future__ import annotations

import json
import os

# Tests compile many small graphs: XLA's cheapest CPU backend settings cut compile time ~40 %.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
# The suite compares against references at f32 tolerances: `dtype="auto"` (bf16 products on the
# kernel paths) is pinned to f32 here; tests of the bf16 modes ask for dtype="bf16" by name, and
# test_options checks what auto means without this setting.
os.environ.setdefault("IKJAX_DTYPE", "f32")
# Nothing written to the user's ~/.cache/ikjax/xla: the persistent compilation cache is off unless
# asked for (tests/test_compile_cache.py points it at temp directories).
os.environ.setdefault("IKJAX_COMPILE_CACHE", "0")
from pathlib import Path

import numpy as np
import pytest


FIXTURES_MISSING = ("GGUF fixtures not found at {d}: the real-converter fixture suite runs where ../shared/fixtures "
                    "exists (this project's workplace) or with IKJAX_FIXTURES set")


def fixtures_dir() -> Path:
    """../shared/fixtures beside the checkout, or $IKJAX_FIXTURES.

    The fixtures (GGUFs from the real converters with reference logits) live only in the project's
    workplace, not in the repository: on a machine with only the repo, every test that needs them
    is skipped with this reason (a whole module when it asks at import, as test_fixtures does),
    while the self-made oracles (tiny models written by our writer) still run."""
    env = os.environ.get("IKJAX_FIXTURES")
    d = Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "fixtures"
    if not (d / "MANIFEST.json").exists():
        pytest.skip(FIXTURES_MISSING.format(d=d), allow_module_level=True)
    return d


def _tiny(tmp_path_factory, layers: int) -> str:
    from ikjax.tools.synthetic import make_model
    p = tmp_path_factory.getbasetemp() / f"ikjax-tiny-{layers}L.gguf"
    if not p.exists():
        make_model(p, "tiny", "Q8_0", layers=layers)
    return str(p)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The tiny synthetic preset cut to 2 layers (Q8_0): made once per session."""
    return _tiny(tmp_path_factory, 2)


@pytest.fixture(scope="session")
def tiny4_model(tmp_path_factory):
    """The tiny preset with 4 layers (Q8_0; layer 0 dense, 1-3 MoE): enough layers for -ngl,
    --n-cpu-moe and splits over devices. Made once per session."""
    return _tiny(tmp_path_factory, 4)


def manifest() -> list[dict]:
    return json.loads((fixtures_dir() / "MANIFEST.json").read_text())


def fixture_entry(name: str) -> dict:
    return next(e for e in manifest() if e["file"] == name)


def load_ref(entry: dict, key: str = "ref") -> tuple[np.ndarray, np.ndarray]:
    d = fixtures_dir()
    return np.load(d / entry["tokens"]), np.load(d / (entry.get(key) or entry["ref"]))


def rel_err(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


# The default run is spread over worker processes (pytest-xdist, pyproject.toml's addopts: `-n auto
# --dist loadfile`): each test file runs whole on one worker, so its module fixtures (a subprocess of
# fake devices, a server) are made once. Workers: one per core this process may use, at most 4 (each
# holds JAX, the compiled steps of its files and, for the oracle tests, torch). `-n 0` runs serially.
MAX_WORKERS = 4


def pytest_xdist_auto_num_workers(config):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_WORKERS, cores))


# Files sent to the workers first, longest first (seconds per file in a default run on this
# workplace's 2-core box, 2 workers, ordered by what each file took there): with the long files at
# the end of the queue one worker would finish them alone while the other waits. A file not named
# here keeps its place after these; the order is only a schedule, nothing in a file depends on
# another having run.
LONG_FILES = (
    "test_multi_device.py",      # 4 and 8 fake devices, one subprocess each
    "test_engine.py",
    "test_cpu_quant_matmul.py",
    "test_fixtures.py",
    "test_modes.py",
    "test_cpu_mla.py",
    "test_model_families.py",
    "test_sweep_bench.py",
    "test_perplexity.py",
    "test_layer_groups.py",
    "test_kernels_quant_matmul.py",
    "test_kernels_moe.py",
    "test_batch_consistency.py",
    "test_moe.py",
    "test_cpu_moe.py",
    "test_quant.py",
    "test_host_stream.py",
    "test_fuzz.py",
    "test_multi_host.py",        # two processes per check
    "test_expert_stats.py",
    "test_compile_cache.py",
    "test_surfaces.py",
    "test_serve.py",
    "test_placement.py",
    "test_stored_steps.py",
    "test_kernels_mla.py",
    "test_scheduler.py",
    "test_multi_device_decode.py",
    "test_real_geometry.py",
    "test_model_kernels.py",
    "test_batch_invariance.py",
    "test_synthetic.py",
    "test_faults.py",
    "test_cli.py",
    "test_chat_cli.py",
    "test_text_api.py",
    "test_cache_sequence.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda it: rank.get(it.path.name, len(rank)))  # stable: tests of a file stay in order


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_steps():
    """Engines share compiled steps through one jit; a long session of distinct options would
    keep every executable alive. Drop them between test modules."""
    yield
    import jax
    jax.clear_caches()
