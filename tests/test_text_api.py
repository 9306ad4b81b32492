"""The text API (ikjax.runtime.text, Engine.complete / chat / session) on the tiny synthetic model:
text equal to generate's tokens decoded, streaming token by token with the same tokens, stop
strings that never leak into a stream, whole UTF-8 characters only, the KV cache reused across
turns without changing the answer, the repetition penalty and --ignore-eos."""
from __future__ import annotations

import dataclasses
import os
import re
import threading
import time

import numpy as np
import pytest

import ikjax
from ikjax.errors import OptionError
from ikjax.runtime import generation
from ikjax.runtime.sampling import apply_penalties, sample_device
from ikjax.runtime.text import StopStrings, TextStream, encode_prompt

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def eng(tiny_model):
    return ikjax.load(tiny_model, ctx=256, ubatch=64)


def _text(eng, ids) -> str:
    """generate's ids as text, llama-server's way: control tokens (BOS, EOS) are no text."""
    tok = eng.tokenizer
    return b"".join(tok.piece(i) for i in ids).decode("utf-8", errors="replace")


def test_complete_is_generate_decoded(eng):
    ids = eng.tokenizer.encode(PROMPT)
    want = list(eng.generate(ids, 24))
    c = eng.complete(PROMPT, 24)
    assert c.tokens == want and c.text == _text(eng, want) and c.content == c.text
    assert c.finish_reason == ("stop" if want[-1] == eng.config.eos_token_id else "length")
    assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == (len(ids), 24, len(ids) + 24)
    s = eng.complete(PROMPT, 24, stream=True)
    deltas = list(s)
    assert "".join(deltas) == c.text == s.text and s.tokens == want and s.finish_reason == c.finish_reason
    assert len(deltas) > 1 and all(deltas)
    assert eng.complete(ids, 24).text == c.text  # token ids in, as a prompt


def test_stream_asks_one_token_per_dispatch(eng, monkeypatch):
    """generate(stream=True) runs decode steps of one token (chunk 1), the plain call DECODE_CHUNK
    to a dispatch; both give the same tokens, greedy and for one seed."""
    assert eng.decode_loop()
    calls = []
    real = eng.decode

    def spy(cache, tokens, start, n, **kw):
        calls.append((n, kw["chunk"]))
        return real(cache, tokens, start, n, **kw)

    monkeypatch.setattr(eng, "decode", spy)
    ids = eng.tokenizer.encode(PROMPT)
    for sp in (dict(), dict(temperature=1.0, top_k=40, seed=7)):
        calls.clear()
        plain = list(eng.generate(ids, 20, stop=(), **sp))
        assert calls and all(c == generation.DECODE_CHUNK for _, c in calls)
        calls.clear()
        got = []
        g = eng.generate(ids, 20, stop=(), stream=True, **sp)
        for t in g:
            got.append(t)
            assert len(calls) == len(got) - 1  # each token yielded before the next step runs
        assert calls and set(calls) == {(1, 1)} and got == plain


def test_stop_strings_never_leak(eng):
    full = eng.complete(PROMPT, 40, stop=None).text
    stop = full[10:13]
    k = full.index(stop)
    c = eng.complete(PROMPT, 40, stop=[stop, "never appears \u2603"])
    assert c.text == full[:k] and c.finish_reason == "stop" and len(c.tokens) < 40
    s = eng.complete(PROMPT, 40, stop=stop, stream=True)
    deltas = list(s)
    assert "".join(deltas) == full[:k] and s.finish_reason == "stop"


def test_stop_strings_held_back_across_deltas():
    """StopStrings on every cut of a text: the output is the text up to the first stop string, and
    every piece passed on is final (a later delta never reveals it was the start of a stop)."""
    text = "abc <|im_end|> tail"
    for stops in (["<|im_end|>"], ["<|im_", "zzz"], ["c <"], ["none"]):
        want = text.split(stops[0])[0] if stops[0] in text else text
        for step in (1, 2, 3, 7):
            s = StopStrings(stops)
            out = []
            for i in range(0, len(text), step):
                piece, stopped = s.feed(text[i:i + step])
                out.append(piece)
                if stopped:
                    break
            out.append(s.flush())
            assert "".join(out) == want, (stops, step)
            assert all(want.startswith("".join(out[:j + 1])) for j in range(len(out)))


