"""Fixtures of the lab tests: the `labkit` command run in process or as a process, and the engines they build.

``labkit_in_process(*args, env=None)`` runs the real app (every command registered) through Typer's CliRunner
and answers like a subprocess: ``returncode``, ``stdout``, ``stderr``. An exception that escapes the app (what
a process would print as a traceback) is added to ``stderr`` as a ``Traceback`` line, so a test that asserts
"no traceback" FAILs on it as it would on the process's stderr.
``labkit_process(*args, env=None)`` runs ``python -m labkit ARGS`` from the repository root (testkit.labkit_process: a subprocess,
~2.5 CPU-s of imports before the command starts; for what is about the process: exit status, stderr, stdin,
signals).
``lab_engine(**kw)`` builds an ``LLMEngine`` on the session's tiny model through the root ``engine_factory``
(``testkit.ENGINE_DEFAULTS``, keywords override them; closed at the end of the module).
The root conftest (tests/conftest.py) keeps ``cli_app``, ``labkit_argv``, ``runs`` and ``tiny_model_dir``."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import pytest
import testkit

REPO = Path(__file__).resolve().parents[2]


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str
    exception: BaseException | None = None


def run_in_process(app, *args, env: dict | None = None) -> CliResult:
    from typer.testing import CliRunner

    res = CliRunner().invoke(app, [str(a) for a in args], env=env)
    escaped = None if res.exception is None or isinstance(res.exception, SystemExit) else res.exception
    stderr = res.stderr
    if escaped is not None:
        stderr += f"\nTraceback: {type(escaped).__name__}: {escaped} escaped the app\n"
    return CliResult(res.exit_code, res.stdout, stderr, escaped)


@pytest.fixture
def labkit_in_process(cli_app):
    def run(*args, env: dict | None = None) -> CliResult:
        return run_in_process(cli_app, *args, env=env)

    return run


@pytest.fixture
def labkit_process():
    """testkit.labkit_process from the repository root."""
    return functools.partial(testkit.labkit_process, cwd=REPO)


@pytest.fixture(scope="module")
def lab_engine(engine_factory):
    return engine_factory
