"""Typer shells for the numerical guardrails: ``labkit logits {collect,compare,guard}`` and
``labkit principles cached-forward``. Wire them in with ``register(app)``.

Exit codes (these commands): 0 PASS / COLLECTED, 1 FAIL, 2 a user error (one red line, no traceback),
3 REVIEW (a top-1 flip inside the measured error, or any check that asks a human to look: not a
failure, not a pass either; scripts can tell it apart).
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Callable, Iterator, NoReturn, Optional

import typer
from rich.table import Table
from rich.text import Text

from labkit.console import checks_table, console, dict_table, err_console, error_line, kv_table, note, print_json, rel, verdict_text
from labkit.errors import UserError
from labkit.cli.options import DeviceOpt, ModelOpt

EXIT_PASS = 0
EXIT_FAIL = 1
EXIT_USER_ERROR = 2
EXIT_REVIEW = 0            # REVIEW asks for a look; like every labkit command, only FAIL exits non-zero
EXIT_CODES = {"PASS": EXIT_PASS, "FAIL": EXIT_FAIL, "REVIEW": EXIT_REVIEW, "NOT-RUN": EXIT_FAIL}
EXIT_HELP = "Exit codes: 0 PASS/COLLECTED/REVIEW (REVIEW: look before trusting the numbers), 1 FAIL, 2 user error."

JsonOpt = Annotated[bool, typer.Option("--json", help="Print the evidence record as JSON on stdout.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of the preset continuation ids (and graph-suite prompts).")]
SuiteOpt = Annotated[str, typer.Option("--suite", help="baseline (15 rows) | graph (126 rows).")]
AttentionOpt = Annotated[str, typer.Option("--attention", help="Engine attention backend: auto | flash_attn | triton | torch.")]
BucketsOpt = Annotated[Optional[str], typer.Option("--graph-buckets", help="Graph batch buckets, e.g. 1,2,4,8,16 (default: cover every batch).")]
MaxAbsOpt = Annotated[float, typer.Option("--max-abs", help="Per-row max abs logit error threshold.")]
RelL2Opt = Annotated[float, typer.Option("--rel-l2", help="Per-row relative L2 threshold (logits and new KV).")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="auto (bfloat16 on CUDA, float32 on CPU) | bfloat16 | float16 | float32.")]
KvMaxAbsOpt = Annotated[float, typer.Option("--kv-max-abs", help="New-KV max abs threshold (when both sides hold KV arrays).")]


# --------------------------------------------------------------------------- plumbing


def _user_errors(fn: Callable) -> Callable:
    """A UserError ends the command with one red line and exit code 2."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as exc:
            error_line(str(exc) or type(exc).__name__)
            raise typer.Exit(EXIT_USER_ERROR) from None
    return wrapper


def _group(app: typer.Typer, name: str, help_text: str) -> typer.Typer:
    """The sub-typer ``name`` of ``app``: the one already registered (another module's), else a new one."""
    for info in app.registered_groups:
        inst = info.typer_instance
        names = {info.name if isinstance(info.name, str) else None,
                 getattr(getattr(inst, "info", None), "name", None)}
        if name in names and inst is not None:
            return inst
    sub = typer.Typer(help=help_text, no_args_is_help=True)
    app.add_typer(sub, name=name)
    return sub


