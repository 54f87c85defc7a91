"""The HTTP front over loopback (127.0.0.1): bad input, routes, OpenAI client, ports, close, the serve and
client commands. The contract checks that hold with the engine in-process and in an engine process alike
(NDJSON stream, cancel, overload, faults, health, metrics, raw SSE) run over both modes in
test_service_engine_process.py."""
from __future__ import annotations

import asyncio
import json
import socket

import pytest
from service_fixtures import body, ids, openai_client, ready_url, run, serving, settle_after, with_session

from serve.errors import ServeError
from labkit.load import client
from serve.entrypoints.api_server import ServerThread, bind_socket
from serve.core.worker import Worker, WorkerConfig

MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    yield from serving(tiny_model_dir, worker_id="http-test", server_kw={"max_body_bytes": 64 * 1024})


_idle = settle_after("server")


def test_port_zero_prints_a_real_url(server):
    assert server.url.startswith("http://127.0.0.1:") and not server.url.endswith(":0")


def test_generate_non_stream_and_text_prompt(server):
    async def go(sess):
        async with sess.post(f"{server.url}/generate", json={"prompt": "Hello", "max_tokens": 4, "stream": False,
                                                             "ignore_eos": True}) as resp:
            return resp.status, await resp.json()

    status, out = run(with_session(go))
    assert status == 200 and len(out["token_ids"]) == 4 and out["finished"]["reason"] == "length"


def test_client_records_both_observers(server):
    recorded: list[dict] = []
    res = run(with_session(lambda s: client.stream_native(s, server.url, body("obs-1", 4), record=recorded.append)))
    assert res.reason == "length" and res.tokens == 4 and res.worker_id == "http-test"
    client_ev = [e["event"] for e in recorded if e["observer"] == "client"]
    engine_ev = [e["event"] for e in recorded if e["observer"] == "engine"]
    assert client_ev == ["submitted", "admitted"] + ["token"] * 4 + ["finished"]
    assert engine_ev == ["submitted", "admitted"] + ["token"] * 4 + ["finished"]
    tok = [e for e in recorded if e["observer"] == "client" and e["event"] == "token"]
    assert all(e["t_ns"] >= e["server_t_ns"] for e in tok)      # one monotonic clock on one machine


# --------------------------------------------------------------------------- bad input

# the engine-side refusals (vocabulary, context length, request id, prompt size) are in
# test_service_engine_process.py's test_bad_requests_are_400, over both modes
BAD = [
    ("/generate", b"{not json", 400, "invalid_json"),
    ("/generate", b"[1, 2]", 400, "invalid_body"),
    ("/generate", {"max_tokens": 3}, 400, "missing_prompt"),
    ("/generate", {"prompt": "a", "prompt_token_ids": [1]}, 400, "invalid_value"),
    ("/generate", {"prompt": ""}, 400, "empty_prompt"),
    ("/generate", {"prompt": 5}, 400, "invalid_type"),
    ("/generate", {"prompt_token_ids": []}, 400, "empty_prompt"),
    ("/generate", {"prompt_token_ids": [1, "2"]}, 400, "invalid_type"),
    ("/generate", {"prompt_token_ids": [1, True]}, 400, "invalid_type"),
    ("/generate", {"prompt": "a", "max_tokens": 0}, 400, "invalid_value"),
    ("/generate", {"prompt": "a", "max_tokens": -1}, 400, "invalid_value"),
    ("/generate", {"prompt": "a", "max_tokens": MAX_MODEL_LEN}, 400, "invalid_value"),
    ("/generate", {"prompt": "a", "max_tokens": "5"}, 400, "invalid_type"),
    ("/generate", {"prompt": "a", "max_tokens": 2.5}, 400, "invalid_type"),
    ("/generate", {"prompt": "a", "max_tokens": True}, 400, "invalid_type"),
    ("/generate", {"prompt": "a", "temperature": -0.5}, 400, "invalid_value"),
    ("/generate", {"prompt": "a", "temperature": "hot"}, 400, "invalid_type"),
    ("/generate", {"prompt": "a", "ignore_eos": "yes"}, 400, "invalid_type"),
    ("/generate", {"prompt": "a", "seed": 1.5}, 400, "invalid_type"),
    ("/generate", {"prompt": "a", "tags": {"reason": 1}}, 400, "invalid_value"),
    ("/generate", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_value"),
    ("/generate", {"messages": "hi"}, 400, "invalid_type"),
    ("/generate", {"prompt": "x" * (70 * 1024)}, 413, "body_too_large"),
    ("/cancel", {}, 400, "missing_request_id"),
    ("/cancel", {"request_id": 7}, 400, "invalid_type"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "n": 2, "best_of": 3}, 400, "unsupported_parameter"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "n": 129}, 400, "invalid_value"),
    ("/v1/completions", {"model": "tiny", "prompt": ["a"] * 65}, 400, "invalid_value"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, 400, "invalid_value"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "logprobs": 21}, 400, "invalid_value"),
    ("/v1/completions", {"model": "tiny"}, 400, "missing_prompt"),
    ("/v1/completions", {"model": "no-such-model", "prompt": "a"}, 404, "model_not_found"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 10 ** 9}, 400, "invalid_value"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "stream_options": {"include_usage": True}}, 400, "invalid_value"),
    ("/v1/chat/completions", {"model": "tiny"}, 400, "missing_prompt"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "invalid_type"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "unsupported_content"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 0}, 400, "invalid_value"),
]


