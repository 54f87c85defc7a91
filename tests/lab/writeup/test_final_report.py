"""`labkit report` without --inputs: the final evidence report assembled from runs/.

One `labkit report` runs as a process (its exit status and its --json stdout); the others run the same app in
process (tests/lab/conftest.py's ``labkit_in_process``)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from labkit.writeup import report as final_report
from labkit.paths import repo_root
from testkit import labkit_process as labkit

ROOT = repo_root()


def _cuda() -> int:
    from labkit.run_all import machine

    return machine()["cuda_device_count"]


def test_bare_report_on_empty_runs_lists_every_item_not_run_with_a_reason(runs, labkit_in_process):
    r = labkit_in_process("report")
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((runs / "final-report.json").read_text())
    assert {it["id"] for it in data["items"]} >= {"timeline", "logits", "before-after", "two-gpu", "recovery"}
    assert data["verdict"] == "PASS" and data["failed_required"] == []
    assert set(data["not_run_items"]) == {it["id"] for it in data["items"]}
    assert all(m["reason"] for m in data["missing"])
    if _cuda() < 2:
        two = next(it for it in data["items"] if it["id"] == "two-gpu")
        assert two["findings"][0]["reason"].startswith("needs 2 GPUs")
    env = data["environment"]
    assert env["packages"]["torch"] and "cuda_available" in env["torch"] and "nvidia_smi" in env
    assert env["pip_check"]["ok"] is True and "available" in env["nvcc"]
    assert "applied_patches" in data["engine_changes"]
    md = (runs / "final-report.md").read_text()
    for heading in ("## request timeline", "## Environment", "## Engine changes", "## Missing, with the reason"):
        assert heading in md
    assert "| pip check | no broken requirements |" in md and "| nvcc | " in md
    assert (runs / "environment.txt").read_text().count("==") > 5
    assert (runs / "source-head.txt").is_file()


def test_report_labels_kind_and_verdict_and_fails_on_a_failed_required_item(runs, balanced_evidence):
    (runs / "patches").mkdir(parents=True)
    (runs / "patches" / "no-balanced-policy.json").write_text(balanced_evidence.read_text())
    (runs / "runtime-cpu.json").write_text("{not json")          # service.simulate: corrupt -> FAIL
    r = labkit("report", "--json")
    assert r.returncode == 1
    data = json.loads(r.stdout)
    items = {it["id"]: it for it in data["items"]}
    ba = {f["checkpoint"]: f for f in items["before-after"]["findings"]}["patches.no-balanced-policy"]
    assert (ba["verdict"], ba["kind"]) == ("PASS", "cpu-real-scheduler")
    assert ba["highlights"]["after served in 3 decodes"] == [1, 2, 3, 4, 5, 6]
    assert items["before-after"]["verdict"] == "PASS"
    assert set(data["failed_required"]) == {"timeline", "recovery"}
    md = (runs / "final-report.md").read_text()
    assert "`patches.no-balanced-policy`: **PASS**, real scheduler on CPU" in md


def test_report_with_inputs_is_still_the_service_comparison(runs, labkit_in_process):
    r = labkit_in_process("report", "--inputs", str(runs / "missing.jsonl"))
    assert r.returncode == 2 and "no such log" in r.stdout + r.stderr
    assert not (runs / "final-report.json").exists()


def test_timeline_reads_engine_and_client_events(tmp_path):
    log = tmp_path / "x.jsonl"
    events = [{"event": "submitted", "request_id": "stream-1", "observer": "engine", "t_ns": 1_000_000},
              {"event": "admitted", "request_id": "stream-1", "observer": "engine", "t_ns": 3_000_000},
              {"event": "token", "request_id": "stream-1", "observer": "engine", "t_ns": 5_000_000, "index": 0},
              {"event": "finished", "request_id": "stream-1", "observer": "engine", "t_ns": 6_000_000,
               "reason": "length"},
              {"event": "token", "request_id": "stream-1", "observer": "client", "t_ns": 5_500_000}]
    log.write_text("\n".join(json.dumps(e) for e in events) + "\n")
    tl = final_report.request_timeline(log)
    seq = [(e["event"], e["t_ms"]) for e in tl["requests"]["stream-1"] if e["observer"] == "engine"]
    assert seq == [("submitted", 0.0), ("admitted", 2.0), ("token", 4.0), ("finished", 5.0)]


def _load_log(path: Path, n_tokens: int = 40) -> Path:
    """A load-run log: a warmup first (finished before anything else), then a completed and a cancelled request."""
    ms = 1_000_000
    ev = lambda name, rid, t, **kw: {"event": name, "request_id": rid, "observer": "engine", "t_ns": t * ms, **kw}  # noqa: E731
    events = [ev("submitted", "warmup-0-e0", 0, warmup=True), ev("admitted", "warmup-0-e0", 1),
              ev("token", "warmup-0-e0", 2, index=1), ev("finished", "warmup-0-e0", 3, reason="length")]
    events += [ev("submitted", "mixed-3", 10), ev("admitted", "mixed-3", 14)]
    events += [ev("token", "mixed-3", 20 + i, index=i + 1) for i in range(n_tokens)]
    events += [ev("finished", "mixed-3", 20 + n_tokens, reason="length"),
               ev("submitted", "mixed-5", 12), ev("admitted", "mixed-5", 15), ev("token", "mixed-5", 30, index=1),
               ev("finished", "mixed-5", 31, reason="cancelled")]
    path.write_text("\n".join(json.dumps(e) for e in events) + "\n")
    return path


def test_timeline_shows_real_requests_never_a_warmup(tmp_path):
    tl = final_report.request_timeline(_load_log(tmp_path / "load.jsonl"))
    assert list(tl["requests"]) == ["mixed-3", "mixed-5"] and tl["warmups_skipped"] == 1
    m = tl["milestones"]["mixed-3"]["engine"]
    assert (m["submitted"], m["admitted"], m["first_token"], m["last_token"], m["tokens"]) == (0.0, 4.0, 10.0, 49.0, 40)
    assert tl["milestones"]["mixed-5"]["engine"]["reason"] == "cancelled"


def test_markdown_shows_milestones_and_the_json_keeps_every_token(runs, tmp_path):
    from labkit.writeup.timeline import timeline_md

    tl = final_report.request_timeline(_load_log(tmp_path / "load.jsonl"))
    md = "\n".join(timeline_md(tl, plotted=True))
    assert "| `mixed-3` | engine | 0 | 4 | 10 | 49 | 50 (length) | 40 |" in md
    assert "@" not in md and "→" not in md and md.count("| `mixed-3` |") == 1     # no per-token sequence
    assert sum(e["event"] == "token" for e in tl["requests"]["mixed-3"]) == 40


def _text_overlaps(fig) -> list[tuple[str, str]]:
    from matplotlib.text import Text

    fig.canvas.draw()                   # lay the legend and the labels out first
    renderer = fig.canvas.get_renderer()
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in fig.findobj(Text)
             if t.get_visible() and t.get_text().strip()]
    return [(a, b) for i, (a, ba) in enumerate(boxes) for b, bb in boxes[i + 1:] if ba.overlaps(bb)]


@pytest.mark.parametrize("ids", [None, ("mixed-3",), ("mixed-3", "mixed-5", "warmup-0-e0")])
def test_timeline_picture_has_no_overlapping_text(tmp_path, ids):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from labkit.writeup.timeline import timeline_figure

    tl = final_report.request_timeline(_load_log(tmp_path / "load.jsonl"), ids)
    fig = timeline_figure(tl)
    try:
        assert _text_overlaps(fig) == []
        fig.axes[0].annotate("finished (cancelled)", (31, 0), rotation=30)     # the old style of label: caught
        fig.axes[0].annotate("submitted", (31, 0), rotation=30)
        assert _text_overlaps(fig)
    finally:
        plt.close(fig)
    png, why = final_report.timeline_plot(tl, tmp_path / "t.png")
    assert why is None and Path(png).stat().st_size > 0


def test_report_embeds_every_picture_next_to_its_evidence(runs):
    (runs / "patches").mkdir(parents=True)
    (runs / "patches" / "no-step-trace.json").write_text("{}")
    (runs / "patches" / "no-step-trace.steps.png").write_bytes(b"\x89PNG dummy")
    (runs / "quick-walk-a.json").write_text("{}")
    for name in ("quick-walk-a.steps.png", "quick-walk-a.kv.png", "quick-walk-ab.steps.png"):
        (runs / name).write_bytes(b"\x89PNG dummy")
    (runs / "quick-walk-a.html").write_text("<html></html>")
    report = final_report.write_final_report(plots=False)
    md = Path(report["_paths"]["md"]).read_text()
    section = md.split("## before / after (the patches)")[1].split("\n## ")[0]
    assert "![no-step-trace.steps.png](patches/no-step-trace.steps.png)" in section
    engine = md.split("## Pictures of the engine")[1].split("\n## ")[0]
    assert "![quick-walk-a.kv.png](quick-walk-a.kv.png)" in engine and "![quick-walk-a.steps.png](quick-walk-a.steps.png)" in engine
    assert "quick-walk-ab" not in md                       # another stem's picture is not this evidence's
    assert "(quick-walk-a.html)" in engine
