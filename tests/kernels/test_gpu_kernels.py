"""CUDA-only: each attention backend against the torch reference on random paged inputs; graph vs eager."""
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HQ, HK, D = 16, 8, 128
# (q heads, kv heads, head_dim): Qwen3-0.6B's (GQA 2), SmolLM2-135M's (GQA 3, head_dim 64), a Qwen2-7B-style GQA 7
SHAPES = [(16, 8, 128), (9, 3, 64), (28, 4, 128)]
SHAPE_IDS = ["qwen3-16x8x128", "smollm2-9x3x64", "gqa7-28x4x128"]


def backends():
    from engine.attention import available_backends
    return [b for b in available_backends("cuda") if b != "torch"]


def float32_backends():
    """The backends a float32 engine can take: FlashAttention-2 has no float32 kernels (the engine refuses it
    there with one line; the bf16 guards cover flash_attn)."""
    return [b for b in backends() if b != "flash_attn"]


def make_cache(num_blocks, page, dtype=torch.bfloat16, hk=HK, d=D):
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(num_blocks, page, hk, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(num_blocks, page, hk, d, device="cuda", dtype=dtype, generator=g)
    return k, v


def tables_for(lengths, page, num_blocks, seed=0):
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, i = [], 0
    for n in lengths:
        nb = (n + page - 1) // page
        tables.append(perm[i:i + nb])
        i += nb
    width = max(len(t) for t in tables)
    return torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32, device="cuda")


def build_meta(q_lens, k_lens, tables, is_prefill):
    from engine.attention import AttentionMetadata
    cu_q = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(k_lens).cumsum(0).tolist()), dtype=torch.int32, device="cuda")
    return AttentionMetadata(
        is_prefill=is_prefill, slot_mapping=torch.full((sum(q_lens),), -1, dtype=torch.int64, device="cuda"),
        cu_seqlens_q=cu_q if is_prefill else None, cu_seqlens_k=cu_k if is_prefill else None,
        max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens), block_tables=tables,
        context_lens=None if is_prefill else torch.tensor(k_lens, dtype=torch.int32, device="cuda"),
        seqlens_q=list(q_lens), seqlens_k=list(k_lens))


def get(name):
    from engine.attention import create_backend
    return create_backend(name, 256)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("page", [16, 256])
@pytest.mark.parametrize("name", backends())
def test_decode_matches_torch(name, page, shape):
    hq, hk, d = shape
    if name == "flash_attn" and page % 256:
        pytest.skip("flash_attn needs page % 256 == 0")
    lengths = [1, 17, 255, 256, 257, 1000, 3000]
    kc, vc = make_cache(400 if page == 16 else 40, page, hk=hk, d=d)
    tables = tables_for(lengths, page, kc.shape[0])
    q = torch.randn(len(lengths), hq, d, device="cuda", dtype=torch.bfloat16)
    meta = build_meta([1] * len(lengths), lengths, tables, False)
    ref = get("torch").forward(q, None, None, kc, vc, meta, d ** -0.5)
    out = get(name).forward(q, None, None, kc, vc, meta, d ** -0.5)
    assert (out.float() - ref.float()).abs().max().item() < 2e-2


