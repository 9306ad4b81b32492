"""Tool calls (issue 23): OpenAI's `tools` rendered into the prompt, the model's call syntax parsed
back into `tool_calls`, whole and streamed, through the real server app driven by the `openai`
client.

The tiny random model never writes a call, so the end-to-end tests give the app a scheduler whose
answer is scripted: the answer's text is encoded by the model's own tokenizer and handed to the
app token by token through the scheduler's event interface, as the real scheduler hands them; the
template, the tokenizer, the Job's detokenization, the handlers and the client are the real ones.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest

from ikjax.chat_template import AnswerSplitter, builtin
from ikjax.errors import OptionError
from ikjax.chat_template import forced_answer_start
from ikjax.tool_calls import (DS_CALL_BEGIN, DS_CALLS_BEGIN, TOOL_MARKERS, ToolCall, ToolCallSplitter, call_text,
                              check_tools, forced_call, parse_tool_calls, tool_family, tool_messages)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}

R1_ANSWER = ("Let me look.\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
             "```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>"
             "get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
SAMPLES = {
    "r1": (R1_ANSWER, "Let me look.\n", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    "v31": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Oslo\"}"
            "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "", [("get_weather", {"city": "Oslo"})]),
    "kimi": ("ok <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
             "{\"city\": \"Rome\"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1"
             "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>", "ok ",
             [("get_weather", {"city": "Rome"}), ("get_time", {})]),
    "glm": ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Bern</arg_value>\n<arg_key>days</arg_key>"
            "\n<arg_value>3</arg_value>\n</tool_call>", "", [("get_weather", {"city": "Bern", "days": 3})]),
    "hermes": ("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Lima\"}}\n</tool_call>", "",
               [("get_weather", {"city": "Lima"})]),
}


def _calls(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("form", sorted(SAMPLES))
def test_parse_every_call_syntax(form):
    text, content, want = SAMPLES[form]
    got_content, calls = parse_tool_calls(text)
    assert got_content == content and _calls(calls) == want
    assert len({c.id for c in calls}) == len(calls)  # an id each
    if form == "kimi":
        assert [c.id for c in calls] == ["functions.get_weather:0", "functions.get_time:1"]


BAD_ARGS = [  # a call whose arguments are not a JSON object is not a call (a client's json.loads failed on "{")
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\n```<｜tool▁call▁end｜>",
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜><｜tool▁call▁end｜>",
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{bad<|tool_call_end|>",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": \"not json\"}\n</tool_call>",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": \"[1, 2]\"}\n</tool_call>",
    # one good call and one malformed: the section stays text (no call half taken, nothing lost)
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁call▁begin｜>g<｜tool▁sep｜>"
    "{<｜tool▁call▁end｜><｜tool▁calls▁end｜>"]


@pytest.mark.parametrize("text", ["no call here", "a <tool_call> that never ends",
                                  "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weath",
                                  "<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n</tool_call>", *BAD_ARGS])
def test_what_is_not_a_complete_call_stays_content(text):
    assert parse_tool_calls(text) == (text, [])


def test_the_sections_debris_after_its_calls_is_not_content():
    """Text after the last call that holds call markers ("}{<｜tool▁call▁end｜>`") is the section's
    debris, not content (an outside probe saw the markers in `content`); plain text after it stays."""
    calls = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```"
             "<｜tool▁call▁end｜>")
    content, got = parse_tool_calls("hi " + calls + "}{<｜tool▁call▁end｜>`")
    assert content == "hi " and _calls(got) == [("get_time", {})]
    content, got = parse_tool_calls("hi " + calls + "<｜tool▁calls▁end｜> Done.")
    assert content == "hi  Done." and [c.name for c in got] == ["get_time"]


@pytest.mark.parametrize("form", sorted(SAMPLES) + ["plain", "cut"])
def test_streamed_split_equals_the_whole(form):
    """At every split point (and every pair of them for the short texts) the streamed content plus
    finish() equals parse_tool_calls of the whole, and no marker's start is ever sent as content."""
    text = {"plain": "just <tool text, no call <", "cut": R1_ANSWER[:60]}.get(form) or SAMPLES[form][0]
    want_content, want_calls = parse_tool_calls(text)
    cuts = [(i,) for i in range(len(text) + 1)]
    if len(text) < 120:
        cuts += [(i, j) for i in range(0, len(text), 3) for j in range(i, len(text), 5)]
    for cut in cuts:
        bounds = [0, *cut, len(text)]
        s = ToolCallSplitter()
        sent = [s.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])]
        rest, calls = s.finish()
        assert "".join(sent) + rest == want_content, cut
        assert _calls(calls) == _calls(want_calls), cut
        if want_calls:
            assert all("<｜tool" not in x and "<tool_call>" not in x and "<|tool" not in x for x in sent), cut


