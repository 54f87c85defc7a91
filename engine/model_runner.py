"""ModelRunner: a scheduled batch in, its sampled token ids out (nano-vllm's model_runner.py).

A step: :meth:`ModelRunner.run` (waits for the ids on the host) or :meth:`ModelRunner.launch` (leaves them
on the device, for the overlapped decode) -> :meth:`forward` (the batch's inputs from ``self.inputs``,
engine/step_inputs.py, and the route: eager or a captured graph) -> :meth:`run_model` (the model, or a
graph replay) -> ``self.sampler`` (engine/sampling/). Each returns what it measured: the route, the
host's wait for the ids, the step's span on the GPU.

Start-up, in order: load the weights, size and allocate the KV pool (:meth:`allocate_kv_cache`,
engine/kv_pool.py), warm every shape a wide batch meets (engine/warmup.py), capture the CUDA graphs
(engine/graph.py), start the device clock (engine/device_clock.py).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from engine import kv_pool, pdl
from engine.attention import create_backend, resolve_backend_name
from engine.config import Config, ConfigError
from engine.device_clock import DeviceClock
from engine.distributed import SINGLE, ParallelContext
from engine.graph import EAGER, PREFILL_GRAPH_SEQS, DecodeGraphs, PrefillGraphs, Route, prefill_buckets
from engine.levers import (decode_knobs, decode_layer_on, decode_prologue_mode, fp8_decode_knobs, fp8_v_transposed,
                           gemv_rows_setting, l2_prefetch_mode, skinny_rows_setting)
from engine.loader import load_model
from engine.mixed_graphs import MixedGraphs, mixed_buckets
from engine.models import build_model
from engine.observe import HookSet
from engine.piecewise import PiecewiseGraphs, piecewise_buckets
from engine.sampling.logprobs import SampledLogprobs, TokenLogprob, record_prompt_logprobs
from engine.sampling.sampler import Sampler
from engine.sequence import Sequence
from engine.step_inputs import InputBuilder, StepInputs
from engine.warmup import CompileWatch, graph_buckets, profile_run, warm_paths


@contextmanager
def default_dtype_device(dtype: torch.dtype, device: str):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)


@dataclass
class Launched:
    """A launched step's sampled ids: on the device (to feed the next step) and, once `ready`, on the host."""
    device_ids: torch.Tensor
    host_ids: torch.Tensor
    ready: "torch.cuda.Event | None"
    route: Route = EAGER
    logprobs: SampledLogprobs | None = None    # rows that asked for log-probs (read after tolist())
    started: "torch.cuda.Event | None" = None  # reached when the GPU began the step (engine/device_clock.py)
    clock: DeviceClock | None = None

    def tolist(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host_ids.tolist()

    def host_logprobs(self, token_ids: list[int]) -> dict[int, TokenLogprob]:
        """Batch row -> the drawn token's log-prob and alternatives (rows that asked only)."""
        return self.logprobs.to_host(token_ids) if self.logprobs is not None else {}

    def device_span(self) -> tuple[int, int] | None:
        """The step's start and end on the GPU (monotonic ns), after tolist()."""
        if self.clock is None or self.started is None or self.ready is None:
            return None
        return self.clock.span(self.started, self.ready)


class ModelRunner:
    def __init__(self, config: Config, tp: ParallelContext = SINGLE, workers=None, device: str | None = None):
        self.config = config
        self.tp = tp
        self.workers = workers            # rank 0 of a TP engine: the other ranks' handle
        self.device = device or config.resolved_device()
        if self.device.startswith("cuda:"):
            torch.cuda.set_device(torch.device(self.device))
        self.dtype = config.resolved_dtype(self.device)
        self.block_size = config.kvcache_block_size
        self.attention_backend = resolve_backend_name(config.attention_backend, self.device, self.block_size,
                                                      config.attention_needs(self.device))
        self.backend = create_backend(self.attention_backend, self.block_size)
        self.inputs = InputBuilder(self.block_size, self.device)
        self.on_inputs: Callable[[StepInputs], None] | None = None   # observer hook (tracing)
        self.clock: DeviceClock | None = None           # CUDA: each step's span on the GPU (set up last)
        self.hooks = HookSet()            # the engine hands in its own (phases, the point before the forward)
        self.memory: dict = {}
        t0 = time.perf_counter()
        with default_dtype_device(self.dtype, self.device):
            self.model = build_model(config.hf_config, self.backend, tp)
        missing = load_model(self.model, config.model)
        missing = [m for m in missing if "rotary" not in m]
        if missing:
            raise ConfigError(f"checkpoint in {config.model} lacks parameters: {', '.join(missing[:4])}")
        self.model.eval()
        rows = gemv_rows_setting()        # read (and a bad LAB_GEMV_ROWS refused) on every device
        skinny = skinny_rows_setting()    # and LAB_SKINNY_GEMM
        prologue = decode_prologue_mode(config, self.attention_backend)   # and a bad LAB_DECODE_PROLOGUE
        layer_kernel = decode_layer_on(self.attention_backend)    # and LAB_DECODE_LAYER
        l2 = l2_prefetch_mode(prologue)                           # and LAB_L2_PREFETCH
        self._take_decode_knobs(config)   # and LAB_FP8_DECODE, LAB_DECODE
        self.fused_ops = self._enable_fused_ops(rows, prologue, skinny)
        if self.fused_ops and l2 != "0" and hasattr(self.model, "set_l2_prefetch"):     # a layer's asks: 3/4 of L2
            self.model.set_l2_prefetch(l2, torch.cuda.get_device_properties(self.device).L2_cache_size * 3 // 4)
        self.gemv_rows = rows if self.fused_ops else 0   # tokens a projection takes through the GEMV kernels
        self.skinny_rows = skinny if self.fused_ops else 0   # ... and through the split-K GEMM from 2 tokens
        self.pdl = pdl.enable(self.device, config.pdl)     # engine/pdl.py: False off CUDA and before Hopper
        self.load_seconds = time.perf_counter() - t0
        self.sampler = Sampler(self.device, config.seed, config.eos_token_ids, config.logprobs_mode)
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.paged_prefill_graphs: PrefillGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        self.num_kvcache_blocks = self.allocate_kv_cache()
        if layer_kernel and self.fused_ops:
            self._enable_decode_layer()
        self.warmed: list[dict] = []      # the shapes start-up ran (engine/warmup.py), for describe()
        self.warm_seconds = 0.0
        warm_paths(self)
        if not config.enforce_eager:
            if not self.device.startswith("cuda"):
                raise ConfigError("graph execution needs CUDA (use enforce_eager on CPU)")
            self.capture_graphs()
        if self.device.startswith("cuda") and self.tp.rank == 0:   # the other TP ranks' steps are nobody's to read
            self.clock = self.inputs.clock = DeviceClock()
        if layer_kernel and self.fused_ops:
            self._check_decode_layer()
        # Triton kernels compiled after start-up (engine/warmup.py): a variant the warm-up missed
        self.late_compiles = CompileWatch() if self.device.startswith("cuda") else None

    def _enable_fused_ops(self, gemv_rows: int = 1, prologue: str = "", skinny_rows: int = 0) -> bool:
        """Turn the fused Triton kernels on (CUDA, --fused-ops), the GEMVs for up to ``gemv_rows`` tokens, the split-K
        GEMM for 2 to ``skinny_rows`` and the decode prologue in ``prologue``'s mode (levers.decode_prologue_mode);
        False where they stay off."""
        if not self.config.fused_ops:      # --no-fused-ops: the plain path (backend.store_kv runs)
            return False
        if not self.device.startswith("cuda"):
            return False
        try:
            import engine.layers.fused_kernels  # noqa: F401
        except ImportError:
            return False
        for module in self.model.modules():
            if hasattr(module, "fused"):
                module.fused = True
            if hasattr(module, "gemv_rows"):
                module.gemv_rows = gemv_rows
            if hasattr(module, "skinny_rows"):
                module.skinny_rows = skinny_rows
            if hasattr(module, "decode_prologue"):
                module.decode_prologue = prologue
        if skinny_rows:                    # its counters before any graph capture (inside one it would not split)
            from engine.layers.skinny_gemm import counters
            counters(torch.device(self.device))
        return True

    def _enable_decode_layer(self) -> None:
        """LAB_DECODE_LAYER=1: a batch-1 decode step's layers each as one persistent kernel, its splits sized for
        max_model_len (known once the pool is); the kernel's counters allocated before any graph capture."""
        from engine.layers.decode_layer import layer_sync

        layer_sync(self.device)
        for module in self.model.modules():
            if hasattr(module, "decode_layer"):
                module.decode_layer = self.config.max_model_len

    def _take_decode_knobs(self, config: Config) -> None:
        """The Triton decode kernel's knobs from the levers (LAB_FP8_DECODE on an e4m3 cache, LAB_DECODE on one in the
        model's dtype; engine/levers.py), put on the backend, whose every paged_decode call passes them; and the e4m3
        V cache's layout (LAB_FP8_V_T), which the pool marks on its V views."""
        self.fp8_decode = fp8_decode_knobs(config, self.attention_backend)
        self.decode_knobs = decode_knobs(config, self.attention_backend)
        self.fp8_v_t = fp8_v_transposed(config)          # and LAB_FP8_V_T: the e4m3 V cache's layout
        if self.fp8_decode or self.decode_knobs:
            self.backend.decode_knobs = self.fp8_decode or self.decode_knobs

    def _check_decode_layer(self) -> None:
        """After the warm-up and the graph captures ran the layer kernel: refuse to serve if one of its grid
        barriers gave up (its programs were not all resident at once, e.g. another process holds SMs), since
        its numbers are then wrong."""
        from engine.layers.decode_layer import FLAG, layer_sync

        sync = layer_sync(self.device)
        if sync is not None and int(sync[FLAG]):
            raise ConfigError("LAB_DECODE_LAYER=1: a grid barrier of the decode layer kernel gave up during start-up "
                              "(its programs were not all resident on the GPU at once); unset LAB_DECODE_LAYER")

    # -- start-up: the KV pool and the graphs -----------------------------------------------
    def allocate_kv_cache(self) -> int:
        """Size the pool (engine/kv_pool.py; on CUDA after the profile run), fit max_model_len "auto" to it,
        allocate it. Returns its number of blocks."""
        cfg = self.config
        block_bytes = kv_pool.bytes_per_block(cfg, self.dtype, self.tp.world_size)
        if cfg.num_kvcache_blocks > 0:
            n = cfg.num_kvcache_blocks
        elif self.device == "cpu":
            n, self.memory = kv_pool.cpu_blocks(cfg, block_bytes)
        else:
            torch.cuda.synchronize()
            profile_run(self)
            n, self.memory = kv_pool.gpu_blocks(cfg, block_bytes, self.model)
        n = self.tp.min_int(n)            # every rank holds the same pool
        if n < 1:
            raise ConfigError(f"no memory left for the KV cache (raise gpu_memory_utilization?): {self.memory}")
        cfg.fit_to_pool(n)
        self.kv_cache = kv_pool.allocate(self.model.attention_layers(), n, cfg, self.dtype, self.device,
                                         self.tp.world_size, v_t=self.fp8_v_t)
        self.memory.update({"num_blocks": n, "bytes_per_block": block_bytes, "kv_cache_bytes": n * block_bytes})
        return n

    def capture_graphs(self) -> None:
        cfg = self.config
        buckets = graph_buckets(cfg)
        max_blocks = (cfg.max_model_len + self.block_size - 1) // self.block_size
        self.graphs = DecodeGraphs(self.model, buckets, max_blocks, cfg.max_model_len, self.device)
        self.graphs.capture()
        self.warmed += [{"path": "decode-graph", "seqs": b, "tokens": cfg.max_model_len} for b in self.graphs.buckets]
        # prefill graphs: the triton backend's prefills read only device tensors (the grid follows the bucket),
        # fresh ones and ones reading a cached prefix through the block table (prefix hits, chunk continuations);
        # one rank only, since the other ranks route their replayed inputs on their own
        if cfg.prefill_graphs and self.attention_backend == "triton" and self.tp.world_size == 1:
            seqs = min(PREFILL_GRAPH_SEQS, cfg.max_num_seqs)
            self.prefill_graphs = PrefillGraphs(self.model, prefill_buckets(cfg.max_num_batched_tokens), seqs,
                                                self.device)
            self.prefill_graphs.capture()
            self.paged_prefill_graphs = PrefillGraphs(self.model, prefill_buckets(cfg.max_num_batched_tokens), seqs,
                                                      self.device, max_blocks=max_blocks, max_model_len=cfg.max_model_len)
            self.paged_prefill_graphs.capture()
            self.warmed += [{"path": path, "seqs": seqs, "tokens": t}
                            for path, g in (("prefill-graph", self.prefill_graphs),
                                            ("paged-prefill-graph", self.paged_prefill_graphs)) for t in g.buckets]
        # mixed graphs (engine/mixed_graphs.py): a mixed step's decode rows and chunks in one graph, for the same
        # reasons (the triton kernels' grids follow the bucket; one rank)
        if cfg.mixed_batches and cfg.mixed_graphs and self.attention_backend == "triton" and self.tp.world_size == 1:
            self.mixed_graphs = MixedGraphs(self.model, mixed_buckets(cfg.max_num_seqs, cfg.max_num_batched_tokens),
                                            max_blocks, cfg.max_model_len, self.device)
            self.mixed_graphs.capture()
            self.warmed += [{"path": "mixed-graph", "seqs": d, "tokens": t} for d, t in self.mixed_graphs.buckets]
        # piecewise graphs (engine/piecewise.py): every other step of at most the largest bucket (mixed steps,
        # prefills of more sequences or tokens than a prefill graph holds, other backends' prefix hits and chunks),
        # attention eager between the pieces; one rank only, as above
        if cfg.piecewise_graphs and self.tp.world_size == 1:
            self.piecewise = PiecewiseGraphs(self.model, self.backend, piecewise_buckets(cfg.max_num_batched_tokens),
                                             cfg.max_num_seqs, self.device)
            self.piecewise.capture()
            self.warmed += [{"path": "piecewise-graph", "seqs": self.piecewise.rows(t), "tokens": t}
                            for t in self.piecewise.buckets]

    @property
    def capture_seconds(self) -> float:
        return sum(g.capture_seconds for g in (self.graphs, self.prefill_graphs, self.paged_prefill_graphs,
                                               self.mixed_graphs, self.piecewise) if g is not None)

    # -- a step ------------------------------------------------------------------------------
    def run(self, seqs: list[Sequence], is_prefill: bool, step: int = 0
            ) -> tuple[list[int], Route, dict[int, TokenLogprob], float, tuple[int, int] | None]:
        """One step, waiting for its tokens on the host. Returns the token ids, the route, batch row ->
        log-prob of its token (rows whose requests asked), the seconds the host was blocked reading the
        ids (StepOutput.wait_s) and, on CUDA, the step's span on the GPU (StepOutput.device_span)."""
        logits, route, started = self.forward(seqs, is_prefill, step=step)
        with self.hooks.phase("sample", step):
            tokens, logprobs = self.sampler(seqs, logits)
            ended = self.clock.mark() if self.clock is not None else None
            t_wait = time.perf_counter()
            ids = tokens.tolist()
            wait_s = time.perf_counter() - t_wait      # host blocked on the device
        span = self.clock.span(started, ended) if ended is not None else None
        return ids, route, (logprobs.to_host(ids) if logprobs is not None else {}), wait_s, span

    def launch(self, seqs: list[Sequence], is_prefill: bool, feed: torch.Tensor | None = None,
               step: int = 0) -> Launched:
        """run() without waiting: the sampled ids stay on the device, and a copy to pinned host memory is
        queued right behind them with an event, so reading them later waits for this step only, not for
        a step launched after it."""
        logits, route, started = self.forward(seqs, is_prefill, feed, step)
        with self.hooks.phase("sample", step):
            tokens, logprobs = self.sampler(seqs, logits)
        if not tokens.is_cuda:
            return Launched(tokens, tokens, None, route, logprobs)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        if logprobs is not None:
            logprobs.stage()                     # read after `ready`, like the ids
        ready = torch.cuda.Event(enable_timing=True)
        ready.record()
        return Launched(tokens, host, ready, route, logprobs, started, self.clock)

    def forward(self, seqs: list[Sequence], is_prefill: bool, feed: torch.Tensor | None = None,
                step: int = 0) -> tuple[torch.Tensor, Route, "torch.cuda.Event | None"]:
        """The step's logits, the route they took and the mark where the GPU began the step (None without
        a device clock). feed: the leading decode rows' input ids as a device tensor, from a step still in
        flight; those rows' positions are then one further than the host's token lists (plan_ahead)."""
        hooks = self.hooks
        with hooks.phase("prepare", step):
            if feed is None:
                inputs = self.inputs.prepare(seqs, is_prefill)
            else:
                inputs = self.inputs.to_inputs(self.inputs.plan_ahead(seqs, fed=feed.shape[0]))
                inputs.input_ids[:feed.shape[0]].copy_(feed)
            if self.workers is not None:
                self.workers.send("run", inputs.plan)   # the other ranks replay the same forward
            if self.on_inputs is not None:
                self.on_inputs(inputs)
        if hooks:
            hooks.before_forward(step, inputs)
        with hooks.phase("forward", step):
            if is_prefill and not all(s.prompt_logprobs_done for s in seqs):
                return self._prefill_with_prompt_logprobs(seqs, inputs), EAGER, inputs.started
            route = self.route_for(inputs)
            return self.run_model(inputs, route), route, inputs.started

    def route_for(self, inputs: StepInputs) -> Route:
        """A decode replays the smallest captured graph that covers its batch; a prefill without decode rows
        the smallest prefill graph that covers its tokens and sequences (fresh, or paged where it reads a cached
        prefix); a mixed step the smallest mixed graph that holds its decode rows and chunks; any other step (a
        prefill of more sequences or tokens, a mixed step no mixed graph holds) the smallest piecewise graph that
        covers its tokens, attention eager between its pieces; a step larger than every bucket is eager."""
        tokens, seqs = inputs.input_ids.shape[0], len(inputs.meta.seqlens_q)
        if self.graphs is not None and not inputs.is_prefill:
            bucket = self.graphs.bucket_for(tokens)
            if bucket is not None:
                return Route("graph", bucket)
        if self.prefill_graphs is not None and inputs.is_prefill and inputs.meta.block_tables is None:
            bucket = self.prefill_graphs.bucket_for(tokens, seqs)
            if bucket is not None:
                return Route("prefill-graph", bucket)
        if (self.paged_prefill_graphs is not None and inputs.is_prefill and inputs.meta.block_tables is not None
                and not inputs.meta.num_decodes):
            bucket = self.paged_prefill_graphs.bucket_for(tokens, seqs)
            if bucket is not None:
                return Route("paged-prefill-graph", bucket)
        if self.mixed_graphs is not None and inputs.is_prefill and inputs.meta.num_decodes:
            key = self.mixed_graphs.bucket_for(tokens, seqs, inputs.meta.num_decodes)
            if key is not None:
                return Route("mixed-graph", key[1], rows=key[0])
        if self.piecewise is not None and inputs.is_prefill:
            bucket = self.piecewise.bucket_for(tokens, seqs)
            if bucket is not None:
                return Route("piecewise", bucket)
        return EAGER

    @torch.inference_mode()
    def run_model(self, inputs: StepInputs, route: Route | None = None) -> torch.Tensor:
        """Hidden states of the last position of each sequence -> logits [N, vocab]."""
        route = self.route_for(inputs) if route is None else route
        if route.kind == "graph":          # the graph includes the LM head
            return self.graphs.replay(route.bucket, inputs.input_ids, inputs.positions, inputs.meta)
        if route.kind == "prefill-graph":
            return self.prefill_graphs.replay(route.bucket, inputs.input_ids, inputs.positions, inputs.meta)
        if route.kind == "paged-prefill-graph":
            return self.paged_prefill_graphs.replay(route.bucket, inputs.input_ids, inputs.positions, inputs.meta)
        if route.kind == "mixed-graph":
            return self.mixed_graphs.replay((route.rows, route.bucket), inputs.input_ids, inputs.positions, inputs.meta)
        if route.kind == "piecewise":
            return self.piecewise.replay(route.bucket, inputs.input_ids, inputs.positions, inputs.meta)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        if inputs.is_prefill:
            hidden = hidden[inputs.meta.cu_seqlens_q[1:].long() - 1]
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def _prefill_with_prompt_logprobs(self, seqs: list[Sequence], inputs: StepInputs) -> torch.Tensor:
        """An eager prefill that also records the prompt log-probs of the sequences asking for them
        (engine/sampling/logprobs.py); returns the last positions' logits, as run_model."""
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        record_prompt_logprobs(seqs, inputs.meta.seqlens_q, hidden, self.model.compute_logits)
        return self.model.compute_logits(hidden[inputs.meta.cu_seqlens_q[1:].long() - 1])

    def close(self) -> None:
        """Drop the KV pool (and the layer views of it), the graphs and the weights so their memory can go back."""
        for layer in self.model.attention_layers():
            layer.k_cache = layer.v_cache = torch.empty(0)
        self.kv_cache = torch.empty(0)
        self.graphs = self.prefill_graphs = self.paged_prefill_graphs = self.mixed_graphs = self.piecewise = None
        self.model = None
        if self.late_compiles is not None:
            self.late_compiles.close()
        if self.workers is not None:
            self.workers.close()
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
