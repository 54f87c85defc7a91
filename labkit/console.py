"""Shared rich output: verdict colours, check tables, result tables, JSON and error lines.

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


def _sci(x) -> str:
    return "-" if x is None else f"{x:.3e}"


def _num(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def _pcts(d: dict | None, keys=("p50", "p90", "p99")) -> str:
    if not d or not d.get("n"):
        return "–"
    return " / ".join(_num(d.get(k)) for k in keys)


# setup


def render_doctor(record: dict) -> None:
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
        "engine": (f"{facts['engine_import']['path']}: {facts['engine_run']['output_tokens']} token in "
                   f"{facts['engine_run']['generate_seconds']} s ({facts['engine_run']['attention_backend']})"
                   if facts["engine_run"]["ok"] else f"{facts['engine_import']['path']}: {facts['engine_run']['error']}"),
        "flash-attn": _flash_line(facts.get("flash_attn")),
        "evidence kind": record["kind"],
    }, title="machine"))
    if "engine" in facts:
        console.print(kv_table(doctor_engine_rows(facts["engine"]), title="engine KV pool (docs/LAB.md §11)"))


def _flash_line(f: dict | None) -> str:
    """doctor's flash-attn row: what it found and what that can run."""
    if not f:
        return "not checked"
    if not f["found"]:
        return f["why"]
    text = f"{readable(f.get('version'))} ({f['build']} build, {f['location']}): {f['runs']}"
    if f.get("imports") is False:
        text += f"; does not import: {f['import_error']}"
    if f.get("arch_note"):
        text += f"; {f['arch_note']}"
    return text


def gib(n: int | float | None, missing: str = "n/a") -> str:
    """Bytes in GiB (3 significant digits), with MiB beside it below 1 GiB."""
    if n is None:
        return missing
    text = f"{n / 2**30:.3g} GiB"
    return text if n >= 2**30 else f"{text} ({n / 2**20:.3g} MiB)"


def doctor_engine_rows(e: dict) -> dict:
    """``doctor --engine``'s KV pool rows: memory in GiB, a block in bytes and MiB."""
    mem = e["memory"]
    return {
        "attention / dtype": f"{e['attention_backend']} / {e['dtype']}",
        "weights": gib(mem.get("weights_bytes"), "n/a (CPU budget)"),
        "peak work memory": gib(mem.get("peak_work_bytes"), "n/a (CPU budget)"),
        "KV budget": gib(mem.get("kv_budget_bytes")),
        "bytes per block": f"{e['bytes_per_block']} ({e['mib_per_block']} MiB, {e['block_size']} tokens)",
        "blocks": f"{e['num_blocks']} ({e['tokens_in_pool']} tokens)",
    }


def render_smoke(record: dict) -> None:
    f = record["facts"]
    console.print(kv_table({"prompt tokens": f["prompt_tokens"], "output token ids": f["output_token_ids"],
                            "text": f["text"], "kv_blocks": f["kv_blocks"],
                            "attention": record["engine"]["attention_backend"],
                            "model": record["model"]["path"]}, title="smoke"))


def render_quick_walk(record: dict) -> None:
    f = record["facts"]
    def blocks(d: dict, key: str, i: int, count: int) -> str:
        ids = d.get(key)            # block ids (evidence before they were recorded: the count only)
        return f"blocks {ids[i]}" if ids is not None else f"{count} blocks"

    rows = [{"step": d["step"], "phase": d["phase"],
             "before (label total/cached/scheduled, block ids)": "  ".join(
                 f"{b[0]} {b[1]}/{b[2]}/{b[3]} {blocks(d, 'before_blocks', i, b[4])}" for i, b in enumerate(d["before"])),
             "after (label total/cached, block ids)": "  ".join(
                 f"{a[0]} {a[1]}/{a[2]} {blocks(d, 'after_blocks', i, a[3])}" for i, a in enumerate(d["after"])),
             "finished": ",".join(d["finished"])} for d in f["step_digest"]]
    console.print(dict_table(rows, title=f"quick-walk {f['case']}: {f['title']}"))
    console.print(f"steps={f['num_steps']} output_counts={f['output_counts']}")
    if record["checkpoint"] is None:
        note("no checkpoint states the expectations for these options: facts recorded, nothing asserted")


def render_generate(record: dict, path) -> None:
    for r in record["facts"]["requests"]:
        console.print(kv_table({"prompt tokens": r["prompt_tokens"], "output token ids": r["output_token_ids"],
                                "text": r["text"], "finish": r["finish_reason"]}, title="output"))
    if record["facts"].get("note"):
        note(record["facts"]["note"])
    console.print(f"evidence: {rel(path)}")


