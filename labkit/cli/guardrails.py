"""``labkit logits {collect,compare,guard,calibrate}`` and ``labkit principles {cached-forward,shapes}``.

Wire them in with ``register(app)``. Every command ends through :func:`labkit.cli.app.finish` (the exit
table is in that module).
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Callable, Iterator, Optional

import typer

from labkit.cli.app import finish
from labkit.cli.options import (AttentionOpt, DeviceOpt, DtypeOpt, KvCacheDtypeOpt, ModelOpt, SeedOpt,
                                TensorParallelSizeOpt, engine_flag)
from labkit.console import err_console, print_json
from labkit.console.guardrails import (
    render_calibration,
    render_cached_forward,
    render_collect,
    render_compare,
    render_tp_shapes,
)
from labkit.errors import UserError

EXIT_HELP = "Exit codes: 0 PASS/COLLECTED/REVIEW (REVIEW: look before trusting the numbers), 1 FAIL, 2 user error, 70 internal error."

JsonOpt = Annotated[bool, typer.Option("--json", help="Print the evidence record as JSON on stdout.")]
SuiteOpt = Annotated[str, typer.Option("--suite", help="baseline (15 rows) | graph (126 rows).")]
BucketsOpt = Annotated[Optional[str], typer.Option("--graph-buckets", help="Graph batch buckets, e.g. 1,2,4,8,16 (default: cover every batch).")]
MaxAbsOpt = Annotated[Optional[float], typer.Option("--max-abs", help="Override the per-row max abs logit threshold (default: the logits table's entry for the device and dtype, checkpoints/guardrails.json).")]
RelL2Opt = Annotated[Optional[float], typer.Option("--rel-l2", help="Override the per-row relative L2 threshold, logits and new KV (default: the logits table's entry).")]
KvMaxAbsOpt = Annotated[float, typer.Option("--kv-max-abs", help="New-KV max abs threshold (when both sides hold KV arrays).")]


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


# --------------------------------------------------------------------------- commands


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
    kv_cache_dtype: KvCacheDtypeOpt = "auto",
    tensor_parallel_size: TensorParallelSizeOpt = 1,
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
                            dtype=dtype, progress=tick, tp=tensor_parallel_size, kv_cache_dtype=kv_cache_dtype)
    if not json_out:
        render_collect(record)
    paths = record["_paths"]
    finish(record, [paths["json"], paths["npz"]], json_out=json_out, word=_status_word(record))


def logits_compare(
    lhs: Annotated[Optional[Path], typer.Option("--lhs", help="PREFIX of the measured collection.")] = None,
    rhs: Annotated[Optional[Path], typer.Option("--rhs", help="PREFIX of the reference collection.")] = None,
    max_abs: MaxAbsOpt = None,
    rel_l2: RelL2Opt = None,
    kv_max_abs: KvMaxAbsOpt = 0.1,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", dir_okay=False, help="Evidence JSON (default runs/logits-compare.json; a comparison by hand is evidence for no checkpoint).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Row by row: max abs, relative L2, top-1 and the reference's top-2 margin; PASS / REVIEW / FAIL."""
    from labkit.guardrails.compare import compare

    if lhs is None or rhs is None:
        raise UserError("both --lhs PREFIX and --rhs PREFIX are required")
    record = compare(lhs, rhs, out, max_abs=max_abs, rel_l2=rel_l2, kv_max_abs=kv_max_abs)
    if not json_out:
        render_compare(record)
    finish(record, [record["_paths"]["json"]], json_out=json_out)


