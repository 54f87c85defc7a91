"""Where a served step's time goes, from a `labkit serve` event log's step records: per load window (a rate of a
sweep), per step kind and batch size, the host's view of a step (launch to ids in hand), the interval between
consecutive steps, and on CUDA the step's GPU span and the GPU's idle gap before it (engine/device_clock.py).

A decode's TPOT is the interval between the steps that carry it; this splits that interval into GPU work, GPU idle
(the engine waited for the host) and the steps of other kinds in between (prefills that stall the decodes).

    python tools/served_steps.py SERVER_LOG.jsonl [--rate-logs NAME-rate*.jsonl] [--idle-s 1.0] [--json OUT]

With --rate-logs (a sweep's per-rate event logs) each window is a rate: from its first request's submission to its
last one's end, as the engine saw them; without, the log's runs of steps separated by at least --idle-s of no step.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 512)


def bucket(n: int) -> int:
    """The smallest bucket bound at or above n (the last bound for anything larger)."""
    return next((b for b in BUCKETS if n <= b), BUCKETS[-1])


def read_steps(path: Path) -> list[dict]:
    steps = []
    with open(path) as f:
        for line in f:
            if '"event":"step"' not in line.replace(" ", ""):
                continue
            rec = json.loads(line)
            if rec.get("event") == "step" and "start_ns" in rec:
                steps.append(rec)
    steps.sort(key=lambda s: s["start_ns"])
    return steps


def windows(steps: list[dict], idle_s: float) -> list[list[dict]]:
    out: list[list[dict]] = []
    for s in steps:
        if out and s["start_ns"] - out[-1][-1]["t_ns"] < idle_s * 1e9:
            out[-1].append(s)
        else:
            out.append([s])
    return out


def rate_windows(steps: list[dict], rate_logs: list[Path]) -> list[tuple[str, list[dict]]]:
    """(rate log's name, the steps inside its requests' span) per per-rate event log."""
    out = []
    for path in rate_logs:
        lo = hi = None
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                if rec.get("observer") == "engine" and rec.get("event") in ("submitted", "finished"):
                    t = rec["t_ns"]
                    lo, hi = (t if lo is None else min(lo, t)), (t if hi is None else max(hi, t))
        if lo is not None:
            out.append((path.stem, [s for s in steps if lo <= s["start_ns"] and s["t_ns"] <= hi]))
    return [(name, w) for name, w in out if w]


def p50(values: list[float]) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return round(v[len(v) // 2], 3)


def summarize(window: list[dict]) -> dict:
    """One window: its span, step counts by kind, the GPU's busy share, and per (kind, batch bucket) the p50s."""
    span_ns = window[-1]["t_ns"] - window[0]["start_ns"]
    gpu = [s for s in window if "gpu_start_ns" in s]
    busy = sum(s["gpu_end_ns"] - s["gpu_start_ns"] for s in gpu)
    rows: dict[tuple[str, int], dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for prev, s in zip([None] + window[:-1], window):
        r = rows[(s["phase"], bucket(s["num_seqs"]))]
        r["host_ms"].append((s["t_ns"] - s["start_ns"]) / 1e6)
        r["tokens"].append(s["num_tokens"])
        if prev is not None:
            r["interval_ms"].append((s["t_ns"] - prev["t_ns"]) / 1e6)
        if "gpu_start_ns" in s:
            r["gpu_ms"].append((s["gpu_end_ns"] - s["gpu_start_ns"]) / 1e6)
            if prev is not None and "gpu_end_ns" in prev:
                r["gpu_idle_ms"].append(max(0, s["gpu_start_ns"] - prev["gpu_end_ns"]) / 1e6)
    kinds = collections.Counter(s["phase"] for s in window)
    return {
        "span_s": round(span_ns / 1e9, 3), "steps": len(window), "kinds": dict(kinds),
        "gpu_busy_fraction": round(busy / span_ns, 4) if gpu and span_ns > 0 else None,
        "by_kind_and_batch": [
            {"kind": kind, "batch_le": b, "steps": len(r["host_ms"]), "tokens_p50": p50(r["tokens"]),
             **{k + "_p50": p50(r[k]) for k in ("interval_ms", "host_ms", "gpu_ms", "gpu_idle_ms")}}
            for (kind, b), r in sorted(rows.items())],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--rate-logs", type=Path, nargs="*", default=[])
    ap.add_argument("--idle-s", type=float, default=1.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not args.log.is_file():
        print(f"error: {args.log} is not a file", file=sys.stderr)
        return 2
    steps = read_steps(args.log)
    if not steps:
        print(f"error: {args.log} holds no step records", file=sys.stderr)
        return 2
    named = (rate_windows(steps, args.rate_logs) if args.rate_logs
             else [(f"window {i}", w) for i, w in enumerate(windows(steps, args.idle_s))])
    result = [{"window": name, **summarize(w)} for name, w in named]
    for w in result:
        print(f"{w['window']}: {w['span_s']} s, {w['steps']} steps {w['kinds']}, GPU busy {w['gpu_busy_fraction']}")
        print(f"  {'kind':8} {'batch<=':>7} {'steps':>6} {'tok':>6} {'interval':>9} {'host':>7} {'gpu':>7} {'gpu idle':>9}")
        for r in w["by_kind_and_batch"]:
            f = lambda v: "-" if v is None else f"{v:.3f}"     # noqa: E731
            print(f"  {r['kind']:8} {r['batch_le']:>7} {r['steps']:>6} {f(r['tokens_p50']):>6} "
                  f"{f(r['interval_ms_p50']):>9} {f(r['host_ms_p50']):>7} {f(r['gpu_ms_p50']):>7} "
                  f"{f(r['gpu_idle_ms_p50']):>9}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
