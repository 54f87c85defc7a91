"""`labkit bench`: offline throughput and latency of the engine on fixed workloads, with baselines in the same run.

Every figure is measured on this machine in this process; evidence keeps every repeat.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from random import randint, seed

from engine import LLMEngine, RequestError, SamplingParams, StructuredOutputsParams
from engine.args import PRESETS
from labkit.errors import UserError
from labkit.evidence import write_evidence
from labkit.lab_engine import release_engine, sync_device, timed_generate
from labkit.paths import default_out

#: the model the bench checkpoints' figures are for (a synthetic run of another preset is judged by none)
CHECKPOINT_PRESET = "qwen3-0.6b"
WORKLOADS = ("nano-vllm", "graph-vs-eager", "latency", "attention", "gemv", "nano-batches")
# nano-vllm's bench.py engine settings (engine/args.py's preset)
NANO_VLLM_ENGINE = PRESETS["nano-vllm"]


#: --sampling: "plain" is nano-vllm's (temperature only); "heavy" adds the processors on every request
#: (engine/sampling/processors.py), so their cost shows next to the plain figure.
SAMPLING = {"plain": {}, "heavy": dict(top_p=0.9, top_k=50, repetition_penalty=1.1)}


def nano_vllm_workload(num_seqs: int = 256, max_input: int = 1024, max_output: int = 1024, sampling: str = "plain",
                       json_schema: dict | None = None):
    """nano-vllm's bench.py: random.seed(0); prompts of randint(100,1024) ids in [0,10000]; max_tokens randint(100,1024).
    json_schema: every request's output under it (compact JSON, as labkit serve's default); a request then also
    ends where its JSON does (ignore_eos only keeps EOS from ending it before)."""
    seed(0)
    prompts = [[randint(0, 10000) for _ in range(randint(100, max_input))] for _ in range(num_seqs)]
    extra = dict(SAMPLING[sampling])
    if json_schema is not None:
        extra["structured_outputs"] = StructuredOutputsParams(json=json_schema, disable_any_whitespace=True)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=randint(100, max_output), **extra)
              for _ in range(num_seqs)]
    return prompts, params


def load_json_schema(path: Path) -> dict:
    """--json-schema FILE: a JSON schema object (the engine compiles it, and refuses one xgrammar cannot)."""
    import json

    try:
        schema = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"--json-schema {path}: cannot read a JSON schema: {' '.join(str(e).split())[:200]}") from None
    if not isinstance(schema, dict):
        raise UserError(f"--json-schema {path}: a JSON schema is an object, got {type(schema).__name__}")
    return schema


def fixed_workload(num_seqs: int, input_len: int, output_len: int, start: int = 1000):
    prompts = [[(start + 7919 * i + j) % 150000 for j in range(input_len)] for i in range(num_seqs)]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len) for _ in range(num_seqs)]
    return prompts, params


def engine_for(model_dir: str, device: str, attention: str, eager: bool, **kw) -> LLMEngine:
    return LLMEngine(model_dir, device=device, attention_backend=attention, enforce_eager=eager, **kw)


def engine_facts(engine: LLMEngine) -> dict:
    d = engine.describe()
    return {"init_seconds": d["init_seconds"], "load_seconds": d["load_seconds"],
            "capture_seconds": d["graph"]["capture_seconds"], "graph_buckets": d["graph"]["buckets"],
            "kv_blocks": d["num_kvcache_blocks"], "attention_backend": d["attention_backend"],
            "memory": d["memory"], "warmup": d["warmup"],
            "qk_norm_rope_kv": (d.get("model") or {}).get("qk_norm_rope_kv"),    # the route: fused, decode-prologue...
            "decode_layer": bool((d.get("model") or {}).get("decode_layer")),    # LAB_DECODE_LAYER's kernel ran
            "l2_prefetch": (d.get("model") or {}).get("l2_prefetch", "0"),     # LAB_L2_PREFETCH's mode
            "fp8_decode": d.get("fp8_decode") or {},         # LAB_FP8_DECODE's knobs ({}: splits.py's)
            "decode_knobs": d.get("decode_knobs") or {}}     # LAB_DECODE's


# -- workloads -------------------------------------------------------------------------------------
def bench_nano_vllm(model_dir: str, device: str, attention: str, eager: bool, repeats: int,
                    profile: bool = False, overlap: bool = False, sampling: str = "plain",
                    json_schema: dict | None = None, num_seqs: int = 256, kv_cache_dtype: str = "auto") -> dict:
    prompts, params = nano_vllm_workload(num_seqs, sampling=sampling, json_schema=json_schema)
    engine = engine_for(model_dir, device, attention, eager, overlap=overlap, kv_cache_dtype=kv_cache_dtype,
                        **NANO_VLLM_ENGINE)
    facts = {"engine": engine_facts(engine), "overlap": overlap, "workload": {
        "name": "nano-vllm", "num_seqs": len(prompts), "input_tokens": sum(map(len, prompts)),
        "expected_output_tokens": sum(p.max_tokens for p in params), "temperature": 0.6, "ignore_eos": True,
        "sampling": sampling, **SAMPLING[sampling], **NANO_VLLM_ENGINE}}
    if json_schema is not None:
        facts["workload"]["structured_outputs"] = {"json": json_schema, "disable_any_whitespace": True,
                                                   "backend": "xgrammar"}
        try:
            t0 = time.perf_counter()
            engine.validate(prompts[0], params[0])             # the one compile (cached for every request)
            facts["workload"]["structured_outputs"]["compile_seconds"] = round(time.perf_counter() - t0, 4)
        except RequestError as e:
            release_engine(engine)
            raise UserError(f"--json-schema: {e}") from None
    engine.generate(["Benchmark: "], SamplingParams())          # nano-vllm's warm-up
    if json_schema is not None:            # and a constrained one: the mask kernel (Triton on CUDA) is built once
        engine.generate(["Benchmark: "], SamplingParams(max_tokens=8, structured_outputs=params[0].structured_outputs))
    runs, timed = [], None
    for _ in range(repeats):               # every repeat starts cold: identical prompts must not hit the prefix cache
        engine.reset_prefix_cache()
        reasons: dict[str, int] = {}
        count = lambda out: [reasons.__setitem__(s.finish_reason, reasons.get(s.finish_reason, 0) + 1)  # noqa: E731
                             for s in out.finished]
        timed = timed_generate(engine, prompts, params, steps=True, also=count)
        runs.append({**timed.record(), "finish_reasons": reasons})
    facts["repeats"] = runs
    facts["output_tokens"] = runs[-1]["output_tokens"]
    facts["first_repeat_tok_s"] = runs[0]["tok_s"]      # nano-vllm's own figure: the first run after its warm-up
    facts["median_tok_s"] = statistics.median(r["tok_s"] for r in runs)
    facts["bound"] = workload_bound(engine, prompts, timed.output_lens, device, facts["median_tok_s"])
    if profile:
        from labkit.bench.profile import profile_run
        engine.reset_prefix_cache()
        facts["profile"] = profile_run(engine, prompts, params)
    release_engine(engine)
    return facts


def workload_bound(engine: LLMEngine, prompts, output_lens: list[int], device: str, tok_s: float | None = None) -> dict:
    """The bound of this workload on this device (labkit.bench.bound's roofline per phase): the model's
    shape, the KV pool's element size, the prompts' and outputs' actual lengths, and the copy roof and
    matmul peak measured now."""
    from labkit.bench.bound import decode_bound

    if not device.startswith("cuda"):
        return {"bound_tok_s": None, "why": "the bound needs a device copy roof and matmul peak (CUDA)"}
    from labkit.bench.timing import copy_roof_gbs, matmul_peak_tflops

    import torch

    dtype = engine.describe()["dtype"]
    weight_element = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    kv_element = engine.probe.kv_cache().element_size()
    out = decode_bound(engine.config.shape, weight_element, kv_element, [len(p) for p in prompts], output_lens,
                       copy_roof_gbs(), matmul_tflops=matmul_peak_tflops(dtype=dtype))
    if tok_s is not None:
        out["measured_tok_s"] = tok_s
        out["share_of_bound"] = round(tok_s / out["bound_tok_s"], 3)
    return out


def _median_run(model_dir, device, attention, eager, num_seqs, input_len, output_len, max_num_seqs,
                warmups=2, repeats=3, graph_buckets: tuple[int, ...] | None = None) -> dict:
    prompts, params = fixed_workload(num_seqs, input_len, output_len)
    kw = dict(max_num_seqs=max_num_seqs, max_model_len=1024, max_num_batched_tokens=4096)
    if graph_buckets is not None:
        kw["graph_buckets"] = graph_buckets
    engine = engine_for(model_dir, device, attention, eager, **kw)
    for _ in range(warmups):
        engine.generate(prompts, params)
    runs = [timed_generate(engine, prompts, params) for _ in range(repeats)]
    routes = _decode_routes(engine, prompts, params)
    out = {"eager": eager, "engine": engine_facts(engine),
           "repeats": [r.record() for r in runs],
           "median_tok_s": round(statistics.median(r.tok_s for r in runs), 1),
           "output_tokens_per_repeat": sorted({r.output_tokens for r in runs}),
           "decode_routes": routes}
    release_engine(engine)
    return out


def _decode_routes(engine: LLMEngine, prompts, params) -> list[str]:
    """One more untimed pass that records the route every decode step took (graph bucket or eager)."""
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp)
    routes = set()
    while not engine.is_finished():
        out = engine.step()
        if out.seqs and not out.is_prefill:
            routes.add(str(out.route))
    return sorted(routes)


#: appendix B.5's uncovered buckets: batch 17 under max_num_seqs 20 has none, so a graph engine falls back to eager
FALLBACK_BUCKETS = (1, 2, 4, 8, 16)


def bench_graph_vs_eager(model_dir: str, device: str, attention: str) -> dict:
    """B.4 (16 requests) and B.5 (17 under max_num_seqs 20), each eager and with graphs in separate engines; then
    B.5 step 4: the same 17 requests on a graph engine whose buckets stop at 16 (``b5_fallback``: its decodes take
    the eager fallback) against B.5's explicit eager engine and its covering bucket, with each engine's start-up
    (init, capture) apart from the timed window."""
    facts = {}
    for name, (n, max_seqs) in {"b4": (16, 32), "b5": (17, 20)}.items():   # appendix B.4, B.5
        eager = _median_run(model_dir, device, attention, True, n, 128, 32, max_seqs)
        graph = _median_run(model_dir, device, attention, False, n, 128, 32, max_seqs)
        facts[name] = {"num_seqs": n, "input_len": 128, "output_len": 32, "max_num_seqs": max_seqs,
                       "eager": eager, "graph": graph,
                       "graph_over_eager": round(graph["median_tok_s"] / eager["median_tok_s"], 3)}
    b5 = facts["b5"]
    fallback = _median_run(model_dir, device, attention, False, 17, 128, 32, 20, graph_buckets=FALLBACK_BUCKETS)
    facts["b5_fallback"] = {
        "num_seqs": 17, "input_len": 128, "output_len": 32, "max_num_seqs": 20, "graph_buckets": list(FALLBACK_BUCKETS),
        "graph": fallback,
        "fallback_over_eager": round(fallback["median_tok_s"] / b5["eager"]["median_tok_s"], 3),
        "fallback_over_covered": round(fallback["median_tok_s"] / b5["graph"]["median_tok_s"], 3),
        "startup_seconds": {side: {"init": run["engine"]["init_seconds"], "capture": run["engine"]["capture_seconds"]}
                            for side, run in (("eager", b5["eager"]), ("covered", b5["graph"]),
                                              ("fallback", fallback))}}
    return facts


LATENCY_BATCHES = (1, 8, 64)


def bench_latency(model_dir: str, device: str, attention: str, batches=LATENCY_BATCHES, input_len=128,
                  output_len=128, modes: list[tuple[str, bool, bool]] | None = None, rounds: int = 1,
                  kv_cache_dtype: str = "auto") -> dict:
    """Time per output token at each batch: eager and graph one step at a time (each step timed alone, from
    a synchronized start), and on CUDA graph_overlap, the overlapped decode `labkit serve` runs by default:
    there a step's tokens arrive while the next step computes, so the time per token is the interval
    between two consecutive steps' outputs (no synchronization between them). ``gpu``: the same steps as the
    GPU ran them (their device spans, engine/device_clock.py): each step's time on the GPU and the gaps
    between consecutive steps, where it had nothing of the engine's to run (None off CUDA).
    modes: (name, enforce_eager, overlap) to run (default: the three above). rounds: timed passes of each
    batch after its warm-up (the median is over every step of them; ``round_medians`` says how they spread)."""
    from labkit.bench.spans import device_stats

    facts = {}
    if modes is None:
        modes = [("eager", True, False), ("graph", False, False)]
        if device.startswith("cuda"):
            modes.append(("graph_overlap", False, True))
    for mode, eager, overlap in modes:
        engine = engine_for(model_dir, device, attention, eager, max_num_seqs=max(batches), max_model_len=1024,
                            max_num_batched_tokens=8192, overlap=overlap, kv_cache_dtype=kv_cache_dtype)
        facts[mode] = {"engine": engine_facts(engine)}
        for b in batches:
            prompts, params = fixed_workload(b, input_len, output_len)
            engine.generate(prompts, params)                     # warm-up at this batch size
            step_ms, spans, round_medians = [], [], []
            for _ in range(rounds):
                ms = _latency_round(engine, prompts, params, b, overlap, spans)
                round_medians.append(round(statistics.median(ms), 4))
                step_ms += ms
            gpu = device_stats(spans, None, None, b)
            facts[mode][f"batch_{b}"] = {"decode_steps": len(step_ms),
                                         "ms_per_output_token_median": round(statistics.median(step_ms), 4),
                                         "ms_per_output_token_mean": round(statistics.fmean(step_ms), 4),
                                         "gpu": {"busy_fraction": gpu["gpu_busy_fraction"],
                                                 "step_ms": gpu["wide_gpu_step_ms"], "gap_ms": gpu["wide_gpu_gap_ms"]}}
            if rounds > 1:
                facts[mode][f"batch_{b}"]["round_medians"] = round_medians
            bound = latency_bound(engine, device, b, input_len + output_len / 2)
            if bound is not None:
                bound["measured_over_bound"] = round(statistics.median(step_ms) / bound["bound_ms_per_step"], 3)
                facts[mode][f"batch_{b}"]["bound"] = bound
        release_engine(engine)
    return facts


def _latency_round(engine: LLMEngine, prompts, params, batch: int, overlap: bool, spans: list) -> list[float]:
    """One pass of the batch: ms per output token of each full decode step (appends their device spans)."""
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp)
    step_ms, last = [], None
    while not engine.is_finished():
        if not overlap:
            sync_device()
        t0 = time.perf_counter()
        out = engine.step()
        now = time.perf_counter()
        full = not out.is_prefill and len(out.seqs) == batch
        if full and (not overlap or last is not None):
            step_ms.append((now - (last if overlap else t0)) * 1e3)
        if full and out.device_span is not None:
            spans.append((*out.device_span, batch))
        last = now if full else None
    return step_ms


def latency_bound(engine: LLMEngine, device: str, batch: int, context: float) -> dict | None:
    """The decode step's weight + K/V read time at the copy roof measured now (labkit.bench.bound.step_bound)."""
    if not device.startswith("cuda"):
        return None
    import torch

    from labkit.bench.timing import copy_roof_gbs
    from labkit.bench.bound import step_bound

    weight_element = torch.empty(0, dtype=getattr(torch, engine.describe()["dtype"])).element_size()
    return step_bound(engine.config.shape, weight_element, engine.probe.kv_cache().element_size(), batch, context,
                      copy_roof_gbs())


def bench_hf_baseline(model_dir: str, device: str, attention: str, num_seqs: int = 32, output_len: int = 128) -> dict:
    """Transformers generate vs ours on the same fraction of the nano-vllm workload (same prompts, same lengths)."""
    import torch
    from transformers import AutoModelForCausalLM

    prompts, _ = nano_vllm_workload()
    prompts = prompts[:num_seqs]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=output_len) for _ in prompts]
    engine = engine_for(model_dir, device, attention, False, **NANO_VLLM_ENGINE)
    engine.generate(prompts[:2], params[:2])
    ours = timed_generate(engine, prompts, params)
    release_engine(engine)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    width = max(map(len, prompts))
    pad = 151643
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    gen_kw = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=True, temperature=0.6,
                  top_k=0, top_p=1.0, pad_token_id=pad)
    with torch.inference_mode():
        model.generate(input_ids=ids[:2], attention_mask=mask[:2], **{**gen_kw, "max_new_tokens": 8, "min_new_tokens": 8})
        sync_device()
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, **gen_kw)
        sync_device()
        hf_s = time.perf_counter() - t0
    hf_tokens = int((out.shape[1] - width) * out.shape[0])
    del model
    release_engine(None)
    return {"fraction": f"first {num_seqs} of the nano-vllm workload's prompts, {output_len} output tokens each",
            "ours": ours.record(),
            "hf": {"seconds": round(hf_s, 4), "output_tokens": hf_tokens, "tok_s": round(hf_tokens / hf_s, 1),
                   "settings": "transformers generate, left-padded batch, sampling at 0.6, default attention"},
            "ours_over_hf": round(ours.tok_s / (hf_tokens / hf_s), 2)}


