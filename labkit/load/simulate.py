"""``labkit simulate``: the whole chain on CPU, with the lifecycle cases of handbook 5.7.1.

Worker (real engine, tiny synthetic model by default) → HTTP server on 127.0.0.1 (free port) →
client (the same code as ``labkit client``/``load``) → report. Scenarios, in order:

1. ``streaming``: three concurrent streams; each is submitted → admitted → token 1..N → finished.
2. ``waiting_cancel``: a request cancelled while queued finishes cancelled and is never admitted.
3. ``running_cancel``: ``cancel_after=3``: finished cancelled, no token after it, every KV block free.
4. ``full_queue``: with the owner held, ``queue_size`` requests queue up, the next gets 429, the
   accepted ones all complete.
5. ``slow_consumer``: a stream nobody reads (in process: HTTP socket buffers would hide it) is
   cancelled with ``cause=slow_consumer`` and its buffer stays bounded.
6. ``disconnect``: a client that goes away after two tokens gets its request cancelled.
7. ``engine_exception``: an injected fault inside ``engine.step()`` fails the batch's requests with
   ``error``; the engine stays consistent and the worker keeps serving.
8. ``shutdown``: closing the server mid-stream finishes every open request (cancelled/shutdown),
   frees every block, is idempotent, refuses new work and releases the port.

The owner is held (``Worker.pause``) where a case needs a request to stay queued, so every case is
deterministic. The log (``--out X.jsonl``) holds the engine's and the client's events; the evidence
(``X.json``) holds per-scenario facts judged by checkpoint ``service.simulate``.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from engine import SamplingParams
from labkit.evidence import envelope, write_evidence
from labkit.lab_engine import LAB_BUILDER
from labkit.paths import default_out
from labkit.load import client
from serve.observe.events import EventLog, MemorySink, fan_out, split_out
from serve.entrypoints.api_server import ServerThread, bind_socket
from serve.core.config import WorkerConfig
from serve.core.front import WorkerUnavailable
from serve.core.worker import Worker
from labkit.load.trace import token_ids

CHECKPOINT = "service.simulate"
QUEUE_SIZE = 3
MAX_ACTIVE = 2
SLOW_BUFFER = 4


def _ids(name: str, n: int = 24) -> list[int]:
    return token_ids(5, name, n)


def _body(rid: str, max_tokens: int, n: int = 24) -> dict:
    return {"request_id": rid, "prompt_token_ids": _ids(rid, n), "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0}


async def _until(pred, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"simulate: timed out waiting for {what}")
        await asyncio.sleep(0.01)


def _blocks(worker: Worker) -> dict:
    free, total = worker.run_on_owner(lambda e: (e.stats().free_blocks, e.stats().num_blocks))
    return {"free": free, "total": total, "all_free": free == total}


def _order_ok(events: list[dict], n_tokens: int) -> bool:
    names = [e["event"] for e in events if e["event"] in ("submitted", "admitted", "token", "finished")]
    want = ["submitted", "admitted"] + ["token"] * n_tokens + ["finished"]
    idx = [e.get("index") for e in events if e["event"] == "token"]
    return names == want and idx == list(range(1, n_tokens + 1))


def _engine_events(mem: MemorySink, rid: str) -> list[dict]:
    return [e for e in mem.snapshot() if e.get("request_id") == rid and e.get("observer") == "engine"]


def _tokens_after_finished(events: list[dict]) -> int:
    seen, after = False, 0
    for e in events:
        if e["event"] == "finished":
            seen = True
        elif e["event"] == "token" and seen:
            after += 1
    return after


@dataclass
class _Sim:
    """What every scenario works with: the server's URL, one client session, the worker, the in-memory
    event log and the recorder of the client's events."""
    server: ServerThread
    worker: Worker
    mem: MemorySink
    record: Callable[[dict], None]
    sess: Any = None

    @property
    def url(self) -> str:
        return self.server.url

    def stream(self, rid: str, max_tokens: int, **kw):
        return client.stream_native(self.sess, self.url, _body(rid, max_tokens), record=kw.pop("record", self.record),
                                    log_server_events=False, **kw)

    def queue(self, names: list[str], max_tokens: int) -> list[asyncio.Task]:
        return [asyncio.create_task(self.stream(n, max_tokens)) for n in names]

    async def blocks(self) -> dict:
        return await asyncio.get_running_loop().run_in_executor(None, _blocks, self.worker)


