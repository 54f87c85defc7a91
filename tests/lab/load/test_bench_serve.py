"""`labkit bench --workload serve` on CPU: the whole mechanism (offline cold + warm, a real `labkit serve`
subprocess replayed over the native and the OpenAI API, the server's step log) with the tiny model and a
small trace; the step arithmetic; the checkpoint's data against the facts the bench writes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from labkit.bench.serve import ISSUE_TRACE, device_stats, percentiles, step_stats, wide_batch_for
from labkit.load.trace import TraceOptions

SMALL = TraceOptions(requests=8, prompt_tokens=32, long_prompt_tokens=64, long_every=2, max_tokens=8, interval_ms=0.0)


@pytest.fixture(scope="module")
def serve_record(tiny_model_dir, tmp_path_factory):
    from labkit.bench.serve import run_serve_bench

    out = tmp_path_factory.mktemp("bench-serve") / "bench-serve.json"
    return run_serve_bench(out, model=str(tiny_model_dir), device="cpu", attention="torch", trace=SMALL)


def test_serve_bench_runs_the_trace_offline_and_served_on_cpu(serve_record):
    r = serve_record
    f = r["facts"]
    assert r["kind"] == "cpu-real-engine" and r["checkpoint"] is None and r["verdict"] == "PASS", r["checks"]
    expected = SMALL.requests * SMALL.max_tokens
    assert f["trace"]["expected_output_tokens"] == expected
    assert f["output_tokens_per_run"] == dict.fromkeys(("offline_cold", "offline_warm", "native", "openai"), expected)
    assert set(f["requests_per_run"].values()) == {SMALL.requests}
    assert f["runs_agree"] is True
    for api in ("native", "openai"):
        a = f[api]
        assert a["tok_s"] > 0 and 0 < a["engine_busy_fraction"] <= 1
        assert a["wide_steps"] > 0 and a["wide_step_ms"]["n"] == a["wide_steps"]
        assert a["wide_gap_ms"]["n"] >= 1 and a["wide_gap_ms"]["p50"] >= 0
        assert a["verdict"] == "PASS" and Path(a["events"]).is_file()
    assert f["ratios"]["native_over_offline"] == pytest.approx(f["native"]["tok_s"] / f["offline"]["warm"]["tok_s"], rel=1e-2)
    assert f["ratios"]["first_over_warm"] == pytest.approx(f["offline"]["cold"]["seconds"] / f["offline"]["warm"]["seconds"], rel=1e-2)
    assert f["server"]["exit_code"] == 0 and f["server"]["steps_logged"] > 0
    assert f["wide_batch"] == wide_batch_for(f["settings"], SMALL.requests) == 6
    assert f["bound"]["bound_tok_s"] is None            # no copy roof on a CPU: said, not invented


def test_server_log_is_the_real_server_and_the_trace_is_the_generators(serve_record):
    f = serve_record["facts"]
    log = [json.loads(x) for x in Path(f["server"]["log"]).read_text().splitlines()]
    assert log[0]["event"] == "header" and log[0]["role"] == "server" and log[0]["url"] == f["server"]["url"]
    steps = [e for e in log if e["event"] == "step"]
    assert len(steps) == f["server"]["steps_logged"]
    # both replays' requests and their warmups went through that one server (the OpenAI API's get server ids)
    from labkit.bench.serve import LOAD_WARMUP_REQUESTS

    admitted = {e["request_id"] for e in log if e["event"] == "admitted"}
    assert len(admitted) == 2 * (SMALL.requests + LOAD_WARMUP_REQUESTS)
    assert {f"r{i:03d}" for i in range(SMALL.requests)} <= admitted
    from labkit.load.trace import render

    assert Path(f["trace"]["path"]).read_text() == render(SMALL)


def test_checkpoint_paths_exist_in_the_bench_facts(serve_record):
    """Every path cuda.bench-serve judges is a fact the bench writes (the CPU run has the same layout)."""
    from labkit.checks import _resolve, get_checkpoint

    cp = get_checkpoint("cuda.bench-serve")
    record = {**serve_record, "facts": {**serve_record["facts"], "bound": {"copy_roof_gb_s": 1.0, "share_of_bound_max": 0.5}}}
    for a in cp.assertions:
        _resolve(record, a.path)                     # raises on a path the facts do not have
    assert cp.command == ["labkit", "bench", "--workload", "serve"]
    assert ISSUE_TRACE.requests * ISSUE_TRACE.max_tokens == 131072


def test_step_stats_busy_fraction_and_gaps():
    ms = 1_000_000
    steps = [{"start_ns": 0, "t_ns": 10 * ms, "num_seqs": 250},
             {"start_ns": 12 * ms, "t_ns": 22 * ms, "num_seqs": 250},
             {"start_ns": 25 * ms, "t_ns": 35 * ms, "num_seqs": 100},
             {"start_ns": 36 * ms, "t_ns": 46 * ms, "num_seqs": 210},
             {"start_ns": 90 * ms, "t_ns": 99 * ms, "num_seqs": 250}]          # outside the window
    s = step_stats(steps, 0, 50 * ms, 200)
    assert s["steps"] == 4 and s["busy_s"] == pytest.approx(0.040)
    assert s["engine_busy_fraction"] == pytest.approx(0.8)
    assert s["wide_steps"] == 3 and s["wide_step_ms"]["p50"] == pytest.approx(10.0)
    assert s["wide_gap_ms"]["n"] == 1 and s["wide_gap_ms"]["p50"] == pytest.approx(2.0)   # only 250 -> 250 pairs
    clipped = step_stats(steps, 5 * ms, 50 * ms, 200)                                     # a step cut by the window
    assert clipped["busy_s"] == pytest.approx(0.035)


def test_device_stats_gpu_busy_and_gaps():
    ms = 1_000_000
    # the GPU's spans: back to back (the overlapped decode), then a 3 ms wait for the host, then overlapping
    # spans (never counted twice), a narrow step, and one outside the window
    spans = [(0, 10 * ms, 256), (10 * ms, 20 * ms, 256), (23 * ms, 33 * ms, 256), (32 * ms, 40 * ms, 256),
             (40 * ms, 45 * ms, 50), (45 * ms, 50 * ms, 256), (90 * ms, 99 * ms, 256)]
    s = device_stats(spans, 0, 50 * ms, 200)
    assert s["gpu_busy_fraction"] == pytest.approx(47 / 50)
    assert s["wide_gpu_gap_ms"]["n"] == 3                        # 256 -> 256 pairs only
    assert s["wide_gpu_gap_ms"]["p50"] == pytest.approx(0.0) and s["wide_gpu_gap_ms"]["max"] == pytest.approx(3.0)
    assert s["wide_gpu_step_ms"]["n"] == 5
    assert device_stats(spans[:2], None, None, 200)["gpu_busy_fraction"] == pytest.approx(1.0)   # own window
    assert device_stats([], 0, 1, 200)["gpu_busy_fraction"] is None      # CPU: no spans, the GPU figures unmeasured
    # the server's step records carry the spans; step_stats reports the GPU's figures beside the host's
    steps = [{"start_ns": a, "t_ns": b + ms, "num_seqs": n, "gpu_start_ns": a, "gpu_end_ns": b} for a, b, n in spans[:3]]
    st = step_stats(steps, 0, 50 * ms, 200)
    assert st["gpu_busy_fraction"] == pytest.approx(30 / 50) and st["wide_gpu_gap_ms"]["max"] == pytest.approx(3.0)
    assert step_stats([{k: v for k, v in r.items() if not k.startswith("gpu")} for r in steps],
                      0, 50 * ms, 200)["wide_gpu_gap_ms"]["n"] == 0


def test_percentiles_and_wide_batch():
    assert percentiles([]) == {"n": 0, "p50": None, "p90": None, "p99": None, "max": None}
    p = percentiles([float(x) for x in range(1, 101)])
    assert p["p50"] == 50.5 and p["max"] == 100.0 and p["p90"] == 90.1      # linear, as the load report's
    assert wide_batch_for({"max_num_seqs": 256}, 256) == 200
    assert wide_batch_for({"max_num_seqs": 256}, 8) == 6
    assert wide_batch_for({"max_num_seqs": 1}, 8) == 1


def test_serve_bench_refuses_a_trace_longer_than_its_context(tiny_model_dir, tmp_path):
    from labkit.bench.serve import run_serve_bench
    from labkit.errors import UserError

    with pytest.raises(UserError, match="exceeds max-model-len"):
        run_serve_bench(tmp_path / "x.json", model=str(tiny_model_dir), device="cpu", attention="torch",
                  trace=TraceOptions(requests=2, prompt_tokens=1000, long_prompt_tokens=1000, max_tokens=100,
                                     interval_ms=0.0))


def test_trace_options_need_the_serve_workload(cli_app):
    from typer.testing import CliRunner

    result = CliRunner().invoke(cli_app, ["bench", "--workload", "latency", "--requests", "8"])
    assert result.exit_code == 2 and "apply to --workload serve" in result.output


def test_step_bound_is_weights_plus_kv_at_the_roof():
    from engine.config import ModelShape
    from labkit.assets.synth import PRESETS
    from labkit.bench.bound import decode_weight_bytes, step_bound

    shape = ModelShape.from_hf(PRESETS["qwen3-8b"])
    one = step_bound(shape, 2, 2, 1, 0, 1000.0)
    assert one["bound_ms_per_step"] == pytest.approx(decode_weight_bytes(shape, 2) / 1e12 * 1e3, rel=1e-3)
    wide = step_bound(shape, 2, 2, 64, 192, 1000.0)
    assert wide["kv_read_bytes"] == 64 * 192 * shape.kv_bytes_per_token(2)
    assert wide["bound_ms_per_step"] > one["bound_ms_per_step"]
    with pytest.raises(ValueError):
        step_bound(shape, 2, 2, 1, 0, 0.0)


def test_token_count_check_compares_the_client_with_the_server(serve_record):
    """The client's count (token events, or OpenAI token chunks) must equal the server's own count
    (num_completion_tokens / usage.completion_tokens): a client that counts a chunk of held-back text as
    a token (131,075 for 131,072) FAILs the run."""
    import copy

    from labkit.bench.serve import run_assertions
    from labkit.checks import _run_checks

    name = "openai: client token count equals the server's"
    good = _run_checks(serve_record)
    assert [c["passed"] for c in good if c["name"] == name] == [True]
    bad = copy.deepcopy(serve_record)
    bad["facts"]["openai"]["server_reported_output_tokens"] += 3       # the two sides disagree
    bad["run_assertions"] = run_assertions(bad["facts"])
    assert [c["passed"] for c in _run_checks(bad) if c["name"] == name] == [False]


def test_serve_bench_reports_wait_and_the_gap_by_part(serve_record):
    """Offline and served: the wide steps' wait for their sampled ids, and the served gaps split by the owner's
    parts (deliver, wakes, publish, boundary, other), one sample per gap."""
    from labkit.bench.serve import GAP_PARTS

    f = serve_record["facts"]
    warm = f["offline"]["warm"]
    assert warm["wide_decode_wait_ms"]["n"] == warm["wide_decode_step_ms"]["n"] > 0
    assert warm["wide_decode_wait_ms"]["max"] <= warm["wide_decode_step_ms"]["max"]
    for api in ("native", "openai"):
        a = f[api]
        assert a["wide_wait_ms"]["n"] == a["wide_steps"] and a["wide_wait_ms"]["max"] <= a["wide_step_ms"]["max"]
        parts = a["wide_gap_parts_ms"]
        assert set(parts) == set(GAP_PARTS)
        assert all(p["n"] == a["wide_gap_ms"]["n"] for p in parts.values())
        assert parts["deliver"]["p50"] > 0


def test_bench_serve_prints_a_table_not_its_facts_as_json(serve_record, cli_app, monkeypatch, tmp_path):
    """Issue 29 item 16: `bench --workload serve` ends with one table of its runs (the facts stay in the evidence
    file), not ~400 lines of JSON before it. The command runs on the module's record (no second bench)."""
    import importlib

    from typer.testing import CliRunner

    monkeypatch.setattr(importlib.import_module("labkit.cli.app"), "_bench_serve", lambda *a, **kw: serve_record)
    res = CliRunner().invoke(cli_app, ["bench", "--workload", "serve", "--device", "cpu",
                                       "--out", str(tmp_path / "b.json")], env={"COLUMNS": "160"})
    out = res.output
    assert res.exit_code == 0, out
    assert "bench serve" in out and len(out.splitlines()) < 60, out
    assert not any(line.lstrip().startswith('"') for line in out.splitlines()), out   # no JSON lines
    f = serve_record["facts"]
    for run in ("offline cold", "offline warm", "native (in-process)", "openai (in-process)"):
        assert run in out, run
    assert f"{f['native']['tok_s']:.2f}" in out and str(f["native"]["output_tokens"]) in out
