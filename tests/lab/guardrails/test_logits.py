"""logits collect / compare / guard on the tiny model (CPU, float32), and their error paths.

The numbers: baseline = 15 rows (A 3, B 2+5, C 3, D 1+1; the chunk candidate of D is discarded),
graph = 126 rows (1+9+16+17+20 requests, prefill + one decode each); both implementations in float32
agree to ~1e-6, far inside the handbook's 0.5 / 0.02 starting thresholds.
"""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from labkit.checks import check_evidence, get_checkpoint
from labkit.errors import UserError
from labkit.guardrails.calibrate import calibrate
from labkit.guardrails.collect import collect, expected_route
from labkit.guardrails.compare import compare, judge_rows
from labkit.guardrails.suites import build_suite, trajectory_sha256
from labkit.cli.app import EXIT_CODES

pytestmark = pytest.mark.usefixtures("one_tokenizer")     # tests/conftest.py: one tokenizer per model directory


@pytest.fixture(scope="module")
def app(cli_app):
    return cli_app


def run_cli(app, *args):
    return CliRunner().invoke(app, [str(x) for x in args])


@pytest.fixture(scope="module")
def baseline(tiny_model_dir, tmp_path_factory, app):
    """`labkit logits guard --suite baseline`: nano eager + hf collected, then compared."""
    d = tmp_path_factory.mktemp("baseline")
    command = get_checkpoint("guardrails.logits-baseline").command[1:]  # the checkpoint's command and options
    res = run_cli(app, *command, "--model", tiny_model_dir, "--device", "cpu", "--out", d / "engine-logits-check.json")
    assert res.exit_code == 0, res.output
    return d


