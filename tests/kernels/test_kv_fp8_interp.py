"""The FP8 KV cache's kernels on the CPU through Triton's interpreter (TRITON_INTERPRET=1), against float32
references built from engine/attention/kv_quant.py:

- the quantizing store (kv_store.store_kv into e4m3 caches) writes kv_quant.quantize(x, scale) byte for
  byte, saturates past 448 * scale, and leaves padding slots untouched;
- the fused q/k norm + RoPE store writes the same bytes as the kernel without the store followed by the
  quantizing store_kv;
- the paged decode (one split, several splits with the reduce kernel and with the fused reduce, 1 and 2 kv heads
  per program, the V scale on the accumulator or on each V tile) and the paged prefill read e4m3 caches: their outputs against float32 attention on the
  dequantized caches (value * scale);
- each of them again with the V cache's blocks holding each head's positions contiguous (kv_quant.v_t): the stores
  write there what a read of that layout finds, and the decode (a page's position runs a tile, or position by
  position) and the prefill read it.

The scales are 0.05 (K) and 0.02 (V), not 1.0, and the values span e4m3's range at those scales, so a kernel
that drops or misplaces a scale is off by far more than the tolerance (each case also records how far the
reference moves when a scale is dropped). Skipped where triton is not installed or its interpreter cannot run.
"""
from __future__ import annotations

import json
import sys

import pytest

from interp import interpreter_ready

K_SCALE, V_SCALE = 0.05, 0.02
DTYPES = ("float32", "bfloat16")
# decode: (kv heads per program, sm_count, fuse_reduce, V scale on each tile, block_n); sm_count 1: one split (the
# kernel writes the output), 16: several splits, combined by the reduce kernel (False) or the last split (True);
# block_n 64 reads each position's page from the block table, 16 (it divides PAGE) one page a tile, as an e4m3
# cache's default does (engine/attention/splits.py: DECODE_FP8_PAGE_TILE)
DECODE = [(1, 1, None, False, 64), (1, 16, False, False, 64), (2, 16, True, False, 64), (2, 1, None, False, 64),
          (1, 1, None, True, 64), (2, 16, True, True, 64), (1, 16, False, False, 16), (2, 1, None, False, 16)]
# the same kernels over a V cache in the other layout (kv_quant.v_t): block_n 16 with one kv head a program reads a
# page's position runs (engine/attention/decode_tiles.py: v_tile_t), the others position by position
DECODE_VT = [(1, 16, False, False, 16), (1, 1, None, False, 16), (2, 16, True, False, 16), (1, 16, False, True, 64)]
HQ, HK, D, PAGE = 4, 2, 32, 16
LENGTHS = [0, 1, 37, 70]              # a padding row, one position, partial tiles, across pages
# decode tolerance: float32 queries reach the reference to float32 rounding; bfloat16 queries (and P rounded to
# bfloat16 before P.V, as every kernel here does) to a few bf16 steps of outputs of magnitude ~1 * V_SCALE * 448
DECODE_TOL = {"float32": 1e-4, "bfloat16": 3e-2}


