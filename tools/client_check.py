#!/usr/bin/env python3
"""Real OpenAI clients against a running `labkit serve`: the official ``openai`` client, langchain-openai and
litellm, used as their users use them (chat and completions, streams, structured outputs, tools).

The clients are not in the project's environment (CI does not install them), so this script runs from a
virtual environment of its own, against a server started from the checkout:

    python3 -m venv /tmp/clients && /tmp/clients/bin/pip install openai langchain-openai litellm
    python -c "from pathlib import Path; from labkit.assets.synth import synth_model; \\
               synth_model('tiny', Path('/tmp/tiny'), seed=0)"
    python -m labkit serve --model /tmp/tiny --port 8871 --served-model-name tiny --reasoning-parser qwen3
    /tmp/clients/bin/python tools/client_check.py --base-url http://127.0.0.1:8871/v1

The tiny synthetic model's weights are random: every check bounds its output (max_tokens, enums, ranges,
maxLength) and checks shapes and constraints, never meaning. Prints one line per check (PASS / FAIL and why),
then the passes and failures per client; exit status 1 when any check failed. ``--only openai,litellm`` runs
some clients only.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
import warnings
from typing import Callable, Literal

from pydantic import BaseModel, Field

CHECKS: dict[str, list[tuple[str, Callable]]] = {"openai": [], "langchain": [], "litellm": []}
CHAT = [{"role": "user", "content": "hi"}]


def check(client: str):
    """Register the decorated function as one of ``client``'s checks."""
    def add(fn: Callable) -> Callable:
        CHECKS[client].append((fn.__name__, fn))
        return fn
    return add


# --------------------------------------------------------------------------- schemas and tools

class Pick(BaseModel):
    color: Literal["red", "green"]
    n: int = Field(ge=0, le=9)


class Code(BaseModel):
    code: str = Field(pattern=r"^[a-z]+$", min_length=2, max_length=4)


class Mail(BaseModel):
    email: str = Field(pattern=r"^\w+@\w+\.com$", max_length=16)


class Item(BaseModel):
    name: str = Field(max_length=6)
    qty: int = Field(ge=1, le=9)


class Order(BaseModel):
    """Order items."""
    item: Item
    rush: bool


class GetWeather(BaseModel):
    """The weather in a city."""
    city: str = Field(max_length=6)
    unit: Literal["C", "F"]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two digits",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                                    "b": {"type": "integer", "minimum": 0, "maximum": 9}},
                   "required": ["a", "b"], "additionalProperties": False}}}


def weather_ok(args: dict) -> bool:
    return set(args) == {"city", "unit"} and len(args["city"]) <= 6 and args["unit"] in ("C", "F")


def add_ok(args: dict) -> bool:
    return set(args) == {"a", "b"} and all(isinstance(args[k], int) and 0 <= args[k] <= 9 for k in "ab")


def expect(cond: bool, what) -> None:
    if not cond:
        raise AssertionError(str(what)[:400])


# --------------------------------------------------------------------------- the official openai client

def _openai(ctx):
    import openai
    return openai.OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0, timeout=120)


@check("openai")
def chat_completion(ctx):
    out = _openai(ctx).chat.completions.create(model=ctx.model, messages=CHAT, max_tokens=8, seed=1)
    c = out.choices[0]
    expect(isinstance(c.message.content, str) and c.finish_reason in ("stop", "length"), c)
    expect(out.usage.completion_tokens == 8 or c.finish_reason == "stop", out.usage)


@check("openai")
def completion(ctx):
    out = _openai(ctx).completions.create(model=ctx.model, prompt="Hello", max_tokens=6, n=2, seed=2)
    expect(len(out.choices) == 2 and all(isinstance(c.text, str) for c in out.choices), out)


@check("openai")
def chat_stream_with_usage(ctx):
    chunks = list(_openai(ctx).chat.completions.create(model=ctx.model, messages=CHAT, max_tokens=8, stream=True,
                                                       stream_options={"include_usage": True}))
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    expect(finish in (["length"], ["stop"]), finish)
    expect(chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0, chunks[-1])


