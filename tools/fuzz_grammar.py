"""The structured-output classes and scenarios of tools/fuzz_service.py: hostile schemas, grammars, regexes,
choices and tools (each streamed or not, on every route that takes them), and the scenarios where one client's
constraint could slow or endanger the others:

- ``distinct-schemas``: N distinct large schemas one after another; the server's RSS before and after (the
  compiled-grammar cache is bounded by bytes);
- ``hostile-latency``: a plain 8-token request's latency idle, then while clients loop costly grammars (an
  ambiguous EBNF, schemas whose compile takes seconds);
- ``large-constrained``: ``/health`` latency (p50, p99, max) while 8 large chat requests with tool_choice
  required arrive at once.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path

import aiohttp

EVIL = "k\r\nINFO forged line\x1b[2J"
AMBIGUOUS = 'root ::= (s)*\ns ::= s s | [a-z] | s'          # its matcher's work grows with every character
GEN_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")


def deep_schema_text(n: int) -> str:
    return '{"type": "array", "items": ' * n + '{"type": "string"}' + "}" * n


def wide_schema(tag: str, n: int, required: bool = True) -> dict:
    names = [f"{tag}_{i}" for i in range(n)]
    schema = {"type": "object", "properties": {k: {"type": "string", "maxLength": 8} for k in names}}
    if required:
        schema["required"] = names
    return schema


#: Patterns beside length bounds (engine/sampling/string_bounds.py): narrowed, a grammar of their own, past its
#: compile-work bound, refused, overflowing Python's parser.
PATTERNS = (r"^[a-z]+$", r"^\w+@\w+\.com$", r"^.+ .+$", r"^[^@\s]+@[^@\s]+$", r"(?i)a+", r"(a)\1", r"a{4294967295}",
            r"(a+){1000}", "(" * 200 + "a+b+" + ")" * 200, r"[^\s\S]+")


def hostile_schema(rng, evil_refs: bool) -> dict | str:
    return rng.choice((
        lambda: deep_schema_text(rng.choice((64, 1000, 5000))),
        lambda: {"type": "foo"},
        lambda: {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
        lambda: {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        lambda: {"type": "string", "pattern": "(("},
        lambda: {"type": "string", "pattern": rng.choice(PATTERNS), "minLength": rng.choice((0, 3, 10 ** 6)),
                 "maxLength": rng.choice((1, 8, 254, 10 ** 6))},
        lambda: {"type": "object", "properties": {"a": {"$ref": "http://x/" + (EVIL if evil_refs else "y")}}},
        lambda: {"type": "string", "format": EVIL},
        lambda: wide_schema(f"o{rng.randrange(10 ** 6)}", rng.choice((50, 200, 300)), required=False),
        lambda: {"enum": [f"v{i}" for i in range(rng.choice((10, 5000)))]},
        lambda: {"type": "integer", "minimum": 10, "maximum": 1},
        lambda: {"type": "array", "minItems": 10 ** 6},
        lambda: True,
        lambda: [],
    ))()


def _gen_body(route: str, stream: bool, constraint: dict, max_tokens: int = 8) -> dict:
    if route == "/v1/chat/completions":
        body = {"messages": [{"role": "user", "content": "go"}]}
    else:
        body = {"prompt": "go"}
    return {**body, "max_tokens": max_tokens, "stream": stream, **constraint}


def classes(rng, http, j, evil_refs: bool = False) -> dict:
    """name -> a function of i giving (request bytes, options for fuzz_service.exchange). ``evil_refs``: some
    schemas carry a ``$ref`` URI with CR, LF and ESC, which xgrammar's C++ quotes on stderr itself: only for
    `labkit serve`, which escapes that output (an in-process server under a test runner does not)."""

    def send(route: str, body: dict):
        return http("POST", route, j(body)), {"read_timeout": 120}

    def schemas(i):
        route, stream = rng.choice(GEN_ROUTES), rng.random() < 0.5
        schema = hostile_schema(rng, evil_refs)
        where = rng.choice(("structured_outputs", "guided_json", "response_format"))
        if where == "structured_outputs":
            c = {"structured_outputs": {"json": schema}}
        elif where == "guided_json" and route != "/generate":
            c = {"guided_json": schema}
        elif route != "/generate":
            c = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
        else:
            c = {"structured_outputs": {"json": schema}}
        return send(route, _gen_body(route, stream, c))

    def grammars(i):
        route, stream = rng.choice(GEN_ROUTES), rng.random() < 0.5
        g = rng.choice((AMBIGUOUS, "root ::= ", "root ::= root", 'root ::= root "a" | "a"', "x ::= \"a\"",
                        "root ::= " + " | ".join(f'"w{k}"' for k in range(rng.choice((10, 20000)))),
                        f'root ::= "{EVIL}"', "root ::= [", 'root ::= "a"{1000000}', "root ::= (" * 3000))
        key = "guided_grammar" if route != "/generate" and rng.random() < 0.3 else None
        c = {key: g} if key else {"structured_outputs": {"grammar": g}}
        return send(route, _gen_body(route, stream, c, max_tokens=rng.choice((8, 32))))

    def regexes(i):
        route, stream = rng.choice(GEN_ROUTES), rng.random() < 0.5
        r = rng.choice(("((", r"[^\s\S]", "(a+)+$", "a{100000}", r"\p{L}+", "(?=x)x", EVIL, "[z-a]", "a{2,1}",
                        "(" * 5000 + ")" * 5000, r"\d{3}-\d{2}"))
        key = "guided_regex" if route != "/generate" and rng.random() < 0.3 else None
        c = {key: r} if key else {"structured_outputs": {"regex": r}}
        return send(route, _gen_body(route, stream, c))

    def choices(i):
        route, stream = rng.choice(GEN_ROUTES), rng.random() < 0.5
        pick = rng.randrange(7)
        extra: dict = {}
        if pick == 0:
            ch: object = []
        elif pick == 1:
            ch = [""]
        elif pick == 2:
            ch = [f"c{k}" for k in range(rng.choice((1000, 20000)))]
        elif pick == 3:
            ch = [1, 2]
        elif pick == 4:
            ch = ["x" * 100_000]
        elif pick == 5:
            ch, extra = ["left", "right"], {"allowed_token_ids": [0, 1]}
        else:
            ch, extra = ["a", "b"], {"min_tokens": 50}
        key = "guided_choice" if route != "/generate" and rng.random() < 0.3 else None
        c = {key: ch} if key else {"structured_outputs": {"choice": ch}}
        return send(route, {**_gen_body(route, stream, c), **extra})

    def tools(i):
        stream = rng.random() < 0.5
        params = rng.choice((
            {"type": "object", "properties": {"a": {"type": "foo"}}},
            {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
            {"type": "object", "$defs": {"n": {"$ref": "#/$defs/n"}}, "properties": {"a": {"$ref": "#/$defs/n"}}},
            {"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}},
            {"type": "object", "properties": {"a": {"type": "string", "pattern": rng.choice(PATTERNS),
                                                    "maxLength": rng.choice((2, 40, 10 ** 6))}}},
            {"type": "object", "$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}}}},
             "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"]},
            {"type": "object", "properties": {"a": {"$ref": "http://x/" + (EVIL if evil_refs else "y")}}},
            json.loads(deep_schema_text(rng.choice((64, 500)))),
            wide_schema(f"t{rng.randrange(10 ** 6)}", 200, required=False),
            "not an object",
        ))
        tool = {"type": "function", "function": {"name": "f", "description": "d", "parameters": params}}
        choice = rng.choice(("required", "auto", "none", {"type": "function", "function": {"name": "f"}},
                             {"type": "function", "function": {"name": "missing"}}))
        body = {"messages": [{"role": "user", "content": "call f"}], "tools": [tool], "tool_choice": choice,
                "max_tokens": 24, "stream": stream}
        return send("/v1/chat/completions", body)

    return {"schemas": schemas, "grammars": grammars, "regexes": regexes, "choices": choices, "tools": tools}


# --------------------------------------------------------------------------- scenarios


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _row(name: str, statuses: list[int], ok: bool, detail: str, healthy: bool, **figures) -> dict:
    seen: dict[str, int] = {}
    for s in statuses:
        seen[str(s)] = seen.get(str(s), 0) + 1
    return {"class": name, "requests": len(statuses), "statuses": dict(sorted(seen.items())),
            "5xx": sum(1 for s in statuses if s >= 500), "not_json_errors": 0, "healthy": healthy, "ok": ok,
            "detail": detail, "examples": [], **figures}


async def _post(sess, url: str, path: str, body: dict) -> tuple[int, dict | None, float]:
    t0 = time.monotonic()
    async with sess.post(url + path, json=body) as resp:
        raw = await resp.read()
    try:
        out = json.loads(raw)
    except ValueError:
        out = None
    return resp.status, out, time.monotonic() - t0


async def distinct_schemas(url: str, health, pid: int | None, n: int = 256, props: int = 1000) -> dict:
    """n distinct schemas of ``props`` required properties (about 60 KB each, some 17 MB compiled over Qwen's
    vocabulary), two at a time: the server's RSS before, at its highest and after."""
    before = peak = rss_mb(pid)
    statuses: list[int] = []
    refusals: list[str] = []
    sem = asyncio.Semaphore(2)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as sess:
        async def one(i):
            nonlocal peak
            async with sem:
                st, out, _ = await _post(sess, url, "/v1/completions", {"prompt": "x", "max_tokens": 2,
                                         "structured_outputs": {"json": wide_schema(f"d{i}", props)}})
            statuses.append(st)
            if st != 200 and len(refusals) < 1:
                refusals.append(str(((out or {}).get("error") or {}).get("message"))[:160])
            now = rss_mb(pid)
            if now is not None:
                peak = max(peak or 0, now)
        t0 = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(n)))
    after = rss_mb(pid)
    ok = not any(s >= 500 for s in statuses)
    detail = (f"{n} schemas in {time.monotonic() - t0:.0f} s; RSS {before or 0:.0f} MB before, peak "
              f"{peak or 0:.0f} MB, {after or 0:.0f} MB after" + (f"; first refusal: {refusals[0]}" if refusals else ""))
    return _row("distinct-schemas", statuses, ok, detail, await health() is not None,
                rss_mb_before=before, rss_mb_peak=peak, rss_mb_after=after)


