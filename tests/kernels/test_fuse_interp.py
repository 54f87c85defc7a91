"""The two batch-1 fusions on the CPU through Triton's interpreter (TRITON_INTERPRET=1):

- the normed GEMV (engine/layers/gemv.py::normed_gemv: RMSNorm, with or without the residual add, as the
  one-token GEMV's prologue) against the fused rms_norm kernel then the GEMV, bit for bit, and its new
  residual against x + r;
- q/k norm + RoPE with the KV store (fused_kernels.qk_norm_rope with the cache) against the kernel without
  it followed by kv_store.store_kv, bit for bit over the whole cache (padding slots untouched);
- q/k norm + RoPE one head per program (the tile below QK_SPLIT_BELOW tokens) against every head of a token per
  program, bit for bit (outputs and cache), and both against the torch path (RMSNorm, then RotaryEmbedding);
- the wiring: the tiny Qwen3's one-token forward, and a prompt's prefill, with every fused switch on
  against the plain forward, counting the calls that took the new paths.

Skipped where triton is not installed or its interpreter cannot run a kernel here.
"""
from __future__ import annotations

import json
import sys

import pytest

from interp import interpreted, interpreter_ready, narrow_head

# (N, K): K a multiple of the GEMV's tile and not; N a multiple of the band and not; one band (a single program)
SHAPES = [(24, 64), (37, 80), (16, 1024), (9, 640), (8, 64), (12, 1600)]
DTYPES = ("float32", "bfloat16")
# (HQ, HK, D): heads that fill their power-of-two tile and not (v row 3 * 32 wide)
HEADS = [(4, 2, 32), (6, 3, 32)]


@pytest.fixture(scope="module")
def results(tiny_model_dir):
    return interpreted(__file__, str(tiny_model_dir))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
def test_normed_gemv_is_rms_norm_then_gemv_bit_for_bit(results, dtype, residual):
    for n, k in SHAPES:
        r = results["normed"][f"{n}x{k}-{dtype}-{residual}"]
        assert r["shape"] == [1, n], r
        assert r["y_equal"], (n, k, r)                   # torch.equal with rms_norm then gemv
        assert r["inputs_untouched"], (n, k, r)
        if residual:
            assert r["h_equal"], (n, k, r)               # torch.equal with rms_norm's new residual
            # x + r rounded to the dtype: exact in float32; bfloat16 within one rounding step (the interpreter
            # rounds float32 -> bfloat16 by truncation, torch to nearest)
            assert r["h_vs_sum_rel"] <= (0.0 if dtype == "float32" else 2 ** -7), (n, k, r)
        else:
            assert r["h_is_none"], r


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_store_writes_what_store_kv_writes(results, dtype):
    for hq, hk, d in HEADS:
        r = results["store"][f"{hq}-{hk}-{d}-{dtype}"]
        assert r["qk_equal"], r                      # q and k outputs as without the store
        assert r["k_cache_equal"] and r["v_cache_equal"], r      # whole cache: stored rows and the rest
        assert r["rows_written"] == r["live_tokens"] > 0 and r["padding_tokens"] > 0, r


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_one_head_per_program_is_the_whole_row_tile_and_the_torch_path(results, dtype):
    for hq, hk, d in HEADS:
        r = results["tiles"][f"{hq}-{hk}-{d}-{dtype}"]
        assert r["default_tile"] == 1, r                          # a few tokens take one head per program
        assert r["q_equal"] and r["k_equal"], r                   # the two tiles, bit for bit
        assert r["k_cache_equal"] and r["v_cache_equal"], r
        # against RMSNorm then RotaryEmbedding in torch: float32 to rounding; bfloat16 within a few steps of
        # its 8-bit mantissa (the interpreter truncates float32 -> bfloat16, torch rounds to nearest)
        assert r["vs_torch_max_abs"] <= (1e-5 if dtype == "float32" else 0.1), r


def test_one_token_forward_with_both_fusions_gives_the_plain_logits(results):
    r = results["model"]["decode"]
    # every layer's qkv and gate_up took the normed GEMV (the first layer's qkv without a residual), and the
    # q/k norm kernel stored the token's k and v
    assert r["normed_calls"] == 2 * r["layers"] and r["normed_no_residual"] == 1, r
    assert r["store_calls"] == r["layers"] and r["store_kv_calls"] == 0, r     # and the attention stored no more
    assert r["plain_store_kv_calls"] == r["layers"], r
    assert r["max_abs_err"] <= 1e-4, r                      # the GEMV model case's tolerance
    assert r["kv_max_abs_err"] <= 1e-4, r                    # the slot, cleared before the fused run


def test_prefill_with_the_storing_kernel_gives_the_plain_logits_and_cache(results):
    r = results["model"]["prefill"]
    assert r["normed_calls"] == 0, r                                           # several rows: no normed GEMV
    assert r["store_calls"] == r["layers"] and r["store_kv_calls"] == 0, r
    assert r["max_abs_err"] <= 1e-4 and r["kv_max_abs_err"] <= 1e-4, r


