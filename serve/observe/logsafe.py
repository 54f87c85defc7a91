"""Log lines a client cannot forge: every value that reaches a log line is shown escaped.

A JSON key, a request id, a model name or an error message may hold CR, LF, ESC (ANSI screen codes) or a
lone UTF-16 surrogate. Written raw, one request becomes several log lines or rewrites the operator's terminal.
:func:`safe` shows C0 and C1 control characters, DEL, the Unicode line separators and lone surrogates as
``\\r``, ``\\n``, ``\\t``, ``\\xNN`` or ``\\uNNNN``; :class:`EscapeFilter` applies it to a log record's final
message (the format's arguments included), so a line stays one line whatever a value holds. The JSONL event log
is escaped the same way by :func:`serve.observe.events.dumps_line` (JSON ``\\uNNNN`` escapes).

Native code writes to file descriptor 2 itself, around Python's logging: xgrammar's C++ warnings quote the
schema they compile (a ``$ref`` URI holding CR and ESC forged a whole line). :func:`capture_native_stderr`
makes descriptor 2 a pipe whose lines reach the real stderr escaped by :func:`safe`, each behind
``native: `` (an LF inside a native message cannot be told from a line end, so no line from there can pass
for one of the server's own).
"""
from __future__ import annotations

import logging
import os
import re
import sys
import threading

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


_CAPTURED: list[int] = []          # the real stderr's descriptor, once captured
_READERS: list[threading.Thread] = []   # the thread that forwards the pipe's lines
_LINE_MAX = 64 * 1024              # a longer unfinished line is written (escaped) as it is
NATIVE = "native: "                # what every line written to descriptor 2 by native code starts with


def capture_native_stderr() -> None:
    """From now on what anything writes to file descriptor 2 (native libraries, child processes that inherit
    it) reaches the real stderr one escaped line at a time behind ``native: ``, through a pipe and a thread
    that reads it.
    Python's own ``sys.stderr`` (and the root logger's handlers on it) move to the real stderr: their lines
    are escaped already (:class:`EscapeFilter`). Once per process, and only where ``sys.stderr`` is descriptor 2
    itself (not under a test runner that replaced it)."""
    try:
        direct = sys.stderr.fileno() == 2
    except (AttributeError, OSError, ValueError):
        direct = False
    if _CAPTURED or not direct:
        return
    sys.stderr.flush()
    real = os.dup(2)
    r, w = os.pipe()
    os.dup2(w, 2)
    os.close(w)
    _CAPTURED.append(real)
    old = sys.stderr
    sys.stderr = open(real, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is old:
            handler.setStream(sys.stderr)
    reader = threading.Thread(target=_forward, args=(r, real), name="native-stderr", daemon=True)
    _READERS.append(reader)
    reader.start()


def release_native_stderr(timeout: float = 1.0) -> None:
    """Give descriptor 2 back to the real stderr and wait (``timeout`` s at most) until the reader has written
    out what the pipe still held: a process that ends with ``os._exit`` would drop those lines. The pipe ends
    when no process holds its writing end any more (a child that inherited descriptor 2 and still runs keeps it
    open: then the wait is cut at ``timeout``)."""
    if not _CAPTURED:
        return
    os.dup2(_CAPTURED[0], 2)
    for reader in _READERS:
        reader.join(timeout)


def _forward(r: int, real: int) -> None:
    rest = b""
    while True:
        try:
            chunk = os.read(r, 65536)
        except OSError:
            return
        if not chunk:
            return
        *lines, rest = (rest + chunk).split(b"\n")
        if len(rest) > _LINE_MAX:
            lines.append(rest)
            rest = b""
        if lines:
            text = "".join(NATIVE + safe(line.decode("utf-8", "backslashreplace")) + "\n" for line in lines)
            try:
                os.write(real, text.encode("utf-8"))
            except OSError:
                return