@pytest.mark.parametrize("path,payload,status,code", BAD, ids=[f"{p}:{c}:{i}" for i, (p, _, _, c) in enumerate(BAD)])
def test_bad_input_gets_a_json_error_never_500(server, path, payload, status, code):
    async def go(sess):
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        async with sess.post(f"{server.url}{path}", data=data, headers={"Content-Type": "application/json"}) as resp:
            return resp.status, await resp.json(content_type=None)

    got, err = run(with_session(go))
    assert got == status, err
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["code"] == code
    assert "\n" not in err["error"]["message"]


@pytest.mark.parametrize("method,path,status", [("GET", "/nope", 404), ("GET", "/generate", 405),
                                                ("POST", "/health", 405)])
def test_unknown_routes_and_methods_are_json(server, method, path, status):
    async def go(sess):
        async with sess.request(method, f"{server.url}{path}") as resp:
            return resp.status, await resp.json(content_type=None)

    got, err = run(with_session(go))
    assert got == status and "message" in err["error"]


def test_oversized_chunked_body_is_413(server):
    async def gen():
        for _ in range(40):
            yield b"x" * 4096

    async def go(sess):
        async with sess.post(f"{server.url}/generate", data=gen(), headers={"Content-Type": "application/json"}) as resp:
            return resp.status, await resp.json(content_type=None)

    status, err = run(with_session(go))
    assert status == 413 and err["error"]["code"] == "body_too_large"


# --------------------------------------------------------------------------- OpenAI-compatible


def test_openai_client_streams_a_chat_completion(server):
    pytest.importorskip("openai")
    api = openai_client(server.url, timeout=30)
    models = api.models.list()
    name = models.data[0].id
    stream = api.chat.completions.create(model=name, messages=[{"role": "user", "content": "Say hi"}],
                                         max_tokens=6, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = [c.usage for c in chunks if c.usage]
    assert finals == ["length"] and usage and usage[0].completion_tokens == 6
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content is not None]) >= 6
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    assert isinstance("".join(c.choices[0].delta.content for c in content), str)


def test_openai_client_non_stream_completion_and_chat(server):
    openai = pytest.importorskip("openai")
    api = openai_client(server.url, timeout=30)
    out = api.completions.create(model="tiny", prompt=ids("oa", 12), max_tokens=5, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5
    assert out.usage.prompt_tokens == 12 and out.usage.total_tokens == 17
    chat = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                       extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError):
        api.completions.create(model="tiny", prompt="a", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="gpt-4", prompt="a", max_tokens=2)


