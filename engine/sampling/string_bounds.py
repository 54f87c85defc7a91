"""String schemas with both a ``pattern`` and ``minLength`` / ``maxLength``, as one pattern xgrammar enforces whole.

xgrammar 0.2.9 takes a string schema's ``pattern`` and drops its length bounds (it warns "pattern combined with
minLength/maxLength is not supported"). :func:`bound` rewrites each such string schema of a JSON schema (or of
anything holding schemas, e.g. a structural tag) so that the pattern itself carries the bound, and drops the
bound: the intersection of the pattern's language with the lengths allowed, written as a pattern.

How (the pattern as xgrammar reads it: the whole string must match, ``^`` / ``$`` at its ends change nothing):
- the pattern's lengths already within the bounds: the bound says nothing more and is dropped;
- none of them within the bounds: refused (the pattern matches no string of those lengths);
- otherwise the part of the pattern whose length varies is bounded: a sequence with exactly one part of varying
  length (the rest of fixed length) bounds that part with what the rest leaves; that part may be a repetition of
  something of fixed length (its counts narrowed, e.g. ``^[A-Z]{2}-\\d+$`` with maxLength 6 gives
  ``[A-Z]{2}-\\d{1,3}``) or a choice between alternatives (each bounded the same way, those that cannot fit
  dropped). A pattern with two or more parts of varying length in one sequence (``[a-z]+@[a-z]+``), a repetition
  of something of varying length, inline flags (``(?i)``), back references or lookarounds is refused: each a
  ``ValueError`` naming where in the schema the string is, which the caller turns into a 400.

The pattern is read with Python's own regex parser (``re._parser``) and written back from what it parsed; a
pattern that does not come back the same when written and read again is refused rather than changed.
"""
from __future__ import annotations

import re
import warnings
from re import _constants as C
from re import _parser as sre
from typing import Any

#: Schema keywords whose values are data, not schemas (never rewritten).
DATA = frozenset({"const", "enum", "default", "examples"})
_CATEGORIES = {C.CATEGORY_DIGIT: r"\d", C.CATEGORY_NOT_DIGIT: r"\D", C.CATEGORY_SPACE: r"\s",
               C.CATEGORY_NOT_SPACE: r"\S", C.CATEGORY_WORD: r"\w", C.CATEGORY_NOT_WORD: r"\W"}
_SPECIAL = frozenset(r"\.^$*+?{}[]|()")
_SPECIAL_IN_CLASS = frozenset("\\]^-[")


class _Refused(Exception):
    """The pattern cannot be bounded (the reason in the message)."""


def bound(node: Any, path: str = "") -> Any:
    """``node`` (a schema, or anything holding schemas) with every string schema that has both a ``pattern`` and
    a length bound rewritten as one pattern; the rest unchanged (a new object only where something changed)."""
    if isinstance(node, list):
        out = [bound(v, f"{path}[{i}]") for i, v in enumerate(node)]
        return node if all(a is b for a, b in zip(out, node)) else out
    if not isinstance(node, dict):
        return node
    out = {k: v if k in DATA else bound(v, f"{path}.{k}" if path else str(k)) for k, v in node.items()}
    if _bounded_string(node):
        m, n = node.get("minLength", 0), node.get("maxLength")
        out["pattern"] = _bound_pattern(node["pattern"], m, n, path)
        out.pop("minLength", None)
        out.pop("maxLength", None)
    return node if out.keys() == node.keys() and all(out[k] is node[k] for k in node) else out


def _bounded_string(node: dict) -> bool:
    t = node.get("type")
    is_string = t == "string" or (isinstance(t, list) and "string" in t)
    bounds = [node[k] for k in ("minLength", "maxLength") if k in node]
    return (is_string and isinstance(node.get("pattern"), str) and bool(bounds)
            and all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in bounds))


