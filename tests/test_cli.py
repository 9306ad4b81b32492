"""The typer CLI: ik flags verbatim, one-line errors, bench, run --config, info on every fixture, generate."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import fixtures_dir
from ikjax.cli import app
from ikjax.cli.parser import _rewrite
from ikjax.tools import synthetic

REPO = Path(__file__).resolve().parents[1]


def invoke(args, code=0):
    res = CliRunner().invoke(app, [str(a) for a in args])
    assert res.exit_code == code, f"exit {res.exit_code}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    return res


def assert_one_line_error(res, *words):
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.stdout + res.stderr
    for w in words:
        assert w in err[0], err[0]


# -- flags and errors ------------------------------------------------------------------------------

def test_help_speaks_ik():
    res = invoke(["sweep-bench", "--help"])
    for flag in ("-mla", "-fa", "-amb", "-ctk", "-fmoe", "-ser", "-ot", "-ngl", "-ts", "-ub", "-c", "-b", "-n",
                 "-t", "-m", "--output-format", "--plot"):
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", res.stdout), flag
    res = invoke(["bench", "--help"])
    for flag in ("-p", "-n", "-gp", "-d", "-r", "-o", "-mla", "-ub"):
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", res.stdout), flag
    assert "sweep-bench" in invoke(["--help"]).stdout


def test_bare_flag_rewrite():
    assert _rewrite(["-fa", "-ub", "512"]) == ["-fa", "1", "-ub", "512"]
    assert _rewrite(["-mla", "3", "-fa"]) == ["-mla", "3", "-fa", "1"]
    assert _rewrite(["-fa", "0", "-fmoe"]) == ["-fa", "0", "-fmoe", "1"]
    assert _rewrite(["-fa", "0,1"]) == ["-fa", "0,1"]
    assert _rewrite(["-fa", "auto"]) == ["-fa", "1"]
    assert _rewrite(["-fa", "-fmoe"]) == ["-fa", "1", "-fmoe", "1"]
    assert _rewrite(["-fa", "model.gguf"], has_positional=True) == ["-fa", "1", "model.gguf"]


def test_a_missing_value_names_its_option(tiny_model):
    """An option that takes a value, followed by another option: refused naming both, never read as
    `-op '-muge'` plus a stray `1` ("Got unexpected extra argument(s) (1)") nor run with the switch
    eaten as a value. Negative numbers stay values."""
    for args, flag, nxt in ((["-op", "-muge"], "-op", "-muge"), (["--numa", "-fa"], "--numa", "-fa"),
                            (["-t", "-fa"], "-t", "-fa"), (["-cuda", "-rtr"], "-cuda", "-rtr")):
        res = invoke(["sweep-bench", "-m", tiny_model, "-c", 128, "-ub", 64, *args], 1)
        assert_one_line_error(res, f"{flag}: needs a value, got the option {nxt}")
    assert_one_line_error(invoke(["bench", "-m", tiny_model, "-mla", "-fa"], 1), "-mla: needs a value")
    assert _rewrite(["-ngl", "-1", "-fa"], valued={"-ngl"}, options={"-ngl", "-fa"}) == ["-ngl", "-1", "-fa", "1"]


def test_short_flags_reach_the_options(tiny_model):
    res = invoke(["info", tiny_model, "-c", 8192, "-ub", 256, "-b", 1024, "-mla", 2, "-fa", "-ctk", "q8_0",
                  "-amb", 64])
    assert "memory plan (-c 8192 -ub 256 -mla 2 -fa 1 -ctk q8_0 -amb 64)" in res.stdout
    res = invoke(["info", "-m", tiny_model, "--ctx-size", 1024, "--ubatch-size", 128, "--mla", 0, "--flash-attn", 0])
    # -fa 0: ik's common default -amb 256 caps the K*Q buffer
    assert "memory plan (-c 1024 -ub 128 -mla 0 -fa 0 -ctk f16 -amb 256)" in res.stdout


def test_errors_are_one_line_exit_1(tiny_model, tmp_path):
    assert_one_line_error(invoke(["info", tmp_path / "missing.gguf"], 1), "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(100))
    assert_one_line_error(invoke(["sweep-bench", "-m", bad], 1), "not a GGUF")
    assert_one_line_error(invoke(["sweep-bench", "-m", tiny_model, "-mla", 7], 1), "mla")
    assert_one_line_error(invoke(["sweep-bench", "-m", tiny_model, "-ctk", "q4_0"], 1), "ctk")
    assert_one_line_error(invoke(["sweep-bench", "-m", tiny_model, "-c", "abc"], 1), "-c")
    assert_one_line_error(invoke(["sweep-bench", "-m", tiny_model, "--bogus"], 1), "--bogus")
    assert_one_line_error(invoke(["sweep-bench", "-m", tiny_model, "-ot", "exps"], 1), "ot")
    assert_one_line_error(invoke(["sweep-bench", "-m", tiny_model, "-ser", "9,0.5"], 1), "ser")
    # (-c 64 with -fa is ik's n_ctx 256: -ub 128 fits, as in ik's sweep-bench)
    assert_one_line_error(invoke(["sweep-bench", "-m", tiny_model, "-c", 64, "-ub", 512], 1), "ubatch")


# -- info ---------------------------------------------------------------------------------------------

def _expected_layout(name: str) -> str:
    if "-mainline-" in name:
        return "attn_k_b + attn_v_b only"
    if "-kvb-" in name:
        return "attn_kv_b only"
    return "all three"


def test_info_on_every_fixture():
    files = sorted(fixtures_dir().glob("*.gguf"))
    assert len(files) >= 10
    for f in files:
        t0 = time.perf_counter()
        res = invoke(["info", f, "-c", 32768, "-ctk", "q8_0"])
        assert time.perf_counter() - t0 < 5, f"info took too long on {f.name}"
        out = res.stdout
        assert "architecture   deepseek2" in out
        assert "MLA layout     " + _expected_layout(f.name) in out, (f.name, out)
        assert re.search(r"^total\s+\d+\s+", out, re.M)
        assert "KV cache" in out and "weights" in out and "attention buffer" in out
        m = re.search(r"KV cache\s+([\d.]+) MiB \((\d+) B/token\)", out)
        assert m and int(m.group(2)) > 0


def test_cli_refuses_a_bad_kernel_knob(tiny_model, monkeypatch):
    """A C++ kernels' knob they would not use (they would run their default): one line naming it,
    from the commands that load an engine and from `info`, which reports the kernels' settings."""
    monkeypatch.setenv("IKJAX_AMX_MIN_ROWS", "8")
    for cmd in (["info", tiny_model], ["sweep-bench", "-m", tiny_model, "-c", "256", "-ub", "64", "-n", "4"]):
        assert_one_line_error(invoke(cmd, code=1), "IKJAX_AMX_MIN_ROWS must be an integer >= 16 (at most 2147483648), got '8'")


