"""The Worker on the tiny model, in process: admission, streams, cancel, overload, faults, shutdown."""
from __future__ import annotations

import time

import pytest
from testkit import wait_for
from service_fixtures import settle_after, start_worker

from engine import RequestError, SamplingParams
from labkit.errors import UserError
from serve.errors import ServeError
from serve.observe.events import MemorySink
from serve.core.front import DuplicateRequest, WorkerUnavailable
from serve.core.worker import Worker, WorkerConfig
from labkit.load.trace import token_ids


def ids(name: str, n: int = 20) -> list[int]:
    return token_ids(3, name, n)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def blocks(worker: Worker) -> tuple[int, int]:
    return worker.run_on_owner(lambda e: (e.stats().free_blocks, e.stats().num_blocks))


@pytest.fixture(scope="module")
def sink():
    return MemorySink()


@pytest.fixture(scope="module")
def worker(tiny_model_dir, sink):
    w = start_worker(tiny_model_dir, sink=sink, max_num_batched_tokens=128, max_model_len=256, worker_id="w-test")
    yield w
    w.close()


_idle = settle_after("worker")


def test_stream_order_counts_and_common_fields(worker):
    handles = [worker.submit(ids(f"s{i}"), greedy(5), request_id=f"order-{i}", tags={"class": "short"})
               for i in range(3)]
    for h in handles:
        evs = list(h.events(timeout=20))
        assert [e["event"] for e in evs] == ["submitted", "admitted"] + ["token"] * 5 + ["finished"]
        assert [e["index"] for e in evs if e["event"] == "token"] == [1, 2, 3, 4, 5]
        assert evs[-1]["reason"] == "length" and evs[-1]["num_completion_tokens"] == 5
        assert evs[0]["class"] == "short"
        for e in evs:
            assert e["request_id"] == h.request_id and e["worker_id"] == "w-test" and e["observer"] == "engine"
            assert isinstance(e["t_ns"], int) and isinstance(e["round"], int)
        t = [e["t_ns"] for e in evs]
        assert t == sorted(t)
        rounds = [e["round"] for e in evs if e["event"] == "token"]
        assert rounds == sorted(rounds) and len(set(rounds)) == 5      # one token per step
    # max_active=2: the third request was admitted only when one of the first two finished
    admitted = {e["request_id"]: e for e in worker.sink.snapshot() if e["event"] == "admitted"
                and e["request_id"].startswith("order-")}
    assert admitted["order-0"]["active_before"] == 0 and admitted["order-1"]["active_before"] == 1
    assert admitted["order-2"]["active_before"] <= 1
    assert blocks(worker)[0] == blocks(worker)[1]


def test_text_and_chat_prompts(worker):
    h = worker.submit("Hello there", greedy(3))
    assert h.wait(20)["reason"] == "length"
    h = worker.submit([{"role": "user", "content": "Hi"}], greedy(2))
    assert h.wait(20)["num_completion_tokens"] == 2


@pytest.mark.parametrize("prompt,params,match", [
    ([], greedy(2), "empty"),
    ([151936], greedy(2), "outside the vocabulary"),
    ([-1, 5], greedy(2), "outside the vocabulary"),
    (list(range(1000, 1256)), greedy(2), "max_model_len"),
    (list(range(1000, 1200)), greedy(100), "exceeds max_model_len"),
])
def test_bad_prompts_raise_request_error(worker, prompt, params, match):
    with pytest.raises(RequestError, match=match):
        worker.submit(prompt, params)


def test_bad_request_id_and_duplicates(worker):
    with pytest.raises(RequestError, match="request_id"):
        worker.submit(ids("x"), greedy(1), request_id="has space")
    with pytest.raises(RequestError, match="reserved"):
        worker.submit(ids("x"), greedy(1), tags={"reason": "x"})
    worker.pause()
    worker.submit(ids("d"), greedy(1), request_id="dup")
    with pytest.raises(DuplicateRequest):
        worker.submit(ids("d"), greedy(1), request_id="dup")
    worker.resume()


def test_cancel_waiting_is_never_admitted(worker, sink):
    worker.pause()
    h = worker.submit(ids("w"), greedy(8), request_id="wait-c")
    assert worker.pending_ids() == ["wait-c"]
    assert worker.cancel("wait-c") is True
    worker.resume()
    fin = h.wait(10)
    assert fin["reason"] == "cancelled" and fin["cause"] == "client" and fin["admitted"] is False
    assert not [e for e in sink.snapshot() if e["request_id"] == "wait-c" and e["event"] in ("admitted", "token")]
    assert worker.cancel("wait-c") is False          # finished: nothing to cancel


