"""Evidence envelope, assertion ops, verdicts and checkpoint files (CPU, fast)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from labkit import checks, evidence, evidence_format, paths
from labkit.checks import Assertion, CheckpointError, check_evidence, evaluate, judge, verdict
from testkit import doctor_facts


# --------------------------------------------------------------------------- envelope


def test_envelope_has_every_field():
    env = evidence.envelope(kind="static", device="cpu", model={"path": "m", "synthetic": True}, seed=3,
                            engine={"attention_backend": "torch"})
    for key in ("schema_version", "created_at", "command", "cwd", "git_head", "engine_source_hash",
                "engine_import_path", "versions", "device", "model", "seed", "kind", "engine"):
        assert key in env, key
    assert env["schema_version"] == evidence_format.SCHEMA_VERSION == 2
    assert env["created_at"].endswith("+00:00")
    assert set(env["versions"]) == {"python", "torch", "triton", "transformers", "flash_attn"}
    assert env["versions"]["python"].count(".") == 2
    assert env["git_head"] is None or re.fullmatch(r"[0-9a-f]{40}", env["git_head"])
    assert env["engine_source_hash"] is None or re.fullmatch(r"[0-9a-f]{64}", env["engine_source_hash"])
    assert (env["device"], env["seed"], env["kind"]) == ("cpu", 3, "static")
    assert env["model"]["synthetic"] is True and env["engine"] == {"attention_backend": "torch"}


def test_envelope_rejects_unknown_kind():
    with pytest.raises(ValueError, match="unknown evidence kind"):
        evidence.envelope(kind="measured-somehow")


def test_command_line_uses_basename():
    assert evidence.command_line(["/usr/bin/labkit", "smoke", "--out", "a b.json"]) == "labkit smoke --out 'a b.json'"
    assert evidence.command_line(["/x/labkit/__main__.py", "run"]) == "labkit run"


def test_source_hash_tracks_content_and_names(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    (tmp_path / "notes.txt").write_text("ignored")
    h1 = evidence_format.source_hash(tmp_path)
    assert h1 == evidence_format.source_hash(tmp_path)
    (tmp_path / "notes.txt").write_text("still ignored")
    assert evidence_format.source_hash(tmp_path) == h1
    (tmp_path / "pkg" / "a.py").write_text("x = 2\n")
    assert evidence_format.source_hash(tmp_path) != h1
    assert evidence_format.source_hash(tmp_path / "absent") is None


def test_git_head_outside_a_repo_is_none(tmp_path):
    assert evidence.git_head(tmp_path) is None
    assert evidence.git_dirty(tmp_path) is None


def test_git_dirty_says_when_tracked_files_changed(tmp_path):
    import shutil
    import subprocess
    if shutil.which("git") is None:
        pytest.skip("no git")
    run = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)  # noqa: E731
    run("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    run("add", "a.py")
    run("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "a")
    (tmp_path / "untracked.txt").write_text("not part of the code\n")
    assert evidence.git_dirty(tmp_path) is False
    (tmp_path / "a.py").write_text("x = 2\n")
    assert evidence.git_dirty(tmp_path) is True


def test_default_out_creates_runs(runs):
    assert not runs.exists()
    assert paths.default_out("x.json") == runs / "x.json"
    assert runs.is_dir()


# --------------------------------------------------------------------------- write_evidence


def test_write_evidence_judges_and_writes(runs, labkit_argv):
    labkit_argv.checkpoint("setup.doctor")
    out = runs / "sub" / "doctor.json"
    rec = evidence.write_evidence(out, checkpoint="setup.doctor", kind="cpu-real-engine", facts=doctor_facts(),
                                  device="cpu", seed=0)
    assert rec["verdict"] == "PASS"
    on_disk = json.loads(out.read_text())
    assert on_disk == json.loads(json.dumps(rec))
    assert list(on_disk)[-6:] == ["checkpoint", "facts", "run_assertions", "checks", "verdict", "digest"]
    assert on_disk["digest"] == evidence_format.digest(on_disk)
    names = [c["name"] for c in on_disk["checks"]]
    assert names[:3] == ["checkpoint", "kind", "schema_version"]
    assert "facts.tensor_check.ok" in names
    assert [p.name for p in out.parent.iterdir()] == ["doctor.json"]  # no temp file left


def test_write_evidence_fails_on_bad_facts_and_wrong_kind(runs, labkit_argv):
    labkit_argv.checkpoint("setup.doctor")
    rec = evidence.write_evidence(runs / "a.json", checkpoint="setup.doctor", kind="cpu-real-engine",
                                  facts=doctor_facts(tensor_check={"ok": False, "max_abs_err": 0.5}), device="cpu")
    assert rec["verdict"] == "FAIL"
    failed = {c["name"] for c in rec["checks"] if not c["passed"]}
    assert failed == {"facts.tensor_check.ok", "facts.tensor_check.max_abs_err"}
    rec = evidence.write_evidence(runs / "b.json", checkpoint="setup.doctor", kind="simulated", facts=doctor_facts())
    assert rec["verdict"] == "FAIL"
    assert [c["name"] for c in rec["checks"] if not c["passed"]] == ["kind"]


def test_write_evidence_serializes_numpy_paths_tuples(runs):
    facts = {"a": np.float32(1.5), "b": np.arange(3), "c": Path("/x/y"), "d": (1, 2), "e": np.int64(7),
             "f": {3, 1}, "g": np.bool_(True)}
    rec = evidence.write_evidence(runs / "np.json", checkpoint=None, kind="static", facts=facts)
    data = json.loads((runs / "np.json").read_text())
    assert data["facts"] == {"a": 1.5, "b": [0, 1, 2], "c": "/x/y", "d": [1, 2], "e": 7, "f": [1, 3], "g": True}
    assert rec["checks"] == [] and rec["verdict"] == "REVIEW"  # nothing asserted: a human must look


def test_write_evidence_takes_no_self_judged_checks(runs):
    """A command states its checks as run assertions over its facts; a stored ``passed`` is not accepted."""
    with pytest.raises(TypeError, match="extra_checks"):
        evidence.write_evidence(runs / "x.json", checkpoint=None, kind="simulated", facts={},
                                extra_checks=[{"name": "ratio", "passed": True}])
    ok = evidence.write_evidence(runs / "x.json", checkpoint=None, kind="simulated", facts={"ratio": 1.4},
                                 run_assertions=[checks.run_assertion("facts.ratio", "gt", 1)])
    assert ok["verdict"] == "PASS" and checks.UNJUDGED_KEY not in ok
    bad = evidence.write_evidence(runs / "x.json", checkpoint=None, kind="simulated", facts={"ratio": 0.9},
                                  run_assertions=[checks.run_assertion("facts.ratio", "gt", 1)])
    assert bad["verdict"] == "FAIL"


def test_write_evidence_unknown_checkpoint(runs):
    with pytest.raises(CheckpointError, match="did you mean setup.doctor"):
        evidence.write_evidence(runs / "x.json", checkpoint="setup.docter", kind="static", facts={})


# --------------------------------------------------------------------------- ops

RECORD = {
    "facts": {
        "steps": [{"seqs": [{"total": 3, "tokens": [1, 2, 3]}]}, {"seqs": []}],
        "ok": True,
        "bad": False,
        "n": 10,
        "x": 0.503,
        "name": "torch backend",
        "counts": [3, 3, 3],
        "none": None,
        "map": {"0": "zero"},
    }
}

OP_CASES = [
    # (path, op, value, expected result)
    ("facts.steps.0.seqs.0.total", "eq", 3, True),
    ("facts.steps.0.seqs.0.total", "eq", 4, False),
    ("facts.ok", "eq", 1, False),  # true is not 1
    ("facts.steps.0.seqs.0.tokens", "eq", [1, 2, 3], True),
    ("facts.n", "ne", 9, True),
    ("facts.n", "ne", 10, False),
    ("facts.n", "gt", 9, True),
    ("facts.n", "gt", 10, False),
    ("facts.n", "ge", 10, True),
    ("facts.n", "ge", 11, False),
    ("facts.n", "lt", 11, True),
    ("facts.n", "lt", 10, False),
    ("facts.n", "le", 10, True),
    ("facts.n", "le", 9.5, False),
    ("facts.ok", "gt", 0, False),  # booleans are not numbers
    ("facts.name", "in", ["torch backend", "triton"], True),
    ("facts.name", "in", ["triton"], False),
    ("facts.name", "contains", "torch", True),
    ("facts.name", "contains", "flash", False),
    ("facts.steps.0.seqs.0.tokens", "contains", 2, True),
    ("facts.steps.0.seqs.0.tokens", "contains", 5, False),
    ("facts.steps", "len_eq", 2, True),
    ("facts.steps", "len_eq", 3, False),
    ("facts.ok", "is_true", None, True),
    ("facts.bad", "is_true", None, False),
    ("facts.n", "is_true", None, False),  # truthy is not true
    ("facts.bad", "is_false", None, True),
    ("facts.ok", "is_false", None, False),
    ("facts.none", "is_false", None, False),
    ("facts.x", "abs_le", [0.5, 0.01], True),
    ("facts.x", "abs_le", [0.5, 0.001], False),
    ("facts.counts", "all_eq", 3, True),
    ("facts.steps.0.seqs.0.tokens", "all_eq", 3, False),
    ("facts.steps.1.seqs", "all_eq", 3, False),  # empty list proves nothing
    ("facts.none", "exists", None, True),
    ("facts.absent", "exists", None, False),
    ("len(facts.steps)", "eq", 2, True),
    ("len(facts.steps.1.seqs)", "eq", 1, False),
    ("facts.steps.-1.seqs", "len_eq", 0, True),
    ("facts.map.0", "eq", "zero", True),
]


@pytest.mark.parametrize("path,op,value,expected", OP_CASES)
def test_ops(path, op, value, expected):
    res = evaluate(Assertion(path=path, op=op, value=value, why="w"), RECORD)
    assert res["passed"] is expected
    assert res["status"] == ("pass" if expected else "fail")
    assert res["name"] == path and res["why"].startswith("w")


def test_every_op_is_covered():
    assert {case[1] for case in OP_CASES} == set(checks.OPS)


@pytest.mark.parametrize("path", ["facts.nope", "facts.steps.5.seqs", "facts.steps.x", "facts.n.deeper",
                                  "nothing.at.all", "facts.steps.0.seqs.0.total.1"])
def test_missing_path_is_a_failed_check(path):
    res = evaluate(Assertion(path=path, op="eq", value=1), RECORD)
    assert res["passed"] is False and res["actual"] == "<missing>"


def test_type_errors_fail_instead_of_raising():
    res = evaluate(Assertion(path="facts.name", op="gt", value=1), RECORD)
    assert res["passed"] is False and "not a number" in res["why"]
    res = evaluate(Assertion(path="len(facts.n)", op="eq", value=1), RECORD)
    assert res["passed"] is False and res["actual"].startswith("<no length")


def test_on_fail_review():
    res = evaluate(Assertion(path="facts.n", op="gt", value=100, on_fail="review"), RECORD)
    assert res["status"] == "review" and verdict([res]) == "REVIEW"


def test_resolve_raises_keyerror_for_missing():
    assert checks.resolve(RECORD, "len(facts.counts)") == 3
    with pytest.raises(KeyError):
        checks.resolve(RECORD, "facts.zzz")


# --------------------------------------------------------------------------- verdicts


def _c(status):
    return {"name": status, "passed": status == "pass", "status": status}


def test_verdict_logic():
    assert verdict([_c("pass"), _c("pass")]) == "PASS"
    assert verdict([_c("pass"), _c("fail"), _c("review")]) == "FAIL"
    assert verdict([_c("pass"), _c("review")]) == "REVIEW"
    assert verdict([]) == "REVIEW"
    assert verdict([{"name": "legacy", "passed": False}]) == "FAIL"  # no status field
    assert verdict([{"name": "legacy", "passed": True}]) == "PASS"


# --------------------------------------------------------------------------- check_evidence


def test_check_evidence_states(runs, labkit_argv):
    labkit_argv.checkpoint("setup.doctor")
    cp = checks.get_checkpoint("setup.doctor")
    path = cp.evidence_path()
    assert path == runs / "setup-doctor.json"

    v, res = check_evidence(cp)
    assert v == "NOT-RUN" and res[0]["why"] == f"no evidence at {path}"
    assert checks.reason(v, res) == f"no evidence at {path}"

    evidence.write_evidence(path, checkpoint="setup.doctor", kind="cpu-real-engine", facts=doctor_facts(),
                            device="cpu")
    v, res = check_evidence(cp)
    assert v == "PASS" and all(c["passed"] for c in res)

    path.write_text('{"schema_version": 1, "facts": ')  # truncated
    v, res = check_evidence(cp)
    assert v == "FAIL" and "unreadable evidence" in res[0]["why"]

    evidence.write_evidence(path, checkpoint=None, kind="cpu-real-engine", facts=doctor_facts(), device="cpu")
    v, res = check_evidence(cp)
    assert v == "FAIL" and [c["name"] for c in res if c["status"] == "fail"] == ["checkpoint"]


def test_check_evidence_rejudges_instead_of_trusting(runs, labkit_argv):
    labkit_argv.checkpoint("setup.doctor")
    cp = checks.get_checkpoint("setup.doctor")
    rec = evidence.write_evidence(cp.evidence_path(), checkpoint=cp.id, kind="cpu-real-engine", facts=doctor_facts(),
                                  device="cpu")
    assert check_evidence(cp)[0] == "PASS"
    rec["facts"]["runs_writable"]["ok"] = False  # file edited by hand, still claims PASS
    evidence.write_json(cp.evidence_path(), rec)
    v, res = check_evidence(cp)
    assert v == "FAIL" and [c["name"] for c in res if not c["passed"]] == ["digest", "stored verdict",
                                                                         "facts.runs_writable.ok"]
    rec["digest"] = evidence_format.digest(rec)  # even with the digest made to match, the facts are re-judged
    evidence.write_json(cp.evidence_path(), rec)
    v, res = check_evidence(cp)
    assert v == "FAIL" and [c["name"] for c in res if not c["passed"]] == ["stored verdict", "facts.runs_writable.ok"]


def test_a_file_with_self_judged_checks_fails(runs, labkit_argv):
    """An older writer's ``unjudged_checks`` (results the command judged itself) are not evidence: even
    'passed' ones, sealed with a valid digest, FAIL the file."""
    labkit_argv.checkpoint("setup.doctor")
    cp = checks.get_checkpoint("setup.doctor")
    rec = evidence.write_evidence(cp.evidence_path(), checkpoint=cp.id, kind="cpu-real-engine", facts=doctor_facts(),
                                  device="cpu")
    assert check_evidence(cp)[0] == "PASS"
    rec[checks.UNJUDGED_KEY] = [{"name": "extra", "passed": True, "expected": 1, "actual": 1}]
    rec["digest"] = evidence_format.digest(rec)
    evidence.write_json(cp.evidence_path(), rec)
    v, res = check_evidence(cp)
    assert v == "FAIL" and [(c["name"], c["source"]) for c in res if not c["passed"]] == [
        ("stored verdict", "integrity"), (checks.UNJUDGED_KEY, "integrity")]


def test_judge_non_object_record():
    cp = checks.get_checkpoint("setup.doctor")
    assert verdict(judge(cp, [1, 2])) == "FAIL"


# --------------------------------------------------------------------------- checkpoint files


def test_checkpoints_md_is_up_to_date():
    expected = checks.render_checkpoints_md()
    actual = checks.checkpoints_md_path().read_text(encoding="utf-8")
    assert actual == expected, "CHECKPOINTS.md is stale: run `labkit check --write-md`"


def test_repo_checkpoints_load_and_setup_doctor_first():
    cps = checks.load_checkpoints()
    assert cps[0].id == "setup.doctor"
    doc = cps[0]
    assert doc.command == ["labkit", "doctor"] and doc.needs == "cpu" and doc.takes_model is False
    assert doc.kind == ["cpu-real-engine", "gpu-measured"] and doc.evidence == "runs/setup-doctor.json"


def _cp(**over) -> dict:
    cp = {"id": "setup.x", "title": "t", "command": ["labkit", "x"], "evidence": "runs/x.json", "needs": "cpu",
          "kind": "static", "assertions": [{"path": "facts.a", "op": "eq", "value": 1, "why": "a is 1"}]}
    cp.update(over)
    return cp


def _write(d: Path, stage: str, *cps: dict) -> None:
    d.mkdir(exist_ok=True)
    (d / f"{stage}.json").write_text(json.dumps({"stage": stage, "checkpoints": list(cps)}))


BAD_FILES = [
    (_cp(assertions=[{"path": "facts.a", "op": "equals", "value": 1}]), "unknown op 'equals'"),
    ({k: v for k, v in _cp().items() if k != "evidence"}, "missing key(s) evidence"),
    (_cp(needs="tpu"), "needs must be one of"),
    (_cp(kind=["static", "measured"]), "kind must be one of"),
    (_cp(command=["python", "x"]), "command must start with 'labkit'"),
    (_cp(evidence="/tmp/x.json"), "evidence must be a runs/"),
    (_cp(assertions=[]), "assertions must be a non-empty list"),
    (_cp(assertions=[{"path": "facts.a", "op": "abs_le", "value": 1}]), "abs_le needs [expected, tolerance>=0]"),
    (_cp(assertions=[{"path": "facts.a", "op": "gt", "value": "3"}]), "op gt needs a number"),
    (_cp(assertions=[{"path": "facts.a", "op": "is_true", "value": True}]), "op is_true takes no value"),
    (_cp(assertions=[{"path": "facts.a", "op": "eq"}]), "op eq needs a value"),
    (_cp(assertions=[{"path": "facts..a", "op": "exists"}]), "bad path"),
    (_cp(assertions=[{"path": "facts.a", "op": "exists", "on_fail": "warn"}]), "on_fail must be"),
    (_cp(asserts=[]), "unknown key(s) asserts"),
    (_cp(takes_model="yes"), "takes_model must be true or false"),
]


@pytest.mark.parametrize("raw,message", BAD_FILES)
def test_invalid_checkpoint_files_are_rejected_clearly(tmp_path, raw, message):
    _write(tmp_path, "setup", raw)
    with pytest.raises(CheckpointError) as exc:
        checks.load_checkpoints(tmp_path)
    text = str(exc.value)
    assert message in text
    assert text.startswith("setup.json")
    if "id" in raw:
        assert "'setup.x'" in text


def test_file_level_errors(tmp_path):
    (tmp_path / "setup.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="setup.json: invalid JSON"):
        checks.load_checkpoints(tmp_path)
    (tmp_path / "setup.json").write_text(json.dumps({"stage": "service", "checkpoints": []}))
    with pytest.raises(CheckpointError, match="does not match the file name"):
        checks.load_checkpoints(tmp_path)
    _write(tmp_path, "setup", _cp())
    _write(tmp_path, "service", _cp())
    with pytest.raises(CheckpointError, match="also defined in setup.json"):
        checks.load_checkpoints(tmp_path)


def test_stage_order_and_selection(tmp_path):
    _write(tmp_path, "zeta", _cp(id="zeta.a"))
    _write(tmp_path, "tp", _cp(id="tp.a"))
    _write(tmp_path, "guardrails", _cp(id="guardrails.b"), _cp(id="guardrails.a"))
    _write(tmp_path, "setup", _cp(id="setup.a"))
    _write(tmp_path, "cuda", _cp(id="cuda.a", needs="cuda"))
    _write(tmp_path, "alpha", _cp(id="alpha.a"))
    ids = [cp.id for cp in checks.load_checkpoints(tmp_path)]
    assert ids == ["setup.a", "guardrails.b", "guardrails.a", "cuda.a", "tp.a", "alpha.a", "zeta.a"]
    assert [cp.id for cp in checks.select("guardrails", tmp_path)] == ["guardrails.b", "guardrails.a"]
    assert [cp.id for cp in checks.select("tp.a", tmp_path)] == ["tp.a"]
    with pytest.raises(CheckpointError, match="did you mean"):
        checks.select("guardrail.a", tmp_path)
    with pytest.raises(CheckpointError, match="unknown checkpoint 'cuda.b'"):
        checks.get_checkpoint("cuda.b", tmp_path)


def test_render_md_escapes_and_lists_why(tmp_path):
    _write(tmp_path, "setup", _cp(assertions=[{"path": "facts.a", "op": "eq", "value": 1, "why": "a | b"},
                                              {"path": "facts.b", "op": "exists", "why": "b is there"}]))
    md = checks.render_checkpoints_md(checks.load_checkpoints(tmp_path))
    row = [ln for ln in md.splitlines() if ln.startswith("| `setup.x`")]
    assert row == ["| `setup.x` | setup | cpu | `labkit x` | `runs/x.json` | a \\| b; b is there |"]
