"""The rate sweep's numbers, from one rate's event log (pure functions; ``labkit.load.sweep`` drives).

Definitions (vLLM ``bench serve``'s), over the client's observations of the measured requests:

- TTFT = first token - submitted; TPOT = (t_last - t_first) / (G - 1) (the first token excluded; a
  request with one output token has none); ITL = every gap between consecutive tokens, pooled;
  E2E = finished - submitted. Latencies are taken over completed requests only (as vLLM does).
- Percentiles p50 / p90 / p99, linear interpolation (numpy's default, :func:`labkit.load.report.percentile`).
- Duration = first submit -> last finish of the measured requests; request throughput = completed /
  duration; output throughput = output tokens of the completed requests / duration.
- Goodput (``--goodput ttft:MS tpot:MS e2e:MS``) = completed requests meeting every SLO given, per
  second of the duration (a request without a TPOT meets a TPOT SLO, as vLLM's TPOT 0).
- Accounting: every request of the trace is completed (stop/length), rejected (reason ``rejected``
  or HTTP 429/503), timed out (the client gave up reading) or errored (any other end); one with no
  end at all is lost. ``sent == completed + rejected + errored + timed_out`` exactly when none is lost.
- Prefix-cache hit rate = prompt tokens the prefix cache gave / prompt tokens, from our server's
  ``finished`` events (``num_cached_tokens``); None for a server that does not report it.
- TTFT split (our server's native API, whose events the client keeps as ``observer=engine``; both
  observers read one machine's monotonic clock): per completed request, ingress = the server's submitted -
  the client's; queue = the server's admitted - its submitted; prefill = the server's first token - its
  admitted; delivery = the client's first token - the server's. The four add up to the client's TTFT.
"""
from __future__ import annotations

import math
from typing import Any

from labkit.errors import UserError
from labkit.load.report import COMPLETED, Req, dist, itl_ms, ttft_ms, tpot_ms

SLO_NAMES = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2e": "e2e_ms", "e2el": "e2e_ms"}
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
OUTCOMES = ("completed", "rejected", "errored", "timed_out")
REJECT_STATUS = (429, 503)
TIMEOUT_ERRORS = ("TimeoutError", "ServerTimeoutError", "SocketTimeoutError")
#: achieved request throughput below this share of the offered rate: the server no longer keeps up
SATURATED_SHARE = 0.9


# --------------------------------------------------------------------------- parsing options


def parse_rates(text: str) -> list[float]:
    """``1,2,4,inf`` -> [1.0, 2.0, 4.0, inf]: positive, rising (inf last)."""
    rates = []
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        try:
            r = float(part)
        except ValueError:
            raise UserError(f"--request-rates: {part!r} is not a number (requests/s, or inf)") from None
        if not r > 0 or math.isnan(r):
            raise UserError(f"--request-rates: every rate must be > 0 requests/s, got {part}")
        rates.append(r)
    if not rates:
        raise UserError("--request-rates needs at least one rate, e.g. 1,2,4,inf")
    if any(b <= a for a, b in zip(rates, rates[1:])):
        raise UserError(f"--request-rates must rise (each rate above the one before), got {text}")
    return rates


def parse_goodput(items: list[str] | str | None) -> dict[str, float]:
    """vLLM's ``--goodput ttft:500 tpot:50 e2el:2000`` (ms; ``e2e`` too; space or comma separated)."""
    if not items:
        return {}
    parts = items.replace(",", " ").split() if isinstance(items, str) else \
        [p for item in items for p in item.replace(",", " ").split()]
    out: dict[str, float] = {}
    for p in parts:
        name, sep, value = p.partition(":")
        if not sep or name.lower() not in SLO_NAMES:
            raise UserError(f"--goodput: {p!r} must be NAME:MS with NAME one of ttft, tpot, e2e (e2el)")
        try:
            ms = float(value)
        except ValueError:
            raise UserError(f"--goodput: {p!r}: {value!r} is not a number of ms") from None
        if not (ms > 0 and math.isfinite(ms)):
            raise UserError(f"--goodput: {p!r}: the SLO must be a finite number of ms > 0")
        out[SLO_NAMES[name.lower()]] = ms
    return out


