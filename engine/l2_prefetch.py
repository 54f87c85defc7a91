"""Weights into the GPU's L2 cache ahead of the kernels that read them (opt-in, LAB_L2_PREFETCH; CUDA, sm_90+).

At batch-1 decode a layer's attention reads a few MB of K/V and spends its time on latency (dependent loads, the
PDL wait, the reduce kernel), while the memory system is mostly idle; the GEMVs after it (o, gate_up, down) then
each read their weight once, and at Qwen3-0.6B's sizes (4 to 13 MB) each is short enough that its ramp and tail
keep it well below its bandwidth bound (docs/MEASURED.md: 0.41 to 0.63 of it). Here the attention kernel also
asks the memory system for those weights: ``cp.async.bulk.prefetch.L2.global`` (sm_90) copies a range of global
memory into L2: it holds no registers and gives no result, and nothing the kernel computes changes. If L2 still
holds the bytes when the GEMVs read them, those reads are L2 hits.

Which weights each layer's attention prefetches is the model's plan (``CausalLM.set_l2_prefetch``): ``mlp``
this layer's o, gate_up and down weights (about 23 MB at Qwen3-0.6B; an H100's or H200's L2 holds 50 MB), ``layer``
those and the next layer's qkv weight too. The decode kernel takes them where it runs its reduce kernel (small
batches: triton_kernels.paged_decode), in every program after its PDL wait, so the prefetch does not compete with
the qkv GEMV still streaming its own weight.

``prefetch`` is the device function a kernel calls; ``launch_args`` the host side, the tensors as the kernel's
keyword arguments. Each region is cut into chunks that the launch's programs take in turn (chunk c to program
c mod programs), one chunk a thread of ``LANES``; a chunk is at least ``MIN_CHUNK`` bytes.

Timed on an H100 (docs/MEASURED.md), it lost, so it is off unless asked: batch-1 decode took 0.93 ms a token with
``mlp`` and 0.95 with ``layer`` against 0.86 without. In the step budget (PDL off) the four GEMVs took 0.069 ms
less a step and the attention kernels 0.105 ms more. tools/gpu/l2_probe.py found the MLP's GEMVs taking 27% less
time from L2 than from HBM, and a kernel that only issues these prefetches lasting as long as the 23 MB take to
arrive at the copy roof: asking is not free to the kernel that asks.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:     # a CPU install without triton: no kernel of ours is compiled
    triton = None

MAX_REGIONS = 4          # the tensors one launch prefetches at most
MODES = ("0", "mlp", "layer")

if triton is not None:
    MIN_CHUNK = tl.constexpr(4096)      # bytes a bulk prefetch asks for at least (a multiple of 16)
    LANES = tl.constexpr(128)           # chunks a program asks for at once: a thread each at the decode's 4 warps

    @triton.jit
    def _region(ptr, nbytes, pid, programs, lanes):
        """This program's chunks of one region: chunk pid + programs * lane for each lane (a thread each), chunks
        of nbytes / (programs x LANES) bytes rounded up to 16 and at least MIN_CHUNK; a lane past the region asks
        for nothing (size 0: the instruction is predicated off)."""
        per = (nbytes + programs * LANES - 1) // (programs * LANES)
        chunk = tl.maximum(((per + 15) // 16) * 16, MIN_CHUNK).to(tl.int64)
        off = (pid + programs * lanes).to(tl.int64) * chunk
        size = tl.minimum(tl.maximum(nbytes - off, 0), chunk).to(tl.int32)
        addr = ptr.to(tl.pointer_type(tl.int8)) + tl.where(size > 0, off, 0)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; } mov.u32 $0, 0;",
            "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def prefetch(p0, n0, p1, n1, p2, n2, p3, n3, REGIONS: tl.constexpr):
        """Ask L2 for this launch's share of REGIONS regions (pointer, bytes; 0: none): every program of the grid
        takes its chunks of each. Call it after the PDL wait (engine/pdl.py); it reads and writes nothing."""
        if REGIONS > 0:
            pid = (tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0) + tl.program_id(0)
            programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
            lanes = tl.arange(0, LANES)
            _region(p0, n0, pid, programs, lanes)
            if REGIONS > 1:
                _region(p1, n1, pid, programs, lanes)
            if REGIONS > 2:
                _region(p2, n2, pid, programs, lanes)
            if REGIONS > 3:
                _region(p3, n3, pid, programs, lanes)


def launch_args(tensors: tuple[torch.Tensor, ...]) -> dict:
    """The keyword arguments of a kernel that calls ``prefetch`` for these tensors (at most MAX_REGIONS, each
    contiguous, 16-byte aligned and a multiple of 16 bytes long: a weight in bf16 with an even row is); {} for
    none."""
    if not tensors:
        return {}
    assert len(tensors) <= MAX_REGIONS, len(tensors)
    out: dict = {"L2_REGIONS": len(tensors)}
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        assert t.is_contiguous() and t.data_ptr() % 16 == 0 and nbytes % 16 == 0, (t.shape, t.dtype)
        out[f"l2_p{i}"], out[f"l2_n{i}"] = t, nbytes
    return out
