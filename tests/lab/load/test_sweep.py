"""labkit load --request-rates: the rate sweep's CPU-sized run (the cuda.rate-sweep path), its accounting,
the latency definitions and goodput on hand-made timelines, and the checkpoint failing when it should."""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest

from labkit import checks
from labkit.errors import UserError
from labkit.load import sweep_metrics as sm
from labkit.load.replay import LoadOptions
from labkit.load.report import Req
from labkit.load.sweep import SweepOptions, rate_row, run_sweep
from labkit.load.workloads import WorkloadOptions, write_workload
from serve.core.worker import WorkerConfig

RATES = [8.0, 32.0, math.inf]
REQUESTS = 4
SWEEP_PATHS = ("facts.unsubmitted", "facts.lost", "facts.per_rate.*.errored", "facts.per_rate.*.rejected",
               "facts.per_rate.*.timed_out", "facts.latencies_finite", "facts.monotone.violations")


@pytest.fixture(scope="module")
def swept(tmp_path_factory, tiny_model_dir):
    """One CPU sweep: 3 rates x 4 prefix-repetition requests (one shared 256-token prefix), the tiny model."""
    d = tmp_path_factory.mktemp("sweep")
    base = d / "base.jsonl"
    write_workload(base, WorkloadOptions(dataset="prefix-repetition", num_requests=REQUESTS, num_prefixes=1,
                                         prefix_len=256, suffix_len=16, output_len=6, seed=5), header_only=True)
    worker = WorkerConfig(model=str(tiny_model_dir), device="cpu", max_model_len=512, max_num_batched_tokens=512,
                          max_num_seqs=4)
    load = LoadOptions(trace=base, out=d / "sweep.json", worker=worker, warmup_requests=0, show_progress=False)
    record = run_sweep(SweepOptions(load=load, rates=RATES, goodput={"ttft_ms": 60_000.0, "tpot_ms": 1e-6},
                                    offline_baseline=True))
    return d, record


def sweep_assertions() -> list:
    cp = checks.get_checkpoint("cuda.rate-sweep")
    return [a for a in cp.assertions if a.path in SWEEP_PATHS]


def judged(record: dict) -> dict[str, bool]:
    return {a.path: checks.evaluate(a, record)["passed"] for a in sweep_assertions()}


def test_cpu_sweep_accounts_for_every_request_and_passes_the_checkpoints_sweep_assertions(swept):
    d, record = swept
    facts = record["facts"]
    assert record["verdict"] == "PASS", record["checks"]
    assert record["kind"] == "cpu-real-engine"
    assert facts["rates"] == [8.0, 32.0, "inf"]
    for k, row in enumerate(facts["per_rate"]):
        head = json.loads(Path(row["trace"]).read_text().splitlines()[0])
        assert head["options"]["request_rate"] == row["offered_rate"] and head["options"]["seed"] == 5 + k
        assert row["sent"] == REQUESTS and row["completed"] + row["rejected"] + row["errored"] + row["timed_out"] \
            == row["sent"]
        assert row["ttft_ms"]["n"] == row["completed"] and row["output_tokens"] == 6 * row["completed"]
        assert row["goodput"]["good_requests"] == 0        # a TPOT SLO of 1 ns: no request meets it
    assert sorted(judged(record).values()) == [True] * len(SWEEP_PATHS)
    assert facts["per_rate"][0]["prefix_cache_hit_rate"] > 0      # the shared prefix hit at 8 req/s
    for row in facts["per_rate"]:                # the server's own events split every completed request's TTFT
        split = row["ttft_split_ms"]
        assert all(split[k]["n"] == row["completed"] and split[k]["min"] >= 0 for k in sm.TTFT_PARTS), split
        assert sum(split[k]["mean"] for k in sm.TTFT_PARTS) == pytest.approx(row["ttft_ms"]["mean"], abs=0.01)
    assert facts["offline"]["tok_s"] > 0 and facts["summary"]["served_over_offline"] > 0
    assert Path(facts["picture"]).read_bytes()[:4] == b"\x89PNG"


