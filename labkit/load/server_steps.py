"""Where a served step's time goes, from the server's step records (serve/core/records.py: one "step" event per
engine step, with its host span and, on CUDA, its GPU span from engine/device_clock.py).

A decode's TPOT is the interval between the steps that carry it. Per window (a rate of a sweep) this splits that
interval into the decode steps' own time and the steps of other kinds between them (prefills and mixed steps, which
stall the decodes in nano-vllm's step model), and says whether the GPU waited for the host (its busy fraction, and
its idle time before each step). ``labkit load --request-rates`` adds :func:`summarize` of each rate's steps to the
rate's facts (``server_steps``); ``python tools/served_steps.py SERVER_LOG`` prints the detailed table.
"""
from __future__ import annotations

import collections
from pathlib import Path

from labkit.evidence import read_jsonl
from labkit.load.report import percentile

BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 512)


def bucket(n: int) -> int:
    """The smallest bucket bound at or above n (the last bound for anything larger)."""
    return next((b for b in BUCKETS if n <= b), BUCKETS[-1])


def read_steps(path: Path) -> list[dict]:
    """The step records of an event log (a server's, or a sweep rate's where the server wrote into it), by start;
    a missing log, or a line that is not JSON, is one UserError line."""
    steps = [rec for _, rec in read_jsonl(path, missing="server event log not found", contains=('"step"',))
             if rec.get("event") == "step" and "start_ns" in rec]
    steps.sort(key=lambda s: s["start_ns"])
    return steps


def request_span(events: Path) -> tuple[int, int] | None:
    """[first submission, last end] of a rate's measured requests (not its warm-up ones) as the engine saw them
    (its "submitted" and "finished" events in the rate's event log), or None without engine events."""
    submitted: dict[str, int] = {}
    finished: dict[str, int] = {}
    for _, rec in read_jsonl(events, missing="rate event log not found", contains=('"submitted"', '"finished"')):
        if rec.get("observer") != "engine" or "t_ns" not in rec:
            continue
        if rec.get("event") == "submitted" and not rec.get("warmup"):
            submitted[rec.get("request_id")] = rec["t_ns"]
        elif rec.get("event") == "finished":
            finished[rec.get("request_id")] = rec["t_ns"]
    ends = [finished[r] for r in submitted if r in finished]
    return (min(submitted.values()), max(ends)) if submitted and ends else None


def inside(steps: list[dict], span: tuple[int, int]) -> list[dict]:
    return [s for s in steps if span[0] <= s["start_ns"] and s["t_ns"] <= span[1]]


def idle_windows(steps: list[dict], idle_s: float) -> list[list[dict]]:
    """Runs of steps separated by at least idle_s of no step."""
    out: list[list[dict]] = []
    for s in steps:
        if out and s["start_ns"] - out[-1][-1]["t_ns"] < idle_s * 1e9:
            out[-1].append(s)
        else:
            out.append([s])
    return out


def p50(values: list[float]) -> float | None:
    """The median by the load report's estimator (labkit.load.report.percentile), or None without values."""
    return round(percentile(values, 50), 3) if values else None


def gpu_busy_ns(spans: list[tuple[int, int]], start_ns: int, end_ns: int) -> int:
    """Nanoseconds of [start_ns, end_ns] the GPU spent in at least one of the steps' device spans (start, end),
    overlaps counted once."""
    busy, reach = 0, start_ns
    for a, b in sorted(spans):
        a, b = max(a, reach), min(b, end_ns)
        if b > a:
            busy += b - a
            reach = b
    return busy


def summarize(window: list[dict]) -> dict:
    """One window's steps: span, counts by kind, the GPU's busy fraction (None without GPU spans), the decode steps'
    batch and times (interval: from the previous step's end to this one's, the TPOT a decode in it sees), the share
    of the window in steps of other kinds, and per (kind, batch bucket) the p50s and the share of its steps launched
    behind a step in flight (``ahead``: the overlapped lookahead; None in a log whose records do not say)."""
    if not window:
        return {"steps": 0}
    span_ns = window[-1]["t_ns"] - window[0]["start_ns"]
    gpu = [(s["gpu_start_ns"], s["gpu_end_ns"]) for s in window if "gpu_start_ns" in s]
    busy = gpu_busy_ns(gpu, window[0]["start_ns"], window[-1]["t_ns"])
    rows: dict[tuple[str, int], dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    decode: dict[str, list[float]] = collections.defaultdict(list)
    other_ns = 0
    for prev, s in zip([None] + window[:-1], window):
        r = rows[(s["phase"], bucket(s["num_seqs"]))]
        host_ms = (s["t_ns"] - s["start_ns"]) / 1e6
        interval = None if prev is None else (s["t_ns"] - prev["t_ns"]) / 1e6
        gpu_ms = (s["gpu_end_ns"] - s["gpu_start_ns"]) / 1e6 if "gpu_start_ns" in s else None
        r["host_ms"].append(host_ms)
        r["tokens"].append(s["num_tokens"])
        if "ahead" in s:
            r["ahead"].append(1.0 if s["ahead"] else 0.0)
        for key, v in (("interval_ms", interval), ("gpu_ms", gpu_ms)):
            if v is not None:
                r[key].append(v)
        if prev is not None and "gpu_start_ns" in s and "gpu_end_ns" in prev:
            r["gpu_idle_ms"].append(max(0, s["gpu_start_ns"] - prev["gpu_end_ns"]) / 1e6)
        if s["phase"] == "decode":
            decode["batch"].append(s["num_seqs"])
            for key, v in (("interval_ms", interval), ("gpu_ms", gpu_ms)):
                if v is not None:
                    decode[key].append(v)
        else:
            other_ns += s["t_ns"] - s["start_ns"]
    return {
        "span_s": round(span_ns / 1e9, 4), "steps": len(window),
        "kinds": dict(collections.Counter(s["phase"] for s in window)),
        "gpu_busy_fraction": round(busy / span_ns, 4) if gpu and span_ns > 0 else None,
        "decode": {"steps": len(decode["batch"]), **{k + "_p50": p50(decode[k])
                                                     for k in ("batch", "interval_ms", "gpu_ms")}},
        # the prefill and mixed steps' own spans (launch to ids in hand), over the window
        "other_kinds_share": round(other_ns / span_ns, 4) if span_ns > 0 else None,
        "by_kind_and_batch": [
            {"kind": kind, "batch_le": b, "steps": len(r["host_ms"]), "tokens_p50": p50(r["tokens"]),
             **{k + "_p50": p50(r[k]) for k in ("interval_ms", "host_ms", "gpu_ms", "gpu_idle_ms")},
             "ahead_share": round(sum(r["ahead"]) / len(r["ahead"]), 3) if r["ahead"] else None}
            for (kind, b), r in sorted(rows.items())],
    }


def per_rate(rows: list[dict], server_log: Path | None) -> None:
    """Each sweep rate's ``server_steps``: its steps from the server's log (a ``--serve-process`` server's), or from
    the rate's own event log (an in-process server writes its records there); nothing where neither holds any
    (another server's endpoints)."""
    shared = read_steps(server_log) if server_log is not None and server_log.is_file() else None
    for row in rows:
        events = Path(row["events"])
        span = request_span(events)
        if span is None:
            continue
        steps = inside(shared if shared is not None else read_steps(events), span)
        if steps:
            row["server_steps"] = summarize(steps)
