"""Every ik_llama.cpp flag of SPEC §3, on sweep-bench, bench and generate and as a JSON config key, is
read by its own name: honoured (the run option it sets), accepted with a one-line note naming it, or
refused naming it — never taken for another flag (`-mg` as `-m g`, `-ctv` as `-c tv`, ...).

Most checks go through the real parser (the command's click context: exact matching, bare switches)
and the same option checks the commands run before loading, so they need no model and run in
seconds; a few end-to-end runs on the tiny model check the output streams and the timings.
"""
from __future__ import annotations

import inspect
import json
import os
import re

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from ikjax.cli import CONFIG_COMMANDS, app
from ikjax.cli.bench import _check_bench_options, _note_combinations
from ikjax.cli.generate import _generate_shapes, _precompile_shape
from ikjax.cli.run_options import check_options
from ikjax.errors import OptionError
from ikjax.options import RunOptions, TensorOverride
from ikjax.cli.run_config import parse_config

GROUP = get_command(app)
COMMANDS = ("sweep-bench", "bench", "generate")


def parse(command: str, *args) -> dict:
    """The command's parameters after the real parser (no model is loaded)."""
    cmd = GROUP.get_command(None, command)
    return cmd.make_context(command, [str(a) for a in args]).params


def parse_error(command: str, *args) -> str:
    with pytest.raises(Exception) as e:
        parse(command, *args)
    assert hasattr(e.value, "format_message"), e.value
    return e.value.format_message()


def check(command: str, params: dict) -> RunOptions:
    """The checks a command runs before loading: run options (-> RunOptions) and ik switches (notes)."""
    if command == "bench":
        from ikjax.tools import llama_bench as lb
        fixed, fmoe = _check_bench_options(params)
        swept = {k: params[k] for k in lb.SWEPT if params.get(k) is not None}
        swept["fmoe"] = fmoe
        _note_combinations(swept)
        combo = lb.combinations(swept)[0]
        return RunOptions.from_kwargs(**{**fixed, **{lb.SWEPT[k]: v for k, v in combo.items()}})  # as run_bench
    return check_options(params, command)[1]


def outcome(command: str, params: dict, capsys) -> tuple[RunOptions | None, list[str], str | None]:
    """(options, notes printed, refusal message)."""
    capsys.readouterr()
    try:
        opts = check(command, params)
        err = None
    except OptionError as e:
        opts, err = None, str(e)
    notes = [l for l in capsys.readouterr().err.splitlines() if l.startswith("note: ")]
    return opts, notes, err


def with_defaults(func, kwargs: dict) -> dict:
    sig = inspect.signature(func)
    return {**{n: p.default for n, p in sig.parameters.items()}, **kwargs}