async def _streaming(sim: _Sim) -> dict:
    """Three concurrent streams; each is submitted, admitted, token 1..N, finished."""
    rids = [f"stream-{i}" for i in range(3)]
    per: dict[str, list[dict]] = {r: [] for r in rids}

    def rec_for(rid):
        def rec(ev: dict) -> None:
            sim.record(ev)
            if ev.get("observer") == "client":
                per[rid].append(ev)
        return rec

    results = await asyncio.gather(*[sim.stream(r, 6, record=rec_for(r)) for r in rids])
    admitted = [e.get("active_before") for r in rids for e in _engine_events(sim.mem, r) if e["event"] == "admitted"]
    out = {
        "requests": len(rids), "reasons": [res.reason for res in results],
        "tokens": [res.tokens for res in results],
        "client_order_ok": all(_order_ok(per[r], 6) for r in rids),
        "engine_order_ok": all(_order_ok(_engine_events(sim.mem, r), 6) for r in rids),
        "active_before_at_admission": admitted,
    }
    out["ok"] = out["client_order_ok"] and out["engine_order_ok"] and out["tokens"] == [6, 6, 6]
    return out


async def _waiting_cancel(sim: _Sim) -> dict:
    """A request cancelled while queued finishes cancelled and is never admitted."""
    sim.worker.pause()
    task = asyncio.create_task(sim.stream("wait-cancel", 16))
    await _until(lambda: "wait-cancel" in sim.worker.pending_ids(), what="wait-cancel queued")
    status = await client.cancel(sim.sess, sim.url, "wait-cancel")
    sim.worker.resume()
    res = await task
    fin = [e for e in _engine_events(sim.mem, "wait-cancel") if e["event"] == "finished"]
    out = {"cancel_status": status, "reason": res.reason, "cause": res.cause, "tokens": res.tokens,
           "admitted": bool(fin and fin[0].get("admitted")),
           "admitted_events": sum(e["event"] == "admitted" for e in _engine_events(sim.mem, "wait-cancel"))}
    out["ok"] = status == 200 and res.reason == "cancelled" and res.tokens == 0 and out["admitted_events"] == 0
    return out


async def _running_cancel(sim: _Sim) -> dict:
    """``cancel_after=3``: finished cancelled, no token after it, every KV block free."""
    res = await sim.stream("run-cancel", 64, cancel_after=3)
    ev = _engine_events(sim.mem, "run-cancel")
    blocks = await sim.blocks()
    out = {"reason": res.reason, "cause": res.cause, "client_tokens": res.tokens,
           "cancel_sent_after": res.cancel_sent_after,
           "client_tokens_after_finished": res.tokens_after_finished,
           "engine_tokens_after_finished": _tokens_after_finished(ev),
           "kv_blocks": blocks}
    out["ok"] = (res.reason == "cancelled" and res.tokens >= 3 and res.tokens < 64
                 and res.tokens_after_finished == 0 and out["engine_tokens_after_finished"] == 0
                 and blocks["all_free"])
    return out


async def _full_queue(sim: _Sim) -> dict:
    """With the owner held, ``queue_size`` requests queue up, the next gets 429, the accepted ones complete."""
    sim.worker.pause()
    tasks = sim.queue([f"queued-{i}" for i in range(QUEUE_SIZE)], 4)
    await _until(lambda: len(sim.worker.pending_ids()) == QUEUE_SIZE, what="queue filled")
    over = await sim.stream("over-limit", 4)
    sim.worker.resume()
    accepted = await asyncio.gather(*tasks)
    out = {"queue_size": QUEUE_SIZE, "over_status": over.status, "over_reason": over.reason,
           "over_message": over.message, "accepted_reasons": [r.reason for r in accepted],
           "accepted_tokens": [r.tokens for r in accepted]}
    out["ok"] = over.status == 429 and all(r.reason == "length" and r.tokens == 4 for r in accepted)
    return out


