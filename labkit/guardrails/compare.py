"""Compare two collections row by row (lhs measured, rhs reference) and judge them."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from labkit.checks import run_assertion
from labkit.errors import UserError
from labkit.evidence import read_json, write_evidence
from labkit.paths import default_out
from labkit.guardrails.suites import (
    DEFAULT_KV_MAX_ABS,
    json_of,
    npz_of,
    prefix_of,
    trajectory_sha256,
)


@dataclass
class Collection:
    prefix: Path
    record: dict
    logits: np.ndarray
    kv_new: np.ndarray | None
    kv_rows: np.ndarray | None

    @property
    def facts(self) -> dict:
        return self.record.get("facts") or {}

    def label(self) -> str:
        f = self.facts
        if f.get("backend") == "hf":
            return "hf"
        return f"nano/{f.get('execution')}/{f.get('attention')}"

    def rejudge(self) -> tuple[str, str]:
        """(verdict, reason) of this collection's file, judged from scratch (digest, stored verdict, its run
        assertions, freshness): its stored verdict is never taken at its word."""
        from labkit.checks import check_file, reason

        verdict, checks = check_file(json_of(self.prefix))
        return verdict, reason(verdict, checks)

    def summary(self) -> dict:
        f, r = self.facts, self.record
        verdict, why = self.rejudge()
        out = {"prefix": str(self.prefix), "backend": f.get("backend"), "execution": f.get("execution"),
               "attention": f.get("attention"), "dtype": f.get("dtype"), "device": r.get("device"),
               "kind": r.get("kind"), "verdict": verdict, "verdict_reason": why, "num_rows": f.get("num_rows"),
               "rows_follow_trajectory": f.get("rows_follow_trajectory"),
               "engine_source_hash": r.get("engine_source_hash")}
        if f.get("backend") == "nano":
            out["tensor_parallel_size"] = f.get("tensor_parallel_size", 1)
            out["kv_cache_dtype"] = f.get("kv_cache_dtype", "auto")
            out["routes_as_expected"] = f.get("routes_as_expected")
            out["decode_routes"] = f.get("decode_routes")
        if "kv" in f:
            out["history_unchanged"] = f["kv"].get("history_unchanged")
            out["padding_wrote_nothing"] = f["kv"].get("padding_wrote_nothing")
        return out


def load_collection(path: str | Path, side: str = "") -> Collection:
    prefix = prefix_of(path)
    jpath, npath = json_of(prefix), npz_of(prefix)
    where = f"--{side} " if side else ""
    for p in (jpath, npath):
        if not p.is_file():
            raise UserError(f"{where}{prefix}: {p.name} not found (run `labkit logits collect --out {prefix}` first)")
    try:
        record = read_json(jpath)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{where}{jpath}: unreadable JSON ({exc})") from None
    facts = record.get("facts") if isinstance(record, dict) else None
    if not isinstance(facts, dict) or "trajectory_sha256" not in facts or "rows" not in facts:
        raise UserError(f"{where}{jpath} is not a `labkit logits collect` file")
    try:
        with np.load(npath) as z:
            logits = np.asarray(z["logits"], dtype=np.float32)
            kv_new = np.asarray(z["kv_new"], dtype=np.float32) if "kv_new" in z.files else None
            kv_rows = np.asarray(z["kv_rows"], dtype=np.int64) if "kv_rows" in z.files else None
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"{where}{npath}: unreadable arrays ({' '.join(str(exc).split())[:160]})") from None
    if logits.ndim != 2 or logits.shape[0] != len(facts["rows"]):
        raise UserError(f"{where}{npath}: logits shape {list(logits.shape)} does not match the "
                        f"{len(facts['rows'])} rows of {jpath.name}")
    return Collection(prefix, record, logits, kv_new, kv_rows)


def _refuse_mismatch(lhs: Collection, rhs: Collection) -> None:
    lf, rf = lhs.facts, rhs.facts
    if lf.get("suite") != rf.get("suite"):
        raise UserError(f"refusing to compare: suites differ (lhs {lf.get('suite')}, rhs {rf.get('suite')})")
    lm, rm = lhs.record.get("model") or {}, rhs.record.get("model") or {}
    for key in ("config_sha256", "weights_sha256"):
        if not lm.get(key) or lm.get(key) != rm.get(key):
            raise UserError(f"refusing to compare: model {key.split('_')[0]} sha256 differs "
                            f"(lhs {str(lm.get(key))[:12]}, rhs {str(rm.get(key))[:12]})")
    lrows, rrows = lf["rows"], rf["rows"]
    if lf["trajectory_sha256"] != rf["trajectory_sha256"] or len(lrows) != len(rrows):
        for a, b in zip(lrows, rrows):
            if (a.get("id"), a.get("tokens_sha256")) != (b.get("id"), b.get("tokens_sha256")):
                raise UserError(f"refusing to compare: trajectories differ at row {a.get('index')} "
                                f"(lhs {a.get('id')} len {a.get('length')}, rhs {b.get('id')} len {b.get('length')})")
        raise UserError(f"refusing to compare: trajectories differ (lhs {len(lrows)} rows, rhs {len(rrows)} rows; "
                        f"seed {lf.get('seed')} vs {rf.get('seed')})")
    if lhs.logits.shape != rhs.logits.shape:
        raise UserError(f"refusing to compare: logits shapes differ ({list(lhs.logits.shape)} vs {list(rhs.logits.shape)})")


def trajectory_match(lhs: Collection, rhs: Collection) -> bool:
    """Both files hold the same rows (ids and input-token digests, in order), and each file's trajectory
    digest is the one its rows give (recomputed here, not read)."""
    lrows, rrows = lhs.facts.get("rows"), rhs.facts.get("rows")
    if not (isinstance(lrows, list) and isinstance(rrows, list) and lrows and len(lrows) == len(rrows)):
        return False
    try:
        same = all((a["id"], a["tokens_sha256"]) == (b["id"], b["tokens_sha256"]) for a, b in zip(lrows, rrows))
        return (same and trajectory_sha256(lrows) == lhs.facts.get("trajectory_sha256")
                and trajectory_sha256(rrows) == rhs.facts.get("trajectory_sha256"))
    except (KeyError, TypeError):
        return False


def model_match(lhs: Collection, rhs: Collection) -> bool:
    """Both sides name the same model: config and weights sha256 present and equal."""
    lm, rm = lhs.record.get("model") or {}, rhs.record.get("model") or {}
    return all(lm.get(k) and lm.get(k) == rm.get(k) for k in ("config_sha256", "weights_sha256"))


def row_metrics(a: np.ndarray, b: np.ndarray) -> dict:
    """a measured, b reference (1-D): max abs, relative L2, top-1 of each, reference top-2 margin."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    diff = a64 - b64
    norm_b = float(np.linalg.norm(b64))
    top2 = np.argpartition(-b64, 1)[:2]
    top2 = top2[np.argsort(-b64[top2])]
    return {"max_abs": float(np.max(np.abs(diff))),
            "rel_l2": float(np.linalg.norm(diff) / norm_b) if norm_b > 0 else float(np.linalg.norm(diff)),
            "top1_lhs": int(np.argmax(a64)), "top1_rhs": int(top2[0]),
            "ref_margin": float(b64[top2[0]] - b64[top2[1]])}