@pytest.mark.parametrize("v_t", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_writes_the_quantized_bytes(results, dtype, v_t):
    r = results["store"][f"{dtype}-{v_t}"]
    assert r["k_equal"] and r["v_equal"], r          # bytes: kv_quant.quantize(x, scale), padding untouched
    assert r["saturated"] > 0 and r["k_max"] == 448.0, r
    assert r["padding_untouched"], r
    assert r["dropped_scale_bytes_differ"] > 0.5, r  # the check has teeth: x itself in e4m3 is other bytes


@pytest.mark.parametrize("v_t", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_qk_norm_rope_store_quantizes_as_store_kv(results, dtype, v_t):
    r = results["fused_store"][f"{dtype}-{v_t}"]
    assert r["qk_equal"], r
    assert r["k_cache_equal"] and r["v_cache_equal"], r
    assert r["rows_written"] > 0, r


@pytest.mark.parametrize("v_t", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_reads_fp8_against_float32(results, dtype, v_t):
    for hpp, sms, fuse, v_in_tile, block_n in DECODE_VT if v_t else DECODE:
        r = results["decode"][f"{dtype}-{hpp}-{sms}-{fuse}-{v_in_tile}-{block_n}-{v_t}"]
        assert (r["splits"] == 1) == (sms == 1), r      # one split, or several (reduce kernel / fused reduce)
        assert r["max_abs"] <= DECODE_TOL[dtype], r
        assert r["padding_row_zero"], r
        assert r["k_scale_dropped_err"] > 3 * DECODE_TOL[dtype], r
        assert r["v_scale_dropped_err"] > 10 * DECODE_TOL[dtype], r


@pytest.mark.parametrize("v_t", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_reads_fp8_against_float32(results, dtype, v_t):
    r = results["prefill"][f"{dtype}-{v_t}"]
    assert r["max_abs"] <= DECODE_TOL[dtype], r
    assert r["k_scale_dropped_err"] > 10 * DECODE_TOL[dtype], r
    assert r["v_scale_dropped_err"] > 10 * DECODE_TOL[dtype], r


def test_an_e4m3_cache_launches_its_own_decode_defaults(monkeypatch):
    """paged_decode's launch on an e4m3 cache takes splits.py's DECODE_FP8_* knobs (one block-table load per tile
    where block_n divides the page, the V scale on the accumulator, the register cap) and a cache in the model's dtype
    its DECODE_* ones; a knob given wins, and max_registers=0 (LAB_FP8_DECODE's maxnreg=none) launches with no cap."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from engine.attention import kv_quant, splits
    from engine.attention import triton_kernels as tk

    launches = []

    class Grid:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append(kw)
    monkeypatch.setattr(tk, "_decode_split_kernel", Grid())
    monkeypatch.setattr(tk, "_decode_reduce_kernel", Grid())
    page, n = 256, 2
    q = torch.zeros(n, HQ, D, dtype=torch.bfloat16)
    tables, lens = torch.zeros(n, 1, dtype=torch.int32), torch.full((n,), 100, dtype=torch.int32)
    bf16 = torch.zeros(2, page, HK, D, dtype=torch.bfloat16)
    e4m3 = kv_quant.mark(torch.zeros(2, page, HK, D, dtype=kv_quant.FP8), 1.0, torch.bfloat16)

    def launch(cache, **kw):
        launches.clear()
        tk.paged_decode(q, cache, cache, tables, lens, 1.0, 100, 1, **kw)
        return launches[0]
    fp8 = launch(e4m3)
    assert (fp8["PAGE_TILE"], fp8["V_IN_TILE"], fp8.get("maxnreg")) == (
        splits.DECODE_FP8_PAGE_TILE, splits.DECODE_FP8_V_IN_TILE, splits.DECODE_FP8_MAX_REGISTERS or None)
    assert fp8["num_stages"] == splits.DECODE_FP8_NUM_STAGES and fp8["KV_FP8"]
    plain = launch(bf16)
    assert (plain["PAGE_TILE"], plain.get("maxnreg"), plain["num_stages"]) == (
        splits.DECODE_PAGE_TILE, None, splits.DECODE_NUM_STAGES)
    given = launch(e4m3, page_tile=not splits.DECODE_FP8_PAGE_TILE, fp8_v_in_tile=not splits.DECODE_FP8_V_IN_TILE,
                   max_registers=0)
    assert (given["PAGE_TILE"], given["V_IN_TILE"], "maxnreg" in given) == (
        not splits.DECODE_FP8_PAGE_TILE, not splits.DECODE_FP8_V_IN_TILE, False)
    assert launch(e4m3, block_n=48)["PAGE_TILE"] is False        # 48 does not divide the page: per-position loads


# --------------------------------------------------------------------------- the interpreted process
def _fp8_cast_fix(orig):
    """triton 3.6's interpreter converts to and from e4m3 (float8e4nv) wrongly: a mantissa that rounds up past
    its binade does not carry into the exponent (7.87 -> 4.0), subnormals are truncated, ties do not go to even,
    and e4m3 -> bfloat16 gives garbage. The GPU's conversions (cvt.rn.satfinite) round to nearest even, as
    torch's do, so in the interpreted process every conversion with an e4m3 side goes through torch; the others
    are the interpreter's own. Only the interpreter is patched."""
    import numpy as np
    import torch
    import triton.language as tl

    as_torch = {tl.float8e4nv: torch.float8_e4m3fn, tl.float32: torch.float32, tl.bfloat16: torch.bfloat16,
                tl.float16: torch.float16}
    as_int = {8: (np.int8, torch.int8), 16: (np.int16, torch.int16), 32: (np.int32, torch.int32)}

    def convert(data, src, dst, rounding_mode):
        if tl.float8e4nv not in (src, dst) or src not in as_torch or dst not in as_torch:
            return orig(data, src, dst, rounding_mode)
        np_int, _ = as_int[src.primitive_bitwidth]
        x = torch.from_numpy(np.ascontiguousarray(data).view(np_int).copy()).view(as_torch[src])
        _, t_int = as_int[dst.primitive_bitwidth]
        y = x.to(as_torch[dst]).view(t_int).numpy()
        return y.view(getattr(np, f"uint{dst.primitive_bitwidth}"))
    return convert


def _store(torch, tk, kv_quant, dtype, v_t=False) -> dict:
    from engine.attention import kv_store
    g = torch.Generator().manual_seed(1)
    t, blocks = 6, 3
    k = (torch.randn(t, HK, D, generator=g) * 8 * K_SCALE).to(dtype)
    v = (torch.randn(t, HK, D, generator=g) * 8 * V_SCALE).to(dtype)
    k[0, 0, :4] = torch.tensor([500.0, -1000.0, 448.0, 1e-4]).to(dtype) * K_SCALE     # past the range, at it, tiny
    slots = torch.tensor([3, 17, -1, 0, 40, -1])
    fill = torch.full((blocks, PAGE, HK, D), 0.5).to(kv_quant.FP8)        # padding slots must keep this
    kc, vc = fill.clone(), kv_quant.mark(fill.clone(), V_SCALE, torch.float32, v_t=v_t)
    kv_store.store_kv(k, v, kc, vc, slots, k_scale=K_SCALE, v_scale=V_SCALE)
    ref_k, ref_v = fill.clone(), fill.clone()
    live = slots >= 0
    kv_quant.write(kv_quant.mark(ref_k, K_SCALE, torch.float32), slots[live], k[live])
    kv_quant.write(kv_quant.mark(ref_v, V_SCALE, torch.float32, v_t=v_t), slots[live], v[live])
    byte = lambda x: x.view(torch.uint8)  # noqa: E731
    untouched = torch.ones(blocks * PAGE, dtype=torch.bool)
    untouched[slots[live]] = False
    dropped = k[live].float().clamp(-448, 448).to(kv_quant.FP8)
    return {"k_equal": bool(torch.equal(byte(kc), byte(ref_k))), "v_equal": bool(torch.equal(byte(vc), byte(ref_v))),
            "k_max": float(kc.float().abs().max()), "saturated": int((kc.float().abs() == 448).sum()),
            "padding_untouched": bool(torch.equal(byte(kc).view(-1, HK, D)[untouched], byte(fill).view(-1, HK, D)[untouched])),
            "dropped_scale_bytes_differ": float((byte(dropped) != byte(kc.view(-1, HK, D)[slots[live]])).float().mean())}


def _fused_store(torch, tk, kv_quant, dtype, v_t=False) -> dict:
    from engine.attention import kv_store
    from engine.layers.fused_kernels import qk_norm_rope
    from engine.layers.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(2)
    t = 5
    qkv = torch.randn(t, (HQ + 2 * HK) * D, generator=g).to(dtype)
    pos = torch.tensor([0, 3, 7, 1, 2])
    qw, kw = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype), (1 + 0.1 * torch.randn(D, generator=g)).to(dtype)
    rope = RotaryEmbedding(D, 64, 10000.0)
    slots = torch.tensor([5, -1, 20, 33, 2])
    kc, vc = (torch.zeros(3, PAGE, HK, D, dtype=kv_quant.FP8) for _ in range(2))
    kv_quant.mark(vc, V_SCALE, torch.float32, v_t=v_t)
    q1, k1 = qk_norm_rope(qkv, pos, qw, kw, rope.cos, rope.sin, HQ, HK, D, 1e-6, k_cache=kc, v_cache=vc,
                          slot_mapping=slots, k_scale=K_SCALE, v_scale=V_SCALE)
    q2, k2 = qk_norm_rope(qkv, pos, qw, kw, rope.cos, rope.sin, HQ, HK, D, 1e-6)
    rk, rv = (torch.zeros(3, PAGE, HK, D, dtype=kv_quant.FP8) for _ in range(2))
    kv_quant.mark(rv, V_SCALE, torch.float32, v_t=v_t)
    v = qkv[:, (HQ + HK) * D:].reshape(t, HK, D)
    kv_store.store_kv(k2, v, rk, rv, slots, k_scale=K_SCALE, v_scale=V_SCALE)
    byte = lambda x: x.view(torch.uint8)  # noqa: E731
    want = kv_quant.mark(torch.zeros(3, PAGE, HK, D, dtype=kv_quant.FP8), V_SCALE, torch.float32, v_t=v_t)
    kv_quant.write(want, slots[slots >= 0], v[slots >= 0])     # the torch writer of the same layout
    return {"qk_equal": bool(torch.equal(q1, q2) and torch.equal(k1, k2)),
            "k_cache_equal": bool(torch.equal(byte(kc), byte(rk))),
            "v_cache_equal": bool(torch.equal(byte(vc), byte(rv)) and torch.equal(byte(vc), byte(want))),
            "rows_written": int((byte(kc).view(-1, HK * D) != 0).any(1).sum())}


def _caches(torch, kv_quant, blocks: int, g):
    """Random e4m3 caches whose values span the format (|x| up to ~448) and their dequantized float32 copies."""
    raw_k = torch.randn(blocks, PAGE, HK, D, generator=g) * 2.0 ** torch.randint(-4, 7, (blocks, PAGE, HK, 1), generator=g)
    raw_v = torch.randn(blocks, PAGE, HK, D, generator=g) * 2.0 ** torch.randint(-4, 7, (blocks, PAGE, HK, 1), generator=g)
    kc, vc = kv_quant.quantize(raw_k, 1.0), kv_quant.quantize(raw_v, 1.0)
    kv_quant.mark(kc, K_SCALE, torch.float32)
    kv_quant.mark(vc, V_SCALE, torch.float32)
    return kc, vc, kc.float() * K_SCALE, vc.float() * V_SCALE


def _decode(torch, tk, kv_quant, dtype, hpp, sms, fuse, v_in_tile, block_n, v_t=False) -> dict:
    from labkit.bench.attention import decode_reference

    g = torch.Generator().manual_seed(3)
    blocks = 24
    kc, vc, kf, vf = _caches(torch, kv_quant, blocks, g)
    n = len(LENGTHS)
    tables = torch.randperm(blocks, generator=g)[: n * 5].view(n, 5).to(torch.int32)
    lens = torch.tensor(LENGTHS, dtype=torch.int32)
    q = torch.randn(n, HQ, D, generator=g).to(dtype)
    scale = D ** -0.5
    out = tk.paged_decode(q, kc, kv_quant.to_v_t(vc) if v_t else vc, tables, lens, scale, max(LENGTHS), sms,
                          block_n=block_n, kv_per_prog=hpp, fuse_reduce=fuse, fp8_v_in_tile=v_in_tile)
    ref = decode_reference(q, kf, vf, tables, lens, scale)
    live = lens > 0
    err = float((out.float() - ref)[live].abs().max())
    no_k = decode_reference(q, kc.float(), vf, tables, lens, scale)           # what a dropped K scale gives
    no_v = decode_reference(q, kf, vc.float(), tables, lens, scale)           # ... a dropped V scale
    splits, _ = tk.choose_splits(n, HK // hpp, max(LENGTHS), block_n, sms, tk.DECODE_WAVES)
    return {"max_abs": err, "splits": splits, "padding_row_zero": bool((out[~live] == 0).all()),
            "k_scale_dropped_err": float((no_k - ref)[live].abs().max()),
            "v_scale_dropped_err": float((no_v - ref)[live].abs().max())}


def _prefill(torch, pk, kv_quant, dtype, v_t=False) -> dict:
    from labkit.bench.attention import prefill_reference

    g = torch.Generator().manual_seed(4)
    seqs, prefix, new, blocks = 2, 20, 12, 8
    kc, vc, kf, vf = _caches(torch, kv_quant, blocks, g)
    per = (prefix + new + PAGE - 1) // PAGE
    tables = torch.randperm(blocks, generator=g)[: seqs * per].view(seqs, per).to(torch.int32)
    q = torch.randn(seqs * new, HQ, D, generator=g).to(dtype)
    cu_q = torch.arange(0, seqs + 1, dtype=torch.int32) * new
    cu_k = torch.arange(0, seqs + 1, dtype=torch.int32) * (prefix + new)
    scale = D ** -0.5
    out = pk.paged_prefill(q, kc, kv_quant.to_v_t(vc) if v_t else vc, tables, cu_q, cu_k, new, scale, block_m=16,
                           block_n=16)
    ref = prefill_reference(q, kf, vf, tables, seqs, prefix, new, scale)
    no_k = prefill_reference(q, kc.float(), vf, tables, seqs, prefix, new, scale)
    no_v = prefill_reference(q, kf, vc.float(), tables, seqs, prefix, new, scale)
    return {"max_abs": float((out.float() - ref).abs().max()),
            "k_scale_dropped_err": float((no_k - ref).abs().max()),
            "v_scale_dropped_err": float((no_v - ref).abs().max())}


def main() -> None:
    import torch

    from engine.attention import kv_quant
    from engine.attention import prefill_kernels as pk
    from engine.attention import triton_kernels as tk
    from engine.attention import kv_store

    def probe():
        c = torch.zeros(1, PAGE, 1, D, dtype=kv_quant.FP8)
        kv_store.store_kv(torch.ones(1, 1, D), torch.ones(1, 1, D), c, c.clone(), torch.tensor([0]), k_scale=1.0, v_scale=1.0)

    import triton.runtime.interpreter as interp

    from test_decode_kernel_interp import _bf16_dot_fix

    interp._convert_float = _fp8_cast_fix(interp._convert_float)
    interp.InterpreterBuilder.create_dot = _bf16_dot_fix(interp.InterpreterBuilder.create_dot)
    if not interpreter_ready(probe):
        return
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    both = [(d, t) for d in DTYPES for t in (False, True)]
    out = {"store": {f"{d}-{t}": _store(torch, tk, kv_quant, dt[d], t) for d, t in both},
           "fused_store": {f"{d}-{t}": _fused_store(torch, tk, kv_quant, dt[d], t) for d, t in both},
           "decode": {f"{d}-{hpp}-{sms}-{fuse}-{vit}-{bn}-{t}": _decode(torch, tk, kv_quant, dt[d], hpp, sms, fuse, vit,
                                                                        bn, t)
                      for d, t in both for hpp, sms, fuse, vit, bn in (DECODE_VT if t else DECODE)},
           "prefill": {f"{d}-{t}": _prefill(torch, pk, kv_quant, dt[d], t) for d, t in both}}
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
