"""The Python API refuses bad arguments up front (OptionError naming the parameter), and
`generate` / `generate_batch` stop at the context end the same way (a sequence never holds more
than ctx tokens; stop_reason "context")."""
from __future__ import annotations

import logging

import numpy as np
import pytest

import ikjax
from ikjax.errors import OptionError
from ikjax.runtime.sampling import check_count, check_sampling, sample_next

CTX = 24


@pytest.fixture(scope="module")
def eng(tiny_model):
    # ctx 24 with ubatch 8: a context end reachable in a few decode steps
    return ikjax.load(tiny_model, ctx=CTX, ubatch=8, batch=8, kv_block=8)


BAD_ARGS = [
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 2.0}, "max_tokens"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": "0.8"}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"min_p": 5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"seed": "abc"}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"seed": -2}, "seed"),
    ({"stop": 5}, "stop"),
    ({"stop": ["a"]}, "stop"),
    ({"stop": [10 ** 6]}, "stop"),  # outside the vocabulary: it could never come
    ({"stop": [-1]}, "stop"),
]


@pytest.mark.parametrize("kw", [{"stream": "yes"}, {"ignore_eos": "no"}, {"stream": 1}])
def test_flags_are_booleans(eng, kw):
    """generate's True / False options refuse other values ("no" was taken as true)."""
    with pytest.raises(OptionError, match=f"^{next(iter(kw))}: expected True or False"):
        eng.generate([1, 2, 3], 2, **kw)
    with pytest.raises(OptionError, match=f"^{next(iter(kw))}: expected True or False"):
        eng.complete("hi", 2, **kw)
    assert list(eng.generate([1, 2, 3], 2, stream=np.bool_(True), ignore_eos=False))


def test_chat_names_an_unknown_option(eng):
    with pytest.raises(OptionError, match="^chat: unknown option foo"):
        eng.chat([{"role": "user", "content": "hi"}], 2, foo=1)


@pytest.mark.parametrize("role", ["User", "human", "system ", "function", "wizard"])
def test_chat_refuses_a_role_the_template_would_drop(eng, role):
    """A message whose role the template does not know vanished from the prompt, and an answer came
    as if it had not been sent (an outside probe, stop 65: `eng.chat([{"role": "User", ...}])`
    rendered the bare assistant opening). Refused naming the message, as the server refuses it."""
    from ikjax.chat_template import ChatTemplateError
    with pytest.raises(ChatTemplateError, match=r"^messages\[1\]\.role: expected one of system, developer, user"):
        eng.chat([{"role": "user", "content": "hi"}, {"role": role, "content": "hello"}], 2)


def _call(eng, fn, kw):
    kw = dict(kw)
    max_tokens = kw.pop("max_tokens", 4)
    if fn == "generate":
        return eng.generate([1, 2, 3], max_tokens, **kw)
    return eng.generate_batch([[1, 2, 3], [4, 5]], max_tokens, **kw)


@pytest.mark.parametrize("fn", ["generate", "generate_batch"])
@pytest.mark.parametrize("kw,name", BAD_ARGS, ids=[f"{k}" for k, _ in BAD_ARGS])
def test_bad_argument_refused_naming_it(eng, fn, kw, name):
    before = eng.compile_count
    with pytest.raises(OptionError, match=f"^{name}:"):
        _call(eng, fn, kw)  # eager: generate refuses at the call, not at the first next()
    assert eng.compile_count == before  # nothing ran


@pytest.mark.parametrize("fn", ["generate", "generate_batch"])
def test_token_id_outside_vocab_is_named(eng, fn):
    V = eng.config.vocab_size
    with pytest.raises(OptionError, match=f"token id {V} at index 1 is outside the vocabulary"):
        if fn == "generate":
            eng.generate([3, V, 4], 2)
        else:
            eng.generate_batch([[1, 2], [3, V, 4]], 2)
    with pytest.raises(OptionError, match="token id -1 at index 0"):
        eng.logits([-1, 2])
    for bad in ([], [[1, 2]], ["a", "b"], [1.5, 2.0]):
        with pytest.raises(OptionError):
            eng.generate(bad, 2)
    with pytest.raises(OptionError, match="prompts"):
        eng.generate_batch([], 2)


@pytest.mark.parametrize("fn", ["generate", "generate_batch"])
def test_prompt_longer_than_context_refused(eng, fn):
    long = list(range(3, 3 + CTX + 1))
    with pytest.raises(OptionError, match=f"{CTX + 1} tokens exceed the context size ctx={CTX}"):
        if fn == "generate":
            eng.generate(long, 1)
        else:
            eng.generate_batch([[1, 2], long], 1)


