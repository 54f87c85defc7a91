"""The HTTP server of one worker, on aiohttp: the app and its route table (:class:`Service`), the server on a
bound socket (:class:`HttpServer`) and its own event-loop thread (:class:`ServerThread`).

Why aiohttp: it is on the GPU image (fastapi, uvicorn and starlette are not), it is one dependency
for both this server and the load/client side, ``await response.write()`` waits for the socket to
drain (a slow reader back-pressures its own handler, never the owner thread), and with
``handler_cancellation`` a client that disconnects cancels its handler, which here becomes a cancel
at the owner's next step boundary.

Routes:

========================  ======================================================================
``POST /generate``        native: NDJSON event stream (submitted, admitted, token i, finished);
                          ``"stream": false`` returns the events as one JSON object
``POST /cancel``          ``{"request_id", "cancel_token"}`` → 200 ``{"cancelled": true}`` / 404
``GET  /health``          200 with the worker's state, 503 while starting, unhealthy or closed
``GET  /config``          model identity, engine and worker configuration (authenticated)
``GET  /metrics``         Prometheus exposition via prometheus_client (queue depth, running, KV usage, tokens,
                          requests by finish reason, TTFT/ITL/e2e histograms; docs/METRICS.md)
``POST /v1/completions``  OpenAI-compatible; stream (SSE ``data: {...}`` ... ``data: [DONE]``) or JSON
``POST /v1/chat/completions``  the same through the chat template
``GET  /v1/models``       the one served model
``POST /tokenize``        vLLM's: a prompt or chat messages → ``{count, max_model_len, tokens, token_strs}``
``POST /detokenize``      vLLM's: ``{tokens}`` → ``{prompt}``
``GET  /version``         ``{version}`` of the server
========================  ======================================================================

Errors are JSON ``{"error": {"message", "type", "param", "code"}}`` on every route (also for what
aiohttp's parser refuses): 400 bad input, 401 no or wrong API key, 403 a refused Origin, 404 unknown
route/model/request, 405 wrong method, 408 a request that did not arrive in time, 413 body too large
(before ``100 Continue``), 414/431 request line or headers too large, 415 a body that is not
``application/json``, 429 queue full and 503 not accepting work (both with ``Retry-After``). A 500
means a bug or an engine fault, never bad input.

Who may do what (:mod:`serve.entrypoints.http`): ``--api-key`` on every route but ``/health``, browser origins
only from ``--allowed-origins``, POST bodies only ``application/json``; a generation's answer carries
``X-Request-Id`` and ``X-Cancel-Token``, and ``/cancel`` needs both.

The pieces, one module each (vLLM's seams): middleware and access (:mod:`serve.entrypoints.http`), the
submission path both APIs share (:mod:`serve.entrypoints.serving`), the native routes
(:mod:`serve.entrypoints.serving_native`), the OpenAI routes (:mod:`serve.entrypoints.serving_openai`),
detokenizing (:mod:`serve.entrypoints.detokenize`); ``labkit serve`` itself is :mod:`serve.entrypoints.launch`.
Connections are timed and counted by :mod:`serve.entrypoints.connections` (timeouts per phase, a cap with
eviction of idle clients, a quiet log).
"""
from __future__ import annotations

import asyncio
import errno
import socket
import threading

from aiohttp import web

from serve.errors import ServeError
from serve.entrypoints.connections import ConnectionGuard, ConnectionLimits, GuardedAppRunner, QuietLog
from serve.core.front import WorkerFront
from serve.entrypoints.http import Access, Middleware
from serve.observe.metrics import cache_config_info
from serve.protocol.requests import Limits
from serve.entrypoints.serving import Serving
from serve.entrypoints.serving_native import NativeRoutes
from serve.entrypoints.serving_openai import OpenAIRoutes
from serve.entrypoints.serving_tokens import TokenRoutes

LISTEN_QUEUE = 1024


