"""A whole decoder layer of a batch-1 decode step in one persistent Triton kernel (CUDA; opt-in, LAB_DECODE_LAYER).

At batch 1 a layer is six kernels (the normed qkv GEMV, the decode prologue's split attention, its reduce, the o
GEMV, the normed gate_up GEMV, the SiLU down GEMV), and the step budget on an H100 gave them about 31 us of device
time a layer for about 12 us of bytes: what is left is each kernel's ramp and tail, not bandwidth. Here one launch
of P programs (at most one an SM, so all of them are resident at once) runs the layer's five phases in order, each
program taking the phase's work items pid, pid + P, ...:

1. qkv = W_qkv . RMSNorm(x + residual)          bands of output features; h = x + residual stored (band 0)
2. attention                                    (kv head, split) items: the decode prologue's math (q/k norm and
                                                RoPE, the new k and v made and stored, the split's online softmax;
                                                engine/attention/triton_kernels.py's helpers), the last split of a
                                                kv head to finish combining its query heads (the fused reduce)
3. o = W_o . attention                          bands
4. gate_up = W_gate_up . RMSNorm(o + h)         bands; h2 = o + h stored (band 0)
5. y = W_down . (silu(gate) * up)               bands; the layer returns (y, h2), the next layer's (x, residual)

Between two phases every program waits at a grid barrier (:func:`_grid_barrier`): four a layer where the six
kernels had six launches. Before it waits, a program loads the first weight tile of its next phase (weights never
change in a step), as the GEMV kernels load theirs before their PDL wait, and inside a phase each tile one chunk
ahead of its products (:func:`_gemv_phase`). Each GEMV phase rounds where the GEMV kernels round
(engine/layers/gemv.py's device functions; float32 sums, in their own order), and the attention phase computes
what the decode prologue computes, in its own split layout (one kv head an item).

The barrier counts programs in on a counter and spins until all P have: programs that are not resident would
never arrive, hence P at most the SM count (the kernel's registers, about 225 a thread at Qwen3's shapes in its
sm_90 build, leave room for one program an SM). Triton's interpreter runs a grid's programs one
after another, so there a spin would never end: on the CPU :func:`decode_layer` launches each phase on its own
(``phases``), the same device code between the barriers; the GPU test compares the one launch with that.
A spin gives up after ``MAX_SPIN`` reads and raises the error flag (:func:`layer_sync`), so a barrier that cannot
complete ends in wrong numbers a test sees, not in a hung device; the engine reads the flag once its warm-up and
graph captures have run the kernel and refuses to start if it is up (ModelRunner._check_decode_layer).

The case it takes (Qwen3DecoderLayer.decode_layer_ok): one token, a decode step, Qwen3's q/k norm, no biases, one
rank, a KV cache in the model's dtype (not FP8), the Triton backend with fused ops.

It stays off by default: replayed from CUDA graphs it was slower than the six kernels, its kernel at about a quarter
of its bytes' bound (docs/MEASURED.md). The likely reason is its one program of NUM_WARPS warps an SM: few weight
bytes in flight an SM, where the separate GEMVs keep several programs an SM streaming; the launch ramp it removes
is what graphs and PDL already hide.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine import pdl
from engine.attention.splits import DECODE_BLOCK_N, choose_splits, next_power_of_2
from engine.attention.triton_common import roped
from engine.attention.decode_tiles import (combine_splits, new_token_inputs, new_token_rows, new_token_state, tile_rows,
                                          tile_update)
from engine.layers.gemv import _load_w, _row_rstd, _x_chunk

PHASES = 5
MAX_SPIN = tl.constexpr(1 << 20)     # reads of a barrier's counter before it gives up (about a second)
NUM_WARPS = 8
# the layer's counters, per device: four barrier counters, the error flag, and a counter per kv head (the fused
# reduce) from KV_COUNTERS on
FLAG = 4
KV_COUNTERS = 8
SYNC_WORDS = 1024
# the same, as the kernel reads them
_PHASES, _FLAG, _KV_COUNTERS = tl.constexpr(PHASES), tl.constexpr(FLAG), tl.constexpr(KV_COUNTERS)
_sync: dict[torch.device, torch.Tensor] = {}


def layer_sync(device: torch.device | str) -> torch.Tensor | None:
    """The layer kernel's counters on ``device`` (zeros; a launch leaves them at zero, but for its last barrier's,
    which the next launch resets first): allocated on the first call outside a CUDA graph capture (None inside one
    before that). ``[FLAG]`` turns 1 where a barrier gave up. A CUDA device without an index is the current one (the
    runner names "cuda", a tensor "cuda:0")."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    sync = _sync.get(device)
    if sync is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        sync = _sync[device] = torch.zeros(SYNC_WORDS, dtype=torch.int32, device=device)
    return sync


