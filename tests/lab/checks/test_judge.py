"""The judge trusts nothing an evidence file says about itself (CPU, fast).

Each finding of the "labkit check trusts the file's own verdict" issue, reproduced on a file written by
the real writer: the bad input is judged FAIL (or NOT-RUN when stale) and the good one PASS.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from labkit import checks, evidence, evidence_format
from labkit.checks import CheckpointError, check_evidence, reason, run_assertion
from testkit import doctor_facts

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def gpus_here(monkeypatch):
    """These tests judge files a GPU machine would judge of its own runs: the judge sees two CUDA devices, so
    GPU evidence is judged on its content here. Evidence of a GPU this machine lacks is "unverified" without
    a key (test_verdicts.py)."""
    from labkit.checks import judging

    monkeypatch.setattr(judging, "cuda_device_count", lambda: 2)


@pytest.fixture
def custom(tmp_path, monkeypatch):
    """``custom(**checkpoint)``: a checkpoint ``setup.x`` defined in a temporary checkpoints/ and used by both
    the writer and the judge (``checks.get_checkpoint`` is looked up at call time)."""
    real = checks.get_checkpoint

    def make(thresholds: dict | None = None, **over) -> checks.Checkpoint:
        raw = {"id": "setup.x", "title": "t", "command": ["labkit", "x", "--case", "B", "--trace"],
               "evidence": "runs/x.json", "needs": "cpu", "kind": ["cpu-real-engine", "gpu-measured", "reference"],
               "assertions": [{"path": "facts.n", "op": "eq", "value": 3, "why": "n is 3"}]}
        raw.update(over)
        d = tmp_path / "custom-checkpoints"
        d.mkdir(exist_ok=True)
        data = {"stage": "setup", "checkpoints": [raw], **({"thresholds": thresholds} if thresholds else {})}
        (d / "setup.json").write_text(json.dumps(data))
        monkeypatch.setattr(checks, "get_checkpoint", lambda cid, root=None: real(cid, root or d))
        return checks.get_checkpoint("setup.x")

    return make


MODEL = {"path": "/m", "config_sha256": "c" * 64, "weights_sha256": "w" * 64, "synthetic": True, "preset": "tiny",
         "seed": 0}


def write(cp: checks.Checkpoint, labkit_argv, *, argv: list[str] | None = None, kind: str = "cpu-real-engine",
          device: str | None = "cpu", facts: dict | None = None, model: dict | None = None, **kw) -> dict:
    """Write cp's evidence through the real writer, as ``labkit`` + ``argv`` (default: cp's own command)."""
    labkit_argv(*(cp.command[1:] if argv is None else argv), "--out", str(cp.evidence_path()))
    return evidence.write_evidence(cp.evidence_path(), checkpoint=cp.id, kind=kind, device=device,
                                   facts={"n": 3, "m": 7} if facts is None else facts,
                                   model=dict(MODEL) if model is None else model, **kw)


def edit(cp: checks.Checkpoint, change, *, reseal: bool = False) -> None:
    """Edit cp's evidence file by hand; ``reseal`` also recomputes the digest (a deliberate forger)."""
    rec = json.loads(cp.evidence_path().read_text())
    change(rec)
    if reseal:
        rec["digest"] = evidence_format.digest(rec)
    cp.evidence_path().write_text(json.dumps(rec, indent=2))


def failed(res: list[dict]) -> list[str]:
    return [c["name"] for c in res if c["status"] == "fail"]


# --------------------------------------------------------------------------- run assertions


