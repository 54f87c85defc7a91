"""Warm means warm: what start-up runs (engine/warmup.py), the aligned step inputs that keep Triton from
compiling per batch size, running the plan on CPU, and the step's batch list built once."""
from __future__ import annotations

import itertools

import pytest
import torch

from engine import SamplingParams
from engine.attention.splits import (DECODE_BLOCK_N, DECODE_WAVES, PREFILL_PACKED_SEQS, choose_splits, decode_variant,
                                     decode_variants, max_split_len, next_power_of_2)
from engine.config import Config
from engine.graph import default_buckets
from engine.observe import StepHooks
from engine.warmup import SAMPLER_MODES, prefill_token_counts, run_warmup, warmup_plan

SM = 132          # an H200's SM count: the plan is pure arithmetic, so any machine can check it


def serve_config(model, **kw) -> Config:
    """The serving settings of `labkit serve` on CUDA (graphs, 256 seqs, 16k tokens) on the tiny model's config."""
    base = dict(enforce_eager=False, max_num_seqs=256, max_num_batched_tokens=16384, max_model_len=4096)
    return Config(str(model), **{**base, **kw})


def test_plan_covers_every_decode_bucket_prefill_size_and_sampler_path(tiny_model_dir):
    cfg = serve_config(tiny_model_dir)
    plan = warmup_plan(cfg, "triton", SM)
    graph_rows = {w.seqs for w in plan if w.path == "decode-graph"}
    assert graph_rows == set(default_buckets(256))                  # every bucket the capture makes
    prefill = {w.seqs * w.tokens for w in plan if w.path == "prefill"}
    for t in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192):
        assert t in prefill or any(t - 4 <= p <= t for p in prefill), t
    assert max(prefill) >= 16384 - 4                                 # up to the step budget (4 x 4095)
    assert any(p % 2 for p in prefill)                               # an odd token count
    assert {w.mode for w in plan if w.path == "sample"} == set(SAMPLER_MODES)
    assert {w.seqs for w in plan if w.path == "prefill-paged"} == {1, 3, PREFILL_PACKED_SEQS + 1}
    assert not [w for w in plan if w.path == "decode-eager"]        # graphs cover every decode batch
    # the prefill kernel's two grids (packed up to PREFILL_PACKED_SEQS sequences, the full grid past them), fresh
    # and through the block table
    for path in ("prefill", "prefill-paged"):
        seqs = {w.seqs for w in plan if w.path == path}
        assert min(seqs) <= PREFILL_PACKED_SEQS < max(seqs), (path, seqs)
    assert max(w.seqs for w in warmup_plan(serve_config(tiny_model_dir, max_num_seqs=31), "triton", SM)
               if w.path.startswith("prefill")) <= PREFILL_PACKED_SEQS      # nothing wider can be scheduled


def test_eager_plan_meets_every_decode_kernel_variant(tiny_model_dir):
    """Brute force over batch and context: every (DIRECT, BLOCK_S) the decode kernel can compile is warmed."""
    cfg = serve_config(tiny_model_dir, enforce_eager=True, max_model_len=2048, max_num_seqs=64)
    kv_heads = cfg.shape.num_kv_heads
    plan = warmup_plan(cfg, "triton", SM)
    warmed = {decode_variant(w.seqs, kv_heads, w.tokens, SM) for w in plan if w.path == "decode-eager"}
    reachable = {decode_variant(b, kv_heads, n, SM) for b in range(1, 65) for n in range(1, 2049, 7)}
    assert reachable and reachable <= warmed
    assert {w.seqs for w in plan if w.path == "decode-eager" and not w.mode} == set(default_buckets(64))
    assert not [w for w in plan if w.path == "decode-graph"]


def test_mixed_plan_meets_a_mixed_step_and_every_decode_kernel_variant(tiny_model_dir):
    """Graphs cover every decode batch, but a mixed step's decode rows run the decode kernel eagerly between its
    graph pieces: with mixed steps on, every variant it can compile is warmed, and a mixed step itself."""
    cfg = serve_config(tiny_model_dir, max_model_len=2048, max_num_seqs=64, mixed_batches=True)
    kv_heads = cfg.shape.num_kv_heads
    plan = warmup_plan(cfg, "triton", SM)
    warmed = {decode_variant(w.seqs, kv_heads, w.tokens, SM) for w in plan if w.path == "decode-eager"}
    reachable = {decode_variant(b, kv_heads, n, SM) for b in range(1, 65) for n in range(1, 2049, 7)}
    assert reachable and reachable <= warmed
    assert {(w.seqs, w.tokens, w.cached) for w in plan if w.path == "mixed"} == {(2, 16, 8), (4, 16, 8)}
    off = warmup_plan(serve_config(tiny_model_dir, max_model_len=2048, max_num_seqs=64), "triton", SM)
    assert not [w for w in off if w.path in ("mixed", "decode-eager")]


