"""The GEMV of a few rows (engine/layers/gemv.py::_rows_gemv_kernel: a small decode batch, LAB_GEMV_ROWS) on the
CPU through Triton's interpreter: against F.linear for 2-8 rows (a power of two and not), even and ragged K,
output features that are not a multiple of the band, float32 and bfloat16, with and without the SiLU-and-mul
prologue; each row against the one-row GEMV of that row; the normed prologue against rms_norm then F.linear, each
row with its own rstd, and the new residual; and the wiring: a decode step of three sequences of the tiny Qwen3 with
every fused switch on and gemv_rows 4 gives the plain logits, its projections through the rows kernel.

Skipped where triton is not installed or its interpreter cannot run a kernel here. The setting's parse
(LAB_GEMV_ROWS) is tested without triton.
"""
from __future__ import annotations

import json
import sys

import pytest

from interp import interpreted, interpreter_ready, three_row_decode

ROWS = (2, 3, 5, 8)
SHAPES = [(24, 64), (37, 80), (12, 1600)]
DTYPES = ("float32", "bfloat16")


@pytest.fixture(scope="module")
def results(tiny_model_dir):
    return interpreted(__file__, str(tiny_model_dir))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("silu_mul", [False, True])
def test_rows_gemv_matches_linear_and_the_one_row_gemv(results, dtype, silu_mul):
    for m in ROWS:
        for n, k in SHAPES:
            r = results["cases"][f"{m}x{n}x{k}-{dtype}-{silu_mul}"]
            assert r["shape"] == [m, n] and r["dtype"] == dtype, r
            # the one-row GEMV's tolerances (tests/kernels/test_gemv_interp.py), every row
            assert r["max_rel_err"] <= (1e-5 if dtype == "float32" else 2e-2 if silu_mul else 8e-3), (m, n, k, r)
            # each row against that row alone through the one-row kernel: the same products, summed in another order
            assert r["vs_one_row_rel_err"] <= (1e-5 if dtype == "float32" else 8e-3), (m, n, k, r)


@pytest.mark.parametrize("residual", [False, True])
def test_normed_rows_take_each_rows_own_norm(results, residual):
    for m in ROWS:
        for n, k in SHAPES:
            r = results["normed"][f"{m}x{n}x{k}-{residual}"]
            assert r["shape"] == [m, n] and r["max_rel_err"] <= 1e-5, (m, n, k, r)
            assert r["inputs_untouched"], r
            if residual:
                assert r["h_equal"], r          # x + residual, rounded as rms_norm's residual add
            else:
                assert r["h_is_none"], r


def test_a_small_decode_batch_with_the_rows_gemv_gives_the_plain_logits(results):
    r = results["model"]
    assert r["rows"] == 3, r
    # every layer's qkv and gate_up through the normed rows kernel, o and down (with the activation) and the LM head
    # through the rows GEMV
    assert r["normed_calls"] == 2 * r["layers"], r
    assert r["gemv_calls"] == r["layers"] and r["silu_calls"] == r["layers"] and r["head_calls"] == 1, r
    assert r["max_abs_err"] <= 1e-4, r


@pytest.mark.parametrize("text, rows", [(None, 1), ("", 1), ("1", 1), ("4", 4), (" 8 ", 8)])
def test_the_setting_reads_lab_gemv_rows(monkeypatch, text, rows):
    from engine.levers import GEMV_ROWS_ENV, gemv_rows_setting

    if text is None:
        monkeypatch.delenv(GEMV_ROWS_ENV, raising=False)
    else:
        monkeypatch.setenv(GEMV_ROWS_ENV, text)
    assert gemv_rows_setting() == rows


@pytest.mark.parametrize("text", ["0", "9", "two", "-1", "4.0"])
def test_the_setting_refuses_anything_else_in_one_line(monkeypatch, text):
    from engine.config import ConfigError
    from engine.levers import GEMV_ROWS_ENV, gemv_rows_setting

    monkeypatch.setenv(GEMV_ROWS_ENV, text)
    with pytest.raises(ConfigError, match=r"LAB_GEMV_ROWS=.*: expected a whole number from 1 to 8") as e:
        gemv_rows_setting()
    assert "\n" not in str(e.value)


