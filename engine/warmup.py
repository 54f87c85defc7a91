"""What start-up runs before the first request, as data: every shape a wide batch meets.

On CUDA the first call of a kernel at a new shape pays for what is compiled or loaded lazily: a Triton
kernel is compiled once per value of its constexprs and per specialization of its arguments, cuBLAS
loads the kernel it picks for each new GEMM shape class, the sampler's paths each have their own
kernels. A server pays that on its first wide burst unless start-up has met every such shape already.
:func:`warmup_plan` lists them for one engine configuration; ``ModelRunner.warm_paths`` runs the list
(scratch inputs: slots -1 write nothing, a throwaway generator leaves the engine's random stream as
it is) and records what it ran. Decode batches that a CUDA graph covers are warmed by the capture
(``decode-graph``); the list says so, so a test can check that every bucket is covered.

The plan is the same on every tensor-parallel rank (it depends only on the configuration and the
device type), so the ranks' collectives inside the warm forwards pair up.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from engine.attention.splits import decode_variants
from engine.graph import default_buckets

SAMPLER_MODES = ("greedy", "sampled", "mixed", "seeded")


@dataclass(frozen=True)
class WarmShape:
    """One warm forward. path: prefill (fresh: nothing cached), prefill-paged (a cached prefix read
    through the block table: chunk continuations, prefix hits), decode-eager, decode-graph (a captured
    bucket), sample (a sampler path on `seqs` rows). tokens: new tokens per sequence (prefill) or the
    context length (decode)."""
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


def warmup_plan(config, backend: str, sm_count: int = 0, tp_size: int = 1) -> list[WarmShape]:
    """Every shape to warm for `config` with attention `backend` on a GPU of `sm_count` SMs."""
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
    buckets = graph_buckets(config)
    for b in buckets:
        plan.append(WarmShape("decode-graph", b, max_len, why="captured graph bucket"))
    if not buckets or max(buckets) < max_seqs:
        # eager decode happens: every batch-size class, and every compiled variant of the decode kernel
        for b in default_buckets(max_seqs):
            plan.append(WarmShape("decode-eager", b, 16, why="batch size class"))
        if backend == "triton" and sm_count > 0:
            kv_heads = config.shape.num_kv_heads // tp_size
            for (direct, block_s), (b, ctx) in sorted(decode_variants(max_seqs, kv_heads, max_len, sm_count).items(),
                                                     key=lambda kv: kv[1]):
                plan.append(WarmShape("decode-eager", b, ctx, mode=f"direct={direct},block_s={block_s}",
                                      why="Triton decode variant"))
    for mode in SAMPLER_MODES:
        plan.append(WarmShape("sample", 2, 1, mode=mode, why="sampler path"))
    return plan
