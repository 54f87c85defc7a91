"""What the service test modules share: a worker + server on the tiny model, in either mode, and the
small request helpers (``from service_fixtures import ...``, the folder's fixtures are in conftest.py).

``serving(model, mode, ...)`` is the body of a module fixture: it starts a ``Worker`` (``in-process``) or a
``RemoteWorker`` (``engine-process``: the engine in a child process) and a ``ServerThread`` on 127.0.0.1:0,
yields a ``Served`` (url, worker, sink, mode, thread) and closes both after the module.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import pytest
from testkit import settle

from labkit.load.trace import token_ids
from labkit.load import client
from serve.core.proc_client import worker_class
from serve.observe.events import MemorySink
from serve.entrypoints.api_server import ServerThread
from serve.core.worker import WorkerConfig

MODES = ("in-process", "engine-process")

# the service modules' common worker: two active, a queue of three, small batches, 512-token context
BASE = dict(device="cpu", max_active=2, queue_size=3, max_num_batched_tokens=256, max_num_seqs=4, max_model_len=512)


def worker_config(model, **kw) -> WorkerConfig:
    return WorkerConfig(**{**BASE, "model": str(model), **kw})


def start_worker(model, mode: str = "in-process", sink=None, **kw):
    assert mode in MODES, mode
    return worker_class(mode == "engine-process")(worker_config(model, **kw), sink=sink).start()


@dataclass
class Served:
    url: str
    worker: object
    sink: MemorySink | None
    mode: str
    thread: ServerThread


def serving(model, mode: str = "in-process", *, record: bool = True, server_kw: dict | None = None, **kw):
    """Generator for a module fixture: ``yield from serving(tiny_model_dir, worker_id="x")``. ``record``: the
    worker's events go to a MemorySink (``Served.sink``); without it the worker has no sink."""
    sink = MemorySink() if record else None
    srv = ServerThread(start_worker(model, mode, sink=sink, **kw), "127.0.0.1", 0, **(server_kw or {})).start()
    try:
        yield Served(srv.url, srv.worker, sink, mode, srv)
    finally:
        srv.close()


def openai_client(url: str, timeout: float = 60):
    """The official openai client on a served URL as every OpenAI test uses it: a dummy key, no retries (a
    refusal or a 429 is seen once, as sent)."""
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=timeout)


def settle_after(name: str):
    """An autouse fixture: after each test that used fixture ``name`` (a ``Served``, a ``ServerThread`` or a
    worker), let the module's worker go idle (testkit.settle) so the next test starts on an idle worker."""

    @pytest.fixture(autouse=True)
    def _idle(request):
        yield
        if name in request.fixturenames:
            value = request.getfixturevalue(name)
            settle(getattr(value, "worker", value))

    return _idle


# --------------------------------------------------------------------------- requests


def ids(name: str, n: int = 20, seed: int = 4) -> list[int]:
    return token_ids(seed, name, n)


def body(rid: str, max_tokens: int = 5, **extra) -> dict:
    return {"request_id": rid, "prompt_token_ids": ids(rid), "max_tokens": max_tokens, "ignore_eos": True, **extra}


def run(coro):
    return asyncio.run(coro)


async def with_session(fn):
    async with client.session(30.0) as sess:
        return await fn(sess)


async def queued(sess, url: str, worker, bodies: list[dict]) -> list[asyncio.Task]:
    """Pause ``worker`` and stream ``bodies`` to ``url``; return their tasks once all of them wait in the
    queue. The caller resumes the worker."""
    worker.pause()
    tasks = [asyncio.create_task(client.stream_native(sess, url, b)) for b in bodies]
    for _ in range(500):
        if len(worker.pending_ids()) == len(bodies):
            break
        await asyncio.sleep(0.01)
    return tasks


def post(server, path: str, body: dict) -> tuple[int, dict]:
    """POST JSON ``body`` to ``server.url + path`` (blocking, urllib): (status, parsed JSON), errors too."""
    req = urllib.request.Request(f"{server.url}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def engine_blocks(engine) -> tuple[int, int]:
    """(free, total) KV blocks, read on the owner thread (module level: it pickles to an engine process)."""
    return engine.stats().free_blocks, engine.stats().num_blocks


def frozen_objects(engine) -> int:
    """How many objects the owner's process keeps out of garbage collection (``gc.freeze``); pickles as above."""
    import gc

    return gc.get_freeze_count()


def kv(worker) -> tuple[int, int]:
    return worker.run_on_owner(engine_blocks)


# --------------------------------------------------------------------------- `labkit serve` subprocesses


def ready_url(proc, timeout: float | None = None, seen: list[str] | None = None) -> str | None:
    """Read a `labkit serve` process's stdout until its ``ready: URL`` line; the URL, or None when the output
    ends (or ``timeout`` seconds pass) first. Lines read are appended to ``seen``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while deadline is None or time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            return None
        if seen is not None:
            seen.append(line)
        m = re.search(r"ready: (http://127\.0\.0\.1:\d+)", line)
        if m:
            return m.group(1)
    return None
