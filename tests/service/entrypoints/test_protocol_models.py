"""The request bodies as pydantic models (serve/protocol): pydantic's first error is one 400 naming the field as
the client wrote it, inside nested objects too; types are strict at every depth; null is absent and unknown
fields are ignored at every depth. No server: the parse functions the routes call."""
from __future__ import annotations

import pytest

from serve.protocol.requests import Limits, parse_chat, parse_completion, parse_native
from serve.protocol.wire import ApiError

LIMITS = Limits(64, "tiny")
USER = [{"role": "user", "content": "hi"}]


def refusal(parse, body: dict) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse(body, LIMITS)
    return e.value


@pytest.mark.parametrize("parse,body,param,code", [
    (parse_completion, {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage", "invalid_type"),
    (parse_completion, {"prompt": "hi", "response_format": {"type": "json_schema"}}, "response_format.json_schema",
     "invalid_value"),
    (parse_completion, {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"name": 3}}},
     "response_format.json_schema.name", "invalid_type"),
    (parse_chat, {"messages": [{"role": "user", "content": "x", "name": 5}]}, "messages[0].name", "invalid_type"),
    (parse_chat, {"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
     "messages[0].tool_calls[0].function.name", "invalid_value"),
    (parse_native, {"messages": [USER[0], 7]}, "messages[1]", "invalid_type"),
    (parse_chat, {"messages": [{"role": "user"}]}, "messages[0].content", "invalid_type"),
    (parse_chat, {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls",
     "invalid_value"),
], ids=["stream_options", "json_schema-missing", "json_schema-name", "message-name", "call-name", "message-item",
        "no-content", "user-tool_calls"])
def test_a_nested_field_is_named_as_the_client_wrote_it(parse, body, param, code):
    err = refusal(parse, body)
    assert (err.status, err.param, err.code) == (400, param, code), err.message
    assert err.message.startswith(param) and "\n" not in err.message


def test_null_is_absent_and_unknown_fields_are_ignored_inside_objects_too():
    req = parse_chat({"messages": [{"role": "user", "content": "hi", "no_such": 1, "name": None}], "stream": True,
                      "stream_options": {"include_usage": None, "no_such": 2}, "n": None}, LIMITS)
    assert req.prompt.messages == [{"role": "user", "content": "hi"}] and not req.include_usage and req.n == 1


@pytest.mark.parametrize("parse,body", [
    (parse_completion, {"model": "other", "prompt": "hi", "stop": [{"x": 1}]}),
    (parse_chat, {"model": "other", "messages": "hi", "top_p": "x"}),
    (parse_chat, {"model": "other", "messages": USER, "suffix": "x"}),
], ids=["completions", "chat", "chat-refused-field"])
def test_another_model_is_404_before_any_400_of_the_body(parse, body):
    err = refusal(parse, body)
    assert (err.status, err.code, err.param) == (404, "model_not_found", "model"), err.message


ODD_VALUES = [True, 0, -1, 2 ** 70, 1.5, "", "x", [], [1], ["a"], [[]], [{}], {}, {"a": 1}, {"type": "x"},
              [{"role": "user"}], {"[key]": {"type": None}}]


def test_any_odd_value_in_any_field_is_a_4xx_or_accepted_never_another_exception():
    """Every field the three models know, and a few they do not, each given each odd value (a HugeInt too): the
    parse answers or raises ApiError 4xx, never anything else (which the server would answer with a 500)."""
    from serve.protocol.requests import ChatCompletionRequest, CompletionRequest, GenerateRequest
    from serve.protocol.wire import loads_strict

    huge = loads_strict(b"1" + b"0" * 60)
    routes = ((parse_native, GenerateRequest, {"prompt": "hi"}), (parse_completion, CompletionRequest, {"prompt": "hi"}),
              (parse_chat, ChatCompletionRequest, {"messages": USER}))
    for parse, model, base in routes:
        for name in [*model.model_fields, "no_such_field"]:
            for value in [*ODD_VALUES, huge]:
                try:
                    parse({**base, name: value}, LIMITS)
                except ApiError as e:
                    assert 400 <= e.status < 500 and e.message and "\n" not in e.message, (name, value, e.message)


@pytest.mark.parametrize("parse,body,says", [
    (parse_completion, {"prompt": "hi", "stop": 5}, "stop must be a string or a list of strings, got 5"),
    (parse_chat, {"messages": USER, "tool_choice": 5},
     "tool_choice must be none, auto, required or {type: function, function: {name}}, got 5"),
    (parse_chat, {"messages": [{"role": "user", "content": 5}]},
     "messages[0].content must be a string or a list of text parts, got 5"),
], ids=["stop", "tool_choice", "content"])
def test_a_field_of_several_types_says_all_of_them(parse, body, says):
    err = refusal(parse, body)
    assert (err.code, err.message) == ("invalid_type", says)
