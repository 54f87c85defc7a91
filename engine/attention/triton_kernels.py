"""Our Triton paged decode, split along the context (the KV store is engine/attention/kv_store.py, the prefill
kernels engine/attention/prefill_kernels.py).

Cache layout (per layer): [num_blocks, block_size, num_kv_heads, head_dim], contiguous.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine import l2_prefetch, pdl
from engine.attention.decode_tiles import (combine_splits, new_token_inputs, new_token_rows, new_token_state,
                                          tile_rows, tile_update, v_tile_t)
from engine.attention.triton_common import kv_scales, roped, to_f16
from engine.attention.splits import (DECODE_BLOCK_N, DECODE_KV_PER_PROG,  # noqa: F401
                                     DECODE_NUM_WARPS, DECODE_WAVES, choose_splits,  # (tests use tk.choose_splits)
                                     kv_per_program)
from engine.attention import splits


# -- decode -------------------------------------------------------------------------------------------
@triton.jit
def _decode_row(order_ptr, ORDERED: tl.constexpr):
    """The sequence a decode program reads: its grid row, or through ``order`` (longest context first)."""
    if ORDERED:
        n = tl.load(order_ptr + tl.program_id(1))
    else:
        n = tl.program_id(1)
    return n


# Arguments that change from step to step (split sizes, block-table width) are not specialized on, so
# one compiled variant serves every step instead of a compile on the first step of each new value.
@triton.jit(do_not_specialize=["split_len", "num_splits", "stride_bt", "stride_on", "stride_oh"])
def _decode_split_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, acc_ptr, ml_ptr, out_ptr,
                         scale, split_len, num_splits, stride_qn, stride_qh, stride_bt, stride_on, stride_oh,
                         PAGE: tl.constexpr, HK: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr,
                         D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, DIRECT: tl.constexpr,
                         HPP: tl.constexpr = 1, PAGE_TILE: tl.constexpr = False, order_ptr=None,
                         ORDERED: tl.constexpr = False, lock_ptr=None, FUSED_REDUCE: tl.constexpr = False,
                         BLOCK_S: tl.constexpr = 2, PDL: tl.constexpr = False, v_scale=1.0,
                         KV_FP8: tl.constexpr = False, V_IN_TILE: tl.constexpr = False, qkv_ptr=None,
                         stride_qkv=0, pos_ptr=None, qw_ptr=None, kw_ptr=None, cos_ptr=None, sin_ptr=None,
                         slot_ptr=None, eps=0.0, k_scale=1.0, PROLOGUE: tl.constexpr = False,
                         PREFETCH: tl.constexpr = False, l2_p0=None, l2_n0=0, l2_p1=None, l2_n1=0, l2_p2=None,
                         l2_n2=0, l2_p3=None, l2_n3=0, L2_REGIONS: tl.constexpr = 0, VT: tl.constexpr = False):
    """One (group of HPP kv heads, sequence, split) program. DIRECT (a single split): write the normalized
    output itself (zeros for a padding row), so no reduce kernel runs.

    The grid's fastest axis is the head group, so a sequence's programs start together and read the same
    pages at about the same time (2% off the nano-vllm workload's wide decode steps on an H200 against the
    sequence fastest: docs/MEASURED.md, "Tuning history").

    HPP kv heads per program: a tile holds BLOCK_N positions x HPP heads as HPP * BLOCK_N rows (position
    major, so one position's heads are one contiguous HPP * D run); the HPP * G query rows share one dot
    and each row keeps only the columns of its own kv head. PAGE_TILE (BLOCK_N divides PAGE; tiles start
    at multiples of BLOCK_N): a tile lies inside one page, so one scalar block-table load per tile
    replaces the per-position gather.

    ORDERED: the grid's sequence axis goes through ``order`` (the rows longest context first), so the
    longest programs start first and the short ones fill in behind them.

    FUSED_REDUCE (several splits): no reduce kernel. Each program writes its partial, then counts itself
    in on its (sequence, head group)'s counter; the last of the row's splits with context to read
    combines the partials as _decode_reduce_kernel does (each query head's BLOCK_S splits in one load, not
    one split after another: at batch 1 x 1024 a split-by-split loop of dependent loads made the decode
    some 12 us per layer for 1 us of K/V), writes the output and resets the counter to zero for the next
    launch. Split 0 of a padding row (context 0) writes its zeros.

    KV_FP8: the caches hold e4m3 (engine/attention/kv_quant.py); each tile is converted for its dots, the K
    scale is already in ``scale`` and the V scale multiplies the accumulator once. A bf16 or f16 query's dots
    run in float16 (:func:`to_f16`): sm_90 converts e4m3 pairs to f16 pairs in one instruction, and the
    compiled bf16 path added an f16 -> bf16 conversion per value (PTX of the 256 x 1,024 decode: 64
    e4m3x2 -> f16x2 and 128 f16 -> bf16 conversions per thread and tile, the latter gone in float16).
    V_IN_TILE (FP8): the V scale multiplies each converted V tile instead of the accumulator. The compiled
    kernel then converts V before it crosses shared memory into the P.V dot's transposed operand (16-bit
    ldmatrix.trans); without it, V crosses as bytes and each thread gathers them one byte load at a time (64
    ld.shared.b8 per thread and tile in the same PTX), for 64 f16 multiplies instead. Which is faster is the
    attention bench's to say (`--kv-cache-dtype fp8`); a scale rounded to float16 on the way.

    VT (FP8): the V cache's blocks hold each head's positions contiguous (kv_quant.v_t), so a V tile reaches the
    P.V dot as position runs (:func:`v_tile_t`) instead of the bytes of one position at a time.

    PROLOGUE (the decode prologue, :class:`NewTokens`): no q/k-norm + RoPE kernel and no KV store ran before this
    one. Each program norms and ropes its own query heads from the row's packed qkv (:func:`roped`); the
    context loop stops before the row's last position (the new token's, not in the cache yet), and the program
    whose split holds that position makes the new token's k and v, stores them in the cache (quantized where it
    is FP8) and starts its softmax state from that token (its k and v as the cache now holds them) before the
    loop: folded in after it, the token's tiles stayed live through the loop (156 registers a thread against the
    plain kernel's 105 in the sm_90 build, so three programs an SM instead of four).
    PREFETCH (with PROLOGUE; several splits and the reduce kernel, :class:`NewTokens`): the split's first K/V tile
    is loaded before the PDL wait. With the prologue nothing the kernels before this one write is in it (the cache
    before the new position was written by earlier steps, the block table and context lengths are the step's
    inputs), so at batch 1, where a split is one tile, the whole read overlaps the qkv projection's tail. So are the
    row's position and slot (step inputs), the q/k norm weights and the RoPE tables at that position: loaded before
    the wait too, so that after it the prologue's one dependent load is the qkv row's: the split that holds the new
    token issues its k and v rows' loads with its q heads' (:func:`new_token_rows`), not after its q is made.
    L2_REGIONS (with the prologue, where the reduce kernel runs; LAB_L2_PREFETCH): every program, after the wait,
    asks L2 for its share of up to four weights the layer's next kernels read (engine/l2_prefetch.py).

    Why one function over the house's 80 lines: a kernel is one program, and its phases share what they
    compute: the program's coordinates (n, s, kvh0, ctx), the offsets and masks (heads, gmask, offs_d,
    offs_r), the online-softmax state (m, l, acc) carried through the context loop, and the constexpr
    switches (DIRECT, PAGE_TILE, HPP, FUSED_REDUCE) that drop whole branches at compile time. Triton
    inlines ``@triton.jit`` helpers, so cutting the body into them would cost no speed, but each piece
    would take ten or more of those values and hand the loop state back as a tuple, and the early exit of
    a split past its context must stay here (a ``return`` in a helper ends the helper, not the program).
    What repeats is a helper already (``dot``); the rest reads in order: coordinates, early exit, the
    context loop, then the direct write or the partial and the fused reduce."""
    ROWS: tl.constexpr = HPP * BLOCK_N
    kvh0 = tl.program_id(0) * HPP
    offs_d = tl.arange(0, D)
    offs_r = tl.arange(0, ROWS)
    r_pos = offs_r // HPP                       # the tile's position of each row
    r_head = offs_r % HPP                       # its kv head within the program's group
    if PREFETCH:            # before the wait: only the step's inputs and the cache of earlier steps (see above)
        n = _decode_row(order_ptr, ORDERED)
        ctx = tl.load(ctx_ptr + n)
        start = tl.program_id(2) * split_len
        first_end = tl.minimum(ctx - 1, start + split_len)
        first_off, first_valid = tile_rows(bt_ptr, n, stride_bt, start, first_end, r_pos, r_head, kvh0, offs_d,
                                           PAGE, HK, D, PAGE_TILE)
        first_k = tl.load(kc_ptr + first_off, mask=first_valid[:, None], other=0.0)
        if VT:
            first_v = v_tile_t(vc_ptr, bt_ptr, n, stride_bt, start, first_end, r_pos, r_head, kvh0, offs_d, PAGE, HK,
                               D, BLOCK_N, PAGE_TILE, HPP)
        else:
            first_v = tl.load(vc_ptr + first_off, mask=first_valid[:, None], other=0.0)
        slot, qw1, qw2, kw1, kw2, c, s_ = new_token_inputs(pos_ptr, slot_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, n,
                                                           qkv_ptr.dtype.element_ty, D)     # (see PREFETCH above)
    pdl.enter(PDL)      # engine/pdl.py: nothing before this line reads what an earlier kernel wrote
    if L2_REGIONS > 0:      # before any program's early exit: all of the grid's programs share the chunks
        l2_prefetch.prefetch(l2_p0, l2_n0, l2_p1, l2_n1, l2_p2, l2_n2, l2_p3, l2_n3, L2_REGIONS)
    if not PREFETCH:
        n = _decode_row(order_ptr, ORDERED)
        ctx = tl.load(ctx_ptr + n)
        start = tl.program_id(2) * split_len
    s = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_G)
    gmask = offs_g < HPP * G
    heads = kvh0 * G + offs_g
    if not DIRECT:
        if start >= ctx:           # a split past this sequence's context: nothing to read (the reduce skips it)
            if FUSED_REDUCE:
                if ctx == 0:
                    if s == 0:     # padding row (graph bucket): a finite zero output
                        tl.store(out_ptr + n * stride_on + heads[:, None] * stride_oh + offs_d[None, :],
                                 tl.zeros([BLOCK_G, D], tl.float32).to(out_ptr.dtype.element_ty),
                                 mask=gmask[:, None])
            return
    g_head = tl.minimum(offs_g // G, HPP - 1)   # each query row's kv head (padding rows: the last one)
    if PROLOGUE:            # the new token (position ctx - 1) comes from the qkv row, not the cache
        row = qkv_ptr + n.to(tl.int64) * stride_qkv
        holds_new = (ctx > 0) & (ctx - 1 >= start) & (ctx - 1 < start + split_len)     # this split holds it
        if PREFETCH:        # its k and v rows in the q row's round: one dependent load after the wait, not two
            k1, k2, v_new = new_token_rows(row, kvh0 + g_head, tl.where(holds_new, gmask, False), HK, G, D)
        else:
            slot, qw1, qw2, kw1, kw2, c, s_ = new_token_inputs(pos_ptr, slot_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, n,
                                                               qkv_ptr.dtype.element_ty, D)
        q = roped(row, heads, gmask, qw1, qw2, c, s_, eps, D)
        end = tl.minimum(ctx - 1, start + split_len)
    else:
        q = tl.load(q_ptr + n * stride_qn + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=gmask[:, None], other=0.0)
        end = tl.minimum(ctx, start + split_len)
    if KV_FP8 and not IEEE:     # the dots in float16: e4m3 -> f16 is one conversion per pair, -> bf16 two more
        q = to_f16(q)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    if PROLOGUE:            # the new token first (its k and v made, stored and folded in), so none of it is live
        if holds_new:       # through the loop
            if not PREFETCH:
                k1, k2, v_new = new_token_rows(row, kvh0 + g_head, gmask, HK, G, D)
            m, l, acc = new_token_state(q, k1, k2, v_new, kvh0 + g_head, offs_g, gmask, slot, kw1, kw2, c, s_, kc_ptr,
                                        vc_ptr, eps, scale, k_scale, v_scale, HK, G, D, BLOCK_G, KV_FP8, V_IN_TILE, PAGE,
                                        VT)
    loop_start = start
    if PREFETCH:            # the first tile, loaded before the wait
        if start < end:
            m, l, acc = tile_update(q, first_k, first_v, first_valid, g_head, r_head, m, l, acc, scale, v_scale, IEEE,
                                    HPP, KV_FP8, V_IN_TILE)
        loop_start = start + BLOCK_N
    for kstart in range(loop_start, end, BLOCK_N):
        kv_off, valid = tile_rows(bt_ptr, n, stride_bt, kstart, end, r_pos, r_head, kvh0, offs_d, PAGE, HK, D,
                                  PAGE_TILE)
        k = tl.load(kc_ptr + kv_off, mask=valid[:, None], other=0.0)
        if VT:
            v = v_tile_t(vc_ptr, bt_ptr, n, stride_bt, kstart, end, r_pos, r_head, kvh0, offs_d, PAGE, HK, D, BLOCK_N,
                         PAGE_TILE, HPP)
        else:
            v = tl.load(vc_ptr + kv_off, mask=valid[:, None], other=0.0)
        m, l, acc = tile_update(q, k, v, valid, g_head, r_head, m, l, acc, scale, v_scale, IEEE, HPP, KV_FP8,
                                V_IN_TILE)
    if KV_FP8 and not V_IN_TILE:
        acc = acc * v_scale                     # sum p * (v * s) = s * sum p * v: once per row
    if DIRECT:
        o = tl.where(l[:, None] > 0, acc / tl.maximum(l, 1e-30)[:, None], 0.0)
        tl.store(out_ptr + n * stride_on + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=gmask[:, None])
    else:
        rows = (n * (HK * G) + heads) * num_splits
        base = rows + s
        tl.store(acc_ptr + base[:, None] * D + offs_d[None, :], acc, mask=gmask[:, None])
        tl.store(ml_ptr + base * 2, m, mask=gmask)
        tl.store(ml_ptr + base * 2 + 1, l, mask=gmask)
        if FUSED_REDUCE:
            tl.debug_barrier()                          # the whole partial is written before the count
            lock = lock_ptr + n * tl.num_programs(0) + tl.program_id(0)
            active = tl.minimum(num_splits, tl.cdiv(ctx, split_len))
            if tl.atomic_add(lock, 1, sem="acq_rel") == active - 1:
                tl.atomic_xchg(lock, 0)                 # every split of this launch has counted
                offs_s = tl.arange(0, BLOCK_S)
                smask = offs_s < active
                for gi in tl.static_range(HPP * G):     # each query head: its splits in one load each
                    combine_splits(acc_ptr, ml_ptr, (n * (HK * G) + kvh0 * G + gi) * num_splits + offs_s, smask,
                                   out_ptr + n * stride_on + (kvh0 * G + gi) * stride_oh, offs_d, D)


@triton.jit(do_not_specialize=["num_splits", "split_len"])
def _decode_reduce_kernel(acc_ptr, ml_ptr, ctx_ptr, out_ptr, num_splits, split_len, stride_on, stride_oh,
                          HQ: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False):
    """Combine a row's splits; only the splits that hold part of its context were written. The context length (a
    step input, as the split kernel's PREFETCH reads it) is loaded before the PDL wait."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, D)
    ctx = tl.load(ctx_ptr + n)
    pdl.enter(PDL)      # engine/pdl.py: nothing before this line reads what an earlier kernel of the step wrote
    out_ptrs = out_ptr + n * stride_on + h * stride_oh + offs_d
    if ctx == 0:               # padding row (graph bucket): a finite zero output
        tl.store(out_ptrs, tl.zeros([D], tl.float32).to(out_ptr.dtype.element_ty))
        return
    offs_s = tl.arange(0, BLOCK_S)
    smask = offs_s < tl.minimum(num_splits, tl.cdiv(ctx, split_len))
    base = (n * HQ + h) * num_splits + offs_s
    m = tl.load(ml_ptr + base * 2, mask=smask, other=float("-inf"))
    l = tl.load(ml_ptr + base * 2 + 1, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(smask & (l > 0), tl.exp(m - m_max), 0.0)
    acc = tl.load(acc_ptr + base[:, None] * D + offs_d[None, :], mask=smask[:, None], other=0.0)
    num = tl.sum(acc * w[:, None], 0)
    den = tl.sum(l * w, 0)
    tl.store(out_ptrs, (num / den).to(out_ptr.dtype.element_ty))


@dataclass
class NewTokens:
    """A decode step's new token per row as the qkv projection left it, for the decode prologue (the split
    kernel's PROLOGUE): q/k-norm + RoPE of the row's query heads and of its new k, and the store of that k and
    v in the paged cache, inside the attention kernel; no q/k-norm + RoPE kernel runs before it (at batch 1 a
    kernel of 24 one-head programs per layer). Qwen3's q/k norm (fused_kernels._qk_norm_rope_kernel's math)."""
    qkv: torch.Tensor            # [N, (Hq + 2 Hk) * D]: q heads, k heads, v heads (columns contiguous)
    positions: torch.Tensor      # [N]: each row's position (its context length - 1)
    q_weight: torch.Tensor       # [D]: q_norm's weight
    k_weight: torch.Tensor       # [D]: k_norm's weight
    cos: torch.Tensor            # [max_position, D]: RotaryEmbedding's float32 tables
    sin: torch.Tensor
    eps: float
    slot_mapping: torch.Tensor   # [N]: each row's new k/v slot (-1: written nowhere)
    num_heads: int               # Hq
    # each split's first K/V tile loaded before the PDL wait (the kernel's PREFETCH), in the small decodes that
    # combine their splits with the reduce kernel (batch 1-4 at 8 kv heads: splits of one tile each). Not wider:
    # the tile held through the wait costs registers, at 256 x 1,024 157 a thread under triton 3.9 (3 programs an
    # SM) against 106 without (tools/kernel_resources.py); the variants stay the decode's own (DIRECT, FUSED_REDUCE)
    prefetch: bool = True
    # weights the layer's next kernels read, asked of L2 by the same decodes (LAB_L2_PREFETCH, engine/l2_prefetch.py)
    l2: tuple = ()


def paged_decode(q: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, max_len: int, sm_count: int, block_n: int = DECODE_BLOCK_N,
                 num_warps: int | None = None, num_stages: int | None = None, waves: int = DECODE_WAVES,
                 kv_per_prog: int = DECODE_KV_PER_PROG, page_tile: bool | None = None,
                 order: torch.Tensor | None = None, fuse_reduce: bool | None = None,
                 k_scale: float | None = None, v_scale: float | None = None,
                 fp8_v_in_tile: bool | None = None, max_registers: int | None = None,
                 new: NewTokens | None = None) -> torch.Tensor:
    """q [N, Hq, D] -> out [N, Hq, D]; reads context_lens[i] positions of seq i through its block table.
    new (q None): the decode prologue; each row's q and its new token's k and v are made from ``new.qkv`` inside
    the kernel, which also stores that k and v (:class:`NewTokens`).
    FP8 caches (engine/attention/kv_quant.py) are dequantized by k_scale and v_scale (None: the caches' own);
    num_warps, num_stages, page_tile, fp8_v_in_tile, max_registers (a cap on registers a thread, Triton's maxnreg; 0: no
    cap): None takes the cache's own default (engine/attention/splits.py: the DECODE_* knobs for a cache in the model's
    dtype, the DECODE_FP8_* knobs for an e4m3 one); fp8_v_in_tile: the V scale on each V tile, not on the accumulator
    (the kernel's V_IN_TILE).
    order (int32 [N], a permutation of the rows): the order in which the rows' programs are launched
    (AttentionMetadata.decode_order: longest context first); the result does not depend on it.
    fuse_reduce: several splits are combined by their last program (no reduce kernel) where the counters
    exist (:func:`decode_locks`), else by the reduce kernel; None: by the batch's program count
    (:func:`engine.attention.splits.fuse_reduce`: a small batch takes the reduce kernel, which PDL starts
    under the split kernel's tail).

    block_n positions per tile (each position finds its own page, so any page size works); the tuning
    knobs (block_n, num_warps, num_stages, waves) are swept by `labkit bench --workload attention --sweep`,
    and their defaults live in engine/attention/splits.py (docs/MEASURED.md keeps the sweeps that chose
    them). kv_per_prog: kv heads per program (the largest divisor of the kv heads
    not above it, :func:`engine.attention.splits.kv_per_program`); page_tile: one block-table load per
    tile where block_n divides the page size (else the per-position path). Both are swept by
    `labkit bench --workload attention --sweep` (every default lives in engine/attention/splits.py).
    """
    _, page, hk, d = k_cache.shape
    if new is not None:
        assert q is None and new.qkv.stride(-1) == 1 and new.qkv.shape[-1] == (new.num_heads + 2 * hk) * d
        q = new.qkv                                  # (its pointer only: the kernel reads the heads from it)
        n, hq = q.shape[0], new.num_heads
    else:
        n, hq, _ = q.shape
    g = hq // hk
    hpp = kv_per_program(hk, kv_per_prog)
    num_splits, split_len = choose_splits(n, hk // hpp, max_len, block_n, sm_count, waves)
    direct = num_splits == 1
    acc = torch.empty(0 if direct else n * hq * num_splits * d, dtype=torch.float32, device=q.device)
    ml = torch.empty(0 if direct else n * hq * num_splits * 2, dtype=torch.float32, device=q.device)
    out = torch.empty(n, hq, d, dtype=q.dtype, device=q.device)
    programs = n * (hk // hpp)                                           # per split
    if fuse_reduce is None:
        fuse_reduce = splits.fuse_reduce(programs)
    locks = decode_locks(q.device) if fuse_reduce and not direct else None
    fused = locks is not None and programs <= locks.numel()
    fp8 = kv_scales(k_cache, v_cache, k_scale, v_scale)
    given = {"page_tile": page_tile, "num_warps": num_warps, "num_stages": num_stages, "fp8_v_in_tile": fp8_v_in_tile,
             "max_registers": max_registers}
    knobs = splits.decode_defaults(bool(fp8)) | {k: v for k, v in given.items() if v is not None}
    page_tile, num_warps, num_stages = knobs["page_tile"], knobs["num_warps"], knobs["num_stages"]
    fp8_v_in_tile, max_registers = knobs.get("fp8_v_in_tile", False), knobs.get("max_registers", 0)
    if fp8:
        scale, fp8 = scale * fp8["k_scale"], {"v_scale": fp8["v_scale"], "KV_FP8": True, "V_IN_TILE": fp8_v_in_tile,
                                              "VT": fp8.get("VT", False),
                                              **({"k_scale": fp8["k_scale"]} if new is not None else {})}
    prologue = {} if new is None else dict(
        qkv_ptr=new.qkv, stride_qkv=new.qkv.stride(0), pos_ptr=new.positions, qw_ptr=new.q_weight,
        kw_ptr=new.k_weight, cos_ptr=new.cos, sin_ptr=new.sin, slot_ptr=new.slot_mapping, eps=new.eps, PROLOGUE=True,
        PREFETCH=new.prefetch and not direct and not fused,
        **(l2_prefetch.launch_args(new.l2) if not direct and not fused else {}))
    _decode_split_kernel[(hk // hpp, n, num_splits)](                   # a sequence's heads launch together
        q, k_cache, v_cache, block_tables, context_lens, acc, ml, out, scale, split_len, num_splits,
        q.stride(0), q.stride(1) if new is None else 0, block_tables.stride(0), out.stride(0), out.stride(1),
        PAGE=page, HK=hk, G=g, BLOCK_G=max(16, triton.next_power_of_2(hpp * g)), D=d, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32, DIRECT=direct, HPP=hpp, PAGE_TILE=page_tile and page % block_n == 0,
        order_ptr=order, ORDERED=order is not None, lock_ptr=locks, FUSED_REDUCE=fused,
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)) if fused else 2,
        num_warps=num_warps, num_stages=num_stages, **fp8, **prologue, **pdl.launch(q),
        **({"maxnreg": max_registers} if max_registers else {}))
    if direct or fused:
        return out
    _decode_reduce_kernel[(n, hq)](acc, ml, context_lens, out, num_splits, split_len, out.stride(0), out.stride(1),
                                   HQ=hq, D=d, BLOCK_S=max(2, triton.next_power_of_2(num_splits)), **pdl.launch(q))
    return out


DECODE_LOCKS = 1 << 16                  # (sequence, head group) counters of the fused reduce, per device
_locks: dict[torch.device, torch.Tensor] = {}


def decode_locks(device: torch.device) -> torch.Tensor | None:
    """The fused reduce's counters on `device` (zeros; every launch leaves them at zero). Allocated on the
    first call outside a CUDA graph capture (the Triton backend allocates them when it is created); None
    inside a capture before that, and the decode then runs its reduce kernel."""
    locks = _locks.get(device)
    if locks is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        locks = _locks[device] = torch.zeros(DECODE_LOCKS, dtype=torch.int32, device=device)
    return locks