@check("openai")
def completion_stream(ctx):
    chunks = list(_openai(ctx).completions.create(model=ctx.model, prompt="Hello", max_tokens=6, stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    expect(isinstance(text, str) and chunks[-1].choices[0].finish_reason in ("stop", "length"), chunks[-1])


@check("openai")
def response_format_json_schema(ctx):
    rf = {"type": "json_schema", "json_schema": {"name": "pick", "schema": Pick.model_json_schema(), "strict": True}}
    out = _openai(ctx).chat.completions.create(model=ctx.model, messages=CHAT, max_tokens=40, response_format=rf)
    Pick.model_validate_json(out.choices[0].message.content)


@check("openai")
def response_format_json_schema_stream(ctx):
    rf = {"type": "json_schema", "json_schema": {"name": "pick", "schema": Pick.model_json_schema()}}
    chunks = _openai(ctx).chat.completions.create(model=ctx.model, messages=CHAT, max_tokens=40, response_format=rf,
                                                  stream=True)
    Pick.model_validate_json("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))


def _parse(client):
    return getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse


@check("openai")
def parse_pydantic_model(ctx):
    out = _parse(_openai(ctx))(model=ctx.model, messages=CHAT, max_tokens=40, response_format=Pick)
    expect(isinstance(out.choices[0].message.parsed, Pick), out.choices[0].message)


@check("openai")
def parse_pattern_with_length_bounds(ctx):
    out = _parse(_openai(ctx))(model=ctx.model, messages=CHAT, max_tokens=40, response_format=Code)
    code = out.choices[0].message.parsed
    expect(isinstance(code, Code) and 2 <= len(code.code) <= 4, out.choices[0].message)


@check("openai")
def parse_two_part_pattern_with_max_length(ctx):
    out = _parse(_openai(ctx))(model=ctx.model, messages=CHAT, max_tokens=40, response_format=Mail)
    mail = out.choices[0].message.parsed
    expect(isinstance(mail, Mail) and len(mail.email) <= 16, out.choices[0].message)


def expect_tool_calls(c):
    """A choice that ends in tool calls, each of a known tool with arguments it takes."""
    expect(c.finish_reason == "tool_calls" and c.message.tool_calls, c)
    for tc in c.message.tool_calls:
        args = json.loads(tc.function.arguments)
        expect(weather_ok(args) if tc.function.name == "get_weather" else add_ok(args), tc)


@check("openai")
def tools_required(ctx):
    out = _openai(ctx).chat.completions.create(model=ctx.model, messages=CHAT, max_tokens=120, tools=[WEATHER, ADD],
                                               tool_choice="required", seed=3)
    expect_tool_calls(out.choices[0])


@check("openai")
def tools_named(ctx):
    out = _openai(ctx).chat.completions.create(model=ctx.model, messages=CHAT, max_tokens=120, tools=[WEATHER, ADD],
                                               tool_choice={"type": "function", "function": {"name": "add"}})
    c = out.choices[0]
    expect(c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c)
    expect(c.message.tool_calls[0].function.name == "add" and add_ok(json.loads(
        c.message.tool_calls[0].function.arguments)), c)


@check("openai")
def tools_streamed_deltas(ctx):
    chunks = _openai(ctx).chat.completions.create(model=ctx.model, messages=CHAT, max_tokens=120, tools=[WEATHER],
                                                  tool_choice="required", stream=True, parallel_tool_calls=False)
    calls: dict[int, dict] = {}
    content, finish = "", None
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            one = calls.setdefault(tc.index, {"id": None, "name": "", "args": ""})
            one["id"] = one["id"] or tc.id
            one["name"] += (tc.function.name or "") if tc.function else ""
            one["args"] += (tc.function.arguments or "") if tc.function else ""
        finish = ch.choices[0].finish_reason or finish
    expect(finish == "tool_calls" and len(calls) == 1 and not content, (finish, calls, content))
    one = calls[0]
    expect(one["id"] and one["name"] == "get_weather" and weather_ok(json.loads(one["args"])), one)


@check("openai")
def pydantic_function_tool_nested(ctx):
    import openai
    tool = openai.pydantic_function_tool(Order)
    expect("$defs" in json.dumps(tool) or "$ref" in json.dumps(tool), tool)
    out = _openai(ctx).chat.completions.create(model=ctx.model, messages=CHAT, max_tokens=160, tools=[tool],
                                               tool_choice="required")
    c = out.choices[0]
    expect(c.finish_reason == "tool_calls", c)
    Order.model_validate_json(c.message.tool_calls[0].function.arguments)


@check("openai")
def parse_with_pydantic_function_tool(ctx):
    import openai
    out = _parse(_openai(ctx))(model=ctx.model, messages=CHAT, max_tokens=160, tools=[openai.pydantic_function_tool(
        Order)], tool_choice={"type": "function", "function": {"name": "Order"}})
    tc = out.choices[0].message.tool_calls[0]
    expect(isinstance(tc.function.parsed_arguments, Order), tc)


@check("openai")
def stream_helper_with_tools(ctx):
    import openai
    with _openai(ctx).chat.completions.stream(model=ctx.model, messages=CHAT, max_tokens=160, tools=[
            openai.pydantic_function_tool(Order)], tool_choice="required") as stream:
        kinds = {event.type for event in stream}
        final = stream.get_final_completion()
    expect("tool_calls.function.arguments.done" in kinds, kinds)
    expect(isinstance(final.choices[0].message.tool_calls[0].function.parsed_arguments, Order), final)


@check("openai")
def tool_result_round_trip(ctx):
    client = _openai(ctx)
    first = client.chat.completions.create(model=ctx.model, messages=CHAT, max_tokens=120, tools=[WEATHER],
                                           tool_choice="required", parallel_tool_calls=False).choices[0].message
    tc = first.tool_calls[0]
    messages = CHAT + [first.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": tc.id, "content": "sunny"}]
    out = client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=6, tools=[WEATHER])
    expect(out.choices[0].finish_reason in ("stop", "length", "tool_calls"), out)


@check("openai")
def tools_auto_cut_by_max_tokens(ctx):
    client = _openai(ctx)
    for max_tokens in (1, 2, 3, 5):
        c = client.chat.completions.create(model=ctx.model, messages=CHAT, max_tokens=max_tokens, tools=[WEATHER],
                                           seed=max_tokens).choices[0]
        expect("<tool" not in (c.message.content or "") and not (c.message.content or "").endswith("<"), c)


@check("openai")
def models_list(ctx):
    ids = [m.id for m in _openai(ctx).models.list()]
    expect(ctx.model in ids, ids)


# --------------------------------------------------------------------------- langchain-openai

def _lc(ctx, **kw):
    from langchain_openai import ChatOpenAI
    return ChatOpenAI(model=ctx.model, base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0, **kw)


@check("langchain")
def invoke(ctx):
    msg = _lc(ctx, max_tokens=8).invoke("hi")
    expect(isinstance(msg.content, str) and msg.response_metadata.get("finish_reason") in ("stop", "length"), msg)


@check("langchain")
def stream(ctx):
    parts = list(_lc(ctx, max_tokens=8).stream("hi"))
    expect(parts and all(isinstance(p.content, str) for p in parts), parts)


@check("langchain")
def bind_tools_required(ctx):
    msg = _lc(ctx, max_tokens=120).bind_tools([GetWeather], tool_choice="required").invoke("weather?")
    expect(len(msg.tool_calls) >= 1 and msg.tool_calls[0]["name"] == "GetWeather", msg)
    GetWeather.model_validate(msg.tool_calls[0]["args"])


@check("langchain")
def bind_tools_named(ctx):
    msg = _lc(ctx, max_tokens=160).bind_tools([GetWeather, Order], tool_choice="Order").invoke("order")
    expect(len(msg.tool_calls) == 1 and msg.tool_calls[0]["name"] == "Order", msg)
    Order.model_validate(msg.tool_calls[0]["args"])


@check("langchain")
def bind_tools_streamed(ctx):
    chunks = list(_lc(ctx, max_tokens=120).bind_tools([GetWeather], tool_choice="required").stream("weather?"))
    msg = chunks[0]
    for ch in chunks[1:]:
        msg = msg + ch
    expect(len(msg.tool_calls) >= 1, msg)
    GetWeather.model_validate(msg.tool_calls[0]["args"])


@check("langchain")
def tool_message_round_trip(ctx):
    from langchain_core.messages import HumanMessage, ToolMessage
    llm = _lc(ctx, max_tokens=120)
    first = llm.bind_tools([GetWeather], tool_choice="required").invoke([HumanMessage("weather?")])
    call = first.tool_calls[0]
    msg = llm.bind_tools([GetWeather]).invoke([HumanMessage("weather?"), first,
                                               ToolMessage(content="sunny", tool_call_id=call["id"])], max_tokens=6)
    expect(isinstance(msg.content, str), msg)


@check("langchain")
def structured_output_json_schema(ctx):
    out = _lc(ctx, max_tokens=40).with_structured_output(Pick, method="json_schema").invoke("pick")
    expect(isinstance(out, Pick), out)


@check("langchain")
def structured_output_function_calling(ctx):
    out = _lc(ctx, max_tokens=120).with_structured_output(Pick, method="function_calling").invoke("pick")
    expect(isinstance(out, Pick), out)


@check("langchain")
def structured_output_streamed(ctx):
    parts = list(_lc(ctx, max_tokens=40).with_structured_output(Pick, method="json_schema").stream("pick"))
    expect(parts and isinstance(parts[-1], Pick), parts)


@check("langchain")
def structured_output_include_raw(ctx):
    out = _lc(ctx, max_tokens=120).with_structured_output(Order, method="function_calling",
                                                          include_raw=True).invoke("order")
    expect(isinstance(out["parsed"], Order) and out["parsing_error"] is None, out)


@check("langchain")
def batch_and_ainvoke(ctx):
    import asyncio
    llm = _lc(ctx, max_tokens=4)
    outs = llm.batch(["a", "b", "c"])
    msg = asyncio.run(llm.ainvoke("d"))
    expect(len(outs) == 3 and isinstance(msg.content, str), outs)


# --------------------------------------------------------------------------- litellm

def _litellm(ctx, **kw):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")      # no fetch of its price list
    import litellm
    litellm.suppress_debug_info = True
    return litellm.completion(model=f"openai/{ctx.model}", api_base=ctx.base_url, api_key=ctx.api_key,
                              num_retries=0, **kw)


@check("litellm")
def completion_basic(ctx):
    out = _litellm(ctx, messages=CHAT, max_tokens=8)
    expect(isinstance(out.choices[0].message.content, str), out)


@check("litellm")
def completion_stream(ctx):
    parts = list(_litellm(ctx, messages=CHAT, max_tokens=8, stream=True))
    expect(parts and parts[-1].choices[0].finish_reason in ("stop", "length"), parts[-1])


@check("litellm")
def tools_required(ctx):
    out = _litellm(ctx, messages=CHAT, max_tokens=120, tools=[WEATHER, ADD], tool_choice="required")
    expect_tool_calls(out.choices[0])


@check("litellm")
def tools_named(ctx):
    out = _litellm(ctx, messages=CHAT, max_tokens=120, tools=[WEATHER, ADD],
                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    tc = out.choices[0].message.tool_calls[0]
    expect(tc.function.name == "get_weather" and weather_ok(json.loads(tc.function.arguments)), tc)


@check("litellm")
def tools_streamed(ctx):
    import litellm
    parts = list(_litellm(ctx, messages=CHAT, max_tokens=120, tools=[WEATHER], tool_choice="required", stream=True))
    msg = litellm.stream_chunk_builder(parts, messages=CHAT).choices[0].message
    expect(msg.tool_calls and weather_ok(json.loads(msg.tool_calls[0].function.arguments)), msg)


@check("litellm")
def tool_result_round_trip(ctx):
    first = _litellm(ctx, messages=CHAT, max_tokens=120, tools=[WEATHER], tool_choice="required").choices[0].message
    messages = CHAT + [first.model_dump(), {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "ok"}]
    out = _litellm(ctx, messages=messages, max_tokens=6, tools=[WEATHER])
    expect(isinstance(out.choices[0].message.content, (str, type(None))), out)


@check("litellm")
def response_format_pydantic(ctx):
    out = _litellm(ctx, messages=CHAT, max_tokens=40, response_format=Pick)
    Pick.model_validate_json(out.choices[0].message.content)


@check("litellm")
def text_completion(ctx):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm
    out = litellm.text_completion(model=f"openai/{ctx.model}", api_base=ctx.base_url, api_key=ctx.api_key,
                                  prompt="Hello", max_tokens=6)
    expect(isinstance(out.choices[0].text, str), out)


# --------------------------------------------------------------------------- run

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8871/v1")
    ap.add_argument("--model", default="tiny", help="the served model name")
    ap.add_argument("--api-key", default="x")
    ap.add_argument("--only", default="", help="comma list of clients (openai, langchain, litellm)")
    ap.add_argument("-v", "--verbose", action="store_true", help="a failure's traceback")
    ctx = ap.parse_args()
    warnings.filterwarnings("ignore", module="pydantic")        # langchain's own serializer warnings
    clients = [c for c in ctx.only.split(",") if c] or list(CHECKS)
    counts = {}
    for client in clients:
        passed = failed = 0
        for name, fn in CHECKS[client]:
            try:
                fn(ctx)
            except Exception as e:                    # every failure is reported, the run goes on
                failed += 1
                print(f"FAIL {client}.{name}: {type(e).__name__}: {' '.join(str(e).split())[:300]}", flush=True)
                if ctx.verbose:
                    traceback.print_exc()
            else:
                passed += 1
                print(f"PASS {client}.{name}", flush=True)
        counts[client] = (passed, failed)
    print()
    for client, (passed, failed) in counts.items():
        print(f"{client:10s} {passed:3d} passed {failed:3d} failed of {passed + failed}")
    return 1 if any(f for _, f in counts.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
