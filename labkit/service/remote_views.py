"""What the front end reads of a worker whose engine runs in its own process (``labkit serve
--engine-process``; the design is in :mod:`labkit.service.engine_process`).

All of it is read-only and answered in the parent, without a round trip to the engine process:

- :class:`_EngineView` (``worker.engine``): the engine config the child reported, the engine's own
  admission rule over the limits it reported, the prompt encoding and tokenizer (loaded in the parent),
  and the KV pool's numbers from the last snapshot.
- :class:`_BuiltView` (``worker.built``): kind, device, model identity and engine description, as the
  child reported them at start.
- :class:`RemoteWorkerViews`, the read-only half of :class:`labkit.service.engine_process.RemoteWorker`:
  its state (``/health``), the child's last published snapshot with this side's health, the reason a
  submission or call is refused, and the evidence envelope of its event log.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine import LLMEngine, SamplingParams
from engine.llm_engine import EngineStats
from labkit.service.worker import Worker


class _EngineView:
    """What the front end reads of the engine: its config, the admission rule over the limits the child
    reported, the tokenizer (loaded here), and the pool's numbers from the last snapshot."""

    encode = LLMEngine.encode                    # the engine's own prompt encoding (it reads .tokenizer only)

    def __init__(self, config, num_blocks: int, worker: "RemoteWorkerViews"):
        self.config = config
        self.num_blocks = num_blocks
        self.tokenizer = None
        self._worker = worker

    def validate(self, token_ids: list[int], params: SamplingParams | None = None) -> None:
        LLMEngine.check_request(self.config, self.num_blocks, token_ids, params)

    def stats(self) -> EngineStats:
        s = self._worker.snapshot()
        total = s.get("kv_blocks_total", self.num_blocks)
        free = s.get("kv_blocks_free", total)
        return EngineStats(s.get("engine_waiting", 0), s.get("engine_running", 0), total, free, total - free,
                           s.get("round", 0))


@dataclass
class _BuiltView:
    """``Worker.built`` as the child reported it (kind, device, model identity, engine description)."""
    engine: _EngineView
    model: dict
    device: str
    kind: str
    description: dict

    def describe(self) -> dict:
        return self.description


class RemoteWorkerViews:
    """The state a RemoteWorker shows (its fields are set by :class:`RemoteWorker`: ``_ready``, ``_closed``,
    ``_unhealthy``, ``_snapshot``, ``_lock``, ``process``, ``worker_id``)."""

    def _unhealthy_reason(self) -> str | None:
        if self._unhealthy:
            return self._unhealthy
        if self._snapshot.get("state") == "unhealthy":
            return self._snapshot.get("reason") or "the engine process's worker is unhealthy"
        return None

    @property
    def accepting(self) -> bool:
        return self._ready and not self._closed and self._unhealthy_reason() is None

    def state(self) -> str:
        if self._closed:
            return "closed"
        if not self._ready:
            return "starting"
        return "unhealthy" if self._unhealthy_reason() else "ok"

    def snapshot(self) -> dict:
        """The child's last published state (queue, active, KV blocks, round), with this side's health."""
        with self._lock:
            snap = dict(self._snapshot)
        snap.pop("reason", None)
        snap["state"] = self.state()
        reason = self._unhealthy_reason()
        if reason:
            snap["reason"] = reason
        return snap

    def _unavailable_reason(self) -> str:
        if self._closed:
            return f"worker {self.worker_id} is shut down"
        if not self._ready:
            return f"worker {self.worker_id} is starting"
        return f"worker {self.worker_id} is unhealthy: {self._unhealthy_reason()}"

    def header(self, **extra) -> dict:
        """The evidence envelope for a JSONL log written from this worker (after start)."""
        return Worker.header(self, engine_process={"pid": self.process.pid if self.process else None}, **extra)
