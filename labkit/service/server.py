"""The HTTP front of one Worker, on aiohttp.

Why aiohttp: it is on the GPU image (fastapi, uvicorn and starlette are not), it is one dependency
for both this server and the load/client side, ``await response.write()`` waits for the socket to
drain (a slow reader back-pressures its own handler, never the owner thread), and with
``handler_cancellation`` a client that disconnects cancels its handler, which here becomes a cancel
at the owner's next step boundary.

Routes:

========================  ======================================================================
``POST /generate``        native: NDJSON event stream (submitted, admitted, token i, finished);
                          ``"stream": false`` returns the events as one JSON object
``POST /cancel``          ``{"request_id"}`` → 200 ``{"cancelled": true}`` / 404
``GET  /health``          200 with the worker's state, 503 while starting, unhealthy or closed
``GET  /metrics``         Prometheus text (queue depth, running, KV blocks, tokens, TTFT/ITL)
``POST /v1/completions``  OpenAI-compatible; stream (SSE ``data: {...}`` ... ``data: [DONE]``) or JSON
``POST /v1/chat/completions``  the same through the chat template
``GET  /v1/models``       the one served model
========================  ======================================================================

Errors are JSON ``{"error": {"message", "type", "param", "code"}}``: 400 bad input, 404 unknown
route/model/request, 405 wrong method, 413 body too large, 429 queue full, 503 not accepting work.
A 500 means a bug or an engine fault, never bad input.

Why one file of this length: the native and the OpenAI routes share the submit, stream and error
paths, and keeping them together is what keeps the two APIs' answers the same.
"""
from __future__ import annotations

import asyncio
import errno
import json
import socket
import threading
import time
from typing import Any, Callable

from aiohttp import web

from engine import RequestError
from labkit.errors import UserError
from labkit.service import protocol
from labkit.service.protocol import ApiError, GenRequest, Limits
from labkit.service.stream import RequestHandle
from labkit.service.worker import DuplicateRequest, Worker, WorkerUnavailable

POLL_S = 0.5          # how often a waiting handler checks that its client is still there


# --------------------------------------------------------------------------- text


