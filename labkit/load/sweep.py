"""``labkit load --request-rates 1,2,4,inf``: one server driven at rising request rates (vLLM ``bench serve
--request-rate``, swept), a row of facts per rate, the latency-throughput curve.

The trace given with ``--trace`` must be a production-shaped one (``labkit trace --dataset ...``): its
header holds the workload's options, and each rate k gets its own trace from them with
``request_rate`` = the k-th rate and ``seed`` = the header's seed + k (the seed family: the same
shapes and lengths drawn the same way, but new prompt tokens per rate, so no rate starts on a prefix
cache the rate before it filled). Each rate's trace is written next to the evidence
(``<stem>-rate<R>.trace.jsonl``) and replayed by ``labkit load``'s wall-clock HTTP replay
(``<stem>-rate<R>.jsonl`` the event log), one rate after the other, against the same server: ours on
127.0.0.1 in this process (the ``--serve-local`` target, started once for the whole sweep) or the
running servers of ``--endpoints`` (any OpenAI-compatible one with ``--api openai``). Warmup requests
go before the first rate only.

Per rate (``labkit.load.sweep_metrics``): accounting, throughputs, TTFT / TPOT / ITL / E2E, goodput
under ``--goodput`` SLOs, prefix-cache hit rate. ``--stop-at-saturation`` skips the rates above the
first one the server did not keep up with. ``--offline-baseline`` (our server only) then runs the
highest rate's requests through the same engine offline (``LLMEngine.generate``, prefix cache reset),
so the served saturation throughput is a share of the offline one measured in the same run.
"""
from __future__ import annotations

import asyncio
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from labkit.checks import run_assertion
from labkit.errors import UserError
from labkit.evidence import write_evidence
from labkit.lab_engine import LAB_BUILDER
from labkit.load import sweep_metrics as sm
from labkit.load.replay import (LoadOptions, Router, check_options, drive_http, remote_identity, remote_kind,
                                worker_config)
from labkit.load.report import read_log, requests_by_observer
from labkit.load.trace import read_trace, warmup_requests
from labkit.load.workloads import WorkloadOptions, write_workload
from serve.observe.events import EventLog, split_out

#: achieved throughput may fall this far below the best lower rate's and still count as monotone
MONOTONE_TOLERANCE = 0.10


@dataclass
class SweepOptions:
    load: LoadOptions
    rates: list[float]
    goodput: dict[str, float] = field(default_factory=dict)
    stop_at_saturation: bool = False
    offline_baseline: bool = False
    serve_process: bool = False          # our server as a `labkit serve` process (its own GIL), not in this one
    tolerance: float = MONOTONE_TOLERANCE


