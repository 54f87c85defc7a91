"""principles residual: layer 0's residual path recomputed by hand from its own modules equals the engine's
layer (tiny model, CPU, float32: exactly), judged by principles.residual."""
from __future__ import annotations

from labkit.checks import check_evidence, get_checkpoint
from labkit.experiments.residual import residual_sites, run_residual


def _failed(record: dict) -> set[str]:
    return {c["name"] for c in record["checks"] if not c["passed"]}


def test_residual_path_by_hand_equals_the_engine(tiny_model_dir, tmp_path, labkit_argv):
    out = tmp_path / "residual.json"
    labkit_argv.checkpoint("principles.residual", "--out", str(out))
    rec = run_residual(out, str(tiny_model_dir), "cpu", "torch")
    assert rec["checkpoint"] == "principles.residual" and rec["verdict"] == "PASS", _failed(rec)
    assert check_evidence(get_checkpoint("principles.residual"), out)[0] == "PASS"
    f = rec["facts"]
    assert f["T_per_step"] == [16, 1] and f["next_norm"] == "model.layers.1.input_layernorm"
    assert f["worst"] == {"h_rel_diff": 0.0, "mlp_rel_diff": 0.0, "y_rel_diff": 0.0}     # float32, same ops
    assert all(s["layer_input_residual"] is None and s["h"] == s["x"] for s in f["steps"])


def test_sites_point_at_the_norms_add():
    sites = residual_sites()
    assert sites["norm_add"]["source"].startswith("x = x + residual")
    assert sites["mlp_residual"]["source"] == "x, residual = self.post_attention_layernorm(x, residual)"


def test_a_norm_that_drops_the_residual_add_fails(tiny_model_dir, tmp_path, labkit_argv, monkeypatch):
    """Break the engine on purpose: RMSNorm(x, residual) normalizes x but hands the residual back unchanged."""
    from engine.layers.layernorm import RMSNorm

    def no_add(self, x, residual=None):
        return self._norm(x) if residual is None else (self._norm(x), residual)

    monkeypatch.setattr(RMSNorm, "forward", no_add)
    labkit_argv.checkpoint("principles.residual")
    rec = run_residual(tmp_path / "r.json", str(tiny_model_dir), "cpu", "torch")
    assert rec["verdict"] == "FAIL"
    assert {"facts.worst.h_rel_diff", "facts.worst.y_rel_diff"} <= _failed(rec)
