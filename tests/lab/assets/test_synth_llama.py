"""The ``smollm2-135m`` synthetic preset: a Llama of SmolLM2-135M's exact shapes, with Qwen's BPE cut to
its 49,152 ids (labkit/assets/tokenizer.py: cut_layout). The weight list is transformers' own LlamaForCausalLM's;
the tokenizer never gives an id outside the vocabulary, keeps <|endoftext|> 0 / <|im_start|> 1 / <|im_end|> 2 where
SmolLM2 has them and round-trips text; a 2-layer copy of the preset (every width as is) generates through the engine
the ids transformers generates, float32 on the CPU."""
from __future__ import annotations

import pytest
import torch

from labkit.assets import synth

NAME = "smollm2-135m"


def test_the_preset_has_smollm2s_shapes():
    from engine.config import ModelShape
    from engine.models import family_for

    cfg = synth.PRESETS[NAME]
    shape = ModelShape.from_hf(cfg)
    assert (shape.num_layers, shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim,
            shape.intermediate_size, shape.vocab_size, shape.tie_word_embeddings) == (30, 576, 9, 3, 64, 1536, 49152, True)
    assert cfg["rope_theta"] == 100000.0 and cfg["model_type"] == "llama" and family_for(cfg).name == "llama"
    assert shape.kv_bytes_per_token(2) == 2 * 30 * 3 * 64 * 2              # 23,040 bytes per token in bf16


def test_the_weight_list_is_transformers_llama():
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = {**synth.PRESETS[NAME], "num_hidden_layers": 1, "vocab_size": 512}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**cfg))
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert {n: s for n, s, _, _ in synth._param_specs(cfg)} == theirs         # no q_norm / k_norm


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory):
    """The preset with 2 of its 30 layers (float32, random init), every width and the tokenizer as is."""
    mp = pytest.MonkeyPatch()
    mp.setitem(synth.PRESETS, NAME, {**synth.PRESETS[NAME], "num_hidden_layers": 2})
    try:
        yield synth.synth_model(NAME, tmp_path_factory.mktemp("smollm2") / "m", dtype="float32", init="random")
    finally:
        mp.undo()


def test_the_cut_tokenizer_stays_inside_the_vocabulary(two_layers):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(two_layers))
    assert len(tok) == 49152
    assert [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    text = "The capital of France is Paris; naïve café — 12345 日本語 🚀\n\tdef f(x): return x**2"
    ids = tok(text).input_ids
    assert 0 < min(ids) and max(ids) < 49152 and tok.decode(ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok(chat).input_ids[0] == 1 and 2 in tok(chat).input_ids
    assert tok.eos_token_id == 2


def test_the_engine_generates_what_transformers_generates(two_layers):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine import LLMEngine, SamplingParams

    engine = LLMEngine(str(two_layers), device="cpu", enforce_eager=True, dtype="float32", max_model_len=256,
                       attention_backend="torch")
    try:
        assert engine.describe()["model"]["qk_norm_rope_kv"] == "plain"
        out = engine.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8,
                                                                           ignore_eos=True))[0]
    finally:
        engine.close()
    hf = AutoModelForCausalLM.from_pretrained(str(two_layers), dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(str(two_layers))("The capital of France is").input_ids
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, len(ids):]
    assert out["token_ids"] == ref.tolist()
