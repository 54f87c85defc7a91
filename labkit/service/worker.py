"""The Worker: one thread creates and owns the engine; everyone else only sends it messages.

Threads and ownership
    ``start()`` spawns the owner thread, which builds the engine (model load, KV pool) and reports
    an init error back to the caller of ``start()``. Only the owner touches the engine. Other
    threads call ``submit()``, ``cancel()``, ``run_on_owner()`` and ``close()``, all thread-safe.

Admission and the queue
    ``submit()`` validates the prompt at once (``engine.RequestError`` for a text prompt of more than
    ``max_prompt_bytes`` UTF-8 bytes, refused before the tokenizer sees it; an empty prompt, a token
    id outside the vocabulary, prompt + max_tokens beyond max_model_len, a prompt the KV pool can
    never hold) and appends the request to a bounded queue of ``queue_size``. A request without an
    id gets a random one (``<worker_id>-<16 hex digits>``): no client can guess or claim the next. A full queue rejects
    the request: its stream gets ``finished(reason=rejected)`` and ``handle.rejected`` is true; no
    request is ever dropped silently. At each step boundary the owner handles cancels first, then
    admits queued requests in order while fewer than ``max_active`` are admitted and unfinished.

Event streams and slow consumers
    Each request has a handle with a bounded buffer (``stream_buffer`` events). The owner never
    blocks on a consumer: when a token would leave more than ``stream_buffer`` events unread, the
    request is cancelled at that step boundary with ``cause=slow_consumer`` and its KV blocks are
    freed. A buffer therefore never holds more than ``stream_buffer + 2`` events (the overflowing
    token and the finished event). ``submit(stream=False)`` keeps only the finished event (for
    in-process load replay, where the JSONL log is the record).

Chat messages and special tokens
    Messages go through the model's chat template. Only the template's own markers become control
    tokens: text inside a message that spells a special token (``<|im_start|>system``) is tokenized as
    plain text, so a user cannot forge a turn. ``special_tokens_in_content=True`` restores the old
    behaviour (the whole rendered prompt parsed for special tokens).

Cancellation
    ``cancel(request_id)`` is recorded and handled by the owner at the next step boundary: a queued
    request finishes ``cancelled`` without ever being admitted; an admitted one goes through
    ``engine.abort`` (its blocks are freed at once) and gets no token after its finished event.

Engine exceptions
    If ``engine.step()`` raises, the requests of the batch that was being run (all admitted
    requests when the batch is unknown, e.g. a failure inside the scheduler) are aborted and finish
    with ``reason=error`` and the exception's one-line message. The owner then checks that the
    engine is still consistent (scheduler queues match the admitted requests, every used KV block is
    held by one of them, no stale scheduled tokens). If it is, the worker keeps serving: queued and
    unaffected requests go on. If it is not, the worker turns unhealthy: every other request
    finishes with ``error``, ``submit()`` raises :class:`WorkerUnavailable` (HTTP 503) and
    ``/health`` says why; the process stays up so the evidence can be read, and a restart recovers.
    An exception outside ``engine.step()`` (a bug in the worker or a feeder) is treated the same
    way as an inconsistent engine: everything open finishes with ``error`` and the worker turns
    unhealthy instead of dying silently.

Shutdown
    ``close()`` is idempotent: the owner stops at the next boundary, finishes every queued and
    admitted request with ``cancelled``/``cause=shutdown`` (aborting them frees their blocks),
    closes the engine and exits. The join is bounded by ``timeout``; if the owner is stuck inside a
    step, the remaining handles are finished with ``error`` from the closing thread.

Test hooks: ``pause()``/``resume()`` hold the owner at a step boundary (so a test can fill the queue
deterministically), ``inject_fault(at_step)`` raises inside ``engine.step()`` just before the forward (a step hook),
``set_feeder(fn)`` calls ``fn(round)`` on the owner before each admission (round-mode replay).

Why one long file: everything here runs on, or hands work to, the one owner thread, and the contract
above is only checkable with admission, stepping, delivery and shutdown side by side. It shrinks once
the engine offers the stats, invariant check and step hooks the worker now reads from its internals.
"""
from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import secrets
import threading
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from engine import RequestError, SamplingParams
from engine.observe import StepHooks
from labkit.errors import UserError
from labkit.service.events import Sink, make_event, now_ns, sink_many
from labkit.service.metrics import ServiceStats
from labkit.service.protocol import REQUEST_ID_RE, RESERVED_FIELDS
from labkit.service.stream import RequestHandle, wake_all


