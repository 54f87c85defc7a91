"""vLLM's habits on the HTTP side: the model as it was given accepted as the request's ``model`` id, ``GET
/version``, ``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes."""
from __future__ import annotations

import urllib.request
import json

import pytest
from service_fixtures import MODES, post, serving, settle_after

from serve.core.worker import Worker, WorkerConfig
from serve.entrypoints.api_server import ServerThread


@pytest.fixture(scope="module", params=MODES)
def server(tiny_model_dir, request):
    """The routes read the worker's front only (its tokenizer, encode, served record): both worker kinds."""
    yield from serving(tiny_model_dir, request.param, record=False, max_active=2, queue_size=8, max_model_len=256,
                       worker_id="vllm-habits")


_idle = settle_after("server")


def get(server, path: str) -> tuple[int, dict]:
    with urllib.request.urlopen(f"{server.url}{path}", timeout=30) as resp:
        return resp.status, json.loads(resp.read())


def complete(server, model: str, **extra) -> tuple[int, dict]:
    return post(server, "/v1/completions", {"model": model, "prompt": "Hello there", "max_tokens": 2,
                                            "temperature": 0, **extra})


def test_the_model_path_it_was_started_with_is_its_id_too(server, tiny_model_dir):
    """`vllm serve PATH`: a request naming PATH is served; the answer names the served model as before."""
    status, body = complete(server, str(tiny_model_dir))
    assert status == 200, body
    assert body["model"] == "tiny"
    status, body = post(server, "/v1/chat/completions", {"model": str(tiny_model_dir), "max_tokens": 2,
                                                         "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200, body
    assert get(server, f"/v1/models/{tiny_model_dir}")[1]["id"] == "tiny"
    assert complete(server, "tiny")[0] == 200
    status, body = complete(server, str(tiny_model_dir) + "-other")
    assert status == 404 and body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"


def test_a_fetched_name_is_its_id_and_a_served_model_name_replaces_them(tiny_model_dir, monkeypatch):
    """`--model smollm2` (a name `labkit model fetch` installed): `smollm2` is an id of the served model; with
    --served-model-name only that name is (vLLM's rule)."""
    import labkit.assets.resolve as resolve
    from labkit.lab_engine import LAB_BUILDER

    monkeypatch.setattr(resolve, "_fetched_model", lambda name: tiny_model_dir if name == "smollm2" else None)
    worker = Worker(WorkerConfig(model="smollm2", device="cpu", max_model_len=256), build=LAB_BUILDER).start()
    with ServerThread(worker) as srv:
        assert complete(srv, "smollm2")[0] == 200
        assert complete(srv, "llama")[0] == 404
    worker = Worker(WorkerConfig(model=str(tiny_model_dir), device="cpu", max_model_len=256)).start()
    with ServerThread(worker, served_model_name="mine") as srv:
        assert complete(srv, "mine")[0] == 200
        assert complete(srv, str(tiny_model_dir))[0] == 404


def test_version(server):
    status, body = get(server, "/version")
    assert status == 200 and isinstance(body["version"], str) and body["version"]


def test_tokenize_counts_what_a_completion_counts_and_detokenize_inverts_it(server):
    status, body = post(server, "/tokenize", {"prompt": "Hello there, tokenizer"})
    assert status == 200, body
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == 256 and body["token_strs"] is None
    usage = post(server, "/v1/completions", {"prompt": "Hello there, tokenizer", "max_tokens": 1})[1]["usage"]
    assert usage["prompt_tokens"] == body["count"]
    assert post(server, "/detokenize", {"tokens": body["tokens"]}) == (200, {"prompt": "Hello there, tokenizer"})
    strs = post(server, "/tokenize", {"prompt": "Hello there, tokenizer", "return_token_strs": True})[1]
    assert len(strs["token_strs"]) == strs["count"] and all(isinstance(s, str) for s in strs["token_strs"])


def test_tokenize_messages_as_a_chat_prompt(server):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    status, body = post(server, "/tokenize", {"model": "tiny", "messages": msgs})
    assert status == 200, body
    usage = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1})[1]["usage"]
    assert usage["prompt_tokens"] == body["count"]
    bare = post(server, "/tokenize", {"messages": msgs, "add_generation_prompt": False})[1]
    assert bare["count"] < body["count"] and body["tokens"][:bare["count"]] == bare["tokens"]
    text = post(server, "/detokenize", {"tokens": body["tokens"]})[1]["prompt"]
    assert "What is 2+2?" in text


@pytest.mark.parametrize("path,payload,status,param", [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": ["a"]}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "prompt"),
    ("/tokenize", {"messages": "hi"}, 400, "messages"),
    ("/tokenize", {"prompt": "a", "model": "gpt-4"}, 404, "model"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/detokenize", {"tokens": [1, "2"]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10 ** 9]}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
])
def test_bad_bodies_are_one_4xx_naming_the_field(server, path, payload, status, param):
    got, body = post(server, path, payload)
    assert got == status and body["error"]["param"] == param, body
