"""Step budget attribution (:mod:`labkit.bench.step_budget`): from a profiled pass's Chrome trace, what
each device item of a decode step is spent on, and the host time outside the device.

Attribution. Each device item (kernel, memcpy, memset) is mapped to the host call that launched it
(the trace's correlation id), and that call to the innermost ``budget:`` range around it: the module
that launched the kernel. Memcpy and memset are ``copies``; a kernel outside every module range is
named by its kernel name (qk_norm_rope, the paged decode's split and reduce kernels, copies) or ``other``. On CPU the items are the top-level aten
ops and the "device time" is their host time.

Kernels inside a CUDA graph replay have no module ranges around them (they all launch from one
cudaGraphLaunch). If the profiler sees them, each replay's kernel sequence is aligned with an eager
step's (same model code, same kernels in the same order; difflib on the names) and every matched
kernel takes its eager twin's category; the unmatched ones are named by kernel name. If it does not
see them, the graph step's GPU split is not measured and the eager split is shown next to the graph
step's time (``attribution`` says which).

Host time outside the device: for each phase range, the part of it during which no device item ran;
what is left of the step (outside every phase) is ``between``.
"""
from __future__ import annotations

import difflib
import gzip
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from engine.observe import PHASES

GEMM_ROLES = ("qkv", "o", "gate_up", "down", "lm_head")
CATEGORIES = ("layer", "attention", "kv_store", *(f"gemm.{r}" for r in GEMM_ROLES), "norm", "qk_norm_rope", "rotary",
              "activation", "embedding", "sampler", "copies", "other")
HOST_PARTS = (*PHASES, "between")
#: the record_function range names step_budget opens (module, phase, step) and the trace is read by
RANGE = "budget:"              # module / backend ranges: budget:<category>
PHASE_RANGE = "budget.phase:"  # engine phase ranges
STEP_RANGE = "budget.step"
#: phases whose own device items have a category (the rest are named by kernel name)
PHASE_CATEGORY = {"sample": "sampler", "prepare": "copies"}


# -- the trace -------------------------------------------------------------------------------------
@dataclass
class Item:
    """One device item (CUDA) or top-level op (CPU): where it ran, where it was launched from, its category."""
    name: str
    start: float          # us, on the device (CUDA) or the host (CPU)
    dur: float
    launch: float         # us, host time of the launching call
    launch_name: str = ""
    cat: str = ""         # trace category: kernel | gpu_memcpy | gpu_memset | cpu_op
    category: str = ""
    ranges: list = field(default_factory=list)   # enclosing budget ranges, outermost first


