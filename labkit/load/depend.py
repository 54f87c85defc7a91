"""Replaying a trace whose requests wait on others (``labkit trace --dataset multi-turn``).

A request with ``"after": ID`` is sent ``think_time_ms`` after request ID finished (its reply has
arrived), never before; requests without ``after`` are sent at their ``arrival_ms`` as usual. Both
``labkit load`` paths use this in ``--mode wall`` (in process: one thread per root request that has
followers, which waits on each handle; over HTTP: one task per chain). ``--mode round`` refuses
such a trace: a round-indexed replay has no reply time to wait for.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Awaitable, Callable

from labkit.errors import UserError


def has_deps(reqs: list[dict]) -> bool:
    return any(r.get("after") is not None for r in reqs)


def split_deps(reqs: list[dict]) -> tuple[list[dict], dict[str, list[dict]]]:
    """(roots in arrival order, followers by the id they wait on); a dangling or cyclic ``after`` is a UserError."""
    ids = {r["request_id"] for r in reqs}
    roots, children = [], {}
    for r in reqs:
        dep = r.get("after")
        if dep is None:
            roots.append(r)
        elif dep not in ids or dep == r["request_id"]:
            raise UserError(f"trace request {r['request_id']}: after={dep!r} names no other request in the trace")
        else:
            children.setdefault(dep, []).append(r)
    reached, stack = 0, list(roots)
    while stack:
        r = stack.pop()
        reached += 1
        stack.extend(children.get(r["request_id"], []))
    if reached != len(reqs):
        raise UserError("trace: the after= chains form a cycle (some requests would never be sent)")
    return roots, children


def think_s(r: dict) -> float:
    return max(0.0, float(r.get("think_time_ms", 0.0))) / 1000.0


def replay_threads(reqs: list[dict], submit: Callable[[dict], object], timeout_s: float,
                   on_done: Callable[[], None] | None = None) -> list:
    """In process: send roots at arrival_ms, each follower think time after its request finished;
    returns every handle (all finished) or raises the first failure as a UserError."""
    roots, children = split_deps(reqs)
    handles: list = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    t0 = time.monotonic()
    deadline = t0 + timeout_s

    def run(r: dict, not_before: float) -> None:
        try:
            delay = not_before - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            h = submit(r)
            with lock:
                handles.append(h)
            left = deadline - time.monotonic()
            if left <= 0 or h.wait(left) is None:
                raise UserError(f"request {r['request_id']} did not finish within {timeout_s:g} s")
            if on_done is not None:
                on_done()
            for c in children.get(r["request_id"], []):
                run(c, time.monotonic() + think_s(c))
        except BaseException as e:      # reported by the caller, after every thread ended
            with lock:
                errors.append(e)

    threads = [threading.Thread(target=run, args=(r, t0 + r["arrival_ms"] / 1000.0), daemon=True) for r in roots]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return handles


async def replay_async(reqs: list[dict], send: Callable[[dict], Awaitable[object]],
                       on_done: Callable[[], None] | None = None) -> None:
    """Over HTTP: the same order with asyncio tasks; ``send`` returns when the request's reply ended."""
    roots, children = split_deps(reqs)
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    async def run(r: dict, not_before: float) -> None:
        delay = not_before - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        await send(r)
        if on_done is not None:
            on_done()
        await asyncio.gather(*(run(c, loop.time() + think_s(c)) for c in children.get(r["request_id"], [])))

    await asyncio.gather(*(run(r, t0 + r["arrival_ms"] / 1000.0) for r in roots))
