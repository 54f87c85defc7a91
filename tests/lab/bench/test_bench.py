"""bench: the profiled pass accounts for every step and restores the engine; options are checked."""
from __future__ import annotations

from pathlib import Path

import pytest

from labkit.bench.run import fixed_workload, judged_checkpoint, run_bench
from labkit.bench.profile import PARTS, profile_run
from labkit.errors import UserError

ROOT = Path(__file__).resolve().parents[3]
#: the engine's own defaults where the factory's (testkit.ENGINE_DEFAULTS) differ: these runs are the bench's engine
ENGINE_OWN = dict(attention_backend="auto", kvcache_block_size=256)


@pytest.mark.parametrize("overlap", [False, True])
def test_profile_times_every_part_of_every_decode_step(lab_engine, overlap):
    """The parts come from the engine's step hooks, which the overlapped path calls too: every decode
    step (including those launched ahead of the previous step's tokens) has a prepare, forward, sample
    and postprocess time, and the step count matches the synchronous run."""
    engine = lab_engine(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256, overlap=overlap, **ENGINE_OWN)
    prompts, params = fixed_workload(4, 40, 8)
    facts = profile_run(engine, prompts, params, window_start=1, window_steps=2)
    decode = facts["decode"]
    assert decode["steps"] == 7 and decode["tokens"] == 28
    for part in PARTS:
        assert decode["ms_per_step_by_part"][part] > 0, (overlap, part)
    engine.close()


def test_profile_run_accounts_for_every_step(lab_engine):
    engine = lab_engine(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, **ENGINE_OWN)
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
    (dict(workload="latency", sampling="heavy"), "--sampling applies"),
    (dict(workload="nano-vllm", sampling="spicy"), "unknown sampling"),
    (dict(workload="attention", device="cpu"), "needs CUDA"),
    (dict(workload="nope"), "unknown workload"),
    (dict(workload="latency", json_schema=ROOT / "workloads/bench-schema.json"), "--json-schema applies"),
    (dict(workload="nano-vllm", json_schema=ROOT / "README.md"), "cannot read a JSON schema"),
    (dict(workload="nano-vllm", json_schema="no/such/file.json"), "cannot read a JSON schema"),
    (dict(workload="nano-vllm", batch=1), "--batch applies"),
    (dict(workload="latency", batch=0), "--batch applies"),
    (dict(workload="attention", repeats=2), "--repeats applies"),
    (dict(workload="gemv", device="cpu"), "needs CUDA"),
    (dict(workload="gemv", batch=1), "--batch applies"),
    (dict(workload="latency", sweep=True), "--sweep applies to --workload attention and gemv"),
    (dict(workload="nano-batches", device="cpu"), "needs CUDA"),
    (dict(workload="nano-batches", batch=1), "--batch applies"),
    (dict(workload="latency", context=64), "--context applies"),
    (dict(workload="nano-batches", context=0), "--context applies"),
    (dict(workload="nano-batches", device="cpu", baseline="hf"), "no --baseline"),
])
def test_bench_rejects_bad_combinations(kw, message, tmp_path):
    with pytest.raises(UserError, match=message):
        run_bench(out=tmp_path / "x.json", **kw)


def test_timed_generate_records_every_step(lab_engine):
    from labkit.bench.run import timed_generate

    engine = lab_engine(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, **ENGINE_OWN)
    prompts, params = fixed_workload(3, 20, 5)
    rec = timed_generate(engine, prompts, params, steps=True).record()
    # 3 x 20 prompt tokens fit one 64-token prefill step; the first token comes from it, then 4 decode steps
    assert rec["output_tokens"] == 15 and rec["prefill_steps"] == 1 and rec["decode_steps"] == 4
    assert len(rec["slowest_steps"]) == 5 and {s["phase"] for s in rec["slowest_steps"]} == {"prefill", "decode"}
    assert rec["prefill_seconds"] + rec["decode_seconds"] <= rec["seconds"]
    engine.close()


