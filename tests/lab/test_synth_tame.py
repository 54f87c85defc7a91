"""The tame init (labkit/assets/synth_tame.py): qwen3-0.6b's default, a real test in BF16, not a degenerate one.

On the full qwen3-0.6b preset (CPU): greedy continuations walk the seeded bigram and are not one repeated
token; removing any one layer's attention output moves the logits by more than the bf16 guard's thresholds
(the handbook's 0.5 / 0.02, read from the logits table), so a guard that PASSes has seen every layer.
"""
from __future__ import annotations

import json
import subprocess
import sys

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
    """The qwen3-0.6b preset with its default (tame) init, seed 0, written by `labkit model synth` in a child
    process: drawing the weights peaks at about 3 GB, which the test process then never holds."""
    from testkit import labkit_process

    out = tmp_path_factory.mktemp("tame") / "qwen3-0.6b"
    proc = labkit_process("model", "synth", "--preset", "qwen3-0.6b", "--out", str(out), "--json")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert json.loads((out / "labkit_synth.json").read_text())["init"] == "tame"
    return out


def _bf16_thresholds() -> dict:
    from labkit.checks import threshold_entry

    _, entry = threshold_entry("logits", "cuda", "bfloat16")
    return entry


def _in_child(part: str, model_dir) -> dict:
    """This module as a script in a fresh process (``part``: greedy or ablation): loading the 0.6B model peaks at
    about 3.8 GB (the mapped file and the weights), which the test process, holding the session's other
    modules, then never adds to itself. The script's last stdout line, as JSON."""
    proc = subprocess.run([sys.executable, __file__, part, str(model_dir)], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_greedy_continuations_walk_the_bigram_not_one_token(tame_dir):
    nxt = bigram_next(json.loads((tame_dir / "config.json").read_text()), 0, synth._tensor_seed)
    outs = _in_child("greedy", tame_dir)["token_ids"]
    follows = 0
    for prompt, ids in zip(PROMPTS, outs, strict=True):
        assert len(set(ids)) >= 6, (prompt[-1], ids)                      # not a constant, not a short loop
        walk = [prompt[-1]] + list(ids)
        follows += sum(int(nxt[a]) == b for a, b in zip(walk, walk[1:]))
    assert follows >= 0.75 * 8 * len(PROMPTS), follows                   # the language the weights encode


@pytest.mark.slow
def test_removing_any_layers_attention_moves_the_logits_past_the_bf16_thresholds(tame_dir):
    th = _bf16_thresholds()
    worst = _in_child("ablation", tame_dir)["worst"]
    assert len(worst) == json.loads((tame_dir / "config.json").read_text())["num_hidden_layers"], worst
    # every layer: the bf16 guard would FAIL an engine that dropped its attention (relative L2 past 0.02)
    assert all(rel > th["rel_l2"] for _, rel in worst), worst
    # and the first layer (whose change every later layer carries on) moves some logit past the max abs threshold
    assert worst[0][0] > th["max_abs"], worst


# -- the child process -----------------------------------------------------------------------------------
def _greedy(model_dir: str) -> dict:
    """Each prompt's 8 greedy tokens on the engine in bf16, the three prompts in one batch (each decode step
    reads the weights once for all three)."""
    from engine import LLMEngine, SamplingParams

    engine = LLMEngine(model_dir, device="cpu", dtype="bfloat16", attention_backend="torch", enforce_eager=True,
                       kvcache_block_size=16, max_model_len=256, num_kvcache_blocks=64)   # not the CPU's 1 GiB
    try:
        outs = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    finally:
        engine.close()
    return {"token_ids": [list(out["token_ids"] if isinstance(out, dict) else out.token_ids) for out in outs]}


def _ablation(model_dir: str) -> dict:
    """Per layer, (max abs, relative L2) of the prompts' last-position float32 logits moved by zeroing that layer's
    attention output (the worst prompt of each). The layers before the removed one see the plain forward's
    inputs, so they give its outputs: those are replayed instead of computed again."""
    from transformers import AutoModelForCausalLM

    # the stored bf16 weights widened to float32 (exact)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="eager")
    model = model.float().eval()
    layers = model.model.layers
    outputs: list[list] = [[None] * len(layers) for _ in PROMPTS]      # each prompt's output of every layer, unchanged

    def last_logits(ablated: int | None = None) -> list[torch.Tensor]:
        logits = []
        for p, prompt in enumerate(PROMPTS):
            hooks = [layer.register_forward_hook(lambda mod, inp, out, p=p, j=j: outputs[p].__setitem__(j, out))
                     for j, layer in enumerate(layers)] if ablated is None else \
                [layers[ablated].self_attn.o_proj.register_forward_hook(lambda mod, inp, out: torch.zeros_like(out))]
            for j in range(ablated or 0):
                layers[j].forward = lambda *a, _out=outputs[p][j], **kw: _out
            try:
                with torch.no_grad():
                    out = model(input_ids=torch.tensor([prompt]), use_cache=False, logits_to_keep=1)
                logits.append(out.logits[0, -1].double())
            finally:
                for h in hooks:
                    h.remove()
                for j in range(ablated or 0):
                    del layers[j].forward
        return logits

    base = last_logits()
    worst = []
    for i in range(len(layers)):
        moved = last_logits(i)
        worst.append((max(float((m - b).abs().max()) for m, b in zip(moved, base)),
                      max(float((m - b).norm() / b.norm()) for m, b in zip(moved, base))))
    return {"worst": worst}


if __name__ == "__main__":
    print(json.dumps({"greedy": _greedy, "ablation": _ablation}[sys.argv[1]](sys.argv[2])))
