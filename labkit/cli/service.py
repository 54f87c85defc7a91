"""Typer commands of the service half of the lab: serve, client, trace, load, report, simulate.

Each is a module-level function (importable, testable) that ``register(app)`` adds as a top-level command at
the end of this module. Each is a thin shell: options → one plain
function (``run_serve``, ``run_client``, ``write_trace``, ``run_load``, ``compare``,
``run_simulate``) → a :mod:`labkit.console` renderer → :func:`labkit.cli.app.finish` for those that
write judged evidence (load, simulate); ``client`` exits 1 when its request failed. Heavy imports
happen inside the commands so ``labkit --help`` stays fast.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from labkit.cli.app import finish, skip_teardown
from labkit.errors import UserError
from labkit.cli.options import JsonOpt, ModelOpt, SeedOpt, engine_options

# --------------------------------------------------------------------------- shared options

MaxActiveOpt = Annotated[int, typer.Option("--max-active", help="Admitted, unfinished requests at most (admission limit).")]
QueueSizeOpt = Annotated[int, typer.Option("--queue-size", help="Queued, not yet admitted requests at most (an n x prompts request counts once); beyond: rejected (HTTP 429).")]
WorkerIdOpt = Annotated[str, typer.Option("--worker-id", help="Name of this worker in every event.")]
#: The engine options (engine/args.py's FLAGS) each command takes.
SERVE_ENGINE_OPTIONS = ("scheduling_policy", "max_consecutive_prefill", "max_num_batched_tokens", "max_num_seqs",
                        "max_model_len", "gpu_memory_utilization", "enforce_eager", "overlap", "attention_backend",
                        "kv_cache_dtype", "enable_prefix_caching", "mixed_batches", "device", "dtype", "seed",
                        "kvcache_block_size", "tensor_parallel_size", "dist_init", "shm_name")
LOAD_ENGINE_OPTIONS = ("scheduling_policy", "max_consecutive_prefill", "max_num_batched_tokens", "max_num_seqs",
                       "max_model_len", "gpu_memory_utilization", "enforce_eager", "attention_backend", "device",
                       "tensor_parallel_size", "enable_prefix_caching", "mixed_batches", "overlap", "kv_cache_dtype")


def _endpoints(text: str | None) -> list[str]:
    return [e.strip().rstrip("/") for e in (text or "").split(",") if e.strip()]


def _one_model(model_arg: str | None, model) -> str | None:
    """vLLM's ``serve MODEL`` or ``--model``: one of them, or both the same."""
    if model_arg is not None and model is not None and str(model) != model_arg:
        raise UserError(f"two models given: {model_arg!r} and --model {str(model)!r}; give one")
    model = model if model is not None else model_arg
    return str(model) if model else None


def _on_ready(out):
    """What ``labkit serve`` prints once the worker is up: its banner and the URL."""
    from labkit.console import console
    from labkit.console.serving import render_serving

    def ready(url: str, worker) -> None:
        render_serving(worker, out)
        console.print(f"ready: {url}  (Ctrl-C stops)", soft_wrap=True)
        sys.stdout.flush()

    return ready


