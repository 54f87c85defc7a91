"""The model families (engine/families.py) against transformers, on tiny random models that transformers
itself writes (``LlamaConfig``/``Qwen2Config``/``Qwen3Config`` + ``save_pretrained``), in float32 on the CPU.

Each family: the engine's teacher-forced logits through the real scheduler (paged KV, chunked prefill at two
budgets, decode) and a prefix-cache hit vs transformers recomputing the whole prefix; greedy ids equal to
transformers' ``generate``; TP=2 (gloo) equal to TP=1. No tokenizer: token ids in, token ids out.

The models: Llama tied (SmolLM2's layout: 9 q / 3 kv heads, head_dim 64, rope_theta 1e5); Llama untied with
attention and MLP biases and llama3 rope scaling; Qwen2 (q/k/v bias, no o bias) with 14 q / 2 kv heads (GQA 7,
head_dim 64, Qwen2-0.5B's grouping); Qwen3 written by transformers too (q/k norm). Every weight, norm and bias is
drawn at unit scale (transformers' own init leaves biases at zero and norms at one, which would hide a dropped
bias or norm). The mutations at the bottom show each comparison FAIL on an engine broken on purpose.
"""
from __future__ import annotations

import json

import pytest
import torch

from engine import SamplingParams
from engine.config import Config, ConfigError, read_model_dir
from labkit.guardrails.forcing import teacher_forced
from testkit import engines

TOLERANCE = 1e-4        # as tests/engine/test_engine_vs_hf.py; measured worst here: a few 1e-6
VOCAB = 512

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)

#: name -> (transformers config class, its keywords)
FAMILY_MODELS = {
    "llama-smollm2": ("LlamaConfig", dict(COMMON, hidden_size=144, num_attention_heads=9, num_key_value_heads=3,
                                          head_dim=64, tie_word_embeddings=True, rope_theta=100000.0)),
    "llama-bias-llama3": ("LlamaConfig", dict(COMMON, num_attention_heads=4, num_key_value_heads=2,
                                              attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
                                              rope_theta=500000.0,
                                              rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                            "original_max_position_embeddings": 64})),
    "qwen2-gqa7": ("Qwen2Config", dict(COMMON, hidden_size=112, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                                       tie_word_embeddings=True, rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", dict(COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  tie_word_embeddings=False, rope_theta=1000000.0)),
}


def _randomize(model, seed: int) -> None:
    """Every parameter at unit scale: linear weights N(0, 1/fan_in), embeddings N(0, 0.25) (tied, logits with a
    std of a few units), norms 1 + 0.1 N(0, 1), biases 0.1 N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(0.25 * noise)
            else:
                p.copy_(noise * p.shape[-1] ** -0.5)


def write_family_model(name: str, out, seed: int = 0):
    """A tiny random model of FAMILY_MODELS[name], written by transformers' save_pretrained."""
    import transformers

    cls_name, kw = FAMILY_MODELS[name]
    config = getattr(transformers, cls_name)(**kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: write_family_model(name, root / name) for name in FAMILY_MODELS}


@pytest.fixture(scope="module")
def hf_models(family_dirs):
    from transformers import AutoModelForCausalLM

    return {name: AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager",
                                                       dtype=torch.float32).eval()
            for name, path in family_dirs.items()}


def _workload(seed: int, lengths=(3, 70, 17, 130), n_out: int = 4):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]
    conts = [torch.randint(3, VOCAB, (n_out,), generator=g).tolist() for _ in prompts]
    return prompts, conts


def worst_error(engine, hf, prompts, conts) -> float:
    """Teacher-forced rows through the engine vs transformers on each whole prefix: the worst max-abs logit
    error (and every row's argmax equal)."""
    rows = teacher_forced(engine, prompts, conts)
    assert len(rows) == sum(len(c) for c in conts)
    worst = 0.0
    with torch.no_grad():
        for tokens, row, _ in rows:
            ref = hf(torch.tensor([tokens]), use_cache=False).logits[0, -1].float()
            worst = max(worst, (ref - row).abs().max().item())
            assert ref.argmax() == row.argmax(), f"argmax differs at prefix length {len(tokens)}"
    return worst


@pytest.mark.parametrize("name", sorted(FAMILY_MODELS))
def test_the_config_picks_the_family(family_dirs, name):
    cfg = read_model_dir(family_dirs[name])
    from engine.models import family_for

    assert family_for(cfg).name == name.split("-")[0]


@pytest.mark.parametrize("block_size,budget", [(16, 512), (4, 24)])
@pytest.mark.parametrize("name", sorted(FAMILY_MODELS))
def test_teacher_forced_logits_match_transformers(family_dirs, hf_models, name, block_size, budget):
    """Prefill in one step (budget 512) and chunked in pieces of 24 tokens over 4-token blocks, then decode."""
    with engines(family_dirs[name]) as build:
        engine = build(kvcache_block_size=block_size, max_num_batched_tokens=budget, max_model_len=512)
        worst = worst_error(engine, hf_models[name], *_workload(block_size + len(name)))
    print(f"{name}: worst max-abs logit error (block {block_size}, budget {budget}): {worst:.3e}")
    assert worst < TOLERANCE


