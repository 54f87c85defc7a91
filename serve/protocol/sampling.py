"""The checks of request fields that every route shares (:mod:`serve.protocol.requests` re-exports them): the
error constructor :func:`bad`, typed readers (``read_int``, ``read_number``, ``read_bool``), the bounded rendering of a
client's value (``show``), value checks (``number_check``, ``int_check``, ``type_check``), and the sampling
parameters (:data:`SAMPLING_CHECKS`, :func:`sampling_fields`) that map onto :class:`engine.SamplingParams` on
``/generate``, ``/v1/completions`` and ``/v1/chat/completions`` alike: one validator, so a value one route
refuses every route refuses (tests/service/entrypoints/test_service_vllm_fields.py runs a table of bad values on all three).

Their ranges are stated once, by ``SamplingParams`` (engine/sampling/params.py): here each value's JSON type is
checked (``invalid_type``); the engine's refusal of a value out of range (its ``RequestError`` code
``invalid_<field>``) is the 400's message, word for word, naming the field (:data:`PARAM_FIELDS`).
"""
from __future__ import annotations

import math
import reprlib
from typing import Any, Callable

from serve.protocol.wire import ApiError, HugeInt

INT64 = (-(2 ** 63), 2 ** 63 - 1)      # seeds: vLLM's range (a signed 64-bit integer); outside it a 400


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code, param)


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_int(body: dict, name: str, default: int | None, lo: int, hi: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, HugeInt):
        raise bad(f"{name} must be between {lo} and {hi}, got {value!r}", name)
    if not is_int(value):
        raise bad(f"{name} must be an integer, got {show(value)}", name, "invalid_type")
    if not lo <= value <= hi:
        raise bad(f"{name} must be between {lo} and {hi}, got {value}", name)
    return value


def read_number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, HugeInt):
        raise bad(f"{name} must be between {lo:g} and {hi:g}, got {value!r}", name)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise bad(f"{name} must be a number, got {show(value)}", name, "invalid_type")
    if not lo <= value <= hi:
        raise bad(f"{name} must be between {lo:g} and {hi:g}, got {show(value)}", name)
    return float(value)


def read_bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"{name} must be true or false, got {show(value)}", name, "invalid_type")
    return value


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 2, 40, 40, 40


def show(value: Any) -> str:
    """A short, safe rendering of a client's value for a message (bounded depth and length)."""
    text = repr(value) if isinstance(value, HugeInt) else _REPR.repr(value)
    text = text.encode("ascii", "backslashreplace").decode("ascii")
    return text if len(text) <= 60 else text[:57] + "..."


def number_check(lo: float, hi: float, lo_open: bool = False):
    def check(name: str, v: Any) -> None:
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise bad(f"{name} must be a number, got {show(v)}", name, "invalid_type")
        if not (lo < v if lo_open else lo <= v) or not v <= hi:
            raise bad(f"{name} must be {'>' if lo_open else '>='} {lo:g} and <= {hi:g}, got {show(v)}", name)
    return check


def int_check(lo: int, hi: int = 2 ** 31):
    def check(name: str, v: Any) -> None:
        if not is_int(v):
            raise bad(f"{name} must be an integer, got {show(v)}", name, "invalid_type")
        if not lo <= v <= hi:
            raise bad(f"{name} must be between {lo} and {hi}, got {show(v)}", name)
    return check


def type_check(*types: type, what: str):
    def check(name: str, v: Any) -> None:
        if not isinstance(v, types) or (bool not in types and isinstance(v, bool)):
            raise bad(f"{name} must be {what}, got {show(v)}", name, "invalid_type")
    return check


def _logit_bias_check(name: str, v: Any) -> None:
    if not isinstance(v, dict):
        raise bad(f"{name} must be an object of token id -> bias, got {show(v)}", name, "invalid_type")
    for k, b in v.items():
        if not (isinstance(k, str) and k.lstrip("-").isdigit()):
            raise bad(f"{name} keys must be token ids, got {show(k)}", name, "invalid_type")
        if not isinstance(b, (int, float)) or isinstance(b, bool):
            raise bad(f"{name} values must be numbers, got {show(b)}", name, "invalid_type")


def _token_list_check(name: str, v: Any) -> None:
    if not isinstance(v, list) or not all(is_int(t) for t in v):
        raise bad(f"{name} must be a list of integer token ids, got {show(v)}", name, "invalid_type")


_number = type_check(int, float, what="a number")
_integer = type_check(int, what="an integer")

#: The sampling parameters of OpenAI / vLLM requests that map onto SamplingParams, with their JSON type checks
#: (their ranges: SamplingParams').
SAMPLING_CHECKS: dict[str, Callable[[str, Any], None]] = {
    "top_p": _number,
    "top_k": _integer,
    "min_p": _number,
    "presence_penalty": _number,
    "frequency_penalty": _number,
    "repetition_penalty": _number,
    "min_tokens": _integer,
    "logit_bias": _logit_bias_check,
    "allowed_token_ids": _token_list_check,
}


def sampling_fields(body: dict) -> dict:
    """SamplingParams keyword arguments from the body's sampling parameters (null = absent), each of its JSON
    type: the one reader of the native and the OpenAI routes."""
    kw: dict[str, Any] = {}
    for name, check in SAMPLING_CHECKS.items():
        value = body.get(name)
        if value is None:
            continue
        check(name, value)
        kw[name] = {int(k): b for k, b in value.items()} if name == "logit_bias" else value
    return kw


#: The request fields an engine refusal can name (its RequestError code is ``invalid_<field>``).
PARAM_FIELDS = frozenset(SAMPLING_CHECKS) | {"temperature", "max_tokens", "stop_token_ids", "logprobs",
                                             "prompt_logprobs", "seed", "n", "best_of"}


def seed_of(body: dict) -> int | None:
    """The request's seed, an integer in int64 as vLLM takes it (no folding: outside is a 400)."""
    seed = body.get("seed")
    if seed is None:
        return None
    if not isinstance(seed, (int, HugeInt)) or isinstance(seed, bool):
        raise bad(f"seed must be an integer, got {show(seed)}", "seed", "invalid_type")
    if isinstance(seed, HugeInt) or not INT64[0] <= seed <= INT64[1]:
        raise bad(f"seed must be a signed 64-bit integer in [-2^63, 2^63 - 1], got {show(seed)}", "seed")
    return int(seed)
