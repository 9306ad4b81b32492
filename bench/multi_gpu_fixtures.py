"""The real-converter fixtures on a multi-device mesh at f32 (issue 13, item 3).

    IKJAX_DTYPE=f32 python3 bench/multi_gpu_fixtures.py [--fixtures DIR] [--budget 110]

For each fixture (default: a subset, see DEFAULT_CASES) and MLA mode, the logits of a `-sm layer`
and a `-sm graph` run over 2 and over 4 devices (every mesh size up to the devices present) are
compared with the same model on one device and with the fixture's reference (the transformers
logits, `ref_kbvb` for -mla 1 where the file has it, as tests/test_fixtures.py reads them).

One device is run twice: with the default kernels (Pallas on a GPU, C++ on a CPU) and with the
XLA path (`IKJAX_KERNELS=xla`). Their gap is how far these f32 logits move when only the order of
the sums changes; a split is held to max(1e-5, 2 x that gap) against the nearer of the two (a
split that runs the same kernels stage by stage, `-sm layer`, should match the kernel run bit for
bit; `-sm graph` splits contractions into partial sums joined by all-reduce), and to the fixture's
own tolerance against the reference. Same rule as tests/test_multi_device.py.

Devices: whatever JAX sees — the GPUs, or fake CPU devices with
XLA_FLAGS=--xla_force_host_platform_device_count=4 (the same checks, only slower). A mesh of m
devices out of n is taken with -ts (1,1 = the first two; llama.cpp pads the shares with zeros).

Fixtures: --fixtures, else $IKJAX_FIXTURES, else .gpufix in the repo (what is carried to the
device), else ../shared/fixtures beside the repo; manifest entries whose file is absent are named
and skipped. Compile time dominates (a load and a compile per case): --budget stops starting new
cases after that many seconds and lists what was left.

Prints one line per case and a last line `summary: ...`; exit status 0 only if every case ran and passed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if os.environ.get("IKJAX_DTYPE", "f32") != "f32":
    print(f"note: IKJAX_DTYPE={os.environ['IKJAX_DTYPE']} replaced by f32 (these checks compare at f32)", flush=True)
os.environ["IKJAX_DTYPE"] = "f32"

import numpy as np  # noqa: E402

TOL = 1e-5
# (file, MLA modes): the MoE fixture with every MLA tensor form in every mode; the attn_kv_b-only
# fixture (k_b/v_b derived at load) in the standard and the flash absorbed mode. These are the two
# fixtures carried to the device in .gpufix; with ../shared/fixtures, --all runs every entry.
DEFAULT_CASES = {"v3tiny-all-Q4_K_M.gguf": (0, 1, 2, 3), "v2lite_tiny-kvb-Q5_1.gguf": (0, 3)}


def rel(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if got.shape != ref.shape:
        raise ValueError(f"shape {got.shape} vs {ref.shape}")
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def fixtures_dir(arg: str | None) -> Path | None:
    cands = [Path(arg)] if arg else []
    if os.environ.get("IKJAX_FIXTURES"):
        cands.append(Path(os.environ["IKJAX_FIXTURES"]))
    cands += [ROOT / ".gpufix", ROOT.parent / "shared" / "fixtures"]
    return next((d for d in cands if (d / "MANIFEST.json").exists()), None)


def load(path: Path, kernels: str | None, **opts):
    """ikjax.load with IKJAX_KERNELS set for this engine only (the backend is resolved at load)."""
    import ikjax
    old = os.environ.pop("IKJAX_KERNELS", None)
    if kernels:
        os.environ["IKJAX_KERNELS"] = kernels
    try:
        return ikjax.load(path, ctk="f32", dtype="f32", **opts)
    finally:
        os.environ.pop("IKJAX_KERNELS", None)
        if old is not None:
            os.environ["IKJAX_KERNELS"] = old


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fixtures", help="folder with MANIFEST.json")
    ap.add_argument("--all", action="store_true", help="every manifest entry present, every MLA mode")
    ap.add_argument("--files", help="comma list of fixture files (every MLA mode) instead of the default subset")
    ap.add_argument("--modes", default="0,1,2,3", help="MLA modes to run (intersected with each file's)")
    ap.add_argument("--meshes", default="2,4", help="mesh sizes (those above the device count are dropped)")
    ap.add_argument("--splits", default="layer,graph",
                    help="comma list of layer, graph, layer-ot, graph-ot (-ot: with -ot exps=CPU, routed experts in "
                         "host memory; next to GPUs that needs the CUDA host-experts handler built)")
    ap.add_argument("--ts4", default="", help="-ts for the 4-device -sm layer case (default: equal shares)")
    ap.add_argument("--budget", type=float, default=110.0, help="seconds after which no new case starts")
    args = ap.parse_args()
    t_start = time.perf_counter()

    import jax
    import ikjax  # noqa: F401  (sets XLA flags before the backend starts)
    devs = jax.devices()
    n = len(devs)
    print(f"devices: {n} x {devs[0].device_kind} ({devs[0].platform}), jax {jax.__version__}, IKJAX_DTYPE=f32",
          flush=True)
    meshes = [m for m in (int(x) for x in args.meshes.split(",") if x) if 2 <= m <= n]
    if not meshes:
        print(f"summary: nothing to check: {n} device(s), meshes {args.meshes} need at least 2", flush=True)
        return 1
    folder = fixtures_dir(args.fixtures)
    if folder is None:
        print("summary: no fixtures (no MANIFEST.json in --fixtures, $IKJAX_FIXTURES, .gpufix or ../shared/fixtures)",
              flush=True)
        return 1
    entries = json.loads((folder / "MANIFEST.json").read_text())
    modes = [int(x) for x in args.modes.split(",") if x]
    if args.all:
        want = {e["file"]: tuple(modes) for e in entries}
    elif args.files:
        want = {f: tuple(modes) for f in args.files.split(",") if f}
    else:
        want = {f: tuple(m for m in ms if m in modes) for f, ms in DEFAULT_CASES.items()}
    by_file = {e["file"]: e for e in entries}
    absent = [f for f in want if f not in by_file or not (folder / f).exists()]
    plan = [(by_file[f], ms) for f, ms in want.items() if f not in absent]
    print(f"fixtures: {folder} ({len(plan)} files; absent here: {', '.join(absent) or 'none'})", flush=True)
    splits = [s for s in args.splits.split(",") if s]

    ok = bad = err = noref = 0
    left: list[str] = []
    for entry, ms in plan:
        path = folder / entry["file"]
        tokens = np.load(folder / entry["tokens"])
        for mla in ms:
            if time.perf_counter() - t_start > args.budget:
                left.append(f"{entry['file']} mla={mla}")
                continue
            fa = mla != 0  # tests/test_fixtures.py: standard attention without FA, the MLA modes with it
            ref_file = folder / (entry.get("ref_kbvb") if mla == 1 and entry.get("ref_kbvb") else entry["ref"])
            # .gpufix carries some references only: without it the case is checked against one device alone
            ref = np.load(ref_file) if ref_file.exists() else None
            t0 = time.perf_counter()
            try:
                one = load(path, None, mla=mla, fa=fa).logits(tokens)
                one_xla = load(path, "xla", mla=mla, fa=fa).logits(tokens)
            except Exception as ex:  # report and go on: one broken case must not hide the rest
                err += 1
                print(f"{entry['file']} mla={mla}: one device: {type(ex).__name__}: {str(ex).splitlines()[0][:200]}",
                      flush=True)
                continue
            gap = rel(one, one_xla)
            one_ref = f"{rel(one, ref):.2e}" if ref is not None else f"n/a ({ref_file.name} absent)"
            print(f"{entry['file']} mla={mla} fa={int(fa)} 1 device: vs reference {one_ref} (tol {entry['tol']:g}), "
                  f"kernels vs XLA path {gap:.2e} [{time.perf_counter() - t0:.1f}s]", flush=True)
            tol = max(TOL, 2 * gap)
            for sm in splits:
                for m in meshes:
                    if time.perf_counter() - t_start > args.budget:
                        left.append(f"{entry['file']} mla={mla} -sm {sm} x{m}")
                        continue
                    ts = args.ts4 if (m == n and sm == "layer" and args.ts4) else ("" if m == n else ",".join(["1"] * m))
                    extra = {"ot": "exps=CPU"} if sm.endswith("-ot") else {}
                    t1 = time.perf_counter()
                    try:
                        eng = load(path, None, mla=mla, fa=fa, sm=sm.removesuffix("-ot"), ts=ts, **extra)
                        got = eng.logits(tokens)
                        used = sum(1 for v in eng.memory_plan().per_device.values() if v > 0)
                        del eng
                    except Exception as ex:  # noqa: BLE001
                        err += 1
                        print(f"{entry['file']} mla={mla} -sm {sm} x{m}{' -ts ' + ts if ts else ''}: ERROR "
                              f"{type(ex).__name__}: {str(ex).splitlines()[0][:200]}", flush=True)
                        continue
                    r_k, r_x = rel(got, one), rel(got, one_xla)
                    r_ref = rel(got, ref) if ref is not None else None
                    near = min(r_k, r_x)
                    good = near <= tol and (r_ref is None or r_ref <= entry["tol"])
                    ok, bad, noref = ok + good, bad + (not good), noref + (r_ref is None)
                    print(f"{entry['file']} mla={mla} fa={int(fa)} -sm {sm} x{m}{' -ts ' + ts if ts else ''} "
                          f"({used} devices hold weights): vs 1 device kernels {r_k:.2e}, XLA {r_x:.2e} (tol {tol:.1e}); "
                          f"vs reference {'n/a' if r_ref is None else f'{r_ref:.2e}'} (tol {entry['tol']:g}) {'ok' if good else 'FAIL'} "
                          f"[{time.perf_counter() - t1:.1f}s]", flush=True)
            jax.clear_caches()
    total = time.perf_counter() - t_start
    print(f"summary: {ok} ok, {bad} FAIL, {err} errors on {n} x {devs[0].device_kind} at f32 "
          f"(-sm {'/'.join(splits)} over {'/'.join(map(str, meshes))} devices) in {total:.0f}s"
          + (f"; {noref} of them against one device only (reference file absent)" if noref else "")
          + (f"; not run (budget {args.budget:.0f}s): {', '.join(left)}" if left else "")
          + (f"; absent: {', '.join(absent)}" if absent else ""), flush=True)
    return 0 if (bad == 0 and err == 0 and not left) else 1


if __name__ == "__main__":
    sys.exit(main())