def judge_rows(metrics: list[dict], max_abs: float, rel_l2: float) -> tuple[str, list[dict]]:
    """Mark each row's failures; verdict PASS (none), REVIEW (only explained top-1 flips) or FAIL.

    A top-1 flip is explained when the reference's top-2 margin is smaller than the row's measured max
    abs error: an error of that size can reorder two candidates that close.
    """
    explained_only = True
    any_fail = False
    for m in metrics:
        reasons = []
        if not (m["max_abs"] <= max_abs):
            reasons.append("max_abs")
        if not (m["rel_l2"] <= rel_l2):
            reasons.append("rel_l2")
        if m.get("kv_ok") is False:
            reasons.append("kv")
        m["top1_same"] = m["top1_lhs"] == m["top1_rhs"]
        m["flip_explained"] = (not m["top1_same"]) and m["ref_margin"] < m["max_abs"]
        if not m["top1_same"]:
            reasons.append("top1_flip" if m["flip_explained"] else "top1")
        m["failures"] = reasons
        if reasons:
            any_fail = True
            if reasons != ["top1_flip"]:
                explained_only = False
    if not any_fail:
        return "PASS", metrics
    return ("REVIEW" if explained_only else "FAIL"), metrics


def compared_dtype(lhs: Collection, rhs: Collection) -> str:
    """The dtype both collections ran in (``a+b`` when they differ: no threshold entry has such a key)."""
    ld, rd = str(lhs.facts.get("dtype")), str(rhs.facts.get("dtype"))
    return ld if ld == rd else f"{ld}+{rd}"


