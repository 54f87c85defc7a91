"""The fuzz's issue-29 scenarios (tools/fuzz_service.py runs them after its classes): fair admission (item 1),
one cancel for every choice (item 4) and forged log lines (item 2, the ``log-injection`` class's check).

Each scenario returns a table row: ``class``, ``requests``, ``statuses``, ``5xx``, ``healthy`` like a class, plus
``ok`` and ``detail`` (what was measured)."""
from __future__ import annotations

import asyncio
import json
import re
import time

import aiohttp

EVIL = "k\r\nINFO forged line\x1b[2J"
#: raw control characters (TAB aside), DEL, C1 and lone surrogates: none may reach a log line
RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


def log_injection_bodies(rng, i: int) -> bytes:
    """A body whose refusal names a key holding CR/LF/ESC: nested beyond 32 levels, or with a lone surrogate."""
    pick = i % 3
    if pick == 0:
        inner: dict = {"x": 1}
        for _ in range(rng.choice((33, 40, 64))):
            inner = {EVIL: inner}
        body = {"model": "m", "prompt": "hi", "max_tokens": 1, **inner}
    elif pick == 1:
        body = {"model": "m", "prompt": "hi", "max_tokens": 1, EVIL + "\ud800": 1}
    else:
        body = {"model": "m", "prompt": "hi", "max_tokens": 1, "stop": [{EVIL: [[[1]]]}]}
    return json.dumps(body).encode()


def sampling_bodies(rng, i: int) -> tuple[str, bytes]:
    """A logit_bias past its bound (1024 entries; a 400 before any work), a long
    prompt's log-probs (echo + logprobs: computed in bounded chunks, the server stays healthy), and bad sampling
    values on the native /generate (refused as the OpenAI routes refuse them)."""
    pick = i % 3
    if pick == 0:
        bias = {str(t): rng.choice((-100, 5, 100)) for t in range(rng.choice((1025, 5000, 100_000)))}
        return "/v1/completions", json.dumps({"model": "", "prompt": "hi", "max_tokens": 1, "logit_bias": bias}).encode()
    if pick == 1:
        prompt = " ".join(rng.choice(("alpha", "beta", "gamma")) for _ in range(300))
        return "/v1/completions", json.dumps({"model": "", "prompt": prompt, "max_tokens": 1, "echo": True,
                                              "logprobs": 5}).encode()
    bad = rng.choice(({"top_p": -1}, {"top_k": "x"}, {"logit_bias": "x"}, {"temperature": -0.5},
                      {"min_p": 2}, {"seed": 2 ** 64}))
    return "/generate", json.dumps({"prompt": "hi", "max_tokens": 1, **bad}).encode()


def forged_lines(log_text: str) -> int:
    """Log lines that a client wrote: a line starting with the forged text, or any raw control character."""
    lines = log_text.split("\n")
    return sum(1 for line in lines if line.startswith("INFO forged") or RAW.search(line.rstrip("\r")))


async def _stream(sess, url: str, body: dict, on_first=None) -> dict:
    t0 = time.monotonic()
    async with sess.post(f"{url}/v1/completions", json={**body, "stream": True}) as resp:
        if resp.status != 200:
            await resp.read()
            return {"status": resp.status, "s": time.monotonic() - t0, "end": time.monotonic()}
        finish, tokens, first = {}, {}, True
        async for raw in resp.content:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data: {"):
                continue
            for ch in json.loads(line[6:]).get("choices", []):
                if ch.get("finish_reason"):
                    finish[ch["index"]] = ch["finish_reason"]
                else:
                    tokens[ch["index"]] = tokens.get(ch["index"], 0) + 1
            if first and on_first is not None:
                first = False
                await on_first(resp)
        return {"status": 200, "finish": finish, "tokens": tokens, "s": time.monotonic() - t0, "end": time.monotonic()}


def _row(name: str, results: list[dict], ok: bool, detail: str, healthy: bool) -> dict:
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    return {"class": name, "requests": len(results), "statuses": dict(sorted(statuses.items())),
            "5xx": sum(1 for r in results if r["status"] >= 500), "not_json_errors": 0, "healthy": healthy,
            "ok": ok, "detail": detail, "examples": []}


async def fair_admission(url: str, health, big_tokens: int = 48) -> dict:
    """n=64 first (``big_tokens`` each); then a 1-token request from another client and a concurrent n=16: the
    small one answers while the n=64 still runs, and the n=16 is not 429."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as sess:
        big = asyncio.create_task(_stream(sess, url, {"prompt": "a b c", "max_tokens": big_tokens, "n": 64,
                                                       "ignore_eos": True, "temperature": 0}))
        for _ in range(500):
            h = await health()
            if h and h.get("active", 0) >= 1:
                break
            await asyncio.sleep(0.02)
        small, mid = await asyncio.gather(
            _stream(sess, url, {"prompt": "x", "max_tokens": 1, "temperature": 0}),
            _stream(sess, url, {"prompt": "y", "max_tokens": 2, "n": 16, "ignore_eos": True, "temperature": 0}))
        big = await big
    ok = (big["status"] == small["status"] == mid["status"] == 200 and small["end"] < big["end"])
    detail = (f"1-token request {small['s'] * 1e3:.0f} ms, ended {big['end'] - small['end']:.1f} s before the n=64 "
              f"({big['s']:.1f} s); n=16 status {mid['status']}")
    return _row("fair-n64", [big, small, mid], ok, detail, await health() is not None)


async def cancel_all_choices(url: str, health, kv_free) -> dict:
    """A streamed n=3 and a two-prompt request, cancelled after the first chunk: every choice ends abort, well
    before max_tokens, and the KV pool is whole again."""
    results, fine = [], True
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as sess:
        async def cancel(resp):
            body = {"request_id": resp.headers["X-Request-Id"], "cancel_token": resp.headers["X-Cancel-Token"]}
            async with sess.post(f"{url}/cancel", json=body) as r:
                await r.read()

        for shape in ({"prompt": "a b", "n": 3}, {"prompt": ["a b", "c d"]}):
            r = await _stream(sess, url, {**shape, "max_tokens": 400, "ignore_eos": True, "temperature": 0}, cancel)
            results.append(r)
            want = shape.get("n", 2)
            fine &= (r["status"] == 200 and r.get("finish") == {i: "abort" for i in range(want)}
                     and max(r["tokens"].values()) < 200)
    free, total = await kv_free()
    fine &= free == total
    detail = "; ".join(f"finish {r.get('finish')} tokens {r.get('tokens')}" for r in results) + f"; KV {free}/{total}"
    return _row("cancel-all-choices", results, fine, detail, await health() is not None)
