"""``labkit report`` without ``--inputs``: print and exit on the final evidence report (labkit/writeup/report.py)."""
from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import typer


def final_report_command(out: Path | None, plots: bool, json_out: bool) -> NoReturn:
    from labkit.console import console, dict_table, note, print_json, rel, verdict_text
    from labkit.writeup.report import exit_code, write_final_report

    report = write_final_report(out, plots=plots)
    paths = report.pop("_paths")
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
    raise typer.Exit(exit_code(report))
