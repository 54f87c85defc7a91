"""Synthetic norm weights are distinct, so a loader that swaps two norms cannot hide behind equal constants.

Every layernorm, q_norm, k_norm and the final norm of a synthetic model carries its own seeded weights
(1 + small noise, times its scale). Swapping q_norm and k_norm in the checkpoint changes the engine's
logits, and an engine whose loader maps q_norm onto k_norm (and back) fails the baseline guardrail
against transformers while the unpatched engine passes it.
"""
from __future__ import annotations

import shutil

import pytest
import torch

from labkit.guardrails.forcing import teacher_forced

SWAP = {"self_attn.q_norm": "self_attn.k_norm", "self_attn.k_norm": "self_attn.q_norm"}


def _norms(path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {n: f.get_tensor(n) for n in f.keys() if "norm" in n}


def test_every_norm_weight_is_its_own(tiny_model_dir):
    norms = _norms(tiny_model_dir)
    assert len(norms) == 2 * 4 + 1                       # 2 layers x (input, post, q, k) + final
    names = sorted(norms)
    for i, a in enumerate(names):
        assert norms[a].std() > 0, a                     # not a constant
        for b in names[i + 1:]:
            if norms[a].shape == norms[b].shape:
                assert not torch.equal(norms[a], norms[b]), (a, b)


def _logits(build, model_dir) -> torch.Tensor:
    """``build``: the test's ``tiny_engine``."""
    engine = build(model=model_dir, device="cpu", enforce_eager=True, kvcache_block_size=16, max_model_len=256)
    try:
        rows = teacher_forced(engine, [list(range(1000, 1020)), list(range(5000, 5007))], [[7, 8, 9], [10, 11]])
        return torch.stack([row for _, row, _ in rows])
    finally:
        engine.close()


def test_swapping_q_norm_and_k_norm_in_the_checkpoint_changes_the_logits(tiny_engine, tiny_model_dir, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    swapped = tmp_path / "swapped"
    shutil.copytree(tiny_model_dir, swapped)
    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    for name in [n for n in tensors if "q_norm" in n]:
        k = name.replace("q_norm", "k_norm")
        tensors[name], tensors[k] = tensors[k], tensors[name]
    save_file(tensors, str(swapped / "model.safetensors"), metadata={"format": "pt"})
    base, moved = _logits(tiny_engine, tiny_model_dir), _logits(tiny_engine, swapped)
    assert torch.isfinite(moved).all()
    assert (base - moved).abs().max().item() > 1e-2       # float32 on CPU: identical weights agree to ~1e-6


@pytest.mark.parametrize("loader_swaps", [False, True], ids=["engine-loader", "loader-swaps-q-k-norm"])
def test_a_loader_that_swaps_q_norm_and_k_norm_fails_the_baseline_guard(tiny_model_dir, tmp_path, monkeypatch,
                                                                         loader_swaps, labkit_argv):
    from engine.models.qwen3 import Qwen3ForCausalLM
    from labkit.guardrails.calibrate import guard

    labkit_argv.checkpoint("guardrails.logits-baseline")
    if loader_swaps:       # the loader's name mapping sends each checkpoint q_norm to k_norm and back
        mapping = {**Qwen3ForCausalLM.packed_modules_mapping, **{a: (b, None) for a, b in SWAP.items()}}
        monkeypatch.setattr(Qwen3ForCausalLM, "packed_modules_mapping", mapping)
    rec = guard("baseline", tmp_path / "guard.json", model=str(tiny_model_dir), device="cpu", attention="torch",
                dtype="float32")            # the checkpoint's thresholds: the logits table's cpu/float32 entry
    f = rec["facts"]
    assert f["num_rows"] == 15 and f["trajectory_match"]
    if loader_swaps:
        assert rec["verdict"] == "FAIL"
        failed = {c["name"] for c in rec["checks"] if not c["passed"]}
        assert {"facts.worst_max_abs", "facts.worst_rel_l2"} <= failed
    else:
        assert rec["verdict"] == "PASS", [c for c in rec["checks"] if not c["passed"]]
        assert f["worst_max_abs"] < 1e-3