# -- the interpreter process ----------------------------------------------------------------------------
def _normed(n: int, k: int, dtype: str, residual: bool) -> dict:
    import torch

    from engine.layers.fused_kernels import rms_norm
    from engine.layers.gemv import gemv, normed_gemv

    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(n * 1000 + k)
    x = (3 * torch.randn(1, k, generator=gen)).to(dt)
    res = torch.randn(1, k, generator=gen).to(dt) if residual else None
    nw = (1 + 0.2 * torch.randn(k, generator=gen)).to(dt)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dt)
    before = (x.clone(), None if res is None else res.clone())
    y, h = normed_gemv(x, w, nw, 1e-6, res)
    out = {"shape": list(y.shape), "inputs_untouched": torch.equal(x, before[0])
           and (res is None or torch.equal(res, before[1]))}
    if residual:
        normed, h_ref = rms_norm(x, nw, 1e-6, res)
        s = x.float() + res.float()
        out |= {"h_equal": torch.equal(h, h_ref),
                "h_vs_sum_rel": ((h.float() - s).abs() / s.abs().clamp_min(1e-30)).max().item()}
    else:
        normed = rms_norm(x, nw, 1e-6)
        out["h_is_none"] = h is None
    out["y_equal"] = torch.equal(y, gemv(normed, w))
    return out


def _store(hq: int, hk: int, d: int, dtype: str) -> dict:
    import torch

    from engine.attention.kv_store import store_kv
    from engine.layers.fused_kernels import qk_norm_rope

    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(hq * 100 + hk)
    t, blocks, page, max_pos = 6, 4, 4, 64
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(dt)
    pos = torch.randint(0, max_pos, (t,), generator=gen)
    qw, kw = (1 + 0.2 * torch.randn(d, generator=gen)).to(dt), (1 + 0.2 * torch.randn(d, generator=gen)).to(dt)
    cos, sin = torch.randn(max_pos, d, generator=gen), torch.randn(max_pos, d, generator=gen)
    slots = torch.tensor([5, -1, 14, 0, -1, 11])          # scattered over the blocks, two padding tokens
    kc0 = torch.randn(blocks, page, hk, d, generator=gen).to(dt)
    vc0 = torch.randn(blocks, page, hk, d, generator=gen).to(dt)
    q_ref, k_ref = qk_norm_rope(qkv, pos, qw, kw, cos, sin, hq, hk, d, 1e-6)
    kc_ref, vc_ref = kc0.clone(), vc0.clone()
    v = qkv[:, (hq + hk) * d:].view(t, hk, d)
    store_kv(k_ref, v, kc_ref, vc_ref, slots)
    kc, vc = kc0.clone(), vc0.clone()
    q, k = qk_norm_rope(qkv, pos, qw, kw, cos, sin, hq, hk, d, 1e-6, k_cache=kc, v_cache=vc, slot_mapping=slots)
    changed = ((kc != kc0).view(-1, hk * d).any(1) | (vc != vc0).view(-1, hk * d).any(1)).sum().item()
    return {"qk_equal": torch.equal(q, q_ref) and torch.equal(k, k_ref), "k_cache_equal": torch.equal(kc, kc_ref),
            "v_cache_equal": torch.equal(vc, vc_ref), "rows_written": changed,
            "live_tokens": int((slots >= 0).sum()), "padding_tokens": int((slots < 0).sum())}


def _tiles(hq: int, hk: int, d: int, dtype: str) -> dict:
    import torch

    from engine.layers.fused_kernels import qk_heads_per_program, qk_norm_rope
    from engine.layers.layernorm import RMSNorm
    from engine.layers.rotary import RotaryEmbedding

    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(hq * 10 + hk)
    t, blocks, page, max_pos = 5, 3, 4, 64
    qkv = (2 * torch.randn(t, (hq + 2 * hk) * d, generator=gen)).to(dt)
    pos = torch.randint(0, max_pos, (t,), generator=gen)
    qn, kn = RMSNorm(d).to(dt), RMSNorm(d).to(dt)
    qn.weight.data = (1 + 0.2 * torch.randn(d, generator=gen)).to(dt)
    kn.weight.data = (1 + 0.2 * torch.randn(d, generator=gen)).to(dt)
    rope = RotaryEmbedding(d, max_pos, 10000.0)
    slots = torch.tensor([3, -1, 9, 0, 6])
    runs = {}
    for hpp in (1, 1 << (hq + hk - 1).bit_length()):
        kc, vc = torch.zeros(blocks, page, hk, d, dtype=dt), torch.zeros(blocks, page, hk, d, dtype=dt)
        q, k = qk_norm_rope(qkv, pos, qn.weight, kn.weight, rope.cos, rope.sin, hq, hk, d, qn.eps,
                            k_cache=kc, v_cache=vc, slot_mapping=slots, heads_per_program=hpp)
        runs[hpp] = (q, k, kc, vc)
    (q1, k1, kc1, vc1), (qa, ka, kca, vca) = runs.values()
    q_in, k_in, _ = qkv.split([hq * d, hk * d, hk * d], -1)
    rq, rk = rope(pos, qn(q_in.reshape(t, hq, d)), kn(k_in.reshape(t, hk, d)))
    err = max((q1.float() - rq.float()).abs().max().item(), (k1.float() - rk.float()).abs().max().item())
    return {"default_tile": qk_heads_per_program(t, hq + hk), "q_equal": torch.equal(q1, qa),
            "k_equal": torch.equal(k1, ka), "k_cache_equal": torch.equal(kc1, kca), "v_cache_equal": torch.equal(vc1, vca),
            "vs_torch_max_abs": err}