@pytest.mark.parametrize("name", [b for b in backends() if b == "triton"])
def test_decode_single_split_writes_output_directly(name):
    """A batch big enough for one split per program (40 x 8 kv heads) skips the reduce kernel; padding
    rows (context 0, as in a graph bucket) come out as zeros, like the reference."""
    from engine.attention import triton_kernels as tk
    lengths = [0 if i % 7 == 3 else 1 + (i * 97) % 900 for i in range(40)]
    kc, vc = make_cache(200, 256)                    # 40 sequences of up to 900 positions: at most 160 pages
    tables = tables_for([max(n, 1) for n in lengths], 256, kc.shape[0])
    assert (tables >= 0).sum().item() == sum((max(n, 1) + 255) // 256 for n in lengths)
    q = torch.randn(len(lengths), HQ, D, device="cuda", dtype=torch.bfloat16)
    meta = build_meta([1] * len(lengths), lengths, tables, False)
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    assert tk.choose_splits(len(lengths), HK, max(lengths), 64, sm, waves=1)[0] == 1      # the direct path
    ref = get("torch").forward(q, None, None, kc, vc, meta, D ** -0.5)
    out = tk.paged_decode(q, kc, vc, tables, meta.context_lens, D ** -0.5, max(lengths), sm, waves=1)
    assert (out.float() - ref.float()).abs().max().item() < 2e-2
    assert out[3].abs().max().item() == 0


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("page", [16, 256])
@pytest.mark.parametrize("name", backends())
def test_prefill_with_prefix_and_chunk_matches_torch(name, page, shape):
    hq, hk, d = shape
    if name == "flash_attn" and page % 256:
        pytest.skip("flash_attn needs page % 256 == 0")
    q_lens, k_lens = [37, 188, 300, 5], [37 + 512, 700, 300, 5 + 256]   # prefix hits, a continuation, fresh
    kc, vc = make_cache(400 if page == 16 else 40, page, hk=hk, d=d)
    tables = tables_for(k_lens, page, kc.shape[0], seed=1)
    q = torch.randn(sum(q_lens), hq, d, device="cuda", dtype=torch.bfloat16)
    meta = build_meta(q_lens, k_lens, tables, True)
    # this chunk's K/V, as the model would have stored them: the last q_len positions of each sequence
    from engine.attention.torch_backend import gather_kv
    k = torch.cat([gather_kv(kc, tables[i], kl)[kl - ql:] for i, (ql, kl) in enumerate(zip(q_lens, k_lens))])
    v = torch.cat([gather_kv(vc, tables[i], kl)[kl - ql:] for i, (ql, kl) in enumerate(zip(q_lens, k_lens))])
    ref = get("torch").forward(q, k, v, kc, vc, meta, d ** -0.5)
    out = get(name).forward(q, k, v, kc, vc, meta, d ** -0.5)
    assert (out.float() - ref.float()).abs().max().item() < 2e-2


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("name", backends())
def test_fresh_prefill_matches_torch(name, strided, shape):
    """Fresh prefill; strided: q, k, v are views of one fused qkv projection (row stride (hq + 2 hk) * d)."""
    hq, hk, d = shape
    q_lens = [1, 64, 300]
    t = sum(q_lens)
    if strided:
        qkv = torch.randn(t, (hq + 2 * hk) * d, device="cuda", dtype=torch.bfloat16)
        q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hk * d, hk * d], -1))
    else:
        q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(t, hk, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(t, hk, d, device="cuda", dtype=torch.bfloat16)
    kc, vc = make_cache(8, 256, hk=hk, d=d)
    meta = build_meta(q_lens, q_lens, None, True)
    ref = get("torch").forward(q, k, v, kc, vc, meta, d ** -0.5)
    out = get(name).forward(q, k, v, kc, vc, meta, d ** -0.5)
    assert (out.float() - ref.float()).abs().max().item() < 2e-2


def test_triton_store_skips_padding_slots():
    from engine.attention.kv_store import store_kv
    kc, vc = make_cache(4, 16)
    before_k, before_v = kc.clone(), vc.clone()
    k = torch.randn(3, HK, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(3, HK, D, device="cuda", dtype=torch.bfloat16)
    slots = torch.tensor([5, -1, 40], device="cuda")
    store_kv(k, v, kc, vc, slots)
    flat_k, flat_v = kc.view(-1, HK, D), vc.view(-1, HK, D)
    assert torch.equal(flat_k[5], k[0]) and torch.equal(flat_v[40], v[2])
    changed = (kc != before_k).flatten(2).any(-1).view(-1).nonzero().flatten().tolist()
    changed_v = (vc != before_v).flatten(2).any(-1).view(-1).nonzero().flatten().tolist()
    assert changed == changed_v == [5, 40]


@pytest.fixture(scope="module")
def gpu_model_dir(tmp_path_factory):
    from labkit.assets.synth import synth_model
    return synth_model("tiny", tmp_path_factory.mktemp("tiny") / "m", dtype="float32")


@pytest.fixture(scope="module")
def smollm2_model_dir(tmp_path_factory):
    """A synthetic Llama of SmolLM2-135M's shapes (9 q / 3 kv heads of 64, 30 layers, vocab 49,152)."""
    from labkit.assets.synth import synth_model
    return synth_model("smollm2-135m", tmp_path_factory.mktemp("smollm2") / "m", dtype="float32")


def graph_decode_matches_eager(kernel_engine, model_dir, name, vocab, before_graph=None):
    """Batches 1, 9, 16, 17, 20 (max_num_seqs 20): replayed graphs give the eager logits. before_graph: called
    between building the eager engine and the graph one."""
    from engine import SamplingParams

    kw = dict(device="cuda", dtype="float32", attention_backend=name, max_num_seqs=20, kvcache_block_size=256,
              num_kvcache_blocks=64, max_model_len=1024, max_num_batched_tokens=8192)
    eager = kernel_engine(model_dir, enforce_eager=True, **kw)
    if before_graph is not None:
        before_graph()
    graph = kernel_engine(model_dir, enforce_eager=False, **kw)
    assert 17 <= max(graph.describe()["graph"]["buckets"])
    for batch in (1, 9, 16, 17, 20):
        g = torch.Generator().manual_seed(batch)
        prompts = [torch.randint(0, vocab, (int(n),), generator=g).tolist()
                   for n in torch.randint(3, 300, (batch,), generator=g)]
        rows = {}
        for eng in (eager, graph):
            seqs = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)) for p in prompts]
            s, pf = eng.schedule()
            eng.postprocess(s, [0] * len(s), pf)
            s, pf = eng.schedule()
            assert not pf and len(s) == batch
            logits, route = eng.forward_logits(s, pf)
            rows[eng is graph] = logits.float()
            assert route.kind == ("graph" if eng is graph else "eager")
            eng.postprocess(s, [0] * batch, pf)
            assert eng.is_finished() and all(q.is_finished for q in seqs)
        diff = rows[True] - rows[False]
        rel_l2 = (diff.norm(dim=-1) / rows[False].norm(dim=-1)).max().item()
        # float32 (Triton's dots use tf32): padding and fixed-width block tables change reduction order only
        assert diff.abs().max().item() < 0.05 and rel_l2 < 2e-3, (batch, diff.abs().max().item(), rel_l2)