# (args, expectation): ("opt", field, value) honoured; ("note", text) noted; ("refuse", text) refused.
# Each note / refusal must name the flag itself.
CASES = [
    (["-mg", 0], ("note", "-mg 0 has no effect with one device")),
    (["-mg", 1], ("refuse", "-mg 1")),
    (["--main-gpu", 0], ("note", "-mg 0")),
    (["-ctv", "q8_0"], ("note", "-ctv q8_0 has no effect with -mla 3")),
    (["-ctv", "q8_0", "-mla", 0], ("refuse", "ctv: with -mla 0")),
    (["-ctv", "f16", "-mla", 0], ("opt", "ctv", "f16")),
    (["--cache-type-v", "bf16", "-ctk", "bf16", "-mla", 0], ("opt", "v_cache_type", "bf16")),
    (["-tb", 2], ("opt", "threads_batch", 2)),
    (["--threads-batch", 3, "-t", 1], ("opt", "prompt_threads", 3)),
    (["-t", 3], ("opt", "threads", 3)),
    (["-sm", "layer"], ("note", "-sm layer has no effect with one device")),
    (["-sm", "graph"], ("note", "-sm graph has no effect with one device")),
    (["-sm", "none"], ("note", "-sm none has no effect with one device")),
    (["-sm", "row"], ("refuse", "-sm: expected none, layer or graph")),
    (["-ts", "3,1"], ("note", "-ts 3,1 has no effect with one device")),
    (["-ts", "x"], ("refuse", "-ts")),
    (["-rtr"], ("note", "-rtr has no effect")),
    (["-rtr", 0], ("none",)),
    (["-thp"], ("note", "-thp has no effect")),
    (["--no-mmap"], ("note", "--no-mmap has no effect")),
    (["--numa", "distribute"], ("note", "--numa distribute has no effect")),
    (["--numa", "everywhere"], ("refuse", "--numa")),
    (["-nkvo"], ("note", "-nkvo has no effect on CPU")),
    (["-ooae"], ("note", "-ooae has no effect")),
    (["-no-ooae"], ("note", "-no-ooae has no effect")),
    (["-op", "moe,0"], ("note", "-op moe,0 has no effect")),
    (["-cuda", "fusion=1"], ("note", "-cuda fusion=1 has no effect")),
    (["-muge"], ("note", "-muge has no effect")),
    (["-mqkv"], ("note", "-mqkv has no effect")),
    (["-ger"], ("note", "-ger has no effect")),
    (["-wb"], ("note", "-wb has no effect")),
    # ik's newer switches (an outside probe found each an unknown option)
    (["-khad"], ("note", "-khad has no effect")), (["-no-fug"], ("note", "-no-fug has no effect")),
    (["-no-mmad"], ("note", "-no-mmad has no effect")), (["-rcache"], ("note", "-rcache has no effect")),
    (["-smgs"], ("note", "-smgs has no effect")), (["-sas"], ("note", "-sas has no effect")),
    (["-grt", "f16"], ("note", "-grt f16 has no effect")), (["-cram", 0], ("note", "-cram 0 has no effect")),
    (["-dt", 0.1], ("note", "-dt 0.1 has no effect")), (["--minilog"], ("note", "--minilog has no effect")),
    (["-rtr", "2"], ("refuse", "-rtr: expected 0/1/on/off/auto, got 2")),
    (["-fa", 2], ("refuse", "-fa: expected 0/1/on/off/auto, got 2")),
    (["-fa"], ("opt", "fa", True)),
    (["-fa", 0], ("opt", "fa", False)),
    (["-fa", "auto"], ("opt", "fa", True)),
    (["-fa", "off"], ("opt", "fa", False)),
    ([], ("opt", "fmoe", True)),  # ik's default
    (["-fmoe", 0], ("opt", "fmoe", False)),
    (["-no-fmoe"], ("opt", "fmoe", False)),
    (["-mla", 2], ("opt", "mla", 2)),
    (["-amb", 64], ("opt", "amb", 64)),
    (["-ctk", "q8_0"], ("opt", "ctk", "q8_0")),
    (["-ser", "2,0.5"], ("opt", "ser", ("min_experts", 2))),
    (["-c", 512], ("opt", "ctx", 512)),  # bench: noted (below)
    (["-b", 256, "-ub", 64], ("opt", "ubatch", 64)),
    (["-ngl", 0], ("opt", "ngl", 0)),
    (["-ot", "exps=CPU"], ("opt", "ot", (TensorOverride("exps", "CPU"),))),
    (["-cmoe"], ("opt", "ot", (TensorOverride("ffn_(up|down|gate)_exps", "CPU"),))),
    (["--cpu-moe"], ("opt", "cpu_moe", True)),
    (["-ncmoe", 2], ("opt", "ot", (TensorOverride(r"blk\.(0|1)\.ffn_(up|down|gate)_exps", "CPU"),))),
    (["--n-cpu-moe", 1, "-ot", "output=CPU"],
     ("opt", "ot", (TensorOverride("output", "CPU"), TensorOverride(r"blk\.(0)\.ffn_(up|down|gate)_exps", "CPU")))),
    (["-cmoe", "-ncmoe", 2], ("refuse", "cpu-moe")),
]