def test_answer_splitter_reasoning_then_calls():
    """R1's answer with tools: reasoning (the prompt opened <think>), then content and calls. Fed at
    every split point into two deltas, the joined deltas are the whole answer's split."""
    text = "weighing it up </think>\n\n" + R1_ANSWER
    for cut in range(len(text) + 1):
        a = AnswerSplitter(opened=True, tools=True)
        r1, c1 = a.feed(text[:cut])
        r2, c2 = a.feed(text[cut:])
        r3, c3, calls = a.finish()
        assert (r1 + r2 + r3, c1 + c2 + c3) == ("weighing it up", "Let me look.\n"), cut
        assert a.had_reasoning and [c.name for c in calls] == ["get_weather", "get_time"], cut
    plain = AnswerSplitter(opened=None, tools=False)
    assert plain.feed(text) == ("", text) and plain.finish() == ("", "", []) and not plain.had_reasoning


@pytest.mark.parametrize("family", ["deepseek", "deepseek-v3.1", "kimi", "glm", "hermes"])
def test_each_family_parses_its_own_call_text(family):
    calls = [ToolCall("get_weather", '{"city": "Paris", "days": 2}'), ToolCall("get_time", "{}")]
    content, got = parse_tool_calls(call_text(calls, family))
    assert content == "" and _calls(got) == _calls(calls)


def test_a_template_renders_tools_only_where_its_code_reads_them():
    """The tool list goes into the system prompt unless the template's code reads `tools`: a word in
    its text or a comment does not count; a template that reads them gets them as a variable only."""
    reads = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if tools %}[{{ tools | length }} tools]{% endif %}"
    mentions = "{# no tools here #}tools: {% for m in messages %}{{ m['content'] }}{% endfor %}"
    msgs = [{"role": "user", "content": "q"}]
    assert tool_messages(msgs, [WEATHER], reads) == msgs
    injected = tool_messages(msgs, [WEATHER], mentions)
    assert injected[0]["role"] == "system" and '"get_weather"' in injected[0]["content"]


def test_template_families():
    assert tool_family(builtin("deepseek3").source) == "deepseek"
    assert tool_family(builtin("deepseek2").source) == "deepseek"
    assert tool_family(builtin("kimi-k2").source) == "kimi"
    assert tool_family(builtin("chatglm4").source) == "glm"
    assert tool_family(builtin("chatml").source) == "hermes"
    assert tool_family(V31_CALLS) == "deepseek-v3.1"


# DeepSeek V3.1's template's tool-call branch (its calls: NAME<sep>ARGS, no "function" nor fence)
V31_CALLS = ("{%- for tool in message['tool_calls'] %}{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ "
             "tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}"
             "{%- endfor %}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{{'<｜Assistant｜>'}}")


def test_v3_1_template_gets_its_own_call_syntax_everywhere():
    """A V3.1 template renders earlier calls as NAME<sep>ARGS: the tools prompt's example and a forced
    call use the same form (they used V3's `function<sep>NAME` + fenced JSON, two syntaxes in one
    prompt), and the answer parses in it."""
    from ikjax.tool_calls import tools_prompt
    ex = tools_prompt([WEATHER], tool_family(V31_CALLS))
    assert DS_CALL_BEGIN + "function_name<｜tool▁sep｜>{" in ex and "```" not in ex
    opening = forced_call(NAMED, "deepseek-v3.1")
    assert opening == DS_CALLS_BEGIN + DS_CALL_BEGIN + "get_weather<｜tool▁sep｜>"
    content, calls = parse_tool_calls(opening + '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
                                      "deepseek-v3.1", ["get_weather"])
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_r1_template_renders_tools_and_earlier_calls():
    """R1's template has a tool_calls branch (content None) and tool outputs but no `tools`: the
    tool list goes into the system prompt with R1's call syntax; an earlier call whose arguments a
    client sent as an object renders as JSON text; its result as R1's tool output."""
    t = builtin("deepseek3")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"}]
    text = t.render(tool_messages(msgs, [WEATHER], t.source), add_generation_prompt=True, tools=[WEATHER])
    head = text.split("<｜User｜>")[0]
    assert head.startswith("Be brief.\n\n") and '"get_weather"' in head and DS_CALLS_BEGIN + DS_CALL_BEGIN in head
    assert ("<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
            '{"city": "Paris"}\n```<｜tool▁call▁end｜>') in text
    assert "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>sunny, 21 C<｜tool▁output▁end｜><｜tool▁outputs▁end｜>" in text
    # tool_choice "required" / one function: asked for in words (no grammar forces a call here)
    req = t.render(tool_messages(msgs[:2], [WEATHER], t.source, "required"))
    one = t.render(tool_messages(msgs[:2], [WEATHER], t.source, {"type": "function", "function": {"name": "get_weather"}}))
    assert "at least one tool call" in req and "a call of get_weather" in one and "at least one" not in one
    # no tools: the prompt is the template's alone
    plain = [{"role": "user", "content": "hi"}]
    assert t.render(tool_messages(plain, None, t.source)) == t.render(plain)


