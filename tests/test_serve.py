"""`ikjax serve` as a real process on 127.0.0.1, driven by the `openai` client and raw HTTP (issue 23).

Two servers per module (each started once: a process start and its compiles cost seconds on this
CPU): `server` (-np 4, 256 tokens a slot, -ub 16) for the answers, streams, concurrency and the
prompt cache; `small` (-np 1, a queue of 1, --api-key) for 401, 503 and cancellation. Greedy
answers are compared with `Engine.generate` for the same ids alone, on an engine loaded in this
process with the options of one slot (ctx 256, ubatch 16).
"""
from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

openai = pytest.importorskip("openai")

CTX, NP, UB = 256, 4, 16
TEMPLATES = Path(__file__).resolve().parents[1] / "ikjax" / "templates"
MODEL = "ikjax-tiny-2L.gguf"  # the id /v1/models lists: the file's name (conftest's tiny_model)
START_S = 120


class Proc:
    """A server process: its URL once it listens, its stderr kept (read on a thread)."""

    def __init__(self, model: str, *args: str):
        cmd = [sys.executable, "-m", "ikjax.cli", "serve", "-m", model, "--port", "0", *args]
        self.p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.url: str | None = None
        ready = threading.Event()

        def read():
            for line in self.p.stderr:
                self.lines.append(line)
                if line.startswith("listening on "):
                    self.url = line.split()[-1]
                    ready.set()
            ready.set()
        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(START_S) or self.url is None:
            self.stop()
            pytest.fail("server did not start:\n" + "".join(self.lines[-20:]))
        self.host, self.port = self.url.removeprefix("http://").rsplit(":", 1)

    def stop(self) -> None:
        self.p.terminate()
        try:
            self.p.wait(30)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


@pytest.fixture(scope="module")
def server(tiny_model):
    # llama-server's flags for the template file and the page: R1's template (its <think> opening
    # the answer: the reasoning tests) and no page at /
    s = Proc(tiny_model, "-c", str(CTX * NP), "-np", str(NP), "-ub", str(UB), "--temp", "0",
             "--chat-template-file", str(TEMPLATES / "deepseek-r1.jinja"), "--no-webui", "--slots")
    yield s
    s.stop()
    assert s.p.returncode == 0, "".join(s.lines[-20:])  # SIGTERM: a clean shutdown
    t0 = time.time()  # said in the log (its reading thread may lag the exit a moment)
    while not any("SIGTERM: shutting down" in line for line in s.lines) and time.time() - t0 < 10:
        time.sleep(0.05)
    assert any("SIGTERM: shutting down (0 requests in flight" in line for line in s.lines), s.lines[-5:]


@pytest.fixture(scope="module")
def small(tiny_model, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("\nother-key\n  third  \n")  # llama-server's --api-key-file: a key a line
    # R1's builtin template by name: the page's reasoning pane, and answers long enough to stop
    # a slot of 8192 tokens: a stream held open for seconds even where the tiny model decodes 1.6k t/s
    # (this workplace's Zen 4: 1,900 tokens in 1.2 s, over before a gone client could be noticed)
    s = Proc(tiny_model, "-c", "8192", "-np", "1", "-ub", str(UB), "--max-queue", "1", "--api-key", "sekret",
             "--api-key-file", str(keys), "--temp", "0", "--chat-template", "deepseek-r1")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def ref(tiny_model):
    import ikjax
    return ikjax.load(tiny_model, ctx=CTX, ubatch=UB)


def client(s: Proc, key: str = "none"):
    return openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0, timeout=120)


def call(s: Proc, method: str, path: str, body=None, headers=None, raw: bytes | None = None):
    """(status, parsed JSON or text) of one raw HTTP request."""
    c = http.client.HTTPConnection(s.host, int(s.port), timeout=120)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    c.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    r = c.getresponse()
    text = r.read().decode()
    c.close()
    try:
        return r.status, json.loads(text)
    except ValueError:
        return r.status, text


def reference(eng, ids: list[int], n: int) -> tuple[list[int], str]:
    """Greedy ids and text of `Engine.generate` for these ids alone (EOS not part of the text)."""
    out = list(eng.generate(ids, n))
    detok = eng.tokenizer.detokenizer()
    text = "".join(detok.feed(t) for t in out if t != eng.config.eos_token_id) + detok.finish()
    return out, text


def prompts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "tea", "sun", "river", "stone", "cloud", "seven"]
    return [" ".join(rng.choice(words, int(rng.integers(2, 30)))) for _ in range(n)]


# -- answers -------------------------------------------------------------------------------------

def test_health_models_props(server):
    status, body = call(server, "GET", "/health")
    assert status == 200 and body["status"] == "ok"
    models = client(server).models.list()
    assert [m.id for m in models.data] == [MODEL]
    status, props = call(server, "GET", "/props")
    assert status == 200 and props["total_slots"] == NP
    gs = props["default_generation_settings"]
    assert gs["n_ctx"] == CTX and gs["temperature"] == gs["params"]["temperature"]  # ik's flat form and llama.cpp's
    assert props["chat_template"] and props["prompt_cache"] == "auto"


def test_completion_greedy_equals_generate(server, ref):
    """/completion with return_tokens: the very ids generate gives for each prompt alone; the
    OpenAI client's /v1/completions: the same text."""
    c = client(server)
    for text in prompts(3, seed=1):
        ids = call(server, "POST", "/tokenize", {"content": text, "add_special": True})[1]["tokens"]
        want_ids, want_text = reference(ref, ids, 12)
        status, body = call(server, "POST", "/completion", {"prompt": text, "n_predict": 12, "temperature": 0,
                                                             "return_tokens": True})
        assert status == 200 and body["tokens"] == want_ids and body["content"] == want_text
        r = c.completions.create(model=MODEL, prompt=text, max_tokens=12, temperature=0)
        assert r.choices[0].text == want_text
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want_ids)
        assert r.choices[0].finish_reason == ("stop" if len(want_ids) < 12 else "length")


def test_streams_equal_whole_answers(server, ref):
    c = client(server)
    text = prompts(1, seed=2)[0]
    whole = c.completions.create(model=MODEL, prompt=text, max_tokens=10, temperature=0)
    chunks = list(c.completions.create(model=MODEL, prompt=text, max_tokens=10, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # OpenAI's chunks before the usage chunk carry "usage": null (the key itself: a raw client's view)
    for path in ("/v1/completions", "/v1/chat/completions"):
        req = {"model": MODEL, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True},
               **({"prompt": text} if path == "/v1/completions" else {"messages": [{"role": "user", "content": text}]})}
        _, sse = call(server, "POST", path, req)
        events = [json.loads(ln[6:]) for ln in sse.splitlines() if ln.startswith("data: {")]
        assert all("usage" in e and e["usage"] is None for e in events[:-1]) and events[-1]["usage"]["completion_tokens"] > 0
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    chat = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0,
                                     extra_body={"reasoning_format": "none"})
    parts = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10,
                                           temperature=0, stream=True, extra_body={"reasoning_format": "none"}))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == chat.choices[0].message.content
    assert parts[-1].choices[0].finish_reason == chat.choices[0].finish_reason
    # the chat prompt is the template's text, tokenized once (no second BOS)
    rendered = ref.chat_template("deepseek-r1").render(msgs)
    ids = ref.tokenizer.encode(rendered, add_bos=False)
    assert chat.usage.prompt_tokens == len(ids)
    assert chat.choices[0].message.content == reference(ref, ids, 10)[1]


def test_stream_with_return_tokens_sends_every_token(server, ref):
    """/completion streamed with return_tokens: one event per generated token, even where its text
    is held back (random ids: byte tokens, incomplete UTF-8), the ids those of the whole answer."""
    rng = np.random.default_rng(7)
    ids = [int(t) for t in rng.integers(100, ref.config.vocab_size, 20)]
    body = {"prompt": ids, "n_predict": 16, "temperature": 0, "ignore_eos": True, "return_tokens": True}
    whole = call(server, "POST", "/completion", body)[1]
    c = http.client.HTTPConnection(server.host, int(server.port), timeout=120)
    c.request("POST", "/completion", body=json.dumps({**body, "stream": True}),
              headers={"Content-Type": "application/json"})
    events = [json.loads(line[6:]) for line in c.getresponse().read().decode().splitlines()
              if line.startswith("data: ")]
    c.close()
    steps = [e for e in events if not e["stop"]]
    assert len(steps) == 16 and all(len(e["tokens"]) == 1 for e in steps)
    assert [e["tokens"][0] for e in steps] == whole["tokens"]
    assert "".join(e["content"] for e in events) == whole["content"]


def test_reasoning_content(server):
    """R1's template opens <think>: with --reasoning-format deepseek the answer is reasoning until
    </think> (the tiny model never writes one), with none it stays in content."""
    c = client(server)
    msgs = [{"role": "user", "content": "why"}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    plain = c.chat.completions.create(**kw, extra_body={"reasoning_format": "none"}).choices[0].message
    split = c.chat.completions.create(**kw).choices[0].message
    assert split.content == "" and split.model_extra["reasoning_content"] == plain.content.strip()
    parts = list(c.chat.completions.create(**kw, stream=True))
    assert "".join(p.choices[0].delta.model_extra.get("reasoning_content") or "" for p in parts
                   ) == split.model_extra["reasoning_content"]
    # ik's deepseek-legacy: reasoning_content whole, inline in the content when streamed
    legacy = {"reasoning_format": "deepseek-legacy"}
    whole = c.chat.completions.create(**kw, extra_body=legacy).choices[0].message
    assert whole.model_extra["reasoning_content"] == split.model_extra["reasoning_content"] and whole.content == ""
    streamed = list(c.chat.completions.create(**kw, stream=True, extra_body=legacy))
    assert "".join(p.choices[0].delta.content or "" for p in streamed if p.choices) == plain.content


def test_stop_string_and_sampling_fields(server):
    c = client(server)
    text = prompts(1, seed=3)[0]
    full = c.completions.create(model=MODEL, prompt=text, max_tokens=16, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    stop = full[5:7]
    cut = c.completions.create(model=MODEL, prompt=text, max_tokens=16, temperature=0, stop=[stop],
                               extra_body={"ignore_eos": True})
    assert cut.choices[0].text == full[:full.find(stop)] and cut.choices[0].finish_reason == "stop"
    # a seed gives the same sampled answer twice
    a, b = (c.completions.create(model=MODEL, prompt=text, max_tokens=8, temperature=1.0, top_p=0.9,
                                 seed=7).choices[0].text for _ in range(2))
    assert a == b


def test_frequency_and_presence_penalties(server, ref):
    """OpenAI's frequency_penalty / presence_penalty (and llama-server's /completion fields of the
    same names): greedy answers equal `generate` with the same penalties, and differ from the
    answer without them; a value outside [-2, 2] is a 400 naming it."""
    c = client(server)
    text = prompts(1, seed=4)[0]
    ids = call(server, "POST", "/tokenize", {"content": text, "add_special": True})[1]["tokens"]
    seq = list(ids)  # the prompt grown by greedy's choice after it, until that choice is in it
    for _ in range(160):
        t = list(ref.generate(seq, 1, ignore_eos=True))[0]
        if t in seq:
            break
        seq.append(t)
    else:
        raise AssertionError("no greedy repeat within 160 tokens: pick another prompt")
    kw = dict(frequency_penalty=1.5, presence_penalty=0.75)
    n = 8
    want = list(ref.generate(seq, n, repeat_last_n=-1, ignore_eos=True, **kw))
    assert want != list(ref.generate(seq, n, ignore_eos=True))
    extra = {"repeat_last_n": -1, "ignore_eos": True}
    status, body = call(server, "POST", "/completion", {"prompt": seq, "n_predict": n, "temperature": 0,
                                                         "return_tokens": True, **extra, **kw})
    assert status == 200 and body["tokens"] == want
    detok = ref.tokenizer.detokenizer()
    want_text = "".join(detok.feed(t) for t in want) + detok.finish()
    r = c.completions.create(model=MODEL, prompt=seq, max_tokens=n, temperature=0, extra_body=extra, **kw)
    assert r.choices[0].text == want_text
    for name in kw:
        _error(call(server, "POST", "/v1/completions", {"prompt": "x", name: 3}), 400, name)


def test_prompt_cache_reuses_whole_chunks(server, ref):
    """The same 40-token prompt twice: the second feeds only what is past the last whole -ub
    chunk (32 of 40 reused) and answers the same."""
    ids = [int(t) for t in np.random.default_rng(4).integers(2, ref.config.vocab_size, 40)]
    first = call(server, "POST", "/completion", {"prompt": ids, "n_predict": 6, "temperature": 0,
                                                 "return_tokens": True})[1]
    second = call(server, "POST", "/completion", {"prompt": ids + [5], "n_predict": 6, "temperature": 0,
                                                  "return_tokens": True})[1]
    assert second["timings"]["cache_n"] == 32 and second["timings"]["prompt_n"] == 9
    assert first["tokens"] == reference(ref, ids, 6)[0]
    assert second["tokens"] == reference(ref, ids + [5], 6)[0]


def test_sixteen_concurrent_clients(server, ref):
    texts = prompts(16, seed=5)
    c = client(server)

    def one(text):
        return c.completions.create(model=MODEL, prompt=text, max_tokens=8, temperature=0)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(one, texts))
    took = time.perf_counter() - t0
    for text, r in zip(texts, answers):
        ids = ref.tokenizer.encode(text)
        assert r.choices[0].text == reference(ref, ids, 8)[1], text
    status, slots = call(server, "GET", "/slots")
    assert not any(s["is_processing"] for s in slots)
    assert took < 60


def test_apply_template(server, ref):
    """llama-server's /apply-template: the prompt a chat request renders to (the file's template,
    tools in its system part), which /v1/chat/completions then counts as its prompt tokens."""
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    st, body = call(server, "POST", "/apply-template", {"messages": msgs})
    assert st == 200 and body["prompt"] == ref.chat_template("deepseek-r1").render(msgs)
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
    st, with_tools = call(server, "POST", "/apply-template", {"messages": msgs, "tools": [tool]})
    assert st == 200 and '"get_time"' in with_tools["prompt"].split("<｜User｜>")[0]
    got = client(server).chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, temperature=0)
    assert got.usage.prompt_tokens == len(ref.tokenizer.encode(body["prompt"], False))
    _error(call(server, "POST", "/apply-template", {"messages": msgs, "tools": "x"}), 400, "tools")


