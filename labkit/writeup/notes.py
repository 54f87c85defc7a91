"""``labkit notes``: one template per lab step under ``notes/templates/``, copied into ``notes/`` with the
facts of that step's evidence already filled in, so a learner writes observations, not transcriptions.

A template starts with an HTML comment that this module reads and leaves out of the copy::

    <!-- labkit notes: ...
    guide: docs/LAB.md#3-quick-walk-a-d
    checkpoint: setup.quick-walk-a
    fact: A steps | setup.quick-walk-a | facts.num_steps
    -->

and holds a ``<!-- facts -->`` line where the facts go: each checkpoint's verdict (re-judged from its
evidence), evidence kind, file and time, then each ``fact`` line's value (or why it is missing).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labkit.errors import UserError
from labkit.evidence import utc_stamp, read_json
from labkit.paths import repo_root, runs_dir

NOTES_DIR_ENV = "LABKIT_NOTES_DIR"
_FACTS_MARK = "<!-- facts -->"
_HEAD_START = "<!-- labkit notes:"


@dataclass
class Template:
    step: str
    path: Path
    title: str
    guide: str
    checkpoints: list[str] = field(default_factory=list)
    facts: list[tuple[str, str, str]] = field(default_factory=list)   # (label, checkpoint, path)
    body: str = ""


def templates_dir() -> Path:
    return repo_root() / "notes" / "templates"


def notes_dir() -> Path:
    override = os.environ.get(NOTES_DIR_ENV)
    return Path(override).expanduser().resolve() if override else repo_root() / "notes"


def parse_template(path: Path) -> Template:
    text = path.read_text(encoding="utf-8")
    if not text.startswith(_HEAD_START) or "-->" not in text:
        raise UserError(f"{path}: a notes template starts with a '{_HEAD_START} ... -->' block")
    head, body = text.split("-->", 1)
    t = Template(step=path.stem, path=path, title="", guide="", body=body.lstrip("\n"))
    for n, line in enumerate(head.splitlines()[1:], 2):
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if not key:
            continue
        if key == "guide":
            t.guide = value
        elif key == "checkpoint":
            t.checkpoints.append(value)
        elif key == "fact":
            parts = [p.strip() for p in value.split("|")]
            if len(parts) != 3 or not all(parts):
                raise UserError(f"{path}:{n}: a fact line is 'fact: LABEL | CHECKPOINT | PATH'")
            t.facts.append((parts[0], parts[1], parts[2]))
        else:
            raise UserError(f"{path}:{n}: unknown key {key!r} (guide, checkpoint, fact)")
    titles = [ln[2:].strip() for ln in t.body.splitlines() if ln.startswith("# ")]
    t.title = titles[0] if titles else t.step
    if _FACTS_MARK not in t.body:
        raise UserError(f"{path}: no '{_FACTS_MARK}' line to put the facts at")
    return t


def load_templates() -> list[Template]:
    return [parse_template(p) for p in sorted(templates_dir().glob("*.md"))]


def find_template(step: str) -> Template:
    import difflib

    templates = {t.step: t for t in load_templates()}
    key = step.strip().removesuffix(".md")
    if key in templates:
        return templates[key]
    close = difflib.get_close_matches(key, list(templates), n=3, cutoff=0.4)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; steps: {', '.join(templates)}"
    raise UserError(f"no notes template for step {step!r}{hint}")


# --------------------------------------------------------------------------- facts from the evidence


def _value_text(v: Any, limit: int = 160) -> str:
    text = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False, default=str)
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def evidence_facts(t: Template) -> dict:
    """Each checkpoint's verdict / kind / evidence, and each fact's value, from what is under runs/."""
    from labkit.checks import check_evidence, get_checkpoint, reason, resolve

    checkpoints, records = [], {}
    for cid in t.checkpoints:
        cp = get_checkpoint(cid)
        path = cp.evidence_path()
        verdict, checks = check_evidence(cp, path)
        row = {"checkpoint": cid, "verdict": verdict, "reason": reason(verdict, checks), "evidence": cp.evidence,
               "command": " ".join(cp.command), "kind": None, "created_at": None}
        if verdict != "NOT-RUN":
            try:
                rec = read_json(path)
                records[cid] = rec
                row.update(kind=rec.get("kind"), created_at=rec.get("created_at"),
                           engine_source_hash=rec.get("engine_source_hash"), engine_patches=rec.get("engine_patches"))
            except (OSError, ValueError):
                pass
        checkpoints.append(row)
    facts = []
    for label, cid, p in t.facts:
        if cid not in records:
            facts.append({"label": label, "checkpoint": cid, "path": p, "value": None, "missing": "no evidence yet"})
            continue
        try:
            facts.append({"label": label, "checkpoint": cid, "path": p, "value": resolve(records[cid], p)})
        except KeyError:
            facts.append({"label": label, "checkpoint": cid, "path": p, "value": None, "missing": "not in the evidence"})
    return {"checkpoints": checkpoints, "facts": facts}


def render_facts(t: Template, ev: dict) -> str:
    lines = [f"## From the evidence (filled by `labkit notes new {t.step}` at {utc_stamp()}; runs: `{runs_dir()}`)", ""]
    if t.guide:
        lines += [f"Lab guide: [{t.guide}](../{t.guide})", ""]
    if not ev["checkpoints"]:
        lines.append("No checkpoint judges this step yet: the numbers below are yours to measure.")
        return "\n".join(lines)
    lines += ["| checkpoint | verdict | evidence kind | evidence | recorded |", "| --- | --- | --- | --- | --- |"]
    for c in ev["checkpoints"]:
        lines.append(f"| `{c['checkpoint']}` | {c['verdict']} | {c['kind'] or '–'} | `{c['evidence']}` | "
                     f"{c['created_at'] or '–'} |")
    not_run = [c for c in ev["checkpoints"] if c["verdict"] == "NOT-RUN"]
    if not_run:
        lines += [""] + [f"- `{c['checkpoint']}` has no evidence yet: run `{c['command']}`" for c in not_run]
    bad = [c for c in ev["checkpoints"] if c["verdict"] in ("FAIL", "REVIEW")]
    lines += [f"- `{c['checkpoint']}` {c['verdict']}: {c['reason']}" for c in bad]
    if ev["facts"]:
        lines += ["", "| fact | value | from |", "| --- | --- | --- |"]
        for f in ev["facts"]:
            value = _value_text(f["value"]) if "missing" not in f else f"({f['missing']})"
            lines.append(f"| {f['label']} | {value} | `{f['checkpoint']}` `{f['path']}` |")
    return "\n".join(lines)


def new_note(step: str, *, force: bool = False, out: Path | None = None) -> dict:
    """Copy the step's template into notes/STEP.md with the facts filled in. Refuses to overwrite
    an existing note unless ``force``."""
    t = find_template(step)
    dest = Path(out) if out is not None else notes_dir() / f"{t.step}.md"
    if dest.exists() and not force:
        raise UserError(f"{dest} exists (your notes): pass --force to overwrite it, or --out elsewhere")
    ev = evidence_facts(t)
    text = t.body.replace(_FACTS_MARK, render_facts(t, ev), 1)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(text, encoding="utf-8")
    return {"step": t.step, "title": t.title, "path": str(dest), **ev}


def list_steps() -> list[dict]:
    rows = []
    for t in load_templates():
        note = notes_dir() / f"{t.step}.md"
        rows.append({"step": t.step, "title": t.title, "checkpoints": t.checkpoints, "guide": t.guide,
                     "note": str(note) if note.exists() else None})
    return rows
