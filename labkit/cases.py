"""The quick-walk cases A-D (handbook 5.2) as data: the prompts, output lengths and labels that the
quick walk (labkit/experiments/quick_walk.py) drives and the baseline logits suite
(labkit/guardrails/suites.py) replays. Their own module so the two rooms share them without importing
each other."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    title: str
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: tuple[int, ...]
    labels: tuple[str, ...]


def _ids(start: int, n: int) -> tuple[int, ...]:
    return tuple(range(start, start + n))


CASES: dict[str, Case] = {
    "A": Case("one request, three steps", (_ids(9000, 3),), (3,), ("A",)),
    "B": Case("two requests batched, R1 leaves first", (_ids(2000, 3), _ids(3000, 4)), (2, 5), ("R1", "R2")),
    "C": Case("crossing the 256th KV slot", (tuple(range(100, 356)),), (3,), ("A",)),
    "D": Case("chunked prefill under a token budget", (_ids(20000, 700), _ids(40000, 32)), (2, 2), ("A", "B")),
    # a short prompt first, then a long one: with --mixed-batches the short one decodes beside the long one's
    # chunks (a mixed step); in the step model the long chunks run alone while the short one waits
    "E": Case("a decode beside a chunk (mixed steps)", (_ids(40000, 32), _ids(20000, 700)), (4, 2), ("S", "L")),
}