def test_a_final_assistant_message_is_continued(server, ref):
    """llama-server's (and ik_llama.cpp's) assistant prefill: a final assistant message is the start of
    the answer, continued, not a closed turn followed by another (a probe found no way to prefill).
    The prompt is the conversation before it with the generation prompt, then its text; the answer
    holds what follows it, greedy as /completion gives for those ids; the reasoning split knows a
    prefill that closed R1's <think>. `continue_final_message: false` (vLLM's) keeps it a turn."""
    msgs = [{"role": "user", "content": "hi"}]
    before = call(server, "POST", "/apply-template", {"messages": msgs})[1]["prompt"]
    pre = [*msgs, {"role": "assistant", "content": "Sure, "}]
    st, body = call(server, "POST", "/apply-template", {"messages": pre})
    from ikjax.runtime.text import render_chat
    r1 = ref.chat_template("deepseek-r1")
    assert st == 200 and body["prompt"] == before + "Sure, " == render_chat(ref, pre, r1)
    closed = call(server, "POST", "/apply-template", {"messages": pre, "continue_final_message": False})[1]["prompt"]
    assert closed == r1.render(pre) != body["prompt"]
    ids = call(server, "POST", "/tokenize", {"content": body["prompt"], "parse_special": True})[1]["tokens"]
    want = call(server, "POST", "/completion", {"prompt": ids, "n_predict": 8, "temperature": 0})[1]["content"]
    got = call(server, "POST", "/v1/chat/completions", {"messages": pre, "max_tokens": 8, "temperature": 0,
                                                        "reasoning_format": "none"})[1]
    assert got["choices"][0]["message"]["content"] == want, (got, want)
    assert got["usage"]["prompt_tokens"] == len(ids)
    assert ref.chat(pre, 8, chat_template=r1, reasoning_format="none").content == want  # the Python API's too
    # R1's generation prompt opens <think>: a prefill that closes it leaves an answer without reasoning
    done = [*msgs, {"role": "assistant", "content": "ok</think>\n\nThe answer:"}]
    got = call(server, "POST", "/v1/chat/completions", {"messages": done, "max_tokens": 8, "temperature": 0})[1]
    assert got["choices"][0]["message"].get("reasoning_content") is None, got
    _error(call(server, "POST", "/v1/chat/completions", {"messages": [*pre, pre[-1]], "max_tokens": 2}), 400,
           "two assistant messages")
    _error(call(server, "POST", "/v1/chat/completions", {"messages": pre, "continue_final_message": "yes"}), 400,
           "continue_final_message")


def test_tokenize_detokenize(server, ref):
    status, body = call(server, "POST", "/tokenize", {"content": "hello world", "with_pieces": True})
    ids = [p["id"] for p in body["tokens"]]
    assert ids == ref.tokenizer.encode("hello world", add_bos=False)
    assert "".join(p["piece"] for p in body["tokens"]) == "hello world"
    assert call(server, "POST", "/detokenize", {"tokens": ids}) == (200, {"content": "hello world"})
    # a piece that is not UTF-8 by itself (a byte token) comes as its byte values, as llama-server gives it
    text = "a\U0001F600\u4e2d b"
    pieces = call(server, "POST", "/tokenize", {"content": text, "with_pieces": True})[1]["tokens"]
    assert any(isinstance(p["piece"], list) for p in pieces), pieces
    joined = b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in pieces)
    assert joined == text.encode()
    # parse_special (llama-server's, default true): false keeps a special token's text as text
    special = ref.tokenizer.token_text(ref.tokenizer.bos_id) + "x"
    assert call(server, "POST", "/tokenize", {"content": special})[1]["tokens"][0] == ref.tokenizer.bos_id
    literal = call(server, "POST", "/tokenize", {"content": special, "parse_special": False})[1]["tokens"]
    assert literal == ref.tokenizer.encode(special, add_bos=False, parse_special=False) and ref.tokenizer.bos_id not in literal
    _error(call(server, "POST", "/tokenize", {"content": "x", "parse_special": "no"}), 400, "parse_special")


def test_metrics(server):
    from prometheus_client.parser import text_string_to_metric_families
    assert call(server, "POST", "/completion", {"prompt": "Hi", "n_predict": 2, "temperature": 0})[0] == 200
    status, text = call(server, "GET", "/metrics")
    assert status == 200
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams["ikjax_tokens_predicted"].samples[0].value > 0
    assert fams["ikjax_slots"].samples[0].value == NP
    assert fams["ikjax_requests_processing"].samples[0].value == 0
    assert "ikjax_requests_deferred" in fams and "ikjax_predicted_tokens_seconds" in fams
    done = {s.labels["reason"]: s.value for s in fams["ikjax_requests"].samples if s.name.endswith("_total")}
    assert done["max_tokens"] > 0
    # llama-server's own names too (a dashboard made for it reads this server), the same figures
    for ours, theirs in (("ikjax_tokens_predicted", "llamacpp:tokens_predicted"),
                         ("ikjax_prompt_tokens", "llamacpp:prompt_tokens"), ("ikjax_decode_steps", "llamacpp:n_decode"),
                         ("ikjax_requests_processing", "llamacpp:requests_processing")):
        assert fams[theirs].samples[0].value == fams[ours].samples[0].value, theirs
    assert "llamacpp:tokens_predicted_total" in text and "llamacpp:prompt_tokens_seconds " in text
    # llama-server's two throughput gauges cover the time since the previous scrape (its bucket
    # reset at each): work in between shows, a scrape right after shows none; ours keep the average
    st, _ = call(server, "POST", "/completion", {"prompt": "Hello", "n_predict": 4, "temperature": 0})
    assert st == 200
    fams = {f.name: f for f in text_string_to_metric_families(call(server, "GET", "/metrics")[1])}
    assert fams["llamacpp:predicted_tokens_seconds"].samples[0].value > 0
    assert fams["llamacpp:prompt_tokens_seconds"].samples[0].value > 0
    fams = {f.name: f for f in text_string_to_metric_families(call(server, "GET", "/metrics")[1])}
    assert fams["llamacpp:predicted_tokens_seconds"].samples[0].value == 0
    assert fams["ikjax_predicted_tokens_seconds"].samples[0].value > 0


def test_expert_stats_endpoint(server, tiny_model, tmp_path):
    """GET /expert-stats: with --expert-stats FILE.json the counts so far, in the file's form (a
    client keeps them should the server die before writing the file), the file written at the end;
    without it a 404 JSON error."""
    status, body = call(server, "GET", "/expert-stats")
    assert status == 404 and "--expert-stats" in body["error"]["message"]
    f = tmp_path / "s.json"
    s = Proc(tiny_model, "-c", "512", "-np", "2", "-ub", str(UB), "--temp", "0", "--expert-stats", str(f))
    try:
        status, ans = call(s, "POST", "/completion", {"prompt": "alpha beta gamma", "n_predict": 6})
        assert status == 200, ans
        status, st = call(s, "GET", "/expert-stats")
        assert status == 200 and set(st) == {"tokens", "layers"} and st["layers"]
        fed = ans["tokens_evaluated"] + ans["tokens_predicted"] - 1  # the last token is never fed
        assert st["tokens"] == fed, (st["tokens"], ans["tokens_evaluated"], ans["tokens_predicted"])
    finally:
        s.stop()
    assert json.loads(f.read_text()) == st


# -- errors --------------------------------------------------------------------------------------

def _error(status_body, status: int, needle: str):
    status_got, body = status_body
    assert status_got == status, body
    assert set(body["error"]) >= {"message", "type", "code"} and body["error"]["code"] == status
    assert needle in body["error"]["message"], body


def test_logit_bias(server, ref):
    """OpenAI's logit_bias (object of id strings) and llama-server's (list of [id, bias | false]):
    +100 on one id makes a greedy answer that id alone; a ban (false, or -100) keeps the greedy
    answer's first token out of it, on the device argmax path too."""
    ids = [int(t) for t in np.random.default_rng(7).integers(3, ref.config.vocab_size, 9)]
    plain, _ = reference(ref, ids, 4)
    t = next(x for x in range(3, 100) if x not in plain and x != ref.config.eos_token_id)
    c = client(server)
    got = c.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, logit_bias={str(t): 100})
    assert got.choices[0].text == ref.tokenizer.decode([t] * 4)
    for bias in ([[plain[0], False]], {str(plain[0]): -100}):
        st, body = call(server, "POST", "/completion", {"prompt": ids, "n_predict": 2, "temperature": 0,
                                                        "logit_bias": bias, "return_tokens": True})
        assert st == 200 and body["tokens"][0] != plain[0], bias


def test_bad_requests_are_400(server):
    _error(call(server, "POST", "/v1/completions", raw=b"{not json"), 400, "not valid JSON")
    _error(call(server, "POST", "/v1/completions", ["a list"]), 400, "JSON object")
    _error(call(server, "POST", "/v1/completions", {"prompt": "x", "temperature": "hot"}), 400, "temperature")
    _error(call(server, "POST", "/v1/completions", {"prompt": "x", "max_tokens": -5}), 400, "max_tokens")
    _error(call(server, "POST", "/v1/completions", {"max_tokens": 2}), 400, "prompt")
    _error(call(server, "POST", "/v1/completions", {"prompt": [1, 10 ** 9]}), 400, "outside the vocabulary")
    _error(call(server, "POST", "/v1/completions", {"prompt": "x", "n": 2}), 400, "one choice")
    _error(call(server, "POST", "/v1/completions", {"prompt": "x", "logit_bias": {"999999999": 5}}), 400, "token id")
    _error(call(server, "POST", "/v1/completions", {"prompt": "x", "logit_bias": {"7": "up"}}), 400, "logit_bias")
    _error(call(server, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                          "response_format": {"type": "json_object"}}),
           400, "response_format")
    _error(call(server, "POST", "/v1/chat/completions", {"messages": []}), 400, "messages")
    _error(call(server, "POST", "/v1/chat/completions",
                {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), 400, "only text")
    _error(call(server, "POST", "/v1/completions", {"prompt": [5] * CTX}), 400, "context")  # too long for a slot
    _error(call(server, "POST", "/detokenize", {"tokens": [-1]}), 400, "vocabulary")
    _error(call(server, "POST", "/v1/completions", raw=b"x" * (33 << 20)), 413, "MiB")
    # JSON's words, not Python's (a probe, stop 67: "got NoneType", "use sys.set_int_max_str_digits()")
    _error(call(server, "POST", "/v1/completions", raw=b"null"), 400, "expected a JSON object, got null")
    _error(call(server, "POST", "/v1/completions", {"prompt": 5}), 400, "got a number")
    status, body = call(server, "POST", "/completion", raw=b'{"prompt": "x", "n_predict": ' + b"9" * 5000 + b"}")
    _error((status, body), 400, "more than 4300 digits")
    assert "sys." not in body["error"]["message"]
    # a temperature past float32's range: every id equally likely, answered without NumPy's overflow warning
    n0 = len(server.lines)
    assert call(server, "POST", "/completion", {"prompt": "x", "n_predict": 2, "temperature": 1e308})[0] == 200
    time.sleep(0.2)
    assert not any("Warning" in ln for ln in server.lines[n0:]), server.lines[n0:]
    # found by an outside probe (were 500s, or a silent no-op):
    _error(call(server, "POST", "/v1/completions", raw=b"[" * 100000 + b"]" * 100000), 400, "nested too deeply")
    _error(call(server, "POST", "/v1/completions", raw=b"abcde", headers={"Content-Encoding": "gzip"}), 400,
           "content-encoding")  # (aiohttp's reason in full; it said "400, message:")
    time.sleep(0.3)  # and aiohttp's own log of it (three tracebacks, "Unhandled exception") is dropped
    assert not any("Unhandled exception" in line or "Traceback" in line for line in server.lines), server.lines[-20:]
    _error(call(server, "POST", "/v1/completions", {"prompt": "x", "repeat_penalty": 1e308}), 400, "repeat_penalty")
    _error(call(server, "POST", "/completion", {"prompt": "x", "grammar": 'root ::= "yes"'}), 400, "grammar")
    _error(call(server, "POST", "/completion", {"prompt": "x", "json_schema": {"type": "object"}}), 400, "json_schema")
    _error(call(server, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                          "chat_template_kwargs": {"messages": []}}),
           400, "chat_template_kwargs.messages")
    # a second outside probe: samplers and limits not run here were answered as if not asked for
    for field, value in (("mirostat", 2), ("typical_p", 0.9), ("dry_multiplier", 0.8), ("xtc_probability", 0.5),
                         ("top_n_sigma", 1.5), ("dynatemp_range", 0.3), ("min_keep", 3), ("t_max_predict_ms", 500),
                         ("n_indent", 4)):
        _error(call(server, "POST", "/completion", {"prompt": "x", "n_predict": 1, field: value}), 400, field)
    _error(call(server, "POST", "/completion", {"prompt": "x", "samplers": ["temperature", "top_k"]}), 400, "samplers")
    _error(call(server, "POST", "/completion", {"prompt": "x", "samplers": ["foo", "top_k"]}), 400, "foo")
    _error(call(server, "POST", "/v1/completions", {"prompt": "x", "suffix": " after"}), 400, "suffix")
    _error(call(server, "POST", "/v1/completions", {"prompt": "x", "best_of": 2}), 400, "best_of")
    # a third probe (stop 67): on chat and /completion best_of was ignored; llama-server's images on
    # /completion were dropped unread; a prompt time limit was ignored
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    _error(call(server, "POST", "/v1/chat/completions", {**chat, "best_of": 2}), 400, "best_of")
    for field, value in (("best_of", 3), ("image_data", [{"data": "AAAA", "id": 1}]),
                         ("multimodal_data", ["AAAA"]), ("t_max_prompt_ms", 100)):
        _error(call(server, "POST", "/completion", {"prompt": "x", "n_predict": 1, field: value}), 400, field)
    # echo with logprobs: OpenAI lists the prompt's tokens too, which are not computed here (it answered
    # with the answer's alone)
    _error(call(server, "POST", "/v1/completions", {"prompt": "x", "echo": True, "logprobs": 2}), 400, "echo")
    for keep in ("a", 1.5, -2, True):  # n_keep: an integer >= -1 (a third probe: "a" was answered 200)
        _error(call(server, "POST", "/completion", {"prompt": "x", "n_predict": 1, "n_keep": keep}), 400, "n_keep")
    assert call(server, "POST", "/completion", {"prompt": "x", "n_predict": 1, "n_keep": -1})[0] == 200
    # their off values (what llama-server's own clients send by default) are fine
    offs = {"mirostat": 0, "typical_p": 1.0, "dry_multiplier": 0.0, "xtc_probability": 0.0, "top_n_sigma": 0.0,
            "dynatemp_range": 0.0, "min_keep": 0, "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"],
            "best_of": 1, "suffix": "", "t_max_predict_ms": -1, "t_max_prompt_ms": -1, "image_data": []}
    assert call(server, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 1, **offs})[0] == 200
    # the server is fine afterwards
    assert call(server, "POST", "/completion", {"prompt": "ok", "n_predict": 2})[0] == 200