def _setup_logging(log_level: str, stats_interval: float) -> None:
    import logging

    level = getattr(logging, log_level.upper(), None) \
        if log_level.lower() in ("debug", "info", "warning", "error", "critical") else None
    if level is None:
        raise UserError(f"--log-level must be debug, info, warning, error or critical, got {log_level!r}")
    if stats_interval < 0:
        raise UserError(f"--stats-interval must be >= 0, got {stats_interval!r}")
    from serve.observe.logsafe import capture_native_stderr, install

    logging.basicConfig(level=level, stream=sys.stderr, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    logging.getLogger("labkit").setLevel(level)
    install(*logging.getLogger().handlers)        # every line on stderr escaped, aiohttp's too
    capture_native_stderr()                       # and what native code (xgrammar's C++) writes there


# --------------------------------------------------------------------------- commands


@engine_options(*SERVE_ENGINE_OPTIONS, presets={"on CUDA": "serve-cuda", "on CPU": "practice"},
                notes={"overlap": "Off with tensor parallel."})
def serve(
    model_arg: Annotated[Optional[str], typer.Argument(metavar="[MODEL]", show_default=False, help="The model, as vLLM's `serve MODEL` (same as --model).")] = None,
    model: ModelOpt = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on (127.0.0.1: this machine only).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port; 0 picks a free one and prints the URL.")] = 8801,
    max_active: Annotated[Optional[int], typer.Option("--max-active", show_default=False, help="Admitted, unfinished requests at most (admission limit). Default: --max-num-seqs' default.")] = None,
    queue_size: QueueSizeOpt = 64,
    max_active_per_request: Annotated[Optional[int], typer.Option("--max-active-per-request", show_default=False, help="Running slots one request (n x prompts) may hold, so others start while it runs. Default: all but a quarter of --max-active.")] = None,
    worker_id: WorkerIdOpt = "worker-0",
    stream_buffer: Annotated[int, typer.Option("--stream-buffer", help="Unread events per stream before the request is cancelled as a slow consumer.")] = 512,
    max_body_bytes: Annotated[int, typer.Option("--max-body-bytes", help="Largest request body (HTTP 413 beyond).")] = 1 << 20,
    served_model_name: Annotated[Optional[str], typer.Option("--served-model-name", help="Model id for the OpenAI API (default: the preset or directory name).")] = None,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="LABKIT_API_KEY", show_envvar=True, help="Require Authorization: Bearer KEY on every route but /health.")] = None,
    allowed_origins: Annotated[str, typer.Option("--allowed-origins", help="Comma list of web origins (http://host:port) whose pages may call this server; '*' for any. Default: none.")] = "",
    max_prompt_bytes: Annotated[Optional[int], typer.Option("--max-prompt-bytes", help="Text prompts longer than this (UTF-8 bytes) are refused before tokenizing (default 32 x max-model-len, at least 16 KiB).")] = None,
    special_tokens_in_content: Annotated[bool, typer.Option("--special-tokens-in-content", help="Let special-token text inside chat messages become control tokens (the old, forgeable behaviour).")] = False,
    reasoning_parser: Annotated[Optional[str], typer.Option("--reasoning-parser", help="qwen3: a chat answer's <think> part goes to message.reasoning_content (and reasoning) and to the stream's deltas, as vLLM's flag. Default: none, the text unchanged.")] = None,
    enable_auto_tool_choice: Annotated[bool, typer.Option("--enable-auto-tool-choice/--no-enable-auto-tool-choice", help="tool_choice auto (the default when tools are sent): parse the model's tool calls. vLLM needs this flag; here it is on, so agent frameworks work out of the box.")] = True,
    tool_call_parser: Annotated[str, typer.Option("--tool-call-parser", help="How tool calls are read: hermes (Qwen3's <tool_call> JSON), the only one.")] = "hermes",
    grammar_cache_mb: Annotated[int, typer.Option("--grammar-cache-mb", help="Compiled grammars (structured outputs, required tool calls) kept for reuse, in MiB in all; the least recently used go first.")] = 512,
    grammar_compile_timeout: Annotated[float, typer.Option("--grammar-compile-timeout", help="Seconds a grammar compile may take (queued behind others included); past it the request is a 400 naming the field.")] = 10.0,
    grammar_max_mb: Annotated[int, typer.Option("--grammar-max-mb", help="Largest compiled grammar, in MiB; a larger one is a 400 naming the field.")] = 128,
    grammar_step_budget_ms: Annotated[float, typer.Option("--grammar-step-budget-ms", help="CPU milliseconds one request's grammar mask may take in one step; past it the request finishes (finish_reason abort), so one costly grammar cannot slow every step.")] = 10.0,
    max_connections: Annotated[int, typer.Option("--max-connections", help="Open connections at most (lowered to fit the file limit); beyond, idle ones are closed, then 503.")] = 512,
    timeout_keep_alive: Annotated[float, typer.Option("--timeout-keep-alive", help="Seconds a connection may wait for the first byte of a request.")] = 5.0,
    timeout_headers: Annotated[float, typer.Option("--timeout-headers", help="Seconds for a request line and headers to arrive (then 408).")] = 10.0,
    timeout_body: Annotated[float, typer.Option("--timeout-body", help="Seconds for a request body to arrive (then 408).")] = 30.0,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", dir_okay=False, help="JSONL event log (header + every event). Default: runs/serve-<worker-id>.jsonl (see --event-log).")] = None,
    event_log: Annotated[bool, typer.Option("--event-log/--no-event-log", help="Without --out, keep the event log in runs/serve-<worker-id>.jsonl (the previous run's moves to .jsonl.1), capped by --event-log-max-mb.")] = True,
    event_log_max_mb: Annotated[Optional[float], typer.Option("--event-log-max-mb", show_default=False, help="Rotate the event log at this size (MB, 10^6 bytes): it moves to .jsonl.1, older ones shift up, and a new file starts with the header. Default: 256 for the log under runs/, no cap with --out.")] = None,
    event_log_backups: Annotated[int, typer.Option("--event-log-backups", help="Rotated event log files kept (.jsonl.1 newest ... .jsonl.N oldest); 0 keeps none.")] = 3,
    log_level: Annotated[str, typer.Option("--log-level", help="debug | info | warning | error: info prints an access line per request and a stats line every --stats-interval while busy.")] = "info",
    stats_interval: Annotated[float, typer.Option("--stats-interval", help="Seconds between stats lines while busy (0: none).")] = 10.0,
    engine_process: Annotated[Optional[bool], typer.Option("--engine-process/--no-engine-process", show_default=False, help="Run the engine and its owner thread in a process of their own; this one keeps the HTTP front end, detokenization and the event log. Default: on on CUDA (tensor-parallel-size 1), off on CPU.")] = None,
    engine: dict | None = None,
) -> None:
    """Serve the engine over HTTP: /generate (NDJSON), /cancel, /health, /config, /metrics, OpenAI /v1/*,
    vLLM's /tokenize, /detokenize and /version (docs/OPENAI.md).
    Every event goes to a JSONL log: --out, or by default runs/serve-<worker-id>.jsonl, rotated at
    --event-log-max-mb (256 by default) with --event-log-backups old files; --no-event-log for none."""
    from labkit.console import console
    from labkit.console.serving import render_served
    from labkit.evidence import envelope
    from labkit.lab_engine import LAB_BUILDER, detect_device
    from labkit.paths import runs_dir
    from serve.core.config import WorkerConfig
    from serve.entrypoints.connections import ConnectionLimits
    from serve.observe.events import plan_serve_log
    from serve.entrypoints.launch import run_serve, serve_args

    model = _one_model(model_arg, model)
    _setup_logging(log_level, stats_interval)
    log_plan = plan_serve_log(out, worker_id, event_log, event_log_max_mb, event_log_backups, runs_dir())
    given = dict(engine or {})
    args, chosen = serve_args(detect_device(given.get("device", "auto")), given.pop("tensor_parallel_size", 1),
                              model=model, max_active=max_active, engine_process=engine_process, **given)
    engine_process, max_active = chosen["engine_process"], chosen["max_active"]
    cfg = WorkerConfig(args, max_active=max_active, queue_size=queue_size, worker_id=worker_id,
                       max_active_per_request=max_active_per_request, stream_buffer=stream_buffer,
                       max_prompt_bytes=max_prompt_bytes,
                       special_tokens_in_content=special_tokens_in_content, reasoning_parser=reasoning_parser,
                       enable_auto_tool_choice=enable_auto_tool_choice, tool_call_parser=tool_call_parser,
                       grammar_cache_mb=grammar_cache_mb, grammar_compile_timeout=grammar_compile_timeout,
                       grammar_max_mb=grammar_max_mb, grammar_step_budget_ms=grammar_step_budget_ms)
    connections = ConnectionLimits(timeout_keep_alive=timeout_keep_alive, timeout_headers=timeout_headers,
                                   timeout_body=timeout_body, max_connections=max_connections)
    summary = run_serve(cfg, host, port, log_plan.path, served_model_name=served_model_name,
                        max_body_bytes=max_body_bytes, on_ready=_on_ready(log_plan.path), api_key=api_key,
                        allowed_origins=allowed_origins, connections=connections, stats_interval=stats_interval,
                        on_context=lambda why: console.print(why, soft_wrap=True), log_plan=log_plan,
                        engine_process=engine_process, envelope=envelope, build=LAB_BUILDER)
    render_served(summary)
    skip_teardown()               # closed in order: the process ends without the interpreter's teardown


