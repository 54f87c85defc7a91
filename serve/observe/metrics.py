"""Counters, gauges and histograms of one Worker, exposed through ``prometheus_client`` for ``GET /metrics``.

Each :class:`ServiceStats` owns its own ``CollectorRegistry`` (never the process-global one), so two servers
in one process keep apart. The owner thread counts; the HTTP thread sets the gauges from the worker's
published snapshot and renders the registry with the standard exposition (``generate_latest``, or
OpenMetrics when the scraper asks for it). Names follow vLLM's where the meaning is the same
(``num_requests_running``, ``time_to_first_token_seconds``, ``inter_token_latency_seconds``,
``e2e_request_latency_seconds``, ``kv_cache_usage_perc``) with the ``labkit_`` prefix; every series carries
``worker_id``. TTFT, ITL and e2e latency here are engine-observed (from submit to the step that produced the
token, or that ended the request). docs/METRICS.md lists every name with its type.

Beside them, once the server names its model (:meth:`ServiceStats.set_model_name`), vLLM's own series
(:class:`VllmSeries`: ``vllm:num_requests_running``, ``vllm:prompt_tokens_total``,
``vllm:request_success_total{finished_reason}``, ...), labelled ``model_name`` and ``engine`` as vLLM's, for every
quantity this server measures the way vLLM does, so that vLLM's dashboards and scrapers read it. A finished
request's phases (queue, prefill, decode, inference) come from its moments (:class:`RequestTimes`), which each
worker kind stamps on its own request records.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

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
    "labkit_triton_compiles_after_startup": "Triton kernels compiled after start-up (each stalled a step; start-up "
                                            "warms every variant it knows, so this stays 0).",
}
KV_USAGE = "labkit_kv_cache_usage_perc"
PHASES = ("prefill", "decode", "mixed")      # engine.step_output.step_kind
#: the worker's finish reasons as vLLM's finished_reason label (rejected requests never ran: not counted there)
VLLM_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)     # vLLM's, tokens per step
N_BUCKETS = (1, 2, 5, 10, 20)                                                            # vLLM's, the n parameter


@dataclass(frozen=True)
class RequestTimes:
    """A finished request's moments (monotonic ns; 0: it never got there), for vLLM's phase histograms."""
    submitted_ns: int
    scheduled_ns: int            # the start of the first engine step that scheduled it
    first_token_ns: int
    last_token_ns: int
    finished_ns: int

    def phases(self) -> tuple[float, float, float, float]:
        """(queue, prefill, decode, inference) seconds, vLLM's intervals: queue from submit to first scheduled,
        prefill from first scheduled to the first token, decode from the first to the last token, inference from
        first scheduled to the last token (a preemption inside one counts in it). A request that ended before a
        moment (cancelled while queued or mid-prefill) has that interval end at its finish; an interval whose
        start never came is 0."""
        end = self.finished_ns
        scheduled = self.scheduled_ns or end
        first = self.first_token_ns or end
        last = self.last_token_ns or end
        return (max(0, scheduled - self.submitted_ns) / 1e9, max(0, first - scheduled) / 1e9,
                max(0, last - first) / 1e9 if self.first_token_ns else 0.0, max(0, last - scheduled) / 1e9)


class VllmSeries:
    """vLLM's names for what the worker measures as vLLM does (labels ``model_name``, ``engine``="0", as vLLM's,
    and ``worker_id``, as every series here)."""

    def __init__(self, reg: CollectorRegistry, model_name: str, worker_id: str, cache_config: dict[str, str]):
        lab, v = ("model_name", "engine", "worker_id"), (model_name, "0", worker_id)

        def gauge(name, help_):
            return Gauge(name, help_, lab, registry=reg).labels(*v)

        def counter(name, help_):
            return Counter(name, help_, lab, registry=reg).labels(*v)

        def hist(name, help_, buckets):
            return Histogram(name, help_, lab, buckets=buckets, registry=reg).labels(*v)

        self.running = gauge("vllm:num_requests_running", "Requests in the engine's running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting: the worker queue + the engine's waiting.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prompt = counter("vllm:prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation = counter("vllm:generation_tokens", "Output tokens produced.")
        self.preemptions = counter("vllm:num_preemptions", "Sequences preempted by the scheduler.")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        success = Counter("vllm:request_success", "Finished requests by finished_reason.", (*lab, "finished_reason"),
                          registry=reg)
        self.success = {r: success.labels(*v, r) for r in sorted(set(VLLM_REASONS.values()))}
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token (engine-observed).", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency (engine-observed).",
                        E2E_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds", "Submit to the first step that scheduled the request.",
                          E2E_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds", "First scheduled to the first token.", E2E_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds", "First token to the last token.", E2E_BUCKETS)
        self.inference = hist("vllm:request_inference_time_seconds", "First scheduled to the last token.",
                              E2E_BUCKETS)
        self.tpot = hist("vllm:request_time_per_output_token_seconds", "A request's decode time per output token "
                         "after the first.", ITL_BUCKETS)
        self.req_prompt = hist("vllm:request_prompt_tokens", "Prompt tokens per finished request.", TOKEN_BUCKETS)
        self.req_generation = hist("vllm:request_generation_tokens", "Output tokens per finished request.",
                                   TOKEN_BUCKETS)
        self.req_max_tokens = hist("vllm:request_params_max_tokens", "The max_tokens parameter per finished request.",
                                   TOKEN_BUCKETS)
        self.req_n = hist("vllm:request_params_n", "The n parameter, once per prompt of a request.", N_BUCKETS)
        self.iteration = hist("vllm:iteration_tokens_total", "Tokens per engine step: the prompts whose prefill it "
                              "ended, plus the tokens it produced.", ITERATION_BUCKETS)
        # vLLM's info gauge: the KV cache's settings as labels, value 1
        Gauge("vllm:cache_config_info", "The engine's KV cache settings.", (*cache_config, "engine", "worker_id"),
              registry=reg).labels(*cache_config.values(), "0", worker_id).set(1)
        self._totals = {"engine_preemptions": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0}

    def scrape(self, gauges: dict[str, float]) -> None:
        """Gauges from the worker's snapshot; the engine's running totals become counter increments (a total
        that went down, a fresh engine, counts from zero again)."""
        self.running.set(gauges.get("labkit_engine_running", 0))
        self.waiting.set(gauges.get("labkit_num_requests_waiting", 0) + gauges.get("labkit_engine_waiting", 0))
        total = gauges.get("labkit_kv_blocks_total", 0)
        self.kv_usage.set(gauges.get("labkit_kv_blocks_used", 0) / total if total else 0.0)
        for key, series in (("engine_preemptions", self.preemptions), ("prefix_cache_queries", self.prefix_queries),
                            ("prefix_cache_hits", self.prefix_hits)):
            now, last = int(gauges.get(key, 0)), self._totals[key]
            series.inc(now - last if now >= last else now)
            self._totals[key] = now


def cache_config_info(served) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info`` for a served engine (``serve.core.front.ServedEngine``): the fields
    of vLLM's CacheConfig this engine has, as strings."""
    cfg = served.config
    return {"block_size": str(cfg.kvcache_block_size), "cache_dtype": str(cfg.kv_cache_dtype),
            "enable_prefix_caching": str(cfg.enable_prefix_caching),
            "gpu_memory_utilization": str(cfg.gpu_memory_utilization), "num_gpu_blocks": str(served.num_blocks)}


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
        self.vllm: VllmSeries | None = None

    def set_model_name(self, name: str, cache_config: dict[str, str] | None = None) -> None:
        """Add vLLM's series, labelled with the served model name (once; the server calls it at start).
        ``cache_config``: the labels of ``vllm:cache_config_info`` (:func:`cache_config_info`)."""
        with self.lock:
            if self.vllm is None:
                self.vllm = VllmSeries(self.registry, name, self.worker_id, cache_config or {})

    # -- counting (the owner thread) ---------------------------------------------------------
    def count_prompt(self, tokens: int) -> None:
        """An admitted request's prompt tokens."""
        self._prompt.inc(tokens)
        if self.vllm is not None:
            self.vllm.prompt.inc(tokens)

    def count_tokens(self, ttfts: list[float], itls: list[float], first_prompt_tokens: int = 0) -> None:
        """A step's output tokens in one go, under one lock: first tokens' TTFTs, later tokens' ITLs (seconds);
        ``first_prompt_tokens``: the prompt tokens of the requests whose first token the step made (vLLM counts
        a prompt in the step that ends its prefill)."""
        if not ttfts and not itls:
            return
        vllm = self.vllm
        with self.lock:
            self._generation.inc(len(ttfts) + len(itls))
            for v in ttfts:
                self.ttft.observe(v)
            for v in itls:
                self.itl.observe(v)
            if vllm is not None:
                vllm.generation.inc(len(ttfts) + len(itls))
                for v in ttfts:
                    vllm.ttft.observe(v)
                for v in itls:
                    vllm.itl.observe(v)
                vllm.iteration.observe(first_prompt_tokens + len(ttfts) + len(itls))

    def count_step(self, phase: str, seconds: float) -> None:
        self._steps[phase].inc()
        self._step_seconds[phase].inc(seconds)

    def count_engine_error(self) -> None:
        self._errors.inc()

    def count_finished(self, reason: str, e2e_seconds: float | None = None, prompt_tokens: int = 0,
                       generation_tokens: int = 0, *, times: RequestTimes | None = None, max_tokens: int = 0,
                       n: int = 0) -> None:
        """A finished request; ``e2e_seconds`` only for one that was admitted (vLLM counts only those).
        ``times``: its moments (vLLM's phase histograms); ``max_tokens``: its max_tokens parameter; ``n``: the n
        parameter of the request whose first sample this is (0: a later sample, its prompt already counted)."""
        self._finished.labels(self.worker_id, reason).inc()
        if reason == "rejected":
            self._rejected.inc()
        if e2e_seconds is not None:
            self.e2e.observe(e2e_seconds)
            vllm = self.vllm
            if vllm is not None and reason in VLLM_REASONS:
                vllm.success[VLLM_REASONS[reason]].inc()
                vllm.e2e.observe(e2e_seconds)
                vllm.req_prompt.observe(prompt_tokens)
                vllm.req_generation.observe(generation_tokens)
                if times is not None:
                    phases = times.phases()
                    for series, seconds in zip((vllm.queue, vllm.prefill, vllm.decode, vllm.inference), phases):
                        series.observe(seconds)
                    vllm.tpot.observe(phases[2] / (generation_tokens - 1) if generation_tokens > 1 else 0.0)
                if max_tokens:
                    vllm.req_max_tokens.observe(max_tokens)
                if n:
                    vllm.req_n.observe(n)

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
        if self.vllm is not None:
            with self.lock:                   # two scrapes at once must not both count the same increment
                self.vllm.scrape(gauges)
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type
