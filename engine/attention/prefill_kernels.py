"""Our Triton paged prefill: causal varlen attention of a batch of prompts or chunks, on the new K/V (fresh) or
through the block table (prefix hits, chunk continuations; first_seq: a mixed step's chunks after its decode rows).

Cache layout (per layer): [num_blocks, block_size, num_kv_heads, head_dim], contiguous (engine/attention/
triton_kernels.py holds the KV store and the paged decode over the same layout).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine import pdl
from engine.attention import splits
from engine.attention.triton_common import dot, kv_scales, online_softmax, to_f16, v_offset


# -- prefill: through the block table (prefix hits, chunk continuations) or on the new K/V (fresh) ----
#: a prefill of at most this many sequences launches one program per (query tile of any sequence, head), its
#: tiles packed: a step's or a graph bucket's sequences x its longest query in tiles would be mostly empty
#: programs (a paged prefill graph holds 16 sequences: at 1,024 tokens 4,096 programs, 256 with work for one
#: 1,024-token prompt); wider prefills keep the (tile, sequence, head) grid
PACKED_SEQS = splits.PREFILL_PACKED_SEQS
_PACKED_BLOCK_S = triton.next_power_of_2(PACKED_SEQS + 1)     # the sequences' offsets one packed program reads


@triton.jit
def _packed_tile(cu_q_ptr, seq0, num_seqs, g, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr):
    """Packed grid: program g's sequence (counted from seq0; num_seqs or more where g is past every tile) and its
    query tile in that sequence. The sequences' tiles are numbered one after another, in order."""
    offs = tl.arange(0, BLOCK_S)
    smask = offs < num_seqs
    lo = tl.load(cu_q_ptr + seq0 + offs, mask=smask, other=0)
    hi = tl.load(cu_q_ptr + seq0 + offs + 1, mask=smask, other=0)
    tiles = tl.where(smask, (hi - lo + BLOCK_M - 1) // BLOCK_M, 0)
    ends = tl.cumsum(tiles, 0)                                  # past each sequence's last tile
    n = tl.sum((ends <= g).to(tl.int32), 0)                     # the sequences whose tiles all come before g
    first = tl.sum(tl.where(offs < n, tiles, 0), 0)             # g's sequence's first tile
    return n, g - first


@triton.jit(do_not_specialize=["stride_bt", "seq0", "num_seqs"])
def _prefill_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, cu_q_ptr, cu_k_ptr, out_ptr, scale,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_k, stride_v, seq0, num_seqs,
                    PAGE: tl.constexpr, HK: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, PAGED: tl.constexpr,
                    PDL: tl.constexpr = False, v_scale=1.0, KV_FP8: tl.constexpr = False,
                    PACKED: tl.constexpr = False, BLOCK_S: tl.constexpr = 32, VT: tl.constexpr = False):
    """PAGED: K/V rows are cache slots found through the block table (row stride HK * D).
    Not PAGED: K/V are this step's new rows [T, HK, D] (row strides stride_k, stride_v), nothing cached before.
    KV_FP8 (PAGED): the caches hold e4m3, read as the decode kernel reads them (the K scale in ``scale``, the
    V scale on the output). VT (PAGED, FP8): the V cache's blocks hold each head's positions contiguous
    (engine/attention/kv_quant.py: v_t).
    seq0: the grid's first sequence (a mixed step's prefill rows after its decodes): the same compiled kernel
    whatever it is, where a slice of cu_seqlens and the block table would change their pointers' alignment and
    compile a new variant mid-serving. num_seqs: the sequences from seq0 on.
    PACKED (num_seqs < BLOCK_S): the grid is (a bound on the sequences' query tiles, heads), each program finds
    its sequence and tile (:func:`_packed_tile`); else (query tiles of the longest, sequences, heads)."""
    pdl.enter(PDL)      # engine/pdl.py: nothing before this line reads what an earlier kernel wrote
    if PACKED:
        rel, tile = _packed_tile(cu_q_ptr, seq0, num_seqs, tl.program_id(0), BLOCK_M, BLOCK_S)
        if rel >= num_seqs:                    # past the last sequence's last tile
            return
        n = seq0 + rel
        h = tl.program_id(1)
    else:
        tile = tl.program_id(0)
        n = seq0 + tl.program_id(1)
        h = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + n)
    q_len = tl.load(cu_q_ptr + n + 1) - q_start
    k_len = tl.load(cu_k_ptr + n + 1) - tl.load(cu_k_ptr + n)
    if tile * BLOCK_M >= q_len:
        return
    prefix = k_len - q_len                     # positions already in the cache before this chunk
    kvh = h // G
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    qmask = offs_m < q_len
    q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=qmask[:, None], other=0.0)
    if KV_FP8 and not IEEE:     # the dots in float16, as the decode kernel's
        q = to_f16(q)
    q_pos = prefix + offs_m
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    end = tl.minimum(k_len, prefix + (tile + 1) * BLOCK_M)
    for kstart in range(0, end, BLOCK_N):
        offs_n = kstart + tl.arange(0, BLOCK_N)
        valid = offs_n < end
        if PAGED:
            blk = tl.load(bt_ptr + n * stride_bt + offs_n // PAGE, mask=valid, other=0).to(tl.int64)
            row = blk * PAGE + offs_n % PAGE
        else:
            row = (q_start + offs_n).to(tl.int64)
        head = kvh * D + offs_d[None, :]
        k = tl.load(kc_ptr + row[:, None] * stride_k + head, mask=valid[:, None], other=0.0)
        if VT:
            v = tl.load(vc_ptr + v_offset(row[:, None], kvh, offs_d[None, :], HK, D, PAGE, True), mask=valid[:, None],
                        other=0.0)
        else:
            v = tl.load(vc_ptr + row[:, None] * stride_v + head, mask=valid[:, None], other=0.0)
        if KV_FP8:                              # e4m3 -> the dots' dtype (float16, or float32): exact
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        scores = dot(q, tl.trans(k), IEEE) * scale
        keep = valid[None, :] & (offs_n[None, :] <= q_pos[:, None])
        scores = tl.where(keep, scores, float("-inf"))
        m, l, acc = online_softmax(scores, v, m, l, acc, IEEE)
    out = acc / l[:, None]
    if KV_FP8:
        out = out * v_scale
    tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=qmask[:, None])


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                  scale: float, block_m: int = 64, block_n: int = 64, num_warps: int = 4,
                  num_stages: int = 2, k_scale: float | None = None, v_scale: float | None = None,
                  first_seq: int = 0) -> torch.Tensor:
    """Causal varlen attention of q [T, Hq, D] over every sequence's cached K/V (prefix + this chunk).
    FP8 caches (engine/attention/kv_quant.py) are dequantized by k_scale and v_scale (None: the caches' own).
    first_seq: only the sequences from this one on (their output rows; the rows before are left unwritten).

    The tile sizes, warps and stages are swept by `labkit bench --workload attention --sweep`."""
    _, page, hk, d = k_cache.shape
    fp8 = kv_scales(k_cache, v_cache, k_scale, v_scale)
    if fp8:
        scale, fp8 = scale * fp8["k_scale"], {"v_scale": fp8["v_scale"], "KV_FP8": True, "VT": fp8.get("VT", False)}
    return _launch_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, scale,
                           page=page, hk=hk, strides_kv=(hk * d, hk * d), stride_bt=block_tables.stride(0), paged=True,
                           block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages, fp8=fp8,
                           first_seq=first_seq)


