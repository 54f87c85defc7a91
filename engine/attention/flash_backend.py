"""flash-attn backend (the handbook's path): varlen prefill with block_table for prefix hits,
flash_attn_with_kvcache for decode. Needs KV block sizes that are multiples of 256."""
from __future__ import annotations

from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

from engine.attention.backend import AttentionBackend
from engine.attention import kv_store
from engine.attention.metadata import AttentionMetadata


class FlashAttention(AttentionBackend):
    name = "flash_attn"

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping):
        kv_store.store_kv(k, v, k_cache, v_cache, slot_mapping)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        if meta.is_prefill:
            if meta.block_tables is not None:      # read the cached prefix (and this chunk) from the pages
                k, v = k_cache, v_cache
            return flash_attn_varlen_func(q, k, v, cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
                                          max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
                                          softmax_scale=scale, causal=True, block_table=meta.block_tables)
        out = flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.context_lens,
                                      block_table=meta.block_tables, softmax_scale=scale, causal=True)
        return out.squeeze(1)