def test_an_assistant_turn_keeps_its_text_beside_its_calls_where_the_template_renders_both():
    """A client's assistant turn with text and tool_calls: a template that renders the two together
    (DeepSeek V3-0324's, V3.1's form: text, then the calls section) gets the text, as transformers
    and llama-server give it; R1's first template (calls only where content is none) still gets
    content None, or it would drop the calls."""
    from ikjax.chat_template import ChatTemplate, renders_text_beside_calls
    both = ChatTemplate(
        "{%- for m in messages %}{%- if m['role'] == 'user' %}<U>{{ m['content'] }}{%- elif m['role'] == 'assistant' %}"
        "<A>{%- if m['content'] is not none %}{{ m['content'] }}{%- endif %}"
        "{%- if m['tool_calls'] %}{%- for c in m['tool_calls'] %}<call>{{ c['function']['name'] }}:"
        "{{ c['function']['arguments'] }}</call>{%- endfor %}{%- endif %}<end>{%- endif %}{%- endfor %}", "both")
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Let me check.", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}]
    assert renders_text_beside_calls(both.source) and not renders_text_beside_calls(builtin("deepseek-r1").source)
    out = both.render(tool_messages(msgs, None, both.source, keep_text=renders_text_beside_calls(both.source)),
                      add_generation_prompt=False)
    assert out == '<U>Weather in Paris?<A>Let me check.<call>get_weather:{"city": "Paris"}</call><end>', out
    r1 = builtin("deepseek-r1")
    text = r1.render(tool_messages(msgs, None, r1.source, keep_text=renders_text_beside_calls(r1.source)))
    assert "get_weather" in text
    # through the text API, as eng.chat renders it
    from ikjax.runtime.text import render_chat
    assert "Let me check.<call>get_weather" in render_chat(None, msgs, both, add_generation_prompt=False)


def test_earlier_calls_arguments_as_objects_where_the_template_reads_objects():
    """A template that writes `arguments | tojson` (Qwen's, Hermes-style) gets the arguments as an
    object, so they render once encoded, as transformers renders a client's object; DeepSeek's R1
    template, which prints them as they are, gets the JSON text (an outside probe: the Hermes form
    rendered "{\\"city\\": ...}" twice encoded, and a GLM-style `.items()` loop was a 400)."""
    from ikjax.chat_template import ChatTemplate
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    hermes = ChatTemplate("{% for m in messages %}{% for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}"
                          "\", \"arguments\": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}{% endfor %}",
                          name="hermes-like")
    got = hermes.render(tool_messages(msgs, None, hermes.source), add_generation_prompt=False)
    assert got == '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    glm = ChatTemplate("{% for m in messages %}{% for c in m.tool_calls or [] %}{% for k, v in "
                       "c.function.arguments.items() %}{{ k }}={{ v }};{% endfor %}{% endfor %}{% endfor %}", name="glm-like")
    assert glm.render(tool_messages(msgs, None, glm.source), add_generation_prompt=False) == "city=Paris;"
    r1 = builtin("deepseek-r1")
    assert '```json\n{"city": "Paris"}\n```' in r1.render(tool_messages(msgs, None, r1.source))


def test_templates_without_tool_branches_get_calls_as_text():
    """chatml has no tool_calls branch and no tool role test: an earlier call is written in the
    family's syntax into the assistant's content, a result becomes a user turn naming the tool."""
    t = builtin("deepseek2")
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "function": {"name": "get_time", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "name": "get_time", "content": "noon"}]
    text = t.render(tool_messages(msgs, [TIME], t.source), bos_token="", eos_token="<eos>")
    assert "Assistant: <｜tool▁calls▁begin｜>" in text and "Tool result (get_time):\nnoon" in text
    assert text.index('"get_time"') < text.index("User: q")  # the tool list first, in the system part


@pytest.mark.parametrize("tools, choice", [
    ("x", None), ([{"type": "function"}], None), ([{"type": "retrieval", "function": {"name": "a"}}], None),
    ([WEATHER], "sometimes"), ([WEATHER], {"type": "function", "function": {"name": "nope"}}), (None, 3)])
def test_bad_tools_are_refused(tools, choice):
    with pytest.raises(OptionError):
        check_tools(tools, choice)


@pytest.mark.parametrize("calls", ["x", ["x"], [{"function": "f"}], [{"function": {"arguments": "{}"}}]])
def test_malformed_earlier_calls_are_refused(calls):
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": calls}]
    with pytest.raises(OptionError, match=r"messages\[1\]\.tool_calls"):
        tool_messages(msgs, None, builtin("deepseek3").source)


def test_good_tools_pass():
    for choice in (None, "auto", "none", "required", {"type": "function", "function": {"name": "get_time"}}):
        check_tools([WEATHER, TIME], choice)