@pytest.mark.parametrize("name", ["torch"] + float32_backends())
def test_graph_decode_matches_eager(kernel_engine, gpu_model_dir, name):
    graph_decode_matches_eager(kernel_engine, gpu_model_dir, name, 150000)


@pytest.mark.parametrize("name", ["torch"] + float32_backends())
def test_graph_decode_matches_eager_on_smollm2_shapes(kernel_engine, smollm2_model_dir, name):
    """The same on a Llama with head_dim 64 and 3 q heads per kv head (the batch-1 GEMV at hidden 576 included)."""
    graph_decode_matches_eager(kernel_engine, smollm2_model_dir, name, 49152)


@pytest.mark.parametrize("name", float32_backends())
def test_prefill_graph_matches_eager(kernel_engine, gpu_model_dir, name):
    """Fresh prefills of 1, 3 and 16 ragged prompts replay a prefill graph and give the eager logits; a prefill
    that has more sequences than a prefill graph takes replays a piecewise graph (attention eager between the
    pieces), and one that reads a cached prefix a paged prefill graph; both give the eager logits too."""
    from engine import SamplingParams
    from engine.graph import PREFILL_GRAPH_SEQS

    kw = dict(device="cuda", dtype="float32", attention_backend=name, max_num_seqs=20, kvcache_block_size=16,
              num_kvcache_blocks=512, max_model_len=1024, max_num_batched_tokens=2048)
    eager = kernel_engine(gpu_model_dir, enforce_eager=True, **kw)
    graph = kernel_engine(gpu_model_dir, enforce_eager=False, **kw)
    if name != "triton":
        assert graph.describe()["graph"]["prefill_buckets"] == []
        return
    assert graph.describe()["graph"]["prefill_buckets"][-1] == 1024
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for batch, expect in ((1, "prefill-graph"), (3, "prefill-graph"), (PREFILL_GRAPH_SEQS, "prefill-graph"),
                          (PREFILL_GRAPH_SEQS + 1, "piecewise")):
        g = torch.Generator().manual_seed(batch)
        prompts = [torch.randint(0, 150000, (int(n),), generator=g).tolist()
                   for n in torch.randint(1, 60, (batch,), generator=g)]
        rows = {}
        for eng in (eager, graph):
            eng.reset_prefix_cache()
            for p in prompts:
                eng.add_request(p, sp)
            s, pf = eng.schedule()
            assert pf and len(s) == batch
            logits, route = eng.forward_logits(s, pf)
            rows[eng is graph] = logits.float()
            assert route.kind == (expect if eng is graph else "eager"), (batch, route)
            eng.postprocess(s, [0] * len(s), pf)
            while not eng.is_finished():
                eng.step()
        diff = rows[True] - rows[False]
        rel_l2 = (diff.norm(dim=-1) / rows[False].norm(dim=-1)).max().item()
        assert diff.abs().max().item() < 0.05 and rel_l2 < 2e-3, (batch, diff.abs().max().item(), rel_l2)
    # prompts whose first blocks are cached: prefix-reading prefills of 1 and 3 sequences replay a paged prefill
    # graph (attention through the block table inside the graph) and give the eager logits
    for batch in (1, 3):
        g = torch.Generator().manual_seed(100 + batch)
        firsts = [torch.randint(0, 150000, (int(n),), generator=g).tolist()
                  for n in torch.randint(20, 90, (batch,), generator=g)]
        rows, cached = {}, {}
        for eng in (eager, graph):
            eng.reset_prefix_cache()
            for p in firsts:                               # fills the cache
                eng.add_request(p, sp)
            while not eng.is_finished():
                eng.step()
            for p in firsts:                               # the same prompts and more: a prefix to read
                eng.add_request(p + list(range(2000, 2000 + len(p) // 2)), sp)
            s, pf = eng.schedule()
            cached[eng is graph] = [q.num_cached_tokens for q in s]
            logits, route = eng.forward_logits(s, pf)
            rows[eng is graph] = logits.float()
            assert route.kind == ("paged-prefill-graph" if eng is graph else "eager"), (batch, route)
            eng.postprocess(s, [0] * len(s), pf)
            while not eng.is_finished():
                eng.step()
        assert cached[True] == cached[False] and min(cached[True]) > 0, cached
        diff = rows[True] - rows[False]
        rel_l2 = (diff.norm(dim=-1) / rows[False].norm(dim=-1)).max().item()
        assert diff.abs().max().item() < 0.05 and rel_l2 < 2e-3, (batch, diff.abs().max().item(), rel_l2)


def test_uncovered_batch_falls_back_to_eager(kernel_engine, gpu_model_dir):
    from engine import SamplingParams
    eng = kernel_engine(gpu_model_dir, device="cuda", enforce_eager=False, max_num_seqs=20,
                   graph_buckets=(1, 2, 4, 8, 16), num_kvcache_blocks=64)
    for i in range(17):
        eng.add_request(list(range(100 + i, 110 + i)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    routes = []
    while not eng.is_finished():
        routes.append(eng.step().route.kind)
    # the prefill of 17 prompts replays a piecewise graph; the decode of 17 has no covering decode bucket: eager
    assert routes == ["piecewise", "eager"]


def test_fused_ops_match_the_torch_layers():
    from engine.layers.activation import SiluAndMul
    from engine.layers.fused_kernels import qk_norm_rope
    from engine.layers.layernorm import RMSNorm
    from engine.layers.rotary import RotaryEmbedding

    torch.manual_seed(0)
    t, hidden = 37, 1024
    with torch.device("cuda"):
        norm = RMSNorm(hidden).to(torch.bfloat16)
        norm.weight.data = torch.randn(hidden, dtype=torch.bfloat16) * 0.1 + 1
        x = torch.randn(t, hidden, dtype=torch.bfloat16)
        res = torch.randn(t, hidden, dtype=torch.bfloat16)
        ref = norm(x), norm(x, res)
        norm.fused = True
        out = norm(x), norm(x, res)
        close = dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(out[0], ref[0], **close)
        torch.testing.assert_close(out[1][0], ref[1][0], **close)
        assert torch.equal(out[1][1], ref[1][1])                      # the residual sum itself is exact

        act = SiluAndMul()
        y = torch.randn(t, 2 * 3072, dtype=torch.bfloat16)
        ref_act = act(y)
        act.fused = True
        torch.testing.assert_close(act(y), ref_act, **close)

        qn, kn = RMSNorm(D).to(torch.bfloat16), RMSNorm(D).to(torch.bfloat16)
        qn.weight.data.fill_(2.0)
        rope = RotaryEmbedding(D, 4096, 1e6)
        qkv = torch.randn(t, (HQ + 2 * HK) * D, dtype=torch.bfloat16)
        pos = torch.randint(0, 4000, (t,))
        q, k, _ = qkv.split([HQ * D, HK * D, HK * D], -1)
        rq, rk = rope(pos, qn(q.reshape(t, HQ, D)), kn(k.reshape(t, HK, D)))
        fq, fk = qk_norm_rope(qkv, pos, qn.weight, kn.weight, rope.cos, rope.sin, HQ, HK, D, qn.eps)
        torch.testing.assert_close(fq, rq, **close)
        torch.testing.assert_close(fk, rk, **close)


@pytest.mark.parametrize("name", [b for b in backends() if b == "triton"])
def test_float32_attention_is_exact_not_tf32(name):
    """In float32 the Triton kernels use IEEE products: they agree with the torch reference to ~1e-5."""
    lengths = [5, 300, 1000]
    kc, vc = make_cache(40, 256, dtype=torch.float32)
    tables = tables_for(lengths, 256, kc.shape[0])
    q = torch.randn(len(lengths), HQ, D, device="cuda", dtype=torch.float32)
    meta = build_meta([1] * len(lengths), lengths, tables, False)
    ref = get("torch").forward(q, None, None, kc, vc, meta, D ** -0.5)
    out = get(name).forward(q, None, None, kc, vc, meta, D ** -0.5)
    assert (out - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_sampler_greedy_rows_are_argmax(dtype):
    from engine.sampling.sampler import sample
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(64, 151936, device="cuda", generator=g).to(dtype)
    logits[3, 17] = logits[3, 99] = logits[3].max() + 1          # a tie: the first index wins, as in torch
    assert sample(logits, [0.0] * 64, [g] * 64) == logits.argmax(-1).tolist()


def test_fused_sampler_is_seeded_and_follows_the_distribution():
    from engine.sampling.sampler import sample
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05], device="cuda")
    t = 0.7
    logits = (probs.log() * t).repeat(20000, 1)                     # softmax(logits / t) == probs
    a = sample(logits, [t] * 20000, [torch.Generator(device="cuda").manual_seed(3)] * 20000)
    b = sample(logits, [t] * 20000, [torch.Generator(device="cuda").manual_seed(3)] * 20000)
    assert a == b
    freq = torch.bincount(torch.tensor(a), minlength=5).float() / 20000
    assert torch.allclose(freq, probs.cpu(), atol=0.015), freq
    # a request with its own generator draws the same token whatever its batch mates are
    own = lambda: torch.Generator(device="cuda").manual_seed(99)  # noqa: E731
    shared = torch.Generator(device="cuda").manual_seed(1)
    flat = torch.zeros(3, 1000, device="cuda")
    first = sample(flat, [1.0, 1.0, 0.0], [shared, own(), shared])[1]
    again = sample(flat[:2], [1.0, 1.0], [torch.Generator(device="cuda").manual_seed(5), own()])[1]
    assert first == again


def test_overlapped_decode_with_graphs_matches_one_step_at_a_time(kernel_engine, gpu_model_dir):
    """Config.overlap on CUDA: the next step's ids are fed on the device into the graph's inputs."""
    from engine import SamplingParams

    kw = dict(device="cuda", dtype="float32", max_num_seqs=20, kvcache_block_size=16, num_kvcache_blocks=256,
              max_model_len=512, max_num_batched_tokens=2048, enforce_eager=False)
    prompts = [[(1000 + 37 * i + j) % 150000 for j in range(5 + 23 * i)] for i in range(9)]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 7 * i, ignore_eos=True) for i in range(9)]
    outs = {}
    for overlap in (False, True):
        engine = kernel_engine(gpu_model_dir, overlap=overlap, **kw)
        outs[overlap] = [o["token_ids"] for o in engine.generate(prompts, params)]
        engine.close()
    assert outs[True] == outs[False]


@pytest.mark.parametrize("sampling", ["plain", "processed"])
def test_overlapped_decode_never_waits_on_the_stream(kernel_engine, gpu_model_dir, sampling):
    """The overlapped decode launches step k+1 before it reads step k: nothing in between may synchronize
    the stream (a torch.tensor(list, device=cuda) does: it waited for the step in flight and left the GPU
    idle while the host prepared the next one). CUDA's sync debug mode raises on any such call; the steps
    below include batches that shrink (index_select of the fed ids) and, processed, top-k/top-p rows."""
    from engine import SamplingParams

    extra = dict(top_p=0.9, top_k=20, logprobs=2) if sampling == "processed" else {}
    engine = kernel_engine(gpu_model_dir, device="cuda", dtype="float32", max_num_seqs=20, kvcache_block_size=16,
                      num_kvcache_blocks=256, max_model_len=512, max_num_batched_tokens=2048, enforce_eager=False,
                      overlap=True)
    for i in range(9):
        engine.add_request([(1000 + 37 * i + j) % 150000 for j in range(5 + 11 * i)],
                           SamplingParams(temperature=0.7, max_tokens=12 + 3 * i, ignore_eos=True, **extra))
    decoded = 0
    while decoded < 3:                          # prefill, then a few decode steps (first-use compiles)
        decoded += not engine.step().is_prefill
    spans = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        while not engine.is_finished():
            out = engine.step()
            spans.append(out.device_span)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        engine.close()
    assert len(spans) > 20 and all(s is not None and s[0] <= s[1] for s in spans)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))     # one stream: each step after the one before


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemv_matches_cublas_on_qwen3_shapes(dtype):
    """The one-token GEMV (engine/layers/gemv.py) on the 0.6B's and the 8B's projection shapes, with and without
    the SiLU-and-mul prologue, against F.linear (and the fused SiLU kernel) on the GPU; and on the LM head's
    (the vocabulary x hidden), which the batch-1 decode also reads through it."""
    import torch.nn.functional as F

    from engine.layers.fused_kernels import silu_and_mul
    from engine.layers.gemv import gemv

    shapes = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (6144, 4096), (4096, 12288)]
    smollm2 = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
    g = torch.Generator(device="cuda").manual_seed(0)
    for n, k in shapes + smollm2 + [(151936, 1024), (151936, 4096)]:
        w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(dtype)
        x = torch.randn(1, k, device="cuda", generator=g).to(dtype)
        gate_up = torch.randn(1, 2 * k, device="cuda", generator=g).to(dtype)
        for got, want in ((gemv(x, w), F.linear(x, w)), (gemv(gate_up, w, silu_mul=True), F.linear(silu_and_mul(gate_up), w))):
            err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            assert got.shape == want.shape and got.dtype == dtype
            assert err <= (1e-5 if dtype == torch.float32 else 1e-2), (n, k, err)