def render_facts_json(record: dict) -> None:
    console.print_json(data={k: v for k, v in record["facts"].items()})


def _p50(value) -> Any:
    return value.get("p50") if isinstance(value, dict) else value


def bench_serve_rows(facts: dict) -> list[dict]:
    """``bench --workload serve``: one row per run (offline cold and warm, each served API and mode); the
    whole facts stay in the evidence file."""
    off = facts["offline"]
    warm = off["warm"].get("tok_s")
    served = facts.get("ab") or [{"mode": "engine-process" if facts.get("engine_process") else "in-process",
                                  "native": facts["native"], "openai": facts["openai"]}]
    runs = [("offline cold", off["cold"]), ("offline warm", off["warm"])]
    runs += [(f"{api} ({run['mode']})", run[api]) for run in served for api in ("native", "openai")]
    return [{"run": name, "requests": rec.get("completed", rec.get("requests")),
             "output tokens": rec.get("output_tokens"), "tok/s": _num(rec.get("tok_s")),
             "x offline warm": _num(round(rec["tok_s"] / warm, 3)) if rec.get("tok_s") and warm else "-",
             "TTFT p50 (ms)": _num(_p50(rec.get("ttft_ms")))} for name, rec in runs]


# guardrails


def _routes_text(facts: dict) -> str:
    routes = facts.get("decode_routes") or {}
    if not routes:
        return "-"
    parts = []
    for batch, r in routes.items():
        where = f"graph@{r['bucket']}" if r.get("route") == "graph" else str(r.get("route"))
        ok = "" if (r.get("route"), r.get("bucket")) == (r.get("expected_route"), r.get("expected_bucket")) else " (unexpected)"
        parts.append(f"{batch}:{where}{ok}")
    return ", ".join(parts)


def render_collect(record: dict) -> None:
    f = record["facts"]
    data = {
        "suite": f"{f['suite']} (seed {f['seed']})",
        "backend": f"{f['backend']}  execution {f['execution']}  attention {f['attention']}  dtype {f['dtype']}",
        "device": record.get("device"),
        "rows": f"{f['num_rows']} / {f['expected_rows']}",
        "trajectory sha256": f["trajectory_sha256"][:16],
    }
    if f.get("backend") == "nano":
        data["decode routes (batch:route)"] = _routes_text(f)
        if f.get("graph_buckets"):
            data["graph buckets"] = ",".join(map(str, f["graph_buckets"]))
    if "kv" in f:
        kv = f["kv"]
        data["history KV unchanged"] = kv["history_unchanged"]
        data["padding wrote nothing"] = kv["padding_wrote_nothing"]
        data["new KV rows"] = f"{kv['new_kv_rows']} {kv['new_kv_shape']}"
    if "expect_uncovered" in f:
        eu = f["expect_uncovered"]
        data["batch 17 decode"] = f"route {eu['route']}, completed {eu['completed']}" + (f", error {eu['error']}" if eu["error"] else "")
    console.print(kv_table(data, title="logits collect"))


def render_compare(record: dict) -> None:
    f = record["facts"]
    th = f["thresholds"]
    summary = {
        "lhs (measured)": f"{rel(f['lhs']['prefix'])}  {f['lhs']['backend']}/{f['lhs']['execution']}/{f['lhs']['attention']} {f['lhs']['dtype']} on {f['lhs']['device']}",
        "rhs (reference)": f"{rel(f['rhs']['prefix'])}  {f['rhs']['backend']}/{f['rhs']['execution']}/{f['rhs']['attention']} {f['rhs']['dtype']} on {f['rhs']['device']}",
        "rows": f"{f['num_rows']} ({f['suite']})",
        "worst max abs": f"{_sci(f['worst_max_abs'])} (threshold {th['max_abs'] if th['max_abs'] is None else format(th['max_abs'], 'g')}; median {_sci(f['median_max_abs'])})",
        "worst relative L2": f"{_sci(f['worst_rel_l2'])} (threshold {th['rel_l2'] if th['rel_l2'] is None else format(th['rel_l2'], 'g')}; median {_sci(f['median_rel_l2'])})",
        "top-1 agreement": f"{f['top1_agree']}/{f['num_rows']} ({f['unexplained_top1_flips']} unexplained flips)",
        "first divergent row": (f"#{f['first_divergent_row']['index']} {f['first_divergent_row']['id']} "
                                f"({', '.join(f['first_divergent_row']['failures'])})") if f["first_divergent_row"] else "none",
    }
    kv = f["kv"]
    summary["new KV"] = (f"{kv['rows']} rows, worst max abs {_sci(kv['worst_max_abs'])} (threshold {th['kv_max_abs']:g}), "
                         f"worst rel L2 {_sci(kv['worst_rel_l2'])}") if kv["compared"] else f"not compared: {kv['why_not']}"
    worst = Table(title=f"{len(f['worst_rows'])} worst rows (by max abs)", title_justify="left")
    for col in ("row", "id", "phase", "len", "max abs", "rel L2", "top-1 lhs/rhs", "ref top-2 margin", "failures"):
        worst.add_column(col, justify="right" if col in ("row", "len", "max abs", "rel L2", "ref top-2 margin") else "left")
    for r in f["worst_rows"]:
        worst.add_row(str(r["index"]), r["id"], r["phase"], str(r["length"]), _sci(r["max_abs"]), _sci(r["rel_l2"]),
                      f"{r['top1_lhs']}/{r['top1_rhs']}", f"{r['ref_margin']:.4f}", ",".join(r["failures"]) or "-")
    console.print(kv_table(summary, title="logits compare"))
    console.print(worst)


