"""JSON strings that stay JSON under ``minLength`` / ``maxLength``.

xgrammar 0.2.9 writes a string schema with a length bound as ``"\\"" name_characters{m, n} "\\""`` whose
character rule is ``[^\\"\\\\\\r\\n]``: every other control character (tab, U+0001, ...) passes raw, so the output
can be invalid JSON (upstream xgrammar issue 800). Every other string rule of xgrammar excludes U+0000-U+001F.
:func:`guard` rewrites those character rules of a grammar's EBNF to exclude them too; :func:`affected` says
whether a schema's JSON text can hold such a bound at all (only then is the grammar written out and guarded).
"""
from __future__ import annotations

import re

#: A length-bounded string's character rule as xgrammar 0.2.9 prints it.
_CHARACTERS = re.compile(r'^([\w-]+_characters ::= \(\()\[\^\\"\\\\\\r\\n\](\)\))$', re.M)
#: The same rule without control characters (what xgrammar's basic_string_sub allows, escapes aside).
_JSON_CHARACTER = '[^\\0-\\x1f\\"\\\\]'


def affected(schema_text: str) -> bool:
    """Whether a schema's (or structural tag's) JSON text mentions a string length bound."""
    return '"minLength"' in schema_text or '"maxLength"' in schema_text


def guard(ebnf: str) -> str:
    """``ebnf`` with each length-bounded string's characters limited to what JSON allows raw."""
    return _CHARACTERS.sub(lambda m: m.group(1) + _JSON_CHARACTER + m.group(2), ebnf)
