"""`labkit bench --workload serve`: one trace, offline and served, in one run.

(a) Offline: the trace's requests through ``LLMEngine.generate`` (what ``LLM.generate`` runs) on a freshly
    built engine: a first (cold) pass right after start-up, then, with the prefix cache reset, a warm pass.
    first_over_warm says how much first-use work start-up's warmup left for the first burst; the Triton
    kernels compiled during each pass are listed (``compiled``) where Triton lets us watch.
(b) Served: the same engine settings in a real ``labkit serve`` process on 127.0.0.1 (its own process,
    its own GIL), driven by the ``labkit load --mode wall`` machinery over the native NDJSON API and then
    the OpenAI API. The server's event log has one ``step`` record per engine step (start and end on the
    machine's monotonic clock, the batch size), from which, inside each API's measured window: the
    engine's busy fraction (time inside ``engine.step()`` / window), and at wide batches (>= wide_batch
    sequences) the step time and the gap between one step's end and the next one's start.

The bound is labkit.bench.bound's decode bound for the trace's actual prompt and output lengths, the
model's shape and a device copy timed in the same run (CUDA only). The evidence says every input.

Every run also states what must hold whatever the hardware (run_assertions): the four runs carry the
same requests and the same output token counts.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from labkit.bench.spans import device_stats, percentiles
from labkit.errors import UserError
from labkit.load.server_process import ServerProcess
from labkit.load.server_steps import read_steps
from labkit.load.trace import TraceOptions, make_trace, write_trace
from engine.args import DEFAULTS
from serve.core.config import serve_defaults

#: The serve bench's trace: 256 requests at once, half 512 and half 1024 prompt tokens, 512 outputs each.
ISSUE_TRACE = TraceOptions(requests=256, prompt_tokens=512, long_prompt_tokens=1024, long_every=2, max_tokens=512,
                           interval_ms=0.0)
#: Engine settings, the same offline and served: the engine part of a server's defaults (serve_defaults), with
#: the trace's context on CUDA (the served engine's context is not fitted to the pool, so both runs hold the same).
SERVED = ("enforce_eager", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "overlap")
CUDA_CONTEXT = 4096


def _settings(device: str) -> dict:
    chosen = {k: v for k, v in serve_defaults(device).items() if k in SERVED}
    if chosen["max_model_len"] == "auto":
        chosen["max_model_len"] = CUDA_CONTEXT
    return {**chosen, "gpu_memory_utilization": DEFAULTS.gpu_memory_utilization}


CUDA_SETTINGS = _settings("cuda")
CPU_SETTINGS = _settings("cpu")
WIDE_BATCH = 200                       # the "decode phase (batch >= 200)" at 256 sequences
LOAD_WARMUP_REQUESTS = 2               # `labkit load`'s default


def settings_for(device: str) -> dict:
    return dict(CUDA_SETTINGS if device.startswith("cuda") else CPU_SETTINGS)


def wide_batch_for(settings: dict, requests: int) -> int:
    """200 at 256 sequences per step; proportionally fewer (at least 1) when fewer can run at once."""
    width = min(settings["max_num_seqs"], requests)
    return max(1, min(WIDE_BATCH, (width * WIDE_BATCH) // 256 or 1))


# --------------------------------------------------------------------------- Triton compiles


@contextmanager
def watch_compiles():
    """Yields a list that collects one entry per Triton kernel specialization compiled (an in-memory cache
    miss) inside the block, or ``None`` when Triton is absent or offers no hook."""
    try:
        import triton
    except ImportError:
        yield None
        return
    seen: list[str] = []

    def hook(*args, **kwargs):
        fn = kwargs.get("fn")
        name = getattr(fn, "name", None) or getattr(getattr(fn, "fn", None), "__name__", None) or "?"
        seen.append(str(kwargs.get("repr") or name)[:300])
        return False                   # never skip the compile

    knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
    if knobs is not None and hasattr(knobs, "jit_cache_hook"):
        old = knobs.jit_cache_hook
        knobs.jit_cache_hook = hook
        try:
            yield seen
        finally:
            knobs.jit_cache_hook = old
        return
    from triton.runtime.jit import JITFunction

    if not hasattr(JITFunction, "cache_hook"):
        yield None
        return
    old = JITFunction.cache_hook
    JITFunction.cache_hook = hook
    try:
        yield seen
    finally:
        JITFunction.cache_hook = old


def _kernel_names(compiled: list[str] | None) -> dict[str, int] | None:
    if compiled is None:
        return None
    out: dict[str, int] = {}
    for entry in compiled:
        name = entry.split("[", 1)[0].split("(", 1)[0]
        out[name] = out.get(name, 0) + 1
    return dict(sorted(out.items()))


# --------------------------------------------------------------------------- (a) offline


def _pass_record(timed, compiled: list[str] | None, wide: int) -> dict:
    rec = timed.record()
    rec["requests"] = len(timed.output_lens or [])
    rec["compiled_kernels"] = _kernel_names(compiled)
    rec["compiled"] = None if compiled is None else compiled[:40]
    decode_wide = [s * 1e3 for p, b, s in (timed.steps or []) if not p and b >= wide]
    rec["wide_decode_step_ms"] = percentiles(decode_wide)
    return rec


class _Waits:
    """on_step for LLMEngine.generate: the wide decode steps' wait for their sampled ids (StepOutput.wait_s),
    and every step's span on the GPU (CUDA)."""

    def __init__(self, wide: int):
        self.wide, self.ms, self.spans = wide, [], []

    def __call__(self, out) -> None:
        if not out.is_prefill and len(out.seqs) >= self.wide:
            self.ms.append(out.wait_s * 1e3)
        if out.device_span is not None:
            self.spans.append((*out.device_span, len(out.seqs)))


