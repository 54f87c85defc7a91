"""Checkpoints as data, and the judge that re-reads evidence against them.

A file ``checkpoints/<stage>.json`` holds ``{"stage": ..., "checkpoints": [...]}``. Each checkpoint
names the command that produces its evidence, where that evidence lands, what the machine needs,
which evidence kind is acceptable, and assertions over the evidence record::

    {"path": "facts.steps.0.seqs.0.total", "op": "eq", "value": 3, "why": "..."}

Paths are dotted keys with integer list indices; ``len(<path>)`` takes a length. A missing path is a
failed check (actual ``"<missing>"``), never an exception. An assertion may carry
``"on_fail": "review"`` to turn its failure into REVIEW instead of FAIL.

A run states its own checks in the same language (``run_assertions`` in the evidence file, written by
``labkit.evidence``). The judge trusts nothing the file says about itself: ``check_evidence`` verifies
the digest, re-evaluates the checkpoint's and the run's assertions from the facts, checks the envelope
against the checkpoint (kind, device class, synthetic flag, command and options) and compares the
engine source hash with the current tree (stale evidence is NOT-RUN).

Why one file of this length: the checkpoints, the runs' own assertions and the threshold tables are
written in one assertion language, and the loader, the evaluator and the judge share its types
(Assertion, Threshold) and its one evaluator; CHECKPOINTS.md is rendered from the same objects. A split
along loading / judging is the next cut if it grows further.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from labkit.errors import UserError
from labkit.evidence_format import (
    DIGEST_KEY,
    ENGINE_FREE_KINDS,
    KIND_DEVICE,
    KINDS,
    SCHEMA_VERSION,
    digest,
    engine_source_hash,
)
from labkit.paths import repo_root, runs_dir

STAGE_ORDER = ("setup", "guardrails", "service", "cuda", "tp")
NEEDS = ("cpu", "cuda", "2gpu")
NEEDS_REASON = {"cuda": "needs CUDA", "2gpu": "needs 2 GPUs"}
MISSING_TEXT = "<missing>"

_CHECKPOINT_KEYS = {
    "required": ("id", "title", "command", "evidence", "needs", "kind", "assertions"),
    "optional": ("takes_model", "timeout_s", "notes", "synthetic"),
}
#: Where an older writer kept checks a command judged itself (a stored ``passed``); the judge no longer
#: accepts them: a file that holds them FAILs (run the command again).
UNJUDGED_KEY = "unjudged_checks"
_ASSERTION_KEYS = {"required": ("path", "op"), "optional": ("value", "threshold", "why", "on_fail", "name")}
#: ``"<device class>/<dtype>"``: the key of a threshold table entry (device class as the envelope gives it).
_THRESHOLD_KEY_RE = re.compile(r"(cpu|cuda)/[a-z0-9_]+")
_THRESHOLD_OPS = ("gt", "ge", "lt", "le")


class CheckpointError(UserError):
    """A checkpoint file (or a requested id) is invalid."""


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Threshold:
    """One metric of a threshold table: its value per ``"<device class>/<dtype>"``."""
    table: str
    metric: str
    values: tuple[tuple[str, float], ...]

    @property
    def ref(self) -> str:
        return f"{self.table}.{self.metric}"

    def keys(self) -> list[str]:
        return [k for k, _ in self.values]

    def lookup(self, key: str | None) -> float | None:
        return next((v for k, v in self.values if k == key), None)


@dataclass(frozen=True)
class Assertion:
    path: str
    op: str
    value: Any = None
    why: str = ""
    on_fail: str = "fail"  # "fail" | "review"
    name: str = ""
    threshold: Threshold | None = None   # the value comes from a threshold table, by the record's device and dtype

    def label(self) -> str:
        return self.name or self.path

    def expected_text(self, value: Any = None) -> str:
        if self.op in _NO_VALUE_OPS:
            return self.op
        if self.threshold is not None:
            return f"{self.op} {self.threshold.ref}" + (f" = {json.dumps(value)}" if value is not None else "")
        return f"{self.op} {json.dumps(self.value, ensure_ascii=False)}"


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


def _fail(where: str, problem: str) -> CheckpointError:
    return CheckpointError(f"{where}: {problem}")


def _check_keys(where: str, obj: dict, spec: dict) -> None:
    missing = [k for k in spec["required"] if k not in obj]
    if missing:
        raise _fail(where, f"missing key(s) {', '.join(missing)}")
    allowed = set(spec["required"]) | set(spec["optional"])
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise _fail(where, f"unknown key(s) {', '.join(unknown)} (allowed: {', '.join(sorted(allowed))})")


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _validate_path(where: str, path: Any) -> None:
    if not isinstance(path, str) or not path:
        raise _fail(where, f"path must be a non-empty string, got {path!r}")
    m = _LEN_RE.fullmatch(path)
    inner = m.group(1) if m else path
    if any(not part for part in inner.split(".")):
        raise _fail(where, f"bad path {path!r}")


def _parse_threshold_ref(where: str, raw: dict, tables: dict[str, dict] | None) -> Threshold:
    ref = raw["threshold"]
    if "value" in raw:
        raise _fail(where, f"give a value or a threshold, not both (path {raw['path']})")
    if raw["op"] not in _THRESHOLD_OPS:
        raise _fail(where, f"a threshold needs op {', '.join(_THRESHOLD_OPS)}, got {raw['op']!r}")
    if tables is None:
        raise _fail(where, "thresholds are for checkpoint assertions; a run states its values")
    table, _, metric = str(ref).partition(".")
    if table not in tables:
        raise _fail(where, f"unknown threshold table {table!r} in {ref!r} (tables: {', '.join(sorted(tables)) or 'none'})")
    entries = tables[table]["entries"]
    missing = [k for k, e in entries.items() if metric not in e]
    if not metric or missing:
        raise _fail(where, f"threshold {ref!r}: no metric {metric!r} in table {table!r} entries {', '.join(missing or entries)}")
    return Threshold(table, metric, tuple((k, float(e[metric])) for k, e in entries.items()))


def _parse_assertion(where: str, raw: Any, tables: dict[str, dict] | None = None) -> Assertion:
    if not isinstance(raw, dict):
        raise _fail(where, f"assertion must be an object, got {raw!r}")
    _check_keys(where, raw, _ASSERTION_KEYS)
    _validate_path(where, raw["path"])
    op = raw["op"]
    if op not in OPS:
        close = difflib.get_close_matches(str(op), OPS, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise _fail(where, f"unknown op {op!r}{hint}; ops: {', '.join(OPS)}")
    threshold = _parse_threshold_ref(where, raw, tables) if "threshold" in raw else None
    has_value = "value" in raw or threshold is not None
    value = raw.get("value")
    if threshold is not None:
        pass
    elif op in _NO_VALUE_OPS:
        if has_value:
            raise _fail(where, f"op {op} takes no value (path {raw['path']})")
    elif not has_value:
        raise _fail(where, f"op {op} needs a value (path {raw['path']})")
    elif op in ("gt", "ge", "lt", "le") and not _is_number(value):
        raise _fail(where, f"op {op} needs a number, got {value!r}")
    elif op == "in" and not isinstance(value, list):
        raise _fail(where, f"op in needs a list, got {value!r}")
    elif op == "len_eq" and not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        raise _fail(where, f"op len_eq needs a non-negative integer, got {value!r}")
    elif op == "abs_le" and not (
        isinstance(value, list) and len(value) == 2 and all(_is_number(v) for v in value) and value[1] >= 0
    ):
        raise _fail(where, f"op abs_le needs [expected, tolerance>=0], got {value!r}")
    on_fail = raw.get("on_fail", "fail")
    if on_fail not in ("fail", "review"):
        raise _fail(where, f"on_fail must be 'fail' or 'review', got {on_fail!r}")
    return Assertion(
        path=raw["path"], op=op, value=value, why=str(raw.get("why", "")), on_fail=on_fail,
        name=str(raw.get("name", "")), threshold=threshold,
    )


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


def threshold_key(device: Any, dtype: Any) -> str | None:
    """``"<device class>/<dtype>"`` (``"cuda/bfloat16"``), or None when either is unknown."""
    cls = _device_class(device)
    return f"{cls}/{dtype}" if cls and isinstance(dtype, str) and dtype else None


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


# --------------------------------------------------------------------------- paths in records

_LEN_RE = re.compile(r"len\((.+)\)")
_INDEX_RE = re.compile(r"-?\d+")


class _Missing(Exception):
    def __init__(self, actual: str = MISSING_TEXT):
        super().__init__(actual)
        self.actual = actual


def resolve(record: Any, path: str) -> Any:
    """Value at a dotted path (``a.b.0.c``) or ``len(a.b)``; raises KeyError if absent."""
    try:
        return _resolve(record, path)
    except _Missing as e:
        raise KeyError(f"{path}: {e.actual}") from None


def _resolve(record: Any, path: str) -> Any:
    m = _LEN_RE.fullmatch(path)
    if m:
        value = _resolve(record, m.group(1))
        if not isinstance(value, (list, dict, str)):
            raise _Missing(f"<no length: {type(value).__name__}>")
        return len(value)
    cur = record
    for part in path.split("."):
        if isinstance(cur, dict):
            if part not in cur:
                raise _Missing()
            cur = cur[part]
        elif isinstance(cur, list) and _INDEX_RE.fullmatch(part):
            i = int(part)
            if not -len(cur) <= i < len(cur):
                raise _Missing()
            cur = cur[i]
        else:
            raise _Missing()
    return cur


# --------------------------------------------------------------------------- ops


def _equal(a: Any, b: Any) -> bool:
    """JSON equality where true != 1 and lists/objects compare element-wise."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if _is_number(a) and _is_number(b):
        return a == b
    return type(a) is type(b) and a == b


