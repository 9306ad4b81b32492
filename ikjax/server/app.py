"""`ikjax serve`'s HTTP side (aiohttp): llama-server's and OpenAI's endpoints over one Scheduler.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models   (OpenAI; SSE when stream)
    POST /completion  POST /tokenize  POST /detokenize  GET /props  GET /slots  GET /health
    GET /metrics (Prometheus)   GET /expert-stats (with --expert-stats)   GET / (a chat page)

Each generate request becomes a `Job` on the scheduler (ikjax.runtime.scheduler); the handler
awaits its text deltas and writes them as one JSON answer or as Server-Sent Events (`data: {...}`
lines, OpenAI's streams ending with `data: [DONE]`). A client that goes away cancels its job
(aiohttp cancels the handler: `handler_cancellation`), which frees its slot at the next step.

Errors are JSON `{"error": {"code", "message", "type"}}` with their status, from one middleware:
400 a malformed or too long request (the field named), 401 a missing or wrong key under
--api-key, 404 an unknown route or model, 405, 413 a body over MAX_BODY, 503 a full queue, 500
anything else (logged). Nothing a client sends drops the connection or leaves a slot busy.
The socket, the connections and the process's signals are ikjax.server.transport's.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError

from ikjax.chat_template import (AnswerSplitter, ChatTemplateError, answer_opening, developer_as_system,
                                 opens_reasoning, renders_text_beside_calls, split_prefill)
from ikjax.errors import OptionError
from ikjax.runtime.scheduler import QueueFullError, Scheduler
from ikjax.server import anthropic, openai as oai
from ikjax.server.jobs import Job
from ikjax.server.metrics import CONTENT_TYPE, Metrics
from ikjax.server.openai import ApiError, Defaults, GenParams, bad
from ikjax.server.transport import CONTINUE, quiet_aiohttp_logs
from ikjax.tool_calls import TOOL_MARKERS, check_tools, tool_messages

log = logging.getLogger("ikjax")

MAX_BODY = 32 << 20  # bytes of a request body (a 128k-token prompt as JSON ids is ~1 MiB)
PUBLIC = frozenset({"/health", "/v1/health", "/models", "/v1/models", "/", "/index.html"})
STATIC = Path(__file__).resolve().parent / "static"
# llama-server's --reasoning-format values; deepseek-legacy (ik's and mainline's): as deepseek, but a streamed
# answer's reasoning stays inline in its content (read here as none when streamed)
REASONING_FORMATS = ("deepseek", "none", "auto", "deepseek-legacy")


@dataclass
class ServerConfig:
    model_name: str  # the id /v1/models lists (--alias, else the file's name)
    model_path: str
    n_slots: int
    api_key: str | tuple[str, ...] | None = None  # one key, or several (--api-key-file): any of them passes
    webui: bool = True  # the chat page at / (--no-webui: a 404 there)
    timeout: float = 600.0  # seconds a read of the body or a write of the answer may take (llama-server -to)
    reasoning_format: str = "deepseek"
    defaults: Defaults = field(default_factory=Defaults)


class _Routes:
    """The app's router with one `Expect` handler on every route (Server._expect)."""

    def __init__(self, router, expect):
        self._router, self._expect = router, expect

    def add_get(self, path, handler):
        self._router.add_get(path, handler, expect_handler=self._expect)

    def add_post(self, path, handler):
        self._router.add_post(path, handler, expect_handler=self._expect)