class IncrementalText:
    """Turns a growing list of token ids into text pieces without splitting a UTF-8 character.

    Only the tail after the last clean boundary is decoded each time; a piece that ends in the
    replacement character (an incomplete multi-byte sequence) is held back until the next token.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0          # ids[:prefix] are settled text
        self.read = 0            # ids[:read] have been emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self.tokenizer is None:
            return ""
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            piece = after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
            return piece
        return ""

    def text(self) -> str:
        return self._decode(self.ids) if self.tokenizer is not None else ""


# --------------------------------------------------------------------------- helpers


def error_response(err: ApiError, **extra) -> web.Response:
    return web.json_response(err.body(**extra), status=err.status)


def _disconnected(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def _read_json(request: web.Request, limit: int) -> Any:
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(413, f"request body of {request.content_length} bytes exceeds the limit of {limit} bytes",
                       "body_too_large")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"request body exceeds the limit of {limit} bytes", "body_too_large") from None
    if len(raw) > limit:
        raise ApiError(413, f"request body exceeds the limit of {limit} bytes", "body_too_large")
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})", "invalid_json") from None


def _finish_reason_openai(finished: dict) -> str:
    reason = finished.get("reason")
    return reason if reason in ("stop", "length") else "abort"


class ClientGone(Exception):
    pass


# --------------------------------------------------------------------------- the app


class Service:
    """Routes over one Worker."""

    def __init__(self, worker: Worker, served_model_name: str | None = None, max_body_bytes: int = 1 << 20):
        self.worker = worker
        model = (worker.built.model or {}) if worker.built else {}
        name = served_model_name or model.get("preset") or _basename(model.get("path")) or "model"
        cfg = worker.engine.config
        self.limits = Limits(cfg.max_model_len, cfg.vocab_size, name, max_body_bytes)
        self.created = int(time.time())

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.limits.max_body_bytes, middlewares=[self._errors])
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/cancel", self.cancel)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable):
        try:
            return await handler(request)
        except ApiError as e:
            return error_response(e)
        except ClientGone:
            return web.Response(status=499)       # nobody is listening any more
        except web.HTTPRequestEntityTooLarge:
            return error_response(ApiError(413, f"request body exceeds the limit of {self.limits.max_body_bytes} bytes",
                                           "body_too_large"))
        except web.HTTPException as e:
            if e.status < 400:
                raise
            code = {404: "not_found", 405: "method_not_allowed"}.get(e.status, "http_error")
            text = f"{request.method} {request.path}: {e.reason}"
            return error_response(ApiError(e.status, text, code))

    # -- submission ---------------------------------------------------------------
    async def _submit(self, req: GenRequest) -> RequestHandle:
        def call() -> RequestHandle:
            return self.worker.submit(req.prompt, req.params, request_id=req.request_id, tags=req.tags)

        try:
            if isinstance(req.prompt, list) and (not req.prompt or isinstance(req.prompt[0], int)):
                handle = call()               # token ids: no tokenizer work, keep arrival order
            else:
                handle = await asyncio.get_running_loop().run_in_executor(None, call)
        except RequestError as e:
            param = {"invalid_request_id": "request_id", "invalid_tags": "tags"}.get(e.code, "prompt")
            raise ApiError(400, str(e), e.code, param) from None
        except DuplicateRequest as e:
            raise ApiError(400, str(e), "duplicate_request_id", "request_id") from None
        except WorkerUnavailable as e:
            raise ApiError(503, str(e), "unavailable") from None
        if handle.rejected:
            msg = (handle.result or {}).get("message", "queue full")
            raise ApiError(429, f"request {handle.request_id} rejected: {msg}; retry later", "queue_full")
        return handle

    async def _events(self, handle: RequestHandle, request: web.Request):
        """The handle's events until finished; ClientGone when the client went away meanwhile."""
        while True:
            batch = await handle.aget(POLL_S)
            if not batch:
                if handle.finished and handle.buffered == 0:
                    return
                if _disconnected(request):
                    raise ClientGone()
                continue
            for ev in batch:
                yield ev
                if ev["event"] == "finished":
                    return

    def _abandon(self, handle: RequestHandle | None) -> None:
        if handle is not None and not handle.finished:
            self.worker.cancel(handle.request_id, cause="disconnect")

    # -- native --------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        req = protocol.parse_native(await _read_json(request, self.limits.max_body_bytes), self.limits)
        handle = await self._submit(req)
        text = IncrementalText(self.worker.tokenizer if req.detokenize else None)
        if not req.stream:
            return await self._collect_native(handle, request, text)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", "Cache-Control": "no-cache",
                                           "X-Request-Id": handle.request_id, "X-Worker-Id": self.worker.worker_id})
        try:
            await resp.prepare(request)
            async for ev in self._events(handle, request):
                if ev["event"] == "token" and req.detokenize:
                    ev = {**ev, "text": text.push(ev["token_id"])}
                await resp.write(json.dumps(ev, separators=(",", ":"), ensure_ascii=False).encode() + b"\n")
            await resp.write_eof()
        except (ClientGone, ConnectionError):
            pass                          # the finally below turns it into a cancel at the owner
        finally:
            self._abandon(handle)
        return resp

    async def _collect_native(self, handle: RequestHandle, request: web.Request, text: IncrementalText) -> web.Response:
        events = []
        try:
            async for ev in self._events(handle, request):
                if ev["event"] == "token":
                    text.push(ev["token_id"])
                events.append(ev)
        finally:
            self._abandon(handle)
        fin = handle.result or {}
        return web.json_response({"request_id": handle.request_id, "token_ids": text.ids, "text": text.text(),
                                  "finished": fin, "events": events})

    async def cancel(self, request: web.Request) -> web.Response:
        rid = protocol.parse_cancel(await _read_json(request, self.limits.max_body_bytes))
        if not self.worker.cancel(rid, cause="client"):
            raise ApiError(404, f"no request {rid!r} in flight (unknown or already finished)", "request_not_found",
                           "request_id")
        return web.json_response({"request_id": rid, "cancelled": True})

    async def health(self, request: web.Request) -> web.Response:
        snap = self.worker.snapshot()
        built = self.worker.built
        body = {"status": snap["state"], **snap, "kind": built.kind if built else None,
                "device": built.device if built else None,
                "model": built.model if built else None, "served_model_name": self.limits.served_model_name,
                "max_model_len": self.limits.max_model_len,
                "engine": built.describe() if built else None, "worker": vars(self.worker.config)}
        return web.json_response(body, status=200 if snap["state"] == "ok" else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        text = self.worker.stats.render(self.worker.gauges())
        return web.Response(text=text, content_type="text/plain", charset="utf-8",
                            headers={"X-Prometheus-Format": "0.0.4"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.limits.served_model_name, "object": "model", "created": self.created, "owned_by": "nano-lab",
            "max_model_len": self.limits.max_model_len}]})

    # -- OpenAI-compatible ---------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = protocol.parse_completion(await _read_json(request, self.limits.max_body_bytes), self.limits)
        return await self._openai(req, request)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        req = protocol.parse_chat(await _read_json(request, self.limits.max_body_bytes), self.limits)
        return await self._openai(req, request)

    async def _openai(self, req: GenRequest, request: web.Request) -> web.StreamResponse:
        handle = await self._submit(req)
        chat = req.api == "chat"
        oid = f"{'chatcmpl' if chat else 'cmpl'}-{handle.request_id}"
        created = int(time.time())
        model = self.limits.served_model_name
        text = IncrementalText(self.worker.tokenizer)
        prompt_tokens = 0

        def chunk(piece: str | None, finish: str | None, first: bool = False) -> dict:
            if chat:
                delta: dict = {}
                if first:
                    delta["role"] = "assistant"
                if piece is not None:
                    delta["content"] = piece
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                return {"id": oid, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [choice]}
            return {"id": oid, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish}]}

        def usage(fin: dict) -> dict:
            p, c = fin.get("num_prompt_tokens", prompt_tokens), fin.get("num_completion_tokens", len(text.ids))
            return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

        if not req.stream:
            try:
                async for ev in self._events(handle, request):
                    if ev["event"] == "token":
                        text.push(ev["token_id"])
            finally:
                self._abandon(handle)
            fin = handle.result or {}
            if fin.get("reason") == "error":
                raise ApiError(500, f"the engine failed on this request: {fin.get('message')}", "engine_error")
            if fin.get("reason") == "cancelled" and fin.get("cause") == "shutdown":
                raise ApiError(503, "the server shut down before the request finished", "shutdown")
            finish = _finish_reason_openai(fin)
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": text.text()},
                          "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text.text(), "logprobs": None, "finish_reason": finish}
            return web.json_response({"id": oid, "object": "chat.completion" if chat else "text_completion",
                                      "created": created, "model": model, "choices": [choice], "usage": usage(fin)},
                                     headers={"X-Request-Id": handle.request_id, "X-Worker-Id": self.worker.worker_id})

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": handle.request_id, "X-Worker-Id": self.worker.worker_id})

        async def send(obj: Any) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
            await resp.write(f"data: {data}\n\n".encode())

        try:
            await resp.prepare(request)
            if chat:
                await send(chunk("", None, first=True))
            async for ev in self._events(handle, request):
                if ev["event"] == "token":
                    await send(chunk(text.push(ev["token_id"]), None))
                elif ev["event"] == "finished":
                    if ev.get("reason") == "error":
                        await send({"error": ApiError(500, f"the engine failed on this request: {ev.get('message')}",
                                                      "engine_error").body()["error"]})
                    else:
                        await send(chunk(None if chat else "", _finish_reason_openai(ev)))
                        if req.include_usage:
                            body = chunk(None, None)
                            body["choices"] = []
                            body["usage"] = usage(ev)
                            await send(body)
            await send("[DONE]")
            await resp.write_eof()
        except (ClientGone, ConnectionError):
            pass
        finally:
            self._abandon(handle)
        return resp