@pytest.fixture(scope="module")
def graph(tiny_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("graph")
    nano = collect("nano", "graph", d / "nano", model=str(tiny_model_dir), device="cpu", execution="eager")
    hf = collect("hf", "graph", d / "hf", model=str(tiny_model_dir), device="cpu")
    return d, nano, hf


def copy_collection(src, dst):
    for ext in (".json", ".npz"):
        shutil.copy(f"{src}{ext}", f"{dst}{ext}")
    return dst


def rewrite_npz(prefix, **changes):
    path = f"{prefix}.npz"
    with np.load(path) as z:
        arrays = {k: z[k].copy() for k in z.files}
    for key, fn in changes.items():
        fn(arrays[key])
    np.savez(path, **arrays)


# --------------------------------------------------------------------------- suites


def test_suites_have_the_handbook_row_counts():
    base = build_suite("baseline")
    assert base.expected_rows == 15 and len(base.rows()) == 15
    assert [len(g.requests) for g in base.groups] == [1, 2, 1, 2]
    assert [r.max_tokens for g in base.groups for r in g.requests] == [3, 2, 5, 3, 1, 1]
    assert [len(r.prompt) for r in base.groups[3].requests] == [700, 32]
    graph = build_suite("graph")
    assert [len(g.requests) for g in graph.groups] == [1, 9, 16, 17, 20] and graph.expected_rows == 126
    for g in graph.groups:
        lengths = [len(r.prompt) for r in g.requests]
        assert len(set(lengths)) == len(lengths)               # different lengths inside a batch
    # the trajectory is a function of the seed only
    assert trajectory_sha256(build_suite("graph").rows()) == trajectory_sha256(graph.rows())
    assert trajectory_sha256(build_suite("graph", seed=1).rows()) != trajectory_sha256(graph.rows())


def test_expected_route_picks_the_smallest_covering_bucket_else_eager():
    b = [1, 2, 4, 8, 16]
    assert expected_route("graph", "decode", 9, b) == ("graph", 16)
    assert expected_route("graph", "decode", 17, b) == ("eager", None)
    assert expected_route("graph", "prefill", 1, b) == ("eager", None)
    assert expected_route("eager", "decode", 1, b) == ("eager", None)
    # prefill graphs: a fresh prefill of at most prefill_seqs sequences takes the smallest covering token bucket
    pg = dict(prefill_buckets=[16, 32, 64], prefill_seqs=4)
    assert expected_route("graph", "prefill", 2, b, tokens=40, fresh=True, **pg) == ("prefill-graph", 64)
    assert expected_route("graph", "prefill", 1, b, tokens=16, fresh=True, **pg) == ("prefill-graph", 16)
    assert expected_route("graph", "prefill", 2, b, tokens=40, fresh=False, **pg) == ("eager", None)   # reads a prefix
    assert expected_route("graph", "prefill", 5, b, tokens=40, fresh=True, **pg) == ("eager", None)    # too many seqs
    assert expected_route("graph", "prefill", 1, b, tokens=65, fresh=True, **pg) == ("eager", None)    # too many tokens
    assert expected_route("eager", "prefill", 1, b, tokens=16, fresh=True, **pg) == ("eager", None)
    # piecewise graphs: any other prefill of at most the largest token bucket whose rows hold its sequences
    pw = dict(pg, piecewise_buckets=[16, 32, 64], piecewise_seqs=4)
    assert expected_route("graph", "prefill", 2, b, tokens=40, fresh=False, **pw) == ("piecewise", 64)
    assert expected_route("graph", "prefill", 5, b, tokens=40, fresh=True, **pw) == ("eager", None)     # 5 > 4 rows
    # paged prefill graphs: a prefix-reading prefill without decode rows takes a prefill bucket, a mixed step not
    pp = dict(pw, paged_prefill=True)
    assert expected_route("graph", "prefill", 2, b, tokens=40, fresh=False, **pp) == ("paged-prefill-graph", 64)
    assert expected_route("graph", "prefill", 2, b, tokens=40, fresh=False, decodes=1, **pp) == ("piecewise", 64)
    assert expected_route("graph", "prefill", 5, b, tokens=40, fresh=False, **pp) == ("eager", None)
    assert expected_route("graph", "prefill", 3, b, tokens=3, fresh=False, **pw) == ("piecewise", 16)
    assert expected_route("graph", "prefill", 1, b, tokens=65, fresh=False, **pw) == ("eager", None)
    assert expected_route("graph", "prefill", 2, b, tokens=40, fresh=True, **pw) == ("prefill-graph", 64)


# --------------------------------------------------------------------------- baseline


def test_baseline_guard_collects_both_sides_and_passes(baseline):
    rec = json.loads((baseline / "engine-logits-check.json").read_text())
    f = rec["facts"]
    assert rec["verdict"] == "PASS" and rec["checkpoint"] == "guardrails.logits-baseline"
    assert rec["kind"] == "cpu-real-engine"
    assert f["num_rows"] == 15 and f["top1_agree"] == 15 and f["first_divergent_row"] is None
    assert f["worst_max_abs"] < 1e-4 and f["worst_rel_l2"] < 1e-5
    assert len(f["worst_rows"]) == 5
    assert check_evidence(get_checkpoint("guardrails.logits-baseline"), baseline / "engine-logits-check.json")[0] == "PASS"

    nano = json.loads((baseline / "engine-nano.json").read_text())
    nf = nano["facts"]
    assert nano["verdict"] == "PASS" and nf["status"] == "COLLECTED" and nf["rows_follow_trajectory"]
    assert nano["engine_source_hash"] and nano["engine_import_path"]
    assert nano["model"]["config_sha256"] and nano["model"]["weights_sha256"]
    assert [r["id"] for r in nf["rows"]][:5] == ["A/A/0", "A/A/1", "A/A/2", "B/R1/0", "B/R1/1"]
    assert [r["length"] for r in nf["rows"] if r["group"] == "C"] == [256, 257, 258]
    # case D: the first prefill round is a chunk of A, its candidate discarded; then both complete
    d_steps = [s for s in nf["steps"] if s["group"] == "D"]
    assert [s["discarded"] for s in d_steps] == [["A"], []] and [s["batch"] for s in d_steps] == [1, 2]
    assert all(s["route"] == "eager" and s["route_as_expected"] for s in nf["steps"])
    with np.load(baseline / "engine-nano.npz") as z:
        assert z["logits"].shape == (15, 151936) and z["logits"].dtype == np.float32
    hf = json.loads((baseline / "engine-hf.json").read_text())
    assert hf["facts"]["trajectory_sha256"] == nf["trajectory_sha256"]
    assert hf["engine"]["implementation"] == "transformers" and hf["engine"]["use_cache"] is False


def test_a_corrupted_npz_row_fails_and_is_named(baseline, tmp_path, app):
    bad = copy_collection(baseline / "engine-nano", tmp_path / "bad")
    rewrite_npz(bad, logits=lambda a: a.__setitem__((9, slice(100, 110)), a[9, 100:110] + 1.0))
    res = run_cli(app, "logits", "compare", "--lhs", bad, "--rhs", baseline / "engine-hf", "--out", tmp_path / "c.json")
    assert res.exit_code == 1, res.output
    rec = json.loads((tmp_path / "c.json").read_text())
    f = rec["facts"]
    assert rec["verdict"] == "FAIL" and f["failing_rows"] == 1
    assert f["first_divergent_row"]["index"] == 9 and f["first_divergent_row"]["id"] == "B/R2/4"
    assert "max_abs" in f["first_divergent_row"]["failures"] and f["worst_rows"][0]["index"] == 9
    assert "B/R2/4" in res.output


def test_mismatched_trajectories_and_models_are_refused(baseline, tiny_model_dir, tmp_path, app):
    other = collect("hf", "baseline", tmp_path / "seed1", model=str(tiny_model_dir), device="cpu", seed=1)
    assert other["facts"]["trajectory_sha256"] != json.loads((baseline / "engine-hf.json").read_text())["facts"]["trajectory_sha256"]
    with pytest.raises(UserError, match=r"trajectories differ at row 1 \(lhs A/A/1"):
        compare(baseline / "engine-nano", tmp_path / "seed1", tmp_path / "x.json")
    res = run_cli(app, "logits", "compare", "--lhs", baseline / "engine-nano", "--rhs", tmp_path / "seed1",
                  "--out", tmp_path / "x.json")
    assert res.exit_code == 2 and "trajectories differ" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "x.json").exists()

    other_model = copy_collection(baseline / "engine-hf", tmp_path / "other-model")
    rec = json.loads((tmp_path / "other-model.json").read_text())
    rec["model"]["weights_sha256"] = "0" * 64
    (tmp_path / "other-model.json").write_text(json.dumps(rec))
    with pytest.raises(UserError, match="weights sha256 differs"):
        compare(baseline / "engine-nano", other_model, tmp_path / "y.json")


