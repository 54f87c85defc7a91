"""Device functions our Triton kernels share (Triton inlines them into each kernel): the dots' precision, the
FP8 cache's quantize and scales, and the q/k norm + RoPE of the fused q/k kernel (engine/layers/fused_kernels.py)
and of the decode prologue (engine/attention/triton_kernels.py)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention import kv_quant


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """float32 inputs: exact fp32 products when IEEE (Triton's default is tf32); other dtypes ignore it."""
    if IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def online_softmax(scores, v, m, l, acc, IEEE: tl.constexpr):
    """One tile folded into a running softmax: scores [rows, positions] (masked ones -inf) and the tile's values v
    [positions, D] update each row's max m, its sum of exponentials l and its weighted sum acc; the new (m, l, acc).
    The paged decode and the paged prefill both keep their state this way."""
    m_new = tl.maximum(m, tl.max(scores, 1))
    p = tl.exp(scores - m_new[:, None])
    alpha = tl.exp(m - m_new)
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE)
    return m_new, l, acc


@triton.jit
def fp8_quantize(x, scale):
    """x / scale as e4m3 (what an FP8 cache holds, engine/attention/kv_quant.py): float32 division, saturated at
    +-448, rounded to nearest even (kv_quant.quantize does the same in torch)."""
    y = tl.minimum(tl.maximum(x.to(tl.float32) / scale, -448.0), 448.0)
    return y.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def v_offset(slot, head, d, HK: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, VT: tl.constexpr):
    """The element offset in a V cache of (slot, kv head, dim), broadcast: position-major as K ([blocks, PAGE,
    HK, D]), or with VT each block [HK, D, PAGE] (engine/attention/kv_quant.py: v_t)."""
    if VT:
        out = (slot // PAGE) * (PAGE * HK * D) + head * (D * PAGE) + d * PAGE + slot % PAGE
    else:
        out = slot * (HK * D) + head * D + d
    return out


def kv_scales(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: float | None = None,
              v_scale: float | None = None) -> dict:
    """The FP8 launch arguments of a kernel reading or writing these caches: k_scale and v_scale (given, else
    the caches' own, engine/attention/kv_quant.py), KV_FP8, and VT where the V cache's blocks hold each head's
    positions contiguous (kv_quant.v_transposed); {} for caches in the model's dtype."""
    if not kv_quant.is_fp8(k_cache):
        return {}
    assert kv_quant.is_fp8(v_cache), "K and V caches of different dtypes"
    return {"k_scale": kv_quant.scale_of(k_cache) if k_scale is None else float(k_scale),
            "v_scale": kv_quant.scale_of(v_cache) if v_scale is None else float(v_scale), "KV_FP8": True,
            **({"VT": True} if kv_quant.v_transposed(v_cache) else {})}


@triton.jit
def to_f16(x):
    """A bf16 query as float16 for dots with an e4m3 tile converted to float16: exact within float16's range
    (bf16 has the fewer mantissa bits), saturated at its bounds (+-65504) past them."""
    return tl.minimum(tl.maximum(x.to(tl.float32), -65504.0), 65504.0).to(tl.float16)


@triton.jit
def rms_norm_halves(x1, x2, w1, w2, eps, D: tl.constexpr):
    """Heads [H, D/2] x 2 (each head's halves) -> RMSNorm by the weight's halves w1, w2 (float32), rounded at the
    reference's points (layernorm.py), as float32 values of the activation dtype: the q/k norm of
    fused_kernels._qk_norm_rope_kernel and of the decode prologue (:func:`roped`)."""
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    rstd = 1.0 / tl.sqrt((tl.sum(f1 * f1, 1) + tl.sum(f2 * f2, 1)) / D + eps)
    dt = x1.dtype
    n1 = ((f1 * rstd[:, None]).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
    n2 = ((f2 * rstd[:, None]).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
    return n1, n2


@triton.jit
def rope_halves(n1, n2, c, s, dt: tl.constexpr):
    """Neox RoPE of heads' halves n1, n2 (float32) by c, s (float32, already rounded to dt), rounded at the
    reference's points (rotary.py) -> (o1, o2) in dt."""
    o1 = ((n1 * c).to(dt).to(tl.float32) + (-n2 * s).to(dt).to(tl.float32)).to(dt)
    o2 = ((n2 * c).to(dt).to(tl.float32) + (n1 * s).to(dt).to(tl.float32)).to(dt)
    return o1, o2


@triton.jit
def weight_halves(w_ptr, D: tl.constexpr):
    """A q/k norm weight's two halves as float32 [1, D/2] rows (a weight: a kernel may load it before its PDL wait)."""
    half = tl.arange(0, D // 2)
    return tl.load(w_ptr + half).to(tl.float32)[None, :], tl.load(w_ptr + D // 2 + half).to(tl.float32)[None, :]


@triton.jit
def rope_at(cos_ptr, sin_ptr, pos, dt: tl.constexpr, D: tl.constexpr):
    """The RoPE tables' cos and sin halves at `pos`, rounded to the activation dtype dt, as float32 [1, D/2] rows (the
    model's tables at a step input's position: a kernel may load them before its PDL wait)."""
    half = tl.arange(0, D // 2)
    c = tl.load(cos_ptr + pos * D + half).to(dt).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * D + half).to(dt).to(tl.float32)[None, :]
    return c, s


@triton.jit
def head_halves(row_ptr, heads, mask, D: tl.constexpr):
    """The heads `heads` [H] of one token's packed qkv row (column head * D) as their two halves [H, D/2] each (rows
    where ``mask`` is off read zeros): the loads of :func:`roped`, apart so that a kernel can issue them with others."""
    half = tl.arange(0, D // 2)
    base = row_ptr + heads[:, None] * D
    x1 = tl.load(base + half[None, :], mask=mask[:, None], other=0.0)
    x2 = tl.load(base + D // 2 + half[None, :], mask=mask[:, None], other=0.0)
    return x1, x2


@triton.jit
def norm_rope(x1, x2, w1, w2, c, s, eps, D: tl.constexpr):
    """Heads' halves x1, x2 (:func:`head_halves`) normed by the weight halves w1, w2 and roped by c, s
    (:func:`weight_halves`, :func:`rope_at`), as one [H, D] tile."""
    n1, n2 = rms_norm_halves(x1, x2, w1, w2, eps, D)
    o1, o2 = rope_halves(n1, n2, c, s, x1.dtype)
    return tl.reshape(tl.permute(tl.join(o1, o2), (0, 2, 1)), (o1.shape[0], D))


@triton.jit
def roped(row_ptr, heads, mask, w1, w2, c, s, eps, D: tl.constexpr):
    """The heads `heads` [H] of one token's packed qkv row normed and roped (:func:`head_halves`, :func:`norm_rope`),
    as one [H, D] tile (rows where ``mask`` is off read zeros)."""
    x1, x2 = head_halves(row_ptr, heads, mask, D)
    return norm_rope(x1, x2, w1, w2, c, s, eps, D)
