"""The persistent decode layer (engine/layers/decode_layer.py: a batch-1 decode step's whole decoder layer in one
kernel) on the CPU through Triton's interpreter (TRITON_INTERPRET=1), one launch a phase (the interpreter runs a
grid's programs one after another, so a grid barrier could not complete here; the GPU test runs the one launch):

- against a float32 reference of the layer in torch: RMSNorm, the qkv projection, q/k norm and RoPE, attention over
  the cached positions and the new token, o, the residual, RMSNorm, SiLU-gated MLP; the layer's output and new
  residual, the new k and v in the cache, and every other cache row untouched;
- the wiring: the tiny Qwen3 with the Triton backend and every fused kernel on generates the same greedy tokens
  with LAB_DECODE_LAYER's route as without it, and its decode steps' logits agree, each layer of each batch-1 decode
  step through the kernel.

Cases: one split and several (the combine of the fused reduce), the first layer (no residual), a context of only the
new token, fewer programs than bands (several bands a program), small tiles (several chunks a band), float32 and
bfloat16.

Skipped where triton is not installed or its interpreter cannot run a kernel here.
"""
from __future__ import annotations

import sys

import pytest

from interp import case_key, interpreter_ready, print_results

H, HQ, HK, D, INTER, PAGE = 64, 4, 2, 16, 128, 16
BLOCKS = 12
# (dtype, context, residual, SMs, programs, weight tile elements): 16 SMs give several splits, 1 a single split; 3
# programs several bands each; 256-element tiles several chunks a band (the default takes each of these rows whole)
CASES = [("float32", 37, True, 16, None, None), ("float32", 37, True, 1, None, None),
         ("float32", 70, False, 16, None, None), ("float32", 1, True, 16, None, None), ("float32", 50, True, 16, 3, None),
         ("float32", 50, True, 16, 3, 256), ("bfloat16", 37, True, 16, None, None), ("bfloat16", 70, False, 1, None, 256)]


@pytest.mark.parametrize("case", CASES, ids=case_key)
def test_the_layer_kernel_against_a_float32_layer(results, case):
    r = results[case_key(case)]
    assert r["splits"] > 1 or case[3] == 1, r
    assert (r["most_chunks"] > 1) == (case[5] is not None), r
    # float32: float32 sums in another order; bfloat16: the activations rounded at each of the layer's steps, as
    # the unfused kernels round them (against values up to about 2)
    tol = 2e-5 if case[0] == "float32" else 6e-2
    assert r["y"] <= tol and r["h2"] <= tol, r
    assert r["k_new"] <= tol and r["v_new"] <= tol, r
    assert r["rest_of_cache_untouched"], r
    assert r["flag"] == 0, r


def test_tiny_model_decodes_the_same_through_the_layer_kernel(model_results):
    r = model_results
    assert r["route"] is True and r["plain_route"] is False, r
    assert r["layer_calls"] == r["batch1_decode_steps"] * r["layers"] > 0, r   # each batch-1 decode step, each layer
    assert r["plain_layer_calls"] == 0, r
    assert r["tokens_equal"], r
    assert r["decode_logits_max_abs"] <= 1e-4, r