@pytest.mark.parametrize("residual", [False, True])
def test_normed_gemv_is_rms_norm_then_gemv_bit_for_bit_on_qwen3_shapes(residual):
    """The RMSNorm prologue of the one-token GEMV (gemv.py::normed_gemv) against the fused rms_norm kernel then
    the GEMV, torch.equal, on the 8B's qkv and gate_up shapes (K 4096) and the 0.6B's (K 1024), bfloat16,
    several random rows each (the row's float32 sum of squares must reduce in the same order)."""
    from engine.layers.fused_kernels import rms_norm
    from engine.layers.gemv import gemv, normed_gemv

    g = torch.Generator(device="cuda").manual_seed(1)
    for n, k in [(6144, 4096), (24576, 4096), (4096, 1024), (6144, 1024), (960, 576), (3072, 576)]:
        w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16)
        nw = (1 + 0.2 * torch.randn(k, device="cuda", generator=g)).to(torch.bfloat16)
        for _ in range(8):
            x = (4 * torch.randn(1, k, device="cuda", generator=g)).to(torch.bfloat16)
            r = torch.randn(1, k, device="cuda", generator=g).to(torch.bfloat16) if residual else None
            y, h = normed_gemv(x, w, nw, 1e-6, r)
            if residual:
                normed, h_ref = rms_norm(x, nw, 1e-6, r)
                assert torch.equal(h, h_ref), (n, k)
                assert torch.equal(h, x + r), (n, k)            # x + r rounded once to bfloat16
            else:
                normed = rms_norm(x, nw, 1e-6)
                assert h is None
            want = gemv(normed, w)
            assert torch.equal(y, want), (n, k, (y.float() - want.float()).abs().max().item())


