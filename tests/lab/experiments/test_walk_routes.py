"""Each walk step records its route (ModelRunner.route_for's choice, fused or plain) and the attention branch
each sequence took; the explorer shows both with the engine functions that build each section; lesson 7's
picture draws them."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def prefix_walk(tiny_model_dir, tmp_path_factory):
    from labkit.experiments.prefix_walk import run_prefix

    out = tmp_path_factory.mktemp("routes") / "prefix.json"
    run_prefix(out, str(tiny_model_dir), "cpu", "torch")
    return out


def test_each_step_records_its_route_and_each_sequence_its_branch(prefix_walk):
    record = json.loads(prefix_walk.read_text())
    steps = record["facts"]["steps"]
    assert all(st["route"] == {"kind": "eager", "bucket": None, "route": "eager", "fused": False} for st in steps)
    kinds = set()
    for st in steps:
        assert [a["label"] for a in st["attention"]] == [s["label"] for s in st["before"]]
        for a, s in zip(st["attention"], st["before"]):
            # the scheduler's view (cached before the forward) against the branch read from the runner's inputs
            if st["phase"] == "decode":
                assert (a["branch"], a["queries"], a["keys"]) == ("decode", 1, s["total"])
            else:
                want = "prefill-cached" if s["cached"] > 0 else "prefill-fresh"
                assert (a["branch"], a["queries"], a["keys"]) == (want, s["scheduled"], s["cached"] + s["scheduled"])
            kinds.add(a["branch"])
    assert kinds == {"prefill-fresh", "prefill-cached", "decode"}      # the walk takes all three branches


def test_the_route_lands_on_its_own_step():
    from engine.graph import Route
    from labkit.experiments.quick_walk import StepRecorder

    rec = StepRecorder({})
    rec.steps = [{"step": 4}, {"step": 5}]
    rec.route(SimpleNamespace(step=4, route=Route("graph", 8)), fused=True)   # an overlapped step's output lands late
    assert rec.steps[0]["route"] == {"kind": "graph", "bucket": 8, "route": "graph:8", "fused": True}
    assert "route" not in rec.steps[1]


def test_explorer_names_the_functions_that_build_each_section(prefix_walk, tmp_path):
    from labkit.pictures import write_explorer
    from labkit.pictures.explorer import BUILT_BY, embedded_data

    page = write_explorer(prefix_walk)
    data = embedded_data(page.read_text(encoding="utf-8"))
    assert set(data["built_by"]) == set(BUILT_BY)
    for rows in data["built_by"].values():
        for f in rows:
            src = (REPO / f["file"]).read_text(encoding="utf-8").splitlines()
            word = f["name"].split(".")[-1]
            assert src[f["line"] - 1].lstrip().startswith((f"def {word}(", f"class {word}")), f
            assert (page.parent / f["href"]).resolve() == (REPO / f["file"]).resolve()
    assert data["attention"]["backend"] == "torch"
    assert data["attention"]["calls"]["decode"].startswith("TorchAttention._decode")
    assert '<div id="attention">' in page.read_text(encoding="utf-8")


def test_lesson_7_picture_is_drawn_from_the_branches(prefix_walk, tmp_path):
    import shutil

    from labkit.pictures import draw_walk

    copy = tmp_path / "p.json"
    shutil.copy(prefix_walk, copy)
    written = draw_walk(copy)
    pic = tmp_path / "p.attention.png"
    assert pic in written and pic.stat().st_size > 15_000
    rec = json.loads(copy.read_text())
    for st in rec["facts"]["steps"]:
        st.pop("attention")
    copy.write_text(json.dumps(rec))
    pic.unlink()
    assert pic not in draw_walk(copy)          # no branches recorded: no lesson-7 picture


@pytest.fixture(scope="module")
def case_c(tiny_model_dir, tmp_path_factory):
    from labkit.experiments.quick_walk import run_quick_walk

    out = tmp_path_factory.mktemp("case-c") / "c.json"
    run_quick_walk("C", out=out, model=str(tiny_model_dir), device="cpu", trace=True)
    return out


def test_case_c_slot_picture_shows_the_decode_that_takes_a_new_block(case_c):
    from labkit.pictures import walkdata

    facts = json.loads(case_c.read_text())["facts"]
    steps = facts["steps"]
    # the step whose scheduled table is longer than the table the previous step left: a block was appended
    grew = next(b for a, b in zip(steps, steps[1:]) if len(b["before"][0]["block_table"]) > len(a["after"]["seqs"][0]["block_table"]))
    view = walkdata.slot_view(facts)
    assert (view.step, view.phase) == (grew["step"], "decode")
    assert [s.block_id for s in view.spans] == [grew["before"][0]["block_table"][-1]]


def test_picture_step_draws_that_step_and_refuses_a_missing_one(case_c, tmp_path, labkit_in_process):
    import shutil

    copy = tmp_path / "c.json"
    shutil.copy(case_c, copy)
    res = labkit_in_process("picture", copy, "--step", "1")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "c.step-1.slots.png").stat().st_size > 15_000
    assert not (tmp_path / "c.steps.png").exists()          # only the step's slot picture
    res = labkit_in_process("picture", copy, "--step", "9")
    assert res.returncode == 2 and "--step 9: no such step" in res.stderr and "Traceback" not in res.stderr


def test_a_small_kv_pool_preempts_and_the_pictures_draw_it(tiny_model_dir, tmp_path, monkeypatch, labkit_in_process):
    """Case B at block size 4 in a pool of 2 blocks: R2's first decode finds no free block, so the scheduler
    preempts it; the step log, the engine's own counter, the step grid and the KV pool agree on where."""
    from labkit.pictures import draw_walk, walkdata

    monkeypatch.setenv("LABKIT_RUNS_DIR", str(tmp_path / "runs"))
    res = labkit_in_process("quick-walk", "--case", "B", "--kv-cache-block-size", "4", "--num-kvcache-blocks", "2",
                            "--trace", "--model", tiny_model_dir, "--device", "cpu")
    assert res.returncode == 0, res.stdout + res.stderr
    path = tmp_path / "runs" / "quick-walk-b-bs4-blocks2.json"      # its own file: these options' evidence
    record = json.loads(path.read_text())
    facts = record["facts"]
    assert record["checkpoint"] is None and facts["options"]["num_kvcache_blocks"] == 2
    assert facts["preemptions"] >= 1 and len(facts["preempted_at"]) == facts["preemptions"]
    assert facts["output_counts"] == [2, 5]                 # preempted, re-admitted, finished all the same
    grid = walkdata.step_grid(facts)
    steps = [st["step"] for st in facts["steps"]]
    view = walkdata.pool_view(facts)
    for p in facts["preempted_at"]:
        j = steps.index(p["step"])
        assert grid.cells[grid.labels.index(p["label"])][j].kind == "preempted"
        assert view.preempted[j] == {b: p["label"] for b in p["blocks"]}
    assert sum(len(g) > 0 for g in view.preempted) == facts["preemptions"]
    from labkit.pictures.explorer import explorer_data

    views = explorer_data(record, facts, "t")["views"]       # the explorer's pool section says it too
    for p in facts["preempted_at"]:
        assert views[steps.index(p["step"])]["preempted"] == {str(b): p["label"] for b in p["blocks"]}
    assert any(p.name.endswith(".kv.png") for p in draw_walk(path))
    res = labkit_in_process("quick-walk", "--case", "prefix", "--num-kvcache-blocks", "2")
    assert res.returncode == 2 and "--num-kvcache-blocks is for cases A-E" in res.stderr


