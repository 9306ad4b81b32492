"""Issue 21: sweep-bench and bench print what ik_llama.cpp's tools print for the same command line."""
from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from ikjax.cli import app
from ikjax.tools import llama_bench as lb
from ikjax.tools import sweep_bench as sb


def _run(args, code=0):
    res = CliRunner().invoke(app, [str(a) for a in args])
    assert res.exit_code == code, res.stderr + res.stdout
    return res


def _rows(stdout):
    return [l for l in stdout.splitlines() if re.match(r"\|\s+\d", l)]


def test_ub_above_b_rows_are_ub_tokens(tiny_model):
    """ik: -c 256 -ub 128 -b 64 gives 2 rows of PP 128 (each row two 64-token decode calls), the
    banner says n_ubatch = 128; ikjax used to clamp ub to b and print 4 rows of PP 64."""
    res = _run(["sweep-bench", "-m", tiny_model, "-c", 256, "-ub", 128, "-b", 64, "-n", 2])
    assert "n_batch = 64, n_ubatch = 128" in res.stdout
    rows = _rows(res.stdout)
    assert [tuple(int(c) for c in r.split("|")[1:4]) for r in rows] == [(128, 2, 0), (128, 2, 128)]


def test_pp_row_runs_in_min_ub_b_steps(tiny_model):
    import ikjax
    eng = ikjax.load(tiny_model, ctx=256, ubatch=128, batch=48)
    assert eng.options.ubatch == 48
    assert [n for _, n, _ in sb._row_steps(eng, 0, 128, 0)] == [48, 48, 32]


def test_ub_below_4_gives_tg_0_rows(tiny_model):
    """-ub 1: TG = ub/4 = 0 as ik; used to crash in dynamic_update_slice (a 1-token PP step was
    compiled as a 0-step decode loop)."""
    # (-fa 0: ik pads n_ctx 8 to 32 without flash attention, so the sweep's rows are 0, 4, .. 28)
    res = _run(["sweep-bench", "-m", tiny_model, "-c", 8, "-fa", 0, "-ub", 1, "--sweep-stride", 4])
    rows = _rows(res.stdout)
    assert [tuple(int(c) for c in r.split("|")[1:4]) for r in rows] == [(1, 0, n) for n in range(0, 32, 4)]


def test_sweep_stride_and_memory_columns(tiny_model):
    res = _run(["sweep-bench", "-m", tiny_model, "-c", 256, "-ub", 64, "-n", 1, "--sweep-stride", 3,
                "--sweep-memory"])
    lines = res.stdout.splitlines()
    assert sb.HEADER_MEMORY in lines and sb.SEPARATOR_MEMORY in lines
    assert sb.HEADER_MEMORY.endswith("|    RSS HWM | VRAM delta |")
    rows = _rows(res.stdout)
    assert [int(r.split("|")[3]) for r in rows] == [0, 192]
    for r in rows:
        rss, vram = (c.strip() for c in r.split("|")[8:10])
        assert float(rss) > 0 and vram == "n/a"  # no accelerator here
    res = _run(["sweep-bench", "-m", tiny_model, "-c", 128, "-ub", 64, "-n", 1, "--sweep-memory", "-of", "jsonl"])
    recs = [json.loads(l) for l in res.stdout.splitlines() if l.strip()]
    assert list(recs[0])[-2:] == ["rss_hwm_mib", "vram_delta_mib"]
    assert recs[0]["rss_hwm_mib"] > 0 and recs[0]["vram_delta_mib"] is None


def test_plot_target_checked_before_the_run(tiny_model, tmp_path):
    res = _run(["sweep-bench", "-m", tiny_model, "-c", 128, "-ub", 64, "--plot", tmp_path / "no" / "x.png"], 1)
    assert "--plot" in res.stderr and "does not exist" in res.stderr and "compiled" not in res.stderr
    res = _run(["sweep-bench", "-m", tiny_model, "-c", 128, "-ub", 64, "--plot", tmp_path / "x.qqq"], 1)
    assert "cannot write .qqq" in res.stderr


@pytest.mark.parametrize("args,flag", [(["-p", "-5"], "-p"), (["-n", "3,-1"], "-n"), (["-ub", "0"], "-ub"),
                                       (["-pg", "-1,4"], "-pg"), (["-tgb", "2"], "-tgb"), (["-w", "2"], "-w")])
