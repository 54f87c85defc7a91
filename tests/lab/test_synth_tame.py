"""The tame init (labkit/assets/synth_tame.py): qwen3-0.6b's default, a real test in BF16, not a degenerate one.

On the full qwen3-0.6b preset (CPU): greedy continuations walk the seeded bigram and are not one repeated
token; removing any one layer's attention output moves the logits by more than the bf16 guard's thresholds
(the handbook's 0.5 / 0.02, read from the logits table), so a guard that PASSes has seen every layer.
"""
from __future__ import annotations

import json

import pytest
import torch

from labkit.assets import synth
from labkit.assets.files import ModelError
from labkit.assets.identity import model_identity
from labkit.assets.synth_tame import bigram_next

PROMPTS = [list(range(9000, 9003)), list(range(3000, 3008)), list(range(100, 140))]


def test_inits_presets_and_marker(tmp_path):
    assert synth.default_init("qwen3-0.6b") == "tame" and synth.default_init("tiny") == "random"
    random_dir = synth.synth_model("tiny", tmp_path / "r")
    tame_dir = synth.synth_model("tiny", tmp_path / "t", init="tame")
    assert json.loads((random_dir / "labkit_synth.json").read_text())["init"] == "random"
    assert json.loads((tame_dir / "labkit_synth.json").read_text())["init"] == "tame"
    assert model_identity(tame_dir)["init"] == "tame"
    assert model_identity(random_dir)["weights_sha256"] != model_identity(tame_dir)["weights_sha256"]
    with pytest.raises(ModelError, match="unknown init"):
        synth.synth_model("tiny", tmp_path / "x", init="chaotic")


def test_cli_synth_init_option(cli_app, tmp_path):
    from typer.testing import CliRunner

    res = CliRunner().invoke(cli_app, ["model", "synth", "--preset", "tiny", "--init", "tame", "--out",
                                       str(tmp_path / "m"), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "m" / "labkit_synth.json").read_text())["init"] == "tame"


@pytest.fixture(scope="module")
def tame_dir(tmp_path_factory):
    """The qwen3-0.6b preset with its default (tame) init, seed 0."""
    return synth.synth_model("qwen3-0.6b", tmp_path_factory.mktemp("tame") / "qwen3-0.6b")


def _bf16_thresholds() -> dict:
    from labkit.checks import threshold_entry

    _, entry = threshold_entry("logits", "cuda", "bfloat16")
    return entry


@pytest.mark.slow
def test_greedy_continuations_walk_the_bigram_not_one_token(tame_dir):
    from engine import LLMEngine, SamplingParams

    nxt = bigram_next(json.loads((tame_dir / "config.json").read_text()), 0, synth._tensor_seed)
    engine = LLMEngine(str(tame_dir), device="cpu", dtype="bfloat16", attention_backend="torch", enforce_eager=True,
                       kvcache_block_size=16, max_model_len=256)
    try:
        outs = [engine.generate([p], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
                for p in PROMPTS]
    finally:
        engine.close()
    follows = 0
    for prompt, out in zip(PROMPTS, outs):
        ids = out["token_ids"] if isinstance(out, dict) else out.token_ids
        assert len(set(ids)) >= 6, (prompt[-1], ids)                      # not a constant, not a short loop
        walk = [prompt[-1]] + list(ids)
        follows += sum(int(nxt[a]) == b for a, b in zip(walk, walk[1:]))
    assert follows >= 0.75 * 8 * len(PROMPTS), follows                   # the language the weights encode


@pytest.mark.slow
def test_removing_any_layers_attention_moves_the_logits_past_the_bf16_thresholds(tame_dir):
    from transformers import AutoModelForCausalLM

    th = _bf16_thresholds()
    model = AutoModelForCausalLM.from_pretrained(str(tame_dir), dtype=torch.float32, attn_implementation="eager").eval()

    def last_logits() -> list[torch.Tensor]:
        with torch.no_grad():
            return [model(input_ids=torch.tensor([p]), use_cache=False).logits[0, -1].double() for p in PROMPTS]

    base = last_logits()
    worst = []
    for layer in model.model.layers:
        hook = layer.self_attn.o_proj.register_forward_hook(lambda mod, inp, out: torch.zeros_like(out))
        try:
            moved = last_logits()
        finally:
            hook.remove()
        max_abs = max(float((m - b).abs().max()) for m, b in zip(moved, base))
        rel_l2 = max(float((m - b).norm() / b.norm()) for m, b in zip(moved, base))
        worst.append((max_abs, rel_l2))
    # every layer: the bf16 guard would FAIL an engine that dropped its attention (relative L2 past 0.02)
    assert all(rel > th["rel_l2"] for _, rel in worst), worst
    # and the first layer (whose change every later layer carries on) moves some logit past the max abs threshold
    assert worst[0][0] > th["max_abs"], worst