def _basename(path: str | None) -> str | None:
    if not path:
        return None
    return str(path).rstrip("/").rsplit("/", 1)[-1] or None


# --------------------------------------------------------------------------- listening


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound socket for ``host:port`` (0: a free port); a port in use is one clear UserError."""
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise UserError(f"--port must be between 0 and 65535 (0 picks a free one), got {port!r}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise UserError(f"port {port} on {host} is already in use; stop the other server or pick another "
                            f"--port (0 picks a free one)") from None
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}"


class HttpServer:
    """The aiohttp app of a Service on a bound socket, inside the caller's event loop."""

    def __init__(self, service: Service, sock: socket.socket, shutdown_timeout: float = 5.0):
        self.service = service
        self.sock = sock
        self.url = url_of(sock)
        self._runner = web.AppRunner(service.app(), handle_signals=False, access_log=None,
                                     handler_cancellation=True, shutdown_timeout=shutdown_timeout)

    async def start(self) -> str:
        await self._runner.setup()
        site = web.SockSite(self._runner, self.sock)
        await site.start()
        return self.url

    async def stop(self) -> None:
        await self._runner.cleanup()


class ServerThread:
    """A Worker's HTTP server on its own event-loop thread (tests, simulate, ``load --serve-local``).

    ``close()`` closes the worker first (open streams end with cancelled/shutdown) and then the
    server; it is idempotent and every join is bounded.
    """

    def __init__(self, worker: Worker, host: str = "127.0.0.1", port: int = 0, *, served_model_name: str | None = None,
                 max_body_bytes: int = 1 << 20, sock: socket.socket | None = None):
        self.worker = worker
        self.sock = sock or bind_socket(host, port)
        self.url = url_of(self.sock)
        self._service = Service(worker, served_model_name, max_body_bytes)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: HttpServer | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._closed = False
        self._lock = threading.Lock()

    @property
    def service(self) -> Service:
        return self._service

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self._thread = threading.Thread(target=self._run, name=f"labkit-http-{self.worker.worker_id}", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise UserError(f"HTTP server did not start within {timeout} s")
        if self._error is not None:
            raise self._error
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            self._server = HttpServer(self._service, self.sock)
            loop.run_until_complete(self._server.start())
        except BaseException as e:
            self._error = e
            self._started.set()
            loop.close()
            return
        self._started.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def close(self, timeout: float = 15.0) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.worker.close(timeout=timeout)
        loop, server = self._loop, self._server
        if loop is not None and server is not None and loop.is_running():
            fut = asyncio.run_coroutine_threadsafe(server.stop(), loop)
            try:
                fut.result(timeout)
            except Exception:
                pass
            loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout)
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> "ServerThread":
        return self.start() if self._thread is None else self

    def __exit__(self, *exc) -> None:
        self.close()


