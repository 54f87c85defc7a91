"""Constrained decoding that one client cannot turn against the others (engine/sampling/structured.py,
serve/core/front.py), through the running server on the tiny model: the compiled-grammar cache bounded by
bytes; a request's compiled grammar pinned while it lives, so the step loop never compiles."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from service_fixtures import post, serving, settle_after

pytest.importorskip("xgrammar")

CACHE_MB = 16


def wide_schema(tag: str, n: int = 600) -> dict:
    """A schema of n required string properties: about 5 MB compiled over the Qwen vocabulary."""
    names = [f"{tag}_{i}" for i in range(n)]
    return {"type": "object", "properties": {k: {"type": "string", "maxLength": 8} for k in names},
            "required": names}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    yield from serving(tiny_model_dir, record=False, max_active=2, queue_size=16, max_model_len=256,
                       worker_id="grammar-budget", grammar_cache_mb=CACHE_MB)


_idle = settle_after("server")


def test_grammar_cache_is_bounded_by_bytes(server):
    for i in range(6):
        status, res = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2,
                                                       "structured_outputs": {"json": wide_schema(f"s{i}")}})
        assert status == 200, res
    cache = server.worker.engine.grammars._cache
    held = sum(int(g.memory_size_bytes) for g in cache.values())
    assert 0 < held <= CACHE_MB << 20, (len(cache), held)


def test_a_grammar_evicted_while_queued_is_not_compiled_in_the_step_loop(server, monkeypatch):
    """A request's compiled grammar is pinned while it lives: the cache dropping it while the request waits
    does not make the owner thread (the step loop) compile it again at admission."""
    from engine.sampling import structured

    worker = server.worker
    compiled_on: list[str] = []
    real = structured._compile

    def spy(compiler, so):
        compiled_on.append(threading.current_thread().name)
        return real(compiler, so)

    monkeypatch.setattr(structured, "_compile", spy)
    worker.pause()
    try:
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(post, server, "/v1/completions",
                                 {"prompt": "x", "max_tokens": 2, "structured_outputs": {"json": wide_schema("q")}})
            deadline = time.monotonic() + 30
            while not worker.pending_ids() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert worker.pending_ids(), "the request never queued"
            assert len(compiled_on) == 1                     # compiled at submit
            worker.engine.grammars._cache.clear()            # evicted while it waits
            worker.resume()
            status, res = answer.result(60)
    finally:
        worker.resume()
    assert status == 200, res
    assert compiled_on.count(worker._thread.name) == 0, compiled_on
