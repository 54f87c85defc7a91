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
    assert rec["kind"] == "reference"                 # transformers made both paths, not our engine
    assert f["thresholds"]["key"] == "cpu/float32" and f["thresholds"]["source"] == "table logits cpu/float32"
    assert f["inputs_follow_trajectory"] and f["positions_follow"] and f["top1_flips"] == 0
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


@pytest.fixture
def fault(monkeypatch):
    """``fault(fn)``: the reference model gets a forward pre-hook (before any measuring hook) that may rewrite
    a call's keyword arguments: a broken caller, as the model receives it."""
    import labkit.guardrails.collect as collect

    load = collect.load_reference_model

    def install(fn):
        def loading(*args, **kwargs):
            model = load(*args, **kwargs)
            model.register_forward_pre_hook(lambda _m, a, kw: (a, fn(dict(kw))), with_kwargs=True)
            return model

        monkeypatch.setattr(collect, "load_reference_model", loading)

    return install


def _failed(rec):
    return {c["name"]: c["status"] for c in rec["checks"] if c["status"] != "pass"}


def test_off_by_one_decode_positions_fail_on_the_thresholds(tiny_model_dir, tmp_path, fault):
    def shift(kw):
        if kw.get("use_cache") and kw["input_ids"].shape[1] == 1:
            kw["position_ids"] = kw["position_ids"] + 1          # the classic cached-decode position bug
        return kw

    fault(shift)
    rec = run_cached_forward(tmp_path / "cf.json", model=str(tiny_model_dir), device="cpu", dtype="float32")
    failed = _failed(rec)
    assert rec["verdict"] == "FAIL" and rec["facts"]["positions_follow"] is False
    assert failed["cached vs uncached max_abs"] == "fail" and failed["cached vs uncached rel_l2"] == "fail"
    assert rec["facts"]["max_abs_logit_error"] > rec["facts"]["thresholds"]["max_abs"]


def test_a_top1_flip_fails_not_review(tiny_model_dir, tmp_path, fault):
    def other_token(kw):
        if kw.get("use_cache") and kw["input_ids"].shape[1] == 1:
            kw["input_ids"] = (kw["input_ids"] + 1) % 1000          # the cached path is fed the wrong ids
        return kw

    fault(other_token)
    rec = run_cached_forward(tmp_path / "cf.json", model=str(tiny_model_dir), device="cpu", dtype="float32")
    failed = _failed(rec)
    assert rec["verdict"] == "FAIL" and rec["facts"]["top1_flips"] > 0
    assert failed["same top-1 on every step"] == "fail"                       # FAIL, not review
    assert failed["inputs follow the trajectory"] == "fail"                   # measured from what the model got


def test_other_options_are_evidence_for_no_checkpoint(tiny_model_dir, tmp_path, app, monkeypatch):
    monkeypatch.setenv("LABKIT_RUNS_DIR", str(tmp_path / "runs"))
    res = CliRunner().invoke(app, ["principles", "cached-forward", "--prompt-len", "64", "--steps", "8", "--repeats", "1",
                                   "--dtype", "float32",
                                   "--model", str(tiny_model_dir), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    rec = json.loads((tmp_path / "runs" / "cached-forward-s64-g8.json").read_text())
    assert rec["checkpoint"] is None and rec["verdict"] == "PASS"
    assert rec["facts"]["checkpoint_not_claimed"]["why"] == "--repeats 1, not --repeats 3"
    assert not (tmp_path / "runs" / "cached-forward.json").exists()
    assert "note: not evidence for guardrails.cached-forward" in " ".join(res.output.split())
