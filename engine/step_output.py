"""What one engine step returns (StepOutput) and what kind of step it was (step_kind): read by the engine's
callers (the serving worker's step records, the benches, the lab's walks)."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.graph import EAGER, Route
from engine.scheduler import StepOutcome
from engine.sequence import Sequence


def step_kind(seqs: list[Sequence], is_prefill: bool) -> str:
    """decode, prefill, or mixed: a step (read before it runs) that prefills and also decodes sequences the
    scheduler scheduled as decodes (``Sequence.decoding``; a preempted request's recompute is a prefill)."""
    if not is_prefill:
        return "decode"
    return "mixed" if any(s.decoding for s in seqs) else "prefill"


@dataclass
class StepOutput:
    step: int
    is_prefill: bool
    seqs: list[Sequence]
    outcome: StepOutcome
    num_tokens: int                     # positions computed this step
    seconds: float = 0.0
    scheduled: list[tuple[int, int]] = field(default_factory=list)   # (seq_id, positions it computed)
    route: Route = EAGER                # eager, or the decode graph bucket replayed
    logprobs: dict = field(default_factory=dict)   # seq_id -> TokenLogprob of its accepted token (if asked)
    wait_s: float = 0.0                 # host time blocked reading the step's sampled ids (their tolist());
                                        # overlapped: the GPU's slack (near 0: the GPU waited on the host)
    device_span: tuple[int, int] | None = None   # CUDA: when the GPU began and ended the step (monotonic ns,
                                                 # engine/device_clock.py); None elsewhere
    kind: str = ""                      # decode | prefill | mixed (decodes and prefill chunks in one step)
    ahead: bool = False                 # overlapped: launched while the step before it was in flight (the
                                        # lookahead), not after that step's tokens were read

    def __post_init__(self) -> None:
        if not self.kind:
            self.kind = "prefill" if self.is_prefill else "decode"

    @property
    def finished(self) -> list[Sequence]:
        return self.outcome.finished