class Server:
    """The app's state: engine, tokenizer, chat template, scheduler, metrics."""

    def __init__(self, eng, tokenizer, template, scheduler: Scheduler, config: ServerConfig):
        if config.reasoning_format not in REASONING_FORMATS:
            raise OptionError(f"--reasoning-format: expected one of {', '.join(REASONING_FORMATS)}, got "
                              f"{config.reasoning_format!r}")
        self.eng, self.tok, self.template, self.scheduler, self.config = eng, tokenizer, template, scheduler, config
        self.metrics = Metrics(scheduler)
        key = config.api_key
        self._keys = frozenset((key,) if isinstance(key, str) else key or ())  # any of them passes
        self.created = int(time.time())
        self.names = {config.model_name, config.model_path, Path(config.model_path).name,
                      Path(config.model_path).stem}

    # -- the app ---------------------------------------------------------------------------------
    def app(self) -> web.Application:
        quiet_aiohttp_logs()
        app = web.Application(client_max_size=MAX_BODY, middlewares=[self._errors, self._preflight, self._auth])
        app.on_response_prepare.append(_cors_headers)
        r = _Routes(app.router, self._expect)
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_post("/chat/completions", self.chat_completions)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/responses", self.responses)
        r.add_post("/v1/messages", self.messages)
        r.add_post("/v1/messages/count_tokens", self.count_tokens)
        r.add_post("/responses", self.responses)
        r.add_post("/completions", self.completion)
        r.add_post("/completion", self.completion)
        r.add_get("/v1/models", self.models)
        r.add_get("/models", self.models)
        r.add_get("/health", self.health)
        r.add_get("/v1/health", self.health)
        r.add_get("/props", self.props)
        r.add_get("/v1/props", self.props)
        r.add_get("/slots", self.slots)
        r.add_get("/slots/list", self.slots)  # (ik's name for the same list)
        r.add_post("/slots/{id}", self.slot_action)
        r.add_get("/v1/models/{model:.+}", self.model)  # (an id with a slash: "org/name")
        for path in ("/v1/embeddings", "/embeddings", "/embedding"):
            r.add_post(path, self.embeddings)
        r.add_post("/apply-template", self.apply_template)
        r.add_post("/tokenize", self.tokenize)
        r.add_post("/detokenize", self.detokenize)
        r.add_get("/metrics", self.metrics_text)
        r.add_get("/expert-stats", self.expert_stats)
        r.add_get("/", self.index)
        r.add_get("/index.html", self.index)
        app.on_shutdown.append(self._shutdown)
        return app

    async def _shutdown(self, app) -> None:
        await asyncio.to_thread(self.scheduler.stop)

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        out = await self._errors_of(request, handler)
        if request.path.startswith("/v1/messages") and out.status >= 400:  # Anthropic's clients: its error form
            try:
                message = json.loads(out.text)["error"]["message"]
            except (TypeError, ValueError, KeyError, AttributeError):
                return out
            new = web.json_response(anthropic.error_body(out.status, message), status=out.status)
            for name in ("Allow", "Retry-After"):
                if name in out.headers:
                    new.headers[name] = out.headers[name]
            return new
        return out

    async def _errors_of(self, request: web.Request, handler):
        try:
            return await handler(request)
        except ApiError as e:
            return _error(e)
        except web.HTTPException as e:  # the router's 404 / 405, the body limit's 413
            if e.status < 400:
                raise
            msg = {404: f"no such endpoint: {request.method} {request.path}",
                   405: f"method {request.method} not allowed on {request.path}",
                   413: f"request body over {MAX_BODY >> 20} MiB"}.get(e.status, e.reason or "error")
            out = _error(ApiError(e.status, msg))
            if isinstance(e, web.HTTPMethodNotAllowed):  # RFC 9110: a 405 names the methods allowed
                out.headers["Allow"] = ", ".join(sorted(e.allowed_methods))
            return out
        except QueueFullError as e:
            out = _error(ApiError(503, str(e)))
            out.headers["Retry-After"] = "1"  # (as the listener's own 503 while the model loads)
            return out
        except OptionError as e:  # a prompt too long for a slot, a token outside the vocabulary
            return _error(bad(str(e).splitlines()[0]))
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as e:  # noqa: BLE001
            log.exception("%s %s failed", request.method, request.path)
            return _error(ApiError(500, f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"))

    @web.middleware
    async def _preflight(self, request: web.Request, handler):
        """A browser's CORS preflight (OPTIONS with Access-Control-Request-Method) is answered before
        the key is asked for (browsers send no credentials with it), as llama-server answers it, so a
        web app served from another origin can call the API; `_cors_headers` marks every answer."""
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            return web.Response(status=204, headers={
                "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers", "*"),
                "Access-Control-Max-Age": "86400"})
        return await handler(request)

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        self._check_key(request)
        return await handler(request)

    def _check_key(self, request: web.Request, public: bool | None = None) -> None:
        keys = self._keys
        if keys and not (request.path in PUBLIC if public is None else public):
            auth = request.headers.get("Authorization", "")
            given = auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("X-Api-Key")
            if given not in keys:  # a key sent in another form (no "Bearer ") is a wrong key, not a missing one
                raise ApiError(401, "Invalid API Key" if given or auth.strip() else
                               "missing API key (Authorization: Bearer KEY, or x-api-key: KEY)")

    async def _expect(self, request: web.Request) -> web.Response | None:
        """`Expect: 100-continue` (curl sends it for a body over 1 KiB): the interim 100 only where the
        body will be read. Before (aiohttp's own handler, RESULTS §23af): a 100 went out ahead of a 401
        for a missing key and of the 413 for a 32 MiB-plus body (the client was invited to upload it
        first), an unknown Expect value got a text/plain 417, and a client gone before the 100 was
        written logged a traceback every time."""
        if request.version != aiohttp.HttpVersion11:
            return None
        expect = request.headers.get("Expect", "")
        try:
            if expect.lower() != "100-continue":
                raise ApiError(417, f"Expect: {expect!r} is not supported (only 100-continue)", "invalid_request_error")
            self._check_key(request)
            if (request.content_length or 0) > MAX_BODY:
                raise ApiError(413, f"request body over {MAX_BODY >> 20} MiB")
            await request.writer.write(CONTINUE)
        except ApiError as e:
            out = _error(e)
            out.force_close()  # the body was never read: no further request can follow on this connection
            return out
        except ConnectionError:  # the client left: an answer nobody reads, dropped without a log
            out = _error(ApiError(400, "the client closed the connection"))
            out.force_close()
            return out
        request.writer.output_size = 0  # (the interim answer is not the response's body)
        return None

    async def _body(self, request: web.Request) -> dict:
        if request.content_length is not None and request.content_length > MAX_BODY:
            # refused on the header, before waiting for bytes that may never come (a probe's 1-byte
            # body under a 99 GB Content-Length waited out --timeout for a 408)
            raise web.HTTPRequestEntityTooLarge(max_size=MAX_BODY, actual_size=request.content_length)
        try:
            raw = await asyncio.wait_for(request.read(), self.config.timeout)
        except asyncio.TimeoutError:
            raise ApiError(408, f"request body not received within {self.config.timeout:g}s") from None
        except ConnectionResetError:  # the client left mid-body: nobody to answer, nothing to log
            raise ApiError(400, "request body: the client closed the connection") from None
        except (web.RequestPayloadError, ContentEncodingError) as e:  # a body that does not decode (bad gzip, chunks)
            why = " ".join(str(e.__cause__ or e).split()) or type(e).__name__  # (aiohttp's line 1 is "400, message:")
            raise bad(f"request body: unreadable ({why})"[:300]) from None
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            why = str(e).splitlines()[0]
            if "int_max_str_digits" in why:  # (Python's advice to raise its limit is not the client's)
                why = "an integer of more than 4300 digits"
            raise bad(f"request body: not valid JSON ({why})") from None
        except RecursionError:
            raise bad("request body: not valid JSON (nested too deeply)") from None
        return oai.json_object(body)

    def _check_model(self, body: dict) -> str:
        name = body.get("model")
        if name is None or name == "":
            return self.config.model_name
        if not isinstance(name, str):
            raise bad(f"model: expected a string, got {oai.json_type(name)}")
        # any name is this server's one model, echoed back, as llama-server does (clients and
        # scripts send placeholders like "gpt-3.5-turbo"; a 404 broke them)
        return name

    # -- text in -----------------------------------------------------------------------------------
    async def _encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True,
                      prompt: bool = True) -> list[int]:
        """Token ids of `text`; `add_bos` None: a BOS where the model's tokenizer adds one (DeepSeek
        files; not GLM-4 / Kimi / GigaChat ones, as llama-server); `parse_special` False: special
        tokens' text stays text (/tokenize's field). `prompt`: a text longer than a slot's context
        could hold even at the vocabulary's longest token is refused before it is tokenized (an 8 MB
        prompt took 20 s of this 2-core host's tokenizer to be told it was too long)."""
        limit = self.scheduler.ctx * self.tok.max_token_chars
        if prompt and isinstance(text, str) and len(text) > limit and self.tok.tokenizer.normalizer is None:
            raise bad(f"prompt: {len(text)} characters cannot fit a slot's context ({self.scheduler.ctx} tokens, "
                      f"-c / -np; a token of this vocabulary holds at most {self.tok.max_token_chars} characters)")
        try:
            return await asyncio.to_thread(self.tok.encode, text, add_bos, parse_special)
        except OptionError as e:
            raise bad(f"prompt: {e}") from None

    async def _prompt_ids(self, prompt: str | list) -> list[int]:
        """The prompt's ids: text encoded, ids as they are, and a mixed list as llama-server's
        (each text encoded in place, a BOS only where the list starts with a text)."""
        if isinstance(prompt, str):
            ids = await self._encode(prompt)
        else:
            ids = []
            for i, part in enumerate(prompt):
                ids += await self._encode(part, None if i == 0 else False) if isinstance(part, str) else [part]
        if not ids:
            raise bad("prompt: empty")
        return ids

    async def _chat_prompt(self, body: dict) -> tuple[list[int], str, str, str]:
        """(prompt ids, prompt text, the answer's forced start, the prefill) of a chat request: the
        start (`forced_answer_start`: the opening of a call that `tool_choice` requires) ends the
        text and the ids, and is the first part of the answer the splitter reads; the prefill (a
        final assistant message, continued: `split_prefill`) ends them too, and is not repeated in
        the answer (llama-server's)."""
        messages = oai.messages_field(body)
        cont = body.get("continue_final_message")  # vLLM's; a final assistant message is continued unless false
        if cont not in (None, True, False):
            raise bad(f"continue_final_message: expected true or false, got {cont!r}"[:300])
        for name, why in (("chat_template", "this server renders its own template (--chat-template); give "
                                            "chat_template_kwargs for its variables"),
                          ("echo", "a chat answer does not repeat the prompt here")):
            if body.get(name) not in (None, False):  # vLLM's fields: they would change the answer
                raise bad(f"{name}: not supported ({why}); leave it out")
        extra = body.get("chat_template_kwargs")
        if extra is not None and not isinstance(extra, dict):
            raise bad("chat_template_kwargs: expected an object")
        extra = dict(extra or {})
        # what the render call sets itself: add_generation_prompt honoured (true or false), messages
        # and tools refused (they are the request's own fields; a 500 before, "multiple values")
        top = body.get("add_generation_prompt")  # vLLM's place for it; chat_template_kwargs' is llama-server's
        if top is not None and "add_generation_prompt" in extra and extra["add_generation_prompt"] != top:
            raise bad("add_generation_prompt: given twice, with two values")
        add_generation_prompt = extra.pop("add_generation_prompt", True if top is None else top)
        if not isinstance(add_generation_prompt, bool):
            raise bad(f"chat_template_kwargs.add_generation_prompt: expected true or false, "
                      f"got {add_generation_prompt!r}"[:300])
        for name in ("messages", "tools"):
            if name in extra:
                raise bad(f"chat_template_kwargs.{name}: give {name} as the request's own field")
        check_tools(body.get("tools"), body.get("tool_choice"))  # an OptionError: the 400 of _errors
        prefill = None
        if add_generation_prompt or cont:  # (a raw render without the generation prompt continues nothing)
            try:
                messages, prefill = split_prefill(messages, cont)
            except ChatTemplateError as e:
                raise bad(str(e)) from None
            add_generation_prompt = add_generation_prompt or prefill is not None
        tools = body.get("tools") if body.get("tool_choice") != "none" else None
        messages = tool_messages(developer_as_system(messages, self.template.source), tools, self.template.source,
                                 body.get("tool_choice"), keep_text=renders_text_beside_calls(self.template.source))
        if tools:
            extra["tools"] = tools
        # on a worker thread: a long conversation's render is Python work the event loop need not wait for
        text = await asyncio.to_thread(self.template.render, messages, add_generation_prompt=add_generation_prompt,
                                       **extra)
        end = answer_opening(text, self.template.source, tools, body.get("tool_choice"), add_generation_prompt, prefill)
        text += end
        start = "" if prefill is not None else end
        bos = self.tok.token_text(self.tok.bos_id)
        # a template writes BOS itself: the text is tokenized without another one (llama-server strips
        # the template's and adds its own: the same ids)
        ids = await self._encode(text, add_bos=False if bos and text.startswith(bos) else None)
        return ids, text, start, prefill or ""

    async def _gen_params(self, body: dict, **kw) -> GenParams:
        """`oai.gen_params`, with a `logit_bias` given by text tokenized on a worker thread (not on the
        event loop)."""
        params = oai.gen_params(body, self.config.defaults, **kw)
        if oai.bias_has_text(params.logit_bias):
            params.logit_bias = await asyncio.to_thread(oai.bias_by_id, params.logit_bias,
                                                        lambda text: self.tok.encode(text, False, False))
        return params

    def _job(self, ids: list[int], params: GenParams, keep: frozenset[int] = frozenset(), start: bool = True) -> Job:
        """A checked job (the scheduler's checks: OptionError), started unless `start` is False."""
        job = Job(self.scheduler, self.tok, ids, params, on_first=self.metrics.ttft.observe, keep=keep)
        return job.start() if start else job

    # -- generation --------------------------------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        model = self._check_model(body)
        params = await self._gen_params(body, max_names=("n_predict", "max_tokens", "max_completion_tokens"),
                                        endpoint="chat")
        params.id_slot = oai.check_slot(body, self.config.n_slots)
        use_tools = bool(body.get("tools")) and body.get("tool_choice") != "none"
        one_call = body.get("parallel_tool_calls") is False  # OpenAI's: at most one call an answer
        if body.get("parallel_tool_calls") not in (None, True, False):
            raise bad(f"parallel_tool_calls: expected true or false, got {body.get('parallel_tool_calls')!r}"[:300])
        ids, text, start, prefill = await self._chat_prompt(body)
        fmt = body.get("reasoning_format")
        fmt = self.config.reasoning_format if fmt is None else fmt
        if fmt not in REASONING_FORMATS:
            raise bad(f"reasoning_format: expected one of {', '.join(REASONING_FORMATS)}, got {fmt!r}")
        if fmt == "deepseek-legacy":
            fmt = "none" if params.stream else "deepseek"
        opened = opens_reasoning(text[:len(text) - len(start)], prefill)
        # calls in the template family's own syntax, of the offered tools only; a forced call's
        # opening (the prompt's end) read as the answer's first text
        answer = AnswerSplitter.for_chat(opened if fmt != "none" else None, body["tools"] if use_tools else None,
                                         self.template.source, forced=start)
        opening = answer.opening
        # a call's markers are control tokens in DeepSeek's and Kimi's vocabularies: shown, to be parsed
        job = self._job(ids, params, self.tok.ids_of(TOOL_MARKERS) if use_tools else frozenset())
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": cid, "created": created, "model": model, "system_fingerprint": "ikjax"}
        try:
            if not params.stream:
                reasoning, content, calls = await _whole_answer(answer, job, one_call)
                message: dict[str, Any] = {"role": "assistant",
                                           "content": content if content.strip() or not calls else None}
                if answer.had_reasoning and reasoning.strip():  # (none: left out, as split_reasoning's None)
                    message["reasoning_content"] = reasoning
                if calls:
                    message["tool_calls"] = [t.openai() for t in calls]
                return web.json_response({
                    **head, "object": "chat.completion",
                    "choices": [{"index": 0, "message": message, "logprobs": self._chat_logprobs(job),
                                 "finish_reason": _finish(job, calls)}],
                    "usage": self._usage(job), "timings": job.req.timings(job.n_generated)})
            chunk = {**head, "object": "chat.completion.chunk"}

            def delta(d: dict, finish: str | None = None, logprobs: dict | None = None) -> dict:
                out = {**chunk, "choices": [{"index": 0, "delta": d, "logprobs": logprobs, "finish_reason": finish}]}
                if params.timings_per_token:  # llama-server's live speed figures
                    out["timings"] = job.req.timings(job.n_generated)
                return out

            async def events():
                yield delta({"role": "assistant", "content": ""})  # (OpenAI's first delta)
                for d in _deltas(*opening):
                    yield delta(d)
                sent = 0  # log-probability entries given so far
                async for piece in job.pieces():
                    lp = self._chat_logprobs(job, piece=True)  # the piece's tokens, with its first delta
                    sent += len(lp["content"]) if lp else 0
                    for d in _deltas(*answer.feed(piece)):
                        yield delta(d, logprobs=lp)
                        lp = None
                    if lp is not None and lp["content"]:  # text held back (a tag): its tokens still
                        yield delta({"content": ""}, logprobs=lp)
                whole = self._chat_logprobs(job)
                if whole is not None and len(whole["content"]) > sent:  # the tokens that completed a stop
                    # string (their text never came as a piece): the whole answer's list has them
                    yield delta({"content": ""}, logprobs={"content": whole["content"][sent:]})
                r, c, calls = answer.finish()
                calls = calls[:1] if one_call else calls
                for d in _deltas(r, c):
                    yield delta(d)
                if calls:  # each call whole in one delta (OpenAI's clients add the deltas up)
                    yield delta({"tool_calls": [t.openai(i) for i, t in enumerate(calls)]})
                yield {**delta({}, _finish(job, calls)), "timings": job.req.timings(job.n_generated)}
                if params.include_usage:
                    yield {**chunk, "choices": [], "usage": self._usage(job)}
            return await self._stream(request, [job], _usage_null_until_last(events()) if params.include_usage
                                      else events(), done=True)
        finally:
            job.cancel()

    async def _chat_job(self, chat: dict):
        """(model, params, one call only, the answer's splitter, the started job) of a chat request made
        from another API's (the Responses and Messages APIs): checked, rendered and run as a chat answer."""
        model = self._check_model(chat)
        if chat.get("parallel_tool_calls") not in (None, True, False):
            raise bad(f"parallel_tool_calls: expected true or false, got {chat['parallel_tool_calls']!r}"[:300])
        params = await self._gen_params(chat, max_names=("max_tokens",), endpoint="chat")
        params.id_slot = oai.check_slot(chat, self.config.n_slots)
        use_tools = bool(chat.get("tools")) and chat.get("tool_choice") != "none"
        ids, text, start, prefill = await self._chat_prompt(chat)
        fmt = chat.get("reasoning_format")  # (llama-server's field, as on chat: none leaves <think> in the text)
        fmt = self.config.reasoning_format if fmt is None else fmt
        if fmt not in REASONING_FORMATS:
            raise bad(f"reasoning_format: expected one of {', '.join(REASONING_FORMATS)}, got {fmt!r}"[:300])
        opened = opens_reasoning(text[:len(text) - len(start)], prefill)
        answer = AnswerSplitter.for_chat(opened if fmt != "none" else None,
                                         chat["tools"] if use_tools else None, self.template.source, forced=start)
        job = self._job(ids, params, self.tok.ids_of(TOOL_MARKERS) if use_tools else frozenset())
        return model, params, chat.get("parallel_tool_calls") is False, answer, job

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's Responses API (POST /v1/responses, served by ik_llama.cpp's server too): the request
        as the chat request it means (`oai.responses_to_chat`), run as a chat answer (the template,
        R1's reasoning, tool calls), answered as a Response object, or streamed as its events
        (`event: response.output_text.delta` ...; no [DONE])."""
        body = await self._body(request)
        model, params, one_call, answer, job = await self._chat_job(oai.responses_to_chat(body))
        tag, created = uuid.uuid4().hex, int(time.time())
        rs_id, msg_id = f"rs_{tag}", f"msg_{tag}"

        def response(status: str, output: list[dict]) -> dict:
            done = status in ("completed", "incomplete")
            thought = "".join(c["text"] for o in output if o["type"] == "reasoning" for c in o["content"])
            return {"id": f"resp_{tag}", "object": "response", "created_at": created, "status": status,
                    "model": model, "output": output, "error": None,
                    "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                    "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
                    "metadata": body.get("metadata") or {}, "parallel_tool_calls": not one_call,
                    "temperature": params.temperature, "top_p": params.top_p,
                    "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
                    "text": {"format": {"type": "text"}}, "store": False, "previous_response_id": None,
                    "reasoning": {"effort": None, "summary": None}, "truncation": "disabled",
                    "usage": oai.response_usage(len(job.req.prompt), job.n_generated, job.req.n_cached,
                                                len(self.tok.encode(thought, False)) if thought else 0)
                    if done else None}

        def reasoning_item(t: str, status: str) -> dict:
            return {"id": rs_id, "type": "reasoning", "summary": [], "status": status,
                    "content": [{"type": "reasoning_text", "text": t}] if t else []}

        def message_item(t: str, status: str) -> dict:
            return {"id": msg_id, "type": "message", "role": "assistant", "status": status,
                    "content": [{"type": "output_text", "text": t, "annotations": [], "logprobs": []}]
                    if status == "completed" else []}

        def call_item(t, status: str) -> dict:
            return {"id": f"fc_{t.id}", "type": "function_call", "call_id": t.id, "name": t.name,
                    "arguments": t.arguments if status == "completed" else "", "status": status}

        def status_of() -> str:
            return "incomplete" if oai.FINISH[job.finish_reason] == "length" else "completed"

        try:
            if not params.stream:
                reasoning, content, calls = await _whole_answer(answer, job, one_call)
                output = [reasoning_item(reasoning, "completed")] if answer.had_reasoning and reasoning.strip() else []
                if content.strip() or not (calls or output):  # (an answer cut off while it thought: no message)
                    output.append(message_item(content, "completed"))
                output += [call_item(t, "completed") for t in calls]
                return web.json_response(response(status_of(), output))

            async def events():
                seq = itertools.count()
                output: list[dict] = []  # the items done
                now = {"r": None, "c": None}  # the reasoning's / the message's text while its item is open

                def ev(kind: str, **kw) -> dict:
                    return {"type": kind, "sequence_number": next(seq), **kw}

                def close_reasoning() -> list[dict]:
                    if now["r"] is None:
                        return []
                    item, now["r"] = reasoning_item(now["r"], "completed"), None
                    i = len(output)
                    output.append(item)
                    return [ev("response.reasoning_text.done", item_id=rs_id, output_index=i, content_index=0,
                               text=item["content"][0]["text"] if item["content"] else ""),
                            ev("response.output_item.done", output_index=i, item=item)]

                def open_message() -> list[dict]:
                    if now["c"] is not None:
                        return []
                    now["c"] = ""
                    return [ev("response.output_item.added", output_index=len(output),
                               item=message_item("", "in_progress")),
                            ev("response.content_part.added", item_id=msg_id, output_index=len(output),
                               content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                      "logprobs": []})]

                def pieces(r: str, c: str) -> list[dict]:
                    out = []
                    if r:
                        if now["r"] is None:
                            now["r"] = ""
                            out.append(ev("response.output_item.added", output_index=len(output),
                                          item=reasoning_item("", "in_progress")))
                        now["r"] += r
                        out.append(ev("response.reasoning_text.delta", item_id=rs_id, output_index=len(output),
                                      content_index=0, delta=r))
                    if c:
                        out += close_reasoning() + open_message()
                        now["c"] += c
                        out.append(ev("response.output_text.delta", item_id=msg_id, output_index=len(output),
                                      content_index=0, delta=c, logprobs=[]))
                    return out

                yield ev("response.created", response=response("in_progress", []))
                yield ev("response.in_progress", response=response("in_progress", []))
                async for r, c in _answer_pieces(answer, job):
                    for e in pieces(r, c):
                        yield e
                r, c, calls = _answer_end(answer, one_call)
                for e in pieces(r, c) + close_reasoning():
                    yield e
                if not calls and not output:  # (an empty answer is still one message)
                    for e in open_message():
                        yield e
                if now["c"] is not None:
                    item, i = message_item(now["c"], "completed"), len(output)
                    output.append(item)
                    yield ev("response.output_text.done", item_id=msg_id, output_index=i, content_index=0,
                             text=now["c"], logprobs=[])
                    yield ev("response.content_part.done", item_id=msg_id, output_index=i, content_index=0,
                             part=item["content"][0])
                    yield ev("response.output_item.done", output_index=i, item=item)
                for t in calls:
                    i = len(output)
                    yield ev("response.output_item.added", output_index=i, item=call_item(t, "in_progress"))
                    yield ev("response.function_call_arguments.delta", item_id=f"fc_{t.id}", output_index=i,
                             delta=t.arguments)
                    yield ev("response.function_call_arguments.done", item_id=f"fc_{t.id}", output_index=i,
                             arguments=t.arguments, name=t.name)
                    output.append(call_item(t, "completed"))
                    yield ev("response.output_item.done", output_index=i, item=output[-1])
                status = status_of()
                yield ev("response.completed" if status == "completed" else "response.incomplete",
                         response=response(status, output))
            return await self._stream(request, [job], events(), done=False, sse=_sse_event)
        finally:
            job.cancel()

    async def count_tokens(self, request: web.Request) -> web.Response:
        """Anthropic's POST /v1/messages/count_tokens: the prompt's tokens, as the template renders it."""
        chat = anthropic.messages_to_chat(await self._body(request), counting=True)
        self._check_model(chat)
        ids, _, _, _ = await self._chat_prompt(chat)
        return web.json_response({"input_tokens": len(ids)})

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic's Messages API (POST /v1/messages, served by ik_llama.cpp's server too, for the
        clients written against Anthropic's): the request as the chat request it means
        (`anthropic.messages_to_chat`), run as a chat answer, answered as a Message of thinking, text and
        tool_use blocks, or streamed as its events (message_start .. message_stop)."""
        body = await self._body(request)
        model, params, one_call, answer, job = await self._chat_job(anthropic.messages_to_chat(body))
        mid = f"msg_{uuid.uuid4().hex}"

        def stop_of(calls: list) -> tuple[str, str | None]:
            reason = anthropic.STOP_REASONS[job.finish_reason]
            if calls and reason in ("end_turn", "stop_sequence"):
                return "tool_use", None
            return reason, job.stopping_word if reason == "stop_sequence" else None

        def usage() -> dict:
            return anthropic.usage(len(job.req.prompt), job.n_generated, job.req.n_cached)

        def tool_block(t) -> dict:
            try:
                args = json.loads(t.arguments or "{}")
            except ValueError:
                args = {"_raw": t.arguments}
            return {"type": "tool_use", "id": t.id, "name": t.name, "input": args if isinstance(args, dict)
                    else {"_value": args}}

        def message(content: list[dict], stop: str | None, seq: str | None, use: dict) -> dict:
            return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
                    "stop_reason": stop, "stop_sequence": seq, "usage": use}

        try:
            if not params.stream:
                reasoning, content, calls = await _whole_answer(answer, job, one_call)
                blocks = [{"type": "thinking", "thinking": reasoning, "signature": ""}] \
                    if answer.had_reasoning and reasoning.strip() else []
                if content or not (calls or blocks):  # (cut off while it thought: no empty text block)
                    blocks.append({"type": "text", "text": content})
                blocks += [tool_block(t) for t in calls]
                return web.json_response(message(blocks, *stop_of(calls), usage()))

            async def events():
                now = {"kind": None, "index": -1}  # the open block

                def switch(kind: str) -> list[dict]:
                    out = []
                    if now["kind"] == kind:
                        return out
                    if now["kind"] is not None:
                        out.append({"type": "content_block_stop", "index": now["index"]})
                    now["kind"], now["index"] = kind, now["index"] + 1
                    block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" \
                        else {"type": "text", "text": ""}
                    out.append({"type": "content_block_start", "index": now["index"], "content_block": block})
                    return out

                def pieces(r: str, c: str) -> list[dict]:
                    out = []
                    if r:
                        out += switch("thinking")
                        out.append({"type": "content_block_delta", "index": now["index"],
                                    "delta": {"type": "thinking_delta", "thinking": r}})
                    if c:
                        out += switch("text")
                        out.append({"type": "content_block_delta", "index": now["index"],
                                    "delta": {"type": "text_delta", "text": c}})
                    return out

                yield {"type": "message_start", "message": message([], None, None, {**usage(), "output_tokens": 0})}
                async for r, c in _answer_pieces(answer, job):
                    for e in pieces(r, c):
                        yield e
                r, c, calls = _answer_end(answer, one_call)
                for e in pieces(r, c) + ([] if calls or now["kind"] is not None else switch("text")):
                    yield e
                if now["kind"] is not None:
                    yield {"type": "content_block_stop", "index": now["index"]}
                for i, t in enumerate(calls, now["index"] + 1):
                    block = tool_block(t)
                    yield {"type": "content_block_start", "index": i, "content_block": {**block, "input": {}}}
                    yield {"type": "content_block_delta", "index": i,
                           "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}}
                    yield {"type": "content_block_stop", "index": i}
                stop, seq = stop_of(calls)
                yield {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": seq},
                       "usage": {"output_tokens": job.n_generated}}
                yield {"type": "message_stop"}
            return await self._stream(request, [job], events(), done=False, sse=_sse_anthropic)
        finally:
            job.cancel()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's /v1/completions."""
        body = await self._body(request)
        model = self._check_model(body)
        params = await self._gen_params(body, max_names=("n_predict", "max_tokens"), endpoint="completions")
        params.id_slot = oai.check_slot(body, self.config.n_slots)
        oai.check_completions_only(body)
        prompts = oai.prompts_field(body)
        echo = oai.bool_field(body, "echo", False)
        if echo and params.top_logprobs is not None:  # OpenAI's answer lists the prompt's tokens too
            raise bad("echo with logprobs: the prompt's log-probabilities are not computed here; ask for one of them")
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model,
                "system_fingerprint": "ikjax", "object": "text_completion"}
        ids, jobs = await self._start_jobs(prompts, params)
        try:
            # echo: the prompt as given (ids as their text) before the answer
            prefixes = [(p if isinstance(p, str) else self.tok.decode(x)) if echo else "" for p, x in zip(prompts, ids)]
            if not params.stream:  # a choice a prompt, by its index (OpenAI's batch)
                texts = await asyncio.gather(*(j.text() for j in jobs))
                choices = [{"index": i, "text": pre + text, "logprobs": self._completions_logprobs(job, len(pre)),
                            "finish_reason": oai.FINISH[job.finish_reason]}
                           for i, (pre, job, text) in enumerate(zip(prefixes, jobs, texts))]
                timings = {"timings": jobs[0].req.timings(jobs[0].n_generated)} if len(jobs) == 1 else {}
                return web.json_response({**head, "choices": choices, "usage": self._usage_of(jobs), **timings})

            def choice(i: int, text: str, finish: str | None = None, logprobs: dict | None = None) -> dict:
                return {**head, "choices": [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}]}

            async def one(i: int, job: Job, prefix: str):
                offset = len(prefix)
                if prefix:
                    yield choice(i, prefix)
                async for piece in job.pieces():
                    yield choice(i, piece, logprobs=self._completions_logprobs(job, offset, piece=True))
                    offset += len(piece)
                last = {**choice(i, "", oai.FINISH[job.finish_reason]), "timings": job.req.timings(job.n_generated)}
                if not params.include_usage:  # (llama-server's final chunk always has its usage)
                    last["usage"] = self._usage_of([job])
                yield last

            async def events():
                async for obj in _merged([one(i, job, pre) for i, (job, pre) in enumerate(zip(jobs, prefixes))]):
                    yield obj
                if params.include_usage:
                    yield {**head, "choices": [], "usage": self._usage_of(jobs)}
            return await self._stream(request, jobs, _usage_null_until_last(events()) if params.include_usage
                                      else events(), done=True)
        finally:
            _cancel(jobs)

    async def completion(self, request: web.Request) -> web.StreamResponse:
        """llama-server's own /completion (n_predict, cache_prompt, stream; no [DONE]). Several
        prompts: a list of answers, each with its index (ik_llama.cpp runs a task a prompt); streamed,
        each event carries its prompt's index."""
        body = await self._body(request)
        params = await self._gen_params(body, max_names=("n_predict", "max_tokens"))
        params.id_slot = oai.check_slot(body, self.config.n_slots)
        prompts = oai.prompts_field(body)
        _, jobs = await self._start_jobs(prompts, params)
        try:
            if not params.stream:
                texts = await asyncio.gather(*(j.text() for j in jobs))
                answers = [{**self._completion_final(job, text, prompt, True), "index": i}
                           for i, (prompt, job, text) in enumerate(zip(prompts, jobs, texts))]
                return web.json_response(answers if len(jobs) > 1 else answers[0])

            async def one(i: int, job: Job, prompt):
                # with return_tokens, an event per token (its text may be "" while held back)
                async for piece in job.pieces(every_token=params.return_tokens):
                    event = {"content": piece, "stop": False, "id_slot": job.req.slot, "index": i,
                             "tokens": list(job.new_ids) if params.return_tokens else []}
                    if params.top_logprobs is not None:
                        event["completion_probabilities"] = self._probabilities(job, piece=True)
                    if params.timings_per_token:  # llama-server's live speed figures
                        event["timings"] = job.req.timings(job.n_generated)
                    yield event
                yield {**self._completion_final(job, job.tail, prompt, False), "index": i}
            return await self._stream(request, jobs, _merged([one(i, job, prompt) for i, (job, prompt)
                                                              in enumerate(zip(jobs, prompts))]), done=False)
        finally:
            _cancel(jobs)

    async def _start_jobs(self, prompts: list, params: GenParams) -> tuple[list[list[int]], list[Job]]:
        """(ids, started jobs) of a request's prompts, each a job of its own (several batch across
        the slots as separate requests do). Every prompt is tokenized and checked (vocabulary,
        length for a slot) before any job starts, so a bad prompt late in a list sends the 400
        naming it (`prompt[i]`) with nothing run; a job that cannot start (a full queue: the 503)
        cancels those started before it. More prompts than the slots and the queue hold together
        can never be taken, busy server or not: a 400, not a 503 to retry forever."""
        room = self.config.n_slots + self.scheduler.max_queue
        if len(prompts) > room:
            raise bad(f"prompt: {len(prompts)} prompts in one request, but {self.config.n_slots} slots (-np) and a "
                      f"queue of {self.scheduler.max_queue} (--max-queue) take at most {room}; send fewer at once")
        ids, jobs = [], []
        for i, p in enumerate(prompts):
            try:
                one = await self._prompt_ids(p)
                jobs.append(self._job(one, params, start=False))
            except (ApiError, OptionError) as e:
                msg = str(e).splitlines()[0]
                if len(prompts) == 1 or not msg.startswith("prompt: "):  # (a setting's error is every prompt's)
                    raise
                raise bad(f"prompt[{i}]: {msg[len('prompt: '):]}") from None  # which prompt of the list
            ids.append(one)
        started: list[Job] = []
        try:
            for job in jobs:
                started.append(job.start())
        except BaseException:
            _cancel(started)
            raise
        return ids, jobs

    def _usage_of(self, jobs: list[Job]) -> dict:
        """`usage` summed over the jobs of one request."""
        return oai.usage(sum(len(j.req.prompt) for j in jobs), sum(j.n_generated for j in jobs),
                         sum(j.req.n_cached for j in jobs))

    def _completion_final(self, job: Job, text: str, prompt, whole: bool) -> dict:
        """/completion's answer, or the last event of its stream (`whole` False: no text, no ids)."""
        p, reason = job.params, job.finish_reason
        # every token's probabilities on the answer, and on a stream's last event too (ik's final
        # result carries them stream or not)
        probs = {"completion_probabilities": self._probabilities(job)} if p.top_logprobs is not None else {}
        return {**probs, "content": text, "id_slot": job.req.slot, "stop": True, "model": self.config.model_name,
                "index": 0, "tokens": list(job.token_ids) if p.return_tokens and whole else [],
                "tokens_predicted": job.n_generated,
                "tokens_evaluated": len(job.req.prompt),
                "tokens_cached": len(job.req.prompt) - job.req.shifted + max(job.n_generated - 1, 0),  # (llama-server's n_past: the
                # last sampled token is not run through the model, so not in the cache; /slots' n_cached)
                "prompt": prompt,  # as given: text, or the token ids (ik echoes the array)
                "generation_settings": {"n_ctx": self.scheduler.ctx, "n_predict": -1 if p.max_tokens is None
                                        else p.max_tokens, **p.sampling(), "seed": job.req.sampling["seed"],
                                        "stop": p.stop,
                                        "cache_prompt": p.cache_prompt, "ignore_eos": p.ignore_eos,
                                        # ik's names beside ours: n_probs, max_tokens, and what ran
                                        "n_probs": p.top_logprobs or 0, "max_tokens": -1 if p.max_tokens is None
                                        else p.max_tokens, "stream": p.stream, "model": self.config.model_name},
                "truncated": job.req.truncated, "stop_type": {"eos": "eos", "stop": "word"}.get(reason, "limit"),
                "stopped_eos": reason == "eos", "stopped_word": reason == "stop",
                "stopped_limit": reason in ("max_tokens", "context"), "stopping_word": job.stopping_word,
                "has_new_line": "\n" in text, "timings": job.req.timings(job.n_generated)}

    # -- log-probabilities (the scheduler's Request.token_logprobs, in each endpoint's form) ---------
    def _logprob_rows(self, job: Job, piece: bool) -> list[tuple[int, float, tuple]]:
        """(id, logprob, alternatives) of the answer's tokens, the ends of generation (EOS, stop
        ids) and a stop string's tokens left out: all of them, or (`piece`) those whose text the
        delta just taken carries."""
        ids = job.token_ids
        lo = len(ids) - len(job.new_ids) if piece else 0
        rows = job.req.token_logprobs
        return [(ids[i], *rows[i]) for i in range(lo, min(len(ids), len(rows)))
                if ids[i] not in job.req.stop_ids and job.in_answer(i)]

    def _token(self, tid: int) -> tuple[str, list[int]]:
        b = self.tok.piece(tid)
        return b.decode("utf-8", errors="replace"), list(b)

    def _legacy_key(self, tid: int, as_bytes: bool = False) -> str:
        """A token as OpenAI's completions `logprobs` name it: its text, or "bytes:\\xNN..." for a
        piece that is not whole UTF-8 (a byte token: every one printed as U+FFFD before, so the
        alternatives' dict, keyed by text, kept one of them and listed fewer than asked for)."""
        text, b = self._token(tid)
        if as_bytes or "\ufffd" in text and "\ufffd".encode() not in bytes(b):
            return "bytes:" + "".join(f"\\x{x:02x}" for x in b)
        return text

    def _entry(self, tid: int, lp: float, with_id: bool = False) -> dict:
        """One token's {token, logprob, bytes} (llama-server's form adds its id)."""
        text, b = self._token(tid)
        return {**({"id": tid} if with_id else {}), "token": text, "logprob": lp, "bytes": b}

    def _entries(self, job: Job, piece: bool, with_id: bool = False) -> list[dict]:
        """Each answer token's entry with its alternatives' (`top_logprobs`)."""
        return [{**self._entry(tid, lp, with_id), "top_logprobs": [self._entry(a, alp, with_id) for a, alp in alts]}
                for tid, lp, alts in self._logprob_rows(job, piece)]

    def _chat_logprobs(self, job: Job, piece: bool = False) -> dict | None:
        """OpenAI chat's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}, ...]}."""
        if job.params.top_logprobs is None:
            return None
        return {"content": self._entries(job, piece)}

    def _completions_logprobs(self, job: Job, offset: int, piece: bool = False) -> dict | None:
        """OpenAI completions' `logprobs`: tokens, token_logprobs, top_logprobs ({token: logprob}
        each), text_offset (where each token's text starts in the choice's text)."""
        if job.params.top_logprobs is None:
            return None
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        rows = self._logprob_rows(job, piece)
        for tid, lp, alts in rows:
            out["tokens"].append(self._legacy_key(tid))
            out["token_logprobs"].append(lp)
            top: dict[str, float] = {}
            for aid, alp in alts:  # best first; two ids that print alike both listed (the second by its bytes)
                key = self._legacy_key(aid)
                top[key if key not in top else self._legacy_key(aid, as_bytes=True)] = alp
            out["top_logprobs"].append(top)
        out["text_offset"] = oai.text_offsets([self.tok.piece(tid) for tid, _, _ in rows], offset)
        return out

    def _probabilities(self, job: Job, piece: bool = False) -> list[dict]:
        """llama-server's `completion_probabilities` (n_probs): id, token, logprob, bytes and
        top_logprobs (id, token, logprob, bytes) of each token, as mainline's server gives them, and
        `content` with `probs` ([{tok_str, prob}], the alternatives' probabilities), as ik_llama.cpp's
        gives them (its clients read that form: an outside probe, stop 65)."""
        out = self._entries(job, piece, with_id=True)
        for e in out:
            e["content"] = _ik_tok_str(e["bytes"], e["token"])
            e["probs"] = [{"tok_str": _ik_tok_str(a["bytes"], a["token"]), "prob": math.exp(a["logprob"])}
                          for a in e["top_logprobs"]]
        return out

    def _usage(self, job: Job) -> dict:
        return oai.usage(len(job.req.prompt), job.n_generated, job.req.n_cached)

    # -- SSE -----------------------------------------------------------------------------------------
    async def _stream(self, request: web.Request, jobs: list[Job], events, done: bool, sse=None) -> web.StreamResponse:
        """Server-Sent Events: each object as `data: {...}`, then `data: [DONE]` (OpenAI's streams).
        An error after the headers went out is one last `data: {"error": ...}` event; a reader that
        went away or stopped reading (--timeout) ends the stream, and its jobs are cancelled. `sse`:
        another event form (the Responses API's named events, `_sse_event`)."""
        sse = sse or _sse
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                          "X-Accel-Buffering": "no"})
        if request.version < aiohttp.HttpVersion11:
            # HTTP/1.0 has no chunked framing: the stream's end is the connection's end, even for a
            # client that asked to keep it alive (curl --http1.0 -H 'Connection: keep-alive' waited
            # for the keep-alive timeout after [DONE])
            out.force_close()
        try:
            await out.prepare(request)  # (inside: a reader gone before the headers went out cancels the jobs too)
            try:
                async for obj in events:
                    await self._write(out, sse(obj))
            except ApiError as e:
                await self._write(out, sse(e.body()))
            if done:
                await self._write(out, b"data: [DONE]\n\n")
            await out.write_eof()
        except (ConnectionError, asyncio.TimeoutError):
            _cancel(jobs)
        return out

    async def _write(self, out: web.StreamResponse, data: bytes) -> None:
        """A write that a reader who stopped reading cannot hold for longer than --timeout."""
        await asyncio.wait_for(out.write(data), self.config.timeout)

    # -- the rest ---------------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        cfg = self.eng.config
        meta = {"n_vocab": cfg.vocab_size, "n_ctx_train": cfg.context_length, "n_ctx": self.scheduler.ctx,
                "n_slots": self.scheduler.n_slots}
        model = {"id": self.config.model_name, "object": "model", "created": self.created, "owned_by": "ikjax",
                 "meta": meta}
        return web.json_response({"object": "list", "data": [model],
                                  "models": [{"name": self.config.model_name, "model": self.config.model_name}]})

    async def health(self, request: web.Request) -> web.Response:
        """llama-server's: the slots idle and busy; "no slot available" when none is idle, a 503
        then with `?fail_on_no_slot` (what a load balancer routes on); `?include_slots`: /slots too."""
        busy = self.scheduler.slots_busy()
        out = {"status": "ok", "slots_idle": self.scheduler.n_slots - busy, "slots_processing": busy}
        if "include_slots" in request.query:  # (what /slots shows: behind the key, as /slots is)
            self._check_key(request, public=False)
            out["slots"] = self.scheduler.slot_info()
        status = 200
        if busy >= self.scheduler.n_slots:
            out["status"] = "no slot available"
            status = 503 if "fail_on_no_slot" in request.query else 200
        return web.json_response(out, status=status)

    async def props(self, request: web.Request) -> web.Response:
        d = self.config.defaults
        params = {"n_predict": d.n_predict, "temperature": d.temperature, "top_k": d.top_k, "top_p": d.top_p,
                  "min_p": d.min_p, "seed": d.seed, "cache_prompt": True, "n_keep": d.n_keep, "n_discard": 0}
        return web.json_response({
            "n_ctx": self.scheduler.ctx, "model_name": self.config.model_name,
            # the settings under `params` (llama.cpp's form now) and flat beside n_ctx (ik's
            # get_formatted_generation): a client written for either reads them
            "default_generation_settings": {"n_ctx": self.scheduler.ctx, **params, "params": params},
            "total_slots": self.scheduler.n_slots, "model_path": self.config.model_path,
            "model_alias": self.config.model_name, "chat_template": self.template.source,
            "chat_template_name": self.template.name, "bos_token": self.tok.token_text(self.tok.bos_id),
            "eos_token": self.tok.token_text(self.tok.eos_id), "prompt_cache": self.scheduler.prompt_cache,
            "reasoning_format": self.config.reasoning_format, "modalities": {"vision": False, "audio": False},
            "build_info": "ikjax"})

    async def slots(self, request: web.Request) -> web.Response:
        return web.json_response(self.scheduler.slot_info())

    async def slot_action(self, request: web.Request) -> web.Response:
        """llama-server's POST /slots/{id}?action=erase: forget an idle slot's cached tokens (its
        prompt cache); save / restore (llama-server's --slot-save-path) are not done here: 501."""
        raw = request.match_info["id"]
        if not raw.isdigit() or not int(raw) < self.scheduler.n_slots:
            raise bad(f"id_slot: expected a slot 0..{self.scheduler.n_slots - 1}, got {raw!r}"[:300])
        action = request.query.get("action")
        if action == "erase":
            return web.json_response({"id_slot": int(raw), "n_erased": self.scheduler.erase_slot(int(raw))})
        if action in ("save", "restore"):
            raise ApiError(501, f"slot {action}: not supported by this server (no slot files)")
        raise bad(f"action: expected erase, save or restore, got {action!r}"[:300])

    async def model(self, request: web.Request) -> web.Response:
        """OpenAI's GET /v1/models/{model}: the served model's object, 404 for any other name (a
        request's `model` may name anything: llama-server's rule, `_check_model`)."""
        name = request.match_info["model"]
        if name not in self.names:
            raise ApiError(404, f"model {name!r} not found (this server serves {self.config.model_name!r})",
                           "not_found_error")
        return web.json_response({"id": name, "object": "model", "created": self.created, "owned_by": "ikjax"})

    async def embeddings(self, request: web.Request) -> web.Response:
        """Embeddings are not computed by this server (llama-server answers 501 unless started with
        --embeddings): a 501 naming that, not a 404 that reads as a wrong address."""
        raise ApiError(501, "embeddings: not supported by this server (it serves text generation)")

    async def apply_template(self, request: web.Request) -> web.Response:
        """llama-server's /apply-template: the prompt text a chat request's messages (and tools)
        render to, without generating: {"prompt": ...}."""
        body = await self._body(request)
        _, text, _, _ = await self._chat_prompt(body)
        return web.json_response({"prompt": text})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        add = None if oai.bool_field(body, "add_special", False) else False
        special = oai.bool_field(body, "parse_special", True)
        content = body.get("content")
        if content is None:  # (ik: no content, no tokens)
            ids = []
        elif isinstance(content, list):  # llama-server's mixed form: texts and token ids, in order
            ids = []
            for i, part in enumerate(content):
                if isinstance(part, str):
                    ids += await self._encode(part, add if i == 0 else False, special, prompt=False)
                elif isinstance(part, int) and not isinstance(part, bool) and 0 <= part < self.tok.n_vocab:
                    ids.append(part)
                else:
                    raise bad(f"content[{i}]: expected a string or a token id in [0, {self.tok.n_vocab}), got "
                              f"{oai.json_type(part)}"[:300])
        else:
            text = oai.text_field(body, "content")
            # add_special: the special tokens the model's tokenizer adds (a BOS where it adds one), as
            # llama-server's llama_tokenize(add_special); never a BOS the model's prompts do not get
            ids = await self._encode(text, add, special, prompt=False)
        if oai.bool_field(body, "with_pieces", False):
            pieces = await asyncio.to_thread(lambda: [{"id": i, "piece": _piece(self.tok.piece(i, special=True))}
                                                      for i in ids])
            return web.json_response({"tokens": pieces})
        return web.json_response({"tokens": ids})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)

        def text() -> str:  # on a worker thread: a 32 MiB body holds ~15M ids, seconds of Python work
            if body.get("tokens") is None:  # (ik: no tokens, no text)
                return ""
            ids = oai.tokens_field(body)
            V = self.tok.n_vocab
            bad_ids = [t for t in ids if not 0 <= t < V]
            if bad_ids:
                raise bad(f"tokens: id {bad_ids[0]} is outside the vocabulary [0, {V})")
            return self.tok.decode(ids)
        return web.json_response({"content": await asyncio.to_thread(text)})

    async def expert_stats(self, request: web.Request) -> web.Response:
        """The expert statistics counted so far (--expert-stats FILE.json), in the file's form: read
        while the server runs, and kept by a client should the server die before writing the file."""
        if not self.eng.options.expert_stats:
            raise ApiError(404, "expert statistics are off (start the server with --expert-stats FILE.json)")
        stats = await asyncio.to_thread(self.eng.expert_stats)
        return web.json_response(stats)

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def index(self, request: web.Request) -> web.Response:
        page = STATIC / "index.html"
        if not self.config.webui:
            raise ApiError(404, "the chat page is off (--no-webui)")
        if not page.exists():
            raise ApiError(404, "no chat page in this install")
        return web.Response(body=page.read_bytes(), content_type="text/html", charset="utf-8")


