"""The decode prologue (triton_kernels.paged_decode with ``new``: q/k-norm + RoPE and the new token's KV store
inside the split kernel) on the CPU through Triton's interpreter (TRITON_INTERPRET=1), against

- the route it replaces: fused_kernels.qk_norm_rope storing k and v, then paged_decode on its q (the output, and
  the whole caches bit for bit: the new rows and the rest), with each split's first tile read before the PDL wait
  (PREFETCH) and after it, the two the same;
- a float32 reference: RMSNorm and RoPE in torch, then softmax attention over the cached positions and the new
  token.

and the wiring: the tiny Qwen3 on the Triton backend generates the same greedy tokens, and its decode steps the
same logits, with its decode steps through the prologue as through the unfused route.

Cases: one split and several (the reduce kernel and the fused reduce), one and two kv heads per program, float32
and bfloat16, bf16 and e4m3 caches, a row launched out of order, a row whose context is only its new token, and a
graph's padding row (context 0, slot -1: nothing written, zeros out).

Skipped where triton is not installed or its interpreter cannot run a kernel here.
"""
from __future__ import annotations

import sys

import pytest

from interp import case_key, interpreter_ready, print_results

HQ, HK, D, PAGE = 4, 2, 32, 16
CONTEXTS = [37, 1, 70, 0]             # the last row is a graph's padding row
MAX_LEN = 96
BLOCKS = 24
FP8_SCALES = (0.5, 2.0)         # an e4m3 cache's k and v scales
# (dtype, kv cache, heads per program, SMs: 1 gives one split, 8 and 64 several, fused reduce, positions a tile): the
# first tile read before the PDL wait (PREFETCH) where several splits go to the reduce kernel; 16-position tiles
# give those splits two tiles each, the second read in the loop; a seventh field True: one block-table load a tile
# (page_tile, where the tile divides the page); an eighth True: the e4m3 V cache's blocks hold each head's positions
# contiguous (kv_quant.v_t), read one position run a tile (page_tile, one kv head a program) or position by position
CASES = [("float32", "auto", 1, 1, False, 64), ("float32", "auto", 1, 64, False, 64), ("float32", "auto", 2, 64, True, 64),
         ("bfloat16", "auto", 1, 64, True, 64), ("bfloat16", "auto", 2, 1, False, 64),
         ("bfloat16", "fp8", 1, 64, False, 64), ("float32", "fp8", 1, 64, True, 64),
         ("float32", "auto", 1, 8, False, 16), ("bfloat16", "fp8", 1, 8, False, 16),
         ("float32", "auto", 1, 8, False, 16, True), ("bfloat16", "auto", 1, 16, True, 16, True),
         ("bfloat16", "fp8", 1, 8, False, 16, True, True), ("float32", "fp8", 1, 64, True, 64, False, True)]


@pytest.mark.parametrize("case", CASES, ids=case_key)
def test_prologue_gives_the_unfused_route_output_and_caches(results, case):
    r = results[case_key(case)]
    assert r["splits"] > 1 or case[3] == 1, r
    assert r["tiles_a_split"] == (2 if case[5] == 16 else r["tiles_a_split"]), r
    assert r["k_cache_equal"] and r["v_cache_equal"], r          # the new rows, and nothing else touched
    assert r["v_as_written"], r                                  # e4m3: in its layout, where a read finds it
    assert r["rows_written"] == HK * sum(map(bool, CONTEXTS)) and r["stale_before"], r   # live rows x kv heads
    tol = 2e-6 if case[0] == "float32" else 2e-2
    assert r["vs_unfused"] <= tol, r
    assert r["padding_row_max"] == 0.0, r
    assert r["prefetch_same"], r          # the first tile read before the PDL wait: the same output and caches


@pytest.mark.parametrize("case", CASES, ids=case_key)
def test_prologue_against_float32_reference(results, case):
    r = results[case_key(case)]
    # float32: the kernel's float32 dots against torch's; bfloat16: q, k, v and p rounded to bf16 on the way (the
    # reference reads the e4m3 cache and the new token as the cache holds them, so FP8 adds no error of its own)
    tol = 1e-4 if case[0] == "float32" else 4e-2
    assert r["vs_reference"] <= tol, r


def test_tiny_model_decodes_the_same_through_the_prologue(model_results):
    r = model_results
    assert r["prologue_calls"] == r["decode_steps"] * r["layers"] > 0, r        # every decode step's every layer
    assert r["unfused_prologue_calls"] == 0, r
    assert r["tokens_equal"], r
    assert r["decode_logits_max_abs"] <= 1e-4, r


