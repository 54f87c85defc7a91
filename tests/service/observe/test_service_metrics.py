"""GET /metrics through prometheus_client (issue 14 item 6): parsed with prometheus_client's own parser after
real requests on the tiny CPU model, the counters and histograms move by what the requests did, and two
servers in one process keep their registries apart."""
from __future__ import annotations

import asyncio
import json

import pytest
from testkit import wait_for
from prometheus_client.parser import text_string_to_metric_families

from labkit.load.trace import token_ids
from labkit.load import client
from serve.entrypoints.api_server import ServerThread
from serve.core.worker import Worker, WorkerConfig

PROMPT = token_ids(4, "metrics", 12)


def run(coro):
    return asyncio.run(coro)


def start(model, worker_id: str) -> ServerThread:
    w = Worker(WorkerConfig(model=str(model), device="cpu", max_active=2, queue_size=4, max_num_batched_tokens=256,
                            max_num_seqs=4, max_model_len=256, worker_id=worker_id)).start()
    return ServerThread(w, "127.0.0.1", 0, max_body_bytes=64 * 1024).start()


@pytest.fixture(scope="module")
def servers(tiny_model_dir):
    a, b = start(tiny_model_dir, "metrics-a"), start(tiny_model_dir, "metrics-b")
    yield a, b
    a.close()
    b.close()


def fetch(srv, accept: str | None = None) -> tuple[str, str]:
    async def go():
        headers = {"Accept": accept} if accept else {}
        async with client.session(30.0) as sess, sess.get(f"{srv.url}/metrics", headers=headers) as r:
            assert r.status == 200
            return r.headers["Content-Type"], await r.text()

    return run(go())


def scrape(srv) -> tuple[str, dict, dict]:
    """(content type, {family name: type}, {(sample name, sorted labels without worker_id): value})."""
    ctype, text = fetch(srv)
    types, samples = {}, {}
    for fam in text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            assert s.labels.get("worker_id") == srv.worker.worker_id, s
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "worker_id"))
            samples[(s.name, labels)] = s.value
    return ctype, types, samples


