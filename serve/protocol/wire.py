"""What arrives on the wire before any route sees it: the one client-visible error (:class:`ApiError`, OpenAI's
body ``{"error": {"message", "type", "param", "code"}}``), request bodies as strict JSON
(:func:`loads_strict`) and what aiohttp's parser refuses (:func:`parser_error`).

Bodies are strict JSON: no ``NaN``/``Infinity``, no number that overflows a double, no lone surrogate in a
string, no nesting deeper than :data:`MAX_DEPTH`; an integer of more than :data:`MAX_INT_DIGITS` digits is
kept as a :class:`HugeInt`, so the field that holds it is named in its 400 (Python's own 4,300-digit limit
never turns it into a 500).
"""
from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_DEPTH = 32                 # JSON nesting levels in a request body
MAX_INT_DIGITS = 40            # longer integers are HugeInt: no field takes them
_LONG_INT = 10 ** MAX_INT_DIGITS   # the least integer of more than MAX_INT_DIGITS digits (JSON has no leading 0)
_NUMBER_TYPES = frozenset((int, float, bool, type(None)))   # a list of only these holds nothing to look into


class ApiError(Exception):
    """A client-visible error: HTTP status, one-line message, machine code, the offending field (``param``),
    extra response ``headers`` (Retry-After, WWW-Authenticate) and whether the connection must close
    (``close``: the body was not read)."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 type_: str | None = None, headers: dict[str, str] | None = None, close: bool = False):
        super().__init__(message)
        self.status = status
        self.message = " ".join(str(message).split())
        self.code = code
        self.param = param
        self.type = type_ or _DEFAULT_TYPES.get(status, "invalid_request_error")
        self.headers = dict(headers or {})
        self.close = close

    def body(self, **extra) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code},
                **extra}


_DEFAULT_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                  404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
                  413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error",
                  431: "invalid_request_error", 500: "server_error", 503: "service_unavailable"}


class HugeInt:
    """An integer literal too long to be any field's value; shown by its length, never converted."""

    __slots__ = ("digits",)

    def __init__(self, text: str):
        self.digits = len(text.lstrip("-"))

    def __repr__(self) -> str:
        return f"an integer of {self.digits} digits"


def _parse_int(text: str):
    return HugeInt(text) if len(text) > MAX_INT_DIGITS else int(text)


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def _no_constants(name: str):
    raise ValueError(f"{name} is not valid JSON (use a number or null)")


def loads_strict(raw: bytes, what: str = "the request body") -> Any:
    """The body as JSON, or an ApiError 400 that says what is wrong (and where, when it can). ``what``: how the
    messages name the text (JSON text inside a body, e.g. a schema sent as a string, is held to the same rules)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"{what} is not UTF-8 ({e.reason} at byte {e.start})", "invalid_json") from None
    # json's own int() first (a prompt of token ids is a thousand integers: no Python call each); a body with
    # an integer of more than MAX_INT_DIGITS digits is parsed again with each integer through _parse_int
    value = _loads(text, what, fast=True)
    if value is _TOO_LONG or _check_tree(value, what):
        value = _loads(text, what, fast=False)
        _check_tree(value, what)
    return value


_TOO_LONG = object()


def _loads(text: str, what: str, fast: bool) -> Any:
    try:
        if fast:
            return json.loads(text, parse_float=_parse_float, parse_constant=_no_constants)
        return json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_no_constants)
    except RecursionError:
        raise ApiError(400, f"{what} is nested too deeply (at most {MAX_DEPTH} levels)",
                       "invalid_json") from None
    except json.JSONDecodeError as e:
        raise ApiError(400, f"{what} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})",
                       "invalid_json") from None
    except ValueError as e:
        if fast:                      # (an integer past Python's own digit limit: the slow parse names it)
            return _TOO_LONG
        raise ApiError(400, f"{what} is not valid JSON ({e})", "invalid_json") from None


def _long_int(v: Any) -> bool:
    return type(v) is int and not -_LONG_INT < v < _LONG_INT


def _check_tree(value: Any, what: str = "the request body") -> bool:
    """Depth and strings of a parsed body, iteratively (no recursion a deep body could exhaust); True when it
    holds an int of more than MAX_INT_DIGITS digits (json's own parse: loads_strict parses it again)."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    long = _long_int(value)
    while stack:
        v, path, depth = stack.pop()
        if isinstance(v, str):
            _check_str(v, path)
        elif isinstance(v, (dict, list)):
            if depth >= MAX_DEPTH:
                field = re.split(r"[.\[]", path, maxsplit=1)[0] if path else ""
                raise ApiError(400, f"{what} is nested too deeply (at most {MAX_DEPTH} levels)"
                               + (f" in {field}" if field else ""), "invalid_json", _param(field))
            if isinstance(v, dict):
                for k, item in v.items():
                    where = f"{path}.{k}" if path else str(k)
                    _check_str(k, where)
                    if isinstance(item, (str, dict, list)):
                        stack.append((item, where, depth + 1))
                    elif _long_int(item):
                        long = True
                continue
            types = set(map(type, v))
            if types == {int}:                           # token ids: passes at C speed only
                long = long or max(v) >= _LONG_INT or min(v) <= -_LONG_INT
            elif types <= _NUMBER_TYPES:
                long = long or any(map(_long_int, v))
            else:
                for i, item in enumerate(v):
                    if isinstance(item, (str, dict, list)):
                        stack.append((item, f"{path}[{i}]", depth + 1))
                    elif _long_int(item):
                        long = True
    return long


def _check_str(s: str, path: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"{path or 'the body'} holds a lone UTF-16 surrogate ({s[e.start]!a}), which is not text",
                       "invalid_unicode", _param(path)) from None


def _param(path: str) -> str | None:
    return path[:120] if path else None


def parser_error(status: int, exc: BaseException | None, message: str | None) -> ApiError:
    """What aiohttp's parser (or a handler bug) reported, as one JSON error: 4xx for what the client sent."""
    from aiohttp import http_exceptions as hx

    text = " ".join(str(getattr(exc, "message", None) or message or exc or "").split())[:300]
    if status >= 500 and not isinstance(exc, hx.HttpProcessingError):
        if status == 504:
            return ApiError(504, "the request handler timed out", "handler_timeout")
        return ApiError(500, "internal error while handling the request (see the server log)", "internal_error")
    if isinstance(exc, hx.BadHttpMethod):
        return ApiError(400, f"unknown HTTP method: {text}", "invalid_method")
    if isinstance(exc, hx.LineTooLong):
        if "header" in text.lower() or not re.search(r"b['\"]([A-Z]+ |/)", text):
            return ApiError(431, f"a request header is too long: {text[:160]}", "header_too_large")
        return ApiError(414, f"the request line is too long: {text[:160]}", "request_line_too_long")
    if "too many headers" in text.lower():
        return ApiError(431, f"too many request headers: {text}", "header_too_large")
    if isinstance(exc, hx.TransferEncodingError):
        return ApiError(400, f"bad chunked transfer encoding: {text}", "invalid_transfer_encoding")
    if isinstance(exc, hx.ContentEncodingError):
        return ApiError(400, f"the body does not match its Content-Encoding: {text}", "invalid_content_encoding",
                        "Content-Encoding")
    code = getattr(exc, "code", status)
    code = code if isinstance(code, int) and 400 <= code < 500 else 400
    return ApiError(code, f"malformed HTTP request: {text or 'unparseable'}", "bad_http_request")
