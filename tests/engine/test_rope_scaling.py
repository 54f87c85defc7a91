"""Rope scaling: default, linear, yarn and llama3 as transformers computes them,
other types refused.

The frequencies and the cos/sin scaling are compared with transformers' own Qwen3 rotary embedding; the
logits with the engine on a rope-scaled tiny model are the models.rope-* checkpoints (run here in-process),
and the scaling is shown to move the baseline suite's logits far beyond the logits thresholds, so that
those checkpoints cannot PASS with an engine that ignores it (tests/engine/test_mutations.py breaks it on purpose).
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from testkit import labkit_process
from engine.config import ConfigError, RopeScaling, read_model_dir
from engine.layers.rotary import RotaryEmbedding, rope_frequencies

BASE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=40960, rope_theta=1e6)

CASES = {
    "default": {},
    "no-theta": {"rope_theta": None},
    "linear": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "yarn-old-key": {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 10240}},
    "yarn-no-original": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
    "yarn-all-options": {"rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096,
                                          "beta_fast": 16, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5,
                                          "truncate": False}},
    "yarn-attention-factor": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 10240, "attention_factor": 1.5}},
    "yarn-rope-parameters": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 5e5,
                                                 "original_max_position_embeddings": 10240}},
    "llama3": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "llama3-other-bands": {"rope_parameters": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 2.0,
                                               "high_freq_factor": 8.0, "rope_theta": 5e5,
                                               "original_max_position_embeddings": 1024}},
    "yarn-top-level-original": {"original_max_position_embeddings": 8192,
                                "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 10240}},
}


def _cfg(extra: dict) -> dict:
    cfg = {**BASE, **extra}
    return {k: v for k, v in cfg.items() if v is not None}


@pytest.mark.parametrize("name", sorted(CASES))
def test_frequencies_and_tables_match_transformers(name):
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    cfg = _cfg(CASES[name])
    ref = Qwen3RotaryEmbedding(Qwen3Config(**json.loads(json.dumps(cfg))))
    rope = RopeScaling.from_hf(cfg)
    assert rope.rope_type == ref.rope_type
    inv_freq, scaling = rope_frequencies(16, rope)
    assert torch.equal(inv_freq, ref.inv_freq)
    assert scaling == ref.attention_scaling
    ours = RotaryEmbedding(16, 4096, rope.theta, rope)
    positions = torch.tensor([0, 1, 7, 300, 731, 4095])
    cos, sin = ref(torch.zeros(1, dtype=torch.float32), positions[None])
    torch.testing.assert_close(ours.cos[positions], cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.sin[positions], sin[0], rtol=0, atol=1e-6)


def test_yarn_changes_only_the_slow_dimensions_and_scales_the_tables():
    """yarn:4 keeps the fastest frequencies, divides the slowest by the factor and bakes 0.1 ln 4 + 1 into cos/sin."""
    default = RopeScaling.from_hf(_cfg({}))
    yarn = RopeScaling.from_hf(_cfg(CASES["yarn-old-key"]))
    f0, s0 = rope_frequencies(16, default)
    f1, s1 = rope_frequencies(16, yarn)
    assert s0 == 1.0 and s1 == pytest.approx(0.1 * np.log(4.0) + 1.0)
    assert torch.equal(f1[0], f0[0])
    assert torch.allclose(f1[-1], f0[-1] / 4)
    table = RotaryEmbedding(16, 8, yarn.theta, yarn)
    assert table.cos[0, 0].item() == pytest.approx(s1)       # cos(0) = 1, times the attention factor


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "su"])
def test_other_rope_types_are_one_line_config_errors(rope_type):
    with pytest.raises(ConfigError) as exc:
        RopeScaling.from_hf(_cfg({"rope_scaling": {"rope_type": rope_type, "factor": 2.0}}))
    msg = str(exc.value)
    assert repr(rope_type) in msg and "\n" not in msg


def test_read_model_dir_refuses_before_weights_load(tiny_model_dir, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    (model / "model.safetensors").unlink()                   # no weights at all: the refusal comes first
    cfg = json.loads((model / "config.json").read_text())
    cfg["rope_scaling"] = {"type": "dynamic", "factor": 2.0}
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="'dynamic'"):
        read_model_dir(model)


@pytest.fixture(scope="module")
def dynamic_model(tmp_path_factory):
    from labkit.assets.synth import synth_model

    return synth_model("tiny", tmp_path_factory.mktemp("dyn") / "m", rope_scaling="dynamic:2")


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi", "--max-tokens", "2"],
                                     ["serve", "--port", "0"]])
def test_generate_and_serve_refuse_an_unsupported_type_in_one_line(dynamic_model, command):
    proc = labkit_process(*command, "--model", str(dynamic_model), "--device", "cpu")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("error:")]
    assert errors == ["error: rope scaling type 'dynamic' in config.json is not supported "
                      "(supported: default, linear, yarn, llama3)"]
    assert "Traceback" not in proc.stdout + proc.stderr


def test_synth_writes_the_block(tiny_model_dir, tmp_path):
    from labkit.assets.synth import synth_model

    path = synth_model("tiny", tmp_path / "y", rope_scaling="yarn:4")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0,
                                   "original_max_position_embeddings": cfg["max_position_embeddings"] // 4}
    assert (path / "model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()


@pytest.mark.parametrize("spec", ["yarn", "yarn:1", "yarn:x", "longrope:4", "linear:inf"])
def test_bad_specs_are_user_errors(spec):
    from labkit.assets.rope import parse_rope_spec
    from labkit.errors import UserError

    with pytest.raises(UserError):
        parse_rope_spec(spec)


@pytest.fixture(scope="module")
def rope_guards(tiny_model_dir, tmp_path_factory):
    """Each models.rope-* checkpoint's own command, in-process on the tiny model."""
    from testkit import checkpoint_command
    from labkit.guardrails.calibrate import guard

    out = {}
    for kind, spec in (("yarn", "yarn:4"), ("linear", "linear:2")):
        runs = tmp_path_factory.mktemp(f"rope-{kind}")
        with checkpoint_command(f"models.rope-{kind}"):
            out[kind] = guard("baseline", runs / f"models-rope-{kind}.json", model=str(tiny_model_dir),
                              device="cpu", attention="torch", dtype="float32", rope_scaling=spec)
    return out


