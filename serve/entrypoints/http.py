"""HTTP middleware and access control, shared by every route (vLLM's api_server middleware).

- :class:`Access`: who may use the server: ``--api-key`` (vLLM's flag; also ``$LABKIT_API_KEY``): every route
  but ``/health`` needs ``Authorization: Bearer KEY``; browsers: a request with an ``Origin`` outside
  ``--allowed-origins`` (default: none) is refused, and POST bodies must be ``application/json``, so a web
  page cannot drive a local server.
- :class:`Middleware`: before any handler (:meth:`Middleware.precheck`: origin, key, a POST body's type,
  encoding and declared size, refused before a byte of the body is read and before ``100 Continue``),
  ``Expect: 100-continue``, CORS and preflight, and the one error shape: every failure is JSON
  ``{"error": {"message", "type", "param", "code"}}``, also for what aiohttp's parser refuses.
  :meth:`Middleware.read_json` reads a body under its deadline and size limit as strict JSON.
- the small helpers the routes share: :func:`json_bytes` (one JSON document as UTF-8),
  :func:`error_response`, :func:`disconnected`, :func:`connection_of`, :func:`is_loopback`, :class:`ClientGone`.
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import os
from dataclasses import dataclass
from typing import Any, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from serve.errors import ServeError
from serve.protocol import requests as protocol
from serve.entrypoints.connections import Connection
from serve.protocol.wire import ApiError, loads_strict, parser_error

INLINE_BODY_BYTES = 16 * 1024     # a larger JSON body is parsed off the event loop
BODY_BYTES = web.RequestKey("labkit_body_bytes", int)   # a request's body size, once read

API_KEY_ENV = "LABKIT_API_KEY"
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
            raise ServeError("--api-key must be a non-empty string without spaces")
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


class ClientGone(Exception):
    """The client went away while its request ran."""


def error_response(err: ApiError, **extra) -> web.Response:
    resp = web.json_response(err.body(**extra), status=err.status, headers=err.headers or None)
    if err.close:
        resp.force_close()
    return resp


def disconnected(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def connection_of(request: web.Request) -> Connection | None:
    proto = request.protocol
    return proto if isinstance(proto, Connection) else None


_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)   # built once, not per event


def json_bytes(obj: Any) -> bytes:
    """One JSON document as UTF-8; whatever cannot be UTF-8 (it should never get here) is escaped, not a crash."""
    try:
        return _JSON.encode(obj).encode("utf-8")
    except (UnicodeEncodeError, ValueError):
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=True, default=str).encode("ascii")


def is_loopback(request: web.Request) -> bool:
    try:
        return ipaddress.ip_address((request.remote or "").split("%")[0]).is_loopback
    except ValueError:
        return False


def _refused_origin(origin: str, close: bool) -> ApiError:
    return ApiError(403, f"requests from the web origin {protocol.show(origin)} are not allowed "
                         "(start the server with --allowed-origins to allow it)", "origin_not_allowed", "Origin",
                    close=close)


def _too_large(limit: int, close: bool = True) -> ApiError:
    return ApiError(413, f"request body exceeds the limit of {limit} bytes", "body_too_large", close=close)


class Middleware:
    """What runs around every handler: access, body checks, CORS, errors, reading the body."""

    def __init__(self, access: Access, max_body_bytes: int, timeout_body: float):
        self.access = access
        self.max_body_bytes = max_body_bytes
        self.timeout_body = timeout_body

    def precheck(self, request: web.Request) -> None:
        """Origin, API key, and for a POST route its body's type, encoding and declared size: refused here,
        before a byte of the body is read (and before ``100 Continue``)."""
        origin = request.headers.get("Origin")
        if origin is not None and not self.access.origin_allowed(origin):
            raise _refused_origin(origin, close=True)
        if request.path != "/health" and not self.access.key_ok(request.headers.get("Authorization")):
            raise ApiError(401, "this server needs an API key: send Authorization: Bearer <key>", "invalid_api_key",
                           "Authorization", headers={"WWW-Authenticate": "Bearer"}, close=True)
        matched = getattr(request.match_info, "http_exception", None) is None
        if request.method != "POST" or not matched:
            return
        ctype = request.headers.get("Content-Type", "")
        if ctype.split(";", 1)[0].strip().lower() not in JSON_TYPES:
            raise ApiError(415, f"the body must be application/json, got Content-Type {protocol.show(ctype or None)}",
                           "unsupported_media_type", "Content-Type", close=True)
        encoding = request.headers.get("Content-Encoding", "").strip().lower()
        if encoding not in BODY_ENCODINGS:
            raise ApiError(415, f"Content-Encoding {protocol.show(encoding)} is not supported (send identity, gzip "
                                "or deflate)", "unsupported_content_encoding", "Content-Encoding", close=True)
        limit = self.max_body_bytes
        length = request.content_length
        if length is not None and length > limit:
            raise ApiError(413, f"request body of {length} bytes exceeds the limit of {limit} bytes", "body_too_large",
                           close=True)

    async def expect(self, request: web.Request) -> web.StreamResponse | None:
        """``Expect: 100-continue``: the checks first; only a request that passes them is invited to send its body."""
        conn = connection_of(request)
        if conn is not None:
            conn.enter("busy")
        try:
            self.precheck(request)
        except ApiError as e:
            resp = self.cors(request, error_response(e))
            resp.force_close()
            if conn is not None:
                conn.enter("idle")
            return resp
        expect = request.headers.get("Expect", "")
        if expect.lower() != "100-continue":
            resp = error_response(ApiError(417, f"unsupported Expect: {protocol.show(expect)}", "expectation_failed",
                                           "Expect", close=True))
            if conn is not None:
                conn.enter("idle")
            return resp
        if request.version >= (1, 1):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return None

    def cors(self, request: web.Request, resp: web.StreamResponse) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        if origin is not None and self.access.origin_allowed(origin) and not resp.prepared:
            resp.headers["Access-Control-Allow-Origin"] = origin
            resp.headers["Vary"] = "Origin"
            resp.headers["Access-Control-Expose-Headers"] = "X-Request-Id, X-Cancel-Token, X-Worker-Id"
        return resp

    @web.middleware
    async def errors(self, request: web.Request, handler: Callable):
        conn = connection_of(request)
        if conn is not None:
            conn.enter("body" if request.method == "POST" else "busy")
        try:
            return self.cors(request, await self._handle(request, handler))
        finally:
            if conn is not None:
                conn.enter("idle")

    async def _handle(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        try:
            if request.method == "OPTIONS" and request.headers.get("Origin") and \
                    request.headers.get("Access-Control-Request-Method"):
                return self._preflight(request)
            self.precheck(request)
            return await handler(request)
        except ApiError as e:
            return error_response(e)
        except ClientGone:
            return web.Response(status=499)       # nobody is listening any more
        except web.HTTPRequestEntityTooLarge:
            return error_response(_too_large(self.max_body_bytes))
        except web.HTTPException as e:
            if e.status < 400:
                raise
            code = {404: "not_found", 405: "method_not_allowed"}.get(e.status, "http_error")
            text = f"{request.method} {protocol.show(request.path)}: {e.reason}"
            return error_response(ApiError(e.status, text, code, headers={k: v for k, v in e.headers.items()
                                                                          if k == "Allow"}))

    def _preflight(self, request: web.Request) -> web.Response:
        origin = request.headers["Origin"]
        if not self.access.origin_allowed(origin):
            raise _refused_origin(origin, close=False)
        return web.Response(status=204, headers={
            "Access-Control-Allow-Origin": origin, "Vary": "Origin", "Access-Control-Max-Age": "600",
            "Access-Control-Allow-Methods": "GET, POST",
            "Access-Control-Allow-Headers": "Authorization, Content-Type"})

    async def read_json(self, request: web.Request) -> Any:
        """The body (read under its deadline, within the size limit) as strict JSON."""
        limit = self.max_body_bytes
        timeout = self.timeout_body
        conn = connection_of(request)
        if conn is not None:
            conn.enter("body")
        try:
            async with asyncio.timeout(timeout):      # no task of its own (wait_for's): a body already here is read
                raw = await request.read()            # in the handler's turn of the event loop
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {timeout:g} s", "request_timeout",
                           close=True) from None
        except web.HTTPRequestEntityTooLarge:
            raise _too_large(limit) from None
        except HttpProcessingError as e:
            err = parser_error(400, e, None)
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
            raise _too_large(limit, close=False)
        request[BODY_BYTES] = len(raw)
        if len(raw) > INLINE_BODY_BYTES:              # parsed in a worker thread: the event loop goes on answering
            return await asyncio.get_running_loop().run_in_executor(None, loads_strict, raw)
        return loads_strict(raw)