@pytest.mark.parametrize("share, err, verdict", [(0.88, 0.01, "PASS"), (0.5, 0.01, "REVIEW"), (0.3, 0.01, "FAIL"),
                                                 (0.88, 0.5, "FAIL")])
def test_attention_checkpoint_judges_the_summary(share, err, verdict, tmp_path, labkit_argv):
    """cuda.attention-bandwidth reads facts.summary (what bench_attention writes): short of 0.7 asks for
    review, short of half of it FAILs, and so does a kernel whose output is off the dense reference."""
    from labkit.evidence import write_evidence

    labkit_argv.checkpoint("cuda.attention-bandwidth")
    facts = {"copy_roof_gb_s": 4190.0, "rows": [], "prefill_rows": [],
             "summary": {"decode_shape": [256, 2048], "decode_share_of_roof": {"triton": share, "torch": 0.3},
                         "decode_worst_max_abs_err": err, "prefill_worst_max_abs_err": 0.01, "kernels_checked": 12,
                         "prefill_shape": [30, 0, 540], "prefill_tflop_s": {"triton:paged": 127.0}}}
    record = write_evidence(tmp_path / "a.json", checkpoint="cuda.attention-bandwidth", kind="gpu-measured",
                            facts=facts, device="cuda")
    assert record["verdict"] == verdict


def test_every_cuda_target_has_a_failing_floor():
    """Each `on_fail: review` performance target (a number the fact must reach: ge / le) has an assertion on
    the same fact that FAILs at half of it. (A review that is not a figure, such as cuda.rate-sweep's "saturated
    at a finite rate", has no floor: there is no half of it.)"""
    from labkit.checks import load_checkpoints

    targets = 0
    for cp in [c for c in load_checkpoints() if c.stage == "cuda"]:
        for target in [a for a in cp.assertions if a.on_fail == "review" and a.op in ("ge", "le")]:
            targets += 1
            floors = [a for a in cp.assertions if a.path == target.path and a.on_fail == "fail"]
            assert len(floors) == 1, (cp.id, target.path)
            half = target.value / 2 if target.op == "ge" else target.value * 2
            assert floors[0].op == target.op and floors[0].value == half, (cp.id, target.path)
    assert targets >= 10


# -- attention output check (pure PyTorch, CPU) ---------------------------------------------------------
def _small_decode(dtype=None):
    import torch
    from labkit.bench.attention import PagedCase
    return PagedCase(3, 40, hq=4, hk=2, d=16, page=16, dtype=dtype or torch.float32, device="cpu")


def test_decode_reference_agrees_with_the_engine_backend_and_catches_a_wrong_output():
    import torch
    from engine.attention import create_backend
    from labkit.bench.attention import OUTPUT_TOL, max_abs_error

    case = _small_decode()
    case.context_lens = torch.tensor([40, 17, 1], dtype=torch.int32)        # ragged: the mask matters
    ref = case.reference()
    out = create_backend("torch", 16).forward(case.q, None, None, case.k_cache, case.v_cache, case.meta(), case.scale)
    assert max_abs_error(out, ref) < 1e-5
    assert max_abs_error(out.flip(0), ref) > OUTPUT_TOL                        # outputs of the wrong sequences
    case.context_lens = torch.tensor([40, 40, 40], dtype=torch.int32)        # a kernel that ignores context_lens
    assert max_abs_error(out, case.reference()) > OUTPUT_TOL
    assert max_abs_error(out[:2], ref) == float("inf")                         # a missing row
    assert max_abs_error(out * float("nan"), ref) == float("inf")


