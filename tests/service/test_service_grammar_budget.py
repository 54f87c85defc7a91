"""Constrained decoding that one client cannot turn against the others (engine/sampling/structured.py,
serve/core/front.py), through the running server on the tiny model: the compiled-grammar cache bounded by
bytes."""
from __future__ import annotations

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
