"""``labkit report`` without ``--inputs``: print and exit on the final evidence report (labkit/writeup/report.py)."""
from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import typer


def final_report_command(out: Path | None, plots: bool, json_out: bool, pack: bool = False,
                         with_arrays: bool = False) -> NoReturn:
    """The report (exit 1 when a required item FAILs); with ``pack``, then learning-evidence.tar.gz beside it
    (labkit/writeup/pack.py), whatever the verdict."""
    from labkit.console import console, dict_table, note, print_json, rel, verdict_text
    from labkit.writeup.report import exit_code, write_final_report

    report = write_final_report(out, plots=plots)
    paths = report.pop("_paths")
    if pack:
        from labkit.paths import repo_root, runs_dir
        from labkit.writeup.pack import ARCHIVE_NAME, pack_evidence

        packed = pack_evidence(Path(paths["json"]).parent / ARCHIVE_NAME, repo_root(), runs_dir(), with_arrays)
        report["pack"] = {k: packed[k] for k in ("path", "bytes", "evidence_files", "notes_files")} | {
            "files": len(packed["files"]), "left_out": len(packed["left_out"])}
    if json_out:
        print_json(report)
        raise typer.Exit(exit_code(report))
    rows = []
    for it in report["items"]:
        ran = [f"{f['checkpoint']} {f['verdict']} ({f['kind_text']})" for f in it["findings"] if f["verdict"] != "NOT-RUN"]
        missing = [f"{f['checkpoint']} ({f['reason'].split(' (')[0].split(':')[0]})" for f in it["findings"]
                   if f["verdict"] == "NOT-RUN"]
        rows.append({"item": it["title"] + ("" if it["required"] else " (optional)"), "verdict": it["verdict"],
                     "evidence": "; ".join(ran) or "–", "not run": "; ".join(missing) or "–"})
    console.print(dict_table(rows, title="labkit report: the final evidence"))
    if report["not_run_items"]:
        note(f"NOT-RUN: {', '.join(report['not_run_items'])} (the reasons are in the report's 'Missing' section)")
    line = verdict_text(report["verdict"])
    line.append(f"  wrote {rel(paths['md'])} and {rel(paths['json'])}")
    console.print(line, soft_wrap=True)
    if pack:
        p = report["pack"]
        console.print(f"packed {p['files']} files ({p['evidence_files']} evidence JSON, {p['notes_files']} notes) into "
                      f"{rel(p['path'])}, {p['bytes'] / 1e6:.1f} MB"
                      + (f"; left out {p['left_out']} NPZ files (--with-arrays keeps them)" if p["left_out"] else ""),
                      soft_wrap=True)
        if not p["notes_files"]:
            note("no notes of yours under notes/: `labkit notes new STEP` starts one")
    raise typer.Exit(exit_code(report))
