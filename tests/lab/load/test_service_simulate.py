"""labkit simulate end to end on CPU, judged by its checkpoint; and the CLI shell around it."""
from __future__ import annotations

import json

from labkit.checks import check_evidence, get_checkpoint
from labkit.load.simulate import run_simulate


def test_simulate_passes_its_checkpoint(tiny_model_dir, tmp_path, labkit_argv):
    labkit_argv.checkpoint("service.simulate")
    out = tmp_path / "runtime-cpu.jsonl"
    record = run_simulate(out, model=str(tiny_model_dir))
    failed = [c for c in record["checks"] if not c["passed"]]
    assert record["verdict"] == "PASS", failed
    assert record["kind"] == "cpu-real-engine" and record["checkpoint"] == "service.simulate"
    sc = record["facts"]["scenarios"]
    assert set(sc) == {"streaming", "waiting_cancel", "running_cancel", "full_queue", "slow_consumer", "disconnect",
                       "engine_exception", "shutdown"}
    verdict, _ = check_evidence(get_checkpoint("service.simulate"), tmp_path / "runtime-cpu.json")
    assert verdict == "PASS"
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["event"] == "header" and lines[0]["kind"] == "cpu-real-engine"
    observers = {e["observer"] for e in lines[1:] if e.get("request_id")}
    assert observers == {"engine", "client"}
    report = record["facts"]["report"]
    assert report["engine"]["rejections"] == 1 and report["engine"]["terminations"]["error"] == 2
    assert report["engine"]["causes"]["cancelled/shutdown"] == 3


def test_simulate_cli(tiny_model_dir, tmp_path):
    from typer.testing import CliRunner

    from labkit.cli import app
    result = CliRunner().invoke(app, ["simulate", "--out", str(tmp_path / "sim.jsonl"), "--model", str(tiny_model_dir)])
    assert result.exit_code == 0, result.output
    assert "PASS" in result.output and (tmp_path / "sim.json").is_file()
