"""A string schema's pattern and length bounds written as one pattern (engine/sampling/string_bounds.py): the
rewritten pattern matches exactly the strings of the original whose length is within the bounds."""
from __future__ import annotations

import itertools
import re

import pytest

from engine.sampling.string_bounds import bound


def rewritten(pattern: str, **bounds) -> str:
    out = bound({"type": "string", "pattern": pattern, **bounds})
    assert "minLength" not in out and "maxLength" not in out, out
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


@pytest.mark.parametrize("pattern, bounds, says", [
    (r"^\w+@\w+$", {"maxLength": 8}, "more than one part of varying length"),
    (r"(a|bc)+", {"maxLength": 8}, "repeats something of varying length"),
    (r"(?i)a+", {"maxLength": 8}, "inline flags"),
    (r"(a)\1+", {"maxLength": 8}, "not supported"),
    (r"^[0-9]{4}$", {"minLength": 5}, "matches no string of length 5 or more"),
], ids=["two-varying", "varying-repeat", "flags", "backref", "disjoint"])
def test_refusals_name_the_string(pattern, bounds, says):
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern, **bounds}}}
    with pytest.raises(ValueError, match="at properties.s: ") as e:
        bound(schema)
    assert says in str(e.value)


def test_data_and_other_types_are_left_alone():
    schema = {"type": "object", "properties": {"n": {"type": "integer", "pattern": "a+", "maxLength": 2}},
              "default": {"type": "string", "pattern": "a+", "maxLength": 2},
              "enum": [{"type": "string", "pattern": "a+", "maxLength": 2}]}
    assert bound(schema) is schema