def _num(x: Any) -> float:
    if not _is_number(x):
        raise TypeError(f"not a number: {x!r}")
    return x


def _contains(actual: Any, value: Any) -> bool:
    if isinstance(actual, list):
        return any(_equal(x, value) for x in actual)
    if isinstance(actual, str):
        return isinstance(value, str) and value in actual
    if isinstance(actual, dict):
        return value in actual
    raise TypeError(f"cannot look inside {type(actual).__name__}")


def _len(x: Any) -> int:
    if not isinstance(x, (list, dict, str)):
        raise TypeError(f"no length: {type(x).__name__}")
    return len(x)


def _abs_le(actual: Any, value: list) -> bool:
    a = _num(actual)
    return math.isfinite(a) and abs(a - value[0]) <= value[1]


def _all_eq(actual: Any, value: Any) -> bool:
    if not isinstance(actual, list):
        raise TypeError(f"not a list: {type(actual).__name__}")
    return bool(actual) and all(_equal(x, value) for x in actual)


OPS: dict[str, Callable[[Any, Any], bool]] = {
    "eq": _equal,
    "ne": lambda a, v: not _equal(a, v),
    "gt": lambda a, v: _num(a) > v,
    "ge": lambda a, v: _num(a) >= v,
    "lt": lambda a, v: _num(a) < v,
    "le": lambda a, v: _num(a) <= v,
    "in": lambda a, v: any(_equal(a, x) for x in v),
    "contains": _contains,
    "len_eq": lambda a, v: _len(a) == v,
    "is_true": lambda a, v: a is True,
    "is_false": lambda a, v: a is False,
    "abs_le": _abs_le,
    "all_eq": _all_eq,
    "exists": lambda a, v: True,
}
_NO_VALUE_OPS = ("is_true", "is_false", "exists")