def test_ik_web_ui_requests_and_ik_fields(server):
    """What ik_llama.cpp's own web UI sends with every message (an outside probe, stop 65: refused with
    a 400 before): its sampler string "kdypmxntw" and the settings of the samplers not run here at
    ik's off values (top_n_sigma 0, typical_p / tfs_z 1 or above, dynatemp_range 0 or below, an
    adaptive target below 0, XTC at a threshold above 0.5). ik's fields that would change the answer
    are refused, never ignored; the penalties run whether `samplers` names them or not (ik applies
    them before its chain); a temperature below 0 is greedy; logit_bias takes text as ik does (each
    of its tokens biased)."""
    msgs = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "hi"}]
    webui = {"messages": msgs, "stream": False, "cache_prompt": True, "reasoning_format": "auto",
             "samplers": "kdypmxntw", "dynatemp_range": 0.0, "dynatemp_exponent": 1.0, "xtc_probability": 0.0,
             "xtc_threshold": 0.1, "top_n_sigma": 0.0, "repeat_last_n": 64, "repeat_penalty": 1.0,
             "presence_penalty": 0.0, "frequency_penalty": 0.0, "dry_multiplier": 0.0, "dry_base": 1.75,
             "dry_allowed_length": 2, "dry_penalty_last_n": -1, "max_tokens": 4, "adaptive_target": -1.0,
             "adaptive_decay": 0.9, "timings_per_token": False, "temperature": 0.8, "top_k": 40, "top_p": 0.95,
             "min_p": 0.05, "typical_p": 1.0}
    status, out = call(server, "POST", "/v1/chat/completions", webui)
    assert status == 200 and out["choices"][0]["finish_reason"] in ("length", "stop"), out
    status, out = call(server, "POST", "/v1/completions", {**{k: v for k, v in webui.items() if k != "messages"},
                                                           "prompt": "hi"})
    assert status == 200, out
    base = {"prompt": "the same words the same words", "n_predict": 6, "temperature": 0, "return_tokens": True}
    greedy = call(server, "POST", "/completion", base)[1]["tokens"]
    for extra in ({"samplers": ["dry", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]},
                  {"typical_p": 1.5, "tfs_z": 1.5, "dynatemp_range": -1, "top_n_sigma": -0.5},
                  {"xtc_probability": 0.5, "xtc_threshold": 0.9}, {"temperature": -1}):
        status, out = call(server, "POST", "/completion", {**base, **extra})
        assert status == 200 and out["tokens"] == greedy, (extra, out)
    for field, value in (("adaptive_target", 0.5), ("banned_strings", ["#"]), ("banned_regex", ["a+"]),
                         ("penalty_prompt", [1, 2]), ("system_prompt", "be brief"), ("top_n_sigma", 0.5)):
        _error(call(server, "POST", "/completion", {**base, field: value}), 400, field)
    # the penalties run with a chain that does not name them (settings that change this prompt's answer)
    seq = call(server, "POST", "/tokenize", {"content": base["prompt"], "add_special": True})[1]["tokens"]
    for _ in range(160):  # the prompt grown by greedy's choice until that choice is in it: a penalty then acts
        t = call(server, "POST", "/completion", {**base, "prompt": seq, "n_predict": 1})[1]["tokens"][0]
        if t in seq:
            break
        seq.append(t)
    else:
        raise AssertionError("no greedy repeat within 160 tokens: pick another prompt")
    pen = {**base, "prompt": seq, "repeat_penalty": 1.5, "frequency_penalty": 1.0, "repeat_last_n": -1}
    with_pen = call(server, "POST", "/completion", pen)[1]["tokens"]
    assert with_pen != call(server, "POST", "/completion", {**base, "prompt": seq})[1]["tokens"]
    for chain in ("kt", "top_k;temperature", ["top_k", "temperature"], "kkt", "dkypmxts"):
        assert call(server, "POST", "/completion", {**pen, "samplers": chain})[1]["tokens"] == with_pen, chain
    _error(call(server, "POST", "/completion", {**base, "samplers": "top_k;foo"}), 400, "foo")
    for ok in ({"system_prompt": ""}, {"min_keep": 1}):
        assert call(server, "POST", "/completion", {**base, **ok})[0] == 200, ok
    # logit_bias by text: each of the text's tokens, as the same ids would
    word = call(server, "POST", "/detokenize", {"tokens": greedy[:1]})[1]["content"]  # greedy's first token's text
    ids = call(server, "POST", "/tokenize", {"content": word, "add_special": False})[1]["tokens"]
    by_id = call(server, "POST", "/completion", {**base, "logit_bias": [[t, -100] for t in ids]})[1]["tokens"]
    assert not set(ids) & set(by_id) and (by_id != greedy or greedy[0] not in ids)
    for bias in ({word: -100}, [[word, -100]], [[word, False]]):
        assert call(server, "POST", "/completion", {**base, "logit_bias": bias})[1]["tokens"] == by_id, bias
    # digits are ASCII digits ("²" is text, a 500 before); in the list form any string is text, as in ik
    assert call(server, "POST", "/completion", {**base, "logit_bias": {"²": -1}})[0] == 200
    tid = call(server, "POST", "/tokenize", {"content": "42", "add_special": False})[1]["tokens"]
    as_text = call(server, "POST", "/completion", {**base, "logit_bias": [["42", -100]]})[1]["tokens"]
    assert as_text == call(server, "POST", "/completion", {**base, "logit_bias": [[t, -100] for t in tid]})[1]["tokens"]
    _error(call(server, "POST", "/completion", {**base, "logit_bias": {"x" * 70000: -1}}), 400, "logit_bias")
    # the figures ik's web UI shows as the context's use
    t = call(server, "POST", "/completion", base)[1]["timings"]
    assert t["n_ctx"] == CTX and t["n_past"] == len(call(server, "POST", "/tokenize", {
        "content": base["prompt"], "add_special": True})[1]["tokens"]) + 5, t  # (as tokens_cached: the last not in)
    props = call(server, "GET", "/v1/props")[1]
    assert props["n_ctx"] == CTX and props["model_name"] and props["total_slots"] == NP


