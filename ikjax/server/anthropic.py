"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens), as ik_llama.cpp's server serves
it for clients written against Anthropic's (coding agents): a request as the chat request it means, an
answer as a Message (thinking, text and tool_use blocks) or its event stream. The server runs it through
the chat endpoint's machinery (ikjax.server.app.Server.messages); this module holds the two conversions."""
from __future__ import annotations

import json

from ikjax.server.openai import _is_int, bad, json_type

STOP_REASONS = {"eos": "end_turn", "stop": "stop_sequence", "max_tokens": "max_tokens", "context": "max_tokens"}


def messages_to_chat(body: dict, counting: bool = False) -> dict:
    """An Anthropic Messages request as the chat request it means: `system` (a string or text blocks) a
    system message first; each message's content a string or blocks (text; an assistant's tool_use blocks
    its tool calls; a user's tool_result blocks tool messages, in order; earlier thinking dropped, as
    DeepSeek's templates drop earlier reasoning); `max_tokens` (required, as Anthropic's, unless
    `counting`: count_tokens' request), `stop_sequences`
    the stop strings, tools (`input_schema`) chat tools, tool_choice auto / any / tool / none."""
    if not counting and (not _is_int(body.get("max_tokens")) or body["max_tokens"] < 1):
        raise bad(f"max_tokens: required, an integer >= 1, got {body.get('max_tokens')!r}"[:300])
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages: expected a non-empty list of {role, content} objects")
    chat = {k: body[k] for k in ("model", "temperature", "top_p", "top_k", "stream", "seed", "min_p", "id_slot",
                                 "cache_prompt", "reasoning_format", "chat_template_kwargs") if k in body}
    if not counting:
        chat["max_tokens"] = body["max_tokens"]
    out: list[dict] = []
    system = body.get("system")
    if isinstance(system, list):  # (Claude Code's x-anthropic-* header blocks: not the model's, as ik drops them)
        system = [b for b in system if not (isinstance(b, dict) and isinstance(b.get("text"), str)
                                            and b["text"].startswith("x-anthropic-"))]
    if system is not None:
        out.append({"role": "system", "content": _text(system, "system")})
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise bad("metadata: expected an object")
    if body.get("top_k") is not None and (not _is_int(body["top_k"]) or body["top_k"] < 0):
        raise bad(f"top_k: expected an integer >= 0, got {body['top_k']!r}"[:300])
    for i, m in enumerate(msgs):
        out += _message(m, i)
    chat["messages"] = out
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad("stop_sequences: expected a list of strings")
        chat["stop"] = stops
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind == "tool" and isinstance(choice.get("name"), str):
            chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        elif kind in ("auto", "any", "none"):
            chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
        else:
            raise bad(f"tool_choice: expected {{type: auto | any | none}} or {{type: tool, name}}, got {choice!r}"[:300])
        if isinstance(choice, dict) and choice.get("disable_parallel_tool_use") is True:
            chat["parallel_tool_calls"] = False
    thinking = body.get("thinking")
    if thinking is not None and (not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled",
                                                                                              "adaptive")):
        raise bad("thinking: expected {type: enabled, budget_tokens} or {type: disabled}")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled" and thinking.get("budget_tokens") is not None:
        n = thinking["budget_tokens"]
        if not _is_int(n) or n < 0:
            raise bad(f"thinking.budget_tokens: expected an integer >= 0, got {n!r}"[:300])
        chat["thinking_budget_tokens"] = n  # ik's reasoning budget (R1's <think> block)
    return chat


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where}: expected a string or a list of text blocks, got {json_type(content)}")
    parts = []
    for j, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else json_type(b)
            if kind in ("image", "document"):
                raise bad(f"{where}[{j}]: {kind} blocks are not supported (a text-only model)")
            raise bad(f"{where}[{j}]: expected a text block, got {kind!r}"[:300])
        parts.append(b["text"])
    return "".join(parts)


def _message(m, i: int) -> list[dict]:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise bad(f"{where}: expected {{role: user | assistant, content}}")
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list) or (not content and role == "user"):
        raise bad(f"{where}.content: expected a string or a non-empty list of blocks, got "
                  f"{json_type(content) if not isinstance(content, list) else 'an empty list'}")
    text, calls, results = [], [], []
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind in ("thinking", "redacted_thinking"):
            continue
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                raise bad(f"{at}: a tool_use block needs id and name")
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b.get("input") or {})}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(b.get("tool_use_id"), str):
                raise bad(f"{at}: a tool_result block needs tool_use_id")
            c = b.get("content", "")
            if isinstance(c, list):  # (its text blocks; an image in a tool's result is not readable here)
                c = [x for x in c if isinstance(x, dict) and x.get("type") == "text"]
            results.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                            "content": _text(c, f"{at}.content") if c is not None else ""})
        elif kind in ("image", "document"):
            raise bad(f"{at}: {kind} blocks are not supported (a text-only model)")
        elif isinstance(kind, str):
            continue  # server-tool blocks of an earlier turn (server_tool_use, web_search_tool_result ...): ik drops them
        else:
            raise bad(f"{at}: expected a content block with a type"[:300])
    if role == "assistant":
        return [{"role": "assistant", "content": "".join(text) if text or not calls else None,
                 **({"tool_calls": calls} if calls else {})}]
    return results + ([{"role": "user", "content": "".join(text)}] if text or not results else [])


def _tools(tools) -> list[dict]:
    if not isinstance(tools, list):
        raise bad("tools: expected a list")
    out = []
    for i, t in enumerate(tools):  # every named tool a function (server tools such as bash_20250124 too, as ik)
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
            raise bad(f"tools[{i}]: expected a tool {{name, description, input_schema}}")
        if t.get("input_schema") is not None and not isinstance(t["input_schema"], dict):
            raise bad(f"tools[{i}].input_schema: expected a JSON schema object")
        fn = {"name": t["name"], **({"description": t["description"]} if isinstance(t.get("description"), str)
                                    else {}),
              "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}
        out.append({"type": "function", "function": fn})
    return out


def usage(prompt_n: int, completion_n: int, cached: int) -> dict:
    return {"input_tokens": prompt_n - cached, "output_tokens": completion_n, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0}


def error_body(status: int, message: str) -> dict:
    """Anthropic's error object (its clients read `error.type` and `error.message`)."""
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            413: "request_too_large", 503: "overloaded_error", 529: "overloaded_error"}.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
