"""Structured outputs in a request body: every spelling OpenAI and vLLM clients send, as one
:class:`engine.StructuredOutputsParams` (the engine compiles it with xgrammar and constrains the output).

Sources (at most one per request; two is a 400 naming the second):
- ``response_format`` (OpenAI): ``{"type": "text"}`` (nothing), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`` and vLLM's
  ``{"type": "structural_tag", ...}`` (the structural tag itself: ``format`` or the older
  ``structures`` + ``triggers``).
- ``structured_outputs`` (vLLM): ``{json | json_object | regex | choice | grammar | structural_tag,
  disable_any_whitespace}``.
- vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``, with
  ``guided_decoding_backend`` accepted only as ``"xgrammar"`` or ``"auto"`` (the one backend here).
- ``structural_tag`` (vLLM's completions field): the structural tag as a JSON string (or object).

JSON is compact by default here (``disable_any_whitespace`` on, vLLM's switch): with free whitespace between
tokens a model can spend its whole budget on blanks, and a random synthetic model always does. A request may
send ``structured_outputs: {..., "disable_any_whitespace": false}`` for any whitespace.

A schema or structural tag sent as JSON text is parsed here under the body's own rules
(:func:`serve.protocol.wire.loads_strict`: at most ``MAX_DEPTH`` levels, strict numbers, UTF-8 text), and an
integer too long for any field (a ``HugeInt``) anywhere in a constraint is refused: each a 400 naming the field.
Its size is bounded by the body's.
"""
from __future__ import annotations

from typing import Any

from engine import RequestError, StructuredOutputsParams
from serve.protocol.wire import ApiError, HugeInt, loads_strict

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
BACKENDS = ("xgrammar", "auto")
#: The body fields that carry a constraint, in the order they are looked at.
SOURCES = ("response_format", "structured_outputs", *GUIDED, "structural_tag")
COMPACT_DEFAULT = True


def _bad(message: str, param: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code, param)


def _from_response_format(rf: Any) -> dict | None:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise _bad("response_format must be an object {type: ...}", "response_format", "invalid_type")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise _bad("response_format.json_schema must be an object {name, schema, strict}",
                       "response_format", "invalid_type")
        if "name" in js and not isinstance(js["name"], str):
            raise _bad("response_format.json_schema.name must be a string", "response_format", "invalid_type")
        schema = js.get("schema", js.get("json_schema"))
        return {"json_object": True} if schema is None else {"json": schema}
    if kind == "structural_tag":
        tag = {k: v for k, v in rf.items() if k != "type"}
        if "format" in tag:
            tag = {"type": "structural_tag", **tag}
        return {"structural_tag": tag}
    raise _bad(f"response_format.type must be text, json_object, json_schema or structural_tag, got {kind!r}"[:200],
               "response_format")


def _one_source(body: dict) -> tuple[str, dict] | None:
    """(the field it came from, the StructuredOutputsParams fields) of the body's constraint, if any."""
    found: list[tuple[str, dict | None]] = []
    for name in SOURCES:
        value = body.get(name)
        if value is None:
            continue
        if name == "response_format":
            found.append((name, _from_response_format(value)))
        elif name == "structured_outputs":
            if not isinstance(value, dict):
                raise _bad("structured_outputs must be an object", name, "invalid_type")
            found.append((name, dict(value)))
        elif name in GUIDED:
            found.append((name, {GUIDED[name]: value}))
        else:
            found.append((name, {"structural_tag": value}))
    found = [(n, f) for n, f in found if f is not None]
    if len(found) > 1:
        raise _bad(f"{found[1][0]} cannot be combined with {found[0][0]}: give one structured-output constraint",
                   found[1][0])
    return found[0] if found else None


def _check_backend(body: dict) -> None:
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in BACKENDS:
        raise _bad(f"guided_decoding_backend must be one of {', '.join(BACKENDS)} (the one backend here), "
                   f"got {str(backend)[:60]!r}", "guided_decoding_backend",
                   "unsupported_parameter" if isinstance(backend, str) else "invalid_type")


def _parsed(name: str, spec: dict) -> dict:
    """``spec`` with a schema or tag given as JSON text parsed (the body's rules); a HugeInt in it refused."""
    for kind, what in (("json", "schema"), ("structural_tag", "structural tag")):
        if isinstance(spec.get(kind), str):
            try:
                spec[kind] = loads_strict(spec[kind].encode("utf-8"), f"{name}: the {what} text")
            except ApiError as e:
                raise _bad(e.message, name) from None
    stack: list = [spec]
    while stack:
        v = stack.pop()
        if isinstance(v, HugeInt):
            raise _bad(f"{name} holds {v!r}, which no constraint can take", name)
        if isinstance(v, dict):
            stack += v.values()
        elif isinstance(v, list):
            stack += v
    return spec


def source(body: dict) -> str | None:
    """The body field a constraint came from (names the param of a refusal the engine finds later)."""
    return next((name for name in SOURCES if body.get(name) is not None
                 and body.get(name) != {"type": "text"}), None)


def structured_outputs(body: dict) -> StructuredOutputsParams | None:
    """The request's constraint as engine params, or None. A malformed one is a 400 naming its field; one
    xgrammar cannot compile is refused at submit (the engine's RequestError ``invalid_structured_outputs``)."""
    _check_backend(body)
    found = _one_source(body)
    if found is None:
        return None
    name, spec = found
    spec = _parsed(name, spec)
    spec.setdefault("disable_any_whitespace", COMPACT_DEFAULT)
    try:
        return StructuredOutputsParams.of(spec)
    except (RequestError, TypeError) as e:
        message = str(e)
        if name != "structured_outputs":       # say it in the client's own field's terms
            message = f"{name}: {message}"
        raise _bad(message, name) from None
