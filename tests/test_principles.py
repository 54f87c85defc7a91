"""principles cached-forward (handbook B.1.6) on the tiny model: counts, errors, timings, checkpoint."""
import json

import pytest
from typer.testing import CliRunner

from labkit.checks import check_evidence, get_checkpoint
from labkit.guardrails.cached_forward import expected_counts, run_cached_forward


@pytest.fixture(scope="module")
def app(cli_app):
    return cli_app


@pytest.fixture
def seen_widths(monkeypatch):
    """The input widths the reference model really received, in call order (a forward pre-hook), so a
    test compares the widths the command reports with what was fed, not with its own loop counters."""
    import labkit.guardrails.collect as collect

    widths: list[int] = []
    load = collect.load_reference_model

    def loading(*args, **kwargs):
        model = load(*args, **kwargs)
        model.register_forward_pre_hook(lambda _m, _a, kw: widths.append(int(kw["input_ids"].shape[1])),
                                        with_kwargs=True)
        return model

    monkeypatch.setattr(collect, "load_reference_model", loading)
    return widths


@pytest.mark.parametrize("s,g,uncached,cached", [(64, 8, 540, 71), (128, 8, 1052, 135), (64, 1, 64, 64), (5, 3, 18, 7)])
def test_expected_counts(s, g, uncached, cached):
    exp = expected_counts(s, g)
    assert exp["positions_uncached"] == uncached == sum(exp["widths_uncached"])
    assert exp["positions_cached"] == cached == sum(exp["widths_cached"])
    assert exp["widths_uncached"][0] == s and exp["widths_cached"][1:] == [1] * (g - 1)


def test_default_run_is_540_vs_71_and_passes_its_checkpoint(tiny_model_dir, tmp_path, app, seen_widths):
    out = tmp_path / "cached-forward.json"
    command = get_checkpoint("guardrails.cached-forward").command[1:]      # the checkpoint's command and options
    res = CliRunner().invoke(app, [*command, "--model", str(tiny_model_dir), "--device", "cpu", "--out", str(out)])
    assert res.exit_code == 0, res.output
    rec = json.loads(out.read_text())
    f = rec["facts"]
    assert rec["checkpoint"] == "guardrails.cached-forward" and rec["verdict"] == "PASS"
    # the checkpoint's repeats, each 8 uncached then 8 cached forwards; the model saw exactly the reported widths
    assert seen_widths == (list(range(64, 72)) + [64] + [1] * 7) * int(command[command.index("--repeats") + 1])
    assert f["widths_uncached"] == seen_widths[:8] and sum(seen_widths[:8]) == f["positions_uncached"] == 540
    assert f["widths_cached"] == seen_widths[8:16] and sum(seen_widths[8:16]) == f["positions_cached"] == 71
    assert f["max_abs_logit_error"] < 1e-4 and f["relative_l2_logit_error"] < 1e-5 and f["same_top1_steps"] == 8
    tm = f["timing"]
    assert len(tm["cached"]["prefill_s"]) == 3 and len(tm["cached"]["decode_s"]) == 3
    assert len(tm["uncached"]["median_step_s"]) == 8
    assert check_evidence(get_checkpoint("guardrails.cached-forward"), out)[0] == "PASS"


def test_other_lengths_recompute_the_expected_counts(tiny_model_dir, tmp_path, seen_widths):
    rec = run_cached_forward(tmp_path / "cf.json", model=str(tiny_model_dir), device="cpu", prompt_len=20, steps=4)
    f = rec["facts"]
    assert rec["checkpoint"] is None and rec["verdict"] == "PASS"        # the 64/8 checkpoint does not apply
    assert seen_widths == [20, 21, 22, 23, 20, 1, 1, 1]
    assert f["widths_uncached"] == seen_widths[:4] and f["positions_uncached"] == 86
    assert f["widths_cached"] == seen_widths[4:] and f["positions_cached"] == 23 and f["counts_match"]
    assert f["max_abs_logit_error"] < 1e-4 and f["same_top1_steps"] == 4


@pytest.mark.parametrize("args,message", [
    (["--prompt-len", "0"], "--prompt-len must be a positive integer"),
    (["--steps", "0"], "--steps must be a positive integer"),
    (["--dtype", "fp8"], "unknown dtype 'fp8'"),
    (["--model", "/nonexistent/model"], "/nonexistent/model"),
])
def test_user_errors(app, tmp_path, tiny_model_dir, args, message):
    res = CliRunner().invoke(app, ["principles", "cached-forward", "--device", "cpu", "--out", str(tmp_path / "x.json"),
                                   *([] if "--model" in args else ["--model", str(tiny_model_dir)]), *args])
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.split()) and "Traceback" not in res.output