# --------------------------------------------------------------------------- judging

_ACTUAL_LIMIT = 400


def _short(actual: Any) -> Any:
    """Keep huge actual values (long lists) from bloating check tables."""
    text = json.dumps(actual, ensure_ascii=False, default=str)
    return actual if len(text) <= _ACTUAL_LIMIT else text[: _ACTUAL_LIMIT - 3] + "..."


def _result(name: str, passed: bool, expected: Any, actual: Any, why: str, on_fail: str = "fail",
            source: str = "assertion") -> dict:
    status = "pass" if passed else on_fail
    return {"name": name, "passed": passed, "expected": expected, "actual": actual, "why": why,
            "status": status, "source": source}


def _record_threshold_key(record: dict) -> str | None:
    """The threshold key of a record: the envelope's device class and the record's ``facts.dtype``."""
    try:
        dtype = _resolve(record, "facts.dtype")
    except _Missing:
        dtype = None
    return threshold_key(record.get("device"), dtype)


def evaluate(a: Assertion, record: dict, source: str = "assertion") -> dict:
    """One assertion against one record; never raises for bad data. A threshold assertion takes its value
    from its table's entry for the record's device class and ``facts.dtype``; no such entry is a failure."""
    value = a.value
    if a.threshold is not None:
        key = _record_threshold_key(record)
        value = a.threshold.lookup(key)
        if value is None:
            why = (f"no {a.threshold.table} threshold for {key or 'an unknown device class or dtype'} "
                   f"(entries: {', '.join(a.threshold.keys())}): add one to the thresholds table")
            return _result(a.label(), False, a.expected_text(), f"<no threshold for {key}>", why, "fail", source)
        why_prefix = f"[{a.threshold.table} {key}] "
    else:
        why_prefix = ""
    expected = a.expected_text(value)
    try:
        actual = _resolve(record, a.path)
    except _Missing as e:
        return _result(a.label(), False, expected, e.actual, why_prefix + a.why, a.on_fail, source)
    try:
        passed = bool(OPS[a.op](actual, value))
        why = why_prefix + a.why
    except (TypeError, ValueError) as e:
        passed, why = False, f"{why_prefix}{a.why} [{e}]" if a.why else f"{why_prefix}{e}"
    return _result(a.label(), passed, expected, _short(actual), why, a.on_fail, source)


