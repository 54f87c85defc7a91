"""Shared rich output: verdict colours, check tables, result tables, JSON and error lines; the renderers of
command records by what they render in :mod:`labkit.console.setup` (doctor, smoke, walks, generate),
:mod:`labkit.console.guardrails` (the logits guards) and :mod:`labkit.console.serving` (serve, load, report).

Human output goes to stdout through :data:`console`; progress and errors go to stderr through
:data:`err_console`, so ``--json`` output on stdout stays machine-readable.

Both consoles print strings literally: no rich markup (``[/]``, ``[the docs](url)`` and ``[optional]``
are text, never tags), no ``:emoji:`` codes, no highlighting. Model output, paths and user input go
through them unchanged; styling is done with :class:`rich.text.Text` objects, never with markup.
"""

from __future__ import annotations

import io
import json
import os
import sys
import textwrap
from pathlib import Path
from typing import Any, Iterable

from rich.console import Console
from rich.table import Table
from rich.text import Text

from labkit.evidence import dumps

PLAIN_WIDTH = 80


def _cell_text(cell: Any) -> str:
    """A table cell as plain text (a Text's characters, a str as is, any other renderable as rich draws it)."""
    if cell is None:
        return ""
    if isinstance(cell, Text):
        return cell.plain
    if isinstance(cell, str):
        return cell
    out = Console(width=PLAIN_WIDTH, highlight=False, markup=False, emoji=False, color_system=None,
                  file=io.StringIO())
    out.print(cell)
    return out.file.getvalue().rstrip("\n")


def plain_table(table: Table, width: int = PLAIN_WIDTH) -> list[str]:
    """``table`` as lines that read in a file or a CI log at ``width`` columns, where rich would fold every cell
    into slices of its share of 80 columns (``runs/pat`` / ``ches/no-`` / ...).

    The leading columns that fit side by side within ``width`` (short ones: ids, verdicts, numbers) make one
    aligned line per row, under a header line; every other column follows on lines of its own, ``  header:
    value``, prose wrapped at word boundaries and a path or id never cut. A table without a header whose cells
    are keys and values reads ``key  value``, one per line."""
    cols = [(_cell_text(c.header), [_cell_text(x) for x in c.cells], c.justify) for c in table.columns]
    lines: list[str] = []
    if table.title:
        lines.append(_cell_text(table.title))
    nrows = max((len(cells) for _, cells, _ in cols), default=0)
    if not cols or not nrows:
        return lines + ([_cell_text(table.caption)] if table.caption else [])

    def natural(i: int) -> int:
        head, cells, _ = cols[i]
        return max([len(head) if table.show_header else 0] + [max(map(len, c.split("\n"))) for c in cells])

    inline, used = [], 0
    for i in range(len(cols)):
        w = natural(i)
        multi = any("\n" in c for c in cols[i][1])
        if i == 0 or (not multi and used + 2 + w <= width):
            inline.append(i)
            used += (2 if i else 0) + w
    if not table.show_header and len(cols) == 2 and inline == [0]:      # key / value: value after its key
        key_w = min(natural(0), 32)
        for key, value in zip(cols[0][1], cols[1][1]):
            lines.extend(_wrapped(value, width, f"{key:<{key_w}}  " if len(key) <= key_w else f"{key}  ", " " * 4))
        return lines + ([_cell_text(table.caption)] if table.caption else [])
    widths = {i: natural(i) for i in inline}

    def row_line(cells: list[str]) -> str:
        parts = [(cells[k].rjust(widths[i]) if cols[i][2] == "right" else cells[k].ljust(widths[i]))
                 for k, i in enumerate(inline)]
        return "  ".join(parts).rstrip()

    if table.show_header:
        lines.append(row_line([cols[i][0] for i in inline]))
    for r in range(nrows):
        cell = lambda i: cols[i][1][r] if r < len(cols[i][1]) else ""  # noqa: E731
        lines.append(row_line([cell(i) for i in inline]))
        for i in range(len(cols)):
            if i in inline or not cell(i):
                continue
            label = f"    {cols[i][0]}: " if cols[i][0] else "    "
            if "\n" in cell(i):
                lines.append(label.rstrip())
                lines.extend("        " + ln for ln in cell(i).split("\n"))
            else:
                lines.extend(_wrapped(cell(i), width, label, " " * 8))
    if table.caption:
        lines.append(_cell_text(table.caption))
    return lines


def _wrapped(text: str, width: int, first: str, rest: str) -> list[str]:
    """``text`` wrapped at word boundaries after ``first`` (then ``rest``); a word longer than a line (a path)
    stays whole on a line of its own."""
    return textwrap.wrap(text, width=width, initial_indent=first, subsequent_indent=rest, break_long_words=False,
                         break_on_hyphens=False) or [first.rstrip()]


