"""One token's projections (batch-1 decode, and a one-token prefill) as a Triton GEMV (CUDA only).

At one row a projection is a read of its weight: the time is the weight's bytes over the memory bandwidth.
cuBLAS reaches 0.49-0.81 of the copy roof on Qwen3-8B's qkv, o and down shapes at M = 1 on an H200
(`labkit bench --workload step-budget`); this kernel streams the weight in [BLOCK_N, BLOCK_K] tiles, every program a
band of BLOCK_N output features over the whole K, products and sums in float32, one rounding at the end.

``silu_mul``: the input is the gate_up output [1, 2K] (gate then up) and the kernel reads silu(gate) * up,
rounded to the activation dtype as SiluAndMul does, so the down projection needs no activation kernel.

A few rows (a small decode batch, ``LAB_GEMV_ROWS``: linear.gemv_rows) take ``_rows_gemv_kernel``: every weight
tile is read once and multiplied by each row in turn (per row a [BLOCK_N] partial sum per K chunk, float32), with the
same prologues; its sums run in another order than the one-row kernel's, so a row's result is the product to
float32 rounding, not the one-row kernel's bits. One row keeps ``_gemv_kernel``.

``normed_gemv``: the input is the residual stream before its RMSNorm (input_layernorm before qkv,
post_attention_layernorm before gate_up) and every program first reads the whole row for its rstd, then
normalizes each x chunk as it streams its band: the same float32 sums and roundings at the same points as
``fused_kernels._rms_norm_kernel``, so the result is bit-identical to ``rms_norm`` then ``gemv``. The
row's sum of squares is reduced in the same layout as that kernel's, which needs its warp count
(``NORM_WARPS``: Triton's reduction order follows the layout): the normed launch keeps the plain tile's
per-thread share at that warp count.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine import pdl
from engine.layers.fused_kernels import NORM_WARPS
from engine.layers import MAX_GEMV_ROWS


@triton.jit
def _load_k(ptrs, kmask, EVEN_K: tl.constexpr):
    """One K chunk of a row: unmasked where K is a multiple of the tile, else masked (zeros past K)."""
    if EVEN_K:
        v = tl.load(ptrs)
    else:
        v = tl.load(ptrs, mask=kmask, other=0.0)
    return v


@triton.jit
def _load_w(w_ptr, rn, rk, nmask, kmask, stride_wn, EVEN_K: tl.constexpr):
    """The weight tile [BLOCK_N, BLOCK_K] at rows rn, columns rk (zeros past N, and past K unless EVEN_K)."""
    if EVEN_K:
        w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=nmask[:, None], other=0.0)
    else:
        w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
    return w


@triton.jit
def _x_chunk(x_ptr, res_ptr, nw_ptr, h_ptr, rk, kmask, rstd, pid, K, EVEN_K: tl.constexpr, SILU_MUL: tl.constexpr,
             NORM: tl.constexpr, HAS_RES: tl.constexpr):
    """The input's chunk at columns rk as the weight multiplies it: normed (and h = x + residual stored by
    program 0) or silu(gate) * up, rounded at the reference's points."""
    x = _load_k(x_ptr + rk, kmask, EVEN_K)
    if NORM:
        if HAS_RES:
            r = _load_k(res_ptr + rk, kmask, EVEN_K)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)      # h, the new residual
            if pid == 0:                                                # one writer; never in place
                tl.store(h_ptr + rk, x, mask=kmask)
        nw = _load_k(nw_ptr + rk, kmask, EVEN_K)
        x = ((x.to(tl.float32) * rstd).to(x.dtype).to(tl.float32) * nw.to(tl.float32)).to(x.dtype)
    if SILU_MUL:
        up = _load_k(x_ptr + K + rk, kmask, EVEN_K)
        g = x.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(x.dtype)            # F.silu(gate) in the activation dtype
        x = (silu.to(tl.float32) * up.to(tl.float32)).to(x.dtype)   # * up, rounded as SiluAndMul
    return x