# -- the interpreter process ---------------------------------------------------------------------------------
def run_case(torch, decode_layer, RotaryEmbedding, dtype_name, ctx, has_res, sms, programs, tile) -> dict:
    import torch.nn.functional as F

    from engine.attention.splits import choose_splits, DECODE_BLOCK_N

    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(11)

    def r(*shape, sc=1.0, base=0.0):
        return (torch.randn(*shape, generator=g) * sc + base).to(dtype)
    x, res = r(1, H), (r(1, H) if has_res else None)
    in_norm, post_norm, qn, kn = r(H, sc=0.2, base=1.0), r(H, sc=0.2, base=1.0), r(D, sc=0.2, base=1.0), \
        r(D, sc=0.2, base=1.0)
    qkv_w, o_w = r((HQ + 2 * HK) * D, H, sc=H ** -0.5), r(H, HQ * D, sc=(HQ * D) ** -0.5)
    gu_w, down_w = r(2 * INTER, H, sc=H ** -0.5), r(H, INTER, sc=INTER ** -0.5)
    rope = RotaryEmbedding(D, 256, 10000.0)
    kc, vc = r(BLOCKS, PAGE, HK, D), r(BLOCKS, PAGE, HK, D)
    table = torch.randperm(BLOCKS, generator=g)[:8].to(torch.int32)[None]
    slot = int(table[0, (ctx - 1) // PAGE]) * PAGE + (ctx - 1) % PAGE
    pos = torch.tensor([ctx - 1])
    kc0, vc0 = kc.clone(), vc.clone()
    sync = __import__("engine.layers.decode_layer", fromlist=["layer_sync"]).layer_sync(torch.device("cpu"))
    y, h2 = decode_layer(x, res, in_norm=in_norm, qkv_w=qkv_w, q_norm=qn, k_norm=kn, cos=rope.cos, sin=rope.sin,
                         o_w=o_w, post_norm=post_norm, gate_up_w=gu_w, down_w=down_w, k_cache=kc, v_cache=vc,
                         block_tables=table, context_lens=torch.tensor([ctx], dtype=torch.int32), positions=pos,
                         slot_mapping=torch.tensor([slot]), eps=1e-6, qk_eps=1e-6, max_len=128, sm_count=sms,
                         programs=programs, **({"tile_elements": tile} if tile else {}))

    def f(t):
        return t.float()

    def rms(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * f(w)
    h = f(x) + (f(res) if has_res else 0)
    qkv = rms(h, in_norm) @ f(qkv_w).T
    q, k, v = qkv[:, :HQ * D].view(1, HQ, D), qkv[:, HQ * D:(HQ + HK) * D].view(1, HK, D), qkv[:, (HQ + HK) * D:]
    q, k = rope(pos, rms(q, qn), rms(k, kn))
    v = v.view(1, HK, D)
    slots = [int(table[0, p // PAGE]) * PAGE + p % PAGE for p in range(ctx - 1)]
    keys = torch.cat([f(kc0).view(-1, HK, D)[slots], k])
    vals = torch.cat([f(vc0).view(-1, HK, D)[slots], v])
    grp = HQ // HK
    att = torch.stack([torch.softmax(keys[:, j // grp] @ q[0, j] * D ** -0.5, 0) @ vals[:, j // grp]
                       for j in range(HQ)])
    h2_ref = att.reshape(1, -1) @ f(o_w).T + h
    gu = rms(h2_ref, post_norm) @ f(gu_w).T
    y_ref = (F.silu(gu[:, :INTER]) * gu[:, INTER:]) @ f(down_w).T
    others = torch.ones(BLOCKS * PAGE, dtype=torch.bool)
    others[slot] = False
    from engine.layers.decode_layer import TILE_ELEMENTS, gemv_tile
    chunks = max(-(-k // gemv_tile(n, k, programs or sms, tile or TILE_ELEMENTS)[1])
                 for n, k in ((HQ * D + 2 * HK * D, H), (H, HQ * D), (2 * INTER, H), (H, INTER)))
    return {"splits": choose_splits(1, HK, 128, DECODE_BLOCK_N, sms)[0], "most_chunks": chunks,
            "y": float((f(y) - y_ref).abs().max()), "h2": float((f(h2) - h2_ref).abs().max()),
            "k_new": float((f(kc).view(-1, HK, D)[slot] - k[0]).abs().max()),
            "v_new": float((f(vc).view(-1, HK, D)[slot] - v[0]).abs().max()),
            "rest_of_cache_untouched": bool(torch.equal(kc.view(-1, HK, D)[others], kc0.view(-1, HK, D)[others])
                                            and torch.equal(vc.view(-1, HK, D)[others], vc0.view(-1, HK, D)[others])),
            "flag": int(sync[4])}


def _generate(model_dir: str, layer_kernel: bool) -> dict:
    """The tiny model's greedy generation with the Triton backend and every fused kernel on, the layer kernel on or
    off: its tokens, its decode steps' logits, the batch-1 decode steps and the layer kernel's calls."""
    import engine.layers.decode_layer as dl
    from engine import SamplingParams
    from interp import tiny_triton_engine
    from labkit.bench.run import engine_facts

    engine = tiny_triton_engine(model_dir, decode_prologue="prefetch", decode_layer=128 if layer_kernel else 0)
    runner = engine.runner
    calls = []
    plain = dl.decode_layer
    dl.decode_layer = lambda *a, **k: calls.append(1) or plain(*a, **k)
    # two requests, then one alone: decode steps of batch 2 (the layer kernel's case is one token) and of batch 1
    prompts = [list(range(100 + 9 * i, 100 + 9 * i + n)) for i, n in enumerate((21, 5))]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (6, 2)]
    outs = engine.generate(prompts, params)
    dl.decode_layer = plain
    return {"tokens": [o["token_ids"] for o in outs], "logits": runner.decode_logits, "calls": len(calls),
            "batch1": sum(t.shape[0] == 1 for t in runner.decode_logits), "layers": len(runner.model.attention_layers()),
            "route": engine_facts(engine)["decode_layer"]}      # what the bench's evidence records: the model's route


def _model(model_dir: str) -> dict:
    plain, layer = _generate(model_dir, False), _generate(model_dir, True)
    same_steps = len(plain["logits"]) == len(layer["logits"])
    return {"tokens_equal": plain["tokens"] == layer["tokens"], "batch1_decode_steps": layer["batch1"],
            "layers": layer["layers"], "layer_calls": layer["calls"], "plain_layer_calls": plain["calls"],
            "route": layer["route"], "plain_route": plain["route"],
            "decode_logits_max_abs": max((a - b).abs().max().item() for a, b in zip(plain["logits"], layer["logits"]))
            if same_steps else float("inf")}


def main() -> None:
    import torch
    import triton.runtime.interpreter as interp
    from test_decode_kernel_interp import _bf16_dot_fix

    from engine.attention import triton_kernels as tk
    from engine.layers.decode_layer import decode_layer
    from engine.layers.rotary import RotaryEmbedding

    tk.decode_locks(torch.device("cpu"))

    def one(case):
        return run_case(torch, decode_layer, RotaryEmbedding, *case)
    if not interpreter_ready(lambda: one(CASES[0])):
        return
    interp.InterpreterBuilder.create_dot = _bf16_dot_fix(interp.InterpreterBuilder.create_dot)
    print_results(one, CASES, _model)           # (with the tiny model's directory: the wiring)


if __name__ == "__main__":
    sys.exit(main())
