"""Verdicts that cannot be miscounted: strict checking, an interrupted
``labkit run``, evidence of a patched engine kept apart, and signed evidence. CPU, fast: evidence is
written by the real writer, never by a model run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from labkit import checks, evidence
from testkit import doctor_facts



@pytest.fixture
def no_gpu(monkeypatch):
    import labkit.run_all as runner

    monkeypatch.setattr(runner, "machine", lambda: {"cuda_device_count": 0, "cuda_devices": []})


def write_doctor(labkit_argv, **kw) -> dict:
    cp = checks.get_checkpoint("setup.doctor")
    labkit_argv("doctor")
    return evidence.write_evidence(cp.evidence_path(), checkpoint=cp.id, kind="cpu-real-engine",
                                   facts=doctor_facts(), device="cpu", **kw)


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
    assert (code, row["verdict"], row["provenance"]) == (0, "PASS", "signature not checked (no key here)")


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


# --------------------------------------------------------------------------- evidence this machine cannot make

GPU_CPS = [cp for cp in checks.load_checkpoints() if cp.needs in ("cuda", "2gpu")]
H200 = "cuda:0 NVIDIA H200"


@pytest.fixture
def cuda_devices(monkeypatch):
    """``cuda_devices(n)``: the judge (and ``labkit run``'s machine check) see ``n`` CUDA devices."""
    import labkit.run_all as runner
    from labkit.checks import judging

    def set_count(n: int) -> None:
        monkeypatch.setattr(judging, "cuda_device_count", lambda: n)
        monkeypatch.setattr(runner, "machine", lambda: {"cuda_device_count": n, "cuda_devices": [H200] * n})

    set_count(0)
    return set_count


def _set(facts, parts: list[str], value) -> None:
    """Set ``value`` at ``parts`` (a ``*`` part: in every element of the list there, one made if none)."""
    if parts[0] == "*":
        if not facts:
            facts.append({})
        for item in facts:
            _set(item, parts[1:], value)
        return
    if len(parts) == 1:
        facts[parts[0]] = value
        return
    _set(facts.setdefault(parts[0], [] if parts[1] == "*" else {}), parts[1:], value)


def _get(facts: dict, parts: list[str]):
    cur = facts
    for p in parts:
        if not isinstance(cur, dict) or p not in cur:
            return None
        cur = cur[p]
    return cur


def made_up_facts(cp: checks.Checkpoint, device: str) -> dict:
    """Facts a forger writes for ``cp`` without running anything: for each assertion, a value its op accepts
    (read from the checkpoint itself, never from a run). Threshold values are the table's for ``device``."""
    record: dict = {"facts": {}, "device": device}
    asserted = [a for a in cp.assertions if a.path == "facts.dtype"]
    for a in asserted:
        _set(record, ["facts", "dtype"], a.value)
    for a in cp.assertions:
        if a.threshold is not None and "dtype" not in record["facts"]:
            key = next(k for k in a.threshold.keys() if k.startswith(device.split(":")[0] + "/"))
            record["facts"]["dtype"] = key.split("/", 1)[1]
    for a in cp.assertions:
        length = a.path.startswith("len(")
        parts = (a.path[4:-1] if length else a.path).split(".")
        value = a.value
        if a.threshold is not None:
            value = a.threshold.lookup(checks.threshold_key(device, record["facts"]["dtype"]))
        current = None if "*" in parts else _get(record, parts)
        if current is not None and not length and checks.evaluate(a, record)["passed"]:
            continue
        if length:
            n = value + (1 if a.op == "gt" else 0)
            _set(record, parts, [{} for _ in range(n)] if current is None else current + [{}] * (n - len(current)))
            continue
        if a.op in ("eq", "ge", "le"):
            made = value
        elif a.op in ("gt", "lt"):
            made = value + (1 if a.op == "gt" else -1)
        elif a.op == "ne":
            made = "x" if value != "x" else "y"
        elif a.op in ("is_true", "is_false"):
            made = a.op == "is_true"
        elif a.op == "in":
            made = value[0]
        elif a.op == "all_eq":
            made = value if "*" in parts else [value]
        elif a.op == "len_eq":
            made = [0] * value
        elif a.op == "abs_le":
            made = value[0]
        elif a.op == "contains":
            made = current + str(value) if isinstance(current, str) else [value]
        else:  # exists
            made = 1
        _set(record, parts, made)
    return record["facts"]


def forge(cp: checks.Checkpoint, labkit_argv, *, kind: str = "gpu-measured", device: str = H200) -> dict:
    """Write a made-up evidence file for ``cp`` through the real writer: its command line, a plausible envelope,
    facts that satisfy every assertion. Nothing ran."""
    labkit_argv.checkpoint(cp.id)
    synthetic = cp.synthetic is not False
    model = {"path": "/m", "synthetic": synthetic, "preset": "qwen3-0.6b" if synthetic else None}
    return evidence.write_evidence(cp.evidence_path(), checkpoint=cp.id, kind=kind, facts=made_up_facts(cp, device),
                                   device=device, model=model)


def test_made_up_files_for_every_gpu_checkpoint_are_unverified_here(runs, labkit_argv, monkeypatch, cuda_devices):
    monkeypatch.delenv("LABKIT_EVIDENCE_KEY", raising=False)
    assert len(GPU_CPS) >= 14
    for cp in GPU_CPS:
        assert forge(cp, labkit_argv)["verdict"] == "PASS", cp.id  # the writer's own judge is fooled: nothing ran
    for strict in ((), ("--strict",)):
        code, rows = check_cli(*strict)
        assert code in (0, 1)
        for cp in GPU_CPS:
            row = rows[cp.id]
            assert row["verdict"] == "REVIEW" and row["reason"].startswith("unverified: the evidence needs "), row
            assert row["provenance"] == "unsigned"
    cuda_devices(2)  # on a machine that can run them, the same files are judged on their content
    code, rows = check_cli()
    assert {rows[cp.id]["verdict"] for cp in GPU_CPS} == {"PASS"}


def test_one_gpu_is_not_two(runs, labkit_argv, cuda_devices):
    two = [cp for cp in GPU_CPS if cp.needs == "2gpu"]
    assert two
    cuda_devices(1)
    for cp in two:
        forge(cp, labkit_argv)
        verdict, res = checks.check_evidence(cp)
        assert verdict == "REVIEW" and checks.reason(verdict, res).startswith("unverified: the evidence needs 2 CUDA")


def test_resealed_edits_and_changed_figures_are_unverified_or_fail(runs, labkit_argv, cuda_devices):
    cp = checks.get_checkpoint("cuda.latency")
    forge(cp, labkit_argv)
    path = cp.evidence_path()
    good = path.read_text()
    median = "facts.graph.batch_1.ms_per_output_token_median"
    bound = next(a.value for a in cp.assertions if a.path == median and a.on_fail == "fail")

    reseal(path, lambda r: r["facts"]["graph"]["batch_1"].update(ms_per_output_token_median=bound / 2))
    verdict, res = checks.check_evidence(cp)  # a better figure, resealed: nothing here can tell
    assert verdict == "REVIEW" and checks.reason(verdict, res).startswith("unverified")

    path.write_text(good)
    reseal(path, lambda r: r["facts"]["graph"]["batch_1"].update(ms_per_output_token_median=bound * 2))
    assert checks.check_evidence(cp)[0] == "FAIL"  # a figure past the bound still FAILs: unverified is never better

    path.write_text(good)
    rec = json.loads(good)
    rec["facts"]["graph"]["batch_1"]["ms_per_output_token_median"] = bound / 4  # edited, not resealed
    path.write_text(json.dumps(rec))
    verdict, res = checks.check_evidence(cp)
    assert verdict == "FAIL" and [c["name"] for c in res if c["status"] == "fail"] == ["digest"]


def test_a_cpu_run_relabelled_as_an_h200_run_is_unverified(runs, labkit_argv, cuda_devices):
    cp = checks.get_checkpoint("scheduler.eager-vs-graph")
    forge(cp, labkit_argv, kind="cpu-real-engine", device="cpu")
    verdict, res = checks.check_evidence(cp)
    assert verdict == "FAIL" and "kind" in [c["name"] for c in res if c["status"] == "fail"]
    reseal(cp.evidence_path(), lambda r: r.update(kind="gpu-measured", device=H200, verdict="PASS"))
    verdict, res = checks.check_evidence(cp)
    assert verdict == "REVIEW" and checks.reason(verdict, res).startswith("unverified")


def test_gpu_kind_evidence_of_a_cpu_checkpoint_is_unverified_too(runs, labkit_argv, cuda_devices):
    rec = evidence.write_evidence(runs / "loose.json", checkpoint=None, kind="gpu-measured", device=H200,
                                  facts={"x": 1}, run_assertions=[checks.run_assertion("facts.x", "eq", 1)])
    assert rec["verdict"] == "PASS"
    verdict, res = checks.check_file(runs / "loose.json")
    assert verdict == "REVIEW" and checks.reason(verdict, res).startswith("unverified: the evidence needs 1 CUDA")


def test_a_made_up_signature_is_not_called_signed(runs, labkit_argv, monkeypatch, cuda_devices):
    monkeypatch.delenv("LABKIT_EVIDENCE_KEY", raising=False)
    cp = checks.get_checkpoint("cuda.latency")
    forge(cp, labkit_argv)
    reseal(cp.evidence_path(), lambda r: r.update(signature={"hmac_sha256": "ab" * 32, "key_id": "0" * 16}))
    code, rows = check_cli("cuda.latency")
    row = rows["cuda.latency"]
    assert (code, row["verdict"], row["provenance"]) == (0, "REVIEW", "signature not checked (no key here)")
    assert "carries a signature no key here can check" in row["reason"]
    monkeypatch.setenv("LABKIT_EVIDENCE_KEY", KEY)  # the key of the machine that (supposedly) ran it
    code, row = check_cli("cuda.latency")[0], check_cli("cuda.latency")[1]["cuda.latency"]
    assert (code, row["verdict"], row["provenance"]) == (1, "FAIL", "NOT SIGNED BY THIS KEY")


def test_gpu_evidence_signed_by_a_key_held_here_is_judged_on_its_content(runs, labkit_argv, monkeypatch, cuda_devices):
    monkeypatch.setenv("LABKIT_EVIDENCE_KEY", KEY)  # the GPU machine signed it; this CPU machine holds the key
    cp = checks.get_checkpoint("cuda.latency")
    forge(cp, labkit_argv)
    assert check_cli("cuda.latency")[1]["cuda.latency"]["verdict"] == "PASS"


def test_evidence_the_cpu_really_made_still_passes(runs, labkit_in_process, monkeypatch, cuda_devices):
    monkeypatch.delenv("LABKIT_EVIDENCE_KEY", raising=False)
    res = labkit_in_process("doctor")
    assert res.returncode == 0, res.stdout + res.stderr
    code, row = doctor_row()
    assert (code, row["verdict"], row["provenance"]) == (0, "PASS", "unsigned")


# --------------------------------------------------------------------------- assertions that can fail

#: Ops that hold a fact to one fixed value: on a GPU checkpoint each says in ``literal`` why that value is what
#: the engine must produce.
EQUALITY_OPS = ("eq", "ne", "in", "contains", "len_eq", "all_eq", "abs_le")
#: Path segments under which a command records the configuration it set: asserting them reads an option back.
CONFIG_SEGMENTS = ("engine_config", "worker_config", "load_options", "config", "options")
#: Facts a command writes from its own inputs, whatever the engine does (command words, path): never asserted.
INPUT_ONLY = {
    (("logits", "guard"), "facts.num_rows"): "the comparison's row count is the suite's length",
    (("logits", "guard"), "facts.trajectory_match"): "the comparison refuses files whose trajectories differ",
    (("logits", "guard"), "facts.suite"): "the --suite option",
    (("logits", "guard"), "facts.lhs.backend"): "the guard's own choice of sides",
    (("logits", "guard"), "facts.rhs.backend"): "the guard's own choice of sides",
    (("scheduler", "compare"), "len(facts.request_ids)"): "the trace's request count",
    (("quick-walk",), "facts.a.total"): "the walk's own prompt length",
    (("quick-walk",), "facts.b_first.total"): "the walk's own prompt length",
    (("bench",), "facts.workload.expected_output_tokens"): "the workload's arithmetic",
    (("bench",), "facts.trace.expected_output_tokens"): "the trace's arithmetic",
    (("bench",), "facts.summary.decode_shape"): "the bench's shape table",
    (("bench",), "facts.summary.kernels_checked"): "the bench's shape table times its backends",
    (("load",), "facts.target"): "the --serve-process option",
}


def _words(cp: checks.Checkpoint) -> tuple[list[str], dict[str, list[str]]]:
    from labkit.checks.judging import _parse_words

    head, opts = _parse_words(cp.command)
    return head[1:], {name.lstrip("-").replace("-", "_"): values for name, values in opts}


def _segments(path: str) -> list[str]:
    inner = path[4:-1] if path.startswith("len(") else path
    return [p for p in inner.split(".") if p != "*" and not p.lstrip("-").isdigit()]


def echo(cp: checks.Checkpoint, a) -> str:
    """Why assertion ``a`` of ``cp`` reads back an option of its own command ("" when it does not)."""
    _, opts = _words(cp)
    segs = _segments(a.path)
    values = {v for vs in opts.values() for v in vs}
    if any(s in CONFIG_SEGMENTS for s in segs):
        return "reads back the configuration the command set"
    if segs[-1] in opts:
        return f"reads back --{segs[-1].replace('_', '-')}"
    if a.op in ("eq", "all_eq", "contains", "in") and isinstance(a.value, str):   # a number may match by chance
        if a.value in values:
            return f"{a.value!r} is an option value of the command"
        if isinstance(a.value, str) and a.value.replace("-", "_") in opts:
            return f"{a.value!r} names an option of the command"
    return ""


def audit(cps: list[checks.Checkpoint]) -> dict[str, list[str]]:
    """Assertions that cannot fail, by kind: option echoes (any checkpoint) and fixed values with no stated
    reason (GPU checkpoints) count unless their ``literal`` says why they stay; input-only facts always count."""
    found: dict[str, list[str]] = {"echo": [], "unexplained literal": [], "input only": []}
    for cp in cps:
        head, _ = _words(cp)
        for a in cp.assertions:
            where = f"{cp.id}: {a.path} {a.op} {json.dumps(a.value)}"
            why = echo(cp, a)
            if why and not a.literal:
                found["echo"].append(f"{where} ({why})")
            if cp.needs != "cpu" and a.op in EQUALITY_OPS and a.threshold is None and not a.literal:
                found["unexplained literal"].append(where)
            for (words, path), reason in INPUT_ONLY.items():
                if a.path == path and head[:len(words)] == list(words):
                    found["input only"].append(f"{where} ({reason})")
    return found


def test_no_checkpoint_assertion_echoes_an_option_or_a_constant():
    cps = checks.load_checkpoints()
    found = audit(cps)
    gpu = [a for cp in cps if cp.needs != "cpu" for a in cp.assertions]
    stated = [a for a in gpu if a.literal]
    assert len(gpu) >= 120 and len(stated) >= 40   # the audit reads the real checkpoints
    assert found == {"echo": [], "unexplained literal": [], "input only": []}, (
        "assertions that cannot fail (assert what the engine did instead, or say in the assertion's \"literal\" "
        "why its fixed value judges the engine): " + json.dumps(found, indent=1))


def test_the_audit_finds_each_kind_it_counts():
    raw = {"id": "cuda.x", "title": "t", "evidence": "runs/x.json", "needs": "cuda", "kind": "gpu-measured",
           "command": ["labkit", "load", "--max-num-seqs", "4", "--serve-process", "--mode", "wall"]}
    made = [
        {"path": "facts.engine_config.max_num_seqs", "op": "eq", "value": 4},    # the configuration read back
        {"path": "facts.mode", "op": "eq", "value": "wall", "literal": "x"},     # an echo whose reason is stated stays
        {"path": "facts.warm", "op": "eq", "value": "serve-process", "literal": "stays"},
        {"path": "facts.completed", "op": "eq", "value": 12},                   # a fixed value with no reason
        {"path": "facts.target", "op": "exists"},                                # an input-only fact
        {"path": "facts.completed", "op": "ge", "value": 4},                    # a bound: not a fixed value
    ]
    cp = checks.Checkpoint(id=raw["id"], title="t", command=raw["command"], evidence=raw["evidence"], needs="cuda",
                           kind=["gpu-measured"], stage="cuda",
                           assertions=[checks.language._parse_assertion("x", a) for a in made])
    found = audit([cp])
    assert [w.split(" (")[0] for w in found["echo"]] == ["cuda.x: facts.engine_config.max_num_seqs eq 4"]
    assert found["unexplained literal"] == ["cuda.x: facts.engine_config.max_num_seqs eq 4", "cuda.x: facts.completed eq 12"]
    assert found["input only"] == ["cuda.x: facts.target exists null (the --serve-process option)"]
    assert echo(cp, cp.assertions[1]) == "reads back --mode" and echo(cp, cp.assertions[2]).endswith("names an option of the command")


def test_the_rate_sweep_bounds_errored_rejected_and_timed_out_requests(runs, labkit_argv, cuda_devices):
    cuda_devices(1)   # a machine that can run it judges the file on its content
    cp = checks.get_checkpoint("cuda.rate-sweep")
    forge(cp, labkit_argv)
    path = cp.evidence_path()
    good = path.read_text()
    assert checks.check_evidence(cp)[0] == "PASS"
    for outcome in ("errored", "rejected", "timed_out"):
        path.write_text(good)

        def five(r, outcome=outcome):
            r["facts"]["per_rate"][-1][outcome] = 5           # five requests of the last rate end this way
            r["verdict"] = "FAIL"                             # as the writer would judge it

        reseal(path, five)
        verdict, res = checks.check_evidence(cp)
        assert verdict == "FAIL", outcome
        assert [c["name"] for c in res if c["status"] == "fail"] == [f"facts.per_rate.*.{outcome}"]


LOGITS_GUARDS = [cp.id for cp in checks.load_checkpoints() if cp.command[1:3] == ["logits", "guard"]]


def _guard_on_a_broken_engine(cli_app, tiny_model_dir, tmp_path, labkit_argv) -> dict:
    out = tmp_path / "engine-logits-check.json"
    extra = ("--model", str(tiny_model_dir), "--device", "cpu", "--out", str(out))
    labkit_argv.checkpoint("guardrails.logits-baseline", *extra)
    res = CliRunner().invoke(cli_app, [*checks.get_checkpoint("guardrails.logits-baseline").command[1:], *extra])
    assert res.exit_code in (0, 1), res.output
    return json.loads(out.read_text())


@pytest.mark.parametrize("break_, path", [("ends one token early", "facts.lhs.num_rows"),
                                           ("appends the wrong token", "facts.lhs.rows_follow_trajectory")])
def test_every_logits_guard_judges_the_engines_rows(break_, path, cli_app, tiny_model_dir, tmp_path, labkit_argv,
                                                    monkeypatch, one_tokenizer):
    """The rows of every logits guard are the engine's: a request the engine ends one token early (a row
    missing) or a token it appends wrong (a row whose input is not the trajectory's) FAILs each guard."""
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence

    if break_ == "ends one token early":
        reached = Scheduler._length_reached
        monkeypatch.setattr(Scheduler, "_length_reached", lambda self, seq, ahead=0: reached(self, seq, ahead + 1))
    else:
        append = Sequence.append_token
        monkeypatch.setattr(Sequence, "append_token", lambda self, token_id: append(self, token_id + 1))
    record = _guard_on_a_broken_engine(cli_app, tiny_model_dir, tmp_path, labkit_argv)
    assert record["facts"]["num_rows"] == 15 and record["facts"]["trajectory_match"] is True   # the old checks: blind
    assert len(LOGITS_GUARDS) >= 7
    judged = {cid: [a for a in checks.get_checkpoint(cid).assertions if a.path == path] for cid in LOGITS_GUARDS}
    assert [cid for cid, found in judged.items() if not found] == [], f"logits guards that do not assert {path}"
    for cid, found in judged.items():
        assert not any(checks.evaluate(a, record)["passed"] for a in found), cid


def test_a_checkpoint_our_engine_never_runs_says_so_first():
    from labkit.evidence_format import ENGINE_FREE_KINDS

    free = [cp for cp in checks.load_checkpoints() if set(cp.kind) <= set(ENGINE_FREE_KINDS)]
    assert "guardrails.cached-forward" in [cp.id for cp in free]
    assert [cp.id for cp in free if not cp.title.startswith("Not our engine:")] == []