@triton.jit
def _row_rstd(x_ptr, res_ptr, K, eps, BLOCK_ROW: tl.constexpr, HAS_RES: tl.constexpr):
    """1 / RMS of one whole row (h = x + residual, rounded), as _rms_norm_kernel computes it."""
    offs = tl.arange(0, BLOCK_ROW)
    rmask = offs < K
    row = tl.load(x_ptr + offs, mask=rmask, other=0.0)
    if HAS_RES:
        row = (row.to(tl.float32) + tl.load(res_ptr + offs, mask=rmask, other=0.0).to(tl.float32)).to(row.dtype)
    rf = row.to(tl.float32)
    return 1.0 / tl.sqrt(tl.sum(rf * rf, 0) / K + eps)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, SILU_MUL: tl.constexpr, res_ptr=None, nw_ptr=None, h_ptr=None, eps=0.0,
                 NORM: tl.constexpr = False, HAS_RES: tl.constexpr = False, BLOCK_ROW: tl.constexpr = 1,
                 PEEL: tl.constexpr = True, PDL: tl.constexpr = False):
    """PEEL (rows of one or two K chunks, ``peel_first_chunk``): the first chunk is peeled off the loop, its
    weight tile loaded before pdl.enter (with PDL it streams in while the kernel before this one finishes), the
    loop over the other chunks one body. Rows of more chunks run one loop from 0 after the wait. The tile chosen
    inside the loop instead (``w = w_first if k0 == 0 else load``) made PDL a loss at K = 4096+, where the loop
    runs 4-12 chunks; peeling only rows of one or two chunks was the fastest of the three ways at both Qwen3 sizes
    (docs/MEASURED.md, "Tuning history"). Both ways acc starts from the first chunk's products (0 + p = p): the
    same sums in the same order."""
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    rk = tl.arange(0, BLOCK_K)
    kmask = rk < K
    if PEEL:
        w = _load_w(w_ptr, rn, rk, nmask, kmask, stride_wn, EVEN_K)     # a weight: nothing earlier writes it
    pdl.enter(PDL)      # engine/pdl.py: everything below may read what the kernel before this one wrote
    rstd = 0.0
    if NORM:
        rstd = _row_rstd(x_ptr, res_ptr, K, eps, BLOCK_ROW, HAS_RES)
    if PEEL:
        x = _x_chunk(x_ptr, res_ptr, nw_ptr, h_ptr, rk, kmask, rstd, pid, K, EVEN_K, SILU_MUL, NORM, HAS_RES)
        acc = w.to(tl.float32) * x.to(tl.float32)[None, :]
        start = BLOCK_K
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        start = 0
    for k0 in range(start, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        x = _x_chunk(x_ptr, res_ptr, nw_ptr, h_ptr, rk, kmask, rstd, pid, K, EVEN_K, SILU_MUL, NORM, HAS_RES)
        w = _load_w(w_ptr, rn, rk, nmask, kmask, stride_wn, EVEN_K)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, 1)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _rows_gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_wn, stride_x, stride_y, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SILU_MUL: tl.constexpr, ROWS: tl.constexpr,
                      res_ptr=None, nw_ptr=None, h_ptr=None, eps=0.0, NORM: tl.constexpr = False,
                      HAS_RES: tl.constexpr = False, BLOCK_ROW: tl.constexpr = 1, PDL: tl.constexpr = False):
    """M rows (2 <= M <= ROWS, ROWS a power of two: one compiled variant per power) of x [M, K] (silu_mul: [M, 2K];
    row stride stride_x, also the residual's and h's) times a band of BLOCK_N output features: each weight tile
    loaded once, then each row's chunk (normed or silu(gate) * up as in _x_chunk) multiplies it. Rows past M
    re-read row M - 1 (no masked loads in the unmasked EVEN_K path) and are never stored. res_ptr and h_ptr are
    always pointers (x and y where unused), so every row's offset applies to them alike."""
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    rows = tl.arange(0, ROWS)
    pdl.enter(PDL)      # engine/pdl.py: everything below may read what the kernel before this one wrote
    rstd = tl.zeros([ROWS], dtype=tl.float32)
    if NORM:        # each row's own rstd
        for m in tl.static_range(ROWS):
            r = tl.minimum(m, M - 1) * stride_x
            rstd = tl.where(rows == m, _row_rstd(x_ptr + r, res_ptr + r, K, eps, BLOCK_ROW, HAS_RES), rstd)
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        w = _load_w(w_ptr, rn, rk, nmask, kmask, stride_wn, EVEN_K).to(tl.float32)
        for m in tl.static_range(ROWS):
            r = tl.minimum(m, M - 1) * stride_x
            rstd_m = tl.sum(tl.where(rows == m, rstd, 0.0), 0)
            x = _x_chunk(x_ptr + r, res_ptr + r, nw_ptr, h_ptr + r, rk, kmask, rstd_m, pid, K, EVEN_K, SILU_MUL,
                         NORM, HAS_RES)
            part = tl.sum(w * x.to(tl.float32)[None, :], 1)
            acc = tl.where(rows[:, None] == m, acc + part[None, :], acc)
    tl.store(y_ptr + rows[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & nmask[None, :])


def peel_first_chunk(k: int, block_k: int) -> bool:
    """Whether the kernel loads a row's first weight tile before its PDL wait: at one or two K chunks (every
    Qwen3-0.6B row), not at more (every Qwen3-8B row; see _gemv_kernel)."""
    return triton.cdiv(k, block_k) <= 2


def gemv_config(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for an [n, k] weight: wide tiles along K, and enough bands of output features
    that every SM streams several. Each row is the fastest setting an H200 sweep found for the shapes it serves
    (`labkit bench --workload gemv --sweep`: every tile setting per projection, its calls in a CUDA graph with PDL
    on): K >= 4096 at Qwen3-8B's shapes, K <= 3072 at Qwen3-0.6B's, and the 2 x 4096 tiles (one chunk, peeled) at
    Qwen3-8B's LM head and o; the shapes a sweep left at the general row were within a few percent of their best.
    The sweeps' figures: docs/MEASURED.md, "Tuning history"."""
    if n >= 65536 and k >= 4096:        # an LM head at K = 4096
        return 2, 4096, 8
    if n >= 16384:
        return 32, 512, 8
    if k > 8192:
        return 4, 1024, 4
    if k >= 4096 and n <= 4096:
        return 2, 4096, 8
    if n <= 2048 and k >= 2048:         # Qwen3-0.6B's o [1024, 2048] 3.65 -> 2.13 us, down [1024, 3072] 6.30 -> 3.48
        return 4, 2048, 8
    if n >= 6144 and k <= 2048:         # its gate_up [6144, 1024] (normed: 16 bands at 4 warps) 6.78 -> 5.08 us
        return 16, 512, 4
    return 8, (512 if k >= 512 else triton.next_power_of_2(k)), 4


def normed_tile(config: tuple[int, int, int]) -> tuple[int, int, int]:
    """The tile normed_gemv launches for a gemv_config row: the same elements per thread at NORM_WARPS."""
    block_n, block_k, warps = config
    return max(1, block_n * NORM_WARPS // warps), block_k, NORM_WARPS


def _rows_launch(x, weight, y, block_n: int, block_k: int, warps: int, res=None, h=None, **kw) -> None:
    """_rows_gemv_kernel over x's rows (2..MAX_GEMV_ROWS) into y (res, h: the residual and the new one, else x and
    y stand in)."""
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    assert 2 <= m <= MAX_GEMV_ROWS, m
    _rows_gemv_kernel[(triton.cdiv(n, block_n),)](x, weight, y, m, n, k, weight.stride(0), x.stride(0), y.stride(0),
                                                  BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
                                                  ROWS=triton.next_power_of_2(m), res_ptr=x if res is None else res,
                                                  h_ptr=y if h is None else h, num_warps=warps, **kw,
                                                  **pdl.launch(x))


def gemv(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool = False,
         config: tuple[int, int, int] | None = None, peel: bool | None = None) -> torch.Tensor:
    """x [M, K] (silu_mul: [M, 2K]; M at most MAX_GEMV_ROWS) @ weight[N, K].T -> [M, N] in x's dtype. config, peel: a
    tile in place of gemv_config's, the first chunk peeled or not in place of peel_first_chunk's rule (labkit bench
    --workload gemv; one row)."""
    n, k = weight.shape
    m = x.shape[0]
    assert x.dim() == 2 and x.shape[1] == (2 * k if silu_mul else k) and x.is_contiguous() and weight.stride(1) == 1
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps = config or gemv_config(n, k)
    if m > 1:
        _rows_launch(x, weight, y, block_n, block_k, warps, SILU_MUL=silu_mul)
        return y
    peel = peel_first_chunk(k, block_k) if peel is None else peel
    _gemv_kernel[(triton.cdiv(n, block_n),)](x, weight, y, n, k, weight.stride(0), BLOCK_N=block_n,
                                             BLOCK_K=block_k, EVEN_K=k % block_k == 0, SILU_MUL=silu_mul,
                                             PEEL=peel, num_warps=warps, **pdl.launch(x))
    return y


def normed_gemv(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                residual: torch.Tensor | None = None,
                config: tuple[int, int, int] | None = None,
                peel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm(x [+ residual]) [M, K] @ weight[N, K].T -> ([M, N], the new residual h = x + residual or None); at
    one row bit-identical to ``rms_norm(x, norm_weight, eps, residual)`` then ``gemv``."""
    n, k = weight.shape
    m = x.shape[0]
    assert x.dim() == 2 and x.shape[1] == k and x.is_contiguous() and weight.stride(1) == 1
    assert norm_weight.shape == (k,)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    h = None
    if residual is not None:
        assert residual.shape == x.shape and residual.is_contiguous() and residual.dtype == x.dtype
        h = torch.empty_like(x)
    block_n, block_k, _ = normed_tile(config or gemv_config(n, k))
    if m > 1:
        _rows_launch(x, weight, y, block_n, block_k, NORM_WARPS, residual, h, SILU_MUL=False, nw_ptr=norm_weight,
                     eps=eps, NORM=True, HAS_RES=residual is not None, BLOCK_ROW=triton.next_power_of_2(k))
        return y, h
    peel = peel_first_chunk(k, block_k) if peel is None else peel
    _gemv_kernel[(triton.cdiv(n, block_n),)](x, weight, y, n, k, weight.stride(0), BLOCK_N=block_n,
                                             BLOCK_K=block_k, EVEN_K=k % block_k == 0, SILU_MUL=False,
                                             res_ptr=x if residual is None else residual, nw_ptr=norm_weight,
                                             h_ptr=y if h is None else h, eps=eps, NORM=True,
                                             HAS_RES=residual is not None, BLOCK_ROW=triton.next_power_of_2(k),
                                             PEEL=peel, num_warps=NORM_WARPS, **pdl.launch(x))
    return y, h