def threshold_table(lhs: Collection, rhs: Collection) -> str:
    """The threshold table a comparison is held to: ``kv-fp8`` for the engine with an FP8 KV cache against the
    engine with its cache in the model's dtype (the FP8 cache's own error), else ``logits``."""
    kv = (lhs.facts.get("kv_cache_dtype", "auto"), rhs.facts.get("kv_cache_dtype", "auto"))
    both_nano = lhs.facts.get("backend") == rhs.facts.get("backend") == "nano"
    return "kv-fp8" if both_nano and kv == ("fp8", "auto") else "logits"


def resolve_thresholds(device: Any, dtype: str, max_abs: float | None = None, rel_l2: float | None = None,
                       table_name: str = "logits") -> dict:
    """The logits thresholds a run uses: the table entry (``table_name``: logits, or kv-fp8 for the FP8 KV cache)
    for (device class, dtype), each overridden by an explicit value. ``source`` says which; a value is None
    when neither exists."""
    from labkit.checks import threshold_entry

    key, entry = threshold_entry(table_name, device, dtype)
    overridden = [n for n, v in (("--max-abs", max_abs), ("--rel-l2", rel_l2)) if v is not None]
    table = f"table {table_name} {key}" if entry is not None else f"no entry for {key} in the {table_name} table"
    return {"key": key,
            "max_abs": max_abs if max_abs is not None else (entry or {}).get("max_abs"),
            "rel_l2": rel_l2 if rel_l2 is not None else (entry or {}).get("rel_l2"),
            "source": table if not overridden else f"{' and '.join(overridden)} given ({table})",
            "overridden": overridden}


def _threshold_assertions(th: dict, first_id: str) -> list[dict]:
    out = []
    for metric, fact, name, why in (
            ("max_abs", "worst_max_abs", "rows within max abs", f"worst row max abs error; first divergent row: {first_id}"),
            ("rel_l2", "worst_rel_l2", "rows within relative L2", "||lhs - rhs|| / ||rhs||")):
        if th[metric] is None:
            out.append(run_assertion(f"facts.thresholds.{metric}", "ge", 0, name=f"a logits {metric} threshold",
                                     why=f"{th['source']} (checkpoints/guardrails.json): add one, or give "
                                         "--max-abs and --rel-l2"))
        else:
            out.append(run_assertion(f"facts.{fact}", "le", th[metric], name=name, why=f"{why} [{th['source']}]"))
    return out


def default_compare_out() -> Path:
    """``runs/logits-compare.json``: a comparison by hand is evidence for no checkpoint, so it never lands
    on a checkpoint's file (``labkit logits guard`` writes those)."""
    return default_out("logits-compare.json")


def _row_brief(spec: dict, m: dict) -> dict:
    return {"index": spec["index"], "id": spec["id"], "phase": spec["phase"], "length": spec["length"],
            "max_abs": m["max_abs"], "rel_l2": m["rel_l2"], "top1_lhs": m["top1_lhs"], "top1_rhs": m["top1_rhs"],
            "ref_margin": m["ref_margin"], **({"kv_max_abs": m["kv_max_abs"], "kv_rel_l2": m["kv_rel_l2"]}
                                              if "kv_max_abs" in m else {}),
            "failures": m.get("failures", [])}


def _check_limits(max_abs: float | None, rel_l2: float | None, kv_max_abs: float | None) -> None:
    for name, v in (("--max-abs", max_abs), ("--rel-l2", rel_l2), ("--kv-max-abs", kv_max_abs)):
        if v is not None and not (isinstance(v, (int, float)) and v >= 0 and np.isfinite(v)):
            raise UserError(f"{name} must be a finite number >= 0, got {v!r}")


