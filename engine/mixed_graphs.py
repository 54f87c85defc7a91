"""Whole CUDA graphs for mixed steps: a step's decode rows and prefill chunks in one replay.

A mixed step (engine/scheduler.py with mixed_batches) holds d decode rows, one token each and first, then
the chunks of s prompts. Piecewise graphs (engine/piecewise.py) run it as one graph launch per layer and
the attention eagerly between them: on an H200 the host spent 67-123 us per graph launch, 29 of them a step,
so mixed steps were bound by the host. Here the attention is inside the graph too, which only works where
its launches have fixed grids: the Triton backend's decode kernel sizes its splits from the model's longest
context (as in a decode graph) and its prefill kernel's grid follows the bucket's tokens (as in a paged
prefill graph).

A graph is keyed by (D, T): D decode rows within T tokens. Its flat batch:

- rows 0..D-1 are decode rows: the step's d, then D - d padding rows (context 0, slot -1: the decode
  kernel writes zeros for them and they store nothing);
- rows D..T-1 are the chunks' tokens, sequences D..D+s-1 of cu_seqlens, then padding tokens that belong to
  no sequence (slot -1); padding sequences start and end where the chunks end, so their prefill programs
  return at once;
- the graph ends by gathering the rows the LM head reads into one static buffer (``last``: the d decode
  rows, then each chunk's last token); the LM head runs after the replay on the step's d + s rows only, so
  no padding row costs its vocabulary GEMM and no graph keeps logits of its own (every graph writes the
  same buffer: their memory does not grow with their number).

A step takes the smallest D >= d, then the smallest T >= D + its chunk tokens, with at most
MIXED_GRAPH_CHUNKS chunk sequences; any other mixed step takes piecewise graphs. The token buckets are
finer than powers of two above 256 (engine/graph.py's GRAPH_TOKENS): a step of decodes beside a
1,024-token prompt would otherwise pad to 2,048 tokens, nearly twice the GEMM work of the step itself.

Without CUDA (tests) ``emulate=True`` runs each bucket's forward live on the same static buffers and
metadata, so the layout is checked on the CPU (through Triton's interpreter) with nothing captured.
"""
from __future__ import annotations

import torch

from engine.attention import AttentionMetadata
from engine.graph import GRAPH_TOKENS, budget_buckets, capture_buckets, default_buckets

#: chunk sequences a mixed graph holds at most (its padding sequences cost a returning program each)
MIXED_GRAPH_CHUNKS = 16


def mixed_token_buckets(max_num_batched_tokens: int) -> list[int]:
    """The token buckets (engine/graph.py's GRAPH_TOKENS) a step budget can use, and the budget itself where it
    falls between two; larger steps take piecewise graphs or run eagerly, where the GPU's work outweighs the
    launches."""
    return budget_buckets(GRAPH_TOKENS, max_num_batched_tokens)


def mixed_buckets(max_num_seqs: int, max_num_batched_tokens: int) -> list[tuple[int, int]]:
    """(decode rows, tokens) of every mixed graph: decode rows in powers of two up to max_num_seqs (and
    max_num_seqs itself), tokens the mixed token buckets of the step budget; a graph has at least one chunk
    token after its decode rows."""
    rows = [b for b in default_buckets(max_num_seqs) if b & (b - 1) == 0]
    if max_num_seqs not in rows:
        rows.append(max_num_seqs)
    return [(d, t) for d in rows for t in mixed_token_buckets(max_num_batched_tokens) if t > d]