def test_run_assertions_are_stored_and_rejudged(runs, custom, labkit_argv):
    cp = custom()
    ok = write(cp, labkit_argv, run_assertions=[run_assertion("facts.m", "gt", 5, name="m over 5", why="w")])
    assert ok["verdict"] == "PASS" and ok["run_assertions"] == [{"path": "facts.m", "op": "gt", "value": 5,
                                                                 "name": "m over 5", "why": "w"}]
    assert [c["source"] for c in ok["checks"] if c["name"] == "m over 5"] == ["run"]
    assert check_evidence(cp)[0] == "PASS"

    bad = write(cp, labkit_argv, run_assertions=[run_assertion("facts.m", "gt", 9, name="m over 9")])
    assert bad["verdict"] == "FAIL"
    v, res = check_evidence(cp)
    assert v == "FAIL" and failed(res) == ["m over 9"]


def test_a_failed_run_assertion_with_the_verdict_edited_to_pass_fails(runs, custom, labkit_argv):
    cp = custom()
    write(cp, labkit_argv, run_assertions=[run_assertion("facts.m", "gt", 9, name="m over 9")])
    edit(cp, lambda r: r.update(verdict="PASS"))
    v, res = check_evidence(cp)
    assert v == "FAIL" and failed(res) == ["digest", "stored verdict", "m over 9"]
    assert reason(v, res).startswith("edited after it was written")
    edit(cp, lambda r: None, reseal=True)  # a forger who also fixes the digest: the facts still say FAIL
    v, res = check_evidence(cp)
    assert v == "FAIL" and failed(res) == ["stored verdict", "m over 9"]
    assert "the file says PASS, its facts judge FAIL" in reason(v, res)


def test_a_run_review_assertion_gives_review(runs, custom, labkit_argv):
    cp = custom()
    rec = write(cp, labkit_argv, run_assertions=[run_assertion("facts.m", "gt", 9, on_fail="review")])
    assert rec["verdict"] == "REVIEW" and check_evidence(cp)[0] == "REVIEW"


def test_deleting_the_verdict_fails(runs, custom, labkit_argv):
    cp = custom()
    write(cp, labkit_argv)
    assert check_evidence(cp)[0] == "PASS"
    edit(cp, lambda r: r.pop("verdict"))
    v, res = check_evidence(cp)
    assert v == "FAIL" and failed(res) == ["digest", "stored verdict"]
    edit(cp, lambda r: None, reseal=True)
    assert failed(check_evidence(cp)[1]) == ["stored verdict"]


def test_deleting_the_run_assertions_fails(runs, custom, labkit_argv):
    cp = custom()
    write(cp, labkit_argv, run_assertions=[run_assertion("facts.m", "gt", 9)])
    edit(cp, lambda r: r.update(run_assertions=[]))
    assert failed(check_evidence(cp)[1]) == ["digest", "stored verdict"]


def test_malformed_run_assertions(runs, custom, labkit_argv):
    cp = custom()
    with pytest.raises(CheckpointError, match="unknown op 'bigger'"):
        run_assertion("facts.m", "bigger", 1)
    with pytest.raises(CheckpointError, match="op gt needs a value"):
        write(cp, labkit_argv, run_assertions=[{"path": "facts.m", "op": "gt"}])
    write(cp, labkit_argv)
    edit(cp, lambda r: r.update(run_assertions=[{"path": "facts.m", "op": "gt"}]), reseal=True)
    v, res = check_evidence(cp)
    assert v == "FAIL" and "run_assertions" in failed(res)


# --------------------------------------------------------------------------- digest


def test_editing_a_fact_no_assertion_names_fails(runs, custom, labkit_argv):
    cp = custom()
    write(cp, labkit_argv)
    edit(cp, lambda r: r["facts"].update(m=8))
    v, res = check_evidence(cp)
    assert v == "FAIL" and failed(res) == ["digest"]
    assert reason(v, res) == "edited after it was written (its body no longer matches its digest)"


def test_a_file_without_a_digest_fails(runs, custom, labkit_argv):
    cp = custom()
    write(cp, labkit_argv)
    edit(cp, lambda r: r.pop("digest"))
    v, res = check_evidence(cp)
    assert v == "FAIL" and reason(v, res) == "no digest: not written by this labkit version"