async def _answer_pieces(answer: AnswerSplitter, job: Job):
    """A chat answer's (reasoning, content) pieces as they come: its opening (a forced call's start),
    then each of the job's text pieces through the splitter (`_answer_end` gives the rest)."""
    yield answer.opening
    async for piece in job.pieces():
        yield answer.feed(piece)


def _answer_end(answer: AnswerSplitter, one_call: bool) -> tuple[str, str, list]:
    """The splitter's last (reasoning, content) and the answer's calls (the first only where `one_call`)."""
    r, c, calls = answer.finish()
    return r, c, calls[:1] if one_call else calls


async def _whole_answer(answer: AnswerSplitter, job: Job, one_call: bool) -> tuple[str, str, list]:
    """(reasoning, content, calls) of a chat answer, whole (the non-streamed answers of every chat form)."""
    parts = [p async for p in _answer_pieces(answer, job)]
    r, c, calls = _answer_end(answer, one_call)
    return "".join(p[0] for p in parts) + r, "".join(p[1] for p in parts) + c, calls


def _finish(job: Job, calls: list) -> str:
    """OpenAI's finish_reason: "tool_calls" for an answer that called tools and stopped by itself."""
    return "tool_calls" if calls and oai.FINISH[job.finish_reason] == "stop" else oai.FINISH[job.finish_reason]


