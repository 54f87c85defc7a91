"""CUDA Graphs: small prefills by token-count bucket, and decode by batch-size bucket.

Prefill (PrefillGraphs): a short prompt's prefill is bound by launches, not by the GPU (a 32-token
prefill of the 0.6B model on an H200: 322 kernels, 1.1 ms of GPU work, 17 ms as an eager step), so a
prefill of at most PREFILL_GRAPH_SEQS sequences and at most the largest token bucket replays the graph of
the smallest covering bucket. Two sets: fresh prefills (nothing read from the cache: attention on the new
K/V) and paged ones (a prefix-cache hit or a chunk continuation, no decode rows: attention through the block
table, whose width is the model's longest sequence). Padding sequences have length 0 (the attention kernel's
programs return at once), padding tokens belong to no sequence and write no KV (slot -1); only each real
sequence's last row reaches the LM head.

Decode (DecodeGraphs): capture one graph per batch-size bucket, replay the smallest covering bucket.
Each graph runs the whole decode forward including the LM head, so a replay returns logits and no
GEMM shape changes between steps (an eager LM head would meet a new shape at every batch size).

Padding rows (bucket size > batch) get slot -1 and context length 0: they write no KV and read none.
A batch with no covering bucket runs eagerly instead of failing; the route is recorded per step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata


def default_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_num_seqs, and max_num_seqs itself: every batch size is covered."""
    buckets = [b for b in (1, 2, 4, 8) if b <= max_num_seqs]
    buckets += list(range(16, max_num_seqs + 1, 16))
    if max_num_seqs not in buckets:
        buckets.append(max_num_seqs)
    return sorted(set(buckets))


@torch.inference_mode()
def capture_buckets(buckets: list[int], forward, graphs: dict, outputs: dict) -> float:
    """One graph per bucket of ``forward(bucket)`` into ``graphs``/``outputs``, largest first so the smaller
    ones reuse its memory pool; each runs once eagerly before its capture (compiles, autotuning). Returns
    the seconds it took."""
    t0 = time.perf_counter()
    pool = None
    for b in reversed(buckets):
        forward(b)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool):
            outputs[b] = forward(b)
        if pool is None:
            pool = graph.pool()
        graphs[b] = graph
        torch.cuda.synchronize()
    return time.perf_counter() - t0


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
            self.rows = torch.arange(max_bs, dtype=torch.int32)         # padding rows' place in decode_order
            self.decode_order = self.rows.clone()
            self.block_tables = torch.zeros(max_bs, max_blocks_per_seq, dtype=torch.int32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(is_prefill=False, slot_mapping=self.slot_mapping[:bs],
                                 block_tables=self.block_tables[:bs], context_lens=self.context_lens[:bs],
                                 decode_order=self.decode_order[:bs], max_seqlen_q=1, max_seqlen_k=self.max_model_len,
                                 seqlens_q=[1] * bs, seqlens_k=[0] * bs)

    def _forward(self, bs: int, meta: AttentionMetadata) -> torch.Tensor:
        return self.model.compute_logits(self.model(self.input_ids[:bs], self.positions[:bs], meta))

    def capture(self) -> None:
        self.capture_seconds = capture_buckets(self.buckets, lambda bs: self._forward(bs, self._meta(bs)),
                                               self.graphs, self.outputs)

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
        if meta.decode_order is not None:     # the real rows in their order, then the padding rows (ctx 0)
            self.decode_order[:n].copy_(meta.decode_order)
            self.decode_order[n:bucket].copy_(self.rows[n:bucket])
        else:
            self.decode_order.copy_(self.rows)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:n]


#: token buckets of whole-step graphs (prefill graphs up to PREFILL_GRAPH_MAX_TOKENS, mixed graphs): powers of two
#: to 256, then every 128 to 1,024 and every 256 to 2,048, so a step pads at most an eighth to a quarter of itself
#: above 256 tokens (a 544-token prefill on power-of-two buckets ran the GEMMs of 1,024)
GRAPH_TOKENS = (16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048)
PREFILL_GRAPH_MAX_TOKENS = 1024
PREFILL_GRAPH_TOKENS = tuple(t for t in GRAPH_TOKENS if t <= PREFILL_GRAPH_MAX_TOKENS)
PREFILL_GRAPH_SEQS = 16


def budget_buckets(sizes: tuple[int, ...], max_num_batched_tokens: int) -> list[int]:
    """The token buckets of `sizes` a step budget can use, and the budget itself where it falls between two (up
    to the largest)."""
    buckets = [t for t in sizes if t <= max_num_batched_tokens]
    if max_num_batched_tokens < sizes[-1] and max_num_batched_tokens not in buckets:
        buckets.append(max_num_batched_tokens)
    return sorted(buckets)