def run_offline(model_dir: str, device: str, attention: str, settings: dict, reqs: list[dict], wide: int) -> dict:
    from engine import SamplingParams
    from labkit.bench.run import engine_facts, engine_for, workload_bound
    from labkit.lab_engine import release_engine, timed_generate

    prompts = [r["prompt_token_ids"] for r in reqs]
    params = [SamplingParams(temperature=float(r["temperature"]), max_tokens=int(r["max_tokens"]),
                             ignore_eos=bool(r["ignore_eos"])) for r in reqs]
    kw = {k: v for k, v in settings.items() if k != "enforce_eager"}
    engine = engine_for(model_dir, device, attention, settings["enforce_eager"], **kw)
    try:
        engine.tokenizer                       # loaded before the clock starts (the server loads its own at start)
        facts = {"engine": engine_facts(engine), "warmup": engine.describe()["warmup"]}
        with watch_compiles() as compiled:
            cold = timed_generate(engine, prompts, params, steps=True)
        engine.reset_prefix_cache()            # the warm pass must not reuse the cold pass's prefixes
        waits = _Waits(wide)
        with watch_compiles() as compiled_warm:
            warm = timed_generate(engine, prompts, params, steps=True, also=waits)
        facts["cold"] = _pass_record(cold, compiled, wide)
        facts["warm"] = _pass_record(warm, compiled_warm, wide)
        facts["warm"]["wide_decode_wait_ms"] = percentiles(waits.ms)
        facts["warm"] |= device_stats(waits.spans, None, None, wide)
        facts["first_over_warm"] = round(cold.seconds / warm.seconds, 3) if warm.seconds > 0 else None
        facts["bound"] = workload_bound(engine, prompts, warm.output_lens, device)
    finally:
        release_engine(engine)
    return facts


# --------------------------------------------------------------------------- (b) served


def run_served(model_dir: str, device: str, attention: str, settings: dict, trace_path: Path, out_dir: Path,
               show_progress: bool = False, engine_process: bool = False, tag: str = "") -> tuple[dict, dict, Path, dict]:
    """Native then OpenAI replay against one server (``engine_process``: its engine in a process of its own);
    returns (native record, openai record, server log, server facts). ``tag`` names this run's files."""
    from labkit.load.replay import LoadOptions, run_load

    log = out_dir / f"serve-server{tag}.jsonl"
    server = ServerProcess.start(model_dir, device, attention, settings, log, out_dir / f"serve-server{tag}.out",
                                 engine_process=engine_process)
    records = {}
    try:
        for api in ("native", "openai"):
            records[api] = run_load(LoadOptions(trace=trace_path, out=out_dir / f"serve-{api}{tag}.jsonl",
                                                endpoints=[server.url], mode="wall", api=api,
                                                warmup_requests=LOAD_WARMUP_REQUESTS, timeout_s=1800.0,
                                                show_progress=show_progress))
    finally:
        code = server.stop()
    return records["native"], records["openai"], log, {"url": server.url, "exit_code": code, "log": str(log),
                                                        "output": str(server.output), "engine_process": engine_process}