def test_bench_refuses_negative_lists(args, flag):
    res = _run(["bench", *args], 1)
    assert res.stderr.startswith(f"error: {flag}"), res.stderr


def test_bench_md_is_iks(tiny_model):
    res = _run(["bench", "-m", tiny_model, "-p", 8, "-n", 0, "-r", 1, "-ub", 8, "-mla", "2,3"])
    lines = res.stdout.splitlines()
    header = [c.strip() for c in lines[0].strip("| ").split("|")]
    assert header == ["model", "size", "params", "backend", "threads", "n_ubatch", "mla", "test", "t/s"]
    row = [c.strip() for c in lines[2].strip("| ").split("|")]
    assert row[0] == "deepseek2 ?B Q8_0" and row[3] == "CPU"
    assert re.fullmatch(r"\d+\.\d\d MiB", row[1]) and re.fullmatch(r"\d+\.\d\d M", row[2])
    assert re.fullmatch(r"build: \w+ \(\d+\)", lines[-1]) and lines[-2] == ""
    assert lines[1].startswith("| " + "-" * 30 + " | ---------: |")


def test_bench_json_keys_are_iks_in_order(tiny_model):
    res = _run(["bench", "-m", tiny_model, "-p", 8, "-n", 0, "-r", 1, "-o", "json"])
    rec = json.loads(res.stdout)[0]
    ik = ["build_commit", "build_number", "cuda", "vulkan", "metal", "sycl", "rpc", "gpu_blas", "blas", "cpu_info",
          "gpu_info", "model_filename", "model_type", "model_size", "model_n_params", "n_batch", "n_ubatch",
          "n_threads", "type_k", "type_v", "n_gpu_layers", "split_mode", "main_gpu", "no_kv_offload", "flash_attn",
          "mla_attn", "attn_max_batch", "ser", "reuse", "tensor_split", "use_mmap", "embeddings", "repack", "mqkv",
          "muge", "defer_experts", "fused_moe", "grouped_er", "no_fused_up_gate", "use_thp", "no_ooae", "rcache",
          "sas", "max_gpu", "cuda_params", "override_tensor", "n_prompt", "n_gen", "test_time", "avg_ns",
          "stddev_ns", "avg_ts", "stddev_ts", "test", "samples_ns", "samples_ts"]
    assert list(rec)[:len(ik)] == ik
    assert rec["cuda"] is False and rec["rpc"] == "0" and rec["tensor_split"] == "0.00" and rec["ser"] == "-1,0"


def test_model_desc_and_sizes():
    class F:
        architecture = "deepseek2"
        metadata = {"deepseek2.block_count": 27, "general.file_type": 2, "general.size_label": "64x1.6B"}
        tensors = {}
    assert lb.model_desc(F) == "deepseek2 16B Q4_0"
    assert lb.format_size(15414272) == "14.70 MiB" and lb.format_size(9 * 2**30) == "9.00 GiB"
    assert lb.format_params(14465792) == "14.47 M" and lb.format_params(15_700_000_000) == "15.70 B"


def _bench_rows(res):
    """(threads, mla, test) of each md row; the columns found by the header's names."""
    lines = [l for l in res.stdout.splitlines() if l.startswith("|")]
    head = [c.strip() for c in lines[0].split("|")]
    col = {name: i for i, name in enumerate(head)}
    return [{k: r.split("|")[i].strip() for k, i in col.items() if k} for r in lines[2:]]


def test_bench_repeated_flags_add_up_in_llama_bench_order(tiny_model):
    """llama-bench reads a parameter given several times as a list: `-p 16 -p 32 -t 1 -t 2 -mla 2
    -mla 3` is 8 rows (the last value alone won before: one row, the mla column gone), nested in
    its loop order (mla outside threads, threads outside the tests; n_batch outside n_ubatch outside
    fa outside mla)."""
    res = _run(["bench", "-m", tiny_model, "-p", 16, "-p", 32, "-n", 0, "-r", 1, "-t", 1, "-t", 2, "-mla", 2,
                "-mla", 3])
    rows = _bench_rows(res)
    assert [(r["mla"], r["threads"], r["test"]) for r in rows] == [
        (m, t, p) for m in ("2", "3") for t in ("1", "2") for p in ("pp16", "pp32")]
    assert lb.combinations(dict(mla="2,3", fa="1,0", batch="16,32", ubatch="8,16"))[:4] == [
        dict(batch="16", ubatch="8", fa="1", mla="2"), dict(batch="16", ubatch="8", fa="1", mla="3"),
        dict(batch="16", ubatch="8", fa="0", mla="2"), dict(batch="16", ubatch="8", fa="0", mla="3")]