@pytest.mark.parametrize("kind", ["yarn", "linear"])
def test_the_rope_checkpoints_pass_against_transformers(rope_guards, kind):
    from labkit.checks import check_evidence, get_checkpoint

    record = rope_guards[kind]
    assert record["checkpoint"] == f"models.rope-{kind}"
    assert record["verdict"] == "PASS", record["checks"]
    assert record["facts"]["rope"]["lhs"]["rope_type"] == kind == record["facts"]["rope"]["rhs"]["rope_type"]
    assert check_evidence(get_checkpoint(f"models.rope-{kind}"), record["_paths"]["json"])[0] == "PASS"


@pytest.mark.parametrize("kind", ["yarn", "linear"])
def test_the_scaling_moves_the_logits_far_beyond_the_threshold(rope_guards, tiny_model_dir, tmp_path, kind):
    """The reference with the scaling against the reference without it, on the baseline suite's rows: what an
    engine that ignored the scaling would be off by. It must dwarf the cpu/float32 logits threshold."""
    from labkit.checks import load_thresholds
    from labkit.guardrails.collect import collect_hf

    plain = collect_hf("baseline", tmp_path / "plain-hf", model=str(tiny_model_dir), device="cpu", dtype="float32")
    scaled_npz = rope_guards[kind]["facts"]["rhs"]["prefix"] + ".npz"
    a = np.load(plain["_paths"]["npz"])["logits"].astype(np.float64)
    b = np.load(scaled_npz)["logits"].astype(np.float64)
    threshold = load_thresholds()["logits"]["entries"]["cpu/float32"]["max_abs"]
    worst = float(np.max(np.abs(a - b)))
    assert worst > 1000 * threshold, (kind, worst, threshold)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_cuda_kernel_reads_the_same_scaled_tables(dtype):
    """The fused q/k-norm + RoPE kernel against the torch path, both on yarn tables (attention factor baked in)."""
    from engine.layers.fused_kernels import qk_norm_rope
    from engine.layers.layernorm import RMSNorm

    hq, hk, d, t = 16, 8, 128, 37
    cfg = {**BASE, "head_dim": d, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 10240}}
    rope = RopeScaling.from_hf(cfg)
    torch.manual_seed(0)
    with torch.device("cuda"):
        table = RotaryEmbedding(d, 40960, rope.theta, rope)
        assert table.attention_scaling > 1
        qn, kn = RMSNorm(d).to(dtype), RMSNorm(d).to(dtype)
        qn.weight.data.fill_(2.0)
        qkv = torch.randn(t, (hq + 2 * hk) * d, dtype=dtype)
        pos = torch.randint(0, 40000, (t,))
        q, k, _ = qkv.split([hq * d, hk * d, hk * d], -1)
        rq, rk = table(pos, qn(q.reshape(t, hq, d)), kn(k.reshape(t, hk, d)))
        fq, fk = qk_norm_rope(qkv, pos, qn.weight, kn.weight, table.cos, table.sin, hq, hk, d, qn.eps)
    close = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fq, rq, **close)
    torch.testing.assert_close(fk, rk, **close)
