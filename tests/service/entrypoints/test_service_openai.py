"""The OpenAI-compatible API as OpenAI/vLLM users expect it, through the official ``openai`` client:
parameters refused or accepted as no-ops (docs/OPENAI.md), defaults, stop strings and stop token
ids, several prompts, usage, /v1/models/{id}."""
from __future__ import annotations

import random

import pytest
from testkit import wait_for
from service_fixtures import openai_client, post, ready_url, serving, settle_after

from labkit.load.trace import token_ids
from serve.protocol.requests import NOOP_PARAMS
from serve.entrypoints.detokenize import StopStrings
from serve.core.worker import Worker, WorkerConfig

openai = pytest.importorskip("openai")
MAX_MODEL_LEN = 64


def ids(name: str, n: int = 12) -> list[int]:
    return token_ids(4, name, n)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    yield from serving(tiny_model_dir, record=False, max_active=4, queue_size=16, max_model_len=MAX_MODEL_LEN,
                       worker_id="oai-test")


_idle = settle_after("server")


@pytest.fixture(scope="module")
def api(server):
    return openai_client(server.url, timeout=60)


GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


# --------------------------------------------------------------------------- refuse, never ignore

REFUSED = [
    ("best_of", 2), ("top_logprobs", 2), ("suffix", "x"),
    ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "auto"),
    ("use_beam_search", True), ("skip_special_tokens", False),
    ("bad_words", ["x"]), ("length_penalty", 0.5),
]


@pytest.mark.parametrize("name,value", REFUSED, ids=[n for n, _ in REFUSED])
def test_unimplemented_parameters_are_400_naming_them(server, name, value):
    status, err = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, name: value})
    assert status == 400 and err["error"]["param"] == name and err["error"]["code"] == "unsupported_parameter", err
    assert name in err["error"]["message"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "best_of": 3}, "best_of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]},
     "functions"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{x}}"},
     "chat_template"),
])
def test_unimplemented_on_both_routes(server, path, body, param):
    status, err = post(server, path, body)
    assert status == 400 and err["error"]["param"] == param and err["error"]["code"] == "unsupported_parameter"


NOOPS = {"top_p": 1, "top_k": -1, "min_p": 0, "presence_penalty": 0, "frequency_penalty": 0.0,
         "repetition_penalty": 1.0, "min_tokens": 0, "logit_bias": {}, "n": 1, "best_of": 1, "echo": False,
         "response_format": {"type": "text"}, "skip_special_tokens": True, "use_beam_search": False,
         "length_penalty": 1, "tools": [], "suffix": "", "logprobs": None, "user": "someone"}


def test_noop_values_are_accepted_through_the_client(api):
    extra = {k: v for k, v in NOOPS.items() if k not in ("top_p", "presence_penalty", "frequency_penalty",
                                                          "logit_bias", "n", "best_of", "echo", "suffix",
                                                          "logprobs", "user")}
    out = api.completions.create(model="tiny", prompt=ids("noop"), max_tokens=3, temperature=0, top_p=1,
                                 presence_penalty=0, frequency_penalty=0, logit_bias={}, n=1, best_of=1, echo=False,
                                 suffix="", logprobs=None, user="someone",
                                 extra_body={"ignore_eos": True, "top_k": 0, **extra})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3
    chat = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       temperature=0, top_p=1.0, n=1, logprobs=False, top_logprobs=0,
                                       response_format={"type": "text"}, tool_choice="none",
                                       extra_body={"ignore_eos": True, "add_generation_prompt": True})
    assert chat.usage.completion_tokens == 2


def test_every_refusable_parameter_has_a_refused_and_a_noop_case():
    covered = {n for n, _ in REFUSED} | {"tools", "chat_template"}
    assert set(NOOP_PARAMS) - covered <= {"functions", "function_call", "spaces_between_special_tokens",
                                          "chat_template_kwargs", "audio", "modalities", "prediction",
                                          "web_search_options"}