def test_context_end_same_in_generate_and_batch(eng, caplog):
    """Both stop when prompt + generated reaches ctx, with the same tokens and stop_reason."""
    prompts = [list(range(5, 5 + 18)), list(range(40, 40 + 10))]
    with caplog.at_level(logging.WARNING, logger="ikjax"):
        singles = []
        for p in prompts:
            g = eng.generate(p, 100, stop=())
            singles.append((list(g), g.stop_reason))
        batch = eng.generate_batch(prompts, 100, stop=())
    assert "context full" in caplog.text
    for (toks, reason), p in zip(singles, prompts):
        assert reason == "context"
        assert len(p) + len(toks) == CTX
    assert [list(b) for b in batch] == [t for t, _ in singles]
    assert batch.stop_reasons == ["context", "context"]


def test_max_tokens_and_stop_reasons(eng):
    g = eng.generate([1, 2, 3], 3, stop=())
    assert g.stop_reason is None
    toks = list(g)
    assert len(toks) == 3 and g.stop_reason == "max_tokens"
    g = eng.generate([1, 2, 3], 10, stop=(toks[1],))
    assert list(g) == toks[:2] and g.stop_reason == "eos"
    g = eng.generate([1, 2, 3], 0)
    assert list(g) == [] and g.stop_reason == "max_tokens"
    b = eng.generate_batch([[1, 2, 3], [7, 8]], 0)
    assert b == [[], []] and b.stop_reasons == ["max_tokens", "max_tokens"]
    full = eng.generate(list(range(3, 3 + CTX)), 5)
    assert list(full) == [] and full.stop_reason == "context"
    b = eng.generate_batch([[1, 2, 3], [7, 8]], 3, stop=(toks[1],))
    assert b[0] == toks[:2] and b.stop_reasons[0] == "eos" and len(b[1]) == 3 and b.stop_reasons[1] == "max_tokens"


def test_numpy_scalars_and_seed_conventions(eng):
    a = list(eng.generate(np.array([1, 2, 3]), np.int64(3), temperature=np.float32(1.0), top_k=np.int32(5),
                          seed=np.int64(7), stop=()))
    b = list(eng.generate([1, 2, 3], 3, temperature=1.0, top_k=5, seed=7, stop=()))
    assert a == b
    assert check_sampling(seed=-1)["seed"] is None  # llama.cpp: -1 = random


def test_check_helpers_and_sampler_edges():
    assert check_count("n", 0) == 0
    with pytest.raises(OptionError, match="^n:"):
        check_count("n", "3")
    assert check_sampling(1, 0, 1, 0, None) == dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=None)
    logits = np.array([0.0, 3.0, 1.0, 2.0])
    # min_p = 1 keeps exactly the most likely token; top_p tiny too
    assert sample_next(logits, temperature=1.0, min_p=1.0, rng=np.random.default_rng(0)) == 1
    assert sample_next(logits, temperature=1.0, top_p=1e-9, rng=np.random.default_rng(0)) == 1


