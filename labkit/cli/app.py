"""The ``labkit`` app, its one way to end a command, and the setup commands.

A command is a thin Typer function: options -> one call into a plain function -> evidence -> a
:mod:`labkit.console` renderer -> :func:`finish`::

    @app.command()
    def smoke(out: OutOpt = None, model: ModelOpt = None, json_out: JsonOpt = False) -> None:
        \"\"\"One line of help.\"\"\"
        from labkit.experiments.smoke import run_smoke   # import lazily: keep `labkit --help` fast
        path = resolve_out(out, "setup.smoke")
        record = run_smoke(path, model=model)
        finish(record, path, json_out=json_out)

Exit codes, the same for every command:

=====================  ====  ==========================================================================
PASS                   0
REVIEW                 0     a human should look; not a failure
FAIL                   1
NOT-RUN                0     a row of ``labkit run`` / ``labkit check`` (the reason is in the row)
user error             2     one red ``error:`` line: :class:`labkit.errors.UserError` (ModelError,
                             CheckpointError, ...), ``engine.config.ConfigError``,
                             ``engine.llm_engine.RequestError``, an ``OSError`` naming a file, a
                             usage error; also a single command whose checkpoint cannot run on this
                             machine ("needs CUDA")
internal error         70    any other exception is a bug: one ``internal error:`` line, or the
                             traceback with ``LABKIT_DEBUG=1``
interrupted            130   Ctrl-C outside a command
=====================  ====  ==========================================================================

Errors are mapped by type, never by message text, in the root group (:class:`LabkitGroup`), so
``main`` and ``typer.testing.CliRunner`` see the same codes.
"""

from __future__ import annotations

import bdb
import enum
import sys
from pathlib import Path
from typing import Annotated, NoReturn, Optional

import typer
from typer.core import TyperGroup
from typer.exceptions import TyperException

from labkit import __version__
from labkit.cli.help_format import install as _help_format
from labkit.cli.options import (
    AttentionOpt,
    DeviceOpt,
    EnforceEagerOpt,
    FusedOpsOpt,
    JsonOpt,
    KvCacheBlockSizeOpt,
    KvCacheDtypeOpt,
    MaxConsecutivePrefillOpt,
    MaxModelLenOpt,
    MaxNumBatchedTokensOpt,
    MaxNumSeqsOpt,
    ModelOpt,
    OutOpt,
    SeedOpt,
)
from labkit.console import (
    bench_serve_rows,
    console,
    dict_table,
    debug_enabled,
    err_console,
    error_line,
    internal_error_line,
    print_json,
    rel,
    render_doctor,
    render_facts_json,
    render_generate,
    render_quick_walk,
    render_record,
    render_rows,
    render_smoke,
)
from labkit.errors import UserError

#: Exit code per verdict: REVIEW asks for a human look, it is not a failure.
EXIT_CODES = {"PASS": 0, "REVIEW": 0, "NOT-RUN": 0, "FAIL": 1}
USER_ERROR_EXIT = 2
INTERNAL_ERROR_EXIT = 70
INTERRUPTED_EXIT = 130


def _user_error_types() -> tuple[type[BaseException], ...]:
    """The exception types a user can cause. The engine's are imported here, on the error path only,
    so that ``labkit --help`` does not import torch."""
    from engine.config import ConfigError
    from engine.llm_engine import RequestError
    from serve.errors import ServeError

    return (UserError, ServeError, ConfigError, RequestError)


def is_user_error(e: BaseException) -> bool:
    if isinstance(e, UserError):
        return True
    if isinstance(e, OSError):
        return e.filename is not None
    return isinstance(e, _user_error_types())


def _message(e: BaseException) -> str:
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        return f"{e.strerror}: {e.filename}"
    return str(e) or type(e).__name__