class WorkerUnavailable(RuntimeError):
    """The worker is not accepting work (starting, unhealthy or shut down); HTTP 503."""


class DuplicateRequest(ValueError):
    """A live request already has this request_id."""


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


@dataclass
class WorkerConfig:
    """One worker and its engine. Engine knobs carry the engine's (and vLLM's) names."""
    model: str | None = None
    device: str = "auto"
    attention: str = "auto"
    scheduling_policy: str = "prefill_first"
    max_consecutive_prefill: int | None = None   # None: the policy's own rule
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 8
    max_active: int = 8
    queue_size: int = 64
    max_model_len: int = 1024
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = True
    worker_id: str = "worker-0"
    stream_buffer: int = 512
    num_kvcache_blocks: int | None = None   # None: from the memory budget
    tensor_parallel_size: int = 1           # of this one engine
    dist_init: str | None = None            # tcp://HOST:PORT of its TP group (None: a free port)
    shm_name: str | None = None             # its TP step channel (None: unique per instance)
    load_tokenizer: bool = True             # text prompts and detokenized output need it
    log_steps: bool = True                  # one "step" record per engine step in the log
    max_prompt_bytes: int | None = None     # text prompts longer than this are refused untokenized (None: 32 x max_model_len)
    special_tokens_in_content: bool = False  # True: special-token text inside chat messages becomes control tokens
    overlap: bool = False                   # the engine's overlapped decode (Config.overlap): step k+1 launched
                                            # before step k's tokens are read, so their delivery hides behind it

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_active", "queue_size", "max_model_len",
                     "stream_buffer", "tensor_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.max_prompt_bytes is None:
            self.max_prompt_bytes = max(16 * 1024, 32 * self.max_model_len)
        if not isinstance(self.max_prompt_bytes, int) or isinstance(self.max_prompt_bytes, bool) \
                or self.max_prompt_bytes < 1:
            raise UserError(f"max-prompt-bytes must be a positive integer, got {self.max_prompt_bytes!r}")
        if not REQUEST_ID_RE.fullmatch(self.worker_id):
            raise UserError(f"worker id must match {REQUEST_ID_RE.pattern}, got {self.worker_id!r}")


def checked_submission(worker, prompt, params: SamplingParams | None, request_id, tags: dict | None,
                       fill_context: bool) -> tuple[list[int], SamplingParams, dict]:
    """What submit() checks before it takes the lock, for a Worker and for the engine-process front end
    alike: accepting, the request id's form, the prompt's tokens, the engine's one admission rule (it reads
    the config and the pool size, both fixed after start), the tags. Returns (token ids, params, tags)."""
    if not worker.accepting:
        raise WorkerUnavailable(worker._unavailable_reason())
    params = params or SamplingParams()
    if request_id is not None and not REQUEST_ID_RE.fullmatch(str(request_id)):
        raise RequestError(f"request_id must match {REQUEST_ID_RE.pattern}, got {request_id!r}", "invalid_request_id")
    token_ids = worker.encode(prompt)
    if fill_context:
        params = dataclasses.replace(params, max_tokens=max(1, worker.engine.config.max_model_len - len(token_ids)))
    worker.engine.validate(token_ids, params)
    tags = dict(tags or {})
    clash = sorted(set(tags) & RESERVED_FIELDS)
    if clash:
        raise RequestError(f"tags may not use the reserved field name(s) {', '.join(clash)}", "invalid_tags")
    return token_ids, params, tags


