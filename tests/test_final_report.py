"""`labkit report` without --inputs: the final evidence report assembled from runs/."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from labkit.writeup import report as final_report
from labkit.paths import repo_root
from conftest import labkit_process as labkit

ROOT = repo_root()


@pytest.fixture
def runs(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "runs"
    monkeypatch.setenv("LABKIT_RUNS_DIR", str(d))
    return d


def _cuda() -> int:
    from labkit.run_all import machine

    return machine()["cuda_device_count"]


def test_bare_report_on_empty_runs_lists_every_item_not_run_with_a_reason(runs):
    r = labkit("report")
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
    assert "applied_patches" in data["engine_changes"]
    md = (runs / "final-report.md").read_text()
    for heading in ("## request timeline", "## Environment", "## Engine changes", "## Missing, with the reason"):
        assert heading in md
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


def test_report_with_inputs_is_still_the_service_comparison(runs):
    r = labkit("report", "--inputs", str(runs / "missing.jsonl"))
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
