"""The grammar that makes ``tool_choice: "required"`` or a named function a valid call whatever the model's
weights: Qwen3's hermes format around a JSON schema of the call.

The call's schema is ``{"name": const, "arguments": the tool's parameters}`` (``required``: any of the tools,
``anyOf`` of one such schema per tool). A tool's parameters keep their own scope there: each local ``$ref``
(``#``, ``#/$defs/...``, any ``#/...`` pointer, as pydantic's nested models write them) is rewritten to point
where the parameters now sit (``#/properties/arguments/...``, ``#/anyOf/i/properties/arguments/...``).
xgrammar writes it as EBNF with compact separators (``", "`` and ``": "``, the form Qwen3's template writes
calls in), and the grammar wraps it in the tags::

    root ::= call ("\\n" call)*           (one call when parallel_tool_calls is false, or a named function)
    call ::= "<tool_call>\\n" call_json "\\n</tool_call>"

It goes to the engine as ``structured_outputs={"grammar": ...}`` (engine/sampling/structured.py), which masks
every token the grammar does not allow and finishes the request when the grammar is complete. The tool
parser (serve/protocol/tool_parser.py) then reads the calls back. As vLLM for required and named choices,
no server flag is needed.

The grammar is built when the request is parsed, before admission: a tool whose parameters xgrammar cannot
take (an unsupported type, a ``$ref`` that does not resolve or only loops, an invalid ``pattern``, a ``pattern``
whose ``minLength`` / ``maxLength`` cannot hold (engine/sampling/string_bounds.py), an integer
too long for any field) is a 400 naming ``tools[i].function.parameters``.
"""
from __future__ import annotations

import json
import re

from engine.sampling import json_strings, string_bounds
from serve.protocol.wire import ApiError

_ROOT = re.compile(r"(?<![\w-])root(?![\w-])")
#: Keywords whose values are data, not schemas: a "$ref" inside them is not a reference.
_DATA = frozenset({"const", "enum", "default", "examples"})
#: Keywords whose values map names (any names, "const" too) to schemas.
_NAMED = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def in_scope(schema, base: str):
    """``schema`` with its local ``$ref`` pointers (``#`` or ``#/...``) moved under the JSON pointer ``base``
    (``#/properties/arguments``): the references a schema makes to itself, valid again once it is nested."""
    if isinstance(schema, list):
        return [in_scope(x, base) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in _NAMED and isinstance(v, dict):
            out[k] = {name: in_scope(sub, base) for name, sub in v.items()}
        else:
            out[k] = v if k in _DATA else in_scope(v, base)
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = base + ref[1:]
    return out


def call_schema(tool: dict, at: str = "#") -> dict:
    """One tool's call as a JSON schema: its name as a constant, its parameters as the arguments; ``at``: the
    pointer of this schema in the whole (its parameters' references are rewritten to stay in their scope)."""
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": fn["name"]},
                                             "arguments": in_scope(params, at + "/properties/arguments")},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_call_grammar(tools: list[dict], choice: "str | dict", parallel: bool = True) -> str:
    """EBNF (xgrammar's dialect) for ``choice`` (``required`` or ``{type: function, function: {name}}``) over
    ``tools``: one or more hermes blocks (one for a named function or ``parallel=False``)."""
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        chosen = [t for t in tools if t["function"]["name"] == name]
        parallel = False
    else:
        chosen = list(tools)
    if len(chosen) == 1:
        schema = call_schema(chosen[0])
    else:
        schema = {"anyOf": [call_schema(t, f"#/anyOf/{i}") for i, t in enumerate(chosen)]}
    try:
        ebnf = _ebnf(schema)
    except _REFUSED:
        raise _refusal(tools, chosen) from None
    body = _ROOT.sub("call_json", ebnf)
    root = 'root ::= call ("\\n" call)*' if parallel else "root ::= call"
    return f'{root}\ncall ::= "<tool_call>\\n" call_json "\\n</tool_call>"\n{body}'


#: What xgrammar (and json.dumps, on a HugeInt) raise for a schema they cannot take.
_REFUSED = (RuntimeError, ValueError, TypeError, RecursionError)


def _ebnf(schema: dict) -> str:
    """The schema's EBNF, its length-bounded strings kept free of raw control characters (json_strings.py) and
    a pattern's length bounds kept (string_bounds.py)."""
    import xgrammar

    schema, bounded = string_bounds.bound(schema)
    ebnf = str(xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
    return json_strings.guard(string_bounds.splice(ebnf, bounded))


def _refusal(tools: list[dict], chosen: list[dict]) -> ApiError:
    """The 400 naming the first chosen tool whose call schema xgrammar refuses on its own."""
    from engine.sampling.structured import XGR_PREFIX

    for tool in chosen:
        try:
            _ebnf(call_schema(tool))
        except _REFUSED as e:
            at = f"tools[{tools.index(tool)}].function.parameters"
            message = XGR_PREFIX.sub("", " ".join(str(e).split())).replace("#/properties/arguments", "#")
            message = message.replace("at properties.arguments.", "at ").replace("at properties.arguments:",
                                                                                   "at the root:")[:300]
            return ApiError(400, f"{at} cannot be compiled to a grammar: {message}", "invalid_value", at)
    return ApiError(400, "the tools cannot be compiled to one grammar of calls", "invalid_value", "tool_choice")
