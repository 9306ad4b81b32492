"""Chat templates (ikjax.chat_template): rendered as transformers' apply_chat_template renders them,
DeepSeek R1's template byte for byte, the fallbacks by pre-tokenizer, one-line refusals, and
R1's <think> block split off the answer (llama-server's --reasoning-format deepseek), whole and
streamed with the tags cut anywhere."""
from __future__ import annotations

import hashlib
import logging
import random
import re

import pytest

from ikjax.chat_template import (BUILTINS, ChatTemplate, ChatTemplateError, ReasoningSplitter, builtin, check_choice,
                                 developer_as_system, fallback_name, flatten_content, opens_reasoning, split_prefill,
                                 split_reasoning, template_for)
from ikjax.errors import OptionError

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
# sha256 of DeepSeek-R1's tokenizer_config.json chat_template (the string, no trailing newline)
R1_SHA256 = "56a1447ad31926fdc21fb07e56e5642bd9c850c4f52d8c8af7bbe5f079a84f5f"

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "<think>\nthe user greets\n</think>\n\nHello! 日本 \"q\" <b>"},
     {"role": "user", "content": "And now?\nTwo lines."}],
    [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": ""},
     {"role": "tool", "content": "{\"t\": 21}"}, {"role": "tool", "content": "sunny"},
     {"role": "assistant", "content": "21 and sunny"}, {"role": "user", "content": "thanks"}],
]

# every feature of the environment: whitespace control, loop controls, namespace, dict, tojson
# (non-ASCII, HTML characters, indent), raise_exception guarded, generation blocks, the variables
FEATURES = """{%- set ns = namespace(n=0) -%}
{{ bos_token }}
{% for m in messages %}
    {% if loop.index > 3 %}{% break %}{% endif %}
    {% set ns.n = ns.n + 1 %}
    <{{ m.role }}>{{ m['content'] | trim }}</{{ m.role }}>
    {% if m.role == 'assistant' %}{% generation %}[{{ m.content }}]{% endgeneration %}{{ eos_token }}{% endif %}
{% endfor %}
{{ dict(a=1, b='é<&>') | tojson }} {{ messages | tojson(indent=2) }}
{{ ns.n }} {{ tools is none }} {{ custom_var | default('none') }}
{% if messages | length > 10 %}{{ raise_exception('too many') }}{% endif %}
{%- if add_generation_prompt %}<assistant>{% endif %}"""


def _hf(template: str):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), bos_token=BOS, eos_token=EOS,
                                   chat_template=template)


def test_r1_template_is_deepseeks_byte_for_byte():
    t = builtin("deepseek-r1")
    assert hashlib.sha256(t.source.encode("utf-8")).hexdigest() == R1_SHA256
    assert t.source.endswith("{{'<｜Assistant｜><think>\\n'}}{% endif %}")  # R1's generation prompt opens <think>


