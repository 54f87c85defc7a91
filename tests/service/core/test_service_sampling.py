"""Sampling on the OpenAI routes through the official ``openai`` client (sync and async, stream and not):
n choices with distinct seeds, logprobs objects in OpenAI's shapes with the values of the teacher-forced
log-softmax, echo with prompt log-probs, the sampling parameters reaching the engine, and every
out-of-range value a 400 naming its parameter."""
from __future__ import annotations

import asyncio

import pytest
import torch
from service_fixtures import openai_client, post, serving, settle_after
from testkit import forced_logits

from engine import LLMEngine
from labkit.load.trace import token_ids

openai = pytest.importorskip("openai")
MAX_MODEL_LEN = 64
PROMPT = token_ids(4, "sampling", 12)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    yield from serving(tiny_model_dir, record=False, max_active=8, queue_size=32, max_num_seqs=8,
                       max_model_len=MAX_MODEL_LEN, worker_id="samp-test")


_idle = settle_after("server")


@pytest.fixture(scope="module")
def api(server):
    return openai_client(server.url, timeout=60)


@pytest.fixture(scope="module")
def reference(engine_factory) -> LLMEngine:
    return engine_factory(max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=256)


def forced_logprobs(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(forced_logits(engine, ids), dim=-1)


def tok_ids(tokenizer, texts: list[str]) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(t))[0] for t in texts]


# --------------------------------------------------------------------------- completions


def test_completions_logprobs_shape_and_values(api, server, reference):
    out = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0.9, seed=3, logprobs=3,
                                 extra_body={"ignore_eos": True, "repetition_penalty": 1.2, "top_k": 30})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    assert all(len(d) in (3, 4) for d in lp.top_logprobs)               # 3 alternatives, the chosen one added
    # vLLM's order: the chosen token first, then the alternatives
    assert all(next(iter(d)) == t and d[t] == pytest.approx(v) for d, t, v in zip(lp.top_logprobs, lp.tokens,
                                                                                  lp.token_logprobs))
    # the values: the teacher-forced log-softmax of the chosen tokens (vLLM's raw_logprobs)
    tok = server.worker.tokenizer
    ids = list(PROMPT)
    for text, value in zip(lp.tokens, lp.token_logprobs):
        ref = forced_logprobs(reference, ids)
        near = torch.nonzero((ref - value).abs() < 2e-4).flatten().tolist()
        matches = [i for i in near if tok.decode([i]) == text]
        assert matches, (text, value)
        ids.append(matches[0])


def test_completions_echo_returns_the_prompt_and_its_logprobs(api, server, reference):
    text = "The sky is"
    out = api.completions.create(model="tiny", prompt=text, max_tokens=2, temperature=0, logprobs=1, echo=True,
                                 extra_body={"ignore_eos": True})
    c = out.choices[0]
    assert c.text.startswith(text)
    prompt_ids = server.worker.tokenizer.encode(text)
    lp = c.logprobs
    assert len(lp.tokens) == len(prompt_ids) + 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p in range(1, len(prompt_ids)):
        ref = forced_logprobs(reference, prompt_ids[:p])[prompt_ids[p]].item()
        assert lp.token_logprobs[p] == pytest.approx(ref, abs=2e-4)
    plain = api.completions.create(model="tiny", prompt=text, max_tokens=2, temperature=0, echo=True,
                                   extra_body={"ignore_eos": True})
    assert plain.choices[0].text == c.text and plain.choices[0].logprobs is None


def test_n_gives_n_distinct_choices_seeded_reproducibly(api):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    out = api.completions.create(n=3, **kw)
    texts = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(out.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert len(set(texts)) == 3
    again = api.completions.create(n=3, **kw)
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts
    single = api.completions.create(**{**kw, "seed": 12})             # sample 1 is seed + 1
    assert single.choices[0].text == texts[1]
    assert out.usage.prompt_tokens == len(PROMPT) and out.usage.completion_tokens == 18


def test_n_with_several_prompts_orders_choices_prompt_major(api):
    out = api.completions.create(model="tiny", prompt=[PROMPT, PROMPT[:6]], n=2, max_tokens=2, temperature=0,
                                 extra_body={"ignore_eos": True})
    by = {c.index: c.text for c in out.choices}
    assert sorted(by) == [0, 1, 2, 3] and by[0] == by[1] and by[2] == by[3]       # greedy: siblings agree


def test_stream_with_n_and_logprobs_carries_index_and_logprobs(api):
    stream = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=1.0, seed=2, n=3,
                                    logprobs=2, stream=True, extra_body={"ignore_eos": True})
    texts: dict[int, str] = {}
    counts: dict[int, int] = {}
    for ch in stream:
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.logprobs is not None:
                counts[c.index] = counts.get(c.index, 0) + len(c.logprobs.tokens)
    assert sorted(texts) == [0, 1, 2] and counts == {0: 3, 1: 3, 2: 3}
    whole = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=1.0, seed=2, n=3,
                                   extra_body={"ignore_eos": True})
    assert {c.index: c.text for c in whole.choices} == texts


# --------------------------------------------------------------------------- chat


