"""Where things are: the repository root, ``runs/`` (or ``$LABKIT_RUNS_DIR``) and default evidence paths.

Imports nothing from labkit, so every module (the evidence writer, the judge, the commands) can use it.
"""

from __future__ import annotations

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