def client(
    endpoints: Annotated[str, typer.Option("--endpoints", help="Server URL (the first of a comma list).")] = "http://127.0.0.1:8801",
    prompt: Annotated[str, typer.Option("--prompt", help="Prompt text.")] = "Hello",
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Output tokens at most.")] = 32,
    request_id: Annotated[str, typer.Option("--request-id", help="Request id (unique among live requests).")] = "demo",
    cancel_after: Annotated[Optional[int], typer.Option("--cancel-after", help="POST /cancel after this many tokens.")] = None,
    api: Annotated[str, typer.Option("--api", help="native (/generate) | openai (/v1/completions).")] = "native",
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy.")] = 0.0,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Generate max-tokens even past EOS.")] = False,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="LABKIT_API_KEY", show_envvar=True, help="The server's --api-key.")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", dir_okay=False, help="JSONL of client (and server) events.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Send one streamed request, print its text as it arrives, and record what the client observed.

    Its import path is the console and the HTTP client only (no torch, no engine), so it starts fast."""
    from labkit.console import print_json
    from labkit.console.serving import render_client
    from labkit.load.client import run_client

    eps = _endpoints(endpoints)
    if not eps:
        raise UserError("--endpoints needs a URL")
    streamed: list[str] = []

    def show(piece: str) -> None:
        streamed.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()

    res = run_client(eps[0], prompt, max_tokens, request_id, cancel_after, out, api, temperature,
                     ignore_eos=ignore_eos, api_key=api_key, on_text=None if json_out else show)
    if json_out:
        print_json(res)
    else:
        if streamed:
            sys.stdout.write("\n")
        render_client(res, text=not streamed)
    ok = res["reason"] in ("stop", "length") or (cancel_after is not None and res["reason"] == "cancelled")
    raise typer.Exit(0 if ok else 1)


def trace(
    out: Annotated[Optional[Path], typer.Option("--out", "-o", dir_okay=False, help="Trace file (JSONL); default runs/trace.jsonl (workloads/mixed.jsonl is the shipped trace: write it only on purpose).")] = None,
    requests: Annotated[Optional[int], typer.Option("--requests", help="Requests in the trace (fixed-interval trace; default 12).")] = None,
    prompt_tokens: Annotated[Optional[int], typer.Option("--prompt-tokens", help="Prompt length of a short request (default 32).")] = None,
    long_prompt_tokens: Annotated[Optional[int], typer.Option("--long-prompt-tokens", help="Prompt length of a long request (default 768).")] = None,
    long_every: Annotated[Optional[int], typer.Option("--long-every", help="Every N-th request is long (0: none; default 4).")] = None,
    max_tokens: Annotated[Optional[int], typer.Option("--max-tokens", help="Output tokens of every request (ignore_eos; default 64).")] = None,
    interval_ms: Annotated[Optional[float], typer.Option("--interval-ms", help="Planned gap between arrivals (default 40).")] = None,
    dataset: Annotated[Optional[str], typer.Option("--dataset", "--dataset-name", help="random | prefix-repetition | multi-turn (a production-shaped trace; see the options below; vLLM's prefix_repetition spelling too).")] = None,
    request_rate: Annotated[Optional[float], typer.Option("--request-rate", help="Requests/s (inf: all at once; default inf).")] = None,
    burstiness: Annotated[Optional[float], typer.Option("--burstiness", help="Gamma shape of the gaps (1: Poisson; <1 burstier).")] = None,
    num_requests: Annotated[Optional[int], typer.Option("--num-requests", "--num-prompts", help="Requests (default 100), or give --duration.")] = None,
    duration: Annotated[Optional[float], typer.Option("--duration", help="Seconds of arrivals (needs a finite --request-rate).")] = None,
    input_len: Annotated[Optional[int], typer.Option("--input-len", "--random-input-len", help="Prompt length (random; a user message in multi-turn; default 128).")] = None,
    output_len: Annotated[Optional[int], typer.Option("--output-len", "--random-output-len", help="Output tokens (ignore_eos; default 64).")] = None,
    range_ratio: Annotated[Optional[float], typer.Option("--range-ratio", help="Lengths drawn uniformly from the interval [len*(1-r), len*(1+r)] (default 0).")] = None,
    length_dist: Annotated[Optional[str], typer.Option("--length-dist", help="uniform | lognormal (median len, --sigma).")] = None,
    sigma: Annotated[Optional[float], typer.Option("--sigma", help="Lognormal sigma (default 0.5).")] = None,
    num_prefixes: Annotated[Optional[int], typer.Option("--num-prefixes", help="prefix-repetition: shared prefixes (default 4).")] = None,
    prefix_len: Annotated[Optional[int], typer.Option("--prefix-len", help="prefix-repetition: prefix tokens (default 256).")] = None,
    suffix_len: Annotated[Optional[int], typer.Option("--suffix-len", help="prefix-repetition: suffix tokens (default 32).")] = None,
    sessions: Annotated[Optional[int], typer.Option("--sessions", help="multi-turn: conversations (default 4).")] = None,
    turns: Annotated[Optional[int], typer.Option("--turns", help="multi-turn: turns per conversation (default 3).")] = None,
    think_time_ms: Annotated[Optional[float], typer.Option("--think-time-ms", help="multi-turn: gap after a reply before the next turn (default 0).")] = None,
    seed: SeedOpt = 17,
    header_only: Annotated[bool, typer.Option("--header-only", help="With --dataset: write the header (the options) alone, a rate sweep's base (labkit load --request-rates).")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Write an arrival trace (the same bytes for the same options; --seed seeds it): the fixed-interval
    short/long trace, or with --dataset/--request-rate a production-shaped one (Poisson/gamma arrivals,
    length distributions, shared prefixes, multi-turn sessions)."""
    from labkit.console import console, kv_table, print_json
    from labkit.load.trace import TraceOptions, write_trace
    from labkit.load.workloads import WorkloadOptions, write_workload
    from labkit.paths import default_out

    old = {"requests": requests, "prompt_tokens": prompt_tokens, "long_prompt_tokens": long_prompt_tokens,
           "long_every": long_every, "max_tokens": max_tokens, "interval_ms": interval_ms}
    new = {"dataset": dataset, "request_rate": request_rate, "burstiness": burstiness, "num_requests": num_requests,
           "duration_s": duration, "input_len": input_len, "output_len": output_len, "range_ratio": range_ratio,
           "length_dist": length_dist, "sigma": sigma, "num_prefixes": num_prefixes, "prefix_len": prefix_len,
           "suffix_len": suffix_len, "sessions": sessions, "turns": turns, "think_time_ms": think_time_ms}
    given_old = [k for k, v in old.items() if v is not None]
    given_new = {k: v for k, v in new.items() if v is not None}
    if given_new.get("dataset") == "prefix_repetition":          # vLLM's spelling
        given_new["dataset"] = "prefix-repetition"
    path = out or default_out("trace.jsonl")
    if given_new:
        if given_old:
            raise UserError(f"--{given_old[0].replace('_', '-')} belongs to the fixed-interval trace; "
                            "with --dataset/--request-rate use --num-requests, --input-len, --output-len")
        _refuse_foreign(given_new)
        summary = write_workload(path, WorkloadOptions(**given_new, seed=seed), header_only=header_only)
    elif header_only:
        raise UserError("--header-only writes a --dataset trace's options; give --dataset")
    else:
        summary = write_trace(path, TraceOptions(**{k: v for k, v in old.items() if v is not None}, seed=seed))
    if json_out:
        print_json(summary)
    else:
        console.print(kv_table(summary, title="labkit trace"))


