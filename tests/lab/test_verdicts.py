"""Verdicts that cannot be miscounted (issue 29, items 7, 11, 12, 8): strict checking, an interrupted
``labkit run``, evidence of a patched engine kept apart, and signed evidence. CPU, fast: evidence is
written by the real writer, never by a model run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from labkit import checks, evidence

DOCTOR_FACTS = {"imports_ok": True, "tensor_check": {"ok": True, "max_abs_err": 2e-5}, "runs_writable": {"ok": True},
                "engine_import": {"ok": True, "inside_project": True},
                "engine_run": {"ok": True, "engine_class_inside_project": True, "output_tokens": 1, "steps": 1}}


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


# --------------------------------------------------------------------------- item 11: labkit run's progress and Ctrl-C


def fake_cps(n: int) -> list[checks.Checkpoint]:
    return [checks.Checkpoint(id=f"setup.fake-{i}", title="t", command=["labkit", "doctor"], evidence=f"runs/fake-{i}.json",
                              needs="cpu", kind=["cpu-real-engine"], assertions=[], stage="setup")
            for i in range(1, n + 1)]


def fake_row(cp, verdict="PASS") -> dict:
    return {"id": cp.id, "verdict": verdict, "reason": "", "seconds": 0.5, "evidence": str(cp.evidence_path()),
            "log": None, "exit_code": 0}


def test_run_prints_n_of_m_the_checkpoint_and_elapsed_time_without_a_terminal(runs, monkeypatch, capsys):
    import labkit.run_all as runner

    cps = fake_cps(3)
    monkeypatch.setattr(runner, "select", lambda stage=None: cps)

    def run_one(cp, model=None, tick=None):
        tick(61.0)  # a long checkpoint: the heartbeat line
        return fake_row(cp)

    monkeypatch.setattr(runner, "run_checkpoint", run_one)
    runner.run_all(show_progress=True)
    err = capsys.readouterr().err
    for i in (1, 2, 3):
        assert f"[{i}/3] setup.fake-{i} (" in err and " s elapsed)" in err
        assert f"[{i}/3] setup.fake-{i} still running (61 s on it, " in err
        assert f"PASS setup.fake-{i} (0.5 s)" in err


def test_ctrl_c_marks_the_report_partial_and_exits_130(runs, monkeypatch):
    import labkit.run_all as runner
    from labkit.cli import app

    cps = fake_cps(3)
    monkeypatch.setattr(runner, "select", lambda stage=None: cps)
    runner.write_report([fake_row(cp) for cp in cps])  # an old, complete report
    assert json.loads((runs / "report.json").read_text())["partial"] is False

    def run_one(cp, model=None, tick=None):
        if cp.id == "setup.fake-2":
            raise KeyboardInterrupt
        return fake_row(cp)

    monkeypatch.setattr(runner, "run_checkpoint", run_one)
    res = CliRunner().invoke(app, ["run"])
    assert res.exit_code == 130, res.output
    assert "interrupted (Ctrl-C) during setup.fake-2" in res.output
    report = json.loads((runs / "report.json").read_text())
    assert (report["partial"], report["interrupted_at"]) == (True, "setup.fake-2")
    assert [(r["id"], r["verdict"]) for r in report["rows"]] == [
        ("setup.fake-1", "PASS"), ("setup.fake-2", "NOT-RUN"), ("setup.fake-3", "NOT-RUN")]
    assert report["rows"][1]["reason"] == "interrupted (Ctrl-C) while it ran"
    assert "- **partial**: interrupted (Ctrl-C) during `setup.fake-2`" in (runs / "report.md").read_text()
    assert not list(runs.glob(".report*"))  # no temp file left behind


def test_ctrl_c_stops_the_running_command_and_says_so_in_its_log(runs, monkeypatch):
    import sys
    import time

    import labkit.run_all as runner

    (cp,) = fake_cps(1)
    monkeypatch.setattr(runner, "HEARTBEAT_S", 0.2)
    monkeypatch.setattr(runner, "build_command", lambda cp, ev, model=None: [
        sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"])

    def tick(seconds):
        raise KeyboardInterrupt  # Ctrl-C arrives while the command runs

    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        runner.run_checkpoint(cp, tick=tick)
    assert time.monotonic() - start < 30  # the 60 s command was stopped, not waited for
    log = (runs / "logs" / "setup.fake-1.log").read_text()
    assert "started" in log and "[labkit run: interrupted (Ctrl-C) after" in log


# --------------------------------------------------------------------------- item 12: a patched engine's evidence


def test_patched_evidence_goes_beside_the_unpatched_one(runs, labkit_argv, monkeypatch):
    original = write_doctor(labkit_argv)
    slot = runs / "setup-doctor.json"
    before = slot.read_bytes()
    monkeypatch.setattr(evidence, "applied_patches", lambda: ["no-step-trace"])
    rec = write_doctor(labkit_argv)
    moved = runs / "patched" / "no-step-trace" / "setup-doctor.json"
    assert rec["_written_to"] == {"requested": str(slot), "path": str(moved)}
    assert "_written_to" not in json.loads(moved.read_text())  # where it went is not part of the file
    assert json.loads(moved.read_text())["engine_patches"] == ["no-step-trace"]
    assert slot.read_bytes() == before and original["engine_patches"] != ["no-step-trace"]
    # already under runs/patched/, outside runs/, or a `labkit patch check` pair: kept where asked
    assert evidence.patched_out(moved) == moved
    assert evidence.patched_out("/elsewhere/x.json") == Path("/elsewhere/x.json")
    pair = checks.get_checkpoint("patches.no-step-trace").evidence_path()
    assert evidence.patched_out(pair) == pair
    assert evidence.patched_out(slot, []) == slot


def test_the_verdict_line_names_the_patch(runs, labkit_argv, monkeypatch):
    from labkit.cli import app

    monkeypatch.setattr(evidence, "applied_patches", lambda: ["no-balanced-policy"])
    monkeypatch.setenv("COLUMNS", "200")
    res = CliRunner().invoke(app, ["principles", "timing"])
    assert res.exit_code == 0, res.output
    line = next(ln for ln in res.stdout.splitlines() if "principles.timing" in ln and "evidence:" in ln)
    assert "engine patch: no-balanced-policy" in line and "runs/patched/no-balanced-policy/timing-example.json" in line
    assert not (runs / "timing-example.json").exists()
    assert "note: made with engine patch no-balanced-policy applied, so written under runs/patched/" in res.output


def test_labkit_run_with_a_patch_applied_keeps_the_unpatched_evidence(runs, labkit_argv, monkeypatch):
    import labkit.run_all as runner

    write_doctor(labkit_argv)
    before = (runs / "setup-doctor.json").read_bytes()
    monkeypatch.setattr(evidence, "applied_patches", lambda: ["no-step-trace"])
    seen = {}

    def judge(cp, rc, seconds, timeout, ev, log):
        seen["evidence"] = ev
        return {"id": cp.id, "verdict": "FAIL", "reason": "x: expected 1, got 2"}

    monkeypatch.setattr(runner, "build_command", lambda cp, ev, model=None: ["true"])
    monkeypatch.setattr(runner, "_judge_run", judge)
    row = runner.run_checkpoint(checks.get_checkpoint("setup.doctor"))
    assert seen["evidence"] == runs / "patched" / "no-step-trace" / "setup-doctor.json"
    assert row["reason"] == "engine patch no-step-trace applied: x: expected 1, got 2"
    assert (runs / "setup-doctor.json").read_bytes() == before  # not deleted, not replaced


# --------------------------------------------------------------------------- item 8: signed evidence

KEY = "k" * 32


def reseal(path: Path, change) -> None:
    """A deliberate forger: edit the body, then recompute the digest (anyone can: it is a plain sha256)."""
    from labkit import evidence_format

    rec = json.loads(path.read_text())
    change(rec)
    rec["digest"] = evidence_format.digest(rec)
    path.write_text(json.dumps(rec, indent=2))


def doctor_row(*args: str) -> tuple[int, dict]:
    code, rows = check_cli("setup.doctor", *args)
    return code, rows["setup.doctor"]


def test_without_a_key_nothing_changes_but_the_row_says_unsigned(runs, labkit_argv, monkeypatch):
    monkeypatch.delenv("LABKIT_EVIDENCE_KEY", raising=False)
    monkeypatch.delenv("LABKIT_EVIDENCE_KEY_FILE", raising=False)
    rec = write_doctor(labkit_argv)
    assert "signature" not in rec
    code, row = doctor_row()
    assert (code, row["verdict"], row["provenance"]) == (0, "PASS", "unsigned")
    # the limit of a digest: a forger who edits a fact no assertion reads and reseals still PASSes
    reseal(runs / "setup-doctor.json", lambda r: r["facts"].update(note="edited by hand"))
    assert doctor_row()[1]["verdict"] == "PASS"


def test_a_key_holder_signs_and_the_judge_verifies(runs, labkit_argv, monkeypatch):
    monkeypatch.setenv("LABKIT_EVIDENCE_KEY", KEY)
    rec = write_doctor(labkit_argv)
    assert set(rec["signature"]) == {"hmac_sha256", "key_id"}
    code, row = doctor_row()
    assert (code, row["verdict"], row["provenance"]) == (0, "PASS", "signed")
    path = runs / "setup-doctor.json"
    good = path.read_text()

    reseal(path, lambda r: r["facts"].update(note="edited by hand"))  # an unasserted fact, resealed
    code, row = doctor_row()
    assert (code, row["verdict"]) == (1, "FAIL")
    assert row["reason"] == "not signed by this key: the signature does not match the body (edited, or forged)"
    assert row["provenance"] == "NOT SIGNED BY THIS KEY"

    path.write_text(good)  # a CPU run relabelled as measured on an H200, resealed
    reseal(path, lambda r: r.update(kind="gpu-measured", device="cuda:0 NVIDIA H200"))
    assert doctor_row()[1]["reason"].startswith("not signed by this key")

    path.write_text(good)
    reseal(path, lambda r: r.pop("signature"))  # the signature dropped: as if written without a key
    assert doctor_row()[1]["reason"] == "not signed by this key: the file carries no signature"

    path.write_text(good)
    assert doctor_row()[1]["verdict"] == "PASS"
    monkeypatch.setenv("LABKIT_EVIDENCE_KEY", "another key of 32 bytes........")  # judged with another key
    code, row = doctor_row()
    assert code == 1 and row["reason"].startswith("not signed by this key: signed by key ")
    monkeypatch.delenv("LABKIT_EVIDENCE_KEY")  # no key here: cannot verify, says so, PASS stays PASS
    code, row = doctor_row()
    assert (code, row["verdict"], row["provenance"]) == (0, "PASS", "signed (no key here)")


def test_the_key_can_come_from_a_file(runs, labkit_argv, monkeypatch, tmp_path):
    keyfile = tmp_path / "evidence.key"
    keyfile.write_text(KEY + "\n")
    monkeypatch.setenv("LABKIT_EVIDENCE_KEY_FILE", str(keyfile))
    write_doctor(labkit_argv)
    assert doctor_row()[1]["provenance"] == "signed"
    monkeypatch.delenv("LABKIT_EVIDENCE_KEY_FILE")
    monkeypatch.setenv("LABKIT_EVIDENCE_KEY", KEY)  # the same key given as text verifies it
    assert doctor_row()[1]["provenance"] == "signed"


@pytest.mark.parametrize("env, message", [
    ({"LABKIT_EVIDENCE_KEY": "short"}, "at least 16 bytes"),
    ({"LABKIT_EVIDENCE_KEY_FILE": "/nonexistent/evidence.key"}, "cannot read the key"),
    ({"LABKIT_EVIDENCE_KEY": KEY, "LABKIT_EVIDENCE_KEY_FILE": "/x"}, "not both"),
])
def test_a_bad_key_setting_is_one_error_line(runs, monkeypatch, env, message):
    from labkit.cli import app

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    res = CliRunner().invoke(app, ["check", "setup.doctor"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert [ln for ln in res.output.splitlines() if ln.strip()][-1].startswith("error: ") and message in res.output
