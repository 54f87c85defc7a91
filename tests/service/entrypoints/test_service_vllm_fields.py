"""vLLM's request fields, each honoured or refused (serve/protocol/vllm_fields.py, docs/OPENAI.md "vLLM fields"),
through the official ``openai`` client (``extra_body``) where it applies: return_token_ids, continuous usage
stats, prompt_logprobs, assistant prefill, chat echo, allowed_token_ids, truncate_prompt_tokens,
return_tokens_as_token_ids; every other vLLM field a 400 naming it; int64 seeds; completions' max_tokens
default 16; one validator for /generate and the OpenAI routes (a table of bad values on all three)."""
from __future__ import annotations

import pytest
from service_fixtures import openai_client, post, serving, settle_after

from labkit.load.trace import token_ids
from serve.protocol import vllm_fields as vf
from serve.protocol.requests import DEFAULT_COMPLETION_TOKENS

openai = pytest.importorskip("openai")
MAX_MODEL_LEN = 64
USER = [{"role": "user", "content": "Say hello"}]
PREFILL = [*USER, {"role": "assistant", "content": "Hello wor"}]


def ids(name: str, n: int = 12) -> list[int]:
    return token_ids(4, name, n)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    yield from serving(tiny_model_dir, record=False, max_active=4, queue_size=16, max_model_len=MAX_MODEL_LEN,
                       worker_id="vllm-fields")


_idle = settle_after("server")


@pytest.fixture(scope="module")
def api(server):
    return openai_client(server.url, timeout=60)


def _extra(obj, name):
    return obj.model_dump()[name] if hasattr(obj, "model_dump") else obj[name]


GREEDY = dict(temperature=0, max_tokens=4)


# --------------------------------------------------------------------------- return_token_ids, usage stats


def test_return_token_ids_completions_and_chat_stream_and_not(api, server):
    p = ids("rti")
    out = api.completions.create(model="tiny", prompt=p, **GREEDY, extra_body={"ignore_eos": True,
                                                                                  "return_token_ids": True})
    choice = out.choices[0].model_dump()
    assert choice["prompt_token_ids"] == p and len(choice["token_ids"]) == out.usage.completion_tokens == 4
    chunks = list(api.completions.create(model="tiny", prompt=p, stream=True, **GREEDY,
                                         extra_body={"ignore_eos": True, "return_token_ids": True}))
    dumped = [ch.choices[0].model_dump() for ch in chunks if ch.choices]
    assert [t for d in dumped for t in (d.get("token_ids") or [])] == choice["token_ids"]
    assert dumped[0]["prompt_token_ids"] == p and all(d.get("prompt_token_ids") is None for d in dumped[1:])
    chat = api.chat.completions.create(model="tiny", messages=USER, **GREEDY,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    body = chat.model_dump()
    tok = server.worker.tokenizer
    want = tok.encode(tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True))   # the template's default
    assert body["prompt_token_ids"] == list(want) and len(body["choices"][0]["token_ids"]) == 4
    stream = [c.model_dump() for c in api.chat.completions.create(
        model="tiny", messages=USER, stream=True, **GREEDY, extra_body={"ignore_eos": True, "return_token_ids": True})]
    assert stream[0]["prompt_token_ids"] == list(want)
    assert [t for c in stream for ch in c["choices"] for t in (ch.get("token_ids") or [])] == \
        body["choices"][0]["token_ids"]
    plain = api.completions.create(model="tiny", prompt=p, **GREEDY, extra_body={"ignore_eos": True})
    assert "token_ids" not in plain.choices[0].model_dump() or plain.choices[0].model_dump()["token_ids"] is None


def test_continuous_usage_stats_on_every_chunk(api):
    chunks = list(api.completions.create(
        model="tiny", prompt=ids("cus"), stream=True, temperature=0, max_tokens=5,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "stream_options": {
            "include_usage": True, "continuous_usage_stats": True}}))
    usages = [c.usage for c in chunks]
    assert all(u is not None for u in usages)
    done = [u.completion_tokens for u in usages]
    assert done == sorted(done) and done[-1] == 5 and done[0] < 5
    assert {u.prompt_tokens for u in usages} == {12}


def test_continuous_usage_stats_without_include_usage_is_accepted_and_adds_no_usage(api):
    """vLLM's rule: continuous usage only where include_usage is on; with it off the request is served as usual."""
    chunks = list(api.completions.create(
        model="tiny", prompt=ids("cux"), stream=True, temperature=0, max_tokens=3,
        extra_body={"ignore_eos": True, "stream_options": {"include_usage": False, "continuous_usage_stats": True}}))
    assert chunks and all(c.usage is None for c in chunks)
    assert sum(len(c.choices[0].text) > 0 for c in chunks if c.choices) >= 1


