"""The FP8 KV cache (``kv_cache_dtype="fp8"``, vLLM's spelling; ``auto``: the model's dtype, the default).

K and V are held as e4m3 (``torch.float8_e4m3fn``, 1 byte a value, half of bf16), each with one float32 scale
per layer (per tensor): the cache holds ``e4m3(clamp(x / scale, -448, 448))``, rounded to nearest even, and a
read gives ``value * scale``. The kernels quantize inside the KV write (``kv_store._store_kv_kernel``, the fused q/k-norm
+ RoPE store) and dequantize inside the attention kernels, where the K scale folds into the softmax scale
(``q . (k * s) = s * (q . k)``) and the V scale multiplies the output once (``sum p * v * s = s * sum p * v``),
so a read costs only the e4m3 -> bf16 conversion of each tile.

How the scales are chosen: fixed at 1.0 (vLLM's default when no scales are calibrated). At 1.0, e4m3 keeps
3 mantissa bits (a rounding error of at most 2^-4 = 6.25% of a value) for magnitudes in [2^-6, 448] and an
absolute step of 2^-9 below that. Qwen3's K is the output of
its per-head k RMSNorm (each head's values have RMS 1 before the norm weight), so its entries sit inside that
range; V is a projection of a normed hidden state, of the same order. A scale only helps when values crowd one
end of the range, which these do not; ``labkit logits guard --kv-cache-dtype fp8`` measures the logits against
the bf16 cache and records each side's largest |K| and |V|. Each cache view carries its own scale
(:func:`mark`), so per-layer scales drop in without another change to the kernels.

V's layout (``v_t``, LAB_FP8_V_T): a V cache view holds its bytes as K does, each block [block_size, Hk, D]
(a position's heads contiguous), or, marked ``v_t``, each block [Hk, D, block_size]: a head's positions
contiguous for each of its D values, under the same tensor shape. The P.V dot reduces over positions; in the
first layout an e4m3 V tile reaches that dot's operand one byte at a time (there is no 8-bit transposing
shared-memory load on sm_90), in the second as contiguous runs. Every writer and reader of an e4m3 V cache asks
:func:`v_transposed` (the Triton kernels through their ``VT`` constexpr, the torch reference through
:func:`read` and :func:`write`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.args import KV_CACHE_DTYPES  # noqa: F401  (auto | fp8)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0                 # largest finite e4m3fn value
DEFAULT_SCALE = 1.0             # K and V (vLLM's default without calibration; the module docstring says why)


@dataclass(frozen=True)
class KVQuant:
    """What one FP8 cache view stands for: its scale, the dtype a read gives back (the model's) and whether its
    blocks hold each head's positions contiguous (``v_t``: a V cache's other layout, see the module docstring)."""
    scale: float
    dtype: torch.dtype
    v_t: bool = False


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the KV pool for ``--kv-cache-dtype`` (auto: the model's)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8":
        return FP8
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8


def mark(cache: torch.Tensor, scale: float, dtype: torch.dtype, v_t: bool = False) -> torch.Tensor:
    """Record on an FP8 cache view its scale, the dtype its reads give and (a V cache) its layout (the KV pool
    does this for every layer's k_cache and v_cache); returns the view."""
    cache.kv_quant = KVQuant(float(scale), dtype, bool(v_t))
    return cache


def v_transposed(cache: torch.Tensor) -> bool:
    """Whether the cache's blocks hold each head's positions contiguous ([Hk, D, block_size]; an FP8 V cache
    marked ``v_t``)."""
    q = getattr(cache, "kv_quant", None) if is_fp8(cache) else None
    return q is not None and q.v_t


def _blocks(cache: torch.Tensor) -> torch.Tensor:
    """The cache's bytes as its blocks are laid out: [blocks, block_size, Hk, D], or [blocks, Hk, D, block_size]
    where v_transposed, permuted back to the first shape (a view, not a copy)."""
    raw = cache.view(torch.uint8)
    if v_transposed(cache):
        b, page, hk, d = cache.shape
        raw = raw.view(b, hk, d, page).permute(0, 3, 1, 2)
    return raw


def to_v_t(cache: torch.Tensor) -> torch.Tensor:
    """A copy of an FP8 cache [blocks, block_size, Hk, D] with its blocks laid out [Hk, D, block_size] (the same
    shape, marked v_t with the cache's scale and dtype): what the kernels would have written there."""
    q = spec(cache)
    assert q is not None and not q.v_t, "an FP8 cache in the position-major layout"
    out = mark(torch.empty_like(cache), q.scale, q.dtype, v_t=True)
    _blocks(out).copy_(_blocks(cache))
    return out


def spec(cache: torch.Tensor) -> KVQuant | None:
    """An FP8 cache view's KVQuant (None for a cache in the model's dtype). An FP8 view that was never marked
    is refused: reading it with a guessed scale would be silently wrong."""
    if not is_fp8(cache):
        return None
    q = getattr(cache, "kv_quant", None)
    if q is None:
        raise ValueError("an FP8 KV cache view without its scale (engine.attention.kv_quant.mark was not called on it)")
    return q


def scale_of(cache: torch.Tensor) -> float:
    """The cache's scale (1.0 for a cache in the model's dtype: nothing to undo)."""
    q = spec(cache)
    return 1.0 if q is None else q.scale


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale in e4m3, saturated at +-448 and rounded to nearest even (what the store kernels write)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 values back to ``dtype``: value * scale, in float32 then rounded to dtype."""
    return (x.float() * scale).to(dtype)


def read(cache: torch.Tensor, index) -> torch.Tensor:
    """cache[index] as attention reads it: dequantized where the cache is FP8, else as stored."""
    q = spec(cache)
    if q is None:
        return cache[index]
    return dequantize(_blocks(cache)[index].view(FP8), q.scale, q.dtype)


def write(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Rows ``x`` [n, Hk, D] into the flat slots of a paged cache, quantized where the cache is FP8 (CPU's
    index_copy_ has no e4m3 kernel: the bytes are copied as uint8, through the blocks' layout: :func:`_blocks`)."""
    q = spec(cache)
    if q is None:
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, x.to(cache.dtype))
        return
    page = cache.shape[1]
    _blocks(cache)[slots // page, slots % page] = quantize(x, q.scale).view(torch.uint8)
