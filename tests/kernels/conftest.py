"""Fixtures of the kernel tests: one engine factory.

``kernel_engine(model, **kw)`` builds an ``LLMEngine`` on ``model`` for the GPU tests (test_gpu_kernels.py,
test_gpu_sampling.py) through ``testkit.new_engine`` with one default only, ``device="cuda"``: a kernel test names
its own dtype, backend, execution and shapes, and a setting it leaves out keeps the engine's own default (not
testkit.ENGINE_DEFAULTS, whose eager torch backend is what these tests compare against). Every engine it made is
closed when the test ends, also when the test fails; a test may close one earlier itself (``LLMEngine.close`` runs
once). The Triton-interpreter tests build no engine here: their kernels run in a child process, the test module's
own file (``results``: its cases; ``model_results``: its tiny-model case; a module whose process takes other
arguments defines its own fixture)."""
from __future__ import annotations

import pytest
from testkit import engines

CUDA_DEFAULTS = {"device": "cuda"}


@pytest.fixture
def kernel_engine():
    with engines(defaults=CUDA_DEFAULTS) as build:
        yield build


@pytest.fixture(scope="module")
def results(request):
    from interp import interpreted
    return interpreted(request.module.__file__)


@pytest.fixture(scope="module")
def model_results(request, tiny_model_dir):
    from interp import interpreted
    return interpreted(request.module.__file__, str(tiny_model_dir))
