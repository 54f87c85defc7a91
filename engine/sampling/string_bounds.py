"""String schemas with both a ``pattern`` and ``minLength`` / ``maxLength``, bounded whole.

xgrammar 0.2.9 takes a string schema's ``pattern`` and drops its length bounds (it warns "pattern combined with
minLength/maxLength is not supported"). :func:`bound` rewrites each such string schema of a JSON schema (or of
anything holding schemas, e.g. a structural tag) so that its strings are exactly those the pattern matches whose
length is within the bounds, and drops the bounds (the pattern as xgrammar reads it: the whole string must match,
``^`` / ``$`` at its ends change nothing, and the string holds no ``"``, ``\\`` or control character):

- the pattern's lengths already within the bounds: the bound says nothing more and is dropped;
- none of them within the bounds: refused (the pattern matches no string of those lengths);
- a sequence with exactly one part of varying length (the rest of fixed length): that part is bounded with what
  the rest leaves, as a pattern; that part may be a repetition of something of fixed length (its counts
  narrowed, e.g. ``^[A-Z]{2}-\\d+$`` with maxLength 6 gives ``[A-Z]{2}-\\d{1,3}``) or a choice between
  alternatives (each bounded the same way, those that cannot fit dropped);
- any other pattern (``^\\w+@\\w+\\.com$``: two parts of varying length) gets a grammar of its own: the product of
  the pattern's position automaton (its repetitions unrolled) with a count of the characters so far, as EBNF
  rules, one per state from which the string can still end. The schema then carries a placeholder pattern,
  and :func:`splice` puts the rules in place of the placeholder's rule in the EBNF xgrammar writes for it.
  At most ``MAX_POSITIONS`` positions and ``MAX_STATES`` states (a maxLength of a few hundred over a pattern of
  a few parts is a few thousand); past them, refused.

Inline flags (``(?i)``), back references and lookarounds are refused. Each refusal is a ``ValueError`` naming
where in the schema the string is, which the caller turns into a 400. The pattern is read with Python's own
regex parser (``re._parser``) and written back from what it parsed; a pattern that does not come back the same
when written and read again is refused rather than changed.
"""
from __future__ import annotations

import re
import secrets
import warnings
from re import _constants as C
from re import _parser as sre
from typing import Any, Callable

#: Schema keywords whose values are data, not schemas (never rewritten).
DATA = frozenset({"const", "enum", "default", "examples"})
_CATEGORIES = {C.CATEGORY_DIGIT: r"\d", C.CATEGORY_NOT_DIGIT: r"\D", C.CATEGORY_SPACE: r"\s",
               C.CATEGORY_NOT_SPACE: r"\S", C.CATEGORY_WORD: r"\w", C.CATEGORY_NOT_WORD: r"\W"}
_SPECIAL = frozenset(r"\.^$*+?{}[]|()")
_SPECIAL_IN_CLASS = frozenset("\\]^-[")


#: What the regex parser's other nodes are, in a refusal's words.
_UNSUPPORTED = {"GROUPREF": "back references", "GROUPREF_EXISTS": "conditional groups", "ASSERT": "lookarounds",
                "ASSERT_NOT": "lookarounds", "AT": "anchors inside the pattern and word boundaries",
                "ATOMIC_GROUP": "atomic groups", "POSSESSIVE_REPEAT": "possessive repetitions"}


class _Refused(Exception):
    """The pattern cannot be bounded (the reason in the message)."""


def bound(node: Any) -> tuple[Any, dict[str, Callable[[str], str]]]:
    """``node`` (a schema, or anything holding schemas) with every string schema that has both a ``pattern`` and a
    length bound rewritten (the rest unchanged: a new object only where something changed), and the grammars of
    the strings that no pattern can bound: {the placeholder pattern standing for the string: rules(name)}, for
    :func:`splice` (empty: the schema alone says it all)."""
    grammars: dict[str, Callable[[str], str]] = {}
    return _bound(node, "", grammars), grammars


def splice(ebnf: str, grammars: dict[str, Callable[[str], str]]) -> str:
    """The EBNF xgrammar wrote for a schema :func:`bound` gave, with each placeholder string's rule replaced by its
    grammar of bounded length."""
    for placeholder, rules in grammars.items():
        found = re.compile(rf'^([\w-]+) ::= \(*Regex\("{placeholder}", json_string=true\)\)*$', re.M)
        names = set(found.findall(ebnf))
        taken = set(re.findall(r"^([\w-]+) ::=", ebnf, re.M))
        if not names or any(re.fullmatch(rf"{re.escape(name)}_bl\d+", t) for name in names for t in taken):
            raise ValueError("a string with a pattern and a length bound has no rule of its own in the grammar")
        ebnf = found.sub(lambda m: rules(m.group(1)), ebnf)
    return ebnf


