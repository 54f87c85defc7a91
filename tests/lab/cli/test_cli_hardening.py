"""Issue 15 item 11: command-line mistakes end in one `error:` line (exit 2), defaults never overwrite
tracked files, and the report's plots stay readable."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from labkit.paths import repo_root
from testkit import request, write_log


def _one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [x for x in result.output.splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith("error: ")]
    assert len(errors) == 1, result.output
    return errors[0]


@pytest.mark.parametrize("port", ["80000", "-1", "65536"])
def test_serve_port_out_of_range_is_one_error_line(cli_app, port):
    line = _one_error_line(CliRunner().invoke(cli_app, ["serve", "--port", port, "--device", "cpu"]))
    assert "--port must be between 0 and 65535" in line


def test_generate_max_tokens_beyond_max_model_len_is_refused(cli_app, tiny_model_dir, tmp_path):
    result = CliRunner().invoke(cli_app, ["generate", "-p", "Hello", "--max-tokens", "5000", "--model",
                                          str(tiny_model_dir), "--device", "cpu", "--out", str(tmp_path / "g.json")])
    line = _one_error_line(result)
    assert "5000" in line and "--max-model-len" in line     # the flag that sets the limit, not the config field
    assert not (tmp_path / "g.json").exists()


def test_bench_on_cpu_is_refused_at_once(cli_app, tmp_path):
    result = CliRunner().invoke(cli_app, ["bench", "--workload", "nano-vllm", "--enforce-eager", "--device", "cpu",
                                          "--out", str(tmp_path / "b.json")])
    assert "GPU tool" in _one_error_line(result)


def test_trace_without_out_writes_under_runs_not_the_shipped_trace(cli_app, tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_RUNS_DIR", str(tmp_path / "runs"))
    shipped = repo_root() / "workloads" / "mixed.jsonl"
    before = shipped.read_bytes()
    result = CliRunner().invoke(cli_app, ["trace", "--requests", "3", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert Path(summary["path"]) == tmp_path / "runs" / "trace.jsonl" and Path(summary["path"]).is_file()
    assert shipped.read_bytes() == before


def _png_size(path: Path) -> tuple[int, int]:
    head = Path(path).read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def _log(path: Path, n: int) -> Path:
    events = []
    for i in range(n):
        events += request(f"r{i:03d}", i * 5, [i * 5 + 20, i * 5 + 30], observer="engine", **{"class": "short"})
        events += request(f"r{i:03d}", i * 5, [i * 5 + 21, i * 5 + 31], observer="client", **{"class": "short"})
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_log(path, events)


def test_report_into_a_missing_folder_with_readable_plots(cli_app, tmp_path):
    pytest.importorskip("matplotlib")
    a = _log(tmp_path / "run-a" / "load.jsonl", 256)
    b = _log(tmp_path / "run-b" / "load.jsonl", 256)
    out = tmp_path / "new" / "deeper" / "x.json"
    result = CliRunner().invoke(cli_app, ["report", "--inputs", f"{a},{b}", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    res = json.loads(result.stdout)
    assert out.is_file() and Path(res["markdown"]).is_file()
    timeline = [p for p in res["plots"] if p.endswith("timeline.png")][0]
    width, height = _png_size(Path(timeline))
    assert height <= 3000, height                 # was 39,556 px for 256 requests
    from labkit.load.report import run_labels

    assert run_labels([a, b]) == ["run-a/load", "run-b/load"]


def test_run_labels_keep_unique_stems_short():
    from labkit.load.report import run_labels

    assert run_labels([Path("x/a.jsonl"), Path("y/b.jsonl")]) == ["a", "b"]
    assert run_labels([Path("p/x/load.jsonl"), Path("q/x/load.jsonl")]) == ["p/x/load", "q/x/load"]


# -- help that says what it means, walks typed with default values judged -------------------------------
def _help_text(cli_app, *argv):
    return CliRunner().invoke(cli_app, [*argv, "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": ""}).output


def test_help_keeps_brackets_and_shows_no_rst_backticks(cli_app):
    assert "[len*(1-r), len*(1+r)]" in " ".join(_help_text(cli_app, "trace").split())   # the interval, not markup
    bench = _help_text(cli_app, "bench")
    assert "``" not in bench and "`--workload serve`" in bench, bench


def test_argument_metavars_are_one_style(cli_app):
    """Usage lines name arguments in upper case, optional ones in brackets: not {path}, [[MODEL]] or [target]."""
    import re

    import typer

    root = typer.main.get_command(cli_app)
    seen = 0
    stack = [((), root)]
    while stack:
        names, cmd = stack.pop()
        subs = getattr(cmd, "commands", None)
        if subs:
            stack += [((*names, n), c) for n, c in subs.items()]
            continue
        if not any(getattr(p, "param_type_name", "") == "argument" for p in cmd.params):
            continue
        usage = next(line for line in _help_text(cli_app, *names).splitlines() if "Usage:" in line)
        seen += 1
        assert "{" not in usage and "[[" not in usage, usage
        for arg in re.findall(r"\[OPTIONS\] (.*)$", usage.strip())[0].split():
            assert arg.strip("[].") == arg.strip("[].").upper(), usage
    assert seen >= 5


@pytest.mark.parametrize("argv,checkpoint", [
    (("--case", "D", "--trace"), "setup.quick-walk-d"),        # --max-num-batched-tokens 512 is the default
    (("--case", "A", "--inputs"), "setup.quick-walk-a"),       # --inputs stores the steps as --trace does
])
def test_quick_walk_typed_with_default_values_is_judged_as_its_checkpoint(cli_app, tiny_model_dir, tmp_path,
                                                                          monkeypatch, argv, checkpoint):
    monkeypatch.setenv("LABKIT_RUNS_DIR", str(tmp_path / "runs"))
    res = CliRunner().invoke(cli_app, ["quick-walk", *argv, "--model", str(tiny_model_dir), "--device", "cpu",
                                       "--json"])
    record = json.loads(res.stdout)
    assert record["checkpoint"] == checkpoint and record["verdict"] == "PASS", (record["checkpoint"], record["verdict"],
                                                                              record["facts"].get("checkpoint_not_claimed"))
