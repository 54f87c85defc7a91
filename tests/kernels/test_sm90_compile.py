"""Every Triton kernel variant the engine launches compiles for an H100/H200 (sm_90) on this CPU.

Triton's interpreter (the *_interp.py tests) runs a kernel's Python body without compiling it, so a kernel that
fails only in code generation passed every CPU test before: once a decode kernel variant whose loop
re-assigned a name the prologue had used as a scalar ("loop-carried variable ... has initial type int64 but is
re-assigned") failed on the H200 at its first launch, a device call spent for nothing. Here a fresh process
gives Triton a stand-in CUDA driver that names an sm_90 target, makes every launch a warmup (compile, no
launch) and turns PDL on as on Hopper, then calls the engine's own kernel wrappers on CPU tensors at the
shapes of the tiny, Qwen3-0.6B and Qwen3-8B presets: the batch-1 GEMVs (plain, normed, SiLU-and-mul, with and
without the peeled first chunk), the rows GEMV's variants (2, 4 and 8 rows), the split-K GEMM's row tiles, every paged-decode variant ``decode_variants`` says a batch of 1..512 can
meet, the prefills, the KV store, the norms, q/k norm + RoPE and the sampling kernel, and again every kernel that
reads or writes the KV cache with an FP8 (e4m3) cache: each decode variant, the paged prefill, the quantizing
store and q/k norm + RoPE's store, and all of these again with the V cache's other layout (kv_quant.v_t); and each
decode variant through the decode prologue (q/k norm + RoPE and the
KV store inside the decode kernel), on either cache, and at batch 1 asking L2 for a layer's weights
(engine/l2_prefetch.py); and the persistent decode layer (engine/layers/decode_layer.py) at Qwen3-0.6B's shapes (the first
layer and the later ones) and Qwen3-8B's (the later ones), in its one launch over 132 SMs. Triton's own compiler and the ptxas its wheel ships do the rest; nothing runs
on a GPU.

Skipped where triton is not installed or its CUDA backend cannot compile here.
"""
from __future__ import annotations

import json

import pytest

from interp import interpreted

KERNELS = {"_gemv_kernel", "_rows_gemv_kernel", "_decode_split_kernel", "_decode_reduce_kernel", "_prefill_kernel", "_store_kv_kernel",
           "_rms_norm_kernel", "_qk_norm_rope_kernel", "_silu_mul_kernel", "_gumbel_argmax_kernel",
           "_decode_layer_kernel", "_skinny_kernel"}
PRESETS = ("tiny", "qwen3-0.6b", "qwen3-8b", "smollm2-135m")    # smollm2: head_dim 64, GQA 3


@pytest.fixture(scope="module")
def compiled():
    return interpreted(__file__, timeout=900, interpret=False)     # (interp.py's runner, without the interpreter)


def test_every_variant_compiles_for_sm90(compiled):
    assert not compiled["errors"], compiled["errors"][:3]
    assert set(compiled["kernels"]) == KERNELS, compiled["kernels"]
    assert compiled["targets"] == [["cuda", 90]], compiled["targets"]         # what each compiled kernel was built for


def test_every_preset_meets_its_decode_variants_and_gemv_tiles(compiled):
    for preset in PRESETS:
        p = compiled["presets"][preset]
        assert p["decode_variants"] >= 3, p          # one split, several with the reduce kernel, the fused reduce
        assert p["decode_calls"] == p["decode_variants"] and p["gemv_calls"] == 2 * 5, p   # 5 projections x peel
        assert p["prologue_decode_calls"] == p["decode_variants"], p      # the decode prologue at each variant
        assert p["rows_gemv_calls"] == 3 * 5, p      # 5 projections x the rows kernel's variants (2, 4 and 8 rows)
        assert p["skinny_calls"] == 3 * 5, p         # 5 projections x the split-K GEMM's row tiles (16, 32 and 64)


def test_a_small_decode_asks_l2_for_each_weight_it_is_given(compiled):
    for preset in PRESETS:      # LAB_L2_PREFETCH=layer: o, gate_up, down and the next qkv, one bulk prefetch each
        assert compiled["presets"][preset]["l2_prefetches"] == 4, preset


