"""What every route's body shares, as pydantic models: :class:`StrictBody` (strict JSON types, null is absent,
unknown fields ignored as vLLM does) with :meth:`StrictBody.parse`, the one translation of pydantic's
``ValidationError`` into the server's 400 (:func:`api_error`: one line naming the field), and
:class:`SamplingFields`, the sampling parameters that map onto :class:`engine.SamplingParams` on ``/generate``,
``/v1/completions`` and ``/v1/chat/completions`` alike: one model, so a value one route refuses every route
refuses (tests/service/entrypoints/test_service_vllm_fields.py runs a table of bad values on all three).

Their ranges are stated once, by ``SamplingParams`` (engine/sampling/params.py): the model states each value's
JSON type (``invalid_type``); the engine's refusal of a value out of range (its ``RequestError`` code
``invalid_<field>``) is the 400's message, word for word, naming the field (:data:`PARAM_FIELDS`).
"""
from __future__ import annotations

import reprlib
from typing import Annotated, Any, Optional

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, Strict, ValidationError, WrapValidator,
                      model_validator)

from serve.protocol.wire import ApiError, HugeInt

INT64 = (-(2 ** 63), 2 ** 63 - 1)      # seeds: vLLM's range (a signed 64-bit integer); outside it a 400


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code, param)


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 2, 40, 40, 40


def show(value: Any) -> str:
    """A short, safe rendering of a client's value for a message (bounded depth and length)."""
    text = repr(value) if isinstance(value, HugeInt) else _REPR.repr(value)
    text = text.encode("ascii", "backslashreplace").decode("ascii")
    return text if len(text) <= 60 else text[:57] + "..."


# --------------------------------------------------------------------------- pydantic's errors as one 400

#: What a value of each JSON type is called in a message (pydantic's type errors).
_WHAT = {"int_type": "an integer", "int_parsing": "an integer", "float_type": "a number", "bool_type": "true or false",
         "string_type": "a string", "list_type": "a list", "dict_type": "an object", "model_type": "an object",
         "model_attributes_type": "an object"}
#: The codes of the errors the validators raise (``PydanticCustomError(code, what the field must be)``).
CODES = frozenset({"invalid_value", "invalid_type", "empty_prompt", "unsupported_content", "unsupported_parameter"})
#: The error code of a missing required field.
_MISSING = {"prompt": "missing_prompt", "messages": "missing_prompt", "request_id": "missing_request_id"}
#: pydantic's value errors, as this server words them (ctx: pydantic's context of the error).
_SAYS = {"greater_than_equal": "must be >= {ge}", "greater_than": "must be > {gt}",
         "less_than_equal": "must be <= {le}", "less_than": "must be < {lt}",
         "too_long": "may hold at most {max_length} items", "too_short": "must hold at least {min_length} items",
         "string_too_long": "may be at most {max_length} characters", "string_too_short": "must not be empty",
         "string_pattern_mismatch": "must match {pattern}", "literal_error": "must be {expected}",
         "union_tag_invalid": "must have {discriminator} one of {expected_tags}",
         "union_tag_not_found": "needs {discriminator}"}


def _param(loc: tuple, body: Any, kind: str = "") -> tuple[str | None, Any]:
    """The field an error's ``loc`` names, as the client wrote it (``messages[0].role``, ``tools[1].function.name``),
    and the value there. pydantic's own steps (a union member's tag, ``[key]``) are not in the body and are left out;
    an item of a list of scalars is named by its list (``stop_token_ids``, not ``stop_token_ids[3]``) unless it
    should have been an object (``messages[0]``), an entry of a map by its key (``tags.a``) unless its key is
    what is wrong (``logit_bias``)."""
    parts: list = []
    value = body
    for i, step in enumerate(loc):
        if isinstance(value, dict) and isinstance(step, str) and step in value:
            if i + 1 < len(loc) and loc[i + 1] == "[key]":
                break
            parts.append(step)
            value = value[step]
        elif isinstance(value, list) and isinstance(step, int) and 0 <= step < len(value):
            if not isinstance(value[step], (dict, list)) and kind not in ("model_type", "dict_type"):
                break
            parts.append(step)
            value = value[step]
    if loc and isinstance(loc[-1], str) and loc[-1] != "[key]" and isinstance(value, dict) \
            and loc[-1] not in value and (not parts or parts[-1] != loc[-1]):
        parts.append(loc[-1])            # a field the object lacks (missing, or its default refused)
    elif not parts and loc and isinstance(loc[0], str):
        parts = [loc[0]]
    text = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".")
    return text or None, value


def _says(kind: str, ctx: dict) -> str | None:
    try:
        return _SAYS[kind].format(**ctx) if kind in _SAYS else None
    except KeyError:                     # a pydantic release that names the error's context otherwise
        return None