# --------------------------------------------------------------------------- collections assert what they measured


def failed_names(rec):
    return sorted(c["name"] for c in rec["checks"] if c["status"] == "fail")


def test_collections_state_run_assertions_over_measured_facts(baseline):
    nano = json.loads((baseline / "engine-nano.json").read_text())
    hf = json.loads((baseline / "engine-hf.json").read_text())
    for rec in (nano, hf):
        assert "unjudged_checks" not in rec and rec["verdict"] == "PASS"
        assert {a["path"] for a in rec["run_assertions"]} >= {"facts.num_rows", "facts.rows_follow_trajectory",
                                                             "facts.logits_finite"}
        assert rec["facts"]["logits_finite"] is True and rec["facts"]["num_rows"] == 15
    assert hf["kind"] == "reference"                   # transformers made these rows, not our engine
    assert [s["width"] for s in hf["facts"]["steps"]] == [r["length"] for r in hf["facts"]["rows"]]


def test_non_finite_engine_logits_fail_the_collection(tiny_model_dir, tmp_path, monkeypatch):
    import labkit.guardrails.collect as collect_mod
    from labkit.guardrails import forcing

    real = forcing.drive_teacher_forced

    def poisoned(engine, prompts, continuations, *, probe=None, on_row=None):
        def poison(rec):
            rec.logits[3] = float("nan")
            on_row(rec)
        return real(engine, prompts, continuations, probe=probe, on_row=poison)

    monkeypatch.setattr(collect_mod, "drive_teacher_forced", poisoned)
    rec = collect("nano", "baseline", tmp_path / "nan", model=str(tiny_model_dir), device="cpu")
    assert rec["verdict"] == "FAIL" and rec["facts"]["logits_finite"] is False
    assert failed_names(rec) == ["logits finite"]


