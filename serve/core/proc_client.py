"""The engine in its own process (``labkit serve --engine-process``): vLLM's split, engine loop in one
process, HTTP front end and detokenization in another.

Why: in one process the owner thread (engine steps, one event dict per token, JSON for the event log) and
the HTTP loop (detokenize, format, write a chunk per token) share one GIL; at 256 sequences per step the
front end's per-token work lands between engine steps. Here the owner has a process (and a GIL) of its
own and the front end's work runs beside it.

Processes and channels
    :class:`RemoteWorker` (the parent, where the HTTP server runs) has the public surface the server,
    ``run_serve`` and the tests use from :class:`serve.core.worker.Worker`. ``start()`` spawns a child
    (``multiprocessing`` "spawn": nothing of the parent, CUDA included, is inherited) that runs the existing
    Worker unchanged (:mod:`serve.core.proc_main`). Two one-way pipes of typed messages
    (:mod:`serve.core.messages`): commands parent -> child (Submit, Cancel, Call: the test hooks, Close), written
    by a sender thread of the parent's (:class:`CommandSender`: what was queued while it wrote goes as one
    Commands message, so a burst of submissions costs the event loop neither pickling nor a write each),
    child -> parent: the owner's outputs of a step (or a boundary) as ONE Outputs message, the owner's
    published snapshot after each loop round (queue, active, KV blocks, round, state).

The parent
    A reader thread hands each Outputs message to the same :class:`serve.core.output.OutputProcessor` the
    in-process Worker feeds: the local :class:`RequestHandle`s (one ``wake_all`` per message: one hand-off per
    event loop per step), the event log (the JSON encoding is off the engine's process) and the Prometheus
    :class:`ServiceStats` (TTFT and ITL from the submit stamp and the ``t_ns`` the engine stamped on each step's
    tokens), so /metrics shows the engine's figures as in one process; the engine process counts nothing.
    What the front end reads (the served engine's record, state, snapshot) is answered here, from what the
    child reported: the :class:`serve.core.front.ServedEngine` of its Ready message and its last snapshot.

Submission
    Tokenization and chat templating run in the parent (its own copy of the model's tokenizer, loaded
    from the directory the child reports). ``submit()`` answers synchronously and without a round trip:
    the parent checks the prompt with the engine's own admission rule (``LLMEngine.check_request`` over the
    served record the child reports at start: max_model_len, vocabulary, KV pool), the request id, duplicates
    (its own table of live requests) and the queue (requests it sent and has not yet seen admitted or
    finished: never fewer than the child's queue, so the child never rejects one the parent accepted).
    The request is checked once, here: the token ids go child-ward and the child's Worker queues them as they
    are (``Worker.enqueue_checked``: no second admission check, no second grammar compile). A request the
    engine still refuses when it admits it finishes ``rejected`` with its message.

Failures
    A child init error: ``start()`` raises it (ServeError/ConfigError keep their type and one-line message).
    A child that dies mid-serve: every open handle finishes ``error`` with one line saying so, the worker
    turns unhealthy (``/health`` 503, ``submit()`` raises :class:`WorkerUnavailable`). ``close()`` asks
    the child to close its Worker (open requests end cancelled/shutdown, as in one process), joins it
    within ``timeout``, then terminates it. A parent that dies closes the command pipe: the child closes
    and exits. A slow consumer (more than ``stream_buffer`` unread events in the parent) is cancelled at
    the owner with ``cause=slow_consumer``.

Test hooks ``pause``, ``resume``, ``inject_fault``, ``run_on_owner`` (a picklable function) are calls into
the child, answered on the event pipe (so every event sent before the answer has been handled);
``set_feeder`` stays with the in-process Worker.
"""
from __future__ import annotations

import copy
import itertools
import multiprocessing
import signal
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from engine import LLMEngine, SamplingParams
from serve.errors import ServeError
from serve.core.config import WorkerConfig
from serve.core.proc_main import CHILD_CALLS, READY_TIMEOUT_S, bare_main, child_main  # noqa: F401
from serve.observe.events import Sink, now_ns
from serve.core.front import WorkerFront, WorkerUnavailable
from serve.core.messages import (Admitted, Call, Cancel, Close, Closed, Commands, Finished, InitError, Outputs, Ready,
                                 Reply, Submit)
from serve.core.worker import Worker


