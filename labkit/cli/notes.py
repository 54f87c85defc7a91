"""``labkit notes``: one template per lab step, copied into notes/ with the step's evidence filled in."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from labkit.cli.options import JsonOpt

notes_app = typer.Typer(help="Notes templates per lab step, pre-filled from runs/ (docs/LAB.md lists the steps).",
                        no_args_is_help=True)


@notes_app.command("list")
def list_(json_out: JsonOpt = False) -> None:
    """Every step with a template, the checkpoints that feed it, and whether you have notes for it."""
    from labkit.console import console, dict_table, print_json
    from labkit.writeup.notes import list_steps

    rows = list_steps()
    if json_out:
        print_json(rows)
        return
    console.print(dict_table([{"step": r["step"], "title": r["title"], "your notes": "yes" if r["note"] else "–"}
                              for r in rows], title="labkit notes list"))


@notes_app.command()
def new(
    step: Annotated[str, typer.Argument(help="A step from `labkit notes list` (quick-walk, engine-logits, ...).")],
    force: Annotated[bool, typer.Option("--force", help="Overwrite notes/STEP.md if it exists.")] = False,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", dir_okay=False, help="Write here instead of notes/STEP.md.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Copy the step's template into notes/STEP.md with its evidence (verdicts, numbers, paths) filled in."""
    from labkit.console import console, note, print_json, rel
    from labkit.writeup.notes import new_note

    res = new_note(step, force=force, out=out)
    if json_out:
        print_json(res)
        return
    filled = sum(1 for f in res["facts"] if "missing" not in f)
    console.print(f"wrote {rel(res['path'])}: {res['title']} ({filled} of {len(res['facts'])} facts from the evidence)",
                  soft_wrap=True)
    missing = [c["checkpoint"] for c in res["checkpoints"] if c["verdict"] == "NOT-RUN"]
    if missing:
        note(f"no evidence yet for {', '.join(missing)}: run them, then `labkit notes new {res['step']} --force`")


def register(app: typer.Typer) -> None:
    app.add_typer(notes_app, name="notes")
