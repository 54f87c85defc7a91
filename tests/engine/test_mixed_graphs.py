"""Mixed graphs (engine/mixed_graphs.py) on the CPU: the buckets, the layout a step is loaded into (decode rows
padded to the bucket's, the chunks after them) and the route. Nothing is captured without CUDA; the forward over
that layout runs through Triton's interpreter in tests/kernels/test_mixed_graph_interp.py and as captured graphs
in tests/engine/test_gpu_mixed.py."""
import torch

from engine import SamplingParams
from engine.attention import AttentionMetadata
from engine.graph import Route
from engine.mixed_graphs import MixedGraphs, mixed_buckets, mixed_token_buckets

GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_buckets_pair_decode_rows_with_token_buckets_that_leave_room_for_a_chunk():
    buckets = mixed_buckets(8, 64)
    assert buckets == [(1, 16), (1, 32), (1, 64), (2, 16), (2, 32), (2, 64), (4, 16), (4, 32), (4, 64),
                       (8, 16), (8, 32), (8, 64)]
    assert (16, 16) not in mixed_buckets(16, 64) and (16, 32) in mixed_buckets(16, 64)
    assert {d for d, _ in mixed_buckets(100, 512)} == {1, 2, 4, 8, 16, 32, 64, 100}
    # above 256 tokens finer than powers of two: decodes beside a 1,024-token prompt pad to 1,280, not 2,048
    assert mixed_token_buckets(16384)[-5:] == [1024, 1280, 1536, 1792, 2048]
    assert min(t for t in mixed_token_buckets(16384) if t >= 64 + 1024) == 1280
    assert mixed_token_buckets(100) == [16, 32, 64, 100]


def test_prefill_graphs_take_the_same_finer_buckets_up_to_1024_tokens():
    from engine.graph import prefill_buckets

    assert prefill_buckets(16384) == [16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024]
    assert min(t for t in prefill_buckets(16384) if t >= 544) == 640     # a 544-token prefill: 640 rows, not 1,024
    assert prefill_buckets(300) == [16, 32, 64, 128, 256] and prefill_buckets(8) == [16]


def _graphs(buckets, max_chunks=3):
    return MixedGraphs(None, buckets, max_blocks=4, max_model_len=64, device="cpu", max_chunks=max_chunks, emulate=True)


def test_a_step_takes_the_smallest_decode_rows_then_the_smallest_tokens_that_hold_it():
    g = _graphs(mixed_buckets(8, 64))
    assert g.bucket_for(num_tokens=13, num_seqs=2, num_decodes=1) == (1, 16)      # 1 + 12 chunk tokens
    assert g.bucket_for(num_tokens=16, num_seqs=3, num_decodes=2) == (2, 16)
    assert g.bucket_for(num_tokens=16, num_seqs=4, num_decodes=3) == (4, 32)      # 4 padded rows + 13 > 16
    assert g.bucket_for(num_tokens=63, num_seqs=4, num_decodes=3) == (4, 64)      # 4 + 60: exactly full
    assert g.bucket_for(num_tokens=64, num_seqs=4, num_decodes=3) is None          # 4 + 61 > 64
    assert g.bucket_for(num_tokens=20, num_seqs=7, num_decodes=3) is None          # 4 chunks > 3
    assert g.bucket_for(num_tokens=20, num_seqs=2, num_decodes=0) is None          # no decode rows: not mixed
    assert g.bucket_for(num_tokens=40, num_seqs=10, num_decodes=9) is None         # more decodes than any bucket


