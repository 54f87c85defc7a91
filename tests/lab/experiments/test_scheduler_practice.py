"""`labkit scheduler practice` / `compare`: the checkpoints PASS on the real scheduler and engine, and FAIL
on a deliberately broken scheduler (no rotation, a preemption that keeps its blocks, a knob that does
nothing) or on evidence that shows unequal work; the CUDA / 2-GPU judging on synthetic evidence."""
from __future__ import annotations

import copy

import pytest

from testkit import checkpoint_command
from engine.config import ConfigError
from engine.scheduler import Scheduler
from labkit.checks import check_evidence, evaluate, get_checkpoint, verdict
from labkit.experiments.scheduler_practice import UPSTREAM_SCHEDULER
from labkit.experiments.scheduler_practice import run_upstream as run_pinned_upstream

pytestmark = pytest.mark.usefixtures("one_tokenizer")     # tests/conftest.py: one tokenizer per model directory


def _failed(record: dict) -> set[str]:
    return {c["name"] for c in record["checks"] if c.get("status", "pass" if c.get("passed") else "fail") == "fail"}


@pytest.fixture(scope="module")
def upstream_once():
    """The practice's upstream side runs in its own process against a copy of engine/ (the pinned scheduler), out of
    reach of this module's monkeypatches: the same for the real run and every broken scheduler here, so it runs
    once per module (in whichever practice comes first) and each practice after it reads a copy of that result."""
    from labkit.experiments import scheduler_practice

    run_upstream, seen = scheduler_practice.run_upstream, []

    def once() -> dict:
        if not seen:
            seen.append(run_upstream())
        return copy.deepcopy(seen[0])

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scheduler_practice, "run_upstream", once)
        yield


def _practice(tmp_path, labkit_argv) -> dict:
    from labkit.experiments.scheduler_practice import run_practice

    labkit_argv.checkpoint("scheduler.practice")
    return run_practice(tmp_path / "scheduler-cpu.json")


# --------------------------------------------------------------------------- practice


def test_practice_passes_and_rejudges(tmp_path, labkit_argv, upstream_once):
    record = _practice(tmp_path, labkit_argv)
    assert record["verdict"] == "PASS", _failed(record)
    assert record["kind"] == "cpu-real-scheduler"
    assert check_evidence(get_checkpoint("scheduler.practice"), tmp_path / "scheduler-cpu.json")[0] == "PASS"
    f = record["facts"]
    assert f["prefill_first_vs_upstream"]["same_per_case"] == {c: True for c in
                                                              ("interference", "rotation", "chunk", "kv_short", "preempt")}
    # who pays for the knob: the shorts wait less, the long request's first token comes later
    s = f["knob_summary"]
    assert s["prefill_first/2"]["short_max_gap_rounds"] < s["prefill_first/unset"]["short_max_gap_rounds"]
    assert s["prefill_first/2"]["long_first_token_round"] > s["prefill_first/unset"]["long_first_token_round"]


def test_practice_fails_without_rotation(tmp_path, labkit_argv, upstream_once, monkeypatch):
    original = Scheduler._schedule_decode

    def no_rotation(self):
        served = original(self)
        if self.policy == "balanced":
            self.running.rotate(len(served))      # served requests back at the front: no rotation
        return served

    monkeypatch.setattr(Scheduler, "_schedule_decode", no_rotation)
    record = _practice(tmp_path, labkit_argv)
    assert record["verdict"] == "FAIL"
    assert "facts.balanced.rotation.num_served_in_3_decodes" in _failed(record)


def test_practice_fails_when_preemption_keeps_blocks(tmp_path, labkit_argv, upstream_once, monkeypatch):
    from engine.sequence import SequenceStatus

    def keep_blocks(self, seq):
        seq.status = SequenceStatus.WAITING
        seq.num_scheduled_tokens = 0
        self.waiting.appendleft(seq)              # back to waiting, blocks and cached tokens kept

    monkeypatch.setattr(Scheduler, "preempt", keep_blocks)
    record = _practice(tmp_path, labkit_argv)
    assert record["verdict"] == "FAIL"
    assert {"facts.prefill_first.preempt.C.blocks", "facts.prefill_first.preempt.C.cached"} <= _failed(record)


