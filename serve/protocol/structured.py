"""Structured outputs in a request body: every spelling OpenAI and vLLM clients send (:class:`StructuredFields`,
``response_format`` as pydantic models), as one :class:`engine.StructuredOutputsParams` (the engine compiles it
with xgrammar and constrains the output).

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

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import ConfigDict, Field

from engine import RequestError, StructuredOutputsParams
from serve.protocol.sampling import StrictBody
from serve.protocol.wire import ApiError, HugeInt, loads_strict

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
#: The body fields that carry a constraint, in the order they are looked at.
SOURCES = ("response_format", "structured_outputs", *GUIDED, "structural_tag")
COMPACT_DEFAULT = True


def _bad(message: str, param: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code, param)


# --------------------------------------------------------------------------- response_format (OpenAI's)


class TextFormat(StrictBody):
    type: Literal["text"]

    def spec(self) -> dict | None:
        return None


class JsonObjectFormat(StrictBody):
    type: Literal["json_object"]

    def spec(self) -> dict | None:
        return {"json_object": True}


class JsonSchema(StrictBody):
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Any = Field(None, alias="schema")
    json_schema: Any = None               # an older client's nesting of the schema
    strict: Any = None


class JsonSchemaFormat(StrictBody):
    type: Literal["json_schema"]
    json_schema: JsonSchema

    def spec(self) -> dict | None:
        js = self.json_schema
        schema = js.schema_ if js.schema_ is not None else js.json_schema
        return {"json_object": True} if schema is None else {"json": schema}


class StructuralTagFormat(StrictBody):
    """vLLM's: the structural tag itself (``format``, or the older ``structures`` + ``triggers``)."""
    model_config = ConfigDict(extra="allow")
    type: Literal["structural_tag"]

    def spec(self) -> dict | None:
        tag = dict(self.model_extra or {})
        return {"structural_tag": {"type": "structural_tag", **tag} if "format" in tag else tag}


ResponseFormat = Annotated[Union[TextFormat, JsonObjectFormat, JsonSchemaFormat, StructuralTagFormat],
                           Field(discriminator="type")]


class StructuredFields(StrictBody):
    """The fields a constraint can come from (at most one per request) and vLLM's backend switch."""
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[dict] = None       # its keys: StructuredOutputsParams' (the engine checks them)
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Optional[Literal["xgrammar", "auto"]] = None    # the one backend here
    structural_tag: Any = None

    def constraint_source(self) -> str | None:
        """The body field a constraint came from (names the param of a refusal the engine finds later)."""
        return next((name for name in SOURCES if getattr(self, name) is not None
                     and not isinstance(getattr(self, name), TextFormat)), None)

    def constraint(self) -> StructuredOutputsParams | None:
        """The request's constraint as engine params, or None. Two sources are a 400 naming the second; one
        xgrammar cannot compile is refused at submit (the engine's RequestError ``invalid_structured_outputs``)."""
        found: list[tuple[str, dict]] = []
        for name in SOURCES:
            value = getattr(self, name)
            if value is None:
                continue
            spec = value.spec() if name == "response_format" else dict(value) if name == "structured_outputs" \
                else {GUIDED[name]: value} if name in GUIDED else {"structural_tag": value}
            if spec is not None:
                found.append((name, spec))
        if len(found) > 1:
            raise _bad(f"{found[1][0]} cannot be combined with {found[0][0]}: give one structured-output constraint",
                       found[1][0])
        if not found:
            return None
        name, spec = found[0]
        spec = _parsed(name, spec)
        spec.setdefault("disable_any_whitespace", COMPACT_DEFAULT)
        try:
            return StructuredOutputsParams.of(spec)
        except (RequestError, TypeError) as e:
            message = str(e)
            if name != "structured_outputs":       # say it in the client's own field's terms
                message = f"{name}: {message}"
            raise _bad(message, name) from None


def _parsed(name: str, spec: dict) -> dict:
    """``spec`` with a schema or tag given as JSON text parsed (the body's rules); a HugeInt in it refused. By
    hand: the JSON text inside a field is held to the body's strict-JSON rules (loads_strict), and a schema is
    free-form (any JSON), so no model can say that an integer deep inside it is too long
    (tests/service/entrypoints/test_service_structured.py, the hostile-schema cases)."""
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
