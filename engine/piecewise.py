"""Piecewise CUDA graphs: any step of at most the largest token bucket replays captured graphs, attention
included in the step but not in the graphs (vLLM's piecewise graphs, without torch.compile).

A full graph (engine/graph.py) fixes the attention call's shape: a decode graph holds one query per row, a
prefill graph fresh prompts only. A step that mixes decodes with prefill chunks, or prefills after a
prefix-cache hit, has a different attention shape every time, so it ran eagerly: hundreds of kernel launches
from Python (a cache hit cost more than the prefill it saved). Here the forward is cut at each layer's
attention call: the pieces between (embedding, norms, projections, q/k norm + RoPE + KV store, MLP, and at the
end the gather of each sequence's last row) are captured per token bucket, and attention runs eagerly between
their replays on the step's own metadata; the LM head runs after the last piece on the step's sequences. A step
is then ~2 x layers launches instead of ~10 x layers.

How the cut is made: while a bucket is captured, every attention layer's backend is a :class:`_Cut`: at the
attention call it copies q/k/v into static buffers, ends the graph being captured, begins the next one, and
returns the static output buffer, which the next piece reads. Every piece of a bucket shares one memory pool
(and every bucket the largest one's), and replays in the order it was captured: a tensor that crosses a cut
(the residual stream) keeps its address. Padding rows (bucket > tokens) write no KV (slot -1) and are never
read by attention or the LM head.

Without CUDA (tests) ``emulate=True`` runs the same cut live at every step: the same static buffers, padding,
copies and LM-head rows, only nothing is captured.
"""
from __future__ import annotations

import time

import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.graph import budget_buckets

#: token buckets of piecewise steps (at most the step budget; a step of more tokens runs eagerly): powers of two to
#: 2,048, then every 1,024 to 8,192 (a step past 2,048 pads less than half of itself). An eager step launches every
#: kernel from Python: on an H100 prefills of 3,072-7,168 tokens took 14-43 ms of GPU span eagerly, host-bound,
#: against 9.6 ms for 3,072 tokens and 14.7 ms for 5,120 replayed; past about 10,000 tokens the GPU's own work
#: hides the launches (12,288 tokens took 28.9 ms eagerly, 16,384 took 38.4 eagerly and 42.2 replayed), so larger
#: steps stay eager (docs/MEASURED.md, "piecewise buckets past 2,048 tokens")
PIECEWISE_TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048, 3072, 4096, 5120, 6144, 7168, 8192)


def piecewise_buckets(max_num_batched_tokens: int) -> list[int]:
    """The buckets a step budget can use, and the budget itself where it falls between two (up to the largest)."""
    return budget_buckets(PIECEWISE_TOKENS, max_num_batched_tokens)


class _Cut(AttentionBackend):
    """An attention layer's backend while a bucket is captured (or emulated): the KV store stays in the
    piece; the attention call is where one piece ends and the next begins."""

    def __init__(self, owner: "PiecewiseGraphs", inner: AttentionBackend):
        self.owner, self.inner, self.name = owner, inner, inner.name

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping):
        self.inner.store_kv(k, v, k_cache, v_cache, slot_mapping)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        return self.owner._cut(q, k, v)