async def hostile_latency(url: str, health, clients: int = 4, samples: int = 7) -> dict:
    """A plain 8-token request's latency (median of ``samples``) idle, then while ``clients`` clients loop an
    ambiguous EBNF and schemas whose compile takes seconds."""
    plain = {"prompt": "hi", "max_tokens": 8, "ignore_eos": True, "temperature": 0}
    statuses: list[int] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as sess:
        async def measure() -> list[float]:
            out = []
            for _ in range(samples):
                st, _, s = await _post(sess, url, "/v1/completions", plain)
                statuses.append(st)
                out.append(s)
            return out

        idle = await measure()
        stop = asyncio.Event()

        async def hostile(k):
            i = 0
            while not stop.is_set():
                i += 1
                if (k + i) % 2:
                    c = {"structured_outputs": {"grammar": AMBIGUOUS}, "temperature": 1.0, "max_tokens": 64}
                else:
                    c = {"structured_outputs": {"json": wide_schema(f"h{k}_{i}", 400, required=False)},
                         "max_tokens": 4}
                st, _, _ = await _post(sess, url, "/v1/completions", {"prompt": "x", **c})
                statuses.append(st)

        tasks = [asyncio.create_task(hostile(k)) for k in range(clients)]
        await asyncio.sleep(1.0)
        busy = await measure()
        stop.set()
        await asyncio.gather(*tasks)
    m_idle, m_busy = statistics.median(idle), statistics.median(busy)
    ok = not any(s >= 500 for s in statuses) and m_busy <= 2 * m_idle
    detail = (f"plain 8-token median {m_idle * 1e3:.0f} ms idle, {m_busy * 1e3:.0f} ms (max {max(busy) * 1e3:.0f}) "
              f"while {clients} clients loop costly grammars")
    return _row("hostile-latency", statuses, ok, detail, await health() is not None,
                plain_ms_idle=round(m_idle * 1e3, 1), plain_ms_busy=round(m_busy * 1e3, 1),
                plain_ms_busy_max=round(max(busy) * 1e3, 1))


