"""Per-step attention inputs, passed explicitly from the runner through the model (no global context)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    is_prefill: bool
    slot_mapping: torch.Tensor                     # [T] int64, -1 = do not write (padding)
    # prefill (varlen)
    cu_seqlens_q: torch.Tensor | None = None       # [N+1] int32
    cu_seqlens_k: torch.Tensor | None = None       # [N+1] int32
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    # prefix hits (prefill) and decode
    block_tables: torch.Tensor | None = None       # [N, max_blocks] int32, -1 padded
    context_lens: torch.Tensor | None = None       # [N] int32 (decode)
    decode_order: torch.Tensor | None = None       # [N] int32 (decode): the rows, longest context first
    # host copies for backends that loop per sequence
    seqlens_q: list[int] = field(default_factory=list)
    seqlens_k: list[int] = field(default_factory=list)

    def summary(self) -> dict:
        def lst(t):
            return None if t is None else t.tolist()
        return {
            "is_prefill": self.is_prefill,
            "slot_mapping": lst(self.slot_mapping),
            "cu_seqlens_q": lst(self.cu_seqlens_q),
            "cu_seqlens_k": lst(self.cu_seqlens_k),
            "max_seqlen_q": self.max_seqlen_q,
            "max_seqlen_k": self.max_seqlen_k,
            "block_tables": lst(self.block_tables),
            "context_lens": lst(self.context_lens),
        }
