"""One side (before or after) of a patch's experiment, run against whatever ``engine`` Python imports.

``labkit patch check NAME`` runs this module twice, as ``python -m labkit.experiments.patch_probes NAME`` in a
directory holding a copy of ``engine/`` with the patch applied (before) and one without (after), and
reads the JSON facts it prints last on stdout. Each probe records what the engine did, never what it
should have done: the checkpoint in ``checkpoints/patches.json`` holds the expectations.
"""
from __future__ import annotations

import json
import sys
from typing import Any, Callable


def _engine_identity() -> dict:
    import engine

    from labkit.evidence_format import engine_dir, source_hash

    edir = engine_dir()
    return {"engine_import_path": str(edir), "engine_source_hash": source_hash(edir),
            "engine_module": getattr(engine, "__file__", None)}


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip().rstrip(":")


# --------------------------------------------------------------------------- balanced policy (real scheduler)


def _scheduler(policy: str, *, num_blocks: int, block_size: int, max_num_seqs: int, budget: int):
    from engine import BlockManager, Scheduler, SchedulerLimits

    limits = SchedulerLimits(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=4096,
                             scheduling_policy=policy)
    return Scheduler(limits, BlockManager(num_blocks, block_size))


def _seq(sid: int, n: int, max_tokens: int, block_size: int, start: int):
    from engine.sampling.params import SamplingParams
    from engine.sequence import Sequence

    return Sequence(sid, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    block_size)


def _drive(s, rounds: int) -> list[dict]:
    """Schedule and postprocess ``rounds`` steps with synthetic token ids; one record per round."""
    out = []
    for _ in range(rounds):
        seqs, is_prefill = s.schedule()
        if not seqs:
            break
        out.append({"phase": "prefill" if is_prefill else "decode", "seqs": [q.seq_id for q in seqs],
                    "scheduled": [q.num_scheduled_tokens for q in seqs]})
        s.postprocess(seqs, [7] * len(seqs), is_prefill)
    return out


def _interference(policy: str) -> dict:
    """Two short requests decoding when a 768-token prompt arrives; budget 256 chunks it into three rounds."""
    s = _scheduler(policy, num_blocks=64, block_size=16, max_num_seqs=4, budget=256)
    for sid in (1, 2):
        s.add(_seq(sid, 32, 16, 16, 1000 * sid))
    first = _drive(s, 2)                       # prefill of both shorts, then their first decode
    s.add(_seq(3, 768, 4, 16, 5000))
    rounds = _drive(s, 8)
    phases = [r["phase"] for r in rounds]
    prefills = [i for i, p in enumerate(phases) if p == "prefill"]
    gaps = [b - a for a, b in zip(prefills, prefills[1:])]
    return {"warmup": first, "rounds": rounds, "phases": phases,
            "longest_prefill_run": _longest(phases, "prefill"),
            "decode_between_chunks": bool(gaps) and all(g >= 2 for g in gaps)}


def _longest(phases: list[str], what: str) -> int:
    best = run = 0
    for p in phases:
        run = run + 1 if p == what else 0
        best = max(best, run)
    return best


def _rotation(policy: str) -> dict:
    """Six decode-ready requests, two per batch: who is served in the three decode rounds after the last
    prefill? Rotation reaches all six; without it the front two are served again and again."""
    s = _scheduler(policy, num_blocks=64, block_size=16, max_num_seqs=2, budget=512)
    for sid in range(1, 7):
        s.add(_seq(sid, 8, 16, 16, 100 * sid))
    warmup: list[dict] = []
    while s.waiting and len(warmup) < 12:
        warmup += _drive(s, 1)
    decodes = _drive(s, 3)
    served = sorted({sid for r in decodes for sid in r["seqs"]})
    return {"warmup": warmup, "decode_rounds": [r["seqs"] for r in decodes],
            "phases": [r["phase"] for r in decodes], "served_in_3_decodes": served,
            "num_served_in_3_decodes": len(served)}


def probe_no_balanced_policy(model: str | None) -> tuple[str, dict]:
    from engine.config import SCHEDULING_POLICIES

    facts: dict[str, Any] = {"policies": list(SCHEDULING_POLICIES)}
    for policy in ("prefill_first", "balanced"):
        facts[policy] = {"interference": _interference(policy), "rotation": _rotation(policy)}
    return "cpu-real-scheduler", facts


# --------------------------------------------------------------------------- step instrumentation (real engine)