# --------------------------------------------------------------------------- prompt_logprobs


def test_prompt_logprobs_in_vllms_shape_match_echo(api, server):
    p = ids("plp")
    out = api.completions.create(model="tiny", prompt=p, temperature=0, max_tokens=1,
                                 extra_body={"prompt_logprobs": 2})
    plp = out.choices[0].model_dump()["prompt_logprobs"]
    assert len(plp) == len(p) and plp[0] is None
    echo = api.completions.create(model="tiny", prompt=p, temperature=0, max_tokens=1, echo=True, logprobs=2)
    echoed = echo.choices[0].logprobs.token_logprobs[:len(p)]
    for pos in range(1, len(p)):
        entry = plp[pos][str(p[pos])]
        assert entry["logprob"] == pytest.approx(echoed[pos], abs=1e-5) and entry["rank"] >= 1
        assert entry["decoded_token"] == server.worker.tokenizer.decode([p[pos]])
        assert sum(1 for v in plp[pos].values() if v["rank"] <= 2) >= 2      # the two alternatives, ranked
    two = api.completions.create(model="tiny", prompt=p, temperature=0, max_tokens=1, n=2,
                                 extra_body={"prompt_logprobs": 2}).model_dump()["choices"]
    assert two[0]["prompt_logprobs"] == two[1]["prompt_logprobs"] == plp           # a prompt's, for every sample
    chat = api.chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=1,
                                       extra_body={"prompt_logprobs": 0})
    cp = chat.model_dump()["prompt_logprobs"]
    assert cp[0] is None and all(len(d) == 1 for d in cp[1:])
    status, err = post(server, "/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True})
    assert status == 400 and err["error"]["param"] == "prompt_logprobs"
    status, err = post(server, "/v1/completions", {"prompt": "hi", "prompt_logprobs": -1})
    assert status == 400 and err["error"]["param"] == "prompt_logprobs"


# --------------------------------------------------------------------------- the chat template's fields


def test_assistant_prefill_continues_the_last_message_and_echo(api, server):
    tok = server.worker.tokenizer
    body = dict(model="tiny", messages=PREFILL, **GREEDY)
    extra = {"ignore_eos": True, "return_token_ids": True, "add_generation_prompt": False,
             "continue_final_message": True}
    out = api.chat.completions.create(**body, extra_body=extra).model_dump()
    want = tok.encode(tok.apply_chat_template(PREFILL, tokenize=False, add_generation_prompt=False,
                                              continue_final_message=True))
    assert out["prompt_token_ids"] == list(want) and tok.decode(want).endswith("Hello wor")
    echoed = api.chat.completions.create(**body, extra_body={**extra, "echo": True}).model_dump()
    text = out["choices"][0]["message"]["content"]
    assert echoed["choices"][0]["message"]["content"] == "Hello wor" + text
    plain = api.chat.completions.create(model="tiny", messages=USER, **GREEDY,
                                        extra_body={"ignore_eos": True, "echo": True})
    same = api.chat.completions.create(model="tiny", messages=USER, **GREEDY, extra_body={"ignore_eos": True})
    assert plain.choices[0].message.content == same.choices[0].message.content     # a user turn: nothing echoed
    status, err = post(server, "/v1/chat/completions", {"messages": PREFILL, "continue_final_message": True})
    assert status == 400 and err["error"]["param"] == "continue_final_message"


# --------------------------------------------------------------------------- prompt and sampling fields


def test_allowed_token_ids_mask_the_output(api, server):
    allowed = [11, 220, 1000, 4242]
    out = api.completions.create(model="tiny", prompt=ids("ati"), temperature=1.0, max_tokens=6, seed=3,
                                 extra_body={"ignore_eos": True, "allowed_token_ids": allowed,
                                             "return_token_ids": True})
    got = out.choices[0].model_dump()["token_ids"]
    assert len(got) == 6 and set(got) <= set(allowed)
    status, err = post(server, "/v1/completions", {"prompt": "hi", "allowed_token_ids": [1, 10 ** 7]})
    assert status == 400 and err["error"]["param"] == "allowed_token_ids"
    status, err = post(server, "/v1/chat/completions", {"messages": USER, "allowed_token_ids": []})
    assert status == 400 and err["error"]["param"] == "allowed_token_ids"


def test_truncate_prompt_tokens_keeps_the_last_or_first_k(api, server):
    p = ids("tpt")
    for side, want in (("left", p[-5:]), ("right", p[:5])):
        out = api.completions.create(model="tiny", prompt=p, **GREEDY, extra_body={
            "ignore_eos": True, "truncate_prompt_tokens": 5, "truncation_side": side, "return_token_ids": True})
        assert out.usage.prompt_tokens == 5 and out.choices[0].model_dump()["prompt_token_ids"] == want
    status, err = post(server, "/v1/completions", {"prompt": p, "truncate_prompt_tokens": MAX_MODEL_LEN + 1})
    assert status == 400 and err["error"]["param"] == "truncate_prompt_tokens"


def test_return_tokens_as_token_ids_in_logprobs(api):
    out = api.completions.create(model="tiny", prompt=ids("rta"), **GREEDY, logprobs=1,
                                 extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True,
                                             "return_token_ids": True})
    toks = out.choices[0].logprobs.tokens
    assert toks == [f"token_id:{t}" for t in out.choices[0].model_dump()["token_ids"]]
    chat = api.chat.completions.create(model="tiny", messages=USER, **GREEDY, logprobs=True,
                                       extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    assert all(e.token.startswith("token_id:") for e in chat.choices[0].logprobs.content)


# --------------------------------------------------------------------------- refused, seeds, defaults

#: a well-formed value of each refused vLLM field that is not its no-op
REFUSED_VALUES = {"prompt_embeds": "AAAA", "cache_salt": "salt", "kv_transfer_params": {"a": 1},
                  "ec_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1}, "mm_processor_kwargs": {"a": 1},
                  "media_io_kwargs": {"a": {}}, "logits_processors": ["x"], "logprob_token_ids": [1],
                  "min_characters": 5, "thinking_token_budget": 10, "repetition_detection": {"n": 2},
                  "watermarking": True, "stream_interval": 4, "return_prompt_text": True,
                  "return_token_offsets": True, "return_mm_kwargs": False, "routed_experts_prompt_start": 2,
                  "priority": 1, "include_reasoning": False}


def test_every_other_vllm_field_is_refused_naming_it_and_its_noop_accepted(server):
    assert set(REFUSED_VALUES) == set(vf.REFUSED)
    for name, value in REFUSED_VALUES.items():
        for path, base in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": USER})):
            status, err = post(server, path, {**base, "max_tokens": 1, name: value})
            assert (status, err["error"]["param"], err["error"]["code"]) == (400, name, "unsupported_parameter"), err
    noops = {name: noops[0] for name, (noops, _, _) in vf.REFUSED.items() if noops}
    status, out = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, **noops, "session_id": "s"})
    assert status == 200, out


