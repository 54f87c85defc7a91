"""The Worker: one thread creates and owns the engine; everyone else only sends it messages.

Threads and ownership
    ``start()`` spawns the owner thread, which builds the engine (model load, KV pool) and reports
    an init error back to the caller of ``start()``. Only the owner touches the engine. Other
    threads call ``submit()``, ``cancel()``, ``run_on_owner()`` and ``close()``, all thread-safe.

Admission and the queue
    ``submit()`` (:class:`serve.core.front.WorkerFront`: the checks, the encoding) appends the request
    to a queue of ``queue_size`` requests (the sequences of one HTTP request, ``n`` x prompts, are one request:
    a ``group``); a full queue rejects it (its stream gets ``finished(reason=rejected)`` and ``handle.rejected``
    is true; no request is ever dropped silently). At each step boundary the owner handles cancels first, then
    admits queued requests while fewer than ``max_active`` are admitted and unfinished: round-robin across
    groups, at most ``max_active_per_request`` running per group (:mod:`serve.core.fair`).

Event streams and slow consumers
    Each request's handle buffers ``stream_buffer`` events; the owner never blocks on a consumer: a token that
    would leave more unread cancels the request at that boundary (``cause=slow_consumer``, blocks freed), so a
    buffer never holds more than ``stream_buffer + 2`` events. ``submit(stream=False)`` keeps only the
    finished event (in-process load replay, where the JSONL log is the record).

Cancellation
    ``cancel(request_id)`` is handled by the owner at the next step boundary: a queued request finishes
    ``cancelled`` unadmitted; an admitted one goes through ``engine.abort`` (blocks freed at once), no token after.

Engine exceptions
    If ``engine.step()`` raises, the requests of the batch being run (all admitted ones when the batch is
    unknown) finish with ``reason=error`` and the exception's one-line message. If the engine is still
    consistent afterwards (scheduler queues match the admitted requests, every used KV block is held, no stale
    scheduled tokens) the worker keeps serving; if not, or on an exception outside ``engine.step()`` (a bug in
    the worker or a feeder), every open request finishes with ``error``, the worker turns unhealthy
    (``submit()`` raises :class:`WorkerUnavailable`, HTTP 503; ``/health`` says why) and the process stays up
    so the evidence can be read; a restart recovers.

Shutdown
    ``close()`` is idempotent: the owner stops at the next boundary, finishes every queued and admitted request
    with ``cancelled``/``cause=shutdown`` (blocks freed), closes the engine and exits; the join is bounded by
    ``timeout`` (an owner stuck inside a step: the closing thread finishes the handles with ``error``).

Test hooks: ``pause()``/``resume()`` hold the owner at a boundary, ``inject_fault(at_step)`` raises inside
``engine.step()``, ``set_feeder(fn)`` calls ``fn(round)`` on the owner before each admission (round-mode replay).
"""
from __future__ import annotations

import contextlib
import copy
import threading
from collections import deque
from typing import Any, Callable

from engine import RequestError, SamplingParams
from engine.observe import StepHooks
from serve.errors import ServeError
from serve.core.config import WorkerConfig
from serve.observe.events import Sink, now_ns
from serve.core.fair import per_request_cap, pick
from serve.core.front import ServedEngine, WorkerFront, WorkerUnavailable
from serve.core.messages import Admitted, Cancel, Finished, StepDone, WorkerNote
from serve.core.records import Fault, HostTime, OwnedRequest, OwnerCall, OwnerHooks, step_record, step_tokens
from serve.core.stream import RequestHandle, wake_all


class InjectedFault(RuntimeError):
    """Raised inside engine.step() by ``Worker.inject_fault`` (tests and ``labkit simulate``)."""


class _WorkerHooks(StepHooks):
    """The worker's view of the step path: which seqs a step carries (so an engine error names the
    requests it affects), and the point just before the forward where an injected fault is raised."""

    def __init__(self, worker: "Worker"):
        self.worker = worker

    def on_scheduled(self, step: int, is_prefill: bool, batch: list[tuple[int, int]]) -> None:
        self.worker._scheduled_ids.update(sid for sid, _ in batch)

    def before_forward(self, step: int, inputs: Any) -> None:
        fault = self.worker._fault
        if fault is not None and step >= fault.at_step:
            self.worker._fault = None
            raise InjectedFault(fault.message)


