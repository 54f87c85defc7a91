"""The host path of the service: a step's wake-ups handed to the HTTP loop in one call, the engine's
overlapped decode inside the worker (same greedy tokens, cancels, stop strings, n > 1, logprobs) and
the client's token count of an OpenAI stream (the finish chunk's held-back text is no token)."""
from __future__ import annotations

import asyncio
from collections import Counter

import aiohttp
import pytest
from testkit import wait_for

from engine import SamplingParams
from labkit.load.trace import token_ids
from labkit.load import client
from serve.observe.events import MemorySink
from serve.core.worker import Worker


def ids(name: str, n: int = 12) -> list[int]:
    return token_ids(5, name, n)


def _worker(service_worker, overlap: bool, sink=None) -> Worker:
    return service_worker(sink=sink, max_active=8, queue_size=32, max_num_seqs=8, max_model_len=128,
                          worker_id=f"hp-{'ov' if overlap else 'sync'}", overlap=overlap)


@pytest.fixture(scope="module")
def sync_worker(service_worker):
    return _worker(service_worker, False)


@pytest.fixture(scope="module")
def overlap_worker(service_worker):
    return _worker(service_worker, True)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "overlap"])
def served(request, service_server):
    """The module's sync or overlap worker (the same two the worker tests drive directly) behind a server."""
    return service_server(request.getfixturevalue("overlap_worker" if request.param else "sync_worker"))


def _tokens(worker: Worker, prompt, params: SamplingParams, n: int = 1, **kw) -> list[list[dict]]:
    hs = [worker.submit(prompt, params, **kw)]
    hs += [worker.submit(prompt, params, prefill_after=hs[0].request_id, **kw) for _ in range(n - 1)]   # n > 1
    return [[e for e in h.events(timeout=60) if e["event"] in ("token", "finished")] for h in hs]


# --------------------------------------------------------------------------- one hand-off per step


def test_a_step_wakes_the_http_loop_once_not_once_per_token(service_worker):
    """Eight streams read from one event loop: each owner pass (boundary, then step) reaches that loop
    with at most one call_soon_threadsafe each, whatever the number of streams it fed."""
    sink = MemorySink()
    w = _worker(service_worker, False, sink=sink)
    calls: Counter = Counter()

    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def counting(cb, *args, **kw):
            calls[w.current_round()] += 1
            return real(cb, *args, **kw)

        loop.call_soon_threadsafe = counting
        w.pause()
        handles = [w.submit(ids(f"hand-{i}"), SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
                   for i in range(8)]

        async def read(h) -> int:
            n = 0
            while True:
                evs = await h.aget(timeout=30)
                n += sum(e["event"] == "token" for e in evs)
                if any(e["event"] == "finished" for e in evs):
                    return n
        tasks = [asyncio.ensure_future(read(h)) for h in handles]
        await asyncio.sleep(0.2)           # every reader is waiting before the first step
        w.resume()
        got = await asyncio.gather(*tasks)
        loop.call_soon_threadsafe = real
        return got

    try:
        got = asyncio.run(main())
    finally:
        w.close()
    assert got == [24] * 8
    steps = [e for e in sink.snapshot() if e["event"] == "step"]
    tokens = sum(e["num_seqs"] for e in steps if e["phase"] == "decode")
    assert tokens >= 8 * 20, tokens
    # per round: the step's flush and the next boundary's flush, never one per stream
    assert max(calls.values()) <= 2, calls
    assert sum(calls.values()) <= 2 * len(steps) + 2, (sum(calls.values()), len(steps))


# --------------------------------------------------------------------------- overlap in the worker


def test_overlap_worker_gives_the_sync_workers_greedy_tokens_and_logprobs(sync_worker, overlap_worker):
    assert overlap_worker.engine.config.overlap and not sync_worker.engine.config.overlap
    for i, (n_prompt, max_tokens) in enumerate([(10, 20), (30, 7), (5, 33)]):
        p = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
        a = _tokens(sync_worker, ids(f"eq-{i}", n_prompt), p)[0]
        b = _tokens(overlap_worker, ids(f"eq-{i}", n_prompt), p)[0]
        assert [e.get("token_id") for e in a] == [e.get("token_id") for e in b]
        assert len(a) == max_tokens + 1 and a[-1]["reason"] == b[-1]["reason"] == "length"
        for x, y in zip(a[:-1], b[:-1]):
            assert x["logprob"][0] == y["logprob"][0] and x["logprob"][1] == pytest.approx(y["logprob"][1], abs=1e-5)
            assert [t for t, _ in x["logprob"][3]] == [t for t, _ in y["logprob"][3]]


def test_overlap_worker_n_greater_than_one_and_seeded_sampling(sync_worker, overlap_worker):
    p = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=7)
    a = _tokens(sync_worker, ids("n3"), p, n=3)
    b = _tokens(overlap_worker, ids("n3"), p, n=3)
    assert [[e.get("token_id") for e in s] for s in a] == [[e.get("token_id") for e in s] for s in b]


