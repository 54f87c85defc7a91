"""principles shapes: real weights loaded through the engine's TP layers, reassembled exactly (CPU, no processes)."""
from __future__ import annotations

import pytest

from labkit.checks import get_checkpoint, judge
from labkit.experiments.tp_shapes import run_shapes, tp_shapes

REASSEMBLY = [f"facts.reassembly_max_abs_diff.{n}" for n in
              ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "o_proj", "down_proj")]


def _judged(facts: dict) -> dict:
    from labkit.evidence_format import SCHEMA_VERSION
    record = {"checkpoint": "tp.shapes", "kind": "static", "schema_version": SCHEMA_VERSION, "facts": facts}
    return {c["name"]: c for c in judge(get_checkpoint("tp.shapes"), record)}


def test_tiny_model_splits_and_reassembles_exactly(tiny_model_dir):
    f = tp_shapes(tiny_model_dir, 2)          # tiny: 4 q heads, 2 kv heads, head_dim 16, hidden 64, 2 layers
    assert f["layers_checked"] == 2 and f["load_errors"] == []
    assert f["reassembly_worst_max_abs_diff"] == 0.0 and set(f["reassembly_exact_layers"].values()) == {2}
    r0, r1 = f["ranks"]
    assert (r0["q_heads"], r0["kv_heads"]) == (2, 1)
    assert r0["qkv_proj_weight"] == [2 * 16 + 2 * 16, 64] and r1["down_proj_weight"] == [64, 64]
    assert r1["rows_of_tp1_packed_qkv"] == {"q": [32, 64], "k": [80, 96], "v": [112, 128]}
    assert r0["rows_of_tp1_packed_qkv"] == {"q": [0, 32], "k": [64, 80], "v": [96, 112]}
    assert f["collectives_per_forward"]["all_reduce"] == 2 * 2 + 1
    assert f["collectives_per_forward"]["all_gather"] == 1
    checks = _judged(f)
    assert all(checks[name]["passed"] for name in REASSEMBLY)


def test_run_shapes_with_a_model_writes_evidence(tiny_model_dir, tmp_path):
    rec = run_shapes(2, str(tiny_model_dir), tmp_path / "s.json")
    assert rec["kind"] == "static" and rec["model"]["synthetic"] and rec["checkpoint"] == "tp.shapes"
    # the checkpoint states Qwen3-0.6B's numbers: the tiny model's shapes FAIL it, its reassembly does not
    failed = {c["name"] for c in rec["checks"] if not c["passed"]}
    assert rec["verdict"] == "FAIL" and "facts.ranks.0.q_heads" in failed and not failed & set(REASSEMBLY)


def _wrong_offset_column(self, param, loaded, shard_id=None):
    """A column loader that forgets the rank offset: every rank takes rank 0's rows."""
    offset, size = self.shard_range(shard_id)
    param.data.narrow(0, offset, size).copy_(loaded.narrow(0, 0, size))


def _wrong_offset_row(self, param, loaded, shard_id=None):
    size = param.shape[1]
    param.data.copy_(loaded.narrow(1, 0, size))


@pytest.mark.parametrize("cls,loader,broken", [
    ("QKVParallelLinear", _wrong_offset_column, {"q_proj", "k_proj", "v_proj"}),
    ("RowParallelLinear", _wrong_offset_row, {"o_proj", "down_proj"}),
])
def test_a_loader_that_ignores_the_rank_fails_the_reassembly(tiny_model_dir, monkeypatch, cls, loader, broken):
    import engine.layers.linear as linear

    monkeypatch.setattr(getattr(linear, cls), "weight_loader", loader)
    f = tp_shapes(tiny_model_dir, 2)
    bad = {n for n, d in f["reassembly_max_abs_diff"].items() if d > 0}
    assert bad == broken
    checks = _judged(f)
    assert {name.rsplit(".", 1)[1] for name in REASSEMBLY if not checks[name]["passed"]} == broken


def _judged_tp1(facts: dict) -> dict:
    from labkit.evidence_format import SCHEMA_VERSION
    record = {"checkpoint": "tp.shapes-tp1", "kind": "static", "schema_version": SCHEMA_VERSION, "facts": facts}
    return {c["name"]: c for c in judge(get_checkpoint("tp.shapes-tp1"), record)}


ROWS_TP1 = ("facts.qkv_rows_tp1.measured_matches_config", "facts.qkv_rows_tp1.loader_matches_config")


def test_tp1_qkv_rows_measured_from_the_loaded_weight(tiny_model_dir):
    f = tp_shapes(tiny_model_dir, 1)          # tiny: q = 4 x 16 = 64 rows, k = v = 2 x 16 = 32 rows
    rows = f["qkv_rows_tp1"]
    assert rows["widths"] == {"q": 64, "k": 32, "v": 32, "total": 128} and rows["packed_rows"] == 128
    assert rows["measured"] == rows["from_config"] == rows["from_loader"] == {"q": [0, 64], "k": [64, 96], "v": [96, 128]}
    checks = _judged_tp1(f)
    assert all(checks[name]["passed"] for name in ROWS_TP1)
    # the checkpoint states Qwen3-0.6B's rows: the tiny model's FAIL it
    assert not checks["facts.qkv_rows_tp1.measured.q"]["passed"]


def test_tp1_a_loader_that_swaps_k_and_v_fails(tiny_model_dir, monkeypatch):
    """Break on purpose: shard_range hands K the V rows and V the K rows; the loader writes them there."""
    import engine.layers.linear as linear

    real = linear.QKVParallelLinear.shard_range
    swap = {"q": "q", "k": "v", "v": "k"}
    monkeypatch.setattr(linear.QKVParallelLinear, "shard_range", lambda self, n: real(self, swap[n]))
    f = tp_shapes(tiny_model_dir, 1)
    assert f["qkv_rows_tp1"]["measured"] == {"q": [0, 64], "k": [96, 128], "v": [64, 96]}
    checks = _judged_tp1(f)
    assert not any(checks[name]["passed"] for name in ROWS_TP1)


def test_run_shapes_tp1_claims_its_checkpoint(tiny_model_dir, tmp_path):
    rec = run_shapes(1, str(tiny_model_dir), tmp_path / "s1.json")
    assert rec["checkpoint"] == "tp.shapes-tp1"
    failed = {c["name"] for c in rec["checks"] if not c["passed"]}
    assert "facts.ranks.0.q_heads" in failed and not failed & set(ROWS_TP1)
