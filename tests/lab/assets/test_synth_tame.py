"""The tame init (labkit/assets/synth_tame.py): qwen3-0.6b's default, a real test in BF16, not a degenerate one.

On the full qwen3-0.6b preset (CPU, transformers in one child process that keeps the stored bf16 weights): greedy
continuations in bf16 walk the seeded bigram and are not one repeated token (the engine's bf16 greedy, which this
test ran until 2026-12, gave the same tokens side by side); removing any one layer's attention output moves the
logits by more than the bf16 guard's thresholds (the handbook's 0.5 / 0.02, read from the logits table), so a guard
that PASSes has seen every layer.
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


def one_thread_env() -> dict:
    """The environment for a child of a pytest-xdist worker: one torch thread, as the worker itself has (README:
    one worker per core; two threads per child on two busy cores spin against each other)."""
    import os

    return {**os.environ, "OMP_NUM_THREADS": "1"} if os.environ.get("PYTEST_XDIST_WORKER") else dict(os.environ)


def _in_child(model_dir) -> dict:
    """This module as a script in a fresh process: the 0.6B model loaded once in bf16 (about 1.2 GB, which the test
    process, holding the session's other modules, never adds to itself), its greedy continuations and its
    per-layer attention removal. The script's last stdout line, as JSON; run once for the module's two tests."""
    proc = subprocess.run([sys.executable, __file__, str(model_dir)], capture_output=True, text=True, timeout=900,
                          env=one_thread_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tame_results(tame_dir) -> dict:
    return _in_child(tame_dir)


@pytest.mark.slow
def test_greedy_continuations_walk_the_bigram_not_one_token(tame_dir, tame_results):
    nxt = bigram_next(json.loads((tame_dir / "config.json").read_text()), 0, synth._tensor_seed)
    outs = tame_results["token_ids"]
    follows = 0
    for prompt, ids in zip(PROMPTS, outs, strict=True):
        assert len(ids) == 8, ids
        assert len(set(ids)) >= 6, (prompt[-1], ids)                      # not a constant, not a short loop
        walk = [prompt[-1]] + list(ids)
        follows += sum(int(nxt[a]) == b for a, b in zip(walk, walk[1:]))
    assert follows >= 0.75 * 8 * len(PROMPTS), follows                   # the language the weights encode


@pytest.mark.slow
def test_removing_any_layers_attention_moves_the_logits_past_the_bf16_thresholds(tame_dir, tame_results):
    th = _bf16_thresholds()
    worst = tame_results["worst"]
    assert len(worst) == json.loads((tame_dir / "config.json").read_text())["num_hidden_layers"], worst
    # every layer: the bf16 guard would FAIL an engine that dropped its attention (relative L2 past 0.02)
    assert all(rel > th["rel_l2"] for _, rel in worst), worst
    # and the first layer (whose change every later layer carries on) moves some logit past the max abs threshold
    assert worst[0][0] > th["max_abs"], worst


# -- the child process -----------------------------------------------------------------------------------
# The weights stay in their stored bf16, mapped from the file (1.2 GB; the float32 model took 2.4 GB more and its
# process peaked at 3.9 GB). Greedy runs in bf16; the ablation computes in float32 from float32 copies of one
# module's weights at a time (exact widenings): the embedding for the first layer's inputs, each decoder layer
# while it runs, the final norm, and the head in bands of rows.


class _Stop(Exception):
    """Raised by the first decoder layer's pre-hook once it has its inputs (the rest of that forward is not run)."""


def _greedy(model) -> list[list[int]]:
    """Each prompt's 8 greedy tokens in bf16 (no end of sequence before the 8th, as ignore_eos)."""
    outs = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                             min_new_tokens=8, temperature=None, top_k=None, top_p=None)
        outs.append(out[0, len(prompt):].tolist())
    return outs


def _float_call(module, *args, widened: dict | None = None, **kwargs):
    """``module(*args, **kwargs)`` with float32 copies of its parameters (``widened``: only those named)."""
    names = widened or {n: p for n, p in module.named_parameters()}
    return torch.func.functional_call(module, {n: p.float() for n, p in names.items()}, args, kwargs)


def _first_layer_inputs(model, prompt: list[int]) -> tuple[torch.Tensor, dict]:
    """The float32 hidden states and the keyword arguments (mask, positions, rotary tables) the model's own forward
    gives its first decoder layer for ``prompt``, its embedding widened to float32."""
    got: dict = {}

    def grab(mod, args, kwargs):
        got["h"], got["kw"] = args[0] if args else kwargs.pop("hidden_states"), kwargs
        raise _Stop

    hook = model.model.layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        _float_call(model, input_ids=torch.tensor([prompt]), use_cache=False,
                    widened={"model.embed_tokens.weight": model.model.embed_tokens.weight})
    except _Stop:
        pass
    finally:
        hook.remove()
    assert got["h"].dtype == torch.float32, got["h"].dtype
    return got["h"], got["kw"]


def _ablation(model) -> list[tuple[float, float]]:
    """Per layer, (max abs, relative L2) of the prompts' last-position float32 logits moved by zeroing that layer's
    attention output (the worst prompt of each). Layer by layer, each prompt carries a batch of streams: row 0 the
    plain forward, row 1 + i the one whose layer i lost its attention; layer j adds its stream as a copy of row 0's
    input (the layers before it see the plain inputs) and zeroes that last row's attention output."""
    model.model.rotary_emb.float()                                    # its inv_freq buffer (float32 already)
    starts = [_first_layer_inputs(model, prompt) for prompt in PROMPTS]
    hidden = [h for h, _ in starts]

    def zero_last_row(mod, inp, out):
        return torch.cat([out[:-1], torch.zeros_like(out[-1:])])

    for layer in model.model.layers:
        hook = layer.self_attn.o_proj.register_forward_hook(zero_last_row)
        wide = {n: p.float() for n, p in layer.named_parameters()}   # widened once for the three prompts
        try:
            hidden = [_float_call(layer, torch.cat([h, h[:1]]), widened=wide, **kw)   # .float() of float32: itself
                      for h, (_, kw) in zip(hidden, starts)]
        finally:
            hook.remove()
        del wide
    head = model.lm_head.weight
    last = [_float_call(model.model.norm, h[:, -1]) for h in hidden]
    bands = []                                                        # per prompt, [1 + layers, band] per band
    for r in range(0, head.shape[0], 16384):
        band = head[r:r + 16384].float().T                            # widened once for the three prompts
        bands.append([x @ band for x in last])
    logits = [torch.cat([b[i] for b in bands], 1).double() for i in range(len(hidden))]   # [1 + layers, vocab]
    worst = []
    for i in range(len(model.model.layers)):
        moved = [(x[1 + i] - x[0]) for x in logits]
        worst.append((max(float(d.abs().max()) for d in moved),
                      max(float(d.norm() / x[0].norm()) for d, x in zip(moved, logits))))
    return worst


def _child(model_dir: str) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="eager").eval()
    with torch.no_grad():
        token_ids = _greedy(model)
        return {"token_ids": token_ids, "worst": _ablation(model)}


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1])))