# --------------------------------------------------------------------------- the server's steps


def step_stats(steps: list[dict], start_ns: int, end_ns: int, wide: int) -> dict:
    """Inside [start_ns, end_ns]: busy fraction, and at batch >= wide the step times and inter-step gaps (ms)."""
    span = end_ns - start_ns
    inside = sorted((s for s in steps if s["t_ns"] > start_ns and s["start_ns"] < end_ns), key=lambda s: s["start_ns"])
    busy = sum(min(s["t_ns"], end_ns) - max(s["start_ns"], start_ns) for s in inside)
    wide_steps = [s for s in inside if s["num_seqs"] >= wide]
    pairs = [(a, b) for a, b in zip(inside, inside[1:]) if a["num_seqs"] >= wide and b["num_seqs"] >= wide]
    return {"window_s": round(span / 1e9, 6), "steps": len(inside),
            "busy_s": round(busy / 1e9, 6), "engine_busy_fraction": round(busy / span, 4) if span > 0 else None,
            "wide_batch": wide, "wide_steps": len(wide_steps),
            "wide_step_ms": percentiles([(s["t_ns"] - s["start_ns"]) / 1e6 for s in wide_steps]),
            "wide_wait_ms": percentiles([s["wait_s"] * 1e3 for s in wide_steps if "wait_s" in s]),
            "wide_gap_ms": percentiles([(b["start_ns"] - a["t_ns"]) / 1e6 for a, b in pairs]),
            "wide_gap_parts_ms": gap_parts(pairs),
            **device_stats([(s["gpu_start_ns"], s["gpu_end_ns"], s["num_seqs"]) for s in inside if "gpu_start_ns" in s],
                           start_ns, end_ns, wide)}


#: the owner's time between two steps, by part, as the worker's step record names them ("before")
GAP_PARTS = ("deliver", "wakes", "publish", "boundary", "other")


def gap_parts(pairs: list[tuple[dict, dict]]) -> dict:
    """Percentiles (ms) of each part of the gaps between consecutive wide steps (the later step's "before")."""
    return {part: percentiles([b["before"][part + "_us"] / 1e3 for _, b in pairs if part + "_us" in b.get("before", {})])
            for part in GAP_PARTS}


def received_tokens(events: Path, request_ids: set[str]) -> int:
    """Token events the client itself read for the trace's requests (not the server's own count)."""
    from labkit.evidence import read_jsonl

    return sum(1 for _, e in read_jsonl(events) if e.get("event") == "token" and e.get("observer") == "client"
               and e.get("request_id") in request_ids)


def served_facts(record: dict, steps: list[dict], wide: int, request_ids: set[str]) -> dict:
    f = record["facts"]
    client = f["summary"]["observers"].get("client", {})
    window = client.get("window") or {}
    out = {"tok_s": client.get("throughput_tok_s"), "requests": client.get("requests"),
           "completed": client.get("completed"), "output_tokens": received_tokens(Path(f["events"]), request_ids),
           "server_reported_output_tokens": client.get("output_tokens"),
           "ttft_ms": f["ttft_ms"].get("client"), "tpot_ms": f["tpot_ms"].get("client"),
           "verdict": record["verdict"], "events": f["events"]}
    if window:
        out |= step_stats(steps, window["start_ns"], window["end_ns"], wide)
    return out


# --------------------------------------------------------------------------- the workload


SERVE_MODES = {"in-process": False, "engine-process": True}


def parse_serve_modes(text: str | None, engine_process: bool = False) -> list[bool]:
    """``--serve-modes in-process,engine-process,...`` (served runs in that order, one server each) as
    engine_process flags; without it the one mode ``--engine-process/--no-engine-process`` names."""
    if text is None:
        return [engine_process]
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in SERVE_MODES]
    if not names or bad:
        raise UserError(f"--serve-modes takes a comma list of {' / '.join(SERVE_MODES)}, got {text!r}")
    return [SERVE_MODES[n] for n in names]


def mode_name(engine_process: bool) -> str:
    return "engine-process" if engine_process else "in-process"


