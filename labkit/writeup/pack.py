"""``labkit report --pack``: the learner's evidence in one archive, ``runs/learning-evidence.tar.gz``.

It holds what someone needs to judge the work without the machine it ran on:

- the lab's rules: README.md, CHECKPOINTS.md and the checkpoint definitions (checkpoints/*.json)
- the code as it ran: engine/ and serve/ (Python sources of the working tree, the learner's changes included),
  the shipped patches (patches/) and the workloads (workloads/)
- the evidence: everything under runs/ (the final report, environment.txt and engine-changes.patch among it, when
  ``labkit report`` wrote them), except the NPZ arrays unless asked for (they are the bulk, and every verdict is
  re-judged from the JSON)
- the learner's notes (notes/, templates left out)
- MANIFEST.json: the commit, whether the tree was dirty, and each file's size and sha256; what was left out, and why

Files are stored under one top folder, ``learning-evidence/``, so unpacking never scatters them.
"""
from __future__ import annotations

import io
import json
import tarfile
import time
from pathlib import Path

from labkit.assets.files import sha256_file
from labkit.evidence import git_dirty, git_head, utc_stamp

TOP = "learning-evidence"
ARCHIVE_NAME = "learning-evidence.tar.gz"
RULES = ("README.md", "CHECKPOINTS.md", "pyproject.toml")
#: (folder, glob): the code and inputs, as they are in the working tree
TREES = (("checkpoints", "*.json"), ("engine", "*.py"), ("serve", "*.py"), ("patches", "*"), ("workloads", "*"))
ARRAYS = (".npz",)


def _files(base: Path, pattern: str) -> list[Path]:
    return sorted(p for p in base.rglob(pattern) if p.is_file() and "__pycache__" not in p.parts)


def gather(root: Path, runs: Path, with_arrays: bool = False, exclude: tuple[Path, ...] = ()) -> tuple[dict, list]:
    """{archive name: file} of what the archive holds, and [(name, reason)] of what it leaves out."""
    chosen: dict[str, Path] = {}
    left_out: list[tuple[str, str]] = []
    for name in RULES:
        if (root / name).is_file():
            chosen[name] = root / name
    for folder, pattern in TREES:
        for p in _files(root / folder, pattern):
            chosen[p.relative_to(root).as_posix()] = p
    skip = {e.resolve() for e in exclude}
    for p in _files(runs, "*") if runs.is_dir() else []:
        name = "runs/" + p.relative_to(runs).as_posix()
        if p.resolve() in skip or p.name == ARCHIVE_NAME:
            continue
        if p.suffix in ARRAYS and not with_arrays:
            left_out.append((name, f"{p.stat().st_size} bytes of arrays (--with-arrays keeps them)"))
            continue
        chosen[name] = p
    notes = root / "notes"
    for p in _files(notes, "*") if notes.is_dir() else []:
        rel = p.relative_to(root).as_posix()
        if "templates" in p.relative_to(notes).parts:
            continue
        chosen[rel] = p
    return chosen, left_out


def pack_evidence(out: Path, root: Path, runs: Path, with_arrays: bool = False) -> dict:
    """Write the archive to ``out`` (a .tar.gz) and return its manifest (with ``path`` and ``bytes``)."""
    out = Path(out)
    chosen, left_out = gather(root, runs, with_arrays, exclude=(out,))
    manifest = {
        "kind": "learning-evidence",
        "created": utc_stamp(),
        "git_head": git_head(root),
        "git_dirty": git_dirty(root),
        "files": {name: {"bytes": p.stat().st_size, "sha256": sha256_file(p).hexdigest()} for name, p in sorted(chosen.items())},
        "left_out": [{"file": n, "why": why} for n, why in left_out],
        "evidence_files": sum(1 for n in chosen if n.startswith("runs/") and n.endswith(".json")),
        "notes_files": sum(1 for n in chosen if n.startswith("notes/") and n != "notes/README.md"),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    with tarfile.open(tmp, "w:gz") as tar:
        data = json.dumps(manifest, indent=1).encode()
        info = tarfile.TarInfo(f"{TOP}/MANIFEST.json")
        info.size, info.mtime = len(data), int(time.time())
        tar.addfile(info, io.BytesIO(data))
        for name, p in sorted(chosen.items()):
            tar.add(p, arcname=f"{TOP}/{name}", recursive=False)
    tmp.replace(out)
    return manifest | {"path": str(out), "bytes": out.stat().st_size}
