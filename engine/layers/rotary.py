from __future__ import annotations

import math

import torch
from torch import nn

from engine.config import RopeScaling


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_frequencies(head_dim: int, rope: RopeScaling) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32, head_dim/2) and the attention scaling of cos/sin, as transformers
    computes them for ``default``, ``linear`` (every frequency divided by the factor) and ``yarn`` (NTK-by-parts:
    fast dimensions kept, slow ones divided by the factor, a linear ramp between; cos/sin scaled by mscale)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    pos_freqs = rope.theta ** exponents
    inv_freq = 1.0 / pos_freqs
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3_frequencies(inv_freq, rope), 1.0
    if rope.rope_type != "yarn":
        return inv_freq, 1.0
    factor, orig = rope.factor, rope.original_max_position_embeddings
    scaling = rope.attention_factor
    if scaling is None:
        if rope.mscale and rope.mscale_all_dim:
            scaling = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
        else:
            scaling = _yarn_mscale(factor)

    def dim_of(rotations: float) -> float:
        # the dimension whose wavelength fits `rotations` times into the original context
        return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = dim_of(rope.beta_fast), dim_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp                                     # 1: the original frequency, 0: divided by the factor
    interpolated = 1.0 / (factor * pos_freqs)
    return interpolated * (1 - keep) + inv_freq * keep, float(scaling)


def _llama3_frequencies(inv_freq: torch.Tensor, rope: RopeScaling) -> torch.Tensor:
    """Llama 3.1's scaling: wavelengths longer than original/low_freq_factor divided by the factor, shorter
    than original/high_freq_factor kept, a smooth blend between (transformers' _compute_llama3_parameters)."""
    factor, orig = rope.factor, rope.original_max_position_embeddings
    low, high = rope.low_freq_factor, rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > orig / low, inv_freq / factor, inv_freq)
    smooth = (orig / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < orig / high) * ~(wavelen > orig / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE; cos/sin tables in float32 (the rope scaling's attention factor baked in, so the torch
    path here and the fused CUDA kernel, which reads the same tables, agree), applied in the activation dtype."""

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: RopeScaling | None = None):
        super().__init__()
        rope = scaling if scaling is not None else RopeScaling(theta=float(base))
        inv_freq, self.attention_scaling = rope_frequencies(head_dim, rope)
        self.rope_type = rope.rope_type
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # q: [T, Hq, D], k: [T, Hk, D]
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
