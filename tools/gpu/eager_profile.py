"""Where an eager batch-1 decode step's time goes: the host (Python) side, by function.

Builds an engine with CUDA graphs off (``enforce_eager``), prefills one prompt, then times ``--steps`` decode
steps plain and again under cProfile, and prints the per-step time, the profile's top functions by own time and by
cumulative time, and the count of kernel launches per step seen by torch's profiler.

usage: python tools/gpu/eager_profile.py [--model DIR] [--steps 40] [--attention triton] [--top 35]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--top", type=int, default=35)
    ap.add_argument("--graph", action="store_true", help="profile the graph path instead (for comparison)")
    args = ap.parse_args()

    import torch

    from engine import LLMEngine, SamplingParams
    from labkit.assets.resolve import resolve_model

    model = str(resolve_model(args.model, "cuda").path)
    engine = LLMEngine(model, device="cuda", attention_backend=args.attention, enforce_eager=not args.graph,
                       max_num_seqs=1, max_model_len=2048, overlap=False)
    sp = SamplingParams(temperature=0, max_tokens=4 * args.steps + 8, ignore_eos=True)
    engine.add_request(list(range(1000, 1128)), sp)
    for _ in range(6):                          # the prefill, then warm decode steps (Triton compiles, autotune)
        engine.step()
    torch.cuda.synchronize()

    def timed(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            engine.step()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e3

    print(f"model {model}; {engine.describe()['attention_backend']}; graphs {'on' if args.graph else 'off'}")
    print(f"plain: {timed(args.steps):.3f} ms per decode step (batch 1)")
    prof = cProfile.Profile()
    prof.enable()
    ms = timed(args.steps)
    prof.disable()
    print(f"under cProfile: {ms:.3f} ms per step")
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(args.top)
        print(f"--- top {args.top} by {key} (per {args.steps} steps)")
        print("\n".join(line[:200] for line in buf.getvalue().splitlines() if line.strip())[:12000])
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        timed(4)
    events = [e for e in p.key_averages() if e.device_type.name == "CUDA" or getattr(e, "device_time_total", 0) > 0]
    launches = sum(e.count for e in p.key_averages() if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                                    "cudaLaunchKernelExC"))
    print(f"kernel launches per step (torch profiler, 4 steps): {launches / 4:.0f}; device kinds seen {len(events)}")
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)[:8000])
    engine.close()


if __name__ == "__main__":
    main()
