"""How much the batch-1 GEMVs after a layer's attention gain from finding their weights in L2 (CUDA only).

    python3 tools/gpu/l2_probe.py --out l2-probe.json

At Qwen3-0.6B's shapes (bf16) it times, median of --repeats, each on a flushed L2 (a 512 MB write first):
the o, normed gate_up and SiLU down GEMVs one after another from HBM (``cold``), right after a read of their
weights (``hot``: the most L2 can give), and behind a stand-in for the attention kernel (a sleep of --sleep-us)
with and without a launch of engine/l2_prefetch.py's ``prefetch`` for their weights before it (``sleep`` and
``prefetch + sleep``: what LAB_L2_PREFETCH=mlp can give, if the prefetch lands inside the attention's time), and
the prefetch launch alone. No PDL here (events between kernels): the figures are the GEMVs' own, not a step's.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from engine import l2_prefetch  # noqa: E402


@triton.jit
def _prefetch_only(l2_p0, l2_n0, l2_p1=None, l2_n1=0, l2_p2=None, l2_n2=0, l2_p3=None, l2_n3=0,
                   L2_REGIONS: tl.constexpr = 0):
    """engine/l2_prefetch.py's prefetch alone (its launch_args as the arguments): each program its share."""
    l2_prefetch.prefetch(l2_p0, l2_n0, l2_p1, l2_n1, l2_p2, l2_n2, l2_p3, l2_n3, L2_REGIONS)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--sleep-us", type=float, default=10.0, help="the stand-in attention's length")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()

    import torch

    from engine.config import ModelShape
    from engine.layers.gemv import gemv, normed_gemv
    from labkit.assets.synth import PRESETS
    from labkit.bench.timing import median_event_ms, spin_cycles

    cfg = PRESETS["qwen3-0.6b"]
    shape = ModelShape.from_hf(cfg)
    h, inter, q = shape.hidden_size, cfg["intermediate_size"], shape.num_heads * shape.head_dim
    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    w = {"o": torch.randn(h, q, device=dev, dtype=bf, generator=g) * 0.02,
         "gate_up": torch.randn(2 * inter, h, device=dev, dtype=bf, generator=g) * 0.02,
         "down": torch.randn(h, inter, device=dev, dtype=bf, generator=g) * 0.02}
    x_o, x_h = torch.randn(1, q, device=dev, dtype=bf), torch.randn(1, h, device=dev, dtype=bf)
    x_gu, norm = torch.randn(1, 2 * inter, device=dev, dtype=bf), torch.ones(h, device=dev, dtype=bf)
    flush = torch.empty(512 * 2 ** 20, dtype=torch.int8, device=dev)
    props = torch.cuda.get_device_properties(0)
    sm = props.multi_processor_count
    cycles = spin_cycles(a.sleep_us * 1e-6)
    args = l2_prefetch.launch_args((w["o"], w["gate_up"], w["down"]))

    def gemvs():
        gemv(x_o, w["o"])
        normed_gemv(x_h, w["gate_up"], norm, 1e-6)
        gemv(x_gu, w["down"], silu_mul=True)

    def prefetch(programs=2 * sm):
        _prefetch_only[(programs,)](**args, num_warps=4)

    def sleep():
        torch.cuda._sleep(cycles)

    def timed(before, body) -> float:
        return round(median_event_ms(body, a.repeats, before=lambda: (flush.fill_(1), before())) * 1e3, 2)

    def read_weights():
        for t in w.values():
            t.sum()

    for _ in range(3):          # compile everything first
        gemvs()
        prefetch()
    sleep()
    torch.cuda.synchronize()
    res = {"device": props.name, "sleep_us": a.sleep_us, "l2_mb": round(props.L2_cache_size / 1e6, 1),
           "weights_mb": round(sum(t.numel() * 2 for t in w.values()) / 1e6, 2), "repeats": a.repeats,
           "timing": "CUDA events, median (labkit.bench.timing.median_event_ms), us"}
    res["gemvs_cold"] = timed(lambda: None, gemvs)
    res["gemvs_hot"] = timed(read_weights, gemvs)
    res["sleep"] = timed(lambda: None, sleep)
    res["sleep_then_gemvs"] = timed(lambda: None, lambda: (sleep(), gemvs()))
    res["prefetch_sleep_then_gemvs"] = timed(lambda: None, lambda: (prefetch(), sleep(), gemvs()))
    res["prefetch_alone"] = timed(lambda: None, prefetch)
    res["prefetch_512_programs_sleep_then_gemvs"] = timed(lambda: None, lambda: (prefetch(512), sleep(), gemvs()))
    res["prefetch_then_gemvs"] = timed(lambda: None, lambda: (prefetch(), gemvs()))
    for name, call in (("o", lambda: gemv(x_o, w["o"])),
                       ("gate_up", lambda: normed_gemv(x_h, w["gate_up"], norm, 1e-6)),
                       ("down", lambda: gemv(x_gu, w["down"], silu_mul=True))):
        res[f"{name}_cold"] = timed(lambda: None, call)
        res[f"{name}_hot"] = timed(lambda n=name: w[n].sum(), call)
    print(json.dumps(res, indent=1))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