class PiecewiseGraphs:
    def __init__(self, model, backend: AttentionBackend, buckets: list[int], max_seqs: int, device: str,
                 emulate: bool = False):
        self.model, self.backend = model, backend
        self.buckets = sorted(buckets)
        self.max_seqs = max_seqs
        self.emulate = emulate
        self.layers = model.attention_layers()
        first = self.layers[0]
        t = self.buckets[-1]
        dtype = next(model.parameters()).dtype
        with torch.device(device):
            self.input_ids = torch.zeros(t, dtype=torch.int64)
            self.positions = torch.zeros(t, dtype=torch.int64)
            self.slot_mapping = torch.full((t,), -1, dtype=torch.int64)
            self.last = torch.zeros(min(t, max_seqs), dtype=torch.int64)       # each sequence's last row
            # those rows' hidden states: the last piece gathers them here and the LM head runs after the replay on
            # the step's sequences only (not on every row a bucket could hold: 256 rows of vocabulary GEMM a step)
            self.hidden = torch.zeros(min(t, max_seqs), model.lm_head.weight.shape[1], dtype=dtype)
            self.q = torch.zeros(t, first.num_heads, first.head_dim, dtype=dtype)
            self.k = torch.zeros(t, first.num_kv_heads, first.head_dim, dtype=dtype)
            self.v = torch.zeros_like(self.k)
            self.out = torch.zeros_like(self.q)
        self.pieces: dict[int, list] = {}           # bucket -> its graphs, one more than the layers
        self.capture_seconds = 0.0
        self._tokens = 0                            # the bucket being captured or emulated
        self._live: tuple[AttentionMetadata, int] | None = None    # emulate: the step's metadata and tokens
        self._layer = 0                             # emulate: the attention layer the next cut runs
        self._capture: dict | None = None           # while capturing: the graph, the pieces so far, the pool

    def rows(self, bucket: int) -> int:
        """LM-head rows a bucket's graph computes (its sequences at most)."""
        return min(bucket, self.max_seqs)

    def bucket_for(self, num_tokens: int, num_seqs: int) -> int | None:
        for t in self.buckets:
            if t >= num_tokens and self.rows(t) >= num_seqs and (self.emulate or t in self.pieces):
                return t
        return None

    # -- the cut -----------------------------------------------------------------------------------
    def _cut(self, q, k, v):
        t = self._tokens
        self.q[:t].copy_(q), self.k[:t].copy_(k), self.v[:t].copy_(v)
        if self._live is not None:                  # emulated step: the attention runs here
            meta, n = self._live
            self._attend(self.layers[self._layer], meta, n)
            self._layer += 1
        elif self._capture is not None:             # end this piece, begin the next in the same pool
            self._end_piece()
            self._capture["graph"] = torch.cuda.CUDAGraph()
            self._capture["graph"].capture_begin(pool=self._capture["pool"])
        return self.out[:t]

    def _end_piece(self) -> None:
        """End the graph being captured and keep it as the bucket's next piece (the first one's pool is the pool
        of every piece after it)."""
        cap = self._capture
        cap["graph"].capture_end()
        cap["pieces"].append(cap["graph"])
        if cap["pool"] is None:
            cap["pool"] = cap["graph"].pool()

    def _attend(self, layer, meta: AttentionMetadata, n: int) -> None:
        out = self.backend.forward(self.q[:n], self.k[:n], self.v[:n], layer.k_cache, layer.v_cache, meta, layer.scale)
        self.out[:n].copy_(out)

    def _forward(self, t: int) -> torch.Tensor:
        """The bucket's forward, its sequences' last rows gathered into the static ``hidden`` buffer."""
        meta = AttentionMetadata(is_prefill=True, slot_mapping=self.slot_mapping[:t])
        hidden = self.model(self.input_ids[:t], self.positions[:t], meta)
        rows = self.rows(t)
        return torch.index_select(hidden, 0, self.last[:rows], out=self.hidden[:rows])

    def _cut_layers(self):
        cut = _Cut(self, self.backend)
        for layer in self.layers:
            layer.backend = cut

    def _restore_layers(self):
        for layer in self.layers:
            layer.backend = self.backend

    # -- capture ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """Every bucket, largest first, into one memory pool (pool: another graph set's, to share it)."""
        t0 = time.perf_counter()
        self._cut_layers()
        try:
            stream = torch.cuda.Stream()
            for t in reversed(self.buckets):
                self._tokens = t
                self._forward(t)                    # compiles and autotunes outside the capture
                torch.cuda.synchronize()
                with torch.cuda.stream(stream):
                    graph = torch.cuda.CUDAGraph()
                    graph.capture_begin(pool=pool)
                    self._capture = {"graph": graph, "pieces": [], "pool": pool}
                    self._forward(t)
                    self._end_piece()
                    cap = self._capture
                    pool = cap["pool"]
                torch.cuda.synchronize()
                self._capture = None
                assert len(cap["pieces"]) == len(self.layers) + 1, "a piece per attention call, and the last"
                self.pieces[t] = cap["pieces"]
        finally:
            self._capture = None
            self._restore_layers()
        self.capture_seconds = time.perf_counter() - t0

    # -- a step -------------------------------------------------------------------------------------
    def _load(self, input_ids, positions, meta: AttentionMetadata) -> tuple[int, int]:
        t = input_ids.shape[0]
        n = meta.cu_seqlens_q.shape[0] - 1
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.slot_mapping.fill_(-1)
        self.slot_mapping[:t].copy_(meta.slot_mapping)
        self.last.zero_()
        torch.sub(meta.cu_seqlens_q[1:], 1, out=self.last[:n])
        return t, n

    @torch.inference_mode()
    def replay(self, bucket: int, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [n, vocab] of the last position of each of the step's n sequences."""
        t, n = self._load(input_ids, positions, meta)
        if self.emulate:
            self._emulated(bucket, t, meta)
        else:
            pieces = self.pieces[bucket]
            for layer, piece in zip(self.layers, pieces):
                piece.replay()
                self._attend(layer, meta, t)
            pieces[-1].replay()
        return self.model.compute_logits(self.hidden[:n])

    def _emulated(self, bucket: int, t: int, meta: AttentionMetadata) -> None:
        self._cut_layers()
        self._tokens, self._live, self._layer = bucket, (meta, t), 0
        try:
            self._forward(bucket)
        finally:
            self._live = None
            self._restore_layers()