def test_each_rate_says_where_its_step_time_went(swept):
    """labkit.load.server_steps over the in-process server's step records: every rate's steps, decode and prefill,
    inside its requests' span; no GPU spans on a CPU; the sweep table prints them."""
    from labkit.cli.sweep import render_sweep
    from labkit.console import console

    _, record = swept
    for row in record["facts"]["per_rate"]:
        st = row["server_steps"]
        assert st["kinds"].get("prefill", 0) >= 1 and st["kinds"].get("decode", 0) >= 1, st
        assert st["steps"] == sum(st["kinds"].values()) == sum(r["steps"] for r in st["by_kind_and_batch"]), st
        assert st["decode"]["steps"] == st["kinds"]["decode"] and 1 <= st["decode"]["batch_p50"] <= REQUESTS, st
        assert st["gpu_busy_fraction"] is None and st["decode"]["gpu_ms_p50"] is None, st
        assert 0 < st["other_kinds_share"] < 1, st
    with console.capture() as cap:
        render_sweep(record)
    assert "server steps per rate" in cap.get()


def test_step_summary_on_a_hand_made_timeline():
    """Two decodes around a prefill, with GPU spans (ms): the decode after the prefill sees its interval, the
    prefill's own span is the other kinds' share, and the GPU's idle time before each step is what it waited."""
    from labkit.load.server_steps import summarize

    ms = 1_000_000

    def step(phase, n, start, end, g0, g1):
        return {"event": "step", "phase": phase, "num_seqs": n, "num_tokens": n if phase == "decode" else 100 * n,
                "start_ns": start * ms, "t_ns": end * ms, "gpu_start_ns": g0 * ms, "gpu_end_ns": g1 * ms}

    st = summarize([step("decode", 2, 0, 1, 0, 1), step("prefill", 1, 1, 4, 1.5, 3.5),
                    step("decode", 3, 4.5, 6, 4.5, 6)])
    assert st["span_s"] == 0.006 and st["kinds"] == {"decode": 2, "prefill": 1}
    assert st["gpu_busy_fraction"] == 0.75                                 # (1 + 2 + 1.5) ms of 6
    # the second decode's interval runs from the prefill's end (4 ms) to its own (6 ms): 2.0, not its 1.5 ms span;
    # medians by the load report's estimator (linear interpolation: batches 2 and 3, GPU 1.0 and 1.5 ms)
    assert st["decode"] == {"steps": 2, "batch_p50": 2.5, "interval_ms_p50": 2.0, "gpu_ms_p50": 1.25}
    assert st["other_kinds_share"] == 0.5
    prefill = next(r for r in st["by_kind_and_batch"] if r["kind"] == "prefill")
    assert prefill["gpu_idle_ms_p50"] == 0.5 and prefill["interval_ms_p50"] == 3.0 and prefill["tokens_p50"] == 100
    assert prefill["ahead_share"] is None                        # records that do not say whether launched ahead
    # the share of a row's steps launched behind a step in flight: two of its three decodes
    marked = [step("decode", 2, 0, 1, 0, 1) | {"ahead": False}, step("decode", 2, 1, 2, 1, 2) | {"ahead": True},
              step("decode", 2, 2, 3, 2, 3) | {"ahead": True}]
    assert [r["ahead_share"] for r in summarize(marked)["by_kind_and_batch"]] == [0.667]