def _compare_kv(lhs: Collection, rhs: Collection, metrics: list[dict], kv_max_abs: float, rel_l2: float,
                thresholds: dict) -> tuple[bool, dict[str, Any]]:
    """(compared, summary): the new K/V of each decode row, lhs against rhs, marked on that row's metrics
    (``kv_ok``) when both sides probed the same rows; else why not."""
    kv_compared = (lhs.kv_new is not None and rhs.kv_new is not None and lhs.kv_rows is not None
                   and rhs.kv_rows is not None and np.array_equal(lhs.kv_rows, rhs.kv_rows)
                   and lhs.kv_new.shape == rhs.kv_new.shape)
    kv_summary: dict[str, Any] = {"compared": bool(kv_compared), "max_abs_threshold": kv_max_abs,
                                  "rel_l2_threshold": thresholds["rel_l2"]}
    if not kv_compared:
        have = [s for s, c in (("lhs", lhs), ("rhs", rhs)) if c.kv_new is not None]
        kv_summary["why_not"] = ("neither side has new-KV arrays" if not have else
                                 f"only {have[0]} has new-KV arrays" if len(have) == 1 else "new-KV rows differ")
        return False, kv_summary
    kv_max, kv_rel = [], []
    for j, r in enumerate(lhs.kv_rows.tolist()):
        a, b = lhs.kv_new[j].astype(np.float64), rhs.kv_new[j].astype(np.float64)
        d = a - b
        nb = float(np.linalg.norm(b))
        m = metrics[r]
        m["kv_max_abs"] = float(np.max(np.abs(d)))
        m["kv_rel_l2"] = float(np.linalg.norm(d) / nb) if nb > 0 else float(np.linalg.norm(d))
        m["kv_ok"] = m["kv_max_abs"] <= kv_max_abs and m["kv_rel_l2"] <= rel_l2
        kv_max.append(m["kv_max_abs"])
        kv_rel.append(m["kv_rel_l2"])
    kv_summary.update({"rows": len(kv_max), "worst_max_abs": max(kv_max, default=0.0),
                       "worst_rel_l2": max(kv_rel, default=0.0),
                       "rows_within": sum(1 for r in lhs.kv_rows.tolist() if metrics[r]["kv_ok"])})
    return True, kv_summary


def _row_facts(specs: list[dict], metrics: list[dict], max_abs: float, rel_l2: float, worst: int) -> dict[str, Any]:
    """What the judged rows say: worst and median errors, rows within each threshold, top-1 flips, the
    first divergent row, the worst rows and every row in brief."""
    failing = [i for i, m in enumerate(metrics) if m["failures"]]
    by_abs = sorted(range(len(metrics)), key=lambda i: (-metrics[i]["max_abs"], i))[:worst]
    max_abs_all = [m["max_abs"] for m in metrics]
    rel_all = [m["rel_l2"] for m in metrics]
    flips = [i for i, m in enumerate(metrics) if not m["top1_same"]]
    unexplained = [i for i in flips if not metrics[i]["flip_explained"]]
    return {
        "worst_max_abs": max(max_abs_all), "worst_rel_l2": max(rel_all),
        "median_max_abs": float(np.median(max_abs_all)), "median_rel_l2": float(np.median(rel_all)),
        "rows_within_max_abs": sum(1 for v in max_abs_all if v <= max_abs),
        "rows_within_rel_l2": sum(1 for v in rel_all if v <= rel_l2),
        "top1_agree": len(metrics) - len(flips), "top1_flips": len(flips), "unexplained_top1_flips": len(unexplained),
        "failing_rows": len(failing),
        "first_divergent_row": _row_brief(specs[failing[0]], metrics[failing[0]]) if failing else None,
        "worst_rows": [_row_brief(specs[i], metrics[i]) for i in by_abs],
    }


def _compare_assertions(thresholds: dict, first_id: str, kv_compared: bool, kv_max_abs: float) -> list[dict]:
    assertions = [
        run_assertion("facts.trajectory_match", "is_true", name="same trajectory",
                      why="both files hold the same rows and input tokens (digests recomputed from the rows)"),
        run_assertion("facts.model_match", "is_true", name="same model",
                      why="both files name the same config and weights sha256"),
        run_assertion("facts.lhs.verdict", "eq", "PASS", name="lhs collection re-judged",
                      why="the measured collection's file, judged from scratch (digest, its assertions, freshness)"),
        run_assertion("facts.rhs.verdict", "eq", "PASS", name="rhs collection re-judged",
                      why="the reference collection's file, judged from scratch"),
        run_assertion("facts.logits_finite", "is_true", name="logits finite", why="both sides' arrays are finite"),
        *_threshold_assertions(thresholds, first_id),
        run_assertion("facts.unexplained_top1_flips", "eq", 0, name="no unexplained top-1 flip",
                      why="a flip whose reference top-2 margin is at least that row's max abs error is a real flip"),
        run_assertion("facts.top1_flips", "eq", 0, name="top-1 agreement", on_fail="review",
                      why="a flip whose reference top-2 margin is below that row's max abs error asks for review"),
    ]
    if kv_compared:
        assertions.append(run_assertion("facts.kv.worst_max_abs", "le", kv_max_abs, name="new KV within max abs",
                                        why="K/V written at each decode row's new position, every layer"))
        if thresholds["rel_l2"] is not None:
            assertions.append(run_assertion("facts.kv.worst_rel_l2", "le", thresholds["rel_l2"],
                                            name="new KV within relative L2",
                                            why="K/V written at each decode row's new position, every layer"))
    return assertions