def test_hf_rows_that_were_fed_other_tokens_fail(tiny_model_dir, tmp_path, monkeypatch):
    """The reference's trajectory is measured from the input ids transformers received, not assumed."""
    import labkit.guardrails.collect as collect_mod

    real = collect_mod.reference_last_logits
    monkeypatch.setattr(collect_mod, "reference_last_logits",
                        lambda model, tokens, device: real(model, list(tokens)[:-1] + [1], device))
    rec = collect("hf", "baseline", tmp_path / "off", model=str(tiny_model_dir), device="cpu")
    assert rec["verdict"] == "FAIL" and rec["facts"]["rows_follow_trajectory"] is False
    assert failed_names(rec) == ["rows follow the preset trajectory"]
    # called twice per row: the measured row count is 30, not the suite's 15
    monkeypatch.setattr(collect_mod, "reference_last_logits",
                        lambda model, tokens, device: (real(model, tokens, device), real(model, tokens, device))[1])
    rec = collect("hf", "baseline", tmp_path / "twice", model=str(tiny_model_dir), device="cpu")
    assert rec["facts"]["num_rows"] == 30 and "rows collected" in failed_names(rec)


def test_a_kv_probe_that_saw_no_decode_step_fails(tiny_model_dir, tmp_path, monkeypatch):
    """'history unchanged' over zero probed decode steps is vacuous: the collection says so and FAILs."""
    from labkit.guardrails.forcing import KVProbe

    monkeypatch.setattr(KVProbe, "before", lambda self, *a: None)
    monkeypatch.setattr(KVProbe, "after", lambda self, *a: None)
    rec = collect("nano", "graph", tmp_path / "blind", model=str(tiny_model_dir), device="cpu")
    kv = rec["facts"]["kv"]
    assert kv["history_unchanged"] is True and kv["decode_steps_probed"] == 0      # vacuously "unchanged"
    assert rec["verdict"] == "FAIL"
    assert failed_names(rec) == ["decode steps probed", "new KV of every decode row"]


def reseal(prefix, change):
    """Edit a collection's JSON by hand and recompute its digest (a forger who knows the format)."""
    from labkit.evidence_format import digest

    path = Path(f"{prefix}.json")
    rec = json.loads(path.read_text())
    change(rec)
    rec["digest"] = digest(rec)
    path.write_text(json.dumps(rec))


def test_compare_computes_trajectory_and_model_match(baseline, tmp_path):
    from labkit.guardrails.compare import load_collection, model_match, trajectory_match

    lhs, rhs = load_collection(baseline / "engine-nano"), load_collection(baseline / "engine-hf")
    assert trajectory_match(lhs, rhs) and model_match(lhs, rhs)
    rhs.record["facts"]["rows"][3]["tokens_sha256"] = "0" * 64          # one row fed other tokens
    assert not trajectory_match(lhs, rhs)
    rhs = load_collection(baseline / "engine-hf")
    rhs.record["facts"]["trajectory_sha256"] = "0" * 64                 # a digest its rows do not give
    assert not trajectory_match(lhs, rhs)
    rhs = load_collection(baseline / "engine-hf")
    rhs.record["model"]["weights_sha256"] = "0" * 64
    assert not model_match(lhs, rhs)
    del lhs.record["model"]["config_sha256"]
    assert not model_match(lhs, lhs)                                     # absent is no match


def test_compare_rejudges_its_inputs_instead_of_trusting_them(baseline, tmp_path):
    ok = compare(baseline / "engine-nano", baseline / "engine-hf", tmp_path / "ok.json")
    assert ok["verdict"] == "PASS" and ok["facts"]["lhs"]["verdict"] == ok["facts"]["rhs"]["verdict"] == "PASS"
    assert ok["facts"]["trajectory_match"] is True and ok["facts"]["model_match"] is True

    # an input edited by hand (its digest no longer matches) FAILs the comparison
    edited = copy_collection(baseline / "engine-nano", tmp_path / "edited")
    rec = json.loads(Path(f"{edited}.json").read_text())
    rec["facts"]["logits_finite"] = True
    rec["facts"]["note"] = "edited"
    Path(f"{edited}.json").write_text(json.dumps(rec))
    bad = compare(edited, baseline / "engine-hf", tmp_path / "edited-cmp.json")
    assert bad["verdict"] == "FAIL" and bad["facts"]["lhs"]["verdict"] == "FAIL"
    assert [c["name"] for c in bad["checks"] if c["status"] == "fail"] == ["lhs collection re-judged"]
    assert "edited after it was written" in bad["facts"]["lhs"]["verdict_reason"]

    # a collection whose own facts fail, resealed and claiming PASS: re-judged from its facts, FAIL
    forged = copy_collection(baseline / "engine-hf", tmp_path / "forged")
    reseal(forged, lambda r: r["facts"].update(logits_finite=False))
    bad = compare(baseline / "engine-nano", forged, tmp_path / "forged-cmp.json")
    assert bad["verdict"] == "FAIL" and bad["facts"]["rhs"]["verdict"] == "FAIL"

    # an engine collection from another engine tree is stale: NOT-RUN, and the comparison FAILs
    stale = copy_collection(baseline / "engine-nano", tmp_path / "stale")
    reseal(stale, lambda r: r.update(engine_source_hash="f" * 64))
    bad = compare(stale, baseline / "engine-hf", tmp_path / "stale-cmp.json")
    assert bad["verdict"] == "FAIL" and bad["facts"]["lhs"]["verdict"] == "NOT-RUN"
    assert "stale" in bad["facts"]["lhs"]["verdict_reason"]