def test_stream_never_splits_a_character(eng):
    """Multi-byte characters arrive over several byte tokens: no delta holds half of one (no
    U+FFFD), and the deltas add up to the text."""
    text = "héllo 日本語 🎉 ok ß"
    ids = eng.tokenizer.encode(text, add_bos=False)
    assert len(ids) > len(text)  # the synthetic vocabulary splits them into bytes

    class Ids(generation.Generation):
        def __init__(self):
            super().__init__()
            self._it = iter(ids)
            self.stop_reason = "max_tokens"

    s = TextStream(Ids(), eng.tokenizer.detokenizer(), [])
    deltas = list(s)
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas) and len(deltas) < len(ids)
    # a stop string made of multi-byte characters, cut across tokens too
    s = TextStream(Ids(), eng.tokenizer.detokenizer(), ["語 🎉"])
    assert "".join(s) == "héllo 日本" and s.finish_reason == "stop"
    # the model's own (random) bytes: streamed text equals the whole decoded at once
    c = eng.complete(PROMPT, 40)
    assert "".join(eng.complete(PROMPT, 40, stream=True)) == c.text == _text(eng, c.tokens)


def test_chat_session_reuses_the_cache_without_changing_answers(eng):
    t = eng.chat_template()
    assert t.name == "deepseek3"  # the tiny model has no template; pre-tokenizer deepseek-v3
    sess = eng.session()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    one = eng.chat(msgs, 12, session=sess)
    assert one.prompt == t.render(msgs) and one.usage.cached_tokens == 0
    # V3's generation prompt opens no <think>: the answer is content (the random model writes no tag)
    assert one.reasoning_content is None and one.content.strip() == one.text.strip()
    # R1's opens one: without </think> the whole answer is reasoning
    r1 = eng.chat(msgs, 12, chat_template="deepseek-r1")
    assert r1.prompt == t.render(msgs) + "<think>\n"
    assert (r1.reasoning_content, r1.content) == ((r1.text.strip() or None), "")
    msgs += [{"role": "assistant", "content": one.text}, {"role": "user", "content": "And?"}]
    two = eng.chat(msgs, 12, session=sess)
    fresh = eng.chat(msgs, 12)
    assert two.tokens == fresh.tokens and two.text == fresh.text
    assert two.usage.cached_tokens > len(eng.tokenizer.encode(t.render(msgs[:2]))) // 2
    assert sess.ids == encode_prompt(eng, two.prompt) + two.tokens[:-1]  # one BOS: the template's
    # the same prompt again: everything but its last prefill chunk (from an ubatch boundary, as a
    # fresh prefill cuts it) comes from the cache
    again = eng.chat(msgs, 12, session=sess)
    n, ub = again.usage.prompt_tokens, eng.options.ubatch
    assert again.tokens == two.tokens and again.usage.cached_tokens == (n - 1) // ub * ub
    # a stream closed early keeps the cache consistent for the next call
    s = eng.chat(msgs, 12, session=sess, stream=True)
    next(s)
    s.close()
    assert s.finish_reason == "cancelled" and s.usage.completion_tokens >= 1  # (not "stop": it did not end)
    assert eng.chat(msgs, 12, session=sess).tokens == two.tokens
    # a stream left with `break` (never closed): the next call on the session ends it and goes on
    # (it was refused, "already in use", until the garbage collector found the stream)
    import gc
    gc.disable()
    try:
        for i, _ in enumerate(eng.chat(msgs, 12, session=sess, stream=True)):
            if i == 1:
                break
        assert eng.chat(msgs, 12, session=sess).tokens == two.tokens
        left = eng.complete(PROMPT, 12, session=sess, stream=True)
        next(left)
        sess.reset()  # ends it too, then empties the session
        assert sess.ids == [] and sess.cache is None
        # from another thread, an unfinished generation is still an error
        held = eng.complete(PROMPT, 12, session=sess, stream=True)
        next(held)
        errors = []
        t = threading.Thread(target=lambda: errors.append(_raises(lambda: eng.complete(PROMPT, 2, session=sess))))
        t.start()
        t.join()
        assert errors and "another thread" in errors[0]
        held.close()
        assert eng.complete(PROMPT, 2, session=sess).tokens
    finally:
        gc.enable()
    with pytest.raises(OptionError, match="reasoning_format"):
        eng.chat(msgs, 4, reasoning_format="r1")