def test_a_served_sweeps_rates_take_their_steps_from_the_servers_log(tmp_path):
    """--serve-process: the server's log holds every rate's steps; each rate takes those inside its measured requests'
    span (the engine's submitted .. finished in the rate's log; a warm-up request's steps before it are not the
    rate's), and a rate without engine events gets none."""
    from labkit.load.server_steps import per_rate

    ms = 1_000_000
    server = tmp_path / "server.jsonl"
    server.write_text("".join(json.dumps({"event": "step", "phase": ph, "num_seqs": 1, "num_tokens": 1,
                                          "start_ns": t * ms, "t_ns": (t + 1) * ms}) + "\n"
                              for ph, t in (("prefill", 2), ("prefill", 10), ("decode", 11), ("prefill", 50),
                                            ("decode", 51), ("decode", 52))))
    rows = []
    for name, lo, hi, observer in (("a", 10, 12, "engine"), ("b", 50, 53, "engine"), ("c", 10, 53, "client")):
        events = tmp_path / f"rate-{name}.jsonl"
        warm = [{"event": "submitted", "observer": observer, "request_id": "w", "t_ns": (lo - 9) * ms,
                 "warmup": True}, {"event": "finished", "observer": observer, "request_id": "w", "t_ns": lo * ms}]
        events.write_text("".join(json.dumps(e) + "\n" for e in warm + [
            {"event": ev, "observer": observer, "request_id": "r", "t_ns": t * ms}
            for ev, t in (("submitted", lo), ("finished", hi))]))
        rows.append({"events": str(events)})
    per_rate(rows, server)
    assert rows[0]["server_steps"]["kinds"] == {"prefill": 1, "decode": 1}, rows[0]
    assert rows[1]["server_steps"]["kinds"] == {"prefill": 1, "decode": 2}, rows[1]
    assert "server_steps" not in rows[2]


def test_the_step_reader_parses_only_step_lines_and_refuses_a_broken_one_in_one_line(tmp_path):
    """read_steps reads a server log through labkit.evidence.read_jsonl with its substring filter: lines without a
    step are not parsed (a cut token line passes), steps come back by start, and a broken step line is one
    UserError naming the file and line."""
    from labkit.errors import UserError
    from labkit.load.server_steps import read_steps

    log = tmp_path / "server.jsonl"
    steps = [{"event": "step", "phase": "decode", "start_ns": t, "t_ns": t + 1} for t in (30, 10)]
    log.write_text(json.dumps(steps[0]) + "\n" + '{"event": "token", "t_ns": 5, "tex\n' + json.dumps(steps[1]) + "\n")
    assert [s["start_ns"] for s in read_steps(log)] == [10, 30]
    log.write_text(json.dumps(steps[0]) + "\n" + '{"event": "step", "start_ns": 4\n')
    with pytest.raises(UserError, match=r"server.jsonl:2: not JSON"):
        read_steps(log)


def test_the_sweep_table_names_the_attention_backend_that_served(swept):
    from labkit.cli.sweep import render_sweep
    from labkit.console import console

    _, record = swept
    assert record["engine"]["attention_backend"] == "torch"          # the CPU worker's
    with console.capture() as cap:
        render_sweep(record)
    assert "attention torch" in cap.get().replace("\n", " ")


def test_a_lost_request_fails_the_checkpoint(swept):
    """Break: one rate's log loses a request's finished events; the row counts it lost, the assertion FAILs."""
    d, record = swept
    row = record["facts"]["per_rate"][1]
    events = Path(row["events"])
    lines = events.read_text().splitlines()
    victim = json.loads(Path(row["trace"]).read_text().splitlines()[1])["request_id"]
    kept = [ln for ln in lines if not ('"finished"' in ln and f'"{victim}"' in ln)]
    assert len(kept) < len(lines)
    broken_log = d / "broken.jsonl"
    broken_log.write_text("\n".join(kept) + "\n")
    reqs = [json.loads(ln) for ln in Path(row["trace"]).read_text().splitlines()[1:]]
    broken = rate_row(broken_log, reqs, 32.0, {})
    assert broken["lost"] == 1 and broken["accounted"] == REQUESTS - 1
    bad = copy.deepcopy(record)
    bad["facts"]["lost"][1] = broken["lost"]
    assert judged(bad)["facts.lost"] is False


def test_a_non_monotone_sweep_fails_the_checkpoint(swept):
    """Break: the highest rate's throughput cut to a third of the best below it; the monotone check FAILs."""
    _, record = swept
    rows = copy.deepcopy(record["facts"]["per_rate"])
    rows[-1]["output_throughput_tok_s"] = max(r["output_throughput_tok_s"] for r in rows[:-1]) / 3
    bad = copy.deepcopy(record)
    bad["facts"]["monotone"] = sm.monotone(rows, record["facts"]["monotone"]["tolerance"])
    assert [v["offered_rate"] for v in bad["facts"]["monotone"]["violations"]] == ["inf"]
    assert judged(bad)["facts.monotone.violations"] is False


