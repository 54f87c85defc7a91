from __future__ import annotations

from dataclasses import dataclass

from engine.errors import RequestError


@dataclass
class SamplingParams:
    temperature: float = 1.0      # 0 = greedy
    max_tokens: int = 64
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}", "invalid_sampling_params")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}", "invalid_sampling_params")
