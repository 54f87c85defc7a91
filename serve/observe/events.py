"""Event records and the JSONL log they go to.

Every line of a service log is one JSON object. The first line is the header
(``{"event": "header", ...evidence envelope..., "role": ...}``); every other line is an event::

    {"event": "token", "request_id": "r003", "worker_id": "worker-0", "round": 17,
     "t_ns": 123456789, "observer": "engine", "index": 2, "token_id": 1234}

Common fields: ``event`` (submitted | admitted | token | finished, plus ``step`` and ``worker``
records of the engine), ``request_id``, ``worker_id``, ``round`` (the number of engine steps done
when the event was recorded; a token's round is the step that produced it), ``t_ns``
(``time.monotonic_ns()``: one clock for every process on a machine, never compared across
machines) and ``observer`` (``engine``: recorded by the owner thread; ``client``: recorded where the
stream was read).

Finish reasons: ``stop`` | ``length`` | ``cancelled`` | ``rejected`` | ``error``. A cancel also
names its ``cause``: ``client`` (POST /cancel or ``Worker.cancel``), ``disconnect`` (the HTTP client
went away), ``slow_consumer`` (the stream buffer overflowed) or ``shutdown`` (the worker closed).
"""
from __future__ import annotations

import dataclasses
import datetime
import enum
import json
import os
import sys
import threading
from json.encoder import encode_basestring
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from serve.errors import ServeError
from serve.observe.logsafe import UNSAFE

FINISH_REASONS = ("stop", "length", "cancelled", "rejected", "error")
CANCEL_CAUSES = ("client", "disconnect", "slow_consumer", "shutdown")
REQUEST_EVENTS = ("submitted", "admitted", "token", "finished")
OBSERVERS = ("engine", "client")

Sink = Callable[[dict], None]
"""A sink takes one record; it may also have ``many(records)``, which takes a list (a step's token events) in one
go (see :func:`sink_many`)."""


def now_ns() -> int:
    return time.monotonic_ns()


def make_event(event: str, request_id: str | None, worker_id: str, round_: int, observer: str = "engine",
               t_ns: int | None = None, **fields: Any) -> dict:
    """One event record with the common fields first, in a fixed order."""
    return {"event": event, "request_id": request_id, "worker_id": worker_id, "round": round_,
            "t_ns": now_ns() if t_ns is None else t_ns, "observer": observer, **fields}


