"""CUDA Graphs for decode: capture one graph per batch-size bucket, replay the smallest covering bucket.

Each graph runs the whole decode forward including the LM head, so a replay returns logits and no
GEMM shape changes between steps (an eager LM head would meet a new shape at every batch size).

Padding rows (bucket size > batch) get slot -1 and context length 0: they write no KV and read none.
A batch with no covering bucket runs eagerly instead of failing; the route is recorded per step.
"""
from __future__ import annotations

import time

import torch

from engine.attention import AttentionMetadata


def default_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_num_seqs, and max_num_seqs itself: every batch size is covered."""
    buckets = [b for b in (1, 2, 4, 8) if b <= max_num_seqs]
    buckets += list(range(16, max_num_seqs + 1, 16))
    if max_num_seqs not in buckets:
        buckets.append(max_num_seqs)
    return sorted(set(buckets))


class DecodeGraphs:
    def __init__(self, model, buckets: list[int], max_blocks_per_seq: int, max_model_len: int, device: str):
        self.model = model
        self.buckets = sorted(buckets)
        self.max_model_len = max_model_len
        max_bs = self.buckets[-1]
        with torch.device(device):
            self.input_ids = torch.zeros(max_bs, dtype=torch.int64)
            self.positions = torch.zeros(max_bs, dtype=torch.int64)
            self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64)
            self.context_lens = torch.zeros(max_bs, dtype=torch.int32)
            self.block_tables = torch.zeros(max_bs, max_blocks_per_seq, dtype=torch.int32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(is_prefill=False, slot_mapping=self.slot_mapping[:bs],
                                 block_tables=self.block_tables[:bs], context_lens=self.context_lens[:bs],
                                 max_seqlen_q=1, max_seqlen_k=self.max_model_len,
                                 seqlens_q=[1] * bs, seqlens_k=[0] * bs)

    def _forward(self, bs: int, meta: AttentionMetadata) -> torch.Tensor:
        return self.model.compute_logits(self.model(self.input_ids[:bs], self.positions[:bs], meta))

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        pool = None
        for bs in reversed(self.buckets):           # largest first: smaller graphs reuse its memory pool
            meta = self._meta(bs)
            self._forward(bs, meta)                                        # warm up kernels / autotune
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.outputs[bs] = self._forward(bs, meta)
            if pool is None:
                pool = graph.pool()
            self.graphs[bs] = graph
            torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0

    def bucket_for(self, batch: int) -> int | None:
        for bs in self.buckets:
            if bs >= batch and bs in self.graphs:
                return bs
        return None

    def replay(self, bucket: int, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [n, vocab] of the n real rows."""
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping.fill_(-1)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.context_lens.zero_()
        self.context_lens[:n].copy_(meta.context_lens)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:n]
