"""bench: the profiled pass accounts for every step and restores the engine; options are checked."""
from __future__ import annotations

import pytest

from engine import LLMEngine
from labkit.bench.run import fixed_workload, run_bench
from labkit.bench.profile import PARTS, profile_run
from labkit.errors import UserError


@pytest.mark.parametrize("overlap", [False, True])
def test_profile_times_every_part_of_every_decode_step(tiny_model_dir, overlap):
    """The parts come from the engine's step hooks, which the overlapped path calls too: every decode
    step (including those launched ahead of the previous step's tokens) has a prepare, forward, sample
    and postprocess time, and the step count matches the synchronous run."""
    engine = LLMEngine(str(tiny_model_dir), device="cpu", enforce_eager=True, max_num_seqs=4,
                       max_num_batched_tokens=256, max_model_len=256, overlap=overlap)
    prompts, params = fixed_workload(4, 40, 8)
    facts = profile_run(engine, prompts, params, window_start=1, window_steps=2)
    decode = facts["decode"]
    assert decode["steps"] == 7 and decode["tokens"] == 28
    for part in PARTS:
        assert decode["ms_per_step_by_part"][part] > 0, (overlap, part)
    engine.close()


def test_profile_run_accounts_for_every_step(tiny_model_dir):
    engine = LLMEngine(str(tiny_model_dir), device="cpu", enforce_eager=True, max_num_seqs=4,
                       max_num_batched_tokens=64, max_model_len=256)
    prompts, params = fixed_workload(4, 40, 6)
    facts = profile_run(engine, prompts, params, window_start=1, window_steps=2)
    # 4 x 40 prompt tokens under a 64-token budget: only a step's first sequence may be chunked, so
    # 4 prefill steps of 40; the first token comes from the prefill, then 5 decode steps of 4
    assert facts["prefill"]["steps"] == 4 and facts["prefill"]["tokens"] == 160
    assert facts["decode"]["steps"] == 5 and facts["decode"]["tokens"] == 20
    assert set(facts["decode"]["ms_per_step_by_part"]) == set(PARTS)
    assert facts["decode"]["by_batch"]["batch 1-15"]["steps"] == 5
    assert abs(facts["prefill"]["share_of_time"] + facts["decode"]["share_of_time"] - 1) < 0.01
    window = facts["kernel_window"]
    assert window["decode_steps"] == 2 and window["first_decode_step"] == 1 and window["batch"] == 4
    # the timer's hooks are removed: the engine runs as before and generates the same greedy tokens
    assert not engine.hooks
    again = engine.generate(prompts, params)
    assert all(len(o["token_ids"]) == 6 for o in again)
    engine.close()


@pytest.mark.parametrize("kw, message", [
    (dict(workload="latency", profile=True), "--profile applies"),
    (dict(workload="nano-vllm", sweep=True), "--sweep applies"),
    (dict(workload="latency", overlap=True), "--overlap applies"),
    (dict(workload="attention", device="cpu"), "needs CUDA"),
    (dict(workload="nope"), "unknown workload"),
])
def test_bench_rejects_bad_combinations(kw, message, tmp_path):
    with pytest.raises(UserError, match=message):
        run_bench(out=tmp_path / "x.json", **kw)


def test_timed_generate_records_every_step(tiny_model_dir):
    from labkit.bench.run import timed_generate

    engine = LLMEngine(str(tiny_model_dir), device="cpu", enforce_eager=True, max_num_seqs=4,
                       max_num_batched_tokens=64, max_model_len=256)
    prompts, params = fixed_workload(3, 20, 5)
    rec = timed_generate(engine, prompts, params, steps=True).record()
    # 3 x 20 prompt tokens fit one 64-token prefill step; the first token comes from it, then 4 decode steps
    assert rec["output_tokens"] == 15 and rec["prefill_steps"] == 1 and rec["decode_steps"] == 4
    assert len(rec["slowest_steps"]) == 5 and {s["phase"] for s in rec["slowest_steps"]} == {"prefill", "decode"}
    assert rec["prefill_seconds"] + rec["decode_seconds"] <= rec["seconds"]
    engine.close()


@pytest.mark.parametrize("share, verdict", [(0.88, "PASS"), (0.5, "REVIEW")])
def test_attention_checkpoint_judges_the_summary(share, verdict, tmp_path, labkit_argv):
    """cuda.attention-bandwidth reads facts.summary (what bench_attention writes); short of 0.7 asks for review."""
    from labkit.evidence import write_evidence

    labkit_argv.checkpoint("cuda.attention-bandwidth")
    facts = {"copy_roof_gb_s": 4190.0, "rows": [], "prefill_rows": [],
             "summary": {"decode_shape": [256, 2048], "decode_share_of_roof": {"triton": share, "torch": 0.3},
                         "prefill_shape": [30, 0, 540], "prefill_tflop_s": {"triton:paged": 127.0}}}
    record = write_evidence(tmp_path / "a.json", checkpoint="cuda.attention-bandwidth", kind="gpu-measured",
                            facts=facts, device="cuda")
    assert record["verdict"] == verdict