NAMED = {"type": "function", "function": {"name": "get_weather"}}
# what each family's model writes after a forced opening: (required's rest, the named call's rest)
FORCED_RESTS = {
    "deepseek": ("get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
                 "{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    "deepseek-v3.1": ("get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
                      "{\"city\": \"Paris\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    "kimi": ("get_time:0<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>",
             "{\"city\": \"Paris\"}<|tool_call_end|><|tool_calls_section_end|>"),
    "glm": ("get_time\n</tool_call>", "<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"),
    "hermes": ('get_time", "arguments": {}}\n</tool_call>', '{"city": "Paris"}}\n</tool_call>'),
}


@pytest.mark.parametrize("family", sorted(FORCED_RESTS))
def test_forced_calls_open_the_answer_in_each_family(family):
    """tool_choice "required" / one function: the answer starts with the call section's opening
    in the family's syntax (llama-server forces it by a grammar), so what the model writes next is
    a call's rest; opening plus rest parse as that call, and nothing is forced for auto / none."""
    required, named = FORCED_RESTS[family]
    for choice, rest, want in (("required", required, ("get_time", {})), (NAMED, named, ("get_weather", {"city": "Paris"}))):
        content, calls = parse_tool_calls(forced_call(choice, family) + rest)
        assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [want], (family, choice)
    assert forced_call("auto", family) == forced_call("none", family) == forced_call(None, family) == ""


def test_forced_call_after_r1_s_opened_reasoning():
    """A prompt that opens R1's <think> gets it closed before the forced call (the call comes after
    the thinking; a forced answer has none), and the split gives no reasoning, no content, the call."""
    src = builtin("deepseek-r1").source
    start = forced_answer_start("<｜User｜>hi<｜Assistant｜><think>\n", src, NAMED)
    assert start.startswith("</think>\n\n" + DS_CALLS_BEGIN)
    assert forced_answer_start("<｜User｜>hi<｜Assistant｜>", src, NAMED).startswith(DS_CALLS_BEGIN)
    assert forced_answer_start("<｜User｜>hi<｜Assistant｜>", src, "auto") == ""
    answer = AnswerSplitter(opened=True, tools=True, family="deepseek", names=["get_weather"], forced=start)
    parts = [answer.opening, answer.feed(FORCED_RESTS["deepseek"][1])]
    r, c, calls = answer.finish()
    assert "".join(p[0] for p in parts) + r == "" and ("".join(p[1] for p in parts) + c).strip() == ""
    assert [(t.name, json.loads(t.arguments)) for t in calls] == [("get_weather", {"city": "Paris"})]


def test_calls_only_in_the_family_s_syntax_and_of_offered_tools():
    """With the template's family and the offered names (as the endpoints give them): another
    family's call form is text (a DeepSeek model explaining Qwen's syntax), a call of a function
    not offered is text, and text after the call section stays content."""
    qwen = ('Qwen writes calls like this:\n<tool_call>\n{"name": "delete_all_files", "arguments": {"path": "/"}}\n'
            '</tool_call>\nand the runtime runs them.')
    assert parse_tool_calls(qwen, "deepseek", ["get_weather"]) == (qwen, [])
    assert parse_tool_calls(qwen, "hermes", ["get_weather"]) == (qwen, [])  # not offered
    content, calls = parse_tool_calls(qwen, "hermes", ["delete_all_files"])
    assert [c.name for c in calls] == ["delete_all_files"]
    assert content == "Qwen writes calls like this:\n\nand the runtime runs them."
    content, calls = parse_tool_calls(R1_ANSWER + "\nDone!", "deepseek", ["get_weather", "get_time"])
    assert content == "Let me look.\n\nDone!" and [c.name for c in calls] == ["get_weather", "get_time"]
    assert parse_tool_calls(R1_ANSWER, "deepseek", ["get_weather"]) == (R1_ANSWER, [])  # get_time not offered
    for family, names in (("deepseek", ["get_weather"]), ("hermes", ["get_weather"])):  # streamed: the same
        sp = ToolCallSplitter(family, names)
        streamed = "".join(sp.feed(qwen[i:i + 7]) for i in range(0, len(qwen), 7))
        rest, calls = sp.finish()
        assert (streamed + rest, calls) == (qwen, [])


def test_an_unfinished_forced_call_is_not_content():
    """The forced opening is the prompt's end, not the model's text: a model that stops (or runs
    out of tokens) before finishing the call gives no call and no injected markers as content."""
    start = forced_call("required", "deepseek")
    for tail in ("", "get_wea"):
        answer = AnswerSplitter(opened=None, tools=True, family="deepseek", names=["get_weather"], forced=start)
        parts = [answer.opening, answer.feed(tail)]
        r, c, calls = answer.finish()
        assert calls == [] and "".join(p[1] for p in parts) + c == tail, tail