def render_calibration(record: dict) -> None:
    rows = [{"suite": r["suite"], "exec": r["execution"], "dtype": r["dtype"], "backend": r["backend"],
             "worst max abs": f"{r['worst_max_abs']:.3g}", "median max abs": f"{r['median_max_abs']:.3g}",
             "worst rel L2": f"{r['worst_rel_l2']:.3g}", "median rel L2": f"{r['median_rel_l2']:.3g}",
             "top-1 (min)": f"{r['min_top1_agree']}/{r['num_rows']}",
             "verdicts": ",".join(x["verdict"] for x in r["repeats"])} for r in record["facts"]["results"]]
    console.print(dict_table(rows, title=f"logits calibration, {record['facts']['repeats']} repeats on {record['device']}"))


def render_cached_forward(record: dict) -> None:
    f = record["facts"]
    t = Table(title=f"cached vs uncached, S={f['prompt_len']} G={f['steps']} ({f['dtype']} on {f['device']})",
              title_justify="left")
    for col in ("step", "width uncached", "width cached", "max abs", "rel L2", "same top-1"):
        t.add_column(col, justify="right")
    for s in f["per_step"]:
        t.add_row(str(s["step"]), str(s["width_uncached"]), str(s["width_cached"]), _sci(s["max_abs"]),
                  _sci(s["rel_l2"]), "yes" if s["same_top1"] else "NO")
    console.print(t)
    tm = f["timing"]
    console.print(kv_table({
        "positions": f"uncached {f['positions_uncached']} vs cached {f['positions_cached']} "
                     f"(expected {f['expected']['positions_uncached']} / {f['expected']['positions_cached']}; "
                     f"ratio {f['position_ratio']:.2f})",
        "max abs / rel L2": f"{_sci(f['max_abs_logit_error'])} / {_sci(f['relative_l2_logit_error'])}",
        "same top-1 steps": f"{f['same_top1_steps']}/{f['steps']}",
        "prefill s (median)": f"uncached {tm['uncached']['median_prefill_s']:.4f}  cached {tm['cached']['median_prefill_s']:.4f}",
        "decode s (median)": f"uncached {tm['uncached']['median_decode_s']:.4f}  cached {tm['cached']['median_decode_s']:.4f}",
        "repeats": f["repeats"],
    }, title="cached-forward"))


def render_tp_shapes(record: dict) -> None:
    for r in record["facts"]["ranks"]:
        console.print(f"rank {r['rank']}: {r['q_heads']} q heads, {r['kv_heads']} kv heads, "
                      f"rows of the TP=1 qkv weight {readable(r['rows_of_tp1_packed_qkv'])}")
    rows = record["facts"].get("qkv_rows_tp1")
    if rows:
        table = Table(title="TP=1 packed qkv weight: rows of q_proj, k_proj, v_proj", title_justify="left")
        for col in ("", "width", "from the config", "loader (shard_range)", "measured (by values)"):
            table.add_column(col)
        for n in "qkv":
            table.add_row(n, str(rows["widths"][n]), _rows(rows["from_config"][n]), _rows(rows["from_loader"][n]),
                          _rows(rows["measured"][n]))
        console.print(table)


def _rows(r) -> str:
    return "not found" if r is None else f"[{r[0]}, {r[1]})"


# service and load