def test_qk_norm_rope_store_writes_what_store_kv_writes():
    """The KV store inside the q/k-norm + RoPE kernel, on the 8B's heads (32 q, 8 kv, D 128) in bfloat16:
    the whole cache equals the kernel without the store followed by store_kv; padding slots untouched."""
    from engine.attention.kv_store import store_kv
    from engine.layers.fused_kernels import qk_norm_rope
    from engine.layers.rotary import RotaryEmbedding

    hq, hk, d, t = 32, 8, 128, 7
    g = torch.Generator(device="cuda").manual_seed(2)
    qkv = torch.randn(t, (hq + 2 * hk) * d, device="cuda", generator=g).to(torch.bfloat16)
    pos = torch.randint(0, 4096, (t,), device="cuda", generator=g)
    qw = (1 + 0.2 * torch.randn(d, device="cuda", generator=g)).to(torch.bfloat16)
    kw = (1 + 0.2 * torch.randn(d, device="cuda", generator=g)).to(torch.bfloat16)
    with torch.device("cuda"):
        rope = RotaryEmbedding(d, 4096, 1e6)
    kc0 = torch.randn(8, 16, hk, d, device="cuda", generator=g).to(torch.bfloat16)
    vc0 = torch.randn(8, 16, hk, d, device="cuda", generator=g).to(torch.bfloat16)
    slots = torch.tensor([5, -1, 40, 0, 127, -1, 77], device="cuda")
    q_ref, k_ref = qk_norm_rope(qkv, pos, qw, kw, rope.cos, rope.sin, hq, hk, d, 1e-6)
    kc_ref, vc_ref = kc0.clone(), vc0.clone()
    store_kv(k_ref, qkv[:, (hq + hk) * d:].view(t, hk, d), kc_ref, vc_ref, slots)
    kc, vc = kc0.clone(), vc0.clone()
    q, k = qk_norm_rope(qkv, pos, qw, kw, rope.cos, rope.sin, hq, hk, d, 1e-6, k_cache=kc, v_cache=vc,
                        slot_mapping=slots)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    changed = ((kc != kc0).flatten(2).any(-1) | (vc != vc0).flatten(2).any(-1)).view(-1).nonzero().flatten().tolist()
    assert changed == sorted(s for s in slots.tolist() if s >= 0)