def _deltas(reasoning: str, content: str) -> list[dict]:
    return ([{"reasoning_content": reasoning}] if reasoning else []) + ([{"content": content}] if content else [])


def _ik_tok_str(b: list[int], text: str) -> str:
    """ik_llama.cpp's tok_str of a token: a lone byte of a split character as "byte: \\xNN" (its
    tokens_to_output_formatted_string), else the text (a U+FFFD before: alternatives that were
    different bytes read alike)."""
    return f"byte: \\x{b[0]:x}" if len(b) == 1 and b[0] & 0x80 else text


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def _sse_anthropic(obj: dict) -> bytes:
    """An Anthropic Messages stream event (`event: TYPE`); an error as its `error` event."""
    if "type" not in obj and isinstance(obj.get("error"), dict):
        obj = anthropic.error_body(obj["error"].get("code") or 500, obj["error"].get("message", ""))
    return f"event: {obj['type']}\n".encode() + _sse(obj)


def _sse_event(obj: dict) -> bytes:
    """A Responses API stream event: `event: TYPE` and its data (an error as its `error` event)."""
    if "type" not in obj and isinstance(obj.get("error"), dict):
        obj = {"type": "error", "code": obj["error"].get("code"), "message": obj["error"].get("message"),
               "param": None}
    return f"event: {obj['type']}\n".encode() + _sse(obj)