def logits_guard(
    suite: SuiteOpt = "baseline",
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    attention: AttentionOpt = "auto",
    graph_buckets: BucketsOpt = None,
    seed: SeedOpt = 0,
    dtype: DtypeOpt = "auto",
    kv_cache_dtype: engine_flag("kv_cache_dtype", "Here fp8 runs the FP8 KV cache guard: the engine with an e4m3 KV cache against the same engine with its cache in the model's dtype, baseline suite, held to the kv-fp8 thresholds (checkpoint guardrails.kv-fp8 in bfloat16 on CUDA).") = "auto",
    max_abs: MaxAbsOpt = None,
    rel_l2: RelL2Opt = None,
    kv_max_abs: KvMaxAbsOpt = 0.1,
    lhs_out: Annotated[Optional[Path], typer.Option("--lhs-out", help="PREFIX for the measured side (default next to --out).")] = None,
    rhs_out: Annotated[Optional[Path], typer.Option("--rhs-out", help="PREFIX for the reference side (default next to --out).")] = None,
    tensor_parallel_size: TensorParallelSizeOpt = 1,
    rope_scaling: Annotated[Optional[str], typer.Option(
        "--rope-scaling", metavar="TYPE:FACTOR",
        help="Baseline suite on a copy of the model whose config.json carries this rope scaling "
             "(yarn:4, linear:2); both sides read it (checkpoints models.rope-yarn / models.rope-linear).")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", dir_okay=False, help="Evidence JSON (default: the checkpoint's file).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Collect a suite's guardrail pair and compare it in one go: baseline = nano eager vs hf; graph = nano graph vs nano eager; --kv-cache-dtype fp8 = nano eager with an FP8 KV cache vs nano eager."""
    from labkit.guardrails.calibrate import guard
    from labkit.guardrails.suites import parse_buckets

    buckets = parse_buckets(graph_buckets)
    with _progress() as make:
        record = guard(suite, out, model=str(model) if model else None, device=device, attention=attention,
                          graph_buckets=buckets, seed=seed, dtype=dtype, max_abs=max_abs, rel_l2=rel_l2, kv_max_abs=kv_max_abs,
                          lhs_out=lhs_out, rhs_out=rhs_out, progress=make, tp=tensor_parallel_size,
                          rope_scaling=rope_scaling, kv_cache_dtype=kv_cache_dtype)
    if not json_out:
        render_compare(record)
    f = record["facts"]
    paths = [record["_paths"]["json"], f["lhs"]["prefix"] + ".json", f["rhs"]["prefix"] + ".json"]
    finish(record, paths, json_out=json_out)


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
        render_cached_forward(record)
    finish(record, [record["_paths"]["json"]], json_out=json_out)


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
    else:
        render_calibration(record)


def principles_shapes(
    tensor_parallel_size: TensorParallelSizeOpt = 2,
    model: ModelOpt = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Evidence file.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """How Qwen3's layers split over TP ranks: heads, qkv rows, column/row/vocab splits (static, docs/LAB.md §10)."""
    from labkit.experiments.tp_shapes import run_shapes

    record = run_shapes(tensor_parallel_size, str(model) if model else None, out)
    if not json_out:
        render_tp_shapes(record)
    finish(record, [out] if out else [], json_out=json_out)


def _group(app: typer.Typer, name: str, help_text: str) -> typer.Typer:
    sub = typer.Typer(help=help_text, no_args_is_help=True)
    app.add_typer(sub, name=name)
    return sub


def register(app: typer.Typer) -> None:
    """Add ``logits {collect,compare,guard,calibrate}`` and ``principles {cached-forward,shapes}`` to ``app``."""
    logits_app = _group(app, "logits", "Numerical guardrails: teacher-forced logits, collected and compared (docs/LAB.md §7, §15); --seed seeds the preset continuation ids (and the graph suite's prompts).")
    logits_app.command("collect", epilog=EXIT_HELP)(logits_collect)
    logits_app.command("compare", epilog=EXIT_HELP)(logits_compare)
    logits_app.command("guard", epilog=EXIT_HELP)(logits_guard)
    principles_app = _group(app, "principles", "Principles experiments (docs/LAB.md §8, §10).")
    principles_app.command("cached-forward", epilog=EXIT_HELP)(principles_cached_forward)
    principles_app.command("shapes")(principles_shapes)
    from labkit.cli.principles import register_principles

    register_principles(principles_app)
    logits_app.command("calibrate")(logits_calibrate)