def _case_id(case):
    return " ".join(map(str, case[0])) or "defaults"


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_flag_on_command(command, case, capsys):
    args, expect = case
    try:
        params = parse(command, *args)
    except Exception as e:  # refused by the parser itself (a bad bare-switch value)
        assert expect[0] == "refuse", (args, e)
        assert expect[1] in e.format_message()
        return
    if command == "bench":
        # bench sweeps comma lists as text; only the parser's reading matters before the checks
        params = {k: (str(v) if isinstance(v, int) and k in ("mla", "amb", "ngl", "threads", "batch", "ubatch")
                      else v) for k, v in params.items()}
    assert not params.get("model"), f"{args} was read as -m: {params['model']!r}"
    if command == "bench" and args[:1] == ["-c"]:  # llama-bench sizes the context per test
        expect = ("note", "-c 512 has no effect in bench")
    opts, notes, err = outcome(command, params, capsys)
    kind = expect[0]
    if kind == "refuse":
        assert err is not None and expect[1] in err, (args, err, notes)
        return
    assert err is None, (args, err)
    if kind == "note":
        assert any(expect[1] in n for n in notes), (args, notes)
        assert all(len(n.splitlines()) == 1 for n in notes)
    elif kind == "none":
        assert notes == [], (args, notes)
    else:
        field, value = expect[1], expect[2]
        got = getattr(opts, field)
        if isinstance(value, tuple) and value and isinstance(value[0], str) and field == "ser":
            got, value = getattr(got, value[0]), value[1]
        assert got == value, (args, field, got)
        assert notes == [], (args, notes)


@pytest.mark.parametrize("command", COMMANDS)
def test_nrep(command, capsys):
    params = parse(command, "-nrep", 3)
    assert params["nrep"] == "3" and params.get("n_gen", params.get("n_predict")) != 3
    _, notes, err = outcome(command, params, capsys)
    assert err is None
    if command == "sweep-bench":
        assert notes == []  # honoured: the first row is repeated (test_sweep_nrep_and_streams)
    else:
        assert any(n.startswith("note: -nrep has no effect in " + command) for n in notes), notes
    _, _, err = outcome(command, parse(command, "-nrep", 0), capsys)
    assert err and "-nrep" in err


@pytest.mark.parametrize("command", COMMANDS + ("info",))
@pytest.mark.parametrize("token", ["-mgx", "-ctvv", "-t4", "-c4096", "-tbb", "-xyz", "-smm", "-mlaa", "-rtrr"])
def test_unknown_or_clustered_tokens_are_refused_by_name(command, token):
    msg = parse_error(command, token, "1")
    assert msg.startswith(f"unknown option {token}"), msg


INFO_TOKENS = {"-mg": "main_gpu", "-tb": "threads_batch", "-sm": "split_mode", "-rtr": "rtr", "-nkvo": "nkvo",
               "-nrep": "nrep", "-ooae": "ooae", "-op": "op", "-thp": "thp", "-gr": "gr", "--fit": "fit",
               "--no-warmup": "no_warmup", "-no-fa": "no_fa"}


@pytest.mark.parametrize("token", sorted(INFO_TOKENS))
def test_info_takes_every_run_option_as_itself(token):
    """info takes every run option sweep-bench takes (a pasted ik command line is accepted), and an
    ik switch is read as itself, never as -m / -c / -t / -b / -o."""
    params = parse("info", token, "1")
    assert str(params[INFO_TOKENS[token]]) == "1"
    assert params["model"] is None and params["ctx"] == RunOptions().ctx
    sweep = {p.name for p in GROUP.get_command(None, "sweep-bench").params}
    info = {p.name for p in GROUP.get_command(None, "info").params}
    assert sweep - info <= {"n_gen", "output_format", "sweep_stride", "sweep_memory", "plot", "seed"}


def test_bench_switches_are_not_threads_or_models(capsys):
    """The issue's case: in bench, -thp and -mqkv became a thread count and a model file."""
    params = parse("bench", "-thp", "1", "-mqkv", "1", "-p", 16)
    assert not params["model"] and params["threads"] is None  # (None: the default thread count)
    _, notes, err = outcome("bench", params, capsys)
    assert err is None and any("-thp" in n for n in notes) and any("-mqkv" in n for n in notes)


# -- JSON configs: the same keys, the same outcomes --------------------------------------------------

