"""quick-walk --shapes (cases A and D): model-internal shapes per step against the model's config, and the
rows the LM head read, judged by setup.quick-walk-a-shapes and setup.quick-walk-d-shapes (tiny model, CPU)."""
from __future__ import annotations

import pytest

from labkit.checks import check_evidence, get_checkpoint
from labkit.experiments.quick_walk import run_quick_walk


def _failed(record: dict) -> set[str]:
    return {c["name"] for c in record["checks"] if not c["passed"]}


@pytest.mark.parametrize("case,cp", [("A", "setup.quick-walk-a-shapes"), ("D", "setup.quick-walk-d-shapes")])
def test_shapes_walk_passes_its_checkpoint(tiny_model_dir, tmp_path, labkit_argv, case, cp):
    out = tmp_path / f"{case}.json"
    labkit_argv.checkpoint(cp, "--out", str(out))
    rec = run_quick_walk(case, out=out, model=str(tiny_model_dir), shapes=True)
    assert rec["checkpoint"] == cp and rec["verdict"] == "PASS", _failed(rec)
    assert check_evidence(get_checkpoint(cp), out)[0] == "PASS"
    sh = rec["facts"]["shapes"]
    m = sh["model"]                       # the tiny model's widths, read from its config
    assert (m["hidden"], m["q_heads"], m["kv_heads"], m["head_dim"], m["layers"]) == (64, 4, 2, 16, 2)
    first = sh["steps"][0]
    t = first["T"]
    assert first["embed"] == [t, 64] and first["layer0"] == {"q": [t, 4, 16], "k": [t, 2, 16], "v": [t, 2, 16]}


def test_a_shapes_per_step(tiny_model_dir, tmp_path):
    sh = run_quick_walk("A", out=tmp_path / "a.json", model=str(tiny_model_dir), shapes=True)["facts"]["shapes"]
    assert sh["T_per_step"] == [3, 1, 1] and sh["layers_hooked"] == 2
    assert [s["embed"] for s in sh["steps"]] == [[3, 64], [1, 64], [1, 64]]
    assert [s["logits"][0] for s in sh["steps"]] == [1, 1, 1]


def test_shapes_off_by_default(tiny_model_dir, tmp_path):
    rec = run_quick_walk("A", out=tmp_path / "a.json", model=str(tiny_model_dir))
    assert "shapes" not in rec["facts"]


def _wrong_last_rows(self, inputs, route=None):
    """Break on purpose: a prefill hands the LM head the row before each sequence's last position."""
    import torch

    with torch.inference_mode():
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        if inputs.is_prefill:
            hidden = hidden[inputs.meta.cu_seqlens_q[1:].long() - 2]
        return self.model.compute_logits(hidden)


def test_d_fails_when_the_lm_head_reads_the_wrong_rows(tiny_model_dir, tmp_path, labkit_argv, monkeypatch):
    import engine.model_runner as runner

    monkeypatch.setattr(runner.ModelRunner, "run_model", _wrong_last_rows)
    labkit_argv.checkpoint("setup.quick-walk-d-shapes")
    rec = run_quick_walk("D", out=tmp_path / "d.json", model=str(tiny_model_dir), shapes=True)
    assert rec["facts"]["shapes"]["steps"][1]["lm_head_rows"] == [186, 218]
    assert rec["verdict"] == "FAIL"
    assert {"facts.shapes.steps.1.lm_head_rows", "facts.shapes.lm_head_rows_follow_rule"} <= _failed(rec)


def test_a_fails_when_the_config_widths_disagree_with_the_shapes(tiny_model_dir, tmp_path, labkit_argv, monkeypatch):
    """Break on purpose: judge against kv heads read as the q head count (a GQA model taken for MHA)."""
    import labkit.experiments.walk_shapes as ws

    real = ws.model_dims
    monkeypatch.setattr(ws, "model_dims", lambda shape: {**real(shape), "kv_heads": shape.num_heads})
    labkit_argv.checkpoint("setup.quick-walk-a-shapes")
    rec = run_quick_walk("A", out=tmp_path / "a.json", model=str(tiny_model_dir), shapes=True)
    bad = rec["facts"]["shapes"]["mismatches"]
    assert {m["what"] for m in bad} == {f"layer {i} {k}" for i in (0, 1) for k in "kv"}
    assert {"facts.shapes.shapes_match_config", "facts.shapes.mismatches"} <= _failed(rec)


def test_a_fails_when_the_prompt_is_not_three_tokens(tiny_model_dir, tmp_path, labkit_argv, monkeypatch):
    """Break the data on purpose: case A with a 4-token prompt gives T = 4, 1, 1."""
    import labkit.experiments.quick_walk as qw
    from labkit.cases import Case

    monkeypatch.setitem(qw.CASES, "A", Case("four tokens", (tuple(range(9000, 9004)),), (3,), ("A",)))
    labkit_argv.checkpoint("setup.quick-walk-a-shapes")
    rec = run_quick_walk("A", out=tmp_path / "a.json", model=str(tiny_model_dir), shapes=True)
    assert rec["facts"]["shapes"]["T_per_step"] == [4, 1, 1] and rec["facts"]["shapes"]["shapes_match_config"]
    assert {"facts.shapes.T_per_step", "facts.shapes.lm_head_rows_per_step"} <= _failed(rec)


def test_shapes_for_b_claims_no_checkpoint(tiny_model_dir, tmp_path):
    rec = run_quick_walk("B", out=tmp_path / "b.json", model=str(tiny_model_dir), shapes=True)
    assert rec["checkpoint"] is None and rec["facts"]["shapes"]["shapes_match_config"]


def test_cli_case_a_shapes_prints_the_shapes_table(cli_app, tiny_model_dir, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    monkeypatch.setenv("LABKIT_RUNS_DIR", str(tmp_path / "runs"))
    res = CliRunner().invoke(cli_app, ["quick-walk", "--case", "A", "--shapes", "--model", str(tiny_model_dir),
                                       "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert "model shapes per step" in res.output and "3x4x16" in res.output
    assert (tmp_path / "runs" / "quick-walk-a-shapes.json").exists()
