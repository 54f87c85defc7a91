"""The floor a chain of kernels puts under a CUDA-graph step: µs per kernel of a do-nothing kernel (CUDA only).

    python3 tools/gpu/kernel_floor.py --out kernel-floor.json

A batch-1 decode step of Qwen3-0.6B launches about 170 kernels one after another (each layer's qkv GEMV, the
attention's split and reduce kernels, o, gate_up and down). Here --kernels launches of a kernel that does nothing but
the engine's PDL rule (engine/pdl.py: wait for the kernel before it, let the next one start) and one store are
captured in one CUDA graph, on --programs programs each, with PDL on and off: the time a replay takes over the
launches is what each kernel boundary costs with no work in it. Times the graph replay (labkit.bench.timing.graph_us,
median of --replays).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from engine import pdl  # noqa: E402


@triton.jit
def _nothing(out_ptr, PDL: tl.constexpr = False):
    """The PDL rule's wait and release, then one store a program."""
    pdl.enter(PDL)
    tl.store(out_ptr + tl.program_id(0), tl.program_id(0))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", type=int, default=170)
    ap.add_argument("--programs", default="1,132,264,512", help="programs a launch, comma separated")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()

    import torch

    from labkit.bench.timing import graph_us

    out = torch.zeros(4096, dtype=torch.int32, device="cuda")
    res = {"device": torch.cuda.get_device_name(0), "kernels": a.kernels, "replays": a.replays,
           "timing": "one CUDA graph of the launches, median replay over the launches, us a kernel", "rows": []}
    for on in (False, True):
        pdl.enable("cuda", on)
        for programs in (int(p) for p in a.programs.split(",")):
            def chain(p=programs):
                for _ in range(a.kernels):
                    _nothing[(p,)](out, **pdl.launch(out))
            us = graph_us(chain, 1, a.replays)
            res["rows"].append({"pdl": on, "programs": programs, "us_per_kernel": round(us / a.kernels, 3),
                                "us_per_chain": round(us, 1)})
            print(res["rows"][-1], flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
