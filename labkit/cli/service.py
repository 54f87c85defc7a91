"""Typer commands of the service half of the lab: serve, client, trace, load, report, simulate.

``register(app)`` adds them as top-level commands. Each is a thin shell: options → one plain
function (``run_serve``, ``run_client``, ``write_trace``, ``run_load``, ``compare``,
``run_simulate``) → a rich table → an exit code (0 done / PASS / REVIEW, 1 FAIL or a failed
request, 2 for a user error via ``labkit.cli.main``). Heavy imports happen inside the commands so
``labkit --help`` stays fast.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, NoReturn, Optional

import typer

from labkit.errors import UserError
from labkit.cli.options import AttentionOpt, DeviceOpt, JsonOpt, ModelOpt

# --------------------------------------------------------------------------- shared options

PolicyOpt = Annotated[str, typer.Option("--policy", help="Scheduling policy: prefill_first | balanced.")]
BatchTokensOpt = Annotated[int, typer.Option("--batch-tokens", help="Token budget of one step (max_num_batched_tokens).")]
BatchSeqsOpt = Annotated[int, typer.Option("--batch-seqs", help="Sequences in one step (max_num_seqs).")]
MaxActiveOpt = Annotated[int, typer.Option("--max-active", help="Admitted, unfinished requests at most (admission limit).")]
QueueSizeOpt = Annotated[int, typer.Option("--queue-size", help="Queued, not yet admitted requests at most; beyond: rejected (HTTP 429).")]
MaxModelLenOpt = Annotated[int, typer.Option("--max-model-len", help="Context length (prompt + output) at most.")]
EagerOpt = Annotated[bool, typer.Option("--eager/--graph", help="Eager execution, or CUDA Graph where the engine supports it.")]
WorkerIdOpt = Annotated[str, typer.Option("--worker-id", help="Name of this worker in every event.")]
TpOpt = Annotated[int, typer.Option("--tp", help="Tensor parallel size of the engine.")]
DistInitOpt = Annotated[Optional[str], typer.Option("--dist-init", help="tcp://HOST:PORT of this engine's TP group (default: a free port).")]
ShmNameOpt = Annotated[Optional[str], typer.Option("--shm-name", help="Shared-memory name of this engine's TP channel (default: unique).")]

VERDICT_EXIT = {"PASS": 0, "REVIEW": 0, "NOT-RUN": 0, "FAIL": 1}


def _console():
    from labkit.console import console

    return console


def _fmt(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def _pcts(d: dict | None, keys=("p50", "p90", "p99")) -> str:
    if not d or not d.get("n"):
        return "–"
    return " / ".join(_fmt(d.get(k)) for k in keys)


def _finish_record(record: dict, out: Path | None, json_out: bool) -> NoReturn:
    from labkit.console import checks_table, console, print_json, rel, verdict_text

    if json_out:
        print_json(record)
    else:
        if record.get("checks"):
            console.print(checks_table(record["checks"]))
        line = verdict_text(record.get("verdict") or "REVIEW")
        line.append(f"  {record.get('checkpoint') or ''}", style="bold")
        if out is not None:
            line.append(f"  evidence: {rel(out)}")
        console.print(line, soft_wrap=True)
    raise typer.Exit(VERDICT_EXIT.get(record.get("verdict") or "REVIEW", 1))


def _observer_table(summary: dict, title: str):
    from rich.table import Table

    table = Table(title=title, title_justify="left", caption="latencies in ms, p50 / p99", caption_justify="left")
    for col in ("observer", "req", "done", "rej", "out tok", "TTFT", "ITL", "TPOT", "tok/s", "window s"):
        table.add_column(col, justify="left" if col == "observer" else "right", no_wrap=True)
    two = ("p50", "p99")
    for obs, o in summary["observers"].items():
        table.add_row(obs, str(o["requests"]), str(o["completed"]), str(o["rejections"]), str(o["output_tokens"]),
                      _pcts(o["ttft_ms"], two), _pcts(o["itl_ms"], two), _pcts(o["tpot_ms"], two),
                      _fmt(o.get("throughput_tok_s")), _fmt((o.get("window") or {}).get("seconds")))
    return table


def _endpoints(text: str | None) -> list[str]:
    return [e.strip().rstrip("/") for e in (text or "").split(",") if e.strip()]


# --------------------------------------------------------------------------- commands


def register(app: typer.Typer) -> None:
    """Add serve, client, trace, load, report and simulate to ``app``."""

    @app.command()
    def serve(
        model: ModelOpt = None,
        host: Annotated[str, typer.Option("--host", help="Address to listen on (127.0.0.1: this machine only).")] = "127.0.0.1",
        port: Annotated[int, typer.Option("--port", help="Port; 0 picks a free one and prints the URL.")] = 8801,
        policy: PolicyOpt = "prefill_first",
        batch_tokens: BatchTokensOpt = 512,
        batch_seqs: BatchSeqsOpt = 8,
        max_active: MaxActiveOpt = 8,
        queue_size: QueueSizeOpt = 64,
        max_model_len: MaxModelLenOpt = 1024,
        eager: EagerOpt = True,
        attention: AttentionOpt = "auto",
        device: DeviceOpt = "auto",
        worker_id: WorkerIdOpt = "worker-0",
        tp: TpOpt = 1,
        dist_init: DistInitOpt = None,
        shm_name: ShmNameOpt = None,
        stream_buffer: Annotated[int, typer.Option("--stream-buffer", help="Unread events per stream before the request is cancelled as a slow consumer.")] = 512,
        max_body_bytes: Annotated[int, typer.Option("--max-body-bytes", help="Largest request body (HTTP 413 beyond).")] = 1 << 20,
        served_model_name: Annotated[Optional[str], typer.Option("--served-model-name", help="Model id for the OpenAI API (default: the preset or directory name).")] = None,
        out: Annotated[Optional[Path], typer.Option("--out", "-o", dir_okay=False, help="JSONL event log (header + every event).")] = None,
    ) -> None:
        """Serve the engine over HTTP: /generate (NDJSON), /cancel, /health, /metrics, OpenAI /v1/*."""
        from labkit.console import console, kv_table, note
        from labkit.service.server import run_serve
        from labkit.service.worker import WorkerConfig

        cfg = WorkerConfig(model=str(model) if model else None, device=device, attention=attention, policy=policy,
                           batch_tokens=batch_tokens, batch_seqs=batch_seqs, max_active=max_active,
                           queue_size=queue_size, max_model_len=max_model_len, eager=eager, worker_id=worker_id,
                           stream_buffer=stream_buffer, tp=tp, dist_init=dist_init, shm_name=shm_name)

        def ready(url: str, worker) -> None:
            built = worker.built
            console.print(kv_table({"worker": worker.worker_id, "kind": built.kind,
                                    "model": built.model.get("path"), "synthetic": built.model.get("synthetic"),
                                    "policy": policy, "batch tokens / seqs": f"{batch_tokens} / {batch_seqs}",
                                    "max active / queue": f"{max_active} / {queue_size}",
                                    "KV blocks": built.engine.stats().num_blocks,
                                    "log": str(out) if out else "(none)"}, title="labkit serve"))
            if built.model.get("synthetic"):
                note("synthetic model: random weights; generated text is meaningless")
            console.print(f"ready: {url}  (Ctrl-C stops)", soft_wrap=True)
            sys.stdout.flush()

        summary = run_serve(cfg, host, port, out, served_model_name=served_model_name,
                            max_body_bytes=max_body_bytes, on_ready=ready)
        console.print(kv_table({"finished": summary["finished"], "tokens": summary["generation_tokens"],
                                "steps": summary["steps"], "engine errors": summary["engine_errors"]},
                               title="served"))

    @app.command()
    def client(
        endpoints: Annotated[str, typer.Option("--endpoints", help="Server URL (the first of a comma list).")] = "http://127.0.0.1:8801",
        prompt: Annotated[str, typer.Option("--prompt", help="Prompt text.")] = "Hello",
        max_tokens: Annotated[int, typer.Option("--max-tokens", help="Output tokens at most.")] = 32,
        request_id: Annotated[str, typer.Option("--request-id", help="Request id (unique among live requests).")] = "demo",
        cancel_after: Annotated[Optional[int], typer.Option("--cancel-after", help="POST /cancel after this many tokens.")] = None,
        api: Annotated[str, typer.Option("--api", help="native (/generate) | openai (/v1/completions).")] = "native",
        temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy.")] = 0.0,
        ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Generate max-tokens even past EOS.")] = False,
        out: Annotated[Optional[Path], typer.Option("--out", "-o", dir_okay=False, help="JSONL of client (and server) events.")] = None,
        json_out: JsonOpt = False,
    ) -> None:
        """Send one streamed request and record what the client observed."""
        from labkit.console import console, kv_table, note, print_json
        from labkit.service.client import run_client

        eps = _endpoints(endpoints)
        if not eps:
            raise UserError("--endpoints needs a URL")
        res = run_client(eps[0], prompt, max_tokens, request_id, cancel_after, out, api, temperature,
                         ignore_eos=ignore_eos)
        if json_out:
            print_json(res)
        else:
            console.print(kv_table({k: res[k] for k in ("request_id", "worker_id", "status", "reason", "cause",
                                                        "message", "tokens", "tokens_after_finished", "ttft_ms",
                                                        "kind", "out")}, title="labkit client"))
            console.print(res["text"], markup=False, highlight=False)
            if (res.get("model") or {}).get("synthetic"):
                note("synthetic model: random weights; generated text is meaningless")
        ok = res["reason"] in ("stop", "length") or (cancel_after is not None and res["reason"] == "cancelled")
        raise typer.Exit(0 if ok else 1)

    @app.command()
    def trace(
        out: Annotated[Path, typer.Option("--out", "-o", dir_okay=False, help="Trace file (JSONL).")] = Path("workloads/mixed.jsonl"),
        requests: Annotated[int, typer.Option("--requests", help="Requests in the trace.")] = 12,
        prompt_tokens: Annotated[int, typer.Option("--prompt-tokens", help="Prompt length of a short request.")] = 32,
        long_prompt_tokens: Annotated[int, typer.Option("--long-prompt-tokens", help="Prompt length of a long request.")] = 768,
        long_every: Annotated[int, typer.Option("--long-every", help="Every N-th request is long (0: none).")] = 4,
        max_tokens: Annotated[int, typer.Option("--max-tokens", help="Output tokens of every request (ignore_eos).")] = 64,
        interval_ms: Annotated[float, typer.Option("--interval-ms", help="Planned gap between arrivals.")] = 40.0,
        seed: Annotated[int, typer.Option("--seed", help="Seed of the token ids.")] = 17,
        json_out: JsonOpt = False,
    ) -> None:
        """Write a fixed arrival trace (the same bytes for the same options)."""
        from labkit.console import console, kv_table, print_json
        from labkit.load.trace import TraceOptions, write_trace

        summary = write_trace(out, TraceOptions(requests, prompt_tokens, long_prompt_tokens, long_every, max_tokens,
                                                interval_ms, seed))
        if json_out:
            print_json(summary)
        else:
            console.print(kv_table(summary, title="labkit trace"))

    @app.command()
    def load(
        trace: Annotated[Path, typer.Option("--trace", dir_okay=False, help="Arrival trace (labkit trace).")] = Path("workloads/mixed.jsonl"),
        out: Annotated[Optional[Path], typer.Option("--out", "-o", dir_okay=False, help="Event log X.jsonl (evidence goes to X.json); default runs/load.jsonl.")] = None,
        model: ModelOpt = None,
        endpoints: Annotated[Optional[str], typer.Option("--endpoints", help="Running servers a,b,... instead of the in-process engine.")] = None,
        serve_local: Annotated[bool, typer.Option("--serve-local", help="Serve the in-process engine on 127.0.0.1 and drive it over HTTP.")] = False,
        mode: Annotated[str, typer.Option("--mode", help="wall (planned times) | round (per scheduler round, in process).")] = "wall",
        warmup_requests: Annotated[int, typer.Option("--warmup-requests", help="Warmup requests per target, excluded from the window.")] = 2,
        api: Annotated[str, typer.Option("--api", help="native | openai (any OpenAI-compatible server).")] = "native",
        router: Annotated[str, typer.Option("--router", help="round-robin | least-work (least assigned prompt+max_tokens).")] = "round-robin",
        policy: PolicyOpt = "prefill_first",
        batch_tokens: BatchTokensOpt = 512,
        batch_seqs: BatchSeqsOpt = 8,
        max_active: MaxActiveOpt = 8,
        queue_size: QueueSizeOpt = 64,
        max_model_len: MaxModelLenOpt = 1024,
        eager: EagerOpt = True,
        attention: AttentionOpt = "auto",
        device: DeviceOpt = "auto",
        worker_id: WorkerIdOpt = "worker-0",
        tp: TpOpt = 1,
        profile_dir: Annotated[Optional[Path], typer.Option("--profile-dir", file_okay=False, help="torch.profiler after warmup: Chrome trace + operator table here.")] = None,
        openai_model: Annotated[Optional[str], typer.Option("--openai-model", help="Model id for --api openai (default: the server's first).")] = None,
        timeout_s: Annotated[float, typer.Option("--timeout-s", help="Give up on a request after this long.")] = 600.0,
        checkpoint: Annotated[Optional[str], typer.Option("--checkpoint", help="Judge the evidence against this checkpoint id.")] = None,
        json_out: JsonOpt = False,
    ) -> None:
        """Replay an arrival trace in process or against servers; events to JSONL, evidence next to it."""
        from labkit.console import console, note, rel
        from labkit.evidence import default_out
        from labkit.load.replay import LoadOptions, run_load
        from labkit.service.events import split_out

        out = out or default_out("load.jsonl")
        opts = LoadOptions(trace=trace, out=out, model=str(model) if model else None, endpoints=_endpoints(endpoints),
                           serve_local=serve_local, mode=mode, warmup_requests=warmup_requests, api=api, router=router,
                           policy=policy, batch_tokens=batch_tokens, batch_seqs=batch_seqs, max_active=max_active,
                           queue_size=queue_size, max_model_len=max_model_len, eager=eager, attention=attention,
                           device=device, worker_id=worker_id, tp=tp, profile_dir=profile_dir, openai_model=openai_model,
                           timeout_s=timeout_s, checkpoint=checkpoint, show_progress=not json_out)
        record = run_load(opts)
        events, evidence = split_out(out)
        if not json_out:
            summary = record["facts"]["summary"]
            console.print(_observer_table(summary, f"labkit load ({summary.get('kind') or 'kind unknown'}, {mode})"))
            if record["facts"].get("profile"):
                p = record["facts"]["profile"]
                console.print(f"profile: {rel(p['trace'])}, {rel(p['operators'])}, {rel(p['evidence'])}")
            console.print(f"events: {rel(events)}")
            if summary.get("note"):
                note(summary["note"])
        _finish_record(record, evidence, json_out)

    @app.command()
    def report(
        inputs: Annotated[Optional[str], typer.Option("--inputs", help="Event logs a.jsonl,b.jsonl,... to compare; without it, the final report from runs/.")] = None,
        out: Annotated[Optional[Path], typer.Option("--out", "-o", dir_okay=False, help="Comparison JSON (Markdown and PNGs next to it); default runs/comparison.json, or runs/final-report.json without --inputs.")] = None,
        plots: Annotated[bool, typer.Option("--plots/--no-plots", help="Draw PNG plots (needs matplotlib).")] = True,
        json_out: JsonOpt = False,
    ) -> None:
        """Without --inputs: the final evidence report (runs/final-report.md/.json). With --inputs: TTFT / ITL / TPOT, throughput, terminations compared."""
        if inputs is None:
            from labkit.cli.final import final_report_command

            final_report_command(out, plots, json_out)
        from labkit.console import console, note, print_json, rel
        from labkit.evidence import default_out
        from labkit.load.report import compare

        out = out or default_out("comparison.json")
        paths = [p.strip() for p in inputs.split(",") if p.strip()]
        result = compare(paths, out, plots=plots)
        if json_out:
            print_json(result)
            return
        for i, s in enumerate(result["inputs"]):
            console.print(_observer_table(s, f"{i}: {rel(s['path'])} ({s.get('kind') or 'kind unknown'})"))
            if s.get("note"):
                note(s["note"])
        for row in result["ratios"]:
            console.print(f"ratios vs input 0 ({result['primary_observer']}): " +
                          ", ".join(f"{k} {_fmt(v)}" for k, v in row.items() if k not in ("input", "vs")), soft_wrap=True)
        console.print(f"wrote {rel(out)}, {rel(result['markdown'])}" +
                      "".join(f", {rel(p)}" for p in result["plots"]), soft_wrap=True)
        if result.get("plots_note"):
            note(result["plots_note"])

    @app.command()
    def simulate(
        out: Annotated[Optional[Path], typer.Option("--out", "-o", dir_okay=False, help="Event log X.jsonl (evidence: X.json); default runs/runtime-cpu.json(l).")] = None,
        model: ModelOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """The service chain on CPU (Worker → HTTP → client → report) through cancel, overload, faults and shutdown."""
        from labkit.console import console
        from labkit.service.events import split_out
        from labkit.load.simulate import run_simulate

        record = run_simulate(out, model=str(model) if model else None)
        if not json_out:
            from rich.table import Table

            table = Table(title="labkit simulate", title_justify="left")
            for col in ("scenario", "ok", "facts"):
                table.add_column(col, overflow="fold")
            for name, sc in record["facts"]["scenarios"].items():
                facts = {k: v for k, v in sc.items() if k not in ("ok", "policy", "messages", "over_message")}
                table.add_row(name, "yes" if sc.get("ok") else "NO", _short(facts))
            console.print(table)
            console.print(f"events: {record['facts']['events']}")
        _finish_record(record, split_out(Path(record["facts"]["events"]))[1], json_out)


def _short(d: dict, limit: int = 160) -> str:
    import json

    text = json.dumps(d, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"