# --------------------------------------------------------------------------- run assertions

_NO_VALUE = object()


def run_assertion(path: str, op: str, value: Any = _NO_VALUE, *, name: str = "", why: str = "",
                  on_fail: str = "fail") -> dict:
    """One assertion a command states over its own record (``facts.x``), for
    ``write_evidence(run_assertions=[...])``: the checkpoints' language, validated now, re-judged by
    ``labkit check`` from the facts every time."""
    raw: dict[str, Any] = {"path": path, "op": op}
    if value is not _NO_VALUE:
        raw["value"] = value
    if name:
        raw["name"] = name
    if why:
        raw["why"] = why
    if on_fail != "fail":
        raw["on_fail"] = on_fail
    _parse_assertion(f"run assertion {name or path!r}", raw)
    return raw


def parse_run_assertions(raw: Any) -> list[Assertion]:
    """The ``run_assertions`` of a record as Assertions; CheckpointError if any is malformed."""
    if not isinstance(raw, list):
        raise CheckpointError(f"run_assertions must be a list, got {type(raw).__name__}")
    return [_parse_assertion(f"run assertion #{i}", a) for i, a in enumerate(raw)]


def _run_checks(record: dict) -> list[dict]:
    """The run's own assertions, re-evaluated from the record's facts; a malformed list is one failure."""
    try:
        assertions = parse_run_assertions(record.get("run_assertions", []))
    except CheckpointError as e:
        return [_result("run_assertions", False, "valid assertions", MISSING_TEXT, str(e), source="run")]
    return [evaluate(a, record, "run") for a in assertions]


def _unjudged_checks(record: dict) -> list[dict]:
    """A file with checks its command judged itself (an older writer's ``unjudged_checks``) FAILs: a stored
    result is not evidence, the judge re-evaluates assertions over facts."""
    if UNJUDGED_KEY not in record:
        return []
    return [_result(UNJUDGED_KEY, False, "none (checks are run assertions over facts)", _short(record[UNJUDGED_KEY]),
                    "checks the command judged itself are not accepted: run it again with this labkit",
                    source="integrity")]


# --------------------------------------------------------------------------- envelope vs checkpoint

_OPTION_VALUE_RE = re.compile(r"-\d[\d.eE+-]*")


def _is_option(word: str) -> bool:
    return word.startswith("-") and len(word) > 1 and not _OPTION_VALUE_RE.fullmatch(word)