@dataclass
class _Request:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    handle: RequestHandle
    tags: dict
    submitted_ns: int
    seq: Any = None
    num_tokens: int = 0
    last_token_ns: int = 0
    stop_ids: frozenset = frozenset()
    prefill_after: str | None = None      # n > 1: the sibling request whose prompt KV this one reuses


def _device_fields(out) -> dict:
    """The step's span on the GPU (CUDA; engine/device_clock.py), for the step record."""
    span = getattr(out, "device_span", None)
    return {} if span is None else {"gpu_start_ns": span[0], "gpu_end_ns": span[1]}


def _lp_entry(rec) -> list:
    """A TokenLogprob as event JSON: [token id, log-prob, rank, [[id, log-prob], ...]]."""
    return [rec.token_id, rec.logprob, rec.rank, [[t, v] for t, v in rec.top]]


@dataclass
class _HostTime:
    """The owner's time between one step's end (its tokens in hand) and the next step's start, by part (ns):
    deliver (the step's events built, logged and pushed, finishes), wakes (the readers' wake-ups handed to
    their event loops), publish (the snapshot), boundary (cancels, feeder, admissions); the rest of the gap
    (the owner's lock, owner calls, waiting for the GIL between stamps) is ``other`` in the step record."""
    end_ns: int = 0            # when the last step's tokens were in hand (its record's t_ns); 0: no step yet
    deliver: int = 0
    wakes: int = 0
    publish: int = 0
    boundary: int = 0

    def record(self, start_ns: int) -> dict:
        """The parts of the gap that ended at ``start_ns`` (µs), for the step that starts then."""
        if not self.end_ns:
            return {}
        gap = start_ns - self.end_ns
        parts = {"deliver": self.deliver, "wakes": self.wakes, "publish": self.publish, "boundary": self.boundary}
        parts["other"] = gap - sum(parts.values())
        return {k + "_us": round(v / 1e3, 1) for k, v in parts.items()}

    def restart(self, end_ns: int) -> None:
        self.end_ns, self.deliver, self.wakes, self.publish, self.boundary = end_ns, 0, 0, 0, 0


@dataclass
class _Fault:
    at_step: int
    message: str


@dataclass
class _OwnerCall:
    fn: Callable
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


# --------------------------------------------------------------------------- the worker