def _raises(fn) -> str:
    try:
        fn()
    except OptionError as e:
        return str(e)
    return ""


def test_repeat_penalty_is_llama_cpp_s(eng):
    """--repeat-penalty: each of the last N tokens' logits divided (positive) or multiplied
    (negative) by the penalty before choosing; greedy tokens follow that rule step by step."""
    logits = np.array([2.0, -1.0, 0.5, 3.0])
    assert apply_penalties(logits, [0, 1, 1], 2.0).tolist() == [1.0, -2.0, 0.5, 3.0]
    ids = eng.tokenizer.encode("ab ab ab ab ab ab ab ab")
    got = list(eng.generate(ids, 6, repeat_penalty=1.5, repeat_last_n=8, stop=()))
    # the rule applied by hand, one step a token (prompt and answer both in the window)
    logits, cache = eng.prefill(eng.new_cache(1), np.array(ids), 0)
    seq = list(ids)
    for t in got:
        assert t == int(np.argmax(apply_penalties(logits, seq[-8:], 1.5)))
        seq.append(t)
        out, cache = eng.step(cache, np.array([[t]], np.int32), np.array([len(seq) - 1]), np.array([0]))
        logits = np.asarray(out, np.float32)[0]
    with pytest.raises(OptionError, match="repeat_penalty"):
        eng.generate(ids, 2, repeat_penalty=0.0)


def repeating_prompt(eng, ids: list[int], n: int = 160) -> list[int]:
    """`ids` and its greedy continuation up to where greedy would next pick a token already in it:
    a prompt on which a penalty on the window's tokens changes the answer."""
    seq = list(ids)
    for _ in range(n):
        t = list(eng.generate(seq, 1, stop=()))[0]  # greedy's choice after the whole prompt as it is
        if t in seq:
            return seq
        seq.append(t)
    raise AssertionError(f"no greedy repeat within {n} tokens: pick another prompt")


def test_frequency_and_presence_penalties_are_llama_cpp_s(eng):
    """frequency_penalty / presence_penalty (OpenAI's names, llama.cpp's penalties sampler): after
    the repeat part, each id of the window loses count x frequency + presence; greedy tokens
    follow that rule step by step; a value outside [-2, 2] is refused naming it."""
    logits = np.array([2.0, -1.0, 0.5, 3.0])
    got = apply_penalties(logits, [0, 1, 1, 3], repeat=2.0, frequency=0.25, presence=0.5).tolist()
    assert got == [2.0 / 2 - 0.25 - 0.5, -1.0 * 2 - 0.5 - 0.5, 0.5, 3.0 / 2 - 0.25 - 0.5]
    ids = repeating_prompt(eng, eng.tokenizer.encode("ab ab ab ab ab ab ab ab"))
    kw = dict(frequency_penalty=1.5, presence_penalty=0.75, repeat_last_n=-1)  # the whole context
    got = list(eng.generate(ids, 24, stop=(), **kw))
    logits, cache = eng.prefill(eng.new_cache(1), np.array(ids), 0)
    seq = list(ids)
    for t in got:
        assert t == int(np.argmax(apply_penalties(logits, seq, 1.0, 1.5, 0.75)))
        seq.append(t)
        out, cache = eng.step(cache, np.array([[t]], np.int32), np.array([len(seq) - 1]), np.array([0]))
        logits = np.asarray(out, np.float32)[0]
    assert got != list(eng.generate(ids, 24, stop=()))  # the penalties changed the answer
    for name in ("frequency_penalty", "presence_penalty"):
        with pytest.raises(OptionError, match=name):
            eng.generate(ids, 2, **{name: 2.5})


def test_ignore_eos(eng, monkeypatch):
    """With EOS set to the token greedy picks first, generation stops on it; --ignore-eos never
    draws it (banned on the device and on the host) and runs to max_tokens."""
    ids = eng.tokenizer.encode(PROMPT)
    first = list(eng.generate(ids, 8, stop=()))
    monkeypatch.setattr(eng, "config", dataclasses.replace(eng.config, eos_token_id=first[0]))
    g = eng.generate(ids, 8)
    assert list(g) == first[:1] and g.stop_reason == "eos"
    for kw in (dict(), dict(repeat_penalty=1.01)):  # the device loop, and the host's choice
        got = list(eng.generate(ids, 8, ignore_eos=True, **kw))
        assert len(got) == 8 and first[0] not in got, kw
    logits = np.zeros((1, 8), np.float32)
    logits[0, 3] = 5.0
    import jax
    assert int(sample_device(logits, jax.random.key(0), ban=(3,))[0]) != 3


