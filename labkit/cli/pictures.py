"""``labkit picture EVIDENCE.json``: redraw a walk's pictures and explorer page from its evidence, and
:func:`walk_pictures`, which the walk commands call right after writing their evidence.

The drawing itself is labkit/pictures/ (plain functions); this is the thin shell: paths in, paths out.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from labkit.cli.options import JsonOpt
from labkit.console import console, err_console, note, print_json, rel


def walk_pictures(record: dict, json_out: bool = False) -> list[Path]:
    """After a walk: draw its pictures and explorer next to the evidence and print their paths (on stderr
    with --json, so stdout stays one JSON document). Evidence without a step log gets a note instead."""
    from labkit.pictures import draw_all

    facts = record.get("facts") or {}
    if not facts.get("steps") and not facts.get("hash_chain"):
        if not json_out:
            note("no pictures: the step log (facts.steps) is kept with --trace; "
                 "`labkit picture EVIDENCE.json` draws them from such evidence")
        return []
    written = draw_all(record["_paths"]["json"])
    line = "pictures: " + ", ".join(rel(p) for p in written)
    (err_console if json_out else console).print(line, soft_wrap=True)
    return written


def picture(
    evidence: Annotated[Path, typer.Argument(help="A walk's evidence file (runs/quick-walk-a.json, runs/lifecycle.json, ...).")],
    step: Annotated[Optional[int], typer.Option("--step", metavar="N", show_default=False, help="Only the slot picture of step N (<stem>.step-N.slots.png); without it the slot picture shows a chosen step (a batch of several, a prefix hit, or a decode that takes a new block).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Redraw a walk's pictures (steps, KV pool, slots, attention branches, hash chain) and its HTML explorer from its evidence file."""
    from labkit.pictures import draw_all, draw_step

    written = [draw_step(evidence, step)] if step is not None else draw_all(evidence)
    if json_out:
        print_json({"evidence": str(evidence), "written": [str(p) for p in written]})
        return
    for p in written:
        console.print(f"wrote {rel(p)}", soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command("picture")(picture)
