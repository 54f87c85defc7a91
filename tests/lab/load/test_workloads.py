"""labkit trace --dataset/--request-rate: arrival statistics, seeding, prefix sharing, turn order, bad options."""
from __future__ import annotations

import json
import math
import statistics

import pytest
from typer.testing import CliRunner

from labkit.cli import app
from labkit.errors import UserError
from labkit.load.trace import read_trace
from labkit.load.workloads import WorkloadOptions, make_workload, write_workload

runner = CliRunner()


def gaps_s(reqs: list[dict]) -> list[float]:
    t = [r["arrival_ms"] / 1000.0 for r in reqs]
    return [b - a for a, b in zip(t, t[1:])]


@pytest.mark.parametrize("rate,burst", [(5.0, 1.0), (40.0, 0.25), (10.0, 4.0)])
def test_gaps_have_the_rate_and_the_burstiness(rate, burst):
    n = 20000
    g = gaps_s(make_workload(WorkloadOptions(request_rate=rate, burstiness=burst, num_requests=n + 1,
                                             input_len=1, output_len=1, seed=3)))
    mean, cv = statistics.fmean(g), statistics.pstdev(g) / statistics.fmean(g)
    want_mean, want_cv = 1.0 / rate, 1.0 / math.sqrt(burst)
    # 5 standard errors: the mean's is want_mean*cv/sqrt(n); the std's relative one ~ sqrt((2 + 6/B)/n)/2
    assert abs(mean - want_mean) < 5 * want_mean * want_cv / math.sqrt(n)
    rel = 0.5 * math.sqrt((2 + 6 / burst) / n) + want_cv / math.sqrt(n)
    assert abs(cv - want_cv) < 5 * rel * want_cv


def test_duration_and_infinite_rate():
    reqs = make_workload(WorkloadOptions(request_rate=50.0, duration_s=20.0, input_len=1, output_len=1))
    assert all(r["arrival_ms"] < 20000.0 for r in reqs)
    assert abs(len(reqs) - 1000) < 5 * math.sqrt(1000)          # Poisson count: sd sqrt(R*T)
    burst = make_workload(WorkloadOptions(num_requests=7, input_len=1, output_len=1))
    assert len(burst) == 7 and {r["arrival_ms"] for r in burst} == {0.0}


def test_lengths_uniform_in_the_range_and_lognormal_median():
    reqs = make_workload(WorkloadOptions(num_requests=2000, input_len=100, output_len=20, range_ratio=0.5))
    ins, outs = [r["prompt_tokens"] for r in reqs], [r["max_tokens"] for r in reqs]
    assert min(ins) == 50 and max(ins) == 150 and min(outs) == 10 and max(outs) == 30
    assert all(len(r["prompt_token_ids"]) == r["prompt_tokens"] for r in reqs)
    assert abs(statistics.fmean(ins) - 100) < 5 * (100 / math.sqrt(12)) / math.sqrt(2000)
    fixed = make_workload(WorkloadOptions(num_requests=50, input_len=33, output_len=5))
    assert {r["prompt_tokens"] for r in fixed} == {33} and {r["max_tokens"] for r in fixed} == {5}
    logn = make_workload(WorkloadOptions(num_requests=4000, input_len=200, output_len=4, length_dist="lognormal",
                                         sigma=0.8))
    logs = [math.log(r["prompt_tokens"] / 200) for r in logn]
    assert abs(statistics.median(logs)) < 0.05 and abs(statistics.pstdev(logs) - 0.8) < 0.05


