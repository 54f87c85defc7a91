"""A mixed graph's forward on the CPU through Triton's interpreter (TRITON_INTERPRET=1): the tiny Qwen3 with the
Triton attention backend serves a workload in mixed steps; every mixed step that a mixed graph holds runs twice,
eagerly on its own metadata and over the graph's layout (engine/mixed_graphs.py, emulated: the bucket's static
buffers and metadata, decode rows padded, the decode kernel split for the model's longest context, the prefill
grid of the bucket's tokens, padding sequences), and the logits are compared.

Skipped where triton is not installed or its interpreter cannot run a kernel here.
"""
from __future__ import annotations

import json
import sys

import pytest

from interp import interpreted, interpreter_ready, narrow_head

SM_COUNT = 16       # several splits per decode row in the graph (its longest context), one in the eager step


@pytest.fixture(scope="module")
def results(tiny_model_dir):
    return interpreted(__file__, str(tiny_model_dir))


def test_mixed_graph_steps_give_the_eager_steps_logits(results):
    steps = results["steps"]
    assert len(steps) >= 3, steps
    assert any(s["rows"] > s["decodes"] for s in steps), steps           # padding decode rows
    assert any(s["cached_chunk"] for s in steps), steps                   # a chunk after its cached part
    assert any(s["chunks"] >= 2 for s in steps), steps
    for s in steps:
        assert s["max_abs_err"] <= 1e-4, s


def _workload(model_dir: str) -> dict:
    import torch

    from engine import LLMEngine, SamplingParams
    from engine.attention.triton_backend import TritonAttention
    from engine.graph import EAGER
    from engine.mixed_graphs import MixedGraphs, mixed_buckets

    engine = LLMEngine(model_dir, device="cpu", enforce_eager=True, max_num_seqs=8, max_model_len=256,
                       num_kvcache_blocks=64, kvcache_block_size=16, max_num_batched_tokens=64, mixed_batches=True)
    runner = engine.runner
    narrow_head(runner.model)
    backend = TritonAttention.__new__(TritonAttention)     # the CUDA constructor reads the device's SM count
    backend.sm_count = SM_COUNT
    runner.backend = backend
    for layer in runner.model.attention_layers():
        layer.backend = backend
    blocks = 256 // 16
    graphs = MixedGraphs(runner.model, mixed_buckets(8, 64), blocks, 256, "cpu", emulate=True)
    sp = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)     # noqa: E731
    arrivals = {0: [(17, 12), (23, 12)], 1: [(30, 6), (50, 6)], 3: [(10, 4)]}
    steps = []
    for step in range(60):
        for n, out in arrivals.get(step, []):
            engine.add_request(list(range(100 + 7 * step + n, 100 + 7 * step + 2 * n)), sp(out))
        if engine.is_finished():
            break
        seqs, is_prefill = engine.schedule()
        inputs = runner.inputs.prepare(seqs, is_prefill)
        meta = inputs.meta
        logits = runner.run_model(inputs, EAGER)
        key = graphs.bucket_for(inputs.input_ids.shape[0], len(seqs), meta.num_decodes) if is_prefill else None
        if key is not None:
            d = meta.num_decodes
            got = graphs.replay(key, inputs.input_ids, inputs.positions, meta)
            q = (meta.cu_seqlens_q[d + 1:] - meta.cu_seqlens_q[d:-1]).tolist()
            k = (meta.cu_seqlens_k[d + 1:] - meta.cu_seqlens_k[d:-1]).tolist()
            steps.append({"step": step, "decodes": d, "rows": key[0], "tokens": key[1], "chunks": len(q),
                          "cached_chunk": any(kk > qq for qq, kk in zip(q, k)),
                          "max_abs_err": (got.float() - logits.float()).abs().max().item()
                          if got.shape == logits.shape and torch.isfinite(got).all() else float("inf")})
        engine.postprocess(seqs, logits.argmax(-1).tolist(), is_prefill)
    return {"steps": steps}


def _probe() -> None:
    import torch

    from engine.attention import triton_kernels as tk

    kc = torch.zeros(2, 16, 1, 16)
    tk.paged_decode(torch.zeros(1, 1, 16), kc, kc, torch.zeros(1, 2, dtype=torch.int32),
                    torch.tensor([3], dtype=torch.int32), 0.25, 3, 1)


def main() -> None:
    if not interpreter_ready(_probe):
        return
    print(json.dumps(_workload(sys.argv[1])))


if __name__ == "__main__":
    main()