def test_several_prompts_in_one_request(server):
    """OpenAI's batch form on /v1/completions (a choice a prompt, by index) and llama-server's on
    /completion (a list of answers, each with its index; ik_llama.cpp runs a task a prompt): each
    answer equals the same prompt sent alone (greedy), usage sums them; a list holding an id is one
    prompt (llama-server's mixed form); past 16 prompts, a 400 naming the prompt. Streamed (the
    OpenAI client's and llama-server's streams; each event names its prompt's index): each index's
    pieces make the same answer, each ends with its own finish_reason, usage counts them all."""
    texts = prompts(3, seed=11)
    alone = [call(server, "POST", "/completion", {"prompt": t, "n_predict": 5, "temperature": 0})[1] for t in texts]
    status, out = call(server, "POST", "/completion", {"prompt": texts, "n_predict": 5, "temperature": 0})
    assert status == 200 and isinstance(out, list) and [o["index"] for o in out] == [0, 1, 2]
    assert [o["content"] for o in out] == [a["content"] for a in alone]
    assert [o["tokens_evaluated"] for o in out] == [a["tokens_evaluated"] for a in alone]
    ids = call(server, "POST", "/tokenize", {"content": texts[0], "add_special": True})[1]["tokens"]
    status, out = call(server, "POST", "/v1/completions", {"prompt": [texts[1], ids], "max_tokens": 5,
                                                           "temperature": 0, "echo": True})
    assert status == 200 and [c["index"] for c in out["choices"]] == [0, 1], out
    assert out["choices"][0]["text"] == texts[1] + alone[1]["content"]
    assert out["choices"][1]["text"].endswith(alone[0]["content"])
    assert out["usage"]["prompt_tokens"] == alone[1]["tokens_evaluated"] + len(ids)
    assert out["usage"]["completion_tokens"] == alone[0]["tokens_predicted"] + alone[1]["tokens_predicted"]
    mixed = call(server, "POST", "/completion", {"prompt": [ids[0], texts[0][:5]], "n_predict": 2})
    assert mixed[0] == 200 and isinstance(mixed[1], dict)  # ids and text in one list: one prompt
    chunks = list(client(server).completions.create(model=MODEL, prompt=texts, max_tokens=5, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}))
    by_index: dict[int, list] = {}
    for ch in chunks[:-1]:
        assert len(ch.choices) == 1, ch
        by_index.setdefault(ch.choices[0].index, []).append(ch.choices[0])
    assert sorted(by_index) == [0, 1, 2]
    for i, parts in by_index.items():
        assert "".join(p.text for p in parts) == alone[i]["content"]
        assert [p.finish_reason for p in parts][-1] in ("stop", "length")
        assert all(p.finish_reason is None for p in parts[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == sum(a["tokens_predicted"] for a in alone)
    status, sse = call(server, "POST", "/completion", {"prompt": texts, "n_predict": 5, "temperature": 0,
                                                       "stream": True})
    events = [json.loads(ln[6:]) for ln in sse.splitlines() if ln.startswith("data: ")]
    assert status == 200 and "[DONE]" not in sse  # (llama-server's /completion: no [DONE])
    for i in range(3):
        mine = [e for e in events if e["index"] == i]
        assert "".join(e["content"] for e in mine) == alone[i]["content"]
        assert [e["stop"] for e in mine].count(True) == 1 and mine[-1]["stop"]
        assert mine[-1]["tokens_predicted"] == alone[i]["tokens_predicted"]
    _error(call(server, "POST", "/completion", {"prompt": ["a"] * 17, "n_predict": 1}), 400, "at most 16")
    _error(call(server, "POST", "/completion", {"prompt": ["a", []], "n_predict": 1}), 400, "prompt[1]")
    # a bad prompt late in the list: the 400 names it, and no prompt of the list ran (every one is
    # checked before any starts); a setting's error is not pinned on a prompt
    before = call(server, "GET", "/metrics")[1]
    _error(call(server, "POST", "/completion", {"prompt": [texts[0], texts[1], [10**7]], "n_predict": 4}), 400,
           "prompt[2]: token id 10000000")
    _error(call(server, "POST", "/v1/completions", {"model": MODEL, "prompt": [texts[0], [1] * CTX],
                                                    "max_tokens": 4}), 400, "prompt[1]:")
    _error(call(server, "POST", "/completion", {"prompt": texts[:2], "n_predict": 4, "top_p": 7}), 400, "top_p")
    after = call(server, "GET", "/metrics")[1]
    counted = [ln for ln in before.splitlines() if ln.startswith(("ikjax_prompt_tokens_total", "ikjax_requests_total"))]
    assert counted and counted == [ln for ln in after.splitlines() if ln.startswith(
        ("ikjax_prompt_tokens_total", "ikjax_requests_total"))], (before, after)


def _raw_http(s: Proc, data: bytes) -> tuple[str, bytes]:
    """(status line, body) of bytes sent as they are (what http.client will not send)."""
    import socket
    with socket.create_connection((s.host, int(s.port)), timeout=30) as sock:
        sock.sendall(data)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
    head, _, body = out.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0].decode(), body


def test_connections_closed_by_their_clients_are_closed(server):
    """An outside probe (stop 68): every keep-alive connection that its client closed between requests
    (curl, requests, http.client: each an ordinary request) stayed in CLOSE-WAIT, one descriptor a
    request, until the process ran out of them and stopped answering. 60 such connections leave the
    server's descriptors where they were."""
    import http.client
    fds = Path(f"/proc/{server.p.pid}/fd")
    if not fds.exists():
        pytest.skip("no /proc here: the descriptors are read there")

    def one() -> None:
        c = http.client.HTTPConnection(server.host, int(server.port), timeout=30)
        c.request("GET", "/health")
        assert c.getresponse().read() and True
        c.close()
    one()
    time.sleep(0.3)
    before = len(list(fds.iterdir()))
    for _ in range(60):
        one()
    t0 = time.time()
    while len(list(fds.iterdir())) > before + 5 and time.time() - t0 < 10:
        time.sleep(0.1)
    assert len(list(fds.iterdir())) <= before + 5, (before, len(list(fds.iterdir())))
    assert call(server, "GET", "/health")[0] == 200


def test_a_client_that_shuts_its_side_after_sending_gets_its_answers(server):
    """`printf 'POST ...' | nc -N host port`: the client shuts its writing side down once its request
    is sent. aiohttp closed such a connection on the EOF before any handler answered (stops 62-63:
    no answer at all). Now each whole request that came is answered, pipelined ones too, and then the
    connection closes; a body cut short by the EOF still gets the connection closed, unanswered, and
    the server goes on."""
    import socket
    body = json.dumps({"prompt": "hi", "n_predict": 2}).encode()
    req = b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(
        body) + body

    def half_closed(data: bytes) -> bytes:
        with socket.create_connection((server.host, int(server.port)), timeout=60) as sock:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            out = b""
            while chunk := sock.recv(65536):  # ends when the server closes (a timeout fails the test)
                out += chunk
        return out
    one = half_closed(req)
    assert one.startswith(b"HTTP/1.1 200") and json.loads(one.partition(b"\r\n\r\n")[2])["tokens_predicted"] == 2
    assert half_closed(req * 2).count(b"HTTP/1.1 200 OK") == 2
    assert half_closed(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro") == b""
    assert call(server, "GET", "/health")[0] == 200


def test_a_gone_client_of_a_non_streamed_request_frees_its_slot(small):
    """A client that closes its socket while its non-streamed request generates (an openai client's
    timeout, then its retries: an outside probe, stop 65): the request ran on to its end, up to the
    slot's context, its slot busy meanwhile. The server cannot tell that FIN from a client that only
    shut its writing side (which reads the answer: the test above) until it writes; it now writes an
    interim `100 Continue` while the answer has not started, the closed socket's reset ends the
    connection, and the job is cancelled: the slot is free within seconds, counted as cancelled."""
    import socket
    auth = {"Authorization": "Bearer sekret"}
    cancelled0 = _counter(small, "ikjax_requests_total", {"reason": "cancelled"})
    body = json.dumps({"prompt": "Hello there", "n_predict": 8000, "ignore_eos": True}).encode()
    sock = socket.create_connection((small.host, int(small.port)), timeout=30)
    sock.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekret\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    time.sleep(0.4)
    assert call(small, "GET", "/slots", headers=auth)[1][0]["is_processing"]
    sock.close()
    t0 = time.perf_counter()
    while call(small, "GET", "/slots", headers=auth)[1][0]["is_processing"]:
        assert time.perf_counter() - t0 < 10, "the slot stayed busy after its client had gone"
        time.sleep(0.1)
    assert _counter(small, "ikjax_requests_total", {"reason": "cancelled"}) == cancelled0 + 1
    # a client that only shut its writing side, whose answer takes longer than the probe's first second:
    # interim 100s, then its answer
    body = json.dumps({"prompt": "Hello there", "n_predict": 1500}).encode()
    with socket.create_connection((small.host, int(small.port)), timeout=60) as sock:
        sock.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekret\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        sock.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
    head, _, rest = out.partition(b"HTTP/1.1 200 OK")
    assert rest and set(head.split(b"\r\n\r\n")) <= {b"HTTP/1.1 100 Continue", b""}, out[:300]
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["tokens_predicted"] > 0


def test_a_second_interrupt_forces_the_exit_cleanly(tiny_model):
    """Ctrl-C twice: the first starts the clean shutdown, the second forces the exit at once (status 130,
    or death by SIGINT once the command has handed the signal back: a shell shows 130 for both), never a
    traceback (an outside probe, stop 65: a KeyboardInterrupt from JAX's atexit callback)."""
    import signal
    for gap in (0.02, 0.1):
        s = Proc(tiny_model, "-c", "512", "-np", "1")
        s.p.send_signal(signal.SIGINT)
        time.sleep(gap)
        if s.p.poll() is None:
            s.p.send_signal(signal.SIGINT)
        # 0: the first one's clean exit came first; 130 / death by SIGINT (a shell's 130 both): forced
        assert s.p.wait(30) in (0, 130, -signal.SIGINT), (gap, s.p.returncode, "".join(s.lines[-10:]))
        time.sleep(0.2)
        assert not any("Traceback" in x or "Exception ignored" in x for x in s.lines), s.lines[-10:]


def test_http_1_0_streams_end_and_expect_is_answered_as_json(server):
    """An outside probe (stop 64, RESULTS §23af): an HTTP/1.0 client asking for keep-alive got its
    stream's `[DONE]` and then waited for the keep-alive timeout (HTTP/1.0 has no chunked framing:
    the stream ends with the connection); an unknown Expect value was a text/plain 417; a client
    gone right after its `Expect: 100-continue` headers, or right after a streaming request, logged
    a traceback each time."""
    import socket
    body = json.dumps({"prompt": "hi", "max_tokens": 3, "stream": True}).encode()
    t0 = time.perf_counter()
    with socket.create_connection((server.host, int(server.port)), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.0\r\nConnection: keep-alive\r\nContent-Length: %d\r\n\r\n" % len(body)
                     + body)
        out = b""
        while chunk := sock.recv(65536):  # the server closes once the stream is done
            out += chunk
    assert out.startswith(b"HTTP/1.0 200") and out.rstrip().endswith(b"data: [DONE]") and time.perf_counter() - t0 < 30
    line, answer = _raw_http(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 200-foo\r\n"
                                     b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
    assert line.startswith("HTTP/1.1 417") and "only 100-continue" in json.loads(answer)["error"]["message"]
    before = sum("Traceback" in ln for ln in server.lines)
    for head in (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5000\r\n\r\n",
                 b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body):
        for _ in range(10):
            with socket.create_connection((server.host, int(server.port)), timeout=30) as sock:
                sock.sendall(head)
    time.sleep(1)
    assert sum("Traceback" in ln for ln in server.lines) == before, "".join(server.lines[-30:])
    assert call(server, "POST", "/completion", {"prompt": "ok", "n_predict": 2})[0] == 200


def test_fourth_probe_huge_and_deep_and_malformed_requests(server):
    """An outside probe of the HTTP side (stop 62): an 8 MB prompt was tokenized in full (20 s on a
    2-core host, the tokenizer holding the GIL) before it was found too long, while /health and
    every other stream waited; JSON nested 480 deep in a chat message was a 500 with a 2,900-line
    traceback; a request aiohttp's parser refuses was a text/plain answer and a logged traceback;
    a logit_bias banning every token drew banned tokens."""
    import threading
    answers = {}
    big = {"prompt": "ab " * ((8 << 20) // 3), "max_tokens": 1}
    t = threading.Thread(target=lambda: answers.update(big=call(server, "POST", "/v1/completions", big)))
    t0 = time.perf_counter()
    t.start()
    status, _ = call(server, "GET", "/health")
    t.join(60)
    assert status == 200 and time.perf_counter() - t0 < 10
    _error(answers["big"], 400, "characters cannot fit a slot's context")
    deep = "[" * 480 + "]" * 480
    _error(call(server, "POST", "/v1/chat/completions", raw=(
        '{"messages":[{"role":"user","content":"hi","x":' + deep + '}],"max_tokens":1}').encode()), 400,
        "messages[0]: nested deeper than 64 levels")
    n0 = len(server.lines)
    # a header past the limit: 431 (RFC 6585), its text (an Authorization key, say) neither answered nor logged
    for data, needle, code in (
            (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\nab\r\n0\r\n\r\n",
             b"chunk size", 400),
            (b"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + b"k" * 9000 + b"\r\n\r\n", b"8190 bytes", 431)):
        line, body = _raw_http(server, data)
        assert f" {code} " in line, (line, body[:300])
        err = json.loads(body)["error"]
        assert err["code"] == code and needle.decode() in err["message"] and err["message"].startswith("malformed HTTP")
        assert "kkkk" not in err["message"]
    time.sleep(0.3)
    logged = server.lines[n0:]
    assert not any("Traceback" in ln for ln in logged) and sum("malformed HTTP request" in ln for ln in logged) == 2, \
        logged[-10:]
    assert not any("kkkk" in ln for ln in logged), logged[-10:]
    # a Content-Length past the limit: the 413 at once, not a wait for a body that never comes (--timeout's 408)
    with socket.create_connection((server.host, int(server.port)), timeout=30) as sock:
        t0 = time.perf_counter()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 99999999999\r\n\r\n{")
        head = sock.recv(65536)
        assert head.startswith(b"HTTP/1.1 413") and time.perf_counter() - t0 < 5, head[:200]
    _error(call(server, "POST", "/completion", {"prompt": "hi", "n_predict": 2,
                                                "logit_bias": [[i, False] for i in range(1024)]}), 400, "bans every token")
    assert call(server, "POST", "/completion", {"prompt": "ok", "n_predict": 2})[0] == 200


def test_no_reasoning_field_for_no_reasoning(server):
    """n_predict 0 under R1's template (the prompt opened <think>): no reasoning came, so no
    reasoning_content (it was ""), as an answer whose <think> block is empty has none. (OpenAI's
    max_tokens 0 is a 400; llama-server's n_predict 0 evaluates the prompt only.)"""
    assert call(server, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 0})[0] == 400
    body = call(server, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                         "n_predict": 0})[1]
    msg = body["choices"][0]["message"]
    assert "reasoning_content" not in msg and msg["content"] == "", msg


def test_mixed_prompt_as_llama_server(server, ref):
    """llama-server's mixed prompt, ids and texts in one list: each text encoded in place, a BOS only
    where the list starts with a text (it was a 400)."""
    tok = ref.tokenizer
    for prompt, want in ((["hello", 7, 8, " world"], tok.encode("hello") + [7, 8] + tok.encode(" world", False)),
                         ([7, "hello"], [7] + tok.encode("hello", False))):
        st, body = call(server, "POST", "/completion", {"prompt": prompt, "n_predict": 2, "temperature": 0})
        assert st == 200 and body["tokens_evaluated"] == len(want), (prompt, body)
        same = call(server, "POST", "/completion", {"prompt": want, "n_predict": 2, "temperature": 0})[1]
        assert body["content"] == same["content"] and body["prompt"] == prompt  # echoed as given (ik's)
    _error(call(server, "POST", "/completion", {"prompt": [7, None]}), 400, "prompt")
    # id_slot: -1 or a slot that exists (a slot past -np ran on slot 0)
    _error(call(server, "POST", "/completion", {"prompt": "x", "id_slot": NP}), 400, "id_slot")
    assert call(server, "POST", "/completion", {"prompt": "x", "n_predict": 1, "id_slot": NP - 1})[0] == 200


def test_random_seed_is_reported_and_redoes_the_answer(server):
    """A request without a seed samples with one drawn for it, and generation_settings says which
    (it was null): sent back, that seed gives the same answer, as llama-server's reported seed."""
    body = {"prompt": "tell me a story", "n_predict": 8, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
            "min_p": 0.0}
    a = call(server, "POST", "/completion", body)[1]
    seed = a["generation_settings"]["seed"]
    assert isinstance(seed, int) and 0 <= seed < 2**32
    b = call(server, "POST", "/completion", {**body, "seed": seed})[1]
    assert b["content"] == a["content"] and b["generation_settings"]["seed"] == seed


def test_penalty_last_n_developer_role_first_delta_and_timings(server, ref):
    """mainline llama-server's `penalty_last_n` is `repeat_last_n`; OpenAI's `developer` role is the
    system prompt for a template that has none (DeepSeek's dropped the message); the first streamed
    chat delta holds content "" as OpenAI's; timings' rate x time = tokens, as llama-server's."""
    body = {"prompt": "the same words the same words", "n_predict": 6, "temperature": 0, "repeat_penalty": 1.5}
    a = call(server, "POST", "/completion", {**body, "penalty_last_n": 0})[1]
    b = call(server, "POST", "/completion", {**body, "repeat_last_n": 0})[1]
    c = call(server, "POST", "/completion", {**body, "repeat_last_n": 64})[1]
    assert a["generation_settings"]["repeat_last_n"] == 0 == b["generation_settings"]["repeat_last_n"]
    assert a["content"] == b["content"] and c["generation_settings"]["repeat_last_n"] == 64
    t = c["timings"]
    assert abs(t["predicted_per_second"] * t["predicted_ms"] / 1e3 - t["predicted_n"]) < 1e-6 * t["predicted_n"]
    msgs = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    got = call(server, "POST", "/apply-template", {"messages": msgs})[1]["prompt"]
    assert got == ref.chat_template("deepseek-r1").render([{"role": "system", "content": "Be brief."}, msgs[1]])
    parts = list(client(server).chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0,
                                                        stream=True))
    assert parts[0].choices[0].delta.role == "assistant" and parts[0].choices[0].delta.content == ""


def test_timings_per_token(server):
    """llama-server's `timings_per_token`: every streamed /completion event and chat chunk carries the
    request's timings so far (predicted_n counting up); without it the stream's events have none
    before the last."""
    def events(path, body):
        c = http.client.HTTPConnection(server.host, int(server.port), timeout=120)
        c.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = c.getresponse()
        out = [json.loads(ln[6:]) for ln in r.read().decode().splitlines()
               if ln.startswith("data: ") and ln != "data: [DONE]"]
        c.close()
        return out
    ev = events("/completion", {"prompt": "count with me", "n_predict": 6, "temperature": 0, "ignore_eos": True,
                                "stream": True, "timings_per_token": True, "return_tokens": True})
    counts = [e["timings"]["predicted_n"] for e in ev]
    assert len(ev) >= 6 and counts == sorted(counts) and counts[-1] == 6, counts
    plain = events("/completion", {"prompt": "count with me", "n_predict": 6, "temperature": 0, "stream": True})
    assert all("timings" not in e for e in plain[:-1]) and "timings" in plain[-1]
    chunks = events("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                             "temperature": 0, "stream": True, "timings_per_token": True})
    assert chunks and all("timings" in c for c in chunks if c.get("choices"))
    _error(call(server, "POST", "/completion", {"prompt": "x", "timings_per_token": 1}), 400, "timings_per_token")


def test_null_fields_are_absent_and_template_kwargs(server):
    """null, as OpenAI's clients send for a field not given, is the default for every field (the
    penalties and reasoning_format were 400s); chat_template_kwargs' add_generation_prompt is honoured
    (a 500 before: "multiple values for keyword argument")."""
    msgs = [{"role": "user", "content": "hi"}]
    nulls = {"frequency_penalty": None, "presence_penalty": None, "reasoning_format": None, "temperature": None,
             "top_p": None, "stop": None, "seed": None, "max_tokens": 3}
    status, body = call(server, "POST", "/v1/chat/completions", {"messages": msgs, **nulls})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] <= 3
    with_gen = call(server, "POST", "/apply-template", {"messages": msgs})[1]["prompt"]
    without = call(server, "POST", "/apply-template", {"messages": msgs,
                                                      "chat_template_kwargs": {"add_generation_prompt": False}})
    assert without[0] == 200 and with_gen.startswith(without[1]["prompt"]) and with_gen != without[1]["prompt"]


def test_cors(server):
    """A browser page from another origin can call the API: the preflight is answered (no key asked),
    every answer names the origin, streams too."""
    origin = "http://example.com"
    c = http.client.HTTPConnection(server.host, int(server.port), timeout=60)
    c.request("OPTIONS", "/v1/chat/completions", headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                                          "Access-Control-Request-Headers": "content-type"})
    r = c.getresponse()
    r.read()
    assert r.status == 204 and r.getheader("Access-Control-Allow-Origin") == origin
    assert "POST" in r.getheader("Access-Control-Allow-Methods")
    assert r.getheader("Access-Control-Allow-Headers") == "content-type"
    for body in ({"prompt": "x", "n_predict": 2}, {"prompt": "x", "n_predict": 2, "stream": True}):
        c.request("POST", "/completion", body=json.dumps(body), headers={"Origin": origin})
        r = c.getresponse()
        r.read()
        assert r.status == 200 and r.getheader("Access-Control-Allow-Origin") == origin, body
    c.close()
    assert "Access-Control-Allow-Origin" not in dict(urllib.request.urlopen(server.url + "/health").headers)


def test_unknown_route_is_404_and_any_model_name_is_served(server):
    """A request's `model` may be any name (clients send placeholders like "gpt-3.5-turbo"): the one
    model answers and the name is echoed, as llama-server does (a 404 broke such clients)."""
    _error(call(server, "GET", "/v2/nothing"), 404, "no such endpoint")
    _error(call(server, "GET", "/"), 404, "--no-webui")
    r = client(server).completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert r.model == "gpt-4" and r.usage.completion_tokens >= 1
    c = client(server).chat.completions.create(model="gpt-3.5-turbo", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2)
    assert c.model == "gpt-3.5-turbo"
    _error(call(server, "GET", "/v1/completions"), 405, "not allowed")


def test_slots_by_id_erase_models_by_id_embeddings_allow(server):
    """llama-server's id_slot runs a request on that slot; POST /slots/{id}?action=erase forgets an
    idle slot's cache (save / restore: 501); GET /v1/models/{id} (OpenAI's); embeddings are a 501,
    not a 404; a 405 names the allowed methods (RFC 9110); a user message without content is a 400."""
    for k in (1, 0, 1):
        st, body = call(server, "POST", "/completion", {"prompt": "Hello there slot", "n_predict": 2, "id_slot": k})
        assert st == 200 and body["id_slot"] == k, body
    st, slots = call(server, "GET", "/slots")
    assert call(server, "GET", "/slots/list")[1] == slots  # (ik's route)
    assert all(x["state"] == 0 and x["next_token"]["n_decoded"] == 0 for x in slots), slots
    held = {x["id"]: x["n_cached"] for x in slots} if isinstance(slots, list) else {}
    # the answer's tokens_cached is what the slot holds (llama-server's n_past: the last sampled
    # token is never run through the model); it counted that token too (an outside probe)
    assert body["tokens_cached"] == held[1] == body["tokens_evaluated"] + body["tokens_predicted"] - 1, (body, held)
    st, body = call(server, "POST", "/slots/1?action=erase")
    assert st == 200 and body["id_slot"] == 1 and body["n_erased"] == held.get(1, body["n_erased"]) > 0, body
    deadline = time.time() + 10
    while time.time() < deadline and [x for x in call(server, "GET", "/slots")[1] if x["id"] == 1][0]["n_cached"]:
        time.sleep(0.05)
    assert [x for x in call(server, "GET", "/slots")[1] if x["id"] == 1][0]["n_cached"] == 0
    _error(call(server, "POST", "/slots/0?action=save"), 501, "not supported")
    _error(call(server, "POST", f"/slots/{NP}?action=erase"), 400, "id_slot")
    _error(call(server, "POST", "/slots/0?action=wipe"), 400, "action")
    st, m = call(server, "GET", "/v1/models")
    name = m["data"][0]["id"]
    st, one = call(server, "GET", f"/v1/models/{name}")
    assert st == 200 and one["id"] == name and one["object"] == "model"
    _error(call(server, "GET", "/v1/models/gpt-4"), 404, "not found")
    _error(call(server, "POST", "/v1/embeddings", {"input": "x"}), 501, "embeddings")
    c = http.client.HTTPConnection(server.host, int(server.port), timeout=60)
    c.request("DELETE", "/v1/chat/completions")
    r = c.getresponse()
    r.read()
    c.close()
    assert r.status == 405 and r.getheader("Allow") == "POST", r.getheaders()
    _error(call(server, "POST", "/v1/chat/completions", {"messages": [{"role": "user"}]}), 400, "needs content")


def test_user_field_must_be_a_string():
    """OpenAI's `user` is a string (OpenAI and vLLM answer 400 to any other type): refused naming it."""
    from ikjax.server.openai import ApiError, Defaults, gen_params
    assert gen_params({"user": "u-1"}, Defaults(), max_names=("max_tokens",)).max_tokens is None
    # top_p 0 ("only the most likely token") is applied after the `samplers` chain's filter: a chain of
    # top_p without top_k kept every token before; a chain without top_p had its top_k set to 1
    mk = ("max_tokens",)
    for chain in (["top_p", "temperature"], "pt"):
        g = gen_params({"top_p": 0, "temperature": 1.0, "samplers": chain}, Defaults(), max_names=mk)
        assert (g.top_k, g.top_p) == (1, 1.0), chain
    g = gen_params({"top_p": 0, "top_k": 40, "temperature": 1.0, "samplers": ["top_k", "temperature"]}, Defaults(),
                   max_names=mk)
    assert (g.top_k, g.top_p) == (40, 1.0)
    for bad in (5, ["u"], {"id": 1}, True):
        with pytest.raises(ApiError, match="^user: expected a string"):
            gen_params({"user": bad}, Defaults(), max_names=("max_tokens",))


def test_text_offsets_count_the_answers_characters():
    """/v1/completions' logprobs.text_offset: a token ending inside a UTF-8 character ('!' + the
    first byte of 'ׂ', then its second byte + '!') adds the character once, with the token that
    completes it; the offsets stay inside the answer's text ('!ׂ!�': a lone byte is one '�')."""
    from ikjax.server.openai import text_offsets
    pieces = [b"!\xd7", b"\x82!", b"\xe2", b"x"]
    text = b"".join(pieces).decode("utf-8", "replace")
    assert text_offsets(pieces) == [0, 1, 3, 3] and text == "!\u05c2!\ufffdx"
    assert text_offsets(pieces, 5) == [5, 6, 8, 8]
    assert text_offsets([]) == []


def test_expect_100_continue_only_where_the_body_will_be_read(small):
    """`Expect: 100-continue` (curl's, for big bodies): no interim 100 ahead of a 401 for a missing key
    or of the 413 for a body over the limit (the client would upload it first); with the key and a
    body in bounds, the 100, then the answer."""
    import socket

    def first_line(head: bytes, body: bytes | None = None) -> list[bytes]:
        with socket.create_connection((small.host, int(small.port)), timeout=30) as sock:
            sock.sendall(head)
            got = sock.recv(65536)
            if body is not None and got.startswith(b"HTTP/1.1 100"):
                sock.sendall(body)
                while b"\r\n\r\n" not in got.partition(b"\r\n\r\n")[2]:
                    got += sock.recv(65536)
        return [ln for ln in got.split(b"\r\n") if ln.startswith(b"HTTP/1.1")]
    assert first_line(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 30\r\n\r\n") \
        == [b"HTTP/1.1 401 Unauthorized"]
    assert first_line(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekret\r\n"
                      b"Expect: 100-continue\r\nContent-Length: 60000000\r\n\r\n") == [b"HTTP/1.1 413 Request Entity Too Large"]
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    assert first_line(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekret\r\n"
                      b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body), body) \
        == [b"HTTP/1.1 100 Continue", b"HTTP/1.1 200 OK"]


def test_api_key_401(small):
    _error(call(small, "POST", "/completion", {"prompt": "x", "n_predict": 1}), 401, "API key")
    # a browser's preflight carries no key: answered all the same; the request after it needs one
    assert call(small, "OPTIONS", "/completion", headers={"Origin": "http://a.example",
                                                         "Access-Control-Request-Method": "POST"})[0] == 204
    _error(call(small, "OPTIONS", "/completion"), 401, "API key")  # not a preflight: no way around the key
    with pytest.raises(openai.AuthenticationError):
        client(small, "wrong").completions.create(model=MODEL, prompt="x", max_tokens=1)
    # a key without "Bearer " (or a Basic one) is a wrong key, not a missing one (llama-server: "Invalid API Key")
    for auth in ("sekret", "Basic c2VrcmV0", "Bearer"):
        _error(call(small, "POST", "/completion", {"prompt": "x", "n_predict": 1}, headers={"Authorization": auth}),
               401, "Invalid API Key")
    assert call(small, "GET", "/health")[0] == 200  # open without a key, as llama-server's
    c = http.client.HTTPConnection(small.host, int(small.port), timeout=60)  # a 401 names its scheme (RFC 9110)
    c.request("GET", "/props")
    r = c.getresponse()
    assert r.status == 401 and r.getheader("WWW-Authenticate", "").startswith("Bearer"), r.getheaders()
    r.read()
    c.close()
    r = client(small, "sekret").completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert r.usage.completion_tokens >= 1
    for key in ("other-key", "third"):  # --api-key-file's keys pass too
        assert client(small, key).completions.create(model=MODEL, prompt="x", max_tokens=1).usage.completion_tokens


def _open_stream(s: Proc, prompt: str):
    """A long stream (until the 8192-token slot is full, ignoring EOS): (connection, response)
    with its first event read."""
    c = http.client.HTTPConnection(s.host, int(s.port), timeout=120)
    c.request("POST", "/v1/completions", body=json.dumps({"prompt": prompt, "stream": True, "temperature": 0,
                                                          "ignore_eos": True}),
              headers={"Authorization": "Bearer sekret", "Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200
    assert r.readline().startswith(b"data: ")
    return c, r


def _counter(s: Proc, name: str, labels: dict | None = None) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    text = call(s, "GET", "/metrics", headers={"Authorization": "Bearer sekret"})[1]
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name == name and (labels is None or sample.labels == labels):
                return sample.value
    raise KeyError(name)


def test_queue_full_503_and_cancellation_frees_the_slot(small):
    auth = {"Authorization": "Bearer sekret"}
    cancelled0 = _counter(small, "ikjax_requests_total", {"reason": "cancelled"})
    tokens0 = _counter(small, "ikjax_tokens_predicted_total")
    busy, _ = _open_stream(small, "one")  # holds the only slot
    # llama-server's /health with no idle slot: said, and a 503 where the caller asks for one
    assert call(small, "GET", "/health")[1]["status"] == "no slot available"
    status, health = call(small, "GET", "/health?fail_on_no_slot=1&include_slots", headers=auth)
    assert status == 503 and health["slots_idle"] == 0 and health["slots"][0]["is_processing"], health
    _error(call(small, "GET", "/health?include_slots"), 401, "API key")  # what /slots shows: behind the key
    assert _counter(small, "llamacpp:kv_cache_tokens") > 0
    waiting = http.client.HTTPConnection(small.host, int(small.port), timeout=120)  # waits in the queue of 1
    waiting.request("POST", "/completion", body=json.dumps({"prompt": "two", "n_predict": 3}),
                    headers={**auth, "Content-Type": "application/json"})
    time.sleep(0.5)
    _error(call(small, "POST", "/completion", {"prompt": "three", "n_predict": 1}, auth), 503, "busy")
    # more prompts in one request than the slot and the queue hold even when idle: never takeable, a
    # 400 (a 503 would have the client retry it forever)
    _error(call(small, "POST", "/completion", {"prompt": ["a", "b", "c"], "n_predict": 1}, auth), 400,
           "--max-queue")
    full = http.client.HTTPConnection(small.host, int(small.port), timeout=60)  # a 503 says when to come back
    full.request("POST", "/completion", body=json.dumps({"prompt": "four", "n_predict": 1}),
                 headers={**auth, "Content-Type": "application/json"})
    answer = full.getresponse()
    assert answer.status == 503 and answer.getheader("Retry-After") == "1"
    full.close()
    # the client of the stream goes away: its slot serves the queued request at once
    t0 = time.perf_counter()
    busy.sock.shutdown(socket.SHUT_RDWR)
    busy.close()
    r = waiting.getresponse()
    assert r.status == 200 and json.loads(r.read())["tokens_predicted"] == 3
    assert time.perf_counter() - t0 < 5  # the stream had ~2000 tokens left
    waiting.close()
    for _ in range(50):
        slots = call(small, "GET", "/slots", headers=auth)[1]
        if not slots[0]["is_processing"]:
            break
        time.sleep(0.1)
    assert not slots[0]["is_processing"]
    assert call(small, "GET", "/health?fail_on_no_slot=1") == (200, {"status": "ok", "slots_idle": 1,
                                                                      "slots_processing": 0})
    assert _counter(small, "ikjax_requests_total", {"reason": "cancelled"}) == cancelled0 + 1
    assert _counter(small, "ikjax_tokens_predicted_total") - tokens0 < 1500  # the stream was cut short


# -- the chat page in a real browser (Debian's chromium, headless, driven over the DevTools protocol) ----

class Browser:
    """Headless chromium with one page, driven over the Chrome DevTools Protocol (aiohttp's
    websocket client: no driver package needed)."""

    def __init__(self, exe: str, profile: str):
        self.p = subprocess.Popen([exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                   "--remote-debugging-port=0", f"--user-data-dir={profile}", "about:blank"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.ws_url = None
        t0 = time.time()
        while time.time() - t0 < 60:
            line = self.p.stderr.readline()
            if not line:
                break
            if "DevTools listening on " in line:
                self.ws_url = line.split("DevTools listening on ")[1].strip()
                break
        if self.ws_url is None:
            self.close()
            pytest.fail("chromium did not start")
        threading.Thread(target=lambda: [None for _ in self.p.stderr], daemon=True).start()
        port = self.ws_url.split("/")[2]
        with urllib.request.urlopen(f"http://{port}/json/list") as r:
            self.page_ws = next(t["webSocketDebuggerUrl"] for t in json.load(r) if t["type"] == "page")

    def close(self):
        self.p.terminate()
        try:
            self.p.wait(20)
        except subprocess.TimeoutExpired:
            self.p.kill()


class Page:
    def __init__(self, ws):
        self.ws, self.n = ws, 0

    async def call(self, method: str, **params):
        self.n += 1
        await self.ws.send_json({"id": self.n, "method": method, "params": params})
        while True:
            msg = await self.ws.receive_json(timeout=60)
            if msg.get("id") == self.n:
                assert "error" not in msg, msg
                return msg["result"]

    async def js(self, expr: str):
        r = await self.call("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in r, r
        return r["result"].get("value")

    async def until(self, expr: str, timeout: float = 60):
        t0 = time.time()
        while time.time() - t0 < timeout:
            v = await self.js(expr)
            if v:
                return v
            await asyncio.sleep(0.05)
        raise AssertionError(f"timed out waiting for {expr}")



@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    import shutil
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    b = Browser(exe, str(tmp_path_factory.mktemp("chromium")))
    yield b
    b.close()


@contextlib.asynccontextmanager
async def _chat_page(browser, s: Proc):
    """The chat page at / of server `s`, loaded in the browser's page (a DevTools session)."""
    import aiohttp
    async with aiohttp.ClientSession() as session, session.ws_connect(browser.page_ws, max_msg_size=0) as ws:
        page = Page(ws)
        await page.call("Page.navigate", url=s.url + "/")
        await page.until("document.readyState === 'complete' && !!document.getElementById('send')")
        yield page


async def _send(page, text: str, **fields) -> None:
    """Set the page's fields (by element id) and send `text`, as a user clicks Send."""
    sets = " ".join(f"$({json.dumps(k)}).value = {json.dumps(str(v))};" for k, v in fields.items())
    await page.js(f"(() => {{ const $ = (i) => document.getElementById(i); {sets} "
                  f"$('input').value = {json.dumps(text)}; $('send').click(); }})()")


def _streamed(i: int, chars: int = 20) -> str:
    """JS: whether assistant message i shows more than `chars` characters of answer or reasoning."""
    return (f"(() => {{ const a = document.querySelectorAll('.assistant')[{i}]; if (!a) return false;"
            f"const r = a.querySelector('details div');"
            f"return a.querySelector('.content').textContent.length + (r ? r.textContent.length : 0) > {chars}; }})()")


_FAKE_FETCH = """(() => { window._bodies = []; window._fake = null; window._fakeDelay = 0; const real = window.fetch;
    window.fetch = (url, opts) => {
      if (opts && opts.body) window._bodies.push(JSON.parse(opts.body));
      if (window._fake === null || url !== '/v1/chat/completions') return real(url, opts);
      const bytes = new TextEncoder().encode(window._fake), delay = window._fakeDelay;
      const signal = opts && opts.signal;
      const body = new ReadableStream({ async start(c) {
        const step = delay ? 4096 : bytes.length > 100000 ? 65536 : 3;  // (framings split across reads)
        for (let i = 0; i < bytes.length; i += step) {
          if (signal && signal.aborted) { c.error(new DOMException('aborted', 'AbortError')); return; }
          c.enqueue(bytes.slice(i, i + step));
          if (delay) await new Promise((ok) => setTimeout(ok, delay));
        }
        c.close(); } });
      return Promise.resolve(new Response(body, { status: 200,
        headers: { 'Content-Type': 'text/event-stream' } })); }; })()"""


def _sse(events: list, crlf: bool = False) -> str:
    nl = "\r\n" if crlf else "\n"
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}{nl}{nl}" for e in events)


def _api_answer(s: Proc, msgs: list[dict]) -> dict:
    """The greedy 12-token answer's message of the API itself, for the page to equal."""
    return call(s, "POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 12, "temperature": 0},
                headers={"Authorization": "Bearer sekret"})[1]["choices"][0]["message"]


def test_chat_page_streams_and_stops(small, browser):
    """The page at / in headless chromium: an answer streams in equal to the API's own (reasoning
    shown apart), a second turn goes on the same conversation, and Stop ends a long answer and
    frees the server's slot."""
    auth = {"Authorization": "Bearer sekret"}
    want = _api_answer(small, [{"role": "user", "content": "hello there"}])

    async def drive():
        async with _chat_page(browser, small) as page:
            await _send(page, "hello there", key="sekret", temperature=0, max_tokens=12)
            await page.until("document.querySelector('.assistant') && "
                             "document.querySelector('.assistant').dataset.done === '1'")
            shown = await page.js("""(() => { const a = document.querySelector('.assistant');
                const r = a.querySelector('details div');
                return {content: a.querySelector('.content').textContent, finish: a.dataset.finish,
                        reasoning: r ? r.textContent : null}; })()""")
            assert shown["content"] == want["content"]
            assert shown["reasoning"] == want.get("reasoning_content")
            assert shown["finish"] == "length"
            # a long answer, stopped while it streams
            await _send(page, "tell me more", max_tokens=-1)
            await page.until(_streamed(1))
            assert await page.js("document.getElementById('stop').disabled") is False
            await page.js("document.getElementById('stop').click()")
            await page.until("document.querySelectorAll('.assistant')[1].dataset.done === '1'")
            assert await page.js("document.querySelectorAll('.assistant')[1].dataset.finish") == "stopped"
            assert await page.js("document.getElementById('send').disabled") is False
    asyncio.run(drive())
    for _ in range(50):  # the server saw the connection close: the slot is free
        if not call(small, "GET", "/slots", headers=auth)[1][0]["is_processing"]:
            break
        time.sleep(0.1)
    assert not call(small, "GET", "/slots", headers=auth)[1][0]["is_processing"]


def test_chat_page_new_chat_system_message_and_refused_turns(small, browser):
    """The page's conversation: "New chat" while an answer streams starts an empty conversation (the
    stopped answer used to be added to the new one's turns); the system field goes first in every
    request (the answer equals the API's for [system, user]); a turn the server refuses (a 400)
    leaves the conversation, marked, and the next message is answered."""
    want = _api_answer(small, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}])

    async def drive():
        async with _chat_page(browser, small) as page:
            await _send(page, "tell me a long story", key="sekret", temperature=0, max_tokens=-1)
            await page.until(_streamed(0))
            await page.js("document.getElementById('clear').click()")
            await page.until("document.getElementById('send').disabled === false")
            assert await page.js("JSON.stringify(chatLog)") == "[]"
            await _send(page, "hello there", system="Be brief.", max_tokens=12)
            await page.until("document.querySelector('.assistant') && "
                             "document.querySelector('.assistant').dataset.done === '1'")
            shown = await page.js("document.querySelector('.assistant .content').textContent")
            assert shown == want["content"]
            log = json.loads(await page.js("JSON.stringify(chatLog)"))
            assert [m["role"] for m in log] == ["user", "assistant"]  # (the system message is sent, not kept)
            await _send(page, "refused", max_tokens=-5)
            await page.until("document.querySelectorAll('.assistant')[1] && "
                             "document.querySelectorAll('.assistant')[1].dataset.done === '1'")
            assert await page.js("document.querySelectorAll('.assistant')[1].dataset.finish") == "error"
            assert "max_tokens" in await page.js("document.querySelector('.error').textContent")
            assert await page.js("document.querySelectorAll('.user')[1].classList.contains('unsent')") is True
            assert len(json.loads(await page.js("JSON.stringify(chatLog)"))) == 2
            await _send(page, "and then", max_tokens=4)
            await page.until("document.querySelectorAll('.assistant')[2] && "
                             "document.querySelectorAll('.assistant')[2].dataset.done === '1'")
            assert await page.js("document.querySelectorAll('.assistant')[2].dataset.finish") in ("length", "stop")
            assert len(json.loads(await page.js("JSON.stringify(chatLog)"))) == 4
    asyncio.run(drive())


def test_chat_page_input_method_empty_fields_and_stream_framing(small, browser):
    """What an outside probe of the page found (stop 66): Enter that ends an input method's
    composition sent the half-typed message; an emptied max-tokens field was sent as 0; a stream
    framed with CRLF (an SSE proxy's) showed nothing; a stream cut before its end looked finished.
    The page's fetch is wrapped to record each request's body and, for the chat endpoint, to answer
    with a given SSE text split into small chunks (framings split across reads)."""
    sse = _sse
    delta = [{"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]},
             {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}]}, "[DONE]"]

    async def drive():
        async with _chat_page(browser, small) as page:
            await page.js(_FAKE_FETCH)

            async def answer(fake: str, **fields) -> dict:
                n = await page.js("document.querySelectorAll('.assistant').length")
                await page.js(f"window._fake = {json.dumps(fake)}")
                await _send(page, "hi", **fields)
                await page.until(f"(() => {{ const a = document.querySelectorAll('.assistant')[{n}];"
                                 f"return a && a.dataset.done === '1'; }})()")
                return await page.js(f"""(() => {{ const a = document.querySelectorAll('.assistant')[{n}];
                    const e = a.querySelector('.error');
                    return {{content: a.querySelector('.content').textContent, finish: a.dataset.finish,
                             error: e ? e.textContent : null, body: window._bodies[window._bodies.length - 1]}};
                    }})()""")
            # Enter while an input method composes: nothing sent, the text stays; then Enter sends
            key = ("(() => { const i = document.getElementById('input'); i.value = 'かな';"
                   "i.dispatchEvent(new KeyboardEvent('keydown', {key: 'Enter', bubbles: true, cancelable: true, "
                   "isComposing: %s})); })()")
            await page.js(f"window._fake = {json.dumps(sse(delta, False))}")
            await page.js(key % "true")
            await asyncio.sleep(0.3)
            assert await page.js("document.querySelectorAll('.msg').length") == 0
            assert await page.js("document.getElementById('input').value") == "かな"
            await page.js(key % "false")
            await page.until("document.querySelector('.assistant') && "
                             "document.querySelector('.assistant').dataset.done === '1'")
            assert await page.js("document.querySelector('.user').textContent") == "かな"
            # CRLF framing, in 3-byte reads; empty fields are left out of the request
            for crlf in (False, True):
                got = await answer(sse(delta, crlf), max_tokens="", temperature="")
                assert (got["content"], got["finish"], got["error"]) == ("Hello", "stop", None), (crlf, got)
                assert "max_tokens" not in got["body"] and "temperature" not in got["body"], got["body"]
            got = await answer(sse(delta, True), max_tokens="7", temperature="0.5")
            assert (got["body"]["max_tokens"], got["body"]["temperature"]) == (7, 0.5)
            # a stream that ends with neither a finish_reason nor [DONE]: marked, the turn left out
            got = await answer(sse(delta[:1], False))
            assert got["finish"] == "error" and "cut off" in got["error"], got
            assert await page.js("document.querySelectorAll('.user')[4].classList.contains('unsent')") is True
    asyncio.run(drive())


def test_chat_page_long_answers_scrolling_and_endings(small, browser):
    """A third probe of the page (stop 67): a 4,000-token answer took 24 s to show after the server
    had sent it in 6 (the whole text set and scrolled at every event: the square of its length) and
    Stop waited as long; a reader who scrolled up was pulled back down; a long unbroken word ran
    past the column; nothing on screen said an answer was stopped, cut at the limit, or all
    reasoning; a refused turn's text was gone; leading indentation was trimmed off."""
    delta = lambda text, fin=None, r=False: {"choices": [{"index": 0, "delta": {  # noqa: E731
        "reasoning_content" if r else "content": text}, "finish_reason": fin}]}

    async def drive():
        async with _chat_page(browser, small) as page:
            await page.js(_FAKE_FETCH)

            async def turn(fake: str, text: str = "hi", delay: int = 0) -> int:
                n = await page.js("document.querySelectorAll('.assistant').length")
                await page.js(f"window._fake = {json.dumps(fake)}; window._fakeDelay = {delay}")
                await _send(page, text, key="sekret")
                return n

            def done(n: int) -> str:
                return f"(() => {{ const a = document.querySelectorAll('.assistant')[{n}]; return a && a.dataset.done === '1'; }})()"

            def status(n: int) -> str:
                return f"document.querySelectorAll('.assistant')[{n}].querySelector('.status').textContent"
            # 16,000 events of reasoning then answer: shown whole in seconds, bit for bit
            events = [delta("r%d " % i, r=True) for i in range(8000)] + [delta("w%d " % i) for i in range(8000)]
            t0 = time.perf_counter()
            n = await turn(_sse(events + [delta("", "length"), "[DONE]"]))
            await page.until(done(n), timeout=60)
            took = time.perf_counter() - t0
            got = await page.js(f"""(() => {{ const a = document.querySelectorAll('.assistant')[{n}];
                return [a.querySelector('.content').textContent, a.querySelector('details div').textContent]; }})()""")
            assert got == ["".join("w%d " % i for i in range(8000)), "".join("r%d " % i for i in range(8000))]
            assert took < 8, took  # (74 s before on this machine's kind)
            assert "token limit" in await page.js(status(n))
            # all reasoning, no reply: said
            n = await turn(_sse([delta("hm", r=True), delta("", "stop"), "[DONE]"]))
            await page.until(done(n))
            assert "no reply after the reasoning" in await page.js(status(n))
            # a slow stream: the reader scrolls up and stays there; Stop ends it at once, and says so
            n = await turn(_sse([delta("line %d\n" % i) for i in range(3000)] + [delta("", "stop"), "[DONE]"]),
                           delay=40)
            await page.until(_streamed(n, 2000))
            await page.js("document.getElementById('messages').scrollTop = 0")
            await asyncio.sleep(0.5)
            assert await page.js("document.getElementById('messages').scrollTop") == 0
            t0 = time.perf_counter()
            await page.js("document.getElementById('stop').click()")
            await page.until(done(n))
            assert time.perf_counter() - t0 < 2 and await page.js(status(n)) == "[stopped]"
            # a long unbroken word wraps inside the column
            n = await turn(_sse([delta("x" * 5000, "stop"), "[DONE]"]))
            await page.until(done(n))
            assert await page.js("(() => { const m = document.getElementById('messages');"
                                 "return m.scrollWidth <= m.clientWidth + 1; })()") is True
            # leading indentation kept; a refused turn's text back in the box
            await page.js("window._fake = null")
            await _send(page, "    indented code\n  line2", key="wrong")
            await page.until(done(n + 1))
            assert await page.js("document.querySelectorAll('.user')[%d].textContent" % (n + 1)) == \
                "    indented code\n  line2"
            assert await page.js("document.getElementById('input').value") == "    indented code\n  line2"
    asyncio.run(drive())


def test_port_in_use_is_one_line_before_loading(tiny_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = subprocess.run([sys.executable, "-m", "ikjax.cli", "serve", "-m", tiny_model, "--port", str(port)],
                             capture_output=True, text=True, timeout=120)
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == [f"error: --host 127.0.0.1 --port {port}: cannot listen "
                                               f"(Address already in use)"]


def _ref_logprobs(eng, ids: list[int], out: list[int]) -> list[np.ndarray]:
    """The log-softmax of the engine's logits before each token of `out` (one step a token)."""
    logits, cache = eng.prefill(eng.new_cache(1), np.array(ids), 0)
    rows, seq = [], list(ids)
    for t in out:
        x = np.asarray(logits, np.float64).ravel()
        rows.append(x - (x.max() + np.log(np.exp(x - x.max()).sum())))
        seq.append(t)
        o, cache = eng.step(cache, np.array([[t]], np.int32), np.array([len(seq) - 1]), np.array([0]))
        logits = np.asarray(o, np.float32)[0]
    return rows


def test_logprobs_every_endpoint(server, ref):
    """OpenAI's logprobs (chat: logprobs + top_logprobs; completions: logprobs N) and llama-server's
    n_probs: each answer token's log-probability is the log-softmax of the model's logits there
    (the engine's own steps, alone), its alternatives the most likely ids in order, the tokens'
    bytes make the text; the greedy answer is the one without logprobs; streamed the same."""
    c = client(server)
    text = prompts(1, seed=5)[0]
    ids = call(server, "POST", "/tokenize", {"content": text, "add_special": True})[1]["tokens"]
    n = 6
    want_ids, want_text = reference(ref, ids, n)
    ref_rows = _ref_logprobs(ref, ids, want_ids)
    eos = ref.config.eos_token_id
    shown = [(i, t) for i, t in enumerate(want_ids) if t != eos]
    # /v1/completions, logprobs=3
    r = c.completions.create(model=MODEL, prompt=text, max_tokens=n, temperature=0, logprobs=3)
    ch = r.choices[0]
    assert ch.text == want_text
    lp = ch.logprobs
    assert len(lp.tokens) == len(shown) and len(lp.top_logprobs) == len(shown)
    for (i, t), tok_lp, top, off in zip(shown, lp.token_logprobs, lp.top_logprobs, lp.text_offset):
        assert abs(tok_lp - ref_rows[i][t]) < 2e-3, (tok_lp, ref_rows[i][t])
        # ({token text: logprob}, OpenAI's form; a piece that is not whole UTF-8 named "bytes:\\xNN", so two
        # byte tokens never share a key: as many alternatives as asked for)
        assert len(top) == 3 and max(top.values()) == pytest.approx(tok_lp, abs=1e-9)  # greedy: the top one
        assert sorted(top.values(), reverse=True) == pytest.approx(sorted(ref_rows[i], reverse=True)[:3], abs=2e-3)
        assert 0 <= off <= len(ch.text)
    assert lp.text_offset == sorted(lp.text_offset)
    # 20 alternatives asked for, 20 listed: a byte token's key is its bytes, never U+FFFD (10 of 20 before)
    top = call(server, "POST", "/v1/completions", {"prompt": "\u00e9\u65e5\U0001F600", "max_tokens": 1, "temperature": 0,
                                                   "logprobs": 20})[1]["choices"][0]["logprobs"]["top_logprobs"][0]
    assert len(top) == 20 and not any("\ufffd" in k for k in top), top
    # /v1/chat/completions: logprobs + top_logprobs, whole and streamed
    msgs = [{"role": "user", "content": text}]
    raw = {"reasoning_format": "none"}  # the whole answer in `content`, as the tokens make it
    whole = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=n, temperature=0, logprobs=True,
                                      top_logprobs=2, extra_body=raw)
    plain = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=n, temperature=0, extra_body=raw)
    content = whole.choices[0].logprobs.content
    assert whole.choices[0].message.content == plain.choices[0].message.content
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace") == whole.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.top_logprobs[0].token == e.token and e.logprob <= 0
    streamed = []
    for chunk in c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=n, temperature=0, logprobs=True,
                                          top_logprobs=2, stream=True, extra_body=raw):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    # with a stop string that ends inside the answer, streamed and whole give the same entries (the
    # tokens completing the stop were left out of the stream: an outside probe)
    answer = whole.choices[0].message.content
    cut = next((k for k in range(len(answer) // 3, len(answer) - 2) if answer[k:k + 2].strip()
                and answer.find(answer[k:k + 2]) == k), None)
    if cut is not None:
        stop = answer[cut:cut + 2]
        kw = dict(model=MODEL, messages=msgs, max_tokens=n, temperature=0, logprobs=True, top_logprobs=2,
                  stop=[stop], extra_body=raw)
        w = c.chat.completions.create(**kw)
        s = [e for ch in c.chat.completions.create(**kw, stream=True) if ch.choices and ch.choices[0].logprobs
             for e in ch.choices[0].logprobs.content]
        assert w.choices[0].message.content == answer[:cut]
        assert [(e.token, e.logprob) for e in s] == [(e.token, e.logprob) for e in w.choices[0].logprobs.content]
        # the entries follow the returned text (llama-server drops the stop string's tokens): they
        # cover it, and the last one starts inside it
        got = w.choices[0].logprobs.content
        joined = b"".join(bytes(e.bytes) for e in got).decode("utf-8", "replace")
        assert joined.startswith(answer[:cut]) and len(joined) - len(bytes(got[-1].bytes).decode("utf-8", "replace")) < cut
    # llama-server's /completion n_probs
    status, body = call(server, "POST", "/completion", {"prompt": text, "n_predict": n, "temperature": 0, "n_probs": 2})
    assert status == 200 and [p["id"] for p in body["completion_probabilities"]] == [t for _, t in shown]
    assert all(len(p["top_logprobs"]) == 2 for p in body["completion_probabilities"])
    # ... and ik_llama.cpp's form beside it: content, probs [{tok_str, prob}] (its own clients read that)
    def ik(e):  # ik's tok_str: a lone byte of a split character as "byte: \xNN", else the text
        return f"byte: \\x{e['bytes'][0]:x}" if len(e["bytes"]) == 1 and e["bytes"][0] & 0x80 else e["token"]
    for p in body["completion_probabilities"]:
        assert p["content"] == ik(p) and [q["tok_str"] for q in p["probs"]] == [ik(q) for q in p["top_logprobs"]]
        assert all(abs(q["prob"] - math.exp(t["logprob"])) < 1e-9 for q, t in zip(p["probs"], p["top_logprobs"]))
    # refusals
    _error(call(server, "POST", "/v1/chat/completions", {"messages": msgs, "top_logprobs": 2}), 400, "top_logprobs")
    _error(call(server, "POST", "/v1/chat/completions", {"messages": msgs, "logprobs": True, "top_logprobs": 21}),
           400, "top_logprobs")
    _error(call(server, "POST", "/v1/completions", {"prompt": "x", "logprobs": -1}), 400, "logprobs")


@pytest.mark.parametrize("args, message", [
    (["--api-key-file", "/nonexistent/keys"], "--api-key-file /nonexistent/keys: cannot read"),
    (["--chat-template-file", "/nonexistent.jinja"], "--chat-template-file /nonexistent.jinja: no such file"),
    (["--chat-template", "chatml", "--chat-template-file", __file__], "give one of them")])
def test_server_flag_errors_are_one_line_before_loading(tiny_model, args, message):
    res = subprocess.run([sys.executable, "-m", "ikjax.cli", "serve", "-m", tiny_model, "--port", "0", *args],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1 and message in res.stderr, res.stderr


def test_logprobs_and_zero_bias_do_not_change_a_seeded_answer(server, ref):
    """A seeded, sampled request gives `generate`'s tokens for that seed whether or not it asks for
    log-probabilities or carries a bias of 0 (both moved it to the host's sampler, another random
    stream, before: an outside probe found the answers changed), and each reported log-probability
    is the drawn token's."""
    ids = ref.tokenizer.encode(prompts(1, seed=11)[0])
    kw = dict(prompt=ids, n_predict=12, return_tokens=True, temperature=0.9, top_k=20, top_p=1.0, min_p=0.0,
              seed=5, ignore_eos=True)
    want = list(ref.generate(ids, 12, temperature=0.9, top_k=20, top_p=1.0, min_p=0.0, seed=5, ignore_eos=True))
    plain = call(server, "POST", "/completion", kw)
    probs = call(server, "POST", "/completion", {**kw, "n_probs": 2})
    zero = call(server, "POST", "/completion", {**kw, "logit_bias": {"5": 0}})
    for status, body in (plain, probs, zero):
        assert status == 200, body
        assert body["tokens"] == want, (body["tokens"], want)
    reported = probs[1]["completion_probabilities"]
    assert [p["id"] for p in reported] == want
    assert all(len(p["top_logprobs"]) == 2 and p["logprob"] <= 0.0 for p in reported)
    # penalties draw every token on the host, server and generate alike: one seed, one answer (generate
    # took a device key from the seed's generator it never used, and its host draws ran one ahead)
    for pen in ({"presence_penalty": 0.5}, {"repeat_penalty": 1.1}):
        want = list(ref.generate(ids, 12, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=5, ignore_eos=True,
                                 **pen))
        status, body = call(server, "POST", "/completion", {**kw, "temperature": 1.0, "top_k": 0, **pen})
        assert status == 200 and body["tokens"] == want, (pen, body, want)


def test_concurrent_streams_each_with_its_own_sampling(server, ref):
    """Four streams at once, each with its own temperature, top_k, top_p and min_p (one top_k bucket:
    they share the decode loop, their values step arguments) and seed: each gives `generate`'s tokens
    for its setting alone."""
    texts = prompts(4, seed=21)
    settings = [dict(temperature=0.6, top_k=40, top_p=0.95, min_p=0.05, seed=1),
                dict(temperature=1.2, top_k=12, top_p=1.0, min_p=0.0, seed=2),
                dict(temperature=0.9, top_k=0, top_p=0.8, min_p=0.1, seed=3),
                dict(temperature=0.3, top_k=64, top_p=0.5, min_p=0.0, seed=4)]

    def one(i):
        ids = ref.tokenizer.encode(texts[i])
        body = dict(prompt=ids, n_predict=16, return_tokens=True, ignore_eos=True, **settings[i])
        return ids, call(server, "POST", "/completion", body)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(one, range(4)))
    for (ids, (status, body)), s in zip(got, settings):
        assert status == 200, body
        assert body["tokens"] == list(ref.generate(ids, 16, ignore_eos=True, **s)), s


def test_health_answers_503_while_the_model_loads(tiny_model, tmp_path):
    """The port is bound before the load; until the server proper answers, every request gets
    llama-server's 503 "Loading model" (it hung in the listen backlog: no answer for the seconds of
    the load and warm-up), then /health is 200; GET /v1/models lists the model meanwhile, as
    llama-server lets it through."""
    import json as _json
    import socket as _socket
    with _socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, IKJAX_COMPILE_CACHE=str(tmp_path / "cc"))  # a cold cache: seconds of warm-up
    p = subprocess.Popen([sys.executable, "-m", "ikjax.cli", "serve", "-m", tiny_model, "--port", str(port), "-np", "2",
                          "-c", "512"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    seen, models = [], []
    try:
        deadline = time.time() + START_S
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    seen.append((r.status, None))
                    break
            except urllib.error.HTTPError as e:
                seen.append((e.code, _json.loads(e.read())))
                if not models:  # the model list is there while it loads (llama-server lets it through)
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                        models.append((r.status, _json.loads(r.read())))
            except (urllib.error.URLError, ConnectionError):
                seen.append((None, None))  # not bound yet
            time.sleep(0.05)
    finally:
        p.terminate()
        p.wait(30)
    assert models and models[0][0] == 200 and models[0][1]["data"][0]["id"] == os.path.basename(tiny_model), models
    codes = [c for c, _ in seen]
    assert codes[-1] == 200, seen[-5:]
    loading = [b for c, b in seen if c == 503]
    assert loading and loading[0] == {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
    assert set(codes) <= {None, 503, 200}, set(codes)


def test_limits_usage_and_timings_as_llama_server(server):
    """Three things llama-server clients read (an outside probe against ik's server source): the
    token limit when several are sent (n_predict, then max_tokens, then max_completion_tokens:
    the order was reversed); a streamed /v1/completions' final chunk carries `usage` without
    stream_options (ik's final always does); `timings` after a stop string counts the answer's
    tokens (predicted_n counted the burst decoded past the stop: 10 against 4)."""
    msgs = [{"role": "user", "content": "count"}]
    for body, want in (({"max_tokens": 1, "max_completion_tokens": 3}, 1), ({"max_tokens": 1, "n_predict": 3}, 3)):
        st, r = call(server, "POST", "/v1/chat/completions", {"messages": msgs, "temperature": 0, "ignore_eos": True,
                                                              **body})
        assert st == 200 and r["usage"]["completion_tokens"] == want, (body, r["usage"])
    st, r = call(server, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 1, "n_predict": 3, "ignore_eos": True})
    assert st == 200 and r["usage"]["completion_tokens"] == 3, r["usage"]
    chunks = list(client(server).completions.create(model=MODEL, prompt="x", max_tokens=2, stream=True))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2, chunks[-1]
    # a stop string inside the greedy answer: its timings count what the answer holds
    st, full = call(server, "POST", "/completion", {"prompt": "Hello world", "n_predict": 24, "temperature": 0,
                                                    "ignore_eos": True})
    text = full["content"]
    k = next((i for i in range(len(text) // 3, len(text) - 2) if text[i:i + 2].strip() == text[i:i + 2]
              and text.find(text[i:i + 2]) == i), None)
    assert k is not None, text
    st, r = call(server, "POST", "/completion", {"prompt": "Hello world", "n_predict": 24, "temperature": 0,
                                                 "ignore_eos": True, "stop": [text[k:k + 2]]})
    assert st == 200 and r["stop_type"] == "word" and r["tokens_predicted"] < 24, r
    assert r["timings"]["predicted_n"] == r["tokens_predicted"] and r["timings"]["n_past"] == r["tokens_cached"], r
    st, r = call(server, "POST", "/v1/completions", {"prompt": "Hello world", "max_tokens": 24, "temperature": 0,
                                                     "ignore_eos": True, "stop": [text[k:k + 2]]})
    assert r["timings"]["predicted_n"] == r["usage"]["completion_tokens"] < 24, r
    deadline = time.time() + 20  # the stopped requests' bursts end (the fixture checks none is in flight)
    while time.time() < deadline and any(x["is_processing"] for x in call(server, "GET", "/slots")[1]):
        time.sleep(0.05)


def test_completion_echoes_ids_and_streams_end_with_all_probabilities(server):
    """/completion as ik's server: a token-id prompt comes back as the ids given (it was decoded
    text), and a stream's last event carries every token's probabilities, as the answer does."""
    st, body = call(server, "POST", "/completion", {"prompt": [5, 6, 7, 8], "n_predict": 3, "ignore_eos": True,
                                                    "n_probs": 2})
    assert st == 200 and body["prompt"] == [5, 6, 7, 8], body["prompt"]
    gs = body["generation_settings"]  # ik's names beside ours
    assert gs["n_probs"] == 2 and gs["max_tokens"] == gs["n_predict"] == 3 and gs["stream"] is False, gs
    c = http.client.HTTPConnection(server.host, int(server.port), timeout=120)
    c.request("POST", "/completion", body=json.dumps({"prompt": "hi there", "n_predict": 3, "n_probs": 1,
                                                      "ignore_eos": True, "temperature": 0, "stream": True}),
              headers={"Content-Type": "application/json"})
    events = [json.loads(ln[6:]) for ln in c.getresponse().read().decode().splitlines() if ln.startswith("data: ")]
    c.close()
    st, whole = call(server, "POST", "/completion", {"prompt": "hi there", "n_predict": 3, "n_probs": 1,
                                                     "ignore_eos": True, "temperature": 0})
    last = events[-1]
    assert last["stop"] and [p["id"] for p in last["completion_probabilities"]] == \
        [p["id"] for p in whole["completion_probabilities"]] and len(whole["completion_probabilities"]) == 3


def test_tokenize_mixed_content_and_empty_bodies(server, ref):
    """llama-server's /tokenize takes a mixed array (texts and ids, in order) and answers an empty
    body with no tokens; /detokenize likewise (both were 400s)."""
    a, b = ref.tokenizer.encode("ab", False), ref.tokenizer.encode("cd", False)
    st, body = call(server, "POST", "/tokenize", {"content": ["ab", 300, "cd"]})
    assert st == 200 and body["tokens"] == a + [300] + b, body
    assert call(server, "POST", "/tokenize", {}) == (200, {"tokens": []})
    assert call(server, "POST", "/detokenize", {}) == (200, {"content": ""})
    _error(call(server, "POST", "/tokenize", {"content": ["ab", 10 ** 9]}), 400, "content[1]")


def test_penalties_leave_the_newline_alone_unless_penalize_nl(server, ref):
    """ik_llama.cpp's penalties put the newline token's logit back (penalize_nl false, its default):
    a prompt of lines whose greedy next token is the newline by a margin of 1 keeps it under
    frequency / presence penalties that push it 8 down, and loses it with `penalize_nl: true`;
    the Python API and `Penalties` follow the same rule; a non-boolean penalize_nl is a 400."""
    from ikjax.runtime.sampling import check_penalty
    nl = ref.newline_token
    assert nl is not None and ref.tokenizer.decode([nl]) == "\n"
    ids = call(server, "POST", "/tokenize", {"content": "line one\nline two\nline three\n", "add_special": True})[1]["tokens"]
    assert ids.count(nl) == 3
    logits, _ = ref.prefill(ref.new_cache(1), np.array(ids), 0)
    logits = np.asarray(logits, np.float64)
    bias = float(logits.max() - logits[nl] + 1.0)  # the newline first, by 1
    body = {"prompt": ids, "n_predict": 1, "temperature": 0, "return_tokens": True, "logit_bias": {str(nl): bias},
            "frequency_penalty": 2, "presence_penalty": 2}
    st, got = call(server, "POST", "/completion", body)
    assert st == 200 and got["tokens"] == [nl], got
    st, got = call(server, "POST", "/completion", {**body, "penalize_nl": True})
    assert st == 200 and got["tokens"] != [nl] and got["generation_settings"]["penalize_nl"] is True, got
    _error(call(server, "POST", "/completion", {**body, "penalize_nl": "yes"}), 400, "penalize_nl")
    pen = check_penalty(1.5, 64, 2.0, 2.0)
    row = np.arange(8.0)
    kept = type(pen)(**{**pen.__dict__, "newline": 3}).apply(row, [3, 3, 5])
    assert kept[3] == 3.0 and kept[5] < 5.0
    hit = type(pen)(**{**pen.__dict__, "newline": 3, "penalize_nl": True}).apply(row, [3, 3, 5])
    assert hit[3] < 3.0


def test_n_probs_on_openai_endpoints_budgets_seeds_and_slashed_model_ids(server):
    """llama-server's n_probs on /v1/chat/completions and /v1/completions gives the endpoint's
    logprobs (it was ignored); ik's thinking / reasoning budget ends R1's reasoning early with
    </think> forced (on chat requests; elsewhere a 400: no template says where reasoning starts); a seed below -1 is a fixed seed as ik's uint32 reading makes it (-2 repeats);
    GET /v1/models/{id} takes an id with a slash (a 404 naming it, not "no such endpoint")."""
    msgs = [{"role": "user", "content": "Hello there"}]
    st, body = call(server, "POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 3, "n_probs": 2})
    assert st == 200, body
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"] and all(len(c["top_logprobs"]) == 2 for c in content)
    st, body = call(server, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "n_probs": 2})
    assert st == 200 and len(body["choices"][0]["logprobs"]["top_logprobs"][0]) == 2, body
    # ik's reasoning budget: R1's thinking cut after so many tokens, </think> forced, the answer after it
    full = call(server, "POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 30, "temperature": 0})[1]
    assert full["choices"][0]["message"]["content"] in (None, "")  # 30 tokens: still thinking
    for name in ("thinking_budget_tokens", "reasoning_budget_tokens"):
        st, cut = call(server, "POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 30, "temperature": 0,
                                                                 name: 4})
        msg = cut["choices"][0]["message"]
        assert st == 200 and msg["content"], cut  # the block closed: an answer after it
        assert full["choices"][0]["message"]["reasoning_content"].startswith(msg["reasoning_content"] or "")
        st, _ = call(server, "POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 2, name: -1})
        assert st == 200
        _error(call(server, "POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 2, name: "x"}), 400, name)
        _error(call(server, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2, name: 3}), 400, name)
    req = {"prompt": "Once", "n_predict": 12, "temperature": 1.5, "top_k": 0, "top_p": 1, "min_p": 0, "seed": -2}
    a, b = call(server, "POST", "/completion", req), call(server, "POST", "/completion", req)
    assert a[0] == b[0] == 200 and a[1]["content"] == b[1]["content"]
    assert a[1]["generation_settings"]["seed"] == 2**32 - 2
    st, body = call(server, "GET", "/v1/models/org/name")
    assert st == 404 and "'org/name' not found" in body["error"]["message"], body


def test_ik_probs_name_a_lone_byte_as_ik_does(server, ref):
    """/completion's n_probs in ik's form (content, probs[].tok_str) names a token that is one byte of
    a split character "byte: \\xNN", as ik's tokens_to_output_formatted_string (U+FFFD before); the
    mainline fields keep the text and its bytes."""
    tok = ref.tokenizer
    t = next(i for i in range(ref.config.vocab_size) if len(tok.piece(i)) == 1 and tok.piece(i)[0] & 0x80)
    st, body = call(server, "POST", "/completion", {"prompt": "Hi", "n_predict": 1, "temperature": 0, "n_probs": 3,
                                                    "logit_bias": {str(t): 100}})
    assert st == 200, body
    first = body["completion_probabilities"][0]
    assert first["id"] == t and first["content"] == f"byte: \\x{tok.piece(t)[0]:x}" and first["bytes"] == list(tok.piece(t))
    for alt, p in zip(first["top_logprobs"], first["probs"]):  # the alternatives named the same way
        b = alt["bytes"]
        assert p["tok_str"] == (f"byte: \\x{b[0]:x}" if len(b) == 1 and b[0] & 0x80 else alt["token"])


def test_responses_api_through_the_openai_client(server):
    """OpenAI's Responses API (POST /v1/responses, as ik's server serves it) through the openai client:
    `input` as a string or as items with `instructions`, answered as the chat endpoint answers the same
    conversation (greedy: the same text; R1's reasoning as a reasoning item), streamed as the Response
    events (the deltas add up to the whole, `response.completed` last), max_output_tokens reached:
    status incomplete; bad items a 400."""
    c = client(server)
    kw = dict(max_tokens=8, temperature=0)
    for fmt in ("none", "deepseek"):
        extra = {"reasoning_format": fmt}
        chat = c.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                                                                {"role": "user", "content": "why"}],
                                         extra_body=extra, **kw).choices[0].message
        items = [{"role": "user", "content": [{"type": "input_text", "text": "why"}]}]
        for inp in ("why", items):
            r = c.responses.create(model=MODEL, instructions="Be brief.", input=inp, max_output_tokens=8,
                                   temperature=0, extra_body=extra)
            assert r.object == "response" and r.status == "incomplete" and r.incomplete_details.reason == \
                "max_output_tokens" and r.usage.output_tokens == 8 and r.usage.input_tokens > 0
            kinds = [o.type for o in r.output]
            if fmt == "none":
                assert kinds == ["message"] and r.output_text == chat.content
            else:  # the tiny model never closes R1's <think>: all of it reasoning, no message (cut off thinking)
                assert kinds == ["reasoning"] and r.output_text == "" and r.usage.output_tokens_details.reasoning_tokens > 0
                assert r.output[0].content[0].text == chat.model_extra["reasoning_content"]
        events = list(c.responses.create(model=MODEL, instructions="Be brief.", input="why", max_output_tokens=8,
                                         temperature=0, stream=True, extra_body=extra))
        types = [e.type for e in events]
        assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.incomplete"
        assert [e.sequence_number for e in events] == list(range(len(events)))
        final = events[-1].response
        if fmt == "none":
            assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == chat.content \
                == final.output_text
        else:
            assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == \
                chat.model_extra["reasoning_content"] == final.output[0].content[0].text
    for bad_body in ({"input": []}, {"input": [{"type": "input_image"}]}, {"input": "x", "previous_response_id": "r"},
                     {"input": "x", "tools": [{"type": "function", "name": 5}]}, {"input": "x", "metadata": 5},
                     {"input": "x", "parallel_tool_calls": "no"},
                     {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
                     {"input": "x", "text": {"format": {"type": "json_schema"}}}):
        st, body = call(server, "POST", "/v1/responses", {"model": MODEL, **bad_body})
        assert st == 400 and body["error"]["message"], (bad_body, body)
    # built-in tools (web_search, custom: what coding agents send with every request) left out, as ik's
    st, body = call(server, "POST", "/v1/responses", {"model": MODEL, "input": "x", "max_output_tokens": 2, "tools": [
        {"type": "web_search"}, {"type": "custom", "name": "apply_patch"}]})
    assert st == 200 and body["status"] == "incomplete", body


def test_anthropic_messages_api_through_its_client(server):
    """Anthropic's Messages API (POST /v1/messages, as ik's server serves it) through the anthropic
    client: `system` and messages answered as the chat endpoint answers them (greedy: the same text; R1's
    reasoning a thinking block), max_tokens reached: stop_reason max_tokens; streamed as its events (the
    deltas add up to the whole); count_tokens the prompt's tokens; errors in Anthropic's form."""
    anthropic = pytest.importorskip("anthropic")
    a = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)
    c = client(server)
    for fmt in ("none", "deepseek"):
        extra = {"reasoning_format": fmt}
        chat = c.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                                                                {"role": "user", "content": "why"}],
                                         max_tokens=8, temperature=0, extra_body=extra)
        m = a.messages.create(model=MODEL, system="Be brief.", max_tokens=8, extra_body=extra,  # (--temp 0)
                              messages=[{"role": "user", "content": [{"type": "text", "text": "why"}]}])
        assert m.type == "message" and m.role == "assistant" and m.stop_reason == "max_tokens"
        assert m.usage.output_tokens == 8 and m.usage.input_tokens + m.usage.cache_read_input_tokens == \
            chat.usage.prompt_tokens
        kinds = [b.type for b in m.content]
        if fmt == "none":
            assert kinds == ["text"] and m.content[0].text == chat.choices[0].message.content
        else:
            assert kinds == ["thinking"] and m.content[0].thinking == \
                chat.choices[0].message.model_extra["reasoning_content"]  # (no empty text block)
        with a.messages.stream(model=MODEL, system="Be brief.", max_tokens=8, extra_body=extra,
                               messages=[{"role": "user", "content": "why"}]) as st:
            events = list(st)
            final = st.get_final_message()
        assert events[0].type == "message_start" and final.stop_reason == "max_tokens"
        assert [b.model_dump() for b in final.content] == [b.model_dump() for b in m.content]
    # thinking.budget_tokens: ik's reasoning budget (</think> forced after that many thinking tokens)
    # (the chat endpoint's thinking_budget_tokens: the same answer)
    for budget in (2, 5):
        short = a.messages.create(model=MODEL, max_tokens=12, thinking={"type": "enabled", "budget_tokens": budget},
                                  messages=[{"role": "user", "content": "why"}])
        same = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "why"}], max_tokens=12,
                                         extra_body={"thinking_budget_tokens": budget}).choices[0].message
        thought = [b.thinking for b in short.content if b.type == "thinking"]
        assert thought == ([same.model_extra["reasoning_content"]] if same.model_extra.get("reasoning_content")
                           else []) and "".join(b.text for b in short.content if b.type == "text") == same.content
    n = a.messages.count_tokens(model=MODEL, system="Be brief.", messages=[{"role": "user", "content": "why"}])
    assert n.input_tokens == chat.usage.prompt_tokens
    with pytest.raises(anthropic.BadRequestError) as e:
        a.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "system", "content": "x"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    # Claude Code's x-anthropic-* system block is not the model's (ik drops it); a server tool is a function
    plain = a.messages.count_tokens(model=MODEL, system=[{"type": "text", "text": "Be brief."}],
                                    messages=[{"role": "user", "content": "why"}])
    billed = a.messages.count_tokens(model=MODEL, system=[{"type": "text", "text": "x-anthropic-billing: 1"},
                                                          {"type": "text", "text": "Be brief."}],
                                     messages=[{"role": "user", "content": "why"}])
    assert billed.input_tokens == plain.input_tokens
    # (count_tokens: the tool list alone is longer than a slot of this server)
    hi = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    st, with_tool = call(server, "POST", "/v1/messages/count_tokens", {"model": MODEL, "tools": [
        {"type": "bash_20250124", "name": "bash"}], "messages": [{"role": "user", "content": [
            {"type": "text", "text": "hi"}, {"type": "web_search_tool_result", "content": []}]}]})
    st2, bare = call(server, "POST", "/v1/messages/count_tokens", {"model": MODEL, "messages": hi})
    assert st == st2 == 200 and with_tool["input_tokens"] > bare["input_tokens"], (with_tool, bare)
    for bad_body in ({"messages": [{"role": "user", "content": "x"}]},  # no max_tokens
                     {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
                     {"max_tokens": 4, "messages": "x"}, {"max_tokens": 4, "messages": [{"role": "user",
                      "content": "x"}], "tool_choice": {"type": "sometimes"}},
                     {"max_tokens": 4, "messages": [{"role": "user", "content": []}]},
                     {"max_tokens": 4, "top_k": -5, "messages": [{"role": "user", "content": "x"}]},
                     {"max_tokens": 4, "metadata": 5, "messages": [{"role": "user", "content": "x"}]},
                     {"max_tokens": 4, "tools": [{"name": "f", "input_schema": 5}],
                      "messages": [{"role": "user", "content": "x"}]}):
        st, body = call(server, "POST", "/v1/messages", {"model": MODEL, **bad_body})
        assert st == 400 and body["type"] == "error" and body["error"]["message"], (bad_body, body)
