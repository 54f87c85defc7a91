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
``POST /cancel``          ``{"request_id", "cancel_token"}`` → 200 ``{"cancelled": true}`` / 404
``GET  /health``          200 with the worker's state, 503 while starting, unhealthy or closed
``GET  /config``          model identity, engine and worker configuration (authenticated)
``GET  /metrics``         Prometheus exposition via prometheus_client (queue depth, running, KV usage, tokens,
                          requests by finish reason, TTFT/ITL/e2e histograms; docs/METRICS.md)
``POST /v1/completions``  OpenAI-compatible; stream (SSE ``data: {...}`` ... ``data: [DONE]``) or JSON
``POST /v1/chat/completions``  the same through the chat template
``GET  /v1/models``       the one served model
========================  ======================================================================

Errors are JSON ``{"error": {"message", "type", "param", "code"}}`` on every route (also for what
aiohttp's parser refuses): 400 bad input, 401 no or wrong API key, 403 a refused Origin, 404 unknown
route/model/request, 405 wrong method, 408 a request that did not arrive in time, 413 body too large
(before ``100 Continue``), 414/431 request line or headers too large, 415 a body that is not
``application/json``, 429 queue full and 503 not accepting work (both with ``Retry-After``). A 500
means a bug or an engine fault, never bad input.

Who may do what:

- ``--api-key`` (vLLM's flag; also ``$LABKIT_API_KEY``): every route but ``/health`` needs
  ``Authorization: Bearer KEY``.
- Browsers: a request with an ``Origin`` outside ``--allowed-origins`` (default: none) is refused,
  and POST bodies must be ``application/json``, so a web page cannot drive a local server.
- Request ids the server makes are random; every answer to a generation carries ``X-Request-Id``
  and ``X-Cancel-Token``, and ``/cancel`` needs both: only the client that sent a request can cancel it.
- ``/health`` says whether the server is up, what it serves (the served model name, kind, device,
  max_model_len) and its load; the model path and the engine and worker configuration are on
  ``GET /config``, which needs the API key (without one: only from this machine).

Connections are timed and counted by :mod:`labkit.service.connections` (timeouts per phase, a cap
with eviction of idle clients, a quiet log).

Why one file of this length: the native and the OpenAI routes share the submit, stream and error
paths, and keeping them together is what keeps the two APIs' answers the same.
"""
from __future__ import annotations

import asyncio
import errno
import functools
import hmac
import ipaddress
import json
import os
from json.encoder import encode_basestring
import secrets
import socket
import sys
import threading
import time
import dataclasses
import hashlib
import logging
from dataclasses import dataclass
from typing import Any, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from engine import RequestError
from labkit.errors import UserError
from labkit.service import protocol
from labkit.service.connections import Connection, ConnectionGuard, ConnectionLimits, GuardedAppRunner, QuietLog
from labkit.service.protocol import ApiError, GenRequest, Limits
from labkit.service.stops import StopStrings
from labkit.service.stream import RequestHandle
from labkit.service.worker import DuplicateRequest, Worker, WorkerUnavailable

ACCESS_LOG = logging.getLogger("labkit.access")      # one line per generation request (vLLM's habit)
STATS_LOG = logging.getLogger("labkit.stats")        # one line per interval while busy
STATS_INTERVAL_S = 10.0
POLL_S = 0.5          # how often a waiting handler checks that its client is still there
API_KEY_ENV = "LABKIT_API_KEY"
RETRY_AFTER_S = "1"
LISTEN_QUEUE = 1024
JSON_TYPES = ("application/json",)
BODY_ENCODINGS = ("", "identity", "gzip", "deflate")


@dataclass
class Access:
    """Who may use the server: an optional API key and the browser origins allowed to call it."""
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()

    @classmethod
    def make(cls, api_key: str | None = None, allowed_origins=None) -> "Access":
        key = api_key if api_key is not None else (os.environ.get(API_KEY_ENV) or None)
        if key is not None and (not key.strip() or any(c.isspace() for c in key)):
            raise UserError("--api-key must be a non-empty string without spaces")
        if isinstance(allowed_origins, str):
            allowed_origins = allowed_origins.split(",")
        origins = tuple(o.strip().rstrip("/") for o in (allowed_origins or ()) if o.strip())
        return cls(key, origins)

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.allowed_origins or origin.rstrip("/") in self.allowed_origins

    def key_ok(self, header: str | None) -> bool:
        if self.api_key is None:
            return True
        scheme, _, given = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.api_key.encode())


# --------------------------------------------------------------------------- text


@functools.lru_cache(maxsize=8)
def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """``tokenizer.decode(ids, skip_special_tokens=True)`` as a function. For a fast tokenizer without space
    clean-up that is its Rust tokenizer's decode under a Python layer that costs about twice the decode;
    that decode is used directly once it gave the same text on a probe set (every special id, ids across
    the vocabulary, split multi-byte characters), else the tokenizer's own."""
    def full(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "decode") or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return full

    def fast(ids: list[int]) -> str:
        return backend.decode(ids, skip_special_tokens=True)

    size = len(tokenizer)
    specials = list(getattr(tokenizer, "all_special_ids", []) or [])
    spread = [(i * 7919 + 13) % size for i in range(256)]
    probes = [[t] for t in specials + spread] + [spread[i:i + 5] for i in range(0, 256, 5)] \
        + [specials + spread[:8], tokenizer.encode("héllo wörld ✓ 你好 🙂 \n\t x")]
    probes += [p[:k] for p in probes[-1:] for k in range(1, len(p))]
    try:
        same = all(fast(p) == full(p) for p in probes)
    except Exception:
        same = False
    return fast if same else full


class IncrementalText:
    """Turns a growing list of token ids into text pieces without splitting a UTF-8 character.

    The window ids[prefix:] after a clean boundary is decoded once per token and compared with the text
    it had when last emitted (kept, not decoded again); a piece that ends in the replacement character
    (an incomplete multi-byte sequence) is held back until the next token. Once the window is longer
    than ``WINDOW`` ids it restarts at the previous emit boundary (one more decode then), so a decode
    never covers more than about WINDOW ids and always keeps one emitted piece of left context.
    """

    WINDOW = 8

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0          # ids[:prefix] are settled text
        self.read = 0            # ids[:read] have been emitted
        self._seen = ""          # the text of ids[prefix:read]
        self._decoder = text_decoder(tokenizer) if tokenizer is not None else None

    def _decode(self, ids: list[int]) -> str:
        return self._decoder(ids) if ids else ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self.tokenizer is None:
            return ""
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(self._seen) and not after.endswith("\ufffd"):
            piece = after[len(self._seen):]
            last, self.read = self.read, len(self.ids)
            if self.read - self.prefix > self.WINDOW:
                self.prefix = last
                self._seen = self._decode(self.ids[last:self.read])
            else:
                self._seen = after
            return piece
        return ""

    def flush(self) -> str:
        """At the end of the output: what push() held back (an incomplete character decodes as U+FFFD)."""
        if self.tokenizer is None or self.read == len(self.ids):
            return ""
        before = self._seen
        after = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        self._seen = ""
        return after[len(before):] if after.startswith(before) else after

    def text(self) -> str:
        return self._decode(self.ids) if self.tokenizer is not None else ""


# --------------------------------------------------------------------------- helpers


def error_response(err: ApiError, **extra) -> web.Response:
    resp = web.json_response(err.body(**extra), status=err.status, headers=err.headers or None)
    if err.close:
        resp.force_close()
    return resp


def _disconnected(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _conn(request: web.Request) -> Connection | None:
    proto = request.protocol
    return proto if isinstance(proto, Connection) else None


_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)   # built once, not per event


def _dumps(obj: Any) -> bytes:
    """One JSON document as UTF-8; whatever cannot be UTF-8 (it should never get here) is escaped, not a crash."""
    try:
        return _JSON.encode(obj).encode("utf-8")
    except (UnicodeEncodeError, ValueError):
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=True, default=str).encode("ascii")


_SENTINEL = "\x00"                       # a piece no token text is: its JSON marks where a chunk's text goes
_SENTINEL_JSON = _dumps(_SENTINEL)


def _is_loopback(request: web.Request) -> bool:
    try:
        return ipaddress.ip_address((request.remote or "").split("%")[0]).is_loopback
    except ValueError:
        return False


def _finish_reason_openai(finished: dict) -> str:
    reason = finished.get("reason")
    return reason if reason in ("stop", "length") else "abort"


class ClientGone(Exception):
    pass


# --------------------------------------------------------------------------- the app


class Service:
    """Routes over one Worker."""

    def __init__(self, worker: Worker, served_model_name: str | None = None, max_body_bytes: int = 1 << 20, *,
                 access: Access | None = None, connections: ConnectionLimits | None = None,
                 log: QuietLog | None = None):
        self.worker = worker
        model = (worker.built.model or {}) if worker.built else {}
        name = served_model_name or model.get("preset") or _basename(model.get("path")) or "model"
        cfg = worker.engine.config
        if not isinstance(max_body_bytes, int) or isinstance(max_body_bytes, bool) or max_body_bytes < 1024:
            raise UserError(f"--max-body-bytes must be an integer of at least 1024, got {max_body_bytes!r}")
        self.limits = Limits(cfg.max_model_len, cfg.vocab_size, name, max_body_bytes)
        self.access = access or Access.make()
        self.connections = connections or ConnectionLimits()
        self.connections.check()
        self.log = log or QuietLog()
        self.created = int(time.time())
        ident = json.dumps([name, model, worker.built.describe() if worker.built else None], sort_keys=True,
                           default=str)
        self.system_fingerprint = "fp_" + hashlib.sha256(ident.encode()).hexdigest()[:12]
        self._cancel_tokens: dict[str, str] = {}          # live HTTP requests: request id -> cancel token

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.limits.max_body_bytes, middlewares=[self._errors])
        expect = self._expect
        app.router.add_post("/generate", self.generate, expect_handler=expect)
        app.router.add_post("/cancel", self.cancel, expect_handler=expect)
        app.router.add_get("/health", self.health)
        app.router.add_get("/config", self.config)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.completions, expect_handler=expect)
        app.router.add_post("/v1/chat/completions", self.chat, expect_handler=expect)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model_id:.+}", self.model)
        return app

    # -- before any handler ----------------------------------------------------------------
    def _precheck(self, request: web.Request) -> None:
        """Origin, API key, and for a POST route its body's type, encoding and declared size: refused here,
        before a byte of the body is read (and before ``100 Continue``)."""
        origin = request.headers.get("Origin")
        if origin is not None and not self.access.origin_allowed(origin):
            raise ApiError(403, f"requests from the web origin {protocol._show(origin)} are not allowed "
                                "(start the server with --allowed-origins to allow it)", "origin_not_allowed",
                           "Origin", close=True)
        if request.path != "/health" and not self.access.key_ok(request.headers.get("Authorization")):
            raise ApiError(401, "this server needs an API key: send Authorization: Bearer <key>", "invalid_api_key",
                           "Authorization", headers={"WWW-Authenticate": "Bearer"}, close=True)
        matched = getattr(request.match_info, "http_exception", None) is None
        if request.method != "POST" or not matched:
            return
        ctype = request.headers.get("Content-Type", "")
        if ctype.split(";", 1)[0].strip().lower() not in JSON_TYPES:
            raise ApiError(415, f"the body must be application/json, got Content-Type {protocol._show(ctype or None)}",
                           "unsupported_media_type", "Content-Type", close=True)
        encoding = request.headers.get("Content-Encoding", "").strip().lower()
        if encoding not in BODY_ENCODINGS:
            raise ApiError(415, f"Content-Encoding {protocol._show(encoding)} is not supported (send identity, gzip "
                                "or deflate)", "unsupported_content_encoding", "Content-Encoding", close=True)
        limit = self.limits.max_body_bytes
        length = request.content_length
        if length is not None and length > limit:
            raise ApiError(413, f"request body of {length} bytes exceeds the limit of {limit} bytes", "body_too_large",
                           close=True)

    async def _expect(self, request: web.Request) -> web.StreamResponse | None:
        """``Expect: 100-continue``: the checks first; only a request that passes them is invited to send its body."""
        conn = _conn(request)
        if conn is not None:
            conn.enter("busy")
        try:
            self._precheck(request)
        except ApiError as e:
            resp = self._cors(request, error_response(e))
            resp.force_close()
            if conn is not None:
                conn.enter("idle")
            return resp
        expect = request.headers.get("Expect", "")
        if expect.lower() != "100-continue":
            resp = error_response(ApiError(417, f"unsupported Expect: {protocol._show(expect)}", "expectation_failed",
                                           "Expect", close=True))
            if conn is not None:
                conn.enter("idle")
            return resp
        if request.version >= (1, 1):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return None

    def _cors(self, request: web.Request, resp: web.StreamResponse) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        if origin is not None and self.access.origin_allowed(origin) and not resp.prepared:
            resp.headers["Access-Control-Allow-Origin"] = origin
            resp.headers["Vary"] = "Origin"
            resp.headers["Access-Control-Expose-Headers"] = "X-Request-Id, X-Cancel-Token, X-Worker-Id"
        return resp

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable):
        conn = _conn(request)
        if conn is not None:
            conn.enter("body" if request.method == "POST" else "busy")
        try:
            return self._cors(request, await self._handle(request, handler))
        finally:
            if conn is not None:
                conn.enter("idle")

    async def _handle(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        try:
            if request.method == "OPTIONS" and request.headers.get("Origin") and \
                    request.headers.get("Access-Control-Request-Method"):
                return self._preflight(request)
            self._precheck(request)
            return await handler(request)
        except ApiError as e:
            return error_response(e)
        except ClientGone:
            return web.Response(status=499)       # nobody is listening any more
        except web.HTTPRequestEntityTooLarge:
            return error_response(ApiError(413, f"request body exceeds the limit of {self.limits.max_body_bytes} bytes",
                                           "body_too_large", close=True))
        except web.HTTPException as e:
            if e.status < 400:
                raise
            code = {404: "not_found", 405: "method_not_allowed"}.get(e.status, "http_error")
            text = f"{request.method} {protocol._show(request.path)}: {e.reason}"
            return error_response(ApiError(e.status, text, code, headers={k: v for k, v in e.headers.items()
                                                                          if k == "Allow"}))

    def _preflight(self, request: web.Request) -> web.Response:
        origin = request.headers["Origin"]
        if not self.access.origin_allowed(origin):
            raise ApiError(403, f"requests from the web origin {protocol._show(origin)} are not allowed "
                                "(start the server with --allowed-origins to allow it)", "origin_not_allowed", "Origin")
        return web.Response(status=204, headers={
            "Access-Control-Allow-Origin": origin, "Vary": "Origin", "Access-Control-Max-Age": "600",
            "Access-Control-Allow-Methods": "GET, POST",
            "Access-Control-Allow-Headers": "Authorization, Content-Type"})

    async def _read_json(self, request: web.Request) -> Any:
        """The body (read under its deadline, within the size limit) as strict JSON."""
        limit = self.limits.max_body_bytes
        timeout = self.connections.timeout_body
        conn = _conn(request)
        if conn is not None:
            conn.enter("body")
        try:
            raw = await asyncio.wait_for(request.read(), timeout)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {timeout:g} s", "request_timeout",
                           close=True) from None
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes", "body_too_large",
                           close=True) from None
        except HttpProcessingError as e:
            err = protocol.parser_error(400, e, None)
            err.close = True
            raise err from None
        except web.RequestPayloadError as e:          # the parser could not decode the body
            text = " ".join(str(e).split())[:200]
            if "content-encoding" in text.lower():
                raise ApiError(400, f"the body does not match its Content-Encoding ({text})",
                               "invalid_content_encoding", "Content-Encoding", close=True) from None
            raise ApiError(400, f"the request body could not be read ({text})", "invalid_body", close=True) from None
        except (ConnectionError, asyncio.IncompleteReadError):
            raise ClientGone() from None
        finally:
            if conn is not None:
                conn.enter("busy")
        if len(raw) > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes", "body_too_large")
        return protocol.loads_strict(raw)

    # -- submission ---------------------------------------------------------------
    async def _submit(self, req: GenRequest, prefill_after: str | None = None) -> RequestHandle:
        def call() -> RequestHandle:
            return self.worker.submit(req.prompt, req.params, request_id=req.request_id, tags=req.tags,
                                      fill_context=req.fill_context, stop_token_ids=req.stop_token_ids,
                                      prefill_after=prefill_after)

        try:
            if isinstance(req.prompt, list) and (not req.prompt or isinstance(req.prompt[0], int)):
                handle = call()               # token ids: no tokenizer work, keep arrival order
            else:
                handle = await asyncio.get_running_loop().run_in_executor(None, call)
        except RequestError as e:
            param = {"invalid_request_id": "request_id", "invalid_tags": "tags",
                     "invalid_sampling_params": None}.get(e.code, protocol.param_of(e.code) or _prompt_param(req))
            raise ApiError(400, str(e), e.code, param) from None
        except DuplicateRequest as e:
            raise ApiError(400, str(e), "duplicate_request_id", "request_id") from None
        except WorkerUnavailable as e:
            raise ApiError(503, str(e), "unavailable", headers={"Retry-After": RETRY_AFTER_S}) from None
        if handle.rejected:
            msg = (handle.result or {}).get("message", "queue full")
            raise ApiError(429, f"request {handle.request_id} rejected: {msg}; retry later", "queue_full",
                           headers={"Retry-After": RETRY_AFTER_S})
        self._cancel_tokens[handle.request_id] = secrets.token_urlsafe(18)
        return handle

    def _headers(self, handle: RequestHandle, **extra: str) -> dict[str, str]:
        return {"X-Request-Id": handle.request_id, "X-Cancel-Token": self._cancel_tokens.get(handle.request_id, ""),
                "X-Worker-Id": self.worker.worker_id, **extra}

    async def _batches(self, handle: RequestHandle, request: web.Request):
        """The handle's events until finished, as the lists one wake-up brings (the last ends with the
        finished event); ClientGone when the client went away meanwhile."""
        while True:
            batch = await handle.aget(POLL_S)
            if not batch:
                if handle.finished and handle.buffered == 0:
                    return
                if _disconnected(request):
                    raise ClientGone()
                continue
            for i, ev in enumerate(batch):
                if ev["event"] == "finished":
                    yield batch[:i + 1]
                    return
            yield batch

    async def _events(self, handle: RequestHandle, request: web.Request):
        """The handle's events until finished, one by one."""
        async for batch in self._batches(handle, request):
            for ev in batch:
                yield ev

    def _abandon(self, handle: RequestHandle | None) -> None:
        if handle is None:
            return
        self._cancel_tokens.pop(handle.request_id, None)
        if not handle.finished:
            self.worker.cancel(handle.request_id, cause="disconnect")

    # -- native --------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        req = protocol.parse_native(await self._read_json(request), self.limits)
        handle = await self._submit(req)
        text = IncrementalText(self.worker.tokenizer if req.detokenize else None)
        if not req.stream:
            return await self._collect_native(handle, request, text)
        resp = web.StreamResponse(headers=self._headers(handle, **{"Content-Type": "application/x-ndjson",
                                                                   "Cache-Control": "no-cache"}))
        self._cors(request, resp)
        try:
            await resp.prepare(request)
            async for batch in self._batches(handle, request):
                lines = []
                for ev in batch:
                    if ev["event"] == "token" and req.detokenize:
                        ev = {**ev, "text": text.push(ev["token_id"])}
                    lines.append(_dumps(ev))
                lines.append(b"")
                await resp.write(b"\n".join(lines))      # one write per wake-up, not one per event
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
        body = {"request_id": handle.request_id, "token_ids": text.ids, "text": text.text(), "finished": fin,
                "events": events}
        return web.Response(body=_dumps(body), content_type="application/json",
                            headers={"X-Request-Id": handle.request_id, "X-Worker-Id": self.worker.worker_id})

    async def cancel(self, request: web.Request) -> web.Response:
        rid, token = protocol.parse_cancel(await self._read_json(request))
        if token is None:
            raise ApiError(400, "cancel_token is required: send the X-Cancel-Token of the request's answer",
                           "missing_cancel_token", "cancel_token")
        known = self._cancel_tokens.get(rid)
        if known is None or not hmac.compare_digest(known.encode(), token.encode()) \
                or not self.worker.cancel(rid, cause="client"):
            raise ApiError(404, f"no request {rid!r} in flight that this cancel token controls (unknown, finished, "
                                "or another client's)", "request_not_found", "request_id")
        return web.json_response({"request_id": rid, "cancelled": True})

    async def health(self, request: web.Request) -> web.Response:
        """Up or not, what is served and the load: nothing that names a path or the configuration."""
        snap = self.worker.snapshot()
        built = self.worker.built
        keep = ("worker_id", "round", "queue_depth", "active", "engine_waiting", "engine_running",
                "kv_blocks_total", "kv_blocks_free", "kv_blocks_used")
        body = {"status": snap["state"], "state": snap["state"], **{k: snap[k] for k in keep if k in snap},
                "kind": built.kind if built else None, "device": built.device if built else None,
                "served_model_name": self.limits.served_model_name, "max_model_len": self.limits.max_model_len}
        if snap["state"] != "ok":
            body["reason"] = _redact(snap.get("reason") or "", built)
        return web.json_response(body, status=200 if snap["state"] == "ok" else 503)

    async def config(self, request: web.Request) -> web.Response:
        """The model identity (with its path), engine and worker configuration: with the API key, or from this
        machine when the server has none."""
        if self.access.api_key is None and not _is_loopback(request):
            raise ApiError(403, "/config is only served to this machine unless the server has an --api-key",
                           "forbidden")
        built = self.worker.built
        body = {"served_model_name": self.limits.served_model_name, "max_model_len": self.limits.max_model_len,
                "kind": built.kind if built else None, "device": built.device if built else None,
                "model": built.model if built else None, "engine": built.describe() if built else None,
                "worker": vars(self.worker.config), "max_body_bytes": self.limits.max_body_bytes,
                "connections": vars(self.connections)}
        return web.Response(body=_dumps(body), content_type="application/json")

    async def metrics(self, request: web.Request) -> web.Response:
        body, content_type = self.worker.stats.render(self.worker.gauges(), request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})

    def _model_card(self) -> dict:
        return {"id": self.limits.served_model_name, "object": "model", "created": self.created,
                "owned_by": "nano-lab", "root": self.limits.served_model_name, "parent": None,
                "max_model_len": self.limits.max_model_len}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{id}``: the served model, or a 404 error object."""
        model_id = request.match_info["model_id"]
        if model_id != self.limits.served_model_name:
            raise ApiError(404, f"the model {protocol._show(model_id)} does not exist; this server serves "
                                f"{self.limits.served_model_name!r}", "model_not_found", "model")
        return web.json_response(self._model_card())

    def _access(self, api: str, request_id: str, status: int, choices: list, t0: float) -> None:
        """The access log line of one generation request: id, status, tokens in and out, TTFT, total time."""
        if not ACCESS_LOG.isEnabledFor(logging.INFO):
            return
        prompt = sum(c.prompt_tokens for c in choices)
        out = sum(c.completion_tokens or c.tokens for c in choices)
        ttfts = [c.ttft for c in choices if c.ttft is not None]
        ttft = f"{min(ttfts) * 1e3:.1f}ms" if ttfts else "-"
        finish = ",".join(str(c.finish or "-") for c in choices)
        ACCESS_LOG.info("%s %s status=%d prompt_tokens=%d output_tokens=%d ttft=%s total=%.1fms finish=%s",
                        api, request_id, status, prompt, out, ttft, (time.monotonic() - t0) * 1e3, finish)

    # -- OpenAI-compatible ---------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai_route(request, protocol.parse_completion, "completions")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._openai_route(request, protocol.parse_chat, "chat")

    async def _openai_route(self, request: web.Request, parse: Callable, api: str) -> web.StreamResponse:
        t0 = time.monotonic()
        try:
            req = parse(await self._read_json(request), self.limits)
        except ApiError as e:          # refused before it became a request: still one access line
            if ACCESS_LOG.isEnabledFor(logging.INFO):
                ACCESS_LOG.info("%s - status=%d total=%.1fms error=%s param=%s", api, e.status,
                                (time.monotonic() - t0) * 1e3, e.code, e.param)
            raise
        return await self._openai(req, request)

    async def _submit_all(self, req: GenRequest) -> list[RequestHandle]:
        """One worker request per prompt (a list of prompts in /v1/completions) and sample (n); all or none.
        Choice prompt_i * n + j is prompt i's sample j: seed + j when a seed is given, and it waits for
        sample 0's prefill so that it reuses the prompt's full KV blocks through the prefix cache."""
        prompts = req.prompts or [req.prompt]
        handles: list[RequestHandle] = []
        try:
            for i, prompt in enumerate(prompts):
                for j in range(req.n):
                    k = i * req.n + j
                    rid = req.request_id if k == 0 or req.request_id is None else f"{req.request_id}-{k}"
                    params = req.params
                    if j:
                        params = dataclasses.replace(params, prompt_logprobs=None,
                                                     seed=None if params.seed is None else params.seed + j)
                    one = dataclasses.replace(req, prompt=prompt, request_id=rid, prompts=None, params=params)
                    try:
                        handles.append(await self._submit(one, handles[-1].request_id if j else None))
                    except ApiError as e:
                        if len(prompts) > 1 and e.param == "prompt":
                            e.param = f"prompt[{i}]"
                        raise
        except BaseException:
            for h in handles:
                self._abandon(h)
            raise
        return handles

    def _echo(self, prompt: Any, prompt_logprobs: list | None, fmt: "LogprobsFormat | None",
              c: "_Choice") -> tuple[str, list]:
        """completions echo: the prompt's text, and with logprobs its tokens (the first has no log-prob)."""
        tok = self.worker.tokenizer
        text = prompt if isinstance(prompt, str) else tok.decode(prompt, skip_special_tokens=True)
        if fmt is None or prompt_logprobs is None:
            c.text_offset += len(text)
            return text, []
        ids = self.worker.encode(prompt)
        items = [fmt.item(entry, c, token_id=t) for t, entry in zip(ids, prompt_logprobs)]
        return text, items

    async def _openai(self, req: GenRequest, request: web.Request) -> web.StreamResponse:
        handles = await self._submit_all(req)
        chat = req.api == "chat"
        oid = f"{'chatcmpl' if chat else 'cmpl'}-{handles[0].request_id}"
        created = int(time.time())
        model = self.limits.served_model_name
        fingerprint = self.system_fingerprint
        choices = [_Choice(i, h, IncrementalText(self.worker.tokenizer), StopStrings(req.stop,
                                                                                     req.include_stop_str_in_output))
                   for i, h in enumerate(handles)]
        fmt = LogprobsFormat(self.worker.tokenizer, chat) if req.logprobs is not None else None
        prompts = req.prompts or [req.prompt]
        # echo with logprobs: sample 0 of each prompt carries the prompt's log-probs; its siblings wait for them
        prompt_lps: dict[int, list | None] = {}
        prompt_lps_ready = {i: asyncio.Event() for i in range(len(prompts))}
        t0 = time.monotonic()

        async def echo_logprobs(c: _Choice, ev: dict | None) -> list | None:
            i, j = divmod(c.index, req.n)
            if j == 0:
                prompt_lps[i] = (ev or {}).get("prompt_logprobs")
                prompt_lps_ready[i].set()
            else:
                await prompt_lps_ready[i].wait()
            return prompt_lps.get(i)

        def chunk(index: int, piece: str | None, finish: str | None, first: bool = False,
                  logprobs: list | None = None) -> dict:
            lp = fmt.obj(logprobs) if fmt is not None and logprobs else None
            if chat:
                delta: dict = {}
                if first:
                    delta["role"] = "assistant"
                if piece is not None:
                    delta["content"] = piece
                choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
                body = {"id": oid, "object": "chat.completion.chunk", "created": created, "model": model,
                        "system_fingerprint": fingerprint, "choices": [choice]}
            else:
                body = {"id": oid, "object": "text_completion", "created": created, "model": model,
                        "system_fingerprint": fingerprint,
                        "choices": [{"index": index, "text": piece or "", "logprobs": lp, "finish_reason": finish}]}
            if req.include_usage:
                body["usage"] = None
            return body

        heads: dict[int, tuple[bytes, bytes] | None] = {}

        def token_chunk(index: int, piece: str, logprobs: list | None) -> bytes:
            """chunk(index, piece, None) as _dumps writes it; without log-probs from a per-choice template
            (the JSON around the piece, made once), the piece's JSON string set in."""
            if not (fmt is not None and logprobs):
                if index not in heads:
                    parts = _dumps(chunk(index, _SENTINEL, None)).split(_SENTINEL_JSON)
                    heads[index] = (parts[0], parts[1]) if len(parts) == 2 else None
                head = heads[index]
                if head is not None:
                    try:
                        return head[0] + encode_basestring(piece).encode("utf-8") + head[1]
                    except UnicodeEncodeError:
                        pass
            return _dumps(chunk(index, piece, None, logprobs=logprobs))

        def usage() -> dict:
            p = sum(c.prompt_tokens for c in choices if c.index % req.n == 0)     # a prompt counts once (n > 1)
            n = sum(c.completion_tokens for c in choices)
            return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}

        async def consume(c: _Choice, emit: Callable | None, flush: Callable | None = None) -> None:
            """One choice's events: text through the stop strings to ``emit(index, text)`` (streams), and
            ``flush()`` after each wake-up's batch (one write for the batch's chunks)."""
            async for batch in self._batches(c.handle, request):
                if await consume_batch(c, batch, emit):
                    return
                if flush is not None:
                    await flush()

        async def consume_batch(c: _Choice, batch: list[dict], emit: Callable | None) -> bool:
            """True once the choice is done (finished, error, or a stop string matched)."""
            for ev in batch:
                kind = ev["event"]
                if kind == "submitted":
                    c.prompt_tokens = ev.get("prompt_tokens", 0)
                elif kind == "token":
                    c.tokens += 1
                    if c.ttft is None:
                        c.ttft = time.monotonic() - t0
                        if req.echo:                # the prompt (and its log-probs) before the first token
                            text, items = self._echo(prompts[c.index // req.n], await echo_logprobs(c, ev), fmt, c)
                            c.pieces.append(text)
                            c.lp_items += items
                            if emit is not None:
                                emit(c.index, text, items)
                    out = c.stops.push(c.text.push(ev["token_id"]))
                    c.pieces.append(out)
                    items = [fmt.item(ev["logprob"], c)] if fmt is not None and "logprob" in ev else []
                    c.lp_items += items
                    if emit is not None:            # one chunk per token (load clients time them), maybe ""
                        emit(c.index, out, items)
                    if c.stops.matched is not None:          # the reader found the end: finish it as "stop"
                        self.worker.cancel(c.handle.request_id, cause="stop_string", reason="stop")
                        c.finish, c.completion_tokens = "stop", c.tokens
                        return True
                elif kind == "finished":
                    if req.echo and c.index % req.n == 0:
                        prompt_lps_ready[c.index // req.n].set()       # no token came: siblings stop waiting
                    c.result = ev
                    if ev.get("reason") == "error":
                        c.error = ev.get("message") or "engine error"
                        return True
                    c.tail = c.stops.push(c.text.flush()) + c.stops.flush()    # sent with the finish chunk
                    c.pieces.append(c.tail)
                    c.finish = _finish_reason_openai(ev)
                    c.completion_tokens = ev.get("num_completion_tokens", c.tokens)
                    c.prompt_tokens = ev.get("num_prompt_tokens", c.prompt_tokens)
                    return True
            return False

        async def run_all(emit: Callable | None) -> None:
            tasks = [asyncio.ensure_future(consume(c, emit)) for c in choices]
            try:
                await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()

        status = 200
        try:
            if not req.stream:
                try:
                    await run_all(None)
                finally:
                    for c in choices:
                        self._abandon(c.handle)
                for c in choices:
                    if c.error is not None:
                        status = 500
                        raise ApiError(500, f"the engine failed on this request: {c.error}", "engine_error")
                    if (c.result or {}).get("reason") == "cancelled" and (c.result or {}).get("cause") == "shutdown":
                        status = 503
                        raise ApiError(503, "the server shut down before the request finished", "shutdown")
                out_choices = []
                for c in choices:
                    text = "".join(c.pieces)
                    lp = fmt.obj(c.lp_items) if fmt is not None else None
                    if chat:
                        out_choices.append({"index": c.index, "message": {"role": "assistant", "content": text},
                                            "logprobs": lp, "finish_reason": c.finish})
                    else:
                        out_choices.append({"index": c.index, "text": text, "logprobs": lp,
                                            "finish_reason": c.finish})
                body = {"id": oid, "object": "chat.completion" if chat else "text_completion", "created": created,
                        "model": model, "system_fingerprint": fingerprint, "choices": out_choices, "usage": usage()}
                return web.Response(body=_dumps(body), content_type="application/json",
                                    headers={"X-Request-Id": handles[0].request_id,
                                             "X-Worker-Id": self.worker.worker_id})

            resp = web.StreamResponse(headers=self._headers(handles[0], **{"Content-Type": "text/event-stream",
                                                                           "Cache-Control": "no-cache"}))
            self._cors(request, resp)
            lock = asyncio.Lock()
            pending: list[bytes] = []           # SSE events not yet written, in order

            async def flush() -> None:
                async with lock:
                    if pending:
                        data = b"".join(pending)
                        pending.clear()
                        await resp.write(data)

            async def send(obj: Any) -> None:
                data = obj.encode() if isinstance(obj, str) else _dumps(obj)
                pending.append(b"data: " + data + b"\n\n")
                await flush()

            def emit(index: int, piece: str, logprobs: list | None = None) -> None:
                pending.append(b"data: " + token_chunk(index, piece, logprobs) + b"\n\n")

            async def consume_and_finish(c: _Choice) -> None:
                await consume(c, emit, flush)
                await flush()
                if c.error is not None:
                    await send({"error": ApiError(500, f"the engine failed on this request: {c.error}",
                                                  "engine_error").body()["error"]})
                elif c.finish is not None:
                    await send(chunk(c.index, c.tail or (None if chat else ""), c.finish))

            try:
                await resp.prepare(request)
                if chat:
                    for c in choices:
                        await send(chunk(c.index, "", None, first=True))
                tasks = [asyncio.ensure_future(consume_and_finish(c)) for c in choices]
                try:
                    await asyncio.gather(*tasks)
                finally:
                    for t in tasks:
                        t.cancel()
                if req.include_usage and all(c.finish is not None for c in choices):
                    body = chunk(0, None, None)
                    body["choices"] = []
                    body["usage"] = usage()
                    await send(body)
                await send("[DONE]")
                await resp.write_eof()
            except (ClientGone, ConnectionError):
                status = 499
            finally:
                for c in choices:
                    self._abandon(c.handle)
            return resp
        except ApiError as e:
            status = e.status
            raise
        except ClientGone:
            status = 499
            raise
        finally:
            self._access(req.api, handles[0].request_id, status, choices, t0)


@dataclass
class _Choice:
    """One prompt's request inside an OpenAI answer."""
    index: int
    handle: RequestHandle
    text: IncrementalText
    stops: StopStrings
    pieces: list = dataclasses.field(default_factory=list)
    tokens: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish: str | None = None
    error: str | None = None
    result: dict | None = None
    ttft: float | None = None
    tail: str = ""
    lp_items: list = dataclasses.field(default_factory=list)   # per-token log-prob items (LogprobsFormat.item)
    text_offset: int = 0                                       # completions: where the next token's text starts


class LogprobsFormat:
    """Token log-probs (the worker's ``[id, log-prob, rank, [[id, log-prob], ...]]``) in OpenAI's shapes:
    completions ``{tokens, token_logprobs, top_logprobs, text_offset}`` (top_logprobs maps token text to
    log-prob, the chosen token included, as vLLM), chat ``{content: [{token, logprob, bytes,
    top_logprobs: [{token, logprob, bytes}]}]}``. A token's text is its own decode; -inf (a token a
    processor removed, processed_logprobs only) is sent as -9999.0, as vLLM does."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer = tokenizer
        self.chat = chat

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    @staticmethod
    def _num(v: float | None) -> float | None:
        return None if v is None else max(float(v), -9999.0)

    def item(self, entry: list | None, c: "_Choice", token_id: int | None = None):
        """One token's item; entry None (the first prompt token) has no log-prob."""
        tid = entry[0] if entry is not None else token_id
        text = self._text(tid)
        if self.chat:
            return {"token": text, "logprob": self._num(entry[1]), "bytes": list(text.encode("utf-8")),
                    "top_logprobs": [{"token": (t := self._text(i)), "logprob": self._num(v),
                                      "bytes": list(t.encode("utf-8"))} for i, v in entry[3]]}
        offset = c.text_offset
        c.text_offset += len(text)
        if entry is None:
            return (text, None, None, offset)
        top = {self._text(i): self._num(v) for i, v in entry[3]}
        top.setdefault(text, self._num(entry[1]))
        return (text, self._num(entry[1]), top, offset)

    def obj(self, items: list) -> dict:
        if self.chat:
            return {"content": list(items), "refusal": None}
        return {"tokens": [i[0] for i in items], "token_logprobs": [i[1] for i in items],
                "top_logprobs": [i[2] for i in items], "text_offset": [i[3] for i in items]}


def _basename(path: str | None) -> str | None:
    if not path:
        return None
    return str(path).rstrip("/").rsplit("/", 1)[-1] or None


def _prompt_param(req: GenRequest) -> str:
    if req.api == "chat" or (isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], dict)):
        return "messages"
    if req.api == "native" and isinstance(req.prompt, list):
        return "prompt_token_ids"
    return "prompt"


def _redact(text: str, built) -> str:
    """``text`` without the model's path (an unhealthy worker's reason may quote an engine message)."""
    path = ((built.model or {}).get("path") if built else None) or ""
    text = text.replace(path, "<model>") if path else text
    home = os.path.expanduser("~")
    return text.replace(home, "~") if home and home != "/" else text


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


def _service(worker: Worker, served_model_name, max_body_bytes, api_key, allowed_origins, connections) -> Service:
    return Service(worker, served_model_name, max_body_bytes, access=Access.make(api_key, allowed_origins),
                   connections=connections)


class ServerThread:
    """A Worker's HTTP server on its own event-loop thread (tests, simulate, ``load --serve-local``).

    ``close()`` closes the worker first (open streams end with cancelled/shutdown) and then the
    server; it is idempotent and every join is bounded.
    """

    def __init__(self, worker: Worker, host: str = "127.0.0.1", port: int = 0, *, served_model_name: str | None = None,
                 max_body_bytes: int = 1 << 20, sock: socket.socket | None = None, api_key: str | None = None,
                 allowed_origins=None, connections: ConnectionLimits | None = None):
        self.worker = worker
        self.sock = sock or bind_socket(host, port)
        self.url = url_of(self.sock)
        self._service = _service(worker, served_model_name, max_body_bytes, api_key, allowed_origins, connections)
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


class StatsLine:
    """vLLM's periodic line: prompt and generation tok/s since the last line, running, waiting, KV usage.

    Reads only the worker's counters and its published snapshot; says nothing while idle."""

    def __init__(self, worker: Worker):
        self.worker = worker
        self._last = (time.monotonic(), *self._counts())

    def _counts(self) -> tuple[int, int]:
        st = self.worker.stats
        with st.lock:
            return st.prompt_tokens, st.generation_tokens

    def line(self) -> str | None:
        t, prompt, gen = time.monotonic(), *self._counts()
        t0, prompt0, gen0 = self._last
        self._last = (t, prompt, gen)
        snap = self.worker.snapshot()
        running, waiting = snap.get("active", 0), snap.get("queue_depth", 0)
        if prompt == prompt0 and gen == gen0 and not running and not waiting:
            return None
        dt = max(t - t0, 1e-9)
        total = snap.get("kv_blocks_total") or 0
        kv = 100.0 * (snap.get("kv_blocks_used") or 0) / total if total else 0.0
        return (f"prompt throughput: {(prompt - prompt0) / dt:.1f} tokens/s, generation throughput: "
                f"{(gen - gen0) / dt:.1f} tokens/s, running: {running} reqs, waiting: {waiting} reqs, "
                f"KV cache usage: {kv:.1f}%")


async def _log_stats(worker: Worker, interval: float) -> None:
    stats = StatsLine(worker)
    while True:
        await asyncio.sleep(interval)
        text = stats.line()
        if text is not None:
            STATS_LOG.info("%s", text)


async def serve_until_signal(worker: Worker, sock: socket.socket, *, served_model_name: str | None = None,
                             max_body_bytes: int = 1 << 20, on_ready: Callable[[str], None] | None = None,
                             stop: asyncio.Event | None = None, api_key: str | None = None, allowed_origins=None,
                             connections: ConnectionLimits | None = None,
                             stats_interval: float = STATS_INTERVAL_S) -> None:
    """``labkit serve``: run until SIGINT/SIGTERM (or ``stop``), then close the worker and the server.
    While busy, a stats line every ``stats_interval`` seconds (0: none) on the ``labkit.stats`` logger.

    The worker closes first (open streams end cancelled/shutdown), then every connection that is not
    running a request is closed at once, so half-sent requests never hold up the exit."""
    import signal

    server = HttpServer(_service(worker, served_model_name, max_body_bytes, api_key, allowed_origins, connections),
                        sock)
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
    ticker = asyncio.ensure_future(_log_stats(worker, stats_interval)) if stats_interval > 0 else None
    try:
        await stop.wait()
    finally:
        if ticker is not None:
            ticker.cancel()
        server.guard.close_waiting()
        await loop.run_in_executor(None, worker.close)
        await server.stop()


#: ``labkit serve`` without options: on CUDA a server that serves (vLLM's scale: CUDA graphs, 256
#: sequences per step, a 16384-token step budget, 256 admitted requests, the model's own context
#: length as far as the KV pool holds it, overlapped decode, and the engine in a process of its own: on an
#: H200 that served issue 13's trace at 0.97 of the offline engine against 0.82 in one process, same run);
#: on CPU the handbook's practice settings.
SERVE_DEFAULTS = {
    "cuda": dict(enforce_eager=False, max_num_seqs=256, max_num_batched_tokens=16384, max_active=256,
                 max_model_len=None, overlap=True, engine_process=True),
    "cpu": dict(enforce_eager=True, max_num_seqs=8, max_num_batched_tokens=512, max_active=8, max_model_len=1024,
                overlap=False, engine_process=False),
}
MODEL_CONTEXT = 1 << 30        # max_model_len "as long as the model allows": the engine caps it at the model's


def serve_defaults(device: str) -> dict:
    """The defaults of ``labkit serve`` on a resolved device (``cpu``, ``cuda``, ``cuda:N``)."""
    return dict(SERVE_DEFAULTS["cuda" if device.startswith("cuda") else "cpu"])


def fit_context(worker: Worker, build: Callable[[int], Worker]) -> tuple[Worker, str | None]:
    """A worker started with ``max_model_len=MODEL_CONTEXT``: the model's context length, capped by what
    the KV pool holds (then rebuilt with the cap, via ``build(max_model_len)``). Returns the worker to
    serve with and a line saying what max_model_len is and why."""
    cfg = worker.engine.config
    model_len = cfg.max_model_len
    pool = worker.engine.stats().num_blocks * cfg.kvcache_block_size
    if model_len <= pool:
        why = f"max-model-len {model_len} (the model's context length)"
    else:
        worker.close()
        worker = build(pool)
        why = (f"max-model-len {worker.engine.config.max_model_len}: capped by the KV pool ({pool} tokens); "
               f"the model allows {model_len}")
    worker.config.max_model_len = worker.engine.config.max_model_len
    worker.config.max_prompt_bytes = max(16 * 1024, 32 * worker.config.max_model_len)
    return worker, why


SWITCH_INTERVAL_ENV = "LABKIT_SWITCH_INTERVAL_MS"


def _switch_interval_from_env() -> None:
    """An experiment, off by default: ``LABKIT_SWITCH_INTERVAL_MS`` sets the serve process's GIL switch interval
    (Python's default is 5 ms: a thread back from a GPU wait may wait that long for the front end's GIL)."""
    raw = os.environ.get(SWITCH_INTERVAL_ENV)
    if not raw:
        return
    try:
        ms = float(raw)
        if not 0 < ms <= 1000:
            raise ValueError
    except ValueError:
        raise UserError(f"{SWITCH_INTERVAL_ENV} must be a number of milliseconds in (0, 1000], got {raw!r}") from None
    sys.setswitchinterval(ms / 1e3)


def run_serve(config, host: str = "127.0.0.1", port: int = 8801, out=None, *, served_model_name: str | None = None,
              max_body_bytes: int = 1 << 20, on_ready: Callable[[str, Worker], None] | None = None,
              api_key: str | None = None, allowed_origins=None, connections: ConnectionLimits | None = None,
              stats_interval: float = STATS_INTERVAL_S, on_context: Callable[[str], None] | None = None,
              log_plan=None, engine_process: bool = False) -> dict:
    """``labkit serve``: bind first (a port in use fails before the model loads), start the worker,
    serve until SIGINT/SIGTERM, close. Returns what the worker did (finished requests by reason).
    The event log: ``log_plan`` (:func:`labkit.service.events.plan_serve_log`: path, size cap, rotation),
    else ``out`` uncapped, else none. ``engine_process``: the engine and its owner thread in a process of
    their own (:mod:`labkit.service.engine_process`), this one keeps the HTTP front end."""
    from labkit.service.engine_process import worker_class
    from labkit.service.events import LogPlan

    Access.make(api_key, allowed_origins)                       # option errors before the model loads
    (connections or ConnectionLimits()).check()
    _switch_interval_from_env()
    if log_plan is None:
        log_plan = LogPlan(out if out else None)
    out = log_plan.path
    sock = bind_socket(host, port)
    log = None                  # opened once the model is up: a failed start leaves the previous log alone

    def write(record: dict) -> None:
        if log is not None:
            log.write(record)

    def write_many(records: list[dict]) -> None:       # a step's token events in one hand-off
        if log is not None:
            log.write_many(records)

    write.many = write_many
    sink = write if out is not None else None
    make = worker_class(engine_process)
    worker = make(config, sink=sink)
    try:
        worker.start()
        if config.max_model_len == MODEL_CONTEXT:
            def build(max_model_len: int) -> Worker:
                return make(dataclasses.replace(config, max_model_len=max_model_len, max_prompt_bytes=None),
                            sink=sink).start()

            worker, why = fit_context(worker, build)
            if why and on_context is not None:
                on_context(why)
        log = log_plan.open()
        if log is not None:
            log.write_header(worker.header(role="server", url=url_of(sock)))
        asyncio.run(serve_until_signal(worker, sock, served_model_name=served_model_name,
                                       max_body_bytes=max_body_bytes, api_key=api_key,
                                       allowed_origins=allowed_origins, connections=connections,
                                       stats_interval=stats_interval, on_ready=(lambda url: on_ready(url, worker)) if on_ready else None))
    finally:
        worker.close()
        if log is not None:
            log.close()
        sock.close()
    stats = worker.stats
    return {"finished": dict(stats.finished),
            "generation_tokens": stats.generation_tokens, "steps": dict(stats.steps),
            "engine_errors": stats.engine_errors, "log": str(out) if out else None}