def rate_name(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def base_workload(trace: Path) -> WorkloadOptions:
    """The workload options in a ``labkit trace --dataset`` header (one line of error otherwise)."""
    head = _first_record(trace)
    if not head or "dataset" not in head or not isinstance(head.get("options"), dict):
        raise UserError(f"{trace}: --request-rates needs a trace written by `labkit trace --dataset ...` "
                        "(its header holds the options each rate's trace is made from)")
    raw = dict(head["options"])
    raw = {k: (float(v) if isinstance(v, str) and v.lower() in ("inf", "infinity") else v) for k, v in raw.items()}
    if raw.get("duration_s") is not None:
        raise UserError(f"{trace}: a sweep sends the same number of requests at every rate; "
                        "write the trace with --num-requests instead of --duration")
    known = set(WorkloadOptions.__dataclass_fields__)
    try:
        return WorkloadOptions(**{k: v for k, v in raw.items() if k in known})
    except TypeError as e:
        raise UserError(f"{trace}: its header options do not make a workload: {e}") from None


def _first_record(trace: Path) -> dict | None:
    """The trace's first line (its header), so a header-only file (``labkit trace --header-only``) serves too."""
    import json

    if not Path(trace).is_file():
        raise UserError(f"trace not found: {trace}")
    with open(trace, encoding="utf-8") as f:
        line = f.readline()
    try:
        head = json.loads(line)
    except ValueError:
        raise UserError(f"{trace}:1: not a JSON line") from None
    return head if isinstance(head, dict) and head.get("record") == "header" else None


def rate_workload(base: WorkloadOptions, rate: float, k: int) -> WorkloadOptions:
    return replace(base, request_rate=rate, seed=base.seed + k)


class _Switch:
    """The in-process worker's event sink: into the current rate's log (nothing between rates)."""

    def __init__(self) -> None:
        self.log: EventLog | None = None

    def __call__(self, ev: dict) -> None:
        log = self.log
        if log is not None:
            log.write(ev)


class Target:
    """Where the sweep's requests go: the ``--endpoints`` servers, or ours started once on 127.0.0.1, in this
    process (a Worker behind a ServerThread) or, with ``serve_process``, as a ``labkit serve`` process."""

    def __init__(self, opts: LoadOptions, serve_process: bool = False, log_dir: Path | None = None):
        self.opts = opts
        self.worker = self.server = self.proc = None
        self.sink = _Switch()
        self.endpoints = list(opts.endpoints)
        self.healths: list[dict | None] = []
        self.serve_process, self.log_dir = serve_process, log_dir

    def __enter__(self) -> "Target":
        if not self.endpoints and self.serve_process:
            self.proc = start_server_process(self.opts, Path(self.log_dir))
            self.endpoints = [self.proc.url]
        elif not self.endpoints:
            from serve.entrypoints.api_server import ServerThread
            from serve.core.worker import Worker

            self.worker = Worker(replace(worker_config(self.opts), load_tokenizer=True), sink=self.sink,
                                 build=LAB_BUILDER).start()
            self.server = ServerThread(self.worker).start()
            self.endpoints = [self.server.url]
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.stop()
        if self.server is not None:
            self.server.close()
        elif self.worker is not None:
            self.worker.close()

    def replay(self, opts: LoadOptions, reqs: list[dict], warm: list[dict], events: Path, extra: dict) -> None:
        log = EventLog(events)
        self.sink.log = log
        try:
            router = Router(self.endpoints, opts.router)
            self.healths, _ = asyncio.run(drive_http(opts, reqs, warm, router, log, header=("load", extra),
                                                      log_server_events=self.worker is None))
            if self.proc is not None and self.proc.proc.poll() is not None:
                raise UserError(f"the labkit serve process exited (code {self.proc.proc.returncode}); "
                                f"its output: {self.proc.output}")
        finally:
            self.sink.log = None
            log.close()

    def kv_free(self) -> tuple[int, int] | None:
        if self.worker is None:
            return None
        return self.worker.run_on_owner(lambda e: (e.stats().free_blocks, e.stats().num_blocks))

    def offline(self, reqs: list[dict]) -> dict:
        """The requests offline (generate), the prefix cache reset first: on the served engine itself, or
        (after a ``labkit serve`` process) on an engine built here with the same options."""
        if self.worker is not None:
            return {"engine": "the served engine", **self.worker.run_on_owner(lambda e: _offline(e, reqs),
                                                                               timeout=self.opts.timeout_s)}
        if self.proc is not None:
            self.proc.stop()
            self.proc = None
        from labkit.lab_engine import build_engine, release_engine

        lab = build_engine(self.opts.worker.engine)
        try:
            cold = _offline(lab.engine, reqs)            # a fresh engine's first pass pays first-use costs
            return {"engine": "a new engine, the served options (warm pass)", **_offline(lab.engine, reqs),
                    "cold_pass": cold}
        finally:
            release_engine(lab.engine)


def _offline(engine, reqs: list[dict]) -> dict:
    from labkit.lab_engine import timed_generate
    from labkit.load.replay import sampling

    engine.reset_prefix_cache()
    timed = timed_generate(engine, [r["prompt_token_ids"] for r in reqs], [sampling(r) for r in reqs])
    engine.reset_prefix_cache()
    return timed.record()


def start_server_process(lo: LoadOptions, log_dir: Path):
    """``labkit serve`` on 127.0.0.1 with the sweep's engine and admission options (engine process on CUDA)."""
    from labkit.assets.resolve import resolve_model
    from labkit.load.server_process import ServerProcess
    from labkit.lab_engine import detect_device

    e, w = lo.worker.engine, lo.worker
    device = detect_device(e.device)
    settings = {"max_num_seqs": e.max_num_seqs, "max_num_batched_tokens": e.max_num_batched_tokens,
                "max_model_len": e.max_model_len, "gpu_memory_utilization": e.gpu_memory_utilization,
                "enforce_eager": e.enforce_eager, "overlap": e.overlap}
    extra = ("--max-active", str(w.max_active), "--queue-size", str(w.queue_size), "--scheduling-policy",
             e.scheduling_policy, "--enable-prefix-caching" if e.enable_prefix_caching else "--no-enable-prefix-caching",
             "--mixed-batches" if e.mixed_batches else "--no-mixed-batches",
             "--kv-cache-dtype", e.kv_cache_dtype, "--worker-id", w.worker_id)
    model = str(resolve_model(e.model, device).path)
    return ServerProcess.start(model, device, e.attention_backend, settings, log_dir / "server.jsonl",
                               log_dir / "server.out", engine_process=device.startswith("cuda"), extra_args=extra)


def rate_row(events: Path, reqs: list[dict], rate: float, slos: dict[str, float]) -> dict:
    log = read_log(events)
    by_obs = requests_by_observer(log.events)
    observer = "client" if "client" in by_obs else "engine"
    ids = {r["request_id"] for r in reqs}
    finished = [e for e in log.events if e.get("event") == "finished" and e.get("observer", "engine") == "engine"
                and e.get("request_id") in ids]
    row = sm.rate_facts(rate, [r["request_id"] for r in reqs], by_obs.get(observer, {}), finished, slos)
    row["observer"] = observer
    if observer == "client" and "engine" in by_obs:
        row["ttft_split_ms"] = sm.ttft_split([r["request_id"] for r in reqs], by_obs["client"], by_obs["engine"])
    row["events"] = str(events)
    return row


def run_sweep(opts: SweepOptions) -> dict:
    """Drive every rate; returns the evidence record (written to ``--out``'s .json, the picture beside it)."""
    lo = opts.load if opts.load.endpoints else replace(opts.load, serve_local=True)    # always over HTTP
    check_options(lo)
    if lo.mode != "wall" or lo.profile_dir:
        raise UserError("--request-rates replays on the wall clock over HTTP; leave out --mode round and --profile-dir")
    if opts.offline_baseline and lo.endpoints:
        raise UserError("--offline-baseline runs our engine offline; it needs our server (leave out --endpoints)")
    base = base_workload(lo.trace)
    _, evidence = split_out(lo.out)
    stem = evidence.with_suffix("")
    rows: list[dict] = []
    last_reqs: list[dict] = []
    facts: dict[str, Any] = {}
    if opts.serve_process and lo.endpoints:
        raise UserError("--serve-process starts our server; leave out --endpoints")
    with Target(lo, opts.serve_process, evidence.with_name(f"{evidence.stem}-server")) as target:
        for k, rate in enumerate(opts.rates):
            wl = rate_workload(base, rate, k)
            trace = Path(f"{stem}-rate{rate_name(rate)}.trace.jsonl")
            write_workload(trace, wl)
            _, reqs = read_trace(trace)
            warm = warmup_requests(reqs, lo.warmup_requests) if k == 0 else []
            extra = {"mode": "wall", "api": lo.api, "trace": str(trace), "sweep_rate": rate_name(rate),
                     "trace_options": {**asdict(wl), "request_rate": rate_name(rate)}}
            label = f"rate {rate_name(rate)}/s ({k + 1}/{len(opts.rates)})"
            events = Path(f"{stem}-rate{rate_name(rate)}.jsonl")
            target.replay(replace(lo, trace=trace, progress_label=label), reqs, warm, events, extra)
            row = rate_row(events, reqs, rate, opts.goodput)
            row.update(trace=str(trace), seed=wl.seed)
            rows.append(row)
            _progress_line(lo, label, row)
            last_reqs = reqs
            if opts.stop_at_saturation and row["saturated"] and k + 1 < len(opts.rates):
                facts["skipped_rates"] = [rate_name(r) for r in opts.rates[k + 1:]]
                break
        kv = target.kv_free()
        if kv is not None:
            facts["kv_blocks"] = {"free_at_end": kv[0], "total": kv[1]}
        if opts.offline_baseline:
            facts["offline"] = {"rate": rate_name(opts.rates[len(rows) - 1]), **target.offline(last_reqs)}
        healths = target.healths
        served = target.worker.served if target.worker is not None else None
    if not lo.endpoints:            # our server's step records: where each rate's step time went
        from labkit.load.server_steps import per_rate

        per_rate(rows, evidence.with_name(f"{evidence.stem}-server") / "server.jsonl" if opts.serve_process else None)
    facts.update(_sweep_facts(opts, base, rows, facts.get("offline")))
    facts["picture"] = str(evidence.with_name(f"{evidence.stem}.curve.png"))
    kind, ident = _identity(healths, served)
    record = write_evidence(evidence, checkpoint=lo.checkpoint, kind=kind or "static", facts=facts,
                            device=ident.get("device"), model=ident.get("model"), seed=ident.get("seed"),
                            engine=ident.get("engine"), run_assertions=sweep_assertions(facts))
    from labkit.pictures.sweep import draw_sweep

    draw_sweep(facts, Path(facts["picture"]))
    return record


def _identity(healths: list[dict | None], served) -> tuple[str | None, dict]:
    if served is not None:
        return served.kind, {"model": served.model, "device": served.device, "engine": served.describe(),
                             "seed": served.seed}
    return remote_kind(healths), remote_identity(healths)


def _sweep_facts(opts: SweepOptions, base: WorkloadOptions, rows: list[dict], offline: dict | None) -> dict:
    summ = sm.summary(rows)
    if offline and offline.get("tok_s") and summ["max_output_throughput_tok_s"]:
        summ["served_over_offline"] = round(summ["max_output_throughput_tok_s"] / offline["tok_s"], 4)
    lo = opts.load
    return {
        "rates": [r["offered_rate"] for r in rows],
        "per_rate": rows,
        "sent": [r["sent"] for r in rows],
        "accounted": [r["accounted"] for r in rows],
        "lost": [r["lost"] for r in rows],
        "unsubmitted": [r["sent"] - r["submitted"] for r in rows],
        "latencies_finite": [r["latencies_finite"] for r in rows],
        "monotone": sm.monotone(rows, opts.tolerance),
        "summary": summ,
        "goodput_slos_ms": opts.goodput,
        "workload": {**asdict(base), "request_rate": "per rate", "seed": f"{base.seed} + rate index"},
        "target": "endpoints" if lo.endpoints else ("serve-process" if opts.serve_process else "serve-local"),
        "endpoints": lo.endpoints, "api": lo.api, "warmup_requests": lo.warmup_requests,
        "enable_prefix_caching": None if lo.endpoints else lo.worker.engine.enable_prefix_caching,
        "definitions": {"ttft": "first token - submitted", "tpot": "(t_last - t_first) / (G - 1)",
                        "itl": "gap between consecutive tokens", "e2e": "finished - submitted",
                        "throughput": "over first submit -> last finish", "percentiles": "linear interpolation"},
    }


def sweep_assertions(facts: dict) -> list[dict]:
    """What every sweep must show, checkpoint or not: none lost, latencies finite, and the KV pool free."""
    out = [run_assertion("len(facts.per_rate)", "gt", 0, name="rates measured", why="at least one rate ran"),
           run_assertion("facts.lost", "all_eq", 0, name="no request lost",
                         why="every request sent ended completed, rejected, errored or timed out")]
    if "kv_blocks" in facts:
        out.append(run_assertion("facts.kv_blocks.free_at_end", "eq", facts["kv_blocks"]["total"],
                                 name="KV blocks all free at the end", why="no request leaked KV blocks"))
    return out


def _progress_line(lo: LoadOptions, label: str, row: dict) -> None:
    if not lo.show_progress:
        return
    from labkit.console import err_console

    ttft = row["ttft_ms"].get("p99")
    err_console.print(f"{label}: {row['completed']}/{row['sent']} completed, {row['rejected']} rejected, "
                      f"{row['output_throughput_tok_s']} tok/s, TTFT p99 {ttft} ms", markup=False, highlight=False)
