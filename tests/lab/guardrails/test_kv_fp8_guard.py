"""The FP8 KV cache guard (``labkit logits guard --kv-cache-dtype fp8``) on the CPU: the baseline suite's teacher-forced
logits with the e4m3 cache against the same engine with its float32 cache, on the tiny model with the tame init,
within the kv-fp8 threshold table's cpu/float32 entry (checkpoints/guardrails.json); the checkpoint itself is the
CUDA bfloat16 run (guardrails.kv-fp8)."""
from __future__ import annotations

import pytest

from engine.attention import kv_quant
from labkit.errors import UserError


@pytest.fixture(scope="module")
def tame_tiny(tmp_path_factory):
    """The tiny preset with the tame init (a seeded bigram language: logits with margins, as qwen3-0.6b's)."""
    from labkit.assets.synth import synth_model

    return synth_model("tiny", tmp_path_factory.mktemp("tiny-tame") / "m", seed=0, init="tame")


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_fp8_guard_on_the_tiny_model_within_its_cpu_thresholds(tame_tiny, tmp_path, monkeypatch, scale):
    """The FP8 guard (labkit logits guard --kv-cache-dtype fp8) on the CPU: teacher-forced logits of the baseline
    suite with the e4m3 cache against the float32 cache, within the kv-fp8 table's cpu/float32 entry; at a scale of
    0.25 as well (the engine's is fixed at 1.0), so that a read or write that drops the scale fails here too."""
    from labkit.guardrails.calibrate import guard

    monkeypatch.setattr(kv_quant, "DEFAULT_SCALE", scale)
    record = guard("baseline", tmp_path / "kv.json", model=str(tame_tiny), device="cpu", attention="torch",
                   dtype="float32", kv_cache_dtype="fp8")
    f = record["facts"]
    assert f["kv_cache_dtype"] == {"lhs": "fp8", "rhs": "auto"} and f["thresholds"]["key"] == "cpu/float32"
    assert f["thresholds"]["source"].startswith("table kv-fp8 cpu/float32"), f["thresholds"]
    assert f["num_rows"] == 15 and f["trajectory_match"]
    assert f["worst_max_abs"] <= f["thresholds"]["max_abs"] and f["worst_rel_l2"] <= f["thresholds"]["rel_l2"], f
    assert f["top1_flips"] == 0, f
    assert record["verdict"] == "PASS", record.get("assertions")
    assert f["lhs"]["kv_cache_dtype"] == "fp8" and f["rhs"]["kv_cache_dtype"] == "auto"


@pytest.mark.parametrize("kw, message", [
    (dict(suite="graph"), "--kv-cache-dtype fp8 applies to the baseline suite"),
    (dict(tp=2), "--kv-cache-dtype fp8 takes no --tp or --rope-scaling"),
    (dict(kv_cache_dtype="fp16"), "--kv-cache-dtype must be auto or fp8, got 'fp16'"),
])
def test_fp8_guard_refusals(tmp_path, kw, message):
    from labkit.guardrails.calibrate import guard

    args = dict(suite="baseline", kv_cache_dtype="fp8") | kw
    suite = args.pop("suite")
    with pytest.raises(UserError) as e:
        guard(suite, tmp_path / "x.json", device="cpu", **args)
    assert str(e.value).startswith(message), str(e.value)
