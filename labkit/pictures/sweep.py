"""The rate sweep's latency-throughput curve, drawn from its evidence facts (never from a second run).

One point per rate: achieved output throughput (tok/s) across, latency (ms, log scale) up; TTFT p50,
TTFT p99 and TPOT p50 as three lines, each TTFT p99 point labelled with its offered rate (labels are
pushed apart vertically so none sits on another).
"""
from __future__ import annotations

import math
from pathlib import Path

from labkit.pictures import style

SERIES = (("ttft_ms", "p50", "TTFT p50", "#4e79a7", "o"), ("ttft_ms", "p99", "TTFT p99", "#e15759", "s"),
          ("tpot_ms", "p50", "TPOT p50", "#59a14f", "^"))
LABEL_GAP_PX = 13


def _rate_text(rate) -> str:
    return "inf (all at once)" if rate == "inf" else f"{rate:g} req/s"


def points(facts: dict) -> list[dict]:
    out = []
    for row in facts.get("per_rate", []):
        x = row.get("output_throughput_tok_s")
        if not isinstance(x, (int, float)) or x <= 0:
            continue
        ys = {}
        for key, q, name, *_ in SERIES:
            v = (row.get(key) or {}).get(q)
            if isinstance(v, (int, float)) and v > 0 and math.isfinite(v):
                ys[name] = v
        out.append({"rate": row["offered_rate"], "x": x, "ys": ys})
    return out


def _spread(ys: list[float], gap: float) -> list[float]:
    """Display y positions moved apart (upwards) so consecutive ones are at least ``gap`` apart."""
    order = sorted(range(len(ys)), key=lambda i: ys[i])
    placed = list(ys)
    last = None
    for i in order:
        if last is not None and placed[i] < last + gap:
            placed[i] = last + gap
        last = placed[i]
    return placed


def draw_sweep(facts: dict, path: Path) -> Path | None:
    """Write the curve; None (nothing written) when no rate has a throughput."""
    pts = points(facts)
    if not pts:
        return None
    fig = style.figure(8.0, 5.2)
    ax = fig.add_subplot(1, 1, 1)
    for _, _, name, colour, marker in SERIES:
        xy = [(p["x"], p["ys"][name]) for p in pts if name in p["ys"]]
        if xy:
            ax.plot([x for x, _ in xy], [y for _, y in xy], marker=marker, color=colour, label=name, lw=1.5, ms=6)
    ax.set_yscale("log")
    from matplotlib.ticker import FuncFormatter, LogLocator

    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.set_xlabel("achieved output throughput (tokens/s)")
    ax.set_ylabel("latency (ms, log scale)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=3, fontsize=9, frameon=False)   # above the plot
    xs = [p["x"] for p in pts]
    ax.set_xlim(0, max(xs) * 1.3)                       # from 0 tokens/s; room right of the points for labels
    ys = [v for p in pts for v in p["ys"].values()]
    ax.set_ylim(min(ys) / 2, max(ys) * 2)               # at least a factor 4: the log ticks stay readable
    limit = (facts.get("summary") or {}).get("ttft_p99_limit_ms")
    lo, hi = ax.get_ylim()
    if isinstance(limit, (int, float)) and lo < limit < hi:
        ax.axhline(limit, color="#999999", ls="--", lw=0.8)
        ax.annotate(f"TTFT limit {limit:g} ms", (0, limit), xytext=(4, -3), textcoords="offset points", fontsize=8,
                    color="#666666", va="top")      # under the line: above it, the axis' top clipped it
    fig.canvas.draw()
    anchors = [(p, p["ys"].get("TTFT p99") or max(p["ys"].values(), default=None)) for p in pts]
    anchors = [(p, y) for p, y in anchors if y]
    disp = [ax.transData.transform((p["x"], y)) for p, y in anchors]
    placed = _spread([d[1] for d in disp], LABEL_GAP_PX)
    inv = ax.transData.inverted()
    for (p, y), d, py in zip(anchors, disp, placed):
        tx, ty = inv.transform((d[0] + 10, py))
        ax.annotate(_rate_text(p["rate"]), (p["x"], y), xytext=(tx, ty), fontsize=8, va="center", zorder=5,
                    bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.85},
                    arrowprops={"arrowstyle": "-", "color": "#999999", "lw": 0.6})
    wl = facts.get("workload") or {}
    style.title(fig, f"Latency against throughput, one point per offered request rate\n"
                     f"{wl.get('dataset', '?')} workload, {len(pts)} rate{'s' if len(pts) != 1 else ''}, "
                     f"{facts.get('per_rate', [{}])[0].get('sent', '?')} requests each, target {facts.get('target')}")
    notes = []
    skipped = facts.get("skipped_rates")
    if skipped:
        notes.append(f"rates not run (past saturation): {', '.join(map(str, skipped))}")
    style.add_notes(fig, notes)
    path.parent.mkdir(parents=True, exist_ok=True)
    return style.save(fig, path)