def test_practice_fails_when_the_knob_does_nothing(tmp_path, labkit_argv, upstream_once, monkeypatch):
    init = Scheduler.__init__

    def ignore_knob(self, limits, block_manager):
        init(self, limits, block_manager)
        if self.policy == "prefill_first":
            self.max_consecutive_prefill = None

    monkeypatch.setattr(Scheduler, "__init__", ignore_knob)
    record = _practice(tmp_path, labkit_argv)
    assert record["verdict"] == "FAIL"
    assert "facts.knob.prefill_first.2.longest_prefill_run" in _failed(record)


# --------------------------------------------------------------------------- upstream is pinned

_SERVED_STAY_AT_FRONT = "self.running.extendleft(reversed(scheduled))"


def _learners_edit(text: str) -> str:
    """A learner's edit to engine/scheduler.py: prefill_first sends served decodes to the back (it rotates)."""
    assert _SERVED_STAY_AT_FRONT in text
    return text.replace(_SERVED_STAY_AT_FRONT, "self.running.extend(scheduled)")


def _pin() -> str:
    (a,) = [a for a in get_checkpoint("scheduler.practice").assertions if a.path == "facts.upstream.scheduler_sha256"]
    return a.value


def test_the_pinned_upstream_scheduler_is_the_file_the_checkpoint_pins():
    import hashlib
    from pathlib import Path

    pinned = Path(__file__).resolve().parents[3] / UPSTREAM_SCHEDULER
    assert hashlib.sha256(pinned.read_bytes()).hexdigest() == _pin()


def test_a_learners_edit_on_disk_does_not_reach_the_upstream_side(tmp_path, upstream_once):
    import shutil
    from pathlib import Path

    from labkit.experiments.patch_check import run_module_in
    from labkit.experiments.scheduler_practice import run_upstream

    repo = Path(__file__).resolve().parents[3]
    learner = tmp_path / "learner"
    shutil.copytree(repo / "engine", learner / "engine", ignore=shutil.ignore_patterns("__pycache__"))
    sched = learner / "engine" / "scheduler.py"
    sched.write_text(_learners_edit(sched.read_text()))

    edited, error = run_module_in(learner, ["labkit.experiments.scheduler_practice", "--upstream-side"], 300, "edited")
    assert error is None and edited["ok"], error or edited.get("error")
    upstream = run_upstream()                          # the real tree's pinned side (run once per module)
    assert edited["prefill_first"]["rotation"] != upstream["prefill_first"]["rotation"]   # the edit shows on its own tree

    pinned = run_pinned_upstream(learner)               # the upstream side of the edited tree
    assert pinned["ok"], pinned.get("error")
    assert pinned["scheduler_sha256"] == _pin() != edited["scheduler_sha256"]
    assert pinned["prefill_first"] == upstream["prefill_first"]


def test_practice_fails_when_a_learner_changes_prefill_first(tmp_path, labkit_argv, upstream_once, monkeypatch):
    original = Scheduler._schedule_decode

    def rotates(self, *args, **kw):                     # the edit above, made in this process
        served = original(self, *args, **kw)
        if self.policy == "prefill_first":
            for _ in served:
                self.running.remove(_)
            self.running.extend(served)
        return served

    monkeypatch.setattr(Scheduler, "_schedule_decode", rotates)
    record = _practice(tmp_path, labkit_argv)
    assert record["verdict"] == "FAIL"
    assert "facts.prefill_first_vs_upstream.all_same" in _failed(record)


def test_knob_default_keeps_each_policy_and_is_validated(tiny_model_dir):
    from engine import BlockManager, SchedulerLimits
    from engine.config import Config

    assert Scheduler(SchedulerLimits(scheduling_policy="prefill_first"), BlockManager(4, 4)).max_consecutive_prefill is None
    assert Scheduler(SchedulerLimits(scheduling_policy="balanced"), BlockManager(4, 4)).max_consecutive_prefill == 1
    assert Config(str(tiny_model_dir), max_consecutive_prefill=2).scheduler_limits().max_consecutive_prefill == 2
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="max_consecutive_prefill"):
            Config(str(tiny_model_dir), max_consecutive_prefill=bad)