def run_bench(workload: str, out: Path | None = None, model: str | None = None, device: str = "auto",
              attention: str = "auto", baseline: str | None = None, repeats: int = 1, eager: bool = False,
              profile: bool = False, sweep: bool = False, overlap: bool | None = None, sampling: str = "plain",
              json_schema: Path | None = None, batch: int | None = None, context: int | None = None,
              kv_cache_dtype: str = "auto") -> dict:
    """batch (latency): that batch only, not LATENCY_BATCHES (evidence no checkpoint judges); batch, context
    (nano-batches): the decode step's shape; repeats: the nano-vllm workload's timed repeats, the latency
    workload's rounds per batch; kv_cache_dtype (nano-vllm, latency): fp8 runs the engine with an FP8 KV cache
    (its bound follows: the pool's bytes per value), evidence no checkpoint judges (theirs are the default cache's)."""
    from labkit.lab_engine import detect_device
    from labkit.assets.identity import model_identity
    from labkit.assets.resolve import resolve_model

    if workload not in WORKLOADS:
        raise UserError(f"unknown workload {workload!r}: choose one of {', '.join(WORKLOADS)}")
    if baseline not in (None, "hf"):
        raise UserError(f"unknown baseline {baseline!r}: the only baseline is hf")
    if profile and workload != "nano-vllm":
        raise UserError("--profile applies to --workload nano-vllm")
    if sweep and workload not in ("attention", "gemv"):
        raise UserError("--sweep applies to --workload attention and gemv")
    if overlap and workload != "nano-vllm":
        raise UserError("--overlap applies to --workload nano-vllm")
    if sampling not in SAMPLING:
        raise UserError(f"unknown sampling {sampling!r}: choose one of {', '.join(SAMPLING)}")
    if sampling != "plain" and workload != "nano-vllm":
        raise UserError("--sampling applies to --workload nano-vllm")
    if json_schema is not None and workload != "nano-vllm":
        raise UserError("--json-schema applies to --workload nano-vllm")
    if batch is not None and (workload not in ("latency", "nano-batches") or batch < (2 if workload == "nano-batches" else 1)):
        raise UserError("--batch applies to --workload latency (at least 1), nano-batches (at least 2) and step-budget")
    if context is not None and (workload != "nano-batches" or context < 1):
        raise UserError("--context applies to --workload nano-batches (at least 1) and step-budget")
    if repeats != 1 and workload not in ("nano-vllm", "latency"):
        raise UserError("--repeats applies to --workload nano-vllm and latency")
    if kv_cache_dtype not in ("auto", "fp8"):
        raise UserError(f"--kv-cache-dtype must be auto or fp8, got {kv_cache_dtype!r}")
    if kv_cache_dtype != "auto" and workload not in ("nano-vllm", "latency", "attention"):
        raise UserError("--kv-cache-dtype applies to --workload nano-vllm, latency, attention and step-budget")
    schema = load_json_schema(json_schema) if json_schema is not None else None
    device = detect_device(device)
    if overlap is None:     # nano-vllm: overlapped decode by default on CUDA (--no-overlap for the sync path)
        overlap = workload == "nano-vllm" and device.startswith("cuda")
    if workload == "attention":
        return _run_attention_bench(out, device, attention, sweep, kv_cache_dtype)
    if workload == "gemv":
        return _run_gemv_bench(out, model, device, sweep)
    if workload == "nano-batches":
        return _run_nano_batches_bench(out, model, device, attention, batch, context, baseline, eager)
    if not device.startswith("cuda") and (workload != "nano-vllm" or not eager):
        raise UserError(f"bench --workload {workload} needs CUDA (graphs); on CPU only `--workload nano-vllm --enforce-eager` runs")
    ref = resolve_model(model, device)
    model_dir = str(ref.path)
    if workload == "nano-vllm":
        facts = bench_nano_vllm(model_dir, device, attention, eager, repeats, profile, overlap, sampling, schema,
                                kv_cache_dtype=kv_cache_dtype)
        # the checkpoint's figure is nano-vllm's workload as it is (plain sampling, unconstrained)
        checkpoint = "cuda.bench-nano-vllm" if device.startswith("cuda") and not eager and sampling == "plain" \
            and schema is None else None
    elif workload == "graph-vs-eager":
        facts, checkpoint = bench_graph_vs_eager(model_dir, device, attention), "cuda.graph-vs-eager"
    else:
        facts = bench_latency(model_dir, device, attention, batches=(batch,) if batch else LATENCY_BATCHES,
                              rounds=repeats, kv_cache_dtype=kv_cache_dtype)
        checkpoint = "cuda.latency"
        if batch is not None:
            checkpoint = None
            facts["not_judged"] = f"--batch {batch}: cuda.latency judges batches {', '.join(map(str, LATENCY_BATCHES))}"
    if kv_cache_dtype != "auto" and checkpoint is not None:
        facts["not_judged"] = f"--kv-cache-dtype {kv_cache_dtype}: {checkpoint}'s figures are the default cache's"
        checkpoint = None
    facts["kv_cache_dtype"] = kv_cache_dtype
    if baseline == "hf":
        facts["baseline_hf"] = bench_hf_baseline(model_dir, device, attention)
    facts["device"] = device
    kind = "gpu-measured" if device.startswith("cuda") else "cpu-real-engine"
    identity = dict(model_identity(ref.path))
    checkpoint = judged_checkpoint(checkpoint, identity, facts)
    return write_evidence(out or default_out(f"bench-{workload}.json"), checkpoint=checkpoint, kind=kind,
                          facts=facts, device=device, model=identity)