def prefill_buckets(max_num_batched_tokens: int) -> list[int]:
    """The prefill token buckets a step budget can use (a step never holds more tokens than the budget)."""
    return [t for t in PREFILL_GRAPH_TOKENS if t <= max_num_batched_tokens] or [PREFILL_GRAPH_TOKENS[0]]


class PrefillGraphs:
    """max_blocks 0: fresh prefills; else paged ones (block tables of at most max_blocks blocks, max_model_len
    positions)."""

    def __init__(self, model, buckets: list[int], max_seqs: int, device: str, max_blocks: int = 0,
                 max_model_len: int = 0):
        self.model = model
        self.buckets = sorted(buckets)
        self.max_seqs = max_seqs
        self.paged = max_blocks > 0
        self.max_model_len = max_model_len
        t = self.buckets[-1]
        with torch.device(device):
            self.input_ids = torch.zeros(t, dtype=torch.int64)
            self.positions = torch.zeros(t, dtype=torch.int64)
            self.slot_mapping = torch.full((t,), -1, dtype=torch.int64)
            self.cu_seqlens = torch.zeros(max_seqs + 1, dtype=torch.int32)   # padding sequences: length 0
            self.last = torch.zeros(max_seqs, dtype=torch.int64)             # each sequence's last row
            if self.paged:                                                   # prefix + new positions
                self.cu_seqlens_k = torch.zeros(max_seqs + 1, dtype=torch.int32)
                self.block_tables = torch.zeros(max_seqs, max_blocks, dtype=torch.int32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0

    def _meta(self, t: int) -> AttentionMetadata:
        if self.paged:
            return AttentionMetadata(is_prefill=True, slot_mapping=self.slot_mapping[:t], cu_seqlens_q=self.cu_seqlens,
                                     cu_seqlens_k=self.cu_seqlens_k, max_seqlen_q=t, max_seqlen_k=self.max_model_len,
                                     block_tables=self.block_tables)
        return AttentionMetadata(is_prefill=True, slot_mapping=self.slot_mapping[:t], cu_seqlens_q=self.cu_seqlens,
                                 cu_seqlens_k=self.cu_seqlens, max_seqlen_q=t, max_seqlen_k=t)

    def _forward(self, t: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:t], self.positions[:t], self._meta(t))
        return self.model.compute_logits(hidden[self.last])

    def capture(self) -> None:
        self.capture_seconds = capture_buckets(self.buckets, self._forward, self.graphs, self.outputs)

    def bucket_for(self, num_tokens: int, num_seqs: int) -> int | None:
        if num_seqs > self.max_seqs:
            return None
        for t in self.buckets:
            if t >= num_tokens and t in self.graphs:
                return t
        return None

    def replay(self, bucket: int, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [n, vocab] of the last position of each of the n sequences."""
        t = input_ids.shape[0]
        n = meta.cu_seqlens_q.shape[0] - 1
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.slot_mapping.fill_(-1)
        self.slot_mapping[:t].copy_(meta.slot_mapping)
        self.cu_seqlens.fill_(t)
        self.cu_seqlens[:n + 1].copy_(meta.cu_seqlens_q)
        if self.paged:              # padding sequences: no new tokens, so their programs return before reading
            self.cu_seqlens_k.fill_(0)
            self.cu_seqlens_k[:n + 1].copy_(meta.cu_seqlens_k)
            width = meta.block_tables.shape[1]
            self.block_tables[:n, :width].copy_(meta.block_tables)
        self.last.zero_()
        torch.sub(meta.cu_seqlens_q[1:], 1, out=self.last[:n])
        self.graphs[bucket].replay()
        return self.outputs[bucket][:n]


@dataclass(frozen=True)
class Route:
    """How a forward ran: eagerly, by replaying the decode graph of `bucket` sequences, a prefill graph of
    `bucket` tokens (fresh, or paged: reading a cached prefix), a mixed graph of `rows` decode rows within
    `bucket` tokens (engine/mixed_graphs.py) or a piecewise graph of `bucket` tokens (ModelRunner.route_for
    picks it)."""
    kind: str = "eager"     # "eager" | "graph" | "prefill-graph" | "paged-prefill-graph" | "mixed-graph" | "piecewise"
    bucket: int | None = None
    rows: int | None = None               # mixed-graph: its decode rows

    def __str__(self) -> str:
        if self.kind == "eager":
            return "eager"
        return f"{self.kind}:{self.rows}/{self.bucket}" if self.rows is not None else f"{self.kind}:{self.bucket}"


EAGER = Route()
