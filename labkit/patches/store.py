"""The exercise patches under ``patches/``: list, show, apply, revert, status, and which are applied.

The engine ships with the lab's improvements built in; each patch here is a real ``git diff`` against
``engine/`` that restores the upstream nano-vllm behaviour (the "before"), so a learner can reproduce
the failure, then revert the patch (the "after") and watch the fix work. ``patches/patches.json`` says
which checkpoint judges each pair.

Applying and reverting go through ``git apply`` on the working tree: it checks every hunk first and
writes all or nothing, so a patch that does not apply leaves the tree untouched. Both refuse when
``engine/`` holds changes that no shipped patch explains (commit or stash them first).
"""
from __future__ import annotations

import difflib
import json
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

from labkit.errors import UserError
from labkit.evidence_format import engine_dir, source_hash
from labkit.paths import repo_root


@dataclass(frozen=True)
class Patch:
    name: str            # no-graph-fallback
    file: str            # 02-no-graph-fallback.patch
    title: str
    restores: str
    checkpoint: str
    guide: str

    @property
    def number(self) -> str:
        return self.file.split("-", 1)[0]

    def path(self, root: Path | None = None) -> Path:
        return patches_dir(root) / self.file

    def text(self) -> str:
        return self.path().read_text(encoding="utf-8")

    def files(self) -> list[str]:
        """The files the diff touches (``engine/...``)."""
        return sorted({line[6:].strip() for line in self.text().splitlines() if line.startswith("+++ b/")})

    def readme(self) -> Path:
        return self.path().with_suffix(".md")

    def to_dict(self) -> dict:
        return {**asdict(self), "files": self.files(), "readme": str(self.readme().relative_to(repo_root()))}


# --------------------------------------------------------------------------- the shipped set


def patches_dir(root: Path | None = None) -> Path:
    return (root or repo_root()) / "patches"


def load_patches(root: Path | None = None) -> list[Patch]:
    index = patches_dir(root) / "patches.json"
    if not index.is_file():
        raise UserError(f"no patch index at {index}")
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
        return [Patch(**p) for p in data["patches"]]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise UserError(f"{index}: not a valid patch index ({e})") from None


def find(name: str) -> Patch:
    """A patch by name (``no-graph-fallback``), file name (``02-no-graph-fallback[.patch]``) or number (``02``)."""
    patches = load_patches()
    key = name.strip().removesuffix(".patch")
    for p in patches:
        if key in (p.name, p.file.removesuffix(".patch"), p.number):
            return p
    names = [p.name for p in patches]
    close = difflib.get_close_matches(key, names, n=3, cutoff=0.4)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; known: {', '.join(names)}"
    raise UserError(f"unknown patch {name!r}{hint}")


# --------------------------------------------------------------------------- git apply


def engine_root() -> Path:
    """The directory holding ``engine/`` (the patches' paths are relative to it)."""
    edir = engine_dir()
    return edir.parent if edir is not None else repo_root()