def _bound_pattern(pattern: str, m: int, n: int | None, path: str) -> str:
    where = f"the string schema at {path or 'the root'}"
    shown = pattern if len(pattern) <= 80 else pattern[:77] + "..."
    lengths = f"length {m} to {n}" if n is not None else f"length {m} or more"
    try:
        seq = _read(pattern)
        bounded = _bound_seq(seq, m, n)
    except _Refused as e:
        raise ValueError(f"{where}: its pattern {shown!r} cannot be combined with minLength/maxLength ({e}); "
                         f"put the length in the pattern instead (e.g. [a-z]{{3,8}})") from None
    if bounded is None:
        raise ValueError(f"{where}: its pattern {shown!r} matches no string of {lengths} (minLength/maxLength)")
    return pattern if bounded is seq else _write(bounded)


# --- the pattern as a small tree --------------------------------------------------------------------------------
# seq: a tuple of nodes; a node: ("lit", code) | ("notlit", code) | ("any",) | ("in", negate, items)
# | ("branch", (seq, ...)) | ("repeat", lo, hi or None, seq). A class item: ("lit", code) | ("range", a, b)
# | ("cat", category). Groups are spliced into their sequence (a group without a quantifier changes nothing).

def _read(pattern: str) -> tuple:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            parsed = sre.parse(pattern)
        except re.error as e:
            raise _Refused(f"it is not a regular expression Python reads: {e}") from None
    if parsed.state.flags & ~C.SRE_FLAG_UNICODE:
        raise _Refused("inline flags are not supported")
    items = list(parsed.data)
    if items and items[0] == (C.AT, C.AT_BEGINNING):
        items = items[1:]
    if items and items[-1] == (C.AT, C.AT_END):
        items = items[:-1]
    seq = _seq(items)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = _seq(list(sre.parse(_write(seq)).data))
    if again != seq:
        raise _Refused("it could not be rewritten faithfully")
    return seq


def _seq(items: list) -> tuple:
    out: list = []
    for op, av in items:
        if op is C.LITERAL:
            out.append(("lit", av))
        elif op is C.NOT_LITERAL:
            out.append(("notlit", av))
        elif op is C.ANY:
            out.append(("any",))
        elif op is C.IN:
            out.append(_class(av))
        elif op is C.SUBPATTERN:
            _, add, drop, sub = av
            if add or drop:
                raise _Refused("inline flags are not supported")
            out.extend(_seq(list(sub.data)))
        elif op is C.BRANCH:
            alts = tuple(_seq(list(a.data)) for a in av[1])
            if len(alts) == 1:
                out.extend(alts[0])
            else:
                out.append(("branch", alts))
        elif op in (C.MAX_REPEAT, C.MIN_REPEAT):           # lazy or greedy: the same strings
            lo, hi, sub = av
            out.append(("repeat", lo, None if hi is C.MAXREPEAT else hi, _seq(list(sub.data))))
        else:
            raise _Refused(f"{str(op).lower()} is not supported")
    return tuple(out)


def _class(items: list) -> tuple:
    negate, out = False, []
    for op, av in items:
        if op is C.NEGATE:
            negate = True
        elif op is C.LITERAL:
            out.append(("lit", av))
        elif op is C.RANGE:
            out.append(("range", av[0], av[1]))
        elif op is C.CATEGORY and av in _CATEGORIES:
            out.append(("cat", _CATEGORIES[av]))
        else:
            raise _Refused(f"{str(av).lower()} in a character class is not supported")
    return ("in", negate, tuple(out))


def _width(node_or_seq) -> tuple[int, int | None]:
    """(fewest, most) characters a node or sequence matches; most None: no limit."""
    if isinstance(node_or_seq, tuple) and (not node_or_seq or isinstance(node_or_seq[0], tuple)):
        lo, hi = 0, 0
        for node in node_or_seq:
            a, b = _width(node)
            lo, hi = lo + a, None if hi is None or b is None else hi + b
        return lo, hi
    kind = node_or_seq[0]
    if kind == "branch":
        ws = [_width(a) for a in node_or_seq[1]]
        his = [b for _, b in ws]
        return min(a for a, _ in ws), None if None in his else max(his)
    if kind == "repeat":
        _, lo, hi, sub = node_or_seq
        a, b = _width(sub)
        if b == 0:
            return 0, 0
        return lo * a, None if hi is None or b is None else hi * b
    return 1, 1


