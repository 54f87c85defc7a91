"""`labkit course ex N | show N | replay`: the course's exercises run on the real engine and judged against the
course's rule; each judgement can fail when the engine does something else (a broken engine part, patched in)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("lesson", range(2, 9))
def test_each_exercise_agrees_with_the_course(lesson):
    from labkit.experiments.course import exercise_facts

    facts, _ = exercise_facts(lesson)
    assert facts["agree"] is True, facts


def test_lesson_4_corrects_the_course_arithmetic():
    from labkit.experiments.course import ex4_block_manager

    f = ex4_block_manager()
    assert f["course_text_correct"] is False
    assert (f["got"]["num_blocks_b"], f["got"]["new_blocks"]) == (3, 1) != (4, 2)   # 12 tokens at B=4


@pytest.mark.parametrize("lesson, target, broken", [
    # a slot one past the formula in plan_decode's slot_mapping
    (6, "engine.step_inputs.InputBuilder.plan_decode", None),
    # may_append that always takes a block
    (6, "engine.block_manager.BlockManager.may_append",
     lambda orig: lambda self, seq, ahead=0: seq.block_table.append(self._take_free_block())),
    # a prefix lookup that never hits
    (4, "engine.block_manager.BlockManager.cached_prefix", lambda orig: lambda self, seq: []),
    # positions of a prefill counted from 0 for every sequence (the cached prefix forgotten)
    (5, "engine.step_inputs.InputBuilder.plan_prefill",
     lambda orig: lambda self, seqs: orig(self, [_uncached(s) for s in seqs])),
    # a store that writes the -1 rows too (into the last slot)
    (7, "engine.attention.torch_backend.TorchAttention.store_kv",
     lambda orig: lambda self, k, v, kc, vc, slots: orig(self, k, v, kc, vc, slots.clamp(min=0))),
    # a scheduler that lets every sequence of a batch be cut (budget filled by the second sequence too)
    (3, "engine.scheduler.Scheduler.schedule", lambda orig: lambda self: _cut_all(self, orig)),
])
def test_an_exercise_fails_on_a_broken_engine(monkeypatch, lesson, target, broken):
    import importlib

    from labkit.experiments.course import exercise_facts

    module, _, attr = target.rpartition(".")
    mod_path, _, cls = module.rpartition(".")
    owner = getattr(importlib.import_module(mod_path), cls)
    orig = getattr(owner, attr)
    if attr == "plan_decode":                       # shift every slot of the plan by one
        def shifted(self, seqs, ahead=0, _orig=orig):
            plan = _orig(self, seqs, ahead)
            plan.slot_mapping[:] = [s + 1 for s in plan.slot_mapping]
            return plan
        monkeypatch.setattr(owner, attr, shifted)
    else:
        monkeypatch.setattr(owner, attr, broken(orig))
    facts, _ = exercise_facts(lesson)
    assert facts["agree"] is False, facts


def _uncached(seq):
    seq.num_scheduled_tokens += seq.num_cached_tokens
    seq.num_cached_tokens = 0
    return seq


def _cut_all(sched, orig):
    seqs, is_prefill = orig(sched)
    left = sched.max_num_batched_tokens - sum(s.num_scheduled_tokens for s in seqs)
    for s in list(sched.waiting):
        if left <= 0:
            break
        if s not in seqs:
            if not s.block_table:
                sched.block_manager.allocate(s, [])
            s.num_scheduled_tokens = min(left, s.num_tokens)
            left -= s.num_scheduled_tokens
            seqs.append(s)
    return seqs, is_prefill


def test_course_ex_writes_evidence_its_checkpoint_passes(labkit_in_process, tmp_path):
    out = tmp_path / "ex5.json"
    res = labkit_in_process("course", "ex", "5", "--out", out)
    assert res.returncode == 0, res.stdout + res.stderr
    record = json.loads(out.read_text())
    assert record["checkpoint"] == "course.ex-5" and record["verdict"] == "PASS", record.get("checks")
    assert "[0, 3, 5]" in res.stdout


def test_course_ex_refuses_a_lesson_outside_1_to_8(labkit_in_process):
    res = labkit_in_process("course", "ex", "9")
    assert res.returncode == 2
    assert "lesson 9" in res.stderr and "Traceback" not in res.stderr
    res = labkit_in_process("course", "show", "0")
    assert res.returncode == 2 and "lesson 0" in res.stderr


def test_course_show_prints_each_function_at_its_definition_line(labkit_in_process):
    from labkit.experiments.course import lesson_functions

    for lesson in range(1, 9):
        got = lesson_functions(lesson)
        assert got["functions"], lesson
        for f in got["functions"]:
            src = (REPO / f["file"]).read_text(encoding="utf-8").splitlines()
            if f["name"]:
                word = f["name"].split(".")[-1]
                assert f["line"] and src[f["line"] - 1].lstrip().startswith((f"def {word}(", f"class {word}",
                                                                             f"async def {word}(")), f
    res = labkit_in_process("course", "show", "4")
    assert res.returncode == 0, res.stderr
    line = next(f["line"] for f in lesson_functions(4)["functions"] if f["name"] == "BlockManager.allocate")
    assert f"engine/block_manager.py:{line}" in res.stdout
    assert "b block_manager_mod.BlockManager." in res.stdout      # the module form, a name --debug's prompt offers


def test_course_show_source_writes_each_function_numbered_as_in_its_file(labkit_in_process, tmp_path):
    import re

    from labkit.experiments.course import lesson_functions, lesson_source

    for lesson in range(1, 9):
        text = lesson_source(lesson_functions(lesson))
        heads = re.findall(r"^## (\S+):(\d+)-(\d+)  (\S+)$", text, re.M)
        assert [h[3] for h in heads] == [f["name"] for f in lesson_functions(lesson)["functions"]]
        for file, first, last, name in heads:
            src = (REPO / file).read_text(encoding="utf-8").splitlines()
            body = text.split(f"## {file}:{first}-{last}  {name}\n")[1].split("\n\n## ")[0]
            numbered = {int(m[0]): m[1] for m in re.findall(r"^ *(\d+)(?:  (.*))?$", body, re.M)}
            first, last = int(first), int(last)
            assert sorted(numbered) == list(range(first, last + 1)), name
            assert all(numbered[i] == src[i - 1].rstrip() for i in numbered), name
            word = name.split(".")[-1]
            assert any(src[i - 1].lstrip().startswith((f"def {word}(", f"class {word}", f"async def {word}("))
                       for i in numbered), name
            assert first == 1 or not src[first - 2].lstrip().startswith("@"), name   # its decorators too
            indent = len(src[first - 1]) - len(src[first - 1].lstrip())
            after = next((line for line in src[last:] if line.strip()), "")
            assert len(after) - len(after.lstrip()) <= indent, name       # the definition ends where its block does
    out = tmp_path / "walk" / "l4.txt"
    res = labkit_in_process("course", "show", "4", "--source", "--out", out)
    assert res.returncode == 0, res.stderr
    assert out.read_text(encoding="utf-8") == lesson_source(lesson_functions(4)) + "\n"
    assert "def allocate(" in out.read_text(encoding="utf-8")
    res = labkit_in_process("course", "show", "4", "--out", out)
    assert res.returncode == 2 and "--source" in res.stderr and "Traceback" not in res.stderr


def test_course_show_reports_a_name_the_code_lacks(tmp_path):
    from labkit.experiments.course import lesson_functions

    doc_dir = tmp_path / "docs"
    doc_dir.mkdir()
    (tmp_path / "engine").symlink_to(REPO / "engine")
    text = (REPO / "docs" / "COURSE.md").read_text(encoding="utf-8").replace(
        "`engine/scheduler.py:Scheduler.schedule`", "`engine/scheduler.py:Scheduler.schedule_all`")
    (doc_dir / "COURSE.md").write_text(text, encoding="utf-8")
    got = lesson_functions(3, doc_dir / "COURSE.md")
    assert any(f["name"] == "Scheduler.schedule_all" and f["line"] is None for f in got["functions"])


def test_replay_rule_through_route_for(labkit_in_process, tmp_path):
    out = tmp_path / "r.json"
    res = labkit_in_process("course", "replay", "--out", out)
    assert res.returncode == 0, res.stdout + res.stderr
    f = json.loads(out.read_text())["facts"]
    assert f["all_agree"] is True
    decode = {r["batch"]: r["route"] for r in f["rows"] if r["phase"] == "decode"}
    assert decode[3] == "graph:4" and decode[513] == "eager"
    assert all(r["route"] == "eager" for r in f["rows"] if r["phase"] == "prefill")
    # given buckets and eager enforced: other evidence, no checkpoint claimed
    res = labkit_in_process("course", "replay", "--batch-sizes", "5,40", "--buckets", "8,32", "--out", tmp_path / "c.json")
    rows = json.loads((tmp_path / "c.json").read_text())["facts"]["rows"]
    assert [r["route"] for r in rows if r["phase"] == "decode"] == ["graph:8", "eager"]
    res = labkit_in_process("course", "replay", "--enforce-eager", "--out", tmp_path / "e.json")
    assert all(r["route"] == "eager" for r in json.loads((tmp_path / "e.json").read_text())["facts"]["rows"])
    res = labkit_in_process("course", "replay", "--batch-sizes", "4,x")
    assert res.returncode == 2 and "--batch-sizes" in res.stderr


def test_replay_rule_fails_when_bucket_for_picks_another_bucket(monkeypatch):
    from engine.graph import DecodeGraphs

    from labkit.experiments.replay import replay_facts

    orig = DecodeGraphs.bucket_for
    monkeypatch.setattr(DecodeGraphs, "bucket_for", lambda self, batch: orig(self, batch + 1))  # one too large
    assert replay_facts([1, 3, 8, 128, 513], None, 512, False)["all_agree"] is False