def _bound(node: Any, path: str, grammars: dict) -> Any:
    if isinstance(node, list):
        out = [_bound(v, f"{path}[{i}]", grammars) for i, v in enumerate(node)]
        return node if all(a is b for a, b in zip(out, node)) else out
    if not isinstance(node, dict):
        return node
    out = {k: v if k in DATA else _bound(v, f"{path}.{k}" if path else str(k), grammars) for k, v in node.items()}
    if _bounded_string(node):
        m, n = node.get("minLength", 0), node.get("maxLength")
        out["pattern"] = _bound_pattern(node["pattern"], m, n, path, grammars)
        out.pop("minLength", None)
        out.pop("maxLength", None)
    return node if out.keys() == node.keys() and all(out[k] is node[k] for k in node) else out


def _bounded_string(node: dict) -> bool:
    t = node.get("type")
    is_string = t == "string" or (isinstance(t, list) and "string" in t)
    bounds = [node[k] for k in ("minLength", "maxLength") if k in node]
    return (is_string and isinstance(node.get("pattern"), str) and bool(bounds)
            and all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in bounds))


def _bound_pattern(pattern: str, m: int, n: int | None, path: str, grammars: dict) -> str:
    """The pattern that carries the bounds: narrowed, or a placeholder whose grammar goes to ``grammars``."""
    where = f"the string schema at {path or 'the root'}"
    shown = pattern if len(pattern) <= 80 else pattern[:77] + "..."
    lengths = f"length {m} to {n}" if n is not None else f"length {m} or more"
    try:
        seq = _read(pattern)
        try:
            bounded = _bound_seq(seq, m, n)
        except _Refused:                                   # no pattern says it: a grammar of its own
            rules = product_rules(seq, m, n, "s")
            if rules is None:
                bounded = None
            else:
                placeholder = f"xgrbound{secrets.token_hex(8)}"
                grammars[placeholder] = lambda name: product_rules(seq, m, n, name)
                return placeholder
    except RecursionError:
        raise ValueError(f"{where}: its pattern {shown!r} is nested too deeply to combine with "
                         f"minLength/maxLength") from None
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
        except (re.error, OverflowError, RecursionError) as e:
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
        try:
            again = _seq(list(sre.parse(_write(seq)).data))
        except (re.error, OverflowError) as e:
            raise _Refused(f"it could not be rewritten faithfully: {e}") from None
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
            raise _Refused(f"{_UNSUPPORTED.get(str(op), str(op).lower())} are not supported")
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


# --- a pattern no narrowing can bound: the product of its automaton with a length counter, as EBNF -------------

#: Most positions (characters of the pattern, repetitions unrolled) and most states of the product.
MAX_POSITIONS = 2048
MAX_STATES = 8192
#: The most compile work a grammar of its own may ask for: each alternative of each rule counts 1, or
#: ``WIDE_COST`` when its class holds more than ``WIDE`` characters (xgrammar's token masks for such a class take
#: about 8 times as long to compile: a token walks deep into the rules after it). 3,000 is about 7 s of one
#: thread over Qwen3's vocabulary on a small CPU, within the compile budget.
MAX_COST = 3000
WIDE, WIDE_COST = 128, 8
_TOP = 0x10FFFF
#: xgrammar's classes (its regex reads \d, \w, \s so, whatever Python's re does).
_CLASS_RANGES = {r"\d": [(0x30, 0x39)], r"\w": [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)],
                 r"\s": [(0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
                         (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF)]}
#: What a JSON string cannot hold raw (xgrammar's patterned strings take no escapes: these never appear).
_NOT_JSON = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]


def _merge(ranges: list) -> list:
    out: list = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _complement(ranges: list) -> list:
    out, at = [], 0
    for lo, hi in _merge(ranges):
        if lo > at:
            out.append((at, lo - 1))
        at = hi + 1
    return out + ([(at, _TOP)] if at <= _TOP else [])


def _chars(unit: tuple) -> list:
    """The code points a unit node matches as xgrammar reads it, less those a JSON string cannot hold raw."""
    kind = unit[0]
    if kind == "lit":
        ranges = [(unit[1], unit[1])]
    elif kind == "notlit":
        ranges = _complement([(unit[1], unit[1])])
    elif kind == "any":
        ranges = [(0, _TOP)]
    else:
        ranges = []
        for item in unit[2]:
            if item[0] == "lit":
                ranges.append((item[1], item[1]))
            elif item[0] == "range":
                ranges.append((item[1], item[2]))
            else:
                cat = item[1]
                ranges += _CLASS_RANGES[cat.lower()] if cat.islower() else _complement(_CLASS_RANGES[cat.lower()])
        if unit[1]:
            ranges = _complement(ranges)
    return _complement(_complement(ranges) + _NOT_JSON)              # ranges less _NOT_JSON