@pytest.mark.parametrize("prologue", ["0", "1"])
def test_batch1_decode_takes_both_fusions_and_matches_unfused(kernel_engine, gpu_model_dir, monkeypatch, prologue):
    """Fused ops on: a batch-1 decode step runs the normed GEMV in every layer (qkv and gate_up), and the backend's
    store_kv is not called: with the decode prologue off (LAB_DECODE_PROLOGUE=0) the q/k kernel stores k/v, with it
    on (the default) the attention kernel does and no q/k kernel runs; its logits match fused ops off."""
    monkeypatch.setenv("LAB_DECODE_PROLOGUE", prologue)
    import engine.layers.fused_kernels as fk
    import engine.layers.gemv as gemv_mod
    from engine import SamplingParams

    calls = {"normed": 0, "store": 0, "store_kv": 0}
    real_normed, real_qk = gemv_mod.normed_gemv, fk.qk_norm_rope

    def normed(*a, **kw):
        calls["normed"] += 1
        return real_normed(*a, **kw)

    def qk(*a, **kw):
        calls["store"] += "k_cache" in kw
        return real_qk(*a, **kw)

    def counting(store_kv):
        def store(*a):
            calls["store_kv"] += 1
            return store_kv(*a)
        return store

    rows = {}
    try:
        gemv_mod.normed_gemv, fk.qk_norm_rope = normed, qk
        for fused in (False, True):
            eng = kernel_engine(gpu_model_dir, device="cuda", dtype="float32", enforce_eager=True, fused_ops=fused,
                           attention_backend="triton", max_num_seqs=1, num_kvcache_blocks=16, max_model_len=256)
            backend = eng.runner.model.attention_layers()[0].backend
            backend.store_kv = counting(backend.store_kv)
            layers = len(eng.runner.model.model.layers)
            eng.add_request(list(range(100, 140)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
            s, pf = eng.schedule()
            eng.postprocess(s, [0], pf)
            s, pf = eng.schedule()
            for key in calls:
                calls[key] = 0
            logits, _ = eng.forward_logits(s, pf)
            rows[fused] = (logits.float(), dict(calls))
            eng.close()
    finally:
        gemv_mod.normed_gemv, fk.qk_norm_rope = real_normed, real_qk
    assert rows[False][1] == {"normed": 0, "store": 0, "store_kv": layers}, rows[False][1]
    assert rows[True][1] == {"normed": 2 * layers, "store": layers if prologue == "0" else 0, "store_kv": 0}, rows[True][1]
    diff = rows[True][0] - rows[False][0]
    rel_l2 = (diff.norm(dim=-1) / rows[False][0].norm(dim=-1)).max().item()
    assert diff.abs().max().item() < 0.05 and rel_l2 < 2e-3, (diff.abs().max().item(), rel_l2)


@pytest.mark.parametrize("rows", [2, 3, 8])
def test_rows_gemv_matches_linear_on_qwen3_shapes(rows):
    """engine/layers/gemv.py's rows kernel (a small decode batch, LAB_GEMV_ROWS) on the GPU, bf16, Qwen3-0.6B's
    projections (plain, normed with a residual, SiLU-and-mul, the LM head): each row within bf16 rounding of F.linear
    in float32 over the same inputs."""
    import torch.nn.functional as F

    from engine.layers.fused_kernels import rms_norm
    from engine.layers.gemv import gemv, normed_gemv

    gen = torch.Generator(device="cuda").manual_seed(rows)
    bf = torch.bfloat16
    for n, k, mode in ((4096, 1024, "normed"), (1024, 2048, "plain"), (6144, 1024, "normed"), (1024, 3072, "silu"),
                       (151936, 1024, "plain")):
        w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).to(bf)
        x = torch.randn(rows, 2 * k if mode == "silu" else k, device="cuda", generator=gen).to(bf)
        if mode == "normed":
            res, nw = torch.randn(rows, k, device="cuda", generator=gen).to(bf), torch.rand(k, device="cuda").to(bf)
            y, h = normed_gemv(x, w, nw, 1e-6, res)
            ref_in, h_ref = rms_norm(x, nw, 1e-6, res)
            assert torch.equal(h, h_ref), (n, k)
        elif mode == "silu":
            y = gemv(x, w, silu_mul=True)
            g, u = x.chunk(2, dim=-1)
            ref_in = (F.silu(g.float()).to(bf).float() * u.float()).to(bf)
        else:
            y, ref_in = gemv(x, w), x
        ref = F.linear(ref_in.float(), w.float())
        rel = ((y.float() - ref).abs().amax(-1) / ref.abs().amax(-1)).max().item()
        assert y.shape == (rows, n) and rel < 1e-2, (n, k, mode, rel)


def test_a_small_decode_batch_with_gemv_rows_matches_one_row(kernel_engine, gpu_model_dir, monkeypatch):
    """LAB_GEMV_ROWS=8: a decode of 4 sequences (graphs, the default decode prologue) takes the rows kernel (the
    engine's describe() says 8) and its logits match LAB_GEMV_ROWS=1's (cuBLAS and the separate norms) in float32."""
    from engine import SamplingParams

    out = {}
    for setting in ("1", "8"):
        monkeypatch.setenv("LAB_GEMV_ROWS", setting)
        eng = kernel_engine(gpu_model_dir, device="cuda", dtype="float32", attention_backend="triton", max_num_seqs=4,
                            num_kvcache_blocks=32, max_model_len=256)
        assert eng.describe()["gemv_rows"] == int(setting)
        for i in range(4):
            eng.add_request(list(range(100 + i, 130 + 3 * i)), SamplingParams(temperature=0, max_tokens=2,
                                                                                ignore_eos=True))
        s, pf = eng.schedule()
        eng.postprocess(s, [0] * len(s), pf)
        s, pf = eng.schedule()
        assert not pf and len(s) == 4
        logits, _ = eng.forward_logits(s, pf)
        out[setting] = logits.float()
        eng.close()
    diff = out["8"] - out["1"]
    rel_l2 = (diff.norm(dim=-1) / out["1"].norm(dim=-1)).max().item()
    assert diff.abs().max().item() < 1e-3 and rel_l2 < 1e-4, (diff.abs().max().item(), rel_l2)


def test_pdl_gives_the_same_tokens_and_logprobs_as_plain_launches(kernel_engine, gpu_model_dir):
    """engine/pdl.py on Hopper: the same kernels with programmatic dependent launch (graphs, overlap, batch 1 and
    a wide batch, bf16) give the tokens and the chosen tokens' log-probs of plain launches, bit for bit (a kernel
    that read its input before the wait would race with the kernel before it)."""
    from engine import SamplingParams

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9")
    kw = dict(device="cuda", dtype="bfloat16", max_num_seqs=32, kvcache_block_size=16, num_kvcache_blocks=512,
              max_model_len=512, max_num_batched_tokens=2048, enforce_eager=False, overlap=True)
    prompts = [[(1000 + 37 * i + j) % 150000 for j in range(5 + 23 * i)] for i in range(17)]
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 5 * i, ignore_eos=True) for i in range(17)]
    logged = [SamplingParams(temperature=0.0, max_tokens=6 + 5 * i, ignore_eos=True, logprobs=0) for i in range(17)]
    outs = {}
    for on in (False, True):
        engine = kernel_engine(gpu_model_dir, pdl=on, **kw)
        assert engine.describe()["pdl"] is on
        runs = [engine.generate(prompts[:1], params[:1]), engine.generate(prompts, params),
                engine.generate(prompts, logged)]
        outs[on] = [[(o["token_ids"], o.get("logprobs")) for o in run] for run in runs]
        engine.close()
    assert outs[True] == outs[False]


