"""The output processor: the owner's typed outputs (:mod:`serve.core.messages`) turned into stream events, metrics
and log lines, for both worker kinds (vLLM's ``OutputProcessor`` over ``EngineCoreOutputs``, whether the core runs
in process or not).

The in-process :class:`serve.core.worker.Worker` hands its owner's outputs here once per step and once per
boundary; with an engine process the outputs cross the pipe as they are and the parent's
:class:`serve.core.proc_client.RemoteWorker` hands each message here. So one place keeps a request's stream, counts
its tokens, measures TTFT (submitted to first token) and ITL from the stamps the owner made, counts its finish
and writes its log lines; the engine process counts nothing.

A stream that holds more than its limit of unread events after a token is a slow consumer: :meth:`process`
returns a :class:`Cancel` for it, which the worker kind hands to its owner.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from serve.core.messages import Admitted, Cancel, Finished, StepDone, Submitted, Tokens, WorkerNote
from serve.core.stream import RequestHandle, wake_all
from serve.observe.events import Sink, make_event, sink_many
from serve.observe.metrics import RequestTimes, ServiceStats


@dataclass
class RequestState:
    """A request as the output side holds it: its stream and what its outputs counted so far."""
    handle: RequestHandle
    prompt_tokens: int
    submitted_ns: int
    group: str = ""
    last_token_ns: int = 0
    num_tokens: int = 0
    admitted: bool = False
    slow: bool = False
    max_tokens: int = 0
    n: int = 0                      # the request's n if it is its first sample, else 0 (counted once)
    scheduled_ns: int = 0           # the start of the first step that scheduled it (vLLM's phase metrics)
    first_token_ns: int = 0


class OutputProcessor:
    """Streams, metrics and log lines from the owner's outputs; see the module docstring."""

    def __init__(self, worker_id: str, stats: ServiceStats, sink: Sink | None, log_steps: bool = True):
        self.worker_id = worker_id
        self.stats = stats
        self.sink = sink
        self.log_steps = log_steps
        self.requests: dict[str, RequestState] = {}     # open requests by id (submitted, not finished)

    def add(self, handle: RequestHandle, prompt_tokens: int, submitted_ns: int, group: str, max_tokens: int = 0,
            n: int = 0) -> RequestState:
        state = RequestState(handle, prompt_tokens, submitted_ns, group, max_tokens=max_tokens, n=n)
        self.requests[handle.request_id] = state
        return state

    def process(self, outputs: list, wakes: list[RequestHandle] | None = None) -> list[Cancel]:
        """Hand each output to its stream, the metrics and the log. The handles to wake go to ``wakes`` (the
        owner wakes a step's readers in one hand-off), or are woken here. Returns the cancels of slow consumers."""
        own_wakes = wakes is None
        wakes = [] if own_wakes else wakes
        cancels: list[Cancel] = []
        for out in outputs:
            kind = type(out)
            if kind is Tokens:
                self._tokens(out, wakes, cancels)
            elif kind is Finished:
                self._finished(out, wakes)
            elif kind is StepDone:
                self.stats.count_step(out.phase, out.seconds)
                for rid in out.request_ids:
                    state = self.requests.get(rid)
                    if state is not None and not state.scheduled_ns:
                        state.scheduled_ns = out.start_ns
                if out.record is not None and self.log_steps and self.sink is not None:
                    self.sink(out.record)
            elif kind is Admitted:
                self._admitted(out, wakes)
            elif kind is Submitted:
                self._submitted(out, wakes)
            elif kind is WorkerNote:
                if out.what == "engine_error":
                    self.stats.count_engine_error()
                if self.sink is not None:
                    self.sink(make_event("worker", None, self.worker_id, out.step, what=out.what, **out.fields))
            else:
                raise TypeError(f"not an owner output: {out!r}")
        if own_wakes:
            wake_all(dict.fromkeys(wakes))
        return cancels

    def _event(self, state: RequestState | None, ev: dict, wakes: list) -> None:
        if self.sink is not None:
            self.sink(ev)
        if state is not None:
            state.handle._push(ev)
            wakes.append(state.handle)

    def _submitted(self, out: Submitted, wakes: list) -> None:
        ev = make_event("submitted", out.request_id, self.worker_id, out.step, t_ns=out.t_ns,
                        prompt_tokens=out.prompt_tokens, max_tokens=out.max_tokens, queue_depth=out.queue_depth)
        ev.update(out.tags)               # never as keyword arguments: a tag may share a parameter's name
        self._event(self.requests.get(out.request_id), ev, wakes)

    def _admitted(self, out: Admitted, wakes: list) -> None:
        state = self.requests.get(out.request_id)
        if state is not None:
            state.admitted = True
            self.stats.count_prompt(state.prompt_tokens)
        self._event(state, make_event("admitted", out.request_id, self.worker_id, out.step, t_ns=out.t_ns,
                                      active_before=out.active_before, active=out.active,
                                      queue_depth=out.queue_depth, seq_id=out.seq_id), wakes)

    def _tokens(self, out: Tokens, wakes: list, cancels: list) -> None:
        requests, wid, step, t = self.requests, self.worker_id, out.step, out.t_ns
        logprobs, prompt_logprobs = out.logprobs, out.prompt_logprobs
        rare = bool(logprobs or prompt_logprobs)
        ttfts: list[float] = []
        itls: list[float] = []
        logged: list[dict] = []
        first_prompt_tokens = 0
        for row, rid in enumerate(out.request_ids):
            state = requests.get(rid)
            if state is None:
                continue
            n = state.num_tokens = state.num_tokens + 1
            # make_event's fields in its order, as a literal (one per token: the hot path)
            ev = {"event": "token", "request_id": rid, "worker_id": wid, "round": step, "t_ns": t,
                  "observer": "engine", "index": n, "token_id": out.token_ids[row]}
            if rare:
                if row in logprobs:
                    ev["logprob"] = logprobs[row]
                if row in prompt_logprobs:
                    ev["prompt_logprobs"] = prompt_logprobs[row]
            if n == 1:
                ttfts.append((t - state.submitted_ns) / 1e9)
                state.first_token_ns = t
                first_prompt_tokens += state.prompt_tokens
            else:
                itls.append((t - state.last_token_ns) / 1e9)
            state.last_token_ns = t
            logged.append(ev)
            handle = state.handle
            if handle.keep_tokens and not handle._push(ev) and not state.slow:
                state.slow = True
                cancels.append(Cancel(rid, "slow_consumer", "cancelled", f"more than {handle.limit} events unread"))
            wakes.append(handle)
        self.stats.count_tokens(ttfts, itls, first_prompt_tokens)     # the step's metrics in one go
        sink_many(self.sink, logged)

    def _finished(self, out: Finished, wakes: list) -> None:
        state = self.requests.pop(out.request_id, None)
        if state is None:                 # finished already
            return
        fields: dict[str, Any] = {"reason": out.reason}
        if out.cause is not None:
            fields["cause"] = out.cause
        if out.message is not None:
            fields["message"] = out.message
        fields.update(num_prompt_tokens=state.prompt_tokens, num_completion_tokens=state.num_tokens,
                      admitted=out.admitted)
        if out.num_cached_tokens is not None:
            fields["num_cached_tokens"] = out.num_cached_tokens
        if out.freed_blocks is not None:
            fields["freed_blocks"] = out.freed_blocks
        ev = make_event("finished", out.request_id, self.worker_id, out.step, t_ns=out.t_ns, **fields)
        self.stats.count_finished(out.reason, (out.t_ns - state.submitted_ns) / 1e9 if out.admitted else None,
                                  state.prompt_tokens, state.num_tokens,
                                  times=RequestTimes(state.submitted_ns, state.scheduled_ns, state.first_token_ns,
                                                     state.last_token_ns, out.t_ns),
                                  max_tokens=state.max_tokens, n=state.n)
        if self.sink is not None:
            self.sink(ev)
        state.handle._finish(ev, wake=False)
        wakes.append(state.handle)

    def abandon(self, request_id: str, message: str) -> None:
        """Close a request's stream with a bare error event, counting nothing (when processing itself failed)."""
        state = self.requests.pop(request_id, None)
        if state is not None and not state.handle.finished:
            state.handle._finish({"event": "finished", "request_id": request_id, "reason": "error",
                                  "message": message})
