"""`ikjax serve`'s transport: the listening socket, the 503 answers while the model loads, the
aiohttp server and its connections, the shutdown on SIGINT / SIGTERM, and aiohttp's own logging and
framing answers made to fit this server's JSON errors. The endpoints are ikjax.server.app's.
"""
from __future__ import annotations

import asyncio
import time
import json
import logging
import os
import signal
import socket
import threading

from aiohttp import web, web_protocol, web_server
from aiohttp.http_exceptions import ContentEncodingError, HttpProcessingError, LineTooLong

from ikjax.errors import OptionError
from ikjax.server.openai import ApiError

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"  # the interim answer (to an Expect, and _probe_gone's probe)


class _AnsweredBodyErrors(logging.Filter):
    """aiohttp drains a request's body after the handler; a body that does not decode (bad gzip)
    raises there again and aiohttp logs it as an "Unhandled exception" with three tracebacks, though
    `Server._body` already answered it with a 400 naming the problem. Those records are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, (web.RequestPayloadError, ContentEncodingError))


class _MalformedHttpOneLine(logging.Filter):
    """A request aiohttp's HTTP parser refuses (a bad chunk size, Content-Length beside
    Transfer-Encoding, a header past 8190 bytes, an unknown method...) was logged as "Error
    handling request" with a traceback, one per bad request: a client could fill the log. Such a
    record becomes one line naming the problem."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.msg, record.args, record.exc_info = "malformed HTTP request: %s", (_framing_reason(exc),), None
        return True


def _framing_reason(exc: BaseException | None, message: str | None = None) -> str:
    if _too_long(exc, message):  # aiohttp's message quotes the line: an Authorization header's key, say
        return "a request line or header field over 8190 bytes"
    why = getattr(exc, "message", None) or message or (str(exc) if exc is not None else "")
    return " ".join(str(why).split())[:300] or "unreadable"


def _too_long(exc: BaseException | None, message: str | None = None) -> bool:
    """A request line or header past aiohttp's limit: 431 (RFC 6585), its text never echoed."""
    why = str(getattr(exc, "message", None) or message or "")
    return isinstance(exc, LineTooLong) or why.startswith("Got more than")


def quiet_aiohttp_logs() -> None:
    """The serving process's aiohttp log: answered body errors dropped, malformed requests one line,
    aiohttp's own framing answers in the server's JSON error form."""
    logger = logging.getLogger("aiohttp.server")
    for kind in (_AnsweredBodyErrors, _MalformedHttpOneLine):
        if not any(isinstance(f, kind) for f in logger.filters):
            logger.addFilter(kind())
    _json_framing_errors()


def _json_framing_errors() -> None:
    """What aiohttp answers itself, before any handler runs (its HTTP parser refused the request),
    in this server's JSON error form with the same status: it answered text/plain ("400 Bad
    Request ... Invalid chunk size"). aiohttp has no hook for this answer, so its RequestHandler's
    `handle_error` is wrapped, in the serving process only; its 500s (a handler's failure, which
    `_errors` already turns into JSON) are left as they are."""
    from aiohttp import web_protocol
    orig = web_protocol.RequestHandler.handle_error
    if getattr(orig, "ikjax_json", False):
        return

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None):
        resp = orig(self, request, status, exc, message)
        if status >= 500:
            return resp
        if _too_long(exc, message):
            status = 431
        out = web.json_response(ApiError(status, f"malformed HTTP request: {_framing_reason(exc, message)}").body(),
                                status=status)
        out.force_close()
        return out
    handle_error.ikjax_json = True
    web_protocol.RequestHandler.handle_error = handle_error


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (0: any free port), or one line saying why not."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OptionError(f"--host {host}: cannot resolve ({e.strerror or e})") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise OptionError(f"--host {host} --port {port}: cannot listen ({e.strerror or e})") from None
    sock.setblocking(False)
    return sock


class LoadingResponder:
    """Answers every request on the bound socket with 503 "Loading model" (llama-server's body)
    while the model loads and the steps compile, so that a readiness probe or a client gets an
    answer, not a connection that hangs in the listen backlog (a probe found /health waiting 6.7 s).
    A thread of its own, plain sockets: the request's head is read, the answer written, the
    connection closed. `stop()` before the server proper takes the socket. `model`: the id the
    server will serve, where known before the load: GET /models and /v1/models list it meanwhile
    (llama-server lets those two through while it loads: a client polls them to find the model)."""

    BODY = json.dumps({"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}).encode()

    def __init__(self, sock: socket.socket, model: str | None = None):
        self.sock = sock
        self.models = None if model is None else json.dumps({
            "object": "list", "data": [{"id": model, "object": "model", "created": int(time.time()),
                                        "owned_by": "ikjax"}],
            "models": [{"name": model, "model": model}]}).encode()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ikjax-loading-503", daemon=True)

    def start(self) -> "LoadingResponder":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import select
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self.sock], [], [], 0.1)
                if not ready:
                    continue
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                return
            try:
                conn.settimeout(1.0)
                head = b""
                while b"\r\n\r\n" not in head and len(head) < 65536:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    head += chunk
                line = head.split(b"\r\n", 1)[0].split()
                if (self.models is not None and len(line) >= 2 and line[0] == b"GET"
                        and line[1].split(b"?", 1)[0] in (b"/models", b"/v1/models")):
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                                 b"Content-Length: " + str(len(self.models)).encode() + b"\r\n\r\n" + self.models)
                    continue
                conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                             b"Retry-After: 1\r\nConnection: close\r\nContent-Length: "
                             + str(len(self.BODY)).encode() + b"\r\n\r\n" + self.BODY)
            except OSError:
                pass
            finally:
                conn.close()


