"""How the lab and the service watch the engine without reaching into it. The engine never prints.

Two kinds of listener:

- ``EventBus``: step events with data (``scheduled``, ``inputs``, ``postprocessed``) for tracing and
  the quick-walk cases. Building their data costs host time, so it is built only when someone listens.
- ``StepHooks``: the step's timed phases and the point just before the forward. Both step paths (one
  step at a time, and the overlapped decode) call them, each phase tagged with the step it belongs to:

      schedule -> prepare -> forward -> sample -> postprocess      (phases, timed by the engine)
                            ^ before_forward(step, inputs)       (a test may raise here; a profiler
                                                                   may open a range)

  Under overlap the phases of step k+1 (schedule .. sample) run before step k's postprocess; the step
  number says which step a phase belongs to. On CUDA the forward and sample phases time the launch;
  a listener that wants device time synchronizes in ``phase_end`` (the profiler does).
"""
from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

PHASES = ("schedule", "prepare", "forward", "sample", "postprocess")


@dataclass
class EngineEvent:
    name: str          # "scheduled" (before the forward) | "inputs" (runner tensors) | "postprocessed"
    step: int
    phase: str         # "prefill" | "decode" | "mixed" (a step that prefills and decodes: engine.step_output.step_kind)
    data: dict[str, Any] = field(default_factory=dict)


Observer = Callable[[EngineEvent], None]


class EventBus:
    def __init__(self) -> None:
        self.observers: list[Observer] = []

    def __bool__(self) -> bool:
        return bool(self.observers)

    def subscribe(self, fn: Observer) -> Callable[[], None]:
        self.observers.append(fn)
        return lambda: self.observers.remove(fn)

    def emit(self, event: EngineEvent) -> None:
        for fn in list(self.observers):
            fn(event)


class StepHooks:
    """Override what you need; the engine calls every registered hook in registration order."""

    def on_scheduled(self, step: int, is_prefill: bool, batch: list[tuple[int, int]]) -> None:
        """A step was scheduled: batch is [(seq_id, tokens this step computes)]."""

    def phase_start(self, name: str, step: int) -> None:
        """A phase of `step` begins (name in PHASES)."""

    def phase_end(self, name: str, step: int, seconds: float) -> None:
        """A phase of `step` ended after `seconds` of host time."""

    def before_forward(self, step: int, inputs: Any) -> None:
        """The step's inputs are on the device and the forward is next; raising here fails the step."""


_NULL = nullcontext()


class HookSet:
    """The engine's registered StepHooks. With none registered, a phase costs one truth test."""

    def __init__(self) -> None:
        self.hooks: list[StepHooks] = []

    def __bool__(self) -> bool:
        return bool(self.hooks)

    def add(self, hook: StepHooks) -> Callable[[], None]:
        self.hooks.append(hook)
        return lambda: self.hooks.remove(hook)

    def phase(self, name: str, step: int):
        return self._timed(name, step) if self.hooks else _NULL

    @contextmanager
    def _timed(self, name: str, step: int) -> Iterator[None]:
        hooks = list(self.hooks)
        for h in hooks:
            h.phase_start(name, step)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - t0
            for h in reversed(hooks):
                h.phase_end(name, step, seconds)

    def scheduled(self, step: int, is_prefill: bool, batch: list[tuple[int, int]]) -> None:
        for h in list(self.hooks):
            h.on_scheduled(step, is_prefill, batch)

    def before_forward(self, step: int, inputs: Any) -> None:
        for h in list(self.hooks):
            h.before_forward(step, inputs)
