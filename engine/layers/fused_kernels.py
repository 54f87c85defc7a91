"""Fused Triton kernels for the small per-token ops of a decoder layer (CUDA only).

Each reproduces the reference's rounding: intermediate results are rounded to the activation dtype at
the same points as the PyTorch implementation in layernorm.py / rotary.py / activation.py, so fused and
unfused paths agree to the last bit in most positions (tests check closeness, not identity).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine import pdl
from engine.attention.triton_common import fp8_quantize, kv_scales, rms_norm_halves, rope_halves, v_offset

# rms_norm's warp count; the normed GEMV (gemv.py) reduces its row's sum of squares at the same count, since
# Triton's reduction order (and so the float32 sum) follows the layout
NORM_WARPS = 4


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o, N, eps,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    row = tl.program_id(0)
    pdl.enter(PDL)      # engine/pdl.py: nothing before this line reads what an earlier kernel wrote
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)        # residual stream in the model dtype
        tl.store(res_out_ptr + row * stride_r + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = (xf * rstd).to(x.dtype).to(tl.float32) * w
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    n = shape[-1]
    out = torch.empty_like(x2)
    if residual is None:
        _rms_norm_kernel[(x2.shape[0],)](x2, x2, weight, out, out, x2.stride(0), 0, out.stride(0), n, eps,
                                         HAS_RES=False, BLOCK=triton.next_power_of_2(n), num_warps=NORM_WARPS,
                                         **pdl.launch(x))
        return out.view(shape)
    r2 = residual.reshape(-1, n)
    res_out = torch.empty_like(r2)
    _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, out, res_out, x2.stride(0), r2.stride(0), out.stride(0), n, eps,
                                     HAS_RES=True, BLOCK=triton.next_power_of_2(n), num_warps=NORM_WARPS,
                                     **pdl.launch(x))
    return out.view(shape), res_out.view(shape)


# q/k norm + RoPE at fewer tokens than this runs one head per program (grid tokens x heads) rather than one
# token's every head per program: at batch 1 one program per token left 24 heads' norms and rotations to one SM
QK_SPLIT_BELOW = 64


@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, pos_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
                         stride_qkv, eps, kc_ptr, vc_ptr, slot_ptr, HQ: tl.constexpr, HK: tl.constexpr,
                         D: tl.constexpr, BLOCK_H: tl.constexpr, STORE: tl.constexpr, PDL: tl.constexpr = False,
                         k_scale=1.0, v_scale=1.0, KV_FP8: tl.constexpr = False, VT: tl.constexpr = False,
                         PAGE: tl.constexpr = 1):
    """Program (t, g): token t's heads g * BLOCK_H .. (g + 1) * BLOCK_H - 1 of its HQ q heads then HK k heads
    (contiguous in the packed qkv row) as one tile; BLOCK_H is 1 (a head per program) or covers every head.
    STORE: the roped k heads, and the v heads of the same index (the qkv row's columns after q and k), also go
    to the paged cache ([blocks, block_size, HK, D], contiguous) at row slot_mapping[t], as _store_kv_kernel
    writes them; a padding token (slot < 0) writes nothing there. KV_FP8: the cache is e4m3 and gets k / k_scale
    and v / v_scale (fp8_quantize, as _store_kv_kernel); VT: V's blocks hold each head's positions contiguous
    (kv_quant.v_t, PAGE positions a block)."""
    pdl.enter(PDL)      # engine/pdl.py: nothing before this line reads what an earlier kernel wrote
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)     # 0..HQ-1: q heads, HQ..HQ+HK-1: k heads
    half = tl.arange(0, D // 2)
    live = h < HQ + HK
    is_q = h < HQ
    base = qkv_ptr + t * stride_qkv + h[:, None] * D
    x1 = tl.load(base + half[None, :], mask=live[:, None], other=0.0)
    x2 = tl.load(base + D // 2 + half[None, :], mask=live[:, None], other=0.0)
    w1 = tl.where(is_q[:, None], tl.load(qw_ptr + half)[None, :], tl.load(kw_ptr + half)[None, :]).to(tl.float32)
    w2 = tl.where(is_q[:, None], tl.load(qw_ptr + D // 2 + half)[None, :],
                  tl.load(kw_ptr + D // 2 + half)[None, :]).to(tl.float32)
    n1, n2 = rms_norm_halves(x1, x2, w1, w2, eps, D)
    dt = x1.dtype
    pos = tl.load(pos_ptr + t)
    c = tl.load(cos_ptr + pos * D + half).to(dt).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * D + half).to(dt).to(tl.float32)[None, :]
    o1, o2 = rope_halves(n1, n2, c, s, dt)
    q_dst = q_out_ptr + (t * HQ + h)[:, None] * D
    k_dst = k_out_ptr + (t * HK + h - HQ)[:, None] * D
    q_mask = (is_q & live)[:, None]
    k_mask = ((~is_q) & live)[:, None]
    tl.store(q_dst + half[None, :], o1, mask=q_mask)
    tl.store(q_dst + D // 2 + half[None, :], o2, mask=q_mask)
    tl.store(k_dst + half[None, :], o1, mask=k_mask)
    tl.store(k_dst + D // 2 + half[None, :], o2, mask=k_mask)
    if STORE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        # the slot test selects the tile's mask rather than being and-ed into it: `k_mask & (slot >= 0)` splats a
        # scalar into the tile, which Triton's interpreter holds as int32, and the interpreter of triton >= 3.7
        # refuses a store whose mask is not boolean ("mask has unsupported dtype"); compiled, both are one select
        keep = tl.where(slot >= 0, k_mask, False)
        row = slot * (HK * D) + (h - HQ)[:, None] * D                 # k head j's and v head j's place
        v_src = qkv_ptr + t * stride_qkv + (HK + h)[:, None] * D      # v head j: column (HQ + HK + j) * D
        v1 = tl.load(v_src + half[None, :], mask=keep)
        v2 = tl.load(v_src + D // 2 + half[None, :], mask=keep)
        k1, k2 = o1, o2
        if KV_FP8:
            k1, k2 = fp8_quantize(o1, k_scale), fp8_quantize(o2, k_scale)
            v1, v2 = fp8_quantize(v1, v_scale), fp8_quantize(v2, v_scale)
        tl.store(kc_ptr + row + half[None, :], k1, mask=keep)
        tl.store(kc_ptr + row + D // 2 + half[None, :], k2, mask=keep)
        v_head = (h - HQ)[:, None]
        tl.store(vc_ptr + v_offset(slot, v_head, half[None, :], HK, D, PAGE, VT), v1, mask=keep)
        tl.store(vc_ptr + v_offset(slot, v_head, D // 2 + half[None, :], HK, D, PAGE, VT), v2, mask=keep)


def qk_heads_per_program(tokens: int, heads: int) -> int:
    """The kernel's BLOCK_H: one head per program below QK_SPLIT_BELOW tokens, else a token's every head."""
    return 1 if tokens < QK_SPLIT_BELOW else triton.next_power_of_2(heads)


def qk_norm_rope(qkv: torch.Tensor, positions: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, hq: int, hk: int, d: int, eps: float,
                 k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                 slot_mapping: torch.Tensor | None = None, heads_per_program: int | None = None,
                 k_scale: float | None = None, v_scale: float | None = None):
    """-> q [T, hq, d], k [T, hk, d]. With k_cache, v_cache and slot_mapping, also stores each token's k and v
    in the paged cache (what backend.store_kv would write, quantized where the cache is FP8, by each cache's
    own scale unless k_scale/v_scale are given: engine/attention/kv_quant.py; slot -1 skipped), so no store
    kernel runs.
    heads_per_program: the kernel's tile (default qk_heads_per_program; the tests compare both tiles)."""
    t = qkv.shape[0]
    q = torch.empty(t, hq, d, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(t, hk, d, dtype=qkv.dtype, device=qkv.device)
    store = k_cache is not None
    if store:
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[-2:] == (hk, d)
        assert qkv.stride(-1) == 1 and qkv.shape[-1] == (hq + 2 * hk) * d and slot_mapping.shape == (t,)
    hpp = heads_per_program or qk_heads_per_program(t, hq + hk)
    _qk_norm_rope_kernel[(t, triton.cdiv(hq + hk, hpp))](
        qkv, positions, q_weight, k_weight, cos, sin, q, k, qkv.stride(0), eps,
        k_cache if store else k, v_cache if store else k, slot_mapping if store else positions,
        HQ=hq, HK=hk, D=d, BLOCK_H=hpp, STORE=store, num_warps=1 if hpp == 1 else 4,
        PAGE=k_cache.shape[1] if store else 1,
        **(kv_scales(k_cache, v_cache, k_scale, v_scale) if store else {}), **pdl.launch(qkv))
    return q, k


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, N, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    row = tl.program_id(0)
    pdl.enter(PDL)      # engine/pdl.py: nothing before this line reads what an earlier kernel wrote
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < N
    g = tl.load(x_ptr + row * stride_x + col, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + N + col, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(out_ptr + row * N + col, (act * u.to(tl.float32)).to(g.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    block = 1024
    _silu_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](x2, out, x2.stride(0), n, BLOCK=block, **pdl.launch(x))
    return out.view(*x.shape[:-1], n)