# -- the interpreter process ---------------------------------------------------------------------------------
def _reference(torch, qkv, positions, qw, kw, rope, k_cache, v_cache, tables, contexts, kv_quant, fp8):
    """float32: RMSNorm + RoPE of q and the new k, softmax over the cached positions and the new token."""
    rows = []
    x = qkv.float()
    q = x[:, :HQ * D].view(-1, HQ, D)
    k = x[:, HQ * D:(HQ + HK) * D].view(-1, HK, D)
    v = x[:, (HQ + HK) * D:].view(-1, HK, D)

    def norm(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
    q, k = rope(positions, norm(q, qw), norm(k, kw))
    if fp8:                 # the new token as the cache holds it once stored
        k, v = (kv_quant.dequantize(kv_quant.quantize(t, s), s, torch.float32) for t, s in zip((k, v), FP8_SCALES))
    kc, vc = ((kv_quant.dequantize(c, s, torch.float32) if fp8 else c.float())
              for c, s in zip((k_cache, v_cache), FP8_SCALES))
    for i, ctx in enumerate(contexts):
        if ctx == 0:
            rows.append(torch.zeros(HQ, D))
            continue
        slots = [int(tables[i, p // PAGE]) * PAGE + p % PAGE for p in range(ctx - 1)]
        keys = torch.cat([kc.view(-1, HK, D)[slots], k[i:i + 1]])
        vals = torch.cat([vc.view(-1, HK, D)[slots], v[i:i + 1]])
        g = HQ // HK
        out = []
        for h in range(HQ):
            s = keys[:, h // g] @ q[i, h] * D ** -0.5
            out.append(torch.softmax(s, 0) @ vals[:, h // g])
        rows.append(torch.stack(out))
    return torch.stack(rows)


def run_case(torch, tk, fk, kv_quant, RotaryEmbedding, dtype_name, cache, hpp, sms, fuse, block_n,
             page_tile=False, v_t=False) -> dict:
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(7)
    n = len(CONTEXTS)
    qkv = torch.randn(n, (HQ + 2 * HK) * D, generator=g).to(dtype)
    qw = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype)
    kw = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype)
    rope = RotaryEmbedding(D, 128, 10000.0)
    contexts = torch.tensor(CONTEXTS, dtype=torch.int32)
    positions = (contexts - 1).clamp(min=0).to(torch.int64)
    tables = torch.randperm(BLOCKS, generator=g)[: n * (MAX_LEN // PAGE)].view(n, -1).to(torch.int32)
    slots = torch.tensor([int(tables[i, (c - 1) // PAGE]) * PAGE + (c - 1) % PAGE if c else -1
                          for i, c in enumerate(CONTEXTS)], dtype=torch.int64)
    k_cache = torch.randn(BLOCKS, PAGE, HK, D, generator=g).to(dtype)
    v_cache = torch.randn(BLOCKS, PAGE, HK, D, generator=g).to(dtype)
    if cache == "fp8":
        k_cache, v_cache = (kv_quant.quantize(c, s) for c, s in zip((k_cache, v_cache), FP8_SCALES))
    order = torch.tensor([2, 0, 3, 1], dtype=torch.int32)       # launched out of order, as decode_order does
    before = (k_cache.clone(), v_cache.clone())
    caches = {}
    outs = {}
    for route in ("unfused", "prologue-plain", "prologue"):
        kc, vc = (c.clone() for c in before)
        if cache == "fp8":
            kc, vc = (kv_quant.mark(c, s, dtype) for c, s in zip((kc, vc), FP8_SCALES))
            if v_t:
                vc = kv_quant.to_v_t(vc)
        args = dict(max_len=MAX_LEN, sm_count=sms, kv_per_prog=hpp, fuse_reduce=fuse, order=order, block_n=block_n,
                    page_tile=page_tile)
        if route == "unfused":
            q, _ = fk.qk_norm_rope(qkv, positions, qw, kw, rope.cos, rope.sin, HQ, HK, D, 1e-6,
                                   k_cache=kc, v_cache=vc, slot_mapping=slots)
            out = tk.paged_decode(q, kc, vc, tables, contexts, D ** -0.5, **args)
        else:
            new = tk.NewTokens(qkv, positions, qw, kw, rope.cos, rope.sin, 1e-6, slots, HQ,
                               prefetch=route == "prologue")
            out = tk.paged_decode(None, kc, vc, tables, contexts, D ** -0.5, new=new, **args)
        caches[route], outs[route] = (kc, vc), out.float()
    ref = _reference(torch, qkv, positions, qw, kw, rope, *before, tables, CONTEXTS, kv_quant, cache == "fp8")
    live = [i for i, c in enumerate(CONTEXTS) if c]
    changed = (caches["prologue"][0].view(torch.uint8 if cache == "fp8" else dtype) !=
               before[0].view(torch.uint8 if cache == "fp8" else dtype)).view(BLOCKS * PAGE, HK, -1).any(-1)
    raw = [c.view(torch.uint8) if cache == "fp8" else c for c in (*caches["unfused"], *caches["prologue"])]
    splits, split_len = tk.choose_splits(n, HK // tk.kv_per_program(HK, hpp), MAX_LEN, block_n, sms, tk.DECODE_WAVES)
    plain = [c.view(torch.uint8) if cache == "fp8" else c for c in caches["prologue-plain"]]
    v_as_written = True
    if cache == "fp8":      # the V cache read back (either layout) is the old one with each live row's v quantized
        want = kv_quant.mark(before[1].clone(), FP8_SCALES[1], dtype)
        live_slots = slots[slots >= 0]
        kv_quant.write(want, live_slots, qkv[:, (HQ + HK) * D:].reshape(n, HK, D)[slots >= 0])
        every = torch.arange(BLOCKS).view(1, BLOCKS)
        v_as_written = bool(torch.equal(kv_quant.read(caches["prologue"][1], every), kv_quant.read(want, every)))
    return {"k_cache_equal": bool(torch.equal(raw[0], raw[2])), "v_cache_equal": bool(torch.equal(raw[1], raw[3])),
            "v_as_written": v_as_written,
            "prefetch_same": bool(torch.equal(outs["prologue"], outs["prologue-plain"]) and
                                  all(torch.equal(a, b) for a, b in zip(plain, raw[2:]))),
            "rows_written": int(changed.sum()),
            "stale_before": bool(all((before[0].view(-1, HK, D)[int(slots[i])].float() != 0).any() for i in live)),
            "vs_unfused": float((outs["prologue"] - outs["unfused"]).abs().max()),
            "vs_reference": float((outs["prologue"][live] - ref[live]).abs().max()),
            "padding_row_max": float(outs["prologue"][3].abs().max()), "splits": splits,
            "tiles_a_split": split_len // block_n}


def _generate(model_dir: str, prologue: bool) -> dict:
    """The tiny model's greedy generation with the Triton backend and every fused kernel on (the decode prologue
    on or off): its tokens, its decode steps' logits and the prologue's calls."""
    from engine import SamplingParams
    from interp import tiny_triton_engine

    engine = tiny_triton_engine(model_dir, decode_prologue="prefetch" if prologue else "")
    runner = engine.runner
    backend = runner.backend
    calls = []
    plain_decode_new = backend.decode_new
    backend.decode_new = lambda *a, **k: calls.append(1) or plain_decode_new(*a, **k)
    prompts = [list(range(100 + 9 * i, 100 + 9 * i + n)) for i, n in enumerate((21, 5, 33))]
    outs = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    return {"tokens": [o["token_ids"] for o in outs], "logits": runner.decode_logits, "calls": len(calls),
            "layers": len(runner.model.attention_layers()), "route": runner.model.describe()["qk_norm_rope_kv"]}


def _model(model_dir: str) -> dict:
    plain, prologue = _generate(model_dir, False), _generate(model_dir, True)
    assert prologue["route"] == "decode-prologue" and plain["route"] == "fused", (plain["route"], prologue["route"])
    same_steps = len(plain["logits"]) == len(prologue["logits"])
    return {"tokens_equal": plain["tokens"] == prologue["tokens"], "decode_steps": len(prologue["logits"]),
            "layers": prologue["layers"], "prologue_calls": prologue["calls"], "unfused_prologue_calls": plain["calls"],
            "decode_logits_max_abs": max((a - b).abs().max().item() for a, b in zip(plain["logits"], prologue["logits"]))
            if same_steps else float("inf")}


def main() -> None:
    import torch
    import triton.runtime.interpreter as interp
    from test_decode_kernel_interp import _bf16_dot_fix
    from test_kv_fp8_interp import _fp8_cast_fix

    from engine.attention import kv_quant
    from engine.attention import triton_kernels as tk
    from engine.layers import fused_kernels as fk
    from engine.layers.rotary import RotaryEmbedding

    tk.decode_locks(torch.device("cpu"))   # the fused reduce's counters

    def one(case):
        return run_case(torch, tk, fk, kv_quant, RotaryEmbedding, *case)
    if not interpreter_ready(lambda: one(CASES[0])):
        return
    interp.InterpreterBuilder.create_dot = _bf16_dot_fix(interp.InterpreterBuilder.create_dot)
    interp._convert_float = _fp8_cast_fix(interp._convert_float)      # e4m3 conversions as the GPU rounds them
    print_results(one, CASES, _model)           # (with the tiny model's directory: the wiring)


if __name__ == "__main__":
    sys.exit(main())