def test_the_decode_layer_compiles_at_each_qwen3_preset(compiled):
    for preset in PRESETS:
        p = compiled["presets"][preset]
        # Qwen3-0.6B: the first layer (no residual) and the later ones; Qwen3-8B: the later ones (the first differs
        # in one constexpr only); the tiny shapes run in the interpreter's tests; SmolLM2 has no q/k norm
        assert p["decode_layer_calls"] == {"qwen3-0.6b": 2, "qwen3-8b": 1}.get(preset, 0), p


def test_every_kv_cache_kernel_compiles_with_an_fp8_cache(compiled):
    for preset in PRESETS:
        p = compiled["presets"][preset]
        assert p["fp8_decode_calls"] == p["fp8_prologue_decode_calls"] == p["decode_variants"], p
        # the decode with the V scale in its other place (two rows at max_len: split and reduce kernels), paged
        # prefill, store_kv, q/k norm + RoPE's store at 1 and 64 tokens
        assert p["fp8_other_calls"] == 6, p
        # and with the V cache's blocks holding each head's positions contiguous (LAB_FP8_V_T)
        assert p["fp8_vt_decode_calls"] == p["fp8_vt_prologue_decode_calls"] == p["decode_variants"], p
        assert p["fp8_vt_other_calls"] == 4, p