def test_info_memory_plan_matches_engine(tiny_model):
    import ikjax
    res = invoke(["info", tiny_model, "-c", 1024, "-ub", 128, "-ctk", "q8_0", "-mla", 3])
    eng = ikjax.load(tiny_model, ctx=1024, ubatch=128, ctk="q8_0", mla=3)
    plan = eng.memory_plan()
    for line in plan.lines()[1:]:  # KV cache and attention buffer exactly as the engine plans them
        assert line in res.stdout, (line, res.stdout)


# -- bench ----------------------------------------------------------------------------------------------

def _md_rows(stdout: str) -> tuple[list[str], list[list[str]]]:
    lines = [l for l in stdout.splitlines() if l.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert re.fullmatch(r"\|( -+:? \|)+", lines[1].replace("-:", "--:").replace("- ", "- ")) or "---" in lines[1]
    return header, [[c.strip() for c in l.strip("|").split("|")] for l in lines[2:]]


def test_bench_cartesian_product_and_skip(tiny_model):
    res = invoke(["bench", "-m", tiny_model, "-p", 16, "-n", 2, "-mla", "2,3", "-ub", "16,32", "-ctk", "f16,q4_0",
                  "-r", 2], 1)  # every row printed; status 1: not every test ran (llama-bench's 1)
    assert res.stderr.strip().splitlines()[-1] == "error: 4 of 12 tests did not run (their rows say why)"
    header, rows = _md_rows(res.stdout)
    assert header[:4] == ["model", "size", "params", "backend"] and header[-2:] == ["test", "t/s"]
    col = {h: i for i, h in enumerate(header)}
    assert {"mla", "n_ubatch", "type_k"} <= col.keys()
    ok = [r for r in rows if not r[col["t/s"]].startswith("skipped")]
    bad = [r for r in rows if r[col["t/s"]].startswith("skipped")]
    # 2 mla x 2 ub x 2 ctk = 8 combinations; the 4 with ctk q4_0 cannot load: one row each, the rest go on
    assert len(bad) == 4 and all(r[col["type_k"]] == "q4_0" and "ctk" in r[col["t/s"]] for r in bad)
    assert len(ok) == 4 * 2
    combos = {(r[col["mla"]], r[col["n_ubatch"]]) for r in ok}
    assert combos == {("2", "16"), ("2", "32"), ("3", "16"), ("3", "32")}
    assert sorted({r[col["test"]] for r in ok}) == ["pp16", "tg2"]
    for r in ok:
        m = re.fullmatch(r"(\d+\.\d\d) ± (\d+\.\d\d)", r[col["t/s"]])
        assert m and float(m.group(1)) > 0, r


def test_bench_and_perplexity_check_variables_first(tiny_model, tmp_path, monkeypatch):
    """A bad IKJAX_* value: one line before anything loads, from bench too (it was a 'skipped' row
    a combination) and perplexity (it tokenized the text with the model's header first)."""
    monkeypatch.setenv("IKJAX_KERNELS", "foo")
    assert_one_line_error(invoke(["bench", "-m", tiny_model, "-p", 8, "-n", 2, "-mla", "2,3"], 1),
                          "IKJAX_KERNELS must be one of")
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 200)
    res = invoke(["perplexity", "-m", tiny_model, "-f", str(text), "-c", 64, "--chunks", 1], 1)
    assert_one_line_error(res, "IKJAX_KERNELS must be one of")
    assert "tokenization" not in res.stderr
    monkeypatch.delenv("IKJAX_KERNELS")
    # an -ot device this machine does not have: the same, before the text is tokenized (an outside probe)
    for cmd in (["perplexity", "-m", tiny_model, "-f", str(text), "-c", 64, "--chunks", 1],
                ["generate", "-m", tiny_model, "-p", "hi", "-n", 1]):
        assert_one_line_error(invoke(cmd + ["-ot", "exps=GPU7"], 1), "exps=GPU7", "names accelerator 7")


def test_bench_refuses_a_mode_that_does_not_exist(tiny_model):
    """-mla 2,5: 5 is no MLA mode anywhere (ik's are 0-3): refused before anything loads, not a
    'skipped' row (those are for combinations this build cannot run, as -ctk q4_0 above)."""
    assert_one_line_error(invoke(["bench", "-m", tiny_model, "-mla", "2,5"], 1), "-mla: modes are 0, 1, 2 or 3, got '2,5'")