_ONLY_FOR = {"num_prefixes": "prefix-repetition", "prefix_len": "prefix-repetition", "suffix_len": "prefix-repetition",
             "sessions": "multi-turn", "turns": "multi-turn", "think_time_ms": "multi-turn"}


def _refuse_foreign(given: dict) -> None:
    """An option of another dataset (or one the dataset does not use) is refused, never ignored."""
    ds = given.get("dataset", "random")
    for k in given:
        if k in _ONLY_FOR and _ONLY_FOR[k] != ds:
            raise UserError(f"--{k.replace('_', '-')} is a --dataset {_ONLY_FOR[k]} option (this trace is {ds})")
    if ds == "prefix-repetition" and "input_len" in given:
        raise UserError("--dataset prefix-repetition prompts are --prefix-len + --suffix-len; leave out --input-len")


@engine_options(*LOAD_ENGINE_OPTIONS, presets={"": "practice"})
def load(
    trace: Annotated[Path, typer.Option("--trace", dir_okay=False, help="Arrival trace (labkit trace).")] = Path("workloads/mixed.jsonl"),
    out: Annotated[Optional[Path], typer.Option("--out", "-o", dir_okay=False, help="Event log X.jsonl (evidence goes to X.json); default runs/load.jsonl.")] = None,
    model: ModelOpt = None,
    endpoints: Annotated[Optional[str], typer.Option("--endpoints", "--base-url", help="Running servers a,b,... instead of the in-process engine.")] = None,
    serve_local: Annotated[bool, typer.Option("--serve-local", help="Serve the in-process engine on 127.0.0.1 and drive it over HTTP.")] = False,
    mode: Annotated[str, typer.Option("--mode", help="wall (planned times) | round (per scheduler round, in process).")] = "wall",
    warmup_requests: Annotated[int, typer.Option("--warmup-requests", help="Warmup requests per target, excluded from the window.")] = 2,
    api: Annotated[str, typer.Option("--api", help="native | openai (any OpenAI-compatible server).")] = "native",
    router: Annotated[str, typer.Option("--router", help="round-robin | least-work (least assigned prompt+max_tokens).")] = "round-robin",
    max_active: MaxActiveOpt = 8,
    queue_size: QueueSizeOpt = 64,
    worker_id: WorkerIdOpt = "worker-0",
    profile_dir: Annotated[Optional[Path], typer.Option("--profile-dir", file_okay=False, help="torch.profiler after warmup: Chrome trace + operator table here.")] = None,
    openai_model: Annotated[Optional[str], typer.Option("--openai-model", help="Model id for --api openai (default: the server's first).")] = None,
    timeout_s: Annotated[float, typer.Option("--timeout-s", help="Give up on a request after this long.")] = 600.0,
    max_concurrency: Annotated[Optional[int], typer.Option("--max-concurrency", min=1, show_default=False, help="Requests in flight at most (vLLM bench serve's): one arriving while all are taken is sent when one finishes. Default: no cap.")] = None,
    checkpoint: Annotated[Optional[str], typer.Option("--checkpoint", help="Judge the evidence against this checkpoint id.")] = None,
    request_rates: Annotated[Optional[str], typer.Option("--request-rates", help="Sweep: 1,2,4,inf requests/s, one trace per rate from --trace's header options (a `labkit trace --dataset` trace), over HTTP (our server on 127.0.0.1 unless --endpoints).")] = None,
    goodput: Annotated[Optional[list[str]], typer.Option("--goodput", help="Sweep: SLOs for goodput, vLLM's 'ttft:MS tpot:MS e2e:MS' (quoted, or repeat the option).")] = None,
    stop_at_saturation: Annotated[bool, typer.Option("--stop-at-saturation", help="Sweep: skip the rates above the first one the server did not keep up with (< 0.9 of it).")] = False,
    offline_baseline: Annotated[bool, typer.Option("--offline-baseline", help="Sweep: then run the last rate's requests offline on the same engine (served / offline throughput).")] = False,
    serve_process: Annotated[bool, typer.Option("--serve-process", help="Sweep: our server as a `labkit serve` process of its own (its own GIL; its engine in a process of its own on CUDA) instead of in this one.")] = False,
    json_out: JsonOpt = False,
    engine: dict | None = None,
) -> None:
    """Replay an arrival trace in process or against servers; events to JSONL, evidence next to it.

    With --request-rates: a rate sweep (vLLM bench serve's --request-rate, swept): per rate throughput,
    TTFT/TPOT/ITL/E2E p50/p90/p99, goodput, prefix-cache hit rate and every request accounted for; a
    latency-throughput picture next to the evidence."""
    from labkit.console.serving import render_load
    from labkit.paths import default_out
    from labkit.load.replay import LoadOptions, run_load
    from engine.args import preset
    from serve.core.config import WorkerConfig
    from serve.observe.events import split_out

    out = out or default_out("load.jsonl")
    args = preset("practice", model=str(model) if model else None, **(engine or {}))
    worker = WorkerConfig(args, max_active=max_active, queue_size=queue_size, worker_id=worker_id)
    opts = LoadOptions(trace=trace, out=out, worker=worker, endpoints=_endpoints(endpoints),
                       serve_local=serve_local, mode=mode, warmup_requests=warmup_requests, api=api, router=router,
                       profile_dir=profile_dir, openai_model=openai_model, timeout_s=timeout_s,
                       checkpoint=checkpoint, show_progress=not json_out, max_concurrency=max_concurrency)
    if request_rates is not None:
        from labkit.cli.sweep import render_sweep, sweep_command

        record = sweep_command(opts, request_rates, goodput, stop_at_saturation, offline_baseline, serve_process)
        if not json_out:
            render_sweep(record)
        finish(record, split_out(out)[1], json_out=json_out)
    if goodput or stop_at_saturation or offline_baseline or serve_process:
        raise UserError("--goodput, --stop-at-saturation, --offline-baseline and --serve-process belong to a sweep: "
                        "give --request-rates")
    record = run_load(opts)
    events, evidence = split_out(out)
    if not json_out:
        render_load(record, mode, events)
    finish(record, evidence, json_out=json_out)


