"""labkit load replays a multi-turn trace: a turn is sent think time after its previous turn finished."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from labkit.errors import UserError
from labkit.load.depend import split_deps
from labkit.load.replay import LoadOptions, run_load
from labkit.load.report import read_log
from labkit.load.workloads import WorkloadOptions, write_workload
from serve.core.worker import WorkerConfig

THINK_MS = 30.0


def multi_turn(tmp_path: Path) -> Path:
    path = tmp_path / "mt.jsonl"
    write_workload(path, WorkloadOptions(dataset="multi-turn", sessions=2, turns=3, input_len=4, output_len=3,
                                         think_time_ms=THINK_MS))
    return path


def opts(tmp_path: Path, trace: Path, model: Path, **kw) -> LoadOptions:
    worker = WorkerConfig(model=str(model), device="cpu", max_model_len=256, max_num_batched_tokens=128,
                          max_num_seqs=4)
    return LoadOptions(**{"trace": trace, "out": tmp_path / "load.jsonl", "worker": worker, "warmup_requests": 0,
                          "show_progress": False, **kw})


def check_order(tmp_path: Path, trace: Path) -> int:
    log = read_log(tmp_path / "load.jsonl")
    ev = [e for e in log.events if e.get("observer") == "engine"]
    sub = {e["request_id"]: e["t_ns"] for e in ev if e["event"] == "submitted"}
    fin = {e["request_id"]: e["t_ns"] for e in ev if e["event"] == "finished"}
    reqs = [json.loads(line) for line in trace.read_text().splitlines()[1:]]
    checked = 0
    for r in reqs:
        if "after" in r:
            assert sub[r["request_id"]] - fin[r["after"]] >= THINK_MS * 1e6, r["request_id"]
            checked += 1
    return checked


@pytest.mark.parametrize("serve_local", [False, True])
def test_turns_wait_for_the_previous_reply(tmp_path, tiny_model_dir, serve_local):
    trace = multi_turn(tmp_path)
    record = run_load(opts(tmp_path, trace, tiny_model_dir, serve_local=serve_local))
    assert record["verdict"] == "PASS"
    assert record["facts"]["completed"]["engine"] == 6
    assert check_order(tmp_path, trace) == 4


def test_round_mode_and_bad_dependencies_are_refused(tmp_path, tiny_model_dir):
    trace = multi_turn(tmp_path)
    with pytest.raises(UserError, match="--mode wall"):
        run_load(opts(tmp_path, trace, tiny_model_dir, mode="round"))
    base = {"prompt_token_ids": [1], "arrival_ms": 0.0}
    with pytest.raises(UserError, match="names no other request"):
        split_deps([{**base, "request_id": "a", "after": "zz"}])
    with pytest.raises(UserError, match="cycle"):
        split_deps([{**base, "request_id": "a", "after": "b"}, {**base, "request_id": "b", "after": "a"},
                    {**base, "request_id": "c"}])