# -- the compiling process --------------------------------------------------------------------------------------
def stand_in_driver(calls: list, errors: list, targets: set) -> None:
    """Triton sees an sm_90 device; every launch compiles and returns without running (its outputs stay
    whatever torch.empty gave: nothing reads them). tools/kernel_resources.py builds through it too."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class Sm90:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(Sm90())
    run = JITFunction.run

    def warmup_only(self, *args, grid, warmup, **kwargs):
        try:
            kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
            calls.append(self.fn.__name__)
            targets.add((kernel.metadata.target.backend, kernel.metadata.target.arch))
            return kernel
        except Exception as e:                              # noqa: BLE001 (the test reports it)
            errors.append(f"{self.fn.__name__}: {type(e).__name__}: {str(e)[-400:]}")
    JITFunction.run = warmup_only


def _preset(name: str, calls: list) -> dict:
    import torch

    from engine.attention import kv_store
    import engine.attention.prefill_kernels as pk
    from engine.attention.splits import decode_variants
    from engine.config import ModelShape
    from engine.layers import fused_kernels as fk
    from engine.layers.gemv import gemv, normed_gemv
    from engine.layers.skinny_gemm import skinny_gemm, split_k
    from engine.sampling.gumbel_kernel import gumbel_argmax
    from labkit.assets.synth import PRESETS as SYNTH
    from labkit.bench.gemv import gemv_shapes

    bf16, sm, page, max_len = torch.bfloat16, 132, 256, 4096
    shape = ModelShape.from_hf(SYNTH[name])
    hq, hk, d, h = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.hidden_size
    e = lambda *s, dtype=bf16: torch.empty(*s, dtype=dtype)          # noqa: E731 (never read: nothing runs)
    out = {"gemv_calls": 0, "decode_calls": 0}
    for n, k, mode in gemv_shapes(shape).values():
        for peel in (True, False):
            before = len(calls)
            x, w = e(1, k if mode != "silu" else 2 * k), e(n, k)
            if mode == "normed":
                normed_gemv(e(1, k), w, e(k), 1e-6, e(1, k), peel=peel)
            else:
                gemv(x, w, silu_mul=mode == "silu", peel=peel)
            out["gemv_calls"] += len(calls) > before
    out["rows_gemv_calls"] = 0
    for n, k, mode in gemv_shapes(shape).values():                  # a small decode batch (LAB_GEMV_ROWS)
        for m in (2, 4, 8):
            before = len(calls)
            w = e(n, k)
            if mode == "normed":
                normed_gemv(e(m, k), w, e(k), 1e-6, e(m, k))
            else:
                gemv(e(m, k if mode != "silu" else 2 * k), w, silu_mul=mode == "silu")
            out["rows_gemv_calls"] += len(calls) > before
    out["skinny_calls"] = 0
    for n, k, _ in gemv_shapes(shape).values():                      # a small decode batch (LAB_SKINNY_GEMM)
        for m in (2, 24, 64):
            before = len(calls)
            skinny_gemm(e(m, k), e(n, k), split=split_k(n, k, sm))
            out["skinny_calls"] += len(calls) > before
    blocks = 8
    kc, vc = e(blocks, page, hk, d), e(blocks, page, hk, d)
    variants = decode_variants(512, hk, max_len, sm)
    out["decode_calls"] += _decode_launches(calls, e, variants, kc, vc, page, hq, d, max_len, sm)
    out["prologue_decode_calls"] = _decode_launches(calls, e, variants, kc, vc, page, hq, d, max_len, sm, prologue=True)
    out["decode_variants"] = len(variants)
    out["l2_prefetches"] = _l2_prefetches(e, shape, SYNTH[name], kc, vc, hq, d, max_len, sm)
    t = 64
    cu = torch.tensor([0, 32, 64], dtype=torch.int32)
    pk.paged_prefill(e(t, hq, d), kc, vc, torch.zeros(2, 4, dtype=torch.int32), cu, cu, 32, d ** -0.5)
    pk.varlen_prefill(e(t, hq, d), e(t, hk, d), e(t, hk, d), cu, 32, d ** -0.5)
    wide = torch.arange(0, t + 1, 2, dtype=torch.int32)              # 32 sequences: the prefill's full grid
    pk.paged_prefill(e(t, hq, d), kc, vc, torch.zeros(32, 4, dtype=torch.int32), wide, wide, 2, d ** -0.5)
    pk.varlen_prefill(e(t, hq, d), e(t, hk, d), e(t, hk, d), wide, 2, d ** -0.5)
    kv_store.store_kv(e(t, hk, d), e(t, hk, d), kc, vc, torch.zeros(t, dtype=torch.int64))
    for tokens in (1, t):
        fk.rms_norm(e(tokens, h), e(h), 1e-6)
        fk.rms_norm(e(tokens, h), e(h), 1e-6, e(tokens, h))
        rope = dict(k_cache=kc, v_cache=vc, slot_mapping=torch.zeros(tokens, dtype=torch.int64))
        cos = e(max_len, d, dtype=torch.float32)
        qkv = e(tokens, (hq + 2 * hk) * d)
        fk.qk_norm_rope(qkv, torch.zeros(tokens, dtype=torch.int64), e(d), e(d), cos, cos, hq, hk, d, 1e-6, **rope)
        fk.silu_and_mul(e(tokens, 2 * shape.intermediate_size))
    gumbel_argmax(e(4, shape.vocab_size), torch.ones(4), torch.zeros(4, dtype=torch.int64))
    out["decode_layer_calls"] = _decode_layer_launches(calls, e, shape, SYNTH[name], kc, vc, max_len, sm,
                                                       {"qwen3-0.6b": 2, "qwen3-8b": 1}.get(name, 0))
    out.update(_fp8_cache(calls, e, variants, blocks, page, hq, hk, d, max_len, sm, t, cu))
    return out


def _decode_launches(calls: list, e, variants: dict, kc, vc, page: int, hq: int, d: int, max_len: int, sm: int,
                     prologue: bool = False) -> int:
    """The paged decode at each of ``variants``' (batch, length) over the caches kc/vc (prologue: through the decode
    prologue, q/k norm + RoPE and the KV store inside it): how many launches compiled."""
    import torch

    import engine.attention.triton_kernels as tk

    compiled = 0
    hk = kc.shape[2]
    for batch, length in variants.values():
        before = len(calls)
        tables = torch.zeros(batch, max_len // page, dtype=torch.int32)
        ctx = torch.full((batch,), length, dtype=torch.int32)
        zeros = torch.zeros(batch, dtype=torch.int64)
        q, new = e(batch, hq, d), None
        if prologue:
            cos = e(max_len, d, dtype=torch.float32)
            q, new = None, tk.NewTokens(e(batch, (hq + 2 * hk) * d), zeros, e(d), e(d), cos, cos, 1e-6, zeros, hq)
        tk.paged_decode(q, kc, vc, tables, ctx, d ** -0.5, length, sm, order=torch.arange(batch, dtype=torch.int32),
                        new=new)
        compiled += len(calls) > before
    return compiled


def _l2_prefetches(e, shape, cfg: dict, kc, vc, hq: int, d: int, max_len: int, sm: int) -> int:
    """The batch-1 decode through the prologue asking L2 for a layer's four weights (LAB_L2_PREFETCH=layer): the
    bulk prefetches in its compiled PTX (one a region)."""
    import torch
    from triton.runtime.jit import JITFunction

    import engine.attention.triton_kernels as tk

    h, hk, inter = shape.hidden_size, kc.shape[2], cfg["intermediate_size"]
    weights = (e(h, hq * d), e(2 * inter, h), e(h, inter), e((hq + 2 * hk) * d, h))
    built, run = [], JITFunction.run

    def keep(self, *args, **kwargs):
        kernel = run(self, *args, **kwargs)
        if self.fn.__name__ == "_decode_split_kernel":
            built.append(kernel)
        return kernel
    JITFunction.run = keep
    try:
        zeros, cos = torch.zeros(1, dtype=torch.int64), e(max_len, d, dtype=torch.float32)
        new = tk.NewTokens(e(1, (hq + 2 * hk) * d), zeros, e(d), e(d), cos, cos, 1e-6, zeros, hq, l2=weights)
        tk.paged_decode(None, kc, vc, torch.zeros(1, max_len // kc.shape[1], dtype=torch.int32),
                        torch.full((1,), 1024, dtype=torch.int32), d ** -0.5, max_len, sm, new=new)
    finally:
        JITFunction.run = run
    return built[-1].asm["ptx"].count("cp.async.bulk.prefetch.L2.global") if built and built[-1] else 0


def launch_decode_layer(e, shape, cfg: dict, kc, vc, max_len: int, sm: int, residual: bool = True) -> None:
    """The persistent decode layer at ``shape`` in its one launch over ``sm`` SMs, on never-read tensors ``e`` makes
    (with the stand-in driver: a compile). tools/kernel_resources.py --layer launches it the same way."""
    import torch

    from engine.layers.decode_layer import decode_layer, layer_sync

    layer_sync("cpu")
    h, hq, hk, d, inter = shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim, cfg["intermediate_size"]
    cos = e(max_len, d, dtype=torch.float32)
    decode_layer(e(1, h), e(1, h) if residual else None, in_norm=e(h), qkv_w=e((hq + 2 * hk) * d, h), q_norm=e(d),
                 k_norm=e(d), cos=cos, sin=cos, o_w=e(h, hq * d), post_norm=e(h), gate_up_w=e(2 * inter, h),
                 down_w=e(h, inter), k_cache=kc, v_cache=vc, block_tables=torch.zeros(1, 16, dtype=torch.int32),
                 context_lens=torch.ones(1, dtype=torch.int32), positions=torch.zeros(1, dtype=torch.int64),
                 slot_mapping=torch.zeros(1, dtype=torch.int64), eps=1e-6, qk_eps=1e-6, max_len=max_len,
                 sm_count=sm, phases=False)


def _decode_layer_launches(calls: list, e, shape, cfg: dict, kc, vc, max_len: int, sm: int, variants: int) -> int:
    """The persistent decode layer in its one launch (PDL on), with a residual and (variants 2) without: launches
    that compiled (none for a family without q/k norm)."""
    from engine.families import family_for

    if not family_for(cfg).qk_norm:
        return 0
    compiled = 0
    for residual in (True, False)[:variants]:
        before = len(calls)
        launch_decode_layer(e, shape, cfg, kc, vc, max_len, sm, residual)
        compiled += len(calls) > before
    return compiled


def _fp8_cache(calls: list, e, variants: dict, blocks: int, page: int, hq: int, hk: int, d: int, max_len: int,
               sm: int, t: int, cu) -> dict:
    """The KV cache's kernels again with e4m3 caches (engine/attention/kv_quant.py): launches that compiled."""
    import torch

    import engine.attention.triton_kernels as tk
    from engine.attention import kv_quant, splits

    bf16 = torch.bfloat16
    kc, vc = (kv_quant.mark(e(blocks, page, hk, d, dtype=kv_quant.FP8), 0.5, bf16) for _ in range(2))
    out = {"fp8_decode_calls": _decode_launches(calls, e, variants, kc, vc, page, hq, d, max_len, sm),
           "fp8_prologue_decode_calls": _decode_launches(calls, e, variants, kc, vc, page, hq, d, max_len, sm,
                                                         prologue=True)}
    before = len(calls)
    tk.paged_decode(e(2, hq, d), kc, vc, torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
                    d ** -0.5, max_len, sm, fp8_v_in_tile=not splits.DECODE_FP8_V_IN_TILE)    # the other V-scale place
    _cache_kernels(e, kc, vc, hq, d, max_len, t, cu)
    out["fp8_other_calls"] = len(calls) - before
    # the V cache in its other layout (kv_quant.v_t, LAB_FP8_V_T): every decode variant, through the prologue too,
    # then the paged prefill, store_kv and q/k norm + RoPE's store at 1 and 64 tokens
    vt = kv_quant.mark(e(blocks, page, hk, d, dtype=kv_quant.FP8), 0.5, bf16, v_t=True)
    out["fp8_vt_decode_calls"] = _decode_launches(calls, e, variants, kc, vt, page, hq, d, max_len, sm)
    out["fp8_vt_prologue_decode_calls"] = _decode_launches(calls, e, variants, kc, vt, page, hq, d, max_len, sm,
                                                           prologue=True)
    before = len(calls)
    _cache_kernels(e, kc, vt, hq, d, max_len, t, cu)
    out["fp8_vt_other_calls"] = len(calls) - before
    return out


