"""notes/templates: one per lab step, `labkit notes new` fills in the evidence; docs/LAB.md is the guide the
help texts, the templates and the patches point at."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from labkit.writeup import notes
from labkit.paths import repo_root
from testkit import labkit_process as labkit

ROOT = repo_root()


@pytest.fixture
def runs(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "runs"
    monkeypatch.setenv("LABKIT_RUNS_DIR", str(d))
    monkeypatch.setenv("LABKIT_NOTES_DIR", str(tmp_path / "notes"))
    return d


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def lab_anchors() -> set[str]:
    text = (ROOT / "docs" / "LAB.md").read_text(encoding="utf-8")
    return {_slug(m.group(1)) for m in re.finditer(r"^#{2,3} (.+)$", text, re.M)}


def test_every_step_has_a_template_that_names_real_checkpoints_and_guide_sections():
    from labkit.checks import get_checkpoint

    templates = notes.load_templates()
    assert len(templates) >= 17
    anchors = lab_anchors()
    for t in templates:
        assert t.guide.startswith("docs/LAB.md#") and t.guide.split("#", 1)[1] in anchors, (t.step, t.guide)
        for cid in t.checkpoints:
            get_checkpoint(cid)
        assert {c for _, c, _ in t.facts} <= set(t.checkpoints), t.step
    handbook_named = {"engine-logits", "service-runtime", "scheduling-change", "execution-change", "parallel-service",
                      "service-lifecycle", "tokenizer", "attention", "kv-cache-math", "memory-budget", "lifecycle",
                      "scheduler", "kv-pages", "model-execution", "graph-fallback", "prefix-cache"}
    assert handbook_named <= {t.step for t in templates}


def test_patch_guides_point_at_lab_sections():
    from labkit.patches.store import load_patches

    anchors = lab_anchors()
    for p in load_patches():
        assert p.guide.split("#", 1)[1] in anchors, p.guide


def test_notes_new_fills_the_facts_and_refuses_to_overwrite(runs, balanced_evidence):
    (runs / "patches").mkdir(parents=True)
    (runs / "patches" / "no-balanced-policy.json").write_text(balanced_evidence.read_text())
    r = labkit("notes", "new", "scheduling-change")
    assert r.returncode == 0, r.stdout + r.stderr
    text = (notes.notes_dir() / "scheduling-change.md").read_text()
    assert "labkit notes:" not in text and "<!-- facts -->" not in text
    assert "| `patches.no-balanced-policy` | PASS | cpu-real-scheduler | `runs/patches/no-balanced-policy.json` |" in text
    assert '| after: served in 3 decodes | [1, 2, 3, 4, 5, 6] |' in text
    assert "`service.mixed-gpu` has no evidence yet: run `labkit load" in text
    again = labkit("notes", "new", "scheduling-change")
    assert again.returncode == 2 and "exists" in again.stderr
    assert labkit("notes", "new", "scheduling-change", "--force").returncode == 0


def test_notes_unknown_step_is_one_line(runs):
    r = labkit("notes", "new", "quick-wlak")
    assert r.returncode == 2 and "did you mean quick-walk" in r.stdout + r.stderr


def test_readme_links_the_lab_guide_and_help_does_not_cite_the_handbook():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "docs/LAB.md" in readme
    for f in (ROOT / "labkit" / "cli").glob("*.py"):
        assert not re.search(r"[Hh]andbook \d|\bB\.\d", f.read_text(encoding="utf-8")), f.name
