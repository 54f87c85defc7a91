"""Each walk step records its route (ModelRunner.route_for's choice, fused or plain) and the attention branch
each sequence took; the explorer shows both with the engine functions that build each section; lesson 7's
picture draws them."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]


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
