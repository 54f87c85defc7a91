"""`labkit serve --engine-process`: the HTTP contract is the same with the engine in a process of its own.

The service contract checks that hold in both modes live here, once, and run once per mode (``served``
is a module fixture over ``in-process`` and ``engine-process``: one spawn and model load per mode, not per
test); test_service_http.py keeps the checks of the HTTP front alone (routes, body parsing, OpenAI client,
ports). The crash, init-error and close tests need an engine process of their own.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from testkit import settle, wait_for
from service_fixtures import MODES, body, ids, kv, queued, ready_url, run, serving, settle_after, with_session, \
    worker_config

from labkit.errors import UserError
from labkit.load import client
from serve.core.proc_client import RemoteWorker
from serve.observe.events import MemorySink
from serve.entrypoints.api_server import ServerThread
from serve.core.worker import Worker

MAX_MODEL_LEN = 512


def config(model, **kw):
    return worker_config(model, **{"attention_backend": "torch", "worker_id": "proc-test", **kw})


@pytest.fixture(scope="module", params=MODES)
def served(request, tiny_model_dir):
    yield from serving(tiny_model_dir, request.param, attention_backend="torch", worker_id="proc-test",
                       server_kw={"max_body_bytes": 64 * 1024})


_idle = settle_after("served")


def test_the_engine_runs_where_the_mode_says(served):
    remote = isinstance(served.worker, RemoteWorker)
    assert remote == (served.mode == "engine-process")
    if remote:
        assert served.worker.process.is_alive() and served.worker.process.pid != os.getpid()


def test_native_stream_in_order_with_text(served):
    async def go(sess):
        async with sess.post(f"{served.url}/generate", json=body("nd-1", 6)) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("application/x-ndjson")
            assert resp.headers["X-Worker-Id"] == "proc-test"
            return [json.loads(line) async for line in resp.content if line.strip()]

    evs = run(with_session(go))
    assert [e["event"] for e in evs] == ["submitted", "admitted"] + ["token"] * 6 + ["finished"]
    assert [e["index"] for e in evs if e["event"] == "token"] == list(range(1, 7))
    assert all(isinstance(e["text"], str) for e in evs if e["event"] == "token")
    assert evs[-1]["reason"] == "length" and evs[-1]["num_completion_tokens"] == 6
    for e in evs:
        assert {"request_id", "worker_id", "round", "t_ns", "observer"} <= set(e)
        assert e["observer"] == "engine" and e["worker_id"] == "proc-test"


@pytest.fixture(scope="module")
def reference_greedy(tiny_model_dir):
    """An in-process Worker's greedy tokens for request same-1 (one Worker for both modes)."""
    with Worker(config(tiny_model_dir, worker_id="ref")) as ref:
        return [e["token_id"] for e in ref.submit(ids("same-1"), _params(8)).events(30) if e["event"] == "token"]


def test_both_modes_generate_the_same_greedy_tokens(served, reference_greedy):
    """The engine process runs the same engine: greedy tokens equal an in-process Worker's."""
    res = run(with_session(lambda s: client.stream_native(s, served.url, body("same-1", 8, temperature=0))))
    want = reference_greedy
    got = [e["token_id"] for e in served.sink.snapshot() if e["request_id"] == "same-1" and e["event"] == "token"]
    assert res.tokens == 8 and got == want


def _params(n: int):
    from engine import SamplingParams

    return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)


def test_a_slow_consumer_finishes_alike_in_both_modes(served):
    """One output processor for both worker kinds: the same finished event, whichever side the engine runs on."""
    h = served.worker.submit(ids("slow-both"), _params(150), request_id="slow-both", stream_buffer=4)
    fin = h.wait(30)
    assert (fin["reason"], fin["cause"], fin["message"]) == ("cancelled", "slow_consumer", "more than 4 events unread")
    assert 0 < fin["num_completion_tokens"] < 150
    logged = [e for e in served.sink.snapshot() if e["request_id"] == "slow-both"]
    assert [e["event"] for e in logged][:2] == ["submitted", "admitted"] and logged[-1] == fin