def test_a_forced_call_s_think_close_is_not_content_without_reasoning_split():
    """reasoning_format "none" (no reasoning split): the `</think>` the forced opening closes R1's
    reasoning with is the prompt's, not content."""
    start = "</think>\n\n" + forced_call(NAMED, "deepseek")
    answer = AnswerSplitter(opened=None, tools=True, family="deepseek", names=["get_weather"], forced=start)
    parts = [answer.opening, answer.feed(FORCED_RESTS["deepseek"][1])]
    r, c, calls = answer.finish()
    assert "".join(p[1] for p in parts) + c == "" and [t.name for t in calls] == ["get_weather"]


def test_tools_must_be_json():
    for params in ({"a": {1, 2}}, {"a": object()}, {"a": float("nan")}):
        bad = {"type": "function", "function": {"name": "f", "parameters": params}}
        with pytest.raises(OptionError, match="tools: not JSON"):
            check_tools([bad], None)


def test_a_call_asked_for_needs_tools():
    for choice in ("required", NAMED):
        for tools in (None, []):
            with pytest.raises(OptionError, match="no tools"):
                check_tools(tools, choice)
    with pytest.raises(OptionError):
        check_tools([WEATHER], {"type": "bogus", "function": {"name": "get_weather"}})
    check_tools(None, "auto")
    check_tools(None, "none")


# -- through the app, with the openai client ------------------------------------------------------

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def app_server(tiny_model):
    """The real server app on 127.0.0.1 (its own event loop on a thread), with a scheduler that
    answers every request with `answer["text"]`, token by token, and keeps the prompts it got."""
    import ikjax
    from ikjax.runtime.scheduler import Scheduler
    from ikjax.server.app import Server, ServerConfig

    eng = ikjax.load(tiny_model, ctx=2048, ubatch=16)
    answer = {"text": ""}
    prompts: list[list[int]] = []
    reqs: list = []

    class Scripted(Scheduler):
        def submit(self, req):
            prompts.append(list(req.prompt))
            reqs.append(req)
            ids = eng.tokenizer.encode(answer["text"], False)

            def run():
                for t in ids:
                    req.on_event("token", t)
                req.on_event("done", "eos")
            threading.Thread(target=run, daemon=True).start()
            return req

    sched = Scripted(eng, 1).start()  # its loop idles: submit never queues
    server = Server(eng, eng.tokenizer, eng.chat_template("deepseek3"), sched,
                    ServerConfig(model_name="m", model_path=str(tiny_model), n_slots=1))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    ready, url = threading.Event(), {}
    loop = asyncio.new_event_loop()

    def on_listening(u):
        url["u"] = u
        ready.set()

    async def main():
        task = asyncio.ensure_future(_serve_until(server, sock, on_listening, stop))
        await task

    stop = asyncio.Event()

    async def _serve_until(server, sock, on_listening, stop):
        from aiohttp import web
        runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        on_listening(f"http://127.0.0.1:{sock.getsockname()[1]}")
        await stop.wait()
        await runner.cleanup()

    th = threading.Thread(target=lambda: loop.run_until_complete(main()), daemon=True)
    th.start()
    assert ready.wait(60)
    yield {"url": url["u"], "answer": answer, "prompts": prompts, "tok": eng.tokenizer, "eng": eng, "reqs": reqs}
    loop.call_soon_threadsafe(stop.set)
    th.join(30)


def _client(s):
    return openai.OpenAI(base_url=s["url"] + "/v1", api_key="none", max_retries=0, timeout=60)


def test_tool_calls_whole_and_streamed(app_server):
    tok = app_server["tok"]
    assert tok.decode(tok.encode(R1_ANSWER, False)) == R1_ANSWER  # the script survives the tokenizer
    # its markers are single control tokens, as in a real R1 file: hidden from plain text (so the
    # server must show them when tools are offered, as llama-server's preserved tokens)
    marks = tok.ids_of(TOOL_MARKERS)
    ids = tok.encode(R1_ANSWER, False)
    assert len(marks) == 5 and sum(i in marks for i in ids) == 8
    plain = tok.detokenizer()
    assert "<｜" not in "".join(plain.feed(i) for i in ids) + plain.finish()
    app_server["answer"]["text"] = R1_ANSWER
    c = _client(app_server)
    kw = dict(model="m", messages=[{"role": "user", "content": "Weather in Paris, and the time?"}],
              tools=[WEATHER, TIME], extra_body={"reasoning_format": "none"})
    whole = c.chat.completions.create(**kw)
    ch = whole.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Let me look.\n"
    got = [(t.function.name, json.loads(t.function.arguments)) for t in ch.message.tool_calls]
    assert got == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(t.type == "function" and t.id.startswith("call_") for t in ch.message.tool_calls)
    prompt = tok.decode(app_server["prompts"][-1])
    assert '"get_weather"' in prompt and "get_time" in prompt and DS_CALL_BEGIN in prompt  # the tool list

    parts = list(c.chat.completions.create(**kw, stream=True))
    content = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
    deltas = [t for p in parts if p.choices for t in (p.choices[0].delta.tool_calls or [])]
    assert content == "Let me look.\n" and "<｜" not in content
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == \
        [(0, "get_weather", {"city": "Paris"}), (1, "get_time", {})]
    assert [p.choices[0].finish_reason for p in parts if p.choices][-1] == "tool_calls"

    # tool_choice "none": no tool list in the prompt, nothing parsed, the control tokens hidden as in
    # any answer without tools
    none = c.chat.completions.create(**kw, tool_choice="none").choices[0]
    assert none.finish_reason == "stop" and none.message.tool_calls is None
    assert "<｜" not in none.message.content and none.message.content.startswith("Let me look.\nfunctionget_weather")
    assert '"get_weather"' not in tok.decode(app_server["prompts"][-1])


