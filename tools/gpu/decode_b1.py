"""What batch-1 decode attention adds to a step, between the GEMVs it sits between (CUDA only).

    python3 tools/gpu/decode_b1.py --out decode-b1.json

At Qwen3-0.6B's shapes (bf16, 28 layers, each its own weights and paged KV cache, context --context in a cache
sized for --max-len as the decode graphs size it), one CUDA graph per variant replays the layers' chain with
PDL on as the engine runs it; the figure is the replay's median over the layers, us a layer:

- ``gemvs``: the normed qkv GEMV and the o GEMV only (o reads a fixed input): the chain without attention;
- ``gemvs+attention``: the normed qkv GEMV, the decode through the prologue (q/k norm + RoPE + KV store inside
  it, the split kernel and, at batch 1, the reduce kernel: the engine's route) and the o GEMV on its output;
- ``gemvs+attention fused``: the same with the splits combined by their last program (no reduce kernel);
- ``gemvs+attention block_n=N``: the same with N positions a tile (and a split);
- ``attention``: the decode alone, 28 calls.

The difference between ``gemvs+attention`` and ``gemvs`` is what the attention costs a step once PDL has overlapped
what it can; tools/gpu/kernel_floor.py gives what a kernel boundary alone costs.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()

    import torch

    import engine.attention.triton_kernels as tk
    from engine import pdl
    from engine.config import ModelShape
    from engine.layers.gemv import gemv, normed_gemv
    from engine.layers.rotary import RotaryEmbedding
    from labkit.assets.synth import PRESETS
    from labkit.bench.timing import graph_us

    dev, bf = "cuda", torch.bfloat16
    pdl_on = pdl.enable(dev)
    shape = ModelShape.from_hf(PRESETS["qwen3-0.6b"])
    h, hq, hk, d = shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim
    page = 256
    pages = a.max_len // page
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*s, scale=0.02):
        return torch.randn(*s, device=dev, dtype=bf, generator=g) * scale
    layers = []
    for _ in range(a.layers):
        kc, vc = rnd(pages + 1, page, hk, d, scale=1.0), rnd(pages + 1, page, hk, d, scale=1.0)
        layers.append({"qkv": rnd((hq + 2 * hk) * d, h), "o": rnd(h, hq * d), "kc": kc, "vc": vc,
                       "norm": torch.ones(h, device=dev, dtype=bf)})
    tables = torch.arange(1, pages + 1, device=dev, dtype=torch.int32).view(1, pages)
    ctx = torch.full((1,), a.context, device=dev, dtype=torch.int32)
    positions = (ctx - 1).long()
    slots = (tables[0, (a.context - 1) // page].long() * page + (a.context - 1) % page).view(1)
    rope = RotaryEmbedding(d, a.max_len, 1e6).to(dev)
    qw = kw = torch.ones(d, device=dev, dtype=bf)
    x0, o_in = rnd(1, h, scale=1.0), rnd(1, hq * d, scale=1.0)

    def attention(qkv, lay, **knobs):
        new = tk.NewTokens(qkv, positions, qw, kw, rope.cos, rope.sin, 1e-6, slots, hq)
        return tk.paged_decode(None, lay["kc"], lay["vc"], tables, ctx, d ** -0.5, a.max_len, sm, new=new, **knobs)

    def chain(with_attention: bool, **knobs):
        def run():
            x = x0
            for lay in layers:
                qkv, _ = normed_gemv(x, lay["qkv"], lay["norm"], 1e-6)
                o = attention(qkv, lay, **knobs).view(1, hq * d) if with_attention else o_in
                x = gemv(o, lay["o"])
        return run

    qkv_fixed = rnd(1, (hq + 2 * hk) * d, scale=1.0)

    def attention_only():
        for lay in layers:
            attention(qkv_fixed, lay)

    variants = {"gemvs": chain(False), "gemvs+attention": chain(True),
                "gemvs+attention fused": chain(True, fuse_reduce=True),
                "gemvs+attention block_n=32": chain(True, block_n=32),
                "gemvs+attention block_n=128": chain(True, block_n=128), "attention": attention_only}
    res = {"device": torch.cuda.get_device_name(0), "context": a.context, "max_len": a.max_len, "layers": a.layers,
           "pdl": pdl_on, "timing": "one CUDA graph a variant, median replay over the layers, us a layer", "us_per_layer": {},
           "errors": {}}
    for name, fn in variants.items():
        try:
            us = graph_us(fn, a.layers, a.replays)
            res["us_per_layer"][name] = round(us, 2)
            print(f"{name:32s} {us:8.2f} us a layer", flush=True)
        except Exception as e:                      # noqa: BLE001 (a variant that fails is reported, the rest run)
            res["errors"][name] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"{name}: {res['errors'][name]}", flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
