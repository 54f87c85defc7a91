"""`labkit report --pack`: the learner's evidence in one archive (labkit/writeup/pack.py)."""
from __future__ import annotations

import hashlib
import json
import tarfile

from labkit.paths import repo_root
from labkit.writeup.pack import TOP, pack_evidence

ROOT = repo_root()


def _members(path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def _fake_root(tmp_path):
    """A repository-shaped folder: the rules, code, patches, workloads, notes (a learner's note and a template)."""
    root = tmp_path / "repo"
    for name, text in {"README.md": "readme", "CHECKPOINTS.md": "cps", "pyproject.toml": "[project]",
                       "checkpoints/setup.json": "{}", "engine/llm_engine.py": "x = 1",
                       "engine/attention/backend.py": "y = 2", "engine/__pycache__/llm_engine.cpython-312.pyc": "",
                       "serve/app.py": "z = 3", "patches/01.patch": "diff", "workloads/w.jsonl": "{}",
                       "notes/README.md": "how", "notes/scheduler.md": "my notes", "notes/templates/t.md": "t"}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    runs = tmp_path / "runs"
    (runs / "sub").mkdir(parents=True)
    (runs / "a.json").write_text('{"verdict": "PASS"}')
    (runs / "sub" / "b.png").write_bytes(b"\x89PNG")
    (runs / "a.npz").write_bytes(b"\0" * 64)
    return root, runs


def test_the_archive_holds_rules_code_evidence_and_notes_with_a_manifest_that_matches(tmp_path):
    root, runs = _fake_root(tmp_path)
    out = runs / "learning-evidence.tar.gz"
    manifest = pack_evidence(out, root, runs)
    files = _members(out)
    names = {n.removeprefix(f"{TOP}/") for n in files}
    assert all(n.startswith(f"{TOP}/") for n in files)
    assert names == {"MANIFEST.json", "README.md", "CHECKPOINTS.md", "pyproject.toml", "checkpoints/setup.json",
                     "engine/llm_engine.py", "engine/attention/backend.py", "serve/app.py", "patches/01.patch",
                     "workloads/w.jsonl", "runs/a.json", "runs/sub/b.png", "notes/README.md", "notes/scheduler.md"}
    stored = json.loads(files[f"{TOP}/MANIFEST.json"])
    assert stored["files"] == manifest["files"] and set(stored["files"]) == names - {"MANIFEST.json"}
    for name, meta in stored["files"].items():          # each file's digest is its stored bytes'
        data = files[f"{TOP}/{name}"]
        assert meta == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    assert stored["left_out"] == [{"file": "runs/a.npz", "why": "64 bytes of arrays (--with-arrays keeps them)"}]
    assert stored["evidence_files"] == 1 and stored["notes_files"] == 1


def test_arrays_on_request_and_never_the_archive_itself(tmp_path):
    root, runs = _fake_root(tmp_path)
    out = runs / "learning-evidence.tar.gz"
    pack_evidence(out, root, runs)
    manifest = pack_evidence(out, root, runs, with_arrays=True)        # a second pack beside the first
    names = set(_members(out))
    assert f"{TOP}/runs/a.npz" in names and manifest["left_out"] == []
    assert not any(n.endswith(".tar.gz") or n.endswith(".part") for n in names)


def test_report_pack_writes_the_archive_beside_the_report(runs, labkit_in_process):
    runs.mkdir(parents=True, exist_ok=True)
    (runs / "x.json").write_text("{}")
    r = labkit_in_process("report", "--pack", "--no-plots", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    pack = json.loads(r.stdout)["pack"]
    names = set(_members(runs / "learning-evidence.tar.gz"))
    assert pack["path"] == str(runs / "learning-evidence.tar.gz") and pack["files"] == len(names) - 1
    assert {f"{TOP}/runs/final-report.json", f"{TOP}/runs/environment.txt", f"{TOP}/runs/x.json",
            f"{TOP}/engine/llm_engine.py", f"{TOP}/checkpoints/setup.json", f"{TOP}/README.md"} <= names
    assert len([n for n in names if n.startswith(f"{TOP}/engine/")]) == len(
        [p for p in (ROOT / "engine").rglob("*.py") if "__pycache__" not in p.parts])


def test_pack_options_refused_in_one_line(labkit_in_process):
    for args in (("report", "--pack", "--inputs", "a.jsonl"), ("report", "--with-arrays")):
        r = labkit_in_process(*args)
        assert r.returncode == 2 and len((r.stdout + r.stderr).strip().splitlines()) == 1, r.stdout + r.stderr