class CommandSender:
    """The parent's end of the command pipe, written by a thread of its own: ``send`` queues a command and returns
    (the caller, often the HTTP event loop, pays for neither the pickling nor the write); the thread sends what is
    queued, in order, as one message (:class:`Commands` when there are several). A pipe that failed refuses every
    later command (OSError); Close is the last command it takes."""

    def __init__(self, conn, name: str):
        self.conn = conn
        self._cv = threading.Condition(threading.Lock())
        self._queue: list = []
        self._refused: str | None = None            # why commands are refused: closed, or the pipe failed
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> "CommandSender":
        self._thread.start()
        return self

    def send(self, msg) -> None:
        with self._cv:
            if self._refused is not None:
                raise OSError(self._refused)
            self._queue.append(msg)
            if isinstance(msg, Close):
                self._refused = "the command pipe is closed"
            if len(self._queue) == 1:
                self._cv.notify()

    def join(self, timeout: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                batch, self._queue = self._queue, []
            try:
                self.conn.send(batch[0] if len(batch) == 1 else Commands(batch))
            except (OSError, ValueError) as e:       # the child is gone; the reader says why
                with self._cv:
                    self._refused = f"the command pipe failed: {type(e).__name__}"
                    self._queue.clear()
                return
            if isinstance(batch[-1], Close):
                return


class RemoteWorker(WorkerFront):
    """A Worker whose engine and owner thread live in a child process; see the module docstring."""

    def __init__(self, config: WorkerConfig | None = None, sink: Sink | None = None, build: str | None = None):
        super().__init__(config, sink, build)
        self.process: multiprocessing.process.BaseProcess | None = None
        self._live = self.output.requests              # open requests: the output side's records
        self._pending: dict[str, None] = {}          # sent, not yet seen admitted or finished (ordered)
        self._snapshot: dict = {"state": "starting"}
        self._ready = False
        self._closed = False
        self._closed_done = threading.Event()
        self._unhealthy: str | None = None
        self._commands = None
        self._sender: CommandSender | None = None    # writes self._commands (see CommandSender)
        self._events = None
        self._reader: threading.Thread | None = None
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()

    # -- lifecycle ---------------------------------------------------------------------
    def start(self, timeout: float | None = READY_TIMEOUT_S) -> "RemoteWorker":
        """Spawn the engine process and wait until its Worker is built; re-raise its init error."""
        if self.process is not None:
            raise RuntimeError("worker already started")
        ctx = multiprocessing.get_context("spawn")
        events_r, events_w = ctx.Pipe(duplex=False)
        commands_r, commands_w = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=child_main, args=(self.config, commands_r, events_w, self.build),
                                   name=f"labkit-engine-{self.worker_id}")
        with bare_main():
            self.process.start()
        events_w.close()                 # the child's ends: ours closed, so a dead child reads as EOF here
        commands_r.close()
        self._commands, self._events = commands_w, events_r
        try:
            msg = self._first_message(timeout)
        except BaseException:
            self._abandon_child()
            raise
        if isinstance(msg, InitError):
            self._abandon_child()
            raise msg.error
        self.served = msg.served
        self._snapshot = msg.snapshot
        if self.config.load_tokenizer:
            path = self.served.config.model
            try:
                from transformers import AutoTokenizer

                self._encoder = AutoTokenizer.from_pretrained(path)
            except Exception as e:
                self._abandon_child()
                raise ServeError(f"cannot load the tokenizer of {path}: {' '.join(str(e).split())}") from None
            self.tokenizer = copy.deepcopy(self._encoder)    # the HTTP front decodes with its own copy
        self._ready = True
        self._sender = CommandSender(self._commands, f"labkit-engine-sender-{self.worker_id}").start()
        self._reader = threading.Thread(target=self._read, name=f"labkit-engine-reader-{self.worker_id}",
                                        daemon=True)
        self._reader.start()
        return self

    def _first_message(self, timeout: float | None) -> Ready | InitError:
        deadline = None if timeout is None else time.monotonic() + timeout
        while deadline is None or time.monotonic() < deadline:
            if self._events.poll(0.2):
                try:
                    msg = self._events.recv()
                    if isinstance(msg, (Ready, InitError)):
                        return msg
                    continue                        # the owner's first snapshot: Ready carries a newer one
                except (EOFError, OSError):         # the child closed its end: it is exiting
                    self.process.join(10.0)
                    raise ServeError(f"worker {self.worker_id}: the engine process exited with code "
                                    f"{self.process.exitcode} before it was ready") from None
            if not self.process.is_alive() and not self._events.poll(0.05):
                raise ServeError(f"worker {self.worker_id}: the engine process exited with code "
                                f"{self.process.exitcode} before it was ready")
        raise ServeError(f"worker {self.worker_id}: engine not ready within {timeout} s")

    def _abandon_child(self) -> None:
        self._closed = True
        self._close_pipes()
        self._end_process(5.0)
        self._closed_done.set()

    def _close_pipes(self) -> None:
        if self._sender is not None:
            self._sender.join(5.0)             # what it was sending (Close last) is out first
        for conn in (self._commands, self._events):
            try:
                conn.close()
            except Exception:
                pass

    def _end_process(self, timeout: float) -> None:
        proc = self.process
        if proc is None:
            return
        proc.join(timeout)
        if proc.is_alive():
            proc.terminate()
            proc.join(5.0)
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)

    def close(self, timeout: float = 30.0) -> None:
        """Close the child's Worker (open requests end cancelled/shutdown), then the child; bounded, idempotent."""
        with self._lock:
            first = not self._closed
            self._closed = True
        if not first:
            self._closed_done.wait(timeout)
            return
        try:
            try:
                with self._lock:
                    self._sender.send(Close(timeout))
            except (OSError, ValueError, AttributeError):
                pass
            if self._reader is not None:
                self._reader.join(timeout + 5.0)
            self._end_process(5.0)
            self._fail_open(f"worker {self.worker_id}: the engine process did not finish this request before it "
                            "closed")
        finally:
            self._close_pipes()
            self._closed_done.set()

    def __enter__(self) -> "RemoteWorker":
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- requests -------------------------------------------------------------------------
    def _tokenize(self, prompt, **options) -> list[int]:
        """``LLMEngine.encode``'s rule with this process's copy of the model's tokenizer."""
        return LLMEngine.encode_with(self._encoder, prompt, **options)

    def current_round(self) -> int:
        return self._snapshot.get("round", 0)

    def _enqueue(self, rid: str, token_ids: list[int], params: SamplingParams, prefill_after: str | None,
                 group: str) -> None:
        """The request, checked and accepted here, to the engine process, which queues it as it is."""
        self._pending[rid] = None
        self._groups.add(group)
        try:
            self._sender.send(Submit(rid, token_ids, params, prefill_after, group))
        except (OSError, ValueError):            # the child is gone; the reader says why in a moment
            self._pending.pop(rid, None)
            self._groups.finished(group, waiting=True)
            raise WorkerUnavailable(f"worker {self.worker_id}: the engine process is not reachable") from None

    def pending_ids(self) -> list[str]:
        """Request ids sent to the engine process and not yet seen admitted (or finished), in order."""
        with self._lock:
            return list(self._pending)

    # -- test hooks (calls into the child) -------------------------------------------------
    def _call(self, name: str, *args, timeout: float | None = 60.0) -> Any:
        fut: Future = Future()
        with self._lock:
            if not self._ready or self._closed or self._unhealthy:
                raise WorkerUnavailable(self._unavailable_reason())
            call_id = next(self._call_ids)
            self._calls[call_id] = fut
            self._sender.send(Call(call_id, name, args))
        return fut.result(timeout)

    def pause(self) -> None:
        self._call("pause")

    def resume(self) -> None:
        if self.accepting:
            self._call("resume")

    def inject_fault(self, at_step: int | None = None, message: str = "injected fault") -> None:
        self._call("inject_fault", at_step, message)

    def run_on_owner(self, fn: Callable[[Any], Any], timeout: float | None = 60.0) -> Any:
        """``fn(engine)`` on the child's owner thread; ``fn`` must be picklable (a module-level function)."""
        return self._call("run_on_owner", fn, timeout, timeout=None if timeout is None else timeout + 5.0)

    def set_feeder(self, fn) -> None:
        raise NotImplementedError("a feeder runs on the owner thread: use the in-process Worker")

    # -- state, answered here ---------------------------------------------------------------
    def _unhealthy_reason(self) -> str | None:
        if self._unhealthy:
            return self._unhealthy
        if self._snapshot.get("state") == "unhealthy":
            return self._snapshot.get("reason") or "the engine process's worker is unhealthy"
        return None

    @property
    def accepting(self) -> bool:
        return self._ready and not self._closed and self._unhealthy_reason() is None

    def state(self) -> str:
        if self._closed:
            return "closed"
        if not self._ready:
            return "starting"
        return "unhealthy" if self._unhealthy_reason() else "ok"

    def snapshot(self) -> dict:
        """The child's last published state (queue, active, KV blocks, round), with this side's health."""
        with self._lock:
            snap = dict(self._snapshot)
        snap.pop("reason", None)
        snap["state"] = self.state()
        reason = self._unhealthy_reason()
        if reason:
            snap["reason"] = reason
        return snap

    def _unavailable_reason(self) -> str:
        if self._closed:
            return f"worker {self.worker_id} is shut down"
        if not self._ready:
            return f"worker {self.worker_id} is starting"
        return f"worker {self.worker_id} is unhealthy: {self._unhealthy_reason()}"

    def header(self, envelope: Callable[..., dict] | None = None, **extra) -> dict:
        return super().header(envelope, engine_process={"pid": self.process.pid if self.process else None}, **extra)

    # -- the reader thread -------------------------------------------------------------------
    def _read(self) -> None:
        clean = False
        try:
            while True:
                try:
                    msg = self._events.recv()
                except (EOFError, OSError):
                    break
                if isinstance(msg, Outputs):
                    self._receive(msg)
                elif isinstance(msg, Reply):
                    fut = self._calls.pop(msg.call_id, None)
                    if fut is not None:
                        fut.set_result(msg.value) if msg.ok else fut.set_exception(msg.value)
                elif isinstance(msg, Closed):
                    clean = True
                    break
        except Exception as e:           # a bug here must not leave streams hanging
            self._gone(f"the engine process's event reader failed: {type(e).__name__}: {' '.join(str(e).split())}")
            return
        if not clean:
            self._gone(None)

    def _gone(self, why: str | None) -> None:
        """The child is gone (or unreadable): unless we closed it, every open stream finishes with error."""
        if why is None:
            if self._closed:
                why = "the engine process closed"
            else:
                proc = self.process
                proc.join(2.0)
                code = proc.exitcode
                how = (f"signal {signal.Signals(-code).name}" if code is not None and code < 0
                       else f"exit code {code}")
                why = f"the engine process exited unexpectedly ({how})"
        if not self._closed:
            self._unhealthy = why
            with self._lock:             # nothing runs any more
                self._snapshot = {**self._snapshot, "active": 0, "queue_depth": 0, "engine_running": 0,
                                  "engine_waiting": 0}
        self._fail_open(f"worker {self.worker_id}: {why}")
        for fut in list(self._calls.values()):
            if not fut.done():
                fut.set_exception(WorkerUnavailable(why))
        self._calls.clear()

    def _fail_open(self, message: str) -> None:
        with self._lock:
            open_ = list(self._live.items())
            self._pending.clear()
            self._groups.clear()
        step, t = self.current_round(), now_ns()
        self.output.process([Finished(rid, step, t, "error", message=message, admitted=r.admitted) for rid, r in open_])

    def _receive(self, msg: Outputs) -> None:
        """One message of the engine process: the queue's accounting, then the output processor (streams,
        metrics, log); a slow consumer it reports is cancelled at the owner."""
        with self._lock:                 # before any stream hears of it: a finished request's place is free
            for out in msg.outputs:
                kind = type(out)
                if kind is Admitted or kind is Finished:
                    r = self._live.get(out.request_id)
                    if r is None:
                        continue
                    waiting = self._pending.pop(out.request_id, 0) is None
                    if kind is Finished:
                        self._groups.finished(r.group, waiting=waiting)
                    elif waiting:
                        self._groups.admitted(r.group)
            if msg.snapshot is not None:
                self._snapshot = msg.snapshot
        for c in self.output.process(msg.outputs):
            self._send_cancel(c.request_id, c.cause, c.reason, c.message)

    def _send_cancel(self, request_id: str, cause: str, reason: str, message: str | None = None) -> bool:
        if self._closed:
            return False
        try:
            self._sender.send(Cancel(request_id, cause, reason, message))
        except (OSError, ValueError):
            return False
        return True


def worker_class(engine_process: bool) -> type:
    """The Worker ``labkit serve`` runs: in this process, or in an engine process of its own."""
    return RemoteWorker if engine_process else Worker

