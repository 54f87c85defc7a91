"""Quick walk A-D and smoke end to end on the tiny synthetic model, judged by their checkpoints."""
import json

import pytest

from labkit.checks import check_evidence, get_checkpoint
from labkit.experiments.quick_walk import run_quick_walk
from labkit.experiments.smoke import run_smoke

VARIANTS = [
    ("A", {}, "setup.quick-walk-a"),
    ("B", {}, "setup.quick-walk-b"),
    ("B", {"max_num_seqs": 1}, "setup.quick-walk-b-seqs1"),
    ("C", {}, "setup.quick-walk-c"),
    ("D", {}, "setup.quick-walk-d"),
    ("D", {"budget": 256}, "setup.quick-walk-d-256"),
]


@pytest.mark.parametrize("case,options,cp", VARIANTS, ids=[v[2] for v in VARIANTS])
def test_quick_walk_case_passes_its_checkpoint(tiny_model_dir, tmp_path, case, options, cp, labkit_argv):
    labkit_argv.checkpoint(cp, "--out", str(tmp_path / f"{case}.json"))
    out = tmp_path / f"{case}.json"
    record = run_quick_walk(case, out=out, model=str(tiny_model_dir), trace=True, **options)
    failed = [c for c in record["checks"] if not c["passed"]]
    assert record["checkpoint"] == cp and record["verdict"] == "PASS", failed
    assert record["kind"] == "cpu-real-engine" and record["model"]["synthetic"]
    verdict, _ = check_evidence(get_checkpoint(cp), out)      # labkit check re-judges the same file
    assert verdict == "PASS"


def test_a_trace_records_before_and_after_each_step(tiny_model_dir, tmp_path):
    rec = run_quick_walk("A", out=tmp_path / "a.json", model=str(tiny_model_dir), trace=True)
    steps = rec["facts"]["steps"]
    assert [s["before"][0]["scheduled"] for s in steps] == [3, 1, 1]
    assert all(len(s["after"]["accepted"]) == 1 for s in steps)
    assert steps[-1]["after"]["freed_blocks"] and steps[-1]["after"]["seqs"][0]["block_table"] == []


def test_without_trace_the_step_log_is_left_out(tiny_model_dir, tmp_path):
    rec = run_quick_walk("A", out=tmp_path / "a.json", model=str(tiny_model_dir), trace=False)
    assert "steps" not in rec["facts"]
    assert rec["facts"]["derived"]["tcs_first"] == [[3, 0, 3], [4, 3, 1], [5, 4, 1]]


def test_a_tampered_evidence_file_fails_the_recheck(tiny_model_dir, tmp_path, labkit_argv):
    labkit_argv.checkpoint("setup.quick-walk-d")
    out = tmp_path / "d.json"
    run_quick_walk("D", out=out, model=str(tiny_model_dir), trace=True)
    assert check_evidence(get_checkpoint("setup.quick-walk-d"), out)[0] == "PASS"
    data = json.loads(out.read_text())
    data["facts"]["step_digest"][1]["cu_seqlens_q"] = [0, 187, 220]
    out.write_text(json.dumps(data))
    verdict, checks = check_evidence(get_checkpoint("setup.quick-walk-d"), out)
    assert verdict == "FAIL"


def test_env_trace_prints_one_line_per_step(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LABKIT_TRACE", "1")
    run_quick_walk("A", out=tmp_path / "a.json", model=str(tiny_model_dir))
    lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("event=engine_step")]
    assert len(lines) == 3
    assert ":3/0/3" in lines[0] and ":4/3/1" in lines[1] and ":5/4/1" in lines[2]


def test_smoke_two_tokens_through_the_chat_template(tiny_model_dir, tmp_path, labkit_argv):
    labkit_argv.checkpoint("setup.smoke")
    rec = run_smoke(out=tmp_path / "smoke.json", model=str(tiny_model_dir))
    assert rec["verdict"] == "PASS"
    assert rec["facts"]["output_token_counts"] == [2] and rec["facts"]["kv_blocks"] > 0
    assert "synthetic" in rec["facts"]["note"]