def judged_checkpoint(checkpoint: str | None, identity: dict, facts: dict) -> str | None:
    """The checkpoints' figures are the 0.6B's: a run on another synthetic preset (1.7B .. 8B shapes) is
    evidence judged by no checkpoint, and its facts say why."""
    if checkpoint is not None and identity.get("synthetic") and identity.get("preset") not in (None, CHECKPOINT_PRESET):
        facts["not_judged"] = f"model preset {identity['preset']}: {checkpoint}'s figures are {CHECKPOINT_PRESET}'s"
        return None
    return checkpoint


def _run_gemv_bench(out: Path | None, model: str | None, device: str, sweep: bool) -> dict:
    """The batch-1 GEMV at the model's shapes (labkit/bench/gemv.py): evidence no checkpoint judges."""
    from engine.config import ModelShape, read_model_dir
    from labkit.assets.identity import model_identity
    from labkit.assets.resolve import resolve_model
    from labkit.bench.gemv import bench_gemv

    if not device.startswith("cuda"):
        raise UserError("bench --workload gemv needs CUDA (it times GPU kernels)")
    ref = resolve_model(model, device)
    facts = bench_gemv(ModelShape.from_hf(read_model_dir(ref.path)), sweep=sweep)
    facts["device"] = device
    return write_evidence(out or default_out("bench-gemv.json"), checkpoint=None, kind="gpu-measured",
                          facts=facts, device=device, model=dict(model_identity(ref.path)))


