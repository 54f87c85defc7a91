"""The persistent decode layer (engine/layers/decode_layer.py) on a GPU: its one launch with grid barriers against
the same device code launched a phase at a time (the CPU tests' route), launch after launch and replayed from a
CUDA graph (its counters back at zero each time, no barrier given up), and against the six kernels a layer it
replaces, at Qwen3-0.6B's and Qwen3-8B's layer shapes in bf16; and the tiny model's greedy decode (float32) with LAB_DECODE_LAYER=1 against the same engine without it, eager and
with graphs."""
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPES = {"qwen3-0.6b": (1024, 16, 8, 128, 3072), "qwen3-8b": (4096, 32, 8, 128, 12288)}   # H, Hq, Hk, D, I


def _layer(shape, ctx: int, residual: bool, seed: int = 0):
    """A random layer (bf16) and its step's row: decode_layer's keywords, and x, residual."""
    h, hq, hk, d, inter = shape
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*s, sc=1.0, base=0.0):
        return (torch.randn(*s, generator=g, device="cuda") * sc + base).to(torch.bfloat16)
    page, blocks = 256, 64
    from engine.layers.rotary import RotaryEmbedding
    with torch.device("cuda"):
        rope = RotaryEmbedding(d, 4096, 1e6)
    table = torch.randperm(blocks, generator=g, device="cuda")[:16].to(torch.int32)[None]
    slot = int(table[0, (ctx - 1) // page]) * page + (ctx - 1) % page
    kw = dict(in_norm=r(h, sc=0.1, base=1.0), qkv_w=r((hq + 2 * hk) * d, h, sc=h ** -0.5), q_norm=r(d, sc=0.1, base=1.0),
              k_norm=r(d, sc=0.1, base=1.0), cos=rope.cos, sin=rope.sin, o_w=r(h, hq * d, sc=(hq * d) ** -0.5),
              post_norm=r(h, sc=0.1, base=1.0), gate_up_w=r(2 * inter, h, sc=h ** -0.5),
              down_w=r(h, inter, sc=inter ** -0.5), k_cache=r(blocks, page, hk, d), v_cache=r(blocks, page, hk, d),
              block_tables=table, context_lens=torch.tensor([ctx], dtype=torch.int32, device="cuda"),
              positions=torch.tensor([ctx - 1], device="cuda"), slot_mapping=torch.tensor([slot], device="cuda"),
              eps=1e-6, qk_eps=1e-6, max_len=4096,
              sm_count=torch.cuda.get_device_properties(0).multi_processor_count)
    return kw, r(1, h), (r(1, h) if residual else None)


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("ctx,residual", [(1100, True), (1, False), (4000, True)])
def test_one_launch_equals_the_phases_and_leaves_its_counters_at_zero(name, ctx, residual):
    from engine.layers.decode_layer import FLAG, KV_COUNTERS, layer_sync

    kw, x, res = _layer(SHAPES[name], ctx, residual)
    sync = layer_sync(torch.device("cuda"))
    caches = kw["k_cache"].clone(), kw["v_cache"].clone()
    from engine.layers.decode_layer import decode_layer
    phased = decode_layer(x, res, phases=True, **kw)
    outs = []
    for _ in range(3):                  # launch after launch: each barrier's counter reset for the next
        kw["k_cache"].copy_(caches[0])
        kw["v_cache"].copy_(caches[1])
        outs.append(decode_layer(x, res, phases=False, **kw))
    torch.cuda.synchronize()
    assert int(sync[FLAG]) == 0, "a grid barrier gave up"
    assert sync[:3].tolist() == [0, 0, 0] and int(sync[KV_COUNTERS:KV_COUNTERS + 8].abs().sum()) == 0, sync[:16]
    for y, h2 in outs:                  # the same device code between the barriers: the same bits
        assert torch.equal(y, phased[0]) and torch.equal(h2, phased[1])


@pytest.mark.parametrize("name", list(SHAPES))
def test_the_layer_kernel_against_the_six_kernels_it_replaces(name):
    """bf16 at the model's shapes: the normed qkv GEMV, the decode prologue's attention, the o GEMV, the normed
    gate_up GEMV and the SiLU down GEMV, each its own kernel, against the one launch; the same rounding points, the
    float32 sums in another order."""
    from engine.attention import triton_kernels as tk
    from engine.layers.decode_layer import decode_layer
    from engine.layers.gemv import gemv, normed_gemv

    kw, x, res = _layer(SHAPES[name], 1100, True, seed=2)
    h, hq, hk, d, inter = SHAPES[name]
    caches = kw["k_cache"].clone(), kw["v_cache"].clone()
    y, h2 = decode_layer(x, res, **kw)
    kc, vc = caches
    qkv, hh = normed_gemv(x, kw["qkv_w"], kw["in_norm"], 1e-6, res)
    new = tk.NewTokens(qkv, kw["positions"], kw["q_norm"], kw["k_norm"], kw["cos"], kw["sin"], 1e-6,
                       kw["slot_mapping"], hq)
    attn = tk.paged_decode(None, kc, vc, kw["block_tables"], kw["context_lens"], d ** -0.5, 4096, kw["sm_count"],
                           new=new)
    o = gemv(attn.view(1, -1), kw["o_w"])
    gu, h2_ref = normed_gemv(o, kw["gate_up_w"], kw["post_norm"], 1e-6, hh)
    y_ref = gemv(gu, kw["down_w"], silu_mul=True)
    torch.cuda.synchronize()
    slot = int(kw["slot_mapping"][0])
    for got, want in ((kw["k_cache"], kc), (kw["v_cache"], vc)):    # the same rows written: the new k and v
        assert torch.equal(got.flatten(0, 1)[:slot], want.flatten(0, 1)[:slot])
        assert torch.equal(got.flatten(0, 1)[slot + 1:], want.flatten(0, 1)[slot + 1:])
        assert (got.flatten(0, 1)[slot].float() - want.flatten(0, 1)[slot].float()).abs().max() < 0.05
    for got, want in ((y, y_ref), (h2, h2_ref)):
        rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert rel < 2e-2, (name, rel)


def test_a_graph_replays_the_layer_kernel():
    from engine.layers.decode_layer import FLAG, decode_layer, layer_sync

    kw, x, res = _layer(SHAPES["qwen3-0.6b"], 1100, True, seed=1)
    sync = layer_sync(torch.device("cuda"))
    want = decode_layer(x, res, **kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        decode_layer(x, res, **kw)           # warm on the side stream
        with torch.cuda.graph(graph, stream=stream):
            got = decode_layer(x, res, **kw)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert int(sync[FLAG]) == 0
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_tiny_model_decodes_the_same_with_the_layer_kernel(monkeypatch, tmp_path_factory, eager):
    from engine import LLMEngine, SamplingParams
    from engine.levers import DECODE_LAYER_ENV
    from labkit.assets.synth import synth_model

    model = synth_model("tiny", tmp_path_factory.mktemp("tiny") / "m", dtype="float32")
    prompts = [list(range(200, 200 + n)) for n in (40, 300)]
    out = {}
    for on in ("0", "1"):
        monkeypatch.setenv(DECODE_LAYER_ENV, on)
        engine = LLMEngine(str(model), device="cuda", dtype="float32", attention_backend="triton",
                           enforce_eager=eager, max_num_seqs=4, max_model_len=1024)
        assert engine.describe()["model"]["decode_layer"] is (on == "1")
        out[on] = [engine.generate([p], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]["token_ids"]
                   for p in prompts]
        engine.close()
    assert out["1"] == out["0"]
