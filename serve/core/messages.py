"""What crosses the process boundary of ``serve --engine-process``, one record per kind of message (mini-sglang's
typed backend messages; vLLM's ``EngineCoreRequest``/``EngineCoreOutputs``). Plain dataclasses: the pipes pickle
them as they are.

The parent (:mod:`serve.core.proc_client`) sends commands; the engine process (:mod:`serve.core.proc_main`)
answers with its start (:class:`Ready` or :class:`InitError`), the owner's outputs per step (:class:`Outputs`),
replies to calls (:class:`Reply`) and its end (:class:`Closed`).

The owner's outputs (:class:`Submitted`, :class:`Admitted`, :class:`Tokens`, :class:`Finished`, :class:`StepDone`,
:class:`WorkerNote`) are what :class:`serve.core.output.OutputProcessor` turns into stream events, metrics and log
lines: behind the owner thread in one process, behind the pipe with an engine process; the same records either way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine import SamplingParams


# --------------------------------------------------------------------------- parent -> engine process


@dataclass
class Submit:
    """A request the parent has checked, encoded and accepted: the engine process queues it as it is."""
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    prefill_after: str | None = None
    group: str | None = None


@dataclass
class Cancel:
    request_id: str
    cause: str
    reason: str
    message: str | None = None


@dataclass
class Call:
    """Run one of the Worker's methods named in ``proc_main.CHILD_CALLS``; the answer is a :class:`Reply`."""
    call_id: int
    name: str
    args: tuple


@dataclass
class Close:
    timeout: float


@dataclass
class Commands:
    """Several commands in one message, in the order they were given (the parent's sender thread sends what was
    queued while it sent the last message: a burst of submissions crosses the pipe in a few writes, not one each)."""
    messages: list


# --------------------------------------------------------------------------- engine process -> parent


@dataclass
class Ready:
    """The Worker is built: the served engine's record and the owner's first snapshot."""
    served: Any                      # front.ServedEngine
    snapshot: dict


@dataclass
class InitError:
    error: BaseException


@dataclass
class Outputs:
    """The owner's outputs of one step or boundary (or one made outside the owner thread), and its snapshot after
    a loop round."""
    outputs: list
    snapshot: dict | None = None


@dataclass
class Reply:
    call_id: int
    ok: bool
    value: Any                       # the call's result, or the exception it raised


@dataclass
class Closed:
    pass


# --------------------------------------------------------------------------- the owner's outputs


@dataclass
class Submitted:
    """A request the front accepted (its stamp starts TTFT and the end-to-end latency)."""
    request_id: str
    step: int
    t_ns: int
    prompt_tokens: int
    max_tokens: int
    queue_depth: int
    tags: dict


@dataclass
class Admitted:
    request_id: str
    step: int
    t_ns: int
    active_before: int
    active: int
    queue_depth: int
    seq_id: int


@dataclass
class Tokens:
    """One step's accepted tokens, a column per field (one record per step, not per token: the hot path).
    ``logprobs`` and ``prompt_logprobs`` map a row to its entry (``[id, log-prob, rank, [[id, log-prob], ...]]``,
    or the prompt's list of them) for the requests that asked."""
    step: int
    t_ns: int
    request_ids: list[str]
    token_ids: list[int]
    logprobs: dict[int, list]
    prompt_logprobs: dict[int, list]


@dataclass
class Finished:
    """A request's end: ``reason`` (:data:`serve.observe.events.FINISH_REASONS`), its cause and message."""
    request_id: str
    step: int
    t_ns: int
    reason: str
    cause: str | None = None
    message: str | None = None
    admitted: bool = False
    num_cached_tokens: int | None = None     # prompt tokens the prefix cache gave
    freed_blocks: int | None = None


@dataclass
class StepDone:
    """An engine step: its phase and seconds (metrics) and, with ``log_steps``, its log record; a step that
    prefilled also names the requests it scheduled and when it began (vLLM's queue and prefill phases)."""
    phase: str
    seconds: float
    record: dict | None = None
    start_ns: int = 0
    request_ids: tuple = ()


@dataclass
class WorkerNote:
    """A worker event for the log (``what``: engine_error, closed) with its fields."""
    what: str
    step: int
    fields: dict