def test_answer_without_calls_and_bad_tools(app_server):
    app_server["answer"]["text"] = "It is sunny."
    c = _client(app_server)
    ch = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER],
                                   extra_body={"reasoning_format": "none"}).choices[0]
    assert ch.finish_reason == "stop" and ch.message.content == "It is sunny." and ch.message.tool_calls is None
    for bad in ({"tools": "x"}, {"tools": [WEATHER], "tool_choice": "sometimes"},
                {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": ["x"]}]},
                {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                {"tool_choice": "required"}, {"tools": [], "tool_choice": NAMED}):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(**{"model": "m", "messages": [{"role": "user", "content": "hi"}], **bad})
        assert e.value.status_code == 400 and "tool" in str(e.value)


def test_a_conversation_with_a_call_and_its_result(app_server):
    """The second request of an agent loop: the assistant's call (arguments as the client got them)
    and the tool's result come back; R1's template renders them in its own tokens."""
    app_server["answer"]["text"] = "It is sunny in Paris."
    c = _client(app_server)
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    ch = c.chat.completions.create(model="m", messages=msgs, tools=[WEATHER]).choices[0]
    assert ch.message.content == "It is sunny in Paris."
    prompt = app_server["tok"].decode(app_server["prompts"][-1])
    assert "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```" in prompt
    assert "<｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜>" in prompt


def test_python_chat_with_tools(app_server):
    """`Engine.chat(tools=...)`: the tool list in the rendered prompt, `.tool_calls` parsed out of the
    answer (none from the random model: the content is the whole answer), bad tools refused."""
    eng = app_server["eng"]
    msgs = [{"role": "user", "content": "Weather?"}]
    out = eng.chat(msgs, 4, tools=[WEATHER], chat_template="deepseek3", reasoning_format="none")
    assert '"get_weather"' in out.prompt and out.tool_calls == [] and out.content == out.text
    assert '"get_weather"' not in eng.chat(msgs, 1, chat_template="deepseek3").prompt
    with pytest.raises(OptionError):
        eng.chat(msgs, 1, tools=[{"type": "function"}])


@pytest.mark.parametrize("choice", ["required", "named"])
def test_tool_choice_forces_a_call(app_server, choice):
    """tool_choice "required" or one function over HTTP: the prompt ends with the call's opening
    (the scripted model writes only the rest), and the answer is that call, whole and streamed."""
    tok = app_server["tok"]
    rest = FORCED_RESTS["deepseek"][0 if choice == "required" else 1]
    want = [("get_time", {})] if choice == "required" else [("get_weather", {"city": "Paris"})]
    app_server["answer"]["text"] = rest
    c = _client(app_server)
    kw = dict(model="m", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER, TIME],
              tool_choice=choice if choice == "required" else NAMED)
    ch = c.chat.completions.create(**kw).choices[0]
    prompt = tok.decode(app_server["prompts"][-1])
    assert prompt.endswith(forced_call(kw["tool_choice"], "deepseek")), prompt[-200:]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in ch.message.tool_calls] == want
    parts = list(c.chat.completions.create(**kw, stream=True))
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == ""
    deltas = [t for p in parts if p.choices for t in (p.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == want
    # auto forces nothing: the prompt ends where the template's generation prompt does
    c.chat.completions.create(**{**kw, "tool_choice": "auto"})
    assert tok.decode(app_server["prompts"][-1]).endswith("<｜Assistant｜>")


def test_python_chat_forces_a_call(app_server):
    """`Engine.chat(tools=..., tool_choice=...)`: the prompt ends with the forced opening; "none"
    offers no tools; a bad choice is refused."""
    eng = app_server["eng"]
    msgs = [{"role": "user", "content": "Weather?"}]
    out = eng.chat(msgs, 2, tools=[WEATHER], tool_choice=NAMED, chat_template="deepseek3", reasoning_format="none")
    assert out.prompt.endswith(forced_call(NAMED, "deepseek"))
    st = eng.chat(msgs, 2, tools=[WEATHER], tool_choice=NAMED, chat_template="deepseek3", stream=True)
    assert st.forced_start == forced_call(NAMED, "deepseek") and st.prompt.endswith(st.forced_start)
    list(st)
    st = eng.chat(msgs, 1, tools=[WEATHER], chat_template="deepseek3", stream=True)
    list(st)
    assert st.forced_start == ""
    out = eng.chat(msgs, 1, tools=[WEATHER], tool_choice="none", chat_template="deepseek3")
    assert '"get_weather"' not in out.prompt and out.tool_calls == []
    with pytest.raises(OptionError):
        eng.chat(msgs, 1, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})


def test_requests_other_servers_accept_are_answered_or_refused(app_server):
    """Fields of vLLM's and llama-server's that a client may send: what is done here is done
    (vLLM's repetition_penalty over the whole context, top-level add_generation_prompt,
    parallel_tool_calls false, `samplers` turning off the ones it leaves out), what is not is a
    400 naming it; and OpenAI's own 400s (unknown role, max_tokens 0, stream_options without
    stream), where the request was answered before as if it had not asked."""
    import urllib.error
    import urllib.request
    url = app_server["url"] + "/v1/chat/completions"
    app_server["answer"]["text"] = "ok"
    msgs = [{"role": "user", "content": "hi"}]

    class Reply:
        def __init__(self, status, body):
            self.status_code, self.text = status, body

        def json(self):
            return json.loads(self.text)

    def post(**kw):
        data = json.dumps({"model": "m", "messages": msgs, **kw}).encode()
        req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return Reply(r.status, r.read().decode())
        except urllib.error.HTTPError as e:
            return Reply(e.code, e.read().decode())
    for kw in ({"messages": [{"role": "bogus", "content": "SECRET"}, *msgs]},
               {"messages": [{"role": "function", "name": "f", "content": "x"}, *msgs]},
               {"max_tokens": 0}, {"max_completion_tokens": 0}, {"stream_options": {"include_usage": True}},
               {"min_tokens": 5}, {"stop_token_ids": [3]}, {"include_stop_str_in_output": True},
               {"prompt_logprobs": 1}, {"guided_json": {"type": "object"}}, {"guided_choice": ["a"]},
               {"continue_final_message": "yes"}, {"tfs_z": 0.5}, {"post_sampling_probs": True},
               {"repetition_penalty": 1.2, "repeat_penalty": 1.1}, {"parallel_tool_calls": "no"},
               # vLLM's and OpenAI's fields a probe found answered as if absent (each would change the answer)
               {"structured_outputs": {"choice": ["yes", "no"]}}, {"allowed_token_ids": [5, 6]},
               {"bad_words": ["L"]}, {"truncate_prompt_tokens": 2}, {"use_beam_search": True},
               {"length_penalty": 2.0}, {"skip_special_tokens": False}, {"chat_template": "{{ 'X' }}"},
               {"echo": True}, {"functions": [{"name": "f"}]}, {"function_call": {"name": "f"}},
               {"modalities": ["text", "audio"]}, {"audio": {"voice": "alloy"}}, {"json_schema": {}},
               {"lora": [{"id": 0, "scale": 1.0}]}, {"response_fields": ["content"]}):
        r = post(**kw)
        assert r.status_code == 400 and r.json()["error"]["message"], (kw, r.status_code, r.text[:300])
        assert next(iter(kw)) in r.json()["error"]["message"] or "messages" in kw, (kw, r.text[:300])
    for kw in ({"skip_special_tokens": True}, {"modalities": ["text"]}, {"use_beam_search": False},
               {"length_penalty": 1.0}, {"echo": False}):  # their defaults ask for nothing: taken
        assert post(**kw).status_code == 200, kw
    r = post(repetition_penalty=1.3)
    assert r.status_code == 200
    pen = app_server["reqs"][-1].penalties
    assert pen.repeat == pytest.approx(1.3) and pen.last_n == -1, pen
    r = post(samplers=["temperature"], temperature=0.7, top_k=40, top_p=0.9, min_p=0.1, repeat_penalty=1.2)
    assert r.status_code == 200
    req = app_server["reqs"][-1]
    assert (req.sampling["top_k"], req.sampling["top_p"], req.sampling["min_p"]) == (0, 1.0, 0.0), req.sampling
    # (the penalties run whether `samplers` names them or not, as ik_llama.cpp applies them)
    assert req.sampling["temperature"] == pytest.approx(0.7) and req.penalties.repeat == pytest.approx(1.2)
    r = post(add_generation_prompt=False)
    assert r.status_code == 200
    assert not app_server["tok"].decode(app_server["prompts"][-1]).endswith("<｜Assistant｜>")
    app_server["answer"]["text"] = R1_ANSWER
    r = post(tools=[WEATHER, TIME], parallel_tool_calls=False, reasoning_format="none")
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"], calls


def test_responses_api_tool_calls_and_their_outputs(app_server):
    """The Responses API with function tools (their flat form): an answer that calls two tools is a
    message and two function_call items, whole and streamed (the arguments' events add up to each
    call); a next turn that sends those calls and their outputs back as input items renders them as
    the chat endpoint renders a call turn and its tool messages."""
    tok = app_server["tok"]
    app_server["answer"]["text"] = R1_ANSWER
    c = _client(app_server)
    tools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"],
              **({"description": t["function"]["description"]} if "description" in t["function"] else {})}
             for t in (WEATHER, TIME)]
    kw = dict(model="m", input="Weather in Paris, and the time?", tools=tools, extra_body={"reasoning_format": "none"})
    r = c.responses.create(**kw)
    assert r.status == "completed" and [o.type for o in r.output] == ["message", "function_call", "function_call"]
    assert r.output_text == "Let me look.\n"
    calls = [(o.name, json.loads(o.arguments), o.call_id) for o in r.output[1:]]
    assert [cl[:2] for cl in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    events = list(c.responses.create(**kw, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.type for i in done] == ["message", "function_call", "function_call"]
    args = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(a) for a in args] == [{"city": "Paris"}, {}] and events[-1].type == "response.completed"
    # the next turn: the calls and their outputs as input items
    app_server["answer"]["text"] = "Sunny, noon."
    items = [{"role": "user", "content": "Weather in Paris, and the time?"}] + \
        [{"type": "function_call", "call_id": cid, "name": n, "arguments": json.dumps(a)} for n, a, cid in calls] + \
        [{"type": "function_call_output", "call_id": calls[0][2], "output": "sunny 21C"},
         {"type": "function_call_output", "call_id": calls[1][2], "output": "12:00"}]
    r2 = c.responses.create(model="m", input=items, tools=tools, extra_body={"reasoning_format": "none"})
    assert r2.output_text == "Sunny, noon."
    via_responses = tok.decode(app_server["prompts"][-1])
    assert via_responses == chat_call_turn_prompt(app_server, calls) and "sunny 21C" in via_responses


def chat_call_turn_prompt(app_server, calls) -> str:
    """The prompt the chat endpoint renders for the weather question, an assistant turn making `calls`
    ((name, arguments, id)), and their results "sunny 21C" and "12:00": what the other APIs' call turns
    must render to."""
    msgs = [{"role": "user", "content": "Weather in Paris, and the time?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": cid, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                for n, a, cid in calls]},
            {"role": "tool", "tool_call_id": calls[0][2], "content": "sunny 21C"},
            {"role": "tool", "tool_call_id": calls[1][2], "content": "12:00"}]
    _client(app_server).chat.completions.create(model="m", messages=msgs, tools=[WEATHER, TIME],
                                                extra_body={"reasoning_format": "none"})
    return app_server["tok"].decode(app_server["prompts"][-1])


