"""The one seam every attention implementation sits behind."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    name: str = "base"

    @abstractmethod
    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Write new K/V ([T, Hk, D]) into the paged cache ([num_blocks, B, Hk, D]); slot -1 is skipped."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hk, D] (already stored). Returns [T, Hq, D]."""
