"""The FP8 KV cache on the CPU (engine/attention/kv_quant.py, ``kv_cache_dtype="fp8"``): e4m3 values against
float32, the torch backend's quantizing store and dequantizing reads against float32 attention, the pool's bytes,
the option's refusal, and the tiny model end to end (greedy tokens against the same engine with its float32
cache). The Triton kernels' side: tests/kernels/test_kv_fp8_interp.py; the FP8 guard's (teacher-forced logits):
tests/lab/guardrails/test_kv_fp8_guard.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention import kv_quant
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttention
from engine.config import Config, ConfigError
from engine.args import EngineArgs
from engine.kv_pool import bytes_per_block

KW = dict(device="cpu", enforce_eager=True, kvcache_block_size=16, max_num_batched_tokens=64, max_num_seqs=4)
K_SCALE, V_SCALE = 0.05, 0.02


def test_e4m3_holds_each_value_to_half_a_step_and_saturates():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20000, generator=g) * 2.0 ** torch.randint(-12, 10, (20000,), generator=g) * K_SCALE
    back = kv_quant.dequantize(kv_quant.quantize(x, K_SCALE), K_SCALE, torch.float32)
    y = (x / K_SCALE).abs()
    normal, small, big = (y >= 2 ** -6) & (y <= 448), y < 2 ** -6, y > 448
    assert normal.sum() > 1000 and small.sum() > 100 and big.sum() > 100
    # 3 mantissa bits: at most half a step, 2^-4 of the value; below 2^-6 the step is 2^-9 (half: 2^-10)
    assert ((back - x).abs()[normal] <= 2 ** -4 * x.abs()[normal] * (1 + 1e-6)).all()
    assert ((back - x).abs()[small] <= 2 ** -10 * K_SCALE * (1 + 1e-6)).all()
    assert torch.equal(back[big].abs(), torch.full_like(back[big], 448 * K_SCALE))


def test_an_fp8_cache_without_its_scale_is_refused():
    bare = torch.zeros(2, 4, 1, 8, dtype=kv_quant.FP8)
    with pytest.raises(ValueError, match="without its scale"):
        kv_quant.scale_of(bare)
    assert kv_quant.scale_of(torch.zeros(2)) == 1.0          # a cache in the model's dtype: nothing to undo


def test_kv_cache_dtype_is_checked_with_one_line():
    with pytest.raises(ConfigError) as e:
        EngineArgs(kv_cache_dtype="fp16")
    assert str(e.value) == "kv_cache_dtype must be one of auto, fp8, got 'fp16'"
    assert EngineArgs().kv_cache_dtype == "auto"


def test_the_pool_holds_one_byte_a_value(tiny_model_dir):
    auto, fp8 = Config(str(tiny_model_dir), **KW), Config(str(tiny_model_dir), kv_cache_dtype="fp8", **KW)
    for dtype, ratio in ((torch.float32, 4), (torch.bfloat16, 2)):
        assert bytes_per_block(auto, dtype) == ratio * bytes_per_block(fp8, dtype)
    assert bytes_per_block(fp8, torch.bfloat16) == 16 * fp8.shape.kv_bytes_per_token(1)


def _caches(blocks: int, page: int, hk: int, d: int):
    k = kv_quant.mark(torch.zeros(blocks, page, hk, d, dtype=kv_quant.FP8), K_SCALE, torch.float32)
    v = kv_quant.mark(torch.zeros(blocks, page, hk, d, dtype=kv_quant.FP8), V_SCALE, torch.float32)
    return k, v


def test_torch_backend_stores_quantized_and_reads_dequantized():
    """Prefix-hit prefill and decode through the torch backend on e4m3 caches against float32 attention on
    the values the cache holds (x quantized and back, by its scale)."""
    g = torch.Generator().manual_seed(1)
    page, hk, hq, d, blocks = 4, 2, 4, 16, 6
    kc, vc = _caches(blocks, page, hk, d)
    n_ctx, n_new = 9, 3                                   # 9 positions cached, then a chunk of 3
    k = torch.randn(n_ctx + n_new, hk, d, generator=g) * 0.4
    v = torch.randn(n_ctx + n_new, hk, d, generator=g) * 0.1
    table = torch.tensor([[4, 1, 5, 0]], dtype=torch.int32)
    slots = torch.cat([table[0, p // page:p // page + 1].long() * page + p % page for p in range(n_ctx + n_new)])
    be = TorchAttention()
    be.store_kv(k, v, kc, vc, torch.where(torch.arange(n_ctx + n_new) == 2, -1, slots))   # position 2: padding
    assert (kc.view(torch.uint8).view(-1, hk, d)[slots[2]] == 0).all()                       # never written
    be.store_kv(k[2:3], v[2:3], kc, vc, slots[2:3])
    held_k = (k / K_SCALE).clamp(-448, 448).to(torch.float8_e4m3fn).float() * K_SCALE     # what the cache stands for
    held_v = (v / V_SCALE).clamp(-448, 448).to(torch.float8_e4m3fn).float() * V_SCALE
    scale = d ** -0.5
    q = torch.randn(n_new, hq, d, generator=g)
    meta = AttentionMetadata(is_prefill=True, slot_mapping=slots[n_ctx:], block_tables=table,
                             cu_seqlens_q=torch.tensor([0, n_new], dtype=torch.int32),
                             cu_seqlens_k=torch.tensor([0, n_ctx + n_new], dtype=torch.int32),
                             max_seqlen_q=n_new, max_seqlen_k=n_ctx + n_new, seqlens_q=[n_new], seqlens_k=[n_ctx + n_new])
    out = be.forward(q, k[n_ctx:], v[n_ctx:], kc, vc, meta, scale)
    mask = torch.arange(n_ctx + n_new)[None, :] <= torch.arange(n_ctx, n_ctx + n_new)[:, None]
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), held_k.transpose(0, 1), held_v.transpose(0, 1),
                                         attn_mask=mask, scale=scale, enable_gqa=True).transpose(0, 1)
    assert (out - ref).abs().max() <= 1e-6
    # decode: one query reading all 12 positions
    qd = torch.randn(1, hq, d, generator=g)
    dmeta = AttentionMetadata(is_prefill=False, slot_mapping=torch.tensor([-1]), block_tables=table,
                              context_lens=torch.tensor([n_ctx + n_new], dtype=torch.int32), max_seqlen_k=n_ctx + n_new)
    outd = be.forward(qd, None, None, kc, vc, dmeta, scale)
    refd = F.scaled_dot_product_attention(qd.transpose(0, 1), held_k.transpose(0, 1), held_v.transpose(0, 1),
                                          scale=scale, enable_gqa=True).transpose(0, 1)
    assert (outd - refd).abs().max() <= 1e-6
    # the check has teeth: the values as stored (a dropped scale) are far from what the cache stands for
    assert (kc.float().flatten(0, 1)[slots] - held_k).abs().max() > 1.0


@pytest.fixture(scope="module")
def tame_tiny(tmp_path_factory):
    """The tiny preset with the tame init (a seeded bigram language: logits with margins, as qwen3-0.6b's)."""
    from labkit.assets.synth import synth_model

    return synth_model("tiny", tmp_path_factory.mktemp("tiny-tame") / "m", seed=0, init="tame")


def test_the_engine_runs_an_fp8_cache_end_to_end(tame_tiny):
    """Greedy generation with the e4m3 cache against the float32 cache: the same tokens up to each prompt's first
    divergence, and a divergence only where the float32 run's top two were closer than the FP8 guard's max abs
    logit error allows (a near-tie that any logit error of that size may flip)."""
    from engine import LLMEngine, SamplingParams
    from labkit.checks import threshold_entry

    prompts = [[int(t) for t in torch.randint(1, 5000, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (40, 7, 90)]
    runs, described = {}, {}
    for kv in ("auto", "fp8"):
        eng = LLMEngine(str(tame_tiny), kv_cache_dtype=kv, **KW)
        try:
            runs[kv] = eng.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2))
            described[kv] = eng.describe()
        finally:
            eng.close()
    assert described["fp8"]["kv_cache"] == {"kv_cache_dtype": "fp8", "dtype": "float8_e4m3fn", "v_transposed": False,
                                            "bytes_per_token": described["auto"]["kv_cache"]["bytes_per_token"] // 4,
                                            "scales": {"k": 1.0, "v": 1.0}}
    assert described["fp8"]["config"]["kv_cache_dtype"] == "fp8"
    assert described["auto"]["kv_cache"]["scales"] is None
    _, entry = threshold_entry("kv-fp8", "cpu", "float32")
    same = 0
    for ref, got in zip(runs["auto"], runs["fp8"]):
        a, b = ref["token_ids"], got["token_ids"]
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        same += first
        if first < len(a):
            top = ref["logprobs"][first].top           # the float32 run's top two (log-probs: logit differences)
            assert top[0][1] - top[1][1] <= 2 * entry["max_abs"], (first, top, got["logprobs"][first].top)
    assert same >= 24         # (measured: 29 of 72 tokens before the three first divergences, 24 in one prompt)


def test_an_fp8_cache_on_a_gpu_before_sm89_is_refused_in_one_line(tiny_model_dir, monkeypatch):
    """Triton's e4m3 conversions need compute capability 8.9 (an A800/A100 is 8.0): one line before any load."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    cfg = Config(str(tiny_model_dir), device="cuda", attention_backend="torch", kv_cache_dtype="fp8")
    with pytest.raises(ConfigError) as e:
        cfg.check_machine()
    assert str(e.value) == "kv_cache_dtype fp8 needs a GPU of compute capability 8.9 or later (Ada, Hopper); this one is 8.0"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert cfg.check_machine() == "cuda"
    assert Config(str(tiny_model_dir), device="cuda", attention_backend="torch").check_machine() == "cuda"


def test_the_v_transposed_layout_gives_the_same_generation(tame_tiny, monkeypatch):
    """LAB_FP8_V_T=1: the pool's e4m3 V views hold each block's head positions contiguous (kv_quant.v_t) and every
    write and read goes through that layout: the same tokens and log-probs as the e4m3 cache laid out as K, bit for
    bit (torch backend, prefills, prefix hits and decode steps), and the pool says which layout it holds."""
    from engine import LLMEngine, SamplingParams
    from engine.attention import kv_quant

    prompts = [[int(t) for t in torch.randint(1, 5000, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (40, 7, 90)]
    prompts.append(prompts[2][:60] + [11, 12, 13])              # a prefix hit on the third prompt's blocks
    runs = {}
    for on in ("0", "1"):
        monkeypatch.setenv("LAB_FP8_V_T", on)
        eng = LLMEngine(str(tame_tiny), kv_cache_dtype="fp8", **KW)
        try:
            layer = eng.runner.model.attention_layers()[0]
            assert kv_quant.v_transposed(layer.v_cache) is (on == "1") and not kv_quant.v_transposed(layer.k_cache)
            assert eng.describe()["kv_cache"]["v_transposed"] is (on == "1")
            runs[on] = [(o["token_ids"], [lp.top for lp in o["logprobs"]]) for o in eng.generate(
                prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2))]
        finally:
            eng.close()
    assert runs["1"] == runs["0"]
    monkeypatch.setenv("LAB_FP8_V_T", "yes")
    from engine.config import ConfigError
    with pytest.raises(ConfigError, match="LAB_FP8_V_T='yes'"):
        LLMEngine(str(tame_tiny), kv_cache_dtype="fp8", **KW)
