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

import json
import threading
import time
from pathlib import Path
from typing import Any, Callable

from labkit.evidence import envelope, to_jsonable

FINISH_REASONS = ("stop", "length", "cancelled", "rejected", "error")
CANCEL_CAUSES = ("client", "disconnect", "slow_consumer", "shutdown")
REQUEST_EVENTS = ("submitted", "admitted", "token", "finished")
OBSERVERS = ("engine", "client")

Sink = Callable[[dict], None]


def now_ns() -> int:
    return time.monotonic_ns()


def make_event(event: str, request_id: str | None, worker_id: str, round_: int, observer: str = "engine",
               t_ns: int | None = None, **fields: Any) -> dict:
    """One event record with the common fields first, in a fixed order."""
    return {"event": event, "request_id": request_id, "worker_id": worker_id, "round": round_,
            "t_ns": now_ns() if t_ns is None else t_ns, "observer": observer, **fields}


def dumps_line(record: dict) -> str:
    return json.dumps(record, separators=(",", ":"), ensure_ascii=False, default=to_jsonable) + "\n"


class EventLog:
    """A thread-safe JSONL writer: ``write_header`` once, then ``write`` per event.

    Lines are buffered and flushed every ``flush_every`` records and on ``flush``/``close``, so the
    owner thread pays for a buffered write, not a syscall, per token.
    """

    def __init__(self, path: str | Path, flush_every: int = 64):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("w", encoding="utf-8")
        self._lock = threading.Lock()
        self._pending = 0
        self._flush_every = flush_every
        self.count = 0

    def write_header(self, header: dict) -> None:
        self.write({"event": "header", **header})

    def write(self, record: dict) -> None:
        line = dumps_line(record)
        with self._lock:
            if self._f.closed:
                return
            self._f.write(line)
            self.count += 1
            self._pending += 1
            if self._pending >= self._flush_every:
                self._f.flush()
                self._pending = 0

    def flush(self) -> None:
        with self._lock:
            if not self._f.closed:
                self._f.flush()
                self._pending = 0

    def close(self) -> None:
        with self._lock:
            if not self._f.closed:
                self._f.close()

    def __enter__(self) -> "EventLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MemorySink:
    """Collects events in a list (tests, simulate); thread-safe append."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self._lock = threading.Lock()

    def __call__(self, record: dict) -> None:
        with self._lock:
            self.events.append(record)

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

    return sink


def split_out(out: str | Path) -> tuple[Path, Path]:
    """(events JSONL, evidence JSON) from one ``--out``."""
    out = Path(out)
    if out.suffix == ".json":
        return out.with_suffix(".jsonl"), out
    return out, out.with_suffix(".json")


def log_header(role: str, healths: list[dict | None], extra: dict) -> dict:
    """Header for a log written on the client side: identity as the servers report it."""
    known = [h for h in healths if h]
    kinds = sorted({h.get("kind") for h in known if h.get("kind")})
    env = envelope(kind=kinds[0] if len(kinds) == 1 else "static")
    env["kind"] = kinds[0] if len(kinds) == 1 else None
    if len(kinds) > 1:
        env["kinds"] = kinds
    first = known[0] if known else {}
    env["model"] = first.get("model")
    env["engine"] = first.get("engine")
    env["device"] = None
    env["servers"] = [{k: h.get(k) for k in ("worker_id", "kind", "served_model_name", "max_model_len")} if h else None
                      for h in healths]
    return {**env, "role": role, **extra}