def test_a_step_is_loaded_with_its_decode_rows_padded_and_its_chunks_after_them():
    """Three decodes (contexts 5, 9, 7) and two chunks (6 new tokens after 16 cached; 4 fresh) into (4, 32)."""
    g = _graphs([(4, 32)])
    d, lens = 3, [1, 1, 1, 6, 4]
    cu_q = torch.tensor([0, 1, 2, 3, 9, 13], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 14, 21, 43, 47], dtype=torch.int32)
    ids = torch.arange(100, 113)
    pos = torch.tensor([4, 8, 6, *range(16, 22), *range(4)])
    slots = torch.arange(200, 213)
    tables = torch.arange(10).reshape(5, 2).to(torch.int32)
    meta = AttentionMetadata(is_prefill=True, slot_mapping=slots, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                             max_seqlen_q=6, max_seqlen_k=22, block_tables=tables,
                             context_lens=torch.tensor([5, 9, 7], dtype=torch.int32),
                             decode_order=torch.tensor([1, 2, 0], dtype=torch.int32), seqlens_q=lens,
                             seqlens_k=[5, 9, 7, 22, 4], num_decodes=d)
    g.input_ids.fill_(-7)                                  # what an earlier step left
    assert g._load((4, 32), ids, pos, meta) == 5
    assert g.input_ids[:3].tolist() == [100, 101, 102] and g.input_ids[4:14].tolist() == list(range(103, 113))
    assert g.positions[4:14].tolist() == pos[3:].tolist()
    assert g.slot_mapping[:4].tolist() == [200, 201, 202, -1]          # the padding decode row stores nothing
    assert g.slot_mapping[4:14].tolist() == list(range(203, 213)) and (g.slot_mapping[14:] == -1).all()
    assert g.context_lens.tolist() == [5, 9, 7, 0]                     # ... and reads nothing
    assert g.decode_order.tolist() == [1, 2, 0, 3]
    # sequences 0..3 the decode rows, 4 and 5 the chunks (shifted one row), 6 a padding one of no tokens
    assert g.cu_seqlens_q[:8].tolist() == [0, 1, 2, 3, 4, 10, 14, 14]
    assert g.cu_seqlens_k[4:7].tolist() == [21, 43, 47]
    assert g.block_tables[:3, :2].tolist() == tables[:3].tolist() and g.block_tables[4:6, :2].tolist() == tables[3:].tolist()
    # the LM head's rows: the three decodes, then each chunk's last token
    assert g.last.tolist()[:5] == [0, 1, 2, 9, 13] and (g.last[5:] == 0).all()


def test_a_mixed_step_routes_to_a_mixed_graph_and_wider_ones_to_piecewise(tiny_engine):
    """route_for: a step with decode rows takes the mixed graph that holds it; a step with more chunks than the
    set holds falls through to piecewise. (The set's buckets are marked captured and only routed.)"""
    from engine.piecewise import PiecewiseGraphs

    engine = tiny_engine(device="cpu", kvcache_block_size=16, max_num_batched_tokens=64, max_model_len=512,
                         mixed_batches=True, max_num_seqs=8)
    runner = engine.runner
    runner.piecewise = PiecewiseGraphs(runner.model, runner.backend, [16, 32, 64], 8, "cpu", emulate=True)
    mixed = MixedGraphs(None, mixed_buckets(8, 64), 32, 512, "cpu", max_chunks=1)
    mixed.graphs = dict.fromkeys(mixed.buckets)
    runner.mixed_graphs = mixed
    sp = SamplingParams(max_tokens=8, **GREEDY)
    engine.add_request(list(range(100, 120)), sp)
    engine.step()                                          # its prefill: now it decodes
    engine.add_request(list(range(200, 210)), sp)
    seqs, is_prefill = engine.schedule()
    assert is_prefill and [s.num_scheduled_tokens for s in seqs] == [1, 10]
    assert runner.route_for(runner.inputs.prepare(seqs, is_prefill)) == Route("mixed-graph", 16, rows=1)
    assert str(Route("mixed-graph", 16, rows=1)) == "mixed-graph:1/16"
    engine.postprocess(seqs, [0, 0], is_prefill)
    engine.add_request(list(range(300, 305)), sp)
    engine.add_request(list(range(400, 405)), sp)          # two chunks: more than the set's one
    seqs, is_prefill = engine.schedule()
    assert [s.num_scheduled_tokens for s in seqs] == [1, 1, 5, 5]
    assert runner.route_for(runner.inputs.prepare(seqs, is_prefill)) == Route("piecewise", 16)