def test_deepseek3_is_the_turn_format_without_reasoning_opened():
    """`deepseek3` ends the prompt with `<｜Assistant｜>` (a V3 model's whole answer once came back as
    reasoning_content under R1's `<think>` opening) and writes the V3 turns R1's first template got
    wrong: every system message (developer too, as a system one), a lone call's section closed, a
    second call turn opened again, text beside calls, a reply after tool results."""
    t = template_for({}, "deepseek3", bos_token=BOS, eos_token=EOS)
    msgs = [{"role": "user", "content": "Hello there"}]
    got = t.render(msgs)
    assert got == f"{BOS}<｜User｜>Hello there<｜Assistant｜>" and not opens_reasoning(got)
    two = developer_as_system([{"role": "developer", "content": "D"}, {"role": "system", "content": "S"},
                               {"role": "user", "content": "U"}], t.source)
    assert t.render(two) == f"{BOS}D\n\nS<｜User｜>U<｜Assistant｜>"
    call = lambda city: {"id": "c", "type": "function",  # noqa: E731
                         "function": {"name": "get_weather", "arguments": f'{{"city": "{city}"}}'}}
    section = lambda *cities: ("<｜tool▁calls▁begin｜>" + "\n".join(  # noqa: E731
        f'<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{{"city": "{c}"}}\n```<｜tool▁call▁end｜>'
        for c in cities) + "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>")
    chat = [{"role": "user", "content": "Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call("Paris")]},
            {"role": "tool", "content": "18C"},
            {"role": "assistant", "content": "It is 18C."},
            {"role": "user", "content": "Rome and Oslo?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [call("Rome"), call("Oslo")]},
            {"role": "tool", "content": "20C"}, {"role": "tool", "content": "5C"}]
    want = (f"{BOS}<｜User｜>Paris?<｜Assistant｜>" + section("Paris")
            + "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>18C<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
            + "It is 18C.<｜end▁of▁sentence｜><｜User｜>Rome and Oslo?<｜Assistant｜>Checking." + section("Rome", "Oslo")
            + "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>20C<｜tool▁output▁end｜>\n<｜tool▁output▁begin｜>5C"
            + "<｜tool▁output▁end｜><｜tool▁outputs▁end｜>")
    assert t.render(chat) == want  # after tool results the model answers on: no new assistant header
    assert t.render(chat[:4] + [{"role": "user", "content": "Thanks"}]).endswith(
        "It is 18C.<｜end▁of▁sentence｜><｜User｜>Thanks<｜Assistant｜>")
    assert t.render([{"role": "assistant", "content": "a</think>b"}], add_generation_prompt=False) \
        == f"{BOS}<｜Assistant｜>b<｜end▁of▁sentence｜>"


@pytest.mark.parametrize("name", ["deepseek3", "deepseek-r1", "deepseek2", "chatml", "features"])
def test_renders_as_transformers(name):
    """The same template string and messages give transformers' apply_chat_template text, with and
    without the generation prompt."""
    src = FEATURES if name == "features" else builtin(name).source
    ours = template_for({}, src, bos_token=BOS, eos_token=EOS)
    hf = _hf(src)
    for msgs in CONVERSATIONS:
        for agp in (True, False):
            want = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=agp)
            assert ours.render(msgs, add_generation_prompt=agp) == want, (name, msgs, agp)
    msgs = CONVERSATIONS[2]
    assert ours.render(msgs, custom_var="x") == hf.apply_chat_template(msgs, tokenize=False,
                                                                       add_generation_prompt=True, custom_var="x")


def test_r1_renders_the_turn_format():
    t = template_for({}, "deepseek-r1", bos_token=BOS, eos_token=EOS)
    got = t.render(CONVERSATIONS[2])
    # system first, the earlier answer without its <think> block, the generation prompt opening one
    assert got == (f"{BOS}S<｜User｜>Hi<｜Assistant｜>\n\nHello! 日本 \"q\" <b>{EOS}<｜User｜>And now?\nTwo lines."
                   "<｜Assistant｜><think>\n")
    assert opens_reasoning(got) and not opens_reasoning(t.render(CONVERSATIONS[2], add_generation_prompt=False))
    # a prefill's own tags say where it leaves the block; without any, the prompt's end says
    assert opens_reasoning(got + "Let me", "Let me") and not opens_reasoning(got + "x</think>ok", "x</think>ok")
    assert opens_reasoning(got + "a</think>b<think>c", "a</think>b<think>c")
    plain = t.render(CONVERSATIONS[2], add_generation_prompt=False)
    assert opens_reasoning(plain + "<think>hm", "<think>hm") and not opens_reasoning(plain + "hm", "hm")
    # an assistant tool call (content None, as OpenAI clients send it) renders R1's tool-call block
    calls = [{"role": "user", "content": "q"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}]
    assert "<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"a\": 1}\n```<｜tool▁call▁end｜>" in t.render(calls)
    v2 = template_for({}, "deepseek2", bos_token=BOS, eos_token=EOS).render(CONVERSATIONS[1])
    assert v2 == f"{BOS}You are terse.\n\nUser: 2+2?\n\nAssistant:"
    chatml = template_for({}, "chatml").render(CONVERSATIONS[0])
    assert chatml == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


class _Records(logging.Handler):
    """The records of the "ikjax" logger itself: a CLI test earlier in the session may have set
    that logger not to propagate (ikjax.cli.common.setup_logging), which hides them from caplog."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_gguf_template_first_then_fallback_by_pre_tokenizer():
    own = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    t = template_for({"tokenizer.chat_template": own, "tokenizer.ggml.pre": "deepseek-v3"})
    assert t.name == "gguf" and t.render(CONVERSATIONS[0]) == "[Hi]"
    logger = logging.getLogger("ikjax")
    for pre, name in (("deepseek-v3", "deepseek3"), ("deepseek-llm", "deepseek2"), ("gpt-2", "chatml"),
                      (None, "chatml")):
        meta = {} if pre is None else {"tokenizer.ggml.pre": pre}
        rec, level, disabled = _Records(), logger.level, logging.root.manager.disable
        logger.addHandler(rec)
        logger.setLevel(logging.WARNING if level == logging.NOTSET or level > logging.WARNING else level)
        logging.disable(logging.NOTSET)  # a library imported earlier in the session may have disabled levels
        was_disabled, logger.disabled = logger.disabled, False
        try:
            t = template_for(meta)
        finally:
            logger.removeHandler(rec)
            logger.setLevel(level)
            logging.disable(disabled)
            logger.disabled = was_disabled
        assert t.name == name and t.source == builtin(name).source
        notes = [r.getMessage() for r in rec.records]
        assert len(notes) == 1 and repr(name) in notes[0] and "\n" not in notes[0], notes
    # a choice beats the file's own
    assert template_for({"tokenizer.chat_template": own}, "chatml").name == "chatml"
    # DeepSeek-V3's pre-tokenizer in a file that names itself R1: R1's template (reasoning opened)
    for meta, name in (({"general.name": "DeepSeek-R1-0528"}, "deepseek-r1"), ({"general.basename": "deepseek_r1"},
                       "deepseek-r1"), ({"general.name": "DeepSeek-V3-0324"}, "deepseek3"),
                       ({"general.name": "R1"}, "deepseek-r1"), ({"general.name": "Moonlight-16B-R1x"}, "deepseek3")):
        assert fallback_name({"tokenizer.ggml.pre": "deepseek-v3", **meta}) == name, meta


def test_choice_name_file_or_text(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ bos_token }}{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}", encoding="utf-8")
    t = template_for({}, str(f), bos_token="<s>")
    assert t.name == str(f) and t.render(CONVERSATIONS[1]) == "<s>system:You are terse.;user:2+2?;"
    assert template_for({}, "{{ messages[0].content }}").render(CONVERSATIONS[0]) == "Hi"
    for name in BUILTINS:
        assert template_for({}, name).name == name


def test_bad_choices_are_one_line_errors(tmp_path):
    bad = tmp_path / "latin1.jinja"
    bad.write_bytes(b"{{ '\xe9' }}")
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}", encoding="utf-8")
    cases = [("deepseek9", "deepseek9"), (str(tmp_path / "missing.jinja"), "missing.jinja"),
             (str(tmp_path), "not a file"), (str(bad), "not UTF-8"), (str(broken), "syntax error")]
    for choice, word in cases:
        with pytest.raises(OptionError) as e:
            template_for({}, choice)
        msg = str(e.value)
        assert word in msg and "\n" not in msg, msg
        with pytest.raises(OptionError):
            check_choice(choice)  # the CLI refuses it before loading a model
    with pytest.raises(OptionError, match="syntax error"):
        template_for({"tokenizer.chat_template": "{% if %}"})


def test_render_refusals_are_one_line():
    t = ChatTemplate(FEATURES, "features")
    with pytest.raises(ChatTemplateError, match="too many"):
        t.render([{"role": "user", "content": "x"}] * 11)
    with pytest.raises(ChatTemplateError):  # the sandbox: no reach into Python internals
        ChatTemplate("{{ ''.__class__.__mro__ }}", "evil").render([])
    with pytest.raises(ChatTemplateError, match="underscore|'_'"):
        ChatTemplate("{% set ns = namespace(_x=1) %}", "evil").render([])
    with pytest.raises(ChatTemplateError):  # R1 concatenates content: a list is refused, one line
        builtin("deepseek3").render([{"role": "user", "content": [{"type": "text", "text": "a"}]}])
    with pytest.raises(ChatTemplateError, match="messages"):
        builtin("chatml").render("hello")


def test_split_prefill():
    """A final assistant message without tool calls is the answer's start (llama-server's prefill)."""
    u, a = {"role": "user", "content": "q"}, {"role": "assistant", "content": "Sure"}
    assert split_prefill([u, a]) == ([u], "Sure")
    assert split_prefill([u]) == ([u], None) and split_prefill([u, a], False) == ([u, a], None)
    call = {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f"}}]}
    assert split_prefill([u, call]) == ([u, call], None)  # a call turn is a turn
    assert split_prefill([u, {"role": "assistant", "content": None}]) == ([u], "")
    with pytest.raises(ChatTemplateError, match="two assistant messages"):
        split_prefill([u, a, a])


def test_flatten_content_parts():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "c"}]
    assert flatten_content(msgs) == [{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": "c"}]
    assert msgs[0]["content"][0] == {"type": "text", "text": "a"}  # the caller's messages untouched
    # a newline only once text has gathered (llama-server's join): an empty first part adds none
    parts = lambda *ts: [{"role": "user", "content": [{"type": "text", "text": t} for t in ts]}]  # noqa: E731
    assert [flatten_content(parts(*ts))[0]["content"] for ts in (("", "b"), ("a", "", "b"), ("", ""), ("a", ""))] \
        == ["b", "a\n\nb", "", "a\n"]
    from ikjax.server.openai import messages_field
    assert messages_field({"messages": parts("", "b")})[0]["content"] == "b"
    with pytest.raises(ChatTemplateError, match="image_url"):
        flatten_content([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    # a text part without its text (stop 64's probe: "only text parts are supported, got 'text'")
    with pytest.raises(ChatTemplateError, match=r"content\[0\]: a text part needs a string 'text'"):
        flatten_content([{"role": "user", "content": [{"type": "text"}]}])
    from ikjax.server.openai import ApiError
    with pytest.raises(ApiError, match=r"content\[1\]: a text part needs a string 'text'"):
        messages_field({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": 3}]}]})
    # absent or null content: empty text, as the server reads it (the template failed: "'dict object' has
    # no attribute 'content'"), kept None for an assistant's tool-call turn
    calls = [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]
    assert flatten_content([{"role": "user"}, {"role": "user", "content": None},
                            {"role": "assistant", "content": None, "tool_calls": calls}]) == [
        {"role": "user", "content": ""}, {"role": "user", "content": ""},
        {"role": "assistant", "content": None, "tool_calls": calls}]
    assert builtin("deepseek3").render(flatten_content([{"role": "user"}])).endswith("<｜User｜><｜Assistant｜>")


SPLITS = [
    # (text, opened, reasoning, content)
    ("<think>\nI should add.\n</think>\n\nFour.", False, "I should add.", "Four."),
    ("  <think>a</think>b", False, "a", "b"),
    ("I should add.\n</think>\n\nFour.", True, "I should add.", "Four."),
    ("I should add.\n</think>\n\nFour.", None, "I should add.", "Four."),  # R1 left the tag to the prompt
    ("still thinking <", True, "still thinking <", ""),  # cut off inside the reasoning
    ("<think>\n\n</think>\n\nHi", False, None, "Hi"),  # empty reasoning: none
    ("Plain answer, no tags.", False, None, "Plain answer, no tags."),
    ("Plain <thin", False, None, "Plain <thin"),
    ("  <thi", False, None, "  <thi"),  # could have been a tag, never became one
    ("<think>x</think>y</think>z", False, "x", "y</think>z"),
    ("a < b </thin k> c</think>  d < e", True, "a < b </thin k> c", "d < e"),
    ("", True, None, ""),
]


@pytest.mark.parametrize("text,opened,reasoning,content", SPLITS)
def test_split_reasoning(text, opened, reasoning, content):
    assert split_reasoning(text, opened) == (reasoning, content)


@pytest.mark.parametrize("text,opened,reasoning,content", [s for s in SPLITS if s[1] is not None])
def test_reasoning_splitter_streams_with_tags_cut_anywhere(text, opened, reasoning, content):
    """Deltas of every size, cut at every place (one character at a time, and random cuts): the
    deltas add up to split_reasoning's parts, and no delta carries part of a tag or spaces that
    end up stripped."""
    rng = random.Random(0)
    cuts = [list(range(1, len(text)))] + [sorted(rng.sample(range(1, len(text)), min(k, max(len(text) - 1, 0))))
                                          for k in (1, 2, 3, 5) for _ in range(20)]
    for cut in cuts:
        bounds = [0, *cut, len(text)]
        s = ReasoningSplitter(opened=bool(opened))
        r, c = [], []
        for a, b in zip(bounds, bounds[1:]):
            dr, dc = s.feed(text[a:b])
            r.append(dr)
            c.append(dc)
        dr, dc = s.finish()
        r.append(dr)
        c.append(dc)
        assert ("".join(r) or None, "".join(c)) == (reasoning, content), (text, cut)
        assert not any("</think>" in x or x.endswith("</") for x in r)


@pytest.mark.parametrize("src,words", [
    # strings or lists doubled without printing (the output check never ran): refused by size
    ("{% set ns = namespace(x='a') %}{% for i in range(40) %}{% set ns.x = ns.x ~ ns.x %}{% endfor %}{{ ns.x|length }}",
     "concatenation"),
    ("{% set ns = namespace(x=[1]) %}{% for i in range(40) %}{% set ns.x = ns.x + ns.x %}{% endfor %}{{ ns.x|length }}",
     "too long|took over"),  # (64 Mi items take ~1.5 s: the time limit may come first)
    ("{% set ns = namespace(x='ab') %}{% for i in range(40) %}{% set ns.x = ns.x|replace('a', 'aa') %}{% endfor %}",
     "|replace"),
    ("{{ 'x' * 10**10 }}", "repetition"),    # (a raw MemoryError)
    (r"{{ 10 ** 100000 }}", "power"),          # (one C call: no check inside it)
    ("{{ lipsum(300000, html=False) }}", "lipsum"),  # (36 s in one call)
    # a loop that prints nothing: stopped by time (the limit made short here)
    ("{% set ns = namespace(x=0) %}{% for i in range(99999) %}{% for j in range(99999) %}{% set ns.x = ns.x + 1 %}"
     "{% endfor %}{% endfor %}", "took over"),
])
def test_a_template_that_grows_or_loops_is_refused_in_one_line(src, words, monkeypatch):
    """A model file's template is untrusted: whatever it makes or takes is bounded by checks inside
    the render (an outside probe: loops that print nothing ran without end, namespace doubling grew
    the process until it died, `'x' * 10**10` was a raw MemoryError), in one ChatTemplateError."""
    import time

    import ikjax.chat_template as ct
    monkeypatch.setattr(ct, "MAX_RENDER_SECONDS", 1.0)
    t0 = time.perf_counter()
    with pytest.raises(ct.ChatTemplateError) as e:
        ct.ChatTemplate(src, "probe").render([{"role": "user", "content": "hi"}])
    msg = str(e.value)
    assert re.search(words, msg) and "\n" not in msg and msg.count("chat template probe") == 1, msg
    assert time.perf_counter() - t0 < 20
    # the trace function is gone afterwards, and a well-behaved template still renders
    import sys
    assert sys.gettrace() is None or "ikjax" not in getattr(sys.gettrace(), "__module__", "")
    assert ct.ChatTemplate("{% for m in messages %}{{ m.content ~ '!' * 2 }}{% endfor %}").render(
        [{"role": "user", "content": "hi"}]) == "hi!!"
