"""``labkit serve``: bind, start the worker (in this process or in an engine process of its own), fit the context
to the KV pool, serve until SIGINT/SIGTERM, close (mini-sglang's ``launch.py``). Also the serve defaults per
device (``serve_args``: an engine ``EngineArgs`` and the worker's options) and vLLM's periodic stats line.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import sys
import time
from typing import Callable

from engine import EngineArgs
from serve.errors import ServeError
from serve.entrypoints.api_server import HttpServer, bind_socket, make_service, url_of
from serve.entrypoints.connections import ConnectionLimits
from serve.core.config import engine_args, serve_defaults
from serve.core.front import WorkerFront
from serve.entrypoints.http import Access
from serve.observe.logsafe import install as escape_log

STATS_LOG = logging.getLogger("labkit.stats")        # one line per interval while busy
escape_log(STATS_LOG)
STATS_INTERVAL_S = 10.0


class StatsLine:
    """vLLM's periodic line: prompt and generation tok/s since the last line, running, waiting, KV usage.

    Reads only the worker's counters and its published snapshot; says nothing while idle."""

    def __init__(self, worker: WorkerFront):
        self.worker = worker
        self._last = (time.monotonic(), *self._counts())

    def _counts(self) -> tuple[int, int]:
        st = self.worker.stats
        with st.lock:
            return st.prompt_tokens, st.generation_tokens

    def line(self) -> str | None:
        t, prompt, gen = time.monotonic(), *self._counts()
        t0, prompt0, gen0 = self._last
        self._last = (t, prompt, gen)
        snap = self.worker.snapshot()
        running, waiting = snap.get("active", 0), snap.get("queue_depth", 0)
        if prompt == prompt0 and gen == gen0 and not running and not waiting:
            return None
        dt = max(t - t0, 1e-9)
        total = snap.get("kv_blocks_total") or 0
        kv = 100.0 * (snap.get("kv_blocks_used") or 0) / total if total else 0.0
        return (f"prompt throughput: {(prompt - prompt0) / dt:.1f} tokens/s, generation throughput: "
                f"{(gen - gen0) / dt:.1f} tokens/s, running: {running} reqs, waiting: {waiting} reqs, "
                f"KV cache usage: {kv:.1f}%")


async def _log_stats(worker: WorkerFront, interval: float) -> None:
    stats = StatsLine(worker)
    while True:
        await asyncio.sleep(interval)
        text = stats.line()
        if text is not None:
            STATS_LOG.info("%s", text)


async def serve_until_signal(worker: WorkerFront, sock: socket.socket, *, served_model_name: str | None = None,
                             max_body_bytes: int = 1 << 20, on_ready: Callable[[str], None] | None = None,
                             stop: asyncio.Event | None = None, api_key: str | None = None, allowed_origins=None,
                             connections: ConnectionLimits | None = None,
                             stats_interval: float = STATS_INTERVAL_S) -> None:
    """``labkit serve``: run until SIGINT/SIGTERM (or ``stop``), then close the worker and the server.
    While busy, a stats line every ``stats_interval`` seconds (0: none) on the ``labkit.stats`` logger.

    The worker closes first (open streams end cancelled/shutdown), then every connection that is not
    running a request is closed at once, so half-sent requests never hold up the exit."""
    import signal

    server = HttpServer(make_service(worker, served_model_name, max_body_bytes, api_key, allowed_origins,
                                     connections), sock)
    url = await server.start()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    if on_ready is not None:
        on_ready(url)
    ticker = asyncio.ensure_future(_log_stats(worker, stats_interval)) if stats_interval > 0 else None
    try:
        await stop.wait()
    finally:
        if ticker is not None:
            ticker.cancel()
        server.guard.close_waiting()
        await loop.run_in_executor(None, worker.close)
        await server.stop()



#: What :func:`serve.core.config.serve_defaults` holds beside the engine's options: the worker's.
WORKER_CHOICES = ("max_active", "engine_process")


def serve_args(resolved: str, tensor_parallel_size: int = 1, /, **given) -> tuple[EngineArgs, dict]:
    """``labkit serve``'s engine and worker choices: each option of :func:`serve.core.config.serve_defaults`
    ``given`` as None takes the default of the ``resolved`` device (``cpu``, ``cuda``, ``cuda:N``); any other
    engine option ``given`` (engine names) goes to the engine as it is (None: the engine's default). Overlap and
    the engine process stay off with tensor parallel (the engine refuses overlap there; the engine process was
    measured with one GPU only); CUDA's max_model_len is ``"auto"``: the model's own, fitted to the KV
    pool by the engine while it sizes the pool (one build). Returns the engine's arguments (the engine's
    defaults under them, :func:`serve.core.config.engine_args`) and the worker's options (``max_active``,
    ``engine_process``)."""
    defaults = serve_defaults(resolved)
    if tensor_parallel_size != 1:
        defaults.update(overlap=False, engine_process=False)
    chosen = {k: (given[k] if given.get(k) is not None else v) for k, v in defaults.items()}
    worker = {k: chosen.pop(k) for k in WORKER_CHOICES}
    rest = {k: v for k, v in given.items() if k not in defaults}
    return engine_args(**rest, **chosen, tensor_parallel_size=tensor_parallel_size), worker