@pytest.mark.parametrize("prefix", [0, 24])
def test_prefill_reference_agrees_with_both_routes_and_catches_a_non_causal_kernel(prefix):
    import torch
    import torch.nn.functional as F
    from engine.attention import create_backend
    from labkit.bench.attention import OUTPUT_TOL, PrefillCase, max_abs_error

    case = PrefillCase(3, prefix, 20, hq=4, hk=2, d=16, page=16, dtype=torch.float32, device="cpu")
    ref = case.reference()
    be = create_backend("torch", 16)
    for paged in (True, False) if prefix == 0 else (True,):
        out = be.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.prefill_meta(paged), case.scale)
        assert max_abs_error(out, ref) < 1e-5, paged
    q = case.q.view(3, 20, 4, 16).transpose(1, 2)
    k = case.k.view(3, 20, 2, 16).transpose(1, 2)
    v = case.v.view(3, 20, 2, 16).transpose(1, 2)
    full = F.scaled_dot_product_attention(q, k, v, scale=case.scale, enable_gqa=True)   # no causal mask
    assert max_abs_error(full.transpose(1, 2).reshape(60, 4, 16), ref) > OUTPUT_TOL


def test_an_fp8_case_holds_its_values_in_e4m3_and_its_reference_reads_them_by_the_scale():
    """--kv-cache-dtype fp8: the case's caches are e4m3 (a quarter of float32's bytes), the reference reads them
    dequantized (not the values before quantization), so the torch backend on the same cache matches it; a
    reference that dropped a scale other than 1.0 would not."""
    import torch
    from engine.attention import create_backend, kv_quant
    from labkit.bench.attention import OUTPUT_TOL, PagedCase, PrefillCase, max_abs_error

    plain = _small_decode()
    case = PagedCase(3, 40, hq=4, hk=2, d=16, page=16, dtype=torch.float32, device="cpu", kv_cache_dtype="fp8")
    assert kv_quant.is_fp8(case.k_cache) and kv_quant.is_fp8(case.v_cache) and case.bytes * 4 == plain.bytes
    ref = case.reference()
    be = create_backend("torch", 16)
    assert max_abs_error(be.forward(case.q, None, None, case.k_cache, case.v_cache, case.meta(), case.scale), ref) < 1e-5
    assert max_abs_error(plain.reference(), ref) > 1e-3          # the e4m3 values, not the float32 ones
    kv_quant.mark(case.v_cache, 2.0, torch.float32)               # V now stands for twice its stored values
    assert max_abs_error(case.reference(), 2 * ref) < 1e-5
    prefill = PrefillCase(3, 24, 20, hq=4, hk=2, d=16, page=16, dtype=torch.float32, device="cpu", kv_cache_dtype="fp8")
    out = be.forward(prefill.q, prefill.k, prefill.v, prefill.k_cache, prefill.v_cache, prefill.prefill_meta(True),
                     prefill.scale)
    assert max_abs_error(out, prefill.reference()) < 1e-5
    assert OUTPUT_TOL < max_abs_error(out, PrefillCase(3, 24, 20, hq=4, hk=2, d=16, page=16, dtype=torch.float32,
                                                       device="cpu").reference()) < 1.0


# -- the bandwidth bound (pure, CPU) ------------------------------------------------------------------
def test_decode_bound_from_the_model_shape_and_the_workload():
    from engine.config import ModelShape
    from labkit.assets.synth import PRESETS
    from labkit.bench.bound import decode_bound, decode_weight_bytes, kv_read_bytes

    shape = ModelShape.from_hf(PRESETS["qwen3-0.6b"])
    # Qwen3-0.6B: 596,049,920 parameters with the tied embedding counted once (as the LM head)
    assert decode_weight_bytes(shape, 2) == 2 * 596_049_920
    assert shape.kv_bytes_per_token(2) == 2 * 28 * 8 * 128 * 2 == 114_688
    # prompt 3, 3 outputs: output 0 from the prefill, then decode steps at contexts 4 and 5
    assert kv_read_bytes([3], [3], 10) == (4 + 5) * 10
    assert kv_read_bytes([3, 100], [3, 1], 10) == (4 + 5) * 10          # a one-token request never decodes
    b = decode_bound(shape, 2, 2, [3, 5], [3, 2], copy_roof_gb_s=1000.0)
    assert b["min_decode_steps"] == 2 and b["output_tokens"] == 5
    assert b["bytes_moved"] == 2 * 2 * 596_049_920 + (4 + 5 + 6) * 114_688
    assert b["bound_seconds"] == pytest.approx(b["bytes_moved"] / 1e12)
    assert b["bound_tok_s"] == pytest.approx(5 / b["bound_seconds"], abs=0.05)
    with pytest.raises(ValueError):
        decode_bound(shape, 2, 2, [3], [3], copy_roof_gb_s=0.0)


