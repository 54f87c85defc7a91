"""Mutation tests: a deliberate fault in the engine must make the checkpoint that judges it FAIL.

Each case copies the project into a temporary directory, changes one thing in engine/ (an exact text
replacement that must match once, so a mutation can never silently become a no-op), and runs the
checkpoint's own command there, as `labkit run` would: in a process of its own on the copy (forked, with torch and
transformers already imported, by tests/labkit_forks.py, one forking process for the module). The unmutated copy
PASSes the same commands; every mutant must FAIL (exit 1, verdict FAIL). This is what makes a PASS mean something.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from labkit_forks import LabkitForks

REPO = Path(__file__).resolve().parents[2]
COPIED = ("engine", "serve", "labkit", "checkpoints", "workloads", "pyproject.toml", "CHECKPOINTS.md")

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
    "slot-off-by-one": (                    # a prefill's K/V written one slot further (InputBuilder.slots)
        "engine/step_inputs.py",
        "            shift = seq.block_table[b] * bs - b * bs            # slot = position + shift inside block b\n",
        "            shift = seq.block_table[b] * bs - b * bs + 1        # MUTANT\n",
        ("guardrails.logits-baseline",)),
    # RMSNorm with eps 2e-6 instead of 1e-6: a max abs logit error of ~3e-2 on the tiny model, inside the
    # calibrated CUDA float32 threshold (0.05): only the tight CPU float32 entry of the table sees it
    "rmsnorm-eps-doubled": (
        "engine/layers/layernorm.py",
        "        self.eps = eps\n",
        "        self.eps = eps * 2   # MUTANT: twice the config's rms_norm_eps\n",
        ("guardrails.logits-baseline",)),
    # the loader maps each checkpoint q_norm onto the model's k_norm and back (synthetic norms are distinct)
    "loader-swaps-q-k-norm": (
        "engine/loader.py",
        "                target, shard = name, None\n",
        "                target, shard = name, None\n"
        "                target = target.replace('q_norm', '@').replace('k_norm', 'q_norm').replace('@', 'k_norm')  # MUTANT\n",
        ("guardrails.logits-baseline",)),
    # an engine that reads rope_scaling but builds plain RoPE tables
    "rope-scaling-ignored": (
        "engine/models/qwen3.py",
        "        rope = RopeScaling.from_hf(cfg)\n",
        "        rope = RopeScaling(theta=RopeScaling.from_hf(cfg).theta)   # MUTANT: rope scaling ignored\n",
        ("models.rope-yarn", "models.rope-linear")),
    # yarn's frequencies right, its attention factor (cos/sin scaling) dropped
    "yarn-attention-factor-dropped": (
        "engine/layers/rotary.py",
        "        if self.attention_scaling != 1.0:\n",
        "        if False:   # MUTANT: yarn's attention factor dropped\n",
        ("models.rope-yarn",)),
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


def run_checkpoint(forks: LabkitForks, root: Path, cid: str, model: Path, runs: Path) -> tuple[int, str]:
    """The checkpoint's own command in the copy; returns (exit code, the evidence's verdict)."""
    spec = json.loads((root / "checkpoints" / f"{cid.split('.')[0]}.json").read_text())
    cp = next(c for c in spec["checkpoints"] if c["id"] == cid)
    evidence = runs / Path(cp["evidence"]).name
    proc = forks.run(root, *cp["command"][1:], "--out", str(evidence), "--model", str(model),
                     env={"LABKIT_RUNS_DIR": str(runs), "PYTHONUNBUFFERED": "1"})
    verdict = json.loads(evidence.read_text())["verdict"] if evidence.is_file() else "<no evidence>"
    return proc.returncode, verdict + ("" if proc.returncode in (0, 1) else f" | {proc.stderr[-400:]}")


@pytest.fixture(scope="module")
def control_run(forks, tiny_model_dir, tmp_path_factory):
    """The unmutated copy: (its root, the runs directory of each checkpoint, (exit code, verdict) of each)."""
    root = copy_project(tmp_path_factory.mktemp("control"))
    needed = sorted({cid for *_, cids in MUTATIONS.values() for cid in cids})
    runs = {cid: tmp_path_factory.mktemp("runs") for cid in needed}
    results = {cid: run_checkpoint(forks, root, cid, tiny_model_dir, runs[cid]) for cid in needed}
    return root, runs, results


@pytest.fixture(scope="module")
def control(control_run):
    """Every checkpoint the mutants must fail PASSes in the unmutated copy."""
    return control_run[2]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_a_broken_engine_fails_its_checkpoint(name, control, forks, tiny_model_dir, tmp_path):
    file, text, replacement, cids = MUTATIONS[name]
    for cid in cids:
        assert control[cid] == (0, "PASS"), f"control {cid}: {control[cid]}"
    root = copy_project(tmp_path / "repo")
    mutate(root, file, text, replacement)
    for cid in cids:
        code, verdict = run_checkpoint(forks, root, cid, tiny_model_dir, tmp_path / f"runs-{cid}")
        assert (code, verdict) == (1, "FAIL"), f"mutant {name}: {cid} gave exit {code}, verdict {verdict}"


def labkit_check(forks: LabkitForks, root: Path, runs: Path, cid: str):
    return forks.run(root, "check", cid, "--json", env={"LABKIT_RUNS_DIR": str(runs), "COLUMNS": "200"}, timeout=300)


@pytest.mark.slow
def test_an_edited_evidence_file_fails_labkit_check(control_run, forks):
    """The control's PASSing evidence, a number edited by hand: `labkit check` in the copy FAILs it."""
    root, runs, results = control_run
    cid = "guardrails.logits-baseline"
    assert results[cid] == (0, "PASS"), results[cid]
    ok = labkit_check(forks, root, runs[cid], cid)
    assert ok.returncode == 0 and json.loads(ok.stdout)[0]["verdict"] == "PASS", ok.stdout[-2000:] + ok.stderr[-2000:]
    spec = json.loads((root / "checkpoints" / "guardrails.json").read_text())
    evidence = runs[cid] / Path(next(c for c in spec["checkpoints"] if c["id"] == cid)["evidence"]).name
    text = evidence.read_text()
    rec = json.loads(text)
    rec["facts"]["worst_max_abs"] = rec["facts"]["worst_max_abs"] / 2       # a smaller error, still a PASS by itself
    evidence.write_text(json.dumps(rec, indent=2))
    try:
        bad = labkit_check(forks, root, runs[cid], cid)
        row = json.loads(bad.stdout)[0]
        assert bad.returncode == 1 and row["verdict"] == "FAIL", bad.stdout[-2000:]
        assert "edited after it was written" in json.dumps(row)
    finally:
        evidence.write_text(text)