def fitted_context(worker: WorkerFront) -> str:
    """A worker started with ``max_model_len="auto"``: the engine fitted the model's context length to its KV
    pool while sizing it (one build). Records the fitted length in the worker's config and returns a line
    saying what it is and why."""
    served = worker.served
    model_len, fitted = served.config.shape.max_position_embeddings, served.max_model_len
    if fitted >= model_len:
        why = f"max-model-len {fitted} (the model's context length)"
    else:
        why = f"max-model-len {fitted}: capped by the KV pool ({served.pool_tokens} tokens); the model allows {model_len}"
    worker.config = dataclasses.replace(worker.config, max_model_len=fitted, max_prompt_bytes=None)
    return why


SWITCH_INTERVAL_ENV = "LABKIT_SWITCH_INTERVAL_MS"


def _switch_interval_from_env() -> None:
    """An experiment, off by default: ``LABKIT_SWITCH_INTERVAL_MS`` sets the serve process's GIL switch interval
    (Python's default is 5 ms: a thread back from a GPU wait may wait that long for the front end's GIL)."""
    raw = os.environ.get(SWITCH_INTERVAL_ENV)
    if not raw:
        return
    try:
        ms = float(raw)
        if not 0 < ms <= 1000:
            raise ValueError
    except ValueError:
        raise ServeError(f"{SWITCH_INTERVAL_ENV} must be a number of milliseconds in (0, 1000], got {raw!r}") from None
    sys.setswitchinterval(ms / 1e3)


def run_serve(config, host: str = "127.0.0.1", port: int = 8801, out=None, *, served_model_name: str | None = None,
              max_body_bytes: int = 1 << 20, on_ready: Callable[[str, WorkerFront], None] | None = None,
              api_key: str | None = None, allowed_origins=None, connections: ConnectionLimits | None = None,
              stats_interval: float = STATS_INTERVAL_S, on_context: Callable[[str], None] | None = None,
              log_plan=None, engine_process: bool = False, envelope: Callable[..., dict] | None = None,
              build: str | None = None) -> dict:
    """``labkit serve``: bind first (a port in use fails before the model loads), start the worker,
    serve until SIGINT/SIGTERM, close. Returns what the worker did (finished requests by reason).
    The event log: ``log_plan`` (:func:`serve.observe.events.plan_serve_log`: path, size cap, rotation),
    else ``out`` uncapped, else none. ``engine_process``: the engine and its owner thread in a process of
    their own (:mod:`serve.core.proc_client`), this one keeps the HTTP front end."""
    from serve.core.proc_client import worker_class
    from serve.heap import freeze_startup_heap, thaw_heap
    from serve.observe.events import LogPlan

    Access.make(api_key, allowed_origins)                       # option errors before the model loads
    (connections or ConnectionLimits()).check()
    _switch_interval_from_env()
    if log_plan is None:
        log_plan = LogPlan(out if out else None)
    out = log_plan.path
    sock = bind_socket(host, port)
    log = None                  # opened once the model is up: a failed start leaves the previous log alone

    def write(record: dict) -> None:
        if log is not None:
            log.write(record)

    def write_many(records: list[dict]) -> None:       # a step's token events in one hand-off
        if log is not None:
            log.write_many(records)

    write.many = write_many
    sink = write if out is not None else None
    make = worker_class(engine_process)
    worker = make(config, sink=sink, build=build)
    try:
        worker.start()
        if config.max_model_len == "auto":
            why = fitted_context(worker)
            if on_context is not None:
                on_context(why)
        log = log_plan.open()
        if log is not None:
            log.write_header(worker.header(envelope, role="server", url=url_of(sock)))
        freeze_startup_heap()               # no full collection of the startup heap while serving (serve/heap.py)
        asyncio.run(serve_until_signal(worker, sock, served_model_name=served_model_name,
                                       max_body_bytes=max_body_bytes, api_key=api_key,
                                       allowed_origins=allowed_origins, connections=connections,
                                       stats_interval=stats_interval, on_ready=(lambda url: on_ready(url, worker)) if on_ready else None))
    finally:
        thaw_heap()
        worker.close()
        if log is not None:
            log.close()
        sock.close()
    stats = worker.stats
    return {"finished": dict(stats.finished),
            "generation_tokens": stats.generation_tokens, "steps": dict(stats.steps),
            "engine_errors": stats.engine_errors, "log": str(out) if out else None}
