"""``labkit run``: run every checkpoint this machine can run, in order, and judge its evidence.

Each checkpoint runs as its own process (``python -m labkit <command> --out <evidence>``) from the
repository root, with stdout/stderr captured in ``runs/logs/<id>.log``. Stale evidence is removed
first, so a run that writes nothing cannot pass on an old file. Checkpoints this machine cannot run
are NOT-RUN with the reason. The rows are also written to ``runs/report.json`` and ``runs/report.md``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from functools import lru_cache
from pathlib import Path

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

from labkit.checks import NEEDS_REASON, Checkpoint, check_evidence, provenance, reason, select
from labkit.console import err_console, verdict_text
from labkit.evidence import (
    PATCHED_DIR,
    SCHEMA_VERSION,
    utc_stamp,
    command_line,
    engine_source_hash,
    git_head,
    patched_out,
    versions,
    write_json,
)
from labkit.evidence_format import evidence_key
from labkit.paths import repo_root, runs_dir

DEFAULT_TIMEOUT_S = 1800
#: Without a terminal, a line every this many seconds while one checkpoint runs (CI logs stay alive).
HEARTBEAT_S = 60.0


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during ``labkit run``: the rows so far (the rest NOT-RUN) and the checkpoint it stopped in;
    the report was written, marked partial."""

    def __init__(self, rows: list[dict], at: str | None):
        super().__init__(f"interrupted during {at}" if at else "interrupted")
        self.rows, self.at = rows, at


@lru_cache(maxsize=1)
def machine() -> dict:
    """What this machine offers: CUDA device count and names (0 without torch or CUDA)."""
    try:
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        names = [torch.cuda.get_device_name(i) for i in range(n)]
    except Exception:
        n, names = 0, []
    return {"cuda_device_count": n, "cuda_devices": names}


def can_run(cp: Checkpoint) -> tuple[bool, str]:
    """Whether this machine meets ``cp.needs``; the reason when it does not. ``real-model``: the CPU and a real
    model fetched from the package index (labkit/assets/fetch.py)."""
    if cp.needs == "real-model":
        from labkit.assets.fetch import find_fetched

        return (True, "") if find_fetched("smollm2") is not None else (False, NEEDS_REASON[cp.needs])
    have = machine()["cuda_device_count"]
    need = {"cpu": 0, "cuda": 1, "2gpu": 2}[cp.needs]
    return (True, "") if have >= need else (False, NEEDS_REASON[cp.needs])


def build_command(cp: Checkpoint, evidence: Path, model: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "labkit", *cp.command[1:], "--out", str(evidence)]
    if model and cp.takes_model:
        cmd += ["--model", str(model)]
    return cmd


_BOX = "│╭╮╰╯─━┃┏┓┗┛┡┩┠┨╇╈┼├┤┬┴ \t"


def _last_line(log: Path) -> str:
    """The most telling line of a log: the last ``error:`` line, else the last line with text."""
    try:
        raw = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    lines = [ln.strip(_BOX) for ln in raw]
    lines = [ln for ln in lines if ln]
    errors = [ln for ln in lines if ln.startswith("error:")]
    pick = errors[-1] if errors else (lines[-1] if lines else "")
    return pick[:200]


def _wait(proc: subprocess.Popen, timeout: float, tick=None) -> int | None:
    """The exit code of ``proc``, or None after ``timeout`` s (then it is killed); ``tick(seconds)`` every
    :data:`HEARTBEAT_S`. On Ctrl-C the child is stopped (terminate, then kill) before it propagates."""
    start = time.monotonic()
    try:
        while True:
            left = timeout - (time.monotonic() - start)
            if left <= 0:
                proc.kill()
                proc.wait()
                return None
            try:
                return proc.wait(timeout=min(left, HEARTBEAT_S))
            except subprocess.TimeoutExpired:
                if tick is not None:
                    tick(time.monotonic() - start)
    except KeyboardInterrupt:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise


