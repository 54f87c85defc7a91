"""labkit report: B.8.3 definitions on hand-made logs, common window, classes, Markdown and plots."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from labkit.errors import UserError
from labkit.load.report import compare, percentile, summarize
from testkit import MS, ev, request, write_log

def test_b83_worked_example(tmp_path):
    # handbook B.8.3: sent at 0 s, 4 outputs at 0.12, 0.16, 0.21, 0.25 s
    log = write_log(tmp_path / "b83.jsonl", request("r0", 0, [120, 160, 210, 250]))
    o = summarize(log)["observers"]["engine"]
    assert o["ttft_ms"]["p50"] == 120.0
    assert o["itl_ms"]["n"] == 3 and sorted([o["itl_ms"]["min"], o["itl_ms"]["p50"], o["itl_ms"]["max"]]) == [40, 40, 50]
    assert o["tpot_ms"]["p50"] == pytest.approx(43.333, abs=1e-3)
    assert o["output_tokens"] == 4 and o["completed"] == 1
    assert o["window"]["seconds"] == 0.25 and o["throughput_tok_s"] == 16.0


def test_percentiles_interpolate_linearly():
    xs = list(range(1, 101))
    assert percentile(xs, 50) == 50.5 and percentile(xs, 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0


def test_common_window_across_replicas_and_warmup_excluded(tmp_path):
    events = request("warm", -500, [-400, -300], worker="a", warmup=True)
    events += request("r0", 0, [100, 200], worker="a")                 # replica a: 0 .. 200 ms
    events += request("r1", 300, [500, 600, 1000], worker="b")        # replica b: 300 .. 1000 ms
    o = summarize(write_log(tmp_path / "rep.jsonl", events))["observers"]["engine"]
    assert o["requests"] == 2 and o["warmup_requests"] == 1
    assert o["output_tokens"] == 5
    assert o["window"]["seconds"] == 1.0 and o["throughput_tok_s"] == 5.0      # 5 tokens / (0 .. 1000 ms)
    assert o["workers"]["a"]["requests"] == 1 and o["workers"]["b"]["output_tokens"] == 3
    assert o["workers"]["a"]["overlap_all_s"] == 0.0                          # a ended before b began
    assert o["ttft_ms"]["n"] == 2 and o["ttft_ms"]["min"] == 100.0


def test_classes_terminations_rejections_and_observers_apart(tmp_path):
    events = request("s0", 0, [10, 20, 30], **{"class": "short"})
    events += request("l0", 0, [300, 310], **{"class": "long"})
    events += request("c0", 0, [15], reason="cancelled", **{"class": "short"})
    events[-1]["cause"] = "slow_consumer"
    events += [ev("submitted", "x0", 5, **{"class": "short"}), ev("finished", "x0", 5, reason="rejected",
                                                                   num_completion_tokens=0)]
    events += request("s0", 2, [40, 60, 80], observer="client", **{"class": "short"})
    s = summarize(write_log(tmp_path / "c.jsonl", events))
    eng, cli = s["observers"]["engine"], s["observers"]["client"]
    assert eng["terminations"] == {"cancelled": 1, "length": 2, "rejected": 1} and eng["rejections"] == 1
    assert eng["causes"] == {"cancelled/slow_consumer": 1}
    assert eng["by_class"]["long"]["ttft_ms"]["p50"] == 300.0 and eng["by_class"]["short"]["requests"] == 3
    assert cli["requests"] == 1 and cli["ttft_ms"]["p50"] == 38.0            # client clock only


def test_compare_writes_json_md_and_plots(tmp_path):
    a = write_log(tmp_path / "a.jsonl", request("r0", 0, [100, 150]) + request("r1", 10, [120, 200]),
                  mode="wall", role="load")
    b = write_log(tmp_path / "b.jsonl", request("r0", 0, [50, 75]) + request("r1", 10, [65, 100]), kind="profile")
    out = tmp_path / "cmp.json"
    result = compare([a, b], out)
    data = json.loads(out.read_text())
    assert data["primary_observer"] == "engine" and len(data["inputs"]) == 2
    assert data["ratios"][0]["ttft_ms.p50"] == pytest.approx(0.5, rel=0.01)
    md = (tmp_path / "cmp.md").read_text()
    assert "| 0 | engine | 2 | 2 | 0 | 4 |" in md and "profile evidence" in md
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert result["plots"] == [] and "matplotlib is not importable" in md
    else:
        names = sorted(Path(p).name for p in result["plots"])
        assert names == ["cmp-itl-cdf.png", "cmp-timeline.png", "cmp-ttft-cdf.png"]
        assert all(Path(p).read_bytes()[:4] == b"\x89PNG" for p in result["plots"])


def test_without_matplotlib_the_md_says_so(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)          # import matplotlib -> ImportError
    a = write_log(tmp_path / "a.jsonl", request("r0", 0, [100, 150]))
    result = compare([a], tmp_path / "one.json")
    assert result["plots"] == []
    assert "matplotlib is not importable" in (tmp_path / "one.md").read_text()


def test_report_errors_are_one_line(tmp_path):
    with pytest.raises(UserError, match="no such log"):
        compare([tmp_path / "missing.jsonl"], tmp_path / "x.json")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    with pytest.raises(UserError, match="not JSON"):
        compare([bad], tmp_path / "x.json")
    with pytest.raises(UserError, match=".json"):
        compare([write_log(tmp_path / "a.jsonl", request("r0", 0, [1]))], tmp_path / "x.md")


def test_report_cli(tmp_path):
    from typer.testing import CliRunner

    from labkit.cli import app
    a = write_log(tmp_path / "a.jsonl", request("r0", 0, [100, 150, 170]))
    b = write_log(tmp_path / "b.jsonl", request("r0", 0, [90, 120, 170]))
    result = CliRunner().invoke(app, ["report", "--inputs", f"{a},{b}", "--out", str(tmp_path / "r.json"),
                                      "--no-plots"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "r.json").is_file() and (tmp_path / "r.md").is_file()
    assert "ratios vs input 0" in result.output


def test_queue_wait_per_request_and_percentiles(tmp_path):
    """submitted -> admitted from a known trace: waits 30 and 90 ms (p50 60, p90 84, p99 89.4)."""
    events = [ev("submitted", "r0", 0), ev("admitted", "r0", 30), ev("token", "r0", 50, index=1),
              ev("finished", "r0", 50, reason="length", num_completion_tokens=1),
              ev("submitted", "r1", 10, **{"class": "long"}), ev("admitted", "r1", 100), ev("token", "r1", 160, index=1),
              ev("finished", "r1", 160, reason="length", num_completion_tokens=1),
              ev("submitted", "r2", 20), ev("finished", "r2", 40, reason="cancelled")]     # never admitted
    o = summarize(write_log(tmp_path / "q.jsonl", events))["observers"]["engine"]
    wait = o["queue_wait_ms"]
    assert wait["n"] == 2 and (wait["p50"], wait["p90"], wait["p99"]) == (60.0, 84.0, pytest.approx(89.4))
    assert o["admitted_to_first_token_ms"]["p50"] == 40.0          # (20 + 60) / 2
    assert o["by_class"]["long"]["queue_wait_ms"]["p50"] == 90.0
    per = {r["request_id"]: r for r in o["per_request"]}
    assert per["r0"]["queue_wait_ms"] == 30.0 and per["r1"]["queue_wait_ms"] == 90.0 and per["r2"]["queue_wait_ms"] is None
    assert per["r1"]["queue_wait_ms"] + per["r1"]["admitted_to_first_token_ms"] == per["r1"]["ttft_ms"] == 150.0
    res = compare([write_log(tmp_path / "q2.jsonl", events)], tmp_path / "out" / "q.json", plots=False)
    md = Path(res["markdown"]).read_text()
    assert "queue wait ms" in md and "| 0 | engine | `r1` | long | 90.000 | 60.000 | 150.000 |" in md
    assert json.loads((tmp_path / "out" / "q.json").read_text())["inputs"][0]["observers"]["engine"]["per_request"][1]["queue_wait_ms"] == 90.0
