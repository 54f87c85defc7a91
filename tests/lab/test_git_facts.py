"""Evidence records git facts only when the project root is the repository's root."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from labkit import evidence, paths

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _repo(path):
    path.mkdir(parents=True, exist_ok=True)
    env = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    (path / "f.txt").write_text("x\n")
    subprocess.run(["git", *env, "-C", str(path), "add", "f.txt"], check=True)
    subprocess.run(["git", *env, "-C", str(path), "commit", "-q", "-m", "one"], check=True)
    return subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_a_project_inside_another_repository_records_no_git_head(tmp_path, monkeypatch):
    head = _repo(tmp_path / "home")
    project = tmp_path / "home" / "unpacked" / "nano-lab"      # e.g. a tarball unpacked in a dotfiles repo
    project.mkdir(parents=True)
    assert evidence.git_head(tmp_path / "home") == head          # the repository's own root: recorded
    assert evidence.git_head(project) is None and evidence.git_dirty(project) is None
    monkeypatch.setattr(paths, "repo_root", lambda: project)
    env = evidence.envelope(kind="static")
    assert env["git_head"] is None and env["git_dirty"] is None