def test_a_request_id_stays_taken_until_its_finish_is_out(worker):
    """The owner ends a request, then hands its outputs over at the end of the boundary: until its finished event
    is out, its id is still in flight (a feeder runs in between)."""
    h = worker.submit(ids("race", 20), greedy(200), request_id="id-race")
    wait_for(lambda: h.buffered or h.finished, 20)
    tried: list = []

    def feeder(round_: int) -> None:
        if not tried:
            try:
                tried.append(worker.submit(ids("race", 20), greedy(2), request_id="id-race"))
            except DuplicateRequest as e:
                tried.append(e)

    worker.pause()
    try:
        worker.cancel("id-race")
        worker.set_feeder(feeder)
    finally:
        worker.resume()
    try:
        assert h.wait(20)["reason"] == "cancelled"
        wait_for(lambda: tried, 20)
    finally:
        worker.set_feeder(None)
    assert isinstance(tried[0], DuplicateRequest), tried


def test_cancel_running_frees_blocks_and_stops_tokens(worker, sink):
    h = worker.submit(ids("r", 40), greedy(200), request_id="run-c")
    evs = []
    for ev in h.events(timeout=20):
        evs.append(ev)
        if ev["event"] == "token" and ev["index"] == 3:
            worker.cancel("run-c")
    assert evs[-1]["reason"] == "cancelled" and evs[-1]["admitted"] is True and evs[-1]["freed_blocks"] >= 1
    logged = [e for e in sink.snapshot() if e["request_id"] == "run-c"]
    after = logged[[e["event"] for e in logged].index("finished"):]
    assert [e["event"] for e in after] == ["finished"]              # no token after finished
    assert evs[-1]["num_completion_tokens"] < 200
    free, total = blocks(worker)
    assert free == total


def test_full_queue_rejects_with_reason_and_accepted_complete(worker):
    worker.pause()
    accepted = [worker.submit(ids(f"q{i}"), greedy(3), request_id=f"q-{i}") for i in range(3)]
    over = worker.submit(ids("q9"), greedy(3), request_id="q-over")
    assert over.rejected and over.finished
    assert over.result["reason"] == "rejected" and "queue full" in over.result["message"]
    assert [e["event"] for e in over.drain()] == ["submitted", "finished"]
    worker.resume()
    assert [h.wait(20)["reason"] for h in accepted] == ["length"] * 3


def test_slow_consumer_is_cancelled_and_buffer_bounded(worker):
    limit = 4
    h = worker.submit(ids("slow"), greedy(150), request_id="slow", stream_buffer=limit)
    fin = h.wait(30)
    assert fin["reason"] == "cancelled" and fin["cause"] == "slow_consumer"
    assert h.max_buffered <= limit + 2 and h.buffered <= limit + 2
    assert fin["num_completion_tokens"] < 150
    free, total = blocks(worker)
    assert free == total


def test_fast_consumer_is_not_cancelled(worker):
    h = worker.submit(ids("fast"), greedy(30), stream_buffer=8)
    evs = list(h.events(timeout=30))
    assert evs[-1]["reason"] == "length" and sum(e["event"] == "token" for e in evs) == 30


def test_engine_exception_fails_the_batch_and_keeps_serving(worker, sink):
    worker.pause()
    a = worker.submit(ids("fa"), greedy(6), request_id="fault-a")
    b = worker.submit(ids("fb"), greedy(6), request_id="fault-b")
    c = worker.submit(ids("fc"), greedy(4), request_id="fault-c")      # waits in the queue (max_active=2)
    worker.inject_fault(message="boom")
    worker.resume()
    for h in (a, b):
        fin = h.wait(20)
        assert fin["reason"] == "error" and "boom" in fin["message"]
    assert c.wait(20)["reason"] == "length"                             # the queued one is served
    assert worker.snapshot()["state"] == "ok"
    assert worker.submit(ids("fd"), greedy(2)).wait(20)["reason"] == "length"
    err = [e for e in sink.snapshot() if e.get("what") == "engine_error"][-1]
    assert err["consistent"] is True and sorted(err["affected"]) == ["fault-a", "fault-b"]
    free, total = blocks(worker)
    assert free == total


