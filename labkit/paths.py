"""Where things are: the repository root, ``runs/`` (or ``$LABKIT_RUNS_DIR``), default evidence paths, and the
line where a function is defined in a source file.

Imports nothing from labkit, so every module (the evidence writer, the judge, the commands) can use it.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

#: Environment variable that moves ``runs/`` elsewhere (tests, parallel runs).
RUNS_DIR_ENV = "LABKIT_RUNS_DIR"


def repo_root() -> Path:
    """The directory above the ``labkit`` package (the repository root in a checkout)."""
    return Path(__file__).resolve().parent.parent


def runs_dir() -> Path:
    """Where evidence goes: ``$LABKIT_RUNS_DIR`` if set, else ``<repo>/runs``."""
    override = os.environ.get(RUNS_DIR_ENV)
    return Path(override).expanduser().resolve() if override else repo_root() / "runs"


def default_out(name: str) -> Path:
    """``runs/<name>``; creates ``runs/`` if needed."""
    base = runs_dir()
    base.mkdir(parents=True, exist_ok=True)
    return base / name


def definition_line(file: Path, name: str | None) -> int | None:
    """The line where ``name`` (Name or Class.method) is defined in ``file`` (1 for the file alone), else None."""
    if not name:
        return 1
    scope: list[ast.stmt] = ast.parse(file.read_text(encoding="utf-8")).body
    node = None
    for part in name.split("."):
        node = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            return None
        scope = node.body if isinstance(node, ast.ClassDef) else []
    return node.lineno