@contextmanager
def _progress() -> Iterator[Callable[[str, int], Callable[[int], None]]]:
    """Yields make(label, total) -> advance(n): one transient bar per phase, on stderr."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=err_console, transient=True)

    def make(label: str, total: int) -> Callable[[int], None]:
        task = bar.add_task(label, total=total)
        return lambda n=1: bar.advance(task, n)

    with bar:
        yield make


def _status_word(record: dict) -> str:
    if record.get("verdict") == "PASS" and record.get("checkpoint") is None \
            and (record.get("facts") or {}).get("status") == "COLLECTED":
        return "COLLECTED"
    return record.get("verdict", "FAIL")


def _finish(record: dict, paths: list[str | Path], *, json_out: bool, word: str | None = None) -> NoReturn:
    verdict = record.get("verdict", "FAIL")
    if json_out:
        print_json({k: v for k, v in record.items() if k != "_paths"})
    else:
        if record.get("checks"):
            console.print(checks_table(record["checks"]))
        line = Text(word, style="bold green") if word == "COLLECTED" else verdict_text(verdict)
        line.append(f"  {record.get('checkpoint') or ''}", style="bold")
        line.append("  evidence: " + " + ".join(rel(p) for p in paths))
        console.print(line, soft_wrap=True)
        if verdict == "REVIEW":
            note("REVIEW: look before trusting these numbers")
        synth = (record.get("facts") or {}).get("note")
        if synth:
            note(synth)
    raise typer.Exit(EXIT_CODES.get(verdict, EXIT_FAIL))


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3e}"


def _routes_text(facts: dict) -> str:
    routes = facts.get("decode_routes") or {}
    if not routes:
        return "-"
    parts = []
    for batch, r in routes.items():
        where = f"graph@{r['bucket']}" if r.get("route") == "graph" else str(r.get("route"))
        ok = "" if (r.get("route"), r.get("bucket")) == (r.get("expected_route"), r.get("expected_bucket")) else " (unexpected)"
        parts.append(f"{batch}:{where}{ok}")
    return ", ".join(parts)


def _collect_summary(record: dict) -> Table:
    f = record["facts"]
    data = {
        "suite": f"{f['suite']} (seed {f['seed']})",
        "backend": f"{f['backend']}  execution {f['execution']}  attention {f['attention']}  dtype {f['dtype']}",
        "device": record.get("device"),
        "rows": f"{f['num_rows']} / {f['expected_rows']}",
        "trajectory sha256": f["trajectory_sha256"][:16],
    }
    if f.get("backend") == "nano":
        data["decode routes (batch:route)"] = _routes_text(f)
        if f.get("graph_buckets"):
            data["graph buckets"] = ",".join(map(str, f["graph_buckets"]))
    if "kv" in f:
        kv = f["kv"]
        data["history KV unchanged"] = kv["history_unchanged"]
        data["padding wrote nothing"] = kv["padding_wrote_nothing"]
        data["new KV rows"] = f"{kv['new_kv_rows']} {kv['new_kv_shape']}"
    if "expect_uncovered" in f:
        eu = f["expect_uncovered"]
        data["batch 17 decode"] = f"route {eu['route']}, completed {eu['completed']}" + (f", error {eu['error']}" if eu["error"] else "")
    return kv_table(data, title="logits collect")


def _compare_tables(record: dict) -> list[Table]:
    f = record["facts"]
    th = f["thresholds"]
    summary = {
        "lhs (measured)": f"{rel(f['lhs']['prefix'])}  {f['lhs']['backend']}/{f['lhs']['execution']}/{f['lhs']['attention']} {f['lhs']['dtype']} on {f['lhs']['device']}",
        "rhs (reference)": f"{rel(f['rhs']['prefix'])}  {f['rhs']['backend']}/{f['rhs']['execution']}/{f['rhs']['attention']} {f['rhs']['dtype']} on {f['rhs']['device']}",
        "rows": f"{f['num_rows']} ({f['suite']})",
        "worst max abs": f"{_fmt(f['worst_max_abs'])} (threshold {th['max_abs']:g}; median {_fmt(f['median_max_abs'])})",
        "worst relative L2": f"{_fmt(f['worst_rel_l2'])} (threshold {th['rel_l2']:g}; median {_fmt(f['median_rel_l2'])})",
        "top-1 agreement": f"{f['top1_agree']}/{f['num_rows']} ({f['unexplained_top1_flips']} unexplained flips)",
        "first divergent row": (f"#{f['first_divergent_row']['index']} {f['first_divergent_row']['id']} "
                                f"({', '.join(f['first_divergent_row']['failures'])})") if f["first_divergent_row"] else "none",
    }
    kv = f["kv"]
    summary["new KV"] = (f"{kv['rows']} rows, worst max abs {_fmt(kv['worst_max_abs'])} (threshold {th['kv_max_abs']:g}), "
                         f"worst rel L2 {_fmt(kv['worst_rel_l2'])}") if kv["compared"] else f"not compared: {kv['why_not']}"
    worst = Table(title=f"{len(f['worst_rows'])} worst rows (by max abs)", title_justify="left")
    for col in ("row", "id", "phase", "len", "max abs", "rel L2", "top-1 lhs/rhs", "ref top-2 margin", "failures"):
        worst.add_column(col, justify="right" if col in ("row", "len", "max abs", "rel L2", "ref top-2 margin") else "left")
    for r in f["worst_rows"]:
        worst.add_row(str(r["index"]), r["id"], r["phase"], str(r["length"]), _fmt(r["max_abs"]), _fmt(r["rel_l2"]),
                      f"{r['top1_lhs']}/{r['top1_rhs']}", f"{r['ref_margin']:.4f}", ",".join(r["failures"]) or "-")
    return [kv_table(summary, title="logits compare"), worst]


# --------------------------------------------------------------------------- commands


@_user_errors
def logits_collect(
    backend: Annotated[str, typer.Option("--backend", help="nano (the embedded engine) | hf (transformers).")] = "nano",
    suite: SuiteOpt = "baseline",
    execution: Annotated[str, typer.Option("--execution", help="nano only: eager | graph (CUDA graphs, CUDA only).")] = "eager",
    attention: AttentionOpt = "auto",
    graph_buckets: BucketsOpt = None,
    expect_uncovered: Annotated[bool, typer.Option("--expect-uncovered", help="Graph suite: assert the batch-17 decode has no covering bucket, runs eagerly and completes (default buckets 1,2,4,8,16).")] = False,
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    seed: SeedOpt = 0,
    dtype: DtypeOpt = "auto",
    tp: Annotated[int, typer.Option("--tp", help="nano only: tensor-parallel ranks (baseline suite).")] = 1,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="PREFIX: writes PREFIX.json and PREFIX.npz (a .json suffix is dropped).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Teacher-forced logits along a suite's fixed trajectory: PREFIX.json (trajectory, routes, checks) + PREFIX.npz."""
    from labkit.guardrails.collect import collect
    from labkit.guardrails.suites import SUITES, build_suite, parse_buckets

    buckets = parse_buckets(graph_buckets)
    with _progress() as make:
        tick = make(f"collect {backend} {suite}", build_suite(suite, seed).expected_rows) if suite in SUITES else None
        record = collect(backend, suite, out, model=str(model) if model else None, device=device, attention=attention,
                            execution=execution, graph_buckets=buckets, expect_uncovered=expect_uncovered, seed=seed,
                            dtype=dtype, progress=tick, tp=tp)
    if not json_out:
        console.print(_collect_summary(record))
    paths = record["_paths"]
    _finish(record, [paths["json"], paths["npz"]], json_out=json_out, word=_status_word(record))