def test_knob_option_reaches_the_engine_and_a_bad_value_is_a_user_error(cli_app, tiny_model_dir, tmp_path):
    import json

    from typer.testing import CliRunner

    out = tmp_path / "g.json"
    res = CliRunner().invoke(cli_app, ["generate", "--token-ids", "1,2,3", "--max-tokens", "2", "--device", "cpu",
                                       "--attention", "torch", "--model", str(tiny_model_dir),
                                       "--max-consecutive-prefill", "2", "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["engine"]["config"]["max_consecutive_prefill"] == 2
    res = CliRunner().invoke(cli_app, ["generate", "--token-ids", "1", "--max-consecutive-prefill", "0"])
    assert res.exit_code == 2


# --------------------------------------------------------------------------- comparisons: the step metric


def test_longest_prefill_run_counts_only_prefills_while_a_request_is_mid_decode():
    from labkit.load.compare import longest_prefill_run_while_decoding as run

    steps = [{"round": i, "phase": p} for i, p in enumerate("PDPPPDDPPD")]
    steps = [{**s, "phase": "prefill" if s["phase"] == "P" else "decode"} for s in steps]
    assert run(steps, {"a": [0, 1, 9]}) == 3            # rounds 2-4 while a waits for more
    assert run(steps, {"a": [0, 1]}) == 0                # a is done by round 1: nothing is delayed
    assert run(steps, {"a": [0, 5], "b": [6, 9]}) == 3   # rounds 2-4 (a), 7-8 (b)


# --------------------------------------------------------------------------- comparisons on CPU, for real


def _run_key(side, path) -> tuple:
    """A load run's identity: its side's worker settings and its repeat (``<side>-r<k>.jsonl``)."""
    return tuple(sorted(side.worker.items())), path.stem.rsplit("-", 1)[1]


@pytest.fixture(scope="module")
def load_runs() -> dict:
    """(worker settings, repeat) -> (load record, its event log) of every in-process load run of the module."""
    return {}


@pytest.fixture(scope="module")
def policy_comparison(tiny_model_dir, tmp_path_factory, load_runs):
    from labkit.load import compare

    real = compare._run_inprocess

    def kept(side, path, *args):
        record = real(side, path, *args)
        load_runs[_run_key(side, path)] = record, path
        return record

    out = tmp_path_factory.mktemp("cmp") / "scheduler-policy.json"
    with checkpoint_command("scheduler.policy-comparison"), pytest.MonkeyPatch.context() as mp:
        mp.setattr(compare, "_run_inprocess", kept)
        record = compare.run_compare("policy", out, repeats=3, model=str(tiny_model_dir), device="cpu",
                                     attention="torch")
    return out, record


@pytest.fixture(scope="module")
def knob_comparison(tiny_model_dir, tmp_path_factory, policy_comparison, load_runs):
    """The knob's "unset" side is the policy pair's "prefill_first" side (the same worker settings, the same
    trace): its three runs are the policy comparison's, their event logs copied in; only "max2" runs here."""
    import shutil

    from labkit.load import compare

    real = compare._run_inprocess

    def reused(side, path, *args):
        if _run_key(side, path) not in load_runs:
            return real(side, path, *args)
        record, src = load_runs[_run_key(side, path)]
        for suffix in (".jsonl", ".json"):
            if src.with_suffix(suffix).is_file():
                shutil.copy(src.with_suffix(suffix), path.with_suffix(suffix))
        return copy.deepcopy(record)

    out = tmp_path_factory.mktemp("cmp") / "scheduler-prefill-knob.json"
    with checkpoint_command("scheduler.prefill-knob"), pytest.MonkeyPatch.context() as mp:
        mp.setattr(compare, "_run_inprocess", reused)
        record = compare.run_compare("prefill-knob", out, repeats=3, model=str(tiny_model_dir), device="cpu",
                                     attention="torch")
    return out, record


def test_policy_comparison_passes_on_cpu(policy_comparison):
    out, record = policy_comparison
    assert record["verdict"] == "PASS", _failed(record)
    assert record["kind"] == "cpu-real-engine"
    assert check_evidence(get_checkpoint("scheduler.policy-comparison"), out)[0] == "PASS"
    f = record["facts"]
    for side in ("prefill_first", "balanced"):
        assert len(f["sides"][side]["short_itl_p99_ms"]) == 3 and len(f["sides"][side]["long_ttft_p50_ms"]) == 3


def test_knob_comparison_passes_on_cpu(knob_comparison):
    out, record = knob_comparison
    assert record["verdict"] == "PASS", _failed(record)
    assert check_evidence(get_checkpoint("scheduler.prefill-knob"), out)[0] == "PASS"


def _judge(cid: str, facts: dict) -> tuple[str, set[str]]:
    cp = get_checkpoint(cid)
    checks = [evaluate(a, {"facts": facts}) for a in cp.assertions]
    return verdict(checks), {c["name"] for c in checks if c.get("status") == "fail"}


def test_policy_comparison_fails_on_unequal_work_or_no_alternation(policy_comparison):
    facts = policy_comparison[1]["facts"]
    assert _judge("scheduler.policy-comparison", facts)[0] == "PASS"
    from labkit.load.compare import compare_runs

    runs = copy.deepcopy(facts["per_run"])
    runs["balanced"][1]["output_tokens_by_request"]["r005"] -= 1          # one request one token short
    runs["balanced"][2]["request_ids"] = runs["balanced"][2]["request_ids"][:-1]
    broken = {**facts, **compare_runs(runs, facts["expected_output_tokens"])}
    v, failed = _judge("scheduler.policy-comparison", broken)
    assert v == "FAIL" and {"facts.same_request_sets", "facts.same_token_counts"} <= failed
    runs = copy.deepcopy(facts["per_run"])
    runs["balanced"][0]["longest_prefill_run_while_decoding"] = 2          # two prefills in a row under balanced
    v, failed = _judge("scheduler.policy-comparison", {**facts, **compare_runs(runs, 768)})
    assert v == "FAIL" and failed == {"facts.sides.balanced.longest_prefill_run_while_decoding"}
    runs = copy.deepcopy(facts["per_run"])                                  # who pays flipped in one repeat
    for key in ("short_itl_p99_steps", "long_ttft_p50_steps"):
        a, b = runs["prefill_first"][1], runs["balanced"][1]
        a[key], b[key] = b[key], a[key]
    v, failed = _judge("scheduler.policy-comparison", {**facts, **compare_runs(runs, 768)})
    assert v == "FAIL" and failed == {"facts.who_pays.max_short_itl_p99_steps_ratio",
                                      "facts.who_pays.min_long_ttft_p50_steps_ratio"}


@pytest.mark.parametrize("cid, a, b", [("scheduler.policy-comparison", "prefill_first", "balanced"),
                                       ("scheduler.prefill-knob", "unset", "max2")])
def test_who_pays_is_judged_in_steps_in_every_repeat(cid, a, b):
    """Synthetic step metrics: the second side's shorts gain and its longs pay in every repeat -> the two
    who-pays assertions pass; one repeat where the shorts are worse off, or the longs do not pay, FAILs them."""
    from labkit.load.compare import compare_runs

    def facts(short_b=(3, 3, 3), long_b=(20, 20, 20)):
        runs = {a: [_run(WORK, short_itl_p99_steps=30, long_ttft_p50_steps=8) for _ in range(3)],
                b: [_run(WORK, short_itl_p99_steps=s, long_ttft_p50_steps=t) for s, t in zip(short_b, long_b)]}
        return compare_runs(runs, 768)

    def who(f):
        checks = [evaluate(x, {"facts": f}) for x in get_checkpoint(cid).assertions if "who_pays" in x.path]
        return {c["name"]: c["status"] for c in checks}

    assert set(who(facts()).values()) == {"pass"} and len(who(facts())) == 2
    assert who(facts(short_b=(3, 45, 3)))["facts.who_pays.max_short_itl_p99_steps_ratio"] == "fail"   # worse in one
    assert who(facts(long_b=(20, 20, 8)))["facts.who_pays.min_long_ttft_p50_steps_ratio"] == "fail"


# --------------------------------------------------------------------------- CUDA / 2-GPU judging, synthetic


def _run(rid_tokens: dict[str, int], **kw) -> dict:
    base = {"request_ids": sorted(rid_tokens), "output_tokens_by_request": dict(rid_tokens), "completed": 12,
            "rejections": 0, "output_tokens": sum(rid_tokens.values()), "kv_free_at_end_equals_total": True,
            "short_itl_p99_ms": 3.0, "long_ttft_p50_ms": 40.0, "long_ttft_p99_ms": 50.0, "short_ttft_p50_ms": 9.0,
            "throughput_tok_s": 900.0, "longest_prefill_run_while_decoding": 1}
    return {**base, **kw}


WORK = {f"r{i:03d}": 64 for i in range(12)}


def _execution_facts(identical=12, graph_enabled=True, tokens=WORK) -> dict:
    from labkit.load.compare import compare_runs

    runs = {"eager": [_run(WORK, engine_config={"enforce_eager": True}) for _ in range(3)],
            "graph": [_run(tokens, engine_config={"enforce_eager": False}) for _ in range(3)]}
    facts = compare_runs(runs, 768)
    facts["graph"] = {"eager": {"enabled": False, "capture_seconds": 0.0},
                      "graph": {"enabled": graph_enabled, "capture_seconds": 1.2 if graph_enabled else 0.0}}
    facts["requests_with_identical_outputs"] = [12, identical, 12]
    return facts


def test_eager_vs_graph_judging():
    assert _judge("scheduler.eager-vs-graph", _execution_facts()) == ("PASS", set())
    v, failed = _judge("scheduler.eager-vs-graph", _execution_facts(graph_enabled=False))
    assert v == "FAIL" and {"facts.graph.graph.enabled", "facts.graph.graph.capture_seconds"} <= failed
    v, failed = _judge("scheduler.eager-vs-graph", _execution_facts(tokens={**WORK, "r003": 63}))
    assert v == "FAIL" and "facts.same_token_counts" in failed
    assert _judge("scheduler.eager-vs-graph", _execution_facts(identical=11))[0] == "REVIEW"


def _deployment_facts(replica_b_requests=6, overlap=0.8, peak=(20000, 19000)) -> dict:
    from labkit.load.compare import _deployment_facts as deployments, compare_runs

    def workers(split):
        return {f"w{i}": {"requests": n, "overlap_all_s": overlap if len(split) > 1 else None}
                for i, n in enumerate(split)}

    rb = replica_b_requests
    runs = {"single": [_run(WORK, workers=workers([12]), requests_by_worker={"single": 12}) for _ in range(3)],
            "replicas": [_run(WORK, workers=workers([12 - rb, rb]),
                              requests_by_worker={"replica-a": 12 - rb, "replica-b": rb}) for _ in range(3)],
            "tp2": [_run(WORK, workers=workers([12]), requests_by_worker={"tp-two": 12}) for _ in range(3)]}
    served = {"single": [{"servers": [{"worker_id": "single", "tp": 1, "num_kvcache_blocks": 300}],
                          "gpu_memory_used_peak_mib": list(peak)}] * 3,
              "replicas": [{"servers": [{"worker_id": "replica-a", "tp": 1, "num_kvcache_blocks": 300},
                                        {"worker_id": "replica-b", "tp": 1, "num_kvcache_blocks": 300}],
                            "gpu_memory_used_peak_mib": list(peak)}] * 3,
              "tp2": [{"servers": [{"worker_id": "tp-two", "tp": 2, "num_kvcache_blocks": 700}],
                       "gpu_memory_used_peak_mib": list(peak)}] * 3}
    facts = compare_runs(runs, 768)
    facts["deployments"] = deployments(runs, served)
    return facts


def test_deployments_judging():
    assert _judge("scheduler.deployments", _deployment_facts()) == ("PASS", set())
    v, failed = _judge("scheduler.deployments", _deployment_facts(replica_b_requests=0, overlap=None))
    assert v == "FAIL" and {"facts.deployments.replicas.workers_serving",
                            "facts.deployments.replicas.min_overlap_s"} <= failed
    v, failed = _judge("scheduler.deployments", _deployment_facts(overlap=0.0))
    assert v == "FAIL" and failed == {"facts.deployments.replicas.min_overlap_s"}
    v, failed = _judge("scheduler.deployments", _deployment_facts(peak=(20000,)))
    assert v == "FAIL" and failed == {"len(facts.deployments.replicas.gpu_memory_used_peak_mib.0)"}


def test_gpu_pairs_refuse_a_machine_without_gpus(tmp_path):
    import torch

    from labkit.errors import UserError
    from labkit.load.compare import run_compare

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    for pair in ("execution", "deployments"):
        with pytest.raises(UserError, match="needs"):
            run_compare(pair, tmp_path / f"{pair}.json")