@pytest.mark.parametrize("name", sorted(FAMILY_MODELS))
def test_prefix_cache_hit_gives_the_same_logits(family_dirs, hf_models, name):
    hf = hf_models[name]
    shared = list(range(100, 164))
    with engines(family_dirs[name]) as build:
        engine = build(kvcache_block_size=16)
        teacher_forced(engine, [shared + [5, 6, 7]], [[8, 9]])          # fills the prefix cache
        seq = engine.add_request(shared + [11, 12, 13], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        seqs, is_prefill = engine.schedule()
        assert seq.num_cached_tokens == 64 and seq.num_scheduled_tokens == 3      # 4 blocks reused
        row = engine.forward_logits(seqs, is_prefill)[0][0]
    with torch.no_grad():
        ref = hf(torch.tensor([shared + [11, 12, 13]]), use_cache=False).logits[0, -1]
    assert (ref - row).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("name", sorted(FAMILY_MODELS))
def test_greedy_ids_equal_transformers_generate(family_dirs, hf_models, name):
    prompts, _ = _workload(7, lengths=(5, 40, 23))
    hf = hf_models[name]
    with engines(family_dirs[name]) as build:
        engine = build(max_num_batched_tokens=32)          # chunked prefill on the way
        seqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
                for p in prompts]
        while not engine.is_finished():
            engine.step()
    with torch.no_grad():
        for prompt, seq in zip(prompts, seqs):
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                              pad_token_id=0)[0, len(prompt):].tolist()
            assert seq.completion_token_ids == ref


@pytest.mark.parametrize("name", ["llama-bias-llama3", "qwen2-gqa7"])
def test_describe_names_the_family_and_the_plain_route(family_dirs, name):
    with engines(family_dirs[name]) as build:
        model = build().describe()["model"]
    assert model["family"] == name.split("-")[0]
    assert model["qk_norm"] is False and model["qk_norm_rope_kv"] == "plain"
    assert model["o_bias"] is (name == "llama-bias-llama3") and model["qkv_bias"] is True


# -- tensor parallel ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama-bias-llama3", "qwen2-gqa7"])
def test_tp2_logits_equal_tp1(family_dirs, name):
    """Row-parallel o/down biases added once, column-parallel q/k/v and MLP biases split with their heads."""
    prompts, conts = _workload(11, lengths=(3, 40, 19), n_out=3)
    kw = dict(kvcache_block_size=16, max_num_batched_tokens=64, enforce_eager=True, attention_backend="torch")
    with engines(family_dirs[name]) as build:
        rows1 = teacher_forced(build(tensor_parallel_size=1, **kw), prompts, conts)
        rows2 = teacher_forced(build(tensor_parallel_size=2, **kw), prompts, conts)
    assert [a[0] for a in rows1] == [b[0] for b in rows2]
    worst = max((a[1] - b[1]).abs().max().item() for a, b in zip(rows1, rows2))
    print(f"{name}: TP=2 vs TP=1 worst max-abs logit error: {worst:.3e}")
    assert worst < 5e-5


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_sizes_that_do_not_divide_the_heads_are_one_error(family_dirs, tp):
    """9 q / 3 kv heads (SmolLM2's): TP 2 and 4 divide neither; one line naming both counts, before any weights load."""
    with pytest.raises(ConfigError) as exc:
        Config(str(family_dirs["llama-smollm2"]), tensor_parallel_size=tp, device="cpu")
    msg = str(exc.value)
    assert f"tensor_parallel_size {tp}" in msg and "9 q heads" in msg and "3 kv heads" in msg and "\n" not in msg


# -- unsupported architectures -------------------------------------------------------------------------------

@pytest.mark.parametrize("edit", [
    {"architectures": ["MistralForCausalLM"], "model_type": "mistral"},
    {"architectures": ["LlamaForCausalLM"], "model_type": "mistral"},
    {"architectures": None, "model_type": "gemma"},
    {"hidden_act": "gelu"},
    {"use_sliding_window": True, "sliding_window": 4096},
])
def test_unsupported_configs_are_one_line(family_dirs, tmp_path, edit):
    import shutil

    model = tmp_path / "m"
    shutil.copytree(family_dirs["llama-smollm2"], model)
    cfg = json.loads((model / "config.json").read_text())
    cfg.update({k: v for k, v in edit.items() if v is not None})
    for k in [k for k, v in edit.items() if v is None]:
        cfg.pop(k, None)
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as exc:
        read_model_dir(model)
    msg = str(exc.value)
    assert "\n" not in msg
    if "model_type" in edit:
        assert "supported: LlamaForCausalLM (llama), Qwen2ForCausalLM (qwen2), Qwen3ForCausalLM (qwen3)" in msg


# -- broken on purpose: each comparison above fails -------------------------------------------------------

