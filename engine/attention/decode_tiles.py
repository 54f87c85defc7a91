"""The paged decode's device functions (Triton inlines them into each kernel): a tile's rows and V, the online
softmax's update by a tile, the decode prologue's new token, and a head's splits combined. The split kernel
(engine/attention/triton_kernels.py) and the persistent decode layer (engine/layers/decode_layer.py) share them."""
from __future__ import annotations

import triton
import triton.language as tl

from engine.attention.triton_common import (dot, fp8_quantize, head_halves, norm_rope, online_softmax, rope_at,
                                           v_offset, weight_halves)


@triton.jit
def tile_rows(bt_ptr, n, stride_bt, kstart, end, r_pos, r_head, kvh0, offs_d, PAGE: tl.constexpr, HK: tl.constexpr,
               D: tl.constexpr, PAGE_TILE: tl.constexpr):
    """The decode tile at kstart: each row's offset in the caches (position-major, HPP heads a position) and whether
    its position is before `end`."""
    pos = kstart + r_pos
    valid = pos < end
    if PAGE_TILE:
        blk = tl.load(bt_ptr + n * stride_bt + kstart // PAGE).to(tl.int64)
        slot = blk * PAGE + kstart % PAGE + r_pos
    else:
        blk = tl.load(bt_ptr + n * stride_bt + pos // PAGE, mask=valid, other=0).to(tl.int64)
        slot = blk * PAGE + pos % PAGE
    return slot[:, None] * (HK * D) + (kvh0 + r_head)[:, None] * D + offs_d[None, :], valid


@triton.jit
def v_tile_t(vc_ptr, bt_ptr, n, stride_bt, kstart, end, r_pos, r_head, kvh0, offs_d, PAGE: tl.constexpr,
              HK: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_TILE: tl.constexpr, HPP: tl.constexpr):
    """The decode tile's V [HPP * BLOCK_N, D] from a V cache whose blocks hold each head's positions contiguous
    (kv_quant.v_t), read as [D, rows] and transposed. With PAGE_TILE and one kv head a program the tile is one run of
    BLOCK_N positions a D value inside one page: read unmasked (a position past ``end`` holds a finite value the
    scores' mask already weighs 0) unless the tile has no position before ``end`` (its page may not exist), so
    the runs load whole; else position by position, masked."""
    if PAGE_TILE and HPP == 1:
        blk = tl.load(bt_ptr + n * stride_bt + kstart // PAGE).to(tl.int64)
        inpage = tl.multiple_of(kstart % PAGE, BLOCK_N)
        off = blk * (PAGE * HK * D) + kvh0 * (D * PAGE) + offs_d[:, None] * PAGE + (inpage + r_pos)[None, :]
        live = tl.where(kstart < end, tl.full([D, BLOCK_N], 1, tl.int1), False)     # (a boolean tile: the
        v = tl.load(vc_ptr + off, mask=live, other=0.0)                          # interpreter's mask)
    else:
        pos = kstart + r_pos
        valid = pos < end
        blk = tl.load(bt_ptr + n * stride_bt + pos // PAGE, mask=valid, other=0).to(tl.int64)
        off = v_offset((blk * PAGE + pos % PAGE)[None, :], (kvh0 + r_head)[None, :], offs_d[:, None], HK, D, PAGE, True)
        v = tl.load(vc_ptr + off, mask=valid[None, :], other=0.0)
    return tl.trans(v)


@triton.jit
def tile_update(q, k, v, valid, g_head, r_head, m, l, acc, scale, v_scale, IEEE: tl.constexpr, HPP: tl.constexpr,
                 KV_FP8: tl.constexpr, V_IN_TILE: tl.constexpr):
    """One loaded K/V tile into the online softmax state (m, l, acc): e4m3 tiles converted to q's dtype (and V
    scaled where V_IN_TILE), the scores of each query row's own kv head at the valid positions, p.v added."""
    if KV_FP8:                              # e4m3 -> the dots' dtype (float16, or float32): exact
        k = k.to(q.dtype)
        if V_IN_TILE:
            v = v.to(q.dtype) * tl.cast(v_scale, q.dtype)
        else:
            v = v.to(q.dtype)
    scores = dot(q, tl.trans(k), IEEE) * scale
    keep = valid[None, :]
    if HPP > 1:
        keep = keep & (g_head[:, None] == r_head[None, :])
    scores = tl.where(keep, scores, float("-inf"))
    return online_softmax(scores, v, m, l, acc, IEEE)


@triton.jit
def new_token_inputs(pos_ptr, slot_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, n, dt: tl.constexpr, D: tl.constexpr):
    """What the decode prologue reads for row n besides its qkv row: the new token's slot, the q and k norm weights'
    halves and the RoPE tables' cos and sin at its position (:func:`weight_halves`, :func:`rope_at`; dt the
    activation dtype). Step inputs, weights and tables, none written by an earlier kernel of the step: a kernel may
    load them before its PDL wait (engine/pdl.py)."""
    pos = tl.load(pos_ptr + n)
    slot = tl.load(slot_ptr + n)
    qw1, qw2 = weight_halves(qw_ptr, D)
    kw1, kw2 = weight_halves(kw_ptr, D)
    c, s = rope_at(cos_ptr, sin_ptr, pos, dt, D)
    return slot, qw1, qw2, kw1, kw2, c, s


@triton.jit
def new_token_rows(row, kvh, mask, HK: tl.constexpr, G: tl.constexpr, D: tl.constexpr):
    """The new token's k (as halves, :func:`head_halves`) and v of the kv heads kvh [BLOCK_G] from the packed qkv
    ``row`` (rows where ``mask`` is off read zeros): the loads of :func:`new_token_state`, apart so that a kernel can
    issue them in the same round as its q row's."""
    k1, k2 = head_halves(row, HK * G + kvh, mask, D)
    v = tl.load(row + (HK * G + HK + kvh)[:, None] * D + tl.arange(0, D)[None, :], mask=mask[:, None], other=0.0)
    return k1, k2, v


@triton.jit
def new_token_state(q, k1, k2, v_new, kvh, offs_g, gmask, slot, kw1, kw2, c, s, kc_ptr, vc_ptr, eps, scale,
                    k_scale, v_scale, HK: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
                    KV_FP8: tl.constexpr, V_IN_TILE: tl.constexpr, PAGE: tl.constexpr = 1, VT: tl.constexpr = False):
    """The decode prologue's new token (the split that holds its position): its k (the halves k1, k2 normed by
    k_norm's weight halves kw1, kw2 and roped by the position's c, s: :func:`weight_halves`, :func:`rope_at`) and v,
    as :func:`new_token_rows` loaded them from the packed qkv row, stored at ``slot`` in the paged caches (quantized
    where they are FP8), and the online-softmax state (m, l, acc) of the query rows ``q`` [BLOCK_G, D] started from it
    as the cache now holds it. kvh [BLOCK_G]: each query row's kv head. One writer per kv head (its first query row);
    a padding row (slot < 0) writes nothing (the slot test selects the mask, as in _qk_norm_rope_kernel: the
    interpreter wants a boolean store mask)."""
    offs_d = tl.arange(0, D)
    k_new = norm_rope(k1, k2, kw1, kw2, c, s, eps, D)
    slot = slot.to(tl.int64)
    writer = tl.where(slot >= 0, gmask & (offs_g % G == 0), False)
    dst = slot * (HK * D) + kvh[:, None] * D + offs_d[None, :]
    if KV_FP8:
        k_new = fp8_quantize(k_new, k_scale)
        v_new = fp8_quantize(v_new, v_scale)
    tl.store(kc_ptr + dst, k_new, mask=writer[:, None])
    tl.store(vc_ptr + v_offset(slot, kvh[:, None], offs_d[None, :], HK, D, PAGE, VT), v_new, mask=writer[:, None])
    k_new = k_new.to(q.dtype)                           # as the loop reads a cached position
    v_new = v_new.to(q.dtype)
    if KV_FP8 and V_IN_TILE:
        v_new = v_new * tl.cast(v_scale, q.dtype)
    m = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), 1) * scale     # its weight exp(m - m) = 1
    l = tl.full([BLOCK_G], 1.0, tl.float32)
    acc = v_new.to(tl.float32)
    return m, l, acc


@triton.jit
def combine_splits(acc_ptr, ml_ptr, split_rows, smask, out_at, offs_d, D: tl.constexpr):
    """The fused reduce of one query head, as the reduce kernel combines it: the partials (acc, m, l) of its splits
    ``split_rows`` (where ``smask``) in one load each, read past L1 (other programs wrote them), normalized into
    ``out_at`` [D]."""
    mj = tl.load(ml_ptr + split_rows * 2, mask=smask, other=float("-inf"), cache_modifier=".cg")
    lj = tl.load(ml_ptr + split_rows * 2 + 1, mask=smask, other=0.0, cache_modifier=".cg")
    aj = tl.load(acc_ptr + split_rows[:, None] * D + offs_d[None, :], mask=smask[:, None], other=0.0,
                 cache_modifier=".cg")
    w = tl.where(smask & (lj > 0), tl.exp(mj - tl.max(mj, 0)), 0.0)
    tl.store(out_at + offs_d, (tl.sum(aj * w[:, None], 0) / tl.sum(lj * w, 0)).to(out_at.dtype.element_ty))

