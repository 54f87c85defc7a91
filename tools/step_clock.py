"""Both step models on a multi-turn workload, offline, on the engine's own step clock: where a step model's time
goes when requests arrive while others decode.

One engine per step model (``--mixed-batches`` and nano-vllm's step model), the same requests: ``--sessions``
conversations of ``--turns`` turns; turn 0 of session i arrives at step ``i * --every``, each later turn at the
step its previous turn finished, its prompt the previous prompt, the previous answer and ``--suffix`` new tokens
(the multi-turn workload's shape, with a cached prefix to hit). Per step model it prints the engine's start-up
(warm-up and graph capture seconds, graphs captured per set), the steps taken, steps
from arrival to first token (p50 / p90 / max), step kinds, routes (decode graph, prefill graphs, mixed graphs,
piecewise, eager), the wall time per step of each route (median, p90, max, total) and on CUDA its GPU span, the Triton
kernels compiled after start-up and the slowest steps; on CUDA the engine runs with graphs and the overlapped
decode, as `labkit serve` does.

    python tools/step_clock.py --model DIR [--device cuda] [--sessions 32] [--turns 4] [--every 10] [--json]
                               [--profile FIRST STEPS]
"""
from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import time

from labkit.load.report import percentile


def run(model: str, device: str, mixed: bool, cache: bool, sessions: int, turns: int, every: int, prefix: int,
        suffix: int, output: int, seed: int, profile: tuple[int, int] | None = None) -> dict:
    """profile (first step, steps): torch's profiler over those steps; its tables go in the result's "profile"."""
    from engine import LLMEngine, SamplingParams

    cuda = device.startswith("cuda")
    engine = LLMEngine(model, device=device, max_num_seqs=256, max_num_batched_tokens=16384, max_model_len=2048,
                       mixed_batches=mixed, enable_prefix_caching=cache, enforce_eager=not cuda, overlap=cuda)
    described = engine.describe()
    graph = described["graph"]
    startup = {"init_s": described["init_seconds"], "warmup_s": described["warmup"]["seconds"],
               "capture_s": graph["capture_seconds"],
               "graphs": {"decode": len(graph["buckets"]), "prefill": len(graph["prefill_buckets"]),
                          "paged_prefill": len(graph["prefill_buckets"]) if graph["paged_prefill"] else 0,
                          "mixed": len(graph["mixed_buckets"]), "piecewise": len(graph["piecewise_buckets"])}}
    vocab = engine.config.shape.vocab_size
    rng = random.Random(seed)
    shared = [[rng.randrange(1000, vocab) for _ in range(prefix)] for _ in range(4)]
    pending = [(i * every, i, 0, shared[i % 4] + [rng.randrange(1000, vocab) for _ in range(suffix)])
               for i in range(sessions)]
    sp = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
    live: dict[int, tuple] = {}
    first: dict[int, int] = {}
    kinds = collections.Counter()
    route_ms: dict[str, list[float]] = collections.defaultdict(list)
    steps: list[dict] = []                  # every step: wall ms, GPU ms, route, kind, tokens, rows
    prof = None
    step = 0
    while pending or not engine.is_finished():
        for item in sorted(p for p in pending if p[0] <= step):
            pending.remove(item)
            seq = engine.add_request(item[3], sp)
            live[seq.seq_id] = (item[1], item[2], item[3], step, seq)
        if engine.is_finished():
            step += 1
            continue
        if profile is not None and step == profile[0]:
            prof = _profiler(cuda)
            prof.__enter__()
        t0 = time.perf_counter()
        out = engine.step()
        ms = (time.perf_counter() - t0) * 1e3
        if prof is not None and step == profile[0] + profile[1] - 1:
            prof.__exit__(None, None, None)
        step += 1
        kinds[out.kind] += 1
        route_ms[out.route.kind].append(ms)
        span = out.device_span
        steps.append({"step": step - 1, "ms": round(ms, 3), "gpu_ms": None if span is None else round((span[1] - span[0]) / 1e6, 3),
                      "route": str(out.route), "kind": out.kind, "tokens": out.num_tokens, "rows": len(out.seqs)})
        for sid, (s, t, prompt, arrived, seq) in list(live.items()):
            if sid not in first and seq.num_completion_tokens > 0:
                first[sid] = step - arrived
            if seq.is_finished:
                del live[sid]
                if t + 1 < turns:
                    nxt = prompt + list(seq.completion_token_ids) + [rng.randrange(1000, vocab) for _ in range(suffix)]
                    pending.append((step, s, t + 1, nxt))
    watch = engine.runner.late_compiles
    late = list(watch.names) if watch is not None else None
    engine.close()
    if prof is not None and step < profile[0] + profile[1]:
        prof.__exit__(None, None, None)
    waits = sorted(first.values())
    return {"step_model": "mixed" if mixed else "nano-vllm", "prefix_cache": cache, "startup": startup, "steps": step,
            "requests": len(waits),
            "first_token_steps": {"p50": waits[len(waits) // 2], "p90": waits[int(len(waits) * 0.9)], "max": waits[-1]},
            "kinds": dict(kinds), "routes": {k: len(v) for k, v in route_ms.items()},
            "route_ms": {k: {"median": round(statistics.median(v), 3), "p90": round(percentile(v, 90), 3),
                             "max": round(max(v), 3), "total": round(sum(v), 1)} for k, v in route_ms.items()},
            "route_gpu_ms": _gpu_by_route(steps),
            "compiled_after_start": late,
            "slowest": sorted(steps, key=lambda s: -s["ms"])[:8],
            "profile": None if prof is None else _tables(prof, cuda)}


def _gpu_by_route(steps: list[dict]) -> dict:
    """Per route, the steps' spans on the GPU (CUDA: from the step's first kernel to its sampled ids), median and
    p90: with the overlapped decode a step's wall time holds the wait for the step before it, its GPU span not."""
    spans: dict[str, list[float]] = collections.defaultdict(list)
    for s in steps:
        if s["gpu_ms"] is not None:
            spans[s["route"].split(":")[0]].append(s["gpu_ms"])
    return {k: {"median": round(statistics.median(v), 3), "p90": round(percentile(v, 90), 3)} for k, v in spans.items()}


def _profiler(cuda: bool):
    from torch.profiler import ProfilerActivity, profile
    return profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))


