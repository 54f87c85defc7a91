"""Turns scheduled sequences into tensors, runs the model on the paged KV cache, samples."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from engine.attention import create_backend, resolve_backend_name
from engine.config import Config, ConfigError
from engine.device_clock import DeviceClock
from engine.distributed import SINGLE, ParallelContext
from engine.graph import PREFILL_GRAPH_SEQS, DecodeGraphs, PrefillGraphs, prefill_buckets
from engine.layers.logits_process import RowInputs, TokenHistory
from engine.layers.sampler import SampledLogprobs, TokenLogprob, logprobs_of, sample, sample_processed, sample_tensor
from engine.loader import load_model
from engine.observe import HookSet
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.sequence import Sequence
from engine.step_inputs import InputBuilder, StepInputs
from engine.warmup import graph_buckets, warmup_plan


@contextmanager
def default_dtype_device(dtype: torch.dtype, device: str):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)


@dataclass(frozen=True)
class Route:
    """How a forward ran: eagerly, by replaying the decode graph of `bucket` sequences, or the prefill
    graph of `bucket` tokens."""
    kind: str = "eager"                   # "eager" | "graph" | "prefill-graph"
    bucket: int | None = None

    def __str__(self) -> str:
        return "eager" if self.kind == "eager" else f"{self.kind}:{self.bucket}"


EAGER = Route()


@dataclass
class Launched:
    """A launched step's sampled ids: on the device (to feed the next step) and, once `ready`, on the host."""
    device_ids: torch.Tensor
    host_ids: torch.Tensor
    ready: "torch.cuda.Event | None"
    route: Route = EAGER
    logprobs: SampledLogprobs | None = None    # rows that asked for log-probs (read after tolist())
    started: "torch.cuda.Event | None" = None  # reached when the GPU began the step (engine/device_clock.py)

    def tolist(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host_ids.tolist()

    def host_logprobs(self, token_ids: list[int]) -> dict[int, TokenLogprob]:
        """Batch row -> the drawn token's log-prob and alternatives (rows that asked only)."""
        return self.logprobs.to_host(token_ids) if self.logprobs is not None else {}

    def device_span(self, clock: DeviceClock | None) -> tuple[int, int] | None:
        """The step's start and end on the GPU (monotonic ns), after tolist()."""
        if clock is None or self.started is None or self.ready is None:
            return None
        return clock.span(self.started, self.ready)


class ModelRunner(InputBuilder):
    def __init__(self, config: Config, tp: ParallelContext = SINGLE, workers=None, device: str | None = None):
        self.config = config
        self.tp = tp
        self.workers = workers            # rank 0 of a TP engine: the other ranks' handle
        self.device = device or config.resolved_device()
        if self.device.startswith("cuda:"):
            torch.cuda.set_device(torch.device(self.device))
        self.dtype = config.resolved_dtype(self.device)
        self.block_size = config.kvcache_block_size
        self.attention_backend = resolve_backend_name(config.attention_backend, self.device, self.block_size)
        self.backend = create_backend(self.attention_backend, self.block_size)
        self.on_inputs: Callable[[StepInputs], None] | None = None   # observer hook (tracing)
        self.last_wait_s = 0.0            # run_step: host time blocked reading the sampled ids
        self.clock: DeviceClock | None = None           # CUDA: each step's span on the GPU (set up last)
        self._started: "torch.cuda.Event | None" = None  # the step being prepared: where the GPU begins it
        self.last_device_span: tuple[int, int] | None = None   # run_step: the step's span on the GPU
        self.hooks = HookSet()            # the engine hands in its own (phases, the point before the forward)
        self.memory: dict = {}
        t0 = time.perf_counter()
        with default_dtype_device(self.dtype, self.device):
            self.model = Qwen3ForCausalLM(config.hf_config, self.backend, tp)
        missing = load_model(self.model, config.model)
        missing = [m for m in missing if "rotary" not in m]
        if missing:
            raise ConfigError(f"checkpoint in {config.model} lacks parameters: {', '.join(missing[:4])}")
        self.model.eval()
        self.fused_ops = self._enable_fused_ops() if config.fused_ops else False
        self.load_seconds = time.perf_counter() - t0
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.seed)
        self._seq_generators: dict[int, torch.Generator] = {}
        self._history: TokenHistory | None = None     # penalty rows' token counts (made on first use)
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.num_kvcache_blocks = self.allocate_kv_cache()
        self.warmed: list[dict] = []      # the shapes start-up ran (engine/warmup.py), for describe()
        self.warm_seconds = 0.0
        self.warm_paths()
        if not config.enforce_eager:
            if not self.device.startswith("cuda"):
                raise ConfigError("graph execution needs CUDA (use enforce_eager on CPU)")
            self.capture_graphs()
        if self.device.startswith("cuda") and self.tp.rank == 0:   # the other TP ranks' steps are nobody's to read
            self.clock = DeviceClock()

    def _enable_fused_ops(self) -> bool:
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
        return True

    # -- KV pool -------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return self.block_size * self.config.shape.kv_bytes_per_token(elem, self.tp.world_size)

    def _blocks_from_budget(self) -> int:
        cfg = self.config
        blocks_per_seq = (cfg.max_model_len + self.block_size - 1) // self.block_size
        if self.device == "cpu":
            budget = cfg.cpu_kv_cache_bytes
            cap = cfg.max_num_seqs * blocks_per_seq + 1
            self.memory = {"kv_budget_bytes": budget, "source": "cpu_kv_cache_bytes"}
            return max(1, min(budget // self.bytes_per_block, cap))
        torch.cuda.synchronize()
        self.warmup()
        free, total = torch.cuda.mem_get_info()
        used = total - free
        peak = torch.cuda.max_memory_allocated()
        current = torch.cuda.memory_allocated()
        budget = int(total * cfg.gpu_memory_utilization - used - peak + current)
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.memory = {"total_bytes": total, "weights_bytes": weights, "peak_work_bytes": peak - current,
                       "used_before_kv_bytes": used, "kv_budget_bytes": budget,
                       "gpu_memory_utilization": cfg.gpu_memory_utilization}
        return budget // self.bytes_per_block

    def allocate_kv_cache(self) -> int:
        cfg = self.config
        n = cfg.num_kvcache_blocks if cfg.num_kvcache_blocks > 0 else self._blocks_from_budget()
        n = self.tp.min_int(n)            # every rank holds the same pool
        if n < 1:
            raise ConfigError(f"no memory left for the KV cache (raise gpu_memory_utilization?): {self.memory}")
        shape = cfg.shape
        layers = self.model.attention_layers()
        self.kv_cache = torch.zeros(2, len(layers), n, self.block_size, shape.num_kv_heads // self.tp.world_size,
                                    shape.head_dim,
                                    dtype=self.dtype, device=self.device)
        for i, layer in enumerate(layers):
            layer.k_cache = self.kv_cache[0, i]
            layer.v_cache = self.kv_cache[1, i]
        self.memory.update({"num_blocks": n, "bytes_per_block": self.bytes_per_block,
                            "kv_cache_bytes": n * self.bytes_per_block})
        return n

    @torch.inference_mode()
    def warmup(self) -> None:
        """One prefill at the configured token budget, before the KV pool exists, to measure peak work memory."""
        cfg = self.config
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        seq_len = min(cfg.max_num_batched_tokens, cfg.max_model_len)
        num = max(1, min(cfg.max_num_batched_tokens // seq_len, cfg.max_num_seqs))
        self.run_model(self._scratch_prefill(num, seq_len))
        torch.cuda.synchronize()
        torch.cuda.empty_cache()          # the warmup's transient memory must not count as "used"

    def _scratch_prefill(self, num: int, length: int, cached: int = 0) -> StepInputs:
        """Prefill inputs for `num` throwaway sequences of `length` tokens that write nothing (slots -1);
        with `cached`, their first `cached` positions are read from the cache (block 0) as a prefix."""
        seqs = []
        for _ in range(num):
            s = Sequence(-1, [0] * length, None, self.block_size)  # type: ignore[arg-type]
            if cached:
                s.block_table = [0] * ((length + self.block_size - 1) // self.block_size)
                s.num_cached_tokens = cached
            s.num_scheduled_tokens = length - cached
            seqs.append(s)
        inputs = self.prepare_prefill(seqs)
        inputs.meta.slot_mapping.fill_(-1)
        return inputs

    @torch.inference_mode()
    def warm_paths(self) -> None:
        """CUDA: meet every shape a wide batch will use before the first request (engine/warmup.py lists
        them: prefill token counts up to the step budget, prefills reading a cached prefix, eager decode
        batch classes and Triton decode variants where eager decode can happen, the sampler's paths), so
        JIT compiles and first-launch costs land in init time, not in a request. Nothing is written to
        the cache (slots -1) and a throwaway generator keeps the engine's random stream as is. What ran
        is kept in `warmed` (decode-graph rows are run by capture_graphs)."""
        if not self.device.startswith("cuda"):
            return
        self.run_warmup(self.warmup_plan())

    def warmup_plan(self) -> list:
        sm = torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.startswith("cuda") else 0
        return warmup_plan(self.config, self.attention_backend, sm, self.tp.world_size)

    @torch.inference_mode()
    def run_warmup(self, plan: list) -> list[dict]:
        """Run every warm shape of `plan` except decode-graph (capture warms those); returns and keeps
        the records of what ran. Usable on any device (tests run it on CPU)."""
        t0 = time.perf_counter()
        throwaway = torch.Generator(device=self.device)
        seeded = torch.Generator(device=self.device)
        ran = []
        for shape in plan:
            if shape.path == "prefill":
                self.run_model(self._scratch_prefill(shape.seqs, shape.tokens), EAGER)
            elif shape.path == "prefill-paged":
                self.run_model(self._scratch_prefill(shape.seqs, shape.tokens + shape.cached, cached=shape.cached), EAGER)
            elif shape.path == "decode-eager":
                self.run_model(self._scratch_decode(shape.seqs, shape.tokens), EAGER)
            elif shape.path == "sample":
                logits = self.run_model(self._scratch_decode(shape.seqs, 1), EAGER)
                temps = {"greedy": [0.0] * shape.seqs, "sampled": [1.0] * shape.seqs,
                         "mixed": [1.0, 0.0] * (shape.seqs // 2) + [1.0] * (shape.seqs % 2),
                         "seeded": [1.0] * shape.seqs}[shape.mode]
                gens = [throwaway] * shape.seqs if shape.mode != "seeded" else [seeded] + [throwaway] * (shape.seqs - 1)
                sample(logits, temps, gens)
            else:
                continue
            ran.append(shape.record())
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        self.warm_seconds += time.perf_counter() - t0
        self.warmed += ran
        return ran

    def _scratch_decode(self, num: int, context: int) -> StepInputs:
        """Decode inputs for `num` throwaway sequences of `context` positions that read block 0 for every
        position and write nothing (slots -1)."""
        seqs = []
        for _ in range(num):
            s = Sequence(-1, [0] * context, None, self.block_size)  # type: ignore[arg-type]
            s.block_table = [0] * ((context + self.block_size - 1) // self.block_size)
            seqs.append(s)
        inputs = self.prepare_decode(seqs)
        inputs.meta.slot_mapping.fill_(-1)
        return inputs

    def capture_graphs(self) -> None:
        cfg = self.config
        buckets = graph_buckets(cfg)
        max_blocks = (cfg.max_model_len + self.block_size - 1) // self.block_size
        self.graphs = DecodeGraphs(self.model, buckets, max_blocks, cfg.max_model_len, self.device)
        self.graphs.capture()
        self.warmed += [{"path": "decode-graph", "seqs": b, "tokens": cfg.max_model_len} for b in self.graphs.buckets]
        # prefill graphs: the triton backend's fresh prefill reads only device tensors (the grid follows the
        # bucket); one rank only, since the other ranks route their replayed inputs on their own
        if cfg.prefill_graphs and self.attention_backend == "triton" and self.tp.world_size == 1:
            seqs = min(PREFILL_GRAPH_SEQS, cfg.max_num_seqs)
            self.prefill_graphs = PrefillGraphs(self.model, prefill_buckets(cfg.max_num_batched_tokens), seqs,
                                                self.device)
            self.prefill_graphs.capture()
            self.warmed += [{"path": "prefill-graph", "seqs": seqs, "tokens": t} for t in self.prefill_graphs.buckets]

    @property
    def capture_seconds(self) -> float:
        return sum(g.capture_seconds for g in (self.graphs, self.prefill_graphs) if g is not None)

    # -- execution ---------------------------------------------------------------
    def route_for(self, inputs: StepInputs) -> Route:
        """A decode replays the smallest captured graph that covers its batch; a fresh prefill (nothing
        read from the cache) the smallest prefill graph that covers its tokens and sequences; anything
        else is eager."""
        if self.graphs is not None and not inputs.is_prefill:
            bucket = self.graphs.bucket_for(inputs.input_ids.shape[0])
            if bucket is not None:
                return Route("graph", bucket)
        if self.prefill_graphs is not None and inputs.is_prefill and inputs.meta.block_tables is None:
            bucket = self.prefill_graphs.bucket_for(inputs.input_ids.shape[0], len(inputs.meta.seqlens_q))
            if bucket is not None:
                return Route("prefill-graph", bucket)
        return EAGER

    @torch.inference_mode()
    def run_model(self, inputs: StepInputs, route: Route | None = None) -> torch.Tensor:
        """Hidden states of the last position of each sequence -> logits [N, vocab]."""
        route = self.route_for(inputs) if route is None else route
        if route.kind == "graph":          # the graph includes the LM head
            return self.graphs.replay(route.bucket, inputs.input_ids, inputs.positions, inputs.meta)
        if route.kind == "prefill-graph":
            return self.prefill_graphs.replay(route.bucket, inputs.input_ids, inputs.positions, inputs.meta)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        if inputs.is_prefill:
            hidden = hidden[inputs.meta.cu_seqlens_q[1:].long() - 1]
        return self.model.compute_logits(hidden)

    def forward(self, seqs: list[Sequence], is_prefill: bool, feed: torch.Tensor | None = None,
                step: int = 0) -> tuple[torch.Tensor, Route]:
        """The step's logits and the route they took. feed (decode only): the input ids as a device
        tensor, from a step still in flight; positions are then one further than the host's token lists."""
        hooks = self.hooks
        with hooks.phase("prepare", step):
            if feed is None:
                inputs = self.prepare(seqs, is_prefill)
            else:
                inputs = self.to_inputs(self.plan_decode(seqs, ahead=1))
                inputs.input_ids.copy_(feed)
            if self.workers is not None:
                self.workers.send("run", inputs.plan)   # the other ranks replay the same forward
            if self.on_inputs is not None:
                self.on_inputs(inputs)
        if hooks:
            hooks.before_forward(step, inputs)
        with hooks.phase("forward", step):
            if is_prefill and not all(s.prompt_logprobs_done for s in seqs):
                return self._prefill_with_prompt_logprobs(seqs, inputs), EAGER
            route = self.route_for(inputs)
            return self.run_model(inputs, route), route

    @torch.inference_mode()
    def _prefill_with_prompt_logprobs(self, seqs: list[Sequence], inputs: StepInputs) -> torch.Tensor:
        """An eager prefill that also computes, for the sequences asking for prompt log-probs, the
        log-softmax of the raw logits at every position of their chunk and appends the next prompt
        token's log-prob (with its top alternatives) to seq.prompt_logprobs. Positions already recorded
        (a recompute after preemption) are skipped. Returns the last positions' logits, as run_model."""
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        offset = 0
        for seq, n in zip(seqs, inputs.meta.seqlens_q):
            if not seq.prompt_logprobs_done:
                start = seq.num_cached_tokens
                done = len(seq.prompt_logprobs)            # positions whose next token is recorded, + 1
                first = max(start, done - 1)
                last = min(start + n, seq.num_prompt_tokens - 1)   # position p predicts token p + 1
                if last > first:
                    rows = hidden[offset + first - start: offset + last - start]
                    lp = torch.log_softmax(self.model.compute_logits(rows).float(), dim=-1)
                    targets = torch.tensor(seq.token_ids[first + 1: last + 1], device=lp.device)
                    k = seq.sampling_params.prompt_logprobs
                    chosen, ranks, top_ids, top_lps = logprobs_of(lp, targets, k)
                    ids = top_ids.tolist() if top_ids is not None else None
                    lps = top_lps.tolist() if top_lps is not None else None
                    for j, (t, c, r) in enumerate(zip(targets.tolist(), chosen.tolist(), ranks.tolist())):
                        top = list(zip(ids[j], lps[j])) if ids is not None else []
                        seq.prompt_logprobs.append(TokenLogprob(t, c, int(r), top))
            offset += n
        return self.model.compute_logits(hidden[inputs.meta.cu_seqlens_q[1:].long() - 1])

    def sample(self, seqs: list[Sequence], logits: torch.Tensor, step: int = 0) -> list[int]:
        with self.hooks.phase("sample", step):
            return self._sample(seqs, logits).tolist()

    def sample_tensor(self, seqs: list[Sequence], logits: torch.Tensor, step: int = 0) -> torch.Tensor:
        with self.hooks.phase("sample", step):
            return self._sample(seqs, logits)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        return self._draw(seqs, logits)[0]

    def _draw(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[torch.Tensor, SampledLogprobs | None]:
        """The step's ids on the device, and the log-probs of the rows that asked for them. A batch in
        which no row needs processing takes exactly the plain path (sample_tensor)."""
        temps, gens, rows = [], [], {}
        for i, seq in enumerate(seqs):          # one walk over the batch: temperature, generator, processing
            sp = seq.sampling_params
            temps.append(sp.temperature)
            if sp.seed is not None:
                gen = self._seq_generators.get(seq.seq_id)
                if gen is None:
                    gen = torch.Generator(device=self.device)
                    gen.manual_seed(sp.seed)
                    self._seq_generators[seq.seq_id] = gen
                gens.append(gen)
            else:
                gens.append(self.generator)
            if sp.needs_processing(seq.num_completion_tokens):
                rows[i] = RowInputs(sp, seq.token_ids, seq.num_prompt_tokens, self.config.eos_token_ids, seq.seq_id)
        if not rows:
            return sample_tensor(logits, temps, gens), None
        if self._history is None and any(r.params.has_penalties for r in rows.values()):
            self._history = TokenHistory(logits.shape[1], logits.device)
        return sample_processed(logits, temps, gens, rows, self.config.logprobs_mode, self._history)

    def close(self) -> None:
        """Drop the KV pool (and the layer views of it), the graphs and the weights so their memory can go back."""
        for layer in self.model.attention_layers():
            layer.k_cache = layer.v_cache = torch.empty(0)
        self.kv_cache = torch.empty(0)
        self.graphs = self.prefill_graphs = None
        self.model = None
        if self.workers is not None:
            self.workers.close()
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def forget(self, seq_id: int) -> None:
        self._seq_generators.pop(seq_id, None)
        if self._history is not None:
            self._history.forget(seq_id)

    def run(self, seqs: list[Sequence], is_prefill: bool, step: int = 0) -> tuple[list[int], Route]:
        """One step, waiting for its tokens on the host."""
        ids, route, _ = self.run_step(seqs, is_prefill, step)
        return ids, route

    def run_step(self, seqs: list[Sequence], is_prefill: bool, step: int = 0
                 ) -> tuple[list[int], Route, dict[int, TokenLogprob]]:
        """run(), plus batch row -> log-prob of its token for the rows whose requests asked for them."""
        logits, route = self.forward(seqs, is_prefill, step=step)
        with self.hooks.phase("sample", step):
            tokens, logprobs = self._draw(seqs, logits)
            ended = self.clock.mark() if self.clock is not None else None
            t_wait = time.perf_counter()
            ids = tokens.tolist()
            self.last_wait_s = time.perf_counter() - t_wait    # host blocked on the device (StepOutput.wait_s)
        self.last_device_span = self.clock.span(self._started, ended) if ended is not None else None
        return ids, route, (logprobs.to_host(ids) if logprobs is not None else {})

    def launch(self, seqs: list[Sequence], is_prefill: bool, feed: torch.Tensor | None = None,
               step: int = 0) -> Launched:
        """run() without waiting: the sampled ids stay on the device, and a copy to pinned host memory is
        queued right behind them with an event, so reading them later waits for this step only, not for
        a step launched after it."""
        logits, route = self.forward(seqs, is_prefill, feed, step)
        with self.hooks.phase("sample", step):
            tokens, logprobs = self._draw(seqs, logits)
        if not tokens.is_cuda:
            return Launched(tokens, tokens, None, route, logprobs)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        if logprobs is not None:
            logprobs.stage()                     # read after `ready`, like the ids
        ready = torch.cuda.Event(enable_timing=True)
        ready.record()
        return Launched(tokens, host, ready, route, logprobs, self._started)