def _model(model_dir: str) -> dict:
    """The tiny model's prompt prefill and one decode token, each plain and with every fused switch on (as
    the runner sets them on CUDA). Before each fused run the step's cache slots are cleared, so its k/v
    there are what the storing kernel wrote."""
    import torch

    import engine.layers.fused_kernels as fk
    import engine.layers.gemv as gemv_mod
    from engine import LLMEngine, SamplingParams

    engine = LLMEngine(model_dir, device="cpu", enforce_eager=True, max_num_seqs=1, max_model_len=64,
                       num_kvcache_blocks=8, kvcache_block_size=16, max_num_batched_tokens=64)
    runner = engine.runner
    narrow_head(runner.model)
    layers = len(runner.model.model.layers)
    calls = {"normed": 0, "normed_no_residual": 0, "store": 0, "store_kv": 0}
    real_normed, real_qk = gemv_mod.normed_gemv, fk.qk_norm_rope

    def normed(x, w, nw, eps, residual=None):
        calls["normed"] += 1
        calls["normed_no_residual"] += residual is None
        return real_normed(x, w, nw, eps, residual)

    def qk(*args, **kw):
        calls["store"] += "k_cache" in kw
        return real_qk(*args, **kw)

    gemv_mod.normed_gemv, fk.qk_norm_rope = normed, qk
    backend = runner.model.attention_layers()[0].backend
    real_store_kv = backend.store_kv

    def store_kv(*args):
        calls["store_kv"] += 1
        return real_store_kv(*args)

    backend.store_kv = store_kv
    switches = [m for m in runner.model.modules() if hasattr(m, "fused")]

    def compare(inputs) -> dict:
        for m in switches:
            m.fused = False
        calls["store_kv"] = 0
        plain = runner.run_model(inputs).float()
        plain_store_kv = calls["store_kv"]
        kv_plain = runner.kv_cache.clone()
        slots = inputs.meta.slot_mapping
        runner.kv_cache.view(2, layers, -1, runner.kv_cache.shape[-2] * runner.kv_cache.shape[-1])[:, :, slots] = 0
        for k in calls:
            calls[k] = 0
        for m in switches:
            m.fused = True
        fused = runner.run_model(inputs).float()
        for m in switches:
            m.fused = False
        ok = torch.isfinite(fused).all()
        return {"layers": layers, "normed_calls": calls["normed"], "normed_no_residual": calls["normed_no_residual"],
                "store_calls": calls["store"], "store_kv_calls": calls["store_kv"],
                "plain_store_kv_calls": plain_store_kv,
                "max_abs_err": (fused - plain).abs().max().item() if ok else float("inf"),
                "kv_max_abs_err": (runner.kv_cache - kv_plain).abs().max().item()}

    engine.add_request([11, 12, 13], SamplingParams(max_tokens=4))
    seqs, is_prefill = engine.schedule()
    inputs = runner.inputs.prepare(seqs, is_prefill)
    out = {"prefill": compare(inputs)}
    engine.postprocess(seqs, runner.sampler(seqs, runner.run_model(inputs))[0].tolist(), is_prefill)
    seqs, is_prefill = engine.schedule()                                              # one decode token
    out["decode"] = compare(runner.inputs.prepare(seqs, is_prefill))
    return out


def main() -> None:
    if not interpreter_ready(lambda: _normed(8, 64, "float32", False)):
        return
    normed = {f"{n}x{k}-{dt}-{r}": _normed(n, k, dt, r) for n, k in SHAPES for dt in DTYPES for r in (False, True)}
    store = {f"{hq}-{hk}-{d}-{dt}": _store(hq, hk, d, dt) for hq, hk, d in HEADS for dt in DTYPES}
    tiles = {f"{hq}-{hk}-{d}-{dt}": _tiles(hq, hk, d, dt) for hq, hk, d in HEADS for dt in DTYPES}
    print(json.dumps({"normed": normed, "store": store, "tiles": tiles, "model": _model(sys.argv[1])}))


if __name__ == "__main__":
    main()
