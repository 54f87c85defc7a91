"""EngineProbe: what the lab reads inside a running engine, beside the request path (``LLMEngine.probe``).

The block manager's free list, ref counts and stored hashes, the KV pool with its owners, the pool tensor, the
model's modules for forward hooks, a position's slot, and a decode step as a function a bench can time. Each is a
view: nothing here changes what the engine schedules or computes (the tensors and modules handed out are the
engine's own, to read, never to write).
"""
from __future__ import annotations

from typing import Callable

import torch

from engine.sequence import Sequence


class EngineProbe:
    """Read-only views into one :class:`engine.llm_engine.LLMEngine` (not imported here: the engine imports this
    module)."""

    def __init__(self, engine):
        self._engine = engine

    def free_block_ids(self) -> list[int]:
        return sorted(self._engine.block_manager.free_block_ids)

    def ref_counts(self, block_ids: list[int]) -> list[int]:
        return self._engine.block_manager.ref_counts(block_ids)

    def block_hashes(self, block_ids: list[int]) -> list[int | None]:
        """The prefix-cache hash each block holds now (None: none)."""
        return self._engine.block_manager.block_hashes(block_ids)

    def pool(self) -> dict:
        """The KV pool now: every block in use or still holding a hash, with its ref count and the live
        sequences (ids) whose block tables hold it; free blocks without a hash are left out."""
        owners: dict[int, list[int]] = {}
        scheduler = self._engine.scheduler
        for seq in (*scheduler.running, *scheduler.waiting):
            for b in seq.block_table:
                owners.setdefault(b, []).append(seq.seq_id)
        bm = self._engine.block_manager
        return {"num_blocks": bm.num_blocks, "block_size": bm.block_size,
                "blocks": [{**b, "owners": owners.get(b["id"], [])} for b in bm.pool_snapshot()]}

    def kv_cache(self) -> torch.Tensor:
        """The KV pool [2, layers, blocks, block_size, kv heads, head dim]."""
        return self._engine.runner.kv_cache

    def named_modules(self):
        """The model's modules by name (rank 0), for forward hooks that only read (shape probes)."""
        return self._engine.runner.model.named_modules()

    def slot(self, seq: Sequence, position: int) -> int:
        """Where position's K/V lives in the pool (block_table[p // B] * B + p % B)."""
        return self._engine.runner.inputs.slot(seq, position)

    def decode_step_fn(self, seqs: list[Sequence]) -> Callable[[], torch.Tensor]:
        """The decode step of ``seqs`` (their block tables set by the caller) as a function that runs the
        model's forward and LM head on inputs built once, now, and returns the logits. It writes no K/V (every
        slot -1) and samples nothing: for benches that time a step their own way (labkit/bench/nano_batches.py
        captures it in CUDA graphs of its own)."""
        runner = self._engine.runner
        step = runner.inputs.prepare_decode(seqs)
        step.meta.slot_mapping.fill_(-1)
        model = runner.model
        return lambda: model.compute_logits(model(step.input_ids, step.positions, step.meta))