@pytest.mark.parametrize("args, msg", [
    (["-ctk", "q8_0,q9"], "-ctk: 'q9' is not one of f32, f16, bf16, q8_0, q4_0"),
    (["-ctv", "x"], "-ctv: 'x' is not one of"),
    (["--dtype", "f8"], "--dtype: 'f8' is not one of auto, f32, bf16, f16")])
def test_bench_refuses_a_type_no_build_knows(tiny_model, args, msg):
    """A cache or compute type that exists nowhere: refused in one line before anything loads (it was
    a 'skipped' row a combination); ik's types this build does not store stay skipped rows (above)."""
    assert_one_line_error(invoke(["bench", "-m", tiny_model, "-p", 8, "-n", 2, *args], 1), msg)


@pytest.mark.parametrize("fmt", ["json", "csv", "sql"])
def test_bench_interrupted_prints_the_tests_that_finished(tiny_model, monkeypatch, fmt):
    """Ctrl-C during `bench -o json|csv|sql` (formats written whole at the end): the tests that had
    finished are printed in the format, then the one line and 130 (an outside probe: nothing came,
    where llama-bench prints each test as it ends). Ctrl-C lands right after the first test."""
    from ikjax.tools import llama_bench as lb
    orig = lb.run_bench

    def interrupted_after_one(models, params, tests, reps, on_result, *a, **k):
        def once(r):
            on_result(r)
            raise KeyboardInterrupt
        return orig(models, params, tests, reps, once, *a, **k)
    monkeypatch.setattr(lb, "run_bench", interrupted_after_one)
    res = invoke(["bench", "-m", tiny_model, "-p", "8", "-n", "2", "-r", "1", "-o", fmt], 130)
    assert res.stderr.strip().splitlines()[-1] == "error: interrupted"
    if fmt == "json":
        recs = json.loads(res.stdout)
        assert len(recs) == 1 and recs[0]["n_prompt"] == 8 and recs[0]["avg_ts"] > 0
    elif fmt == "csv":
        lines = res.stdout.splitlines()
        assert len(lines) == 2 and lines[0].startswith("build_commit,") and '"8"' in lines[1]
    else:
        assert res.stdout.startswith("CREATE TABLE IF NOT EXISTS test") and res.stdout.count("INSERT INTO") == 1


def test_bench_json_csv_depth(tiny_model):
    res = invoke(["bench", "-m", tiny_model, "-p", 16, "-n", 2, "-gp", "32,2", "-pg", "16,4", "-d", "0,16", "-r", 2,
                  "-o", "json"])
    recs = json.loads(res.stdout)
    assert [r["test"] for r in recs] == ["pp16", "tg2", "pp16@d16", "tg2@d16", "pp16+tg4", "tg2@pp32"]
    for r in recs:
        assert r["error"] is None and len(r["samples_ts"]) == 2 and r["avg_ts"] > 0
        assert r["avg_ts"] == pytest.approx(sum(r["samples_ts"]) / 2, rel=1e-4)
    by = {r["test"]: r for r in recs}
    # ik's n_prompt/n_gen: tg2@pp32 has a 32-token (untimed) prompt; pp16+tg4 times 16 + 4 tokens together
    assert (by["tg2@pp32"]["n_prompt"], by["tg2@pp32"]["n_gen"], by["tg2@pp32"]["n_depth"]) == (32, 2, 0)
    assert (by["pp16@d16"]["n_prompt"], by["pp16@d16"]["n_depth"]) == (16, 16)
    pg = by["pp16+tg4"]
    assert (pg["n_prompt"], pg["n_gen"]) == (16, 4)
    for ts, ns in zip(pg["samples_ts"], pg["samples_ns"]):
        assert ts == pytest.approx((16 + 4) / (ns / 1e9), rel=1e-6)
    res = invoke(["bench", "-m", tiny_model, "-p", 16, "-n", 0, "-r", 1, "-o", "csv"])
    import csv
    import io
    rows = list(csv.DictReader(io.StringIO(res.stdout)))
    assert len(rows) == 1 and rows[0]["test"] == "pp16" and float(rows[0]["avg_ts"]) > 0
    assert rows[0]["flash_attn"] == "1" and rows[0]["ser"] == "-1,0"  # llama-bench's CSV: bools as 0/1
    # llama-bench's -o sql: CREATE TABLE then an INSERT a test, which SQLite reads back
    import sqlite3
    res = invoke(["bench", "-m", tiny_model, "-p", 16, "-n", 2, "-r", 1, "-o", "sql"])
    assert res.stdout.startswith("CREATE TABLE IF NOT EXISTS test (\n  build_commit TEXT,")
    db = sqlite3.connect(":memory:")
    db.executescript(res.stdout)
    got = db.execute("SELECT n_prompt, n_gen, flash_attn, typeof(avg_ts), avg_ts > 0 FROM test").fetchall()
    assert got == [(16, 0, 1, "real", 1), (0, 2, 1, "real", 1)], got


# -- run --config ----------------------------------------------------------------------------------------