def compare(lhs_path: str | Path, rhs_path: str | Path, out: str | Path | None = None, *,
            max_abs: float | None = None, rel_l2: float | None = None,
            kv_max_abs: float = DEFAULT_KV_MAX_ABS, checkpoint: str | None = None, worst: int = 5,
            unclaimed: dict | None = None) -> dict:
    """``labkit logits compare``: lhs is measured, rhs the reference. Writes the evidence JSON.

    The logits thresholds are the logits table's entry for the lhs device class and the collections'
    dtype (the entry the judge holds a checkpoint to); ``max_abs``/``rel_l2`` override it, and the
    evidence records which it was. With no entry and no override the evidence FAILs, saying so."""
    _check_limits(max_abs, rel_l2, kv_max_abs)
    lhs, rhs = load_collection(lhs_path, "lhs"), load_collection(rhs_path, "rhs")
    _refuse_mismatch(lhs, rhs)
    dtype = compared_dtype(lhs, rhs)
    thresholds = resolve_thresholds(lhs.record.get("device"), dtype, max_abs, rel_l2, threshold_table(lhs, rhs))
    thresholds["kv_max_abs"] = kv_max_abs
    max_abs = thresholds["max_abs"] if thresholds["max_abs"] is not None else math.inf
    rel_l2 = thresholds["rel_l2"] if thresholds["rel_l2"] is not None else math.inf
    specs = lhs.facts["rows"]
    metrics = [row_metrics(lhs.logits[i], rhs.logits[i]) for i in range(len(specs))]
    kv_compared, kv_summary = _compare_kv(lhs, rhs, metrics, kv_max_abs, rel_l2, thresholds)
    verdict, metrics = judge_rows(metrics, max_abs, rel_l2)
    row_facts = _row_facts(specs, metrics, max_abs, rel_l2, worst)
    facts = {
        "suite": lhs.facts.get("suite"), "seed": lhs.facts.get("seed"),
        "lhs": lhs.summary(), "rhs": rhs.summary(),
        "dtype": dtype, "thresholds": thresholds,
        "kv_cache_dtype": {"lhs": lhs.facts.get("kv_cache_dtype", "auto"), "rhs": rhs.facts.get("kv_cache_dtype", "auto")},
        "trajectory_sha256": lhs.facts["trajectory_sha256"], "trajectory_match": trajectory_match(lhs, rhs),
        "model_match": model_match(lhs, rhs),
        "rope": {"lhs": lhs.facts.get("rope"), "rhs": rhs.facts.get("rope")},
        "num_rows": len(metrics), "logits_finite": bool(np.isfinite(lhs.logits).all() and np.isfinite(rhs.logits).all()),
        **row_facts,
        "kv": kv_summary,
        "comparison_verdict": verdict,
        "rows": [[specs[i]["id"], round(m["max_abs"], 9), round(m["rel_l2"], 9), m["top1_same"], round(m["ref_margin"], 6)]
                 for i, m in enumerate(metrics)],
        "rows_columns": ["id", "max_abs", "rel_l2", "top1_same", "ref_margin"],
    }
    if unclaimed:
        facts["checkpoint_not_claimed"] = unclaimed
    first = row_facts["first_divergent_row"]
    assertions = _compare_assertions(thresholds, first["id"] if first else "none", kv_compared, kv_max_abs)
    out_path = Path(out) if out is not None else default_compare_out()
    kind = lhs.record.get("kind") or "cpu-real-engine"
    if not str(lhs.record.get("device") or "").startswith("cuda"):
        kind = "cpu-real-engine"
    record = write_evidence(out_path, checkpoint=checkpoint, kind=kind, facts=facts, device=lhs.record.get("device"),
                            model=lhs.record.get("model"), seed=lhs.facts.get("seed"),
                            engine={"lhs": lhs.record.get("engine"), "rhs": rhs.record.get("engine")},
                            run_assertions=assertions)
    record["_paths"] = {"json": str(out_path)}
    return record
