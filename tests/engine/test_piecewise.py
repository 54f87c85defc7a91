"""Piecewise graphs (engine/piecewise.py) on the CPU, emulated: the forward cut at every attention call, over
static buffers padded to a token bucket, the LM head on each sequence's last row. Nothing is captured without
CUDA, so this is the plumbing (padding, copies, rows, the routes); tests/kernels/test_gpu_kernels.py replays
the captured pieces on a GPU."""
import pytest
import torch

from engine import SamplingParams
from engine.piecewise import PiecewiseGraphs, piecewise_buckets

from test_mixed_step import _arrivals, _workload

GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_buckets_follow_the_step_budget():
    assert piecewise_buckets(512) == [16, 32, 64, 128, 256, 512]
    assert piecewise_buckets(100) == [16, 32, 64, 100]
    assert piecewise_buckets(8) == [8]
    assert piecewise_buckets(3000)[-2:] == [2048, 3000]
    assert piecewise_buckets(16384)[-3:] == [6144, 7168, 8192]     # the serve-cuda budget: larger steps run eagerly


def _emulated(engine, buckets=(16, 32, 64)):
    runner = engine.runner
    runner.piecewise = PiecewiseGraphs(runner.model, runner.backend, list(buckets), engine.config.max_num_seqs,
                                       "cpu", emulate=True)
    return engine


@pytest.mark.parametrize("mixed", [False, True], ids=["step-model", "mixed"])
def test_piecewise_steps_give_the_eager_steps_tokens_and_logits(tiny_engine, mixed):
    prompts, at = _workload(2)
    sp = SamplingParams(max_tokens=10, **GREEDY)
    opts = dict(device="cpu", kvcache_block_size=16, max_num_batched_tokens=64, max_model_len=512,
                mixed_batches=mixed, max_num_seqs=8)
    eager, _ = _arrivals(tiny_engine(**opts), prompts, at, sp)
    engine = _emulated(tiny_engine(**opts), buckets=(16, 32, 64))
    routes = []
    real = engine.runner.run_model

    def spy(inputs, route=None):
        route = engine.runner.route_for(inputs) if route is None else route
        routes.append(route.kind)
        out = real(inputs, route)
        if route.kind == "piecewise":           # the same logits as the eager forward of the same inputs
            hidden = engine.runner.model(inputs.input_ids, inputs.positions, inputs.meta)
            ref = engine.runner.model.compute_logits(hidden[inputs.meta.cu_seqlens_q[1:].long() - 1])
            assert out.shape == ref.shape and (out - ref).abs().max().item() < 1e-4
        return out

    engine.runner.run_model = spy
    pieces, _ = _arrivals(engine, prompts, at, sp)
    assert routes.count("piecewise") >= 3 and "eager" in routes       # decodes stay eager on the CPU
    assert pieces == eager


def test_a_step_larger_than_every_bucket_runs_eagerly(tiny_engine):
    engine = _emulated(tiny_engine(device="cpu", kvcache_block_size=16, max_num_batched_tokens=64), buckets=(16,))
    seq = engine.add_request(list(range(100, 140)), SamplingParams(max_tokens=1, **GREEDY))
    seqs, is_prefill = engine.schedule()
    inputs = engine.runner.inputs.prepare(seqs, is_prefill)
    assert engine.runner.route_for(inputs).kind == "eager"        # 40 tokens > 16
    assert seq.num_scheduled_tokens == 40


def test_a_prefix_reading_prefill_without_decode_rows_takes_a_paged_prefill_graph(tiny_engine):
    """route_for: a prefill that reads a cached prefix replays a paged prefill graph when it has no decode rows
    and at most that graph set's sequences; a mixed step (decode rows first) and a wider prefill take piecewise.
    (CUDA graphs cannot be captured on a CPU: the paged set's buckets are marked captured and only routed.)"""
    from engine.graph import PrefillGraphs, Route

    engine = _emulated(tiny_engine(device="cpu", kvcache_block_size=16, max_num_batched_tokens=64,
                                   max_model_len=512, mixed_batches=True, max_num_seqs=8))
    runner = engine.runner
    paged = PrefillGraphs(None, [16, 64], 2, "cpu", max_blocks=32, max_model_len=512)
    paged.graphs = dict.fromkeys(paged.buckets)

    def route(seqs, is_prefill):
        runner.paged_prefill_graphs = paged
        try:
            return runner.route_for(runner.inputs.prepare(seqs, is_prefill))
        finally:
            runner.paged_prefill_graphs = None

    sp = SamplingParams(max_tokens=4, **GREEDY)
    prompt = list(range(100, 141))
    engine.add_request(prompt, sp)
    while not engine.is_finished():
        engine.step()
    engine.add_request(prompt + [7], sp)                  # 32 positions cached, 10 new
    seqs, is_prefill = engine.schedule()
    assert [s.num_cached_tokens for s in seqs] == [32]
    assert route(seqs, is_prefill) == Route("paged-prefill-graph", 16)
    engine.postprocess(seqs, [0], is_prefill)
    engine.add_request(prompt + [8], sp)                  # arrives while the first decodes: a mixed step
    seqs, is_prefill = engine.schedule()
    assert is_prefill and seqs[0].decoding and not seqs[1].decoding
    assert route(seqs, is_prefill) == Route("piecewise", 16)
    engine.postprocess(seqs, [0, 0], is_prefill)
    while not engine.is_finished():
        engine.step()
    for i in range(3):                                    # three prefix readers: more than the set's 2 sequences
        engine.add_request(prompt + [9, i], sp)
    seqs, is_prefill = engine.schedule()
    assert len(seqs) == 3 and all(s.num_cached_tokens == 32 for s in seqs)
    assert route(seqs, is_prefill) == Route("piecewise", 64)