def test_l2_prefetch_gives_the_same_tokens_and_logprobs(kernel_engine, gpu_model_dir, monkeypatch):
    """LAB_L2_PREFETCH=layer (engine/l2_prefetch.py): the small decodes' attention kernels also ask L2 for the
    layer's weights, which changes no byte any kernel reads: the same tokens and chosen tokens' log-probs as
    without it, bit for bit (graphs, overlap, bf16, batch 1, 4 and a wide batch)."""
    from engine import SamplingParams

    kw = dict(device="cuda", dtype="bfloat16", max_num_seqs=32, kvcache_block_size=16, num_kvcache_blocks=512,
              max_model_len=512, max_num_batched_tokens=2048, enforce_eager=False, overlap=True)
    prompts = [[(3000 + 41 * i + j) % 150000 for j in range(7 + 19 * i)] for i in range(17)]
    logged = [SamplingParams(temperature=0.0, max_tokens=6 + 5 * i, ignore_eos=True, logprobs=0) for i in range(17)]
    outs = {}
    for mode in ("0", "layer"):
        monkeypatch.setenv("LAB_L2_PREFETCH", mode)
        engine = kernel_engine(gpu_model_dir, **kw)
        assert engine.describe()["model"]["l2_prefetch"] == mode
        runs = [engine.generate(prompts[:1], logged[:1]), engine.generate(prompts[:4], logged[:4]),
                engine.generate(prompts, logged)]
        outs[mode] = [[(o["token_ids"], o.get("logprobs")) for o in run] for run in runs]
        engine.close()
    assert outs["layer"] == outs["0"]