def native(srv, max_tokens: int) -> list[int]:
    """A greedy /generate of PROMPT; the token ids the stream carried (ignore_eos: exactly max_tokens)."""
    async def go():
        body = {"prompt_token_ids": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
        async with client.session(30.0) as sess, sess.post(f"{srv.url}/generate", json=body) as r:
            assert r.status == 200
            evs = [json.loads(line) async for line in r.content if line.strip()]
        assert evs[-1]["event"] == "finished" and evs[-1]["reason"] == "length"
        return [e["token_id"] for e in evs if e["event"] == "token"]

    return run(go())


def completion(srv, **extra) -> dict:
    async def go():
        body = {"prompt": PROMPT, "temperature": 0.0, **extra}
        async with client.session(30.0) as sess, sess.post(f"{srv.url}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            return await r.json()

    return run(go())


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def idle(srv) -> None:
    wait_for(lambda: srv.worker.snapshot().get("active", 0) == 0 and not srv.worker.pending_ids())


def test_standard_exposition_with_every_documented_family(servers):
    ctype, types, _ = scrape(servers[0])
    assert ctype == "text/plain; version=0.0.4; charset=utf-8"       # the Prometheus text format
    expected = {
        "labkit_time_to_first_token_seconds": "histogram", "labkit_inter_token_latency_seconds": "histogram",
        "labkit_e2e_request_latency_seconds": "histogram",
        "labkit_prompt_tokens": "counter", "labkit_generation_tokens": "counter",
        "labkit_requests_finished": "counter", "labkit_requests_rejected": "counter",
        "labkit_steps": "counter", "labkit_step_seconds": "counter", "labkit_engine_errors": "counter",
        "labkit_num_requests_running": "gauge", "labkit_num_requests_waiting": "gauge",
        "labkit_kv_cache_usage_perc": "gauge", "labkit_kv_blocks_used": "gauge", "labkit_kv_blocks_free": "gauge",
        "labkit_kv_blocks_total": "gauge", "labkit_engine_running": "gauge", "labkit_engine_waiting": "gauge",
        "labkit_round": "gauge", "labkit_healthy": "gauge", "labkit_triton_compiles_after_startup": "gauge",
    }
    assert {n: types.get(n) for n in expected} == expected


def test_openmetrics_when_the_scraper_asks_for_it(servers):
    ctype, text = fetch(servers[0], "application/openmetrics-text; version=1.0.0")
    assert ctype.startswith("application/openmetrics-text") and text.rstrip().endswith("# EOF")


def test_counters_and_histograms_move_by_what_the_requests_did(servers):
    srv, other = servers
    idle(srv)
    _, _, before = scrape(srv)
    _, _, other_before = scrape(other)
    a = native(srv, 4)
    b = native(srv, 6)
    # a stop token the greedy continuation reaches at index k (its first occurrence): finish "stop" after k+1
    k = next(i for i in range(1, len(b)) if b[i] not in b[:i])
    stopped = completion(srv, max_tokens=8, stop_token_ids=[b[k]])
    assert stopped["choices"][0]["finish_reason"] == "stop"
    idle(srv)
    _, _, after = scrape(srv)
    generated = len(a) + len(b) + stopped["usage"]["completion_tokens"]
    assert len(a) == 4 and len(b) == 6 and stopped["usage"]["completion_tokens"] == k + 1
    assert delta(before, after, "labkit_generation_tokens_total") == generated
    assert delta(before, after, "labkit_prompt_tokens_total") == 3 * len(PROMPT)
    assert delta(before, after, "labkit_requests_finished_total", reason="length") == 2
    assert delta(before, after, "labkit_requests_finished_total", reason="stop") == 1
    for hist in ("labkit_time_to_first_token_seconds", "labkit_e2e_request_latency_seconds"):
        assert delta(before, after, f"{hist}_count") == 3, hist
        assert delta(before, after, f"{hist}_bucket", le="+Inf") == 3, hist
        assert delta(before, after, f"{hist}_sum") > 0, hist
    assert delta(before, after, "labkit_inter_token_latency_seconds_count") == generated - 3
    assert delta(before, after, "labkit_steps_total", phase="prefill") >= 3
    assert after[("labkit_num_requests_running", ())] == 0 and after[("labkit_kv_cache_usage_perc", ())] == 0
    _, _, other_after = scrape(other)                      # the other server's registry did not move
    assert {k: v for k, v in other_after.items() if "created" not in k[0]} == \
           {k: v for k, v in other_before.items() if "created" not in k[0]}


def test_gauges_show_a_request_in_flight(servers):
    """Held after its first token: one request running, none waiting, its KV blocks in use (usage = used/total)."""
    from engine import SamplingParams

    srv = servers[0]
    idle(srv)
    handle = srv.worker.submit(PROMPT, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True),
                               request_id="metrics-inflight")
    try:
        next(e for e in handle.events() if e["event"] == "token")
        srv.worker.pause()
        srv.worker.run_on_owner(lambda e: None)           # the owner is at a boundary, its last step published
        _, _, mid = scrape(srv)
    finally:
        srv.worker.resume()
    assert mid[("labkit_num_requests_running", ())] == 1 and mid[("labkit_num_requests_waiting", ())] == 0
    used, total = mid[("labkit_kv_blocks_used", ())], mid[("labkit_kv_blocks_total", ())]
    assert used > 0 and mid[("labkit_kv_cache_usage_perc", ())] == used / total
    assert handle.wait(60)["reason"] == "length"
    idle(srv)
    _, _, end = scrape(srv)
    assert end[("labkit_num_requests_running", ())] == 0 and end[("labkit_kv_cache_usage_perc", ())] == 0


def test_late_triton_compiles_reach_the_gauge(engine_factory):
    """The engine counts Triton compiles after start-up (engine/warmup.py: CompileWatch; nothing compiles on a
    CPU, so a watch with three names stands in); the worker's snapshot carries the total and /metrics shows it."""
    from types import SimpleNamespace

    from serve.core.front import WorkerFront

    eng = engine_factory(device="cpu", enforce_eager=True, max_model_len=128, max_num_seqs=2)
    assert eng.stats().totals()["triton_compiles_after_startup"] == 0
    eng.runner.late_compiles = SimpleNamespace(names=["_prefill_kernel"] * 3, close=lambda: None)
    totals = eng.stats().totals()
    assert totals["triton_compiles_after_startup"] == 3

    class Front(WorkerFront):
        def snapshot(self):
            return {"state": "ok", **totals}

    front = Front()
    gauges = front.gauges()
    assert gauges["labkit_triton_compiles_after_startup"] == 3
    text = front.stats.render(gauges)[0].decode()
    assert f'labkit_triton_compiles_after_startup{{worker_id="{front.worker_id}"}} 3.0' in text