def _parse_words(words: list[str]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """(the words before the first option, [(option, the non-option words after it), ...])."""
    i = 0
    while i < len(words) and not _is_option(words[i]):
        i += 1
    head, opts = words[:i], []
    while i < len(words):
        word = words[i]
        i += 1
        if word.startswith("--") and "=" in word:
            name, value = word.split("=", 1)
            opts.append((name, [value]))
            continue
        values = []
        while i < len(words) and not _is_option(words[i]):
            values.append(words[i])
            i += 1
        opts.append((word, values))
    return head, opts


def command_mismatch(expected: list[str], recorded: Any) -> str:
    """Why the recorded command line is not ``expected`` (the checkpoint's command), or "" when it is.

    The subcommand words must be the same; every option the checkpoint names must be given, with its
    value(s), at its last occurrence (later ones win), and a flag must not be undone by ``--no-FLAG``
    after it. Options the checkpoint does not name (``--out``, ``--model``, ``--json``) are free."""
    if not isinstance(recorded, str) or not recorded.strip():
        return "no command line recorded"
    try:
        words = shlex.split(recorded)
    except ValueError as e:
        return f"unparsable command line ({e})"
    want_head, want_opts = _parse_words(list(expected))
    head, opts = _parse_words(words)
    if head != want_head:
        return f"ran {' '.join(head) or '(nothing)'}, not {' '.join(want_head)}"
    for name, values in want_opts:
        negation = "--no-" + name[2:] if name.startswith("--") else None
        last = [(n, v) for n, v in opts if n == name or n == negation]
        if not last or last[-1][0] != name:
            return f"{name} not given" if not last else f"{name} undone by {negation}"
        got = last[-1][1][: len(values)]
        if got != values:
            return f"{name} {' '.join(got) or '(no value)'}, not {name} {' '.join(values)}"
    return ""


def _device_class(device: Any) -> str | None:
    if not isinstance(device, str):
        return None
    return re.split(r"[: ]", device.strip(), maxsplit=1)[0] or None


def _envelope_checks(cp: Checkpoint | None, record: dict) -> list[dict]:
    """What the envelope says about how the data was made, against itself and against ``cp``."""
    out = []
    kind, device, model = record.get("kind"), record.get("device", MISSING_TEXT), record.get("model")
    want = KIND_DEVICE.get(kind) if isinstance(kind, str) else None
    if want is not None:
        out.append(_result("device", _device_class(device) == want, f"a {want} device", device,
                           f"{kind} evidence comes from a {want} device", source="envelope"))
    synthetic = model.get("synthetic") if isinstance(model, dict) else None
    if isinstance(model, dict) and isinstance(synthetic, bool) and "preset" in model:
        made = model.get("preset") is not None
        out.append(_result("model.synthetic", synthetic == made, f"{made} (preset {model.get('preset')!r})",
                           synthetic, "a synthesized model names its preset; real weights name none",
                           source="envelope"))
    if cp is None:
        return out
    if cp.synthetic != "any":
        out.append(_result("model.synthetic required", synthetic is cp.synthetic, cp.synthetic,
                           synthetic if isinstance(model, dict) else MISSING_TEXT,
                           "this checkpoint needs " + ("synthetic weights" if cp.synthetic else "real weights"),
                           source="envelope"))
    problem = command_mismatch(cp.command, record.get("command", MISSING_TEXT))
    out.append(_result("command", not problem, " ".join(cp.command), record.get("command", MISSING_TEXT),
                       problem or "written by the checkpoint's command with its options", source="envelope"))
    return out


# --------------------------------------------------------------------------- judging


def judge(cp: Checkpoint | None, record: Any) -> list[dict]:
    """Judge ``record`` from its own content: identity, kind and schema against ``cp``, the envelope
    (device class, synthetic flag, command), ``cp``'s assertions, then the run's own assertions.

    The writer stores this list (and its verdict) in the file as a copy for humans; ``check_evidence``
    calls it again and never reads that copy for the verdict."""
    if not isinstance(record, dict):
        return [_result("evidence", False, "a JSON object", type(record).__name__, "evidence is not an object",
                        source="integrity")]
    out = []
    if cp is not None:
        out += [
            _result("checkpoint", record.get("checkpoint") == cp.id, cp.id, record.get("checkpoint", MISSING_TEXT),
                    "evidence was written for this checkpoint", source="envelope"),
            _result("kind", record.get("kind") in cp.kind, cp.kind, record.get("kind", MISSING_TEXT),
                    "evidence kind is one this checkpoint accepts", source="envelope"),
            _result("schema_version", record.get("schema_version") == SCHEMA_VERSION, SCHEMA_VERSION,
                    record.get("schema_version", MISSING_TEXT), "evidence schema is current", source="envelope"),
        ]
    out += _envelope_checks(cp, record)
    if cp is not None:
        out.extend(evaluate(a, record) for a in cp.assertions)
    out += _run_checks(record)
    out += _unjudged_checks(record)
    return out


def _status(c: dict) -> str:
    return c.get("status") or ("pass" if c.get("passed") else "fail")


def verdict(checks: list[dict]) -> str:
    """FAIL if any check failed, else NOT-RUN if any could not run, else REVIEW if any needs review or
    nothing was asserted (only envelope checks, or none), else PASS."""
    statuses = [_status(c) for c in checks]
    if "fail" in statuses:
        return "FAIL"
    if "not-run" in statuses:
        return "NOT-RUN"
    asserted = [c for c in checks if c.get("source") != "envelope"]
    if "review" in statuses or not asserted:
        return "REVIEW"
    return "PASS"


#: Checks whose ``why`` is the whole story (reason() says it alone).
_PLAIN_SOURCES = ("integrity", "freshness")


def reason(verdict_: str, checks: list[dict]) -> str:
    """One line saying why a verdict came out the way it did."""
    if verdict_ == "PASS":
        return f"{len(checks)} checks passed"
    want = {"FAIL": "fail", "REVIEW": "review", "NOT-RUN": "not-run"}.get(verdict_)
    for c in checks:
        if _status(c) == want:
            if c.get("name") == "evidence" or c.get("source") in _PLAIN_SOURCES:
                return str(c.get("why", ""))
            actual = json.dumps(c.get("actual"), ensure_ascii=False, default=str)
            text = f"{c.get('name')}: expected {c.get('expected')}, got {actual}"
            return f"{text} ({c['why']})" if c.get("why") else text
    return ""


def _digest_check(record: dict) -> dict:
    stored = record.get(DIGEST_KEY)
    if stored is None:
        return _result("digest", False, "a digest", MISSING_TEXT, "no digest: not written by this labkit version",
                       source="integrity")
    actual = digest(record)
    return _result("digest", stored == actual, stored, actual,
                   "edited after it was written (its body no longer matches its digest)" if stored != actual
                   else "the body is what the writer sealed", source="integrity")


def _stored_verdict_check(record: dict, rejudged: str) -> dict:
    stored = record.get("verdict", MISSING_TEXT)
    ok = stored == rejudged
    why = ("the verdict the file states is the one its facts give" if ok else
           f"the file says {stored}, its facts judge {rejudged}: edited after it was written, "
           "or the checkpoint changed since (run it again)")
    return _result("stored verdict", ok, rejudged, stored, why, source="integrity")


def _freshness_check(record: dict) -> dict | None:
    """NOT-RUN when the engine source changed since the evidence was written (not for reference kinds)."""
    if record.get("kind") in ENGINE_FREE_KINDS:
        return None
    recorded, current = record.get("engine_source_hash"), engine_source_hash()
    ok = recorded == current
    why = ("the engine source is the one the evidence was written with" if ok
           else "stale: engine changed since this evidence was written")
    return _result("engine_source_hash", ok, current, recorded, why, "not-run", source="freshness")


def check_evidence(cp: Checkpoint, path: str | Path | None = None) -> tuple[str, list[dict]]:
    """Judge the evidence file of ``cp`` (default: its ``evidence`` path) from scratch.

    FAIL: unreadable, not sealed by its digest (edited, or an old labkit), a stored verdict its facts do
    not give, or any failed check. NOT-RUN: no file, or stale (the engine source changed since; not for
    ``reference`` evidence, which our engine did not make). Otherwise the verdict of the re-judged checks."""
    return check_file(path if path is not None else cp.evidence_path(), cp)


def check_file(path: str | Path, cp: Checkpoint | None = None) -> tuple[str, list[dict]]:
    """Judge any evidence file from scratch, as :func:`check_evidence` does. With ``cp`` None, a file that
    claims a checkpoint is judged against it (an unknown id FAILs) and one that claims none (a collection,
    an experiment with custom options) by its own run assertions, digest, stored verdict and freshness."""
    path = Path(path)
    if not path.is_file():
        return "NOT-RUN", [_result("evidence", False, "a file", MISSING_TEXT, f"no evidence at {path}", "not-run",
                                   source="integrity")]
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return "FAIL", [_result("evidence", False, "valid JSON", "<unreadable>", f"unreadable evidence at {path}: {e}",
                                source="integrity")]
    if cp is None and isinstance(record, dict) and record.get("checkpoint") is not None:
        try:
            cp = get_checkpoint(str(record["checkpoint"]))
        except CheckpointError as e:
            return "FAIL", [_result("checkpoint", False, "a known checkpoint", record["checkpoint"], str(e),
                                    source="integrity")]
    judged = judge(cp, record)
    if not isinstance(record, dict):
        return "FAIL", judged
    rejudged = verdict(judged)
    integrity = [_digest_check(record)]
    if record.get("checkpoint") == (cp.id if cp is not None else None):  # else it judged another checkpoint
        integrity.append(_stored_verdict_check(record, rejudged))
    fresh = _freshness_check(record)
    checks = integrity + ([fresh] if fresh else []) + judged
    if any(_status(c) == "fail" for c in integrity):
        return "FAIL", checks
    if fresh is not None and _status(fresh) == "not-run":
        return "NOT-RUN", checks
    return rejudged, checks


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
        "`2gpu` needs two.",
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