def run(server, sock: socket.socket, on_listening=None, on_stopping=None) -> None:
    """Serve `server` (ikjax.server.app.Server: its `app()` and `config.timeout`) on `sock` (from
    `bind`) until SIGINT / SIGTERM; `on_listening(url)` once it accepts, `on_stopping(signal name)`
    when the first signal starts the shutdown (an operator's log says why the server went)."""
    asyncio.run(_serve(server, sock, on_listening, on_stopping))


class _AnswersHalfClosed(web_protocol.RequestHandler):
    """aiohttp's connection handler, except for a client that shuts its side down after sending
    (`nc -N`, `printf ... | nc`, a socket's shutdown(SHUT_WR)): aiohttp let asyncio close the
    connection on that EOF, before any handler answered, and such a client got no answer at all.
    Where every request that came is whole (its body in), the connection stays open until they
    are answered and then closes; a body cut short by the EOF still closes it at once, as before."""

    _bodies: list | None = None  # each request's body stream parsed on this connection (the last few)
    _client_done = False  # the client shut its side down after whole requests

    def data_received(self, data: bytes) -> None:
        queue = getattr(self, "_messages", None)
        before = len(queue) if queue is not None else 0
        super().data_received(data)
        if queue is not None and len(queue) > before:
            self._bodies = ((self._bodies or []) + [payload for _, payload in list(queue)[before:]])[-8:]

    def eof_received(self):
        if self._bodies and all(b.is_eof() for b in self._bodies):
            self._client_done = True  # no further request can come: answer what came, then close
            if not getattr(self, "_messages", None):
                if getattr(self, "_waiter", None) is not None:
                    # idle, waiting for the next request (a keep-alive client that closed): nothing to
                    # answer, the socket closed now. aiohttp's close() only cancelled the wait for the next request,
                    # which left its loop before the line that closes the transport: every such
                    # connection stayed in CLOSE-WAIT, a descriptor a request until the process ran
                    # out of them (an outside probe, stop 68: 2,000 requests, 2,000 descriptors)
                    self.force_close()
                    return True
                self.close()
            asyncio.get_running_loop().create_task(self._probe_gone())
            return True
        return super().eof_received()

    async def _probe_gone(self, first: float = 1.0, every: float = 0.5) -> None:
        """The client sent its FIN while a request is in flight. It may have shut only its writing side
        (`nc -N`: it reads the answer) or closed the socket (a timeout, a retry: nobody will read), and
        TCP cannot tell the two apart until something is written: a closed socket answers with a reset,
        and the write after that fails, which ends the connection and cancels the handler, its job and
        its slot (handler_cancellation). Not written, a non-streamed request whose client had gone ran to
        its end, up to the slot's context (an outside probe, stop 65: an openai client's timeout and two
        retries left three slots generating to their context's end). So while the request's answer has
        not started, an interim `100 Continue` (HTTP/1.1's clients skip 1xx responses) after a second and
        every half second after it; a stream's own writes find a gone client already."""
        await asyncio.sleep(first)
        while True:
            transport = self.transport
            if transport is None or transport.is_closing():
                return
            req = self._current_request
            if req is None:
                if not getattr(self, "_messages", None):
                    return  # every request answered
            else:
                writer = getattr(req, "_payload_writer", None)
                if req.version < (1, 1) or writer is None:
                    return
                if not getattr(writer, "_headers_written", True) and not writer.output_size:
                    transport.write(CONTINUE)
            await asyncio.sleep(every)

    async def finish_response(self, request, resp, start_time):
        out = await super().finish_response(request, resp, start_time)
        if self._client_done and not getattr(self, "_messages", None):
            self.close()  # the last request's answer is out
        return out


class _Server(web_server.Server):
    def __call__(self) -> web_protocol.RequestHandler:
        return _AnswersHalfClosed(self, loop=self._loop, **self._kwargs)


class _Runner(web.AppRunner):
    async def _make_server(self) -> web_server.Server:
        made = await super()._make_server()
        made.__class__ = _Server  # (the same server; only its connections' handler class differs)
        return made


async def _serve(server, sock: socket.socket, on_listening, on_stopping=None) -> None:
    runner = _Runner(server.app(), handler_cancellation=True, keepalive_timeout=server.config.timeout,
                     access_log=None)
    await runner.setup()
    site = web.SockSite(runner, sock, shutdown_timeout=1.0)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def first(_sig: int) -> None:
        """The first SIGINT / SIGTERM: a clean shutdown (streams told, exit 0). A second one while it
        runs forces the exit at once, with the signal's status (130 / 143): it came out as a
        KeyboardInterrupt from an atexit callback, or as death by the signal, by its timing (an
        outside probe, stop 65)."""
        stop.set()
        if on_stopping is not None:
            on_stopping(signal.Signals(_sig).name)
        for s in (signal.SIGINT, signal.SIGTERM):  # (a process handler: it outlives the loop, into the exit)
            loop.remove_signal_handler(s)
            signal.signal(s, lambda n, _frame: os._exit(128 + n))
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, first, sig)
    host, port = sock.getsockname()[:2]
    if on_listening is not None:
        on_listening(f"http://{_url_host(host)}:{port}")
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
