"""loads_strict's integers: json's own int() parses a body, and any integer of more than MAX_INT_DIGITS digits
(wherever it sits: top level, a field, a list of numbers, a mixed list, deep inside) sends the body through the
parse that keeps it as a HugeInt, so its field is named in the 400; a prompt of token ids takes the fast parse."""
from __future__ import annotations

import json

import pytest

from serve.protocol import wire
from serve.protocol.wire import HugeInt, loads_strict

LONG = "1" + "0" * wire.MAX_INT_DIGITS          # 41 digits: a HugeInt
EDGE = "9" * wire.MAX_INT_DIGITS                # 40 digits: an int


@pytest.mark.parametrize("body, path", [
    (LONG, ()),
    ('{"max_tokens": %s}' % LONG, ("max_tokens",)),
    ('{"max_tokens": -%s}' % LONG, ("max_tokens",)),
    ('{"prompt_token_ids": [1, 2, %s]}' % LONG, ("prompt_token_ids", 2)),
    ('{"prompt_token_ids": [-%s, 2]}' % LONG, ("prompt_token_ids", 0)),
    ('{"logit_bias": [0.5, null, true, %s]}' % LONG, ("logit_bias", 3)),
    ('{"a": [[1], {"b": [2, %s]}, "x"]}' % LONG, ("a", 1, "b", 1)),
])
def test_a_long_integer_anywhere_is_a_huge_int(body, path):
    value = loads_strict(body.encode())
    for key in path:
        value = value[key]
    assert isinstance(value, HugeInt) and value.digits == wire.MAX_INT_DIGITS + 1


def test_forty_digits_and_token_ids_stay_ints_and_take_the_fast_parse(monkeypatch):
    calls = []
    monkeypatch.setattr(wire, "_parse_int", lambda text: calls.append(text) or int(text))
    ids = list(range(100_000, 101_152))
    body = json.dumps({"prompt_token_ids": ids, "max_tokens": int(EDGE), "nested": [[-int(EDGE)], 1.5]}).encode()
    value = loads_strict(body)
    assert value["prompt_token_ids"] == ids and value["max_tokens"] == int(EDGE)
    assert value["nested"][0] == [-int(EDGE)]
    assert calls == []                       # no integer went through the Python callback
    loads_strict(b'{"a": [1, %s]}' % LONG.encode())
    assert len(calls) == 2                   # a long one: the whole body again, each integer through it
