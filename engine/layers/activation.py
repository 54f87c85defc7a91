import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    fused = False               # the runner turns on the Triton kernel on CUDA

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            from engine.layers.fused_kernels import silu_and_mul
            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
