"""Linear layers that know their tensor-parallel shard (column, packed column, row)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import SINGLE, ParallelContext
from engine.errors import ConfigError


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ConfigError(f"weight shape {tuple(loaded.shape)} does not fit parameter {tuple(param.shape)}")
    param.data.copy_(loaded)


def few_rows(x: torch.Tensor, rows: int) -> bool:
    """Activations of at most `rows` tokens (one: batch-1 decode; up to MAX_GEMV_ROWS with LAB_GEMV_ROWS): the
    GEMV's case (engine/layers/gemv.py)."""
    return x.dim() == 2 and 1 <= x.shape[0] <= rows and x.is_contiguous()


class LinearBase(nn.Module):
    fused = False               # the runner turns on the Triton GEMV for one-token inputs on CUDA
    gemv_rows = 1               # ... and for up to this many tokens (the runner's LAB_GEMV_ROWS)
    skinny_rows = 0             # the split-K GEMM for 2 up to this many tokens (the runner's LAB_SKINNY_GEMM; 0: off)

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: ParallelContext):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        raise NotImplementedError

    def takes_gemv(self, x: torch.Tensor) -> bool:
        """One token (up to gemv_rows) on the GEMV path (fused ops on, no bias): the case of ``matmul``'s GEMV and
        of the prologues that run inside it (a column layer's ``normed``, a row layer's ``silu_mul``)."""
        return self.fused and self.bias is None and few_rows(x, self.gemv_rows)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.takes_gemv(x):
            from engine.layers.gemv import gemv
            return gemv(x, self.weight)
        if self.fused and self.bias is None and self.skinny_rows and few_rows(x, self.skinny_rows):
            from engine.layers.skinny_gemm import skinny_gemm
            return skinny_gemm(x, self.weight)
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks: y_rank = x @ W[rows of rank].T; no communication."""
    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: ParallelContext = SINGLE):
        assert out_features % tp.world_size == 0
        super().__init__(in_features, out_features // tp.world_size, bias, tp)

    def weight_loader(self, param, loaded, shard_id=None):
        size = param.shape[0]
        default_weight_loader(param, loaded.narrow(0, self.tp.rank * size, size))

    def normed(self, x: torch.Tensor, norm, residual: torch.Tensor | None = None):
        """self(norm(x, residual)) in one GEMV (engine/layers/gemv.py::normed_gemv): the norm as the fused
        rms_norm kernel computes it. -> (y, the new residual x + residual, or None without a residual).
        Every rank holds the whole row x (a column layer): no communication."""
        from engine.layers.gemv import normed_gemv
        return normed_gemv(x, self.weight, norm.weight, norm.eps, residual)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs packed in one matmul (gate and up)."""
    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False, tp: ParallelContext = SINGLE):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, tp)

    def weight_loader(self, param, loaded, shard_id=None):
        ws = self.tp.world_size
        offset = sum(self.output_sizes[:shard_id]) // ws
        size = self.output_sizes[shard_id] // ws
        target = param.data.narrow(0, offset, size)
        default_weight_loader(target, loaded.narrow(0, self.tp.rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections packed in one matmul; each rank keeps its heads of each."""
    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 tp: ParallelContext = SINGLE):
        self.head_dim = head_dim
        self.num_heads = num_heads // tp.world_size
        self.num_kv_heads = num_kv_heads // tp.world_size
        super().__init__(hidden, (num_heads + 2 * num_kv_heads) * head_dim, bias, tp)

    def shard_range(self, shard_id: str) -> tuple[int, int]:
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        return {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]

    def weight_loader(self, param, loaded, shard_id=None):
        offset, size = self.shard_range(shard_id)
        target = param.data.narrow(0, offset, size)
        default_weight_loader(target, loaded.narrow(0, self.tp.rank * size, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial sums are combined with an all-reduce."""
    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: ParallelContext = SINGLE):
        assert in_features % tp.world_size == 0
        super().__init__(in_features // tp.world_size, out_features, bias, tp)

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:   # bias: added once, on rank 0
            default_weight_loader(param, loaded if self.tp.rank == 0 else torch.zeros_like(loaded))
            return
        size = param.shape[1]
        default_weight_loader(param, loaded.narrow(1, self.tp.rank * size, size))

    def forward(self, x: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
        """silu_mul (the GEMV's rows, see takes_gemv): x is gate_up and the GEMV reads SiluAndMul()(x)."""
        if silu_mul:
            from engine.layers.gemv import gemv
            return self.tp.all_reduce(gemv(x, self.weight, silu_mul=True))
        return self.tp.all_reduce(self.matmul(x))