def bench_serve(model_dir: str, device: str, attention: str, trace: TraceOptions, out_dir: Path,
                show_progress: bool = False, overlap: bool | None = None, modes: list[bool] | None = None) -> dict:
    """Offline once, then one served run (native and OpenAI) per entry of ``modes`` (engine_process flags;
    default one in-process run). The first served run fills ``native``/``openai``/``server`` as always; with
    more than one, ``ab`` lists every served run and ``ab_summary`` their tok/s by mode."""
    modes = modes or [False]
    settings = settings_for(device)
    if overlap is not None:
        settings["overlap"] = overlap
    reqs = make_trace(trace)
    longest = max(r["prompt_tokens"] + r["max_tokens"] for r in reqs)
    if longest > settings["max_model_len"]:
        raise UserError(f"the trace's longest request ({longest} tokens) exceeds max-model-len "
                        f"{settings['max_model_len']} of the serve bench")
    wide = wide_batch_for(settings, len(reqs))
    out_dir.mkdir(parents=True, exist_ok=True)
    trace_path = out_dir / "serve-trace.jsonl"
    trace_summary = write_trace(trace_path, trace)
    facts: dict = {"trace": {"options": asdict(trace), "path": str(trace_path), "sha256": trace_summary["sha256"],
                             "requests": len(reqs), "prompt_tokens": sum(r["prompt_tokens"] for r in reqs),
                             "expected_output_tokens": sum(r["max_tokens"] for r in reqs)},
                   "settings": settings, "wide_batch": wide}
    facts["offline"] = run_offline(model_dir, device, attention, settings, reqs, wide)
    off = facts["offline"]
    warm_tok_s = off["warm"]["tok_s"]
    ratio = lambda a: round(a / warm_tok_s, 3) if a and warm_tok_s else None  # noqa: E731
    ids = {r["request_id"] for r in reqs}
    served = []
    for i, engine_process in enumerate(modes):
        tag = "" if i == 0 else f"-{i + 1}-{mode_name(engine_process)}"
        native, openai, log, server = run_served(model_dir, device, attention, settings, trace_path, out_dir,
                                                 show_progress, engine_process, tag)
        steps = read_steps(log)
        run = {"mode": mode_name(engine_process), "server": {**server, "steps_logged": len(steps)},
               "native": served_facts(native, steps, wide, ids), "openai": served_facts(openai, steps, wide, ids)}
        run["ratios"] = {"native_over_offline": ratio(run["native"]["tok_s"]),
                         "openai_over_offline": ratio(run["openai"]["tok_s"])}
        served.append(run)
    first = served[0]
    facts["engine_process"] = modes[0]
    facts["server"], facts["native"], facts["openai"] = first["server"], first["native"], first["openai"]
    facts["ratios"] = {**first["ratios"], "first_over_warm": off["first_over_warm"]}
    runs = {"offline_cold": off["cold"], "offline_warm": off["warm"], "native": facts["native"], "openai": facts["openai"]}
    if len(served) > 1:
        facts["ab"] = served
        facts["ab_summary"] = ab_summary(served)
        for i, run in enumerate(served[1:], start=2):
            runs[f"native@{i}"], runs[f"openai@{i}"] = run["native"], run["openai"]
    facts["requests_per_run"] = {k: v.get("completed", v.get("requests")) for k, v in runs.items()}
    facts["output_tokens_per_run"] = {k: v["output_tokens"] for k, v in runs.items()}
    facts["runs_agree"] = (len(set(facts["requests_per_run"].values())) == 1
                           and len(set(facts["output_tokens_per_run"].values())) == 1)
    bound = off["bound"]
    if bound.get("bound_tok_s"):
        bound = {**bound, "share_of_bound": {k: (round(v["tok_s"] / bound["bound_tok_s"], 3) if v.get("tok_s") else None)
                                             for k, v in (("offline_warm", off["warm"]), ("native", facts["native"]),
                                                          ("openai", facts["openai"]))}}
        bound["share_of_bound_max"] = max(x for x in bound["share_of_bound"].values() if x is not None)
    facts["bound"] = bound
    return facts


def ab_summary(served: list[dict]) -> dict:
    """Per mode: every run's native and OpenAI tok/s, ratio to offline, busy fraction and wide gap p50."""
    out: dict[str, dict] = {}
    for run in served:
        m = out.setdefault(run["mode"], {"runs": 0, "native_tok_s": [], "openai_tok_s": [], "native_over_offline": [],
                                         "openai_over_offline": [], "native_busy": [], "native_wide_gap_p50_ms": [],
                                         "native_gpu_busy": [], "native_wide_gpu_gap_p50_ms": []})
        m["runs"] += 1
        m["native_tok_s"].append(run["native"].get("tok_s"))
        m["openai_tok_s"].append(run["openai"].get("tok_s"))
        m["native_over_offline"].append(run["ratios"]["native_over_offline"])
        m["openai_over_offline"].append(run["ratios"]["openai_over_offline"])
        m["native_busy"].append(run["native"].get("engine_busy_fraction"))
        m["native_wide_gap_p50_ms"].append((run["native"].get("wide_gap_ms") or {}).get("p50"))
        m["native_gpu_busy"].append(run["native"].get("gpu_busy_fraction"))
        m["native_wide_gpu_gap_p50_ms"].append((run["native"].get("wide_gpu_gap_ms") or {}).get("p50"))
    return out