def req(rid: str, tokens_ms: list[float], finished_ms: float | None, reason: str | None = "length", **kw) -> Req:
    ns = lambda ms: int(ms * 1e6)  # noqa: E731
    return Req(rid, "client", submitted_ns=0, token_ns=[ns(t) for t in tokens_ms],
               finished_ns=None if finished_ms is None else ns(finished_ms), reason=reason, **kw)


def test_latency_definitions_on_a_hand_made_timeline():
    """TTFT to the first token; TPOT over the gaps after it (the first token excluded); ITL every gap; E2E to
    the finish."""
    r = req("a", [100.0, 110.0, 130.0], 140.0)
    lat = sm.latencies([r])
    assert lat["ttft_ms"]["p50"] == 100.0
    assert lat["tpot_ms"]["p50"] == 15.0                 # (130 - 100) / (3 - 1), not 130 / 3
    assert lat["itl_ms"]["n"] == 2 and lat["itl_ms"]["p50"] == 15.0 and lat["itl_ms"]["max"] == 20.0
    assert lat["e2e_ms"]["p50"] == 140.0
    many = sm.latencies([req(str(i), [float(i)], float(i)) for i in range(1, 101)])
    assert many["ttft_ms"]["p90"] == pytest.approx(90.1) and many["ttft_ms"]["p99"] == pytest.approx(99.01)


def test_ttft_split_on_a_hand_made_timeline():
    """Client submits at 0 and reads the first token at 40; the server took it at 2, admitted it at 12 and made
    the token at 37: ingress 2, queue 10, prefill 25, delivery 3, adding up to the TTFT of 40."""
    ns = lambda ms: int(ms * 1e6)  # noqa: E731
    client = {"a": req("a", [40.0, 45.0], 46.0), "gone": req("gone", [], 5.0, reason="error")}
    engine = {"a": Req("a", "engine", submitted_ns=ns(2), admitted_ns=ns(12), token_ns=[ns(37), ns(43)]),
              "gone": Req("gone", "engine", submitted_ns=ns(2))}
    split = sm.ttft_split(["a", "gone", "unseen"], client, engine)
    assert {k: split[k]["p50"] for k in sm.TTFT_PARTS} == \
        {"ingress_ms": 2.0, "queue_ms": 10.0, "prefill_ms": 25.0, "delivery_ms": 3.0}
    assert all(split[k]["n"] == 1 for k in sm.TTFT_PARTS)      # the errored and the unseen request left out
    assert sm.ttft_split(["a"], client, {}) is None            # a server without events of its own: no split


def test_goodput_counts_requests_meeting_every_slo():
    good = req("good", [50.0, 60.0, 70.0], 75.0)          # TTFT 50, TPOT 10, E2E 75
    slow_first = req("ttft", [300.0, 305.0], 310.0)       # TTFT 300
    slow_decode = req("tpot", [40.0, 140.0], 150.0)       # TPOT 100
    one_token = req("one", [20.0], 20.0)                  # no TPOT: meets a TPOT SLO
    rows = {r.request_id: r for r in (good, slow_first, slow_decode, one_token)}
    row = sm.rate_facts(10.0, list(rows), rows, [], {"ttft_ms": 200.0, "tpot_ms": 50.0})
    assert row["goodput"]["good_requests"] == 2
    assert row["duration_s"] == pytest.approx(0.31)
    assert row["goodput"]["req_s"] == pytest.approx(2 / 0.31, rel=1e-3)
    assert sm.rate_facts(10.0, list(rows), rows, [], {"e2e_ms": 100.0})["goodput"]["good_requests"] == 2


