"""What the commands print reads as text, never as Python writes its values: no ``None``, ``True``/``False`` or
``{'a': 1}`` / ``['A']`` reprs in a command's output or in the judge's expected column (``labkit.console.readable``)."""
from __future__ import annotations

import re

import pytest

# a Python repr: a quoted key or item in braces or brackets, or a bare None/True/False word
REPR = re.compile(r"[{\[(, ]'[^']*'(: |, |\]|\))|\bNone\b|\bTrue\b|\bFalse\b")


def reprs(text: str) -> list[str]:
    return [line for line in text.splitlines() if REPR.search(line)]


def test_readable_writes_values_as_text():
    from labkit.console import readable

    assert readable(None) == "-" and readable(True) == "yes" and readable(False) == "no" and readable("a b") == "a b"
    assert readable({"full": 4, "cached": 1}) == "full: 4, cached: 1"
    assert readable(["A", "B"]) == "[A, B]" and readable([]) == "[]" and readable({}) == "-"
    assert readable({"status": "WAITING", "blocks": [], "seq": {"n": None}}) == "status: WAITING, blocks: [], seq: (n: -)"
    assert reprs(readable({"q": [0, 2048], "ok": True, "none": None, "names": ["x"]})) == []


def test_the_repr_pattern_finds_what_python_writes():
    for value in ({"full": 4}, ["A", "B"], None, True, {"a": {"b": False}}):
        assert reprs(f"x {value} y"), value


@pytest.mark.parametrize("args", [("scheduler", "practice"), ("principles", "attention"),
                                  ("principles", "shapes", "--tp", "1"), ("quick-walk", "--case", "prefix")],
                         ids=lambda a: " ".join(a))
def test_command_output_has_no_python_repr(labkit_in_process, tmp_path, args):
    res = labkit_in_process(*args, env={"LABKIT_RUNS_DIR": str(tmp_path)})
    assert res.returncode == 0, res.stdout + res.stderr
    assert reprs(res.stdout) == [] and reprs(res.stderr) == []


def test_the_judge_states_a_synthetic_model_as_text():
    from labkit.checks.judging import judge

    record = {"model": {"synthetic": True, "preset": "tiny"}, "kind": "cpu-real-engine", "device": "cpu"}
    rows = [c for c in judge(None, record) if c["name"] == "model.synthetic"]
    assert [c["expected"] for c in rows] == ["true (preset tiny)"]


def test_the_final_report_has_no_python_repr(labkit_in_process, tmp_path):
    res = labkit_in_process("report", env={"LABKIT_RUNS_DIR": str(tmp_path)})
    assert res.returncode == 0, res.stdout + res.stderr
    assert reprs((tmp_path / "final-report.md").read_text()) == []