def test_the_nano_vllm_workload_bound_is_derived_not_typed_in():
    """The old evidence said 35,000 tok/s for any model; the derived bound scales with the roof and the model."""
    from engine.config import ModelShape
    from labkit.assets.synth import PRESETS
    from labkit.bench.bound import decode_bound
    from labkit.bench.run import nano_vllm_workload

    prompts, params = nano_vllm_workload()
    outs = [p.max_tokens for p in params]
    assert sum(outs) == 133_966
    big, tiny = (ModelShape.from_hf(PRESETS[n]) for n in ("qwen3-0.6b", "tiny"))
    h200 = decode_bound(big, 2, 2, [len(p) for p in prompts], outs, 4190.0)
    assert 20_000 < h200["bound_tok_s"] < 60_000
    half_roof = decode_bound(big, 2, 2, [len(p) for p in prompts], outs, 2095.0)
    assert half_roof["bound_tok_s"] == pytest.approx(h200["bound_tok_s"] / 2, rel=1e-3)
    assert decode_bound(tiny, 4, 4, [len(p) for p in prompts], outs, 4190.0)["bound_tok_s"] > 10 * h200["bound_tok_s"]


@pytest.mark.parametrize("tok_s, share, verdict", [(21000, 0.55, "PASS"), (15000, 0.4, "REVIEW"),
                                                   (9000, 0.24, "FAIL"), (21000, 1.5, "FAIL")])
def test_bench_checkpoint_floor_and_bound(tok_s, share, verdict, tmp_path, labkit_argv):
    from labkit.evidence import write_evidence

    labkit_argv.checkpoint("cuda.bench-nano-vllm")
    facts = {"output_tokens": 133966, "workload": {"expected_output_tokens": 133966}, "median_tok_s": tok_s,
             "engine": {"init_seconds": 12.0}, "bound": {"copy_roof_gb_s": 4190.0, "share_of_bound": share}}
    record = write_evidence(tmp_path / "b.json", checkpoint="cuda.bench-nano-vllm", kind="gpu-measured",
                            facts=facts, device="cuda")
    assert record["verdict"] == verdict


def test_heavy_sampling_workload_is_nano_vllm_plus_the_processors():
    from labkit.bench.run import nano_vllm_workload

    plain_prompts, plain = nano_vllm_workload(num_seqs=8)
    prompts, heavy = nano_vllm_workload(num_seqs=8, sampling="heavy")
    assert prompts == plain_prompts and [p.max_tokens for p in heavy] == [p.max_tokens for p in plain]
    assert all((p.top_p, p.top_k, p.repetition_penalty) == (0.9, 50, 1.1) for p in heavy)
    assert all(p.needs_processing(0) for p in heavy) and not any(p.needs_processing(0) for p in plain)


def test_json_schema_workload_is_nano_vllm_with_every_request_constrained():
    """--json-schema: the same prompts and lengths, each request under the schema; the plain workload's params
    stay plain (the sampler's one per-row test: no grammar work for unconstrained batches)."""
    from labkit.bench.run import load_json_schema, nano_vllm_workload

    schema = load_json_schema(ROOT / "workloads/bench-schema.json")
    plain_prompts, plain = nano_vllm_workload(num_seqs=8)
    prompts, constrained = nano_vllm_workload(num_seqs=8, json_schema=schema)
    assert prompts == plain_prompts and [p.max_tokens for p in constrained] == [p.max_tokens for p in plain]
    assert all(p.structured_outputs.json == schema and p.structured_outputs.disable_any_whitespace for p in constrained)
    assert all(p._plain and p.structured_outputs is None for p in plain)
    assert not any(p._plain for p in constrained)