# -- the interpreter process ----------------------------------------------------------------------------
def _case(m: int, n: int, k: int, dtype: str, silu_mul: bool) -> dict:
    import torch
    import torch.nn.functional as F

    from engine.layers.gemv import gemv

    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(m * 100000 + n * 1000 + k)
    x = torch.randn(m, 2 * k if silu_mul else k, generator=gen).to(dt)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dt)
    y = gemv(x, w, silu_mul=silu_mul)
    one = torch.cat([gemv(x[i:i + 1].contiguous(), w, silu_mul=silu_mul) for i in range(m)])
    if silu_mul:
        g, u = x.chunk(2, dim=-1)
        x = (F.silu(g.float()).to(dt).float() * u.float()).to(dt)
    ref = F.linear(x.float(), w.float())
    rel = lambda a, b: ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()    # noqa: E731
    return {"shape": list(y.shape), "dtype": str(y.dtype).replace("torch.", ""),
            "max_rel_err": max(rel(y[i], ref[i]) for i in range(m)),                  # normwise, each row
            "vs_one_row_rel_err": max(rel(y[i], one[i]) for i in range(m))}


def _normed(m: int, n: int, k: int, residual: bool) -> dict:
    import torch
    import torch.nn.functional as F

    from engine.layers.fused_kernels import rms_norm
    from engine.layers.gemv import normed_gemv

    gen = torch.Generator().manual_seed(m * 100000 + n * 1000 + k + 1)
    # rows of very different scales: a kernel that took one row's rstd for another would be far off
    x = torch.randn(m, k, generator=gen) * torch.logspace(-1, 1, m)[:, None]
    res = torch.randn(m, k, generator=gen) if residual else None
    nw = 1 + 0.2 * torch.randn(k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    before = (x.clone(), None if res is None else res.clone())
    y, h = normed_gemv(x, w, nw, 1e-6, res)
    out = {"shape": list(y.shape), "inputs_untouched": torch.equal(x, before[0])
           and (res is None or torch.equal(res, before[1]))}
    if residual:
        normed, h_ref = rms_norm(x, nw, 1e-6, res)
        out["h_equal"] = torch.equal(h, h_ref)
    else:
        normed = rms_norm(x, nw, 1e-6)
        out["h_is_none"] = h is None
    ref = F.linear(normed, w)
    out["max_rel_err"] = max(((y[i] - ref[i]).abs().max() / ref[i].abs().max()).item() for i in range(m))
    return out


def _model(model_dir: str) -> dict:
    """A decode step of three sequences of the tiny model, plain and with every fused switch on and gemv_rows 4
    (as the runner sets them on CUDA with LAB_GEMV_ROWS=4)."""
    import torch

    import engine.layers.gemv as gemv_mod

    runner, inputs, plain = three_row_decode(model_dir)
    layers = len(runner.model.model.layers)
    calls = {"normed": 0, "gemv": 0, "silu": 0, "head": 0}
    real_gemv, real_normed = gemv_mod.gemv, gemv_mod.normed_gemv
    head = runner.model.lm_head.weight

    def counted(x, w, silu_mul=False):
        if x.shape[0] > 1:
            calls["silu" if silu_mul else "head" if w is head else "gemv"] += 1
        return real_gemv(x, w, silu_mul)

    def normed(x, w, nw, eps, residual=None):
        calls["normed"] += x.shape[0] > 1
        return real_normed(x, w, nw, eps, residual)

    gemv_mod.gemv, gemv_mod.normed_gemv = counted, normed
    for m in runner.model.modules():
        if hasattr(m, "fused"):
            m.fused = True
        if hasattr(m, "gemv_rows"):
            m.gemv_rows = 4
    fused = runner.run_model(inputs).float()
    return {"rows": inputs.input_ids.shape[0], "layers": layers, "normed_calls": calls["normed"], "gemv_calls": calls["gemv"],
            "silu_calls": calls["silu"], "head_calls": calls["head"],
            "max_abs_err": (fused - plain).abs().max().item() if torch.isfinite(fused).all() else float("inf")}


def main() -> None:
    if not interpreter_ready(lambda: _case(2, 8, 64, "float32", False)):
        return
    cases = {f"{m}x{n}x{k}-{dt}-{s}": _case(m, n, k, dt, s) for m in ROWS for n, k in SHAPES for dt in DTYPES
             for s in (False, True)}
    normed = {f"{m}x{n}x{k}-{r}": _normed(m, n, k, r) for m in ROWS for n, k in SHAPES for r in (False, True)}
    print(json.dumps({"cases": cases, "normed": normed, "model": _model(sys.argv[1])}))


if __name__ == "__main__":
    main()
