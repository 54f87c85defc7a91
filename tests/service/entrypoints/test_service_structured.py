"""Structured outputs through the server (serve/protocol/structured.py): OpenAI's response_format, vLLM's
structured_outputs, guided_* and structural_tag, on completions, chat and /generate, through the official
``openai`` client and langchain-openai. The tiny model is random: bounded schemas, so it must finish."""
from __future__ import annotations

import json
import re

import pytest
from service_fixtures import openai_client, post, serving, settle_after

openai = pytest.importorskip("openai")

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["color", "n"], "additionalProperties": False}
CHAT = [{"role": "user", "content": "pick a color"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    yield from serving(tiny_model_dir, record=False, max_active=4, queue_size=16, max_model_len=256,
                       worker_id="structured-test")


_idle = settle_after("server")


@pytest.fixture(scope="module")
def api(server):
    return openai_client(server.url, timeout=120)


def check(text: str) -> None:
    obj = json.loads(text)
    assert set(obj) == {"color", "n"} and obj["color"] in ("red", "green"), obj
    assert isinstance(obj["n"], int) and 0 <= obj["n"] <= 9, obj


def test_response_format_json_schema_on_completions_n2(api):
    rf = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}
    out = api.completions.create(model="tiny", prompt="color:", max_tokens=40, n=2, seed=3,
                                 extra_body={"response_format": rf})     # (the client has it on chat only)
    assert len(out.choices) == 2
    for c in out.choices:
        assert c.finish_reason == "stop", c
        check(c.text)


def test_structured_outputs_regex_on_a_chat_stream(api):
    chunks = list(api.chat.completions.create(model="tiny", messages=CHAT, max_tokens=30, stream=True,
                                              extra_body={"structured_outputs": {"regex": r"[a-c]{3}-\d{2}"}}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert re.fullmatch(r"[a-c]{3}-\d{2}", text), text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_legacy_guided_choice_and_native_generate(server, api):
    out = api.chat.completions.create(model="tiny", messages=CHAT, max_tokens=20, temperature=1.0,
                                      extra_body={"guided_choice": ["left", "right side"],
                                                  "guided_decoding_backend": "xgrammar"})
    assert out.choices[0].message.content in ("left", "right side")
    status, res = post(server, "/generate", {"prompt": "x", "max_tokens": 20, "stream": False,
                                             "structured_outputs": {"json_object": True}})
    assert status == 200, res
    assert isinstance(json.loads(res["text"]), dict), res


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs"),
    ({"structured_outputs": {"json": {}, "choice": ["a"]}}, "structured_outputs"),
    ({"guided_grammar": "root ::= "}, "guided_grammar"),
    ({"guided_json": SCHEMA, "response_format": {"type": "json_object"}}, "guided_json"),
    ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ({"structural_tag": "{not json"}, "structural_tag"),
], ids=["schema", "regex", "two-kinds", "grammar", "two-sources", "backend", "tag"])
def test_bad_constraints_are_400_naming_the_field(server, body, param):
    status, err = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 4, **body})
    assert status == 400 and err["error"]["param"] == param, err


DEEP_TEXT = '{"type": "object", "properties": {"a": ' * 2500 + '{"type": "integer"}' + "}}" * 2500
HUGE = {"type": "integer", "maximum": 10 ** 60}     # an integer literal no field takes (kept as a HugeInt)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": CHAT, "structured_outputs": {"json": DEEP_TEXT}}, "structured_outputs"),
    ("/v1/chat/completions", {"messages": CHAT, "guided_json": DEEP_TEXT}, "guided_json"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": DEEP_TEXT}}}, "response_format"),
    ("/generate", {"prompt": "x", "stream": False, "structured_outputs": {"json": DEEP_TEXT}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "x", "guided_json": DEEP_TEXT}, "guided_json"),
    ("/v1/completions", {"prompt": "x", "structural_tag": "[" * 5000 + "]" * 5000}, "structural_tag"),
    ("/v1/completions", {"prompt": "x", "guided_json": HUGE}, "guided_json"),
    ("/v1/completions", {"prompt": "x", "guided_json": json.dumps(HUGE)}, "guided_json"),
], ids=["structured_outputs", "guided_json", "response_format", "generate", "completions", "tag", "huge-int",
        "huge-int-text"])