async def _slow_consumer(sim: _Sim) -> dict:
    """A stream nobody reads (in process: the stream is simply never read) is cancelled, its buffer bounded."""
    handle = sim.worker.submit(_ids("slow"), SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True),
                               request_id="slow-consumer", stream_buffer=SLOW_BUFFER)
    fin = await asyncio.get_running_loop().run_in_executor(None, handle.wait, 30.0)
    blocks = await sim.blocks()
    out = {"stream_buffer": SLOW_BUFFER, "reason": (fin or {}).get("reason"),
           "cause": (fin or {}).get("cause"), "max_buffered": handle.max_buffered,
           "bound": SLOW_BUFFER + 2, "tokens_generated": (fin or {}).get("num_completion_tokens"),
           "kv_blocks": blocks}
    out["ok"] = (out["reason"] == "cancelled" and out["cause"] == "slow_consumer"
                 and handle.max_buffered <= SLOW_BUFFER + 2 and blocks["all_free"])
    return out


async def _disconnect(sim: _Sim) -> dict:
    """A client that goes away after two tokens gets its request cancelled."""
    got = 0
    async with sim.sess.post(f"{sim.url}/generate", json=_body("disconnect", 64)) as resp:
        async for line in resp.content:
            if b'"event":"token"' in line:
                got += 1
                if got == 2:
                    break
        resp.close()
    await _until(lambda: any(e["event"] == "finished" for e in _engine_events(sim.mem, "disconnect")),
                 what="disconnect cancel")
    fin = [e for e in _engine_events(sim.mem, "disconnect") if e["event"] == "finished"][0]
    out = {"tokens_read": got, "reason": fin.get("reason"), "cause": fin.get("cause"),
           "engine_tokens": fin.get("num_completion_tokens")}
    out["ok"] = fin.get("reason") == "cancelled" and fin.get("cause") == "disconnect"
    return out


async def _engine_exception(sim: _Sim) -> dict:
    """An injected fault inside ``engine.step()`` fails the batch with ``error``; the worker keeps serving."""
    sim.worker.pause()
    tasks = sim.queue(["fault-a", "fault-b"], 8)
    await _until(lambda: len(sim.worker.pending_ids()) == 2, what="fault requests queued")
    sim.worker.inject_fault(message="injected fault (simulate)")
    sim.worker.resume()
    failed = await asyncio.gather(*tasks)
    after = await sim.stream("after-fault", 5)
    async with sim.sess.get(f"{sim.url}/health") as resp:
        health_status = resp.status
        health = await resp.json()
    blocks = await sim.blocks()
    err = [e for e in sim.mem.snapshot() if e.get("event") == "worker" and e.get("what") == "engine_error"]
    out = {"affected_reasons": [r.reason for r in failed],
           "messages": [r.message for r in failed],
           "engine_consistent": bool(err and err[-1].get("consistent")),
           "after_reason": after.reason, "after_tokens": after.tokens,
           "health_status": health_status, "health_state": health.get("status"),
           "kv_blocks": blocks,
           "policy": "the failed batch ends with error; a consistent engine keeps serving"}
    out["ok"] = (all(r.reason == "error" for r in failed) and after.reason == "length"
                 and health_status == 200 and blocks["all_free"])
    return out


async def _close_mid_stream(sim: _Sim) -> tuple[list, float]:
    """(the streams' results, seconds the close took): the server closed while its streams run."""
    names = [f"shutdown-{i}" for i in range(MAX_ACTIVE + 1)]     # one of them waits in the queue
    tasks = sim.queue(names, 200)
    await _until(lambda: any(e["event"] == "token" for e in _engine_events(sim.mem, names[0])), what="streaming")
    t0 = time.monotonic()
    await asyncio.get_running_loop().run_in_executor(None, sim.server.close)
    close_s = time.monotonic() - t0
    return await asyncio.gather(*tasks), close_s


