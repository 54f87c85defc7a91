"""Teacher forcing through the real engine: preset next ids instead of sampled ones, and the KV probe.

The sampler is bypassed: ``engine.forward_logits`` gives the logits (and the route they took), the
preset id goes to ``engine.postprocess``. An intermediate chunk of a chunked prefill yields a candidate that postprocess
discards; it is no row. :class:`KVProbe` records the new K/V of each decode row (graph suite) and checks
that a decode leaves the batch's history KV and the unreferenced blocks untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import numpy as np


class ForcedRow(NamedTuple):
    """One teacher-forced row in the order the engine produced it."""
    tokens: list[int]
    logits: Any        # torch.Tensor [vocab], float32, detached copy
    phase: str


@dataclass
class ForcedRecord:
    request: int                     # index into the prompts passed in
    output_index: int                # 0 = the prefill row
    tokens: list[int]
    logits: Any
    phase: str
    engine_step: int


@dataclass
class ForcedStep:
    engine_step: int
    phase: str
    requests: list[int]              # request index of each scheduled sequence, in batch order
    completing: list[bool]           # False: an intermediate chunk, its candidate is discarded
    route: dict = field(default_factory=dict)


class StepProbe:
    """Hooks around each forward (subclass): ``before`` after scheduling, ``after`` before postprocess."""

    def before(self, engine, seqs, is_prefill: bool, requests: list[int]) -> None:
        pass

    def after(self, engine, seqs, is_prefill: bool, requests: list[int], logits) -> None:
        pass


def drive_teacher_forced(engine, prompts, continuations, *, probe: StepProbe | None = None,
                         on_row: Callable[[ForcedRecord], None] | None = None
                         ) -> tuple[list[ForcedRecord], list[ForcedStep]]:
    """Run the real scheduler until every request is done, handing it preset next ids.

    ``continuations[i]`` holds request i's next ids; its length is its max_tokens (one row per output).
    Returns the rows in the order the engine produced them and one entry per engine step.
    """
    from engine import SamplingParams

    backend = engine.describe()["attention_backend"]
    index: dict[int, int] = {}
    for i, (p, c) in enumerate(zip(prompts, continuations, strict=True)):
        if not c:
            raise ValueError(f"request {i} has no continuation ids")
        seq = engine.add_request(list(p), SamplingParams(temperature=0.0, max_tokens=len(c), ignore_eos=True))
        index[seq.seq_id] = i
    records: list[ForcedRecord] = []
    steps: list[ForcedStep] = []
    while not engine.is_finished():
        seqs, is_prefill = engine.schedule()
        if not seqs:
            raise RuntimeError("the scheduler returned an empty batch while requests remain")
        requests = [index[s.seq_id] for s in seqs]
        if probe is not None:
            probe.before(engine, seqs, is_prefill, requests)
        tokens, fresh = sum(s.num_scheduled_tokens for s in seqs), all(s.num_cached_tokens == 0 for s in seqs)
        decodes = sum(1 for s in seqs if s.decoding) if is_prefill else 0     # a mixed step's decode rows
        logits, taken = engine.forward_logits(seqs, is_prefill)
        route = {"backend": backend, "route": taken.kind, "bucket": taken.bucket, "tokens": tokens, "fresh": fresh,
                 "decodes": decodes}
        if probe is not None:
            probe.after(engine, seqs, is_prefill, requests, logits)
        phase = "prefill" if is_prefill else "decode"
        forced, completing = [], []
        for seq, i, row in zip(seqs, requests, logits):
            done = seq.step_reaches_end
            completing.append(done)
            if done:
                rec = ForcedRecord(i, seq.num_completion_tokens, list(seq.token_ids),
                                   row.detach().float().cpu().clone(), phase, engine.num_steps)
                records.append(rec)
                if on_row is not None:
                    on_row(rec)
                forced.append(int(continuations[i][seq.num_completion_tokens]))
            else:
                forced.append(-1)            # an intermediate chunk: postprocess discards it
        steps.append(ForcedStep(engine.num_steps, phase, requests, completing, route))
        engine.postprocess(seqs, forced, is_prefill)
    return records, steps


def teacher_forced(engine, prompts, continuations) -> list[ForcedRow]:
    """(input tokens, logits, phase) for every row, in the order the engine produced them."""
    records, _ = drive_teacher_forced(engine, prompts, continuations)
    return [ForcedRow(r.tokens, r.logits, r.phase) for r in records]


def _kv_flat(engine):
    """The KV pool as [2, layers, num_blocks * block_size, kv heads, head dim] (a view)."""
    kv = engine.probe.kv_cache()
    return kv.view(kv.shape[0], kv.shape[1], kv.shape[2] * kv.shape[3], kv.shape[4], kv.shape[5])


def _slot(seq, position: int, block_size: int) -> int:
    return seq.block_table[position // block_size] * block_size + position % block_size


class KVProbe(StepProbe):
    """Per decode step: K/V written at the new positions, history untouched, unreferenced blocks untouched."""

    def __init__(self, free_sample: int = 16):
        self.free_sample = free_sample
        self.new_kv: dict[tuple[str, int, int], np.ndarray] = {}   # (group, request, output) -> [2, L, H, D]
        self.steps: list[dict] = []
        self.group = ""
        self._history = None
        self._free = None
        self._free_ids: list[int] = []
        self._hist_slots = None

    def before(self, engine, seqs, is_prefill, requests):
        if is_prefill:
            return
        import torch

        bs = engine.config.kvcache_block_size
        flat = _kv_flat(engine)
        slots = [_slot(s, p, bs) for s in seqs for p in range(s.num_tokens - 1)]
        self._hist_slots = torch.tensor(slots, dtype=torch.long, device=flat.device)
        self._history = flat.index_select(2, self._hist_slots).clone()
        free = engine.probe.free_block_ids()
        last = engine.stats().num_blocks - 1
        pick = free[: self.free_sample // 2] + free[-(self.free_sample // 2):]
        pick += [b for b in (0, last) if b in free]          # where a padding row with slot 0 / -1 would land
        self._free_ids = sorted(set(pick))
        ids = torch.tensor(self._free_ids, dtype=torch.long, device=flat.device)
        self._free = engine.probe.kv_cache().index_select(2, ids).clone() if self._free_ids else None

    def after(self, engine, seqs, is_prefill, requests, logits):
        if is_prefill:
            return
        import torch

        bs = engine.config.kvcache_block_size
        flat = _kv_flat(engine)
        history_same = bool(torch.equal(flat.index_select(2, self._hist_slots), self._history))
        if self._free is not None:
            ids = torch.tensor(self._free_ids, dtype=torch.long, device=flat.device)
            free_same = bool(torch.equal(engine.probe.kv_cache().index_select(2, ids), self._free))
        else:
            free_same = True
        new_slots = torch.tensor([_slot(s, s.num_tokens - 1, bs) for s in seqs], dtype=torch.long, device=flat.device)
        new = flat.index_select(2, new_slots).float().cpu().numpy()          # [2, L, N, H, D]
        for j, (seq, i) in enumerate(zip(seqs, requests)):
            self.new_kv[(self.group, i, seq.num_completion_tokens)] = np.ascontiguousarray(new[:, :, j])
        self.steps.append({"group": self.group, "engine_step": engine.num_steps, "batch": len(seqs),
                           "history_positions": int(self._hist_slots.numel()), "history_unchanged": history_same,
                           "free_blocks_checked": list(self._free_ids), "free_blocks_unchanged": free_same})
        self._history = self._free = self._hist_slots = None