@_user_errors
def logits_compare(
    lhs: Annotated[Optional[Path], typer.Option("--lhs", help="PREFIX of the measured collection.")] = None,
    rhs: Annotated[Optional[Path], typer.Option("--rhs", help="PREFIX of the reference collection.")] = None,
    max_abs: MaxAbsOpt = 0.5,
    rel_l2: RelL2Opt = 0.02,
    kv_max_abs: KvMaxAbsOpt = 0.1,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", dir_okay=False, help="Evidence JSON (default: the guardrail checkpoint's file, else runs/logits-compare.json).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Row by row: max abs, relative L2, top-1 and the reference's top-2 margin; PASS / REVIEW / FAIL."""
    from labkit.guardrails.compare import compare

    if lhs is None or rhs is None:
        raise UserError("both --lhs PREFIX and --rhs PREFIX are required")
    record = compare(lhs, rhs, out, max_abs=max_abs, rel_l2=rel_l2, kv_max_abs=kv_max_abs)
    if not json_out:
        for t in _compare_tables(record):
            console.print(t)
    _finish(record, [record["_paths"]["json"]], json_out=json_out)


@_user_errors
def logits_guard(
    suite: SuiteOpt = "baseline",
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    attention: AttentionOpt = "auto",
    graph_buckets: BucketsOpt = None,
    seed: SeedOpt = 0,
    dtype: DtypeOpt = "auto",
    max_abs: MaxAbsOpt = 0.5,
    rel_l2: RelL2Opt = 0.02,
    kv_max_abs: KvMaxAbsOpt = 0.1,
    lhs_out: Annotated[Optional[Path], typer.Option("--lhs-out", help="PREFIX for the measured side (default next to --out).")] = None,
    rhs_out: Annotated[Optional[Path], typer.Option("--rhs-out", help="PREFIX for the reference side (default next to --out).")] = None,
    tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel ranks of the engine side (baseline suite).")] = 1,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", dir_okay=False, help="Evidence JSON (default: the checkpoint's file).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Collect a suite's guardrail pair and compare it in one go: baseline = nano eager vs hf; graph = nano graph vs nano eager."""
    from labkit.guardrails.calibrate import guard
    from labkit.guardrails.suites import parse_buckets

    buckets = parse_buckets(graph_buckets)
    with _progress() as make:
        record = guard(suite, out, model=str(model) if model else None, device=device, attention=attention,
                          graph_buckets=buckets, seed=seed, dtype=dtype, max_abs=max_abs, rel_l2=rel_l2, kv_max_abs=kv_max_abs,
                          lhs_out=lhs_out, rhs_out=rhs_out, progress=make, tp=tp)
    if not json_out:
        for t in _compare_tables(record):
            console.print(t)
    f = record["facts"]
    paths = [record["_paths"]["json"], f["lhs"]["prefix"] + ".json", f["rhs"]["prefix"] + ".json"]
    _finish(record, paths, json_out=json_out)


@_user_errors
def principles_cached_forward(
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    prompt_len: Annotated[int, typer.Option("--prompt-len", help="S: prompt positions.")] = 64,
    steps: Annotated[int, typer.Option("--steps", help="G: logits steps (the prefill step included).")] = 8,
    repeats: Annotated[int, typer.Option("--repeats", help="Timing repeats of both paths.")] = 1,
    seed: SeedOpt = 0,
    dtype: DtypeOpt = "auto",
    out: Annotated[Optional[Path], typer.Option("--out", "-o", dir_okay=False, help="Evidence JSON (default runs/cached-forward.json).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Transformers with and without KV cache along one trajectory: widths, positions, logit errors, timings (docs/LAB.md §8)."""
    from labkit.guardrails.cached_forward import run_cached_forward

    record = run_cached_forward(out, model=str(model) if model else None, device=device, prompt_len=prompt_len,
                                steps=steps, repeats=repeats, seed=seed, dtype=dtype)
    if not json_out:
        f = record["facts"]
        t = Table(title=f"cached vs uncached, S={f['prompt_len']} G={f['steps']} ({f['dtype']} on {f['device']})",
                  title_justify="left")
        for col in ("step", "width uncached", "width cached", "max abs", "rel L2", "same top-1"):
            t.add_column(col, justify="right")
        for s in f["per_step"]:
            t.add_row(str(s["step"]), str(s["width_uncached"]), str(s["width_cached"]), _fmt(s["max_abs"]),
                      _fmt(s["rel_l2"]), "yes" if s["same_top1"] else "NO")
        console.print(t)
        tm = f["timing"]
        console.print(kv_table({
            "positions": f"uncached {f['positions_uncached']} vs cached {f['positions_cached']} "
                         f"(expected {f['expected']['positions_uncached']} / {f['expected']['positions_cached']}; "
                         f"ratio {f['position_ratio']:.2f})",
            "max abs / rel L2": f"{_fmt(f['max_abs_logit_error'])} / {_fmt(f['relative_l2_logit_error'])}",
            "same top-1 steps": f"{f['same_top1_steps']}/{f['steps']}",
            "prefill s (median)": f"uncached {tm['uncached']['median_prefill_s']:.4f}  cached {tm['cached']['median_prefill_s']:.4f}",
            "decode s (median)": f"uncached {tm['uncached']['median_decode_s']:.4f}  cached {tm['cached']['median_decode_s']:.4f}",
            "repeats": f["repeats"],
        }, title="cached-forward"))
    _finish(record, [record["_paths"]["json"]], json_out=json_out)


# --------------------------------------------------------------------------- wiring


@_user_errors
def logits_calibrate(
    suites: Annotated[str, typer.Option("--suites", help="Comma-separated: baseline,graph.")] = "baseline,graph",
    backends: Annotated[Optional[str], typer.Option("--backends", help="Comma-separated attention backends (default: every one available here).")] = None,
    dtypes: Annotated[str, typer.Option("--dtypes", help="Comma-separated: auto,bfloat16,float32,...")] = "auto",
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Engine collections per configuration.")] = 3,
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    seed: SeedOpt = 0,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", dir_okay=False, help="Evidence JSON (default runs/logits-calibration.json).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Error distribution of the engine against transformers per suite, dtype and backend, over repeats."""
    from labkit.guardrails.calibrate import calibrate

    split = lambda text: tuple(x.strip() for x in text.split(",") if x.strip())  # noqa: E731
    record = calibrate(split(suites), split(backends) if backends else None, split(dtypes), repeats, out,
                          model=str(model) if model else None, device=device, seed=seed)
    if json_out:
        print_json(record)
        raise typer.Exit(0)
    rows = [{"suite": r["suite"], "exec": r["execution"], "dtype": r["dtype"], "backend": r["backend"],
             "worst max abs": f"{r['worst_max_abs']:.3g}", "median max abs": f"{r['median_max_abs']:.3g}",
             "worst rel L2": f"{r['worst_rel_l2']:.3g}", "median rel L2": f"{r['median_rel_l2']:.3g}",
             "top-1 (min)": f"{r['min_top1_agree']}/{r['num_rows']}",
             "verdicts": ",".join(x["verdict"] for x in r["repeats"])} for r in record["facts"]["results"]]
    console.print(dict_table(rows, title=f"logits calibration, {record['facts']['repeats']} repeats on {record['device']}"))


@_user_errors
def principles_shapes(
    tp: Annotated[int, typer.Option("--tp", min=1, help="Tensor-parallel ranks.")] = 2,
    model: ModelOpt = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Evidence file.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """How Qwen3's layers split over TP ranks: heads, qkv rows, column/row/vocab splits (static, docs/LAB.md §10)."""
    from labkit.experiments.tp_shapes import run_shapes

    record = run_shapes(tp, str(model) if model else None, out)
    if not json_out:
        for r in record["facts"]["ranks"]:
            console.print(f"rank {r['rank']}: {r['q_heads']} q heads, {r['kv_heads']} kv heads, "
                          f"rows of the TP=1 qkv weight {r['rows_of_tp1_packed_qkv']}")
    _finish(record, [out] if out else [], json_out=json_out, word=record["verdict"])


def register(app: typer.Typer) -> None:
    """Add ``logits {collect,compare,guard}`` and ``principles cached-forward`` to ``app``."""
    logits_app = _group(app, "logits", "Numerical guardrails: teacher-forced logits, collected and compared (docs/LAB.md §7, §15).")
    logits_app.command("collect", epilog=EXIT_HELP)(logits_collect)
    logits_app.command("compare", epilog=EXIT_HELP)(logits_compare)
    logits_app.command("guard", epilog=EXIT_HELP)(logits_guard)
    principles_app = _group(app, "principles", "Principles experiments (docs/LAB.md §8, §10).")
    principles_app.command("cached-forward", epilog=EXIT_HELP)(principles_cached_forward)
    principles_app.command("shapes")(principles_shapes)
    logits_app.command("calibrate")(logits_calibrate)