def _shutdown(sim: _Sim, stopped: list, close_s: float) -> dict:
    """After the close: every open request finished (cancelled/shutdown), every block free, a second
    close idempotent, new work refused, the port released."""
    t1 = time.monotonic()
    sim.server.close()
    sim.worker.close()
    again_s = time.monotonic() - t1
    try:
        sim.worker.submit(_ids("late"), SamplingParams(max_tokens=2))
        refused = False
    except WorkerUnavailable:
        refused = True
    port = int(sim.url.rsplit(":", 1)[1])
    try:
        bind_socket("127.0.0.1", port).close()
        released = True
    except Exception:
        released = False
    closed = [e for e in sim.mem.snapshot() if e.get("event") == "worker" and e.get("what") == "closed"]
    out = {"reasons": [r.reason for r in stopped], "causes": [r.cause for r in stopped],
           "close_seconds": round(close_s, 3), "second_close_seconds": round(again_s, 3),
           "new_work_refused": refused, "port_released": released,
           "blocks_free_after_close": closed[-1].get("free_blocks") if closed else None,
           "blocks_total": closed[-1].get("total_blocks") if closed else None}
    out["ok"] = (all(r.reason == "cancelled" and r.cause == "shutdown" for r in stopped) and refused
                 and released and closed and closed[-1].get("free_blocks") == closed[-1].get("total_blocks"))
    return out


#: The scenarios in the order they run (the module docstring says what each shows); shutdown ends them.
_SCENARIOS = (("streaming", _streaming), ("waiting_cancel", _waiting_cancel), ("running_cancel", _running_cancel),
              ("full_queue", _full_queue), ("slow_consumer", _slow_consumer), ("disconnect", _disconnect),
              ("engine_exception", _engine_exception))


async def _scenarios(server: ServerThread, worker: Worker, mem: MemorySink, record, facts: dict) -> None:
    sim = _Sim(server, worker, mem, record)
    sc: dict[str, Any] = facts["scenarios"]
    async with client.session(60.0) as sess:
        sim.sess = sess
        for name, scenario in _SCENARIOS:
            sc[name] = await scenario(sim)
        stopped, close_s = await _close_mid_stream(sim)
    sc["shutdown"] = _shutdown(sim, stopped, close_s)


def run_simulate(out: str | Path | None = None, model: str | None = None) -> dict:
    """Run every scenario; returns the evidence record (judged by ``service.simulate``)."""
    events_path, evidence_path = split_out(out or default_out("runtime-cpu.json"))
    mem = MemorySink()
    log = EventLog(events_path)
    cfg = WorkerConfig(model=model, device="cpu", max_active=MAX_ACTIVE, queue_size=QUEUE_SIZE, max_num_batched_tokens=256,
                       max_num_seqs=4, max_model_len=512, worker_id="sim-0")
    worker = Worker(cfg, sink=fan_out(log.write, mem), build=LAB_BUILDER)
    server = None
    t0 = time.monotonic()
    try:
        worker.start()
        log.write_header(worker.header(envelope, role="simulate", mode="scenarios"))
        server = ServerThread(worker).start()
        facts: dict[str, Any] = {"url": server.url, "scenarios": {}, "worker": cfg.flat()}
        record = log.write
        asyncio.run(_scenarios(server, worker, mem, record, facts))
    finally:
        if server is not None:
            server.close()
        worker.close()
        log.close()
    facts["seconds"] = round(time.monotonic() - t0, 2)
    facts["all_ok"] = all(s.get("ok") for s in facts["scenarios"].values())
    facts["failed_scenarios"] = [k for k, s in facts["scenarios"].items() if not s.get("ok")]
    from labkit.load.report import summarize

    summary = summarize(events_path)
    facts["report"] = {obs: {k: o[k] for k in ("requests", "completed", "terminations", "causes", "rejections",
                                                "output_tokens", "ttft_ms", "itl_ms")}
                       for obs, o in summary["observers"].items()}
    facts["events"] = str(events_path)
    served = worker.served
    return write_evidence(evidence_path, checkpoint=CHECKPOINT, kind=served.kind, facts=facts, device=served.device,
                          model=served.model, seed=served.seed, engine=served.describe())