def run_checkpoint(cp: Checkpoint, model: str | None = None, tick=None) -> dict:
    """Run one checkpoint's command and judge what it wrote. Returns a row. ``tick(seconds)`` is called
    every :data:`HEARTBEAT_S` while it runs; Ctrl-C stops the command, notes it in the log and propagates."""
    evidence = patched_out(cp.evidence_path())  # a patched engine's evidence never replaces the unpatched one
    log = runs_dir() / "logs" / f"{cp.id}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    evidence.unlink(missing_ok=True)  # never judge a stale file
    cmd = build_command(cp, evidence, model)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": os.environ.get("COLUMNS", "120")}
    timeout = cp.timeout_s or DEFAULT_TIMEOUT_S
    start = time.monotonic()
    with log.open("w", encoding="utf-8") as f:
        f.write(f"$ {command_line(cmd)}\n\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=repo_root(), env=env, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
        try:
            rc = _wait(proc, timeout, tick)
        except KeyboardInterrupt:
            rc = proc.returncode
            ended = f"killed by signal {-rc}" if rc is not None and rc < 0 else f"exit {rc}"
            f.write(f"\n[labkit run: interrupted (Ctrl-C) after {time.monotonic() - start:.1f} s; "
                    f"the command was stopped ({ended})]\n")
            raise
    seconds = round(time.monotonic() - start, 2)
    row = _judge_run(cp, rc, seconds, timeout, evidence, log)
    if evidence != cp.evidence_path():
        patch = evidence.relative_to(runs_dir() / PATCHED_DIR).parts[0]
        row["reason"] = f"engine patch {patch} applied: {row['reason']}"
    return row


def _judge_run(cp: Checkpoint, rc: int | None, seconds: float, timeout: float, evidence: Path, log: Path) -> dict:
    row = {"id": cp.id, "verdict": "FAIL", "reason": "", "seconds": seconds, "evidence": str(evidence),
           "log": str(log), "exit_code": rc}
    if rc is None:
        row["reason"] = f"timed out after {timeout} s (log: {log})"
        return row
    verdict, checks = check_evidence(cp, evidence)
    row["provenance"] = provenance(evidence)
    if verdict == "NOT-RUN":
        row["reason"] = f"exit {rc}, no evidence written: {_last_line(log)}"
    elif rc not in (0, 1):
        row["reason"] = f"exit {rc}: {_last_line(log)}"
    elif rc == 1 and verdict in ("PASS", "REVIEW"):
        row["reason"] = f"exit 1 although the evidence says {verdict} (log: {log})"
    else:
        row["verdict"] = verdict
        row["reason"] = reason(verdict, checks)
    return row


def _missing_why(cp: Checkpoint, why: str) -> str:
    """NOT-RUN's reason, with the last line of the checkpoint's last ``labkit run`` log when there is no
    evidence (its command crashed or wrote nothing)."""
    log = runs_dir() / "logs" / f"{cp.id}.log"
    if cp.evidence_path().is_file() or not log.is_file():
        return why
    return f"{why}; its last run's log ({log}) ends: {_last_line(log) or '(empty)'}"


def check_row(cp: Checkpoint, *, strict: bool = False) -> dict:
    """``labkit check``'s row for ``cp``: its evidence re-judged. NOT-RUN says why (no file, with the last
    run's log line; stale; or what the machine lacks). With ``strict``, a NOT-RUN this machine could have run
    (missing or stale evidence) is a FAIL: CI ran it, so no current evidence means it did not work."""
    verdict, checks = check_evidence(cp)
    why = reason(verdict, checks)
    if verdict == "NOT-RUN":
        why = _missing_why(cp, why)
        ok, lacks = can_run(cp)
        if not ok:
            why = f"{why} ({lacks}: this machine cannot run it)"
        elif strict:
            verdict, why = "FAIL", f"strict: this machine can run it, but {why}"
    return {"id": cp.id, "verdict": verdict, "reason": why, "provenance": provenance(cp.evidence_path()),
            "evidence": str(cp.evidence_path()), "checks": checks}


def check_all(target: str | None = None, *, strict: bool = False) -> list[dict]:
    """``labkit check [TARGET] [--strict]``: every selected checkpoint's row (:func:`check_row`)."""
    evidence_key()  # a bad key setting is one error line before anything is judged
    return [check_row(cp, strict=strict) for cp in select(target)]


def not_run(cp: Checkpoint, why: str) -> dict:
    return {"id": cp.id, "verdict": "NOT-RUN", "reason": why, "seconds": None, "evidence": str(cp.evidence_path()),
            "log": None, "exit_code": None}


def counts(rows: list[dict]) -> dict[str, int]:
    out = {v: 0 for v in ("PASS", "FAIL", "REVIEW", "NOT-RUN")}
    for r in rows:
        out[r["verdict"]] = out.get(r["verdict"], 0) + 1
    return out


def render_report_md(report: dict) -> str:
    c = report["counts"]
    lines = [
        "# labkit run",
        "",
        f"- created: {report['created_at']}",
        f"- command: `{report['command']}`",
        f"- git head: {report['git_head'] or '(none)'}",
        f"- engine source hash: {report['engine_source_hash'] or '(none)'}",
        f"- CUDA devices: {report['machine']['cuda_device_count']} {', '.join(report['machine']['cuda_devices'])}",
        f"- model: {report['model'] or '(default)'}",
        f"- totals: PASS {c['PASS']}, FAIL {c['FAIL']}, REVIEW {c['REVIEW']}, NOT-RUN {c['NOT-RUN']}",
        *([f"- **partial**: interrupted (Ctrl-C) during `{report['interrupted_at']}`; the checkpoints after it "
           "did not run (NOT-RUN)"] if report.get("partial") else []),
        "",
        "| checkpoint | verdict | reason | seconds | evidence |",
        "| --- | --- | --- | --- | --- |",
    ]
    root = repo_root()
    for r in report["rows"]:
        ev = Path(r["evidence"])
        ev_text = str(ev.relative_to(root)) if ev.is_relative_to(root) else str(ev)
        secs = "" if r["seconds"] is None else f"{r['seconds']:.1f}"
        why = str(r["reason"]).replace("|", "\\|")
        lines.append(f"| `{r['id']}` | {r['verdict']} | {why} | {secs} | `{ev_text}` |")
    return "\n".join(lines) + "\n"


def _write_text(path: Path, text: str) -> Path:
    """Write ``text`` atomically: a reader never sees half a report."""
    from labkit.evidence import write_text

    return write_text(path, text)


def write_report(rows: list[dict], *, stage: str | None = None, model: str | None = None,
                 interrupted_at: str | None = None, partial: bool = False) -> tuple[Path, Path]:
    """``runs/report.json`` and ``.md``, each written atomically; ``partial`` (Ctrl-C during
    ``interrupted_at``) is a field and a line of both."""
    report = {
        "schema_version": SCHEMA_VERSION,
        "created_at": utc_stamp(),
        "command": command_line(),
        "git_head": git_head(),
        "engine_source_hash": engine_source_hash(),
        "versions": versions(),
        "machine": machine(),
        "stage": stage,
        "model": model,
        "partial": partial,
        "interrupted_at": interrupted_at,
        "counts": counts(rows),
        "rows": rows,
    }
    json_path = write_json(runs_dir() / "report.json", report)
    md_path = _write_text(runs_dir() / "report.md", render_report_md(report))
    return json_path, md_path


class _ThisOne(ProgressColumn):
    """Seconds spent on the current checkpoint (the task's ``cp_start`` field)."""

    def render(self, task) -> Text:
        start = task.fields.get("cp_start")
        return Text("" if start is None else f"{time.monotonic() - start:.0f} s on it", style="dim")


class RunDisplay:
    """What ``labkit run`` shows while it runs: N/M, the current checkpoint and the elapsed time, as a
    rich progress bar on a terminal, as plain lines (start, a heartbeat every HEARTBEAT_S, verdict)
    otherwise; nothing with ``show`` False."""

    def __init__(self, total: int, show: bool = True, console=err_console):
        self.total, self.show, self.console = total, show, console
        self.live = show and console.is_terminal
        self.start = time.monotonic()
        self.progress = Progress(
            SpinnerColumn(), MofNCompleteColumn(), TextColumn("[bold]{task.description}"), BarColumn(),
            TimeElapsedColumn(), _ThisOne(), console=console, transient=True, disable=not self.live)
        self.task = self.progress.add_task("labkit run", total=total, cp_start=None)

    def __enter__(self) -> "RunDisplay":
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def _plain(self, text: str) -> None:
        if self.show and not self.live:
            self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def _elapsed(self) -> str:
        return f"{time.monotonic() - self.start:.0f} s elapsed"

    def begin(self, n: int, cp: Checkpoint) -> None:
        self.progress.update(self.task, description=cp.id, cp_start=time.monotonic())
        self._plain(f"[{n}/{self.total}] {cp.id} ({self._elapsed()})")

    def tick(self, n: int, cp: Checkpoint, seconds: float) -> None:
        self._plain(f"[{n}/{self.total}] {cp.id} still running ({seconds:.0f} s on it, {self._elapsed()})")

    def end(self, row: dict) -> None:
        if self.show:
            secs = "" if row["seconds"] is None else f" ({row['seconds']:.1f} s)"
            self.progress.console.print(verdict_text(row["verdict"]), f"{row['id']}{secs}", row["reason"] or "",
                                        soft_wrap=True)
        self.progress.advance(self.task)

    def interrupted(self, at: str | None, done: int) -> None:
        if self.show:
            self.progress.console.print(f"interrupted (Ctrl-C) during {at or '(between checkpoints)'} after "
                                        f"{done} of {self.total} checkpoints, {self._elapsed()}", soft_wrap=True)


def _run_one(cp: Checkpoint, n: int, model: str | None, failed: str | None, display: RunDisplay) -> dict:
    ok, why = can_run(cp)
    if failed is not None:
        return not_run(cp, f"stopped after {failed} failed")
    if not ok:
        return not_run(cp, why)
    return run_checkpoint(cp, model, tick=lambda seconds: display.tick(n, cp, seconds))


def run_all(stage: str | None = None, model: str | None = None, stop_on_fail: bool = False,
            *, show_progress: bool = True) -> list[dict]:
    """Run every checkpoint of ``stage`` (default: all) this machine can run; returns the rows.

    Ctrl-C stops the current command; the report is still written, marked partial (the interrupted
    checkpoint and every later one NOT-RUN), and :class:`RunInterrupted` is raised with the rows."""
    cps = select(stage)
    evidence_key()  # a bad key setting is one error line before anything runs
    rows: list[dict] = []
    failed: str | None = None
    current: Checkpoint | None = None
    with RunDisplay(len(cps), show_progress) as display:
        try:
            for n, cp in enumerate(cps, 1):
                current = cp
                display.begin(n, cp)
                row = _run_one(cp, n, model, failed, display)
                if row["verdict"] == "FAIL" and stop_on_fail:
                    failed = failed or cp.id
                rows.append(row)
                current = None
                display.end(row)
        except KeyboardInterrupt:
            display.interrupted(current.id if current else None, len(rows))
            rows += [not_run(cp, "interrupted (Ctrl-C) while it ran" if cp is current
                             else "not run: labkit run was interrupted") for cp in cps[len(rows):]]
            at = current.id if current else None
            write_report(rows, stage=stage, model=model, interrupted_at=at, partial=True)
            raise RunInterrupted(rows, at) from None
    write_report(rows, stage=stage, model=model)
    return rows