def _run_nano_batches_bench(out: Path | None, model: str | None, device: str, attention: str, batch: int | None,
                            context: int | None, baseline: str | None = None, eager: bool = False) -> dict:
    """One decode step whole, as two halves, and as two halves on two streams (labkit/bench/nano_batches.py):
    evidence no checkpoint judges."""
    from labkit.assets.identity import model_identity
    from labkit.assets.resolve import resolve_model
    from labkit.bench.nano_batches import BATCH, CONTEXT, bench_nano_batches

    if baseline or eager:
        raise UserError("--workload nano-batches captures graphs of its own: it takes no --baseline or --enforce-eager")
    if not device.startswith("cuda"):
        raise UserError("bench --workload nano-batches needs CUDA (it times CUDA graphs on two streams)")
    ref = resolve_model(model, device)
    batch, context = batch or BATCH, context or CONTEXT
    engine = engine_for(str(ref.path), device, attention, True, max_num_seqs=batch, max_model_len=context + 16,
                        max_num_batched_tokens=max(8192, context + 16), gpu_memory_utilization=0.9)
    try:
        facts = {"engine": engine_facts(engine), **bench_nano_batches(engine, batch, context), "device": device}
    except ValueError as e:
        raise UserError(str(e)) from None
    finally:
        engine.close()
    return write_evidence(out or default_out("bench-nano-batches.json"), checkpoint=None, kind="gpu-measured",
                          facts=facts, device=device, model=dict(model_identity(ref.path)))