def test_overlap_worker_stop_token_id_is_the_last_token(sync_worker, overlap_worker):
    full = [e["token_id"] for e in _tokens(sync_worker, ids("stopid"),
                                           SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0][:-1]]
    stop = full[6]
    want = full[:full.index(stop) + 1]
    for w in (sync_worker, overlap_worker):
        evs = _tokens(w, ids("stopid"), SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                      stop_token_ids=[stop])[0]
        assert [e["token_id"] for e in evs[:-1]] == want and evs[-1]["reason"] == "stop"
    wait_for(lambda: overlap_worker.snapshot().get("active", 0) == 0)
    assert overlap_worker.run_on_owner(lambda e: e.check_invariants())[0]


def test_overlap_worker_cancel_mid_stream_sends_nothing_after_finished(overlap_worker):
    free0, total = overlap_worker.run_on_owner(lambda e: (e.stats().free_blocks, e.stats().num_blocks))
    hs = [overlap_worker.submit(ids(f"cx-{i}"), SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
          for i in range(4)]
    seen = []
    for k, h in enumerate(hs):
        n = 0
        for ev in h.events(timeout=60):
            if ev["event"] == "token":
                n += 1
                if n == 3 + k:
                    overlap_worker.cancel(h.request_id)
            seen.append(ev)
        assert h.result["reason"] == "cancelled" and h.result["num_completion_tokens"] < 100
        assert h.drain() == []
    wait_for(lambda: overlap_worker.snapshot().get("active", 0) == 0)
    ok, why = overlap_worker.run_on_owner(lambda e: e.check_invariants())
    assert ok, why
    assert overlap_worker.run_on_owner(lambda e: e.stats().free_blocks) == free0
    after = _tokens(overlap_worker, ids("after"), SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0]
    assert len(after) == 6 and after[-1]["reason"] == "length"


# --------------------------------------------------------------------------- HTTP: stop strings and token counts


def _run(coro_fn):
    async def main():
        async with aiohttp.ClientSession() as s:
            return await coro_fn(s)
    return asyncio.run(main())


def test_stop_string_never_leaks_through_either_path(served):
    prompt = ids("stopstr", 10)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    full = _run(lambda s: client.stream_openai(s, served.url, body, request_id="full")).text
    assert len(full) > 8, full
    stop = full[len(full) // 2:len(full) // 2 + 3]
    want = full[:full.find(stop)]
    res = _run(lambda s: client.stream_openai(s, served.url, {**body, "stop": [stop]}, request_id="stopped"))
    assert res.text == want and res.reason == "stop"
    assert res.usage_completion_tokens == res.tokens < 24


def test_openai_token_count_is_tokens_not_chunks_with_held_back_text(served):
    """A length-finished stream whose last character could start a stop string: the server holds it
    back and sends it with the finish chunk. That chunk has text but no token."""
    prompt = ids("heldback", 10)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    full = _run(lambda s: client.stream_openai(s, served.url, body, request_id="hb-full")).text
    res = _run(lambda s: client.stream_openai(s, served.url, {**body, "stop": [full[-1] + "\x00\x01never"]},
                                              request_id="hb"))
    assert res.text == full and res.reason == "length"
    assert res.tokens == res.usage_completion_tokens == 16, (res.tokens, res.usage_completion_tokens)


def test_piece_never_counts_a_finish_chunk():
    assert client._piece({"text": "x", "finish_reason": "length"}, False) == ("x", False)
    assert client._piece({"delta": {"content": "x"}, "finish_reason": "stop"}, True) == ("x", False)
    assert client._piece({"text": "", "finish_reason": None}, False) == ("", True)
    assert client._piece({"delta": {"content": "y"}, "finish_reason": None}, True) == ("y", True)
