"""A few rows times a weight (a small decode batch's projections) as a split-K Triton GEMM (CUDA, opt-in).

At 24 rows cuBLAS ran Qwen3-0.6B's o and down projections (1,024 output features) at a fifth of their weights'
read on an H200 (`labkit bench --workload step-budget --batch 24`, docs/MEASURED.md): an output that narrow
makes few output tiles, so few SMs stream the weight. Here the grid is (output tiles, K splits): every program
multiplies all the rows (one tensor-core tile of BLOCK_M rows, the rows past M masked) by one [BLOCK_N, K / SPLIT_K]
slice of the weight, so a narrow output still spreads its weight over about one wave of programs. Each program
writes its float32 partial; the last of an output tile's splits to count itself in (an int32 counter per tile,
reset by that program for the next launch) adds the partials in split order and writes y, rounded once to x's
dtype. The sums run in another order than cuBLAS's, so y is the product to float32 rounding, not cuBLAS's bits.

Its first weight tile loads before the PDL wait (engine/pdl.py): weights never change within a step. Taken by
``LinearBase.matmul`` for 2..``skinny_rows`` rows where the runner turns it on (``LAB_SKINNY_GEMM``,
engine/levers.py); the GEMV of gemv.py keeps one row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine import pdl
from engine.attention.triton_common import dot
from engine.layers import MAX_SKINNY_ROWS

BLOCK_N = 64
BLOCK_K = 128
WAVES = 1              # splits so that output tiles x splits fill the GPU about this many times
COUNTERS = 1 << 14     # output-tile counters per device (N / BLOCK_N of the widest projection at most)
_counters: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_x, stride_w, stride_y,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                   K_SPLIT: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = False):
    """y[M, N] = x[M, K] @ w[N, K].T; program (n tile, k split) sums K_SPLIT columns of K (a multiple of BLOCK_K)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = pid_k * K_SPLIT + tl.arange(0, BLOCK_K)
    mmask = rm < M
    nmask = rn < N
    w = tl.load(w_ptr + rn[:, None] * stride_w + rk[None, :], mask=nmask[:, None] & (rk < K)[None, :], other=0.0)
    pdl.enter(PDL)      # engine/pdl.py: x below may be what the kernel before this one wrote
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kk in tl.static_range(0, K_SPLIT, BLOCK_K):
        if kk > 0:
            w = tl.load(w_ptr + rn[:, None] * stride_w + (rk + kk)[None, :],
                        mask=nmask[:, None] & ((rk + kk) < K)[None, :], other=0.0)
        x = tl.load(x_ptr + rm[:, None] * stride_x + (rk + kk)[None, :],
                    mask=mmask[:, None] & ((rk + kk) < K)[None, :], other=0.0)
        acc += dot(x, tl.trans(w), IEEE)          # float32 inputs: full products, not tf32
    out = y_ptr + rm[:, None] * stride_y + rn[None, :]
    omask = mmask[:, None] & nmask[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=omask)
    else:
        tile = part_ptr + (rm[:, None] * N + rn[None, :])
        tl.store(tile + pid_k * M * N, acc, mask=omask)
        tl.debug_barrier()                              # the whole partial is written before the count
        if tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel") == SPLIT_K - 1:
            tl.atomic_xchg(count_ptr + pid_n, 0)        # every split has counted: ready for the next launch
            total = tl.load(tile, mask=omask, other=0.0)
            for s in tl.static_range(1, SPLIT_K):
                total += tl.load(tile + s * M * N, mask=omask, other=0.0)
            tl.store(out, total.to(y_ptr.dtype.element_ty), mask=omask)


def counters(device: torch.device) -> torch.Tensor | None:
    """The output tiles' counters on `device` (zeros; every launch leaves them at zero), allocated on the first
    call outside a CUDA graph capture; None inside a capture before that (the launch then takes one split)."""
    c = _counters.get(device)
    if c is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        c = _counters[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return c


def split_k(n: int, k: int, sm_count: int, waves: int = WAVES, block_n: int = BLOCK_N, block_k: int = BLOCK_K) -> int:
    """K splits of an [n, k] weight: enough that output tiles x splits fill `waves` x sm_count programs, each split
    at least one BLOCK_K chunk (a power of two)."""
    tiles = triton.cdiv(n, block_n)
    want = max(1, triton.cdiv(waves * sm_count, tiles))
    chunks = triton.cdiv(k, block_k)
    split = 1
    while split * 2 <= min(want, chunks):
        split *= 2
    return split


def block_m(m: int) -> int:
    """Rows of the tensor-core tile: 16 (the smallest a dot takes) or the next power of two."""
    return max(16, triton.next_power_of_2(m))


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, split: int | None = None) -> torch.Tensor:
    """x [M, K] (M up to MAX_SKINNY_ROWS, contiguous; the engine sends 2 and more) @ weight[N, K].T -> [M, N] in x's
    dtype. split: K splits (None: from the device's SM count, :func:`split_k`)."""
    m, k = x.shape
    n = weight.shape[0]
    assert 1 <= m <= MAX_SKINNY_ROWS and weight.shape[1] == k and x.is_contiguous() and weight.stride(1) == 1, (x.shape, weight.shape)
    if split is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
        split = split_k(n, k, sms)
    tiles = triton.cdiv(n, BLOCK_N)
    count = counters(x.device) if split > 1 else None
    if count is None or tiles > count.numel():
        split, count = 1, None
    k_split = triton.cdiv(triton.cdiv(k, split), BLOCK_K) * BLOCK_K
    split = triton.cdiv(k, k_split)               # no split without columns of its own
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    _skinny_kernel[(tiles, split)](x, weight, y, part, count if count is not None else y, m, n, k, x.stride(0),
                                   weight.stride(0), y.stride(0), BLOCK_M=block_m(m), BLOCK_N=BLOCK_N,
                                   BLOCK_K=BLOCK_K, SPLIT_K=split, K_SPLIT=k_split,
                                   IEEE=x.dtype == torch.float32, num_warps=4, **pdl.launch(x))
    return y
