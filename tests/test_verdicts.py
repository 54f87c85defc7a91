"""Verdicts that cannot be miscounted (issue 29, items 7, 11, 12, 8): strict checking, an interrupted
``labkit run``, evidence of a patched engine kept apart, and signed evidence. CPU, fast: evidence is
written by the real writer, never by a model run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from labkit import checks, evidence, paths

DOCTOR_FACTS = {"imports_ok": True, "tensor_check": {"ok": True, "max_abs_err": 2e-5}, "runs_writable": {"ok": True},
                "engine_import": {"ok": True, "inside_project": True},
                "engine_run": {"ok": True, "engine_class_inside_project": True, "output_tokens": 1, "steps": 1}}


@pytest.fixture
def runs(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "runs"
    monkeypatch.setenv(paths.RUNS_DIR_ENV, str(d))
    return d


@pytest.fixture
def no_gpu(monkeypatch):
    import labkit.run_all as runner

    monkeypatch.setattr(runner, "machine", lambda: {"cuda_device_count": 0, "cuda_devices": []})


def write_doctor(labkit_argv, **kw) -> dict:
    cp = checks.get_checkpoint("setup.doctor")
    labkit_argv("doctor")
    return evidence.write_evidence(cp.evidence_path(), checkpoint=cp.id, kind="cpu-real-engine",
                                   facts=dict(DOCTOR_FACTS), device="cpu", **kw)


def check_cli(*args: str) -> tuple[int, dict[str, dict]]:
    from labkit.cli import app

    res = CliRunner().invoke(app, ["check", *args, "--json"])
    assert res.exit_code in (0, 1), res.output
    return res.exit_code, {r["id"]: r for r in json.loads(res.stdout)}


# --------------------------------------------------------------------------- item 7: strict


def test_strict_fails_missing_and_stale_evidence_this_machine_can_run(runs, labkit_argv, monkeypatch, no_gpu):
    write_doctor(labkit_argv)
    assert check_cli("setup.doctor", "--strict")[0] == 0  # current evidence: strict changes nothing

    (runs / "setup-doctor.json").unlink()  # missing: its command crashed before writing, says the log
    (runs / "logs").mkdir(parents=True)
    (runs / "logs" / "setup.doctor.log").write_text("$ labkit doctor\n\nerror: the engine would not import\n")
    code, rows = check_cli("setup.doctor")
    assert code == 0 and rows["setup.doctor"]["verdict"] == "NOT-RUN"
    assert "no evidence at" in rows["setup.doctor"]["reason"]
    assert "error: the engine would not import" in rows["setup.doctor"]["reason"]
    code, rows = check_cli("setup.doctor", "--strict")
    assert (code, rows["setup.doctor"]["verdict"]) == (1, "FAIL")
    assert rows["setup.doctor"]["reason"].startswith("strict: this machine can run it, but no evidence at")

    monkeypatch.setattr(evidence, "engine_source_hash", lambda: "0" * 64)  # stale: another engine wrote it
    write_doctor(labkit_argv)
    code, rows = check_cli("setup.doctor", "--strict")
    assert (code, rows["setup.doctor"]["verdict"]) == (1, "FAIL")
    assert "stale: engine changed" in rows["setup.doctor"]["reason"]


def test_strict_leaves_what_this_machine_cannot_run_not_run(runs, no_gpu):
    code, rows = check_cli("cuda.latency", "--strict")
    assert (code, rows["cuda.latency"]["verdict"]) == (0, "NOT-RUN")
    assert rows["cuda.latency"]["reason"].startswith("no evidence at")
    assert rows["cuda.latency"]["reason"].endswith("(needs CUDA: this machine cannot run it)")