def _git(args: list[str], cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", *args], cwd=cwd, input=stdin, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise UserError("git is not installed: patches are applied with `git apply`") from None


def git_apply(patch: Patch, root: Path, *, reverse: bool = False, check: bool = False) -> tuple[bool, str]:
    """``git apply [--reverse] [--check] PATCH`` at ``root``: (ok, git's first error line)."""
    args = ["apply", "--whitespace=nowarn"] + (["--reverse"] if reverse else []) + (["--check"] if check else [])
    proc = _git([*args, str(patch.path())], root)
    lines = [ln for ln in (proc.stderr or "").splitlines() if ln.strip()]
    return proc.returncode == 0, (lines[0] if lines else "")


def is_applied(patch: Patch, root: Path | None = None) -> bool:
    """Applied: its reverse applies cleanly and it does not apply forward again."""
    root = root or engine_root()
    return git_apply(patch, root, reverse=True, check=True)[0] and not git_apply(patch, root, check=True)[0]


@lru_cache(maxsize=8)
def _applied_cached(root: str, engine_hash: str | None) -> tuple[str, ...] | None:
    try:
        return tuple(p.name for p in load_patches() if is_applied(p, Path(root)))
    except (UserError, OSError, subprocess.SubprocessError):
        return None


def applied_patches(root: Path | None = None) -> list[str] | None:
    """Names of the shipped patches applied to the engine Python imports; None when that cannot be told
    (no git, no patch index). Cached per engine source hash, so evidence writing pays once."""
    root = root or engine_root()
    result = _applied_cached(str(root), source_hash(root / "engine"))
    return None if result is None else list(result)


# --------------------------------------------------------------------------- dirty engine


def _in_git(root: Path) -> bool:
    proc = _git(["rev-parse", "--show-toplevel"], root)
    return proc.returncode == 0 and Path(proc.stdout.strip()).resolve() == root.resolve()


def unexplained_changes(root: Path | None = None) -> list[str]:
    """Files under ``engine/`` that differ from HEAD in a way the applied patches do not explain.

    Outside a git checkout nothing can be compared: [] (``git apply --check`` still guards the tree)."""
    root = root or engine_root()
    if not _in_git(root):
        return []
    proc = _git(["status", "--porcelain", "--untracked-files=all", "--", "engine"], root)
    changed: list[str] = []
    for line in proc.stdout.splitlines():
        code, path = line[:2], line[3:].strip()
        if " -> " in path:
            path = path.split(" -> ", 1)[1]
        if "?" in code or "D" in code or "A" in code or "R" in code:
            return [path]          # new, deleted or renamed files: no shipped patch does that
        changed.append(path)
    if not changed:
        return []
    applied = [p for p in load_patches() if is_applied(p, root)]
    touched = sorted(set(changed) | {f for p in applied for f in p.files()})
    with tempfile.TemporaryDirectory(prefix="labkit-patch-") as tmp:
        base = Path(tmp)
        for f in touched:
            show = _git(["show", f"HEAD:{f}"], root)
            if show.returncode != 0:
                return [f]
            (base / f).parent.mkdir(parents=True, exist_ok=True)
            (base / f).write_text(show.stdout, encoding="utf-8")
        for p in applied:
            proc = _git(["apply", "--whitespace=nowarn", str(p.path())], base)
            if proc.returncode != 0:
                return list(p.files())
        return [f for f in changed if not (root / f).is_file()
                or (root / f).read_bytes() != (base / f).read_bytes()]


def _refuse_dirty(root: Path) -> None:
    dirty = unexplained_changes(root)
    if dirty:
        raise UserError(f"engine/ has changes no shipped patch explains ({', '.join(dirty)}); "
                        f"commit or stash them first (git diff -- engine/)")


def apply(name: str, root: Path | None = None) -> dict:
    """Apply one patch to the working tree, all or nothing. Returns the patch's status row."""
    patch, root = find(name), root or engine_root()
    if is_applied(patch, root):
        raise UserError(f"patch {patch.name} is already applied (labkit patch revert {patch.name} undoes it)")
    _refuse_dirty(root)
    ok, why = git_apply(patch, root, check=True)
    if not ok:
        raise UserError(f"patch {patch.name} does not apply to engine/: {why}")
    ok, why = git_apply(patch, root)
    if not ok:  # git apply writes nothing when any hunk fails
        raise UserError(f"patch {patch.name} failed to apply (tree unchanged): {why}")
    _applied_cached.cache_clear()
    return row(patch, root)


def revert(name: str, root: Path | None = None) -> dict:
    """Reverse one applied patch, all or nothing."""
    patch, root = find(name), root or engine_root()
    if not is_applied(patch, root):
        raise UserError(f"patch {patch.name} is not applied (labkit patch status shows what is)")
    _refuse_dirty(root)
    ok, why = git_apply(patch, root, reverse=True)
    if not ok:
        raise UserError(f"patch {patch.name} failed to revert (tree unchanged): {why}")
    _applied_cached.cache_clear()
    return row(patch, root)


def row(patch: Patch, root: Path | None = None) -> dict:
    """name, state (applied | not applied | conflicts), files, checkpoint, title."""
    root = root or engine_root()
    if is_applied(patch, root):
        state = "applied"
    elif git_apply(patch, root, check=True)[0]:
        state = "not applied"
    else:
        state = "conflicts"
    return {"name": patch.name, "file": patch.file, "state": state, "files": patch.files(),
            "checkpoint": patch.checkpoint, "title": patch.title}


def status(root: Path | None = None) -> dict:
    root = root or engine_root()
    rows = [row(p, root) for p in load_patches()]
    return {"engine": str(root / "engine"), "engine_source_hash": source_hash(root / "engine"),
            "patches": rows, "unexplained_changes": unexplained_changes(root)}


# --------------------------------------------------------------------------- a patched copy


def engine_copy(dest: Path, patch: Patch, applied: bool, root: Path | None = None) -> Path:
    """Copy ``engine/`` into ``dest`` and bring the copy to ``applied`` for ``patch`` (the live tree is
    never touched). Returns ``dest``; raise UserError when the patch does not fit the copy."""
    root = root or engine_root()
    shutil.copytree(root / "engine", dest / "engine", ignore=shutil.ignore_patterns("__pycache__"))
    live = is_applied(patch, root)
    if live != applied:
        ok, why = git_apply(patch, dest, reverse=not applied)
        if not ok:
            raise UserError(f"patch {patch.name} does not {'apply to' if applied else 'revert from'} a copy of engine/: {why}")
    return dest
