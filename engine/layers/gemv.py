"""One token's projections (batch-1 decode, and a one-token prefill) as a Triton GEMV (CUDA only).

At one row a projection is a read of its weight: the time is the weight's bytes over the memory bandwidth.
cuBLAS reaches 0.49-0.81 of the copy roof on Qwen3-8B's qkv, o and down shapes at M = 1 on an H200
(issue 13's step budget); this kernel streams the weight in [BLOCK_N, BLOCK_K] tiles, every program a
band of BLOCK_N output features over the whole K, products and sums in float32, one rounding at the end.

``silu_mul``: the input is the gate_up output [1, 2K] (gate then up) and the kernel reads silu(gate) * up,
rounded to the activation dtype as SiluAndMul does, so the down projection needs no activation kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, SILU_MUL: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        if EVEN_K:
            x = tl.load(x_ptr + rk)
        else:
            x = tl.load(x_ptr + rk, mask=kmask, other=0.0)
        if SILU_MUL:
            if EVEN_K:
                up = tl.load(x_ptr + K + rk)
            else:
                up = tl.load(x_ptr + K + rk, mask=kmask, other=0.0)
            g = x.to(tl.float32)
            silu = (g / (1.0 + tl.exp(-g))).to(x.dtype)            # F.silu(gate) in the activation dtype
            x = (silu.to(tl.float32) * up.to(tl.float32)).to(x.dtype)   # * up, rounded as SiluAndMul
        if EVEN_K:
            w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=nmask[:, None], other=0.0)
        else:
            w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=nmask[:, None] & kmask[None, :],
                        other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, 1)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=nmask)


def gemv_config(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for an [n, k] weight: wide tiles along K, and enough bands of output
    features that every SM streams several."""
    block_k = 512 if k >= 512 else triton.next_power_of_2(k)
    block_n = 32 if n >= 16384 else 8
    return block_n, block_k, 8 if k > 8192 or n >= 16384 else 4


def gemv(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
    """x [1, K] (silu_mul: [1, 2K]) @ weight[N, K].T -> [1, N] in x's dtype."""
    n, k = weight.shape
    assert x.shape == (1, 2 * k if silu_mul else k) and x.is_contiguous() and weight.stride(1) == 1
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps = gemv_config(n, k)
    _gemv_kernel[(triton.cdiv(n, block_n),)](x, weight, y, n, k, weight.stride(0), BLOCK_N=block_n,
                                             BLOCK_K=block_k, EVEN_K=k % block_k == 0, SILU_MUL=silu_mul,
                                             num_warps=warps)
    return y