def test_run_config_rejects_unknown_key_and_bad_value(tmp_path, tiny_model):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"command": "sweep-bench", "model": tiny_model, "ctx": 256, "flash_attention": 1}))
    assert_one_line_error(invoke(["run", "--config", cfg], 1), "'flash_attention'")
    cfg.write_text(json.dumps({"command": "sweep-bench", "model": tiny_model, "mla": "three"}))
    assert_one_line_error(invoke(["run", "--config", cfg], 1), "'mla'")
    cfg.write_text(json.dumps({"command": "sweep-bench", "model": tiny_model, "ctk": "q4_0"}))
    assert_one_line_error(invoke(["run", "--config", cfg], 1), "ctk")
    cfg.write_text(json.dumps({"command": "fly", "model": tiny_model}))
    assert_one_line_error(invoke(["run", "--config", cfg], 1), "'command'")
    cfg.write_text("{not json")
    assert_one_line_error(invoke(["run", "--config", cfg], 1), "JSON")
    cfg.write_text(json.dumps({"command": "sweep-bench", "model": tiny_model, "c": 256, "ctx": 512}))
    assert_one_line_error(invoke(["run", "--config", cfg], 1), "keys 'c' and 'ctx'")


def test_probe_configs_specs_and_switches(tmp_path, tiny_model):
    """An outside probe of configs and flags (stop 62), each once silent or a raw Python message:
    `"model": null` ran the built-in default model; a key given twice and `--config` given twice
    kept the last; "--5" for an integer was a ValueError; `-no-fa -fa 1` ran without flash
    attention; a synthetic spec's extra field was ignored and 10^12 layers planned tensors until
    memory ran out; `plot --labels` of the wrong count drew; `make-model --seed -1` was NumPy's
    message; the memory plan rounded -c up to --kv-block unsaid."""
    cfg = tmp_path / "c.json"
    for text, words in (('{"command": "info", "model": null}', ("'model'", "null")),
                        ('{"command": "info", "model": "%s", "ctx": 512, "ctx": 1024}' % tiny_model, ("'ctx' given twice",)),
                        ('{"command": "info", "model": "%s", "ctx": "--5"}' % tiny_model, ("'ctx'", "integer")),
                        ('{"command": "info", "model": "%s", "fa": true, "no_fa": true}' % tiny_model,
                         ("-fa and -no-fa both given",))):
        cfg.write_text(text)
        assert_one_line_error(invoke(["run", "--config", cfg], 1), *words)
    cfg.write_text('{"command": "info", "model": "%s", "ctx": " 512 "}' % tiny_model)
    assert "-c 512 " in invoke(["run", "--config", cfg]).stdout
    from ikjax.cli.run_config import _coerce
    from ikjax.errors import OptionError  # numbers as text, floats as integers ("0.8" was refused)
    assert _coerce("temp", "0.8", float) == 0.8 and _coerce("temp", " 1e-2 ", float) == 0.01
    for bad in ("nan", "inf", "0.8x", "--1"):
        with pytest.raises(OptionError, match="'temp': expected a number"):
            _coerce("temp", bad, float)
    assert_one_line_error(invoke(["run", "--config", cfg, "--config", cfg], 1), "--config: given more than once")
    for args in (["-no-fa", "-fa", 1], ["-fa", 1, "-no-fa"], ["--flash-attn=1", "-no-fa"]):
        assert_one_line_error(invoke(["info", tiny_model, *args], 1), "-fa and -no-fa both given")
    assert_one_line_error(invoke(["info", tiny_model, "-no-fmoe", "-fmoe", 1], 1), "-fmoe and -no-fmoe both given")
    assert "-fa 0 " in invoke(["info", tiny_model, "-no-fa"]).stdout
    for spec, words in (("synthetic:tiny:Q4_0:2:extra", ("is not synthetic:PRESET",)),
                        ("synthetic:tiny:", ("is not synthetic:PRESET",)),
                        ("synthetic:tiny:Q9_0", ("type 'Q9_0'",)),
                        ("synthetic:tiny:Q8_0:100000", ("layers: need 1 to 1024",))):
        res = invoke(["info", spec], 1)
        assert_one_line_error(res, *words)
    assert_one_line_error(invoke(["make-model", "--layers", 999999999999, "-o", tmp_path / "m.gguf"], 1), "layers")
    assert_one_line_error(invoke(["make-model", "--seed", -1, "-o", tmp_path / "m.gguf"], 1), "seed: need 0 to")
    assert not list(tmp_path.glob("*.gguf*"))
    assert_one_line_error(invoke(["plot", cfg, cfg, "--labels", "a"], 1), "--labels: 1 label(s) for 2 file(s)")
    assert_one_line_error(invoke(["run", "--config", ""], 1), "--config: empty path")
    assert_one_line_error(invoke(["plot", cfg, "-o", ""], 1), "output: empty path")
    out = invoke(["info", tiny_model, "-c", 1000]).stdout
    assert re.search(r"KV cache .*1024 tokens: -c 1000 rounded up to --kv-block", out), out
    assert_one_line_error(invoke(["info", tiny_model, "-c", 10**23], 1), "ctx")


def test_run_config_sweep(tmp_path, tiny_model):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"command": "sweep-bench", "model": tiny_model, "ctx": 256, "ub": 128, "n": 2,
                               "mla": 3, "fa": True, "ctk": "q8_0", "output-format": "jsonl"}))
    res = invoke(["run", "--config", cfg])
    rows = [json.loads(l) for l in res.stdout.splitlines() if l.startswith("{")]
    assert [(r["n_kv"], r["tg"], r["n_ubatch"]) for r in rows] == [(0, 2, 128), (128, 2, 128)]


