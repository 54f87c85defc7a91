"""Plain helpers every test folder shares (``from testkit import wait_for``). They live here, not in
``conftest.py``: each folder has its own conftest, and under pytest's default prepend import mode the name
``conftest`` means whichever folder's conftest was loaded last."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

#: The settings most engine tests share: CPU, eager, the torch attention backend, blocks of 16 tokens.
ENGINE_DEFAULTS = dict(device="cpu", enforce_eager=True, attention_backend="torch", kvcache_block_size=16)


def new_engine(model, *, defaults: dict = ENGINE_DEFAULTS, **kw):
    """An ``LLMEngine`` on ``model`` with ``defaults`` (ENGINE_DEFAULTS unless given; keywords override them). The
    caller closes it; the fixtures ``tiny_engine`` (tests/engine/conftest.py, a test's engines), ``engine_factory``
    (tests/conftest.py, a module's) and ``kernel_engine`` (tests/kernels/conftest.py, CUDA) do."""
    from engine import LLMEngine

    return LLMEngine(str(model), **(defaults | kw))


@contextlib.contextmanager
def engines(default_model=None, *, defaults: dict = ENGINE_DEFAULTS):
    """The engine factories' one body: yields ``build(model=None, **kw)`` (:func:`new_engine` on ``model``, else on
    ``default_model``) and closes every engine it built, last first, when the block ends."""
    made = []

    def build(model=None, **kw):
        made.append(new_engine(model or default_model, defaults=defaults, **kw))
        return made[-1]

    try:
        yield build
    finally:
        for engine in reversed(made):
            engine.close()


def wait_for(pred, timeout: float = 10.0) -> None:
    """Poll `pred` until it is true; fail the test after `timeout` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def settle(worker) -> None:
    """After a service test: let a paused worker go on and wait until nothing is active or pending, so the
    next test of the module starts on an idle worker (the module-scoped worker/server fixtures)."""
    worker.resume()
    wait_for(lambda: worker.snapshot().get("active", 0) == 0 and not worker.pending_ids())


@contextlib.contextmanager
def checkpoint_command(cid: str):
    """sys.argv set to checkpoint ``cid``'s command for the block (for module-scoped fixtures, where the
    function-scoped ``labkit_argv`` cannot be used): the envelope records it and the judge checks it."""
    import sys

    from labkit.checks import get_checkpoint

    argv = sys.argv
    sys.argv = ["labkit", *get_checkpoint(cid).command[1:]]
    try:
        yield
    finally:
        sys.argv = argv


def labkit_process(*args, env: dict | None = None, cwd=None, timeout: float = 300):
    """``python -m labkit ARGS`` in a subprocess (wide terminal for tables; ``env`` over this process's, in ``cwd``),
    output captured."""
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "labkit", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": "200", **(env or {})}, cwd=cwd)


def forced_logits(engine, token_ids: list[int]):
    """The raw logits (a float32 tensor) after token_ids on an ``LLMEngine``: one teacher-forced prefill of exactly
    these tokens (in chunks where the prompt is longer than a step's budget); the request ends after it."""
    from engine import SamplingParams

    engine.add_request(token_ids, SamplingParams(max_tokens=1, temperature=0))
    seqs, is_prefill = engine.schedule()
    while len(seqs) == 1 and not seqs[0].step_reaches_end:       # chunks of a long prompt
        engine.postprocess(seqs, [0], is_prefill)
        seqs, is_prefill = engine.schedule()
    logits, _ = engine.forward_logits(seqs, is_prefill)
    engine.postprocess(seqs, [0] * len(seqs), is_prefill)
    return logits[0].float().clone()


@contextlib.contextmanager
def one_tokenizer_per_model():
    """For the block, ``transformers.AutoTokenizer.from_pretrained`` loads each (model directory, options) once and
    hands every later caller that same tokenizer: building one costs about a CPU-second (its conversion to the
    native format), and a module that builds an engine per run of a command pays it per engine. Only for modules
    that never change a tokenizer's files under the same path, nor test the tokenizer's loading itself."""
    import pytest
    from transformers import AutoTokenizer

    load, made = AutoTokenizer.from_pretrained, {}

    def once(*args, **kw):
        key = (tuple(map(str, args)), tuple(sorted((k, repr(v)) for k, v in kw.items())))
        if key not in made:
            made[key] = load(*args, **kw)
        return made[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(AutoTokenizer, "from_pretrained", once)
        yield


MS = 1_000_000


# A load log by hand (labkit.load.report's input): ``write_log(path, request("r0", 0, [120, 160]))``.
def ev(event, rid, t_ms, observer="engine", worker="w0", **kw) -> dict:
    return {"event": event, "request_id": rid, "worker_id": worker, "round": 0, "t_ns": int(t_ms * MS),
            "observer": observer, **kw}


def request(rid, start_ms, token_ms, observer="engine", worker="w0", reason="length", **tags) -> list[dict]:
    out = [ev("submitted", rid, start_ms, observer, worker, **tags), ev("admitted", rid, start_ms, observer, worker)]
    out += [ev("token", rid, t, observer, worker, index=i + 1) for i, t in enumerate(token_ms)]
    out.append(ev("finished", rid, token_ms[-1] if token_ms else start_ms, observer, worker, reason=reason,
                  num_completion_tokens=len(token_ms)))
    return out


def write_log(path: Path, events: list[dict], kind: str = "cpu-real-engine", **header) -> Path:
    with path.open("w") as f:
        f.write(json.dumps({"event": "header", "kind": kind, **header}) + "\n")
        for e in events:
            f.write(json.dumps(e) + "\n")
    return path


def doctor_facts(**over) -> dict:
    """The facts of a passing `setup.doctor` record (what `labkit doctor` writes, the parts its checkpoint judges),
    with ``over``'s keys replaced."""
    facts = {
        "imports_ok": True,
        "tensor_check": {"ok": True, "max_abs_err": 2e-5},
        "runs_writable": {"ok": True},
        "engine_import": {"ok": True, "inside_project": True},
        "engine_run": {"ok": True, "engine_class_inside_project": True, "output_tokens": 1, "steps": 1},
        "toolchain": {"pip_check": {"ok": True, "problems": []}},
    }
    facts.update(over)
    return facts
