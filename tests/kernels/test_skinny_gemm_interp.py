"""The split-K GEMM of a few rows (engine/layers/skinny_gemm.py: a small decode batch, LAB_SKINNY_GEMM) on the CPU
through Triton's interpreter: against a float64 product for 2-40 rows (one tensor-core tile of 16, 32 or 64 rows,
the rows past M masked), output features and K that are not multiples of the tiles, one split and several (the
last split short), float32 and bfloat16; a second launch gives the same bits (every output tile's counter back at
zero); and the wiring: a decode step of three sequences of the tiny Qwen3 with every fused switch on and
skinny_rows 8 gives the plain logits, its four projections a layer through the split-K kernel.

Skipped where triton is not installed or its interpreter cannot run a kernel here. The setting's parse
(LAB_SKINNY_GEMM) is tested without triton.
"""
from __future__ import annotations

import json
import sys

import pytest

from interp import interpreted, interpreter_ready, three_row_decode

ROWS = (2, 5, 17, 40)
SHAPES = [(64, 128), (100, 384), (130, 520)]       # (N, K): one tile; ragged N; ragged N and K
SPLITS = (1, 2, 4)
DTYPES = ("float32", "bfloat16")


@pytest.fixture(scope="module")
def results(tiny_model_dir):
    return interpreted(__file__, str(tiny_model_dir))


@pytest.mark.parametrize("dtype", DTYPES)
def test_skinny_gemm_matches_the_product_for_every_split(results, dtype):
    for m in ROWS:
        for n, k in SHAPES:
            for split in SPLITS:
                r = results["cases"][f"{m}x{n}x{k}-{split}-{dtype}"]
                assert r["shape"] == [m, n] and r["dtype"] == dtype, r
                # float32: the products to float32 rounding; bfloat16: one rounding of a float32 sum
                assert r["max_rel_err"] <= (1e-5 if dtype == "float32" else 8e-3), (m, n, k, split, r)


def test_a_second_launch_gives_the_same_bits_and_leaves_the_counters_at_zero(results):
    for key, r in results["cases"].items():
        assert r["again_equal"], key
        assert r["counters_zero"], key


def test_a_decode_step_takes_the_split_k_gemm_and_keeps_the_logits(results):
    r = results["model"]
    assert r["rows"] == 3
    assert r["skinny_calls"] == 4 * r["layers"], r          # qkv, o, gate_up and down of every layer
    assert r["max_abs_err"] <= 1e-4, r


@pytest.mark.parametrize("text, rows", [(None, 0), ("", 0), ("0", 0), ("2", 2), (" 32 ", 32), ("64", 64)])
def test_the_setting_reads_lab_skinny_gemm(monkeypatch, text, rows):
    from engine.levers import SKINNY_GEMM_ENV, skinny_rows_setting

    if text is None:
        monkeypatch.delenv(SKINNY_GEMM_ENV, raising=False)
    else:
        monkeypatch.setenv(SKINNY_GEMM_ENV, text)
    assert skinny_rows_setting() == rows


@pytest.mark.parametrize("text", ["1", "65", "on", "-2", "8.0"])
def test_the_setting_refuses_anything_else_in_one_line(monkeypatch, text):
    from engine.config import ConfigError
    from engine.levers import SKINNY_GEMM_ENV, skinny_rows_setting

    monkeypatch.setenv(SKINNY_GEMM_ENV, text)
    with pytest.raises(ConfigError, match=r"LAB_SKINNY_GEMM=.*: expected 0 \(off\) or a whole number from 2 to 64") as e:
        skinny_rows_setting()
    assert "\n" not in str(e.value)


def test_the_serve_banner_names_it():
    from labkit.console.serving import lab_levers

    assert lab_levers({"config": {}, "skinny_rows": 24}) == {"lab levers": "LAB_SKINNY_GEMM=24"}
    assert lab_levers({"config": {}, "skinny_rows": 0}) == {}


# -- the interpreter process ----------------------------------------------------------------------------
def _case(m: int, n: int, k: int, split: int, dtype: str) -> dict:
    import torch

    from engine.layers import skinny_gemm as sk

    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(m * 100000 + n * 1000 + k + split)
    x = torch.randn(m, k, generator=gen).to(dt)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dt)
    y = sk.skinny_gemm(x, w, split=split)
    again = sk.skinny_gemm(x, w, split=split)
    ref = x.double() @ w.double().T
    counters = sk._counters.get(x.device)
    return {"shape": list(y.shape), "dtype": str(y.dtype).replace("torch.", ""),
            "max_rel_err": max(((y[i].double() - ref[i]).abs().max() / ref[i].abs().max()).item() for i in range(m)),
            "again_equal": torch.equal(y, again), "counters_zero": counters is None or not bool(counters.any())}


def _model(model_dir: str) -> dict:
    """A decode step of three sequences of the tiny model, plain and with every fused switch on and skinny_rows 8
    (as the runner sets them on CUDA with LAB_SKINNY_GEMM=8)."""
    import torch

    import engine.layers.skinny_gemm as sk_mod

    runner, inputs, plain = three_row_decode(model_dir)
    layers = len(runner.model.model.layers)
    calls = {"skinny": 0}
    real = sk_mod.skinny_gemm

    def counted(x, w, split=None):
        calls["skinny"] += 1
        return real(x, w, split)

    sk_mod.skinny_gemm = counted
    for m in runner.model.modules():
        if hasattr(m, "fused"):
            m.fused = True
        if hasattr(m, "skinny_rows"):
            m.skinny_rows = 8
    fused = runner.run_model(inputs).float()
    return {"rows": inputs.input_ids.shape[0], "layers": layers, "skinny_calls": calls["skinny"],
            "max_abs_err": (fused - plain).abs().max().item() if torch.isfinite(fused).all() else float("inf")}


def main() -> None:
    from triton.runtime import interpreter as interp

    from test_decode_kernel_interp import _bf16_dot_fix       # the interpreter's bf16 tl.dot, as the decode test
    interp.InterpreterBuilder.create_dot = _bf16_dot_fix(interp.InterpreterBuilder.create_dot)
    if not interpreter_ready(lambda: _case(2, 64, 128, 2, "float32")):
        return
    cases = {f"{m}x{n}x{k}-{s}-{dt}": _case(m, n, k, s, dt) for m in ROWS for n, k in SHAPES for s in SPLITS
             for dt in DTYPES}
    print(json.dumps({"cases": cases, "model": _model(sys.argv[1])}))


if __name__ == "__main__":
    main()