def load_trace(path: Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def name_category(name: str, cat: str) -> str:
    """A device item's category from its name alone (no module range around it)."""
    low = name.lower()
    if cat in ("gpu_memcpy", "gpu_memset") or low.startswith(("memcpy", "memset")):
        return "copies"
    if "qk_norm_rope" in low:
        return "qk_norm_rope"
    if "_decode_layer_kernel" in low:
        return "layer"                 # a whole decoder layer in one kernel (LAB_DECODE_LAYER)
    if "_decode_split_kernel" in low or "_decode_reduce_kernel" in low:
        return "attention"             # the decode prologue launches them from self_attn, outside the attn module
    if any(k in low for k in ("copy", "fill", "zero_")):
        return "copies"
    return "other"


def innermost_spans(spans: list[tuple[float, float, str]], points: list[float]) -> list[list[str]]:
    """For each point, the names of the (properly nested) spans containing it, outermost first."""
    order = sorted(range(len(points)), key=lambda i: points[i])
    spans = sorted(spans, key=lambda s: (s[0], -s[1]))
    out: list[list[str]] = [[] for _ in points]
    stack: list[tuple[float, float, str]] = []
    j = 0
    for i in order:
        t = points[i]
        while j < len(spans) and spans[j][0] <= t:
            while stack and stack[-1][0] + stack[-1][1] < spans[j][0]:
                stack.pop()
            stack.append(spans[j])
            j += 1
        while stack and stack[-1][0] + stack[-1][1] < t:
            stack.pop()
        out[i] = [s[2] for s in stack if s[0] <= t <= s[0] + s[1]]
    return out


def trace_items(events: list[dict], device_is_cuda: bool) -> tuple[list[Item], list[tuple[float, float, str]]]:
    """The device items (or top-level CPU ops) of a trace, each with its enclosing budget ranges, and
    the budget spans themselves (start, dur, name)."""
    spans = [(e["ts"], e["dur"], e["name"]) for e in events
             if e.get("ph") == "X" and e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("budget")]
    items: list[Item] = []
    if device_is_cuda:
        launches = {}
        for e in events:
            if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver"):
                corr = (e.get("args") or {}).get("correlation")
                if corr is not None:
                    launches[corr] = e
        for e in events:
            if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
                corr = (e.get("args") or {}).get("correlation")
                host = launches.get(corr)
                if host is None:
                    continue          # launched outside the profiled window
                items.append(Item(e["name"], e["ts"], e["dur"], host["ts"], host["name"], e["cat"]))
    else:
        ops = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"),
                     key=lambda e: (e["tid"], e["ts"], -e["dur"]))
        end: dict = {}
        for e in ops:                   # top level: not inside another op of its thread
            if e["ts"] >= end.get(e["tid"], float("-inf")):
                items.append(Item(e["name"], e["ts"], e["dur"], e["ts"], e["name"], "cpu_op"))
                end[e["tid"]] = e["ts"] + e["dur"]
    enclosing = innermost_spans(spans, [it.launch for it in items])
    for it, names in zip(items, enclosing):
        it.ranges = names
        it.category = range_category(it)
    return items, spans


def range_category(it: Item) -> str:
    """The innermost module range's category; else the phase's (sample, prepare); else by name."""
    if it.cat in ("gpu_memcpy", "gpu_memset"):
        return "copies"
    for name in reversed(it.ranges):
        if name.startswith(RANGE):
            return name[len(RANGE):]
        if name.startswith(PHASE_RANGE):
            phase = name[len(PHASE_RANGE):]
            if phase in PHASE_CATEGORY:
                return PHASE_CATEGORY[phase]
            break
    return name_category(it.name, it.cat)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _overlap(busy: list[tuple[float, float]], a: float, b: float) -> float:
    return sum(max(0.0, min(e, b) - max(s, a)) for s, e in busy if e > a and s < b)


def split_steps(items: list[Item], spans) -> list[dict]:
    """Per step range: its wall, the device time of its items by category, the device busy time and
    the host time outside the device by phase (all in us)."""
    steps = sorted((s for s in spans if s[2] == STEP_RANGE), key=lambda s: s[0])
    phases = sorted((s for s in spans if s[2].startswith(PHASE_RANGE)), key=lambda s: s[0])
    out = []
    for t0, dur, _ in steps:
        t1 = t0 + dur
        mine = [it for it in items if t0 <= it.launch <= t1]
        by_cat = {c: 0.0 for c in CATEGORIES}
        for it in mine:
            by_cat[it.category] = by_cat.get(it.category, 0.0) + it.dur
        busy = _union([(it.start, it.start + it.dur) for it in mine])
        host = {p: 0.0 for p in HOST_PARTS}
        for a, d, name in phases:
            if t0 <= a <= t1:
                host[name[len(PHASE_RANGE):]] += d - _overlap(busy, a, a + d)
        outside = dur - _overlap(busy, t0, t1)
        host["between"] = outside - sum(host[p] for p in PHASES)
        out.append({"wall_us": dur, "device_us": sum(it.dur for it in mine), "busy_us": _overlap(busy, t0, t1),
                    "items": len(mine), "by_category_us": by_cat, "host_outside_us": host,
                    "host_outside_total_us": outside, "_items": mine})
    return out


# -- graph replays ---------------------------------------------------------------------------------
def is_graph_launch(it: Item) -> bool:
    return "graphlaunch" in it.launch_name.lower()


