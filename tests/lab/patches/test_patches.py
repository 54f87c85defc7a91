"""patches/: every patch applies to engine/ and reverts on a clean copy of the repository, refusals leave
the tree untouched, and the CPU before/after checkpoints PASS with the patch applied and reverted.

The real working tree is never touched: each test copies the repository into tmp_path and `git init`s it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from labkit_forks import LabkitForks

from labkit.paths import repo_root
from labkit.patches.store import load_patches

ROOT = repo_root()
PATCHES = load_patches()
CPU_CHECKS = {"no-step-trace", "no-balanced-policy", "fixed-tp-address"}


def _git(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd,
                          capture_output=True, text=True, check=True)


@pytest.fixture
def repo(tmp_path) -> Path:
    """A clean git checkout of engine/, labkit/, patches/ and checkpoints/ in tmp_path."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    dest = tmp_path / "repo"
    for f in files:
        if f.split("/", 1)[0] in ("engine", "labkit", "patches", "checkpoints") and (ROOT / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dest / f)
    _git(dest, "init", "-q")
    _git(dest, "add", "-A")
    _git(dest, "commit", "-q", "-m", "clean")
    return dest


def labkit(forks: LabkitForks, repo: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python -m labkit ARGS`` in its own process on the copy ``repo`` (its path, cwd and runs/)."""
    return forks.run(repo, *args, env={"LABKIT_RUNS_DIR": str(repo / "runs"), "COLUMNS": "200"}, timeout=timeout)


def _clean(repo: Path) -> bool:
    return _git(repo, "status", "--porcelain", "--", "engine").stdout.strip() == ""


def test_every_patch_is_a_git_diff_that_applies_to_engine():
    assert {p.name for p in PATCHES} >= {"no-graph-fallback", "no-balanced-policy", "fixed-tp-address"}
    for p in PATCHES:
        text = p.text()
        assert text.startswith("diff --git a/engine/"), p.file
        assert p.files() and all(f.startswith("engine/") for f in p.files())
        assert p.readme().is_file(), f"{p.file} has no README"
        proc = subprocess.run(["git", "apply", "--check", str(p.path())], cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode == 0 or subprocess.run(  # applied already in this tree: its reverse applies
            ["git", "apply", "--check", "--reverse", str(p.path())], cwd=ROOT).returncode == 0, proc.stderr


def test_each_patch_has_its_checkpoint():
    from labkit.checks import get_checkpoint

    for p in PATCHES:
        cp = get_checkpoint(p.checkpoint)
        assert cp.command[:3] == ["labkit", "patch", "check"] and cp.command[3] == p.name
        assert cp.needs == ("cuda" if p.name not in CPU_CHECKS else "cpu")


def test_apply_and_revert_round_trip_every_patch(repo, forks):
    original = {p: p.read_bytes() for p in (repo / "engine").rglob("*.py")}
    for p in PATCHES:
        r = labkit(forks, repo, "patch", "apply", p.name)
        assert r.returncode == 0, r.stderr
        assert not _clean(repo)
        st = json.loads(labkit(forks, repo, "patch", "status", "--json").stdout)
        assert [x["name"] for x in st["patches"] if x["state"] == "applied"] == [p.name]
        assert st["unexplained_changes"] == []
        again = labkit(forks, repo, "patch", "apply", p.name)
        assert again.returncode == 2 and "already applied" in again.stderr
        r = labkit(forks, repo, "patch", "revert", p.number)
        assert r.returncode == 0, r.stderr
        assert _clean(repo)
    assert {p: p.read_bytes() for p in (repo / "engine").rglob("*.py")} == original


def test_patches_stack_and_unstack(repo, forks):
    for p in PATCHES:
        assert labkit(forks, repo, "patch", "apply", p.file).returncode == 0
    st = json.loads(labkit(forks, repo, "patch", "status", "--json").stdout)
    assert all(x["state"] == "applied" for x in st["patches"]) and st["unexplained_changes"] == []
    for p in reversed(PATCHES):
        assert labkit(forks, repo, "patch", "revert", p.name).returncode == 0
    assert _clean(repo)


def test_refuses_a_dirty_engine_and_leaves_it_alone(repo, forks):
    target = repo / "engine" / "sequence.py"
    target.write_text(target.read_text() + "\n# my own change\n")
    before = {p: p.read_bytes() for p in (repo / "engine").rglob("*.py")}
    r = labkit(forks, repo, "patch", "apply", "no-balanced-policy")
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "engine/sequence.py" in lines[0] and "Traceback" not in r.stderr
    assert {p: p.read_bytes() for p in (repo / "engine").rglob("*.py")} == before


def test_refuses_a_patch_that_does_not_apply_without_touching_the_tree(repo, forks):
    graph = repo / "engine" / "graph.py"
    graph.write_text(graph.read_text().replace("def bucket_for(self, batch: int) -> int | None:",
                                               "def bucket_for(self, batch: int, *, strict: bool = False) -> int | None:"))
    _git(repo, "commit", "-qam", "a change of my own")
    scheduler = (repo / "engine" / "scheduler.py").read_bytes()
    r = labkit(forks, repo, "patch", "apply", "02")
    assert r.returncode == 2 and "does not apply" in r.stderr and "Traceback" not in r.stderr
    assert _clean(repo) and (repo / "engine" / "scheduler.py").read_bytes() == scheduler


def test_unknown_patch_is_one_line():
    from labkit.errors import UserError
    from labkit.patches.store import find

    with pytest.raises(UserError, match="unknown patch 'no-balanced'.*no-balanced-policy"):
        find("no-balanced")


def test_evidence_records_the_applied_patches(repo, forks, tiny_model_dir):
    assert labkit(forks, repo, "patch", "apply", "no-balanced-policy").returncode == 0
    code = ("from labkit.evidence import envelope; import json; "
            "print(json.dumps(envelope(kind='static')['engine_patches']))")
    env = {**os.environ, "PYTHONPATH": str(repo)}
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == ["no-balanced-policy"]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CPU_CHECKS))
def test_cpu_before_after_checkpoint_passes_applied_and_reverted(repo, forks, tiny_model_dir, name):
    """The pair is judged the same whichever state the tree is in; the evidence says which."""
    states = ("applied", "reverted") if name == "no-balanced-policy" else ("applied",)
    for state in states:
        if state == "applied":
            assert labkit(forks, repo, "patch", "apply", name).returncode == 0
        else:
            assert labkit(forks, repo, "patch", "revert", name).returncode == 0
        evidence = repo / "runs" / "patches" / f"{name}.json"
        r = labkit(forks, repo, "patch", "check", name, "--model", str(tiny_model_dir), "--out", str(evidence))
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        record = json.loads(evidence.read_text())
        assert record["verdict"] == "PASS"
        assert record["facts"]["live_state"].startswith("before" if state == "applied" else "after")
        assert record["engine_patches"] == ([name] if state == "applied" else [])
        # re-judged by the copy's own labkit, against the copy's engine (this process imports another tree)
        rejudged = labkit(forks, repo, "check", f"patches.{name}", "--json")
        assert rejudged.returncode == 0 and json.loads(rejudged.stdout)[0]["verdict"] == "PASS", rejudged.stdout[-2000:]
        assert record["facts"]["before"]["engine_source_hash"] != record["facts"]["after"]["engine_source_hash"]


def test_a_probe_that_did_not_run_fails(tmp_path, monkeypatch, labkit_argv):
    """The 'probe ran' assertion reads the side's measured ``ok`` (its process completed and reported facts)."""
    import labkit.experiments.patch_check as pc

    monkeypatch.setattr(pc, "run_side", lambda patch, applied, model=None:
                        {"ok": False, "error": "probe exited 1: boom"} if applied else
                        {"ok": True, "kind": "cpu-real-scheduler", "facts": {}, "engine_source_hash": "x"})
    labkit_argv("patch", "check", "no-balanced-policy")
    rec = pc.run_patch_check("no-balanced-policy", tmp_path / "p.json")
    failed = [c["name"] for c in rec["checks"] if c["status"] == "fail"]
    assert rec["verdict"] == "FAIL" and "before probe ran" in failed and "after probe ran" not in failed
    assert rec["facts"]["before"]["ok"] is False and "unjudged_checks" not in rec


@pytest.mark.slow
def test_lab_step3_patch_experiment_keeps_the_unpatched_pass(repo, forks, tiny_model_dir):
    """docs/LAB.md §3: walk A with --trace (PASS), apply no-step-trace, walk A again: the patched run's
    evidence lands under runs/patched/no-step-trace/ and its verdict line names the patch; the PASS at the
    checkpoint's path is the same bytes; after the revert `labkit check` PASSes it again."""
    walk = ("quick-walk", "--case", "A", "--trace", "--model", str(tiny_model_dir))
    slot = repo / "runs" / "quick-walk-a.json"
    assert labkit(forks, repo, *walk).returncode == 0
    kept = slot.read_bytes()
    assert json.loads(kept)["verdict"] == "PASS"
    assert labkit(forks, repo, "patch", "apply", "no-step-trace").returncode == 0
    patched = labkit(forks, repo, *walk)
    moved = repo / "runs" / "patched" / "no-step-trace" / "quick-walk-a.json"
    record = json.loads(moved.read_text())
    assert record["engine_patches"] == ["no-step-trace"] and record["verdict"] != "PASS"
    line = next(ln for ln in patched.stdout.splitlines() if "setup.quick-walk-a" in ln and "evidence:" in ln)
    assert line.startswith(record["verdict"]) and "engine patch: no-step-trace" in line, line
    assert slot.read_bytes() == kept
    assert labkit(forks, repo, "patch", "revert", "no-step-trace").returncode == 0
    rejudged = labkit(forks, repo, "check", "setup.quick-walk-a", "--json")
    assert json.loads(rejudged.stdout)[0]["verdict"] == "PASS", rejudged.stdout[-2000:]
