"""Log lines a client cannot forge: every value that reaches a log line is shown escaped.

A JSON key, a request id, a model name or an error message may hold CR, LF, ESC (ANSI screen codes) or a
lone UTF-16 surrogate. Written raw, one request becomes several log lines or rewrites the operator's terminal.
:func:`safe` shows C0 and C1 control characters, DEL, the Unicode line separators and lone surrogates as
``\\r``, ``\\n``, ``\\t``, ``\\xNN`` or ``\\uNNNN``; :class:`EscapeFilter` applies it to a log record's final
message (the format's arguments included), so a line stays one line whatever a value holds. The JSONL event log
is escaped the same way by :func:`serve.observe.events.dumps_line` (JSON ``\\uNNNN`` escapes).
"""
from __future__ import annotations

import logging
import re

UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")
_SHORT = {"\r": "\\r", "\n": "\\n", "\t": "\\t"}


def _escape(m: re.Match) -> str:
    c = m.group()
    o = ord(c)
    return _SHORT.get(c) or (f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}")


def safe(value) -> str:
    """``value`` as text for one log line: control characters and lone surrogates escaped."""
    text = value if isinstance(value, str) else str(value)
    return UNSAFE.sub(_escape, text)


class EscapeFilter(logging.Filter):
    """Escapes a record's message (with its arguments) before any handler formats it."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:                   # a bad format string: show it as it is, escaped
            message = f"{record.msg!r} % {record.args!r}"
        record.msg, record.args = safe(message), None
        return True


def install(*loggers: logging.Logger | logging.Handler) -> None:
    """Add one EscapeFilter to each logger (records logged on it) or handler (every record it writes)."""
    for target in loggers:
        if not any(isinstance(f, EscapeFilter) for f in target.filters):
            target.addFilter(EscapeFilter())
