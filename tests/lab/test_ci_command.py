"""`.ci/run` is the README's test command, and pyproject declares the versions that command resolves.

A newcomer copies README.md's "Run the tests" block; CI runs `.ci/run`. When CI installed `triton==3.6.0` before
the README's command (a step the README did not have), CI was green while the README's command failed on a fresh
machine (the newest triton's interpreter refused a kernel's mask). So: `.ci/run` holds the README's command as one
line, verbatim, as its last command (pytest's exit code is the script's), and installs nothing else with pip; the
README's two commands ("Run the lab", "Run the tests") install the same things.
"""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
INSTALLERS = re.compile(r"\b(pip3?|uv|conda|mamba|pipx|easy_install)\b|-m\s+pip\b")


def readme_block(readme: str, heading: str) -> str:
    """The one-line fenced bash block after the line ``heading`` (e.g. "Run the tests:")."""
    m = re.search(re.escape(heading) + r"\s*\n\s*```bash\n(.*?)\n```", readme, re.S)
    assert m, f"README.md has no ```bash block after {heading!r}"
    lines = [ln for ln in m.group(1).splitlines() if ln.strip()]
    assert len(lines) == 1, f"the block after {heading!r} is not one line: {lines}"
    return lines[0].strip()


def commands(script: str) -> list[str]:
    """The script's command lines: no comments, blank lines or continuation-joined pieces split apart."""
    joined = re.sub(r"\\\n\s*", " ", script)
    return [ln.strip() for ln in joined.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def drift(readme: str, ci: str) -> list[str]:
    """What makes `ci` (the text of .ci/run) something other than README's test command; [] when none."""
    test_cmd = readme_block(readme, "Run the tests:")
    lab_cmd = readme_block(readme, "afterwards assembles the final evidence report in `runs/final-report.md`):")
    problems = []
    install = test_cmd.rsplit("&&", 1)[0].strip()
    if lab_cmd.rsplit("&&", 1)[0].strip() != install:
        problems.append(f"the README's lab command installs {lab_cmd!r}, its test command {install!r}")
    lines = commands(ci)
    if test_cmd not in lines:
        problems.append(f".ci/run does not run the README's test command verbatim: {test_cmd!r}")
    elif lines[-1] != test_cmd:
        problems.append(f".ci/run's last command is {lines[-1]!r}, not the README's test command")
    for ln in lines:
        if ln != test_cmd and INSTALLERS.search(ln):
            problems.append(f".ci/run installs something the README's command does not: {ln!r}")
        if ln != test_cmd and "pytest" in ln:
            problems.append(f".ci/run runs pytest outside the README's command: {ln!r}")
    return problems


def test_ci_runs_exactly_the_readme_test_command():
    assert drift((REPO / "README.md").read_text(), (REPO / ".ci" / "run").read_text()) == []


def test_drift_is_caught():
    """The check itself: the drifts that happened (an extra pin before the command, the command edited on one
    side, a second pytest) are each reported."""
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    cmd = readme_block(readme, "Run the tests:")
    assert drift(readme, ci.replace(cmd, "pip install triton==3.6.0\n" + cmd))
    assert drift(readme, ci.replace(cmd, cmd.replace("-n 2", "-n 4")))
    assert drift(readme.replace(cmd, cmd.replace('".[dev]"', '".[dev,cuda]"')), ci)
    assert drift(readme, ci + "\npython -m pytest -q tests/lab\n")
    assert drift(readme, ci.replace(cmd, "python -m pip install -U triton\n" + cmd))


def test_pyproject_declares_a_range_for_each_core_stack_package():
    """torch, triton, transformers and xgrammar carry a lower bound (the oldest tested; pyproject's comment says
    which versions were run), so what pip resolves on a fresh machine is a tested combination or newer."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=!~;\[ ]", d, 1)[0].lower(): d for d in project["dependencies"]}
    for name in ("torch", "triton", "transformers", "xgrammar"):
        assert name in declared and ">=" in declared[name], (name, declared.get(name))
    assert "platform_machine" in declared["triton"]     # triton has Linux x86_64 wheels only: a marker, as xgrammar's