def varlen_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   max_seqlen_q: int, scale: float, block_m: int = 64, block_n: int = 64, num_warps: int = 4,
                   num_stages: int = 2) -> torch.Tensor:
    """Causal varlen attention of q [T, Hq, D] over the new k/v [T, Hk, D] only (nothing cached before):
    one launch for the whole batch, GQA without expanding K/V."""
    _, hk, d = k.shape
    assert k.stride(1) == v.stride(1) == d and k.stride(2) == v.stride(2) == 1
    return _launch_prefill(q, k, v, cu_seqlens_q, cu_seqlens_q, cu_seqlens_q, max_seqlen_q, scale,
                           page=1, hk=hk, strides_kv=(k.stride(0), v.stride(0)), stride_bt=0, paged=False,
                           block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)


def _launch_prefill(q, kv_k, kv_v, block_tables, cu_q, cu_k, max_seqlen_q, scale, *, page, hk, strides_kv,
                    stride_bt, paged, block_m, block_n, num_warps, num_stages, fp8=None, first_seq=0) -> torch.Tensor:
    t, hq, d = q.shape
    n = cu_q.numel() - 1 - first_seq
    out = torch.empty_like(q)
    packed = n <= PACKED_SEQS
    if packed:          # every sequence's tiles: at most one partial tile per sequence beyond t / block_m
        grid = (min(triton.cdiv(t, block_m) + n, n * triton.cdiv(max_seqlen_q, block_m)), hq)
    else:
        grid = (triton.cdiv(max_seqlen_q, block_m), n, hq)
    _prefill_kernel[grid](q, kv_k, kv_v, block_tables, cu_q, cu_k, out, scale,
                          q.stride(0), q.stride(1), out.stride(0), out.stride(1), stride_bt, *strides_kv, first_seq, n,
                          PAGE=page, HK=hk, G=hq // hk, D=d, BLOCK_M=block_m, BLOCK_N=block_n,
                          IEEE=q.dtype == torch.float32, PAGED=paged, num_warps=num_warps, num_stages=num_stages,
                          PACKED=packed, BLOCK_S=_PACKED_BLOCK_S, **(fp8 or {}), **pdl.launch(q))
    return out