def end_with_error(e: Exception) -> NoReturn:
    """A user error: one red line, exit 2. Anything else is a bug: one line and exit 70, or the
    traceback when LABKIT_DEBUG is set (then a non-UserError user error shows its traceback too)."""
    if debug_enabled() and not isinstance(e, UserError):
        raise e
    if is_user_error(e):
        error_line(_message(e))
        raise typer.Exit(USER_ERROR_EXIT)
    internal_error_line(f"{type(e).__name__}: {_message(e)}")
    raise typer.Exit(INTERNAL_ERROR_EXIT)


class LabkitGroup(TyperGroup):
    """The root group: every command's exception ends here and is mapped by :func:`end_with_error`."""

    def invoke(self, ctx: typer.Context):
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort, TyperException):   # exits and usage errors: Typer's own
            raise
        except bdb.BdbQuit:             # `q` at a --debug prompt: the learner stopped on purpose
            sys.stderr.write("debug: quit (the walk stopped; no evidence written)\n")
            raise typer.Exit(0) from None
        except Exception as e:  # noqa: BLE001 - mapped by type in end_with_error
            end_with_error(e)


_help_format()                            # option names are never cut at 80 columns
app = typer.Typer(
    name="labkit",
    cls=LabkitGroup,
    help="A checkpointed lab around the embedded LLM engine. Start with `labkit doctor`, then `labkit run`.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    rich_markup_mode="rich",
)


def resolve_out(out: Path | None, checkpoint_id: str) -> Path:
    """``--out`` if given, else the evidence path of ``checkpoint_id`` (under runs/); with engine patches
    applied, its place under ``runs/patched/<patch>/`` (the unpatched engine's evidence is never replaced)."""
    from labkit.evidence import patched_out

    if out is not None:
        return patched_out(out)
    from labkit.checks import get_checkpoint

    return patched_out(get_checkpoint(checkpoint_id).evidence_path())


def finish(record: dict, paths: str | Path | list[str | Path] | None = None, *, json_out: bool = False,
           word: str | None = None) -> NoReturn:
    """The end of every command that writes evidence: print the record (checks, verdict, evidence
    paths, notes) or, with ``--json``, the record itself; exit with the verdict's code.

    ``word`` replaces the verdict in the last line (``COLLECTED`` for a collection without a checkpoint).
    A single record that is NOT-RUN could not run on this machine: a user error (exit 2).
    """
    from labkit.evidence import is_patched_path

    verdict = record.get("verdict") or "REVIEW"
    if paths is None:
        paths = []
    elif not isinstance(paths, list):
        paths = [paths]
    moved = record.get("_written_to")
    if isinstance(moved, dict):  # a patched engine's evidence went beside the unpatched one
        paths = [moved["path"] if str(p) == moved["requested"] else p for p in paths]
    if json_out:
        print_json({k: v for k, v in record.items() if not k.startswith("_")})
    else:
        render_record(record, paths, word=word)
    if record.get("engine_patches") and any(is_patched_path(p) for p in paths):
        err_console.print(f"note: made with engine patch {', '.join(record['engine_patches'])} applied, so written "
                          "under runs/patched/; the unpatched engine's evidence is kept (labkit patch revert, then "
                          "labkit check)", markup=False, highlight=False)
    unclaimed = (record.get("facts") or {}).get("checkpoint_not_claimed") if isinstance(record.get("facts"), dict) else None
    if isinstance(unclaimed, dict):
        err_console.print(f"note: not evidence for {unclaimed.get('checkpoint')}: {unclaimed.get('why')}; "
                          f"its command is `{unclaimed.get('command')}`", markup=False, highlight=False)
    if verdict == "NOT-RUN":
        from labkit.checks import reason

        error_line(reason(verdict, record.get("checks") or []) or "this checkpoint cannot run on this machine")
        raise typer.Exit(USER_ERROR_EXIT)
    raise typer.Exit(EXIT_CODES.get(verdict, 1))