async def _cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer (streams too: this runs before their headers go out) names the request's Origin
    as allowed, as llama-server's answers do."""
    origin = request.headers.get("Origin")
    if origin:
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Allow-Credentials"] = "true"
        response.headers.add("Vary", "Origin")


def _piece(b: bytes) -> str | list[int]:
    """A token's piece as /tokenize's with_pieces gives it: text, or its byte values where the bytes
    alone are not UTF-8 (a byte token, half a character), as llama-server does."""
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return list(b)


def _cancel(jobs: list[Job]) -> None:
    for job in jobs:
        job.cancel()


async def _merged(streams: list):
    """The events of several async generators (a streamed request's prompts, each its own job) in
    the order they come; the first error ends them all. One is iterated as it is."""
    if len(streams) == 1:
        async for obj in streams[0]:
            yield obj
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(events) -> None:
        try:
            async for obj in events:
                await queue.put((True, obj))
            await queue.put((False, None))
        except Exception as e:  # (an ApiError: the stream's last event names it)
            await queue.put((False, e))
    tasks = [asyncio.ensure_future(pump(events)) for events in streams]
    try:
        left = len(tasks)
        while left:
            more, obj = await queue.get()
            if more:
                yield obj
            elif obj is not None:
                raise obj
            else:
                left -= 1
    finally:
        for t in tasks:
            t.cancel()


async def _usage_null_until_last(events):
    """With stream_options.include_usage, OpenAI's chunks before the last carry `"usage": null` (the
    last one, with no choices, the counts): clients that read `chunk.usage` on every chunk expect
    the key."""
    async for obj in events:
        yield obj if "usage" in obj else {**obj, "usage": None}


def _error(e: ApiError) -> web.Response:
    # a 401 names its scheme (RFC 9110 asks for the header; the key goes as "Authorization: Bearer")
    headers = {"WWW-Authenticate": 'Bearer realm="ikjax"'} if e.status == 401 else None
    return web.json_response(e.body(), status=e.status, headers=headers)
