"""The one-token GEMV (engine/layers/gemv.py) on the CPU through Triton's interpreter (TRITON_INTERPRET=1):
against F.linear for even and ragged K, output features that are not a multiple of the band, float32 and
bfloat16, with and without the SiLU-and-mul prologue; and the wiring: a one-token forward of the tiny Qwen3
with the GEMV turned on in every projection gives the logits of the plain forward.

Skipped where triton is not installed or its interpreter cannot run a kernel here.
"""
from __future__ import annotations

import json
import sys

import pytest

from interp import interpreted, interpreter_ready, narrow_head

# (N, K): K a multiple of its tile and not; N a multiple of the band and not; one or two K chunks (the first
# peeled off the loop) and three or four (one loop from 0)
SHAPES = [(24, 64), (37, 80), (16, 1024), (9, 640), (8, 1536), (12, 1600)]
PEEL_SHAPES = [(16, 1024), (8, 1536), (12, 1600)]
DTYPES = ("float32", "bfloat16")


@pytest.fixture(scope="module")
def results(tiny_model_dir):
    return interpreted(__file__, str(tiny_model_dir))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("silu_mul", [False, True])
def test_gemv_matches_linear(results, dtype, silu_mul):
    for n, k in SHAPES:
        r = results["cases"][f"{n}x{k}-{dtype}-{silu_mul}"]
        assert r["shape"] == [1, n] and r["dtype"] == dtype, r
        # float32: the same products summed in another order; bfloat16: the output's rounding, and with the
        # prologue the activation's (the interpreter rounds float32 -> bfloat16 by truncation, torch to nearest)
        assert r["max_rel_err"] <= (1e-5 if dtype == "float32" else 2e-2 if silu_mul else 8e-3), (n, k, r)


def test_the_peeled_and_the_plain_loop_give_the_same_bits(results):
    # the rule picks one way per row (peel_first_chunk); asked for both ways each shape's output is bit-equal
    assert set(results["peel"]) == {f"{n}x{k}-{dt}" for n, k in PEEL_SHAPES for dt in DTYPES}, results["peel"]
    for key, r in results["peel"].items():
        assert r["chunks"] >= 2 and r["equal"] and r["launched_peel"] == [True, False], (key, r)


def test_a_tile_given_is_the_one_launched(results):
    # config= (labkit bench --workload gemv --sweep) replaces gemv_config: with gemv_config raising, the GEMV
    # and the normed GEMV given gemv_config's own tile give its bits, and another tile gives the product too
    r = results["config"]
    assert r["plain_equal"] and r["normed_equal"] and r["other_tile_rel_err"] <= 1e-5, r


def test_one_token_forward_with_the_gemv_gives_the_plain_logits(results):
    r = results["model"]
    assert r["gemv_calls"] > 0 and r["silu_calls"] > 0, r        # the projections and the MLP's down took it
    assert r["head_calls"] == 1, r                                # and the LM head
    assert r["max_abs_err"] <= 1e-4, r


def _case(n: int, k: int, dtype: str, silu_mul: bool) -> dict:
    import torch
    import torch.nn.functional as F

    from engine.layers.gemv import gemv

    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(n * 1000 + k)
    x = torch.randn(1, 2 * k if silu_mul else k, generator=gen).to(dt)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dt)
    y = gemv(x, w, silu_mul=silu_mul)
    if silu_mul:
        g, u = x.chunk(2, dim=-1)
        x = (F.silu(g.float()).to(dt).float() * u.float()).to(dt)
    ref = F.linear(x.float(), w.float())
    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()       # normwise
    return {"shape": list(y.shape), "dtype": str(y.dtype).replace("torch.", ""), "max_rel_err": err}


def _peel(n: int, k: int, dtype: str) -> dict:
    """The same GEMV with its first chunk peeled and with one loop from 0 (peel= in place of the rule)."""
    import torch
    import triton

    import engine.layers.gemv as gemv_mod

    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(n * 1000 + k + 1)
    x = torch.randn(1, k, generator=gen).to(dt)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dt)
    kernel, launched = gemv_mod._gemv_kernel, []

    class Recorded:             # the PEEL each launch was given
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launched.append(kw["PEEL"])
                return kernel[grid](*args, **kw)
            return launch

    gemv_mod._gemv_kernel = Recorded()
    try:
        ys = [gemv_mod.gemv(x, w, peel=peel) for peel in (True, False)]
    finally:
        gemv_mod._gemv_kernel = kernel
    return {"chunks": triton.cdiv(k, gemv_mod.gemv_config(n, k)[1]), "equal": torch.equal(ys[0], ys[1]),
            "launched_peel": launched}