class Worker(WorkerFront):
    def __init__(self, config: WorkerConfig | None = None, sink: Sink | None = None, hooks: OwnerHooks | None = None,
                 build: str | None = None):
        super().__init__(config, sink, build)              # its _lock is re-entrant: _finish may run with it held
        self.hooks = hooks or OwnerHooks()
        self.engine = None                      # owned by the owner thread once started
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._init_error: BaseException | None = None
        self._cv = threading.Condition(self._lock)
        self._pending: deque[OwnedRequest] = deque()      # submitted, not admitted
        self._active: dict[str, OwnedRequest] = {}        # admitted, not finished (owner only)
        self._by_seq: dict[int, OwnedRequest] = {}        # owner only
        self._cancels: deque[Cancel] = deque()
        self._calls: deque[OwnerCall] = deque()
        self._round = 0
        self._stopping = False
        self._closed = False
        self._closed_done = threading.Event()
        self._paused = False
        self._unhealthy: str | None = None
        self._fault: Fault | None = None
        self._feeder: Callable[[int], None] | None = None
        self._scheduled_ids: set[int] = set()           # seqs in steps scheduled and not yet delivered
        self._range = None                            # profiler range factory (profiling.py)
        self._snapshot: dict = {"state": "starting"}
        self._wakes: list[RequestHandle] | None = None    # owner: handles to wake at the end of a boundary/step
        self._out: list = []                              # owner: outputs not yet handed to the output side
        # owner: where its time went since the last step's end (ns), written into the next step record
        self._host = HostTime()

    # -- lifecycle ---------------------------------------------------------------------
    def start(self, timeout: float | None = 900.0) -> "Worker":
        """Start the owner thread and wait until the engine is built; re-raise its init error."""
        if self._thread is not None:
            raise RuntimeError("worker already started")
        self._thread = threading.Thread(target=self._run, name=f"labkit-owner-{self.worker_id}", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            self.close(timeout=1.0)
            raise ServeError(f"worker {self.worker_id}: engine not ready within {timeout} s")
        if self._init_error is not None:
            self._thread.join(5.0)
            self._closed = True
            self._closed_done.set()
            raise self._init_error
        return self

    def close(self, timeout: float = 30.0) -> None:
        """Stop the owner, finish every open request (cancelled/shutdown), close the engine. Idempotent."""
        with self._lock:
            first = not self._closed
            self._closed = True
            self._stopping = True
            self._cv.notify_all()
        if not first:
            self._closed_done.wait(timeout)
            return
        try:
            thread = self._thread
            if thread is not None and thread.is_alive() and thread is not threading.current_thread():
                thread.join(timeout)
                if thread.is_alive():       # stuck inside a step: finish the streams from here
                    for req in list(self._live.values()):
                        self._finish(req, "error", message=f"worker did not stop within {timeout} s")
        finally:
            self._publish(state="closed")
            self._closed_done.set()

    def __enter__(self) -> "Worker":
        return self.start() if self._thread is None else self

    def __exit__(self, *exc) -> None:
        self.close()

    def on_owner_thread(self) -> bool:
        return threading.current_thread() is self._thread

    @property
    def accepting(self) -> bool:
        return self._ready.is_set() and self._init_error is None and not self._closed and self._unhealthy is None

    def state(self) -> str:
        if self._closed:
            return "closed"
        if not self._ready.is_set():
            return "starting"
        return "unhealthy" if self._unhealthy else "ok"

    # -- the public, thread-safe API (submit and encode: WorkerFront) --------------------------
    def _tokenize(self, prompt, **options) -> list[int]:
        return self.engine.encode(prompt, **options)

    def current_round(self) -> int:
        return self._round

    def _enqueue(self, rid: str, token_ids: list[int], params: SamplingParams, prefill_after: str | None,
                 group: str) -> None:
        self.enqueue_checked(rid, token_ids, params, prefill_after, group)

    def enqueue_checked(self, rid: str, token_ids: list[int], params: SamplingParams, prefill_after: str | None = None,
                        group: str | None = None) -> None:
        """Queue a request a front has checked and accepted (``submit`` here; the parent of an engine process)
        as it is: nothing is checked again."""
        req = OwnedRequest(rid, token_ids, params, prefill_after=prefill_after, group=group or rid)
        with self._lock:
            if not self.accepting:
                raise WorkerUnavailable(self._unavailable_reason())
            self._pending.append(req)
            self._groups.add(req.group)
            self._live[rid] = req
            self._cv.notify_all()

    def _send_cancel(self, request_id: str, cause: str, reason: str, message: str | None = None) -> bool:
        self._cancels.append(Cancel(request_id, cause, reason, message))
        self._cv.notify_all()
        return True

    def run_on_owner(self, fn: Callable[[Any], Any], timeout: float | None = 60.0) -> Any:
        """Run ``fn(engine)`` on the owner thread at a step boundary and return its result."""
        if threading.current_thread() is self._thread:
            return fn(self.engine)
        call = OwnerCall(fn)
        with self._lock:
            if self._closed or self._thread is None or not self._thread.is_alive():
                raise WorkerUnavailable(self._unavailable_reason())
            self._calls.append(call)
            self._cv.notify_all()
        return call.future.result(timeout)

    def snapshot(self) -> dict:
        """The owner's last published state (queue, active, KV blocks, round, health); any thread."""
        with self._lock:
            snap = dict(self._snapshot)
        snap["state"] = self.state()
        if self._unhealthy:
            snap["reason"] = self._unhealthy
        return snap

    # -- test hooks ----------------------------------------------------------------------
    def pause(self) -> None:
        """Hold the owner at the next step boundary (no cancels, admissions or steps) until resume()."""
        with self._lock:
            self._paused = True

    def resume(self) -> None:
        with self._lock:
            self._paused = False
            self._cv.notify_all()

    def inject_fault(self, at_step: int | None = None, message: str = "injected fault") -> None:
        """Make the model runner raise once, inside engine.step(), at step ``at_step`` (default: the next)."""
        self._fault = Fault(at_step if at_step is not None else self._round + 1, message)

    def set_feeder(self, fn: Callable[[int], None] | None) -> None:
        """``fn(round)`` runs on the owner before each admission (it may call submit)."""
        with self._lock:
            self._feeder = fn
            self._cv.notify_all()

    def pending_ids(self) -> list[str]:
        """Request ids queued and not yet admitted, in order (any thread)."""
        with self._lock:
            return [r.request_id for r in self._pending]

    def idle(self) -> bool:
        """No request queued or admitted (meaningful on the owner thread, e.g. inside a feeder)."""
        return not self._active and not self._pending

    def wake(self) -> None:
        with self._lock:
            self._cv.notify_all()

    # -- owner thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._build()
        except BaseException as e:        # reported to start()'s caller
            self._init_error = e
            if self.engine is not None:   # built, then something after it failed
                with contextlib.suppress(Exception):
                    self.engine.close()
            self._ready.set()
            return
        self._publish(state="ok")
        self._ready.set()
        try:
            while True:
                with self._lock:
                    while not self._stopping and not self._has_work_locked():
                        self._cv.wait(0.5)
                    if self._stopping:
                        break
                    paused = self._paused
                try:
                    if self._calls:
                        self._run_calls()
                    if paused:
                        continue
                    self._wakes = []
                    host = self._host
                    t = now_ns()
                    self._boundary()
                    t1 = now_ns()
                    self._flush_wakes()         # admitted/cancelled streams hear it before the step runs
                    t2 = now_ns()
                    host.boundary += t1 - t
                    host.wakes += t2 - t1
                    if self._active:
                        self._step()
                        t = now_ns()
                        self._flush_wakes()     # the whole step's tokens: one wake-up hand-off per event loop
                        host.wakes += now_ns() - t
                    t = now_ns()
                    self._publish()
                    host.publish += now_ns() - t
                except Exception as exc:      # a bug outside engine.step(): stop taking work, say why
                    self._internal_error(exc)
                finally:
                    self._flush_wakes()
                    self._wakes = None
        finally:
            self._shutdown_owner()

    def _flush_wakes(self) -> None:
        self._handoff()
        wakes = self._wakes
        if wakes:
            self._wakes = []
            wake_all(dict.fromkeys(wakes))     # each handle once, in order

    def _emit(self, out) -> None:
        """An output of the owner: batched on the owner thread (handed off once per step and per boundary),
        handed off at once from any other thread."""
        if threading.current_thread() is self._thread:
            self._out.append(out)
        else:
            self._hand([out], None)

    def _handoff(self) -> None:
        """The owner's batch of outputs to the output side; a slow consumer it reports is cancelled now."""
        while self._out:
            batch, self._out = self._out, []
            for c in self._hand(batch, self._wakes):
                self._cancel_now(c.request_id, c.cause, c.reason, c.message)

    def _hand(self, batch: list, wakes: list | None) -> list[Cancel]:
        if self.hooks.outputs is not None:          # the engine process: to the parent's output processor
            self.hooks.outputs(batch)
            return []
        return self.output.process(batch, wakes)

    def _build(self) -> None:
        from serve.core.engine_build import builder

        cfg = self.config
        built = builder(self.build)(cfg.engine)
        self.engine = engine = built.engine
        self.served = ServedEngine(built.kind, built.device, dict(built.model or {}), built.describe(), engine.config,
                                   engine.stats().num_blocks)
        if cfg.load_tokenizer:
            # the HTTP front decodes on its event loop: its own copy, never the one submit() encodes with
            self._encoder = self.engine.tokenizer
            self.tokenizer = copy.deepcopy(self._encoder)
        self.engine.add_hooks(_WorkerHooks(self))
        if getattr(engine, "admit_in_flight", False):
            engine.arrivals = self._admit_pending    # (LAB_ADMIT_IN_FLIGHT: asked between a prefill's launch and read)
        self._grammar_cache = engine.grammars       # submit() compiles constraints into the engine's own cache
        engine.grammars.cache_bytes = cfg.grammar_cache_mb << 20
        engine.grammars.compile_timeout_s = cfg.grammar_compile_timeout
        engine.grammars.max_grammar_bytes = cfg.grammar_max_mb << 20
        engine.grammars.step_budget_s = cfg.grammar_step_budget_ms / 1e3

    def _has_work_locked(self) -> bool:
        if self._calls:
            return True
        if self._paused:
            return False
        return bool(self._pending or self._cancels or self._active or self._feeder)

    def _run_calls(self) -> None:
        while True:
            with self._lock:
                if not self._calls:
                    return
                call = self._calls.popleft()
            if call.future.set_running_or_notify_cancel():
                try:
                    call.future.set_result(call.fn(self.engine))
                except BaseException as e:
                    call.future.set_exception(e)

    def _boundary(self) -> None:
        """Between steps: cancels, then the feeder, then admissions."""
        with self._lock:
            cancels = list(self._cancels)
            self._cancels.clear()
        for c in cancels:
            self._cancel_now(c.request_id, c.cause, c.reason, c.message)
        feeder = self._feeder
        if feeder is not None:
            feeder(self._round)
        self._admit_pending()
        self._handoff()

    def _admit_pending(self) -> bool:
        """The queued requests admission takes now (max_active, the per-request cap) into the engine; True when it
        took any. Also the engine's ``arrivals`` hook (LAB_ADMIT_IN_FLIGHT, on by default: called on this thread
        while a prefill is in flight, so requests that arrived meanwhile can be prefilled behind it)."""
        cfg = self.config
        with self._lock:
            chosen = pick(self._pending, self._active.values(), cfg.max_active - len(self._active),
                          per_request_cap(cfg.max_active, cfg.max_active_per_request))
            if chosen:
                self._pending = self._groups.take(self._pending, chosen)
        for req in chosen:
            self._admit(req)
        return bool(chosen)

    def _admit(self, req: OwnedRequest) -> None:
        try:
            lead = self._active.get(req.prefill_after) if req.prefill_after else None
            req.seq = self.engine.add_request(req.token_ids, req.params, validated=True,   # checked at submit
                                              prefill_after=lead.seq if lead is not None else None)
        except RequestError as e:
            self._finish(req, "rejected", message=str(e))
            return
        self._active[req.request_id] = req
        self._by_seq[req.seq.seq_id] = req
        with self._lock:
            queue = len(self._pending)
        self._emit(Admitted(req.request_id, self._round, now_ns(), len(self._active) - 1, len(self._active), queue,
                            req.seq.seq_id))

    def _cancel_now(self, rid: str, cause: str, reason: str = "cancelled", message: str | None = None) -> None:
        with self._lock:
            req = self._live.get(rid)
            if req is None:
                return
            self._unqueue(req)
        freed: list[int] = []
        if req.seq is not None:
            freed = self.engine.abort(req.seq, reason)
        self._finish(req, reason, cause=cause, message=message, freed_blocks=len(freed))

    def _step(self) -> None:
        engine = self.engine
        t0 = now_ns()
        try:
            if self._range is not None:
                with self._range("step"):
                    out = engine.step()
            else:
                out = engine.step()
        except Exception as exc:
            self._round = engine.num_steps
            self._on_engine_error(exc)
            return
        self._round = out.step
        self._scheduled_ids.difference_update(sid for sid, _ in out.scheduled)
        self._deliver(out, t0)
        self._host.deliver += now_ns() - self._host.end_ns

    def _deliver(self, out, t0: int) -> None:
        """A step's outputs (its record, its tokens, the requests it finished), handed off at once."""
        t = now_ns()
        before = self._host.record(t0)          # the owner's time since the previous step ended
        self._host.restart(t)
        record = None
        if self.config.log_steps:
            record = step_record(out, self.worker_id, t0, t, before, self._rid_of, self.engine.stats().free_blocks)
        # kind: decode | prefill | mixed; a step that prefills may be a request's first (its scheduled moment)
        rids = () if out.kind == "decode" else tuple(filter(None, map(self._rid_of, (s for s, _ in out.scheduled))))
        self._emit(StepDone(out.kind, out.seconds, record, t0, rids))
        self._emit(step_tokens(out, self._by_seq, t))
        for seq in out.outcome.finished:
            req = self._by_seq.get(seq.seq_id)
            if req is not None:
                by_id = seq.finish_reason == "stop" and seq.token_ids[-1] in req.params.stop_token_ids
                g = seq.grammar
                if g is not None and g.over_budget and seq.finish_reason == "abort":
                    self._finish(req, "abort", cause="grammar_budget",
                                 message=f"the grammar's mask work took {g.step_s * 1e3:.0f} ms of CPU in one step, "
                                         f"past its {g.budget_s * 1e3:g} ms budget (--grammar-step-budget-ms)")
                    continue
                self._finish(req, seq.finish_reason, cause="stop_token_id" if by_id else None)
        self._handoff()

    def _rid_of(self, seq_id: int) -> str | None:
        req = self._by_seq.get(seq_id)
        return req.request_id if req else None

    def _finish(self, req: OwnedRequest, reason: str, cause: str | None = None, message: str | None = None,
                freed_blocks: int | None = None) -> None:
        """The one place a request ends on the owner's side: bookkeeping, then its Finished output."""
        if req.done:
            return
        req.done = True
        self._active.pop(req.request_id, None)
        if req.seq is not None:
            self._by_seq.pop(req.seq.seq_id, None)
        with self._lock:
            if self._live.get(req.request_id) is req:
                del self._live[req.request_id]
                self._groups.finished(req.group, waiting=False)
        cached = req.seq.num_prefix_hit_tokens if req.seq is not None else None
        self._emit(Finished(req.request_id, self._round, now_ns(), reason, cause, message, req.seq is not None, cached,
                            freed_blocks))

    # -- failures ----------------------------------------------------------------------------
    def _on_engine_error(self, exc: BaseException) -> None:
        message = " ".join(f"{type(exc).__name__}: {exc}".split())
        if self._scheduled_ids:
            affected = [self._by_seq[sid] for sid in sorted(self._scheduled_ids) if sid in self._by_seq]
        else:
            affected = list(self._active.values())
        self._scheduled_ids.clear()
        for req in affected:
            self._finish(req, "error", message=message, freed_blocks=self._abort_quietly(req, "error"))
        ok, why = self._consistent()
        self._emit(WorkerNote("engine_error", self._round, {"message": message,
                                                            "affected": [r.request_id for r in affected],
                                                            "consistent": ok, "why": why}))
        if not ok:
            self._unhealthy = f"engine inconsistent after {message}: {why}"
            self._end_all("error", message=self._unhealthy, count_freed=False)

    def _internal_error(self, exc: BaseException) -> None:
        message = " ".join(f"{type(exc).__name__}: {exc}".split())
        self._unhealthy = f"internal error in the owner loop: {message}"
        with self._lock:
            self._pending.clear()
            self._feeder = None
        for req in list(self._live.values()):
            self._abort_quietly(req, "error")
            self._finish(req, "error", message=self._unhealthy)
        try:
            self._handoff()
        except Exception:               # the output side itself failed: close the streams with a bare event
            self._out = []
            for rid in list(self.output.requests):
                self.output.abandon(rid, self._unhealthy)
        with self._lock:
            self._live.clear()
            self._groups.clear()
        self._active.clear()
        self._by_seq.clear()

    def _unqueue(self, req: OwnedRequest) -> None:      # with the lock held; _finish counts it out of the live
        if req.seq is None and req in self._pending:
            self._pending.remove(req)
            self._groups.admitted(req.group)

    def _abort_quietly(self, req: OwnedRequest, reason: str) -> int:
        """Abort an admitted request's sequence whatever state the engine is in; the number of blocks freed."""
        if req.seq is None:
            return 0
        try:
            return len(self.engine.abort(req.seq, reason))
        except Exception:
            return 0

    def _end_all(self, reason: str, cause: str | None = None, message: str | None = None,
                 count_freed: bool = True) -> None:
        """Every live request out of the queue, aborted and finished with ``reason``."""
        for req in list(self._live.values()):
            with self._lock:
                self._unqueue(req)
            freed = self._abort_quietly(req, reason)
            self._finish(req, reason, cause=cause, message=message, freed_blocks=freed if count_freed else None)

    def _consistent(self) -> tuple[bool, str]:
        ids = self.engine.live_seq_ids()
        mine = {r.seq.seq_id for r in self._active.values()}
        if ids != mine:
            return False, f"scheduler holds seqs {sorted(ids)} but the worker has {sorted(mine)} admitted"
        return self.engine.check_invariants()

    def _unavailable_reason(self) -> str:
        if self._closed:
            return f"worker {self.worker_id} is shut down"
        if not self._ready.is_set():
            return f"worker {self.worker_id} is starting"
        if self._init_error is not None:
            return f"worker {self.worker_id} failed to start: {self._init_error}"
        return f"worker {self.worker_id} is unhealthy: {self._unhealthy}"

    def _shutdown_owner(self) -> None:
        try:
            self._run_calls()
            self._end_all("cancelled", cause="shutdown")
            self._handoff()
            self._publish()
            self._emit(WorkerNote("closed", self._round, {"free_blocks": self._snapshot.get("kv_blocks_free"),
                                                          "total_blocks": self._snapshot.get("kv_blocks_total")}))
        finally:
            self._handoff()
            with self._lock:
                calls, self._calls = list(self._calls), deque()
            for call in calls:
                call.future.cancel()
            try:
                if self.engine is not None:
                    self.engine.close()
            finally:
                if self.hooks.published is not None:
                    self.hooks.published(self.snapshot())

    def _publish(self, state: str | None = None) -> None:
        """Copy the owner's numbers into a snapshot any thread may read."""
        snap: dict[str, Any] = {"worker_id": self.worker_id, "round": self._round}
        engine = self.engine
        if engine is not None and threading.current_thread() is self._thread:
            st = engine.stats()
            snap.update(engine_waiting=st.waiting, engine_running=st.running, kv_blocks_total=st.num_blocks,
                        kv_blocks_free=st.free_blocks, kv_blocks_used=st.num_blocks - st.free_blocks, **st.totals())
        with self._lock:
            snap.update(queue_depth=len(self._pending), active=len(self._active))
            merged = {**self._snapshot, **snap}
            if state is not None:
                merged["state"] = state
            self._snapshot = merged
        if self.hooks.published is not None and threading.current_thread() is self._thread:
            self.hooks.published(self.snapshot())
