"""The engine process's side of ``labkit serve --engine-process`` (the parent's side, and the design,
are in :mod:`serve.core.proc_client`).

:func:`child_main` is the target the parent spawns (``multiprocessing`` "spawn" pickles it by this
module's path). It runs the existing Worker with the Worker's :class:`OwnerHooks` pointed at the pipe
(:class:`_Sender`): the owner hands its outputs over once per step and once per boundary (``outputs``), and
they go to the parent as ONE message, whose output processor makes the streams, metrics and log lines of them;
after each loop round (``published``) the owner's snapshot follows. Nothing is counted or logged here. It
reports Ready (the :class:`serve.core.front.ServedEngine` record the parent serves and checks submissions
with) or its InitError, then serves the parent's commands (Submit, Cancel, the Calls of :data:`CHILD_CALLS`,
Close; :mod:`serve.core.messages`) until the parent closes it or its pipe reads EOF. A Submit was checked by
the parent: it is queued as it is (a structured-output constraint's grammar is compiled into the engine's
cache on this thread first, off the step loop: the parent's compile checked it over the parent's tokenizer).
"""
from __future__ import annotations

import dataclasses
import signal
import sys
import threading
import time
import types
from contextlib import contextmanager

from engine import RequestError
from serve.errors import ServeError
from serve.heap import freeze_startup_heap
from serve.process_exit import end_without_teardown
from serve.core.config import WorkerConfig
from serve.core.front import WorkerUnavailable
from serve.core.messages import (Call, Cancel, Close, Closed, Commands, Finished, InitError, Outputs, Ready, Reply,
                                 Submit)
from serve.core.records import OwnerHooks
from serve.core.worker import Worker

#: The Worker methods a child may be asked to run (test hooks and snapshots), nothing else.
CHILD_CALLS = ("pause", "resume", "inject_fault", "run_on_owner", "snapshot")
READY_TIMEOUT_S = 900.0


class _Sender:
    """The child's end of the event pipe: the owner's outputs and snapshots, one message per hand-off."""

    def __init__(self, conn):
        self.conn = conn
        self.lock = threading.Lock()

    def outputs(self, batch: list) -> None:
        self.send(Outputs(batch))

    def published(self, snapshot: dict) -> None:
        self.send(Outputs([], snapshot))

    def send(self, msg) -> None:
        with self.lock:
            self.conn.send(msg)


def _portable(exc: BaseException) -> BaseException:
    """An exception the parent can unpickle with its type and one-line message (else a ServeError)."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return ServeError(" ".join(f"{type(exc).__name__}: {exc}".split()))


class _Terminated(Exception):
    """SIGTERM reached the engine process (a process-group kill of ``labkit serve``): close in order."""


def _on_sigterm(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)     # once: the close below must not be cut short
    raise _Terminated()


def child_main(config: WorkerConfig, commands, events, build: str | None = None) -> None:
    """The engine process: build the Worker, report ready (or the init error), then serve commands. SIGTERM
    closes the Worker in order like the parent's close (its engine's TP ranks, shared memory and semaphores
    released: no resource_tracker "leaked" warning), instead of killing the process where it stands. Closed in
order, the process ends without the interpreter's module teardown (:mod:`serve.process_exit`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # Ctrl-C goes to the parent, which closes us in order
    signal.signal(signal.SIGTERM, _on_sigterm)
    sender = _Sender(events)
    hooks = OwnerHooks(outputs=sender.outputs, published=sender.published)
    worker = Worker(dataclasses.replace(config, load_tokenizer=False), hooks=hooks, build=build)
    try:
        worker.start(READY_TIMEOUT_S)
    except _Terminated:
        worker.close(timeout=10.0)
        return
    except BaseException as e:
        sender.send(InitError(_portable(e)))
        return
    freeze_startup_heap()             # the engine's startup heap out of full collections while it steps
    sender.send(Ready(worker.served, worker.snapshot()))
    close_timeout = 30.0
    try:
        close_timeout = _serve_commands(worker, sender, commands)
    except _Terminated:
        close_timeout = 10.0
    finally:
        worker.close(timeout=close_timeout)
        try:
            sender.send(Closed())
        except OSError:
            pass
    end_without_teardown(0)           # closed in order: the parent's join need not wait for the module teardown


def _serve_commands(worker: Worker, sender: _Sender, commands) -> float:
    """The parent's commands until close (its timeout returned) or EOF (the default timeout)."""
    while True:
        try:
            msg = commands.recv()
        except (EOFError, OSError):           # the parent is gone
            return 30.0
        for one in msg.messages if isinstance(msg, Commands) else (msg,):
            if isinstance(one, Close):
                return one.timeout
            _serve_command(worker, sender, one)


def _serve_command(worker: Worker, sender: _Sender, msg) -> None:
    if isinstance(msg, Submit):
        _child_submit(worker, sender, msg)
    elif isinstance(msg, Cancel):
        worker.cancel(msg.request_id, msg.cause, msg.reason, msg.message)
    elif isinstance(msg, Call):
        try:
            if msg.name not in CHILD_CALLS:
                raise ValueError(f"{msg.name} is not a call the engine process takes")
            sender.send(Reply(msg.call_id, True, getattr(worker, msg.name)(*msg.args)))
        except _Terminated:
            raise
        except BaseException as e:
            sender.send(Reply(msg.call_id, False, _portable(e)))


def _child_submit(worker: Worker, sender: _Sender, msg: Submit) -> None:
    so = msg.params.structured_outputs
    try:
        if so is not None:
            worker.engine.grammars.compile(so)       # the engine's own compiled grammar, off the step loop
        worker.enqueue_checked(msg.request_id, msg.token_ids, msg.params, msg.prefill_after, msg.group)
    except (RequestError, WorkerUnavailable) as e:   # the parent's compiler took it, or the worker just stopped
        sender.outputs([Finished(msg.request_id, worker.current_round(), time.monotonic_ns(), "rejected",
                                 message=" ".join(str(e).split()))])


@contextmanager
def bare_main():
    """While a child is spawned, ``__main__`` is an empty module: the child needs nothing of the parent's
    main script (its target, :func:`child_main`, lives in this module), so it never re-runs a script
    without a ``__main__`` guard, nor pytest's or the console script's entry."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main