class Worker:
    def __init__(self, config: WorkerConfig | None = None, sink: Sink | None = None):
        self.config = config or WorkerConfig()
        self.worker_id = self.config.worker_id
        self.sink = sink
        self.stats = ServiceStats(self.worker_id)
        self.engine = None                      # owned by the owner thread once started
        self.built = None
        self.tokenizer = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._init_error: BaseException | None = None
        self._lock = threading.RLock()             # re-entrant: _finish may run with it held
        self._encode_lock = threading.Lock()        # the engine's tokenizer: one encoding thread at a time
        self._cv = threading.Condition(self._lock)
        self._pending: deque[_Request] = deque()      # submitted, not admitted
        self._live: dict[str, _Request] = {}          # pending + admitted, by request id
        self._active: dict[str, _Request] = {}        # admitted, not finished (owner only)
        self._by_seq: dict[int, _Request] = {}        # owner only
        self._cancels: deque[tuple[str, str, str]] = deque()   # (request id, cause, reason)
        self._calls: deque[_OwnerCall] = deque()
        self._round = 0
        self._stopping = False
        self._closed = False
        self._closed_done = threading.Event()
        self._paused = False
        self._unhealthy: str | None = None
        self._fault: _Fault | None = None
        self._feeder: Callable[[int], None] | None = None
        self._scheduled_ids: set[int] = set()           # seqs in steps scheduled and not yet delivered
        self._range = None                            # profiler range factory (profiling.py)
        self._snapshot: dict = {"state": "starting"}
        self._wakes: list[RequestHandle] | None = None    # owner: handles to wake at the end of a boundary/step
        # owner: where its time went since the last step's end (ns), written into the next step record
        self._host = _HostTime()

    # -- lifecycle ---------------------------------------------------------------------
    def start(self, timeout: float | None = 900.0) -> "Worker":
        """Start the owner thread and wait until the engine is built; re-raise its init error."""
        if self._thread is not None:
            raise RuntimeError("worker already started")
        self._thread = threading.Thread(target=self._run, name=f"labkit-owner-{self.worker_id}", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            self.close(timeout=1.0)
            raise UserError(f"worker {self.worker_id}: engine not ready within {timeout} s")
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

    @property
    def accepting(self) -> bool:
        return self._ready.is_set() and self._init_error is None and not self._closed and self._unhealthy is None

    def state(self) -> str:
        if self._closed:
            return "closed"
        if not self._ready.is_set():
            return "starting"
        return "unhealthy" if self._unhealthy else "ok"

    # -- the public, thread-safe API ---------------------------------------------------------
    def encode(self, prompt) -> list[int]:
        """Token ids of a prompt: text, chat messages (chat template) or token ids."""
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        if self.tokenizer is None:
            raise RequestError("this worker was started without a tokenizer: send token ids")
        limit = self.config.max_prompt_bytes
        if isinstance(prompt, str):
            self._check_size(len(prompt.encode("utf-8", "surrogatepass")), limit, "the prompt")
        elif isinstance(prompt, list):
            self._check_size(sum(len(str(m.get("content", "")).encode("utf-8", "surrogatepass")) for m in prompt),
                             limit, "the messages' content")
        try:
            with self._encode_lock:                 # fast tokenizers are not safe to share between threads
                if isinstance(prompt, list) and not self.config.special_tokens_in_content:
                    return self._encode_chat(prompt, limit)
                return self.engine.encode(prompt)
        except RequestError:
            raise
        except Exception as e:                      # a chat template that cannot render these messages
            raise RequestError(f"cannot encode the prompt: {type(e).__name__}: {' '.join(str(e).split())[:200]}",
                               "invalid_prompt") from None

    @staticmethod
    def _check_size(n: int, limit: int, what: str) -> None:
        if n > limit:
            raise RequestError(f"{what} has {n} bytes; this server tokenizes at most {limit} "
                               f"(--max-prompt-bytes)", "prompt_too_long")

    def _encode_chat(self, messages: list[dict], limit: int) -> list[int]:
        """The chat template's text, tokenized so that only the template's own markers are special tokens.

        The template is rendered once with a unique sentinel around every message's content; the text
        outside the sentinels is tokenized as the template made it (its markers become control tokens),
        the content between them with special tokens split into plain text. When no content spells a
        special token this is exactly the engine's own encoding."""
        tok = self.engine.tokenizer
        specials = [t for t in (getattr(tok, "all_special_tokens", None) or []) if t]
        contents = [str(m.get("content") or "") for m in messages]
        if not any(sp in c for c in contents for sp in specials):
            return self.engine.encode(messages)
        mark = "\u2063" + secrets.token_hex(8)
        wrapped = [{**m, "content": f"{mark}{c}{mark}"} for m, c in zip(messages, contents)]
        text = tok.apply_chat_template(wrapped, tokenize=False, add_generation_prompt=True, enable_thinking=False)
        parts = text.split(mark)
        if len(parts) != 2 * len(messages) + 1:
            raise RequestError("the chat template rewrites message content; cannot keep special tokens in it as text "
                               "(start the server with --special-tokens-in-content)", "invalid_prompt")
        self._check_size(sum(len(p.encode("utf-8")) for p in parts), limit, "the rendered chat")
        ids: list[int] = []
        for i, part in enumerate(parts):
            if not part:
                continue
            if i % 2:          # message content: special-token text stays text
                ids += tok.encode(part, add_special_tokens=False, split_special_tokens=True)
            else:              # the template's own text
                ids += tok.encode(part, add_special_tokens=False)
        return ids

    def submit(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
               tags: dict | None = None, stream: bool = True, stream_buffer: int | None = None, *,
               fill_context: bool = False, stop_token_ids=(), prefill_after: str | None = None) -> RequestHandle:
        """Queue a request; returns its handle at once (``handle.rejected`` when the queue is full).

        ``fill_context``: max_tokens becomes what the context leaves after the prompt (max_model_len -
        prompt tokens; OpenAI's default). ``stop_token_ids``: the request finishes with reason ``stop``
        (cause ``stop_token_id``) at the step that produces one of them; that token is its last.
        ``prefill_after``: the id of a request with the same prompt submitted just before (a sibling of
        ``n > 1``); this one waits for that one's prefill and reuses its full KV blocks (prefix cache).
        Token events carry ``logprob`` (``[id, log-prob, rank, [[id, log-prob], ...]]``) when
        ``params.logprobs`` is set; the first carries ``prompt_logprobs`` when ``params.prompt_logprobs`` is.

        Raises ``engine.RequestError`` for a prompt the engine cannot take, :class:`DuplicateRequest`
        for a live request id, :class:`WorkerUnavailable` when not accepting work.
        """
        token_ids, params, tags = checked_submission(self, prompt, params, request_id, tags, fill_context)
        with self._lock:
            if not self.accepting:
                raise WorkerUnavailable(self._unavailable_reason())
            rid = str(request_id) if request_id is not None else self._new_id()
            if rid in self._live:
                raise DuplicateRequest(f"request_id {rid!r} is already in flight")
            handle = RequestHandle(rid, stream_buffer or self.config.stream_buffer, keep_tokens=stream)
            req = _Request(rid, token_ids, params, handle, tags, now_ns(), stop_ids=frozenset(stop_token_ids),
                           prefill_after=prefill_after)
            ev = make_event("submitted", rid, self.worker_id, self._round, t_ns=req.submitted_ns,
                            prompt_tokens=len(token_ids), max_tokens=params.max_tokens,
                            queue_depth=len(self._pending))
            ev.update(tags)                   # never as keyword arguments: a tag may share a parameter's name
            self._emit(req, ev)
            if len(self._pending) >= self.config.queue_size:
                handle.rejected = True
                self._finish(req, "rejected", message=f"queue full ({self.config.queue_size} requests waiting)")
                return handle
            self._pending.append(req)
            self._live[rid] = req
            self._cv.notify_all()
        return handle

    def _new_id(self) -> str:
        while True:
            rid = f"{self.worker_id}-{secrets.token_hex(8)}"
            if rid not in self._live:
                return rid

    def cancel(self, request_id: str, cause: str = "client", reason: str = "cancelled") -> bool:
        """Ask the owner to cancel at its next step boundary; False if no such live request.

        ``reason="stop"`` (with e.g. ``cause="stop_string"``) ends a request that its reader found complete:
        it finishes ``stop``, not ``cancelled``."""
        if reason not in ("cancelled", "stop"):
            raise ValueError(f"a request can be ended as cancelled or stop, not {reason!r}")
        with self._lock:
            if request_id not in self._live:
                return False
            self._cancels.append((request_id, cause, reason))
            self._cv.notify_all()
        return True

    def run_on_owner(self, fn: Callable[[Any], Any], timeout: float | None = 60.0) -> Any:
        """Run ``fn(engine)`` on the owner thread at a step boundary and return its result."""
        if threading.current_thread() is self._thread:
            return fn(self.engine)
        call = _OwnerCall(fn)
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

    def header(self, **extra) -> dict:
        """The evidence envelope for a JSONL log written from this worker (after start)."""
        from labkit.evidence import envelope

        built = self.built
        env = envelope(kind=built.kind, device=built.device, model=built.model, seed=built.engine.config.seed,
                       engine=built.describe())
        return {**env, "worker": asdict(self.config), **extra}

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
        self._fault = _Fault(at_step if at_step is not None else self._round + 1, message)

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
                try:
                    self.engine.close()
                except Exception:
                    pass
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
        wakes = self._wakes
        if wakes:
            self._wakes = []
            wake_all(dict.fromkeys(wakes))     # each handle once, in order

    def _wake(self, handle: RequestHandle) -> None:
        """Wake a handle's readers now, or with the step's batch when the owner is collecting one."""
        if self._wakes is not None and threading.current_thread() is self._thread:
            self._wakes.append(handle)
        else:
            handle._wake()

    def _build(self) -> None:
        from labkit.lab_engine import build_engine

        cfg = self.config
        overrides = dict(max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs,
                         max_model_len=cfg.max_model_len, scheduling_policy=cfg.scheduling_policy,
                         gpu_memory_utilization=cfg.gpu_memory_utilization, enforce_eager=cfg.enforce_eager)
        if cfg.num_kvcache_blocks:
            overrides["num_kvcache_blocks"] = cfg.num_kvcache_blocks
        if cfg.max_consecutive_prefill is not None:
            overrides["max_consecutive_prefill"] = cfg.max_consecutive_prefill
        overrides["tensor_parallel_size"] = cfg.tensor_parallel_size
        if cfg.overlap:
            overrides["overlap"] = True
        for name in ("dist_init", "shm_name"):
            if getattr(cfg, name):
                overrides[name] = getattr(cfg, name)
        self.built = build_engine(cfg.model, cfg.device, cfg.attention, **overrides)
        self.engine = self.built.engine
        if cfg.load_tokenizer:
            # the HTTP front decodes on its event loop: its own copy, never the one submit() encodes with
            self.tokenizer = copy.deepcopy(self.engine.tokenizer)
        self.engine.add_hooks(_WorkerHooks(self))

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
        for rid, cause, reason in cancels:
            self._cancel_now(rid, cause, reason)
        feeder = self._feeder
        if feeder is not None:
            feeder(self._round)
        while True:
            with self._lock:
                if not self._pending or len(self._active) >= self.config.max_active:
                    return
                req = self._pending.popleft()
            self._admit(req)

    def _admit(self, req: _Request) -> None:
        try:
            lead = self._active.get(req.prefill_after) if req.prefill_after else None
            req.seq = self.engine.add_request(req.token_ids, req.params, validated=True,   # checked at submit
                                              prefill_after=lead.seq if lead is not None else None)
        except RequestError as e:
            self._finish(req, "rejected", message=str(e))
            return
        self._active[req.request_id] = req
        self._by_seq[req.seq.seq_id] = req
        self.stats.count_prompt(len(req.token_ids))
        with self._lock:
            queue = len(self._pending)
        self._emit(req, make_event("admitted", req.request_id, self.worker_id, self._round,
                                   active_before=len(self._active) - 1, active=len(self._active),
                                   queue_depth=queue, seq_id=req.seq.seq_id))
        self._wake(req.handle)

    def _cancel_now(self, rid: str, cause: str, reason: str = "cancelled") -> None:
        with self._lock:
            req = self._live.get(rid)
            if req is None:
                return
            if req in self._pending:
                self._pending.remove(req)
        freed: list[int] = []
        if req.seq is not None:
            freed = self.engine.abort(req.seq, reason)
        self._finish(req, reason, cause=cause, freed_blocks=len(freed))

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
        t = now_ns()
        phase = "prefill" if out.is_prefill else "decode"
        self.stats.count_step(phase, out.seconds)
        before = self._host.record(t0)          # the owner's time since the previous step ended
        self._host.restart(t)
        if self.config.log_steps and self.sink is not None:
            self.sink(make_event(
                "step", None, self.worker_id, out.step, t_ns=t, phase=phase, num_seqs=len(out.seqs),
                num_tokens=out.num_tokens, seconds=round(out.seconds, 6), start_ns=t0,
                wait_s=round(getattr(out, "wait_s", 0.0), 6), before=before,
                batch=[[self._rid_of(sid), n] for sid, n in out.scheduled],
                chunks=[self._rid_of(sid) for sid in out.outcome.discarded],
                free_blocks=self.engine.stats().free_blocks, **_device_fields(out)))
        slow: list[_Request] = []
        stopped: list[_Request] = []
        ttfts: list[float] = []
        itls: list[float] = []
        logged: list[dict] = []             # the step's token events, to the log in one hand-off
        wid, step = self.worker_id, out.step
        for seq_id, token_id in out.outcome.accepted.items():
            req = self._by_seq.get(seq_id)
            if req is None:
                continue
            req.num_tokens += 1
            # make_event's fields in its order, as a literal (one per token: the hot path)
            ev = {"event": "token", "request_id": req.request_id, "worker_id": wid, "round": step, "t_ns": t,
                  "observer": "engine", "index": req.num_tokens, "token_id": token_id}
            rec = out.logprobs.get(seq_id)
            if rec is not None:
                ev["logprob"] = _lp_entry(rec)
            if req.num_tokens == 1 and req.seq.prompt_logprobs is not None:
                ev["prompt_logprobs"] = [None if r is None else _lp_entry(r) for r in req.seq.prompt_logprobs]
            if req.num_tokens == 1:
                ttfts.append((t - req.submitted_ns) / 1e9)
            else:
                itls.append((t - req.last_token_ns) / 1e9)
            req.last_token_ns = t
            logged.append(ev)
            if req.handle.keep_tokens and not req.handle._push(ev):
                slow.append(req)
            elif token_id in req.stop_ids:
                stopped.append(req)
        self.stats.count_tokens(ttfts, itls)     # the step's metrics in one go, not a lock per token
        sink_many(self.sink, logged)
        for seq in out.outcome.finished:
            req = self._by_seq.get(seq.seq_id)
            if req is not None:
                by_id = seq.finish_reason == "stop" and seq.token_ids[-1] in req.stop_ids
                self._finish(req, seq.finish_reason, cause="stop_token_id" if by_id else None)
        for req in stopped:
            if req.request_id in self._active:
                freed = self.engine.abort(req.seq, "stop")
                self._finish(req, "stop", cause="stop_token_id", freed_blocks=len(freed))
        for req in slow:
            if req.request_id in self._active:
                freed = self.engine.abort(req.seq, "cancelled")
                self._finish(req, "cancelled", cause="slow_consumer", freed_blocks=len(freed),
                             message=f"more than {req.handle.limit} events unread")
        wakes = self._wakes if self._wakes is not None else []
        for seq_id in out.outcome.accepted:
            req = self._by_seq.get(seq_id)
            if req is not None:
                wakes.append(req.handle)
        if self._wakes is None:
            wake_all(dict.fromkeys(wakes))

    def _rid_of(self, seq_id: int) -> str | None:
        req = self._by_seq.get(seq_id)
        return req.request_id if req else None

    def _finish(self, req: _Request, reason: str, cause: str | None = None, message: str | None = None,
                freed_blocks: int | None = None) -> None:
        """The one place a request ends: finished event, handle closed, bookkeeping, metrics."""
        if req.handle.finished:
            return
        fields: dict[str, Any] = {"reason": reason}
        if cause is not None:
            fields["cause"] = cause
        if message is not None:
            fields["message"] = message
        fields.update(num_prompt_tokens=len(req.token_ids), num_completion_tokens=req.num_tokens,
                      admitted=req.seq is not None)
        if freed_blocks is not None:
            fields["freed_blocks"] = freed_blocks
        ev = make_event("finished", req.request_id, self.worker_id, self._round, **fields)
        self._active.pop(req.request_id, None)
        if req.seq is not None:
            self._by_seq.pop(req.seq.seq_id, None)
        with self._lock:
            if self._live.get(req.request_id) is req:
                del self._live[req.request_id]
        self.stats.count_finished(reason, (now_ns() - req.submitted_ns) / 1e9 if req.seq is not None else None)
        if self.sink is not None:
            self.sink(ev)
        req.handle._finish(ev, wake=False)
        self._wake(req.handle)

    def _emit(self, req: _Request, ev: dict) -> None:
        if self.sink is not None:
            self.sink(ev)
        if req.handle.keep_tokens or ev["event"] != "token":
            req.handle._push(ev)

    # -- failures ----------------------------------------------------------------------------
    def _on_engine_error(self, exc: BaseException) -> None:
        message = " ".join(f"{type(exc).__name__}: {exc}".split())
        if self._scheduled_ids:
            affected = [self._by_seq[sid] for sid in sorted(self._scheduled_ids) if sid in self._by_seq]
        else:
            affected = list(self._active.values())
        self._scheduled_ids.clear()
        self.stats.count_engine_error()
        for req in affected:
            freed: list[int] = []
            try:
                freed = self.engine.abort(req.seq, "error")
            except Exception:
                pass
            self._finish(req, "error", message=message, freed_blocks=len(freed))
        ok, why = self._consistent()
        if self.sink is not None:
            self.sink(make_event("worker", None, self.worker_id, self._round, what="engine_error", message=message,
                                 affected=[r.request_id for r in affected], consistent=ok, why=why))
        if not ok:
            self._unhealthy = f"engine inconsistent after {message}: {why}"
            for req in list(self._live.values()):
                with self._lock:
                    if req in self._pending:
                        self._pending.remove(req)
                if req.seq is not None:
                    try:
                        self.engine.abort(req.seq, "error")
                    except Exception:
                        pass
                self._finish(req, "error", message=self._unhealthy)

    def _internal_error(self, exc: BaseException) -> None:
        message = " ".join(f"{type(exc).__name__}: {exc}".split())
        self._unhealthy = f"internal error in the owner loop: {message}"
        with self._lock:
            self._pending.clear()
            self._feeder = None
        for req in list(self._live.values()):
            if req.seq is not None:
                try:
                    self.engine.abort(req.seq, "error")
                except Exception:
                    pass
            try:
                self._finish(req, "error", message=self._unhealthy)
            except Exception:
                req.handle._finish({"event": "finished", "request_id": req.request_id, "reason": "error",
                                    "message": self._unhealthy})
        with self._lock:
            self._live.clear()
        self._active.clear()
        self._by_seq.clear()

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
            for req in list(self._live.values()):
                with self._lock:
                    if req in self._pending:
                        self._pending.remove(req)
                freed: list[int] = []
                if req.seq is not None:
                    try:
                        freed = self.engine.abort(req.seq, "cancelled")
                    except Exception:
                        pass
                self._finish(req, "cancelled", cause="shutdown", freed_blocks=len(freed))
            self._publish()
            if self.sink is not None:
                self.sink(make_event("worker", None, self.worker_id, self._round, what="closed",
                                     free_blocks=self._snapshot.get("kv_blocks_free"),
                                     total_blocks=self._snapshot.get("kv_blocks_total")))
        finally:
            with self._lock:
                calls, self._calls = list(self._calls), deque()
            for call in calls:
                call.future.cancel()
            if self.engine is not None:
                self.engine.close()

    def _publish(self, state: str | None = None) -> None:
        """Copy the owner's numbers into a snapshot any thread may read."""
        snap: dict[str, Any] = {"worker_id": self.worker_id, "round": self._round}
        engine = self.engine
        if engine is not None and threading.current_thread() is self._thread:
            st = engine.stats()
            snap.update(engine_waiting=st.waiting, engine_running=st.running, kv_blocks_total=st.num_blocks,
                        kv_blocks_free=st.free_blocks, kv_blocks_used=st.num_blocks - st.free_blocks)
        with self._lock:
            snap.update(queue_depth=len(self._pending), active=len(self._active))
            merged = {**self._snapshot, **snap}
            if state is not None:
                merged["state"] = state
            self._snapshot = merged

    def gauges(self) -> dict[str, float]:
        s = self.snapshot()
        return {
            "labkit_num_requests_waiting": s.get("queue_depth", 0),
            "labkit_num_requests_running": s.get("active", 0),
            "labkit_engine_waiting": s.get("engine_waiting", 0),
            "labkit_engine_running": s.get("engine_running", 0),
            "labkit_kv_blocks_total": s.get("kv_blocks_total", 0),
            "labkit_kv_blocks_used": s.get("kv_blocks_used", 0),
            "labkit_kv_blocks_free": s.get("kv_blocks_free", 0),
            "labkit_round": s.get("round", 0),
            "labkit_healthy": 1 if s["state"] == "ok" else 0,
        }
