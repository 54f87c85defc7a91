"""Shared rich output: verdict colours, check tables, result tables, JSON and error lines.

Human output goes to stdout through :data:`console`; progress and errors go to stderr through
:data:`err_console`, so ``--json`` output on stdout stays machine-readable.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Iterable

from rich.console import Console
from rich.table import Table
from rich.text import Text

from labkit.evidence import dumps

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)

VERDICT_STYLE = {"PASS": "bold green", "FAIL": "bold red", "REVIEW": "bold yellow", "NOT-RUN": "dim"}
STATUS_STYLE = {"pass": "green", "fail": "red", "review": "yellow", "not-run": "dim"}


def verdict_text(verdict: str) -> Text:
    return Text(verdict, style=VERDICT_STYLE.get(verdict, "bold"))


def short(value: Any, limit: int = 80) -> str:
    """Compact one-line rendering of a JSON-able value."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def rel(path: str | Path | None) -> str:
    """``path`` relative to the working directory when it lies below it."""
    if path is None:
        return ""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


def checks_table(checks: Iterable[dict], title: str | None = None) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("check", overflow="fold")
    table.add_column("status")
    table.add_column("expected", overflow="fold")
    table.add_column("actual", overflow="fold")
    table.add_column("why", overflow="fold")
    for c in checks:
        status = c.get("status") or ("pass" if c.get("passed") else "fail")
        table.add_row(
            str(c.get("name", "")),
            Text(status, style=STATUS_STYLE.get(status, "")),
            short(c.get("expected")),
            short(c.get("actual")),
            str(c.get("why") or ""),
        )
    return table


def rows_table(rows: Iterable[dict], title: str | None = None) -> Table:
    """Table of checkpoint rows: id, verdict, reason, seconds (if present), evidence."""
    rows = list(rows)
    timed = any("seconds" in r for r in rows)
    table = Table(title=title, title_justify="left")
    table.add_column("checkpoint", no_wrap=True)
    table.add_column("verdict")
    table.add_column("reason", overflow="fold")
    if timed:
        table.add_column("s", justify="right")
    table.add_column("evidence", overflow="fold")
    for r in rows:
        cells: list[Any] = [r["id"], verdict_text(r["verdict"]), r.get("reason") or ""]
        if timed:
            s = r.get("seconds")
            cells.append("" if s is None else f"{s:.1f}")
        cells.append(rel(r.get("evidence")))
        table.add_row(*cells)
    return table


def dict_table(rows: list[dict], title: str | None = None) -> Table:
    """A plain table whose columns are the keys of the first row."""
    table = Table(title=title, show_lines=False)
    columns = list(rows[0]) if rows else []
    for col in columns:
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(*[str(r.get(c, "")) for c in columns])
    return table


def kv_table(data: dict, title: str | None = None) -> Table:
    table = Table(title=title, title_justify="left", show_header=False)
    table.add_column("key", style="bold")
    table.add_column("value", overflow="fold")
    for k, v in data.items():
        table.add_row(str(k), short(v, 120))
    return table


def counts_line(rows: Iterable[dict]) -> Text:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    text = Text()
    for i, v in enumerate(("PASS", "FAIL", "REVIEW", "NOT-RUN")):
        if i:
            text.append("  ")
        text.append(f"{v} {counts.get(v, 0)}", style=VERDICT_STYLE[v] if counts.get(v) else "dim")
    return text


def print_json(data: Any) -> None:
    """Plain JSON on stdout (no rich markup or wrapping)."""
    sys.stdout.write(dumps(data) + "\n")
    sys.stdout.flush()


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def error_line(message: str) -> None:
    """One red line on stderr, never wrapped."""
    err_console.print(Text("error: ", style="bold red") + Text(one_line(message), style="red"), soft_wrap=True)


def note(message: str, style: str = "yellow") -> None:
    """A one-line remark on stderr (e.g. 'synthetic weights')."""
    err_console.print(Text(one_line(message), style=style), soft_wrap=True)


def debug_enabled() -> bool:
    return os.environ.get("LABKIT_DEBUG", "") not in ("", "0")