def test_hostile_schema_text_is_one_400_naming_the_field(server, path, body, param):
    # a schema sent as JSON text is held to the body's own rules (depth 32, no integer of 40+ digits)
    status, err = post(server, path, {"max_tokens": 4, **body})
    assert status == 400 and err["error"]["param"] == param, err
    assert "nested too deeply (at most 32 levels)" in err["error"]["message"] or "61 digits" in err["error"]["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("extra, param", [
    ({"structured_outputs": {"regex": r"[^\s\S]"}}, "structured_outputs"),
    ({"guided_choice": ["left", "right"], "allowed_token_ids": [0, 1, 2]}, "allowed_token_ids"),
    ({"guided_choice": ["left", "right"], "min_tokens": 6}, "min_tokens"),
], ids=["empty-regex", "choice-vs-allowed", "min-tokens-past-choices"])
def test_impossible_constraints_are_refused_up_front(server, extra, param, stream):
    status, err = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 10, "stream": stream, **extra})
    assert status == 400 and err["error"]["param"] == param, err


def test_a_grammar_that_leaves_no_token_ends_without_one(api):
    # min_tokens 4 can be met ("r", "i", "g", "h", "t"), but the model may spell a choice in fewer tokens: the
    # grammar then allows only the end, which min_tokens holds back; the request ends there, its text a choice
    for seed in range(3):
        c = api.completions.create(model="tiny", prompt="x", max_tokens=12, seed=seed,
                                   extra_body={"guided_choice": ["left", "right"], "min_tokens": 4}).choices[0]
        assert c.text in ("left", "right") and c.finish_reason in ("stop", "abort"), c


def test_length_bounded_strings_stay_valid_json(server, api, tiny_model_dir):
    # xgrammar 0.2.9 lets raw control characters into a string with maxLength / minLength (upstream issue 800):
    # a tab pushed by logit_bias must stay out, so the output is JSON whatever the model prefers
    from transformers import AutoTokenizer

    tab = AutoTokenizer.from_pretrained(tiny_model_dir).encode("\t")
    assert len(tab) == 1
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 8},
                                               "t": {"type": "string", "minLength": 2, "maxLength": 4}},
              "required": ["s", "t"], "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    out = api.chat.completions.create(model="tiny", messages=CHAT, max_tokens=40, response_format=rf,
                                      logit_bias={str(tab[0]): 100})
    obj = json.loads(out.choices[0].message.content)
    assert len(obj["s"]) <= 8 and 2 <= len(obj["t"]) <= 4 and "\t" not in obj["s"] + obj["t"], obj


def _one_token(tiny_model_dir, text: str) -> int:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tiny_model_dir).encode(text)
    assert len(ids) == 1, ids
    return ids[0]


@pytest.mark.parametrize("pattern", ["^[a-z]+$", "^[a-z]+-?[a-z]*$"], ids=["narrowed", "grammar"])
def test_a_pattern_and_its_length_bounds_both_hold(server, tiny_model_dir, pattern):
    # xgrammar takes a string's pattern and drops minLength / maxLength: the bounds are written into the pattern,
    # or the string gets a grammar of its own. logit_bias pushes "a" (the string would run on past maxLength) in
    # one request, and the closing quote (it would end before minLength) in the other
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern, "minLength": 3,
                                                     "maxLength": 5}},
              "required": ["s"], "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    for pushed in ("a", '"'):
        status, res = post(server, "/v1/chat/completions", {
            "messages": CHAT, "max_tokens": 30, "response_format": rf,
            "logit_bias": {str(_one_token(tiny_model_dir, pushed)): 100}})
        assert status == 200, res
        obj = json.loads(res["choices"][0]["message"]["content"])
        assert re.fullmatch(pattern, obj["s"]) and 3 <= len(obj["s"]) <= 5, (pushed, obj)
        assert res["choices"][0]["finish_reason"] == "stop", res


@pytest.mark.parametrize("pattern, bounds, says", [
    (r"^[0-9]{4}$", {"minLength": 5}, "matches no string of length 5 or more"),
    (r"^a+b+$", {"maxLength": 1}, "matches no string of length 0 to 1"),
    ("a{4294967295}", {"maxLength": 3}, "not a regular expression Python reads"),
], ids=["disjoint", "disjoint-grammar", "repeat-overflow"])
def test_a_pattern_whose_length_bounds_cannot_hold_is_a_400(server, pattern, bounds, says):
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern, **bounds}}}
    status, err = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert status == 400 and err["error"]["param"] == "response_format", err
    assert "properties.s" in err["error"]["message"] and says in err["error"]["message"], err


def test_langchain_with_structured_output(server):
    lc = pytest.importorskip("langchain_openai")
    from typing import Literal

    from pydantic import BaseModel, Field

    class Pick(BaseModel):
        color: Literal["red", "green"]
        n: int = Field(ge=0, le=9)

    llm = lc.ChatOpenAI(model="tiny", base_url=f"{server.url}/v1", api_key="x", max_tokens=40, max_retries=0)
    pick = llm.with_structured_output(Pick, method="json_schema").invoke("pick a color")
    assert isinstance(pick, Pick) and pick.color in ("red", "green") and 0 <= pick.n <= 9