def test_shipped_configs_are_valid():
    from ikjax.cli import CONFIG_COMMANDS
    from ikjax.cli.run_config import parse_config
    files = sorted((REPO / "configs").glob("*.json"))
    assert len(files) >= 3
    seen = set()
    for f in files:
        name, func, kwargs = parse_config(f, CONFIG_COMMANDS)
        seen.add(name)
        from ikjax.options import RunOptions
        run_keys = {k: v for k, v in kwargs.items() if k in RunOptions.__dataclass_fields__
                    and not (name == "bench" and isinstance(v, str) and "," in v)}
        if name != "bench":
            RunOptions.from_kwargs(**run_keys)
    assert "sweep-bench" in seen
    assert any("exps=CPU" in f.read_text() for f in files)


# -- make-model, generate ------------------------------------------------------------------------------

def test_make_model_cli(tmp_path):
    out = tmp_path / "m.gguf"
    res = invoke(["make-model", "--preset", "tiny", "--layers", 2, "--experts", 8, "--type", "Q4_K", "-o", out])
    assert out.exists() and "wrote" in res.stdout
    info = invoke(["info", out]).stdout
    assert "8 routed" in info and "Q4_K" in info
    assert_one_line_error(invoke(["make-model", "--preset", "huge", "-o", out], 1), "preset")
    assert_one_line_error(invoke(["make-model", "--type", "Q9_9", "-o", out], 1), "type")


def test_generate_streams_text(tiny_model):
    res = invoke(["generate", "-m", tiny_model, "-p", "Hello world", "-n", 6, "--temp", 0, "-c", 256, "-ub", 64])
    assert res.stdout.startswith("Hello world")
    assert len(res.stdout) > len("Hello world\n")
    assert "generated" in res.stderr


