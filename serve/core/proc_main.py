"""The engine process's side of ``labkit serve --engine-process`` (the parent's side, and the design,
are in :mod:`serve.core.proc_client`).

:func:`child_main` is the target the parent spawns (``multiprocessing`` "spawn" pickles it by this
module's path). It runs the existing Worker unchanged, with ``stream=False`` handles (nobody reads them
here), a sink (:class:`_Sender`) that collects the owner's events, and the Worker's :class:`OwnerHooks`:
the owner hands a whole step's wake-ups over once per step (``flushed``), and there the step's events go
to the parent as ONE message; after each loop round (``published``) the owner's snapshot follows. Events
made outside the owner thread (``submitted`` at submit) go out at once, under the same lock. Its Worker
keeps no Prometheus stats (:class:`_Uncounted`): the parent counts from the events. It reports Ready
(the :class:`serve.core.front.ServedEngine` record the parent serves and checks submissions with) or
its InitError, then serves the parent's commands (Submit, Cancel, the Calls of :data:`CHILD_CALLS`,
Close; :mod:`serve.core.messages`) until the parent closes it or its pipe reads EOF.
"""
from __future__ import annotations

import dataclasses
import signal
import sys
import threading
import types
from contextlib import contextmanager

from engine import RequestError
from serve.errors import ServeError
from serve.process_exit import end_without_teardown
from serve.observe.events import make_event
from serve.core.config import WorkerConfig
from serve.core.front import DuplicateRequest, WorkerUnavailable
from serve.core.messages import Call, Cancel, Close, Closed, Events, InitError, Ready, Reply, Submit
from serve.core.records import OwnerHooks
from serve.core.worker import Worker

#: The Worker methods a child may be asked to run (test hooks and snapshots), nothing else.
CHILD_CALLS = ("pause", "resume", "inject_fault", "run_on_owner", "snapshot")
READY_TIMEOUT_S = 900.0


class _Sender:
    """The child's end of the event pipe: the owner's events batched per step, others sent at once."""

    def __init__(self, conn):
        self.conn = conn
        self.lock = threading.Lock()
        self.batch: list[dict] = []
        self.worker: Worker | None = None

    def sink(self, ev: dict) -> None:
        if self.worker.on_owner_thread():
            self.batch.append(ev)
        else:
            self.send(Events([ev]))

    def ship(self, snapshot: dict | None = None) -> None:
        batch, self.batch = self.batch, []
        if batch or snapshot is not None:
            self.send(Events(batch, snapshot))

    def send(self, msg) -> None:
        with self.lock:
            self.conn.send(msg)


class _Uncounted:
    """The child Worker's stats: nothing. The parent counts the same from the events, so the engine's process
    pays no Prometheus counter or histogram per token (about 1 us each)."""

    def count_prompt(self, tokens: int) -> None:
        pass

    def count_tokens(self, ttfts: list[float], itls: list[float], first_prompt_tokens: int = 0) -> None:
        pass

    def count_step(self, phase: str, seconds: float) -> None:
        pass

    def count_engine_error(self) -> None:
        pass

    def count_finished(self, reason: str, e2e_seconds: float | None = None, prompt_tokens: int = 0,
                       generation_tokens: int = 0, *, times=None, max_tokens: int = 0, n: int = 0) -> None:
        pass


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
    hooks = OwnerHooks(flushed=sender.ship, published=sender.ship)
    worker = Worker(dataclasses.replace(config, load_tokenizer=False, log_steps=True), sink=sender.sink, hooks=hooks,
                    build=build)
    sender.worker = worker
    worker.stats = _Uncounted()
    try:
        worker.start(READY_TIMEOUT_S)
    except _Terminated:
        worker.close(timeout=10.0)
        return
    except BaseException as e:
        sender.send(InitError(_portable(e)))
        return
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
        if isinstance(msg, Submit):
            _child_submit(worker, sender, msg)
        elif isinstance(msg, Cancel):
            worker.cancel(msg.request_id, msg.cause, msg.reason)
        elif isinstance(msg, Call):
            try:
                if msg.name not in CHILD_CALLS:
                    raise ValueError(f"{msg.name} is not a call the engine process takes")
                sender.send(Reply(msg.call_id, True, getattr(worker, msg.name)(*msg.args)))
            except _Terminated:
                raise
            except BaseException as e:
                sender.send(Reply(msg.call_id, False, _portable(e)))
        elif isinstance(msg, Close):
            return msg.timeout


def _child_submit(worker: Worker, sender: _Sender, msg: Submit) -> None:
    try:
        worker.submit(msg.token_ids, msg.params, request_id=msg.request_id, tags=msg.tags, stream=False,
                      prefill_after=msg.prefill_after, group=msg.group)
    except (RequestError, DuplicateRequest, WorkerUnavailable) as e:     # the parent's checks let it through
        sender.send(Events([make_event("finished", msg.request_id, worker.worker_id, worker._round, reason="rejected",
                                       message=" ".join(str(e).split()), num_prompt_tokens=len(msg.token_ids),
                                       num_completion_tokens=0, admitted=False)]))


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