def align_graph_step(graph_items: list[Item], eager_forward: list[Item]) -> float:
    """Give each kernel of a graph replay its eager twin's category (difflib alignment of the two kernel
    name sequences, in device order); unmatched kernels keep their name category. Returns the share of
    the replay's device time matched."""
    g = sorted(graph_items, key=lambda it: it.start)
    e = sorted(eager_forward, key=lambda it: it.start)
    sm = difflib.SequenceMatcher(None, [it.name for it in e], [it.name for it in g], autojunk=False)
    matched = 0.0
    for block in sm.get_matching_blocks():
        for k in range(block.size):
            twin, it = e[block.a + k], g[block.b + k]
            it.category = twin.category
            matched += it.dur
    total = sum(it.dur for it in g)
    return matched / total if total else 0.0


# -- a pass's steps -------------------------------------------------------------------------------
def attribute_steps(passes: dict, steps_of: dict) -> dict:
    """Graph steps: align each replay's kernels with an eager step's forward kernels (module doc)."""
    eager_steps = steps_of["eager"]
    out = {"eager": "module ranges (forward pre/post hooks) and phase ranges"}
    if "graph" not in steps_of:
        out["split_from"] = "eager"
        return out
    ref = eager_steps[len(eager_steps) // 2]["_items"] if eager_steps else []
    ref_forward = [it for it in ref if any(r == PHASE_RANGE + "forward" for r in it.ranges)
                   and it.cat == "kernel"]
    seen, shares = 0, []
    for s in steps_of["graph"]:
        replay = [it for it in s["_items"] if is_graph_launch(it)]
        seen += len(replay)
        if replay:
            shares.append(align_graph_step(replay, ref_forward))
            s["by_category_us"] = {c: 0.0 for c in CATEGORIES}
            for it in s["_items"]:
                s["by_category_us"][it.category] += it.dur
    n = len(steps_of["graph"]) or 1
    out["graph_kernels_seen_per_step"] = round(seen / n, 1)
    out["eager_forward_kernels_per_step"] = len(ref_forward)
    out["kineto_sees_graph_kernels"] = seen > 0
    if seen:
        out["graph"] = ("kernels inside each graph replay aligned with an eager step's forward kernels by name "
                        "(difflib); matched kernels take the eager kernel's module category")
        out["graph_matched_share_of_replay_time"] = round(statistics.fmean(shares), 4)
        out["split_from"] = "graph"
    else:
        out["graph"] = "the profiler saw no kernels inside graph replays: the split shown is the eager pass's"
        out["split_from"] = "eager"
    return out


def mean_steps(steps: list[dict]) -> dict:
    n = len(steps) or 1
    ms = lambda f: round(sum(f(s) for s in steps) / n / 1e3, 4)  # noqa: E731
    return {"wall_ms": ms(lambda s: s["wall_us"]), "device_ms": ms(lambda s: s["device_us"]),
            "device_busy_ms": ms(lambda s: s["busy_us"]), "items_per_step": round(sum(s["items"] for s in steps) / n, 1),
            "by_category_ms": {c: ms(lambda s, c=c: s["by_category_us"].get(c, 0.0)) for c in CATEGORIES},
            "host_outside_ms": {p: ms(lambda s, p=p: s["host_outside_us"][p]) for p in HOST_PARTS},
            "host_outside_total_ms": ms(lambda s: s["host_outside_total_us"])}


def top_kernels(steps: list[dict], top: int = 12) -> list[dict]:
    agg: dict[tuple[str, str], list[float]] = {}
    for s in steps:
        for it in s["_items"]:
            agg.setdefault((it.name, it.category), []).append(it.dur)
    n = len(steps) or 1
    rows = sorted(agg.items(), key=lambda kv: sum(kv[1]), reverse=True)[:top]
    return [{"name": k[0][:120], "category": k[1], "per_step": round(len(v) / n, 2),
             "ms_per_step": round(sum(v) / n / 1e3, 4)} for k, v in rows]
