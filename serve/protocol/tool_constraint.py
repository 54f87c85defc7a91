"""The grammar that makes ``tool_choice: "required"`` or a named function a valid call whatever the model's
weights: Qwen3's hermes format around a JSON schema of the call.

The call's schema is ``{"name": const, "arguments": the tool's parameters}`` (``required``: any of the tools,
``anyOf`` of one such schema per tool); xgrammar writes it as EBNF with compact separators (``", "`` and
``": "``, the form Qwen3's template writes calls in), and the grammar wraps it in the tags::

    root ::= call ("\\n" call)*           (one call when parallel_tool_calls is false, or a named function)
    call ::= "<tool_call>\\n" call_json "\\n</tool_call>"

It goes to the engine as ``structured_outputs={"grammar": ...}`` (engine/sampling/structured.py), which masks
every token the grammar does not allow and finishes the request when the grammar is complete. The tool
parser (serve/protocol/tool_parser.py) then reads the calls back. As vLLM for required and named choices,
no server flag is needed.
"""
from __future__ import annotations

import json
import re

_ROOT = re.compile(r"(?<![\w-])root(?![\w-])")


def call_schema(tool: dict) -> dict:
    """One tool's call as a JSON schema: its name as a constant, its parameters as the arguments."""
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_call_grammar(tools: list[dict], choice: "str | dict", parallel: bool = True) -> str:
    """EBNF (xgrammar's dialect) for ``choice`` (``required`` or ``{type: function, function: {name}}``) over
    ``tools``: one or more hermes blocks (one for a named function or ``parallel=False``)."""
    import xgrammar

    if isinstance(choice, dict):
        name = choice["function"]["name"]
        chosen = [t for t in tools if t["function"]["name"] == name]
        parallel = False
    else:
        chosen = list(tools)
    schemas = [call_schema(t) for t in chosen]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    ebnf = str(xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
    body = _ROOT.sub("call_json", ebnf)
    root = 'root ::= call ("\\n" call)*' if parallel else "root ::= call"
    return f'{root}\ncall ::= "<tool_call>\\n" call_json "\\n</tool_call>"\n{body}'