# --------------------------------------------------------------------------- thresholds: one table, by device and dtype


def test_the_guard_uses_the_threshold_table_by_default(baseline):
    from labkit.checks import threshold_entry

    rec = json.loads((baseline / "engine-logits-check.json").read_text())
    th = rec["facts"]["thresholds"]
    key, entry = threshold_entry("logits", rec["device"], rec["facts"]["dtype"])
    assert key == "cpu/float32" and rec["facts"]["dtype"] == "float32"
    assert (th["key"], th["max_abs"], th["rel_l2"]) == (key, entry["max_abs"], entry["rel_l2"])
    assert th["source"] == "table logits cpu/float32" and th["overridden"] == []
    assert {a["value"] for a in rec["run_assertions"] if a["path"] in ("facts.worst_max_abs", "facts.worst_rel_l2")} \
        == {entry["max_abs"], entry["rel_l2"]}


def test_threshold_overrides_are_recorded_and_claim_no_checkpoint(tiny_model_dir, tmp_path, app, monkeypatch):
    runs = tmp_path / "runs"
    monkeypatch.setenv("LABKIT_RUNS_DIR", str(runs))
    command = get_checkpoint("guardrails.logits-baseline").command[1:]
    res = run_cli(app, *command, "--model", tiny_model_dir, "--device", "cpu", "--max-abs", "0.05", "--rel-l2", "0.002")
    assert res.exit_code == 0, res.output
    rec = json.loads((runs / "logits-guard-baseline.json").read_text())   # its own file, not the checkpoint's
    assert rec["checkpoint"] is None and not (runs / "engine-logits-check.json").exists()
    assert not (runs / "engine-nano.json").exists()                        # nor the checkpoint's collections
    th = rec["facts"]["thresholds"]
    assert th["overridden"] == ["--max-abs", "--rel-l2"] and (th["max_abs"], th["rel_l2"]) == (0.05, 0.002)
    assert th["source"] == "--max-abs and --rel-l2 given (table logits cpu/float32)"
    assert rec["facts"]["checkpoint_not_claimed"]["checkpoint"] == "guardrails.logits-baseline"
    assert "note: not evidence for guardrails.logits-baseline" in " ".join(res.output.split())


def test_a_dtype_without_a_threshold_entry_fails_and_says_so(baseline, tmp_path):
    lhs = copy_collection(baseline / "engine-nano", tmp_path / "l")
    rhs = copy_collection(baseline / "engine-hf", tmp_path / "r")
    for side in (lhs, rhs):
        reseal(side, lambda r: r["facts"].update(dtype="float16"))
    rec = compare(lhs, rhs, tmp_path / "c.json")
    assert rec["facts"]["thresholds"]["max_abs"] is None and rec["verdict"] == "FAIL"
    failed = [c for c in rec["checks"] if c["status"] == "fail"]
    assert [c["name"] for c in failed] == ["a logits max_abs threshold", "a logits rel_l2 threshold"]
    assert "no entry for cpu/float16 in the logits table" in failed[0]["why"]
    # the same pair with explicit thresholds is judged by them
    assert compare(lhs, rhs, tmp_path / "c2.json", max_abs=0.05, rel_l2=0.002)["verdict"] == "PASS"


