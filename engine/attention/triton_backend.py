"""Triton backend (CUDA): our paged decode and paged prefill kernels, Triton KV writes.

A fresh prefill (nothing cached in the batch) attends to the new K/V directly with PyTorch's
fused causal attention; prefix hits and chunk continuations read the cache through the block table.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.attention import triton_kernels as tk


class TritonAttention(AttentionBackend):
    name = "triton"

    def __init__(self) -> None:
        self.sm_count = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping):
        tk.store_kv(k, v, k_cache, v_cache, slot_mapping)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        if not meta.is_prefill:
            return tk.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                   meta.max_seqlen_k, self.sm_count)
        if meta.block_tables is not None:
            return tk.paged_prefill(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                    meta.cu_seqlens_k, meta.max_seqlen_q, scale)
        return fresh_prefill(q, k, v, meta, scale)


def fresh_prefill(q, k, v, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Per-sequence causal attention on the new K/V (GQA heads expanded so the fused kernel applies)."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    out = torch.empty_like(q)
    start = 0
    for length in meta.seqlens_q:
        sl = slice(start, start + length)
        out[sl] = F.scaled_dot_product_attention(
            q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1),
            is_causal=True, scale=scale).transpose(0, 1)
        start += length
    return out