def test_forged_engine_source_hash_fails(runs, custom, labkit_argv):
    cp = custom()
    write(cp, labkit_argv)
    edit(cp, lambda r: r.update(engine_source_hash=evidence_format.engine_source_hash()[::-1]))
    v, res = check_evidence(cp)
    assert v == "FAIL" and failed(res) == ["digest"]


def test_digest_survives_floats_and_non_ascii(runs, custom, labkit_argv):
    cp = custom()
    write(cp, labkit_argv, facts={"n": 3, "x": 0.1 + 0.2, "tiny": 1e-300, "big": 2**70, "text": "数据 ✓",
                                  "nan": float("nan")})
    assert check_evidence(cp)[0] == "PASS"


# --------------------------------------------------------------------------- envelope vs checkpoint


@pytest.mark.parametrize("kind,device,ok", [
    ("gpu-measured", "cuda:0 NVIDIA H200", True),
    ("gpu-measured", "cuda", True),
    ("gpu-measured", "cpu", False),
    ("gpu-measured", None, False),
    ("cpu-real-engine", "cpu", True),
    ("cpu-real-engine", "cuda:0 NVIDIA H200", False),
    ("cpu-real-engine", "cudacpu", False),
    ("reference", "cuda:0 NVIDIA H200", True),
    ("reference", "cpu", True),
])
def test_kind_and_device_class_agree(runs, custom, labkit_argv, kind, device, ok):
    cp = custom()
    rec = write(cp, labkit_argv, kind=kind, device=device)
    assert rec["verdict"] == ("PASS" if ok else "FAIL")
    v, res = check_evidence(cp)
    assert v == rec["verdict"]
    assert failed(res) == ([] if ok else ["device"])


def test_kind_must_be_one_the_checkpoint_accepts(runs, custom, labkit_argv):
    cp = custom(kind=["cpu-real-engine"])
    assert write(cp, labkit_argv, kind="cpu-real-engine")["verdict"] == "PASS"
    assert write(cp, labkit_argv, kind="static", device=None)["verdict"] == "FAIL"
    assert failed(check_evidence(cp)[1]) == ["kind"]


def test_flipped_synthetic_flag_fails(runs, custom, labkit_argv):
    cp = custom()
    write(cp, labkit_argv)
    assert check_evidence(cp)[0] == "PASS"
    edit(cp, lambda r: r["model"].update(synthetic=False))
    assert failed(check_evidence(cp)[1]) == ["digest", "stored verdict", "model.synthetic"]
    edit(cp, lambda r: None, reseal=True)
    assert failed(check_evidence(cp)[1]) == ["stored verdict", "model.synthetic"]
    real = {**MODEL, "synthetic": False, "preset": None, "seed": None}
    assert write(cp, labkit_argv, model=real)["verdict"] == "PASS"
    assert write(cp, labkit_argv, model={**real, "synthetic": True})["verdict"] == "FAIL"


@pytest.mark.parametrize("need,synthetic,ok", [("any", True, True), ("any", False, True), (True, True, True),
                                               (True, False, False), (False, False, True), (False, True, False)])
def test_checkpoint_can_require_synthetic_or_real_weights(runs, custom, labkit_argv, need, synthetic, ok):
    cp = custom(synthetic=need)
    assert cp.synthetic == need
    model = MODEL if synthetic else {**MODEL, "synthetic": False, "preset": None, "seed": None}
    write(cp, labkit_argv, model=model)
    v, res = check_evidence(cp)
    assert v == ("PASS" if ok else "FAIL") and failed(res) == ([] if ok else ["model.synthetic required"])


def test_checkpoint_synthetic_key_is_validated(tmp_path):
    d = tmp_path / "cps"
    d.mkdir()
    raw = {"id": "setup.x", "title": "t", "command": ["labkit", "x"], "evidence": "runs/x.json", "needs": "cpu",
           "kind": "static", "assertions": [{"path": "facts.a", "op": "exists"}], "synthetic": "maybe"}
    (d / "setup.json").write_text(json.dumps({"stage": "setup", "checkpoints": [raw]}))
    with pytest.raises(CheckpointError, match='synthetic must be true, false or "any"'):
        checks.load_checkpoints(d)


