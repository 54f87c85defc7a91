"""``labkit scheduler``: the scheduler practice and the before/after comparisons.

``practice`` drives the real Scheduler and BlockManager with synthetic token ids (no model) through the
handbook's cases; ``compare PAIR`` replays workloads/mixed.jsonl on both sides of one change, with
repeats. Both are thin shells over :mod:`labkit.experiments.scheduler_practice` and
:mod:`labkit.load.compare`; they end through :func:`labkit.cli.app.finish`.
"""
from __future__ import annotations

from typing import Annotated

import typer

from labkit.cli.options import AttentionOpt, JsonOpt, ModelOpt, OutOpt, engine_flag

scheduler_app = typer.Typer(help="Scheduler practice on the real scheduler, and before/after comparisons on the mixed trace "
                                 "(docs/LAB.md §14).", no_args_is_help=True)


def _render_practice(record: dict) -> None:
    from rich.table import Table

    from labkit.console import console, readable

    facts = record.get("facts") or {}
    t = Table(title="labkit scheduler practice (real scheduler, synthetic token ids)")
    for col in ("case", "setting", "phases (P = prefill, D = decode)", "what to look at"):
        t.add_column(col)
    short = lambda phases: " ".join("P" if p == "prefill" else "D" for p in phases or [])  # noqa: E731
    for pol in ("prefill_first", "balanced"):
        f = facts.get(pol) or {}
        i, r, k, p = (f.get(c) or {} for c in ("interference", "rotation", "kv_short", "preempt"))
        t.add_row("interference", pol, short(i.get("phases")),
                  f"longest prefill run {i.get('longest_prefill_run')}, shorts' longest gap {i.get('short_max_gap_rounds')} rounds")
        t.add_row("rotation", pol, short(r.get("phases")),
                  f"served in 3 decodes: {', '.join(r.get('served_in_3_decodes') or [])}")
        t.add_row("kv_short", pol, short(k.get("phases")),
                  f"decode while R2 waits for KV: rounds {readable(k.get('decode_while_prefill_waits'))}, "
                  f"R2 prefilled in round {readable(k.get('r2_prefill_round'))}")
        t.add_row("preempt", pol, short([p.get("phase")] if p.get("phase") else []),
                  f"selected {readable(p.get('selected'))}, waiting {readable(p.get('waiting'))}, "
                  f"C {readable(p.get('C'))}")
    for key, s in (facts.get("knob_summary") or {}).items():
        t.add_row("knob", key.replace("/", " --max-consecutive-prefill "), short(s.get("phases")),
                  f"longest prefill run {s.get('longest_prefill_run')}, shorts' longest gap {s.get('short_max_gap_rounds')}, "
                  f"long's first token in round {s.get('long_first_token_round')}")
    console.print(t)
    same = (facts.get("prefill_first_vs_upstream") or {}).get("same_per_case")
    if same is not None:
        console.print(f"prefill_first vs upstream (the pinned patches/upstream/scheduler.py), the same per case: "
                      f"{readable(same)}", soft_wrap=True)


@scheduler_app.command()
def practice(out: OutOpt = None, json_out: JsonOpt = False) -> None:
    """The handbook's scheduler cases on the real Scheduler/BlockManager (no model); writes runs/scheduler-cpu.json."""
    from labkit.cli.app import finish, resolve_out
    from labkit.experiments.scheduler_practice import CHECKPOINT, run_practice

    path = resolve_out(out, CHECKPOINT)
    record = run_practice(path)
    if not json_out:
        _render_practice(record)
    finish(record, path, json_out=json_out)


def _render_compare(record: dict) -> None:
    from rich.table import Table

    from labkit.console import console, readable

    f = record.get("facts") or {}
    t = Table(title=f"labkit scheduler compare {f.get('pair')}: {f.get('what')} ({f.get('repeats')} repeats, "
                    f"{record.get('kind')})")
    for col in ("side", "short ITL p99 ms", "long TTFT p50 ms", "short ITL p99 steps", "long TTFT p50 steps",
                "throughput tok/s", "longest prefill run while decoding", "completed / output tokens"):
        t.add_column(col)
    fmt = lambda xs: " / ".join("–" if x is None else (f"{x:.1f}" if isinstance(x, float) else str(x)) for x in xs)  # noqa: E731
    for name in f.get("side_order") or []:
        s = f["sides"][name]
        t.add_row(name, f"{fmt(s['short_itl_p99_ms'])} (median {s['median_short_itl_p99_ms']})",
                  f"{fmt(s['long_ttft_p50_ms'])} (median {s['median_long_ttft_p50_ms']})",
                  fmt(s.get("short_itl_p99_steps") or []), fmt(s.get("long_ttft_p50_steps") or []),
                  f"{fmt(s['throughput_tok_s'])}", fmt(s["longest_prefill_run_while_decoding"]),
                  f"{fmt(s['completed'])} / {fmt(s['output_tokens'])}")
    console.print(t)
    console.print(f"same request sets: {readable(f.get('same_request_sets'))}; same output tokens per request: "
                  f"{readable(f.get('same_token_counts'))}; event logs in {readable(f.get('logs'))}", soft_wrap=True)
    w = f.get("who_pays")
    if w:
        a, b = w["sides"]
        console.print(f"who pays ({w['unit']}, {b} over {a} per repeat): short ITL p99 "
                      f"{fmt(w['short_itl_p99_steps_ratio'])} (worst {w['max_short_itl_p99_steps_ratio']}), "
                      f"long TTFT p50 {fmt(w['long_ttft_p50_steps_ratio'])} (worst {w['min_long_ttft_p50_steps_ratio']})",
                      soft_wrap=True)


@scheduler_app.command()
def compare(
    pair: Annotated[str, typer.Argument(help="policy | prefill-knob | execution (CUDA) | deployments (2 GPUs).")],
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Runs per side (sides alternate: A1 B1 A2 B2 ...).")] = 3,
    out: OutOpt = None, model: ModelOpt = None,
    device: engine_flag("device", "In-process pairs.") = "auto",
    attention: AttentionOpt = "auto",
    json_out: JsonOpt = False,
) -> None:
    """Replay workloads/mixed.jsonl on both sides of one change, with repeats; judged on equal work first."""
    from labkit.cli.app import finish, resolve_out
    from labkit.console import err_console
    from labkit.load.compare import PAIRS, run_compare

    if pair not in PAIRS:
        from labkit.errors import UserError

        raise UserError(f"unknown pair {pair!r}: choose one of {', '.join(PAIRS)}")
    path = resolve_out(out, PAIRS[pair].checkpoint)
    progress = None if json_out else (lambda side, k: err_console.print(f"run {k + 1}/{repeats}: {side}", highlight=False))
    record = run_compare(pair, path, repeats=repeats, model=str(model) if model else None, device=device,
                         attention=attention, on_run=progress)
    if not json_out:
        _render_compare(record)
    finish(record, path, json_out=json_out)


def register(app: typer.Typer) -> None:
    app.add_typer(scheduler_app, name="scheduler")
