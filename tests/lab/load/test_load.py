"""Traces, routing and load replay (in process, round mode, --serve-local, --endpoints, profile)."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from labkit.checks import load_checkpoints
from labkit.errors import UserError
from labkit.paths import repo_root
from labkit.load.replay import LoadOptions, Router, remote_identity, run_load
from serve.observe.events import split_out
from serve.core.worker import WorkerConfig
from labkit.load.report import read_log
from labkit.load.trace import TraceOptions, read_trace, render, warmup_requests, write_trace

SHIPPED = repo_root() / "workloads" / "mixed.jsonl"
MIXED = TraceOptions(requests=12, prompt_tokens=32, long_prompt_tokens=768, long_every=4, max_tokens=64,
                     interval_ms=40, seed=17)


def small_trace(tmp_path: Path, n: int = 4, max_tokens: int = 4) -> Path:
    path = tmp_path / "small.jsonl"
    write_trace(path, TraceOptions(requests=n, prompt_tokens=12, long_prompt_tokens=40, long_every=2,
                                   max_tokens=max_tokens, interval_ms=5, seed=3))
    return path


def opts(tmp_path: Path, trace: Path, model: Path, **kw) -> LoadOptions:
    worker = WorkerConfig(model=str(model) if model else None, device="cpu", max_model_len=256,
                          max_num_batched_tokens=128, max_num_seqs=4)
    base = dict(trace=trace, out=tmp_path / "load.jsonl", worker=worker, warmup_requests=2, show_progress=False)
    base.update(kw)
    return LoadOptions(**base)


# --------------------------------------------------------------------------- trace


def test_trace_is_deterministic_and_shipped_file_matches(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    sa, sb = write_trace(a, MIXED), write_trace(b, MIXED)
    assert a.read_bytes() == b.read_bytes() and sa["sha256"] == sb["sha256"]
    assert SHIPPED.read_bytes() == render(MIXED).encode(), "workloads/mixed.jsonl is not the documented command's output"
    other = write_trace(tmp_path / "c.jsonl", TraceOptions(**{**MIXED.__dict__, "seed": 18}))
    assert other["sha256"] != sa["sha256"]


def test_mixed_trace_shape():
    head, reqs = read_trace(SHIPPED)
    assert head["options"] == MIXED.__dict__
    assert len(reqs) == 12 and [r["request_id"] for r in reqs] == [f"r{i:03d}" for i in range(12)]
    assert [r["index"] for r in reqs if r["class"] == "long"] == [3, 7, 11]
    assert all(len(r["prompt_token_ids"]) == (768 if r["class"] == "long" else 32) for r in reqs)
    assert [r["arrival_ms"] for r in reqs] == [40.0 * i for i in range(12)]
    assert all(r["max_tokens"] == 64 and r["ignore_eos"] and r["temperature"] == 0.0 for r in reqs)
    assert all(1000 <= t < 150000 for r in reqs for t in r["prompt_token_ids"])
    firsts = {tuple(r["prompt_token_ids"][:16]) for r in reqs}
    assert len(firsts) == 12                                       # no shared prefixes


def test_warmup_requests_have_their_own_prefixes():
    _, reqs = read_trace(SHIPPED)
    warm = warmup_requests(reqs, 2)
    assert [w["class"] for w in warm] == ["short", "long"] and all(w["warmup"] for w in warm)
    trace_prefixes = {tuple(r["prompt_token_ids"][:16]) for r in reqs}
    assert not {tuple(w["prompt_token_ids"][:16]) for w in warm} & trace_prefixes


@pytest.mark.parametrize("content,match", [("", "no requests"), ("{", "not JSON"),
                                           ('{"request_id": "a"}\n', "prompt_token_ids"),
                                           ("[1, 2]\n", "not a JSON object")])
def test_bad_trace_is_a_user_error(tmp_path, content, match):
    p = tmp_path / "t.jsonl"
    p.write_text(content)
    with pytest.raises(UserError, match=match):
        read_trace(p)


def test_trace_cli_writes_the_same_bytes(tmp_path):
    from typer.testing import CliRunner

    from labkit.cli import app
    out = tmp_path / "mixed.jsonl"
    args = ["trace", "--out", str(out), "--requests", "12", "--prompt-tokens", "32", "--long-prompt-tokens", "768",
            "--long-every", "4", "--max-tokens", "64", "--interval-ms", "40", "--seed", "17", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == SHIPPED.read_bytes()


# --------------------------------------------------------------------------- routing


def test_round_robin_and_least_work_routing():
    _, reqs = read_trace(SHIPPED)
    rr = Router(["a", "b"], "round-robin")
    assert [rr.pick(r) for r in reqs] == [0, 1] * 6
    lw = Router(["a", "b"], "least-work")
    picks = [lw.pick(r) for r in reqs]
    # short = 32+64 = 96 work, long = 768+64 = 832: the long ones go where less work was assigned
    assert picks[:4] == [0, 1, 0, 1]
    assert lw.assigned_work == [sum(r["prompt_tokens"] + r["max_tokens"] for r, p in zip(reqs, picks) if p == k)
                                for k in (0, 1)]
    assert abs(lw.assigned_work[0] - lw.assigned_work[1]) <= 832
    assert max(rr.assigned_work) - min(rr.assigned_work) >= max(lw.assigned_work) - min(lw.assigned_work)
    with pytest.raises(UserError):
        Router(["a"], "random")


def test_split_out():
    assert split_out("runs/x.jsonl") == (Path("runs/x.jsonl"), Path("runs/x.json"))
    assert split_out("runs/x.json") == (Path("runs/x.jsonl"), Path("runs/x.json"))


@pytest.mark.parametrize("kw,match", [
    (dict(mode="round", serve_local=True), "round"),
    (dict(mode="bogus"), "--mode"),
    (dict(api="openai"), "--api openai"),
    (dict(endpoints=["http://127.0.0.1:1"], model="x"), "--endpoints"),
    (dict(endpoints=["127.0.0.1:1"], model=None), "http://"),
    (dict(endpoints=["http://127.0.0.1:1"], model=None, profile_dir=Path("p")), "profile"),
])
def test_load_option_errors(tmp_path, tiny_model_dir, kw, match):
    o = opts(tmp_path, SHIPPED, tiny_model_dir)
    for k, v in kw.items():
        if k == "model":
            o.worker = replace(o.worker, model=v)
        else:
            setattr(o, k, v)
    with pytest.raises(UserError, match=match):
        run_load(o)


# --------------------------------------------------------------------------- replay


def test_inprocess_wall_load_excludes_warmup(tmp_path, tiny_model_dir):
    trace = small_trace(tmp_path)
    record = run_load(opts(tmp_path, trace, tiny_model_dir))
    assert record["verdict"] == "PASS" and record["kind"] == "cpu-real-engine"
    f = record["facts"]
    assert f["requests"] == 4 and f["completed"] == {"engine": 4} and f["output_tokens"] == {"engine": 16}
    assert f["kv_free_at_end_equals_total"] is True
    log = read_log(tmp_path / "load.jsonl")
    assert log.header["kind"] == "cpu-real-engine" and log.header["role"] == "load" and log.header["mode"] == "wall"
    sub = [e for e in log.events if e["event"] == "submitted"]
    assert sum(e["warmup"] for e in sub) == 2 and len(sub) == 6
    assert f["summary"]["observers"]["engine"]["warmup_requests"] == 2
    assert (tmp_path / "load.json").is_file()


def test_a_load_that_leaks_kv_blocks_fails(tmp_path, tiny_model_dir, monkeypatch):
    """Break the subject: a block manager that keeps one block of every finished sequence."""
    from engine.block_manager import BlockManager

    real = BlockManager.deallocate

    def leaky(self, seq):
        keep = seq.block_table[-1:]
        freed = real(self, seq)
        for b in keep:
            self.free_block_ids.remove(b)
            self.used_block_ids.add(b)
        return [b for b in freed if b not in keep]

    monkeypatch.setattr(BlockManager, "deallocate", leaky)
    record = run_load(opts(tmp_path, small_trace(tmp_path), tiny_model_dir, warmup_requests=0))
    assert record["facts"]["kv_free_at_end_equals_total"] is False
    assert record["verdict"] == "FAIL"
    assert [c["name"] for c in record["checks"] if c["status"] == "fail"] == ["KV blocks all free at the end"]


def test_load_sanity_assertions_read_the_measured_counts(tmp_path, labkit_argv):
    """Unfinished or failed requests, counted from the event log, fail the run."""
    from labkit.evidence import write_evidence
    from labkit.load.replay import _sanity

    def facts(**terms):
        return {"terminations": {"engine": {"length": 4, **terms}}, "unfinished": {"engine": terms.get("unfinished", 0)},
                "errors": {"engine": terms.get("error", 0)}}

    def verdict(f):
        return write_evidence(tmp_path / "x.json", checkpoint=None, kind="cpu-real-engine", device="cpu", facts=f,
                              run_assertions=_sanity(f))

    assert verdict(facts())["verdict"] == "PASS"
    for bad, name in (({"unfinished": 1}, "every request finished (engine)"), ({"error": 2}, "no engine error (engine)")):
        rec = verdict(facts(**bad))
        assert rec["verdict"] == "FAIL" and [c["name"] for c in rec["checks"] if c["status"] == "fail"] == [name]
    rec = verdict({"terminations": {}, "unfinished": {}, "errors": {}})
    assert rec["verdict"] == "FAIL"                                       # no observer: nothing was measured


def test_round_mode_injects_per_scheduler_round(tmp_path, tiny_model_dir):
    trace = small_trace(tmp_path, n=4, max_tokens=6)
    record = run_load(opts(tmp_path, trace, tiny_model_dir, mode="round", warmup_requests=0))
    assert record["verdict"] == "PASS"
    events = read_log(tmp_path / "load.jsonl").events
    sub = {e["request_id"]: e["round"] for e in events if e["event"] == "submitted"}
    # request k enters at the k-th round of the replay (arrival_round = index)
    assert [sub[f"r{i:03d}"] - sub["r000"] for i in range(4)] == [0, 1, 2, 3]


def test_serve_local_drives_http_and_records_both_observers(tmp_path, tiny_model_dir):
    trace = small_trace(tmp_path)
    record = run_load(opts(tmp_path, trace, tiny_model_dir, serve_local=True, warmup_requests=1))
    f = record["facts"]
    assert record["verdict"] == "PASS"
    assert f["completed"] == {"client": 4, "engine": 4} and f["output_tokens"] == {"client": 16, "engine": 16}
    assert f["ttft_ms"]["client"]["p50"] >= f["ttft_ms"]["engine"]["p50"] > 0


def test_endpoints_native_and_openai_against_two_servers(tmp_path, tiny_model_dir):
    from serve.entrypoints.api_server import ServerThread
    from serve.core.worker import Worker, WorkerConfig

    trace = small_trace(tmp_path)
    servers = [ServerThread(Worker(WorkerConfig(model=str(tiny_model_dir), device="cpu", max_model_len=256,
                                                worker_id=f"rep-{k}")).start()).start() for k in range(2)]
    try:
        eps = [s.url for s in servers]
        rec = run_load(opts(tmp_path, trace, None, endpoints=eps, router="least-work",
                            out=tmp_path / "native.jsonl", warmup_requests=1))
        assert rec["verdict"] == "PASS" and rec["kind"] == "cpu-real-engine"
        workers = rec["facts"]["summary"]["observers"]["client"]["workers"]
        assert set(workers) == {"rep-0", "rep-1"} and sum(w["requests"] for w in workers.values()) == 4
        assert rec["facts"]["router"]["policy"] == "least-work"
        rec = run_load(opts(tmp_path, trace, None, endpoints=eps, api="openai",
                            out=tmp_path / "openai.jsonl", warmup_requests=0))
        assert rec["verdict"] == "PASS"
        assert rec["facts"]["completed"] == {"client": 4} and rec["facts"]["output_tokens"] == {"client": 16}
    finally:
        for s in servers:
            s.close()


def test_load_against_one_server_records_the_served_engine(tmp_path, tiny_model_dir):
    """--endpoints with one server: the evidence names the engine that server runs (its /config's describe():
    the attention backend, graphs, KV cache), as an in-process load does; with two servers it names none."""
    from serve.entrypoints.api_server import ServerThread
    from serve.core.worker import Worker, WorkerConfig

    trace = small_trace(tmp_path)
    server = ServerThread(Worker(WorkerConfig(model=str(tiny_model_dir), device="cpu", max_model_len=256,
                                              attention_backend="torch")).start()).start()
    try:
        rec = run_load(opts(tmp_path, trace, None, endpoints=[server.url], warmup_requests=0))
    finally:
        server.close()
    assert rec["verdict"] == "PASS"
    assert rec["engine"]["attention_backend"] == "torch" and rec["engine"]["num_kvcache_blocks"] > 0
    assert remote_identity([{"engine": {"attention_backend": "torch"}}] * 2)["engine"] is None


def test_profile_dir_writes_trace_and_operator_table(tmp_path, tiny_model_dir):
    trace = small_trace(tmp_path, n=2, max_tokens=3)
    prof = tmp_path / "prof"
    record = run_load(opts(tmp_path, trace, tiny_model_dir, profile_dir=prof, warmup_requests=1))
    assert record["kind"] == "profile"
    p = json.loads((prof / "profile.json").read_text())
    assert p["kind"] == "profile" and p["verdict"] == "PASS" and p["facts"]["trace_written"] is True
    assert {a["path"] for a in p["run_assertions"]} >= {"facts.ranges.step.count", "facts.trace_written"}
    ranges = p["facts"]["ranges"]
    assert ranges["step"]["count"] > 0 and ranges["forward"]["count"] == ranges["step"]["count"]
    for phase in ("schedule", "prepare", "sample", "postprocess"):      # the engine's hooks, every step
        assert ranges[phase]["count"] == ranges["step"]["count"], phase
    assert (prof / "trace.json").stat().st_size > 0 and "Name" in (prof / "operators.txt").read_text()
    names = {e.get("name") for e in json.loads((prof / "trace.json").read_text())["traceEvents"]}
    assert {"step", "forward", "prepare", "sample"} <= names


def test_service_checkpoints_are_valid():
    cps = {cp.id: cp for cp in load_checkpoints()}
    assert cps["service.simulate"].needs == "cpu" and cps["service.simulate"].kind == ["cpu-real-engine"]
    gpu = cps["service.mixed-gpu"]
    assert gpu.needs == "cuda" and "workloads/mixed.jsonl" in gpu.command and gpu.kind == ["gpu-measured"]


# --------------------------------------------------------------------------- --checkpoint


def test_checkpoint_is_refused_unless_the_command_is_the_checkpoints(tmp_path, tiny_model_dir, labkit_argv, cli_app):
    from typer.testing import CliRunner

    labkit_argv("load", "--trace", "workloads/mixed.jsonl", "--checkpoint", "service.mixed-gpu")
    with pytest.raises(UserError, match="--checkpoint service.mixed-gpu: --serve-local not given; its command is "):
        run_load(opts(tmp_path, SHIPPED, tiny_model_dir, checkpoint="service.mixed-gpu"))
    assert not (tmp_path / "load.jsonl").exists()                   # refused before anything ran
    cp = next(c for c in load_checkpoints() if c.id == "service.mixed-gpu")
    words = [w if w != "prefill_first" else "balanced" for w in cp.command[1:]]     # another policy
    res = CliRunner().invoke(cli_app, [*words, "--model", str(tiny_model_dir), "--device", "cpu",
                                       "--out", str(tmp_path / "x.jsonl")])
    assert res.exit_code == 2 and "--scheduling-policy balanced, not --scheduling-policy prefill_first" in \
        " ".join(res.output.split()) and "Traceback" not in res.output
    assert not (tmp_path / "x.jsonl").exists()


@pytest.mark.slow
def test_the_checkpoint_judges_what_the_served_engine_did(tmp_path, tiny_model_dir, labkit_argv):
    """service.mixed-gpu's command, on CPU: every assertion holds over the recorded facts (only the kind fails
    here: the checkpoint wants GPU evidence). Its options are the command check's; the assertions read what the
    engine and the client saw, so a run where the engine finished a request short, or one was rejected, FAILs."""
    from labkit.checks import check_evidence, get_checkpoint
    from labkit.evidence_format import digest

    cp = get_checkpoint("service.mixed-gpu")
    labkit_argv(*cp.command[1:], "--model", str(tiny_model_dir), "--device", "cpu")
    worker = WorkerConfig(model=str(tiny_model_dir), device="cpu", scheduling_policy="prefill_first",
                          max_num_batched_tokens=256, max_num_seqs=4, max_active=8, max_model_len=1024)
    record = run_load(LoadOptions(trace=SHIPPED, out=tmp_path / "mixed.jsonl", worker=worker, serve_local=True,
                                  mode="wall", warmup_requests=2, checkpoint=cp.id, show_progress=False))
    failed = [c["name"] for c in record["checks"] if c["status"] == "fail"]
    assert record["checkpoint"] == cp.id and failed == ["kind"], failed
    assert not any("config" in a.path or "options" in a.path for a in cp.assertions)
    path = tmp_path / "mixed.json"
    for key, path_in_facts in (("completed", ("completed", "engine")), ("output_tokens", ("output_tokens", "client")),
                               ("rejections", ("rejections", "client"))):
        rec = json.loads(path.read_text())
        where = rec["facts"][path_in_facts[0]]
        where[path_in_facts[1]] += -1 if key != "rejections" else 1
        rec["digest"] = digest(rec)
        bad = tmp_path / f"bad-{key}.json"
        bad.write_text(json.dumps(rec))
        v, res = check_evidence(cp, bad)
        assert v == "FAIL" and f"facts.{key}.{path_in_facts[1]}" in [c["name"] for c in res if c["status"] == "fail"]


def _overlaps(events: list[dict], observer: str) -> int:
    """The most requests of ``observer`` in flight at once (submitted, not yet finished), from the log."""
    marks = sorted((e["t_ns"], 1 if e["event"] == "submitted" else -1) for e in events
                   if e.get("observer") == observer and e["event"] in ("submitted", "finished") and not e.get("warmup"))
    most = now = 0
    for _, step in sorted(marks, key=lambda m: (m[0], m[1])):      # a finish before a submit at the same ns
        now += step
        most = max(most, now)
    return most


@pytest.mark.parametrize("serve_local", [False, True], ids=["in-process", "http"])
def test_max_concurrency_holds_requests_until_one_finishes(tmp_path, tiny_model_dir, serve_local):
    """vLLM bench serve's --max-concurrency: 4 requests arriving at once, at most 2 in flight; without it all 4."""
    path = tmp_path / "burst.jsonl"
    write_trace(path, TraceOptions(requests=4, prompt_tokens=12, long_prompt_tokens=40, long_every=2, max_tokens=6,
                                   interval_ms=0, seed=3))
    observer = "client" if serve_local else "engine"
    for cap, want in ((2, 2), (None, 4)):
        rec = run_load(opts(tmp_path, path, tiny_model_dir, warmup_requests=0, serve_local=serve_local,
                            max_concurrency=cap, out=tmp_path / f"c{cap}.jsonl"))
        assert rec["verdict"] == "PASS" and rec["facts"]["completed"][observer] == 4
        assert _overlaps(read_log(tmp_path / f"c{cap}.jsonl").events, observer) == want, cap


def test_max_concurrency_is_refused_in_round_mode(tmp_path, tiny_model_dir):
    with pytest.raises(UserError, match="--max-concurrency"):
        run_load(opts(tmp_path, small_trace(tmp_path), tiny_model_dir, mode="round", max_concurrency=2))
