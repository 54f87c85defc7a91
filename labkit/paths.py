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


def _definition(file: Path, name: str) -> ast.stmt | None:
    """The def or class statement of ``name`` (Name or Class.method) in ``file``, else None."""
    scope: list[ast.stmt] = ast.parse(file.read_text(encoding="utf-8")).body
    node = None
    for part in name.split("."):
        node = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            return None
        scope = node.body if isinstance(node, ast.ClassDef) else []
    return node


def definition_line(file: Path, name: str | None) -> int | None:
    """The line where ``name`` (Name or Class.method) is defined in ``file`` (1 for the file alone), else None."""
    if not name:
        return 1
    node = _definition(file, name)
    return None if node is None else node.lineno


def definition_span(file: Path, name: str | None) -> tuple[int, int] | None:
    """The lines (first, last) of ``name``'s definition in ``file``, its decorators included (the whole file for
    ``name`` None), else None."""
    if not name:
        return 1, max(1, len(file.read_text(encoding="utf-8").splitlines()))
    node = _definition(file, name)
    if node is None:
        return None
    return min([node.lineno] + [d.lineno for d in node.decorator_list]), node.end_lineno or node.lineno
