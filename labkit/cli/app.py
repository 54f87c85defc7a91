"""The ``labkit`` command line: thin Typer shells over plain functions.

Adding a command::

    @app.command()
    def smoke(out: OutOpt = None, model: ModelOpt = None, json_out: JsonOpt = False) -> None:
        \"\"\"One line of help.\"\"\"
        from labkit.experiments.smoke import run_smoke   # import lazily: keep `labkit --help` fast
        path = resolve_out(out, "setup.smoke")
        record = run_smoke(path, model=model)
        finish(record, path, json_out=json_out)

``finish`` prints the checks table, the verdict and the evidence path (or the JSON record with
``--json``) and exits 0 on PASS/REVIEW, 1 on FAIL. Raise :class:`labkit.errors.UserError` for
anything the user can fix: ``main`` turns it into one red line and exit code 2.
"""

from __future__ import annotations

import enum
import sys
from pathlib import Path
from typing import Annotated, NoReturn, Optional

import typer

from labkit import __version__
from labkit.console import (
    checks_table,
    console,
    dict_table,
    counts_line,
    debug_enabled,
    error_line,
    kv_table,
    note,
    print_json,
    rel,
    rows_table,
    verdict_text,
)
from labkit.errors import UserError
from labkit.cli.options import AttentionOpt, DeviceOpt, JsonOpt, ModelOpt, OutOpt

app = typer.Typer(
    name="labkit",
    help="A checkpointed lab around the embedded LLM engine. Start with `labkit doctor`, then `labkit run`.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    rich_markup_mode="rich",
)

# --------------------------------------------------------------------------- shared options

#: Exit code per verdict: REVIEW asks for a human look, it is not a failure.
EXIT_CODES = {"PASS": 0, "REVIEW": 0, "NOT-RUN": 0, "FAIL": 1}
USER_ERROR_EXIT = 2


def resolve_out(out: Path | None, checkpoint_id: str) -> Path:
    """``--out`` if given, else the evidence path of ``checkpoint_id`` (under runs/)."""
    if out is not None:
        return out
    from labkit.checks import get_checkpoint

    return get_checkpoint(checkpoint_id).evidence_path()


def exit_code(verdict: str) -> int:
    return EXIT_CODES.get(verdict, 1)


def finish(record: dict, out: Path | None = None, *, json_out: bool = False) -> NoReturn:
    """Print the record's checks + verdict (+ evidence path), then exit with the verdict's code."""
    if json_out:
        print_json(record)
    else:
        if record.get("checks"):
            console.print(checks_table(record["checks"]))
        line = verdict_text(record["verdict"])
        line.append(f"  {record.get('checkpoint') or ''}", style="bold")
        if out is not None:
            line.append(f"  evidence: {rel(out)}")
        console.print(line, soft_wrap=True)
    raise typer.Exit(exit_code(record["verdict"]))


def finish_rows(rows: list[dict], *, json_out: bool = False, title: str | None = None) -> NoReturn:
    """Print checkpoint rows (id/verdict/reason/...) and exit 1 if any FAILed."""
    if json_out:
        print_json(rows)
    else:
        console.print(rows_table(rows, title=title))
        console.print(counts_line(rows))
    raise typer.Exit(1 if any(r["verdict"] == "FAIL" for r in rows) else 0)


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
        facts = record["facts"]
        imports = {k: (v["version"] if v["ok"] else f"missing ({v['error']})") + ("" if v["required"] else "  [optional]")
                   for k, v in facts["imports"].items()}
        console.print(kv_table(imports, title="packages"))
        tc = facts["tensor_check"]
        console.print(kv_table({
            "python": facts["python"]["executable"],
            "device": record["device"],
            "tensor check": f"{tc['op']} {tc['shape']} {tc['dtype']} on {tc['device']}: max abs err {tc['max_abs_err']:.2e} (tol {tc['tol']:g})",
            "runs/": f"{facts['runs_writable']['dir']} ({'writable' if facts['runs_writable']['ok'] else facts['runs_writable']['error']})",
            "evidence kind": record["kind"],
        }, title="machine"))
        if "engine" in facts:
            e = facts["engine"]
            mem = e["memory"]
            console.print(kv_table({
                "attention / dtype": f"{e['attention_backend']} / {e['dtype']}",
                "weights": mem.get("weights_bytes", "n/a (CPU budget)"),
                "peak work memory": mem.get("peak_work_bytes", "n/a (CPU budget)"),
                "KV budget": mem.get("kv_budget_bytes"),
                "bytes per block": f"{e['bytes_per_block']} ({e['mib_per_block']} MiB, {e['block_size']} tokens)",
                "blocks": f"{e['num_blocks']} ({e['tokens_in_pool']} tokens)",
            }, title="engine KV pool (docs/LAB.md §11)"))
    finish(record, path, json_out=json_out)


