"""CUDA-only: mixed steps and piecewise graphs on the tiny model. With graphs on, a prefix-reading prefill without
decode rows (prefix hits, chunks) replays a paged prefill graph (triton), a mixed step a mixed graph (triton,
engine/mixed_graphs.py) and every other step a full graph does not take piecewise graphs (engine/piecewise.py);
the tokens must be the eager engine's, step for step, and each such step's logits the eager forward's of the same
inputs."""
import pytest
import torch

from engine import SamplingParams

from test_mixed_step import _arrivals, _workload

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GREEDY = dict(temperature=0.0, ignore_eos=True)
SPIED = ("piecewise", "paged-prefill-graph", "mixed-graph")


def _spy(engine, routes: list, tol: float):
    """Record each step's route; check each piecewise, paged prefill or mixed graph step's logits against the eager
    forward of its inputs."""
    runner, real = engine.runner, engine.runner.run_model

    def run_model(inputs, route=None):
        route = runner.route_for(inputs) if route is None else route
        routes.append(route.kind)
        out = real(inputs, route)
        if route.kind in SPIED:
            with torch.inference_mode():
                hidden = runner.model(inputs.input_ids, inputs.positions, inputs.meta)
                ref = runner.model.compute_logits(hidden[inputs.meta.cu_seqlens_q[1:].long() - 1])
            err = (out.float() - ref.float()).abs().max().item()
            assert err <= tol * max(1.0, ref.float().abs().max().item()), err
        return out

    runner.run_model = run_model


@pytest.mark.parametrize("attention", ["triton", "torch"])
@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "step-model"])
def test_piecewise_graphs_give_the_eager_tokens_in_float32(tiny_engine, attention, mixed):
    prompts, at = _workload()
    sp = SamplingParams(max_tokens=12, **GREEDY)
    opts = dict(device="cuda", dtype="float32", attention_backend=attention, kvcache_block_size=16,
                max_num_batched_tokens=64, max_model_len=512, max_num_seqs=16, mixed_batches=mixed,
                num_kvcache_blocks=256)     # two engines at once: a pool each of its own size, not half the GPU each
    eager, _ = _arrivals(tiny_engine(enforce_eager=True, **opts), prompts, at, sp)
    engine = tiny_engine(enforce_eager=False, **opts)
    assert engine.describe()["graph"]["piecewise_buckets"] == [16, 32, 64]
    routes: list = []
    _spy(engine, routes, 1e-4)
    graphs, kinds = _arrivals(engine, prompts, at, sp)
    assert sum(routes.count(k) for k in SPIED) >= 3 and "graph" in routes
    assert ("mixed" in kinds) == mixed
    if mixed:       # the triton backend's mixed steps replay mixed graphs; the torch backend's, piecewise graphs
        assert routes.count("mixed-graph" if attention == "triton" else "piecewise") >= 3
    if attention == "triton" and not mixed:
        assert "paged-prefill-graph" in routes
    assert graphs == eager


def test_piecewise_graphs_in_bf16_with_overlap(tiny_engine):
    prompts, at = _workload(3)
    sp = SamplingParams(max_tokens=16, **GREEDY)
    engine = tiny_engine(device="cuda", dtype="bfloat16", attention_backend="triton", kvcache_block_size=16,
                         max_num_batched_tokens=64, max_model_len=512, max_num_seqs=16, mixed_batches=True,
                         enforce_eager=False, overlap=True, num_kvcache_blocks=256)
    routes: list = []
    _spy(engine, routes, 2e-2)
    out, kinds = _arrivals(engine, prompts, at, sp)
    assert routes.count("mixed-graph") >= 3 and "mixed" in kinds
    assert all(len(o) == 16 for o in out)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("mode", ["1", "prefill"])
def test_prefill_ahead_replays_graphs_with_the_eager_tokens(tiny_engine, monkeypatch, mode):
    """LAB_PREFILL_AHEAD=1, nano-vllm's step model, graphs and the overlapped decode: prefills launched behind a decode
    in flight, and decodes behind a prefill (the prefill's rows fed on the device, the other running requests' ids
    from the host, replayed through the decode graphs), give the eager engine's greedy tokens, one step at a time;
    with "prefill" only the prefills are launched early, and the tokens are the same."""
    prompts, at = _workload()
    sp = SamplingParams(max_tokens=12, **GREEDY)
    opts = dict(device="cuda", dtype="float32", attention_backend="triton", kvcache_block_size=16,
                max_num_batched_tokens=256, max_model_len=512, max_num_seqs=16, mixed_batches=False,
                num_kvcache_blocks=256)
    eager, _ = _arrivals(tiny_engine(enforce_eager=True, **opts), prompts, at, sp)
    monkeypatch.setenv("LAB_PREFILL_AHEAD", mode)
    engine = tiny_engine(enforce_eager=False, overlap=True, **opts)
    assert engine.describe()["prefill_ahead"] is True
    assert engine.describe()["decode_behind_prefill"] is (mode == "1")
    behind, early = [], []
    real, real_early = engine.scheduler._behind_prefill, engine.scheduler._prefill_behind

    def spy(inflight):
        seqs, is_prefill = real(inflight)
        behind.append(sum(s not in inflight for s in seqs))      # rows whose ids come from the host
        return seqs, is_prefill

    def spy_early():
        seqs, is_prefill = real_early()
        early.append(len(seqs))                                  # a prefill launched behind a decode in flight
        return seqs, is_prefill

    engine.scheduler._behind_prefill, engine.scheduler._prefill_behind = spy, spy_early
    routes: list = []
    _spy(engine, routes, 1e-4)
    ahead, _ = _arrivals(engine, prompts, at, sp)
    assert any(early) and "graph" in routes, (early, routes)
    assert any(behind) if mode == "1" else not behind, behind
    assert ahead == eager
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