class Service:
    """The routes over one worker: its middleware, the native and the OpenAI routes, and the route table."""

    def __init__(self, worker: WorkerFront, served_model_name: str | None = None, max_body_bytes: int = 1 << 20, *,
                 access: Access | None = None, connections: ConnectionLimits | None = None,
                 log: QuietLog | None = None):
        served = worker.served
        name = served_model_name or served.model.get("preset") or _basename(served.model.get("path")) or "model"
        if not isinstance(max_body_bytes, int) or isinstance(max_body_bytes, bool) or max_body_bytes < 1024:
            raise ServeError(f"--max-body-bytes must be an integer of at least 1024, got {max_body_bytes!r}")
        self.worker = worker
        cfg = worker.config
        # as vLLM's `serve MODEL`: without --served-model-name, requests may name the model as it was given
        # (a path, a fetched name such as smollm2, a hub id) or by its directory, beside the name shown
        aliases = frozenset() if served_model_name else \
            frozenset(str(a) for a in (cfg.flat()["model"], served.model.get("path")) if a) - {name}
        self.limits = Limits(served.max_model_len, name, max_body_bytes,
                             enable_auto_tool_choice=cfg.enable_auto_tool_choice, reasoning_parser=cfg.reasoning_parser,
                             model_aliases=aliases)
        worker.stats.set_model_name(name, cache_config_info(served))   # vLLM's /metrics series, as vLLM labels them
        self.access = access or Access.make()
        self.connections = connections or ConnectionLimits()
        self.connections.check()
        self.log = log or QuietLog()
        self.http = Middleware(self.access, max_body_bytes, self.connections.timeout_body)
        serving = Serving(worker, self.limits, self.http)
        self.native = NativeRoutes(serving, self.connections)
        self.openai = OpenAIRoutes(serving)
        self.tokens = TokenRoutes(serving)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.limits.max_body_bytes, middlewares=[self.http.errors])
        native, openai, expect = self.native, self.openai, self.http.expect
        app.router.add_post("/generate", native.generate, expect_handler=expect)
        app.router.add_post("/cancel", native.cancel, expect_handler=expect)
        app.router.add_get("/health", native.health)
        app.router.add_get("/config", native.config)
        app.router.add_get("/metrics", native.metrics)
        app.router.add_post("/v1/completions", openai.completions, expect_handler=expect)
        app.router.add_post("/v1/chat/completions", openai.chat, expect_handler=expect)
        app.router.add_get("/v1/models", native.models)
        app.router.add_get("/v1/models/{model_id:.+}", native.model)
        app.router.add_post("/tokenize", self.tokens.tokenize, expect_handler=expect)
        app.router.add_post("/detokenize", self.tokens.detokenize, expect_handler=expect)
        app.router.add_get("/version", self.tokens.version)
        return app


def _basename(path: str | None) -> str | None:
    if not path:
        return None
    return str(path).rstrip("/").rsplit("/", 1)[-1] or None


# --------------------------------------------------------------------------- listening


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound socket for ``host:port`` (0: a free port); a port in use is one clear ServeError."""
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ServeError(f"--port must be between 0 and 65535 (0 picks a free one), got {port!r}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ServeError(f"port {port} on {host} is already in use; stop the other server or pick another "
                            f"--port (0 picks a free one)") from None
        raise ServeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}"


class HttpServer:
    """The aiohttp app of a Service on a bound socket, inside the caller's event loop.

    ``stop()`` first closes every connection that is not running a request (half-sent requests, idle
    keep-alives), so a stop never waits on a client that is not sending."""

    def __init__(self, service: Service, sock: socket.socket, shutdown_timeout: float = 1.0):
        self.service = service
        self.sock = sock
        self.url = url_of(sock)
        self.guard = ConnectionGuard(service.connections, service.log)
        if self.guard.cap_note:
            service.log.event("connection cap lowered", self.guard.cap_note)
        self._runner = GuardedAppRunner(service.app(), self.guard, handle_signals=False, access_log=None,
                                        handler_cancellation=True, shutdown_timeout=shutdown_timeout)

    async def start(self) -> str:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(self.service.log.loop_exception_handler)
        await self._runner.setup()
        site = web.SockSite(self._runner, self.sock, backlog=self.guard.backlog)   # asyncio's accept burst
        await site.start()
        try:
            self.sock.listen(LISTEN_QUEUE)      # the kernel's queue may be long: waiting sockets hold no descriptor
        except OSError:
            pass
        self.guard.start()
        return self.url

    async def stop(self) -> None:
        self.guard.close_waiting()
        await self.guard.stop()
        await self._runner.cleanup()


def make_service(worker: WorkerFront, served_model_name, max_body_bytes, api_key, allowed_origins,
                 connections) -> Service:
    return Service(worker, served_model_name, max_body_bytes, access=Access.make(api_key, allowed_origins),
                   connections=connections)


class ServerThread:
    """A worker's HTTP server on its own event-loop thread (tests, simulate, ``load --serve-local``).

    ``close()`` closes the worker first (open streams end with cancelled/shutdown) and then the
    server; it is idempotent and every join is bounded. ``close(close_worker=False)`` stops only the HTTP
    server, for a worker that outlives it (one worker served by several servers in turn).
    """

    def __init__(self, worker: WorkerFront, host: str = "127.0.0.1", port: int = 0, *,
                 served_model_name: str | None = None,
                 max_body_bytes: int = 1 << 20, sock: socket.socket | None = None, api_key: str | None = None,
                 allowed_origins=None, connections: ConnectionLimits | None = None):
        self.worker = worker
        self.sock = sock or bind_socket(host, port)
        self.url = url_of(self.sock)
        self._service = make_service(worker, served_model_name, max_body_bytes, api_key, allowed_origins, connections)
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

    @property
    def guard(self) -> ConnectionGuard | None:
        return self._server.guard if self._server is not None else None

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self._thread = threading.Thread(target=self._run, name=f"labkit-http-{self.worker.worker_id}", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise ServeError(f"HTTP server did not start within {timeout} s")
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

    def close(self, timeout: float = 15.0, *, close_worker: bool = True) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if close_worker:
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
