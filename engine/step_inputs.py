"""A step's inputs: what the runner plans on the host for a batch (:class:`StepPlan`, the lists rank 0 also
sends to the other tensor-parallel ranks) and how they reach the device (:class:`StepInputs`: views of two
packed host-to-device copies, :meth:`InputBuilder.to_inputs`). The runner holds one InputBuilder
(``ModelRunner.inputs``)."""
from __future__ import annotations

import array
import itertools
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata
from engine.sequence import Sequence


def _aligned(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def longest_first(context_lens: list[int]) -> list[int]:
    """The decode rows by context length, longest first (ties in row order): the order in which the paged
    decode launches its programs, so that at mixed contexts the longest start first and the short fill in
    behind them instead of one long program finishing alone at the end (about 20 us per 256 rows here)."""
    return sorted(range(len(context_lens)), key=context_lens.__getitem__, reverse=True)


@dataclass
class StepPlan:
    """Host-side description of one forward: what rank 0 sends to the other TP ranks."""
    is_prefill: bool
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    seqlens_q: list[int]
    seqlens_k: list[int]
    block_tables: list[list[int]] | None = None
    context_lens: list[int] | None = None
    num_decodes: int = 0                  # a prefill step's leading one-token rows read through the decode kernel


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    is_prefill: bool
    plan: StepPlan | None = None          # the host lists these tensors came from (what TP ranks receive)
    started: "torch.cuda.Event | None" = None   # with a DeviceClock: reached when the GPU begins the step


class InputBuilder:
    """A batch's inputs for the runner that holds it: planned on the host (:meth:`plan_prefill`,
    :meth:`plan_decode`), then copied to ``device`` (:meth:`to_inputs`). With a ``clock`` (a DeviceClock:
    CUDA, rank 0, set by the runner once start-up is done) each step's inputs carry the mark where the GPU
    begins the step (``StepInputs.started``)."""

    def __init__(self, block_size: int, device: str, clock=None):
        self.block_size = block_size
        self.device = device
        self.clock = clock

    def _host_tensor(self, data: list[int], dtype=torch.int32) -> torch.Tensor:
        """A step input on the host, in pinned memory on CUDA (so that its copy to the device is async).
        Through a C array: 2.8x faster than torch.tensor(list) for a 16k-token prefill's 47k ints here."""
        if not data:
            return torch.empty(0, dtype=dtype)
        host = torch.frombuffer(array.array("q" if dtype == torch.int64 else "i", data), dtype=dtype)
        return host.pin_memory() if self.device.startswith("cuda") else host

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        """The cache slots of positions start..end-1: one range per block, not one lookup per position."""
        bs, out = self.block_size, []
        for b in range(start // bs, (end - 1) // bs + 1):
            shift = seq.block_table[b] * bs - b * bs            # slot = position + shift inside block b
            out += range(max(start, b * bs) + shift, min(end, (b + 1) * bs) + shift)
        return out

    @staticmethod
    def _padded_tables(seqs: list[Sequence]) -> list[list[int]]:
        width = max(len(s.block_table) for s in seqs)
        return [s.block_table + [-1] * (width - len(s.block_table)) for s in seqs]

    def plan_prefill(self, seqs: list[Sequence]) -> StepPlan:
        input_ids, positions, slots, lens_q, lens_k = [], [], [], [], []
        for seq in seqs:
            start, end = seq.num_cached_tokens, seq.num_cached_tokens + seq.num_scheduled_tokens
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            lens_q.append(end - start)
            lens_k.append(end)
            if seq.block_table:
                slots += self.slots(seq, start, end)
            else:
                slots += [-1] * (end - start)
        if sum(lens_k) == sum(lens_q):         # nothing read from the cache: attention on the new K/V alone
            return StepPlan(True, input_ids, positions, slots, lens_q, lens_k)
        # a mixed step's decodes (the scheduler puts them first) go to the decode kernel
        decodes = next((i for i, s in enumerate(seqs) if not (s.decoding and lens_q[i] == 1)), len(seqs))
        return StepPlan(True, input_ids, positions, slots, lens_q, lens_k, block_tables=self._padded_tables(seqs),
                        context_lens=lens_k[:decodes] if decodes else None, num_decodes=decodes)

    def plan_decode(self, seqs: list[Sequence], ahead: int = 0, fed: int | None = None) -> StepPlan:
        """ahead=1: the leading `fed` rows (default: all) one position further than the host's token lists
        (the previous step is in flight; their tokens are fed on the device, their input ids here are
        placeholders); the rows after them read their last token from the host."""
        bs = self.block_size
        fed = len(seqs) if fed is None or not ahead else fed
        if fed == len(seqs):
            context_lens = [s.num_tokens + ahead for s in seqs]
            ids = [s.token_ids[-1] for s in seqs] if not ahead else [0] * len(seqs)
        else:                # a decode behind a prefill: the fed rows lead, one position ahead
            context_lens = [s.num_tokens + ahead for s in seqs[:fed]] + [s.num_tokens for s in seqs[fed:]]
            ids = [0] * fed + [s.token_ids[-1] for s in seqs[fed:]]
        slots = [s.block_table[(n - 1) // bs] * bs + (n - 1) % bs for s, n in zip(seqs, context_lens)]
        return StepPlan(False, ids, [n - 1 for n in context_lens], slots,
                        [1] * len(seqs), context_lens, block_tables=self._padded_tables(seqs),
                        context_lens=context_lens)

    def plan_ahead(self, seqs: list[Sequence], fed: int | None = None) -> StepPlan:
        """A step launched while the previous one is in flight: its leading decode rows
        (``Sequence.decoding``) are planned as plan_decode(ahead=1), placeholders for the ids the device
        feeds; the prefill chunks after them (a mixed step) as plan_prefill plans them. fed: how many of
        the decode rows the device feeds (default: all); the decode rows after them (a decode launched
        behind a prefill: Scheduler._behind_prefill) are planned from the host's token lists."""
        d = next((i for i, s in enumerate(seqs) if not s.decoding), len(seqs))
        if d == len(seqs):
            return self.plan_decode(seqs, ahead=1, fed=fed)
        chunks = self.plan_prefill(seqs[d:])
        if not d:
            return chunks
        dec = self.plan_decode(seqs[:d], ahead=1)
        return StepPlan(True, dec.input_ids + chunks.input_ids, dec.positions + chunks.positions,
                        dec.slot_mapping + chunks.slot_mapping, dec.seqlens_q + chunks.seqlens_q,
                        dec.seqlens_k + chunks.seqlens_k, block_tables=self._padded_tables(seqs),
                        context_lens=dec.context_lens, num_decodes=d)

    def to_inputs(self, plan: StepPlan) -> StepInputs:
        """Two host-to-device copies per step: one int64 pack (ids, positions, slots), one int32 pack
        (cumulative lengths or context lengths, then the block table rows); the tensors are views of them.

        Every view starts on a 16-byte boundary (sections are padded to 2 int64 / 4 int32 entries):
        Triton specializes a kernel on whether each pointer is 16-byte aligned, so a view whose offset
        followed the batch size (positions after t ids, a block table after n + 1 offsets) compiled a new
        variant of the kernel for the first step of each alignment, in the middle of serving."""
        t, n = len(plan.input_ids), len(plan.seqlens_q)
        t_pad = _aligned(t, 2)
        pad64 = [0] * (t_pad - t)
        wide = self._host_tensor(plan.input_ids + pad64 + plan.positions + pad64 + plan.slot_mapping, torch.int64)
        sections: dict[str, list[int]] = {}
        if plan.is_prefill:
            sections["cu_q"] = [0, *itertools.accumulate(plan.seqlens_q)]
            sections["cu_k"] = [0, *itertools.accumulate(plan.seqlens_k)]
        if plan.context_lens is not None:
            sections["context_lens"] = plan.context_lens
            sections["decode_order"] = longest_first(plan.context_lens)
        if plan.block_tables is not None:
            sections["block_tables"] = list(itertools.chain.from_iterable(plan.block_tables))
        views: dict[str, torch.Tensor] = {}
        if sections:
            flat: list[int] = []
            starts: dict[str, int] = {}
            for name, values in sections.items():
                starts[name] = len(flat)
                flat += values
                flat += [0] * (_aligned(len(flat), 4) - len(flat))
            packed = self._host_tensor(flat)
        # with a clock, the step's first GPU work: its span starts here, after the host built its inputs
        started = self.clock.mark() if self.clock is not None else None
        wide = wide.to(self.device, non_blocking=True)
        if sections:
            packed = packed.to(self.device, non_blocking=True)
            views = {name: packed[starts[name]:starts[name] + len(v)] for name, v in sections.items()}
        block_tables = views.get("block_tables")
        meta = AttentionMetadata(
            is_prefill=plan.is_prefill, slot_mapping=wide[2 * t_pad:2 * t_pad + t],
            cu_seqlens_q=views.get("cu_q"), cu_seqlens_k=views.get("cu_k"),
            max_seqlen_q=max(plan.seqlens_q), max_seqlen_k=max(plan.seqlens_k),
            block_tables=None if block_tables is None else block_tables.view(n, -1),
            context_lens=views.get("context_lens"), decode_order=views.get("decode_order"),
            seqlens_q=plan.seqlens_q, seqlens_k=plan.seqlens_k, num_decodes=plan.num_decodes)
        return StepInputs(wide[:t], wide[t_pad:t_pad + t], meta, plan.is_prefill, plan, started)

    def prepare_prefill(self, seqs: list[Sequence]) -> StepInputs:
        return self.to_inputs(self.plan_prefill(seqs))

    def prepare_decode(self, seqs: list[Sequence]) -> StepInputs:
        return self.to_inputs(self.plan_decode(seqs))

    def prepare(self, seqs: list[Sequence], is_prefill: bool) -> StepInputs:
        return self.prepare_prefill(seqs) if is_prefill else self.prepare_decode(seqs)
