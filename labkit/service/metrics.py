"""Counters, gauges and histograms of one Worker, exposed through ``prometheus_client`` for ``GET /metrics``.

Each :class:`ServiceStats` owns its own ``CollectorRegistry`` (never the process-global one), so two servers
in one process keep apart. The owner thread counts; the HTTP thread sets the gauges from the worker's
published snapshot and renders the registry with the standard exposition (``generate_latest``, or
OpenMetrics when the scraper asks for it). Names follow vLLM's where the meaning is the same
(``num_requests_running``, ``time_to_first_token_seconds``, ``inter_token_latency_seconds``,
``e2e_request_latency_seconds``, ``kv_cache_usage_perc``) with the ``labkit_`` prefix; every series carries
``worker_id``. TTFT, ITL and e2e latency here are engine-observed (from submit to the step that produced the
token, or that ended the request). docs/METRICS.md lists every name with its type.
"""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)

#: Gauges set from ``Worker.gauges()`` at every scrape (name -> help).
GAUGES = {
    "labkit_num_requests_waiting": "Requests submitted and not yet admitted (the worker queue).",
    "labkit_num_requests_running": "Requests admitted and not finished (engine waiting + running).",
    "labkit_engine_waiting": "Sequences in the engine scheduler's waiting queue.",
    "labkit_engine_running": "Sequences in the engine scheduler's running queue.",
    "labkit_kv_blocks_total": "KV blocks in the paged pool.",
    "labkit_kv_blocks_used": "KV blocks referenced by sequences.",
    "labkit_kv_blocks_free": "KV blocks on the free list.",
    "labkit_round": "Engine steps done by this worker.",
    "labkit_healthy": "1 while the worker accepts work, else 0.",
}
KV_USAGE = "labkit_kv_cache_usage_perc"
PHASES = ("prefill", "decode")


class ServiceStats:
    """What /metrics shows, in a registry of its own. ``lock`` is kept for callers that group updates."""

    def __init__(self, worker_id: str):
        self.worker_id = worker_id
        self.lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=True)
        reg, w = self.registry, ("worker_id",)
        self._gauges = {name: Gauge(name, help_, w, registry=reg).labels(worker_id) for name, help_ in GAUGES.items()}
        self._gauges[KV_USAGE] = Gauge(KV_USAGE, "Fraction of the KV pool's blocks in use (0..1).", w,
                                       registry=reg).labels(worker_id)
        self._finished = Counter("labkit_requests_finished", "Finished requests by reason "
                                 "(stop, length, cancelled, rejected, error, ...).", (*w, "reason"), registry=reg)
        self._finished.labels(worker_id, "length")           # a zero series before the first request
        self._rejected = Counter("labkit_requests_rejected", "Requests rejected (queue full or not admitted).", w,
                                 registry=reg).labels(worker_id)
        self._prompt = Counter("labkit_prompt_tokens", "Prompt tokens of admitted requests.", w,
                               registry=reg).labels(worker_id)
        self._generation = Counter("labkit_generation_tokens", "Output tokens produced.", w,
                                   registry=reg).labels(worker_id)
        steps = Counter("labkit_steps", "Engine steps by phase.", (*w, "phase"), registry=reg)
        seconds = Counter("labkit_step_seconds", "Wall seconds inside engine.step() by phase.", (*w, "phase"),
                          registry=reg)
        self._steps = {p: steps.labels(worker_id, p) for p in PHASES}
        self._step_seconds = {p: seconds.labels(worker_id, p) for p in PHASES}
        self._errors = Counter("labkit_engine_errors", "Engine steps that raised.", w, registry=reg).labels(worker_id)
        self.ttft = Histogram("labkit_time_to_first_token_seconds",
                              "Engine-observed TTFT: submit to the step that produced the first token.", w,
                              buckets=TTFT_BUCKETS, registry=reg).labels(worker_id)
        self.itl = Histogram("labkit_inter_token_latency_seconds",
                             "Engine-observed gap between consecutive output tokens of a request.", w,
                             buckets=ITL_BUCKETS, registry=reg).labels(worker_id)
        self.e2e = Histogram("labkit_e2e_request_latency_seconds",
                             "Engine-observed request latency: submit to the step (or cancel) that finished an "
                             "admitted request.", w, buckets=E2E_BUCKETS, registry=reg).labels(worker_id)

    # -- counting (the owner thread) ---------------------------------------------------------
    def count_prompt(self, tokens: int) -> None:
        self._prompt.inc(tokens)

    def count_tokens(self, ttfts: list[float], itls: list[float]) -> None:
        """A step's output tokens in one go, under one lock: first tokens' TTFTs, later tokens' ITLs (seconds)."""
        if not ttfts and not itls:
            return
        with self.lock:
            self._generation.inc(len(ttfts) + len(itls))
            for v in ttfts:
                self.ttft.observe(v)
            for v in itls:
                self.itl.observe(v)

    def count_step(self, phase: str, seconds: float) -> None:
        self._steps[phase].inc()
        self._step_seconds[phase].inc(seconds)

    def count_engine_error(self) -> None:
        self._errors.inc()

    def count_finished(self, reason: str, e2e_seconds: float | None = None) -> None:
        self._finished.labels(self.worker_id, reason).inc()
        if reason == "rejected":
            self._rejected.inc()
        if e2e_seconds is not None:
            self.e2e.observe(e2e_seconds)

    # -- reading ------------------------------------------------------------------------------
    def _value(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, {"worker_id": self.worker_id, **labels}) or 0.0

    @property
    def finished(self) -> dict[str, int]:
        out = {}
        for family in self._finished.collect():
            for s in family.samples:
                if s.name.endswith("_total") and s.value:
                    out[s.labels["reason"]] = int(s.value)
        return out

    @property
    def prompt_tokens(self) -> int:
        return int(self._value("labkit_prompt_tokens_total"))

    @property
    def generation_tokens(self) -> int:
        return int(self._value("labkit_generation_tokens_total"))

    @property
    def steps(self) -> dict[str, int]:
        return {p: int(self._value("labkit_steps_total", phase=p)) for p in PHASES}

    @property
    def engine_errors(self) -> int:
        return int(self._value("labkit_engine_errors_total"))

    def render(self, gauges: dict[str, float], accept: str | None = None) -> tuple[bytes, str]:
        """The registry in the exposition format ``accept`` asks for (Prometheus text by default), after
        setting the gauges from ``gauges`` (``Worker.gauges()``). Returns (body, content type)."""
        for name, g in self._gauges.items():
            if name in GAUGES:
                g.set(gauges.get(name, 0))
        total = gauges.get("labkit_kv_blocks_total", 0)
        self._gauges[KV_USAGE].set(gauges.get("labkit_kv_blocks_used", 0) / total if total else 0.0)
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type