def test_plan_is_rank_independent_and_follows_kv_heads_per_rank(tiny_model_dir):
    cfg = serve_config(tiny_model_dir, enforce_eager=True, max_num_seqs=32, max_model_len=1024)
    one, two = warmup_plan(cfg, "triton", SM, 1), warmup_plan(cfg, "triton", SM, 2)
    assert warmup_plan(cfg, "triton", SM, 2) == two                   # deterministic: every rank runs the same
    two_kv = {decode_variant(w.seqs, cfg.shape.num_kv_heads // 2, w.tokens, SM) for w in two if w.mode}
    reach = {decode_variant(b, cfg.shape.num_kv_heads // 2, n, SM) for b in range(1, 33) for n in range(1, 1025, 5)}
    assert reach <= two_kv
    assert {w.seqs for w in one if w.path == "decode-graph"} == {w.seqs for w in two if w.path == "decode-graph"}


def test_decode_variant_matches_the_kernel_arithmetic():
    for b, hk, n in itertools.product((1, 3, 64, 256), (1, 4, 8), (1, 63, 64, 65, 1000, 4096, 40960)):
        splits, split_len = choose_splits(b, hk, n, DECODE_BLOCK_N, SM, DECODE_WAVES)
        assert split_len % 64 == 0 and splits * split_len >= n > (splits - 1) * split_len
        assert decode_variant(b, hk, n, SM)[:2] == (splits == 1, max(2, next_power_of_2(splits)))
    assert len(decode_variants(256, 8, 4096, SM)) > 2


def test_small_batches_take_shorter_splits():
    """A small batch's few programs read shorter splits (more of them run at once); wide batches keep the cap."""
    lens = {b: choose_splits(b, 8, 4096, DECODE_BLOCK_N, SM)[1] for b in (1, 4, 8, 16, 32)}
    assert list(lens.values()) == sorted(lens.values()) and lens[1] < lens[32], lens
    for b, n in lens.items():
        assert n <= max_split_len(b * 8), (b, n)


def test_small_batches_combine_splits_in_the_reduce_kernel(tiny_model_dir):
    """Below DECODE_FUSE_REDUCE_FROM programs a split decode takes the reduce kernel (PDL starts it under the split
    kernel's tail: the faster at batch 1-4 on an H200); wider batches combine in the split kernel."""
    assert decode_variant(1, 8, 4096, SM) == (False, 64, False)
    assert decode_variant(4, 8, 4096, SM)[2] is False
    assert decode_variant(8, 8, 4096, SM)[::2] == (False, True)
    assert decode_variant(64, 8, 64, SM) == (True, 2, False)              # one split: no reduce at all
    cfg = serve_config(tiny_model_dir, enforce_eager=True, max_model_len=2048, max_num_seqs=64)
    plan = {w.mode for w in warmup_plan(cfg, "triton", SM) if w.mode.startswith("direct")}
    assert {m.split("fused=")[1] for m in plan} == {"True", "False"}, plan


def test_prefill_token_counts():
    assert prefill_token_counts(16384) == [16, 17, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    assert prefill_token_counts(512)[-1] == 512


# -- the step inputs: every view 16-byte aligned, whatever the batch -------------------------------------
def engine_for(build, **kw):
    """``build``: the test's ``tiny_engine``."""
    return build(device="cpu", enforce_eager=True, kvcache_block_size=16, max_model_len=256,
                 max_num_batched_tokens=256, max_num_seqs=8, **kw)


def test_step_input_views_are_16_byte_aligned_for_any_batch(tiny_engine):
    from engine.sequence import Sequence

    eng = engine_for(tiny_engine)
    runner = eng.runner
    try:
        for n, length, cached in itertools.product((1, 2, 3, 4, 5), (3, 17, 18), (0, 16)):
            seqs = []
            for i in range(n):
                s = Sequence(i, list(range(1, length + cached + 1)), SamplingParams(), 16)
                s.block_table = list(range(i * 4, i * 4 + (length + cached + 15) // 16))
                s.num_cached_tokens = cached
                s.num_scheduled_tokens = length
                seqs.append(s)
            for inputs in (runner.inputs.prepare_prefill(seqs), runner.inputs.prepare_decode(seqs)):
                m = inputs.meta
                views = [inputs.input_ids, inputs.positions, m.slot_mapping, m.cu_seqlens_q, m.cu_seqlens_k,
                         m.block_tables, m.context_lens]
                for v in (v for v in views if v is not None):
                    assert v.data_ptr() % 16 == 0, (n, length, cached, inputs.is_prefill)
                plan = inputs.plan                         # the views still hold exactly the plan
                assert inputs.input_ids.tolist() == plan.input_ids
                assert inputs.positions.tolist() == plan.positions
                assert m.slot_mapping.tolist() == plan.slot_mapping
    finally:
        eng.close()


# -- running the plan (CPU): it writes nothing and leaves the random stream alone ------------------------
def test_run_warmup_on_cpu_writes_nothing_and_keeps_the_generator(tiny_engine, tiny_model_dir):
    eng = engine_for(tiny_engine)
    runner = eng.runner
    try:
        cfg = Config(str(tiny_model_dir), enforce_eager=True, max_num_seqs=8, max_num_batched_tokens=256,
                     max_model_len=256, mixed_batches=True)
        plan = warmup_plan(cfg, "triton", SM)          # the CUDA plan's shapes, run on the CPU backend
        runner.kv_cache.normal_()
        before = runner.kv_cache.clone()
        state = runner.sampler.generator.get_state()
        ran = run_warmup(runner, plan)
        assert torch.equal(runner.kv_cache, before)
        assert torch.equal(runner.sampler.generator.get_state(), state)
        assert {r["path"] for r in ran} == {"prefill", "prefill-paged", "mixed", "decode-eager", "sample"}
        assert len(ran) == len([w for w in plan if w.path != "decode-graph"])
        assert eng.describe()["warmup"]["shapes"] == len(ran)
    finally:
        eng.close()


# -- the step's (seq_id, positions) list: built once -------------------------------------------------------
class _Keep(StepHooks):
    def __init__(self):
        self.batches = []

    def on_scheduled(self, step, is_prefill, batch):
        self.batches.append(batch)


@pytest.mark.parametrize("overlap", [False, True])
def test_step_hands_one_batch_list_to_hooks_and_output(tiny_engine, overlap):
    eng = engine_for(tiny_engine, overlap=overlap)
    keep = _Keep()
    eng.add_hooks(keep)
    try:
        for i in range(3):
            eng.add_request([100 + i, 5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
        outs = []
        while not eng.is_finished():
            out = eng.step()
            if out.seqs:
                outs.append(out)
        assert len(outs) == len(keep.batches)
        for out, batch in zip(outs, keep.batches):
            assert out.scheduled is batch                  # the same list object, not a rebuilt copy
            assert out.num_tokens == sum(n for _, n in batch)
    finally:
        eng.close()


def test_compile_watch_counts_triton_compiles_and_hands_the_hook_back():
    """CompileWatch sits on Triton's jit_cache_hook (called before each compile or disk-cache load; the CPU's
    interpreter compiles nothing, so the hook is called here as Triton calls it), chains the hook before it, and
    close() puts that one back."""
    knobs = pytest.importorskip("triton").knobs
    from types import SimpleNamespace

    from engine.warmup import CompileWatch

    seen = []
    before = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append(kw["fn"].name)
    outer = knobs.runtime.jit_cache_hook
    try:
        watch = CompileWatch()
        knobs.runtime.jit_cache_hook(key=1, fn=SimpleNamespace(name="_prefill_kernel"))
        knobs.runtime.jit_cache_hook(key=2, fn=SimpleNamespace(name="_decode_split_kernel"))
        assert watch.names == ["_prefill_kernel", "_decode_split_kernel"]
        assert seen == watch.names                           # the earlier hook still hears every call
        watch.close()
        assert knobs.runtime.jit_cache_hook is outer
    finally:
        knobs.runtime.jit_cache_hook = before


def test_the_plan_compiles_the_decode_variants_lab_decodes_split_knobs_make(tiny_model_dir):
    """LAB_DECODE's block_n, waves and kv_per_prog change how a context splits: the warm-up plans the variants those
    knobs make (a step would otherwise compile one mid-serving); its other knobs leave the plan alone."""
    cfg = serve_config(tiny_model_dir, enforce_eager=True, max_model_len=2048, max_num_seqs=64)
    kv_heads = cfg.shape.num_kv_heads

    def variants(knobs):
        return {w.mode for w in warmup_plan(cfg, "triton", SM, decode_knobs=knobs) if w.mode.startswith("direct")}

    def expected(**split):
        return {f"direct={d},block_s={s},fused={f}" for d, s, f in decode_variants(64, kv_heads, 2048, SM, **split)}

    knobs = {"block_n": 16, "waves": 16, "kv_per_prog": 2, "num_warps": 8, "page_tile": True}
    assert variants(knobs) == expected(block_n=16, waves=16, kv_per_prog=2) != expected()
    assert variants({"num_warps": 8, "num_stages": 2, "page_tile": True}) == variants(None) == expected()