@pytest.mark.parametrize("argv,ok", [
    (None, True),                                                     # the checkpoint's own command
    (["x", "--trace", "--case", "B", "--model", "m", "--json"], True),  # order and options it does not name
    (["x", "--case=B", "--trace"], True),
    (["x", "--case", "A", "--case", "B", "--trace"], True),           # the last occurrence wins, as in click
    (["x", "--case", "A", "--trace"], False),
    (["x", "--case", "B"], False),                                    # a flag it names is missing
    (["x", "--case", "B", "--trace", "--no-trace"], False),
    (["x", "--case", "B", "--case", "A", "--trace"], False),
    (["y", "--case", "B", "--trace"], False),                         # another command
    (["x", "sub", "--case", "B", "--trace"], False),
])
def test_command_must_be_the_checkpoints_with_its_options(runs, custom, labkit_argv, argv, ok):
    cp = custom()
    rec = write(cp, labkit_argv, argv=argv)
    v, res = check_evidence(cp)
    assert (rec["verdict"], v) == (("PASS", "PASS") if ok else ("FAIL", "FAIL"))
    assert failed(res) == ([] if ok else ["command"])


def test_command_mismatch_explains():
    want = ["labkit", "quick-walk", "--case", "B", "--trace"]
    assert checks.command_mismatch(want, "labkit quick-walk --case B --trace --out 'a b.json'") == ""
    assert checks.command_mismatch(want, "labkit quick-walk --case A --trace") == "--case A, not --case B"
    assert checks.command_mismatch(want, "labkit quick-walk --case B") == "--trace not given"
    assert checks.command_mismatch(want, "pytest -q") == "ran pytest, not labkit quick-walk"
    assert checks.command_mismatch(want, None) == "no command line recorded"
    assert checks.command_mismatch(["labkit", "x", "--n", "-1"], "labkit x --n -1") == ""
    assert checks.command_mismatch(["labkit", "x", "--n", "-1"], "labkit x --n 1") == "--n 1, not --n -1"


def test_command_line_of_python_dash_m():
    assert evidence.command_line(["/x/labkit/__main__.py", "check"]) == "labkit check"
    assert evidence.command_line(["/x/pytest/__main__.py", "-q"]) == "__main__.py -q"  # not labkit


# --------------------------------------------------------------------------- thresholds by device class and dtype

TABLE = {"err": {"notes": "n", "entries": {"cpu/float32": {"max": 1e-3, "source": "measured"},
                                           "cuda/float32": {"max": 0.05, "source": "calibrated"}}}}
ERR_LE = [{"path": "facts.e", "op": "le", "threshold": "err.max", "why": "error within the table's threshold"}]


@pytest.mark.parametrize("kind,device,dtype,e,ok", [
    ("cpu-real-engine", "cpu", "float32", 5e-4, True),
    ("cpu-real-engine", "cpu", "float32", 0.01, False),        # tight on CPU
    ("gpu-measured", "cuda:0 NVIDIA H200", "float32", 0.01, True),  # the same error is fine on CUDA
    ("gpu-measured", "cuda:0 NVIDIA H200", "float32", 0.06, False),
])
def test_a_threshold_is_picked_by_the_records_device_class_and_dtype(runs, custom, labkit_argv, kind, device,
                                                                     dtype, e, ok):
    cp = custom(thresholds=TABLE, assertions=ERR_LE)
    rec = write(cp, labkit_argv, kind=kind, device=device, facts={"e": e, "dtype": dtype})
    v, res = check_evidence(cp)
    assert (rec["verdict"], v) == (("PASS", "PASS") if ok else ("FAIL", "FAIL"))
    (c,) = [c for c in res if c["name"] == "facts.e"]
    key = f"{device.split(':')[0]}/{dtype}"
    assert c["expected"] == f"le err.max = {TABLE['err']['entries'][key]['max']}" and key in c["why"]