def finish_rows(rows: list[dict], *, json_out: bool = False, title: str | None = None) -> NoReturn:
    """The end of ``labkit run`` and ``labkit check``: print the rows; exit 1 if any FAILed
    (NOT-RUN rows exit 0: the machine lacks what they need, the reason is in the row)."""
    if json_out:
        print_json(rows)
    else:
        render_rows(rows, title=title)
    raise typer.Exit(max((EXIT_CODES.get(r["verdict"], 1) for r in rows), default=0))


def _version(value: bool) -> None:
    if value:
        console.print(f"labkit {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version.")] = False,
) -> None:
    """A checkpointed lab around the embedded LLM engine."""


# --------------------------------------------------------------------------- setup


@app.command()
def doctor(out: OutOpt = None, device: DeviceOpt = "auto", json_out: JsonOpt = False,
           engine: Annotated[bool, typer.Option("--engine", help="Also build the engine and report its KV pool sizing.")] = False,
           model: ModelOpt = None) -> None:
    """Check packages, device and a small tensor computation; writes runs/setup-doctor.json."""
    from labkit.doctor import CHECKPOINT, run_doctor

    path = resolve_out(out, CHECKPOINT)
    record = run_doctor(path, device, engine=engine, model=str(model) if model else None)
    if not json_out:
        render_doctor(record)
    finish(record, path, json_out=json_out)


