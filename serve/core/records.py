"""The owner thread's records (:mod:`serve.core.worker` runs the thread): a request as the owner holds it,
the host time between steps by part, owner calls, injected faults, the hooks where its outputs may go instead
(the engine process's pipe), and the log fields made from a step's output.
"""
from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import Any, Callable

from engine import SamplingParams
from serve.core.messages import Tokens
from serve.observe.events import make_event


@dataclass
class OwnerHooks:
    """Where the owner's outputs go instead of this process's output processor, called on the owner thread:
    ``outputs(batch)`` once per step and once per boundary (a list of :mod:`serve.core.messages` outputs),
    ``published(snapshot)`` after each snapshot and once more when the owner has shut down (the engine process
    sends both to the parent there)."""
    outputs: Callable[[list], None] | None = None
    published: Callable[[dict], None] | None = None


@dataclass
class OwnedRequest:
    """A request as the owner thread holds it: its checked tokens and params, its sequence (its stream and counts
    are the output side's: :class:`serve.core.output.RequestState`)."""
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    seq: Any = None
    prefill_after: str | None = None      # n > 1: the sibling request whose prompt KV this one reuses
    group: str = ""                       # the HTTP request it belongs to (serve.core.fair); "": its own id
    started: bool = False                 # its first token went out (prompt log-probs go with it)
    done: bool = False                    # its Finished went out

    def __post_init__(self) -> None:
        self.group = self.group or self.request_id


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
        free_blocks=free_blocks, ahead=bool(getattr(out, "ahead", False)), **device_fields(out))


def step_tokens(out, by_seq: dict[int, OwnedRequest], t: int) -> Tokens:
    """The accepted tokens of a step's output as one :class:`Tokens` record (the hot path: a column per field)."""
    rids: list[str] = []
    toks: list[int] = []
    logprobs: dict[int, list] = {}
    prompt_logprobs: dict[int, list] = {}
    lps, get = out.logprobs, by_seq.get
    for seq_id, token_id in out.outcome.accepted.items():
        req = get(seq_id)
        if req is None:
            continue
        if lps or not req.started:        # the rare fields: log-probs, and the prompt's with the first token
            row = len(rids)
            rec = lps.get(seq_id) if lps else None
            if rec is not None:
                logprobs[row] = lp_entry(rec)
            if not req.started:
                req.started = True
                if req.seq.prompt_logprobs is not None:
                    prompt_logprobs[row] = [None if r is None else lp_entry(r) for r in req.seq.prompt_logprobs]
        rids.append(req.request_id)
        toks.append(token_id)
    return Tokens(out.step, t, rids, toks, logprobs, prompt_logprobs)