def test_anthropic_messages_tool_use_and_results(app_server):
    """Anthropic's Messages API with client tools: an answer that calls two tools is a text block and two
    tool_use blocks (their input parsed), stop_reason tool_use, whole and streamed; a next turn sending
    the tool_use blocks and tool_result blocks back renders as the chat endpoint's call turn and tool
    messages."""
    anthropic = pytest.importorskip("anthropic")
    tok = app_server["tok"]
    app_server["answer"]["text"] = R1_ANSWER
    a = anthropic.Anthropic(base_url=app_server["url"], api_key="none", max_retries=0, timeout=60)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"],
              **({"description": t["function"]["description"]} if "description" in t["function"] else {})}
             for t in (WEATHER, TIME)]
    kw = dict(model="m", max_tokens=64, tools=tools, extra_body={"reasoning_format": "none"},
              messages=[{"role": "user", "content": "Weather in Paris, and the time?"}])
    m = a.messages.create(**kw)
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["text", "tool_use", "tool_use"]
    assert m.content[0].text == "Let me look.\n"
    uses = [(b.name, b.input, b.id) for b in m.content[1:]]
    assert [u[:2] for u in uses] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    with a.messages.stream(**kw) as st:
        final = st.get_final_message()
    assert [(b.type, getattr(b, "input", None)) for b in final.content] == \
        [("text", None), ("tool_use", {"city": "Paris"}), ("tool_use", {})] and final.stop_reason == "tool_use"
    app_server["answer"]["text"] = "Sunny, noon."
    turn = kw["messages"] + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": i, "name": n, "input": x} for n, x, i in uses]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0][2], "content": "sunny 21C"},
                                     {"type": "tool_result", "tool_use_id": uses[1][2],
                                      "content": [{"type": "text", "text": "12:00"}]}]}]
    m2 = a.messages.create(**{**kw, "messages": turn})
    assert m2.content[0].text == "Sunny, noon." and m2.stop_reason == "end_turn"
    via_messages = tok.decode(app_server["prompts"][-1])
    assert via_messages == chat_call_turn_prompt(app_server, uses) and "sunny 21C" in via_messages