def test_the_roofline_bound_adds_compute_and_prefill_terms():
    """With a matmul peak, each phase is at least max(bytes / roof, FLOPs / peak): a wide decode of a large
    model turns compute-bound; a slow peak can only lengthen the bound, never shorten it."""
    from engine.config import ModelShape
    from labkit.assets.synth import PRESETS
    from labkit.bench.bound import attention_flops_per_position, decode_bound, matmul_params

    shape = ModelShape.from_hf(PRESETS["qwen3-8b"])
    layers, head = matmul_params(shape)
    assert layers == 36 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 12288) and head == 151936 * 4096
    assert attention_flops_per_position(shape) == 4 * 32 * 128 * 36
    prompts, outputs = [512] * 256, [256] * 256
    bw = decode_bound(shape, 2, 2, prompts, outputs, copy_roof_gb_s=4000.0)
    rf = decode_bound(shape, 2, 2, prompts, outputs, copy_roof_gb_s=4000.0, matmul_tflops=700.0)
    terms = rf["roofline"]["terms"]
    assert terms["decode_gemm"]["flops"] == 2 * (layers + head) * 255 * 256
    assert terms["decode_gemm"]["bound_by"] == "compute"            # 256 rows of an 8B model per step
    assert terms["decode_attention"]["bound_by"] == "memory"
    assert terms["prefill"]["bound_by"] == "compute"
    assert rf["bound_seconds"] == pytest.approx(sum(t["seconds"] for t in terms.values()))
    assert rf["bound_seconds"] > bw["bound_seconds"]                  # compute and prefill only add time
    slow = decode_bound(shape, 2, 2, prompts, outputs, copy_roof_gb_s=4000.0, matmul_tflops=70.0)
    assert slow["bound_seconds"] > rf["bound_seconds"]
    with pytest.raises(ValueError):
        decode_bound(shape, 2, 2, prompts, outputs, copy_roof_gb_s=4000.0, matmul_tflops=0.0)


def test_workload_bound_calls_the_roofs_as_the_bench_does_on_cuda(tiny_model_dir, monkeypatch):
    """The CUDA branch of workload_bound on a CPU engine, with the two measured roofs stubbed by functions of the
    real ones' signatures (a positional dtype once went to the matrix size and only failed on the H200)."""
    import inspect

    import labkit.bench.timing as timing
    from labkit.bench.run import workload_bound
    from labkit.lab_engine import build_engine

    real = inspect.signature(timing.matmul_peak_tflops)

    def peak(*args, **kwargs):
        bound = real.bind(*args, **kwargs)
        bound.apply_defaults()
        assert isinstance(bound.arguments["n"], int) and isinstance(bound.arguments["dtype"], str)
        return 500.0

    monkeypatch.setattr(timing, "copy_roof_gbs", lambda: 1000.0)
    monkeypatch.setattr(timing, "matmul_peak_tflops", peak)
    built = build_engine(str(tiny_model_dir), "cpu", "torch")
    try:
        out = workload_bound(built.engine, [[1, 2, 3]] * 2, [4, 4], "cuda", tok_s=10.0)
    finally:
        built.engine.close()
    assert out["roofline"]["matmul_peak_tflops"] == 500.0 and out["copy_roof_gb_s"] == 1000.0
    assert out["share_of_bound"] == round(10.0 / out["bound_tok_s"], 3)


def test_a_larger_preset_is_judged_by_no_checkpoint():
    """The bench checkpoints' floors are the 0.6B's: an 8B-shaped run is evidence that says why it is not judged."""
    facts = {}
    assert judged_checkpoint("cuda.latency", {"synthetic": True, "preset": "qwen3-8b"}, facts) is None
    assert "qwen3-8b" in facts["not_judged"]
    for identity in ({"synthetic": True, "preset": "qwen3-0.6b"}, {"synthetic": False, "preset": None}):
        facts = {}
        assert judged_checkpoint("cuda.latency", identity, facts) == "cuda.latency" and not facts