def _tables(prof, cuda: bool) -> dict:
    """The profiled steps' top operators by host time and (CUDA) by device time."""
    avg = prof.key_averages()
    out = {"by_cpu": avg.table(sort_by="self_cpu_time_total", row_limit=25)}
    if cuda:
        out["by_cuda"] = avg.table(sort_by="self_cuda_time_total", row_limit=25)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--every", type=int, default=10, help="steps between two sessions' first turns")
    ap.add_argument("--prefix", type=int, default=256, help="tokens of the prefix four sessions share")
    ap.add_argument("--suffix", type=int, default=32, help="new tokens of each turn")
    ap.add_argument("--output", type=int, default=128, help="answer tokens of each turn")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--profile", type=int, nargs=2, metavar=("FIRST", "STEPS"),
                    help="torch's profiler over STEPS steps from step FIRST (each step model); its tables are printed")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = [run(a.model, a.device, mixed, not a.no_prefix_caching, a.sessions, a.turns, a.every, a.prefix,
                a.suffix, a.output, a.seed, tuple(a.profile) if a.profile else None) for mixed in (True, False)]
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    for r in rows:
        f = r["first_token_steps"]
        print(f"{r['step_model']:9s} prefix cache {'on' if r['prefix_cache'] else 'off'}: {r['steps']} steps, "
              f"{r['requests']} requests, first token after {f['p50']} / {f['p90']} / {f['max']} steps (p50/p90/max)")
        st = r["startup"]
        print(f"          start-up {st['init_s']} s (warm-up {st['warmup_s']} s, graph capture {st['capture_s']} s); "
              "graph buckets captured: " + ", ".join(f"{k} {v}" for k, v in st["graphs"].items()))
        print(f"          kinds {r['kinds']}; routes {r['routes']}")
        print("          ms per step by route (median / p90 / max, total): " + ", ".join(
            f"{k} {v['median']} / {v['p90']} / {v['max']} ({v['total']})" for k, v in r["route_ms"].items()))
        if r["route_gpu_ms"]:
            print("          GPU ms per step by route (median / p90): " + ", ".join(
                f"{k} {v['median']} / {v['p90']}" for k, v in r["route_gpu_ms"].items()))
        if r["compiled_after_start"] is not None:
            print(f"          Triton kernels compiled after start-up: {len(r['compiled_after_start'])} "
                  f"{sorted(set(r['compiled_after_start']))}")
        print("          slowest steps: " + "; ".join(
            f"#{s['step']} {s['ms']} ms (GPU {s['gpu_ms']}) {s['route']} {s['kind']} {s['tokens']} tok {s['rows']} rows"
            for s in r["slowest"][:5]))
        for name, table in (r["profile"] or {}).items():
            print(f"--- profile, {r['step_model']}, {name}\n{table}")


if __name__ == "__main__":
    main()