@app.command()
def check(
    target: Annotated[Optional[str], typer.Argument(help="A stage (setup, ...) or checkpoint id; default all.")] = None,
    write_md: Annotated[bool, typer.Option("--write-md", help="Regenerate CHECKPOINTS.md from checkpoints/*.json.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Re-judge the evidence under runs/ against the checkpoint definitions."""
    from labkit.checks import check_evidence, reason, select, write_checkpoints_md

    if write_md:
        path = write_checkpoints_md()
        console.print(f"wrote {rel(path)}")
        if target is None:
            raise typer.Exit(0)
    rows = []
    for cp in select(target):
        verdict, checks = check_evidence(cp)
        rows.append({"id": cp.id, "verdict": verdict, "reason": reason(verdict, checks),
                     "evidence": str(cp.evidence_path()), "checks": checks})
    if not json_out:
        rows = [{k: v for k, v in r.items() if k != "checks"} for r in rows]
    finish_rows(rows, json_out=json_out, title="labkit check")


@app.command()
def run(
    stage: Annotated[Optional[str], typer.Option("--stage", help="Only this stage (or checkpoint id).")] = None,
    model: ModelOpt = None,
    stop_on_fail: Annotated[bool, typer.Option("--stop-on-fail", help="Stop after the first FAIL.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Run every checkpoint this machine can run, in order; the rest are NOT-RUN with the reason."""
    from labkit.evidence import runs_dir
    from labkit.run_all import run_all

    if model is not None and not model.is_dir():
        raise UserError(f"--model {model}: not a directory")
    rows = run_all(stage=stage, model=str(model) if model else None, stop_on_fail=stop_on_fail)
    if not json_out:
        console.print(f"report: {rel(runs_dir() / 'report.md')}")
    finish_rows(rows, json_out=json_out, title="labkit run")




class CaseName(str, enum.Enum):
    A = "A"
    B = "B"
    C = "C"
    D = "D"


@app.command()
def smoke(out: OutOpt = None, model: ModelOpt = None, device: DeviceOpt = "auto", attention: AttentionOpt = "auto",
          json_out: JsonOpt = False) -> None:
    """A chat-template prompt through the engine: one result, exactly 2 output tokens, kv_blocks > 0."""
    from labkit.experiments.smoke import run_smoke

    path = resolve_out(out, "setup.smoke")
    record = run_smoke(path, model=_model_arg(model), device=device, attention=attention)
    if not json_out:
        f = record["facts"]
        console.print(kv_table({"prompt tokens": f["prompt_tokens"], "output token ids": f["output_token_ids"],
                                "text": f["text"], "kv_blocks": f["kv_blocks"],
                                "attention": record["engine"]["attention_backend"],
                                "model": record["model"]["path"]}, title="smoke"))
        if f.get("note"):
            note(f["note"])
    finish(record, path, json_out=json_out)


@app.command("quick-walk")
def quick_walk(
    case: Annotated[CaseName, typer.Option("--case", case_sensitive=False, help="Quick-walk case (docs/LAB.md §3): A, B, C or D.")],
    trace: Annotated[bool, typer.Option("--trace", help="Store every step (before the forward / after postprocess) in the evidence.")] = False,
    budget: Annotated[int, typer.Option("--budget", min=1, help="Prefill token budget (max_num_batched_tokens).")] = 512,
    max_num_seqs: Annotated[Optional[int], typer.Option("--max-num-seqs", min=1, help="Sequences per step.")] = None,
    block_size: Annotated[int, typer.Option("--block-size", min=1, help="KV block size (a power of two).")] = 256,
    debug: Annotated[bool, typer.Option("--debug", help="Drop into pdb after initialization (warmup excluded).")] = False,
    out: OutOpt = None, model: ModelOpt = None, device: DeviceOpt = "auto", attention: AttentionOpt = "auto",
    json_out: JsonOpt = False,
) -> None:
    """Follow cases A-D step by step (docs/LAB.md §3); LABKIT_TRACE=1 prints one event=engine_step line per step."""
    from labkit.experiments.quick_walk import default_out_for, run_quick_walk

    out = out or default_out_for(case.value, budget, max_num_seqs, block_size)
    record = run_quick_walk(case.value, out=out, model=_model_arg(model), device=device, attention=attention,
                            budget=budget, max_num_seqs=max_num_seqs, block_size=block_size, trace=trace, debug=debug)
    if not json_out:
        f = record["facts"]
        rows = [{"step": d["step"], "phase": d["phase"],
                 "before (label total/cached/scheduled blocks)": "  ".join(f"{b[0]} {b[1]}/{b[2]}/{b[3]} [{b[4]}]" for b in d["before"]),
                 "after (label total/cached blocks)": "  ".join(f"{a[0]} {a[1]}/{a[2]} [{a[3]}]" for a in d["after"]),
                 "finished": ",".join(d["finished"])} for d in f["step_digest"]]
        console.print(dict_table(rows, title=f"quick-walk {f['case']}: {f['title']}"))
        console.print(f"steps={f['num_steps']} output_counts={f['output_counts']}")
        if record["checkpoint"] is None:
            note("no checkpoint states the expectations for these options: facts recorded, nothing asserted")
        if f.get("note"):
            note(f["note"])
    finish(record, out, json_out=json_out)


@app.command()
def generate(
    prompt: Annotated[Optional[list[str]], typer.Option("--prompt", "-p", help="Prompt text (repeat for a batch).")] = None,
    token_ids: Annotated[Optional[str], typer.Option("--token-ids", help="One prompt as comma-separated token ids.")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap each --prompt as a user message through the chat template.")] = False,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Output tokens per request at most.")] = 32,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy.")] = 0.0,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Keep going past end-of-sequence tokens.")] = False,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Per-request sampling seed.")] = None,
    max_model_len: Annotated[int, typer.Option("--max-model-len", help="Context length (prompt + output).")] = 1024,
    block_size: Annotated[int, typer.Option("--block-size", help="KV block size (a power of two).")] = 256,
    eager: Annotated[bool, typer.Option("--eager/--graph", help="Eager, or CUDA graphs for decode (CUDA only).")] = True,
    out: OutOpt = None, model: ModelOpt = None, device: DeviceOpt = "auto", attention: AttentionOpt = "auto",
    json_out: JsonOpt = False,
) -> None:
    """Offline generation through the engine (LLM.generate); outputs and evidence in runs/generate.json."""
    from labkit.evidence import default_out
    from labkit.experiments.generate import run_generate

    path = out or default_out("generate.json")
    record = run_generate(prompt, token_ids, chat, max_tokens, temperature, ignore_eos, seed, path,
                          _model_arg(model), device, attention, max_model_len, block_size, eager)
    if json_out:
        print_json(record)
        raise typer.Exit(0)
    for r in record["facts"]["requests"]:
        console.print(kv_table({"prompt tokens": r["prompt_tokens"], "output token ids": r["output_token_ids"],
                                "text": r["text"], "finish": r["finish_reason"]}, title="output"))
    if record["facts"].get("note"):
        note(record["facts"]["note"])
    console.print(f"evidence: {rel(path)}")


@app.command()
def bench(
    workload: Annotated[str, typer.Option("--workload", help="nano-vllm | graph-vs-eager | latency | attention.")] = "nano-vllm",
    baseline: Annotated[Optional[str], typer.Option("--baseline", help="hf: transformers generate on a fraction of the workload, same GPU, same run.")] = None,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Timed repeats (nano-vllm workload).")] = 1,
    eager: Annotated[bool, typer.Option("--eager", help="No CUDA graphs (nano-vllm workload).")] = False,
    profile: Annotated[bool, typer.Option("--profile", help="nano-vllm: one more, instrumented pass: time by phase and part, top GPU kernels of a decode window.")] = False,
    sweep: Annotated[bool, typer.Option("--sweep", help="attention: also time every knob setting of the Triton decode kernel.")] = False,
    overlap: Annotated[bool, typer.Option("--overlap", help="nano-vllm: launch each decode step before reading the previous one's tokens.")] = False,
    out: OutOpt = None, model: ModelOpt = None, device: DeviceOpt = "auto", attention: AttentionOpt = "auto",
    json_out: JsonOpt = False,
) -> None:
    """Measure throughput / latency on a fixed workload; every repeat is kept in the evidence."""
    from labkit.bench.run import run_bench
    from labkit.evidence import default_out

    path = out or default_out(f"bench-{workload}.json")
    record = run_bench(workload, path, model=_model_arg(model), device=device, attention=attention,
                       baseline=baseline, repeats=repeats, eager=eager, profile=profile, sweep=sweep,
                       overlap=overlap)
    if not json_out:
        console.print_json(data={k: v for k, v in record["facts"].items()})
    finish(record, path, json_out=json_out)


def _model_arg(model: Path | None) -> str | None:
    return str(model) if model is not None else None


# --------------------------------------------------------------------------- entry point


def _user_error_types() -> tuple[type[BaseException], ...]:
    return (UserError, FileNotFoundError, NotADirectoryError, IsADirectoryError, ValueError)


def _message(e: BaseException) -> str:
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        return f"{e.strerror}: {e.filename}"
    return str(e) or type(e).__name__


def main(argv: list[str] | None = None) -> None:
    """Console-script entry: run the app; user errors end in one red line and exit code 2."""
    try:
        app(args=argv, prog_name="labkit")
    except KeyboardInterrupt:
        error_line("interrupted")
        sys.exit(130)
    except Exception as e:
        if not isinstance(e, _user_error_types()) or (debug_enabled() and not isinstance(e, UserError)):
            raise
        error_line(_message(e))
        sys.exit(USER_ERROR_EXIT)


if __name__ == "__main__":
    main()
