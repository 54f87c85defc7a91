"""The assertion language: paths into a record, ops, assertions and threshold references, parsed and evaluated.

An assertion is an object over an evidence record::

    {"path": "facts.steps.0.seqs.0.total", "op": "eq", "value": 3, "why": "..."}

Paths are dotted keys with integer list indices; ``len(<path>)`` takes a length; a ``*`` segment takes every
element of a list (or value of an object) and gives the list of what the rest of the path reads in each
(``facts.per_rate.*.errored`` with ``all_eq`` bounds every rate). A missing path, in any element, is a
failed check (actual ``"<missing>"``), never an exception. An assertion may carry
``"on_fail": "review"`` to turn its failure into REVIEW instead of FAIL, or take its value from a
threshold table (``"threshold": "table.metric"``, by the record's device class and ``facts.dtype``).
``"literal"`` says why a fixed value (or one the command line also holds) judges the engine rather than
echoing the command's inputs; tests/lab/checks/test_verdicts.py asks it of every such assertion of a GPU checkpoint.

The checkpoints (``labkit.checks.spec``), the runs' own assertions (``run_assertion``, stored in the
evidence file as ``run_assertions``) and the threshold tables all speak this language; ``evaluate`` is
its one evaluator and the judge (``labkit.checks.judging``) calls nothing else to weigh an assertion.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Callable

from labkit.errors import UserError

MISSING_TEXT = "<missing>"
_ASSERTION_KEYS = {"required": ("path", "op"),
                   "optional": ("value", "threshold", "why", "on_fail", "name", "literal")}
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
    literal: str = ""   # why a fixed value (or a value the command line also holds) judges the engine

    def label(self) -> str:
        return self.name or self.path

    def expected_text(self, value: Any = None) -> str:
        if self.op in _NO_VALUE_OPS:
            return self.op
        if self.threshold is not None:
            return f"{self.op} {self.threshold.ref}" + (f" = {json.dumps(value)}" if value is not None else "")
        return f"{self.op} {json.dumps(self.value, ensure_ascii=False)}"


# --------------------------------------------------------------------------- parsing


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
    literal = raw.get("literal", "")
    if not isinstance(literal, str) or ("literal" in raw and not literal.strip()):
        raise _fail(where, f"literal must say why the fixed value stays, got {literal!r}")
    return Assertion(
        path=raw["path"], op=op, value=value, why=str(raw.get("why", "")), on_fail=on_fail,
        name=str(raw.get("name", "")), threshold=threshold, literal=literal,
    )


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
    return _walk(record, path.split("."))


def _walk(cur: Any, parts: list[str]) -> Any:
    for i, part in enumerate(parts):
        if part == "*":
            if isinstance(cur, list):
                items = cur
            elif isinstance(cur, dict):
                items = list(cur.values())
            else:
                raise _Missing()
            return [_walk(item, parts[i + 1:]) for item in items]
        if isinstance(cur, dict):
            if part not in cur:
                raise _Missing()
            cur = cur[part]
        elif isinstance(cur, list) and _INDEX_RE.fullmatch(part):
            index = int(part)
            if not -len(cur) <= index < len(cur):
                raise _Missing()
            cur = cur[index]
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


# --------------------------------------------------------------------------- evaluating

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


def _device_class(device: Any) -> str | None:
    if not isinstance(device, str):
        return None
    return re.split(r"[: ]", device.strip(), maxsplit=1)[0] or None


def threshold_key(device: Any, dtype: Any) -> str | None:
    """``"<device class>/<dtype>"`` (``"cuda/bfloat16"``), or None when either is unknown."""
    cls = _device_class(device)
    return f"{cls}/{dtype}" if cls and isinstance(dtype, str) and dtype else None


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
