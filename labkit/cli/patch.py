"""``labkit patch``: the exercise patches under patches/ (list, show, apply, revert, status, check).

Each patch restores one upstream behaviour (the "before") on the working tree with ``git apply``;
``revert`` brings the lab's version back (the "after"). ``check`` runs both sides on copies of
``engine/`` and writes the evidence its checkpoint judges. See docs/LAB.md, "Patches: before and after".
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from labkit.cli.options import JsonOpt, ModelOpt, OutOpt

patch_app = typer.Typer(help="Exercise patches that restore upstream behaviour (the 'before'); docs/LAB.md#patches-before-and-after.",
                        no_args_is_help=True)

NameArg = Annotated[str, typer.Argument(help="Patch name (no-graph-fallback), file (02-no-graph-fallback.patch) or number (02).")]


def _rows(rows: list[dict], title: str) -> None:
    from labkit.console import console, dict_table

    console.print(dict_table([{"patch": r["name"], "state": r["state"], "files": ", ".join(r["files"]),
                               "checkpoint": r["checkpoint"]} for r in rows], title=title))


@patch_app.command("list")
def list_(json_out: JsonOpt = False) -> None:
    """Every shipped patch: what it restores and which checkpoint judges the pair."""
    from labkit.console import console, dict_table, print_json
    from labkit.patches.store import load_patches

    patches = [p.to_dict() for p in load_patches()]
    if json_out:
        print_json(patches)
        return
    console.print(dict_table([{"patch": p["name"], "file": f"patches/{p['file']}", "restores": p["title"],
                               "checkpoint": p["checkpoint"]} for p in patches], title="labkit patch list"))


@patch_app.command()
def show(name: NameArg) -> None:
    """Print a patch's README and its diff."""
    from labkit.console import console
    from labkit.patches.store import find

    p = find(name)
    if p.readme().is_file():
        console.print(p.readme().read_text(encoding="utf-8"), markup=False, highlight=False)
    console.print(p.text(), markup=False, highlight=False, soft_wrap=True)


@patch_app.command()
def apply(name: NameArg, json_out: JsonOpt = False) -> None:
    """Apply a patch to engine/ (all or nothing; refuses on unexplained engine changes)."""
    from labkit.console import console, print_json
    from labkit.patches.store import apply as do_apply

    row = do_apply(name)
    if json_out:
        print_json(row)
        return
    console.print(f"applied {row['name']} ({', '.join(row['files'])}); before/after: labkit patch check {row['name']}; "
                  f"undo: labkit patch revert {row['name']}", soft_wrap=True)


@patch_app.command()
def revert(name: NameArg, json_out: JsonOpt = False) -> None:
    """Reverse an applied patch (all or nothing)."""
    from labkit.console import console, print_json
    from labkit.patches.store import revert as do_revert

    row = do_revert(name)
    if json_out:
        print_json(row)
        return
    console.print(f"reverted {row['name']} ({', '.join(row['files'])})", soft_wrap=True)


@patch_app.command()
def status(json_out: JsonOpt = False) -> None:
    """Which patches are applied to the engine Python imports, and any engine change no patch explains."""
    from labkit.console import console, print_json
    from labkit.patches.store import status as do_status

    st = do_status()
    if json_out:
        print_json(st)
        return
    _rows(st["patches"], f"labkit patch status ({st['engine']})")
    if st["unexplained_changes"]:
        console.print(f"engine changes no patch explains: {', '.join(st['unexplained_changes'])}", soft_wrap=True)


@patch_app.command()
def check(name: NameArg, out: OutOpt = None, model: ModelOpt = None, json_out: JsonOpt = False) -> None:
    """Run a patch's before/after experiment on copies of engine/ and judge the pair."""
    from labkit.cli.app import finish
    from labkit.console import console, kv_table
    from labkit.experiments.patch_check import run_patch_check
    from labkit.patches.store import find

    p = find(name)
    if model is not None and not Path(model).is_dir():
        from labkit.errors import UserError

        raise UserError(f"--model {model}: not a directory")
    from labkit.checks import get_checkpoint

    path = out or get_checkpoint(p.checkpoint).evidence_path()
    record = run_patch_check(p.name, path, model=str(model) if model else None)
    if not json_out:
        f = record["facts"]
        console.print(kv_table({"patch": f"patches/{f['file']}", "restores": f["restores"],
                                "working tree": f["live_state"],
                                "before engine": f["before"].get("engine_source_hash") or f["before"].get("error"),
                                "after engine": f["after"].get("engine_source_hash") or f["after"].get("error")},
                               title=f"labkit patch check {p.name}"))
    finish(record, path, json_out=json_out)


def register(app: typer.Typer) -> None:
    app.add_typer(patch_app, name="patch")