def test_generate_stop_strings_and_n_past_the_context(tiny_model):
    """llama-cli's -r / --reverse-prompt on generate (the probe found none): the text stops at the
    string, printed with it; -n past the context generates to the context's end with a note (an
    error before; llama-cli stops there too)."""
    import ikjax
    base = ["generate", "-m", tiny_model, "-p", "Hello world", "--temp", 0, "-c", 64, "-ub", 32, "--ignore-eos"]
    full = invoke(base + ["-n", 24]).stdout[len("Hello world"):-1]
    eng = ikjax.load(tiny_model, ctx=64, ubatch=32)
    want = eng.complete("Hello world", 24, ignore_eos=True).text
    assert full == want
    stop = want[len(want) // 2: len(want) // 2 + 3]
    assert stop.strip() and stop not in want[:len(want) // 2]
    cut = invoke(base + ["-n", 24, "-r", stop]).stdout
    assert cut == "Hello world" + want[:want.index(stop) + len(stop)] + "\n", (cut, stop)
    res = invoke(base + ["-n", 500])
    n_prompt = len(eng.tokenizer.encode("Hello world"))
    assert f"at most {64 - n_prompt} tokens" in res.stderr and res.exit_code == 0
    err = invoke(["generate", "-m", tiny_model, "-p", "word " * 80, "-c", 64, "-ub", 32], 1).stderr.strip()
    assert err.splitlines()[-1].startswith("error: prompt: ") and "leave no room" in err and "Traceback" not in err


def test_prompt_escapes_and_files_as_llama_cli(tiny_model, tmp_path):
    """llama-cli processes escapes in prompts by default (-e; \\n \\t \\' \\" \\\\ \\xHH, any other
    backslash as written) and drops one trailing newline of an -f file: the same command feeds
    the same tokens here (the probe found `-p 'a\\nb'` fed a backslash and an n)."""
    from ikjax.cli.common import process_escapes, read_prompt_file
    assert process_escapes(r"a\nb\tc\\d\'e\"f\x41\q\\") == "a\nb\tc\\d'e\"fA\\q\\"
    assert process_escapes("no escapes") == "no escapes" and process_escapes("end\\") == "end\\"
    # ik's string_process_escapes exactly (common/common.cpp): only those six and \xHH, any byte
    # (UTF-8 made of them), only where both digits are there; LaTeX and Windows
    # paths as written (\a \b \f \v \? were control characters here)
    assert process_escapes(r"Solve \frac{\alpha}{\beta} in C:\build\vars \? \a") == r"Solve \frac{\alpha}{\beta} in C:\build\vars \? \a"
    assert process_escapes(r"caf\xc3\xa9 \x41 end\x41 \x4") == "café A endA \\x4"
    assert process_escapes(r"\x 9.\x+a.\xg1.") == "\t.\n.\\xg1."  # (C strtol: a space or a sign first)
    assert process_escapes(r"\xff.") == "\udcff."  # (PEP 383: the prompt's check names byte 0xff)
    assert process_escapes("ab\udcff") == "ab\udcff"  # a command line's non-UTF-8 byte stays that byte
    f = tmp_path / "p.txt"
    f.write_text("Hello\\tthere\n\n")
    assert read_prompt_file(str(f)) == "Hello\\tthere\n"
    base = ["generate", "-m", tiny_model, "-n", 1, "--temp", 0, "-c", 256, "-ub", 64]
    assert invoke(base + ["-p", r"a\nb"]).stdout.startswith("a\nb")
    assert invoke(base + ["-p", r"a\nb", "--no-escape"]).stdout.startswith("a\\nb")
    assert invoke(base + ["-f", str(f), "-e"]).stdout.startswith("Hello\tthere\n")


def test_empty_prompt_of_a_model_without_bos_is_refused_before_the_load(tiny_model):
    """An empty prompt is the BOS alone where the model adds one; where it adds none (the tiny model:
    a BPE vocabulary, no add_bos_token) there is nothing to go on from: one line, before the model
    is loaded (an outside probe saw "loaded ..." first)."""
    res = invoke(["generate", "-m", tiny_model, "-n", 2, "--temp", 0, "-c", 64, "-ub", 32], 1)
    assert_one_line_error(res, "prompt: empty")


def test_llama_cli_values_as_llama_cli_reads_them(tiny_model):
    """Values llama-cli takes that were refused here: -n -2 (until the context is filled), -t -1
    (every core), --temp -1 (greedy, as 0), --top-p 2 (off, as 1)."""
    base = ["generate", "-m", tiny_model, "-p", "Hello", "-c", 64, "-ub", 32, "--ignore-eos", "-s", 3]
    greedy = invoke(base + ["-n", 6, "--temp", 0]).stdout
    assert invoke(base + ["-n", 6, "--temp", -1]).stdout == greedy
    assert invoke(base + ["-n", 6, "--temp", 0, "-t", -1, "--top-p", 2]).stdout == greedy
    assert invoke(base + ["-n", -2, "--temp", 0]).stdout == invoke(base + ["-n", -1, "--temp", 0]).stdout


def test_ctx_0_is_the_model_s_training_context(tiny_model, tmp_path):
    """ik's -c 0: the context the model was trained with (refused before), in the CLI (read from
    the file's header before the load: the commands check their rows and slots against it) and in
    the Python API."""
    import ikjax
    eng = ikjax.load(tiny_model, ctx=0, ubatch=64)
    n = eng.config.context_length
    assert eng.options.ctx == n and eng.capacity >= n
    res = invoke(["info", tiny_model, "-c", 0])
    assert f"note: -c 0: the model's training context, {n} tokens" in res.stderr + res.stdout
    assert f"memory plan (-c {n} " in res.stdout
    # perplexity: chunks of that length (a text too short for one of 16k tokens: refused, after the note)
    text = tmp_path / "short.txt"
    text.write_text("hello world " * 2000)
    res = invoke(["perplexity", "-m", tiny_model, "-f", str(text), "-c", 0, "--chunks", 1], 1)
    assert f"-c 0: the model's training context, {n} tokens a chunk" in res.stderr


def test_generate_penalties_are_the_apis(tiny_model):
    """llama-cli's --repeat-penalty / --presence-penalty / --frequency-penalty / --repeat-last-n:
    generate prints what Engine.generate gives with the same penalties (greedy), and the
    penalties' one-token host steps are compiled before the timer (no compile line after it)."""
    import ikjax
    prompt = "ab ab ab ab ab ab ab ab"
    args = ["generate", "-m", tiny_model, "-p", prompt, "-n", 16, "--temp", 0, "-c", 256, "-ub", 64,
            "--presence-penalty", 1.5, "--frequency-penalty", 0.75, "--repeat-last-n", -1]
    res = invoke(args)
    eng = ikjax.load(tiny_model, ctx=256, ubatch=64)
    ids = eng.tokenizer.encode(prompt)
    out = []
    for t in eng.generate(ids, 16, presence_penalty=1.5, frequency_penalty=0.75, repeat_last_n=-1):
        if t == eng.config.eos_token_id:
            break
        out.append(t)
    # (control tokens print as nothing, as llama-cli without --special)
    assert res.stdout == prompt + eng.tokenizer.decode(out, skip_special=True) + "\n", (res.stdout, out)
    after = res.stderr.split("compiled", 1)[1]
    assert "preparing step" not in after, res.stderr
    assert_one_line_error(invoke(args[:-6] + ["--presence-penalty", 3], code=1), "presence_penalty")


def test_default_model_made_on_first_use(tmp_path, monkeypatch):
    """README's first command: `ikjax sweep-bench` with no -m makes and caches the tiny model."""
    monkeypatch.setenv("IKJAX_CACHE", str(tmp_path / "cache"))
    res = invoke(["sweep-bench", "-c", 256, "-ub", 128, "-n", 2])
    assert "making synthetic model tiny" in res.stderr
    assert (tmp_path / "cache" / f"tiny-Q8_0-g{synthetic.GENERATOR}.gguf").exists()
    assert len([l for l in res.stdout.splitlines() if l.startswith("|")]) == 2 + 2
    res = invoke(["info"])  # reuses the cached file
    assert "making" not in res.stderr and "16 routed, top-4" in res.stdout


def test_outside_probe_cli_defects(tiny_model, tmp_path, monkeypatch):
    """What an outside probe of the CLI found (each once a traceback, a quiet default, a late refusal
    or an overwritten file): refused in one line before anything loads, or working as llama-cli's."""
    assert_one_line_error(invoke(["generate", "-m", "", "-p", "x", "-n", 2], 1), "empty path")
    assert_one_line_error(invoke(["generate", "-m", "synthetic:tiny:Q8_0:0", "-p", "x", "-n", 2], 1), "LAYERS >= 1")
    assert_one_line_error(invoke(["generate", "-m", "synthetic:", "-p", "x", "-n", 2], 1), "no preset")
    assert_one_line_error(invoke(["info", tiny_model, "-m", tmp_path / "other.gguf"], 1), "two models")
    assert_one_line_error(invoke(["make-model", "-o", ""], 1), "empty path")
    res = invoke(["generate", "-m", tiny_model, "-p", "x", "-n", 4, "--min-p", 2], 1)  # (--temp -1: greedy, as llama-cli)
    assert_one_line_error(res, "min_p")
    assert "memory plan" not in res.stderr  # before the load
    prompt = tmp_path / "p.txt"
    prompt.write_text("Hello world")
    assert_one_line_error(invoke(["generate", "-m", tiny_model, "-f", prompt, "-p", "x"], 1), "not both")
    assert_one_line_error(invoke(["generate", "-m", tiny_model, "-f", tmp_path / "none.txt"], 1), "none.txt")
    # llama-cli's -f, --ignore-eos and -n -1 (until EOS or the context's end: with EOS banned, the end)
    res = invoke(["generate", "-m", tiny_model, "-f", prompt, "-n", -1, "--ignore-eos", "--temp", 0, "-c", 64,
                  "-ub", 32, "--no-echo"])
    import ikjax
    eng = ikjax.load(tiny_model, ctx=64, ubatch=32)
    ids = eng.tokenizer.encode("Hello world")
    want = list(eng.generate(ids, 64 - len(ids), ignore_eos=True))
    assert len(want) == 64 - len(ids) and res.stdout == eng.tokenizer.decode(want, skip_special=True) + "\n"
    assert "preparing step" not in res.stderr.split("compiled", 1)[1]
    # --expert-stats never replaces a file that is not expert statistics (it overwrote the -f text)
    assert_one_line_error(invoke(["generate", "-m", tiny_model, "-f", prompt, "-n", 2, "--expert-stats", prompt], 1),
                          "not an expert-stats file")
    assert prompt.read_text() == "Hello world"
    monkeypatch.setenv("IKJAX_KERNELS", "pallas")
    assert_one_line_error(invoke(["generate", "-m", tiny_model, "-p", "x", "-n", 2], 1), "IKJAX_KERNELS=pallas")


def test_chat_goes_on_past_the_context(tiny_model):
    """A conversation that outgrows -c drops its oldest exchanges (a note says how many) and goes on,
    as llama-cli's context shift lets it (it ended the program once, naming prompt_ids; then every
    later message was refused); a message too long on its own is dropped with a note."""
    import subprocess
    import sys
    lines = ["Hello", "again and again and again", "ok", "word " * 200, "more", "and more", "bye"]
    r = subprocess.run([sys.executable, "-m", "ikjax.cli", "chat", "-m", tiny_model, "--temp", "0", "-n", "40", "-c",
                        "128", "-ub", "32"], input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert re.search(r"\[context: the oldest \d+ exchanges? dropped to fit -c 128\]", r.stderr), r.stderr[-1500:]
    assert "[message dropped" in r.stderr and "-c 128" in r.stderr  # the 200 words alone
    assert "Traceback" not in r.stderr and "prompt_ids" not in r.stderr
    assert int(re.search(r"chat: (\d+) turns", r.stderr).group(1)) == len(lines) - 1, r.stderr[-500:]


# -- llama-cli habits an outside probe found refused or mishandled ---------------------------------

def test_llama_cli_habits(tiny_model, tmp_path):
    """-ngl -1 (llama.cpp's default: every layer), --top-p 0 (the most likely token only), --mlock and
    -co (noted, no effect) run; a random seed is printed as llama-cli's "sampler seed: N" and -s N
    repeats it; a seed past 32 bits, an -ot regex Python warns about and --expert-stats on a virtual
    file system are one-line errors before anything runs."""
    res = invoke(["generate", "-m", tiny_model, "-p", "hi", "-n", 4, "-c", 64, "-ngl", -1, "--top-p", 0,
                  "--temp", 0.8, "--mlock", "-co"])
    assert "note: --mlock has no effect" in res.stderr and "note: -co has no effect" in res.stderr
    seed = int(next(x for x in res.stderr.splitlines() if x.startswith("sampler seed: ")).split(": ")[1])
    again = invoke(["generate", "-m", tiny_model, "-p", "hi", "-n", 4, "-c", 64, "-ngl", -1, "--top-p", 0,
                    "--temp", 0.8, "-s", seed])
    assert again.stdout == res.stdout and "sampler seed" not in again.stderr
    assert_one_line_error(invoke(["generate", "-m", tiny_model, "-p", "hi", "-s", 2 ** 40], 1), "seed")
    assert_one_line_error(invoke(["generate", "-m", tiny_model, "-p", "hi", "-ot", "[[=CPU"], 1), "bad regex")
    import os
    if os.path.isdir("/proc"):
        assert_one_line_error(invoke(["generate", "-m", tiny_model, "-p", "hi", "-n", 2, "-s", 1, "--expert-stats",
                                      "/proc/es.json"], 1), "virtual file system")


def test_chat_with_stdin_closed_ends_cleanly(tiny_model):
    """`ikjax chat ... <&-` (no stdin at all): the end of input, as llama-cli reads it, not a crash."""
    import os
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "ikjax.cli", "chat", "-m", tiny_model, "-c", "128", "-n", "4"],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), preexec_fn=lambda: os.close(0))
    assert r.returncode == 0 and "Traceback" not in r.stderr and "error" not in r.stderr, r.stderr[-1500:]


