"""What crosses the process boundary of ``serve --engine-process``, one record per kind of message (mini-sglang's
typed backend messages; vLLM's ``EngineCoreRequest``/``EngineCoreOutputs``). Plain dataclasses: the pipes pickle
them as they are.

The parent (:mod:`serve.core.proc_client`) sends commands; the engine process (:mod:`serve.core.proc_main`)
answers with its start (:class:`Ready` or :class:`InitError`), the owner's events per step (:class:`Events`),
replies to calls (:class:`Reply`) and its end (:class:`Closed`). Events stay the log's records (dicts), as the
event log and the streams read them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine import SamplingParams


# --------------------------------------------------------------------------- parent -> engine process


@dataclass
class Submit:
    """A request the parent has checked and encoded: the engine process queues it as it is."""
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    tags: dict
    prefill_after: str | None = None
    group: str | None = None


@dataclass
class Cancel:
    request_id: str
    cause: str
    reason: str


@dataclass
class Call:
    """Run one of the Worker's methods named in ``proc_main.CHILD_CALLS``; the answer is a :class:`Reply`."""
    call_id: int
    name: str
    args: tuple


@dataclass
class Close:
    timeout: float


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
class Events:
    """The owner's events of one step (or one event made outside a step), and its snapshot after a loop round."""
    events: list[dict]
    snapshot: dict | None = None


@dataclass
class Reply:
    call_id: int
    ok: bool
    value: Any                       # the call's result, or the exception it raised


@dataclass
class Closed:
    pass