def test_chat_logprobs_shape_sync_and_stream(api):
    msgs = [{"role": "user", "content": "hi"}]
    out = api.chat.completions.create(model="tiny", messages=msgs, max_tokens=3, temperature=0, logprobs=True,
                                      top_logprobs=2, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 3
    for item in content:
        assert isinstance(item.logprob, float) and item.bytes == list(item.token.encode("utf-8"))
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)       # greedy: the top one
    assert "".join(i.token for i in content) == out.choices[0].message.content
    stream = api.chat.completions.create(model="tiny", messages=msgs, max_tokens=3, temperature=0, logprobs=True,
                                         top_logprobs=2, stream=True, extra_body={"ignore_eos": True})
    streamed = [i for ch in stream for c in ch.choices if c.logprobs for i in c.logprobs.content]
    assert [(i.token, round(i.logprob, 4)) for i in streamed] == [(i.token, round(i.logprob, 4)) for i in content]
    none = api.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, temperature=0)
    assert none.choices[0].logprobs is None


def test_chat_n_async_stream_and_not(server):
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)
    msgs = [{"role": "user", "content": "tell me"}]

    async def go():
        whole = await client.chat.completions.create(model="tiny", messages=msgs, n=3, max_tokens=5, seed=4,
                                                     temperature=1.0, top_p=0.95, extra_body={"ignore_eos": True})
        stream = await client.chat.completions.create(model="tiny", messages=msgs, n=3, max_tokens=5, seed=4,
                                                      temperature=1.0, top_p=0.95, stream=True,
                                                      extra_body={"ignore_eos": True})
        parts: dict[int, str] = {}
        async for ch in stream:
            for c in ch.choices:
                parts[c.index] = parts.get(c.index, "") + (c.delta.content or "")
        await client.close()
        return {c.index: c.message.content for c in whole.choices}, parts

    whole, parts = asyncio.run(go())
    assert sorted(whole) == [0, 1, 2] and len(set(whole.values())) == 3
    assert parts == whole


# --------------------------------------------------------------------------- the parameters reach the engine


def test_logit_bias_string_keys_force_a_token_and_min_tokens_holds_eos(api, server):
    tok = server.worker.tokenizer
    forced = tok.encode(" hello")[0]
    out = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=1.0,
                                 logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    assert out.choices[0].text == tok.decode([forced] * 3)
    eos = server.worker.engine.config.eos_token_ids[0]
    early = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                   logit_bias={str(eos): 100})
    assert early.usage.completion_tokens == 1 and early.choices[0].finish_reason == "stop"
    held = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                  logit_bias={str(eos): 100}, extra_body={"min_tokens": 2})
    assert held.usage.completion_tokens == 3 and held.choices[0].finish_reason == "stop"


def test_sampling_parameters_change_the_draw(api):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    base = api.completions.create(**kw).choices[0].text
    for extra in ({"top_p": 1e-6}, {"extra_body": {"ignore_eos": True, "top_k": 1}},
                  {"extra_body": {"ignore_eos": True, "min_p": 1.0}}):
        greedyish = api.completions.create(**{**kw, **extra}).choices[0].text
        greedy = api.completions.create(**{**kw, "temperature": 0}).choices[0].text
        assert greedyish == greedy != base, extra          # each truncation to the top token is the argmax


# --------------------------------------------------------------------------- out of range: 400 naming it

OUT_OF_RANGE = [
    ("top_p", 0), ("top_p", 1.01), ("top_p", "x"), ("top_k", -2), ("top_k", 2.5), ("min_p", -0.1), ("min_p", 1.5),
    ("presence_penalty", 2.1), ("presence_penalty", -2.1), ("frequency_penalty", 3), ("repetition_penalty", 0),
    ("repetition_penalty", -1), ("logit_bias", {"5": 101}), ("logit_bias", {"x": 1}), ("logit_bias", "x"),
    ("logit_bias", {"999999999": 1}), ("logit_bias", {"-3": 1}), ("min_tokens", -1), ("min_tokens", 9),
    ("n", 0), ("n", 129), ("n", 1.5), ("best_of", 2), ("logprobs", 21), ("logprobs", -1), ("logprobs", True),
    ("seed", 1.5), ("stop_token_ids", [10 ** 7]), ("stop_token_ids", [-1]), ("echo", "yes"),
]


@pytest.mark.parametrize("name,value", OUT_OF_RANGE, ids=[f"{n}={v}" for n, v in OUT_OF_RANGE])
def test_completions_out_of_range_values_are_400_naming_the_parameter(server, name, value):
    status, err = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, name: value})
    assert status == 400 and err["error"]["param"] == name, err
    assert name in err["error"]["message"]


CHAT_OUT_OF_RANGE = [("logprobs", 2), ("top_logprobs", 21), ("top_logprobs", 3), ("top_p", -1), ("n", 0),
                     ("logit_bias", {"1": -101}), ("stop_token_ids", [-1])]


@pytest.mark.parametrize("name,value", CHAT_OUT_OF_RANGE, ids=[f"{n}={v}" for n, v in CHAT_OUT_OF_RANGE])
def test_chat_out_of_range_values_are_400_naming_the_parameter(server, name, value):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, name: value}
    status, err = post(server, "/v1/chat/completions", body)
    assert status == 400 and err["error"]["param"] == name, err


def test_min_tokens_above_the_filled_context_is_400_naming_it(server):
    status, err = post(server, "/v1/completions", {"prompt": PROMPT, "min_tokens": MAX_MODEL_LEN})
    assert status == 400 and err["error"]["param"] == "min_tokens", err


def test_the_official_client_sees_400_for_a_bad_value(api):
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, top_p=1.5)
    assert e.value.body["param"] == "top_p"