@pytest.mark.parametrize("device,dtype", [("cuda:0 NVIDIA H200", "bfloat16"), ("cpu", None)])
def test_a_record_with_no_threshold_entry_fails_and_says_why(runs, custom, labkit_argv, device, dtype):
    cp = custom(thresholds=TABLE, assertions=ERR_LE)
    facts = {"e": 0.0, **({"dtype": dtype} if dtype else {})}
    write(cp, labkit_argv, kind="gpu-measured" if device.startswith("cuda") else "cpu-real-engine", device=device,
          facts=facts)
    v, res = check_evidence(cp)
    assert v == "FAIL" and failed(res) == ["facts.e"]
    key = "cuda/bfloat16" if dtype else "an unknown device class or dtype"
    assert f"no err threshold for {key} (entries: cpu/float32, cuda/float32)" in reason(v, res)


@pytest.mark.parametrize("assertion,thresholds,message", [
    ({"path": "facts.e", "op": "le", "threshold": "err.max", "value": 1}, TABLE, "a value or a threshold, not both"),
    ({"path": "facts.e", "op": "eq", "threshold": "err.max"}, TABLE, "a threshold needs op gt, ge, lt, le"),
    ({"path": "facts.e", "op": "le", "threshold": "nope.max"}, TABLE, "unknown threshold table 'nope'"),
    ({"path": "facts.e", "op": "le", "threshold": "err.min"}, TABLE, "no metric 'min'"),
    (ERR_LE[0], {"err": {"entries": {"gpu/float32": {"max": 1}}}}, "must be \"<cpu|cuda>/<dtype>\""),
    (ERR_LE[0], {"err": {"entries": {"cpu/float32": {"max": -1}}}}, "finite numbers >= 0"),
    (ERR_LE[0], {"err": {"entries": {"cpu/float32": {"max": 1}, "cuda/float32": {"top": 1}}}}, "the others"),
])
def test_threshold_tables_and_references_are_validated(tmp_path, assertion, thresholds, message):
    d = tmp_path / "cps"
    d.mkdir()
    raw = {"id": "setup.x", "title": "t", "command": ["labkit", "x"], "evidence": "runs/x.json", "needs": "cpu",
           "kind": "static", "assertions": [assertion]}
    (d / "setup.json").write_text(json.dumps({"stage": "setup", "thresholds": thresholds, "checkpoints": [raw]}))
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace("|", r"\|")):
        checks.load_checkpoints(d)


def test_a_run_cannot_state_a_threshold_reference():
    with pytest.raises(CheckpointError, match="a run states its values"):
        checks.parse_run_assertions([{"path": "facts.e", "op": "le", "threshold": "logits.max_abs"}])


def test_the_logits_table_is_one_table_for_every_logits_checkpoint():
    table = checks.load_thresholds()["logits"]["entries"]
    assert set(table) >= {"cpu/float32", "cuda/float32", "cuda/bfloat16"}
    assert table["cpu/float32"]["max_abs"] < table["cuda/float32"]["max_abs"] < table["cuda/bfloat16"]["max_abs"]
    for cid in ("guardrails.logits-baseline", "guardrails.graph-vs-eager", "tp.logits-cpu", "tp.logits-2gpu"):
        cp = checks.get_checkpoint(cid)
        refs = {a.path: a.threshold.ref for a in cp.assertions if a.threshold is not None}
        assert refs == {"facts.worst_max_abs": "logits.max_abs", "facts.worst_rel_l2": "logits.rel_l2"}, cid
        assert "--max-abs" not in cp.command and "--rel-l2" not in cp.command     # no hard-coded thresholds


# --------------------------------------------------------------------------- staleness