CONFIG_CASES = [
    ({"mg": 0}, ("note", "-mg 0")), ({"main_gpu": 1}, ("refuse", "-mg 1")),
    ({"ctv": "q8_0"}, ("note", "-ctv q8_0")), ({"cache-type-v": "q8_0", "mla": 0}, ("refuse", "ctv")),
    ({"tb": 2}, ("opt", "threads_batch", 2)), ({"threads_batch": 2}, ("opt", "threads_batch", 2)),
    ({"sm": "layer"}, ("note", "-sm layer")), ({"split_mode": "row"}, ("refuse", "-sm")),
    ({"ts": [3, 1]}, ("note", "-ts 3,1")), ({"rtr": True}, ("note", "-rtr")), ({"rtr": False}, ("none",)),
    ({"thp": 1}, ("note", "-thp")), ({"no_mmap": True}, ("note", "--no-mmap")),
    ({"numa": "isolate"}, ("note", "--numa isolate")), ({"nkvo": True}, ("note", "-nkvo")),
    ({"ooae": True}, ("note", "-ooae")), ({"no-ooae": True}, ("note", "-no-ooae")), ({"op": "x"}, ("note", "-op")),
    ({"cuda": "x=1"}, ("note", "-cuda")), ({"muge": True}, ("note", "-muge")), ({"mqkv": True}, ("note", "-mqkv")),
    ({"ger": True}, ("note", "-ger")), ({"wb": True}, ("note", "-wb")),
    ({"cmoe": True}, ("opt", "cpu_moe", True)), ({"cpu_moe": True}, ("opt", "cpu_moe", True)),
    ({"ncmoe": 2}, ("opt", "n_cpu_moe", 2)), ({"n-cpu-moe": 2}, ("opt", "n_cpu_moe", 2)),
    ({"fa": 2}, ("refuse", "fa")), ({"fa": "auto"}, ("opt", "fa", True)),
    ({"fmoe": False}, ("opt", "fmoe", False)), ({"no_fmoe": True}, ("opt", "fmoe", False)), ({}, ("opt", "fmoe", True)),
]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", CONFIG_CASES, ids=lambda c: json.dumps(c[0]))
def test_config_key(command, case, tmp_path, capsys):
    keys, expect = case
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"command": command, **keys}))
    name, func, kwargs = parse_config(cfg, CONFIG_COMMANDS)
    opts, notes, err = outcome(command, with_defaults(func, kwargs), capsys)
    if expect[0] == "refuse":
        assert err is not None and expect[1] in err, (keys, err)
        return
    assert err is None, (keys, err)
    if expect[0] == "note":
        assert any(expect[1] in n for n in notes), (keys, notes)
    elif expect[0] == "none":
        assert notes == []
    else:
        assert getattr(opts, expect[1]) == expect[2], (keys, getattr(opts, expect[1]))


def test_help_has_no_false_claims():
    for command in COMMANDS:
        text = CliRunner().invoke(app, [command, "--help"], terminal_width=200).stdout
        assert "shards evenly" not in text and "splits evenly" not in text
        for flag in ("-ctv", "-tb", "-sm", "-mg", "-ts", "-rtr", "-thp", "--no-mmap", "--numa", "-nkvo", "-ooae",
                     "-no-ooae", "-op", "-cuda", "-muge", "-ger", "-wb", "-nrep", "--cpu-moe", "--n-cpu-moe"):
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), (command, flag)
    from pathlib import Path
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "splits evenly" not in readme and "shards evenly" not in readme


# -- end to end on the tiny model --------------------------------------------------------------------

def invoke(args, code=0):
    res = CliRunner().invoke(app, [str(a) for a in args])
    if res.exc_info and os.environ.get("IKJAX_DEBUG"):
        import traceback
        traceback.print_exception(*res.exc_info)
    assert res.exit_code == code, f"exit {res.exit_code}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    return res


