"""``labkit report``: latency and throughput from service event logs (JSONL), compared side by side.

Definitions (handbook B.8.3), always within one observer and one clock:

- TTFT = t(first token) - t(submitted) of a request.
- ITL = the gaps between consecutive output tokens of a request (pooled over requests).
- TPOT = (t_last - t_first) / (G - 1) per request with G >= 2 output tokens.
- Queue wait = t(admitted) - t(submitted): the entry wait before the engine takes the request (the
  rest of TTFT, admitted -> first token, is the engine's prefill interval).
- Throughput = output tokens of all measured requests, across every replica, divided by the common
  window: from the first submit to the last finish of those requests (never a sum of per-replica
  best rates).

``observer=engine`` events are recorded by the owner thread (tokens at the end of the step that
produced them); ``observer=client`` events where the stream was read. Both may describe the same
token; they are reported side by side, never mixed. Warmup requests (``warmup: true`` on their
submitted event) are left out of every number. Percentiles are p50/p90/p99 with linear
interpolation. Requests are split by ``class`` (short/long in the shipped traces).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labkit.errors import UserError
from labkit.evidence import read_jsonl

PERCENTILES = (50, 90, 99)
MECHANISM_KINDS = ("simulated", "profile", "cpu-real-scheduler", "static")
COMPLETED = ("stop", "length")


# --------------------------------------------------------------------------- reading


@dataclass
class Log:
    path: Path
    header: dict | None
    events: list[dict]


def read_log(path: str | Path) -> Log:
    path = Path(path)
    header, events = None, []
    for _, rec in read_jsonl(path, missing="no such log"):
        if rec.get("event") == "header":
            header = header or rec
        elif "event" in rec:
            events.append(rec)
    if header is None and not events:
        raise UserError(f"{path}: no events (is it a labkit service log?)")
    return Log(path, header, events)


@dataclass
class Req:
    request_id: str
    observer: str
    worker_id: str | None = None
    cls: str = "all"
    warmup: bool = False
    submitted_ns: int | None = None
    token_ns: list[int] = field(default_factory=list)
    finished_ns: int | None = None
    reason: str | None = None
    cause: str | None = None
    completion_tokens: int | None = None
    admitted: bool = False
    admitted_ns: int | None = None
    status: int | None = None             # the HTTP status of a refused request (429, 503, ...)
    message: str | None = None

    @property
    def output_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else len(self.token_ns)


def requests_by_observer(events: list[dict]) -> dict[str, dict[str, Req]]:
    """Per observer, per request id: the request's timeline."""
    out: dict[str, dict[str, Req]] = {}
    for ev in events:
        name, rid, obs = ev.get("event"), ev.get("request_id"), ev.get("observer", "engine")
        if rid is None or name not in ("submitted", "admitted", "token", "finished"):
            continue
        reqs = out.setdefault(obs, {})
        r = reqs.get(rid)
        if r is None:
            r = reqs[rid] = Req(rid, obs)
        t = ev.get("t_ns")
        if ev.get("worker_id"):
            r.worker_id = ev["worker_id"]
        if name == "submitted":
            r.submitted_ns = t
            r.cls = str(ev.get("class", r.cls))
            r.warmup = bool(ev.get("warmup", False))
        elif name == "admitted":
            r.admitted = True
            if r.admitted_ns is None:
                r.admitted_ns = t
        elif name == "token":
            r.token_ns.append(t)
        elif name == "finished":
            r.finished_ns = t
            r.reason = ev.get("reason")
            r.cause = ev.get("cause")
            r.status = ev.get("status") if isinstance(ev.get("status"), int) else None
            r.message = ev.get("message")
            if isinstance(ev.get("num_completion_tokens"), int):
                r.completion_tokens = ev["num_completion_tokens"]
    return out