def probe_no_step_trace(model: str | None) -> tuple[str, dict]:
    from engine import SamplingParams
    from labkit.lab_engine import build_engine

    built = build_engine(model, "cpu", "torch", enforce_eager=True)
    engine = built.engine
    events: list[dict] = []
    engine.events.subscribe(lambda ev: events.append({"name": ev.name, "step": ev.step, "phase": ev.phase,
                                                      "seqs": ev.data.get("seqs")}))
    try:
        engine.add_request(list(range(9000, 9003)), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        steps = 0
        while not engine.is_finished():
            engine.step()
            steps += 1
    finally:
        engine.close()
    scheduled = [e for e in events if e["name"] == "scheduled"]
    counts: dict[str, int] = {}
    for e in events:
        counts[e["name"]] = counts.get(e["name"], 0) + 1
    return built.kind, {"case": "A", "steps": steps, "event_counts": counts, "num_events": len(events),
                        "scheduled": [[s["total"], s["cached"], s["scheduled"]] for e in scheduled
                                      for s in (e["seqs"] or [])],
                        "model": built.model.get("path"), "synthetic": built.model.get("synthetic")}


# --------------------------------------------------------------------------- TP instance isolation (CPU, gloo)


def probe_fixed_tp_address(model: str | None) -> tuple[str, dict]:
    from labkit.lab_engine import build_engine

    first = second = None
    facts: dict[str, Any] = {"tp": 2, "device": "cpu"}
    try:
        try:
            first = build_engine(model, "cpu", "torch", tensor_parallel_size=2, tp_timeout_s=60.0)
            facts["first"] = {"started": True, **_tp_address(first.engine)}
        except Exception as exc:  # noqa: BLE001 - the finding
            facts["first"] = {"started": False, "error": _error(exc)}
            return "cpu-real-engine", facts
        try:
            second = build_engine(model, "cpu", "torch", tensor_parallel_size=2, tp_timeout_s=20.0)
            facts["second"] = {"started": True, **_tp_address(second.engine)}
        except Exception as exc:  # noqa: BLE001 - the finding
            facts["second"] = {"started": False, "error": _error(exc)}
        facts["both_started"] = bool(facts["first"]["started"] and facts["second"]["started"])
        if facts["both_started"]:
            facts["same_address"] = facts["first"]["dist_init"] == facts["second"]["dist_init"]
            facts["same_shm_name"] = facts["first"]["shm_name"] == facts["second"]["shm_name"]
    finally:
        for b in (second, first):
            if b is not None:
                b.engine.close()
    return "cpu-real-engine", facts


def _tp_address(engine) -> dict:
    tp = engine.describe()["tensor_parallel"]
    return {"dist_init": tp.get("dist_init"), "shm_name": tp.get("shm_name")}


# --------------------------------------------------------------------------- CUDA Graph fallback (GPU)


def probe_no_graph_fallback(model: str | None) -> tuple[str, dict]:
    import tempfile
    from pathlib import Path

    from engine.graph import default_buckets
    from labkit.guardrails.collect import collect_nano

    with tempfile.TemporaryDirectory(prefix="labkit-graph-") as tmp:
        record = collect_nano("graph", Path(tmp) / "graph-uncovered.json", model=model, device="cuda",
                              attention="auto", execution="graph", graph_buckets=(1, 2, 4, 8, 16),
                              expect_uncovered=True)
    f = record["facts"]
    return "gpu-measured", {"default_buckets_20": default_buckets(20), "expect_uncovered": f.get("expect_uncovered"),
                            "num_rows": f.get("num_rows"), "expected_rows": f.get("expected_rows"),
                            "decode_routes": f.get("decode_routes"), "status": f.get("status")}


PROBES: dict[str, Callable[[str | None], tuple[str, dict]]] = {
    "no-step-trace": probe_no_step_trace,
    "no-graph-fallback": probe_no_graph_fallback,
    "no-balanced-policy": probe_no_balanced_policy,
    "fixed-tp-address": probe_fixed_tp_address,
}


def main(argv: list[str]) -> int:
    name, model = argv[0], (argv[1] if len(argv) > 1 and argv[1] else None)
    try:
        kind, facts = PROBES[name](model)
        out = {"ok": True, "kind": kind, "facts": facts, **_engine_identity()}
    except Exception as exc:  # noqa: BLE001 - reported to the parent as data
        out = {"ok": False, "error": _error(exc), **_engine_identity()}
    print("\n" + json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
