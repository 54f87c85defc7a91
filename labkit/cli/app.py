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
interrupted            130   Ctrl-C: one ``interrupted`` line naming the command, its evidence not written
                             and the files it left under runs/
broken pipe            141   stdout's reader went away (``labkit ... | head``): no line
=====================  ====  ==========================================================================

Errors are mapped by type, never by message text, in the root group (:class:`LabkitGroup`), so
``main`` and ``typer.testing.CliRunner`` see the same codes.
"""

from __future__ import annotations

import bdb
import enum
import sys
import time
from pathlib import Path
from typing import Annotated, NoReturn, Optional

import typer
from typer.core import TyperGroup
from typer.exceptions import TyperException

from labkit import __version__
from labkit.cli.help_format import install as _help_format
from labkit.cli.options import (
    DEFAULTS,
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
    ModelOpt,
    OutOpt,
    SeedOpt,
    engine_flag,
)
from labkit.console import (
    console,
    dict_table,
    debug_enabled,
    err_console,
    error_line,
    internal_error_line,
    print_json,
    rel,
    render_record,
    render_rows,
)
from labkit.console.setup import (
    bench_serve_rows,
    render_doctor,
    render_facts_json,
    render_generate,
    render_quick_walk,
    render_smoke,
)
from labkit.errors import UserError

#: Exit code per verdict: REVIEW asks for a human look, it is not a failure.
EXIT_CODES = {"PASS": 0, "REVIEW": 0, "NOT-RUN": 0, "FAIL": 1}
USER_ERROR_EXIT = 2
INTERNAL_ERROR_EXIT = 70
INTERRUPTED_EXIT = 130
BROKEN_PIPE_EXIT = 141


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


#: engine field names whose flag is not the field spelled with dashes (``--kv-cache-block-size``: vLLM's name)
FIELD_FLAGS = {"kvcache_block_size": "--kv-cache-block-size", "attention backend": "--attention",
               "attention_backend": "--attention"}


def as_flags(message: str, flags: set[str]) -> str:
    """An engine or sampling error names its config field (``max_model_len must be a positive integer``); the user
    typed a flag. Each field the command has as a flag is named by that flag (``--max-model-len must be ...``): an
    identifier with underscores anywhere, a plain word (``temperature``) only where it opens the message."""
    import re

    def flag(field: str) -> str | None:
        name = FIELD_FLAGS.get(field) or "--" + field.replace("_", "-")
        return name if name in flags else None

    for field in FIELD_FLAGS:
        if " " in field and message.startswith(field + " ") and flag(field):
            message = flag(field) + message[len(field):]
    message = re.sub(r"(?<![-\w.])[a-z][a-z0-9]*(?:_[a-z0-9]+)+(?![\w-])", lambda m: flag(m.group(0)) or m.group(0),
                     message)
    first = re.match(r"[a-z][a-z0-9]*(?= )", message)
    if first and flag(first.group(0)):
        message = flag(first.group(0)) + message[first.end():]
    return message


def invoked_command(ctx: typer.Context | None) -> tuple[list[str], object | None]:
    """The names (``["model", "synth"]``) and the command a root context ran, from its argv."""
    if ctx is None:
        return [], None
    cmd, names = ctx.command, []
    for arg in ctx.meta.get("labkit_argv", []):
        if not hasattr(cmd, "get_command"):        # a command, not a group (typer carries its own click)
            break
        if arg.startswith("-"):
            continue
        sub = cmd.get_command(ctx, arg)
        if sub is None:
            break
        cmd, names = sub, [*names, arg]
    return names, cmd


def command_flags(ctx: typer.Context | None) -> set[str]:
    """The option names of the command a root context ran (``labkit model synth``: synth's)."""
    cmd = invoked_command(ctx)[1]
    return {o for p in getattr(cmd, "params", []) for o in (*p.opts, *getattr(p, "secondary_opts", []))}


def end_with_error(e: Exception, ctx: typer.Context | None = None) -> NoReturn:
    """A user error: one red line, exit 2. Anything else is a bug: one line and exit 70, or the
    traceback when LABKIT_DEBUG is set (then a non-UserError user error shows its traceback too).
    ``ctx`` (the root context): a field named in the message is named by the command's flag."""
    if debug_enabled() and not isinstance(e, UserError):
        raise e
    if is_user_error(e):
        error_line(as_flags(_message(e), command_flags(ctx)))
        raise typer.Exit(USER_ERROR_EXIT)
    internal_error_line(f"{type(e).__name__}: {_message(e)}")
    raise typer.Exit(INTERNAL_ERROR_EXIT)


#: commands that are silent for seconds before their first output (imports, a model written or loaded, an
#: engine built): a status line on stderr (a terminal) once their options are parsed (not with --json or --help)
STARTING = {
    ("smoke",): "loading the model and building the engine",
    ("quick-walk",): "loading the model and building the engine",
    ("model", "synth"): "writing the model's weights and tokenizer",
    ("simulate",): "building the engine and starting the worker, its HTTP server and the client",
}


def _status_wanted() -> bool:
    """A status line is for a person watching: stderr a terminal (a script reading stderr gets its lines only)."""
    return err_console.is_terminal


def _announce_start(ctx: typer.Context) -> None:
    """Wrap the command a root context is about to run so that it prints its STARTING line first."""
    names, cmd = invoked_command(ctx)
    what = STARTING.get(tuple(names))
    if not what or cmd is None or getattr(cmd, "_labkit_announced", False):
        return
    run = cmd.invoke

    def invoke(sub_ctx, run=run):
        if _status_wanted() and not sub_ctx.params.get("json_out"):
            err_console.print(f"labkit {' '.join(names)}: {what} (seconds on a CPU) ...", style="dim",
                              markup=False, highlight=False, soft_wrap=True)
        return run(sub_ctx)

    cmd.invoke = invoke
    cmd._labkit_announced = True


#: evidence files the running command means to write (resolve_out), named when it is interrupted
PENDING_OUT: list[Path] = []


def interrupted_line(ctx: typer.Context | None) -> None:
    """Ctrl-C in a command: one line naming the command, its evidence that was not written, and the files it
    wrote under runs/ (or beside --out) before it stopped, which stay."""
    from labkit.paths import runs_dir

    words = invoked_command(ctx)[0]
    since = (ctx.meta.get("labkit_start") if ctx else None) or time.time()
    roots = {runs_dir(), *(p.parent for p in PENDING_OUT)}
    left: list[Path] = []
    for root in roots:
        if root.is_dir():
            for i, f in enumerate(root.rglob("*")):
                if i > 20000:
                    break
                try:
                    if f.is_file() and f.stat().st_mtime >= since - 1:
                        left.append(f)
                except OSError:
                    continue
    left = sorted(set(left))
    parts = [f"interrupted (Ctrl-C): labkit {' '.join(words)} stopped".rstrip()]
    unwritten = [p for p in PENDING_OUT if p not in left]
    if unwritten:
        parts.append(", ".join(rel(p) for p in unwritten) + " not written"
                     + (" (the earlier file stays)" if any(p.exists() for p in unwritten) else ""))
    if left:
        more = f" and {len(left) - 3} more" if len(left) > 3 else ""
        parts.append("left behind: " + ", ".join(rel(p) for p in left[:3]) + more)
    else:
        parts.append("nothing else written")
    error_line("; ".join(parts))


class LabkitGroup(TyperGroup):
    """The root group: every command's exception ends here and is mapped by :func:`end_with_error`."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        ctx.meta["labkit_argv"] = list(args)        # which command ran: command_flags, for the error line
        ctx.meta["labkit_start"] = time.time()      # what an interrupted command left: interrupted_line
        return super().parse_args(ctx, args)

    def invoke(self, ctx: typer.Context):
        try:
            _announce_start(ctx)
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort, TyperException):   # exits and usage errors: Typer's own
            raise
        except BrokenPipeError:         # `labkit ... | head`: the reader left; nothing to say, nowhere to say it
            import os

            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())    # no second error at exit's flush
            except (OSError, ValueError):       # stdout is no file (a test's capture)
                pass
            raise typer.Exit(BROKEN_PIPE_EXIT) from None
        except KeyboardInterrupt:       # Typer would exit 130 without a word
            interrupted_line(ctx)
            raise typer.Exit(INTERRUPTED_EXIT) from None
        except bdb.BdbQuit:             # `q` at a --debug prompt: the learner stopped on purpose
            sys.stderr.write("debug: quit (the walk stopped; no evidence written)\n")
            raise typer.Exit(0) from None
        except Exception as e:  # noqa: BLE001 - mapped by type in end_with_error
            end_with_error(e, ctx)


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
        path = patched_out(out)
    else:
        from labkit.checks import get_checkpoint

        path = patched_out(get_checkpoint(checkpoint_id).evidence_path())
    PENDING_OUT.append(Path(path).resolve())
    return path


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

    if model is not None:
        _refuse_unusable_model(model)       # once, here: not again in every checkpoint's command
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


def _refuse_unusable_model(model: Path) -> None:
    """``labkit run --model M``: M resolved (a directory, a fetched name, a hub id in the cache) and validated as
    the checkpoints' commands will, and its weight files' headers read, so that a bad model is one error line
    before the first checkpoint rather than the same failure in each of them."""
    from safetensors import SafetensorError, safe_open

    from labkit.assets.resolve import resolve_model

    ref = resolve_model(str(model), "cpu")
    for file in sorted(ref.path.glob("*.safetensors")):
        try:
            safe_open(str(file), "pt", "cpu")
        except SafetensorError as e:
            raise UserError(f"--model {model}: {file.name} is not a complete safetensors file ({e}); "
                            "download or write it again") from None


def _spell_out_defaults(ctx: typer.Context, names: tuple[str, ...], trace: bool = False) -> None:
    """The command line the evidence records (sys.argv) with the options ``names`` that were left at their
    defaults written out with those values, and ``--trace`` where another flag implies it (``--inputs`` stores
    the steps as ``--trace`` does): ``quick-walk --case D --trace`` ran the checkpoint's command (``--case D
    --max-num-batched-tokens 512 --trace``, 512 being the default) and is judged as it, not left to REVIEW."""
    extra: list[str] = []
    for p in ctx.command.params:
        source = ctx.get_parameter_source(p.name)
        if p.name in names and getattr(source, "name", "") == "DEFAULT" and ctx.params.get(p.name) is not None:
            extra += [p.opts[0], str(ctx.params[p.name])]
    if trace:
        extra.append("--trace")
    if extra and sys.argv and sys.argv[1:2] == ["quick-walk"]:
        sys.argv = [*sys.argv, *extra]


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
    ctx: typer.Context,
    case: Annotated[CaseName, typer.Option("--case", case_sensitive=False, help="Quick-walk case (docs/LAB.md §3): A, B, C or D; lifecycle (docs/LAB.md §4: 64+96 tokens) or prefix (§18: a 512-token prefix hit).")],
    trace: Annotated[bool, typer.Option("--trace", help="Store every step (before the forward, the runner's inputs, after postprocess) in the evidence (cases lifecycle and prefix always do).")] = False,
    shapes: Annotated[bool, typer.Option("--shapes", help="Cases A-D: every layer's embedding/Q/K/V shapes per step against the model's config and the rows the LM head reads; case lifecycle: layer 0's tensor shapes (forward hooks).")] = False,
    max_num_batched_tokens: MaxNumBatchedTokensOpt = DEFAULTS.max_num_batched_tokens,
    max_num_seqs: engine_flag("max_num_seqs", f"Default: {DEFAULTS.max_num_seqs}.", show_default=False) = None,
    kv_cache_block_size: KvCacheBlockSizeOpt = DEFAULTS.kvcache_block_size,
    num_kvcache_blocks: engine_flag("num_kvcache_blocks", "Cases A-E; a small pool makes decodes preempt (e.g. --case B --kv-cache-block-size 4 --num-kvcache-blocks 2); no checkpoint claims such a run.", metavar="N", show_default=False) = None,
    debug: Annotated[bool, typer.Option("--debug", help="Drop into pdb after initialization (warmup excluded).")] = False,
    inputs: Annotated[bool, typer.Option("--inputs", help="Print each step's runner inputs (input_ids, positions, cu_seqlens, max_seqlen, slot_mapping, context_lens, block_tables) as tables; the steps are stored in the evidence as with --trace.")] = False,
    shuffle_blocks: Annotated[Optional[int], typer.Option("--shuffle-blocks", metavar="SEED", show_default=False, help="Hand out KV blocks in a seeded shuffled order (slot != position); no checkpoint claims such a run.")] = None,
    fused_ops: FusedOpsOpt = True,
    mixed_batches: engine_flag("mixed_batches", "Cases A-E; case E shows one.") = False,
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
    _spell_out_defaults(ctx, ("max_num_batched_tokens", "kv_cache_block_size"), trace=inputs and not trace)
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
    prompts: Annotated[Optional[list[str]], typer.Argument(metavar="[PROMPT]...", show_default=False,
                                                            help="Prompt text, as many as you like (the same as --prompt).")] = None,
    prompt: Annotated[Optional[list[str]], typer.Option("--prompt", "-p", help="Prompt text (repeat for a batch).")] = None,
    token_ids: Annotated[Optional[str], typer.Option("--token-ids", help="One prompt as comma-separated token ids.")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap each --prompt as a user message through the chat template.")] = False,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Output tokens per request at most.")] = 32,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy.")] = 0.0,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Keep going past end-of-sequence tokens.")] = False,
    seed: SeedOpt = None,
    max_model_len: MaxModelLenOpt = DEFAULTS.max_model_len,
    kv_cache_block_size: KvCacheBlockSizeOpt = DEFAULTS.kvcache_block_size,
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
    prompt = [*(prompts or []), *(prompt or [])] or None
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
    overlap: engine_flag("overlap", "Workloads nano-vllm and serve. Default: on on CUDA, off on CPU.", show_default=False) = None,
    requests: Annotated[Optional[int], typer.Option("--requests", help="serve: trace requests (default 256).")] = None,
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
    from labkit.bench.run import WORKLOADS, run_bench
    from labkit.lab_engine import detect_device
    from labkit.paths import default_out

    if workload not in (*WORKLOADS, "serve", "step-budget"):      # before the device is looked at
        raise UserError(f"--workload {workload}: no such workload; one of "
                        f"{', '.join((*WORKLOADS, 'serve', 'step-budget'))}")
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


#: set by a command that has shut down in order (``serve``): :func:`main` ends the process without the
#: interpreter's teardown (:func:`serve.process_exit.end_without_teardown`)
_END_WITHOUT_TEARDOWN = False


def skip_teardown() -> None:
    """Ask :func:`main` to end the process without the interpreter's teardown once the command returns."""
    global _END_WITHOUT_TEARDOWN
    _END_WITHOUT_TEARDOWN = True


def main(argv: list[str] | None = None) -> None:
    """Console-script entry: run the app (errors are mapped by :class:`LabkitGroup`); Ctrl-C exits 130."""
    try:
        app(args=argv, prog_name="labkit")
    except KeyboardInterrupt:
        error_line("interrupted")
        sys.exit(INTERRUPTED_EXIT)
    except SystemExit as e:
        if not _END_WITHOUT_TEARDOWN:
            raise
        from serve.process_exit import end_without_teardown

        end_without_teardown(e.code if isinstance(e.code, int) else 0 if e.code is None else 1)
