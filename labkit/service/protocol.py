"""Request bodies of the native and the OpenAI-compatible API: parse, validate, or say why not.

Every problem a client can cause becomes an :class:`ApiError` with an HTTP status (400, 404, 413,
429, 503) and an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``; the server
never answers a bad input with 500. Checks here are the ones that need no engine (types, ranges,
shapes); the worker adds the ones that do (token ids vs the vocabulary, prompt length vs
max_model_len, KV pool size) and they come back as 400 too.

Unknown fields are ignored, as OpenAI-compatible servers do, except those whose meaning we would
silently get wrong: ``n`` > 1, ``best_of`` > 1, ``logprobs``, ``echo``, ``stop``, ``tools`` are
refused with a 400 that names them.

Bodies are strict JSON (:func:`loads_strict`): no ``NaN``/``Infinity``, no number that overflows a
double, no lone surrogate in a string, no nesting deeper than :data:`MAX_DEPTH`; an integer of more
than :data:`MAX_INT_DIGITS` digits is kept as a :class:`HugeInt`, so the field that holds it is
named in its 400 (Python's own 4,300-digit limit never turns it into a 500).
"""
from __future__ import annotations

import json
import math
import re
import reprlib
from dataclasses import dataclass, field
from typing import Any

from engine import SamplingParams

ROLES = ("system", "developer", "user", "assistant", "tool")
TAG_VALUE_TYPES = (str, int, float, bool, type(None))
REQUEST_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}")
#: Event field names a request's tags may not use.
RESERVED_FIELDS = frozenset({"event", "request_id", "worker_id", "round", "round_", "t_ns", "observer",
                             "prompt_tokens", "max_tokens", "queue_depth", "index", "token_id", "reason", "cause",
                             "message"})
TAG_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_.\-]{0,63}")
MAX_DEPTH = 32                 # JSON nesting levels in a request body
MAX_INT_DIGITS = 40            # longer integers are HugeInt: no field takes them


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


# --------------------------------------------------------------------------- strict JSON


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


def loads_strict(raw: bytes) -> Any:
    """The body as JSON, or an ApiError 400 that says what is wrong (and where, when it can)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not UTF-8 ({e.reason} at byte {e.start})", "invalid_json") from None
    try:
        value = json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_no_constants)
    except RecursionError:
        raise ApiError(400, f"the request body is nested too deeply (at most {MAX_DEPTH} levels)",
                       "invalid_json") from None
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})",
                       "invalid_json") from None
    except ValueError as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})", "invalid_json") from None
    _check_tree(value)
    return value


def _check_tree(value: Any) -> None:
    """Depth and strings of a parsed body, iteratively (no recursion a deep body could exhaust)."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        v, path, depth = stack.pop()
        if isinstance(v, str):
            _check_str(v, path)
        elif isinstance(v, (dict, list)):
            if depth >= MAX_DEPTH:
                field = re.split(r"[.\[]", path, maxsplit=1)[0] if path else ""
                raise ApiError(400, f"the request body is nested too deeply (at most {MAX_DEPTH} levels)"
                               + (f" in {field}" if field else ""), "invalid_json", _param(field))
            if isinstance(v, dict):
                for k, item in v.items():
                    where = f"{path}.{k}" if path else str(k)
                    _check_str(k, where)
                    if isinstance(item, (str, dict, list)):
                        stack.append((item, where, depth + 1))
            else:
                for i, item in enumerate(v):
                    if isinstance(item, (str, dict, list)):
                        stack.append((item, f"{path}[{i}]", depth + 1))


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


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code, param)


@dataclass
class Limits:
    max_model_len: int
    vocab_size: int
    served_model_name: str
    max_body_bytes: int = 1 << 20


@dataclass
class GenRequest:
    """One validated request, whichever API it came through."""
    api: str                              # native | completions | chat
    prompt: Any                           # str | list[int] | list[message dict]
    params: SamplingParams
    stream: bool = True
    request_id: str | None = None
    tags: dict = field(default_factory=dict)
    include_usage: bool = False
    model: str | None = None
    detokenize: bool = True               # native: add "text" to token events


