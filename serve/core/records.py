"""The owner thread's records (:mod:`serve.core.worker` runs the thread): a request as the owner holds it,
the host time between steps by part, owner calls, injected faults, the hooks where its output may also go
(the engine process's pipe), and the event fields made from a step's output.
"""
from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import Any, Callable

from engine import SamplingParams
from serve.observe.events import make_event
from serve.observe.metrics import RequestTimes
from serve.core.stream import RequestHandle


@dataclass
class OwnerHooks:
    """Where the owner's output may also go, called on the owner thread: ``flushed()`` after each hand-off of
    wake-ups (once per step and once per boundary), ``published(snapshot)`` after each snapshot and once more
    when the owner has shut down (the engine process sends its events and snapshots to the parent there)."""
    flushed: Callable[[], None] | None = None
    published: Callable[[dict], None] | None = None


@dataclass
class OwnedRequest:
    """A request as the owner thread holds it: its checked tokens and params, its stream, its sequence."""
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    handle: RequestHandle
    tags: dict
    submitted_ns: int
    seq: Any = None
    num_tokens: int = 0
    last_token_ns: int = 0
    scheduled_ns: int = 0                 # the start of the first step that scheduled it (vLLM's phase metrics)
    first_token_ns: int = 0
    prefill_after: str | None = None      # n > 1: the sibling request whose prompt KV this one reuses
    group: str = ""                       # the HTTP request it belongs to (serve.core.fair); "": its own id

    def __post_init__(self) -> None:
        self.group = self.group or self.request_id

    def counts(self) -> tuple[int, int]:
        """(prompt tokens, output tokens so far): what the metrics count at its finish."""
        return len(self.token_ids), self.num_tokens

    def times(self, finished_ns: int) -> RequestTimes:
        return RequestTimes(self.submitted_ns, self.scheduled_ns, self.first_token_ns, self.last_token_ns, finished_ns)


def device_fields(out) -> dict:
    """The step's span on the GPU (CUDA; engine/device_clock.py), for the step record."""
    span = getattr(out, "device_span", None)
    return {} if span is None else {"gpu_start_ns": span[0], "gpu_end_ns": span[1]}


def lp_entry(rec) -> list:
    """A TokenLogprob as event JSON: [token id, log-prob, rank, [[id, log-prob], ...]]."""
    return [rec.token_id, rec.logprob, rec.rank, [[t, v] for t, v in rec.top]]


@dataclass
class HostTime:
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
class Fault:
    """An injected fault: raised inside engine.step() from step ``at_step`` on (``Worker.inject_fault``)."""
    at_step: int
    message: str


@dataclass
class OwnerCall:
    """``fn(engine)`` to run on the owner at a step boundary, and where its result goes."""
    fn: Callable
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


def step_record(out, worker_id: str, t0: int, t: int, before: dict, rid_of: Callable[[int], str | None],
                free_blocks: int) -> dict:
    """A step's record for the event log: phase, batch (request ids and tokens), the chunks it discarded,
    its times (``before``: the owner's time since the previous step ended, by part)."""
    return make_event(
        "step", None, worker_id, out.step, t_ns=t, phase=out.kind,
        num_seqs=len(out.seqs), num_tokens=out.num_tokens, seconds=round(out.seconds, 6), start_ns=t0,
        wait_s=round(getattr(out, "wait_s", 0.0), 6), before=before,
        batch=[[rid_of(sid), n] for sid, n in out.scheduled], chunks=[rid_of(sid) for sid in out.outcome.discarded],
        free_blocks=free_blocks, **device_fields(out))


@dataclass
class StepTokens:
    """What a step's tokens made: their events (to the log in one hand-off), TTFTs and ITLs (s), the prompt
    tokens of the requests it gave a first token, and the requests whose stream now holds more than its limit
    (slow consumers)."""
    logged: list[dict]
    ttfts: list[float]
    itls: list[float]
    slow: list[OwnedRequest]
    first_prompt_tokens: int = 0


def deliver_tokens(out, by_seq: dict[int, OwnedRequest], worker_id: str, t: int) -> StepTokens:
    """Each accepted token of ``out`` as a token event pushed to its request's stream (the hot path)."""
    slow: list[OwnedRequest] = []
    ttfts: list[float] = []
    itls: list[float] = []
    logged: list[dict] = []
    first_prompt_tokens = 0
    wid, step = worker_id, out.step
    for seq_id, token_id in out.outcome.accepted.items():
        req = by_seq.get(seq_id)
        if req is None:
            continue
        req.num_tokens += 1
        # make_event's fields in its order, as a literal (one per token: the hot path)
        ev = {"event": "token", "request_id": req.request_id, "worker_id": wid, "round": step, "t_ns": t,
              "observer": "engine", "index": req.num_tokens, "token_id": token_id}
        rec = out.logprobs.get(seq_id)
        if rec is not None:
            ev["logprob"] = lp_entry(rec)
        if req.num_tokens == 1 and req.seq.prompt_logprobs is not None:
            ev["prompt_logprobs"] = [None if r is None else lp_entry(r) for r in req.seq.prompt_logprobs]
        if req.num_tokens == 1:
            ttfts.append((t - req.submitted_ns) / 1e9)
            req.first_token_ns = t
            first_prompt_tokens += len(req.token_ids)
        else:
            itls.append((t - req.last_token_ns) / 1e9)
        req.last_token_ns = t
        logged.append(ev)
        if req.handle.keep_tokens and not req.handle._push(ev):
            slow.append(req)
    return StepTokens(logged, ttfts, itls, slow, first_prompt_tokens)
