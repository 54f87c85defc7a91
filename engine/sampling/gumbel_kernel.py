"""One-pass Gumbel-max sampling on CUDA (Triton): each row's token from its logits in a single read.

argmax(logits / T - log(-log U)) draws from softmax(logits / T) (the exponential race of the torch
sampler, in log space), so the softmax, the noise tensor and the division never touch memory. U comes
from Triton's counter-based generator keyed by a per-row seed that the caller draws from the row's
torch.Generator: the same seeds give the same tokens. Temperature 0 rows take the plain argmax (the
first index on ties, like torch.argmax).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine import pdl


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, stride, temp_ptr, seed_ptr, val_ptr, idx_ptr, V, CHUNK,
                          BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, chunk): the best perturbed score of its CHUNK of the vocabulary and where it is.

    The noise costs more than the read: one Philox call gives four 32-bit draws (tl.randint4x), so a
    tile is [BLOCK // 4, 4] with one counter per row of four, and a greedy row draws none."""
    pdl.enter(PDL)      # engine/pdl.py: nothing before this line reads what an earlier kernel wrote
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    t = tl.load(temp_ptr + row)
    seed = tl.load(seed_ptr + row)
    inv_t = 1.0 / tl.maximum(t, 1e-5)
    QUADS: tl.constexpr = BLOCK // 4
    quad = tl.arange(0, QUADS)
    lane = tl.arange(0, 4)
    best = tl.full([QUADS, 4], float("-inf"), tl.float32)
    best_idx = tl.zeros([QUADS, 4], tl.int32)
    lo = chunk * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    base = logits_ptr + row.to(tl.int64) * stride
    for start in range(lo, hi, BLOCK):
        offs = start + quad[:, None] * 4 + lane[None, :]
        mask = offs < hi
        x = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32)
        if t > 0:
            r0, r1, r2, r3 = tl.randint4x(seed, start // 4 + quad)
            r = tl.join(tl.join(r0, r1), tl.join(r2, r3)).reshape(QUADS, 4)
            u = tl.random.uint_to_uniform_float(r)
            x = tl.where(mask, x * inv_t - tl.log(-tl.log(u)), float("-inf"))
        better = x > best
        best = tl.where(better, x, best)
        best_idx = tl.where(better, offs, best_idx)
    top = tl.max(tl.max(best, 1), 0)
    tl.store(val_ptr + row * tl.num_programs(1) + chunk, top)
    first = tl.min(tl.min(tl.where(best == top, best_idx, V), 1), 0)
    tl.store(idx_ptr + row * tl.num_programs(1) + chunk, first)


CHUNK = 8192
BLOCK = 2048


def gumbel_argmax(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """logits [N, V] (any float dtype, last dim contiguous), temperatures [N] float32, seeds [N] int64 -> [N].

    The vocabulary is split in chunks so that every SM has rows to work on at any batch size; the
    chunk winners are reduced with argmax over chunks (the first chunk on ties, so the first index wins)."""
    n, v = logits.shape
    assert logits.stride(1) == 1
    assert CHUNK % BLOCK == 0            # a chunk's tiles, and so its Philox counters, never overlap another's
    chunks = triton.cdiv(v, CHUNK)
    vals = torch.empty(n, chunks, dtype=torch.float32, device=logits.device)
    idx = torch.empty(n, chunks, dtype=torch.int32, device=logits.device)
    _gumbel_argmax_kernel[(n, chunks)](logits, logits.stride(0), temperatures, seeds, vals, idx, v, CHUNK,
                                       BLOCK=BLOCK, num_warps=4, **pdl.launch(logits))
    return idx.gather(1, vals.argmax(dim=1, keepdim=True)).squeeze(1)
