"""Connections of the HTTP server: phases with deadlines, a cap, and a log that stays quiet.

aiohttp parses and dispatches; this module decides how long a connection may take and how many
there may be. Every connection is in one phase, with the time it entered it:

=========  ===================================================  =========================================
phase      what the server waits for                            past its deadline
=========  ===================================================  =========================================
``idle``   the first byte of a request (a new connection, or    closed silently (``timeout_keep_alive``)
           keep-alive after a response)
``head``   the rest of the request line and headers             ``408`` JSON, closed (``timeout_headers``)
``body``   the request body (read by the handler)               ``408`` JSON from the handler, closed
                                                                (``timeout_body``; the sweep closes it
                                                                a second later if the handler did not)
``busy``   the handler (generation, streaming): no deadline;    -
           a client that goes away cancels its request
=========  ===================================================  =========================================

A sweep every :data:`SWEEP_S` enforces the deadlines. At most ``max_connections`` connections are
open; a new one beyond it first evicts the connection that has waited longest in ``idle`` or
``head`` (a slow or silent client holds no request), and only when every connection is running a
request is the new one answered ``503`` with ``Retry-After`` and closed. The cap is kept below the
process's file limit, so ``accept()`` does not run out of descriptors while a client can still be
answered. Errors of the event loop and of aiohttp (a failed ``accept()``, a broken request) become
one line per class and interval in the log (:class:`QuietLog`), never a traceback per event.
"""
from __future__ import annotations

import asyncio
import json
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from serve.observe.logsafe import safe

SWEEP_S = 0.25
FD_RESERVE = 32            # descriptors kept free beyond the ones open at start (logs, model files, threads)