def _bound_seq(seq: tuple, m: int, n: int | None) -> tuple | None:
    """``seq`` restricted to matches of m to n characters (n None: no limit); None: no match is left."""
    lo, hi = _width(seq)
    if lo >= m and (n is None or (hi is not None and hi <= n)):
        return seq
    if (hi is not None and hi < m) or (n is not None and lo > n):
        return None
    varying = [i for i, node in enumerate(seq) if _width(node)[0] != _width(node)[1]]
    if len(varying) != 1:
        raise _Refused("it has more than one part of varying length in one sequence")
    i = varying[0]
    fixed = sum(_width(node)[0] for j, node in enumerate(seq) if j != i)
    m2, n2 = max(0, m - fixed), None if n is None else n - fixed
    node = seq[i]
    if node[0] == "branch":
        alts = [a for a in (_bound_seq(alt, m2, n2) for alt in node[1]) if a is not None]
        if not alts:
            return None
        new: tuple = ("branch", tuple(alts)) if len(alts) > 1 else alts[0]
        return seq[:i] + ((new,) if len(alts) > 1 else new) + seq[i + 1:]
    if node[0] == "repeat":
        _, rlo, rhi, sub = node
        w, w_hi = _width(sub)
        if w != w_hi or w == 0:
            raise _Refused("it repeats something of varying length")
        lo2 = max(rlo, -(-m2 // w))
        hi2 = n2 // w if n2 is not None else None
        if rhi is not None:
            hi2 = rhi if hi2 is None else min(rhi, hi2)
        if hi2 is not None and lo2 > hi2:
            return None
        return seq[:i] + (("repeat", lo2, hi2, sub),) + seq[i + 1:]
    raise _Refused("its part of varying length cannot be bounded")        # not reached: units are fixed


def _write(seq: tuple) -> str:
    return "".join(_write_node(node) for node in seq)


def _write_node(node: tuple) -> str:
    kind = node[0]
    if kind == "lit":
        return _char(node[1], _SPECIAL)
    if kind == "notlit":
        return "[^" + _char(node[1], _SPECIAL_IN_CLASS) + "]"
    if kind == "any":
        return "."
    if kind == "in":
        if not node[1] and len(node[2]) == 1 and node[2][0][0] == "cat":
            return node[2][0][1]                                # \d, not [\d]
        parts = []
        for item in node[2]:
            if item[0] == "lit":
                parts.append(_char(item[1], _SPECIAL_IN_CLASS))
            elif item[0] == "range":
                parts.append(_char(item[1], _SPECIAL_IN_CLASS) + "-" + _char(item[2], _SPECIAL_IN_CLASS))
            else:
                parts.append(item[1])
        return "[" + ("^" if node[1] else "") + "".join(parts) + "]"
    if kind == "branch":
        return "(?:" + "|".join(_write(a) for a in node[1]) + ")"
    _, lo, hi, sub = node
    body = _write(sub)
    if not (len(sub) == 1 and sub[0][0] in ("lit", "notlit", "any", "in", "branch")):
        body = "(?:" + body + ")"
    if hi is None:
        q = {0: "*", 1: "+"}.get(lo, f"{{{lo},}}")
    elif lo == hi:
        q = f"{{{lo}}}"
    else:
        q = "?" if (lo, hi) == (0, 1) else f"{{{lo},{hi}}}"
    return body + q


def _char(code: int, special: frozenset) -> str:
    ch = chr(code)
    if ch in special:
        return "\\" + ch
    if ch == " " or (ch.isprintable() and not ch.isspace()):
        return ch
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"