# --------------------------------------------------------------------------- numbers


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation between the closest ranks: numpy's default and
    vLLM's (``vllm bench serve`` reports ``np.percentile``). The one estimator of every lab report and bench."""
    import numpy

    if not len(values):
        raise ValueError("no values")
    return float(numpy.percentile(values, q))


def dist(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    out: dict[str, Any] = {"n": len(values), "mean": round(sum(values) / len(values), 3)}
    for q in PERCENTILES:
        out[f"p{q}"] = round(percentile(values, q), 3)
    out["min"], out["max"] = round(min(values), 3), round(max(values), 3)
    return out


def ttft_ms(r: Req) -> float | None:
    if r.submitted_ns is None or not r.token_ns:
        return None
    return (r.token_ns[0] - r.submitted_ns) / 1e6


def queue_wait_ms(r: Req) -> float | None:
    """Submitted -> admitted (the entry wait), or None when either event is missing."""
    if r.submitted_ns is None or r.admitted_ns is None:
        return None
    return (r.admitted_ns - r.submitted_ns) / 1e6


def admitted_to_first_ms(r: Req) -> float | None:
    """Admitted -> first token (the engine's interval before the first output)."""
    if r.admitted_ns is None or not r.token_ns:
        return None
    return (r.token_ns[0] - r.admitted_ns) / 1e6


def itl_ms(r: Req) -> list[float]:
    return [(b - a) / 1e6 for a, b in zip(r.token_ns, r.token_ns[1:])]


def tpot_ms(r: Req) -> float | None:
    g = len(r.token_ns)
    if g < 2:
        return None
    return (r.token_ns[-1] - r.token_ns[0]) / 1e6 / (g - 1)


def latency(reqs: list[Req]) -> dict:
    return {
        "requests": len(reqs),
        "queue_wait_ms": dist([v for v in map(queue_wait_ms, reqs) if v is not None]),
        "admitted_to_first_token_ms": dist([v for v in map(admitted_to_first_ms, reqs) if v is not None]),
        "ttft_ms": dist([v for v in map(ttft_ms, reqs) if v is not None]),
        "itl_ms": dist([g for r in reqs for g in itl_ms(r)]),
        "tpot_ms": dist([v for v in map(tpot_ms, reqs) if v is not None]),
    }


def _span(r: Req) -> tuple[int, int] | None:
    start = r.submitted_ns if r.submitted_ns is not None else (r.token_ns[0] if r.token_ns else None)
    end = r.finished_ns if r.finished_ns is not None else (r.token_ns[-1] if r.token_ns else None)
    return (start, end) if start is not None and end is not None else None


def observer_summary(reqs: list[Req]) -> dict:
    measured = [r for r in reqs if not r.warmup]
    terminations = Counter(r.reason or "unfinished" for r in measured)
    causes = Counter(f"{r.reason}/{r.cause}" for r in measured if r.cause)
    spans = [s for s in map(_span, measured) if s is not None]
    out_tokens = sum(r.output_tokens for r in measured)
    summary: dict[str, Any] = {
        "requests": len(measured),
        "warmup_requests": len(reqs) - len(measured),
        "completed": sum(terminations.get(k, 0) for k in COMPLETED),
        "terminations": dict(sorted(terminations.items())),
        "causes": dict(sorted(causes.items())),
        "rejections": terminations.get("rejected", 0),
        "output_tokens": out_tokens,
        **{k: v for k, v in latency(measured).items() if k != "requests"},
    }
    if spans:
        start, end = min(s for s, _ in spans), max(e for _, e in spans)
        seconds = (end - start) / 1e9
        summary["window"] = {"start_ns": start, "end_ns": end, "seconds": round(seconds, 6)}
        summary["throughput_tok_s"] = round(out_tokens / seconds, 3) if seconds > 0 else None
        summary["throughput_req_s"] = round(summary["completed"] / seconds, 3) if seconds > 0 else None
    classes = sorted({r.cls for r in measured})
    summary["by_class"] = {c: latency([r for r in measured if r.cls == c]) for c in classes}
    summary["workers"] = _workers(measured)
    summary["per_request"] = [{"request_id": r.request_id, "class": r.cls, "queue_wait_ms": _ms(queue_wait_ms(r)),
                               "admitted_to_first_token_ms": _ms(admitted_to_first_ms(r)), "ttft_ms": _ms(ttft_ms(r))}
                              for r in sorted(measured, key=lambda r: (r.submitted_ns is None, r.submitted_ns or 0))]
    return summary


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def _workers(reqs: list[Req]) -> dict:
    out: dict[str, dict] = {}
    spans: dict[str, tuple[int, int]] = {}
    for r in reqs:
        w = r.worker_id or "?"
        d = out.setdefault(w, {"requests": 0, "output_tokens": 0})
        d["requests"] += 1
        d["output_tokens"] += r.output_tokens
        s = _span(r)
        if s is not None:
            lo, hi = spans.get(w, s)
            spans[w] = (min(lo, s[0]), max(hi, s[1]))
    for w, (lo, hi) in spans.items():
        out[w]["span_s"] = round((hi - lo) / 1e9, 6)
    if len(spans) > 1:
        lo = max(s for s, _ in spans.values())
        hi = min(e for _, e in spans.values())
        overlap = max(0.0, (hi - lo) / 1e9)
        for d in out.values():
            d["overlap_all_s"] = round(overlap, 6)
    return dict(sorted(out.items()))


def summarize(path: str | Path) -> dict:
    """One log: its evidence identity and, per observer, the numbers above."""
    log = read_log(path)
    return summarize_log(log)


def summarize_log(log: Log) -> dict:
    h = log.header or {}
    model = h.get("model") or {}
    by_obs = requests_by_observer(log.events)
    steps = [e for e in log.events if e.get("event") == "step"]
    engine = h.get("engine") or {}
    cfg = engine.get("config") if isinstance(engine, dict) else None
    return {
        "path": str(log.path),
        "kind": h.get("kind"),
        "role": h.get("role"),
        "mode": h.get("mode"),
        "device": h.get("device"),
        "model": {k: model.get(k) for k in ("path", "preset", "synthetic", "config_sha256")} if model else None,
        "engine": {k: (cfg or {}).get(k) for k in ("scheduling_policy", "mixed_batches", "max_num_batched_tokens",
                                                   "max_num_seqs", "max_model_len", "enforce_eager")} if cfg else None,
        "attention_backend": engine.get("attention_backend") if isinstance(engine, dict) else None,
        "steps": {p: sum(e.get("phase") == p for e in steps) for p in ("prefill", "decode", "mixed")},
        "observers": {obs: observer_summary(list(reqs.values())) for obs, reqs in sorted(by_obs.items())},
        "note": _note(h),
    }


def _note(h: dict) -> str | None:
    kind = h.get("kind")
    if kind in MECHANISM_KINDS:
        return f"{kind} evidence: explains a mechanism, not a performance number"
    if h.get("mode") == "round":
        return "round-mode replay: arrivals follow scheduler rounds, explains a mechanism, not a performance number"
    if kind is None:
        return "evidence kind unknown (the server did not report one)"
    return None


# --------------------------------------------------------------------------- comparing


def _primary_observer(summaries: list[dict]) -> str | None:
    for obs in ("client", "engine"):
        if all(obs in s["observers"] for s in summaries):
            return obs
    return None


def _get(d: dict, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


RATIO_METRICS = (("ttft_ms", "p50"), ("ttft_ms", "p99"), ("itl_ms", "p50"), ("itl_ms", "p99"),
                 ("tpot_ms", "p50"), ("throughput_tok_s", None))


def ratios(summaries: list[dict], observer: str) -> list[dict]:
    base = summaries[0]["observers"][observer]
    rows = []
    for s in summaries[1:]:
        cur = s["observers"][observer]
        row = {"input": s["path"], "vs": summaries[0]["path"]}
        for metric, q in RATIO_METRICS:
            a = base.get(metric) if q is None else _get(base, metric, q)
            b = cur.get(metric) if q is None else _get(cur, metric, q)
            key = metric if q is None else f"{metric}.{q}"
            row[key] = round(b / a, 4) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a else None
        rows.append(row)
    return rows


def compare(inputs: list[str | Path], out: str | Path, plots: bool = True) -> dict:
    """Summarize every input, write ``out`` (JSON), the same name with .md, and PNG plots."""
    if not inputs:
        raise UserError("--inputs needs at least one JSONL log")
    out = Path(out)
    if out.suffix != ".json":
        raise UserError(f"--out must end in .json (the Markdown goes next to it), got {out}")
    logs = [read_log(p) for p in inputs]
    summaries = [summarize_log(log) for log in logs]
    out.parent.mkdir(parents=True, exist_ok=True)
    primary = _primary_observer(summaries)
    from labkit.evidence import utc_stamp, command_line, git_head

    result: dict[str, Any] = {
        "schema_version": 1, "created_at": utc_stamp(), "command": command_line(), "git_head": git_head(),
        "definitions": {"queue_wait": "admitted - submitted", "ttft": "first token - submitted", "itl": "gap between consecutive tokens",
                        "tpot": "(t_last - t_first) / (G - 1)", "throughput": "output tokens / common window",
                        "percentiles": list(PERCENTILES)},
        "inputs": summaries, "primary_observer": primary,
        "ratios": ratios(summaries, primary) if primary and len(summaries) > 1 else [],
    }
    md_path = out.with_suffix(".md")
    result["markdown"] = str(md_path)
    result["plots"], result["plots_note"] = (_plots(logs, summaries, out) if plots else ([], "plots not asked for"))
    from labkit.evidence import write_json

    write_json(out, result)
    md_path.write_text(render_md(result), encoding="utf-8")
    return result


# --------------------------------------------------------------------------- markdown


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:.1f}"
    return str(v)


def _pcts(d: dict | None) -> str:
    if not d or not d.get("n"):
        return "–"
    return " / ".join(_fmt(d.get(f"p{q}")) for q in PERCENTILES)


def render_md(result: dict) -> str:
    lines = ["# Service report", "", f"- created: {result['created_at']}", f"- command: `{result['command']}`",
             "- queue wait = admitted − submitted; TTFT = first token − submitted; ITL = gaps between tokens; TPOT = (t_last − t_first)/(G − 1); "
             "throughput = output tokens / common window (first submit → last finish, all replicas). "
             "Latencies in ms as p50 / p90 / p99; warmup requests excluded.", ""]
    lines += ["## Inputs", "", "| # | input | kind | role | mode | model | policy | note |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for i, s in enumerate(result["inputs"]):
        model = s.get("model") or {}
        mtext = (model.get("preset") or model.get("path") or "–") + (" (synthetic)" if model.get("synthetic") else "")
        lines.append(f"| {i} | `{s['path']}` | {s.get('kind') or 'unknown'} | {s.get('role') or '–'} | "
                     f"{s.get('mode') or '–'} | {mtext} | {_get(s, 'engine', 'scheduling_policy') or '–'} | "
                     f"{s.get('note') or ''} |")
    lines += ["", "## Summary", "",
              "| # | observer | requests | completed | rejected | output tokens | queue wait ms | TTFT ms | ITL ms | "
              "TPOT ms | throughput tok/s | window s |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for i, s in enumerate(result["inputs"]):
        for obs, o in s["observers"].items():
            lines.append(f"| {i} | {obs} | {o['requests']} | {o['completed']} | {o['rejections']} | "
                         f"{o['output_tokens']} | {_pcts(o.get('queue_wait_ms'))} | {_pcts(o['ttft_ms'])} | "
                         f"{_pcts(o['itl_ms'])} | "
                         f"{_pcts(o['tpot_ms'])} | {_fmt(o.get('throughput_tok_s'))} | "
                         f"{_fmt(_get(o, 'window', 'seconds'))} |")
    if result.get("ratios"):
        keys = [k for k in result["ratios"][0] if k not in ("input", "vs")]
        lines += ["", f"## Ratios vs input 0 (observer {result['primary_observer']})", "",
                  "| input | " + " | ".join(keys) + " |", "| --- | " + " | ".join("---" for _ in keys) + " |"]
        for row in result["ratios"]:
            lines.append(f"| `{row['input']}` | " + " | ".join(_fmt(row[k]) for k in keys) + " |")
    lines += ["", "## By request class", "",
              "| # | observer | class | requests | queue wait ms | admitted → first token ms | TTFT ms | ITL ms | TPOT ms |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for i, s in enumerate(result["inputs"]):
        for obs, o in s["observers"].items():
            for cls, c in o["by_class"].items():
                lines.append(f"| {i} | {obs} | {cls} | {c['requests']} | {_pcts(c.get('queue_wait_ms'))} | "
                             f"{_pcts(c.get('admitted_to_first_token_ms'))} | {_pcts(c['ttft_ms'])} | "
                             f"{_pcts(c['itl_ms'])} | {_pcts(c['tpot_ms'])} |")
    lines += _queue_wait_lines(result)
    lines += ["", "## Terminations", "", "| # | observer | by reason | cancel causes |", "| --- | --- | --- | --- |"]
    for i, s in enumerate(result["inputs"]):
        for obs, o in s["observers"].items():
            reasons = ", ".join(f"{k} {v}" for k, v in o["terminations"].items()) or "–"
            causes = ", ".join(f"{k} {v}" for k, v in o["causes"].items()) or "–"
            lines.append(f"| {i} | {obs} | {reasons} | {causes} |")
    lines += ["", "## Workers", "", "| # | observer | worker | requests | output tokens | span s | overlap of all s |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for i, s in enumerate(result["inputs"]):
        for obs, o in s["observers"].items():
            for w, d in o["workers"].items():
                lines.append(f"| {i} | {obs} | {w} | {d['requests']} | {d['output_tokens']} | "
                             f"{_fmt(d.get('span_s'))} | {_fmt(d.get('overlap_all_s'))} |")
    lines += ["", "## Plots", ""]
    if result["plots"]:
        lines += [f"![{Path(p).stem}]({Path(p).name})" for p in result["plots"]]
    lines.append(result.get("plots_note") or "")
    return "\n".join(lines) + "\n"


#: Rows of the per-request queue-wait table in the Markdown (the longest waits); the JSON keeps every request.
QUEUE_WAIT_ROWS = 10


def _queue_wait_lines(result: dict) -> list[str]:
    lines = ["", f"## Queue wait per request (the {QUEUE_WAIT_ROWS} longest per observer; every request in the JSON)", "",
             "| # | observer | request | class | queue wait ms | admitted → first token ms | TTFT ms |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for i, s in enumerate(result["inputs"]):
        for obs, o in s["observers"].items():
            rows = [r for r in o.get("per_request", []) if r["queue_wait_ms"] is not None]
            for r in sorted(rows, key=lambda r: -r["queue_wait_ms"])[:QUEUE_WAIT_ROWS]:
                lines.append(f"| {i} | {obs} | `{r['request_id']}` | {r['class']} | {_fmt(r['queue_wait_ms'])} | "
                             f"{_fmt(r['admitted_to_first_token_ms'])} | {_fmt(r['ttft_ms'])} |")
    return lines


# --------------------------------------------------------------------------- plots


#: The timeline: one labelled row per request up to this many; beyond, the rows become a density.
TIMELINE_LABELLED_ROWS = 64
TIMELINE_MIN_IN, TIMELINE_MAX_IN, TIMELINE_MAX_TOTAL_IN = 1.2, 6.0, 24.0     # inches (x 110 dpi)


def timeline_rows_height(n: int) -> float:
    """Inches of one run's timeline panel: 0.28 in a labelled row, capped (and the figure in total)."""
    return min(TIMELINE_MAX_IN, max(TIMELINE_MIN_IN, 0.6 + 0.28 * min(n, TIMELINE_LABELLED_ROWS)))


def run_labels(paths: list[Path]) -> list[str]:
    """Short names that tell the inputs apart: the file stem, plus as many parent folders as it takes."""
    parts = [Path(p).with_suffix("").parts for p in paths]
    for depth in range(1, max((len(p) for p in parts), default=1) + 1):
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return [str(p) for p in paths]


def _plots(logs: list[Log], summaries: list[dict], out: Path) -> tuple[list[str], str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "matplotlib is not importable here: no PNG plots were drawn (pip install matplotlib)."
    stem = out.with_suffix("")
    paths = []
    series = []
    names = run_labels([log.path for log in logs])
    for i, log in enumerate(logs):
        for obs, reqs in requests_by_observer(log.events).items():
            measured = [r for r in reqs.values() if not r.warmup]
            series.append((f"{i}:{names[i]} ({obs})", measured))
    for metric, fn, title in (("ttft", lambda rs: [v for v in map(ttft_ms, rs) if v is not None], "TTFT"),
                              ("itl", lambda rs: [g for r in rs for g in itl_ms(r)], "ITL")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, rs in series:
            xs = sorted(fn(rs))
            if xs:
                ax.step(xs, [(k + 1) / len(xs) for k in range(len(xs))], where="post", label=label)
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("fraction of " + ("requests" if metric == "ttft" else "gaps"))
        ax.set_title(f"{title} CDF")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        path = Path(f"{stem}-{metric}-cdf.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(str(path))
    heights = [timeline_rows_height(len(rs)) for _, rs in series] or [TIMELINE_MIN_IN]
    scale = min(1.0, TIMELINE_MAX_TOTAL_IN / sum(heights))
    fig, axes = plt.subplots(len(series) or 1, 1, figsize=(8, 0.6 + scale * sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, (label, rs) in zip(axes[:, 0], series):
        rs = sorted((r for r in rs if _span(r)), key=lambda r: _span(r)[0])
        if not rs:
            continue
        t0 = min(_span(r)[0] for r in rs)
        labelled = len(rs) <= TIMELINE_LABELLED_ROWS
        thin, thick = (1, 4) if labelled else (0.4, 1.2)        # many rows: a density of lines, not one per tick
        for y, r in enumerate(rs):
            s, e = _span(r)
            first = r.token_ns[0] if r.token_ns else e
            color = "tab:orange" if r.cls == "long" else "tab:blue"
            ax.plot([(s - t0) / 1e9, (first - t0) / 1e9], [y, y], color=color, lw=thin, alpha=0.6)
            ax.plot([(first - t0) / 1e9, (e - t0) / 1e9], [y, y], color=color, lw=thick)
            if r.reason not in COMPLETED:
                if labelled:
                    ax.text((e - t0) / 1e9, y, f" {r.reason}", fontsize=6, va="center")
                else:
                    ax.plot([(e - t0) / 1e9], [y], marker="x", color="tab:red", ms=3)
        if labelled:
            ax.set_yticks(range(len(rs)))
            ax.set_yticklabels([r.request_id for r in rs], fontsize=6)
        else:
            ax.set_ylabel(f"{len(rs)} requests\n(by submit order)", fontsize=7)
            ax.tick_params(axis="y", labelsize=6)
        unfinished = sum(r.reason not in COMPLETED for r in rs)
        ax.set_title(f"{label}: thin = waiting for the first token, thick = streaming (orange = long prompt)"
                     + ("" if labelled or not unfinished else f"; x = not completed ({unfinished})"), fontsize=8)
        ax.set_xlabel("seconds since the first submit")
        ax.grid(axis="x", alpha=0.3)
    path = Path(f"{stem}-timeline.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(str(path))
    return paths, ""
