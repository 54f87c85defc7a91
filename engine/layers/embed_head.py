"""Vocabulary-parallel embedding and LM head."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import SINGLE, ParallelContext
from engine.layers.linear import default_weight_loader, few_rows


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int, tp: ParallelContext = SINGLE):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard_size = (vocab_size + tp.world_size - 1) // tp.world_size
        self.start = tp.rank * self.shard_size
        self.end = min(self.start + self.shard_size, vocab_size)
        self.weight = nn.Parameter(torch.empty(self.shard_size, dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        part = loaded[self.start:self.end]
        param.data.zero_()
        default_weight_loader(param.data.narrow(0, 0, part.shape[0]), part)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return F.embedding(ids, self.weight)
        mask = (ids >= self.start) & (ids < self.end)
        y = F.embedding(torch.where(mask, ids - self.start, 0), self.weight)
        y = y * mask.unsqueeze(-1).to(y.dtype)
        return self.tp.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the vocabulary; each rank computes its slice and rank slices are gathered."""
    fused = False               # the runner turns on the Triton GEMV for one-token inputs on CUDA
    gemv_rows = 1               # ... and for up to this many rows (the runner's LAB_GEMV_ROWS)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.fused and few_rows(hidden, self.gemv_rows):    # batch-1 decode: the head is a read of its weight
            from engine.layers.gemv import gemv
            logits = gemv(hidden, self.weight)
        else:
            logits = F.linear(hidden, self.weight)
        if self.tp.enabled:
            logits = self.tp.all_gather_last_dim(logits)
        return logits[..., : self.vocab_size]