def _run_attention_bench(out: Path | None, device: str, attention: str, sweep: bool,
                         kv_cache_dtype: str = "auto") -> dict:
    """kv_cache_dtype fp8: the backends that read an FP8 cache (not flash_attn), evidence no checkpoint judges
    (cuda.attention-bandwidth's figures are the default cache's)."""
    from engine.attention import available_backends
    from labkit.bench.attention import bench_attention

    if not device.startswith("cuda"):
        raise UserError("bench --workload attention needs CUDA (it times GPU kernels)")
    backends = available_backends(device)
    if attention != "auto":
        if attention not in backends:
            raise UserError(f"attention backend {attention!r} is not available here (available: {', '.join(backends)})")
        backends = [attention]
    if kv_cache_dtype == "fp8":
        if attention == "flash_attn":
            raise UserError("--kv-cache-dtype fp8 needs the triton or torch backend (flash_attn reads no FP8 cache)")
        backends = [b for b in backends if b != "flash_attn"]
    facts = bench_attention(backends, sweep=sweep, kv_cache_dtype=kv_cache_dtype)
    facts["device"] = device
    checkpoint = "cuda.attention-bandwidth"
    if kv_cache_dtype != "auto":
        facts["not_judged"] = f"--kv-cache-dtype {kv_cache_dtype}: {checkpoint}'s figures are the default cache's"
        checkpoint = None
    return write_evidence(out or default_out("bench-attention.json"), checkpoint=checkpoint,
                          kind="gpu-measured", facts=facts, device=device)
