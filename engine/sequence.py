"""A request's state as the scheduler and the runner see it."""
from __future__ import annotations

from copy import copy
from enum import Enum, auto
from itertools import count

from engine.sampling.params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    def __init__(self, seq_id: int, token_ids: list[int], sampling_params: SamplingParams, block_size: int):
        self.seq_id = seq_id
        self.status = SequenceStatus.WAITING
        self.token_ids = copy(token_ids)
        self.num_tokens = len(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_cached_tokens = 0       # positions whose KV is in the cache
        self.num_prefix_hit_tokens: int | None = None   # prompt tokens the prefix cache gave at first admission
        self.num_scheduled_tokens = 0    # positions this step computes
        self.decoding = False            # scheduled as a decode this step (not a prompt chunk or a recompute)
        self.block_table: list[int] = []
        self.num_hashed_blocks = 0       # full blocks already registered in the prefix cache
        self.last_block_hash = -1
        self.block_size = block_size
        self.sampling_params = sampling_params
        self.finish_reason: str | None = None
        self.output_logprobs: list = []      # one TokenLogprob per output token when params.logprobs is set
        # params.prompt_logprobs: None for position 0, then one TokenLogprob per prompt position
        self.prompt_logprobs: list | None = [None] if sampling_params and sampling_params.prompt_logprobs is not None else None
        self.prefill_after: "Sequence | None" = None   # n > 1: wait for this sibling's prefill (shared prompt KV)
        self.grammar = None          # structured outputs: its SequenceGrammar (engine/sampling/structured.py)

    def __len__(self) -> int:
        return self.num_tokens

    def __getitem__(self, key):
        return self.token_ids[key]

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, {self.status.name}, total={self.num_tokens}, "
                f"cached={self.num_cached_tokens}, scheduled={self.num_scheduled_tokens}, blocks={self.block_table})")

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_logprobs_done(self) -> bool:
        return self.prompt_logprobs is None or len(self.prompt_logprobs) >= self.num_prompt_tokens

    @property
    def waits_for_sibling(self) -> bool:
        """n > 1: this sample's prompt is being prefilled by a sibling whose full blocks it will reuse
        through the prefix cache; it is not admitted until that prefill has completed."""
        lead = self.prefill_after
        return lead is not None and not lead.is_finished and lead.num_cached_tokens < lead.num_prompt_tokens

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def num_blocks(self) -> int:
        """Logical blocks needed to hold every known token."""
        return (self.num_tokens + self.block_size - 1) // self.block_size

    @property
    def step_reaches_end(self) -> bool:
        """This step computes up to the last known token: a decode, or the last chunk of a prefill.
        Only then is the step's candidate an output; an intermediate chunk's candidate is discarded."""
        return self.num_cached_tokens + self.num_scheduled_tokens >= self.num_tokens

    def block(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size: (i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.num_tokens += 1

    def snapshot(self) -> dict:
        return {
            "seq_id": self.seq_id,
            "status": self.status.name,
            "total": self.num_tokens,
            "cached": self.num_cached_tokens,
            "scheduled": self.num_scheduled_tokens,
            "completion": self.num_completion_tokens,
            "block_table": list(self.block_table),
        }


class SequenceCounter:
    """Per-engine id source: two engines in one process keep their own numbering."""

    def __init__(self) -> None:
        self._it = count()

    def __call__(self) -> int:
        return next(self._it)