def test_bench_tgb_pairs_join_the_thread_list_and_ser_pairs_by_commas(tiny_model):
    """-tgb T,TB is one more entry of the -t list (several by ';'), as llama-bench: `-t 1 -tgb 1,2`
    runs the tests at 1 thread and at 1 / 2 (its prompts at 2). -ser 2,1,3,0.5 is two settings as
    llama-bench writes them (it was one malformed value). -oe prints the results again on stderr."""
    res = _run(["bench", "-m", tiny_model, "-p", 8, "-n", 2, "-r", 1, "-t", 1, "-tgb", "1,2"])
    assert [(r["threads"], r["test"]) for r in _bench_rows(res)] == [("1", "pp8"), ("1", "tg2"), ("2", "pp8"),
                                                                     ("1", "tg2")]
    assert lb.split_list("2,1,3,0.5", "ser") == ["2,1", "3,0.5"] and lb.split_list("2,1;3,0.5", "ser") == ["2,1", "3,0.5"]
    res = _run(["bench", "-m", tiny_model, "-p", 8, "-n", 0, "-r", 1, "-o", "csv", "-oe", "md"])
    assert res.stdout.startswith("build_commit,build_number,") and '"build_commit"' not in res.stdout
    assert any(l.startswith("| model") for l in res.stderr.splitlines())


def test_bench_sm_list_sweeps_split_modes(tiny_model):
    """llama-bench's `-sm` is a list too (swept outside the batch sizes): one row a mode, an `sm`
    column; a bad value is one line naming -sm. (On one device the modes run alike: a note says so.)"""
    res = _run(["bench", "-m", tiny_model, "-p", 8, "-n", 0, "-r", 1, "-sm", "none,layer", "-sm", "graph"])
    assert [r["sm"] for r in _bench_rows(res)] == ["none", "layer", "graph"]
    res = _run(["bench", "-m", tiny_model, "-p", 8, "-n", 0, "-r", 1, "-sm", "none,row"], 1)
    assert res.stderr.startswith("error: -sm") and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_bench_ubatch_column_is_as_typed_and_mla_use_taken(tiny_model):
    """llama-bench prints -ub as given (`n_ubatch = inst.n_ubatch`; the context clamps it to -b):
    `-ub 16,32 -b 16` is two rows told apart (both said 16); `--mla-use`, llama-bench's long name
    for -mla, is taken (it was an unknown option)."""
    res = _run(["bench", "-m", tiny_model, "-p", 16, "-n", 0, "-r", 1, "-ub", "16,32", "-b", 16, "-o", "jsonl"])
    recs = [json.loads(l) for l in res.stdout.splitlines() if l.strip()]
    assert [(r["n_batch"], r["n_ubatch"]) for r in recs] == [(16, 16), (16, 32)], recs
    md = _run(["bench", "-m", tiny_model, "-p", 16, "-n", 0, "-r", 1, "-ub", "16,32", "-b", 16])
    ub_col = [[c.strip() for c in l.strip("| ").split("|")] for l in md.stdout.splitlines()[2:] if l.startswith("|")]
    head = [c.strip() for c in md.stdout.splitlines()[0].strip("| ").split("|")]
    assert [r[head.index("n_ubatch")] for r in ub_col] == ["16", "32"]
    res = _run(["bench", "-m", tiny_model, "-p", 8, "-n", 0, "-r", 1, "--mla-use", 3, "-o", "jsonl"])
    assert json.loads(res.stdout.splitlines()[0])["mla_attn"] == 3


def test_sweep_bench_n_below_zero_is_iks_default(tiny_model):
    """ik's sweep-bench: `n_predict > 0 ? n_predict : ub/4` (-n -2 was refused here)."""
    a = _run(["sweep-bench", "-m", tiny_model, "-c", 128, "-ub", 32, "-n", -2, "-of", "jsonl"]).stdout
    b = _run(["sweep-bench", "-m", tiny_model, "-c", 128, "-ub", 32, "-of", "jsonl"]).stdout
    tg = lambda out: [json.loads(l)["tg"] for l in out.splitlines() if l.startswith("{")]  # noqa: E731
    assert tg(a) == tg(b) == [8] * len(tg(b)) and tg(b)
