"""The final report's request timeline: a few real requests of a service event log (never a warmup), their
milestones per observer, and a picture with one row per request and no text on the points.

``request_timeline`` keeps every event of the chosen requests (per-token timestamps stay in the report's
JSON); ``milestones`` reduces them to what a person reads (submitted, admitted, first token, last token,
finished, token count); ``timeline_plot`` draws them; ``timeline_md`` writes the milestones as a table.
"""
from __future__ import annotations

import json
from pathlib import Path

#: Request ids the simulated service log (``labkit simulate``) always has: one stream and one cancel.
PREFERRED = ("stream-1", "run-cancel")
COMPLETED = ("stop", "length")
OBSERVERS = ("engine", "client")


def _read(log_path: Path) -> list[dict]:
    events = []
    with log_path.open(encoding="utf-8") as f:
        for line in f:
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(e, dict) and e.get("request_id") and isinstance(e.get("t_ns"), int):
                events.append(e)
    return events


def warmup_ids(events: list[dict]) -> set[str]:
    """Requests marked ``warmup`` on any of their submitted events (or named ``warmup-...`` by the replay)."""
    return {e["request_id"] for e in events
            if (e.get("event") == "submitted" and e.get("warmup")) or str(e["request_id"]).startswith("warmup-")}


def choose_requests(events: list[dict], preferred: tuple[str, ...] = PREFERRED) -> tuple[str, ...]:
    """The requests to show: ``preferred`` where the log has them, else the first completed request of the
    trace and the first one that did not complete (cancelled, rejected, ...), by submit time; never a warmup."""
    warm = warmup_ids(events)
    have = {e["request_id"] for e in events} - warm
    chosen = tuple(r for r in preferred if r in have)
    if chosen:
        return chosen
    first_seen: dict[str, int] = {}
    reason: dict[str, str | None] = {}
    for e in events:
        rid = e["request_id"]
        if rid in warm:
            continue
        first_seen[rid] = min(first_seen.get(rid, e["t_ns"]), e["t_ns"])
        if e.get("event") == "finished" and (rid not in reason or e.get("observer", "engine") == "engine"):
            reason[rid] = e.get("reason")          # the engine's word wins over the client's
    order = sorted(first_seen, key=first_seen.get)
    done = [r for r in order if reason.get(r) in COMPLETED]
    other = [r for r in order if reason.get(r) not in COMPLETED and reason.get(r) is not None]
    return tuple(done[:1] + other[:1]) or tuple(order[:1])


def request_timeline(log_path: Path, request_ids: tuple[str, ...] | None = None, rel=str) -> dict:
    """Every event of the chosen requests, in time order, in ms from each request's first event."""
    events = _read(log_path)
    ids = request_ids if request_ids is not None else choose_requests(events)
    events = [e for e in events if e["request_id"] in ids]
    if not events:
        return {"log": rel(log_path), "requests": {}, "milestones": {}, "reason": "no request events in the log"}
    t0s: dict[str, int] = {}
    for e in events:
        t0s[e["request_id"]] = min(t0s.get(e["request_id"], e["t_ns"]), e["t_ns"])
    out: dict[str, list[dict]] = {}
    for e in sorted(events, key=lambda e: e["t_ns"]):
        detail = {k: e[k] for k in ("reason", "cause", "index", "token_id", "round") if k in e}
        out.setdefault(e["request_id"], []).append({"t_ms": round((e["t_ns"] - t0s[e["request_id"]]) / 1e6, 2),
                                                    "event": e.get("event"), "observer": e.get("observer", "engine"),
                                                    **detail})
    return {"log": rel(log_path), "requests": out, "milestones": {rid: milestones(evs) for rid, evs in out.items()},
            "warmups_skipped": len(warmup_ids(_read(log_path)))}


def milestones(events: list[dict]) -> dict[str, dict]:
    """Per observer: submitted, admitted, first / last token (ms), finished (ms, reason) and the token count."""
    out = {}
    for obs in OBSERVERS:
        evs = [e for e in events if e["observer"] == obs]
        if not evs:
            continue
        at = lambda name: next((e["t_ms"] for e in evs if e["event"] == name), None)  # noqa: E731
        toks = [e["t_ms"] for e in evs if e["event"] == "token"]
        fin = next((e for e in evs if e["event"] == "finished"), None)
        out[obs] = {"submitted": at("submitted"), "admitted": at("admitted"), "cancel_sent": at("cancel_sent"),
                    "first_token": toks[0] if toks else None, "last_token": toks[-1] if toks else None,
                    "tokens": len(toks), "finished": fin["t_ms"] if fin else None,
                    "reason": fin.get("reason") if fin else None}
    return out