def test_openai_completion_stream_over_raw_sse(served):
    res = run(with_session(lambda s: client.stream_openai(
        s, served.url, {"model": "tiny", "prompt": ids("sse", 10), "max_tokens": 4, "temperature": 0,
                        "ignore_eos": True}, request_id="sse-1")))
    assert res.reason == "length" and res.tokens == 4 and res.usage_completion_tokens == 4

    async def raw(sess):
        async with sess.post(f"{served.url}/v1/completions", json={"model": "tiny", "prompt": ids("sse2", 10),
                                                                   "max_tokens": 3, "stream": True,
                                                                   "ignore_eos": True}) as resp:
            return resp.headers["Content-Type"], (await resp.read()).decode()

    ctype, text = run(with_session(raw))
    assert ctype.startswith("text/event-stream")
    frames = [f for f in text.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames) and frames[-1] == "data: [DONE]"
    last = json.loads(frames[-2][6:])
    assert last["object"] == "text_completion" and last["choices"][0]["finish_reason"] == "length"


def test_openai_text_chat_is_templated_in_the_parent(served):
    async def raw(sess):
        async with sess.post(f"{served.url}/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 3,
                "stream": True, "ignore_eos": True}) as resp:
            return resp.status, (await resp.read()).decode()

    status, text = run(with_session(raw))
    frames = [f for f in text.split("\n\n") if f]
    assert status == 200 and frames[-1] == "data: [DONE]"
    chunks = [json.loads(f[6:]) for f in frames[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # the chat template ran in the parent: the submitted event counts the templated prompt's tokens
    tok = served.worker.tokenizer
    want = len(served.worker.encode([{"role": "user", "content": "Say hi"}]))
    sub = [e for e in served.sink.snapshot() if e["event"] == "submitted" and e.get("request_id", "").startswith(
        "proc-test-") and e["prompt_tokens"] == want]
    assert tok is not None and sub


@pytest.mark.parametrize("payload,code", [
    ({"prompt_token_ids": [151936]}, "token_out_of_vocabulary"),
    ({"prompt_token_ids": [-3]}, "token_out_of_vocabulary"),
    ({"prompt_token_ids": list(range(1000, 1000 + MAX_MODEL_LEN))}, "context_length_exceeded"),
    ({"prompt_token_ids": [1000] * 500, "max_tokens": 100}, "context_length_exceeded"),
    ({"prompt": "a", "request_id": "bad id!"}, "invalid_value"),
    ({"prompt": "x" * 20000, "max_tokens": 2}, "prompt_too_long"),
])
def test_bad_requests_are_400(served, payload, code):
    async def go(sess):
        async with sess.post(f"{served.url}/generate", json=payload) as resp:
            return resp.status, await resp.json()

    status, err = run(with_session(go))
    assert status == 400 and err["error"]["code"] == code, err
    assert set(err["error"]) == {"message", "type", "param", "code"} and "\n" not in err["error"]["message"]


def test_full_queue_is_429_duplicate_is_400_and_accepted_complete(served):
    w = served.worker

    async def go(sess):
        tasks = await queued(sess, served.url, w, [body(f"fq-{i}", 3) for i in range(3)])
        async with sess.post(f"{served.url}/generate", json=body("fq-0", 3)) as resp:
            dup = resp.status, await resp.json()
        async with sess.post(f"{served.url}/generate", json=body("fq-over", 3)) as resp:
            over = resp.status, await resp.json(), resp.headers.get("Retry-After")
        w.resume()
        return dup, over, await asyncio.gather(*tasks)

    dup, over, accepted = run(with_session(go))
    assert dup[0] == 400 and dup[1]["error"]["code"] == "duplicate_request_id"
    assert over[0] == 429 and over[1]["error"]["code"] == "queue_full" and over[2] == "1"
    assert over[1]["error"]["type"] == "rate_limit_error"
    assert [r.reason for r in accepted] == ["length"] * 3 and [r.tokens for r in accepted] == [3, 3, 3]
    rejected = [e for e in served.sink.snapshot() if e["request_id"] == "fq-over"]
    assert [e["event"] for e in rejected] == ["submitted", "finished"] and rejected[-1]["reason"] == "rejected"


def test_cancel_frees_blocks_and_sends_nothing_after_finished(served):
    res = run(with_session(lambda s: client.stream_native(s, served.url, body("cx-3", 300), cancel_after=3)))
    assert res.reason == "cancelled" and res.cause == "client" and res.cancel_sent_after == 3
    assert res.tokens_after_finished == 0 and 3 <= res.tokens < 300
    names = [e["event"] for e in served.sink.snapshot() if e["request_id"] == "cx-3"]
    assert names[-1] == "finished" and names.count("finished") == 1
    free, total = kv(served.worker)                 # the engine's own count, as the stream ended
    assert free == total > 0
    settle(served.worker)
    snap = served.worker.snapshot()
    assert snap["kv_blocks_free"] == snap["kv_blocks_total"] > 0

    async def cancel_again(sess, **extra):
        async with sess.post(f"{served.url}/cancel", json={"request_id": "cx-3", **extra}) as resp:
            return resp.status, await resp.json()

    status, err = run(with_session(lambda s: cancel_again(s, cancel_token="stale")))
    assert status == 404 and err["error"]["code"] == "request_not_found"
    status, err = run(with_session(cancel_again))
    assert status == 400 and err["error"]["code"] == "missing_cancel_token" and err["error"]["param"] == "cancel_token"


def test_client_disconnect_cancels_at_the_owner(served):
    async def go(sess):
        async with sess.post(f"{served.url}/generate", json=body("gone", 300)) as resp:
            n = 0
            async for line in resp.content:
                if b'"token"' in line:
                    n += 1
                    if n == 2:
                        break
            resp.close()

    run(with_session(go))
    wait_for(lambda: any(e["request_id"] == "gone" and e["event"] == "finished" for e in served.sink.snapshot()))
    fin = [e for e in served.sink.snapshot() if e["request_id"] == "gone" and e["event"] == "finished"][0]
    assert fin["reason"] == "cancelled" and fin["cause"] == "disconnect" and fin["num_completion_tokens"] < 300


def test_engine_error_finishes_the_batch_with_error_and_keeps_serving(served):
    w = served.worker

    async def go(sess):
        tasks = await queued(sess, served.url, w, [body(f"ex-{i}", 5) for i in range(2)])
        w.inject_fault(message="injected in test")
        w.resume()
        failed = await asyncio.gather(*tasks)
        after = await client.stream_native(sess, served.url, body("ex-after", 3))
        async with sess.get(f"{served.url}/health") as resp:
            return failed, after, resp.status

    failed, after, health = run(with_session(go))
    assert [r.reason for r in failed] == ["error", "error"] and all("injected in test" in r.message for r in failed)
    assert after.reason == "length" and health == 200
    assert 'labkit_engine_errors_total{worker_id="proc-test"} 1.0' in _metrics(served)


def _metrics(served) -> str:
    async def go(sess):
        async with sess.get(f"{served.url}/metrics") as resp:
            assert resp.status == 200
            return await resp.text()

    return run(with_session(go))


def _sample(text: str, name: str) -> float:
    m = re.search(rf'^{name}{{worker_id="proc-test"}} (\S+)$', text, re.M)
    assert m, name
    return float(m.group(1))


def test_metrics_count_what_the_requests_did_from_the_engine_stamps(served):
    before = _metrics(served)
    res = run(with_session(lambda s: client.stream_native(s, served.url, body("met-1", 7))))
    assert res.tokens == 7
    after = _metrics(served)
    assert "# TYPE labkit_time_to_first_token_seconds histogram" in after
    for name, delta in (("labkit_time_to_first_token_seconds_count", 1), ("labkit_inter_token_latency_seconds_count", 6),
                        ("labkit_generation_tokens_total", 7), ("labkit_e2e_request_latency_seconds_count", 1),
                        ("labkit_prompt_tokens_total", 20)):
        assert _sample(after, name) - _sample(before, name) == delta, name
    # TTFT from the engine's own stamps: submitted t_ns to the first token's t_ns
    evs = {e["event"]: e for e in served.sink.snapshot() if e["request_id"] == "met-1" and e["event"] != "token"}
    first = next(e for e in served.sink.snapshot() if e["request_id"] == "met-1" and e["event"] == "token")
    ttft = (first["t_ns"] - evs["submitted"]["t_ns"]) / 1e9
    got = _sample(after, "labkit_time_to_first_token_seconds_sum") - _sample(before, "labkit_time_to_first_token_seconds_sum")
    assert got == pytest.approx(ttft, abs=1e-6)
    steps = [e for e in served.sink.snapshot() if e["event"] == "step"]
    counted = sum(float(v) for v in re.findall(r'^labkit_steps_total\{phase="\w+",worker_id="proc-test"\} (\S+)$',
                                                after, re.M))
    assert steps and counted == len(steps)


def test_health_says_ok_with_the_pool_and_metrics_name_the_series(served):
    async def go(sess):
        async with sess.get(f"{served.url}/health") as r1, sess.get(f"{served.url}/metrics") as r2:
            return r1.status, await r1.json(), r2.status, r2.headers["Content-Type"], await r2.text()

    status, health, s2, ctype, text = run(with_session(go))
    assert status == 200 and health["status"] == "ok" and health["kind"] == "cpu-real-engine"
    assert health["kv_blocks_free"] == health["kv_blocks_total"] > 0 and health["max_model_len"] == MAX_MODEL_LEN
    assert s2 == 200 and ctype.startswith("text/plain")
    for name in ("labkit_num_requests_waiting", "labkit_num_requests_running", "labkit_kv_blocks_used",
                 "labkit_kv_blocks_free", "labkit_generation_tokens_total", "labkit_time_to_first_token_seconds_bucket",
                 "labkit_inter_token_latency_seconds_count"):
        assert f"\n{name}{{" in text or text.startswith(f"{name}{{"), name
    assert "# TYPE labkit_time_to_first_token_seconds histogram" in text


# --------------------------------------------------------------------------- an engine process of its own


def test_a_killed_engine_process_ends_every_open_stream_with_error(tiny_model_dir):
    w = RemoteWorker(config(tiny_model_dir, worker_id="crash")).start()
    with ServerThread(w) as srv:
        async def go(sess):
            tasks = [asyncio.create_task(client.stream_native(sess, srv.url, body(f"kill-{i}", 400)))
                     for i in range(2)]
            def first_tokens() -> float:                   # both streams must have begun before the kill
                return w.stats.registry.get_sample_value("labkit_time_to_first_token_seconds_count",
                                                         {"worker_id": "crash"}) or 0

            wait = time.monotonic() + 30
            while (w.stats.generation_tokens < 4 or first_tokens() < 2) and time.monotonic() < wait:
                await asyncio.sleep(0.01)
            os.kill(w.process.pid, signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            async with sess.get(f"{srv.url}/health") as resp:
                health = resp.status, await resp.json()
            async with sess.post(f"{srv.url}/generate", json=body("after", 2)) as resp:
                after = resp.status, await resp.json()
            return results, health, after

        results, health, after = run(with_session(go))
    assert [r.reason for r in results] == ["error", "error"]
    assert all("engine process exited unexpectedly (signal SIGKILL)" in r.message for r in results)
    assert all(0 < r.tokens < 400 and "\n" not in r.message for r in results)
    assert health[0] == 503 and health[1]["status"] == "unhealthy"
    assert after[0] == 503 and after[1]["error"]["code"] == "unavailable"


def test_the_engine_process_queues_what_the_parent_checked_as_it_is(tiny_model_dir):
    """A request is checked once, in the parent: the engine process does not run the admission rule again (made
    to fail there, it changes nothing)."""
    import functools

    from serve.core.front import ServedEngine

    with RemoteWorker(config(tiny_model_dir, worker_id="trust")).start() as w:
        w.run_on_owner(functools.partial(setattr, ServedEngine, "check"))     # the child's check: not callable
        fin = w.submit(ids("trusted"), _params(3), request_id="trusted").wait(30)
        assert fin["reason"] == "length" and fin["num_completion_tokens"] == 3
        assert w.state() == "ok"


def test_init_error_is_the_same_line_as_in_process(tmp_path):
    cfg = config(tmp_path / "no-such-model", worker_id="bad")
    with pytest.raises(Exception) as local:
        Worker(cfg).start()
    with pytest.raises(Exception) as remote:
        RemoteWorker(cfg).start()
    assert type(remote.value) is type(local.value) and str(remote.value) == str(local.value)
    assert isinstance(remote.value, UserError)


def test_close_ends_open_streams_as_shutdown_and_the_process(tiny_model_dir):
    sink = MemorySink()
    w = RemoteWorker(config(tiny_model_dir, worker_id="closing"), sink=sink).start()
    h = w.submit(ids("long"), _params(400), request_id="long")
    wait_for(lambda: w.stats.generation_tokens >= 2, 30)
    w.close(timeout=20)
    fin = h.wait(5)
    assert fin["reason"] == "cancelled" and fin["cause"] == "shutdown"
    assert w.process.exitcode == 0 and w.state() == "closed"
    assert sink.snapshot()[-1]["what"] == "closed"
    w.close()                                   # idempotent


def test_serve_command_with_engine_process(tiny_model_dir, tmp_path):
    log = tmp_path / "server.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "labkit", "serve", "--model", str(tiny_model_dir), "--port", "0",
                             "--device", "cpu", "--attention", "torch", "--max-model-len", "256", "--worker-id", "sub",
                             "--engine-process", "--out", str(log), "--stats-interval", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = ready_url(proc, 90)
        assert url
        res = run(with_session(lambda s: client.stream_native(s, url, body("sub-1", 3))))
        assert res.reason == "length" and res.worker_id == "sub"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert lines[0]["event"] == "header" and lines[0]["engine_process"]["pid"] != proc.pid
    assert [e["event"] for e in lines if e.get("request_id") == "sub-1"] == \
        ["submitted", "admitted", "token", "token", "token", "finished"]
    assert lines[-1]["what"] == "closed" and lines[-1]["free_blocks"] == lines[-1]["total_blocks"]


# --------------------------------------------------------------------------- the serve bench, A/B in one run


def test_serve_bench_runs_both_modes_after_one_offline_pass(tiny_model_dir, tmp_path):
    from labkit.bench.serve import run_assertions, run_serve_bench
    from labkit.checks import evaluate, parse_run_assertions
    from labkit.load.trace import TraceOptions

    trace = TraceOptions(requests=4, prompt_tokens=16, long_prompt_tokens=32, long_every=2, max_tokens=4,
                         interval_ms=0.0)
    rec = run_serve_bench(tmp_path / "bench-serve.json", model=str(tiny_model_dir), device="cpu", attention="torch",
                          trace=trace, modes=[False, True])
    f = rec["facts"]
    assert rec["verdict"] == "PASS", [c for c in rec["checks"] if c["status"] != "pass"]
    assert [r["mode"] for r in f["ab"]] == ["in-process", "engine-process"] and f["engine_process"] is False
    assert [r["server"]["engine_process"] for r in f["ab"]] == [False, True]
    assert f["output_tokens_per_run"]["native@2"] == f["output_tokens_per_run"]["openai@2"] == 16
    assert set(f["ab_summary"]) == {"in-process", "engine-process"}
    header = json.loads(open(f["ab"][1]["server"]["log"]).readline())
    assert header["engine_process"]["pid"] and "engine_process" not in json.loads(open(f["server"]["log"]).readline())
    # a second served run that lost tokens fails its run assertions
    f["ab"][1]["native"]["output_tokens"] -= 1
    f["output_tokens_per_run"]["native@2"] -= 1
    judged = [evaluate(a, rec) for a in parse_run_assertions(run_assertions(f))]
    failed = {c["name"] for c in judged if c["status"] != "pass"}
    assert "native@2: every output token" in failed
    assert any(n.startswith("native@2 (engine-process)") for n in failed)


def test_bench_serve_modes_option_is_checked(cli_app):
    from typer.testing import CliRunner

    from labkit.bench.serve import parse_serve_modes

    assert parse_serve_modes("in-process,engine-process,in-process") == [False, True, False]
    assert parse_serve_modes(None, True) == [True]
    result = CliRunner().invoke(cli_app, ["bench", "--workload", "serve", "--serve-modes", "in-process,fast",
                                          "--device", "cpu"])
    assert result.exit_code == 2 and "--serve-modes takes" in result.output
    result = CliRunner().invoke(cli_app, ["bench", "--workload", "latency", "--engine-process"])
    assert result.exit_code == 2 and "apply to --workload serve" in result.output
