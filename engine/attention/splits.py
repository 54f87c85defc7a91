"""How the Triton paged decode splits a context (pure Python: no triton import, so the warmup plan and
the tests can reason about the kernel's compiled variants on any machine).

The decode kernel is compiled once per value of its constexprs. Two of them follow the split count:
``DIRECT`` (a single split writes the output itself) and the reduce kernel's ``BLOCK_S`` (the split
count rounded up to a power of two); a third follows the batch, ``FUSED_REDUCE`` (:func:`fuse_reduce`).
:func:`decode_variant` names the variant a call compiles.
"""
from __future__ import annotations

DECODE_BLOCK_N = 64          # positions per tile (paged_decode's default)
DECODE_WAVES = 2             # split so that batch x kv heads x splits fills the GPU this many times (2: at 64 x 1024
                             # one split, 10-11% faster than 4 in two H200 sweeps, neutral on the other shapes)
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 3
# Two more knobs (`labkit bench --workload attention --sweep` ranks them with the four above,
# labkit.bench.attention.sweep_kernel). Switching to the sweep's winner is a change of these six lines: the
# kernel, the backend and the warmup plan (decode_variants) read them.
DECODE_KV_PER_PROG = 1       # kv heads per decode program (kv_per_program: the largest divisor not above it)
DECODE_PAGE_TILE = False     # one block-table load per tile where block_n divides the page size
# An e4m3 cache's own knobs (none of them changes the splits, so the warm-up's decode_variants holds for both caches).
# At the bf16 knobs its sm_90 build takes 168 registers a thread (the e4m3 -> f16 conversions of a whole tile held at
# once), so an SM holds 3 programs to bf16's 4, each buffering half the bytes: 67 KB in flight an SM to bf16's 153
# (tools/kernel_resources.py), and it read no faster than bf16. Its own: one block-table load per tile, the V scale on
# the accumulator (V crosses shared memory as bytes), a cap of 128 registers a thread and 5 stages: 4 programs of 38 KB,
# 152 KB an SM. Timed, each call's GPU time alone (kernel_ms), by tools/gpu/decode_sweep.py on an
# H100: at 256 x 1,024 this setting ran 197.6 us (0.90 of the copy roof) against 225.7 us (0.79) for the earlier
# default (the V scale on each V tile, the per-position block-table loads, no cap); on the nano-vllm workload, the
# same lease, 29,293 tok/s against 26,827 (1.41x the bf16 cache's 20,757), the kv-fp8 guard PASS (docs/MEASURED.md).
# No H200 has timed this setting yet (with the earlier default an H200's e4m3 decode step was 4.56 ms to bf16's 4.69).
# `labkit bench --workload attention --kv-cache-dtype fp8 --sweep` (or tools/gpu/decode_sweep.py) times the grid for
# the next change of these lines; LAB_FP8_DECODE (engine/levers.py) runs an engine with other values of them.
DECODE_FP8_PAGE_TILE = True  # FP8 cache: one block-table load per tile (where block_n divides the page size)
DECODE_FP8_V_IN_TILE = False  # FP8 cache: the V scale on each V tile, not the accumulator (the kernel's V_IN_TILE)
DECODE_FP8_NUM_WARPS = DECODE_NUM_WARPS
DECODE_FP8_NUM_STAGES = 5
DECODE_FP8_MAX_REGISTERS = 128  # a cap on registers a thread (Triton's maxnreg; 0: the compiler's choice)
DECODE_MAX_SPLIT = 512       # positions per split at most (see choose_splits; fewer at small batches) ...
DECODE_MAX_SPLITS = 64       # ... unless that makes more splits than this (a very long max_len: longer splits)
DECODE_SPLIT_PER_PROGRAM = 4     # a small batch's splits: at most this many positions per program of the batch
DECODE_FUSE_REDUCE_FROM = 33     # several splits: combined by each row's last program (the fused reduce) from this
# many programs per split (batch x kv-head programs) up; below it by the reduce kernel, which PDL (engine/pdl.py)
# starts under the split kernel's tail: at batch 1-4 on an H200 the reduce kernel was 20-40% faster per call than
# the fused reduce (docs/MEASURED.md, "Tuning history"). Wider batches were not measured and keep the fused reduce.


# the prefill kernel (prefill_kernels._prefill_kernel): a prefill of at most this many sequences launches its tiles
# packed, one program per (query tile of any sequence, head); a wider one the (tile, sequence, head) grid. Two
# compiled variants, so the warm-up plan meets a prefill past this count too.
PREFILL_PACKED_SEQS = 31


def decode_defaults(fp8: bool) -> dict:
    """paged_decode's per-cache knobs: the DECODE_* lines for a cache in the model's dtype, the DECODE_FP8_* lines
    for an e4m3 one (which alone has a V scale's place and a register cap; 0: none). The kernel's launch and the
    attention bench's default setting both read this."""
    if fp8:
        return {"page_tile": DECODE_FP8_PAGE_TILE, "num_warps": DECODE_FP8_NUM_WARPS,
                "num_stages": DECODE_FP8_NUM_STAGES, "fp8_v_in_tile": DECODE_FP8_V_IN_TILE,
                "max_registers": DECODE_FP8_MAX_REGISTERS}
    return {"page_tile": DECODE_PAGE_TILE, "num_warps": DECODE_NUM_WARPS, "num_stages": DECODE_NUM_STAGES}


