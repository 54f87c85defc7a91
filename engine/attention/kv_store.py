"""Our Triton KV store: one token's k and v per program, written at its slot of the paged caches (quantized where
they are FP8; the decode prologue and the fused q/k-norm + RoPE kernel store their own).

Cache layout (per layer): [num_blocks, block_size, num_kv_heads, head_dim], contiguous (an e4m3 V cache marked
``v_t``: each block [num_kv_heads, head_dim, block_size], engine/attention/kv_quant.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine import pdl
from engine.attention.triton_common import fp8_quantize, kv_scales, v_offset


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_stride, v_stride, kc_ptr, vc_ptr, slot_ptr,
                     WIDTH: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
                     k_scale=1.0, v_scale=1.0, KV_FP8: tl.constexpr = False, VT: tl.constexpr = False,
                     D: tl.constexpr = 1, PAGE: tl.constexpr = 1):
    """KV_FP8: the cache is e4m3; k / k_scale and v / v_scale are what is stored. VT: V's blocks hold each head's
    positions contiguous (kv_quant.v_t; heads of D values, PAGE positions a block)."""
    t = tl.program_id(0)
    pdl.enter(PDL)      # engine/pdl.py: nothing before this line reads what an earlier kernel wrote
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:               # padding row: never touches the cache
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < WIDTH
    k = tl.load(k_ptr + t * k_stride + offs, mask=mask)
    v = tl.load(v_ptr + t * v_stride + offs, mask=mask)
    if KV_FP8:
        k = fp8_quantize(k, k_scale)
        v = fp8_quantize(v, v_scale)
    tl.store(kc_ptr + slot * WIDTH + offs, k, mask=mask)
    tl.store(vc_ptr + v_offset(slot, offs // D, offs % D, WIDTH // D, D, PAGE, VT), v, mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float | None = None, v_scale: float | None = None) -> None:
    """An FP8 cache (kv_quant) is written quantized, by k_scale and v_scale (None: each cache's own scale)."""
    t, hk, d = k.shape
    width = hk * d
    assert k.stride(-1) == 1 and k.stride(-2) == d and v.stride(-1) == 1 and v.stride(-2) == d
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    scales = kv_scales(k_cache, v_cache, k_scale, v_scale)     # {} for a cache in the model's dtype
    _store_kv_kernel[(t,)](k, v, k.stride(0), v.stride(0), k_cache, v_cache, slot_mapping,
                           WIDTH=width, BLOCK=triton.next_power_of_2(width), D=d, PAGE=k_cache.shape[1], **scales,
                           **pdl.launch(k))