def api_error(e: ValidationError, body: Any, at: str | None = None) -> ApiError:
    """The first error pydantic found, as the server's 400: ``<field> must be ..., got <value>``. ``at``: the
    field ``body`` is the value of (a TypeAdapter's errors start inside it)."""
    err = e.errors(include_url=False)[0]
    kind, ctx, value, loc = err["type"], err.get("ctx") or {}, err.get("input"), err["loc"]
    if at is not None:
        body, loc = {at: body}, (at, *loc)
    if not loc and kind in ("model_type", "dict_type"):
        return bad("the request body must be a JSON object", None, "invalid_body")
    param, _ = _param(loc, body, kind)
    name = (param or "the request body") + (" keys" if "[key]" in loc else "")
    if kind == "missing":
        return bad(f"{name} is required", param, _MISSING.get(param or "", "invalid_value"))
    if kind in _WHAT:
        if isinstance(value, HugeInt) and kind in ("int_type", "float_type") and isinstance(loc[-1], str):
            return bad(f"{name} is out of range, got {show(value)}", param)
        return bad(f"{name} must be {_WHAT[kind]}, got {show(value)}", param, "invalid_type")
    says = _says(kind, ctx)
    if says is not None:
        return bad(f"{name} {says}, got {show(value)}" if kind not in ("too_long", "too_short") else f"{name} {says}",
                   param)
    if kind in CODES:                    # raised by a validator here (PydanticCustomError): the code, what it says
        return bad(f"{name} {err['msg']}" + (f", got {show(value)}" if kind == "invalid_type" else ""), param, kind)
    return bad(f"{name}: {err['msg']}", param)          # any other refusal of pydantic's, in its own words


def by_type(what: str, **tags: type) -> Discriminator:
    """A union's member chosen by the value's JSON type (tag -> type); a value of none of them is one
    ``invalid_type`` saying ``what`` the field must be (not one error per member)."""
    return Discriminator(lambda v: next((tag for tag, kind in tags.items() if isinstance(v, kind)), None),
                         custom_error_type="invalid_type", custom_error_message=f"must be {what}")


class StrictBody(BaseModel):
    """A JSON object of a request: strict JSON types (no ``"5"`` for 5, no 1 for true), ``null`` is the field's
    absence (its default), and a field no model states is ignored (vLLM's default)."""
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, body: Any) -> Any:
        return {k: v for k, v in body.items() if v is not None} if isinstance(body, dict) else body

    @classmethod
    def parse(cls, body: Any, limits: Any = None):
        """The body as this model, or the :class:`ApiError` 400 naming the first field that is wrong. ``limits``:
        the server's (serve.protocol.requests.Limits), for the validators that need them."""
        try:
            return cls.model_validate(body, context={"limits": limits})
        except ValidationError as e:
            raise api_error(e, body) from None


# --------------------------------------------------------------------------- the sampling parameters

#: A token id as a JSON object's key (logit_bias): a string of digits, read as an integer.
KeyTokenId = Annotated[int, Strict(False)]


def _as_given(value: Any, handler) -> Any:
    out = handler(value)
    return value if is_int(value) else out


#: A JSON number, an integer kept as given (the engine's message quotes the value as the client wrote it).
Number = Annotated[float, WrapValidator(_as_given)]


class SamplingFields(StrictBody):
    """The sampling parameters of every route (vLLM's names). Types here; ranges: ``SamplingParams``'."""
    max_tokens: Optional[int] = None          # its range is the route's: 1 .. max_model_len - 1
    temperature: Optional[Annotated[Number, Field(le=100)]] = None    # the default is the route's
    seed: Optional[Annotated[int, Field(ge=INT64[0], le=INT64[1])]] = None
    ignore_eos: bool = False
    top_p: Optional[Number] = None
    top_k: Optional[int] = None
    min_p: Optional[Number] = None
    presence_penalty: Optional[Number] = None
    frequency_penalty: Optional[Number] = None
    repetition_penalty: Optional[Number] = None
    min_tokens: Optional[int] = None
    logit_bias: Optional[dict[KeyTokenId, Number]] = None
    allowed_token_ids: Optional[list[int]] = None

    def sampling_kwargs(self) -> dict:
        """SamplingParams keyword arguments of the sampling parameters given."""
        return {name: getattr(self, name) for name in SAMPLING_FIELDS if getattr(self, name) is not None}


#: The sampling parameters that go to SamplingParams as given (its ranges check them).
SAMPLING_FIELDS = ("top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                   "min_tokens", "logit_bias", "allowed_token_ids")
#: The request fields an engine refusal can name (its RequestError code is ``invalid_<field>``).
PARAM_FIELDS = frozenset(SAMPLING_FIELDS) | {"temperature", "max_tokens", "stop_token_ids", "logprobs",
                                             "prompt_logprobs", "seed", "n", "best_of"}
