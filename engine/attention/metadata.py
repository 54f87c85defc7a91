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
    # a step with prefix reads (is_prefill and block_tables): its first num_decodes rows are one query token each
    # (decodes, scheduled first in a mixed step); context_lens / decode_order then describe those rows only, so a
    # backend may run them through its decode kernel and the rest through its prefill (decode_part, prefill_part)
    num_decodes: int = 0

    def decode_part(self) -> "AttentionMetadata":
        """The first num_decodes rows as a decode step's metadata (made once per step: every layer asks)."""
        part = self.__dict__.get("_decode_part")
        if part is None:
            part = self.__dict__["_decode_part"] = self._decode_part()
        return part

    def _decode_part(self) -> "AttentionMetadata":
        d = self.num_decodes
        return AttentionMetadata(is_prefill=False, slot_mapping=self.slot_mapping[:d], max_seqlen_q=1,
                                 max_seqlen_k=max(self.seqlens_k[:d]), block_tables=self.block_tables[:d],
                                 context_lens=self.context_lens, decode_order=self.decode_order,
                                 seqlens_q=self.seqlens_q[:d], seqlens_k=self.seqlens_k[:d])

    def prefill_part(self) -> "AttentionMetadata":
        """The rows after the first num_decodes, as a prefill with prefix reads whose query offsets
        (cu_seqlens_q) still count from the step's first token."""
        d = self.num_decodes
        return AttentionMetadata(is_prefill=True, slot_mapping=self.slot_mapping[d:], cu_seqlens_q=self.cu_seqlens_q[d:],
                                 cu_seqlens_k=self.cu_seqlens_k[d:], max_seqlen_q=max(self.seqlens_q[d:]),
                                 max_seqlen_k=max(self.seqlens_k[d:]), block_tables=self.block_tables[d:],
                                 seqlens_q=self.seqlens_q[d:], seqlens_k=self.seqlens_k[d:])

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
            "num_decodes": self.num_decodes,
        }