def test_compare_by_hand_writes_its_own_file_not_the_checkpoints(baseline, tmp_path, app, monkeypatch):
    """`labkit logits compare` of the guardrail pair, no --out: its own file, evidence for no checkpoint (the
    checkpoint's file is the guard's), and it PASSes instead of failing a 'checkpoint' check it never claimed."""
    runs = tmp_path / "runs"
    monkeypatch.setenv("LABKIT_RUNS_DIR", str(runs))
    res = run_cli(app, "logits", "compare", "--lhs", baseline / "engine-nano", "--rhs", baseline / "engine-hf")
    assert res.exit_code == 0, res.output
    rec = json.loads((runs / "logits-compare.json").read_text())
    assert rec["checkpoint"] is None and rec["verdict"] == "PASS"
    cp = get_checkpoint("guardrails.logits-baseline")
    assert not cp.evidence_path().exists() and check_evidence(cp)[0] == "NOT-RUN"


# --------------------------------------------------------------------------- REVIEW


def test_review_needs_a_flip_inside_the_measured_error():
    def m(max_abs, margin, flip):
        return {"max_abs": max_abs, "rel_l2": 1e-6, "top1_lhs": 1 if flip else 0, "top1_rhs": 0, "ref_margin": margin}
    assert judge_rows([m(1e-3, 0.5, False)], 0.5, 0.02)[0] == "PASS"
    assert judge_rows([m(1e-3, 0.5, False), m(1e-3, 5e-4, True)], 0.5, 0.02)[0] == "REVIEW"
    assert judge_rows([m(1e-3, 2e-3, True)], 0.5, 0.02)[0] == "FAIL"            # margin >= error: real flip
    assert judge_rows([m(1e-3, 5e-4, True), m(0.9, 0.5, False)], 0.5, 0.02)[0] == "FAIL"


def test_a_near_tie_flip_gives_review_and_exit_3(baseline, tmp_path, app):
    ref = copy_collection(baseline / "engine-hf", tmp_path / "ref")
    got = copy_collection(baseline / "engine-nano", tmp_path / "got")
    row = 4
    with np.load(f"{ref}.npz") as z:
        top = float(z["logits"][row].max())

    def tie(ref_side: bool):
        def fn(a):
            # reference: token 7 leads token 8 by 1e-4; measured: 8 leads 7 (error 1.5e-4 > margin 1e-4)
            a[row, 7], a[row, 8] = (top + 1.0, top + 0.9999) if ref_side else (top + 0.99995, top + 1.00005)
        return fn
    rewrite_npz(ref, logits=tie(True))
    rewrite_npz(got, logits=tie(False))
    res = run_cli(app, "logits", "compare", "--lhs", got, "--rhs", ref, "--out", tmp_path / "r.json")
    assert res.exit_code == EXIT_CODES["REVIEW"], res.output
    f = json.loads((tmp_path / "r.json").read_text())["facts"]
    assert f["comparison_verdict"] == "REVIEW" and f["top1_flips"] == 1 and f["unexplained_top1_flips"] == 0
    assert f["first_divergent_row"]["index"] == row and f["first_divergent_row"]["failures"] == ["top1_flip"]
    assert f["first_divergent_row"]["ref_margin"] < f["first_divergent_row"]["max_abs"]


# --------------------------------------------------------------------------- graph suite (eager on CPU)


def test_graph_suite_collects_126_rows_with_kv_checks(graph):
    d, nano, hf = graph
    f = nano["facts"]
    assert nano["verdict"] == "PASS" and f["num_rows"] == 126 and hf["facts"]["num_rows"] == 126
    assert sorted(map(int, f["decode_routes"])) == [1, 9, 16, 17, 20]
    assert f["kv"]["history_unchanged"] and f["kv"]["padding_wrote_nothing"]
    assert f["kv"]["decode_steps_probed"] == 5 and f["kv"]["new_kv_rows"] == 63 and f["logits_finite"]
    assert [s["batch"] for s in f["kv"]["decode_steps"]] == [1, 9, 16, 17, 20]
    assert all(s["free_blocks_checked"] for s in f["kv"]["decode_steps"])
    with np.load(d / "nano.npz") as z:
        assert z["logits"].shape == (126, 151936)
        assert z["kv_new"].shape == (63, 2, 2, 2, 16)              # decode rows, K/V, layers, kv heads, head dim
        rows = z["kv_rows"].tolist()
    assert [f["rows"][r]["step"] for r in rows] == [1] * 63
    decode_row = f["rows"][rows[0]]
    assert decode_row["phase"] == "decode"