@pytest.mark.parametrize("name,value,code", [
    ("top_p", -1, "invalid_value"), ("top_p", 0, "invalid_value"), ("top_p", 1.5, "invalid_value"),
    ("top_p", "x", "invalid_type"), ("top_k", -2, "invalid_value"), ("min_p", 2, "invalid_value"),
    ("logit_bias", "x", "invalid_type"), ("logit_bias", {"a": 1}, "invalid_type"),
    ("logit_bias", {"5": 101}, "invalid_value"), ("temperature", -0.1, "invalid_value"),
    ("max_tokens", 0, "invalid_value"), ("presence_penalty", 3, "invalid_value"),
    ("repetition_penalty", 0, "invalid_value"), ("n", 0, "invalid_value"), ("n", "2", "invalid_type"),
    ("response_format", {"type": "yaml"}, "invalid_value"), ("stop", 5, "invalid_type"),
    ("stop", ["a", ""], "invalid_value"), ("stop_token_ids", [10 ** 7], "invalid_value"),
    ("stop_token_ids", "1", "invalid_type"), ("include_stop_str_in_output", "yes", "invalid_type"),
    ("logprobs", 50, "invalid_value"), ("echo", "no", "invalid_type"),
])
def test_out_of_range_values_are_400_naming_them(server, name, value, code):
    status, err = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, name: value})
    assert status == 400 and err["error"]["param"] == name and err["error"]["code"] == code, err


def test_unknown_fields_are_ignored_as_vllm_does(server):
    status, body = post(server, "/v1/completions", {"prompt": ids("unk"), "max_tokens": 2, "ignore_eos": True,
                                                    "no_such_field": {"x": 1}})
    assert status == 200 and body["usage"]["completion_tokens"] == 2


# --------------------------------------------------------------------------- defaults


def test_no_max_tokens_fills_the_context_on_chat_and_is_16_on_completions(api):
    out = api.completions.create(model="tiny", prompt=ids("fill", 14), **GREEDY)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == 14 and out.usage.completion_tokens == 16      # OpenAI's and vLLM's default
    chat = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], **GREEDY)
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == MAX_MODEL_LEN


def test_max_completion_tokens_is_an_alias_on_chat(api):
    chat = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       max_completion_tokens=4, **GREEDY)
    assert chat.usage.completion_tokens == 4 and chat.choices[0].finish_reason == "length"


# --------------------------------------------------------------------------- stop strings and stop token ids


def _pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(len(text) - 1, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _expected(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    hits = [(i + len(s), i, s) for s in stops if (i := text.find(s)) >= 0]     # first to complete
    if not hits:
        return text, None
    _, i, s = min(hits)
    return text[:i] + (s if include else ""), s


def test_stop_strings_never_leak_in_any_chunking():
    rng = random.Random(7)
    alphabet = "ab c\n"
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 4))]
        include = rng.random() < 0.3
        want, matched = _expected(text, stops, include)
        pieces = list(text) if rng.random() < 0.5 else _pieces(text, rng)
        st = StopStrings(stops, include)
        sent = ""
        for p in pieces:
            out = st.push(p)
            sent += out
            assert want.startswith(sent), (text, stops, pieces, sent)     # nothing sent is ever retracted
            if st.matched:
                break
        sent += st.flush()
        assert sent == want and st.matched == matched, (text, stops, pieces)


def _greedy_text(api, prompt) -> str:
    return api.completions.create(model="tiny", prompt=prompt, max_tokens=24, **GREEDY).choices[0].text


