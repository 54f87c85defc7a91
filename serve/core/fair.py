"""Fair admission across requests: one HTTP request's whole work is a *group* of worker requests (``n`` samples
x prompts, one sequence each), and the worker's queue and running slots are shared among groups, not first come
first served among sequences.

The rule (both worker kinds; the engine process's parent checks the queue the same way):

- The queue holds ``queue_size`` *requests* (groups with a sequence not yet admitted), whatever their ``n``: the
  sequences of an accepted request always join it, so one request never fills the queue for everyone else, and
  a full queue refuses (429) a whole new request, never half of one. A request's own size is bounded by the
  protocol (``n x prompts`` at most ``protocol.MAX_CHOICES``).
- Running slots (``max_active``) go round-robin: at each step boundary a free slot goes to the waiting group that
  holds the fewest running sequences (ties: the one that came first); within a group, in order.
- One group holds at most ``per_request_cap(max_active, max_active_per_request)`` running slots (default: a
  quarter of them, at least one, stay free for others). Without it a request with ``n >= max_active`` would take
  every slot and a newcomer would wait until one of its sequences ends; with it a newcomer starts at the next step
  boundary.

vLLM fans ``n`` out into child requests that its scheduler admits first come first served under
``max_num_seqs`` (no per-request bound, no fairness between requests); the cap and the round-robin are ours, so
one client's ``n=64`` costs others one step, not its whole run.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable, Protocol


class Grouped(Protocol):
    group: str


def per_request_cap(max_active: int, max_active_per_request: int | None) -> int:
    """Running slots one request may hold: the given limit, or all but a quarter of ``max_active`` (>= 1)."""
    if max_active_per_request is not None:
        return max(1, min(max_active, max_active_per_request))
    return max(1, max_active - max(1, max_active // 4))


class Groups:
    """Live and waiting sequences per group (the queue's accounting; the owner of the lock keeps it)."""

    def __init__(self) -> None:
        self.live: Counter[str] = Counter()
        self.waiting: Counter[str] = Counter()

    def has_room(self, group: str, queue_size: int) -> bool:
        """A sibling of a live request always joins; a new request needs a free request place."""
        return group in self.live or len(self.waiting) < queue_size

    def add(self, group: str) -> None:
        self.live[group] += 1
        self.waiting[group] += 1

    def admitted(self, group: str) -> None:
        _down(self.waiting, group)

    def finished(self, group: str, waiting: bool) -> None:
        """A sequence of ``group`` ended (``waiting``: before it was admitted)."""
        _down(self.live, group)
        if waiting:
            _down(self.waiting, group)

    def take(self, pending, chosen: list):
        """``pending`` (a deque) without ``chosen``, which are admitted now."""
        taken = set(map(id, chosen))
        for req in chosen:
            self.admitted(req.group)
        return type(pending)(r for r in pending if id(r) not in taken)

    def clear(self) -> None:
        self.live.clear()
        self.waiting.clear()


def _down(counter: Counter, key: str) -> None:
    if counter[key] <= 1:
        counter.pop(key, None)
    else:
        counter[key] -= 1


def pick(pending: Iterable[Grouped], running: Iterable[Grouped], free: int, cap: int) -> list:
    """Which waiting requests take the ``free`` slots, in order: round-robin over groups (fewest running first,
    ties by arrival), at most ``cap`` running per group, each group's requests in queue order."""
    if free <= 0:
        return []
    queues: dict[str, list] = {}
    for req in pending:                     # dicts keep insertion order: groups by their first waiting request
        queues.setdefault(req.group, []).append(req)
    if not queues:
        return []
    held = Counter(req.group for req in running)
    cursor = dict.fromkeys(queues, 0)
    chosen: list = []
    while len(chosen) < free and queues:
        group = min(queues, key=lambda g: held[g])       # min keeps the first of equals: arrival order
        if held[group] >= cap:
            break                                        # every waiting group is at its cap
        chosen.append(queues[group][cursor[group]])
        held[group] += 1
        cursor[group] += 1
        if cursor[group] == len(queues[group]):
            del queues[group]
    return chosen