def test_graph_suite_nano_matches_hf(graph, tmp_path):
    d, _, _ = graph
    rec = compare(d / "nano", d / "hf", tmp_path / "c.json")
    assert rec["verdict"] == "PASS" and rec["facts"]["num_rows"] == 126
    assert rec["facts"]["kv"]["compared"] is False and "only lhs" in rec["facts"]["kv"]["why_not"]
    assert rec["facts"]["worst_max_abs"] < 1e-4


def test_new_kv_is_compared_and_a_corrupted_kv_row_fails(graph, tmp_path):
    d, _, _ = graph
    same = compare(d / "nano", d / "nano", tmp_path / "same.json")
    assert same["verdict"] == "PASS" and same["facts"]["kv"]["compared"] and same["facts"]["kv"]["rows"] == 63
    bad = copy_collection(d / "nano", tmp_path / "bad")
    rewrite_npz(bad, kv_new=lambda a: a.__setitem__((5, 1, 0), a[5, 1, 0] + 0.5))
    rec = compare(bad, d / "nano", tmp_path / "bad.json")
    with np.load(d / "nano.npz") as z:
        row = int(z["kv_rows"][5])
    first = rec["facts"]["first_divergent_row"]
    assert rec["verdict"] == "FAIL" and first["index"] == row and first["failures"] == ["kv"]
    assert first["kv_max_abs"] == pytest.approx(0.5)


# --------------------------------------------------------------------------- CLI error paths


@pytest.mark.parametrize("args,message", [
    (["logits", "collect", "--suite", "nope"], "unknown suite 'nope'"),
    (["logits", "collect", "--backend", "vllm"], "unknown backend 'vllm'"),
    (["logits", "collect", "--attention", "xformers"], "unknown attention backend 'xformers'"),
    (["logits", "collect", "--dtype", "fp8"], "unknown dtype 'fp8'"),
    (["logits", "collect", "--execution", "graph", "--suite", "graph", "--device", "cpu"], "graph execution needs CUDA"),
    (["logits", "guard", "--suite", "graph", "--device", "cpu"], "graph execution needs CUDA"),
    (["logits", "collect", "--expect-uncovered", "--suite", "baseline"], "--expect-uncovered needs --suite graph"),
    (["logits", "collect", "--graph-buckets", "1,x"], "--graph-buckets must be"),
    (["logits", "collect", "--backend", "hf", "--execution", "graph"], "--backend hf takes no"),
    (["logits", "compare", "--lhs", "nowhere/a"], "both --lhs PREFIX and --rhs PREFIX are required"),
])
def test_user_errors_end_in_one_line(app, tmp_path, args, message):
    res = run_cli(app, *args, "--out", tmp_path / "o")
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.split()) and "Traceback" not in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)


def test_compare_of_missing_files_is_a_user_error(app, tmp_path):
    res = run_cli(app, "logits", "compare", "--lhs", tmp_path / "none", "--rhs", tmp_path / "none2")
    assert res.exit_code == 2 and "none.json not found" in res.output and "Traceback" not in res.output


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_uncovered_batch_17_falls_back_to_eager(tmp_path):
    rec = collect("nano", "graph", tmp_path / "unc", execution="graph", expect_uncovered=True, device="cuda")
    eu = rec["facts"]["expect_uncovered"]
    assert rec["verdict"] == "PASS", rec["checks"]
    assert eu["route"] == "eager" and eu["completed"] and eu["error"] is None
    assert rec["facts"]["decode_routes"]["16"]["route"] == "graph"


def test_calibrate_reports_a_distribution_over_repeats(tiny_model_dir, tmp_path):
    rec = calibrate(("baseline",), ("torch",), ("float32",), 2, tmp_path / "cal.json", model=str(tiny_model_dir),
                       device="cpu", work_dir=tmp_path / "work")
    (res,) = rec["facts"]["results"]
    assert res["num_rows"] == 15 and len(res["repeats"]) == 2 and res["min_top1_agree"] == 15
    assert 0 < res["median_max_abs"] <= res["worst_max_abs"] < 1e-4
    assert res["repeat_spread_max_abs"] == 0.0          # the CPU engine is deterministic run to run
    assert not list((tmp_path / "work").glob("nano-*.npz"))   # engine arrays are not kept
    with pytest.raises(UserError, match="unknown suite"):
        calibrate(("nope",), ("torch",), ("float32",), 1, model=str(tiny_model_dir), device="cpu")