def test_seeds_are_int64_without_folding(server):
    for seed in (2 ** 63, -(2 ** 63) - 1):
        status, err = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "seed": seed})
        assert status == 400 and err["error"]["param"] == "seed", err
    outs = []
    for seed in (2 ** 63 - 1, -(2 ** 63), -1):
        status, out = post(server, "/v1/completions", {"prompt": ids("seed"), "max_tokens": 4, "seed": seed,
                                                       "ignore_eos": True, "return_token_ids": True})
        assert status == 200, out
        outs.append(out["choices"][0]["token_ids"])
    assert outs[0] != outs[1] or outs[1] != outs[2]           # distinct seeds, not folded onto one


def test_completions_default_max_tokens_is_16(api):
    out = api.completions.create(model="tiny", prompt=ids("d16"), extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == DEFAULT_COMPLETION_TOKENS == 16


# --------------------------------------------------------------------------- one validator

BAD = [("top_p", -1), ("top_p", 0), ("top_k", "x"), ("top_k", -2), ("min_p", 2), ("logit_bias", "x"),
       ("logit_bias", {"a": 1}), ("logit_bias", {"5": 101}), ("logit_bias", {str(i): 1 for i in range(1025)}),
       ("presence_penalty", 3), ("repetition_penalty", 0), ("min_tokens", -1), ("allowed_token_ids", "x"),
       ("seed", 2 ** 64), ("seed", "1"), ("temperature", -1)]


def test_generate_refuses_bad_sampling_values_as_the_openai_routes(server):
    for name, value in BAD:
        seen = set()
        for path, base in (("/generate", {"prompt_token_ids": ids("bad"), "stream": False}),
                           ("/v1/completions", {"prompt": ids("bad")}), ("/v1/chat/completions", {"messages": USER})):
            status, err = post(server, path, {**base, "max_tokens": 2, name: value})
            assert status == 400 and err["error"]["param"] == name, (path, name, value, err)
            seen.add((err["error"]["code"], err["error"]["message"]))
        assert len(seen) == 1, (name, value, seen)                # the same refusal, word for word
    status, out = post(server, "/generate", {"prompt_token_ids": ids("ok"), "stream": False, "max_tokens": 3,
                                             "temperature": 1.0, "top_k": 1, "seed": 1})
    status2, out2 = post(server, "/generate", {"prompt_token_ids": ids("ok"), "stream": False, "max_tokens": 3})
    assert status == status2 == 200 and out["token_ids"] == out2["token_ids"]      # top_k 1 is greedy: honoured


RANGES = [("top_p", 0), ("top_k", -2), ("min_p", 2), ("presence_penalty", 3), ("frequency_penalty", -2.5),
          ("repetition_penalty", 0), ("logit_bias", {"5": 101}), ("logit_bias", {str(i): 1 for i in range(1025)}),
          ("allowed_token_ids", []), ("min_tokens", 3)]


def test_a_value_out_of_range_is_refused_in_the_engines_words(server):
    """A sampling range is stated once, by SamplingParams: the 400 names the field and says the engine's message."""
    from engine import RequestError, SamplingParams

    for name, value in RANGES:
        arg = {int(k): b for k, b in value.items()} if name == "logit_bias" else value
        with pytest.raises(RequestError) as e:
            SamplingParams(max_tokens=2, **{name: arg})
        for path, base in (("/generate", {"prompt_token_ids": ids("rng"), "stream": False}),
                           ("/v1/chat/completions", {"messages": USER})):
            status, err = post(server, path, {**base, "max_tokens": 2, name: value})
            assert status == 400, (path, name, err)
            assert (err["error"]["param"], err["error"]["code"], err["error"]["message"]) == \
                (name, "invalid_value", str(e.value)), (path, name)
    with pytest.raises(RequestError) as e:                  # completions' logprobs is SamplingParams.logprobs
        SamplingParams(max_tokens=2, logprobs=21)
    status, err = post(server, "/v1/completions", {"prompt": ids("rng"), "max_tokens": 2, "logprobs": 21})
    assert (status, err["error"]["param"], err["error"]["message"]) == (400, "logprobs", str(e.value))


# --------------------------------------------------------------------------- vLLM's metric names


def _scrape(server) -> dict[tuple[str, str], float]:
    """/metrics' vLLM samples: (sample name, finished_reason or "") -> value, for this server's model_name."""
    import json
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{server.url}/v1/models", timeout=30) as r:
        name = json.loads(r.read())["data"][0]["id"]            # the served model name
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("vllm:") and s.labels.get("model_name") == name:
                if "le" not in s.labels:
                    out[(s.name, s.labels.get("finished_reason", ""))] = s.value
    return out


def test_vllm_metric_names_move_with_a_request(server):
    before = _scrape(server)
    p, n = ids("metrics", 20), 5
    status, out = post(server, "/v1/completions", {"prompt": p, "max_tokens": n, "ignore_eos": True})
    assert status == 200, out
    after = _scrape(server)

    def moved(name, reason=""):
        return after[(name, reason)] - before.get((name, reason), 0.0)

    assert moved("vllm:prompt_tokens_total") == len(p) and moved("vllm:generation_tokens_total") == n
    assert moved("vllm:request_success_total", "length") == 1 and moved("vllm:request_success_total", "stop") == 0
    assert moved("vllm:time_to_first_token_seconds_count") == 1 and moved("vllm:inter_token_latency_seconds_count") == n - 1
    assert moved("vllm:e2e_request_latency_seconds_count") == 1 and moved("vllm:request_queue_time_seconds_count") == 1
    assert moved("vllm:e2e_request_latency_seconds_sum") >= moved("vllm:time_to_first_token_seconds_sum") > 0
    assert moved("vllm:request_prompt_tokens_sum") == len(p) and moved("vllm:request_generation_tokens_sum") == n
    assert moved("vllm:prefix_cache_queries_total") == len(p)
    assert 0 <= moved("vllm:prefix_cache_hits_total") <= len(p) and moved("vllm:num_preemptions_total") == 0
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert (gauge, "") in after


def test_vllm_gauges_show_a_request_in_flight(server):
    from engine import SamplingParams

    worker = server.worker
    handle = worker.submit(ids("gauge"), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    try:
        next(e for e in handle.events() if e["event"] == "token")
        worker.pause()
        worker.run_on_owner(lambda e: None)              # at a boundary, its last step published
        mid = _scrape(server)
    finally:
        worker.resume()
    assert mid[("vllm:num_requests_running", "")] == 1 and mid[("vllm:num_requests_waiting", "")] == 0
    assert mid[("vllm:kv_cache_usage_perc", "")] > 0
    assert handle.wait(60)["reason"] == "length"
    worker.run_on_owner(lambda e: None)
    end = _scrape(server)
    assert end[("vllm:num_requests_running", "")] == 0 and end[("vllm:kv_cache_usage_perc", "")] == 0