def observer_table(summary: dict, title: str) -> Table:
    table = Table(title=title, title_justify="left", caption="latencies in ms, p50 / p99", caption_justify="left")
    for col in ("observer", "req", "done", "rej", "out tok", "queue wait", "TTFT", "ITL", "TPOT", "tok/s", "window s"):
        table.add_column(col, justify="left" if col == "observer" else "right", no_wrap=True)
    two = ("p50", "p99")
    for obs, o in summary["observers"].items():
        table.add_row(obs, str(o["requests"]), str(o["completed"]), str(o["rejections"]), str(o["output_tokens"]),
                      _pcts(o.get("queue_wait_ms") or {}, two), _pcts(o["ttft_ms"], two), _pcts(o["itl_ms"], two), _pcts(o["tpot_ms"], two),
                      _num(o.get("throughput_tok_s")), _num((o.get("window") or {}).get("seconds")))
    return table


def render_serving(worker, out) -> None:
    """``labkit serve``'s banner once the worker is ready."""
    served = worker.served
    console.print(kv_table(serving_banner(worker, out), title="labkit serve"))
    if served.model.get("synthetic"):
        note("synthetic model: random weights; generated text is meaningless")


def serving_banner(worker, out) -> dict:
    """The banner's rows: the served engine as it was built (max model len as fitted, TP size) and the limits."""
    from serve.core.fair import per_request_cap

    served, cfg, args = worker.served, worker.config, worker.config.engine
    return {"worker": worker.worker_id, "kind": served.kind,
            "model": served.model.get("path"), "synthetic": served.model.get("synthetic"),
            "tensor parallel size": served.config.tensor_parallel_size,
            "max model len": served.max_model_len,
            "scheduling policy": args.scheduling_policy,
            "max num batched tokens / seqs": f"{args.max_num_batched_tokens} / {args.max_num_seqs}",
            "max active / per request / queue": f"{cfg.max_active} / "
                                                f"{per_request_cap(cfg.max_active, cfg.max_active_per_request)} / "
                                                f"{cfg.queue_size} requests",
            "KV blocks": served.num_blocks,
            "log": str(out) if out else "(none)"}


def render_served(summary: dict) -> None:
    console.print(kv_table({"finished": summary["finished"], "tokens": summary["generation_tokens"],
                            "steps": summary["steps"], "engine errors": summary["engine_errors"]}, title="served"))


def render_client(res: dict, text: bool = True) -> None:
    """The client's result; ``text=False`` when the text was already streamed to the terminal."""
    console.print(kv_table({k: res[k] for k in ("request_id", "worker_id", "status", "reason", "cause",
                                                "message", "tokens", "tokens_after_finished", "ttft_ms",
                                                "kind", "out")}, title="labkit client"))
    if text:
        console.print(res["text"], markup=False, highlight=False)
    if (res.get("model") or {}).get("synthetic"):
        note("synthetic model: random weights; generated text is meaningless")


def render_load(record: dict, mode: str, events) -> None:
    summary = record["facts"]["summary"]
    console.print(observer_table(summary, f"labkit load ({summary.get('kind') or 'kind unknown'}, {mode})"))
    if record["facts"].get("profile"):
        p = record["facts"]["profile"]
        console.print(f"profile: {rel(p['trace'])}, {rel(p['operators'])}, {rel(p['evidence'])}")
    console.print(f"events: {rel(events)}")
    if summary.get("note"):
        note(summary["note"])


def render_report(result: dict, out) -> None:
    for i, s in enumerate(result["inputs"]):
        console.print(observer_table(s, f"{i}: {rel(s['path'])} ({s.get('kind') or 'kind unknown'})"))
        if s.get("note"):
            note(s["note"])
    for row in result["ratios"]:
        console.print(f"ratios vs input 0 ({result['primary_observer']}): " +
                      ", ".join(f"{k} {_num(v)}" for k, v in row.items() if k not in ("input", "vs")), soft_wrap=True)
    console.print(f"wrote {rel(out)}, {rel(result['markdown'])}" +
                  "".join(f", {rel(p)}" for p in result["plots"]), soft_wrap=True)
    if result.get("plots_note"):
        note(result["plots_note"])


def render_simulate(record: dict) -> None:
    table = Table(title="labkit simulate", title_justify="left")
    for col in ("scenario", "ok", "facts"):
        table.add_column(col, overflow="fold")
    for name, sc in record["facts"]["scenarios"].items():
        facts = {k: v for k, v in sc.items() if k not in ("ok", "policy", "messages", "over_message")}
        table.add_row(name, "yes" if sc.get("ok") else "NO", short(facts, 160))
    console.print(table)
    console.print(f"events: {record['facts']['events']}")