def report(
    inputs: Annotated[Optional[str], typer.Option("--inputs", help="Event logs a.jsonl,b.jsonl,... to compare; without it, the final report from runs/.")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", dir_okay=False, help="Comparison JSON (Markdown and PNGs next to it); default runs/comparison.json, or runs/final-report.json without --inputs.")] = None,
    plots: Annotated[bool, typer.Option("--plots/--no-plots", help="Draw PNG plots (needs matplotlib).")] = True,
    pack: Annotated[bool, typer.Option("--pack", help="Final report: then pack README, checkpoints, code, patches, workloads, runs/ and notes/ into learning-evidence.tar.gz beside it.")] = False,
    with_arrays: Annotated[bool, typer.Option("--with-arrays", help="--pack: keep runs/' NPZ arrays too.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Without --inputs: the final evidence report (runs/final-report.md/.json), with --pack its archive. With --inputs: TTFT / ITL / TPOT, throughput, terminations compared."""
    if inputs is None:
        from labkit.cli.final import final_report_command

        if with_arrays and not pack:
            raise UserError("--with-arrays applies to --pack")
        final_report_command(out, plots, json_out, pack=pack, with_arrays=with_arrays)
    if pack or with_arrays:
        raise UserError("--pack packs the final report's evidence: leave out --inputs")
    from labkit.console import print_json
    from labkit.console.serving import render_report
    from labkit.paths import default_out
    from labkit.load.report import compare

    out = out or default_out("comparison.json")
    paths = [p.strip() for p in inputs.split(",") if p.strip()]
    result = compare(paths, out, plots=plots)
    if json_out:
        print_json(result)
    else:
        render_report(result, out)


def simulate(
    out: Annotated[Optional[Path], typer.Option("--out", "-o", dir_okay=False, help="Event log X.jsonl (evidence: X.json); default runs/runtime-cpu.json(l).")] = None,
    model: ModelOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """The service chain on CPU (Worker → HTTP → client → report) through cancel, overload, faults and shutdown."""
    from labkit.console.serving import render_simulate
    from labkit.load.simulate import run_simulate
    from serve.observe.events import split_out

    record = run_simulate(out, model=str(model) if model else None)
    if not json_out:
        render_simulate(record)
    finish(record, split_out(Path(record["facts"]["events"]))[1], json_out=json_out)


# --------------------------------------------------------------------------- registration


def register(app: typer.Typer) -> None:
    """Add serve, client, trace, load, report and simulate to ``app``."""
    for command in (serve, client, trace, load, report, simulate):
        app.command()(command)
