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
    assert piecewise_buckets(16384)[-1] == 2048


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