def test_stop_string_ends_stream_and_non_stream(api):
    prompt = ids("stop", 10)
    full = _greedy_text(api, prompt)
    assert len(full) > 8, full
    stop = full[len(full) // 2:len(full) // 2 + 3]
    want = full[:full.find(stop)]
    out = api.completions.create(model="tiny", prompt=prompt, max_tokens=24, stop=stop, **GREEDY)
    assert out.choices[0].text == want and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 24
    stream = list(api.completions.create(model="tiny", prompt=prompt, max_tokens=24, stop=[stop, "\x00never"],
                                         stream=True, stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in stream if c.choices) == want
    assert [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert stream[-1].usage.completion_tokens == out.usage.completion_tokens
    inc = api.completions.create(model="tiny", prompt=prompt, max_tokens=24, stop=stop,
                                 extra_body={"ignore_eos": True, "include_stop_str_in_output": True}, temperature=0)
    assert inc.choices[0].text == want + stop


def test_stop_string_on_chat_stream(api):
    msgs = [{"role": "user", "content": "count"}]
    full = api.chat.completions.create(model="tiny", messages=msgs, max_tokens=20, **GREEDY).choices[0].message.content
    stop = full[5:7]
    want = full[:full.find(stop)]
    chunks = list(api.chat.completions.create(model="tiny", messages=msgs, max_tokens=20, stop=[stop], stream=True,
                                              **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_token_ids_finish_with_stop(server, api):
    prompt = ids("stopid", 10)
    status, body = post(server, "/generate", {"prompt_token_ids": prompt, "max_tokens": 12, "ignore_eos": True,
                                              "stream": False})
    toks = body["token_ids"]
    target = toks[5]
    first = toks.index(target)
    out = api.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                 extra_body={"ignore_eos": True, "stop_token_ids": [target]})
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == first + 1


# --------------------------------------------------------------------------- API surface


def test_models_by_id(api):
    card = api.models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        api.models.retrieve("gpt-4")
    assert e.value.body["code"] == "model_not_found"


def test_a_list_of_prompts_gets_one_choice_each(api):
    prompts = [ids("pa", 8), ids("pb", 9), ids("pc", 10)]
    out = api.completions.create(model="tiny", prompt=prompts, max_tokens=3, **GREEDY)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.usage.prompt_tokens == 27 and out.usage.completion_tokens == 9
    singles = [api.completions.create(model="tiny", prompt=p, max_tokens=3, **GREEDY).choices[0].text
               for p in prompts]
    assert [c.text for c in out.choices] == singles
    stream = list(api.completions.create(model="tiny", prompt=prompts, max_tokens=3, stream=True,
                                         stream_options={"include_usage": True}, **GREEDY))
    for i, want in enumerate(singles):
        assert "".join(c.choices[0].text for c in stream if c.choices and c.choices[0].index == i) == want
    assert sorted(c.choices[0].index for c in stream if c.choices and c.choices[0].finish_reason) == [0, 1, 2]
    assert stream[-1].usage.completion_tokens == 9 and not stream[-1].choices


def test_bad_prompt_in_a_list_names_its_index(server):
    status, err = post(server, "/v1/completions", {"prompt": [[1, 2], [10 ** 7]], "max_tokens": 2})
    assert status == 400 and err["error"]["param"] == "prompt[1]"
    wait_for(lambda: server.worker.snapshot().get("active", 0) == 0 and not server.worker.pending_ids())


def test_response_fields_as_openai(api):
    out = api.completions.create(model="tiny", prompt=ids("f"), max_tokens=2, **GREEDY)
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.created > 0
    assert out.system_fingerprint and out.system_fingerprint.startswith("fp_") and out.usage is not None
    chat = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       **GREEDY)
    assert chat.id.startswith("chatcmpl-") and chat.object == "chat.completion"
    assert chat.system_fingerprint == out.system_fingerprint and chat.usage.total_tokens > 0
    chunks = list(api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2, stream=True, stream_options={"include_usage": True},
                                              **GREEDY))
    assert all(c.system_fingerprint == out.system_fingerprint and c.created > 0 for c in chunks)
    assert chunks[-1].usage.completion_tokens == 2 and all(c.usage is None for c in chunks[:-1])
    plain = list(api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=2, stream=True, **GREEDY))
    assert all(c.usage is None and c.choices for c in plain)


def test_access_log_line_per_request(api, caplog):
    with caplog.at_level("INFO", logger="labkit.access"):
        api.completions.create(model="tiny", prompt=ids("log"), max_tokens=2, **GREEDY)
        with pytest.raises(openai.BadRequestError):
            api.completions.create(model="tiny", prompt="hi", max_tokens=2, top_p=1.5)
    lines = [r.getMessage() for r in caplog.records if r.name == "labkit.access"]
    assert any("status=200" in x and "prompt_tokens=12" in x and "output_tokens=2" in x and "ttft=" in x
               and "total=" in x for x in lines), lines
    assert any("status=400" in x and "top_p" in x for x in lines), lines


def test_null_is_absent_and_metadata_fields_are_accepted(server):
    from serve.protocol.requests import IGNORED_PARAMS

    body = {"prompt": ids("null"), "max_tokens": 2, "ignore_eos": True, **{k: None for k in NOOP_PARAMS},
            **{k: None for k in IGNORED_PARAMS}, "metadata": {"a": "b"}, "store": False, "parallel_tool_calls": True}
    status, out = post(server, "/v1/completions", body)
    assert status == 200 and out["usage"]["completion_tokens"] == 2, out


# --------------------------------------------------------------------------- the CLI's vLLM habits


def test_serve_positional_model_logs_access_and_stats_lines(tiny_model_dir, tmp_path):
    import re
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "labkit", "serve", str(tiny_model_dir), "--port", "0",
                             "--device", "cpu", "--max-model-len", "128", "--log-level", "info",
                             "--stats-interval", "0.2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = []
        url = ready_url(proc, seen=seen)
        assert url, "".join(seen)
        cli = openai_client(url, timeout=60)
        out = cli.completions.create(model=cli.models.list().data[0].id, prompt=ids("cli", 10), max_tokens=40,
                                     temperature=0, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 40
        while not any("labkit.stats:" in x for x in seen):    # the next tick reports the tokens just made
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        rest = proc.stdout.read()      # not communicate(): it reads the pipe past what readline() buffered
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(seen) + rest
    assert re.search(r"labkit\.access: completions \S+ status=200 prompt_tokens=10 output_tokens=40 ttft=[\d.]+ms "
                     r"total=[\d.]+ms", text), text
    assert re.search(r"labkit\.stats: prompt throughput: [\d.]+ tokens/s, generation throughput: [\d.]+ tokens/s, "
                     r"running: \d+ reqs, waiting: \d+ reqs, KV cache usage: [\d.]+%", text), text


def test_serve_refuses_two_different_models(cli_app, tiny_model_dir):
    from typer.testing import CliRunner

    result = CliRunner().invoke(cli_app, ["serve", str(tiny_model_dir), "--model", "/elsewhere", "--port", "0"])
    assert result.exit_code != 0 and "two models" in result.output


def test_client_streams_text_as_it_arrives(server, cli_app):
    from typer.testing import CliRunner

    result = CliRunner().invoke(cli_app, ["client", "--endpoints", server.url, "--prompt", "Hello", "--max-tokens",
                                          "5", "--ignore-eos", "--request-id", "cli-stream"])
    assert result.exit_code == 0, result.output
    status, body = post(server, "/generate", {"prompt": "Hello", "max_tokens": 5, "ignore_eos": True,
                                              "stream": False})
    assert result.output.startswith(body["text"] + "\n")      # the text first, as it streamed, then the table


def test_client_import_path_has_no_torch_or_engine():
    import subprocess
    import sys

    # of the engine, only its option table (engine/args.py: the flags' spellings and help) and its errors
    options_only = {"engine", "engine.args", "engine.errors"}
    code = ("import sys; import labkit.cli; import labkit.cli.service; import labkit.console; "
            "import labkit.load.client; "
            f"bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'engine', 'transformers') "
            f"and m not in {sorted(options_only)}]; print(bad); "
            "sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "labkit", "client", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0
    imported = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines() if "|" in line}
    assert "torch" not in imported and {m for m in imported if m.split(".")[0] == "engine"} <= options_only


# --------------------------------------------------------------------------- serve defaults


def test_serve_defaults_per_device():
    from serve.entrypoints.launch import serve_defaults

    assert serve_defaults("cuda") == serve_defaults("cuda:1") == dict(
        enforce_eager=False, max_num_seqs=256, max_num_batched_tokens=16384, max_active=256, max_model_len="auto",
        overlap=True, engine_process=True)
    assert serve_defaults("cpu") == dict(enforce_eager=True, max_num_seqs=8, max_num_batched_tokens=512, max_active=8,
                                         max_model_len=1024, overlap=False, engine_process=False)


def test_auto_context_is_fitted_to_the_kv_pool_in_one_build(tiny_model_dir, monkeypatch):
    """max_model_len "auto": the engine caps the model's context at what its pool holds while sizing it; the
    worker is built once (the old path built a second engine with the cap)."""
    import engine.llm_engine as le
    from serve.entrypoints.launch import fitted_context

    builds = []
    real_init = le.LLMEngine.__init__
    monkeypatch.setattr(le.LLMEngine, "__init__", lambda self, *a, **k: (builds.append(1), real_init(self, *a, **k))[1])
    cfg = WorkerConfig(model=str(tiny_model_dir), device="cpu", max_model_len="auto", num_kvcache_blocks=2,
                       worker_id="fit")
    w = Worker(cfg).start()
    try:
        model_len, pool = w.served.config.shape.max_position_embeddings, w.served.pool_tokens
        assert model_len > pool, "the tiny model's context must exceed a 2-block pool for this test"
        why = fitted_context(w)
        assert w.served.max_model_len == pool == w.config.max_model_len
        assert w.config.max_prompt_bytes == max(16 * 1024, 32 * pool)
        assert f"capped by the KV pool ({pool} tokens); the model allows {model_len}" in why
        assert len(builds) == 1
    finally:
        w.close()
