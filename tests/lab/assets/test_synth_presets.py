"""The Qwen3-family synthetic presets (1.7B, 4B, 8B): configs transformers accepts, parameter lists that
match transformers' own model, shapes the bound is computed from."""
from __future__ import annotations

import json

import pytest

from engine.config import ModelShape
from labkit.assets import synth

LARGE = ("qwen3-1.7b", "qwen3-4b", "qwen3-8b")


def small(cfg: dict, layers: int = 1, vocab: int = 512) -> dict:
    """The preset with few layers and a small vocabulary (fast), every other shape as is."""
    return {**cfg, "num_hidden_layers": layers, "max_window_layers": layers, "vocab_size": vocab}


@pytest.mark.parametrize("name", LARGE)
def test_preset_config_loads_in_transformers(name, tmp_path):
    from transformers import AutoConfig

    cfg = synth.PRESETS[name]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf = AutoConfig.from_pretrained(tmp_path)
    assert hf.model_type == "qwen3"
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(hf, key) == cfg[key], key
    shape = ModelShape.from_hf(cfg)
    assert shape.num_heads % shape.num_kv_heads == 0 and shape.head_dim == 128


@pytest.mark.parametrize("name", LARGE)
def test_synth_parameters_match_transformers_model(name):
    """Our weight list (names and shapes, the untied lm_head included) is what transformers' Qwen3 builds."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = small(synth.PRESETS[name])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**cfg))
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg["tie_word_embeddings"]:
        theirs.pop("lm_head.weight", None)                  # tied: saved once, as the embedding
    ours = {n: s for n, s, _, _ in synth._param_specs(cfg)}
    assert ours == theirs


def test_large_presets_grow_and_8b_is_untied():
    from labkit.bench.bound import decode_weight_bytes

    sizes = [decode_weight_bytes(ModelShape.from_hf(synth.PRESETS[n]), 2) for n in ("qwen3-0.6b", *LARGE)]
    assert sizes == sorted(sizes) and len(set(sizes)) == 4
    assert synth.PRESETS["qwen3-8b"]["tie_word_embeddings"] is False
    assert all(synth.PRESETS[n]["tie_word_embeddings"] for n in ("qwen3-1.7b", "qwen3-4b"))
    # 8B: about 8.2e9 parameters, i.e. ~16.4 GB at bf16
    params = sum(__import__("math").prod(s) for _, s, _, _ in synth._param_specs(synth.PRESETS["qwen3-8b"]))
    assert 8.0e9 < params < 8.3e9


def test_untied_synth_model_runs_in_the_engine(tmp_path, monkeypatch, lab_engine):
    """An untied preset's lm_head is written and loaded (tiny shapes, the 8B preset's untied head)."""
    from engine import SamplingParams

    monkeypatch.setitem(synth.PRESETS, "tiny", {**synth.PRESETS["tiny"], "tie_word_embeddings": False})
    path = synth.synth_model("tiny", tmp_path / "untied", seed=1)
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" in f.keys()
    eng = lab_engine(model=path, max_model_len=128, max_num_batched_tokens=128, attention_backend="auto",
                     kvcache_block_size=256)
    try:
        assert not torch_equal_head(eng)
        out = eng.generate([[11, 12, 13]], SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(out[0]["token_ids"]) == 3
    finally:
        eng.close()


def torch_equal_head(eng) -> bool:
    import torch

    model = eng.runner.model
    return torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_synth_device_is_checked(tmp_path):
    with pytest.raises(synth.ModelError, match="--device"):
        synth.synth_model("tiny", tmp_path / "x", device="tpu")
