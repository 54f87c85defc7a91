"""Issue 29 items 1 and 4: fair admission across requests (a request's n x prompts sequences are one request in
the queue, round-robin running slots, a per-request cap) and one /cancel that stops every choice of a request.

One server on the tiny model (four running slots, a queue of sixteen requests) for the module."""
from __future__ import annotations

import asyncio
import json
import re
import time

import aiohttp
import pytest
from service_fixtures import ids, kv, serving, settle_after
from testkit import wait_for

from serve.core.fair import Groups, per_request_cap, pick

BIG_TOKENS = 12


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    yield from serving(tiny_model_dir, record=False, max_active=4, queue_size=16, max_num_seqs=4)


_idle = settle_after("served")


def _completion(prompt: list[int], max_tokens: int, **extra) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            **extra}


async def _sse(sess: aiohttp.ClientSession, url: str, body: dict, on_first=None) -> dict:
    """Stream a completion: status, the choices' finish reasons and token counts, when it ended (monotonic)."""
    async with sess.post(f"{url}/v1/completions", json={**body, "stream": True}) as resp:
        if resp.status != 200:
            return {"status": resp.status, "body": await resp.text(), "done": time.monotonic()}
        finish: dict[int, str] = {}
        tokens: dict[int, int] = {}
        first = True
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in json.loads(line[6:])["choices"]:
                if ch["finish_reason"] is not None:
                    finish[ch["index"]] = ch["finish_reason"]
                elif ch["text"]:
                    tokens[ch["index"]] = tokens.get(ch["index"], 0) + 1
            if first and on_first is not None:
                first = False
                await on_first(resp)
        return {"status": 200, "finish": finish, "tokens": tokens, "done": time.monotonic()}


def test_pick_round_robin_and_cap():
    """The rule on its own: fewest running first, ties by arrival, a group stops at its cap."""
    class R:
        def __init__(self, group):
            self.group = group

    big = [R("big") for _ in range(8)]
    small = R("small")
    chosen = pick([*big, small], [], free=4, cap=3)
    assert [r.group for r in chosen] == ["big", "small", "big", "big"]
    assert pick(big, [R("big")] * 3, free=1, cap=3) == []
    assert per_request_cap(4, None) == 3 and per_request_cap(1, None) == 1 and per_request_cap(8, 2) == 2
    g = Groups()
    for _ in range(3):
        g.add("a")
    assert g.has_room("a", 1) and not g.has_room("b", 1)       # a sibling joins, a new request does not


def test_small_request_answers_while_n16_runs_and_n8_is_not_refused(served):
    """n=16 arrives first; a 1-token request from another client then finishes while the big one still runs, and a
    concurrent n=8 is queued (two requests in a queue of sixteen), not 429."""
    async def main():
        async with aiohttp.ClientSession() as sess:
            big = asyncio.create_task(_sse(sess, served.url, _completion(ids("big"), BIG_TOKENS, n=16)))
            for _ in range(3000):                          # the big request is running
                if served.worker.snapshot().get("active", 0) >= 1:
                    break
                await asyncio.sleep(0.01)
            t0 = time.monotonic()
            small, mid = await asyncio.gather(_sse(sess, served.url, _completion(ids("small"), 1)),
                                              _sse(sess, served.url, _completion(ids("mid"), 2, n=8)))
            return await big, small, mid, t0

    big, small, mid, t0 = asyncio.run(main())
    assert big["status"] == 200 and small["status"] == 200, (big, small)
    assert mid["status"] == 200, mid                      # the old rule: 12 waiting sequences + 8 > 16 -> 429
    assert small["finish"] == {0: "length"} and len(mid["finish"]) == 8
    assert small["done"] < big["done"], "the 1-token request waited for the whole n=16 request"
    assert big["finish"] == {i: "length" for i in range(16)}, big
    wait_for(lambda: kv(served.worker)[0] == kv(served.worker)[1], 10)


@pytest.mark.parametrize("shape", [dict(n=3), dict(prompts=2)])
def test_cancel_stops_every_choice(served, shape):
    """/cancel with the answer's id and token ends every choice of an n=3 / two-prompt stream (finish_reason
    "abort", the OpenAI face of cancelled), long before max_tokens; the KV pool is whole again."""
    max_tokens = 200
    prompt = [ids("c0"), ids("c1")] if "prompts" in shape else ids("c0")
    body = _completion(prompt, max_tokens, **({"n": shape["n"]} if "n" in shape else {}))
    expected = shape.get("n", 2)

    async def main():
        async with aiohttp.ClientSession() as sess:
            async def cancel(resp):
                rid, token = resp.headers["X-Request-Id"], resp.headers["X-Cancel-Token"]
                async with sess.post(f"{served.url}/cancel", json={"request_id": rid, "cancel_token": token}) as r:
                    assert r.status == 200, await r.text()
            return await _sse(sess, served.url, body, on_first=cancel)

    res = asyncio.run(main())
    assert res["status"] == 200, res
    assert res["finish"] == {i: "abort" for i in range(expected)}, res
    assert max(res["tokens"].values()) < max_tokens // 2, res
    wait_for(lambda: served.worker.snapshot().get("active", 1) == 0, 10)
    free, total = kv(served.worker)
    assert free == total, (free, total)


EVIL = "k\r\nINFO forged line\x1b[2J"


def _nested(depth: int) -> dict:
    inner: dict = {"x": 1}
    for _ in range(depth):
        inner = {EVIL: inner}
    return inner


@pytest.mark.parametrize("body", [
    {"model": "tiny", "prompt": "hi", **_nested(40)},                       # nested beyond 32 levels under EVIL
    {"model": "tiny", "prompt": "hi", EVIL + "\ud800": 1},                  # a key with a lone surrogate
], ids=["nested", "surrogate"])
def test_access_log_escapes_client_values(served, caplog, body):
    """One access line per request and no raw control character or surrogate in it, whatever the body holds."""
    raw = json.dumps(body).encode()                   # json escapes the surrogate as \ud800: it reaches the parser
    caplog.set_level("INFO", logger="labkit.access")

    async def main():
        async with aiohttp.ClientSession() as sess:
            async with sess.post(f"{served.url}/v1/completions", data=raw,
                                 headers={"Content-Type": "application/json"}) as resp:
                return resp.status

    status = asyncio.run(main())
    assert status == 400
    def refusals() -> list[str]:
        """The access lines of refusals (they name a param); an earlier test's request may log its line late."""
        return [m for m in (r.getMessage() for r in caplog.records if r.name == "labkit.access") if "param=" in m]

    wait_for(refusals, 5)
    lines = refusals()
    assert len(lines) == 1, lines
    assert not re.search("[\x00-\x1f\x7f-\x9f\ud800-\udfff]", lines[0]), lines
    assert "\\r\\nINFO forged line\\x1b" in lines[0], lines                            # shown, escaped


def test_event_log_lines_escape_control_characters(tmp_path):
    """The JSONL event log: one line per record, DEL / C1 / line separators / surrogates as JSON escapes."""
    from serve.observe.events import dumps_line
    from serve.observe.logsafe import safe

    rec = {"event": "finished", "request_id": "r", "message": EVIL + "\x9b2J\u2028\ud800"}
    line = dumps_line(rec)
    assert line.count("\n") == 1 and line.endswith("\n")
    assert not re.search("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]", line[:-1]), repr(line)
    assert json.loads(line) == rec
    shown = safe(rec["message"])
    assert shown == "k\\r\\nINFO forged line\\x1b[2J\\x9b2J\\u2028\\ud800"
