"""Percentiles (the load report's estimator), and what the GPU did from the steps' device spans
(engine/device_clock.py): shared by the serve and latency workloads."""
from __future__ import annotations

from labkit.load.report import percentile
from labkit.load.server_steps import gpu_busy_ns


def percentiles(values: list[float]) -> dict:
    """n, p50, p90, p99 and max of ``values`` (:func:`labkit.load.report.percentile`: the load report's estimator)."""
    if not values:
        return {"n": 0, "p50": None, "p90": None, "p99": None, "max": None}
    return {"n": len(values), **{f"p{q}": round(percentile(values, q), 4) for q in (50, 90, 99)},
            "max": round(max(values), 4)}


def device_stats(spans: list[tuple[int, int, int]], start_ns: int | None, end_ns: int | None, wide: int) -> dict:
    """What the GPU did, from the steps' device spans (engine/device_clock.py): (start_ns, end_ns, num_seqs)
    in step order. Its busy fraction of [start_ns, end_ns] (None: from the first step's start to the last
    one's end), and at batch >= wide its step times and the gaps between consecutive steps: time it had
    nothing of the engine's to run, i.e. the engine waited for the host. Without spans (CPU) the same
    fields, unmeasured (None / n 0)."""
    if not spans:
        return {"gpu_busy_fraction": None, "wide_gpu_step_ms": percentiles([]), "wide_gpu_gap_ms": percentiles([])}
    start_ns = spans[0][0] if start_ns is None else start_ns
    end_ns = spans[-1][1] if end_ns is None else end_ns
    inside = [s for s in spans if s[1] > start_ns and s[0] < end_ns]
    busy = gpu_busy_ns([(a, b) for a, b, _ in inside], start_ns, end_ns)
    wide_pairs = [(x, y) for x, y in zip(inside, inside[1:]) if x[2] >= wide and y[2] >= wide]
    span = end_ns - start_ns
    return {"gpu_busy_fraction": round(busy / span, 4) if span > 0 else None,
            "wide_gpu_step_ms": percentiles([(b - a) / 1e6 for a, b, n in inside if n >= wide]),
            "wide_gpu_gap_ms": percentiles([max(0, y[0] - x[1]) / 1e6 for x, y in wide_pairs])}