def test_sweep_nrep_and_streams(tiny_model):
    """stdout holds ik's table and nothing else; notes, compile progress and timings go to stderr."""
    res = invoke(["sweep-bench", "-m", tiny_model, "-c", 128, "-ub", 64, "-n", 2, "-nrep", 2, "-mg", 0, "-sm",
                  "layer", "-rtr", "-thp", "-tb", 1, "-t", 2, "-ctv", "q8_0"])
    out = res.stdout.splitlines()
    assert all(l == "" or l.startswith("|") or l.startswith("main: n_kv_max") for l in out), out
    assert "n_threads = 2, n_threads_batch = 1" in res.stdout
    rows = [l for l in out if re.match(r"\|\s+64 \|", l)]
    assert len(rows) == 4  # -c 128 with -fa: ik's n_ctx 256, rows at 0, 64, 128, 192
    for flag in ("-mg 0", "-sm layer", "-rtr", "-thp", "-ctv q8_0"):
        assert any(l.startswith(f"note: {flag}") for l in res.stderr.splitlines()), flag
    assert re.search(r"preparing step 1/\d+ of the first row \(\d+ tokens, KV bucket \d+\)", res.stderr), res.stderr


def test_bench_jsonl_keys_and_types(tiny_model):
    res = invoke(["bench", "-m", tiny_model, "-p", 16, "-n", 2, "-pg", "8,2", "-r", 1, "-o", "jsonl", "-thp", "1",
                  "-mqkv", "1"])
    recs = [json.loads(l) for l in res.stdout.splitlines()]
    assert [r["test"] for r in recs] == ["pp16", "tg2", "pp8+tg2"]
    types = {"model_filename": str, "model_type": str, "model_size": int, "model_n_params": int, "n_batch": int,
             "n_ubatch": int, "n_threads": int, "type_k": str, "type_v": str, "n_gpu_layers": int,
             "flash_attn": bool, "mla_attn": int, "attn_max_batch": int, "fused_moe": bool, "ser": str,
             "n_prompt": int, "n_gen": int, "n_depth": int, "test_time": str, "avg_ns": int, "stddev_ns": int,
             "avg_ts": float, "stddev_ts": float, "samples_ns": list, "samples_ts": list, "test": str,
             "build_commit": str, "build_number": int}
    for r in recs:
        for k, t in types.items():
            assert isinstance(r[k], t) and not (t is int and isinstance(r[k], bool)), (k, r[k])
        assert r["flash_attn"] is True and r["fused_moe"] is True and r["mla_attn"] == 3 and r["type_k"] == "f16"
    assert recs[2]["n_prompt"] == 8 and recs[2]["n_gen"] == 2
    assert any("-thp" in l for l in res.stderr.splitlines()) and any("-mqkv" in l for l in res.stderr.splitlines())
    res = invoke(["bench", "-m", tiny_model, "-p", 16, "-n", 0, "-r", 1, "-o", "json"])
    arr = json.loads(res.stdout)
    assert isinstance(arr, list) and len(arr) == 1 and arr[0]["test"] == "pp16" and isinstance(arr[0]["avg_ts"], float)


def test_generate_compiles_before_timing(tiny_model):
    """The steps generate needs are compiled before the timer starts: generation compiles nothing."""
    import ikjax
    from ikjax.tokenizer import GGUFTokenizer
    eng = ikjax.load(tiny_model, ctx=256, ubatch=32)
    ids = GGUFTokenizer(eng.file.metadata).encode("Hello world, a prompt of a few tokens " * 3)
    for n_tok, kv, chunk in _generate_shapes(eng, len(ids), 40):
        _precompile_shape(eng, n_tok, kv, chunk, dict(temperature=0.0))
    before = eng.compile_count
    out = list(eng.generate(ids, 40, temperature=0.0))
    assert len(out) >= 1 and eng.compile_count == before
    res = invoke(["generate", "-m", tiny_model, "-p", "Hello", "-n", 4, "--temp", 0, "-c", 128, "-ub", 32, "-tb", 1,
                  "-ncmoe", 1])
    err = res.stderr
    assert err.index("compiled ") < err.index("prompt: ") and "compilation not included" in err


def test_one_device_split_note_printed_once(tiny_model):
    """`-sm layer` on one device: the command line's note, not again the placement's (the same
    fact came out twice)."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "ikjax.cli", "generate", "-m", tiny_model, "-p", "hi", "-n", "1", "-c", "64",
                        "-sm", "layer"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-1500:]
    said = [l for l in r.stderr.splitlines() if "-sm layer has no effect with one device" in l]
    assert len(said) == 1 and said[0].startswith("note: "), r.stderr