def test_placement_flags_as_the_load_has_them(tiny_model, tmp_path, caplog):
    """An outside probe's findings: `-ot ''` refused in one line as ik does (it was dropped),
    `bench -ngl -1` read as every layer like the other commands (it was refused), `-t` past the
    cores noted (it was clamped silently), and `info` prints the load's own placement notes."""
    assert_one_line_error(invoke(["generate", "-m", tiny_model, "-p", "hi", "-n", "1", "-ot", ""], 1), "ot:", "empty")
    res = invoke(["bench", "-m", tiny_model, "-p", "8", "-n", "1", "-r", "1", "-ngl", "-1", "-o", "csv"])
    assert "-1" in res.stdout.splitlines()[1] or "99" in res.stdout.splitlines()[1], res.stdout
    res = invoke(["generate", "-m", tiny_model, "-p", "hi", "-n", "1", "-t", "100000"])
    assert re.search(r"note: -t 100000: this process may run on \d+ cores", res.stderr + caplog.text), res.stderr
    res = invoke(["info", tiny_model, "-ot", "nomatch=CPU"])
    assert "note           -ot nomatch=CPU: matches no tensor of this file" in res.stdout, res.stdout


def test_info_plans_the_graph_split_as_the_load(tiny_model):
    """`info -sm graph` over 4 (fake CPU) devices prints the per-device weights the load prints
    (it planned from names and sizes alone, so nothing split: the whole model on every device)."""
    env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()}
    lines = {}
    for cmd in (["info", tiny_model], ["generate", "-m", tiny_model, "-p", "hi", "-n", "1"]):
        res = subprocess.run([sys.executable, "-m", "ikjax.cli", *cmd, "-sm", "graph"], env=env, capture_output=True,
                             text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        lines[cmd[0]] = [line.split("MiB weights")[0].strip() for line in (res.stdout + res.stderr).splitlines()
                         if "MiB weights" in line and "on CPU" in line]
    assert len(lines["info"]) == 4 and lines["info"] == lines["generate"], lines


def test_info_checks_gpu_experts_as_a_load(tiny_model, tmp_path):
    """`info --gpu-experts N` says which copies a load would make from the statistics, and refuses
    what a load refuses (no statistics, no host experts) in one line; it printed nothing before."""
    stats = tmp_path / "st.json"
    res = subprocess.run([sys.executable, "-m", "ikjax.cli", "generate", "-m", tiny_model, "-p", "hello there", "-n",
                          "4", "--expert-stats", str(stats)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and stats.is_file(), res.stderr  # (written as the process ends)
    res = invoke(["info", tiny_model, "-ot", "exps=CPU", "--gpu-experts", "2", "--expert-stats", stats])
    assert re.search(r"note +gpu experts: \d+ of \d+ host-resident experts also on the GPU", res.stdout), res.stdout
    assert_one_line_error(invoke(["info", tiny_model, "-ot", "exps=CPU", "--gpu-experts", "2"], 1),
                          "gpu-experts", "needs expert statistics")
    assert_one_line_error(invoke(["info", tiny_model, "--gpu-experts", "2", "--expert-stats", stats], 1),
                          "gpu-experts", "no routed experts are in host memory")


def test_flag_readings_an_outside_probe_found(tiny_model, tmp_path):
    """chat -p TEXT -f FILE sent the file and dropped -p silently (generate refuses the pair);
    --top-k below 0 is off in llama-cli (was refused); --chat-template-file on a directory said
    "no such file"."""
    f = tmp_path / "f.txt"
    f.write_text("second message")
    assert_one_line_error(invoke(["chat", "-m", tiny_model, "-p", "from-p", "-f", f, "-n", 2], 1), "not both")
    base = ["generate", "-m", tiny_model, "-p", "hello", "-n", 4, "--seed", 3, "--temp", 1.0, "-c", 128]
    assert invoke(base + ["--top-k", -1]).stdout == invoke(base + ["--top-k", 0]).stdout
    assert_one_line_error(invoke(["chat", "-m", tiny_model, "--chat-template-file", tmp_path], 1),
                          "--chat-template-file", "not a file")


def test_chat_template_refusal_long_system_prompt_and_n_minus_2(tiny_model, tmp_path):
    """A template that refuses one message drops that message and the chat goes on (its render in
    the context fit raised out of the chat, exit 1); a system prompt that leaves no room is one
    line before any input (every message was "dropped: send a shorter one", without end); -n -2
    is llama-cli's "until the context fills", as generate reads it (was refused)."""
    tpl = tmp_path / "cond.jinja"
    tpl.write_text("{% for m in messages %}{% if 'bad' in m.content %}{{ raise_exception('no bad words') }}"
                   "{% endif %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
    base = [sys.executable, "-m", "ikjax.cli", "chat", "-m", tiny_model, "-c", "512", "--temp", "0", "-n", "3", "-v"]
    r = subprocess.run([*base, "--chat-template", str(tpl)], input="ok\nbad\nok again\n", capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "[message dropped: chat template" in r.stderr and "no bad words" in r.stderr, \
        r.stderr[-1500:]
    assert "turn 2: prompt" in r.stderr and int(re.search(r"chat: (\d+) turns", r.stderr).group(1)) == 2, \
        r.stderr[-800:]
    r = subprocess.run([*base, "-sys", "ab " * 600], input="hi\n", capture_output=True, text=True, timeout=300)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 1 and err[-1].startswith("error: system-prompt: ") and "-c 512" in err[-1], r.stderr[-800:]
    r = subprocess.run([*base[:-3], "-n", "-2"], input="", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "error" not in r.stderr, r.stderr[-800:]


def test_chat_says_when_an_answer_fills_the_context(tiny_model):
    """An answer cut by the end of the context says so (it just stopped; only -v told why); one cut
    by -n does not, as llama-cli prints nothing there."""
    base = [sys.executable, "-m", "ikjax.cli", "chat", "-m", tiny_model, "--temp", "0", "--ignore-eos", "-c", "128"]
    r = subprocess.run(base, input="hi\n", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "[answer stopped: the context (-c 128) is full" in r.stderr, r.stderr[-800:]
    r = subprocess.run([*base, "-n", "3"], input="hi\n", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "[answer stopped" not in r.stderr, r.stderr[-800:]