def _ebnf_class(ranges: list) -> str:
    def esc(c: int) -> str:
        return chr(c) if chr(c).isascii() and chr(c).isalnum() else (f"\\u{c:04x}" if c <= 0xFFFF else f"\\U{c:08x}")
    return "[" + "".join(esc(lo) if lo == hi else f"{esc(lo)}-{esc(hi)}" for lo, hi in ranges) + "]"


class _Glushkov:
    """The position automaton of a pattern tree: each unit node (a character or class) a position; ``units`` its
    characters as an EBNF class (None: none a JSON string holds), ``follow`` the positions that may come next."""

    def __init__(self):
        self.units: list[str | None] = []
        self.cost: list[int] = []
        self.follow: list[set[int]] = []

    def build(self, seq: tuple) -> tuple[set[int], set[int], bool]:
        """(first positions, last positions, matches the empty string) of ``seq``, positions made as needed."""
        first: set[int] = set()
        last: set[int] = set()
        nullable = True
        for node in seq:
            f, l, n = self._node(node)
            for p in last:
                self.follow[p] |= f
            first = first | f if nullable else first
            last = l | last if n else l
            nullable = nullable and n
        return first, last, nullable

    def _node(self, node: tuple) -> tuple[set[int], set[int], bool]:
        kind = node[0]
        if kind == "branch":
            parts = [self.build(alt) for alt in node[1]]
            return (set().union(*(f for f, _, _ in parts)), set().union(*(l for _, l, _ in parts)),
                    any(n for _, _, n in parts))
        if kind == "repeat":
            _, lo, hi, sub = node
            more = (("opt", sub, hi - lo),) if hi is not None else (("star", sub),)
            return self.build((("group", sub),) * lo + more)
        if kind == "group":
            return self.build(node[1])
        if kind == "star":
            f, l, _ = self.build(node[1])
            for p in l:
                self.follow[p] |= f
            return f, l, True
        if kind == "opt":                        # up to k more copies, in order: (x (x (x)?)?)?
            _, sub, k = node
            if k == 0:
                return set(), set(), True
            f, l, _ = self.build(sub + (("opt", sub, k - 1),))
            return f, l, True
        if len(self.units) >= MAX_POSITIONS:
            raise _Refused(f"it has more than {MAX_POSITIONS} character positions once its repetitions are unrolled")
        chars = _chars(node)
        self.units.append(_ebnf_class(chars) if chars else None)
        self.cost.append(WIDE_COST if sum(hi - lo + 1 for lo, hi in chars) > WIDE else 1)
        self.follow.append(set())
        p = len(self.units) - 1
        return {p}, {p}, False


def product_rules(seq: tuple, m: int, n: int | None, name: str) -> str | None:
    """EBNF rules (the first named ``name``) for the content of a JSON string that ``seq`` matches whole and whose
    length is m to n (n None: no limit): states (position, characters so far), the count held at m when there is
    no upper bound; only states from which the string can still end. None: no such string."""
    g = _Glushkov()
    first, last, nullable = g.build(seq)
    start = -1

    def step(k: int) -> int | None:
        if n is None:
            return min(k + 1, m)
        return k + 1 if k + 1 <= n else None

    states, edges, todo = {(start, 0): 0}, {}, [(start, 0)]
    while todo:
        p, k = todo.pop()
        k2 = step(k)
        out = []
        for q in sorted(first if p == start else g.follow[p]) if k2 is not None else ():
            if g.units[q] is None:
                continue
            if (q, k2) not in states:
                if len(states) >= MAX_STATES:
                    raise _Refused(f"bounding its length takes more than {MAX_STATES} grammar states")
                states[(q, k2)] = len(states)
                todo.append((q, k2))
            out.append((q, k2))
        edges[(p, k)] = out
    accepting = {s for s in states if (nullable if s[0] == start else s[0] in last) and s[1] >= m}
    live, changed = set(accepting), True          # the states from which an accepting one can be reached
    while changed:
        changed = False
        for s, out in edges.items():
            if s not in live and any(t in live for t in out):
                live.add(s)
                changed = True
    if (start, 0) not in live:
        return None
    cost = sum(g.cost[t[0]] for s in live for t in edges[s] if t in live)
    if cost > MAX_COST:
        raise _Refused(f"bounding its length takes a grammar of {cost} units of compile work, past {MAX_COST} "
                       f"(a smaller maxLength, or narrower classes than . or [^...], fit)")

    def rule(s: tuple) -> str:
        return name if s == (start, 0) else f"{name}_bl{states[s]}"

    lines = []
    for s in sorted(live, key=states.get):
        alts = [f"({g.units[t[0]]} {rule(t)})" for t in edges[s] if t in live]
        lines.append(f"{rule(s)} ::= " + " | ".join(alts + (['""'] if s in accepting else [])))
    return "\n".join(lines)