class LabConsole(Console):
    """rich's Console, except that a table printed where there is no terminal (a file, a pipe, a CI log) is laid
    out by :func:`plain_table` rather than folded into rich's grid, at the console's width (80 columns, or
    $COLUMNS where it is set)."""

    def print(self, *objects: Any, **kwargs: Any) -> None:
        if self.is_terminal or not any(isinstance(o, Table) for o in objects):
            return super().print(*objects, **kwargs)
        for o in objects:
            if isinstance(o, Table):
                for line in plain_table(o, width=self.width):      # 80, or $COLUMNS where it is set
                    super().print(Text(line), soft_wrap=True)
            else:
                super().print(o, **kwargs)


console = LabConsole(highlight=False, markup=False, emoji=False)
err_console = LabConsole(stderr=True, highlight=False, markup=False, emoji=False)

VERDICT_STYLE = {"PASS": "bold green", "FAIL": "bold red", "REVIEW": "bold yellow", "NOT-RUN": "dim"}
STATUS_STYLE = {"pass": "green", "fail": "red", "review": "yellow", "not-run": "dim"}


def verdict_text(verdict: str) -> Text:
    return Text(verdict, style=VERDICT_STYLE.get(verdict, "bold"))


def short(value: Any, limit: int = 80) -> str:
    """Compact one-line rendering of a JSON-able value."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def readable(value: Any) -> str:
    """A value as it reads in a line or a table cell, never as Python writes it (``None``, ``True``,
    ``{'a': 1}``): text as is, ``-`` for none, ``yes``/``no``, a list in brackets and a mapping as
    ``key: value`` pairs, each item readable in turn (``[A, B]``; ``status: WAITING, blocks: []``; a mapping
    inside another in parentheses)."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        if not value:
            return "-"
        return ", ".join(f"{k}: {f'({readable(v)})' if isinstance(v, dict) and v else readable(v)}"
                         for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(f"({readable(v)})" if isinstance(v, dict) and v else readable(v) for v in value) + "]"
    return str(value)


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
    """Table of checkpoint rows: id, verdict, reason, seconds and signature (if present), evidence."""
    rows = list(rows)
    timed = any("seconds" in r for r in rows)
    signed = any(r.get("provenance") not in (None, "-") for r in rows)  # no column when no file was read
    table = Table(title=title, title_justify="left")
    table.add_column("checkpoint", no_wrap=True)
    table.add_column("verdict")
    table.add_column("reason", overflow="fold")
    if timed:
        table.add_column("s", justify="right")
    if signed:
        table.add_column("signature")
    table.add_column("evidence", overflow="fold")
    for r in rows:
        cells: list[Any] = [r["id"], verdict_text(r["verdict"]), r.get("reason") or ""]
        if timed:
            s = r.get("seconds")
            cells.append("" if s is None else f"{s:.1f}")
        if signed:
            cells.append(r.get("provenance") or "-")
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


def internal_error_line(message: str) -> None:
    """A bug, in one red line on stderr, with the way to its traceback."""
    err_console.print(Text("internal error: ", style="bold red")
                      + Text(one_line(message) + " (set LABKIT_DEBUG=1 for the traceback)", style="red"),
                      soft_wrap=True)


# --------------------------------------------------------------------------- record renderers


def render_record(record: dict, paths: list, word: str | None = None) -> None:
    """The end of a command: checks table, verdict line (checkpoint, evidence paths) and notes."""
    verdict = record.get("verdict") or "REVIEW"
    if record.get("checks"):
        console.print(checks_table(record["checks"]))
    line = Text(word, style="bold green") if word == "COLLECTED" else verdict_text(word or verdict)
    line.append(f"  {record.get('checkpoint') or ''}", style="bold")
    patches = record.get("engine_patches")
    if isinstance(patches, list) and patches:
        line.append(f"  engine patch: {', '.join(map(str, patches))}", style="bold yellow")
    if paths:
        line.append("  evidence: " + " + ".join(rel(p) for p in paths))
    console.print(line, soft_wrap=True)
    if verdict == "REVIEW":
        note("REVIEW: look before trusting these numbers")
    synthetic = (record.get("facts") or {}).get("note")
    if synthetic:
        note(synthetic)


def render_rows(rows: list[dict], title: str | None = None) -> None:
    """Checkpoint rows (``labkit run``, ``labkit check``) and their counts."""
    console.print(rows_table(rows, title=title))
    console.print(counts_line(rows))


def sci(x) -> str:
    return "-" if x is None else f"{x:.3e}"


def num(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def pcts(d: dict | None, keys=("p50", "p90", "p99")) -> str:
    if not d or not d.get("n"):
        return "–"
    return " / ".join(num(d.get(k)) for k in keys)
