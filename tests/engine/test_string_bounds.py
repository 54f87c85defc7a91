"""A string schema's pattern and length bounds bounded whole (engine/sampling/string_bounds.py): the rewritten
pattern, or the grammar of its own, matches exactly the strings of the original whose length is within the
bounds."""
from __future__ import annotations

import itertools
import re

import pytest

from engine.sampling.string_bounds import bound, splice


def rewritten(pattern: str, **bounds) -> str:
    out, grammars = bound({"type": "string", "pattern": pattern, **bounds})
    assert "minLength" not in out and "maxLength" not in out and not grammars, out
    return out["pattern"]


@pytest.mark.parametrize("pattern, bounds, expected", [
    (r"^[a-z]+$", {"minLength": 3, "maxLength": 5}, "[a-z]{3,5}"),
    (r"^[A-Z]{2}-\d+$", {"maxLength": 6}, r"[A-Z]{2}-\d{1,3}"),
    (r"(foo|[a-z]+)", {"maxLength": 2}, "[a-z]{1,2}"),
    (r"a|bc|d+", {"minLength": 2, "maxLength": 4}, "(?:bc|d{2,4})"),
    (r"(ab)+", {"maxLength": 5}, "(?:ab){1,2}"),
    (r"[\]\[^-]*\.", {"minLength": 2}, r"[\]\[\^\-]+\."),
    (r"^\d{4}$", {"minLength": 1, "maxLength": 9}, r"^\d{4}$"),          # already within: kept as written
], ids=["class", "fixed-and-varying", "choice", "choice-dropped", "group", "escapes", "within"])
def test_rewrites(pattern, bounds, expected):
    assert rewritten(pattern, **bounds) == expected


@pytest.mark.parametrize("pattern, lo, hi", [(r"[ab]+c", 2, 3), (r"(x|yz|w*)", 1, 2), (r"a{1,4}-b", 4, None),
                                             (r"(c|ab*)z", 2, 3)])
def test_the_rewrite_is_the_intersection(pattern, lo, hi):
    bounds = {"minLength": lo, **({"maxLength": hi} if hi is not None else {})}
    new = rewritten(pattern, **bounds)
    for n in range(0, 7):
        for chars in itertools.product("abcxyzw-", repeat=n):
            s = "".join(chars)
            want = bool(re.fullmatch(pattern, s)) and lo <= n and (hi is None or n <= hi)
            assert bool(re.fullmatch(new, s)) == want, (s, new)


@pytest.mark.parametrize("pattern, lo, hi", [(r"^\w+@\w+\.c$", 0, 6), (r"[a-c]+-[a-c]*", 2, 4),
                                             (r"(a|bc)+", 3, 5), (r"a*b*c*", 2, None), (r"(ab?)+c", 0, 4)])
def test_a_grammar_of_its_own_is_the_intersection(pattern, lo, hi):
    """Patterns no narrowing bounds: their grammar, compiled by xgrammar, against re.fullmatch on every string of
    up to 7 characters over the pattern's own alphabet."""
    import json

    import xgrammar as xgr

    bounds = {"minLength": lo, **({"maxLength": hi} if hi is not None else {})}
    schema, grammars = bound({"type": "string", "pattern": pattern, **bounds})
    assert len(grammars) == 1 and "minLength" not in schema and "maxLength" not in schema, schema
    grammar = xgr.Grammar.from_ebnf(splice(str(xgr.Grammar.from_json_schema(json.dumps(schema))), grammars))
    alphabet = sorted(set(re.sub(r"\\w", "a", pattern)) & set("abcom@.-_"))
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(['"', *alphabet]))
    compiled = compiler.compile_grammar(grammar)
    for n in range(0, 8):
        for chars in itertools.product(alphabet, repeat=n):
            s = "".join(chars)
            want = bool(re.fullmatch(pattern, s)) and lo <= n and (hi is None or n <= hi)
            m = xgr.GrammarMatcher(compiled)
            got = m.accept_string('"' + s) and m.accept_string('"')
            assert got == want, (s, pattern)


@pytest.mark.parametrize("pattern, bounds, says", [
    (r"(?i)a+", {"maxLength": 8}, "inline flags"),
    (r"(a)\1+", {"maxLength": 8}, "back references are not supported"),
    ("a{4294967295}", {"maxLength": 8}, "not a regular expression Python reads"),
    (r"^[0-9]{4}$", {"minLength": 5}, "matches no string of length 5 or more"),
    (r"^a+b+$", {"maxLength": 1}, "matches no string of length 0 to 1"),
    (r"^\w+@\w+$", {"maxLength": 5000}, "grammar states"),
    (r"^.+ .+$", {"maxLength": 100}, "units of compile work"),
], ids=["flags", "backref", "overflow", "disjoint", "disjoint-grammar", "too-many-states", "too-costly"])
def test_refusals_name_the_string(pattern, bounds, says):
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern, **bounds}}}
    with pytest.raises(ValueError, match="at properties.s: ") as e:
        bound(schema)
    assert says in str(e.value)


def test_data_and_other_types_are_left_alone():
    schema = {"type": "object", "properties": {"n": {"type": "integer", "pattern": "a+", "maxLength": 2}},
              "default": {"type": "string", "pattern": "a+", "maxLength": 2},
              "enum": [{"type": "string", "pattern": "a+", "maxLength": 2}]}
    assert bound(schema) == (schema, {}) and bound(schema)[0] is schema
