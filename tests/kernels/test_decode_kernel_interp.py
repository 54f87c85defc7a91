"""The Triton paged decode kernel on the CPU through Triton's interpreter (TRITON_INTERPRET=1): every
decode variant (kv heads per program, one block-table load per tile, tile sizes) against the float32
dense reference, for pages smaller and larger than a tile, 1, 2 and 4 query heads per kv head, ragged
contexts with padding rows (context 0) and single positions, bf16 and float32, one split and several.

Skipped where triton is not installed (the CPU CI installs torch's CPU wheel only) or its interpreter
cannot run a kernel here.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from labkit.bench.attention import OUTPUT_TOL, decode_reference

ROOT = Path(__file__).resolve().parents[2]
HK, D = 4, 32
# (kv_per_prog, page_tile, block_n): today's kernel first, then the candidates
VARIANTS = [(1, False, 64), (1, True, 64), (2, True, 32), (2, False, 32), (4, True, 16), (4, False, 16)]
PAGES = (16, 256)
LENGTHS = [0, 1, 37, 300]          # a padding row, one position, a partial tile, across a 256-page boundary
# (G, dtype, sm_count): every G in both dtypes; sm_count 1 gives one split (DIRECT: the kernel writes the
# output itself), 16 several splits and the reduce kernel; each G and each dtype meets both
SETTINGS = [(1, "float32", 1), (1, "bfloat16", 16), (2, "float32", 16), (2, "bfloat16", 1), (4, "float32", 1),
            (4, "bfloat16", 16)]
# SETTINGS in two halves, each with every G, both dtypes, one split and several. Today's kernel (VARIANTS[0], the
# digests' baseline) runs every setting on both pages; a candidate runs one half on one page and the other half on
# the other (alternating with the variant), so every pair of variant, page and setting still meets (each variant
# every setting, each page every setting). An interpreted case costs about half a second of CPU: the candidates'
# triples would add 30 cases for no pair not already met. The launch-order and the reduce-kernel cases (today's kernel
# with one switch changed) run one half on each page the same way: each switch meets every setting and both pages.
HALVES = ([SETTINGS[0], SETTINGS[2], SETTINGS[5]], [SETTINGS[1], SETTINGS[3], SETTINGS[4]])


def switch_settings(page) -> list:
    """The settings a launch-order or reduce-kernel case runs on ``page``: one half each page."""
    return HALVES[PAGES.index(page)]


def variant_settings(variant, page) -> list:
    if tuple(variant) == VARIANTS[0]:
        return SETTINGS
    return HALVES[(VARIANTS.index(tuple(variant)) + PAGES.index(page)) % 2]


def _index_fix(orig):
    """triton 3.6's interpreter turns a scalar into int() of a 1-element array, which numpy >= 2.4 refuses
    (a dynamic loop bound then fails): take the element itself. Only the interpreter is patched."""
    def patch(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    return patch


def _bf16_dot_fix(orig):
    """triton 3.6's interpreter keeps bfloat16 as its uint16 bits and multiplies those in tl.dot: widen
    bfloat16 operands to float32 first (exact), as the GPU's MMA does."""
    import numpy as np
    import triton.language as tl

    def widen(h):
        if h.dtype.scalar == tl.bfloat16:
            return type(h)((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return orig(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)
    return create_dot


@pytest.fixture(scope="module")
def results():
    """Every (variant, page, G, dtype, splits) case run once in a fresh interpreter process: triton reads
    TRITON_INTERPRET when triton.language is imported, so it cannot be switched on inside this process."""
    pytest.importorskip("triton")
    cases = [[list(v), page, *s] for v in VARIANTS for page in PAGES for s in variant_settings(v, page)]
    cases += [[[3, True, 16], 256, *s] for s in SETTINGS[:2]]
    cases += [[list(VARIANTS[0]), page, *s, True] for page in PAGES for s in switch_settings(page)]   # launch order
    cases += [[list(VARIANTS[0]), page, *s, False, False] for page in PAGES for s in switch_settings(page)]  # reduce
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, __file__], input=json.dumps(cases), capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(out["skip"])
    return {(tuple(c[0]), *c[1:]): r for c, r in zip(cases, out["results"])}


def paged_case(page: int, g: int, dtype, lengths=LENGTHS, seed: int = 0):
    """Random K/V in a pool of scattered pages, block tables padded with -1 (as the engine pads them)."""
    gen = torch.Generator().manual_seed(seed)
    pages = [(n + page - 1) // page for n in lengths]
    num_blocks = sum(pages) + 3
    k_cache = torch.randn(num_blocks, page, HK, D, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, page, HK, D, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(max(pages), 1)
    tables, i = [], 0
    for p in pages:
        tables.append(perm[i:i + p] + [-1] * (width - p))
        i += p
    q = torch.randn(len(lengths), HK * g, D, generator=gen).to(dtype)
    return (q, k_cache, v_cache, torch.tensor(tables, dtype=torch.int32),
            torch.tensor(lengths, dtype=torch.int32))


def run_case(tk, variant, page: int, g: int, dtype: str, sm_count: int, ordered: bool = False,
             fused: bool = True) -> dict:
    """One kernel call against the float32 reference: max abs error, padding rows, output dtype and shape,
    and a digest of the output (the launch order must not change a bit of it). ordered: the rows' programs
    launch longest context first (AttentionMetadata.decode_order). fused: several splits are combined by
    their last program (the engine's path), else by the reduce kernel; the counters must end at zero."""
    from engine.step_inputs import longest_first

    dt = getattr(torch, dtype)
    q, kc, vc, bt, ctx = paged_case(page, g, dt, seed=g)
    hpp, page_tile, block_n = variant
    order = torch.tensor(longest_first(ctx.tolist()), dtype=torch.int32) if ordered else None
    try:
        out = tk.paged_decode(q, kc, vc, bt, ctx, D ** -0.5, int(ctx.max()), sm_count, block_n=block_n,
                              kv_per_prog=hpp, page_tile=page_tile, order=order, fuse_reduce=fused)
    except Exception as e:                         # noqa: BLE001 (reported to the test, which fails on it)
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    ref = decode_reference(q, kc, vc, bt, ctx, D ** -0.5)
    ref[ctx == 0] = 0.0                            # a padding row: the kernel writes zeros
    err = (out.float() - ref).abs().max().item()
    return {"max_abs_err": err if err == err else float("inf"), "same_dtype": out.dtype == dt,
            "same_shape": out.shape == q.shape, "padding_zero": out[ctx == 0].abs().max().item() == 0,
            "digest": hashlib.sha256(out.float().numpy().tobytes()).hexdigest(),
            "locks_zero": all(int(v.abs().sum()) == 0 for v in tk._locks.values())}


def check(r: dict, dtype: str) -> None:
    assert "error" not in r, r
    assert r["same_dtype"] and r["same_shape"] and r["padding_zero"] and r["locks_zero"], r
    assert r["max_abs_err"] <= (1e-4 if dtype == "float32" else OUTPUT_TOL), r


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"hpp{v[0]}-{'pagetile' if v[1] else 'gather'}-n{v[2]}")
@pytest.mark.parametrize("page", PAGES)
def test_variant_matches_reference(results, variant, page):
    for g, dtype, sm in variant_settings(variant, page):
        check(results[(variant, page, g, dtype, sm)], dtype)


@pytest.mark.parametrize("page", PAGES)
def test_launch_order_changes_no_bit_of_the_output(results, page):
    """The rows launched longest context first (the engine's decode_order; LENGTHS is not in that order):
    every output as the reference wants it and bit-identical to the row-order launch."""
    from engine.step_inputs import longest_first
    assert longest_first(LENGTHS) != list(range(len(LENGTHS)))
    for g, dtype, sm in switch_settings(page):
        r = results[(VARIANTS[0], page, g, dtype, sm, True)]
        check(r, dtype)
        assert r["digest"] == results[(VARIANTS[0], page, g, dtype, sm)]["digest"], (g, dtype, sm)


@pytest.mark.parametrize("page", PAGES)
def test_the_reduce_kernel_and_the_fused_reduce_agree(results, page):
    """Several splits (sm_count 16) combined by the reduce kernel: the reference's output, and the fused
    reduce's (the default, every other case here) to float32 rounding."""
    for g, dtype, sm in switch_settings(page):
        r = results[(VARIANTS[0], page, g, dtype, sm, False, False)]
        check(r, dtype)
        if sm == 1:        # one split: no reduce of either kind, the same kernel
            assert r["digest"] == results[(VARIANTS[0], page, g, dtype, sm)]["digest"]


def test_kv_per_prog_follows_the_kv_heads(results):
    """A kv_per_prog that does not divide the kv heads (a TP share of 3 heads, say) uses the largest divisor."""
    from engine.attention.splits import kv_per_program
    assert [kv_per_program(4, w) for w in (1, 2, 3, 4, 8)] == [1, 2, 2, 4, 4]
    assert [kv_per_program(3, w) for w in (1, 2, 4)] == [1, 1, 3]
    for g, dtype, sm in SETTINGS[:2]:
        check(results[((3, True, 16), 256, g, dtype, sm)], dtype)        # 3 -> 2 kv heads per program here


# -- the sweep's ranking (pure Python) --------------------------------------------------------------------
def _result(share, ok=True, **knobs):
    base = {"kv_per_prog": 1, "page_tile": False, "block_n": 64, "num_warps": 4, "num_stages": 3, "waves": 4}
    return base | knobs | {"share_of_roof": share, "output_ok": ok}


def test_sweep_ranks_the_setting_robust_across_shapes_and_never_a_wrong_output():
    from labkit.bench.attention import default_decode_setting, kernel_sweep_settings, rank_kernel_sweep

    assert default_decode_setting() in kernel_sweep_settings()          # today's kernel is always timed
    fast_wrong = _result(0.99, ok=False, kv_per_prog=4)
    peaky = _result(0.95, kv_per_prog=2)                                 # best on one shape, poor on the other
    steady = _result(0.88, page_tile=True)
    shapes = [{"batch": 256, "context": 1024, "results": [fast_wrong, peaky, steady]},
              {"batch": 1, "context": 4096, "results": [fast_wrong | {"share_of_roof": 0.9},
                                                        peaky | {"share_of_roof": 0.3},
                                                        steady | {"share_of_roof": 0.5}]}]
    robust = rank_kernel_sweep(shapes)["robust"]
    assert (robust["page_tile"], robust["kv_per_prog"]) == (True, 1)
    assert robust["share_of_roof"] == {"256x1024": 0.88, "1x4096": 0.5}
    assert robust["worst_share_of_best"] == round(0.88 / 0.95, 3)


def test_fp8_sweep_times_the_v_scale_in_both_places_and_ranks_them_apart():
    """An e4m3 cache's sweep holds its default (with the V scale's place) and each setting with the V scale on
    the tile and on the accumulator; two settings that differ only there rank as two."""
    from labkit.bench.attention import default_decode_setting, kernel_sweep_settings, rank_kernel_sweep

    settings = kernel_sweep_settings("fp8")
    assert default_decode_setting("fp8") in settings
    assert {s["fp8_v_in_tile"] for s in settings} == {False, True}
    assert len({tuple(sorted(s.items())) for s in settings}) == len(settings)
    on_acc, in_tile = _result(0.5, fp8_v_in_tile=False), _result(0.8, fp8_v_in_tile=True)
    shapes = [{"batch": 256, "context": 1024, "results": [on_acc, in_tile]},
              {"batch": 1, "context": 4096, "results": [on_acc | {"share_of_roof": 0.6}, in_tile]}]
    robust = rank_kernel_sweep(shapes)["robust"]
    assert robust["fp8_v_in_tile"] is True and robust["share_of_roof"] == {"256x1024": 0.8, "1x4096": 0.8}


def test_the_fp8_sweeps_lever_candidate_stays_in_the_default_tile_and_spells_lab_fp8_decode(monkeypatch):
    """tools/gpu/decode_sweep.py: the candidate LAB_FP8_DECODE can set is the robust setting among the default's
    tile, even where another tile ranks first overall; its spelling is one the lever reads back to the same knobs."""
    import sys
    from types import SimpleNamespace

    from interp import ROOT

    from engine.levers import FP8_DECODE_ENV, fp8_decode_knobs
    from labkit.bench.attention import default_decode_setting

    sys.path.insert(0, str(ROOT / "tools" / "gpu"))
    from decode_sweep import lever_candidate

    default = default_decode_setting("fp8")
    other_tile = default | {"block_n": 128, "page_tile": True, "share_of_roof": 0.9, "output_ok": True}
    warps8 = default | {"num_warps": 8, "max_registers": 128, "fp8_v_in_tile": False, "share_of_roof": 0.7,
                        "output_ok": True}
    plain = default | {"share_of_roof": 0.6, "output_ok": True}
    res = {"default": default, "shapes": [{"batch": 256, "context": 1024, "results": [other_tile, warps8, plain]},
                                          {"batch": 64, "context": 1024, "results": [other_tile, warps8, plain]}]}
    cand = lever_candidate(res)
    assert cand["num_warps"] == 8 and cand["block_n"] == default["block_n"]
    tile = int(default["page_tile"])
    assert cand["lab_fp8_decode"] == f"warps=8,stages={default['num_stages']},page_tile={tile},v_in_tile=0,maxnreg=128"
    monkeypatch.setenv(FP8_DECODE_ENV, cand["lab_fp8_decode"])
    assert fp8_decode_knobs(SimpleNamespace(kv_cache_dtype="fp8"), "triton") == {
        "num_warps": 8, "num_stages": default["num_stages"], "page_tile": bool(tile), "fp8_v_in_tile": False,
        "max_registers": 128}
    assert lever_candidate({"default": default, "shapes": [{"batch": 1, "context": 8, "results": [other_tile]}]}) \
        is None


def test_warmup_variants_follow_kv_per_prog():
    """With several kv heads per program the split count follows the programs per sequence; the warmup
    plan's variants (decode_variants) must then be the ones the kernel compiles."""
    from engine.attention.splits import (DECODE_WAVES, choose_splits, decode_variant, decode_variants, kv_per_program,
                                         next_power_of_2)
    sm = 132
    for hpp in (1, 2, 4):
        reach = {decode_variant(b, 8, n, sm, kv_per_prog=hpp) for b in range(1, 129) for n in range(1, 4097, 61)}
        assert reach <= set(decode_variants(128, 8, 4096, sm, kv_per_prog=hpp))
        for b, n in ((1, 4096), (32, 512), (64, 1024), (256, 1024)):     # as paged_decode splits
            splits, _ = choose_splits(b, 8 // kv_per_program(8, hpp), n, 64, sm, DECODE_WAVES)
            assert decode_variant(b, 8, n, sm, kv_per_prog=hpp)[:2] == (splits == 1, max(2, next_power_of_2(splits)))
    assert decode_variant(256, 8, 1024, sm, waves=16, kv_per_prog=1) != decode_variant(256, 8, 1024, sm, waves=16,
                                                                                        kv_per_prog=4)


def main() -> None:
    """The interpreter process: run the cases read from stdin, print {"results": [...]} (or {"skip": why})."""
    import triton.runtime.interpreter as interp
    from interp import patch_interpreter           # tests/kernels/interp.py, beside this script

    patch_interpreter()
    interp.InterpreterBuilder.create_dot = _bf16_dot_fix(interp.InterpreterBuilder.create_dot)
    from engine.attention import triton_kernels as tk

    cases = json.loads(sys.stdin.read())
    probe = run_case(tk, (1, False, 16), 16, 1, "float32", 1)
    if "error" in probe:
        print(json.dumps({"skip": f"Triton's interpreter cannot run here: {probe['error'][:160]}"}))
        return
    print(json.dumps({"results": [run_case(tk, tuple(c[0]), *c[1:]) for c in cases]}))


if __name__ == "__main__":
    main()