async def serve_until_signal(worker: Worker, sock: socket.socket, *, served_model_name: str | None = None,
                             max_body_bytes: int = 1 << 20, on_ready: Callable[[str], None] | None = None,
                             stop: asyncio.Event | None = None) -> None:
    """``labkit serve``: run until SIGINT/SIGTERM (or ``stop``), then close the worker and the server."""
    import signal

    server = HttpServer(Service(worker, served_model_name, max_body_bytes), sock)
    url = await server.start()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    if on_ready is not None:
        on_ready(url)
    try:
        await stop.wait()
    finally:
        await loop.run_in_executor(None, worker.close)
        await server.stop()


def run_serve(config, host: str = "127.0.0.1", port: int = 8801, out=None, *, served_model_name: str | None = None,
              max_body_bytes: int = 1 << 20, on_ready: Callable[[str, Worker], None] | None = None) -> dict:
    """``labkit serve``: bind first (a port in use fails before the model loads), start the worker,
    serve until SIGINT/SIGTERM, close. Returns what the worker did (finished requests by reason)."""
    from labkit.service.events import EventLog

    sock = bind_socket(host, port)
    log = EventLog(out) if out else None
    worker = Worker(config, sink=log.write if log else None)
    try:
        worker.start()
        if log is not None:
            log.write_header(worker.header(role="server", url=url_of(sock)))
        asyncio.run(serve_until_signal(worker, sock, served_model_name=served_model_name,
                                       max_body_bytes=max_body_bytes,
                                       on_ready=(lambda url: on_ready(url, worker)) if on_ready else None))
    finally:
        worker.close()
        if log is not None:
            log.close()
        sock.close()
    stats = worker.stats
    return {"finished": dict(stats.finished),
            "generation_tokens": stats.generation_tokens, "steps": dict(stats.steps),
            "engine_errors": stats.engine_errors, "log": str(out) if out else None}