# --------------------------------------------------------------------------- field checks


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int(body: dict, name: str, default: int | None, lo: int, hi: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, HugeInt):
        raise bad(f"{name} must be between {lo} and {hi}, got {value!r}", name)
    if not _is_int(value):
        raise bad(f"{name} must be an integer, got {_show(value)}", name, "invalid_type")
    if not lo <= value <= hi:
        raise bad(f"{name} must be between {lo} and {hi}, got {value}", name)
    return value


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, HugeInt):
        raise bad(f"{name} must be between {lo:g} and {hi:g}, got {value!r}", name)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise bad(f"{name} must be a number, got {_show(value)}", name, "invalid_type")
    if not lo <= value <= hi:
        raise bad(f"{name} must be between {lo:g} and {hi:g}, got {_show(value)}", name)
    return float(value)


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"{name} must be true or false, got {_show(value)}", name, "invalid_type")
    return value


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 2, 40, 40, 40


def _show(value: Any) -> str:
    """A short, safe rendering of a client's value for a message (bounded depth and length)."""
    text = repr(value) if isinstance(value, HugeInt) else _REPR.repr(value)
    text = text.encode("ascii", "backslashreplace").decode("ascii")
    return text if len(text) <= 60 else text[:57] + "..."


def _token_ids(value: Any, param: str) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        raise bad(f"{param} must be a list of integer token ids", param, "invalid_type")
    if not value:
        raise bad(f"{param} is empty", param, "empty_prompt")
    return value


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise bad(f"{param} must be a string", param, "invalid_type")
    if not value:
        raise bad(f"{param} is empty", param, "empty_prompt")
    return value


def _messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise bad("messages must be a non-empty list of {role, content} objects", "messages", "invalid_type")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object", where, "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role must be one of {', '.join(ROLES)}, got {_show(role)}", f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):        # content parts: only text is understood
            texts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise bad(f"{where}.content[{j}] must be a text part {{type: text, text}}",
                              f"{where}.content", "unsupported_content")
                texts.append(part["text"])
            content = "".join(texts)
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise bad(f"{where}.content must be a string", f"{where}.content", "invalid_type")
        out.append({"role": role, "content": content})
    return out


def _request_id(body: dict) -> str | None:
    rid = body.get("request_id")
    if rid is None:
        return None
    if not isinstance(rid, str) or not rid:
        raise bad("request_id must be a non-empty string", "request_id", "invalid_type")
    if not REQUEST_ID_RE.fullmatch(rid):
        raise bad(f"request_id must match {REQUEST_ID_RE.pattern}", "request_id")
    return rid


def _tags(body: dict) -> dict:
    tags = body.get("tags", {})
    if tags is None:
        return {}
    if not isinstance(tags, dict) or len(tags) > 16:
        raise bad("tags must be an object of at most 16 fields", "tags", "invalid_type")
    for k, v in tags.items():
        if not isinstance(k, str) or not TAG_NAME_RE.fullmatch(k) or k in RESERVED_FIELDS:
            raise bad(f"tag name {_show(k)} is not allowed (a letter, then letters, digits, '_', '.', '-', "
                      f"at most 64; not an event field)", "tags")
        if not isinstance(v, TAG_VALUE_TYPES) or (isinstance(v, str) and len(v) > 256) \
                or (isinstance(v, float) and not math.isfinite(v)) or (isinstance(v, int) and abs(v) >= 2 ** 63):
            raise bad(f"tag {k} must be a short scalar (a string of at most 256 characters, a finite number, "
                      f"true, false or null)", f"tags.{k}", "invalid_type")
    return dict(tags)


def _refuse_unsupported(body: dict) -> None:
    if body.get("n", 1) not in (1, None):
        raise bad("only n=1 is supported", "n", "unsupported_parameter")
    if body.get("best_of", 1) not in (1, None):
        raise bad("only best_of=1 is supported", "best_of", "unsupported_parameter")
    for name in ("logprobs", "top_logprobs", "echo", "tools", "functions", "suffix"):
        if body.get(name) not in (None, False, 0, [], ""):
            raise bad(f"{name} is not supported by this server", name, "unsupported_parameter")
    if body.get("stop") not in (None, [], ""):
        raise bad("stop sequences are not supported by this server", "stop", "unsupported_parameter")


def _params(body: dict, limits: Limits, default_temperature: float, max_tokens_names=("max_tokens",)) -> SamplingParams:
    hi = limits.max_model_len - 1
    max_tokens = None
    for name in max_tokens_names:
        if body.get(name) is not None:
            max_tokens = _int(body, name, None, 1, hi)
            break
    if max_tokens is None:
        max_tokens = min(16 if default_temperature else 64, hi)
    temperature = _number(body, "temperature", default_temperature, 0.0, 100.0)
    seed = body.get("seed")
    if seed is not None and not (_is_int(seed) and -(2 ** 63) <= seed < 2 ** 64):
        raise bad(f"seed must be an integer in [-2^63, 2^64), got {_show(seed)}", "seed",
                  "invalid_type" if not isinstance(seed, (int, HugeInt)) or isinstance(seed, bool) else "invalid_value")
    ignore_eos = _bool(body, "ignore_eos", False)
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=ignore_eos,
                          seed=None if seed is None else int(seed) % (2 ** 63))


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None, "invalid_body")
    return body