def _config() -> dict:
    """gemv / normed_gemv with config= while gemv_config raises (float32, [12, 1600])."""
    import torch
    import torch.nn.functional as F

    import engine.layers.gemv as gemv_mod

    gen = torch.Generator().manual_seed(7)
    x, res = torch.randn(1, 1600, generator=gen), torch.randn(1, 1600, generator=gen)
    w, nw = torch.randn(12, 1600, generator=gen) / 40, torch.rand(1600, generator=gen) + 0.5
    tile = gemv_mod.gemv_config(12, 1600)
    plain, (normed, _) = gemv_mod.gemv(x, w), gemv_mod.normed_gemv(x, w, nw, 1e-6, res)
    real = gemv_mod.gemv_config

    def refuse(n, k):
        raise AssertionError("gemv_config called although a tile was given")

    gemv_mod.gemv_config = refuse
    try:
        given, (given_normed, _) = gemv_mod.gemv(x, w, config=tile), gemv_mod.normed_gemv(x, w, nw, 1e-6, res,
                                                                                          config=tile)
        other = gemv_mod.gemv(x, w, config=(4, 256, 4))
    except AssertionError as e:
        return {"error": str(e)}
    finally:
        gemv_mod.gemv_config = real
    ref = F.linear(x, w)
    return {"plain_equal": torch.equal(plain, given), "normed_equal": torch.equal(normed, given_normed),
            "other_tile_rel_err": ((other - ref).abs().max() / ref.abs().max()).item()}


def _model(model_dir: str) -> dict:
    """The tiny model's one-token forward, plain and with every projection's GEMV and the LM head's (the
    runner's fused switch on the linear layers and the head only: the norm and RoPE kernels are tested
    elsewhere)."""
    import torch

    import engine.layers.gemv as gemv_mod
    from engine import LLMEngine
    from engine.layers.embed_head import ParallelLMHead
    from engine.layers.linear import LinearBase

    engine = LLMEngine(model_dir, device="cpu", enforce_eager=True, max_num_seqs=1, max_model_len=64,
                       num_kvcache_blocks=8, kvcache_block_size=16, max_num_batched_tokens=64)
    narrow_head(engine.runner.model)
    from engine import SamplingParams
    seq = engine.add_request([11, 12, 13], SamplingParams(max_tokens=4))
    seqs, is_prefill = engine.schedule()
    engine.postprocess(seqs, engine.runner.run(seqs, is_prefill)[0], is_prefill)     # the prompt's KV
    seqs, is_prefill = engine.schedule()                                              # one decode token
    inputs = engine.runner.inputs.prepare(seqs, is_prefill)
    plain = engine.runner.run_model(inputs).float()
    calls = {"gemv": 0, "silu": 0, "head": 0}
    real = gemv_mod.gemv
    head = engine.runner.model.lm_head.weight

    def counted(x, w, silu_mul=False):
        calls["silu" if silu_mul else "head" if w is head else "gemv"] += 1
        return real(x, w, silu_mul)

    gemv_mod.gemv = counted
    layers = [m for m in engine.runner.model.modules() if isinstance(m, (LinearBase, ParallelLMHead))]
    for m in layers:
        m.fused = True
    fused = engine.runner.run_model(inputs).float()
    assert seq.num_tokens == 4
    return {"gemv_calls": calls["gemv"], "silu_calls": calls["silu"], "head_calls": calls["head"],
            "max_abs_err": (fused - plain).abs().max().item() if torch.isfinite(fused).all() else float("inf")}


def main() -> None:
    if not interpreter_ready(lambda: _case(8, 64, "float32", False)):
        return
    cases = {f"{n}x{k}-{dt}-{s}": _case(n, k, dt, s) for n, k in SHAPES for dt in DTYPES for s in (False, True)}
    peel = {f"{n}x{k}-{dt}": _peel(n, k, dt) for n, k in PEEL_SHAPES for dt in DTYPES}
    print(json.dumps({"cases": cases, "peel": peel, "config": _config(), "model": _model(sys.argv[1])}))


if __name__ == "__main__":
    main()