# --------------------------------------------------------------------------- one request


def e2e_ms(r: Req) -> float | None:
    if r.submitted_ns is None or r.finished_ns is None:
        return None
    return (r.finished_ns - r.submitted_ns) / 1e6


def outcome(r: Req | None) -> str:
    """completed | rejected | timed_out | errored | lost (no end seen)."""
    if r is None or r.reason is None:
        return "lost"
    if r.reason in COMPLETED:
        return "completed"
    if r.reason == "rejected" or r.status in REJECT_STATUS:
        return "rejected"
    if r.reason == "error" and str(r.message or "").startswith(TIMEOUT_ERRORS):
        return "timed_out"
    return "errored"


def meets(r: Req, slos: dict[str, float]) -> bool:
    values = {"ttft_ms": ttft_ms(r), "tpot_ms": tpot_ms(r), "e2e_ms": e2e_ms(r)}
    for key, limit in slos.items():
        v = values[key]
        if v is None and key == "tpot_ms":
            continue                       # one output token: no TPOT (vLLM counts it 0)
        if v is None or v > limit:
            return False
    return True


# --------------------------------------------------------------------------- one rate


def accounting(sent_ids: list[str], by_id: dict[str, Req]) -> dict:
    counts = {k: 0 for k in (*OUTCOMES, "lost")}
    for rid in sent_ids:
        counts[outcome(by_id.get(rid))] += 1
    counts["sent"] = len(sent_ids)
    counts["submitted"] = sum(1 for rid in sent_ids if rid in by_id and by_id[rid].submitted_ns is not None)
    counts["accounted"] = sum(counts[k] for k in OUTCOMES)
    return counts


def latencies(done: list[Req]) -> dict:
    return {"ttft_ms": dist([v for v in map(ttft_ms, done) if v is not None]),
            "tpot_ms": dist([v for v in map(tpot_ms, done) if v is not None]),
            "itl_ms": dist([g for r in done for g in itl_ms(r)]),
            "e2e_ms": dist([v for v in map(e2e_ms, done) if v is not None])}


def duration_s(reqs: list[Req]) -> float | None:
    starts = [r.submitted_ns for r in reqs if r.submitted_ns is not None]
    ends = [r.finished_ns for r in reqs if r.finished_ns is not None]
    if not starts or not ends:
        return None
    return max(0.0, (max(ends) - min(starts)) / 1e9)


def hit_rate(engine_finished: list[dict]) -> float | None:
    """Cached prompt tokens / prompt tokens over our server's finished events (None: not reported)."""
    rows = [e for e in engine_finished if isinstance(e.get("num_cached_tokens"), int)
            and isinstance(e.get("num_prompt_tokens"), int)]
    prompt = sum(e["num_prompt_tokens"] for e in rows)
    if not rows or prompt == 0:
        return None
    return round(sum(e["num_cached_tokens"] for e in rows) / prompt, 4)


def rate_facts(offered: float, sent_ids: list[str], client: dict[str, Req], engine_finished: list[dict],
               slos: dict[str, float]) -> dict:
    """One rate's row: accounting, duration, throughputs, latency distributions, goodput, hit rate."""
    measured = [client[rid] for rid in sent_ids if rid in client]
    done = [r for r in measured if outcome(r) == "completed"]
    seconds = duration_s(measured)
    out_tokens = sum(r.output_tokens for r in done)
    per_s = (lambda n: round(n / seconds, 3)) if seconds else (lambda n: None)
    good = sum(meets(r, slos) for r in done) if slos else None
    lat = latencies(done)
    row: dict[str, Any] = {
        "offered_rate": "inf" if math.isinf(offered) else offered,
        **accounting(sent_ids, client),
        "duration_s": None if seconds is None else round(seconds, 6),
        "output_tokens": out_tokens,
        "request_throughput": per_s(len(done)),
        "output_throughput_tok_s": per_s(out_tokens),
        **lat,
        "goodput": None if good is None else {"slos_ms": slos, "good_requests": good, "req_s": per_s(good)},
        "prefix_cache_hit_rate": hit_rate(engine_finished),
    }
    row["latencies_finite"] = latencies_finite(row)
    row["saturated"] = saturated(row)
    return row