def test_every_end_is_sorted_into_one_outcome():
    rows = {
        "done": req("done", [1.0], 2.0),
        "busy": req("busy", [], 1.0, reason="rejected", status=429),
        "down": req("down", [], 1.0, reason="error", status=503),
        "slow": req("slow", [1.0], 9.0, reason="error", message="ServerTimeoutError: Timeout on reading data"),
        "broke": req("broke", [1.0], 3.0, reason="error", message="ClientPayloadError: x"),
        "hung": req("hung", [1.0], None, reason=None),
    }
    acc = sm.accounting([*rows, "never"], rows)
    assert {k: acc[k] for k in (*sm.OUTCOMES, "lost")} == \
        {"completed": 1, "rejected": 2, "errored": 1, "timed_out": 1, "lost": 2}
    assert acc["sent"] == 7 and acc["submitted"] == 6 and acc["accounted"] == 5


def test_prefix_cache_hit_rate_from_the_servers_finished_events():
    ev = [{"num_prompt_tokens": 300, "num_cached_tokens": 256}, {"num_prompt_tokens": 100, "num_cached_tokens": 0}]
    assert sm.hit_rate(ev) == 0.64
    assert sm.hit_rate([{"num_prompt_tokens": 300}]) is None      # a server that does not report it: n/a


@pytest.mark.parametrize("text, message", [("4,2", "must rise"), ("0,1", "> 0"), ("x", "not a number"), ("", "at least")])
def test_bad_rates_are_one_line(text, message):
    with pytest.raises(UserError, match=message):
        sm.parse_rates(text)


def test_goodput_spelling():
    assert sm.parse_goodput(["ttft:500 tpot:50", "e2el:3000"]) == {"ttft_ms": 500.0, "tpot_ms": 50.0,
                                                                   "e2e_ms": 3000.0}
    for bad in ("ttft", "itl:5", "ttft:-1", "ttft:x"):
        with pytest.raises(UserError, match="--goodput"):
            sm.parse_goodput(bad)


def test_cli_refuses_sweep_options_without_rates_and_old_traces(tmp_path):
    from typer.testing import CliRunner

    from labkit.cli import app

    res = CliRunner().invoke(app, ["load", "--goodput", "ttft:5", "--out", str(tmp_path / "x.jsonl")])
    assert res.exit_code == 2 and "give --request-rates" in res.output
    res = CliRunner().invoke(app, ["load", "--trace", "workloads/mixed.jsonl", "--request-rates", "1,2",
                                   "--out", str(tmp_path / "x.jsonl")])
    assert res.exit_code == 2 and "labkit trace --dataset" in res.output


def test_a_non_finite_latency_fails_the_checkpoint(swept):
    """Break: one rate's TPOT p99 becomes NaN; the row is no longer finite and the assertion FAILs."""
    _, record = swept
    bad = copy.deepcopy(record)
    row = bad["facts"]["per_rate"][0]
    row["tpot_ms"]["p99"] = float("nan")
    bad["facts"]["latencies_finite"][0] = sm.latencies_finite(row)
    assert judged(bad)["facts.latencies_finite"] is False


def test_the_served_sweep_starts_labkit_serve_with_the_sweeps_engine_options(tmp_path, monkeypatch, tiny_model_dir):
    """--serve-process (cuda.rate-sweep's path, CUDA only in the lab): the `labkit serve` it starts gets the
    sweep's engine options (it read a field the engine's EngineArgs does not have, and the H200 run crashed)."""
    from labkit.load import server_process, sweep

    seen = {}
    monkeypatch.setattr(server_process.ServerProcess, "start",
                        classmethod(lambda cls, *a, **kw: seen.update(args=a, kw=kw)))
    worker = WorkerConfig(model=str(tiny_model_dir), device="cpu", attention_backend="torch", max_num_seqs=3,
                          max_model_len=256, kv_cache_dtype="fp8")
    sweep.start_server_process(LoadOptions(trace=tmp_path / "t.jsonl", out=tmp_path / "o.json", worker=worker), tmp_path)
    _, device, attention, settings = seen["args"][:4]
    assert (device, attention) == ("cpu", "torch"), seen
    extra = list(seen["kw"]["extra_args"])
    assert extra[extra.index("--kv-cache-dtype") + 1] == "fp8", extra
    assert (settings["max_num_seqs"], settings["max_model_len"]) == (3, 256), settings
    assert seen["kw"]["engine_process"] is False
