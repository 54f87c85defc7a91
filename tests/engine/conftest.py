"""Fixtures of the engine tests: one engine factory.

``tiny_engine(**kw)`` builds an ``LLMEngine`` on the session's tiny model (``tests/conftest.py``'s
``tiny_model_dir``) with the settings most engine tests share (CPU, eager, the torch attention backend, blocks
of 16 tokens); keywords override them (``model=PATH`` builds on another model directory). Every engine it
made is closed when the test ends, also when the test fails; a test may close one earlier itself
(``LLMEngine.close`` runs once)."""
from __future__ import annotations

import pytest
from testkit import engines


@pytest.fixture
def tiny_engine(tiny_model_dir):
    with engines(tiny_model_dir) as build:
        yield build