def test_a_load_interrupted_in_the_runtime_import_leaves_the_next_one_working(tiny_model):
    """Ctrl-C while a notebook's first `ikjax.load` imports the runtime (an outside probe, stop 65): every
    later `ikjax.load` failed with "module 'ikjax.ops' has no attribute 'registry'" until the process
    restarted. The interrupted import now takes its half-made modules back out of sys.modules; the
    next load imports them afresh and runs. (The interrupt raised from the import hook, at the third
    import of ikjax.ops: where a real one landed.)"""
    import subprocess
    import sys
    script = """
import builtins, sys
import ikjax
real, seen = builtins.__import__, [0]
def imp(name, *a, **k):
    if name.startswith("ikjax.ops"):
        seen[0] += 1
        if seen[0] == 3:
            raise KeyboardInterrupt
    return real(name, *a, **k)
builtins.__import__ = imp
try:
    ikjax.load
except KeyboardInterrupt:
    print("interrupted")
builtins.__import__ = real
print(ikjax.load(sys.argv[1], ctx=32).logits([1, 2]).shape)
"""
    res = subprocess.run([sys.executable, "-c", script, str(tiny_model)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["interrupted", "(2,", f"{ikjax.load(tiny_model, ctx=32).config.vocab_size})"]


def test_numpy_integers_are_integers_to_the_options():
    """`ikjax.load(M, ctx=np.int64(64))` was refused ("expected an integer, got np.int64(64)") while
    ctx=" 64 " was taken (an outside probe, stop 65): NumPy's integers are integers; a float still is not."""
    from ikjax.options import RunOptions
    o = RunOptions.from_kwargs(ctx=np.int64(64), ubatch=np.int32(16), threads=np.uint8(2))
    assert (o.ctx, o.ubatch, o.threads) == (64, 16, 2) and type(o.ctx) is int
    with pytest.raises(OptionError, match="ctx: expected an integer"):
        RunOptions.from_kwargs(ctx=np.float64(64))
    with pytest.raises(OptionError, match="ctx: expected an integer"):
        RunOptions.from_kwargs(ctx=np.bool_(True))


@pytest.mark.parametrize("path", ["", "  ", b"/tmp/model.gguf", None, 5])
def test_load_names_a_path_that_is_no_path(path):
    """`ikjax.load("")` said ".: not a regular file (a directory)" and `ikjax.load(b"...")` "cannot open: no
    such file" for a file that exists (an outside probe, stop 65): the argument itself is named."""
    with pytest.raises(OptionError, match=r"^path: expected the model file's path"):
        ikjax.load(path)


def test_tokenizer_flags_are_booleans(eng):
    """`tokenizer.encode("a", add_bos="no")` added BOS (the string read as true; an outside probe, stop 65)."""
    tok = eng.tokenizer
    for kw in ({"add_bos": "no"}, {"add_bos": 0}, {"parse_special": "false"}):
        with pytest.raises(OptionError, match=f"^{next(iter(kw))}: expected True or False"):
            tok.encode("a", **kw)
    assert tok.encode("a", add_bos=np.bool_(False)) == tok.encode("a", add_bos=False)


def test_a_session_taken_by_two_threads_at_once_goes_to_one(eng):
    """Two threads starting a generation on one session: exactly one runs, the other is refused.
    Thread A is held inside `_acquire` right after its busy check while thread B tries (an outside
    probe saw both pass the check-then-set, 3 times in 1500 trials, one cache given to both)."""
    import inspect
    import sys
    import threading

    from ikjax.runtime.generation import KVSession
    lines, first = inspect.getsourcelines(KVSession._acquire)
    hold_at = first + next(i for i, l in enumerate(lines) if "self._busy = True" in l)
    code = KVSession._acquire.__code__
    paused, go = threading.Event(), threading.Event()
    s = eng.session()
    out = {}

    def run(name, traced):
        def local(frame, event, arg):
            if event == "line" and frame.f_lineno == hold_at and not paused.is_set():
                paused.set()
                go.wait(10)
            return local
        if traced:
            sys.settrace(lambda f, e, a: local if f.f_code is code else None)
        try:
            out[name] = list(eng.generate([1, 2, 3], 2, session=s))
        except OptionError as e:
            out[name] = str(e)
        finally:
            sys.settrace(None)
    a = threading.Thread(target=run, args=("a", True))
    a.start()
    assert paused.wait(30)
    b = threading.Thread(target=run, args=("b", False))
    b.start()
    b.join(1.0)  # with the lock B waits for A's hand-over (without it B ran through now)
    go.set()
    a.join(60)
    b.join(60)
    ran = [k for k, v in out.items() if isinstance(v, list)]
    assert len(ran) == 1 and "already in use" in out["ab".replace(ran[0], "")], out
    assert not s._busy and list(eng.generate([1, 2, 3], 2, session=s)) == out[ran[0]]


def test_templates_dividing_by_zero_and_impossible_caches_are_one_line(eng):
    """{{ 1/0 }} in a template was a bare ZeroDivisionError; new_cache(10**12) XLA's
    RESOURCE_EXHAUSTED; a closed engine still made caches and sessions."""
    from ikjax.chat_template import ChatTemplateError
    from ikjax.errors import DoesNotFitError
    for src in ("{{ 1/0 }}", "{{ 7 // 0 }}", "{{ 5 % 0 }}", "{% if 3 is divisibleby 0 %}x{% endif %}"):
        with pytest.raises(ChatTemplateError, match="ZeroDivisionError"):
            eng.chat([{"role": "user", "content": "hi"}], 2, chat_template=src)
    with pytest.raises(DoesNotFitError, match="a KV cache of 1000000000000 sequences"):
        eng.new_cache(10 ** 12)
    e2 = ikjax.load(eng.file.path, ctx=CTX, ubatch=8)
    e2.close()
    for call in (lambda: e2.new_cache(1), e2.session, e2.memory_plan):
        with pytest.raises(OptionError, match="closed"):
            call()