def fuse_reduce(programs: int) -> bool:
    """Whether a decode of `programs` programs per split combines its splits in the split kernel."""
    return programs >= DECODE_FUSE_REDUCE_FROM


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def kv_per_program(kv_heads: int, want: int) -> int:
    """The kv heads one decode program reads: the largest divisor of kv_heads not above `want` (so any
    tensor-parallel share of the heads works)."""
    return max(h for h in range(1, max(1, min(want, kv_heads)) + 1) if kv_heads % h == 0)


def max_split_len(programs: int, block_n: int = DECODE_BLOCK_N) -> int:
    """Positions per split at most for a decode of `programs` (batch x kv-head programs): DECODE_SPLIT_PER_PROGRAM
    x programs as a power of two, between one tile and DECODE_MAX_SPLIT. A small batch's few programs each
    read a long split one tile after another; shorter splits spread it over more SMs. In a CUDA graph
    (28 layers, max_len 4096, context 1,100, bf16, H200, one lease) the decode took per layer at batch 1
    11.0 -> 10.0 us (one tile per split, 64 splits), batch 4 20.4 -> 14.5 (128), batch 8 24.6 -> 20.7 (256);
    batch 16 and more keep 512 (at 32, 128 positions per split was 16% slower)."""
    return max(block_n, min(DECODE_MAX_SPLIT, DECODE_SPLIT_PER_PROGRAM * next_power_of_2(programs)))


def choose_splits(batch: int, kv_heads: int, max_len: int, block_n: int, sm_count: int,
                  waves: int = 2) -> tuple[int, int]:
    """(num_splits, split_len) for a decode of `batch` sequences x `kv_heads` programs each whose longest
    context is max_len: enough splits that batch x kv_heads x splits fills the GPU `waves` times, each at
    most DECODE_MAX_SPLIT positions (unless that makes more than DECODE_MAX_SPLITS); split_len % block_n == 0.

    Inside a CUDA graph max_len is the model's max length, not the batch's longest context: splits sized
    from it (1408 positions at batch 16 and max_len 4096) left most contexts in one split per head. With the
    cap, splits past a row's context exit at once (about 15% off the nano-vllm workload's small-batch decode
    steps on an H200: docs/MEASURED.md, "Tuning history"). At small batches the cap is lower
    (:func:`max_split_len`)."""
    chunks = max(1, cdiv(max_len, block_n))
    want = max(1, cdiv(waves * sm_count, batch * kv_heads))
    splits = min(want, chunks)
    per_split = cdiv(chunks, splits)
    if splits > 1:
        per_split = min(chunks, max(min(per_split, max_split_len(batch * kv_heads, block_n) // block_n),
                                    cdiv(chunks, DECODE_MAX_SPLITS)))
    split_len = per_split * block_n
    return cdiv(max_len, split_len), split_len


def decode_variant(batch: int, kv_heads: int, max_len: int, sm_count: int, block_n: int = DECODE_BLOCK_N,
                   waves: int = DECODE_WAVES, kv_per_prog: int = DECODE_KV_PER_PROG) -> tuple[bool, int, bool]:
    """(DIRECT, BLOCK_S, FUSED_REDUCE) of the decode call at this batch and longest context: its compiled
    variant (BLOCK_S: the split kernel's fused reduce or the reduce kernel's). (Its other constexprs, HPP and
    PAGE_TILE, follow the engine's fixed shapes and the defaults.)"""
    programs = kv_heads // kv_per_program(kv_heads, kv_per_prog)       # programs per sequence and split
    num_splits, _ = choose_splits(batch, programs, max_len, block_n, sm_count, waves)
    direct = num_splits == 1
    return direct, max(2, next_power_of_2(num_splits)), not direct and fuse_reduce(batch * programs)


def decode_variants(max_batch: int, kv_heads: int, max_model_len: int, sm_count: int,
                    block_n: int = DECODE_BLOCK_N, waves: int = DECODE_WAVES,
                    kv_per_prog: int = DECODE_KV_PER_PROG) -> dict[tuple[bool, int, bool], tuple[int, int]]:
    """Every decode variant a batch of 1..max_batch sequences with contexts up to max_model_len can meet,
    each with one (batch, max_len) that meets it (the smallest batch, then the shortest context)."""
    out: dict[tuple[bool, int, bool], tuple[int, int]] = {}
    max_chunks = max(1, cdiv(max_model_len, block_n))
    programs = kv_heads // kv_per_program(kv_heads, kv_per_prog)
    by_want: dict[tuple[int, int, bool], int] = {}   # (the split count a batch wants, its cap, fused) -> first batch
    for batch in range(1, max_batch + 1):
        key = (max(1, cdiv(waves * sm_count, batch * programs)), max_split_len(batch * programs, block_n),
               fuse_reduce(batch * programs))
        by_want.setdefault(key, batch)
    for batch in sorted(by_want.values()):
        for chunks in range(1, max_chunks + 1):
            max_len = min(chunks * block_n, max_model_len)
            key = decode_variant(batch, kv_heads, max_len, sm_count, block_n, waves, kv_per_prog)
            out.setdefault(key, (batch, max_len))
    return out