def test_token_logprobs_are_the_log_softmax():
    """sampling.token_logprobs: the chosen id's log-softmax value and the k most likely, in order;
    check_top_logprobs' bounds."""
    from ikjax.runtime.sampling import check_top_logprobs, token_logprobs
    x = np.array([1.0, 3.0, -2.0, 3.5, 0.0])
    ref = x - np.log(np.exp(x).sum())
    lp, top = token_logprobs(x, 2, 3)
    assert lp == pytest.approx(ref[2], abs=1e-12)
    assert [i for i, _ in top] == [3, 1, 0] and [v for _, v in top] == pytest.approx(ref[[3, 1, 0]].tolist(), abs=1e-12)
    assert token_logprobs(x, 0, 0)[1] == () and len(token_logprobs(x, 0, 20)[1]) == 5
    assert check_top_logprobs(None) is None and check_top_logprobs(0) == 0
    for bad_k in (-1, 21, 2.0, True):
        with pytest.raises(OptionError, match="top_logprobs"):
            check_top_logprobs(bad_k)


def test_chat_refuses_messages_a_template_would_drop(eng):
    """A message that is not an object (a ValueError from dict() before), has no role, or holds
    content that is not text is refused naming it: a template renders nothing for a message without
    a role, so its text vanished from the prompt and an answer came all the same."""
    for messages, words in ((["hi"], "messages[0]: expected an object"),
                            ([{"content": "hi"}], "messages[0].role"),
                            ([{"role": "user", "content": "a"}, {"role": "", "content": "b"}], "messages[1].role"),
                            ([{"role": "user", "content": 5}], "messages[0].content")):
        with pytest.raises(ikjax.IkjaxError, match=re.escape(words)):
            eng.chat(messages, 2)
    assert eng.chat([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], 2).text is not None


def test_a_prompt_sent_again_on_a_session_answers_as_fresh():
    """A session holding a prompt whole feeds its last prefill chunk again, cut where a fresh
    prefill cuts it: the kernels' numbers follow a step's row count (decode form under 4 rows, the
    amx level's bf16 tiles from 32 padded rows), and the 2-token re-feed before gave greedy
    answers that left a fresh call's at the 21st token (real-converter fixture, default dtype:
    an outside probe)."""
    from conftest import fixtures_dir
    e = ikjax.load(str(fixtures_dir() / "v3dense-all-Q8_0.gguf"), ctx=256, ubatch=16)
    for prompt in ("Hello there friend", "The quick brown fox jumps over the lazy dog while the cat sleeps " * 2):
        fresh = e.complete(prompt, 30).tokens
        s = e.session()
        e.complete(prompt, 30, session=s)
        again = e.complete(prompt, 30, session=s)
        assert again.tokens == fresh, prompt
        n = again.usage.prompt_tokens
        assert again.usage.cached_tokens == (n - 1) // 16 * 16


def test_api_inputs_an_outside_probe_found(eng, tmp_path):
    """Each was a TypeError / OverflowError / ValueError from a library's depths, a silent no-op
    or a directory made from a typo; now one-line OptionErrors, or taken as the API's peers take
    them."""
    from ikjax.chat_template import ChatTemplateError
    msgs = [{"role": "user", "content": "hi"}]
    for bad in ([-1], [1.5], "abc", [eng.config.vocab_size]):
        with pytest.raises(OptionError, match="token"):
            eng.tokenizer.decode(bad)
    assert eng.tokenizer.decode([1, 2]) == eng.tokenizer.tokenizer.decode([1, 2], skip_special_tokens=False)
    for b in (-1, 0, "2", 1.5):
        with pytest.raises(OptionError, match="batch"):
            eng.new_cache(b)
        with pytest.raises(OptionError, match="batch"):
            eng.memory_plan(b)
    with pytest.raises(OptionError, match="template_kwargs"):
        eng.chat(msgs, 1, template_kwargs="x")
    with pytest.raises(ChatTemplateError):
        eng.chat(msgs, 1, chat_template="{% for i in range(10**9) %}x{% endfor %}")
    with pytest.raises(OptionError, match="expert_counts"):
        ikjax.RunOptions.from_kwargs(expert_counts=str(tmp_path / "s.json"))
    ids = eng.tokenizer.encode("Hello there", False)
    assert eng.complete(np.array(ids), 3).tokens == eng.complete(ids, 3).tokens  # (as generate takes arrays)
    with pytest.raises(OptionError, match="does not exist"):
        eng.save_expert_stats(tmp_path / "no" / "s.json", {"tokens": 0, "layers": {}})
    assert not (tmp_path / "no").exists()