def test_evidence_from_another_engine_tree_is_stale(runs, custom, labkit_argv, monkeypatch):
    cp = custom()
    write(cp, labkit_argv)
    assert check_evidence(cp)[0] == "PASS"
    monkeypatch.setattr(evidence, "engine_source_hash", lambda: "0" * 64)  # written by another engine tree
    write(cp, labkit_argv)
    v, res = check_evidence(cp)
    assert v == "NOT-RUN" and reason(v, res) == "stale: engine changed since this evidence was written"
    # stale beats a failed check (run it again), a broken seal beats stale
    write(cp, labkit_argv, facts={"n": 4})
    assert check_evidence(cp)[0] == "NOT-RUN"
    edit(cp, lambda r: r["facts"].update(n=3))
    assert check_evidence(cp)[0] == "FAIL"


def test_reference_evidence_does_not_go_stale(runs, custom, labkit_argv, monkeypatch):
    cp = custom()
    monkeypatch.setattr(evidence, "engine_source_hash", lambda: "0" * 64)
    write(cp, labkit_argv, kind="reference")
    v, res = check_evidence(cp)
    assert v == "PASS" and "engine_source_hash" not in [c["name"] for c in res]


def test_engine_source_hash_is_computed_once(monkeypatch):
    first = evidence_format.engine_source_hash()
    assert first is not None and first == evidence_format.source_hash(evidence_format.engine_dir())
    monkeypatch.setattr(evidence_format, "source_hash", lambda d: pytest.fail("hashed again"))
    assert evidence_format.engine_source_hash() == first


# --------------------------------------------------------------------------- verdicts, CLI, imports


def test_nothing_asserted_is_review_even_with_envelope_checks(runs, labkit_argv):
    rec = evidence.write_evidence(runs / "g.json", checkpoint=None, kind="cpu-real-engine", facts={}, device="cpu")
    assert [c["source"] for c in rec["checks"]] == ["envelope"] and rec["verdict"] == "REVIEW"
    bad = evidence.write_evidence(runs / "g.json", checkpoint=None, kind="cpu-real-engine", facts={}, device="cuda")
    assert bad["verdict"] == "FAIL"


def test_labkit_check_names_the_reason(runs, labkit_argv, monkeypatch):
    from labkit.cli import app

    cp = checks.get_checkpoint("setup.doctor")
    facts = doctor_facts()
    labkit_argv("doctor")
    evidence.write_evidence(cp.evidence_path(), checkpoint=cp.id, kind="cpu-real-engine", facts=facts, device="cpu")

    def row():
        res = CliRunner().invoke(app, ["check", "setup.doctor", "--json"])
        (r,) = json.loads(res.stdout)
        return res.exit_code, r["verdict"], r["reason"]

    assert row()[:2] == (0, "PASS")
    edit(cp, lambda r: r["facts"].update(imports_ok="yes"))
    assert row() == (1, "FAIL", "edited after it was written (its body no longer matches its digest)")
    monkeypatch.setattr(evidence, "engine_source_hash", lambda: "0" * 64)
    evidence.write_evidence(cp.evidence_path(), checkpoint=cp.id, kind="cpu-real-engine", facts=facts, device="cpu")
    assert row() == (0, "NOT-RUN", "stale: engine changed since this evidence was written")


def test_the_judge_does_not_import_the_writer():
    code = ("import sys, labkit.checks, labkit.paths, labkit.evidence_format; "
            "assert 'labkit.evidence' not in sys.modules, 'checks imports evidence'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_kinds_name_how_the_data_was_made():
    assert {"static", "reference"} <= set(evidence_format.KINDS)
    assert evidence_format.ENGINE_FREE_KINDS == ("reference",)
    with pytest.raises(ValueError, match="unknown evidence kind"):
        evidence.envelope(kind="transformers")
    assert dataclasses.replace(checks.get_checkpoint("setup.doctor")).synthetic == "any"
