"""CUDA-only: the FP8 KV cache's Triton kernels at Qwen3's head shapes (16 q / 8 kv heads of 128) against float32
references on the dequantized caches, as the interpreter tests check them on the CPU (test_kv_fp8_interp.py):
the quantizing store (bytes equal to torch's e4m3 rounding), the fused q/k norm + RoPE store, the paged decode
at one split, several with the reduce kernel and with the fused reduce (launch order permuted), and the paged
prefill; a dropped scale is far outside every tolerance (each case checks that too)."""
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HQ, HK, D = 16, 8, 128
K_SCALE, V_SCALE = 0.05, 0.02


def caches(blocks, page, seed=0):
    from engine.attention import kv_quant

    g = torch.Generator(device="cuda").manual_seed(seed)
    spread = lambda: 2.0 ** torch.randint(-4, 7, (blocks, page, HK, 1), device="cuda", generator=g)  # noqa: E731
    kc = kv_quant.quantize(torch.randn(blocks, page, HK, D, device="cuda", generator=g) * spread(), 1.0)
    vc = kv_quant.quantize(torch.randn(blocks, page, HK, D, device="cuda", generator=g) * spread(), 1.0)
    kv_quant.mark(kc, K_SCALE, torch.bfloat16)
    kv_quant.mark(vc, V_SCALE, torch.bfloat16)
    return kc, vc, kc.float() * K_SCALE, vc.float() * V_SCALE