def run_assertions(facts: dict) -> list[dict]:
    """What every serve bench run must show, on any device: the same work in all four runs, all of it."""
    from labkit.checks import run_assertion

    expected = facts["trace"]["expected_output_tokens"]
    out = [run_assertion("facts.runs_agree", "is_true", name="same requests and output tokens in all four runs",
                         why="offline cold, offline warm, native and OpenAI served the same requests and tokens")]
    for run in facts["output_tokens_per_run"]:
        out.append(run_assertion(f"facts.output_tokens_per_run.{run}", "eq", expected, name=f"{run}: every output token",
                                 why="the trace's requests x max_tokens (ignore_eos) were generated"))
        out.append(run_assertion(f"facts.requests_per_run.{run}", "eq", facts["trace"]["requests"],
                                 name=f"{run}: every request", why="every request of the trace completed"))
    for run in ("native", "openai"):        # tokens the client read == tokens the server says it streamed
        out.append(run_assertion(f"facts.{run}.output_tokens", "eq", facts[run].get("server_reported_output_tokens"),
                                 name=f"{run}: client token count equals the server's",
                                 why="token events (native) or token chunks (OpenAI, the finish chunk's held-back "
                                     "text is no token) counted by the client equal the server's count "
                                     "(finished.num_completion_tokens / usage.completion_tokens)"))
    out.append(run_assertion("facts.native.wide_steps", "gt", 0, name="wide steps seen",
                             why="the server's log has steps at the wide batch inside the native window"))
    out.append(run_assertion("facts.server.exit_code", "eq", 0, name="server stopped cleanly",
                             why="labkit serve exited 0 on SIGINT after the replays"))
    for i, run in enumerate(facts.get("ab", [])[1:], start=1):     # further served runs (--serve-modes)
        for api in ("native", "openai"):
            out.append(run_assertion(f"facts.ab.{i}.{api}.output_tokens", "eq",
                                     facts["ab"][i][api].get("server_reported_output_tokens"),
                                     name=f"{api}@{i + 1} ({run['mode']}): client token count equals the server's",
                                     why="as for the first served run"))
        out.append(run_assertion(f"facts.ab.{i}.server.exit_code", "eq", 0, name=f"server @{i + 1} stopped cleanly",
                                 why="labkit serve exited 0 on SIGINT after the replays"))
    return out


def run_serve_bench(out: Path | None = None, model: str | None = None, device: str = "auto", attention: str = "auto",
                    trace: TraceOptions | None = None, show_progress: bool = False,
                    overlap: bool | None = None, modes: list[bool] | None = None) -> dict:
    """`labkit bench --workload serve`: the evidence (runs/bench-serve.json, logs in runs/bench-serve/). On
    CUDA with the default trace it is judged as cuda.bench-serve; on a CPU (tiny model, a small trace) it is
    evidence of the mechanism (cpu-real-engine) for no checkpoint, judged by its run assertions."""
    from labkit.assets.identity import model_identity
    from labkit.assets.resolve import resolve_model
    from labkit.evidence import write_evidence
    from labkit.lab_engine import detect_device
    from labkit.paths import default_out

    trace = trace or ISSUE_TRACE
    trace.check()
    device = detect_device(device)
    ref = resolve_model(model, device)
    path = out or default_out("bench-serve.json")
    facts = bench_serve(str(ref.path), device, attention, trace, path.with_suffix(""), show_progress, overlap, modes)
    facts["device"] = device
    cuda = device.startswith("cuda")
    checkpoint = "cuda.bench-serve" if cuda and trace == ISSUE_TRACE else None
    return write_evidence(path, checkpoint=checkpoint, kind="gpu-measured" if cuda else "cpu-real-engine",
                          facts=facts, device=device, model=dict(model_identity(ref.path)),
                          run_assertions=run_assertions(facts))