TTFT_PARTS = ("ingress_ms", "queue_ms", "prefill_ms", "delivery_ms")


def ttft_split(sent_ids: list[str], client: dict[str, Req], engine: dict[str, Req]) -> dict | None:
    """Where the client's TTFT went (ingress, queue, prefill, delivery: the module's definitions), each a
    distribution over the completed requests both observers timed; None when no request has both."""
    parts: dict[str, list[float]] = {k: [] for k in TTFT_PARTS}
    for rid in sent_ids:
        c, e = client.get(rid), engine.get(rid)
        if c is None or e is None or outcome(c) != "completed" or not c.token_ns or not e.token_ns \
                or None in (c.submitted_ns, e.submitted_ns, e.admitted_ns):
            continue
        marks = (c.submitted_ns, e.submitted_ns, e.admitted_ns, e.token_ns[0], c.token_ns[0])
        for k, a, b in zip(TTFT_PARTS, marks, marks[1:]):
            parts[k].append((b - a) / 1e6)
    if not parts["ingress_ms"]:
        return None
    return {k: dist(v) for k, v in parts.items()}


def latencies_finite(row: dict) -> bool:
    """Every completed request gave TTFT and E2E, and every reported latency is a finite number >= 0."""
    if not row["completed"]:
        return False
    for key in LATENCIES:
        d = row[key]
        if key in ("ttft_ms", "e2e_ms") and d.get("n") != row["completed"]:
            return False
        for q in ("p50", "p90", "p99"):
            if d.get("n") and not (isinstance(d.get(q), (int, float)) and math.isfinite(d[q]) and d[q] >= 0):
                return False
    return True


def saturated(row: dict) -> bool | None:
    """Whether the server fell behind the offered rate (inf: always; None without a throughput)."""
    rate, got = row["offered_rate"], row["request_throughput"]
    if rate == "inf":
        return True
    if got is None:
        return None
    return got < SATURATED_SHARE * rate


# --------------------------------------------------------------------------- the sweep


def monotone(rows: list[dict], tolerance: float) -> dict:
    """Achieved output throughput never falls more than ``tolerance`` below the best of the lower rates."""
    tputs = [r["output_throughput_tok_s"] for r in rows]
    violations = []
    best = None
    for r, t in zip(rows, tputs):
        if t is None:
            violations.append({"offered_rate": r["offered_rate"], "throughput_tok_s": None, "best_below": best})
            continue
        if best is not None and t < (1 - tolerance) * best:
            violations.append({"offered_rate": r["offered_rate"], "throughput_tok_s": t, "best_below": best})
        best = t if best is None else max(best, t)
    return {"tolerance": tolerance, "throughput_tok_s": tputs, "violations": violations}


def summary(rows: list[dict], ttft_limit_ms: float = 1000.0) -> dict:
    """What the sweep says: the first saturated rate, the first rate whose TTFT p99 passes the limit,
    the best throughput (the saturation throughput when the sweep reached saturation)."""
    first_sat = next((r["offered_rate"] for r in rows if r["saturated"]), None)
    over = next((r["offered_rate"] for r in rows if (r["ttft_ms"].get("p99") or 0) > ttft_limit_ms), None)
    tputs = [r["output_throughput_tok_s"] for r in rows if r["output_throughput_tok_s"] is not None]
    return {"first_saturated_rate": first_sat, "ttft_p99_limit_ms": ttft_limit_ms,
            "first_rate_ttft_p99_over_limit": over,
            "last_rate_ttft_p99_within_limit": next((r["offered_rate"] for r in reversed(rows)
                                                     if r["ttft_ms"].get("n") and r["ttft_ms"]["p99"] <= ttft_limit_ms
                                                     and (over is None or _before(r["offered_rate"], over))), None),
            "max_output_throughput_tok_s": max(tputs) if tputs else None}


def _before(a, b) -> bool:
    fa = math.inf if a == "inf" else a
    fb = math.inf if b == "inf" else b
    return fa < fb