class MixedGraphs:
    def __init__(self, model, buckets: list[tuple[int, int]], max_blocks: int, max_model_len: int, device: str,
                 max_chunks: int = MIXED_GRAPH_CHUNKS, emulate: bool = False):
        self.model = model
        self.buckets = sorted(buckets)
        self.max_chunks = max_chunks
        self.max_model_len = max_model_len
        self.emulate = emulate
        rows = max(d for d, _ in self.buckets)
        t = max(t for _, t in self.buckets)
        seqs = rows + max_chunks
        with torch.device(device):
            self.input_ids = torch.zeros(t, dtype=torch.int64)
            self.positions = torch.zeros(t, dtype=torch.int64)
            self.slot_mapping = torch.full((t,), -1, dtype=torch.int64)
            self.cu_seqlens_q = torch.zeros(seqs + 1, dtype=torch.int32)
            self.cu_seqlens_k = torch.zeros(seqs + 1, dtype=torch.int32)
            self.block_tables = torch.zeros(seqs, max_blocks, dtype=torch.int32)
            self.context_lens = torch.zeros(rows, dtype=torch.int32)
            self.rows = torch.arange(seqs + 1, dtype=torch.int32)
            self.decode_order = self.rows[:rows].clone()
            self.last = torch.zeros(seqs, dtype=torch.int64)
            head = model.lm_head.weight if model is not None else None                 # (None: routing tests)
            self.hidden = torch.zeros(seqs, head.shape[1], dtype=head.dtype) if head is not None else None
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0

    def _meta(self, key: tuple[int, int]) -> AttentionMetadata:
        d, t = key
        n = d + self.max_chunks
        return AttentionMetadata(is_prefill=True, slot_mapping=self.slot_mapping[:t],
                                 cu_seqlens_q=self.cu_seqlens_q[:n + 1], cu_seqlens_k=self.cu_seqlens_k[:n + 1],
                                 max_seqlen_q=t - d, max_seqlen_k=self.max_model_len,
                                 block_tables=self.block_tables[:n], context_lens=self.context_lens[:d],
                                 decode_order=self.decode_order[:d], seqlens_q=[1] * d,
                                 seqlens_k=[self.max_model_len] * d, num_decodes=d)

    def _forward(self, key: tuple[int, int]) -> torch.Tensor:
        """The bucket's forward, its LM-head rows gathered into the static ``hidden`` buffer."""
        d, t = key
        rows = d + self.max_chunks
        hidden = self.model(self.input_ids[:t], self.positions[:t], self._meta(key))
        return torch.index_select(hidden, 0, self.last[:rows], out=self.hidden[:rows])

    def capture(self) -> None:
        self.capture_seconds = capture_buckets(self.buckets, self._forward, self.graphs, {})

    def bucket_for(self, num_tokens: int, num_seqs: int, num_decodes: int) -> tuple[int, int] | None:
        """The smallest (decode rows, tokens) that holds a step's decodes and, after the padded decode rows,
        its chunks; None where none does."""
        if not num_decodes or num_seqs - num_decodes > self.max_chunks:
            return None
        rows = min((d for d, _ in self.buckets if d >= num_decodes), default=None)
        if rows is None:
            return None
        need = rows + num_tokens - num_decodes
        for d, t in self.buckets:
            if d == rows and t >= need and (self.emulate or (d, t) in self.graphs):
                return d, t
        return None

    def _load(self, key: tuple[int, int], input_ids, positions, meta: AttentionMetadata) -> int:
        """The step's rows into the bucket's layout (decode rows padded to D); returns its sequence count."""
        rows, _ = key
        d, n = meta.num_decodes, meta.cu_seqlens_q.shape[0] - 1
        chunk_tokens, shift = input_ids.shape[0] - d, rows - d
        self.input_ids[:d].copy_(input_ids[:d])
        self.input_ids[rows:rows + chunk_tokens].copy_(input_ids[d:])
        self.positions[:d].copy_(positions[:d])
        self.positions[rows:rows + chunk_tokens].copy_(positions[d:])
        self.slot_mapping.fill_(-1)
        self.slot_mapping[:d].copy_(meta.slot_mapping[:d])
        self.slot_mapping[rows:rows + chunk_tokens].copy_(meta.slot_mapping[d:])
        self.context_lens.zero_()
        self.context_lens[:d].copy_(meta.context_lens[:d])
        self.decode_order.copy_(self.rows[:self.decode_order.shape[0]])     # the real rows' order, then the padding's
        if meta.decode_order is not None:
            self.decode_order[:d].copy_(meta.decode_order)
        # sequences: each decode row one token (0..rows), the chunks shifted past the padding rows, then
        # padding sequences of no tokens where the chunks end (the padding tokens after them are nobody's)
        self.cu_seqlens_q.fill_(rows + chunk_tokens)
        self.cu_seqlens_q[:rows + 1].copy_(self.rows[:rows + 1])
        torch.add(meta.cu_seqlens_q[d + 1:], shift, out=self.cu_seqlens_q[rows + 1:rows + n - d + 1])
        self.cu_seqlens_k.fill_(0)
        self.cu_seqlens_k[rows:rows + n - d + 1].copy_(meta.cu_seqlens_k[d:])
        width = meta.block_tables.shape[1]
        self.block_tables[:d, :width].copy_(meta.block_tables[:d])
        self.block_tables[rows:rows + n - d, :width].copy_(meta.block_tables[d:])
        self.last.zero_()
        self.last[:d].copy_(self.rows[:d])
        torch.add(meta.cu_seqlens_q[d + 1:], shift - 1, out=self.last[d:n])
        return n

    @torch.inference_mode()
    def replay(self, key: tuple[int, int], input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [n, vocab]: each decode row's, then each chunk's last position's, as the eager step's."""
        n = self._load(key, input_ids, positions, meta)
        if self.emulate:
            self._forward(key)
        else:
            self.graphs[key].replay()
        return self.model.compute_logits(self.hidden[:n])