def test_lesson_6_exercise_has_its_checkpoint_and_its_own_file(tiny_model_dir, tmp_path, monkeypatch, labkit_in_process):
    monkeypatch.setenv("LABKIT_RUNS_DIR", str(tmp_path / "runs"))
    res = labkit_in_process("quick-walk", "--case", "C", "--kv-cache-block-size", "16", "--trace",
                            "--model", tiny_model_dir, "--device", "cpu")
    assert res.returncode == 0, res.stdout + res.stderr
    record = json.loads((tmp_path / "runs" / "quick-walk-c-bs16.json").read_text())
    assert (record["checkpoint"], record["verdict"]) == ("course.quick-walk-c-bs16", "PASS"), record["checks"]
    # another option set keeps its own file, claims nothing
    res = labkit_in_process("quick-walk", "--case", "C", "--kv-cache-block-size", "16", "--shuffle-blocks", "7",
                            "--trace", "--model", tiny_model_dir, "--device", "cpu")
    other = json.loads((tmp_path / "runs" / "quick-walk-c-bs16-shuffle7.json").read_text())
    assert other["checkpoint"] is None
    assert json.loads((tmp_path / "runs" / "quick-walk-c-bs16.json").read_text())["digest"] == record["digest"]


def test_hash_picture_names_the_last_block_rule(prefix_walk):
    from labkit.pictures import hashes, walkdata

    rows = walkdata.hash_rows(json.loads(prefix_walk.read_text())["facts"])
    flagged = [(r["label"], b["index"]) for r in rows for b in r["blocks"] if hashes.last_not_looked_up(r, b)]
    assert flagged == [("D", 1)]      # D is exactly 512 tokens: its full second block is its last, never looked up


def test_a_mixed_steps_decode_rows_take_the_decode_branch():
    """A mixed step (decodes first, then prefill rows): the rows the runner counted as decodes (num_decodes)
    are decodes in the record and in the step grid, the others are prefill rows."""
    from labkit.experiments.quick_walk import attention_branches
    from labkit.pictures import walkdata

    step = {"step": 3, "phase": "mixed",
            "before": [{"label": "R1", "total": 9, "cached": 8, "scheduled": 1, "block_table": [0, 1]},
                       {"label": "R2", "total": 6, "cached": 0, "scheduled": 6, "block_table": [2, 3]}],
            "inputs": {"cu_seqlens_q": [0, 1, 7], "cu_seqlens_k": [0, 9, 15], "context_lens": [8]},
            "after": {"seqs": [], "running": ["R1", "R2"], "waiting": [], "finished": []}}
    step["attention"] = attention_branches(step, num_decodes=1)
    assert [(a["branch"], a["queries"], a["keys"]) for a in step["attention"]] == \
        [("decode", 1, 9), ("prefill-fresh", 6, 6)]
    grid = walkdata.step_grid({"steps": [step], "requests": [{"label": "R1"}, {"label": "R2"}]})
    assert [row[0].kind for row in grid.cells] == ["decode", "prefill"]