def _jsonable(obj: Any) -> Any:
    """``default=`` of the log's encoder: dataclasses, paths, enums, sets, numpy and torch values."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=repr)
    if hasattr(obj, "tolist"):                     # numpy arrays and scalars, tensors
        return obj.tolist()
    return str(obj)                                # Path, dtype, ...


_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, default=_jsonable)   # built once, not per line
TOKEN_KEYS = ("event", "request_id", "worker_id", "round", "t_ns", "observer", "index", "token_id")


def _token_line(r: dict) -> str | None:
    """A plain token event (exactly make_event's fields, str ids, int numbers, no log-probs) written by hand:
    the same text json.dumps makes, at a third of the cost; None for anything else."""
    if tuple(r) != TOKEN_KEYS:
        return None
    rid, wid, obs = r["request_id"], r["worker_id"], r["observer"]
    nums = (r["round"], r["t_ns"], r["index"], r["token_id"])
    if type(rid) is not str or type(wid) is not str or type(obs) is not str or r["event"] != "token" \
            or any(type(v) is not int for v in nums):
        return None
    return (f'{{"event":"token","request_id":{encode_basestring(rid)},"worker_id":{encode_basestring(wid)},'
            f'"round":{nums[0]},"t_ns":{nums[1]},"observer":{encode_basestring(obs)},"index":{nums[2]},'
            f'"token_id":{nums[3]}}}\n')


def dumps_line(record: dict) -> str:
    """One JSONL line: compact JSON, UTF-8 as is, but no raw control character, line separator or lone surrogate
    (JSON ``\\uNNNN`` escapes: json itself leaves DEL, C1 controls and surrogates raw with ensure_ascii off)."""
    line = _token_line(record)
    if line is None:
        line = _ENCODER.encode(record)
        if UNSAFE.search(line):
            line = UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", line)
        line += "\n"
    return line


def sink_many(sink: Sink | None, records: list[dict]) -> None:
    """Hand records to a sink, in one call when it has ``many``."""
    if sink is None or not records:
        return
    many = getattr(sink, "many", None)
    if many is not None:
        many(records)
    else:
        for r in records:
            sink(r)


class EventLog:
    """A thread-safe JSONL writer: ``write_header`` once, then ``write`` per event.

    Lines are buffered and flushed every ``flush_every`` records and on ``flush``/``close``, so the
    owner thread pays for a buffered write, not a syscall, per token.

    ``max_bytes`` caps the file: once it holds that many bytes, the next record closes it and rotates it to
    ``PATH.1`` (``PATH.1`` to ``PATH.2``, ..., the oldest beyond ``backups`` deleted; no backups: the file starts
    over), and a new ``PATH`` begins with the header again (``"rotation": n``) and that record, so each file reads
    on its own. ``rotate_existing`` moves a file already at ``path`` to ``PATH.1`` first instead of overwriting it.
    (``logging.handlers.RotatingFileHandler`` rotates the same way but cannot begin each file with the header.)
    """

    def __init__(self, path: str | Path, flush_every: int = 64, *, max_bytes: int | None = None,
                 backups: int = 0, rotate_existing: bool = False, claim: "LogClaim | None" = None):
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if backups < 0:
            raise ValueError(f"backups must be >= 0, got {backups}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.backups = max_bytes, backups
        if rotate_existing and self.path.is_file() and self.path.stat().st_size:
            self._shift()
        self._f = self.path.open("w", encoding="utf-8")
        self._lock = threading.Lock()
        self._pending = 0
        self._flush_every = flush_every
        self._bytes = 0
        self._header: dict | None = None
        self.count = 0
        self.rotations = 0
        self.claim = claim                  # this process's hold on the path (released on close)

    def backup_path(self, i: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{i}")

    def _shift(self) -> None:
        """PATH -> PATH.1 -> ... -> PATH.<backups>; what falls off the end is deleted."""
        if self.backups == 0:
            self.path.unlink(missing_ok=True)
            return
        self.backup_path(self.backups).unlink(missing_ok=True)
        for i in range(self.backups - 1, 0, -1):
            if self.backup_path(i).exists():
                self.backup_path(i).rename(self.backup_path(i + 1))
        self.path.rename(self.backup_path(1))

    def _write_locked(self, line: str) -> None:
        self._f.write(line)
        self._bytes += len(line.encode("utf-8"))
        self.count += 1
        self._pending += 1

    def write_header(self, header: dict) -> None:
        self._header = dict(header)
        self.write({"event": "header", **header})

    def write(self, record: dict) -> None:
        line = dumps_line(record)
        with self._lock:
            if self._f.closed:
                return
            if self.max_bytes is not None and self._bytes >= self.max_bytes:
                self._rotate_locked()       # when a record is due, so a log never ends in a file of a header alone
            self._write_locked(line)
            self._after_write_locked()

    def write_many(self, records: list[dict]) -> None:
        """``write`` for each record, with one lock and (without a size cap) one buffered write."""
        if self.max_bytes is not None:          # the cap is checked line by line
            for r in records:
                self.write(r)
            return
        text = "".join(map(dumps_line, records))
        with self._lock:
            if self._f.closed:
                return
            self._f.write(text)
            self._bytes += len(text)            # (only compared with max_bytes, which is unset here)
            self.count += len(records)
            self._pending += len(records)
            self._after_write_locked()

    __call__ = write                            # an EventLog is itself a sink
    many = write_many

    def _after_write_locked(self) -> None:
        if self._pending >= self._flush_every:
            self._f.flush()
            self._pending = 0

    def _rotate_locked(self) -> None:
        self._f.close()
        self._shift()
        self._f = self.path.open("w", encoding="utf-8")
        self._bytes = self._pending = 0
        self.rotations += 1
        if self._header is not None:
            self._write_locked(dumps_line({"event": "header", **self._header, "rotation": self.rotations}))

    def flush(self) -> None:
        with self._lock:
            if not self._f.closed:
                self._f.flush()
                self._pending = 0

    def close(self) -> None:
        with self._lock:
            if not self._f.closed:
                self._f.close()
            if self.claim is not None:
                self.claim.release()

    def __enter__(self) -> "EventLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


DEFAULT_SERVE_LOG_MAX_MB = 256.0
DEFAULT_SERVE_LOG_BACKUPS = 3


class LogClaim:
    """One process's exclusive hold on a default event log path: an ``flock`` on a hidden lock file beside it
    (``runs/.serve-w.jsonl.lock``), held from the plan until the log closes (or the process ends), so a second
    ``labkit serve`` with the same worker id never rotates or overwrites a log another process writes."""

    def __init__(self, path: Path):
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fd: int | None = os.open(path.with_name(f".{path.name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._fd)
            self._fd = None
            raise

    @classmethod
    def first_free(cls, path: Path) -> "LogClaim":
        """``path`` when no live process holds it, else ``<stem>-<pid>[-k].jsonl``: unique to this process."""
        candidates = [path] + [path.with_name(f"{path.stem}-{os.getpid()}{'-' + str(k) if k else ''}{path.suffix}")
                               for k in range(64)]
        for p in candidates:
            try:
                return cls(p)
            except OSError:
                continue
        raise OSError(f"no free event log name next to {path}")

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)              # closing the descriptor drops the flock
            self._fd = None

    __del__ = release


@dataclass(frozen=True)
class LogPlan:
    """Where a server's event log goes and how it is capped (``path`` None: no log); ``claim``: this process's
    hold on a default path (:class:`LogClaim`)."""
    path: Path | None
    max_bytes: int | None = None
    backups: int = 0
    rotate_existing: bool = False
    claim: LogClaim | None = None

    def open(self) -> "EventLog | None":
        if self.path is None:
            return None
        return EventLog(self.path, max_bytes=self.max_bytes, backups=self.backups,
                        rotate_existing=self.rotate_existing, claim=self.claim)


def plan_serve_log(out: str | Path | None, worker_id: str, enabled: bool = True, max_mb: float | None = None,
                   backups: int = DEFAULT_SERVE_LOG_BACKUPS, log_dir: str | Path = "runs") -> LogPlan:
    """A server's event log: ``--out`` as given (no cap unless ``max_mb``), else, unless disabled,
    :func:`default_serve_log` in ``log_dir`` capped at ``max_mb`` (default 256 MB) with ``backups`` old files, the
    previous run's log kept as the first of them. ServeError (one line) for a bad cap or count. The default path is
    claimed for this process (:class:`LogClaim`): while another live process writes ``serve-<worker_id>.jsonl``, this one
    writes ``serve-<worker_id>-<pid>.jsonl`` and rotates only that."""
    if max_mb is not None and not (max_mb > 0 and max_mb != float("inf")):
        raise ServeError(f"--event-log-max-mb must be a positive number, got {max_mb!r}")
    if backups < 0:
        raise ServeError(f"--event-log-backups must be >= 0, got {backups!r}")
    if out is not None:
        return LogPlan(Path(out), int(max_mb * 1e6) if max_mb else None, backups)
    if not enabled:
        return LogPlan(None)
    mb = max_mb if max_mb is not None else DEFAULT_SERVE_LOG_MAX_MB
    try:
        claim = LogClaim.first_free(default_serve_log(worker_id, log_dir))
    except OSError as e:
        raise ServeError(f"cannot claim an event log under {log_dir}: {e}; give --out or --no-event-log") from None
    return LogPlan(claim.path, max(1, int(mb * 1e6)), backups, rotate_existing=True, claim=claim)


def default_serve_log(worker_id: str, log_dir: str | Path = "runs") -> Path:
    """Where a server keeps its event log without ``--out``: ``<log_dir>/serve-<worker_id>.jsonl`` (``labkit serve``
    gives the lab's ``runs/``); creates ``log_dir``."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in worker_id) or "worker"
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    return Path(log_dir) / f"serve-{safe}.jsonl"


def basic_envelope(*, kind: str, device: str | None = None, model: dict | None = None, seed: int | None = None,
                   engine: dict | None = None) -> dict:
    """A log header's identity when the caller gives none: when, which command, what was served. (``labkit
    serve`` gives the lab's evidence envelope, which adds the tree's identity.)"""
    return {"created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": [sys.executable, *sys.argv], "device": device, "model": model, "seed": seed, "kind": kind,
            "engine": engine}


class MemorySink:
    """Collects events in a list (tests, simulate); thread-safe append."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self._lock = threading.Lock()

    def __call__(self, record: dict) -> None:
        with self._lock:
            self.events.append(record)

    def many(self, records: list[dict]) -> None:
        with self._lock:
            self.events.extend(records)

    def snapshot(self) -> list[dict]:
        with self._lock:
            return list(self.events)


def fan_out(*sinks: Sink | None) -> Sink | None:
    live = [s for s in sinks if s is not None]
    if not live:
        return None
    if len(live) == 1:
        return live[0]

    def sink(record: dict) -> None:
        for s in live:
            s(record)

    def many(records: list[dict]) -> None:
        for s in live:
            sink_many(s, records)

    sink.many = many
    return sink


def split_out(out: str | Path) -> tuple[Path, Path]:
    """(events JSONL, evidence JSON) from one ``--out``."""
    out = Path(out)
    if out.suffix == ".json":
        return out.with_suffix(".jsonl"), out
    return out, out.with_suffix(".json")