def _cache_kernels(e, kc, vc, hq: int, d: int, max_len: int, t: int, cu) -> None:
    """The paged prefill over the caches kc/vc, then the two kernels that write them: store_kv, and q/k norm +
    RoPE's store at 1 and t tokens (with the stand-in driver: compiles)."""
    import torch

    from engine.attention import kv_store
    import engine.attention.prefill_kernels as pk
    from engine.layers import fused_kernels as fk

    hk = kc.shape[2]
    pk.paged_prefill(e(t, hq, d), kc, vc, torch.zeros(2, 4, dtype=torch.int32), cu, cu, 32, d ** -0.5)
    kv_store.store_kv(e(t, hk, d), e(t, hk, d), kc, vc, torch.zeros(t, dtype=torch.int64))
    for tokens in (1, t):
        cos = e(max_len, d, dtype=torch.float32)
        fk.qk_norm_rope(e(tokens, (hq + 2 * hk) * d), torch.zeros(tokens, dtype=torch.int64), e(d), e(d), cos, cos,
                        hq, hk, d, 1e-6, k_cache=kc, v_cache=vc, slot_mapping=torch.zeros(tokens, dtype=torch.int64))


def main() -> None:
    calls: list = []
    errors: list = []
    targets: set = set()
    try:
        import engine.pdl as pdl
        stand_in_driver(calls, errors, targets)
        pdl.launch = lambda t: {"PDL": True, "launch_pdl": True}     # as on Hopper: PDL's waits compiled in
        import engine.attention.triton_kernels as tk
        import torch
        tk.decode_locks(torch.device("cpu"))
        from engine.layers.skinny_gemm import counters
        counters(torch.device("cpu"))
        from engine.layers.gemv import gemv
        gemv(torch.empty(1, 64, dtype=torch.bfloat16), torch.empty(16, 64, dtype=torch.bfloat16))
        if errors or not calls:
            print(json.dumps({"skip": f"Triton cannot compile for sm_90 here: {(errors or ['no launch seen'])[0][:200]}"}))
            return
    except Exception as e:                                      # noqa: BLE001
        print(json.dumps({"skip": f"Triton cannot compile for sm_90 here: {type(e).__name__}: {str(e)[:200]}"}))
        return
    presets = {name: _preset(name, calls) for name in PRESETS}
    print(json.dumps({"targets": sorted(map(list, targets)), "kernels": sorted(set(calls)), "errors": errors, "presets": presets}))


if __name__ == "__main__":
    main()