def test_seeded_same_bytes_other_seed_other_trace(tmp_path):
    o = WorkloadOptions(dataset="prefix-repetition", request_rate=8.0, burstiness=0.5, num_requests=40,
                        prefix_len=16, suffix_len=4)
    a, b = write_workload(tmp_path / "a.jsonl", o), write_workload(tmp_path / "b.jsonl", o)
    assert a["sha256"] == b["sha256"] and (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    c = write_workload(tmp_path / "c.jsonl", WorkloadOptions(**{**o.__dict__, "seed": 18}))
    assert c["sha256"] != a["sha256"]
    head, reqs = read_trace(tmp_path / "c.jsonl")
    assert head["options"]["seed"] == 18 and head["options"]["burstiness"] == 0.5 and head["dataset"] == o.dataset
    ids_a = [r["prompt_token_ids"] for r in read_trace(tmp_path / "a.jsonl")[1]]
    assert ids_a != [r["prompt_token_ids"] for r in reqs]
    assert gaps_s(read_trace(tmp_path / "a.jsonl")[1]) != gaps_s(reqs)


def test_prefix_repetition_shares_n_prefixes():
    n, p, s = 5, 24, 6
    reqs = make_workload(WorkloadOptions(dataset="prefix-repetition", num_requests=40, num_prefixes=n,
                                         prefix_len=p, suffix_len=s))
    heads = {}
    for r in reqs:
        assert r["prompt_tokens"] == p + s == len(r["prompt_token_ids"])
        heads.setdefault(r["prefix_index"], set()).add(tuple(r["prompt_token_ids"][:p]))
    assert sorted(heads) == list(range(n)) and all(len(v) == 1 for v in heads.values())   # one prefix per index
    assert len({next(iter(v)) for v in heads.values()}) == n                              # N distinct prefixes
    counts = [sum(r["prefix_index"] == j for r in reqs) for j in range(n)]
    assert counts == [40 // n] * n
    assert len({tuple(r["prompt_token_ids"][p:]) for r in reqs}) == len(reqs)           # every suffix fresh


def test_multi_turn_grows_and_orders_turns(tmp_path):
    o = WorkloadOptions(dataset="multi-turn", sessions=3, turns=4, input_len=5, output_len=3, think_time_ms=25.0,
                        request_rate=2.0)
    write_workload(tmp_path / "m.jsonl", o)
    _, reqs = read_trace(tmp_path / "m.jsonl")          # sorted by arrival, as load replays it
    assert len(reqs) == 12
    pos = {r["request_id"]: i for i, r in enumerate(reqs)}
    by_id = {r["request_id"]: r for r in reqs}
    for r in reqs:
        if r["turn"] == 0:
            assert "after" not in r
            continue
        prev = by_id[r["after"]]
        assert prev["session"] == r["session"] and prev["turn"] == r["turn"] - 1
        assert pos[prev["request_id"]] < pos[r["request_id"]] and r["think_time_ms"] == 25.0
        n = prev["prompt_tokens"]
        assert r["prompt_token_ids"][:n] == prev["prompt_token_ids"]                      # the conversation so far
        assert r["prompt_tokens"] == n + prev["max_tokens"] + 5                            # + reply + user message
    assert sorted({r["session"] for r in reqs}) == ["s000", "s001", "s002"]


def test_default_cli_trace_is_unchanged_and_dataset_cli_works(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert runner.invoke(app, ["trace", "--out", str(a)]).exit_code == 0
    from labkit.load.trace import TraceOptions, render

    assert a.read_text() == render(TraceOptions())
    res = runner.invoke(app, ["trace", "--out", str(b), "--dataset", "multi-turn", "--sessions", "2", "--turns", "2",
                              "--input-len", "3", "--output-len", "2", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["dependent_turns"] == 2


@pytest.mark.parametrize("args,match", [
    (["--request-rate", "0"], "--request-rate must be > 0"),
    (["--request-rate", "-3"], "--request-rate must be > 0"),
    (["--burstiness", "0"], "--burstiness must be"),
    (["--num-requests", "5", "--duration", "2", "--request-rate", "3"], "not both"),
    (["--duration", "2"], "finite --request-rate"),
    (["--range-ratio", "1"], "--range-ratio must be in"),
    (["--length-dist", "zipf"], "--length-dist must be one of"),
    (["--dataset", "chat"], "--dataset must be one of"),
    (["--dataset", "random", "--requests", "3"], "--requests belongs to the fixed-interval trace"),
    (["--num-prefixes", "3"], "--num-prefixes is a --dataset prefix-repetition option"),
    (["--dataset", "prefix-repetition", "--input-len", "3"], "leave out --input-len"),
    (["--dataset", "multi-turn", "--num-requests", "3"], "--sessions x --turns"),
    (["--dataset", "multi-turn", "--turns", "0"], "--turns must be a positive integer"),
    (["--dataset", "multi-turn", "--think-time-ms", "-1"], "--think-time-ms must be"),
])
def test_bad_options_are_one_error_line(tmp_path, args, match):
    res = runner.invoke(app, ["trace", "--out", str(tmp_path / "x.jsonl"), *args])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and match in lines[0], res.output
    assert not (tmp_path / "x.jsonl").exists()


def test_bad_options_refused_in_the_function():
    with pytest.raises(UserError, match="--sigma"):
        make_workload(WorkloadOptions(length_dist="lognormal", sigma=-1.0))
