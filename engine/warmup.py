"""What start-up runs before the first request, as data: every shape a wide batch meets.

On CUDA the first call of a kernel at a new shape pays for what is compiled or loaded lazily: a Triton
kernel is compiled once per value of its constexprs and per specialization of its arguments, cuBLAS
loads the kernel it picks for each new GEMM shape class, the sampler's paths each have their own
kernels. A server pays that on its first wide burst unless start-up has met every such shape already.
:func:`warmup_plan` lists them for one engine configuration; :func:`warm_paths` runs the list on a
runner (:func:`run_warmup`: scratch inputs, slots -1 write nothing, a throwaway generator leaves the
engine's random stream as it is) and records what it ran in ``runner.warmed``. Decode batches that a
CUDA graph covers are warmed by the capture (``decode-graph``); the list says so, so a test can check
that every bucket is covered. :func:`profile_run` is the one forward before the KV pool exists: the
peak work memory that engine/kv_pool.py leaves room for.

The plan is the same on every tensor-parallel rank (it depends only on the configuration and the
device type), so the ranks' collectives inside the warm forwards pair up.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from engine.attention.splits import PREFILL_PACKED_SEQS, decode_variants
from engine.graph import EAGER, default_buckets
from engine.levers import DECODE_SPLIT_KNOBS
from engine.sampling.sampler import sample
from engine.sequence import Sequence
from engine.step_inputs import InputBuilder, StepInputs

SAMPLER_MODES = ("greedy", "sampled", "mixed", "seeded")


@dataclass(frozen=True)
class WarmShape:
    """One warm forward. path: prefill (fresh: nothing cached), prefill-paged (a cached prefix read
    through the block table: chunk continuations, prefix hits), mixed (`seqs` - 1 decode rows, then one
    chunk after a cached prefix), decode-eager, decode-graph (a captured bucket), sample (a sampler path on
    `seqs` rows). tokens: new tokens per sequence (prefill, mixed: the chunk's) or the context length
    (decode)."""
    path: str
    seqs: int
    tokens: int
    cached: int = 0
    mode: str = ""
    why: str = ""

    def record(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v not in ("", 0) or k in ("seqs", "tokens")}


def prefill_token_counts(max_num_batched_tokens: int, smallest: int = 16) -> list[int]:
    """Token counts of one prefill step from `smallest` up to the step budget: every power of two and the
    budget itself (GEMM kernels are chosen by the token count's size class), plus an odd count."""
    counts = {max_num_batched_tokens}
    n = smallest
    while n < max_num_batched_tokens:
        counts.add(n)
        n *= 2
    counts.add(min(smallest + 1, max_num_batched_tokens))
    return sorted(counts)


def graph_buckets(config) -> list[int]:
    """The decode batch sizes that CUDA graphs will be captured for (empty when eager)."""
    if config.enforce_eager:
        return []
    buckets = list(config.graph_buckets) if config.graph_buckets else default_buckets(config.max_num_seqs)
    return [b for b in buckets if b <= config.max_num_seqs] or [min(buckets)]


def warmup_plan(config, backend: str, sm_count: int = 0, tp_size: int = 1,
                decode_knobs: dict | None = None) -> list[WarmShape]:
    """Every shape to warm for `config` with attention `backend` on a GPU of `sm_count` SMs; `decode_knobs`: the
    Triton decode's knobs in place of splits.py's (engine/levers.py: LAB_DECODE), whose split knobs make its
    compiled variants."""
    max_len, budget, max_seqs = config.max_model_len, config.max_num_batched_tokens, config.max_num_seqs
    plan: list[WarmShape] = []
    for t in prefill_token_counts(budget):
        length = min(t, max_len - 1)
        seqs = max(1, min(t // length, max_seqs))
        plan.append(WarmShape("prefill", seqs, length, why="GEMM size class / step token count"))
    if max_len > 16:
        # a chunk continuation: one and several sequences reading a cached prefix through the block table
        for seqs in sorted({1, min(3, max_seqs)}):
            plan.append(WarmShape("prefill-paged", seqs, 16, cached=8, why="cached prefix through the block table"))
    wide = PREFILL_PACKED_SEQS + 1
    if backend == "triton" and max_seqs >= wide and budget >= wide:
        # the prefill kernel's other grid: a prefill of more sequences than it packs (fresh, and through the table)
        tokens = min(16, budget // wide)
        plan.append(WarmShape("prefill", wide, tokens, why="prefill grid past the packed sequences"))
        if max_len > tokens + 8:
            plan.append(WarmShape("prefill-paged", wide, tokens, cached=8, why="prefill grid past the packed sequences"))
    mixed = config.mixed_batches
    if mixed and max_len > 16 and max_seqs > 1:
        for seqs in sorted({2, min(4, max_seqs)}):
            plan.append(WarmShape("mixed", seqs, 16, cached=8, why="decode rows and a chunk in one step"))
    buckets = graph_buckets(config)
    for b in buckets:
        plan.append(WarmShape("decode-graph", b, max_len, why="captured graph bucket"))
    if not buckets or max(buckets) < max_seqs or mixed:
        # eager decode happens (a batch no graph covers; a mixed step's decode rows, whose attention runs between
        # its graph pieces): every batch-size class, and every compiled variant of the decode kernel
        for b in default_buckets(max_seqs):
            plan.append(WarmShape("decode-eager", b, 16, why="batch size class"))
        if backend == "triton" and sm_count > 0:
            kv_heads = config.shape.num_kv_heads // tp_size
            split = {k: v for k, v in (decode_knobs or {}).items() if k in DECODE_SPLIT_KNOBS}
            for (direct, block_s, fused), (b, ctx) in sorted(decode_variants(max_seqs, kv_heads, max_len, sm_count,
                                                                             **split).items(), key=lambda kv: kv[1]):
                plan.append(WarmShape("decode-eager", b, ctx, mode=f"direct={direct},block_s={block_s},fused={fused}",
                                      why="Triton decode variant"))
    for mode in SAMPLER_MODES:
        plan.append(WarmShape("sample", 2, 1, mode=mode, why="sampler path"))
    return plan


# -- running it on a runner (engine/model_runner.py: start-up) ------------------------------------------------
def scratch_prefill(inputs: InputBuilder, num: int, length: int, cached: int = 0) -> StepInputs:
    """Prefill inputs for `num` throwaway sequences of `length` tokens that write nothing (slots -1);
    with `cached`, their first `cached` positions are read from the cache (block 0) as a prefix."""
    bs = inputs.block_size
    seqs = []
    for _ in range(num):
        s = Sequence(-1, [0] * length, None, bs)  # type: ignore[arg-type]
        if cached:
            s.block_table = [0] * ((length + bs - 1) // bs)
            s.num_cached_tokens = cached
        s.num_scheduled_tokens = length - cached
        seqs.append(s)
    step = inputs.prepare_prefill(seqs)
    step.meta.slot_mapping.fill_(-1)
    return step


def scratch_decode(inputs: InputBuilder, num: int, context: int) -> StepInputs:
    """Decode inputs for `num` throwaway sequences of `context` positions that read block 0 for every
    position and write nothing (slots -1)."""
    bs = inputs.block_size
    seqs = []
    for _ in range(num):
        s = Sequence(-1, [0] * context, None, bs)  # type: ignore[arg-type]
        s.block_table = [0] * ((context + bs - 1) // bs)
        seqs.append(s)
    step = inputs.prepare_decode(seqs)
    step.meta.slot_mapping.fill_(-1)
    return step


def scratch_mixed(inputs: InputBuilder, decodes: int, length: int, cached: int) -> StepInputs:
    """A mixed step's inputs that write nothing (slots -1): `decodes` one-token rows reading `cached` + 1
    positions of block 0, then one chunk of `length` - `cached` new tokens after a `cached`-token prefix."""
    bs = inputs.block_size
    seqs = []
    for i in range(decodes + 1):
        s = Sequence(-1, [0] * (cached + 1 if i < decodes else length), None, bs)  # type: ignore[arg-type]
        s.block_table = [0] * ((s.num_tokens + bs - 1) // bs)
        s.num_cached_tokens = s.num_tokens - 1 if i < decodes else cached
        s.num_scheduled_tokens = s.num_tokens - s.num_cached_tokens
        s.decoding = i < decodes
        seqs.append(s)
    step = inputs.prepare_prefill(seqs)
    step.meta.slot_mapping.fill_(-1)
    return step


@torch.inference_mode()
def profile_run(runner) -> None:
    """CUDA, before the KV pool exists: one prefill at the configured token budget, so that the pool's
    sizing (engine/kv_pool.py: gpu_blocks) can read the peak work memory."""
    cfg = runner.config
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    seq_len = min(cfg.max_num_batched_tokens, cfg.max_model_len)
    num = max(1, min(cfg.max_num_batched_tokens // seq_len, cfg.max_num_seqs))
    runner.run_model(scratch_prefill(runner.inputs, num, seq_len))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()          # the profile run's transient memory must not count as "used"


def plan_for(runner) -> list[WarmShape]:
    """The runner's plan: its configuration, attention backend, GPU's SM count and TP size."""
    sm = torch.cuda.get_device_properties(runner.device).multi_processor_count if runner.device.startswith("cuda") else 0
    return warmup_plan(runner.config, runner.attention_backend, sm, runner.tp.world_size,
                       getattr(runner.backend, "decode_knobs", None))


def warm_paths(runner) -> None:
    """CUDA: meet every shape a wide batch will use before the first request (the plan: prefill token
    counts up to the step budget, prefills reading a cached prefix, eager decode batch classes and Triton
    decode variants where eager decode can happen, the sampler's paths), so JIT compiles and first-launch
    costs land in init time, not in a request. Decode-graph rows are run by the capture."""
    if runner.device.startswith("cuda"):
        run_warmup(runner, plan_for(runner))


@torch.inference_mode()
def run_warmup(runner, plan: list[WarmShape]) -> list[dict]:
    """Run every warm shape of `plan` except decode-graph (capture warms those) on `runner`; returns the
    records of what ran and adds them to ``runner.warmed`` (and the time to ``runner.warm_seconds``).
    Nothing is written to the cache and the engine's generator is not drawn from. Usable on any device
    (tests run it on CPU)."""
    t0 = time.perf_counter()
    throwaway = torch.Generator(device=runner.device)
    seeded = torch.Generator(device=runner.device)
    inputs, ran = runner.inputs, []
    for shape in plan:
        if shape.path == "prefill":
            runner.run_model(scratch_prefill(inputs, shape.seqs, shape.tokens), EAGER)
        elif shape.path == "prefill-paged":
            runner.run_model(scratch_prefill(inputs, shape.seqs, shape.tokens + shape.cached, cached=shape.cached),
                             EAGER)
        elif shape.path == "mixed":
            runner.run_model(scratch_mixed(inputs, shape.seqs - 1, shape.tokens + shape.cached, shape.cached), EAGER)
        elif shape.path == "decode-eager":
            runner.run_model(scratch_decode(inputs, shape.seqs, shape.tokens), EAGER)
        elif shape.path == "sample":
            logits = runner.run_model(scratch_decode(inputs, shape.seqs, 1), EAGER)
            temps = {"greedy": [0.0] * shape.seqs, "sampled": [1.0] * shape.seqs,
                     "mixed": [1.0, 0.0] * (shape.seqs // 2) + [1.0] * (shape.seqs % 2),
                     "seeded": [1.0] * shape.seqs}[shape.mode]
            gens = [throwaway] * shape.seqs if shape.mode != "seeded" else [seeded] + [throwaway] * (shape.seqs - 1)
            sample(logits, temps, gens)
        else:
            continue
        ran.append(shape.record())
    if runner.device.startswith("cuda"):
        torch.cuda.synchronize()
    runner.warm_seconds += time.perf_counter() - t0
    runner.warmed += ran
    return ran


class CompileWatch:
    """The Triton kernels this process compiles from now on (or loads from Triton's disk cache: a first call at
    a new specialization either way), by name. Start-up opens one after it has warmed every path; a serving
    engine whose watch fills has met a kernel variant the plan missed, and paid for it inside a step.
    Chains a hook installed before it; without Triton (or before Triton 3.4's knobs) it sees nothing."""

    def __init__(self) -> None:
        self.names: list[str] = []
        try:
            from triton import knobs
        except ImportError:
            self._knobs = None
            return
        self._knobs, self._prev = knobs, knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = self._hook

    def _hook(self, **kw):
        self.names.append(getattr(kw.get("fn"), "name", "?"))
        return self._prev(**kw) if self._prev is not None else None

    def close(self) -> None:
        if self._knobs is not None and self._knobs.runtime.jit_cache_hook == self._hook:
            self._knobs.runtime.jit_cache_hook = self._prev
        self._knobs = None