def large_tool_body(i: int, kb: int) -> dict:
    n = kb * 1024 // 200
    props = [(f"t{i}_field_{k}", {"type": "string", "description": "d" * 150}) for k in range(n)]
    tools = [{"type": "function", "function": {"name": f"f{i}_{k}", "description": "a tool",
                                               "parameters": {"type": "object", "properties": dict(props[k::4])}}}
             for k in range(4)]
    return {"messages": [{"role": "user", "content": f"call one {i}"}], "tools": tools, "tool_choice": "required",
            "max_tokens": 4}


async def large_constrained(url: str, health, n: int = 8, kb: int = 700) -> dict:
    """/health latency while ``n`` chat requests of about ``kb`` KB with tool_choice required arrive at once."""
    statuses: list[int] = []
    lat: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as sess:
        done = asyncio.Event()

        async def poll():
            while not done.is_set():
                t0 = time.monotonic()
                async with sess.get(url + "/health") as r:
                    await r.read()
                lat.append(time.monotonic() - t0)
                await asyncio.sleep(0.01)

        watcher = asyncio.create_task(poll())
        await asyncio.sleep(0.1)
        results = await asyncio.gather(*(_post(sess, url, "/v1/chat/completions", large_tool_body(i, kb))
                                         for i in range(n)))
        done.set()
        await watcher
    statuses = [st for st, _, _ in results]
    lat.sort()
    p50, p99, worst = lat[len(lat) // 2], lat[min(len(lat) - 1, int(len(lat) * 0.99))], lat[-1]
    ok = not any(s >= 500 for s in statuses) and p99 < 0.05
    detail = (f"/health p50 {p50 * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, max {worst * 1e3:.0f} ms over {len(lat)} "
              f"polls while {n} chat requests of {kb} KB (tool_choice required) arrived")
    return _row("large-constrained", statuses, ok, detail, await health() is not None,
                health_ms_p50=round(p50 * 1e3, 1), health_ms_p99=round(p99 * 1e3, 1), health_ms_max=round(worst * 1e3, 1))