def test_inconsistent_engine_turns_unhealthy(tiny_model_dir):
    w = Worker(WorkerConfig(model=str(tiny_model_dir), device="cpu", max_model_len=256, load_tokenizer=False,
                            worker_id="w-bad")).start()
    try:
        w.run_on_owner(lambda e: e.block_manager._take_free_block())      # a block nobody holds
        h = w.submit(ids("x"), greedy(3))
        w.inject_fault()
        assert h.wait(20)["reason"] == "error"
        wait_for(lambda: w.snapshot()["state"] == "unhealthy")
        assert "inconsistent" in w.snapshot()["reason"]
        with pytest.raises(WorkerUnavailable, match="unhealthy"):
            w.submit(ids("y"), greedy(1))
    finally:
        w.close()


def test_close_is_idempotent_bounded_and_finishes_open_requests(tiny_model_dir):
    w = Worker(WorkerConfig(model=str(tiny_model_dir), device="cpu", max_active=1, max_model_len=256,
                            load_tokenizer=False, worker_id="w-close")).start()
    running = w.submit(ids("c1"), greedy(200))
    queued = w.submit(ids("c2"), greedy(200))
    running.get(10)
    t0 = time.monotonic()
    w.close()
    w.close()
    assert time.monotonic() - t0 < 10
    for h in (running, queued):
        assert h.result["reason"] == "cancelled" and h.result["cause"] == "shutdown"
    assert queued.result["admitted"] is False
    with pytest.raises(WorkerUnavailable, match="shut down"):
        w.submit(ids("c3"), greedy(1))
    assert w.snapshot()["state"] == "closed"


def test_init_error_reaches_start(tmp_path):
    with pytest.raises(UserError):
        Worker(WorkerConfig(model=str(tmp_path / "nope"), device="cpu")).start()


def test_config_rejects_bad_numbers():
    with pytest.raises(ServeError, match="max-active"):
        WorkerConfig(max_active=0)
    with pytest.raises(ServeError, match="worker id"):
        WorkerConfig(worker_id="bad id")


def test_an_owner_loop_bug_turns_the_worker_unhealthy_not_dead(tiny_model_dir):
    w = Worker(WorkerConfig(model=str(tiny_model_dir), device="cpu", max_model_len=256, load_tokenizer=False,
                            worker_id="w-bug")).start()
    try:
        w.pause()
        h = w.submit(ids("bug"), greedy(3))
        w.set_feeder(lambda round_: 1 / 0)
        w.resume()
        fin = h.wait(10)
        assert fin["reason"] == "error" and "ZeroDivisionError" in fin["message"]
        assert w.snapshot()["state"] == "unhealthy"
        with pytest.raises(WorkerUnavailable):
            w.submit(ids("bug2"), greedy(1))
    finally:
        w.close()


def test_offline_and_online_admission_follow_one_rule(worker, engine_factory):
    """prompt + max_tokens beyond max_model_len: the same RequestError code from Worker.submit and from
    LLMEngine.generate (the engine's validate is the one rule)."""
    prompt, params = ids("rule", 200), greedy(100)              # 300 > max_model_len 256
    with pytest.raises(RequestError) as online:
        worker.submit(prompt, params)
    engine = engine_factory(max_model_len=256, max_num_batched_tokens=128, attention_backend="auto",
                            kvcache_block_size=256)
    try:
        with pytest.raises(RequestError) as offline:
            engine.generate([prompt], params)
        assert engine.is_finished()                              # nothing of the refused batch was queued
        assert engine.generate([prompt], greedy(56))[0]["finish_reason"] == "length"   # 256 exactly fits
    finally:
        engine.close()
    assert online.value.code == offline.value.code == "context_length_exceeded"


def test_text_prompts_from_many_threads_share_no_tokenizer(worker):
    """Submit encodes under one lock; the HTTP front decodes with a tokenizer of its own."""
    import concurrent.futures

    assert worker.tokenizer is not None
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        encoded = list(pool.map(worker.encode, [f"hello number {i} " * 20 for i in range(32)]))
    assert all(e == worker.encode(f"hello number {i} " * 20) for i, e in enumerate(encoded))
    engine_tokenizer = worker.run_on_owner(lambda e: e.tokenizer)
    assert worker.tokenizer is not engine_tokenizer