def _check_model(body: dict, limits: Limits) -> str | None:
    model = body.get("model")
    if model is None:
        return None
    if not isinstance(model, str):
        raise bad("model must be a string", "model", "invalid_type")
    if model not in (limits.served_model_name, ""):
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {limits.served_model_name!r}",
                       "model_not_found", "model")
    return model


# --------------------------------------------------------------------------- the three APIs


def parse_native(body: Any, limits: Limits) -> GenRequest:
    """``POST /generate``: one of prompt (text), prompt_token_ids, messages; greedy by default.

    Optional: max_tokens, temperature, seed, ignore_eos, stream (default true), request_id, tags
    (short scalars copied into the submitted event, e.g. the trace's class), detokenize (default
    true: token events carry their text piece; load replay turns it off)."""
    body = _object(body)
    given = [k for k in ("prompt", "prompt_token_ids", "messages") if body.get(k) is not None]
    if len(given) != 1:
        raise bad("give exactly one of prompt, prompt_token_ids, messages" +
                  (f" (got {', '.join(given)})" if given else ""), None, "missing_prompt" if not given else "invalid_value")
    key = given[0]
    if key == "prompt":
        prompt: Any = _text(body["prompt"], "prompt")
    elif key == "prompt_token_ids":
        prompt = _token_ids(body["prompt_token_ids"], "prompt_token_ids")
    else:
        prompt = _messages(body["messages"])
    params = _params(body, limits, default_temperature=0.0)
    return GenRequest("native", prompt, params, stream=_bool(body, "stream", True), request_id=_request_id(body),
                      tags=_tags(body), detokenize=_bool(body, "detokenize", True))


def parse_completion(body: Any, limits: Limits) -> GenRequest:
    """``POST /v1/completions``: prompt is a string, token ids, or a one-element list of either."""
    body = _object(body)
    model = _check_model(body, limits)
    _refuse_unsupported(body)
    if "prompt" not in body or body["prompt"] is None:
        raise bad("prompt is required", "prompt", "missing_prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) != 1:
            raise bad("only one prompt per request is supported", "prompt", "unsupported_parameter")
        prompt = prompt[0]
    if isinstance(prompt, str):
        prompt = _text(prompt, "prompt")
    else:
        prompt = _token_ids(prompt, "prompt")
    params = _params(body, limits, default_temperature=1.0)
    stream = _bool(body, "stream", False)
    return GenRequest("completions", prompt, params, stream=stream, request_id=_request_id(body),
                      include_usage=_include_usage(body, stream), model=model)


def parse_chat(body: Any, limits: Limits) -> GenRequest:
    """``POST /v1/chat/completions``: messages through the model's chat template."""
    body = _object(body)
    model = _check_model(body, limits)
    _refuse_unsupported(body)
    if "messages" not in body:
        raise bad("messages is required", "messages", "missing_prompt")
    messages = _messages(body["messages"])
    params = _params(body, limits, default_temperature=1.0, max_tokens_names=("max_completion_tokens", "max_tokens"))
    stream = _bool(body, "stream", False)
    return GenRequest("chat", messages, params, stream=stream, request_id=_request_id(body),
                      include_usage=_include_usage(body, stream), model=model)


def _include_usage(body: dict, stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise bad("stream_options must be an object", "stream_options", "invalid_type")
    if not stream:
        raise bad("stream_options is only allowed with stream=true", "stream_options")
    return _bool(opts, "include_usage", False)


def parse_cancel(body: Any) -> tuple[str, str | None]:
    """``POST /cancel``: (request_id, cancel_token); the token is the X-Cancel-Token of the request's answer."""
    body = _object(body)
    rid = _request_id(body)
    if rid is None:
        raise bad("request_id is required", "request_id", "missing_request_id")
    token = body.get("cancel_token")
    if token is not None and (not isinstance(token, str) or not 0 < len(token) <= 256):
        raise bad("cancel_token must be the X-Cancel-Token string of the request's answer", "cancel_token",
                  "invalid_type")
    return rid, token