@app.command()
def check(
    target: Annotated[Optional[str], typer.Argument(help="A stage (setup, ...) or checkpoint id; default all.")] = None,
    write_md: Annotated[bool, typer.Option("--write-md", help="Regenerate CHECKPOINTS.md from checkpoints/*.json.")] = False,
    strict: Annotated[bool, typer.Option("--strict", help="A checkpoint this machine can run but has no current evidence for (missing: its command crashed or never ran; stale) FAILs (exit 1). CI uses it.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Re-judge the evidence under runs/ against the checkpoint definitions."""
    from labkit.checks import write_checkpoints_md
    from labkit.run_all import check_all

    if write_md:
        path = write_checkpoints_md()
        console.print(f"wrote {rel(path)}")
        if target is None:
            raise typer.Exit(0)
    rows = check_all(target, strict=strict)
    if not json_out:
        rows = [{k: v for k, v in r.items() if k != "checks"} for r in rows]
    finish_rows(rows, json_out=json_out, title="labkit check" + (" --strict" if strict else ""))


@app.command()
def run(
    stage: Annotated[Optional[str], typer.Option("--stage", help="Only this stage (or checkpoint id).")] = None,
    model: ModelOpt = None,
    stop_on_fail: Annotated[bool, typer.Option("--stop-on-fail", help="Stop after the first FAIL.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Run every checkpoint this machine can run, in order; the rest are NOT-RUN with the reason."""
    from labkit.paths import runs_dir
    from labkit.run_all import RunInterrupted, run_all

    if model is not None and not model.is_dir():
        raise UserError(f"--model {model}: not a directory")
    try:
        rows = run_all(stage=stage, model=str(model) if model else None, stop_on_fail=stop_on_fail)
    except RunInterrupted as e:
        if json_out:
            print_json(e.rows)
        else:
            render_rows(e.rows, title="labkit run (interrupted)")
        error_line(f"interrupted (Ctrl-C) during {e.at or 'labkit run'}; {rel(runs_dir() / 'report.md')} "
                   "is marked partial")
        raise typer.Exit(INTERRUPTED_EXIT) from None
    if not json_out:
        console.print(f"report: {rel(runs_dir() / 'report.md')}")
    finish_rows(rows, json_out=json_out, title="labkit run")


class CaseName(str, enum.Enum):
    A = "A"
    B = "B"
    C = "C"
    D = "D"
    E = "E"
    LIFECYCLE = "lifecycle"
    PREFIX = "prefix"


@app.command()
def smoke(out: OutOpt = None, model: ModelOpt = None, device: DeviceOpt = "auto", attention: AttentionOpt = "auto",
          json_out: JsonOpt = False) -> None:
    """A chat-template prompt through the engine: one result, exactly 2 output tokens, kv_blocks > 0."""
    from labkit.experiments.smoke import run_smoke

    path = resolve_out(out, "setup.smoke")
    record = run_smoke(path, model=_model_arg(model), device=device, attention=attention)
    if not json_out:
        render_smoke(record)
    finish(record, path, json_out=json_out)


@app.command("quick-walk")
def quick_walk(
    case: Annotated[CaseName, typer.Option("--case", case_sensitive=False, help="Quick-walk case (docs/LAB.md §3): A, B, C or D; lifecycle (docs/LAB.md §4: 64+96 tokens) or prefix (§18: a 512-token prefix hit).")],
    trace: Annotated[bool, typer.Option("--trace", help="Store every step (before the forward, the runner's inputs, after postprocess) in the evidence (cases lifecycle and prefix always do).")] = False,
    shapes: Annotated[bool, typer.Option("--shapes", help="Cases A-D: every layer's embedding/Q/K/V shapes per step against the model's config and the rows the LM head reads; case lifecycle: layer 0's tensor shapes (forward hooks).")] = False,
    max_num_batched_tokens: MaxNumBatchedTokensOpt = 512,
    max_num_seqs: MaxNumSeqsOpt = None,
    kv_cache_block_size: KvCacheBlockSizeOpt = 256,
    num_kvcache_blocks: Annotated[Optional[int], typer.Option("--num-kvcache-blocks", metavar="N", min=1, show_default=False, help="Cases A-E: a KV pool of N blocks (default: sized from memory); a small pool makes decodes preempt (e.g. --case B --kv-cache-block-size 4 --num-kvcache-blocks 2); no checkpoint claims such a run.")] = None,
    debug: Annotated[bool, typer.Option("--debug", help="Drop into pdb after initialization (warmup excluded).")] = False,
    inputs: Annotated[bool, typer.Option("--inputs", help="Print each step's runner inputs (input_ids, positions, cu_seqlens, max_seqlen, slot_mapping, context_lens, block_tables) as tables; the steps are stored in the evidence as with --trace.")] = False,
    shuffle_blocks: Annotated[Optional[int], typer.Option("--shuffle-blocks", metavar="SEED", show_default=False, help="Hand out KV blocks in a seeded shuffled order (slot != position); no checkpoint claims such a run.")] = None,
    fused_ops: FusedOpsOpt = True,
    mixed_batches: Annotated[bool, typer.Option("--mixed-batches/--no-mixed-batches", help="Cases A-E: mixed steps (the running decodes and prefill chunks in one step) instead of nano-vllm's step model; case E shows one.")] = False,
    out: OutOpt = None, model: ModelOpt = None, device: DeviceOpt = "auto", attention: AttentionOpt = "auto",
    json_out: JsonOpt = False,
) -> None:
    """Follow cases A-D step by step (docs/LAB.md §3), or the walks lifecycle (§4) and prefix (§18); LABKIT_TRACE=1 prints one event=engine_step line per step."""
    from labkit.cli.pictures import walk_pictures
    from labkit.cli.walks import render_inputs
    from labkit.experiments.quick_walk import run_quick_walk

    if case in (CaseName.LIFECYCLE, CaseName.PREFIX):
        if num_kvcache_blocks is not None:
            raise UserError("--num-kvcache-blocks is for cases A-E")
        if mixed_batches:
            raise UserError("--mixed-batches is for cases A-E")

        from labkit.cli.walks import walk_case

        record = walk_case(case.value, out=out, model=_model_arg(model), device=device, attention=attention,
                           budget=max_num_batched_tokens, max_num_seqs=max_num_seqs, block_size=kv_cache_block_size,
                           trace=trace or inputs, debug=debug, shapes=shapes, json_out=json_out,
                           shuffle_blocks=shuffle_blocks)
        if inputs and not json_out:
            render_inputs(record)
        walk_pictures(record, json_out)
        finish(record, record["_paths"]["json"], json_out=json_out)
    record = run_quick_walk(case.value, out=out, model=_model_arg(model), device=device, attention=attention,
                            budget=max_num_batched_tokens, max_num_seqs=max_num_seqs, block_size=kv_cache_block_size,
                            trace=trace or inputs, debug=debug, shuffle_blocks=shuffle_blocks, shapes=shapes,
                            fused_ops=fused_ops, num_kvcache_blocks=num_kvcache_blocks, mixed_batches=mixed_batches)
    if not json_out:
        render_quick_walk(record)
        if inputs:
            render_inputs(record)
        if shapes:
            from labkit.cli.walks import render_walk_shapes

            render_walk_shapes(record)
    walk_pictures(record, json_out)
    finish(record, record["_paths"]["json"], json_out=json_out)


@app.command()
def generate(
    prompt: Annotated[Optional[list[str]], typer.Option("--prompt", "-p", help="Prompt text (repeat for a batch).")] = None,
    token_ids: Annotated[Optional[str], typer.Option("--token-ids", help="One prompt as comma-separated token ids.")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap each --prompt as a user message through the chat template.")] = False,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Output tokens per request at most.")] = 32,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy.")] = 0.0,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Keep going past end-of-sequence tokens.")] = False,
    seed: SeedOpt = None,
    max_model_len: MaxModelLenOpt = 1024,
    kv_cache_block_size: KvCacheBlockSizeOpt = 256,
    enforce_eager: EnforceEagerOpt = True,
    fused_ops: FusedOpsOpt = True,
    kv_cache_dtype: KvCacheDtypeOpt = "auto",
    max_consecutive_prefill: MaxConsecutivePrefillOpt = None,
    out: OutOpt = None, model: ModelOpt = None, device: DeviceOpt = "auto", attention: AttentionOpt = "auto",
    json_out: JsonOpt = False,
) -> None:
    """Offline generation through the engine (LLM.generate); outputs and evidence in runs/generate.json.

    ``--seed`` seeds each request's sampling (default: unseeded)."""
    from labkit.paths import default_out
    from labkit.experiments.generate import run_generate

    path = out or default_out("generate.json")
    record = run_generate(prompt, token_ids, chat, max_tokens, temperature, ignore_eos, seed, path,
                          _model_arg(model), device, attention, max_model_len, kv_cache_block_size, enforce_eager,
                          max_consecutive_prefill=max_consecutive_prefill, fused_ops=fused_ops,
                          kv_cache_dtype=kv_cache_dtype)
    if json_out:
        print_json(record)
    else:
        render_generate(record, path)


@app.command()
def bench(
    workload: Annotated[str, typer.Option("--workload", help="nano-vllm | graph-vs-eager | latency | attention | gemv | nano-batches | serve | step-budget.")] = "nano-vllm",
    baseline: Annotated[Optional[str], typer.Option("--baseline", help="hf: transformers generate on a fraction of the workload, same GPU, same run.")] = None,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Timed repeats (nano-vllm); rounds per batch (latency).")] = 1,
    enforce_eager: EnforceEagerOpt = False,
    profile: Annotated[bool, typer.Option("--profile", help="nano-vllm: one more, instrumented pass: time by phase and part, top GPU kernels of a decode window.")] = False,
    sweep: Annotated[bool, typer.Option("--sweep", help="attention: also time every knob setting of the Triton decode kernel; gemv: every tile setting of the batch-1 GEMV.")] = False,
    overlap: Annotated[Optional[bool], typer.Option("--overlap/--no-overlap", show_default=False, help="nano-vllm, serve: launch each decode step before reading the previous one's tokens. Default: on on CUDA, off on CPU.")] = None,
    requests: Annotated[Optional[int], typer.Option("--requests", help="serve: trace requests (default 256, issue 13's trace).")] = None,
    prompt_tokens: Annotated[Optional[int], typer.Option("--prompt-tokens", help="serve: short prompt tokens (default 512).")] = None,
    long_prompt_tokens: Annotated[Optional[int], typer.Option("--long-prompt-tokens", help="serve: long prompt tokens (default 1024).")] = None,
    long_every: Annotated[Optional[int], typer.Option("--long-every", help="serve: every Nth request is long (default 2).")] = None,
    max_tokens: Annotated[Optional[int], typer.Option("--max-tokens", help="serve: output tokens per request (default 512).")] = None,
    sampling: Annotated[str, typer.Option("--sampling", help="nano-vllm: plain (temperature only) | heavy (top_p 0.9, top_k 50, repetition_penalty 1.1 on every request).")] = "plain",
    json_schema: Annotated[Optional[Path], typer.Option("--json-schema", help="nano-vllm: every request's output under this JSON schema (xgrammar, compact JSON); e.g. workloads/bench-schema.json.")] = None,
    batch: Annotated[Optional[int], typer.Option("--batch", help="step-budget, nano-batches: sequences decoding together (default 256); latency: this batch only (default 1, 8 and 64).")] = None,
    context: Annotated[Optional[int], typer.Option("--context", help="step-budget, nano-batches: prompt tokens of each sequence (default 1024).")] = None,
    steps: Annotated[Optional[int], typer.Option("--steps", help="step-budget: decode steps timed and profiled per pass (default 20).")] = None,
    warm_steps: Annotated[Optional[int], typer.Option("--warm-steps", help="step-budget: decode steps run before each pass (default 5).")] = None,
    engine_process: Annotated[Optional[bool], typer.Option("--engine-process/--no-engine-process", show_default=False, help="serve: the server's engine in a process of its own (labkit serve --engine-process). Default: as labkit serve's (on on CUDA, off on CPU).")] = None,
    serve_modes: Annotated[Optional[str], typer.Option("--serve-modes", help="serve: served runs in this order after the one offline pass, e.g. in-process,engine-process,in-process,engine-process (A/B in one run).")] = None,
    kv_cache_dtype: KvCacheDtypeOpt = "auto",
    out: OutOpt = None, model: ModelOpt = None, device: DeviceOpt = "auto", attention: AttentionOpt = "auto",
    json_out: JsonOpt = False,
) -> None:
    """Measure throughput / latency on a fixed workload; every repeat is kept in the evidence.

    ``--workload serve`` runs one trace offline (cold, then warm) and through a `labkit serve` process
    (native and OpenAI APIs); on CPU it runs with a small trace (``--requests 8 --prompt-tokens 32 ...``).
    ``--workload step-budget`` says what each ms of a decode step at ``--batch`` x ``--context`` goes to
    (per kernel category, with bounds; on CPU with small sizes: ``--batch 4 --context 32 --steps 3``)."""
    from labkit.bench.run import run_bench
    from labkit.lab_engine import detect_device
    from labkit.paths import default_out

    trace = _bench_trace(workload, dict(requests=requests, prompt_tokens=prompt_tokens,
                                        long_prompt_tokens=long_prompt_tokens, long_every=long_every,
                                        max_tokens=max_tokens))
    if workload != "serve" and (engine_process is not None or serve_modes is not None):
        raise UserError("--engine-process and --serve-modes apply to --workload serve")
    if workload == "step-budget":
        from labkit.bench.step_budget import step_budget_command

        record = step_budget_command(out, model=_model_arg(model), device=device, attention=attention,
                                     sizes=dict(batch=batch, context=context, steps=steps, warm=warm_steps),
                                     others={"--baseline": baseline, "--profile": profile, "--sweep": sweep,
                                             "--overlap/--no-overlap": overlap, "--enforce-eager": enforce_eager,
                                             "--repeats": repeats != 1, "--sampling": sampling != "plain",
                                             "--json-schema": json_schema is not None},
                                     show=not json_out, kv_cache_dtype=kv_cache_dtype)
        finish(record, record["_paths"], json_out=json_out)
    if batch is not None and workload not in ("latency", "nano-batches"):
        raise UserError("--batch applies to --workload step-budget, latency and nano-batches")
    if context is not None and workload != "nano-batches":
        raise UserError("--context applies to --workload step-budget and nano-batches")
    if any(v is not None for v in (steps, warm_steps)):
        raise UserError("--steps and --warm-steps apply to --workload step-budget")
    if workload != "serve" and not detect_device(device).startswith("cuda"):   # minutes on a CPU, nothing to show
        raise UserError("bench is a GPU tool and this run would use the CPU (no CUDA here, or --device cpu); "
                        "try the engine on CPU with `labkit generate` instead (or `--workload serve` with a small trace)")
    path = out or default_out(f"bench-{workload}.json")
    if workload == "serve":
        if baseline or profile or sweep or enforce_eager or repeats != 1 or sampling != "plain" or json_schema \
                or kv_cache_dtype != "auto":
            raise UserError("--workload serve takes the trace options, --overlap/--no-overlap, --engine-process, "
                            "--serve-modes, --model, --device, --attention and --out only")
        record = _bench_serve(path, model=model, device=device, attention=attention, trace=trace, json_out=json_out,
                              overlap=overlap, engine_process=engine_process, serve_modes=serve_modes)
    else:
        record = run_bench(workload, path, model=_model_arg(model), device=device, attention=attention,
                           baseline=baseline, repeats=repeats, eager=enforce_eager, profile=profile, sweep=sweep,
                           overlap=overlap, sampling=sampling, json_schema=json_schema, batch=batch,
                           context=context, kv_cache_dtype=kv_cache_dtype)
    if not json_out and workload == "serve":        # a table; the whole facts are in the evidence file
        console.print(dict_table(bench_serve_rows(record["facts"]), title="bench serve (tok/s of output tokens)"))
    elif not json_out:
        render_facts_json(record)
    finish(record, path, json_out=json_out)


def _bench_trace(workload: str, trace_opts: dict):
    """The serve workload's trace with the options given (None when none is: the workload's default)."""
    if not any(v is not None for v in trace_opts.values()):
        return None
    if workload != "serve":
        raise UserError("the trace options (--requests, --prompt-tokens, ...) apply to --workload serve")
    from dataclasses import replace

    from labkit.bench.serve import ISSUE_TRACE
    return replace(ISSUE_TRACE, **{k: v for k, v in trace_opts.items() if v is not None})


def _bench_serve(path: Path, *, model: Path | None, device: str, attention: str, trace, json_out: bool,
                 overlap: bool | None, engine_process: bool | None, serve_modes: str | None) -> dict:
    """``--workload serve``: one trace offline and through the served modes (``labkit serve``'s default
    engine placement when neither ``--engine-process`` nor ``--serve-modes`` is given)."""
    from labkit.bench.serve import parse_serve_modes, run_serve_bench
    from labkit.lab_engine import detect_device

    if engine_process is not None and serve_modes is not None:
        raise UserError("give --engine-process or --serve-modes, not both")
    if engine_process is None:
        from serve.entrypoints.launch import serve_defaults

        engine_process = serve_defaults(detect_device(device))["engine_process"]
    return run_serve_bench(path, model=_model_arg(model), device=device, attention=attention, trace=trace,
                           show_progress=not json_out, overlap=overlap,
                           modes=parse_serve_modes(serve_modes, engine_process))


def _model_arg(model: Path | None) -> str | None:
    return str(model) if model is not None else None


# --------------------------------------------------------------------------- entry point


def main(argv: list[str] | None = None) -> None:
    """Console-script entry: run the app (errors are mapped by :class:`LabkitGroup`); Ctrl-C exits 130."""
    try:
        app(args=argv, prog_name="labkit")
    except KeyboardInterrupt:
        error_line("interrupted")
        sys.exit(INTERRUPTED_EXIT)