# --------------------------------------------------------------------------- two servers, ports, close


def test_two_servers_on_their_own_ports(tiny_model_dir, server):
    w2 = Worker(WorkerConfig(model=str(tiny_model_dir), device="cpu", max_model_len=256, worker_id="second")).start()
    with ServerThread(w2) as second:
        assert second.url != server.url

        async def go(sess):
            return await asyncio.gather(client.stream_native(sess, server.url, body("two-a", 3)),
                                        client.stream_native(sess, second.url, body("two-b", 3)))

        a, b = run(with_session(go))
        assert (a.worker_id, a.reason, b.worker_id, b.reason) == ("http-test", "length", "second", "length")


def test_port_in_use_is_one_clear_error(server):
    port = int(server.url.rsplit(":", 1)[1])
    with pytest.raises(ServeError, match=f"port {port} on 127.0.0.1 is already in use") as exc:
        bind_socket("127.0.0.1", port)
    assert "\n" not in str(exc.value)


def test_serve_command_port_in_use_exits_nonzero(server):
    from typer.testing import CliRunner

    from labkit.cli import app
    port = server.url.rsplit(":", 1)[1]
    result = CliRunner().invoke(app, ["serve", "--port", port, "--device", "cpu"])
    assert result.exit_code != 0
    # the app maps the ServeError itself (one `error:` line, exit 2), so CliRunner sees the exit, not the exception
    assert result.exit_code == 2 and "error: " in result.output and "already in use" in result.output


def test_server_close_twice_and_releases_port(tiny_model_dir):
    w = Worker(WorkerConfig(model=str(tiny_model_dir), device="cpu", max_model_len=256, max_active=1,
                            load_tokenizer=False, worker_id="closing")).start()
    srv = ServerThread(w).start()
    port = int(srv.url.rsplit(":", 1)[1])

    async def go(sess):
        task = asyncio.create_task(client.stream_native(sess, srv.url, body("long-run", 200)))
        while not w.snapshot().get("active"):
            await asyncio.sleep(0.01)
        await asyncio.get_running_loop().run_in_executor(None, srv.close)
        return await task

    res = run(with_session(go))
    assert res.reason == "cancelled" and res.cause == "shutdown"
    srv.close()
    w.close()
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_serve_command_port_zero_prints_url_and_stops_on_sigint(tiny_model_dir, tmp_path):
    import signal
    import subprocess
    import sys

    log = tmp_path / "server.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "labkit", "serve", "--model", str(tiny_model_dir), "--port", "0",
                             "--device", "cpu", "--max-model-len", "256", "--worker-id", "sub", "--out", str(log)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = ready_url(proc, 60)
        assert url and not url.endswith(":0")
        res = run(with_session(lambda s: client.stream_native(s, url, body("sub-1", 3))))
        assert res.reason == "length" and res.worker_id == "sub"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert "served" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert lines[0]["event"] == "header" and lines[0]["role"] == "server" and lines[0]["url"] == url
    assert lines[-1]["what"] == "closed" and lines[-1]["free_blocks"] == lines[-1]["total_blocks"]


def test_client_command_cancel_after_writes_a_log(server, tmp_path):
    from typer.testing import CliRunner

    from labkit.cli import app
    out = tmp_path / "client-cancel.jsonl"
    result = CliRunner().invoke(app, ["client", "--endpoints", server.url, "--prompt", "Hello", "--max-tokens", "200",
                                      "--ignore-eos", "--request-id", "cli-cancel", "--cancel-after", "3",
                                      "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout[result.stdout.index("{"):])
    assert summary["reason"] == "cancelled" and summary["tokens_after_finished"] == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0]["event"] == "header" and lines[0]["kind"] == "cpu-real-engine" and lines[0]["role"] == "client"
    assert any(e["event"] == "cancel_sent" for e in lines)
    client_ev = [e["event"] for e in lines[1:] if e["observer"] == "client" and e["event"] != "cancel_sent"]
    assert client_ev[0] == "submitted" and client_ev[-1] == "finished"
