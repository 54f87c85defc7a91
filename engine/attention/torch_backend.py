"""Reference backend in plain PyTorch: paged KV, causal varlen prefill, prefix hits, decode. CPU and CUDA."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention import kv_quant
from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata

try:
    from engine.attention.kv_store import store_kv as _triton_store
except ImportError:          # no triton (CPU machines): boolean-mask writes
    _triton_store = None


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` positions of one sequence from the paged cache: [length, Hk, D] (dequantized where
    the cache is FP8: engine/attention/kv_quant.py)."""
    block_size = cache.shape[1]
    n = (length + block_size - 1) // block_size
    return kv_quant.read(cache, block_table[:n].long()).flatten(0, 1)[:length]


class TorchAttention(AttentionBackend):
    name = "torch"

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping):
        if k_cache.is_cuda and _triton_store is not None:   # no host sync: capturable in a CUDA graph
            _triton_store(k, v, k_cache, v_cache, slot_mapping)
            return
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        if slots.numel() == 0:
            return
        kv_quant.write(k_cache, slots, k[keep])         # quantized where the cache is FP8
        kv_quant.write(v_cache, slots, v[keep])

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        if not meta.is_prefill:
            return self._decode(q, k_cache, v_cache, meta, scale)
        d = meta.num_decodes
        if not d:
            return self._prefill(q, k, v, k_cache, v_cache, meta, scale)
        # a mixed step: its leading one-token rows batched as a decode, the prefill rows one by one
        out = torch.empty_like(q)
        out[:d] = self._decode(q[:d], k_cache, v_cache, meta.decode_part(), scale)
        if d < q.shape[0]:
            out[d:] = self._prefill(q[d:], k[d:], v[d:], k_cache, v_cache, meta.prefill_part(), scale)
        return out

    @staticmethod
    def _attend(q, k, v, mask, scale, causal: bool):
        # q [Tq, Hq, D], k/v [Tk, Hk, D] -> [Tq, Hq, D]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, is_causal=causal and mask is None, scale=scale, enable_gqa=True)
        return out.transpose(0, 1)

    def _prefill(self, q, k, v, k_cache, v_cache, meta, scale):
        out = torch.empty_like(q)
        q_start = 0
        for i, (lq, lk) in enumerate(zip(meta.seqlens_q, meta.seqlens_k)):
            qi = q[q_start:q_start + lq]
            if lk == lq:          # nothing cached before this chunk: attend to the new K/V only
                ki, vi = k[q_start:q_start + lq], v[q_start:q_start + lq]
                out[q_start:q_start + lq] = self._attend(qi, ki, vi, None, scale, causal=True)
            else:                 # cached prefix: read it (and this chunk) through the block table
                table = meta.block_tables[i]
                ki, vi = gather_kv(k_cache, table, lk), gather_kv(v_cache, table, lk)
                q_pos = torch.arange(lk - lq, lk, device=q.device)
                mask = torch.arange(lk, device=q.device)[None, :] <= q_pos[:, None]
                out[q_start:q_start + lq] = self._attend(qi, ki, vi, mask, scale, causal=False)
            q_start += lq
        return out

    def _decode(self, q, k_cache, v_cache, meta, scale):
        # one query per sequence; batch all sequences with a length mask
        n, max_blocks = meta.block_tables.shape
        block_size = k_cache.shape[1]
        tables = meta.block_tables.long().clamp_min(0)
        keys = kv_quant.read(k_cache, tables).flatten(1, 2)        # [N, max_blocks*B, Hk, D], dequantized
        vals = kv_quant.read(v_cache, tables).flatten(1, 2)
        lens = meta.context_lens.long()
        mask = torch.arange(max_blocks * block_size, device=q.device)[None, :] < lens[:, None]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),                                  # [N, Hq, 1, D]
            keys.transpose(1, 2), vals.transpose(1, 2),      # [N, Hk, L, D]
            attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True)
        out = out.squeeze(2)
        # rows with context length 0 (graph padding) attend to nothing: keep them finite zeros
        return torch.where((lens > 0)[:, None, None], out, torch.zeros_like(out))