def tables_for(lengths, page, blocks):
    perm = torch.randperm(blocks, generator=torch.Generator().manual_seed(1)).tolist()
    width = max(1, max((n + page - 1) // page for n in lengths))
    rows, i = [], 0
    for n in lengths:
        nb = (n + page - 1) // page
        rows.append(perm[i:i + nb] + [0] * (width - nb))
        i += nb
    return torch.tensor(rows, dtype=torch.int32, device="cuda")


def test_store_writes_torchs_e4m3_bytes():
    from engine.attention import kv_quant
    from engine.attention import kv_store

    t, page = 300, 256
    k = torch.randn(t, HK, D, device="cuda", dtype=torch.bfloat16) * 8 * K_SCALE
    v = torch.randn(t, HK, D, device="cuda", dtype=torch.bfloat16) * 8 * V_SCALE
    k[0, 0, :2] = torch.tensor([1000.0, -1000.0], device="cuda", dtype=torch.bfloat16)      # saturates
    slots = torch.randperm(2 * page, device="cuda")[:t]
    slots[5] = -1
    kc = torch.zeros(2, page, HK, D, device="cuda", dtype=kv_quant.FP8)
    vc = torch.zeros_like(kc)
    kv_store.store_kv(k, v, kc, vc, slots, k_scale=K_SCALE, v_scale=V_SCALE)
    torch.cuda.synchronize()
    live = slots >= 0
    want_k = kv_quant.quantize(k[live].cpu(), K_SCALE).view(torch.uint8)
    want_v = kv_quant.quantize(v[live].cpu(), V_SCALE).view(torch.uint8)
    got_k = kc.view(torch.uint8).view(-1, HK, D)[slots[live]].cpu()
    got_v = vc.view(torch.uint8).view(-1, HK, D)[slots[live]].cpu()
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert kc.float().abs().max().item() == 448.0


def test_fused_store_writes_what_store_kv_writes():
    from engine.attention import kv_quant
    from engine.attention import kv_store
    from engine.layers.fused_kernels import qk_norm_rope
    from engine.layers.rotary import RotaryEmbedding

    t, page = 70, 16
    g = torch.Generator(device="cuda").manual_seed(3)
    qkv = torch.randn(t, (HQ + 2 * HK) * D, device="cuda", generator=g).to(torch.bfloat16)
    pos = torch.randint(0, 4000, (t,), device="cuda", generator=g)
    qw = (1 + 0.1 * torch.randn(D, device="cuda", generator=g)).to(torch.bfloat16)
    kw = (1 + 0.1 * torch.randn(D, device="cuda", generator=g)).to(torch.bfloat16)
    rope = RotaryEmbedding(D, 4096, 1e6).cuda()
    slots = torch.randperm(8 * page, device="cuda", generator=g)[:t]
    slots[3] = -1
    v = qkv[:, (HQ + HK) * D:].reshape(t, HK, D)
    kc, vc, rk, rv = (kv_quant.mark(torch.zeros(8, page, HK, D, device="cuda", dtype=kv_quant.FP8), s, torch.bfloat16)
                      for s in (K_SCALE, V_SCALE, K_SCALE, V_SCALE))
    for tile in (1, None):              # one head per program, and every head of a token per program
        q1, k1 = qk_norm_rope(qkv, pos, qw, kw, rope.cos, rope.sin, HQ, HK, D, 1e-6, k_cache=kc, v_cache=vc,
                              slot_mapping=slots, heads_per_program=tile)
        # the store: the bytes store_kv writes of the k this same launch returned
        kv_store.store_kv(k1, v, rk, rv, slots)
        assert torch.equal(kc.view(torch.uint8), rk.view(torch.uint8))
        assert torch.equal(vc.view(torch.uint8), rv.view(torch.uint8))
        # the kernel compiled without the store gives the same q and k, up to a bf16 rounding step in a rare
        # element (the two compilations may order the RMSNorm's sum differently; the interpreter test, which has
        # one order, asks for equal bits): within a step of the RoPE terms (|x| < 4: 2^-6) where two terms cancel
        q2, k2 = qk_norm_rope(qkv, pos, qw, kw, rope.cos, rope.sin, HQ, HK, D, 1e-6, heads_per_program=tile)
        for a, b in ((q1, q2), (k1, k2)):
            torch.testing.assert_close(a, b, rtol=2 ** -7, atol=2 ** -5)
            assert (a != b).float().mean().item() < 1e-3


@pytest.mark.parametrize("v_t", [False, True])
@pytest.mark.parametrize("page", [16, 256])
@pytest.mark.parametrize("lengths, fuse", [([1, 4096], None), ([1, 17, 255, 256, 257, 1000, 3000], False),
                                           ([1, 17, 255, 256, 257, 1000, 3000], True), ([1024] * 64, None),
                                           ([0, 5, 0, 300], None)])
def test_decode_reads_fp8_against_float32(page, lengths, fuse, v_t):
    """v_t: the V cache's blocks hold each head's positions contiguous (kv_quant.v_t, LAB_FP8_V_T)."""
    from engine.attention import triton_kernels as tk
    from labkit.bench.attention import decode_reference

    blocks = sum((n + page - 1) // page for n in lengths) + 2
    kc, vc, kf, vf = caches(blocks, page)
    tables = tables_for(lengths, page, blocks)
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    q = torch.randn(len(lengths), HQ, D, device="cuda", dtype=torch.bfloat16)
    order = torch.argsort(lens, descending=True).to(torch.int32)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    from engine.attention import kv_quant
    out = tk.paged_decode(q, kc, kv_quant.to_v_t(vc) if v_t else vc, tables, lens, D ** -0.5, max(lengths), sms,
                          order=order, fuse_reduce=fuse)
    live = lens > 0
    ref = decode_reference(q, kf, vf, tables, lens.clamp_min(1), D ** -0.5)
    tol = 3e-2 * max(1.0, ref[live].abs().max().item())
    assert (out.float() - ref)[live].abs().max().item() <= tol
    assert (out[~live] == 0).all()
    dropped = decode_reference(q, kf, vc.float(), tables, lens.clamp_min(1), D ** -0.5)     # V scale dropped
    assert (dropped - ref)[live].abs().max().item() > 10 * tol


def test_the_v_t_layout_gives_the_same_tokens(kernel_engine, tmp_path_factory, monkeypatch):
    """LAB_FP8_V_T=1 on an engine (graphs, overlap, the decode prologue, bf16, an e4m3 cache): the same greedy tokens
    as the e4m3 cache laid out as K, and log-probs within bf16 rounding of them, at batch 1 and 17."""
    from engine import SamplingParams
    from labkit.assets.synth import synth_model

    model = synth_model("tiny", tmp_path_factory.mktemp("tiny-vt") / "m", dtype="float32")
    kw = dict(device="cuda", dtype="bfloat16", max_num_seqs=32, kvcache_block_size=16, num_kvcache_blocks=512,
              max_model_len=512, max_num_batched_tokens=2048, enforce_eager=False, overlap=True,
              kv_cache_dtype="fp8")
    prompts = [[(5000 + 43 * i + j) % 150000 for j in range(9 + 21 * i)] for i in range(17)]
    logged = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0) for _ in range(17)]
    outs = {}
    for on in ("0", "1"):
        monkeypatch.setenv("LAB_FP8_V_T", on)
        engine = kernel_engine(model, **kw)
        assert engine.describe()["kv_cache"]["v_transposed"] is (on == "1")
        outs[on] = [engine.generate(prompts[:1], logged[:1]), engine.generate(prompts, logged)]
        engine.close()
    for a_run, b_run in zip(outs["0"], outs["1"]):
        for a, b in zip(a_run, b_run):
            assert a["token_ids"] == b["token_ids"]
            for x, y in zip(a["logprobs"], b["logprobs"]):
                assert abs(x.logprob - y.logprob) < 5e-2, (x, y)


def test_prefill_reads_fp8_against_float32():
    from engine.attention import prefill_kernels as pk
    from labkit.bench.attention import prefill_reference

    seqs, prefix, new, page = 4, 512, 128, 256
    per = (prefix + new + page - 1) // page
    kc, vc, kf, vf = caches(seqs * per + 1, page)
    tables = tables_for([prefix + new] * seqs, page, seqs * per + 1)
    q = torch.randn(seqs * new, HQ, D, device="cuda", dtype=torch.bfloat16)
    cu_q = torch.arange(seqs + 1, dtype=torch.int32, device="cuda") * new
    cu_k = torch.arange(seqs + 1, dtype=torch.int32, device="cuda") * (prefix + new)
    out = pk.paged_prefill(q, kc, vc, tables, cu_q, cu_k, new, D ** -0.5)
    ref = prefill_reference(q, kf, vf, tables, seqs, prefix, new, D ** -0.5)
    tol = 3e-2 * max(1.0, ref.abs().max().item())
    assert (out.float() - ref).abs().max().item() <= tol
    dropped = prefill_reference(q, kc.float(), vf, tables, seqs, prefix, new, D ** -0.5)      # K scale dropped
    assert (dropped - ref).abs().max().item() > tol