def _break_o_bias(monkeypatch):
    from engine.layers.linear import RowParallelLinear

    forward = RowParallelLinear.forward

    def no_bias(self, x, silu_mul=False):
        out = forward(self, x, silu_mul)
        return out - self.bias if self.bias is not None and self.bias.shape[0] == out.shape[-1] else out
    monkeypatch.setattr(RowParallelLinear, "forward", no_bias)


def _break_rope_theta(monkeypatch):
    import engine.config as config_mod

    from_hf = config_mod.RopeScaling.from_hf.__func__
    monkeypatch.setattr(config_mod.RopeScaling, "from_hf",
                        classmethod(lambda cls, cfg: from_hf(cls, {**cfg, "rope_theta": 10000.0,
                                                                    "rope_parameters": None})))


def _break_qkv_bias(monkeypatch):
    from engine import families

    rows = tuple(f if f.name != "qwen2" else families.ModelFamily(**{**f.__dict__, "qkv_bias": False})
                 for f in families.FAMILIES)
    monkeypatch.setattr(families, "FAMILIES", rows)


def _break_qk_norm(monkeypatch):
    from engine import families

    rows = tuple(f if f.name != "qwen3" else families.ModelFamily(**{**f.__dict__, "qk_norm": False})
                 for f in families.FAMILIES)
    monkeypatch.setattr(families, "FAMILIES", rows)


def _break_llama3_rope(monkeypatch):
    import engine.layers.rotary as rotary

    monkeypatch.setattr(rotary, "_llama3_frequencies", lambda inv_freq, rope: inv_freq)


MUTATIONS = {       # mutation -> the model it shows on
    "o-bias-dropped": (_break_o_bias, "llama-bias-llama3"),
    "rope-theta-10000": (_break_rope_theta, "llama-smollm2"),
    "qwen2-qkv-bias-dropped": (_break_qkv_bias, "qwen2-gqa7"),
    "qwen3-qk-norm-dropped": (_break_qk_norm, "qwen3"),
    "llama3-scaling-ignored": (_break_llama3_rope, "llama-bias-llama3"),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_the_comparison_fails_on_a_broken_engine(family_dirs, hf_models, monkeypatch, mutation):
    """What the tests above assert (argmax equal and logits within TOLERANCE) does not hold on an engine broken on
    purpose: a dropped o bias, rope theta 10,000 instead of the config's (the silent transformers 4.51 misread the
    issue names), Qwen2's q/k/v bias or Qwen3's q/k norm dropped from the family table (the model loads: the
    checkpoint tensors it no longer has parameters for are refused, so those two load a copy without them), the
    llama3 scaling ignored."""
    import shutil

    breaker, name = MUTATIONS[mutation]
    model = family_dirs[name]
    if mutation in ("qwen2-qkv-bias-dropped", "qwen3-qk-norm-dropped"):
        from safetensors.torch import load_file, save_file

        model = shutil.copytree(model, monkeypatch.__dict__.setdefault("_tmp", model.parent / f"{name}-{mutation}"),
                                dirs_exist_ok=True)
        drop = ".bias" if "bias" in mutation else "_norm."
        tensors = {k: v for k, v in load_file(str(model / "model.safetensors")).items()
                   if not (drop in k and "self_attn" in k)}
        save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    breaker(monkeypatch)
    with engines(model) as build:
        engine = build(kvcache_block_size=16, max_num_batched_tokens=512, max_model_len=512)
        try:
            worst = worst_error(engine, hf_models[name], *_workload(5, lengths=(3, 70, 130), n_out=3))
        except AssertionError as exc:          # an argmax already differs
            print(f"{mutation}: {str(exc).splitlines()[0]}")
            return
    print(f"{mutation}: worst max-abs logit error {worst:.3e}")
    assert worst > 100 * TOLERANCE


# -- the loader on Llama/Qwen2 names ------------------------------------------------------------------------

def _rewrite(src, dst, edit):
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = edit(load_file(str(dst / "model.safetensors")))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_an_untied_model_without_its_head_is_refused(family_dirs, tmp_path):
    model = _rewrite(family_dirs["llama-bias-llama3"], tmp_path / "m",
                     lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"})
    with pytest.raises(ConfigError, match="lacks parameters: lm_head.weight"):
        with engines(model) as build:
            build()


def test_rope_buffers_and_a_tied_heads_copy_are_skipped(family_dirs, hf_models, tmp_path):
    """Older Llama checkpoints hold each layer's rotary_emb.inv_freq; a tied checkpoint may hold lm_head.weight
    too (here a wrong one, which a tied engine must not read)."""
    def add(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(32)
        t["lm_head.weight"] = torch.zeros_like(t["model.embed_tokens.weight"])
        return t
    model = _rewrite(family_dirs["llama-smollm2"], tmp_path / "m", add)
    with engines(model) as build:
        worst = worst_error(build(), hf_models["llama-smollm2"], *_workload(3, lengths=(9, 33), n_out=2))
    assert worst < TOLERANCE