def test_api_inputs_a_second_outside_probe_found(eng, tmp_path):
    """Stop 67's probe of the Python API: a template's nested loops grew the process without end;
    float arrays ran as truncated ids; unknown keywords were Python's TypeError; a stream whose
    session another call took over said "length"; expert statistics of any shape and a path that
    is not a path were written; perplexity's base file replaced whatever file it was given."""
    from ikjax.chat_template import ChatTemplateError
    msgs = [{"role": "user", "content": "hi"}]
    t0 = time.perf_counter()
    with pytest.raises(ChatTemplateError, match="Mi characters|took over"):
        eng.chat(msgs, 1, chat_template="{% for i in range(99999) %}{% for j in range(99999) %}x{% endfor %}"
                                        "{% endfor %}")
    assert time.perf_counter() - t0 < 30
    for kw in ({5: 1}, {"messages": []}, {"add_generation_prompt": False}):
        with pytest.raises(OptionError, match="template_kwargs"):
            eng.chat(msgs, 1, template_kwargs=kw)
    for arr in (np.array([5.7, 6.2]), np.array([True, True])):
        with pytest.raises(OptionError, match="integers"):
            eng.complete(arr, 2)
    for call in (lambda: eng.complete("hi", 2, foo=1), lambda: eng.generate([5], 2, foo=1),
                 lambda: eng.generate_batch([[5]], 2, repeat_penalty=1.1)):
        with pytest.raises(OptionError, match="unknown option"):
            call()
    s = eng.session()
    st = eng.complete("Hello world", 30, stream=True, session=s, ignore_eos=True)
    next(st)
    eng.complete("Hello world", 2, session=s)  # takes the session over: the stream ends
    list(st)
    assert st.finish_reason == "cancelled"
    for path, stats in ((tmp_path / "a.json", 5), (tmp_path / "b.json", {"x": 1}),
                        (tmp_path / "c.json", {"tokens": 3, "layers": {"1": [-1, 2]}}), (7, {"tokens": 0, "layers": {}})):
        with pytest.raises(OptionError, match="expert-stats"):
            eng.save_expert_stats(path, stats)
    assert not any(tmp_path.iterdir()) and not os.path.exists("7")
    victim = tmp_path / "model.gguf"
    victim.write_bytes(b"GGUF" + b"\0" * 100)
    ids = eng.tokenizer.encode("hello world " * 40)
    with pytest.raises(OptionError, match="not a base logits file"):
        eng.perplexity(ids, 64, save_base=victim)
    assert victim.read_bytes() == b"GGUF" + b"\0" * 100
    with pytest.raises(OptionError, match="file path"):
        eng.perplexity(ids, 64, save_base=5)
    base = tmp_path / "base.kld"
    eng.perplexity(ids, 64, save_base=base)
    eng.perplexity(ids, 64, save_base=base)  # a base file is replaced
    assert base.read_bytes()[:8] == b"_logits_"


def test_earlier_tool_call_arguments_that_are_not_json(eng):
    """An earlier turn's tool-call arguments given from Python as something JSON cannot hold (a set):
    one OptionError naming the message and call (a raw TypeError from json.dumps before)."""
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {"a": {1, 2}}}}]},
            {"role": "user", "content": "x"}]
    with pytest.raises(OptionError, match=re.escape("messages[1].tool_calls[0].function.arguments: not JSON")):
        eng.chat(msgs, 1, chat_template="deepseek-r1")
    msgs[1]["tool_calls"][0]["function"]["arguments"] = {"a": [1, 2]}  # JSON: taken
    assert eng.chat(msgs, 1, chat_template="deepseek-r1").usage.completion_tokens == 1