@dataclass
class ConnectionLimits:
    """How long each phase of a connection may take, and how many connections may be open."""
    timeout_keep_alive: float = 5.0      # idle: no byte of a request yet
    timeout_headers: float = 10.0        # head: request line + headers, from their first byte
    timeout_body: float = 30.0           # body: the whole body, from the end of the headers
    max_connections: int = 512           # lowered to fit the file limit (see effective_max_connections)
    lingering_s: float = 2.0             # after an early answer, how long an unread body is drained

    def check(self) -> None:
        from serve.errors import ServeError

        for name in ("timeout_keep_alive", "timeout_headers", "timeout_body"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= 3600:
                raise ServeError(f"--{name.replace('_', '-')} must be between 0 and 3600 seconds, got {v!r}")
        if not isinstance(self.max_connections, int) or isinstance(self.max_connections, bool) \
                or not 1 <= self.max_connections <= 1_000_000:
            raise ServeError(f"--max-connections must be a positive integer, got {self.max_connections!r}")


def open_fds() -> int | None:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


def effective_max_connections(wanted: int) -> tuple[int, int, str | None]:
    """(cap, listen backlog, why the cap was lowered): ``wanted`` lowered so that the open connections plus
    two bursts of ``accept()`` (asyncio accepts up to ``backlog`` sockets per loop turn before any of them
    is counted, and the sockets they evict close a turn later) leave :data:`FD_RESERVE` descriptors free."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return wanted, 128, None
    if soft == resource.RLIM_INFINITY or soft > 1 << 20:
        return wanted, 128, None
    used = open_fds() or 64
    free = max(16, soft - used - FD_RESERVE)
    backlog = max(8, min(128, free // 8))
    room = max(8, free - 2 * backlog)          # one burst accepted, one burst of evicted sockets not yet closed
    if room < wanted:
        return room, backlog, (f"at most {room} connections: the file limit is {soft} and {used} descriptors are "
                               f"open (raise it with `ulimit -n`)")
    return wanted, backlog, None


# --------------------------------------------------------------------------- the log


class QuietLog:
    """One line per event class per ``interval`` seconds on stderr, with a count of what was held back."""

    def __init__(self, interval: float = 10.0, write: Callable[[str], None] | None = None, prefix: str = "labkit serve"):
        self.interval = interval
        self.prefix = prefix
        self._write = write or (lambda line: (sys.stderr.write(line + "\n"), sys.stderr.flush()))
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self.counts: dict[str, int] = {}

    def event(self, cls: str, detail: str = "") -> None:
        self.counts[cls] = self.counts.get(cls, 0) + 1
        now = time.monotonic()
        last = self._last.get(cls)
        if last is not None and now - last < self.interval:
            self._held[cls] = self._held.get(cls, 0) + 1
            return
        held = self._held.pop(cls, 0)
        self._last[cls] = now
        more = f" (+{held} more in the last {self.interval:g} s)" if held else ""
        text = f"{self.prefix}: {cls}" + (f": {' '.join(str(detail).split())[:300]}" if detail else "")
        try:
            self._write(safe(text) + more)
        except Exception:         # a closed stderr must not break the server
            pass

    def flush(self) -> None:
        """Say how many events were held back since each class's last line."""
        for cls, held in list(self._held.items()):
            if held:
                try:
                    self._write(f"{self.prefix}: {cls}: {held} more since the last line")
                except Exception:
                    pass
        self._held.clear()

    def loop_exception_handler(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        """For ``loop.set_exception_handler``: a failed ``accept()`` and the like, one line per class."""
        exc = context.get("exception")
        message = context.get("message") or ""
        if isinstance(exc, OSError) and "accept" in message:
            self.event(f"accept failed ({os.strerror(exc.errno) if exc.errno else type(exc).__name__})",
                       "new connections wait in the listen backlog; retrying")
        elif exc is not None:
            self.event(f"event loop: {type(exc).__name__}", f"{message}: {exc}")
        else:
            self.event("event loop", message)


def json_error_bytes(status: int, reason: str, message: str, code: str, type_: str,
                     headers: dict[str, str] | None = None) -> bytes:
    """A complete HTTP/1.1 error response that closes the connection, for where no aiohttp response exists."""
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()
    head = [f"HTTP/1.1 {status} {reason}", "Content-Type: application/json; charset=utf-8",
            f"Content-Length: {len(body)}", "Connection: close", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


# --------------------------------------------------------------------------- connections


class Connection(RequestHandler):
    """aiohttp's request handler with a phase, a deadline and a place in the :class:`ConnectionGuard`."""

    def __init__(self, guard: "ConnectionGuard", manager, **kwargs):
        super().__init__(manager, **kwargs)
        self.guard = guard
        self.phase = "idle"
        self.since = time.monotonic()
        self.refused = False
        self.closed_by_guard: str | None = None

    def enter(self, phase: str) -> None:
        self.phase = phase
        self.since = time.monotonic()

    # -- asyncio protocol --------------------------------------------------------------
    def connection_made(self, transport) -> None:
        if not self.guard.admit(self):
            self.refused = True
            try:
                transport.write(json_error_bytes(
                    503, "Service Unavailable", f"the server has {self.guard.cap} connections open, its limit; "
                    "retry later", "too_many_connections", "service_unavailable", {"Retry-After": "1"}))
                transport.close()
            except Exception:
                pass
            return
        super().connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if data and self.phase == "idle":
            self.enter("head")
        super().data_received(data)

    def connection_lost(self, exc) -> None:
        self.guard.forget(self)
        if self.refused:
            return
        super().connection_lost(exc)

    # -- aiohttp hooks --------------------------------------------------------------------
    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """A request aiohttp could not parse (or a handler bug): one JSON error, one quiet log line."""
        from serve.protocol.wire import parser_error

        if request.writer.output_size > 0:       # a response is under way: the connection is broken
            raise ConnectionError("response already started")
        err = parser_error(status, exc, message)
        if err.status >= 500:
            self.guard.log.event(f"internal error: {type(exc).__name__ if exc else 'unknown'}", str(exc or message))
        else:
            self.guard.log.event(f"bad HTTP request ({err.code})", err.message)
        resp = web.json_response(err.body(), status=err.status)
        resp.force_close()
        return resp

    def log_exception(self, *args, **kw) -> None:
        exc = kw.get("exc_info")
        exc = exc if isinstance(exc, BaseException) else sys.exc_info()[1]
        from aiohttp.http_exceptions import HttpProcessingError
        from aiohttp.web_protocol import PayloadAccessError, RequestPayloadError

        if isinstance(exc, (HttpProcessingError, ConnectionError, RequestPayloadError, PayloadAccessError,
                            asyncio.TimeoutError)):
            self.guard.log.event("client sent a broken body or went away")
            return
        detail = (args[0] % args[1:]) if args and isinstance(args[0], str) and len(args) > 1 else (args[0] if args else "")
        self.guard.log.event(f"aiohttp: {type(exc).__name__ if exc else 'error'}", f"{detail}: {exc}")

    def expire(self, why: str, answer: bytes | None = None) -> None:
        """Close this connection now (after writing ``answer``, if given)."""
        self.closed_by_guard = why
        transport = self.transport
        if answer is not None and transport is not None and not transport.is_closing():
            try:
                transport.write(answer)
            except Exception:
                pass
        self.force_close()


@dataclass
class ConnectionGuard:
    limits: ConnectionLimits
    log: QuietLog = field(default_factory=QuietLog)

    def __post_init__(self) -> None:
        self.cap, self.backlog, self.cap_note = effective_max_connections(self.limits.max_connections)
        self.live: dict[Connection, None] = {}          # insertion-ordered
        self.stats = {"accepted": 0, "refused": 0, "evicted": 0, "idle_closed": 0, "header_timeouts": 0,
                      "body_timeouts": 0}
        self._task: asyncio.Task | None = None

    # -- admission --------------------------------------------------------------------
    def admit(self, conn: Connection) -> bool:
        if len(self.live) >= self.cap:
            victim = self._oldest_waiting()
            if victim is not None:
                self.stats["evicted"] += 1
                self.log.event("connection limit reached", f"{self.cap} open; closing the one idle longest "
                                                         "for a new client")
                self.forget(victim)
                victim.expire("evicted")
        if len(self.live) >= self.cap:
            self.stats["refused"] += 1
            self.log.event("connection limit reached", f"{self.cap} open, all running requests; "
                                                     "answering 503 to new clients")
            return False
        self.stats["accepted"] += 1
        self.live[conn] = None
        return True

    def forget(self, conn: Connection) -> None:
        self.live.pop(conn, None)

    def _oldest_waiting(self) -> Connection | None:
        waiting = [c for c in self.live if c.phase in ("idle", "head")]
        return min(waiting, key=lambda c: c.since) if waiting else None

    # -- deadlines --------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
        self.log.flush()

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                self.sweep()
            except Exception as e:           # never let the sweep die
                self.log.event(f"connection sweep: {type(e).__name__}", str(e))

    def sweep(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        lim = self.limits
        for conn in list(self.live):
            age = now - conn.since
            if conn.phase == "idle" and age > lim.timeout_keep_alive:
                self.stats["idle_closed"] += 1
                self.forget(conn)
                conn.expire("idle")
            elif conn.phase == "head" and age > lim.timeout_headers:
                self.stats["header_timeouts"] += 1
                self.log.event("request headers timed out", f"no complete request head within "
                                                            f"{lim.timeout_headers:g} s; answered 408")
                self.forget(conn)
                conn.expire("headers", json_error_bytes(
                    408, "Request Timeout", f"the request line and headers did not arrive within "
                    f"{lim.timeout_headers:g} s", "request_timeout", "invalid_request_error"))
            elif conn.phase == "body" and age > lim.timeout_body + 1.0:
                self.stats["body_timeouts"] += 1
                self.forget(conn)
                conn.expire("body")

    def close_waiting(self) -> int:
        """Shutdown: close every connection that is not running a request; returns how many."""
        n = 0
        for conn in list(self.live):
            if conn.phase != "busy":
                self.forget(conn)
                conn.expire("shutdown")
                n += 1
        return n

    def snapshot(self) -> dict:
        phases: dict[str, int] = {}
        for c in self.live:
            phases[c.phase] = phases.get(c.phase, 0) + 1
        return {"open": len(self.live), "cap": self.cap, "phases": phases, **self.stats}


class _GuardedServer(web.Server):
    """aiohttp's low-level server whose connections are :class:`Connection`\\ s of one guard."""

    guard: ConnectionGuard

    def __call__(self) -> Connection:
        return Connection(self.guard, self, loop=self._loop, **self._kwargs)


class GuardedAppRunner(web.AppRunner):
    """An AppRunner whose server makes :class:`Connection`\\ s; aiohttp's own keep-alive timer is only a
    backstop behind the guard's deadlines."""

    def __init__(self, app: web.Application, guard: ConnectionGuard, **kwargs):
        lim = guard.limits
        kwargs.setdefault("keepalive_timeout", lim.timeout_keep_alive + lim.timeout_headers + 5.0)
        kwargs.setdefault("lingering_time", lim.lingering_s)
        super().__init__(app, **kwargs)
        self.guard = guard

    async def _make_server(self):
        server = await super()._make_server()
        server.__class__ = _GuardedServer
        server.guard = self.guard
        return server