@triton.jit
def _grid_barrier(count_ptr, flag_ptr, nprog):
    """Every program of the grid waits here until all ``nprog`` have arrived: this program's writes are issued
    (debug_barrier) before one release add counts it in, and its later reads follow the acquire read that saw the
    count complete. Gives up after MAX_SPIN reads, raising the flag."""
    tl.debug_barrier()
    tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    spins = 0
    while (seen < nprog) & (spins < MAX_SPIN):
        seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    if seen < nprog:
        tl.atomic_xchg(flag_ptr, 1)
    tl.debug_barrier()


@triton.jit
def _first_tile(w_ptr, band, N, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The weight tile of ``band``'s first K chunk (zeros past N: a program with no band of its own)."""
    rn = band * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    return _load_w(w_ptr, rn, rk, rn < N, rk < K, stride_w, EVEN_K)


@triton.jit
def _gemv_phase(x_ptr, res_ptr, nw_ptr, h_ptr, w_ptr, y_ptr, w_first, N, K, stride_w, eps, pid, nprog,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_ROW: tl.constexpr, EVEN_K: tl.constexpr,
                SILU_MUL: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, TRIPS: tl.constexpr,
                CHUNKS: tl.constexpr):
    """y = W . x over the bands pid, pid + nprog, ... (TRIPS of them; those past N masked, nothing stored), each
    CHUNKS chunks of K; x normed (NORM: RMSNorm of x [+ res] as gemv._x_chunk makes it, h = x + res stored by the
    band-0 program) or silu(gate) * up (SILU_MUL). Every weight tile is loaded one chunk ahead of its products (the
    band's next chunk, or the first of the program's next band; the first, ``w_first``, before the barrier), so a
    tile streams in while the one before it is multiplied: with one program an SM its own loads are all the SM has
    in flight. A band's sum: float32, chunk by chunk (EVEN_K: K a multiple of BLOCK_K)."""
    rstd = 0.0
    if NORM:
        rstd = _row_rstd(x_ptr, res_ptr, K, eps, BLOCK_ROW, HAS_RES)
    cols = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, BLOCK_N)
    w = w_first
    acc = tl.zeros([BLOCK_N], tl.float32)
    for i in range(TRIPS * CHUNKS):
        band = pid + (i // CHUNKS) * nprog
        c = i % CHUNKS
        nrn = (pid + ((i + 1) // CHUNKS) * nprog) * BLOCK_N + rows       # the next tile's rows and columns
        nrk = ((i + 1) % CHUNKS) * BLOCK_K + cols
        w_next = _load_w(w_ptr, nrn, nrk, (nrn < N) & (i + 1 < TRIPS * CHUNKS), nrk < K, stride_w, EVEN_K)
        rk = c * BLOCK_K + cols
        x = _x_chunk(x_ptr, res_ptr, nw_ptr, h_ptr, rk, rk < K, rstd, band, K, EVEN_K, SILU_MUL, NORM, HAS_RES)
        part = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], 1)
        acc = tl.where(c == 0, part, acc + part)
        if c == CHUNKS - 1:
            rn = band * BLOCK_N + rows
            tl.store(y_ptr + rn, acc.to(y_ptr.dtype.element_ty), mask=rn < N)
        w = w_next


@triton.jit
def _attention_phase(qkv_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, pos_ptr, slot_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr,
                     acc_ptr, ml_ptr, out_ptr, lock_ptr, scale, eps, split_len, pid, nprog,
                     HK: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                     PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr,
                     TRIPS: tl.constexpr):
    """The (kv head, split) items pid, pid + nprog, ...: the decode prologue's split (triton_kernels
    _decode_split_kernel with PROLOGUE, one kv head an item) of the one sequence; its partial written, and the last
    split of the kv head to count in combines the head's query heads into out [Hq * D]. One split: the output
    written directly."""
    ctx = tl.load(ctx_ptr)
    slot, qw1, qw2, kw1, kw2, c, s_ = new_token_inputs(pos_ptr, slot_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, 0,
                                                       qkv_ptr.dtype.element_ty, D)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    gmask = offs_g < G
    r_pos = tl.arange(0, BLOCK_N)
    r_head = tl.zeros([BLOCK_N], tl.int32)
    g_head = tl.zeros([BLOCK_G], tl.int32)
    active = tl.minimum(SPLITS, tl.cdiv(ctx, split_len))
    for trip in range(TRIPS):
        item = pid + trip * nprog
        kvh = item % HK
        s = item // HK
        start = s * split_len
        heads = kvh * G + offs_g
        if (s < active) & (item < HK * SPLITS):
            q = roped(qkv_ptr, heads, gmask, qw1, qw2, c, s_, eps, D)
            end = tl.minimum(ctx - 1, start + split_len)
            m = tl.full([BLOCK_G], float("-inf"), tl.float32)
            l = tl.zeros([BLOCK_G], tl.float32)
            acc = tl.zeros([BLOCK_G, D], tl.float32)
            if (ctx - 1 >= start) & (ctx - 1 < start + split_len):     # the new token: made, stored, folded in
                k1, k2, v_new = new_token_rows(qkv_ptr, kvh + g_head, gmask, HK, G, D)
                m, l, acc = new_token_state(q, k1, k2, v_new, kvh + g_head, offs_g, gmask, slot, kw1, kw2, c, s_,
                                            kc_ptr, vc_ptr, eps, scale, 1.0, 1.0, HK, G, D, BLOCK_G, False, False)
            for kstart in range(start, end, BLOCK_N):
                kv_off, valid = tile_rows(bt_ptr, 0, 0, kstart, end, r_pos, r_head, kvh, offs_d, PAGE, HK, D,
                                          False)
                k = tl.load(kc_ptr + kv_off, mask=valid[:, None], other=0.0)
                v = tl.load(vc_ptr + kv_off, mask=valid[:, None], other=0.0)
                m, l, acc = tile_update(q, k, v, valid, g_head, r_head, m, l, acc, scale, 1.0, IEEE, 1, False,
                                        False)
            if SPLITS == 1:
                o = tl.where(l[:, None] > 0, acc / tl.maximum(l, 1e-30)[:, None], 0.0)
                tl.store(out_ptr + heads[:, None] * D + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
                         mask=gmask[:, None])
            else:
                base = heads * SPLITS + s
                tl.store(acc_ptr + base[:, None] * D + offs_d[None, :], acc, mask=gmask[:, None])
                tl.store(ml_ptr + base * 2, m, mask=gmask)
                tl.store(ml_ptr + base * 2 + 1, l, mask=gmask)
                tl.debug_barrier()                          # the whole partial is written before the count
                if tl.atomic_add(lock_ptr + kvh, 1, sem="acq_rel", scope="gpu") == active - 1:
                    tl.atomic_xchg(lock_ptr + kvh, 0)       # every split of this launch has counted
                    offs_s = tl.arange(0, SPLITS)
                    for gi in tl.static_range(G):
                        combine_splits(acc_ptr, ml_ptr, (kvh * G + gi) * SPLITS + offs_s, offs_s < active,
                                       out_ptr + (kvh * G + gi) * D, offs_d, D)


@triton.jit(do_not_specialize=["split_len"])
def _decode_layer_kernel(
        x_ptr, res_ptr, h_ptr, h2_ptr, y_ptr,                       # the layer's activations in and out
        in_norm_ptr, qkv_w_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, o_w_ptr, post_norm_ptr, gu_w_ptr, down_w_ptr,
        kc_ptr, vc_ptr, bt_ptr, ctx_ptr, pos_ptr, slot_ptr,           # the cache and the step's row
        qkv_ptr, attn_ptr, o_ptr, gu_ptr, acc_ptr, ml_ptr, sync_ptr,  # scratch
        eps, qk_eps, scale, split_len,
        H: tl.constexpr, HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, INTER: tl.constexpr,
        PAGE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
        BN_QKV: tl.constexpr, BN_O: tl.constexpr, BN_GU: tl.constexpr, BN_DOWN: tl.constexpr,
        T_QKV: tl.constexpr, T_ATT: tl.constexpr, T_O: tl.constexpr, T_GU: tl.constexpr, T_DOWN: tl.constexpr,
        BK_QKV: tl.constexpr, BK_O: tl.constexpr, BK_GU: tl.constexpr, BK_DOWN: tl.constexpr,
        C_QKV: tl.constexpr, C_O: tl.constexpr, C_GU: tl.constexpr, C_DOWN: tl.constexpr,
        E_QKV: tl.constexpr, E_O: tl.constexpr, E_GU: tl.constexpr, E_DOWN: tl.constexpr,
        BLOCK_ROW: tl.constexpr, HAS_RES: tl.constexpr, IEEE: tl.constexpr,
        NPROG: tl.constexpr, FIRST: tl.constexpr = 1, LAST: tl.constexpr = 5, PDL: tl.constexpr = False):
    """Phases FIRST..LAST of the layer (module docstring), a grid barrier between two of them; NPROG programs (the
    grid, as a constant: the interpreter's num_programs is no scalar its range takes). Each GEMV phase has its own
    tile (BN_ rows by BK_ columns), trips T_ and chunks C_ a band, E_: its K a multiple of BK_."""
    pid = tl.program_id(0)
    nprog = NPROG
    NQKV: tl.constexpr = (HQ + 2 * HK) * D
    if FIRST == 1:
        w_first = _first_tile(qkv_w_ptr, pid, NQKV, H, H, BN_QKV, BK_QKV, E_QKV)
    pdl.enter(PDL)      # engine/pdl.py: nothing before this line reads what an earlier kernel wrote
    if FIRST == 1:              # (nested: Triton's interpreter cannot `&` a constexpr with a bool)
        if LAST == _PHASES:     # barrier 4's counter, still at nprog from the last launch (1-3 reset theirs below)
            if pid == 0:
                tl.atomic_xchg(sync_ptr + 3, 0)
    if FIRST == 1:
        _gemv_phase(x_ptr, res_ptr, in_norm_ptr, h_ptr, qkv_w_ptr, qkv_ptr, w_first, NQKV, H, H, eps, pid, nprog,
                    BN_QKV, BK_QKV, BLOCK_ROW, E_QKV, False, True, HAS_RES, T_QKV, C_QKV)
    if (FIRST <= 1) & (LAST >= 2):
        _grid_barrier(sync_ptr + 0, sync_ptr + _FLAG, nprog)
    if (FIRST <= 2) & (LAST >= 2):
        _attention_phase(qkv_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, pos_ptr, slot_ptr, qw_ptr, kw_ptr, cos_ptr,
                         sin_ptr, acc_ptr, ml_ptr, attn_ptr, sync_ptr + _KV_COUNTERS, scale, qk_eps, split_len, pid,
                         nprog, HK, HQ // HK, BLOCK_G, D, PAGE, BLOCK_N, SPLITS, IEEE, T_ATT)
    if (FIRST <= 3) & (LAST >= 3):
        w_first = _first_tile(o_w_ptr, pid, H, HQ * D, HQ * D, BN_O, BK_O, E_O)
    if (FIRST <= 2) & (LAST >= 3):
        _grid_barrier(sync_ptr + 1, sync_ptr + _FLAG, nprog)
        if pid == 0:
            tl.atomic_xchg(sync_ptr + 0, 0)        # every program is past barrier 1
    if (FIRST <= 3) & (LAST >= 3):
        _gemv_phase(attn_ptr, attn_ptr, attn_ptr, attn_ptr, o_w_ptr, o_ptr, w_first, H, HQ * D, HQ * D, eps, pid,
                    nprog, BN_O, BK_O, 1, E_O, False, False, False, T_O, C_O)
    if (FIRST <= 4) & (LAST >= 4):
        w_first = _first_tile(gu_w_ptr, pid, 2 * INTER, H, H, BN_GU, BK_GU, E_GU)
    if (FIRST <= 3) & (LAST >= 4):
        _grid_barrier(sync_ptr + 2, sync_ptr + _FLAG, nprog)
        if pid == 0:
            tl.atomic_xchg(sync_ptr + 1, 0)
    if (FIRST <= 4) & (LAST >= 4):
        _gemv_phase(o_ptr, h_ptr, post_norm_ptr, h2_ptr, gu_w_ptr, gu_ptr, w_first, 2 * INTER, H, H, eps, pid,
                    nprog, BN_GU, BK_GU, BLOCK_ROW, E_GU, False, True, True, T_GU, C_GU)
    if LAST >= 5:
        w_first = _first_tile(down_w_ptr, pid, H, INTER, INTER, BN_DOWN, BK_DOWN, E_DOWN)
    if (FIRST <= 4) & (LAST >= 5):
        _grid_barrier(sync_ptr + 3, sync_ptr + _FLAG, nprog)
        if pid == 0:
            tl.atomic_xchg(sync_ptr + 2, 0)
    if LAST >= 5:
        _gemv_phase(gu_ptr, gu_ptr, gu_ptr, gu_ptr, down_w_ptr, y_ptr, w_first, H, INTER, INTER, eps, pid, nprog,
                    BN_DOWN, BK_DOWN, 1, E_DOWN, True, False, False, T_DOWN, C_DOWN)


TILE_ELEMENTS = 16384           # a weight tile's elements at most (64 a thread at NUM_WARPS, as the GEMV kernels')
MAX_BAND_ROWS = 16


def gemv_tile(n: int, k: int, programs: int, tile_elements: int = TILE_ELEMENTS) -> tuple[int, int]:
    """(rows, columns) of a GEMV phase's weight tile for an [n, k] weight over ``programs``: the most rows (a power
    of two, at most MAX_BAND_ROWS) that still give every program a band, then as many columns (a power of two, up
    to the whole row) as ``tile_elements`` allows. A narrow weight (Qwen3-0.6B's o and down: 4-row bands) so takes its
    row in one or two chunks, not several small ones: each chunk is a round trip to memory for a program that
    has only its own loads in flight."""
    rows = MAX_BAND_ROWS
    while rows > 1 and triton.cdiv(n, rows) < programs:
        rows //= 2
    return rows, min(next_power_of_2(max(k, 16)), max(16, tile_elements // rows))


def decode_layer(x: torch.Tensor, residual: torch.Tensor | None, *, in_norm: torch.Tensor, qkv_w: torch.Tensor,
                 q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 o_w: torch.Tensor, post_norm: torch.Tensor, gate_up_w: torch.Tensor, down_w: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, eps: float,
                 qk_eps: float, max_len: int, sm_count: int, programs: int | None = None,
                 phases: bool | None = None, tile_elements: int = TILE_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer at one token: x, residual [1, H] (residual None: the first layer, h = x) -> (y, h2), the
    next layer's x and residual; the new token's k and v stored at slot_mapping[0]. programs: P (default the SM
    count, and never above it); phases: one launch a phase (the default on the CPU, where the interpreter cannot
    spin at a barrier) instead of one launch in all; tile_elements: the weight tiles' size at most (gemv_tile)."""
    _, page, hk, d = k_cache.shape
    h_size = x.shape[1]
    hq = qkv_w.shape[0] // d - 2 * hk
    inter = down_w.shape[1]
    assert x.shape == (1, h_size) and x.is_contiguous() and qkv_w.shape == ((hq + 2 * hk) * d, h_size)
    assert k_cache.dtype == x.dtype, "the layer kernel reads a cache in the model's dtype"
    device = x.device
    if phases is None:
        phases = device.type != "cuda"
    p = max(1, min(programs or sm_count, sm_count))
    num_splits, split_len = choose_splits(1, hk, max_len, DECODE_BLOCK_N, sm_count)
    num_splits = next_power_of_2(num_splits)            # a power of two for the combine's load (extra ones idle)
    e = lambda *shape, dtype=x.dtype: torch.empty(*shape, dtype=dtype, device=device)     # noqa: E731
    h = x if residual is None else e(1, h_size)
    h2, y, qkv, attn, o, gu = e(1, h_size), e(1, h_size), e(qkv_w.shape[0]), e(hq * d), e(h_size), e(2 * inter)
    acc = e(hq * num_splits * d, dtype=torch.float32)
    ml = e(hq * num_splits * 2, dtype=torch.float32)
    sync = layer_sync(device)
    assert sync is not None and KV_COUNTERS + hk <= SYNC_WORDS
    args = (x, x if residual is None else residual, h, h2, y, in_norm, qkv_w, q_norm, k_norm, cos, sin, o_w,
            post_norm, gate_up_w, down_w, k_cache, v_cache, block_tables, context_lens, positions, slot_mapping,
            qkv, attn, o, gu, acc, ml, sync, eps, qk_eps, d ** -0.5, split_len)
    meta = dict(H=h_size, HQ=hq, HK=hk, D=d, INTER=inter, PAGE=page, BLOCK_G=max(16, next_power_of_2(hq // hk)),
                BLOCK_N=DECODE_BLOCK_N, SPLITS=num_splits, T_ATT=triton.cdiv(hk * num_splits, p), NPROG=p,
                BLOCK_ROW=next_power_of_2(h_size), HAS_RES=residual is not None, IEEE=x.dtype == torch.float32,
                num_warps=NUM_WARPS)
    for name, (n, k) in {"QKV": qkv_w.shape, "O": o_w.shape, "GU": gate_up_w.shape, "DOWN": down_w.shape}.items():
        rows, cols = gemv_tile(n, k, p, tile_elements)
        meta |= {f"BN_{name}": rows, f"BK_{name}": cols, f"T_{name}": triton.cdiv(triton.cdiv(n, rows), p),
                 f"C_{name}": triton.cdiv(k, cols), f"E_{name}": k % cols == 0}
    if phases:
        for phase in range(1, PHASES + 1):
            _decode_layer_kernel[(p,)](*args, **meta, FIRST=phase, LAST=phase)
    else:
        _decode_layer_kernel[(p,)](*args, **meta, **pdl.launch(x))
    return y, h2