_MARKS = (  # milestone, marker, size, colour, legend text
    ("submitted", "|", 11, "black", "submitted"),
    ("admitted", ">", 6, "tab:purple", "admitted"),
    ("first_token", "o", 6, "tab:orange", "first token"),
    ("last_token", "D", 5, "tab:orange", "last token"),
    ("cancel_sent", "v", 7, "tab:red", "cancel sent (client)"),
    ("finished", "s", 9, "tab:gray", "finished"),
)
_HOLLOW = {"finished"}          # drawn open, so a last token at the same time shows through
LEGEND_IN = 0.5           # inches of figure kept below the axes for the legend (two rows of entries)
_LANE = {"engine": (-0.16, "tab:blue"), "client": (0.16, "tab:green")}     # y grows downwards: engine above


def timeline_plot(timeline: dict, out: Path) -> tuple[str | None, str | None]:
    """A PNG: one row per request (engine lane above, client lane below), tokens as small dots, milestones as
    markers explained by the legend; request names and outcomes on the y axis; no text on the points."""
    if not timeline.get("requests"):
        return None, "no request events to draw"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, "matplotlib is not importable: no timeline plot"
    fig = timeline_figure(timeline)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return str(out), None


def timeline_figure(timeline: dict):
    """The timeline's matplotlib figure (the caller saves and closes it)."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    rows = list(timeline["requests"].items())
    height = LEGEND_IN + 1.3 + 0.7 * len(rows)        # inches: the legend's band below, the plot above it
    fig, ax = plt.subplots(figsize=(8, height))
    for y, (rid, evs) in enumerate(rows):
        ms = timeline.get("milestones", {}).get(rid) or milestones(evs)
        for obs, m in ms.items():
            dy, colour = _LANE[obs]
            ts = [e["t_ms"] for e in evs if e["observer"] == obs]
            ax.plot([min(ts), max(ts)], [y + dy] * 2, color=colour, lw=2.5, alpha=0.45, solid_capstyle="butt")
            toks = [e["t_ms"] for e in evs if e["observer"] == obs and e["event"] == "token"]
            ax.plot(toks, [y + dy] * len(toks), ".", ms=4, color="black")
            for key, marker, size, c, _ in _MARKS:
                if m.get(key) is not None:
                    ax.plot([m[key]], [y + dy], marker=marker, ms=size, color=c, ls="none", mew=1.5,
                            mfc="none" if key in _HOLLOW else c)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([_row_label(rid, timeline, evs) for rid, evs in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.4, -0.6)          # the first request on top
    ax.set_xlabel("ms since the request's first event (its submission)")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(f"request timeline ({timeline['log']}): upper lane engine, lower lane client", fontsize=9)
    handles = [Line2D([], [], color=_LANE[o][1], lw=2.5, alpha=0.45, label=f"{o} lane") for o in OBSERVERS]
    handles.append(Line2D([], [], marker=".", ms=6, color="black", ls="none", label="token"))
    handles += [Line2D([], [], marker=mk, ms=s, color=c, ls="none", mew=1.5, mfc="none" if k in _HOLLOW else c, label=t)
                for k, mk, s, c, t in _MARKS]
    fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 0.0), ncol=5, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, LEGEND_IN / height, 1, 1))
    return fig


def _row_label(rid: str, timeline: dict, evs: list[dict]) -> str:
    ms = timeline.get("milestones", {}).get(rid) or milestones(evs)
    m = ms.get("engine") or next(iter(ms.values()), {})
    return f"{rid}\n{m.get('reason') or 'unfinished'}, {m.get('tokens', 0)} tokens"


def _ms(v) -> str:
    return "–" if v is None else f"{v:g}"


def timeline_md(timeline: dict, plotted: bool) -> list[str]:
    """The milestones as a table (ms since the request's first event); the tokens' times stay in the JSON."""
    if not timeline.get("requests"):
        return ["", f"(no timeline: {timeline.get('reason', 'no events')})"]
    skipped = timeline.get("warmups_skipped") or 0
    out = ["", f"From `{timeline['log']}`" + (f" ({skipped} warmup requests left out)" if skipped else "")
           + (", drawn in the plot below." if plotted else "."), "",
           "| request | observer | submitted | admitted | first token | last token | finished | tokens |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for rid, ms in timeline["milestones"].items():
        for obs, m in ms.items():
            fin = _ms(m["finished"]) + (f" ({m['reason']})" if m["reason"] else "")
            if m.get("cancel_sent") is not None:
                fin += f"; cancel sent {_ms(m['cancel_sent'])}"
            out.append(f"| `{rid}` | {obs} | {_ms(m['submitted'])} | {_ms(m['admitted'])} | {_ms(m['first_token'])} | "
                       f"{_ms(m['last_token'])} | {fin} | {m['tokens']} |")
    out += ["", "Times in ms since the request's first event; every token's time is in the report's JSON "
                "(`timeline.requests`)."]
    return out