@pytest.mark.parametrize("cache", ["auto", "fp8"])
@pytest.mark.parametrize("batch", [1, 64])
def test_decode_prologue_matches_qk_norm_rope_then_decode(batch, cache):
    """The decode prologue (q/k norm + RoPE and the KV store inside the decode kernel) against the route it
    replaces, at Qwen3-0.6B's heads in bf16 (bf16 and e4m3 caches): the same output within bf16 rounding, the
    same V bytes, K within one rounding step (the two kernels sum a head's squares in different layouts, so an
    rstd may differ in its last bit) and every other cache row untouched."""
    import engine.attention.triton_kernels as tk
    import engine.layers.fused_kernels as fk
    from engine.attention import kv_quant
    from engine.layers.rotary import RotaryEmbedding

    page, blocks, max_len = 256, 4 * batch + 8, 1024
    g = torch.Generator(device="cuda").manual_seed(batch)
    lengths = torch.randint(2, max_len, (batch,), generator=g, device="cuda").to(torch.int32)
    tables = tables_for(lengths.tolist(), page, blocks, seed=batch).clamp(min=0)
    slots = torch.stack([tables[i, (n - 1) // page].long() * page + (n - 1) % page for i, n in enumerate(lengths)])
    qkv = torch.randn(batch, (HQ + 2 * HK) * D, device="cuda", dtype=torch.bfloat16, generator=g)
    qw, kw = (1 + 0.1 * torch.randn(2, D, device="cuda", generator=g)).to(torch.bfloat16)
    rope = RotaryEmbedding(D, max_len, 1e6).cuda()
    k0, v0 = make_cache(blocks, page)
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    outs, caches = [], []
    for prologue in (False, True):
        kc, vc = k0.clone(), v0.clone()
        if cache == "fp8":
            kc, vc = (kv_quant.mark(kv_quant.quantize(c, 0.5), 0.5, torch.bfloat16) for c in (kc, vc))
        positions = (lengths - 1).long()
        if prologue:
            new = tk.NewTokens(qkv, positions, qw, kw, rope.cos, rope.sin, 1e-6, slots, HQ)
            out = tk.paged_decode(None, kc, vc, tables, lengths, D ** -0.5, max_len, sm, new=new)
        else:
            q, _ = fk.qk_norm_rope(qkv, positions, qw, kw, rope.cos, rope.sin, HQ, HK, D, 1e-6, k_cache=kc, v_cache=vc,
                                   slot_mapping=slots)
            out = tk.paged_decode(q, kc, vc, tables, lengths, D ** -0.5, max_len, sm)
        outs.append(out.float())
        caches.append([kv_quant.dequantize(c, 0.5, torch.float32) if cache == "fp8" else c.float() for c in (kc, vc)])
    (k_plain, v_plain), (k_pro, v_pro) = caches
    assert torch.equal(v_plain, v_pro)
    # one rounding step: bf16's relative one, or e4m3's (its subnormals' absolute step at scale 0.5 near zero)
    step, floor = (2 ** -7, 0.0) if cache == "auto" else (2 ** -3, 2 ** -10)
    assert ((k_plain - k_pro).abs() <= step * k_plain.abs() + floor).all()
    others = torch.ones(blocks * page, dtype=torch.bool, device="cuda")
    others[slots] = False
    assert torch.equal(k_plain.view(blocks * page, -1)[others], k_pro.view(blocks * page, -1)[others])
    assert (outs[0] - outs[1]).abs().max().item() < 2e-2


def test_graph_decode_through_the_prologue_matches_eager(kernel_engine, gpu_model_dir, monkeypatch):
    """LAB_DECODE_PROLOGUE=1: the decode graphs capture the decode prologue (the model says so) and replay the
    logits of the plain route (LAB_DECODE_PROLOGUE=0), eager."""
    monkeypatch.setenv("LAB_DECODE_PROLOGUE", "0")
    graph_decode_matches_eager(kernel_engine, gpu_model_dir, "triton", 150000,
                               before_graph=lambda: monkeypatch.setenv("LAB_DECODE_PROLOGUE", "1"))
    eng = kernel_engine(gpu_model_dir, device="cuda", dtype="float32", attention_backend="triton", max_num_seqs=4,
                        num_kvcache_blocks=16, max_model_len=256)
    assert eng.describe()["model"]["qk_norm_rope_kv"] == "decode-prologue"
