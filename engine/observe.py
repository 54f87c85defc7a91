"""Step events the engine emits for tracing, debugging and the service. The engine never prints."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class EngineEvent:
    name: str          # "scheduled" (before the forward) | "inputs" (runner tensors) | "postprocessed"
    step: int
    phase: str         # "prefill" | "decode"
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