def test_latency_reads_each_full_decode_step_s_gpu_span(tiny_model_dir, monkeypatch):
    """The latency workload's ``gpu`` facts come from the full decode steps' device spans: given spans of
    0.6 ms one every 1 ms (what engine/device_clock.py reports on CUDA), each step took 0.6 ms on the GPU
    with 0.4 ms gaps; the prefill step's span is not one of them. Off CUDA (no spans) the facts say n 0."""
    import dataclasses

    from engine import LLMEngine
    from labkit.bench.run import bench_latency

    step = LLMEngine.step
    clock = iter(range(10**6))

    def with_span(self):
        out = step(self)
        t = next(clock) * 1_000_000
        return dataclasses.replace(out, device_span=(t, t + 600_000) if not out.is_prefill else (t, t + 50_000_000))

    plain = bench_latency(str(tiny_model_dir), "cpu", "torch", batches=(2,), input_len=8, output_len=5,
                          modes=[("eager", True, False)])["eager"]["batch_2"]
    assert plain["decode_steps"] == 4 and plain["gpu"]["step_ms"]["n"] == 0 and plain["gpu"]["busy_fraction"] is None
    monkeypatch.setattr(LLMEngine, "step", with_span)
    gpu = bench_latency(str(tiny_model_dir), "cpu", "torch", batches=(2,), input_len=8, output_len=5,
                        modes=[("eager", True, False)])["eager"]["batch_2"]["gpu"]
    assert gpu["step_ms"]["n"] == 4 and gpu["step_ms"]["p50"] == 0.6 and gpu["step_ms"]["max"] == 0.6
    assert gpu["gap_ms"]["n"] == 3 and gpu["gap_ms"]["p50"] == 0.4 and gpu["busy_fraction"] == round(2.4 / 3.6, 4)


def test_latency_rounds_pool_their_steps_and_say_each_round_s_median(tiny_model_dir):
    from labkit.bench.run import bench_latency

    r = bench_latency(str(tiny_model_dir), "cpu", "torch", batches=(1,), input_len=8, output_len=5,
                      modes=[("eager", True, False)], rounds=3)["eager"]
    assert set(r) == {"engine", "batch_1"}
    b1 = r["batch_1"]
    assert b1["decode_steps"] == 3 * 4 and len(b1["round_medians"]) == 3
    assert min(b1["round_medians"]) <= b1["ms_per_output_token_median"] <= max(b1["round_medians"])


def test_latency_at_one_batch_is_evidence_no_checkpoint_judges(tiny_model_dir, tmp_path, monkeypatch):
    """--batch narrows the latency workload to one batch; cuda.latency judges batches 1, 8 and 64, so that
    evidence names no checkpoint and says why; the default run names it. (The run is stubbed: CUDA only.)"""
    import labkit.assets.identity as identity
    import labkit.bench.run as bench_run
    import labkit.lab_engine as lab_engine

    seen = []
    real = identity.model_identity      # the tiny preset is judged by no checkpoint: a checkpoint model's identity
    monkeypatch.setattr(identity, "model_identity", lambda path: {**real(path), "synthetic": False, "preset": None})
    monkeypatch.setattr(lab_engine, "detect_device", lambda device: "cuda")
    monkeypatch.setattr(bench_run, "bench_latency", lambda *a, **kw: seen.append(kw) or {})
    one = run_bench("latency", out=tmp_path / "one.json", model=str(tiny_model_dir), batch=1, repeats=5)
    assert seen[-1]["batches"] == (1,) and seen[-1]["rounds"] == 5
    assert one["checkpoint"] is None and "--batch 1" in one["facts"]["not_judged"]
    default = run_bench("latency", out=tmp_path / "all.json", model=str(tiny_model_dir))
    assert seen[-1]["batches"] == (1, 8, 64) and seen[-1]["rounds"] == 1
    assert default["checkpoint"] == "cuda.latency" and "not_judged" not in default["facts"]
