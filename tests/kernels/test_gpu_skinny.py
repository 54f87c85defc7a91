"""The split-K GEMM of a few rows (engine/layers/skinny_gemm.py, LAB_SKINNY_GEMM) on a GPU: Qwen3-0.6B's four
projections at 2-32 rows against F.linear (cuBLAS) in bf16, and replayed from a CUDA graph."""
import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]      # qkv, o, gate_up, down: (N, K)


@pytest.mark.parametrize("m", [2, 8, 24, 32])
def test_skinny_gemm_matches_linear_on_qwen3_shapes(m):
    from engine.layers.skinny_gemm import skinny_gemm

    gen = torch.Generator(device="cuda").manual_seed(m)
    for n, k in SHAPES:
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).bfloat16()
        ref = F.linear(x.float(), w.float())
        y = skinny_gemm(x, w)
        # one rounding of a float32 sum to bf16 (8 bits of mantissa), each row against its own largest output
        err = ((y.float() - ref).abs().amax(1) / ref.abs().amax(1)).max().item()
        assert err <= 8e-3, (m, n, k, err)


def test_skinny_gemm_replays_from_a_cuda_graph():
    from engine.layers.skinny_gemm import counters, skinny_gemm

    counters(torch.device("cuda"))
    x = torch.randn(24, 2048, device="cuda").bfloat16()
    w = (torch.randn(1024, 2048, device="cuda") / 2048 ** 0.5).bfloat16()
    eager = skinny_gemm(x, w)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        y = skinny_gemm(x, w)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, eager)
    x.copy_(torch.randn_like(x))                     # new inputs, the same captured kernels
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, skinny_gemm(x, w))
