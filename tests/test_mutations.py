"""Mutation tests: a deliberate fault in the engine must make the checkpoint that judges it FAIL.

Each case copies the project into a temporary directory, changes one thing in engine/ (an exact text
replacement that must match once, so a mutation can never silently become a no-op), and runs the
checkpoint's own command there, as `labkit run` would. The unmutated copy PASSes the same commands;
every mutant must FAIL (exit 1, verdict FAIL). This is what makes a PASS mean something.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COPIED = ("engine", "labkit", "checkpoints", "workloads", "pyproject.toml", "CHECKPOINTS.md")

# name -> (file, text, replacement, checkpoints that must FAIL)
MUTATIONS = {
    "rope-one-position": (
        "engine/layers/rotary.py",
        "        # q: [T, Hq, D], k: [T, Hk, D]\n",
        "        positions = torch.where(positions == 5, positions + 1, positions)   # MUTANT: one wrong position\n",
        ("guardrails.logits-baseline",)),
    "dropped-kv-block": (
        "engine/attention/torch_backend.py",
        "        keep = slot_mapping >= 0\n",
        "        keep = (slot_mapping >= 0) & (slot_mapping // k_cache.shape[1] != 1)   # MUTANT: block 1 never written\n",
        ("guardrails.logits-baseline",)),
    "slot-off-by-one": (
        "engine/model_runner.py",
        "        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size\n",
        "        return seq.block_table[position // self.block_size] * self.block_size + (position + 1) % self.block_size  # MUTANT\n",
        ("guardrails.logits-baseline",)),
}


def copy_project(dest: Path) -> Path:
    for name in COPIED:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dest / name)
    return dest


def mutate(root: Path, file: str, text: str, replacement: str) -> None:
    path = root / file
    source = path.read_text(encoding="utf-8")
    assert source.count(text) == 1, f"mutation target not found exactly once in {file}: {text!r}"
    path.write_text(source.replace(text, replacement), encoding="utf-8")


def run_checkpoint(root: Path, cid: str, model: Path, runs: Path) -> tuple[int, str]:
    """The checkpoint's own command in the copy; returns (exit code, the evidence's verdict)."""
    spec = json.loads((root / "checkpoints" / f"{cid.split('.')[0]}.json").read_text())
    cp = next(c for c in spec["checkpoints"] if c["id"] == cid)
    evidence = runs / Path(cp["evidence"]).name
    cmd = [sys.executable, "-m", "labkit", *cp["command"][1:], "--out", str(evidence), "--model", str(model)]
    env = {**os.environ, "PYTHONPATH": str(root), "LABKIT_RUNS_DIR": str(runs), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    verdict = json.loads(evidence.read_text())["verdict"] if evidence.is_file() else "<no evidence>"
    return proc.returncode, verdict + ("" if proc.returncode in (0, 1) else f" | {proc.stderr[-400:]}")


@pytest.fixture(scope="module")
def control(tiny_model_dir, tmp_path_factory):
    """The unmutated copy: every checkpoint the mutants must fail PASSes here."""
    root = copy_project(tmp_path_factory.mktemp("control"))
    needed = sorted({cid for *_, cids in MUTATIONS.values() for cid in cids})
    results = {cid: run_checkpoint(root, cid, tiny_model_dir, tmp_path_factory.mktemp("runs")) for cid in needed}
    return results


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_a_broken_engine_fails_its_checkpoint(name, control, tiny_model_dir, tmp_path):
    file, text, replacement, cids = MUTATIONS[name]
    for cid in cids:
        assert control[cid] == (0, "PASS"), f"control {cid}: {control[cid]}"
    root = copy_project(tmp_path / "repo")
    mutate(root, file, text, replacement)
    for cid in cids:
        code, verdict = run_checkpoint(root, cid, tiny_model_dir, tmp_path / f"runs-{cid}")
        assert (code, verdict) == (1, "FAIL"), f"mutant {name}: {cid} gave exit {code}, verdict {verdict}"
