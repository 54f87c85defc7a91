"""The load client in an all-at-once burst: each request leaves before the next one is made, its body serialised
before the window opens and sent as those bytes, and no full garbage collection of the client's heap inside
the window."""
from __future__ import annotations

import asyncio
import gc
import json

from aiohttp import web

from labkit.load import client
from labkit.load.replay import LoadOptions, Router, drive_http
from serve.observe.events import EventLog


def burst(n: int = 6) -> list[dict]:
    return [{"request_id": f"b{i}", "index": i, "class": "all", "arrival_ms": 0.0, "prompt_token_ids": [1000 + i] * 8,
             "prompt_tokens": 8, "max_tokens": 3} for i in range(n)]


class Recording(Router):
    def __init__(self, endpoints, seen):
        super().__init__(endpoints)
        self.seen = seen

    def pick(self, r: dict) -> int:
        self.seen.append(("made", r["request_id"]))
        return super().pick(r)


def fake_drive(tmp_path, monkeypatch, api: str = "native", reqs: list[dict] | None = None):
    """drive_http over a fake client: what each request's stream was given, in the order things happened."""
    seen: list[tuple] = []
    given: dict[str, dict] = {}

    async def health(sess, ep):
        return {"worker_id": "w0", "kind": "cpu-real-engine"}

    async def model_name(sess, ep):
        return "served"

    async def stream(sess, ep, body, *, request_id=None, payload=None, **kw):
        rid = request_id or body["request_id"]
        seen.append(("sent", rid))
        given[rid] = {"body": body, "payload": payload, "frozen": gc.get_freeze_count()}
        await asyncio.sleep(0.01)
        return client.ClientResult(rid, ep, reason="length")

    monkeypatch.setattr(client, "fetch_health", health)
    monkeypatch.setattr(client, "fetch_model_name", model_name)
    monkeypatch.setattr(client, "stream_native", stream)
    monkeypatch.setattr(client, "stream_openai", stream)
    reqs = reqs if reqs is not None else burst()
    opts = LoadOptions(trace=tmp_path / "t.jsonl", out=tmp_path / "load.jsonl", api=api, show_progress=False)
    log = EventLog(tmp_path / "load.jsonl")
    try:
        asyncio.run(drive_http(opts, reqs, reqs[:1] and [{**reqs[0], "request_id": "warm"}],
                               Recording(["http://127.0.0.1:9"], seen), log))
    finally:
        log.close()
    return seen, given


def test_a_burst_sends_each_request_before_the_next_is_made(tmp_path, monkeypatch):
    seen, _ = fake_drive(tmp_path, monkeypatch)
    order = [(what, rid) for what, rid in seen if rid != "warm-e0"]
    ids = [f"b{i}" for i in range(6)]
    for a, b in zip(ids, ids[1:]):
        assert order.index(("sent", a)) < order.index(("made", b)), order


def test_bodies_are_serialised_before_the_window_and_sent_as_they_are(tmp_path, monkeypatch):
    _, given = fake_drive(tmp_path, monkeypatch)
    assert given["warm-e0"]["payload"] is None                  # the warmup: serialised when sent, as before
    for i in range(6):
        g = given[f"b{i}"]
        assert g["payload"] == client.json_body(g["body"])
        assert json.loads(g["payload"]) == g["body"]
        assert g["body"]["prompt_token_ids"] == [1000 + i] * 8 and g["body"]["detokenize"] is False


def test_openai_bodies_are_serialised_with_the_stream_fields(tmp_path, monkeypatch):
    _, given = fake_drive(tmp_path, monkeypatch, api="openai")
    for i in range(6):
        g = given[f"b{i}"]
        assert g["body"]["model"] == "served"
        assert json.loads(g["payload"]) == {**g["body"], "stream": True, "stream_options": {"include_usage": True}}


def test_the_window_runs_on_a_frozen_heap_and_unfreezes_after(tmp_path, monkeypatch):
    assert gc.get_freeze_count() == 0
    _, given = fake_drive(tmp_path, monkeypatch)
    assert given["warm-e0"]["frozen"] == 0
    assert all(given[f"b{i}"]["frozen"] > 0 for i in range(6))
    assert gc.get_freeze_count() == 0


def test_stream_native_posts_the_payload_bytes_as_json():
    got: dict = {}

    async def generate(request: web.Request) -> web.StreamResponse:
        got["type"] = request.headers.get("Content-Type")
        got["raw"] = await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        await resp.write(b'{"event":"token","request_id":"p1","t_ns":1,"index":0,"token_id":7}\n'
                         b'{"event":"finished","request_id":"p1","t_ns":2,"reason":"length"}\n')
        await resp.write_eof()
        return resp

    async def main():
        app = web.Application()
        app.router.add_post("/generate", generate)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        body = {"request_id": "p1", "prompt_token_ids": [5, 6], "max_tokens": 1}
        payload = b'{"request_id":"p1", "prompt_token_ids":[5,6],"max_tokens":1}'
        try:
            async with client.session() as sess:
                return await client.stream_native(sess, url, body, payload=payload), payload
        finally:
            await runner.cleanup()

    res, payload = asyncio.run(main())
    assert got["raw"] == payload and got["type"] == "application/json"
    assert res.reason == "length" and res.token_ids == [7]
