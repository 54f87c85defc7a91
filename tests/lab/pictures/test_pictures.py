"""Pictures of the engine and the walk explorer (labkit/pictures/), drawn from real tiny walks.

The data each picture is drawn from is checked against the evidence (cells = steps x requests, spans =
the runner's slot_mapping, pool rows = after.pool); the PNGs exist at the size their layout chose; the
explorer inlines the evidence's steps unchanged and, in a real headless browser, shows the step the URL
names. ``walk_schema.to_schema`` brings today's evidence up to the shared schema (after.pool,
inputs.block_tables, facts.hash_chain) where it lacks those fields.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from labkit.cases import CASES
from labkit.errors import UserError
from labkit.experiments.prefix_walk import SHARED, TAILS
from labkit.experiments.quick_walk import run_quick_walk
from labkit.pictures import draw_all, draw_walk, picture_path, walkdata
from labkit.pictures.style import DPI
from walk_schema import to_schema


def _prompts(case: str) -> dict[str, list[int]]:
    spec = CASES[case]
    return {lab: list(p) for lab, p in zip(spec.labels, spec.prompts)}


@pytest.fixture(scope="module")
def walks(tiny_model_dir, tmp_path_factory):
    """Real walks on the tiny model, once per module: {name: evidence path}."""
    from labkit.experiments.prefix_walk import run_prefix

    d = tmp_path_factory.mktemp("walks")
    out = {}
    run_quick_walk("D", out=d / "d.json", model=str(tiny_model_dir), device="cpu", trace=True)
    out["d"] = d / "d.json"
    run_quick_walk("B", out=d / "b2.json", model=str(tiny_model_dir), device="cpu", trace=True, block_size=2)
    out["b2"] = d / "b2.json"
    run_prefix(d / "prefix.json", str(tiny_model_dir), "cpu", trace=True)
    out["prefix"] = d / "prefix.json"
    return out


def _facts(path: Path) -> dict:
    return json.loads(path.read_text())["facts"]


def _schema_copy(walks, name: str, tmp_path: Path, **kw) -> Path:
    """The walk's evidence brought up to schema.md, written to tmp_path."""
    rec = json.loads(walks[name].read_text())
    if name == "prefix":
        prompts = {"A": [*SHARED, *TAILS["A"]], "B": [*SHARED, *TAILS["B"]], "C": [*SHARED, *TAILS["C"]], "D": list(SHARED)}
    else:
        prompts = _prompts(name[0].upper())
    out = tmp_path / f"{name}-schema.json"
    out.write_text(json.dumps(to_schema(rec, prompts, **kw)))
    return out


def _as_older_evidence(src: Path, dst: Path) -> Path:
    """A copy of the evidence without the schema's newer fields (as evidence written before them)."""
    rec = json.loads(src.read_text())
    for st in rec["facts"]["steps"]:
        st["after"].pop("pool", None)
        st.pop("attention", None)
        st.pop("route", None)
        for k in ("input_ids", "max_seqlen_q", "max_seqlen_k", "block_tables"):
            st["inputs"].pop(k, None)
    rec["facts"].pop("hash_chain", None)
    dst.write_text(json.dumps(rec))
    return dst


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


# --------------------------------------------------------------------------- the data behind the pictures


def test_step_grid_is_steps_by_requests_with_the_scheduled_tokens(walks):
    facts = _facts(walks["d"])
    grid = walkdata.step_grid(facts)
    assert grid.labels == ["A", "B"] and grid.steps == [st["step"] for st in facts["steps"]]
    assert sum(len(row) for row in grid.cells) == len(facts["steps"]) * len(facts["requests"])
    for j, st in enumerate(facts["steps"]):
        for s in st["before"]:
            assert grid.cells[grid.labels.index(s["label"])][j].tokens == s["scheduled"]
    kinds = [[c.kind for c in row] for row in grid.cells]
    # D: A's 700 tokens as a 512 chunk, then 188 with B's 32, then one decode step for both
    assert kinds == [["prefill chunk", "prefill", "decode"], ["waiting", "prefill", "decode"]]
    assert [c.finished_here for c in grid.cells[0]] == [False, False, True]


def test_step_grid_marks_preempted_running_and_finished():
    """Hand-made steps (the grid reads only before/after): R2 is preempted after its prefill, R1 runs on."""
    def step(n, phase, before, waiting=(), running=(), finished=()):
        return {"step": n, "phase": phase, "before": [{"label": l, "total": t, "cached": c, "scheduled": s, "block_table": [0]}
                                                      for l, t, c, s in before],
                "after": {"waiting": list(waiting), "running": list(running), "finished": list(finished), "seqs": []}}
    facts = {"requests": [{"label": "R1"}, {"label": "R2"}], "steps": [
        step(1, "prefill", [("R1", 3, 0, 3), ("R2", 4, 0, 4)], running=["R1", "R2"]),
        step(2, "decode", [("R1", 4, 3, 1)], waiting=["R2"], running=["R1"]),
        step(3, "prefill", [("R2", 5, 0, 5)], running=["R1", "R2"]),
        step(4, "decode", [("R2", 6, 5, 1)], running=["R1"], finished=["R2"]),
        step(5, "decode", [("R1", 5, 4, 1)], finished=["R1"])]}
    kinds = [[c.kind for c in row] for row in walkdata.step_grid(facts).cells]
    assert kinds == [["prefill", "decode", "running, not in this step", "running, not in this step", "decode"],
                     ["prefill", "preempted", "prefill", "decode", "finished"]]


def test_pool_view_reads_after_pool_owners_sharing_and_cached_blocks(walks, tmp_path):
    facts = _facts(_schema_copy(walks, "prefix", tmp_path))
    view = walkdata.pool_view(facts)
    assert view.from_pool and not any("after.pool" in n for n in view.notes)
    for st, row in zip(facts["steps"], view.rows):
        assert {b["id"]: (b["owners"], b["ref_count"], b["hashed"]) for b in st["after"]["pool"]["blocks"]} == \
               {b: (s.owners, s.ref_count, s.hashed) for b, s in row.items()}
    a_blocks = facts["a"]["block_table"][:2]
    after_a = view.rows[[st["after"]["finished"] for st in facts["steps"]].index(["A"])]
    assert all(after_a[b].owners == [] and after_a[b].hashed for b in a_blocks)      # A gone: its full blocks stay cached
    a_done = [st["after"]["finished"] for st in facts["steps"]].index(["A"])
    assert view.released[a_done] == {b: "A" for b in facts["a"]["block_table"]}       # held in its last step, given back
    assert not view.released[0]
    assert any(row[b].ref_count == 2 and sorted(row[b].owners) == ["B", "C"] for row in view.rows for b in a_blocks if b in row)
    assert view.shown == list(range(view.shown[0], view.shown[-1] + 1)) and len(view.shown) < view.num_blocks
    assert any("stay free" in n for n in view.notes)


def test_pool_view_without_after_pool_says_so_and_uses_the_tables(walks, tmp_path):
    facts = _facts(_as_older_evidence(walks["d"], tmp_path / "d.json"))
    view = walkdata.pool_view(facts)
    assert not view.from_pool
    assert any("after.pool not in this evidence" in n for n in view.notes)
    for st, row in zip(facts["steps"], view.rows):
        live = {s["label"]: s["block_table"] for s in st["after"]["seqs"] if s["label"] not in st["after"]["finished"]}
        assert {b: sorted(s.owners) for b, s in row.items()} == \
               {b: sorted(l for l, t in live.items() if b in t) for t in live.values() for b in t}


@pytest.mark.parametrize("name", ["d", "b2"])
def test_slot_spans_are_the_runners_slot_mapping(walks, name):
    facts = _facts(walks[name])
    view = walkdata.slot_view(facts)
    st = next(s for s in facts["steps"] if s["step"] == view.step)
    assert len(st["before"]) > 1 and st["phase"] == "prefill"       # the first prefill with more than one sequence
    inp, bs = st["inputs"], facts["options"]["block_size"]
    assert sum(s.length for s in view.spans) == view.num_tokens == len(inp["slot_mapping"])
    for s in view.spans:
        assert inp["slot_mapping"][s.batch_start:s.batch_start + s.length] == list(range(s.first_slot, s.first_slot + s.length))
        assert inp["positions"][s.batch_start:s.batch_start + s.length] == list(range(s.position, s.position + s.length))
        assert s.first_slot // bs == s.block_id == (s.first_slot + s.length - 1) // bs
    if name == "b2":     # block size 2: R1's 3 tokens and R2's 4 cross blocks, one span per block
        assert [(s.label, s.length) for s in view.spans] == [("R1", 2), ("R1", 1), ("R2", 2), ("R2", 2)]


def test_hash_rows_follow_the_chain(walks, tmp_path):
    facts = _facts(_schema_copy(walks, "prefix", tmp_path, with_hash_chain=True))
    rows = walkdata.hash_rows(facts)
    assert [r["label"] for r in rows] == ["A", "B", "C", "D"]
    for r in rows:
        for prev, b in zip(r["blocks"], r["blocks"][1:]):
            assert b["parent"] == prev["hash"]
    b = rows[1]["blocks"]
    assert [x["hit"] for x in b] == [True, True, False] and b[2]["short"] is None    # 512 shared, then a partial block
    with pytest.raises(UserError):
        walkdata.hash_rows(_facts(walks["d"]))


# --------------------------------------------------------------------------- files


def test_draw_walk_writes_every_picture_at_its_size_and_leaves_the_evidence_alone(walks, tmp_path):
    from labkit.pictures import grids, hashes

    path = _schema_copy(walks, "prefix", tmp_path, with_hash_chain=True)
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    written = draw_walk(path)
    assert [p.name for p in written] == [f"prefix-schema.{n}.png" for n in ("steps", "kv", "slots", "attention", "hash")]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
    facts = _facts(path)
    want = {"steps": grids.steps_size(walkdata.step_grid(facts)), "kv": grids.kv_size(walkdata.pool_view(facts)),
            "hash": hashes.hash_size(walkdata.hash_rows(facts))}
    for name, (w, h) in want.items():
        assert _png_size(picture_path(path, name)) == (round(w * DPI), round(h * DPI))
    for p in written:
        assert p.stat().st_size > 15_000, f"{p.name} is nearly empty"


def test_todays_evidence_draws_with_notes(walks, tmp_path):
    """Evidence without the schema's newer fields still draws (with notes in the pictures): steps, kv, slots."""
    path = _as_older_evidence(walks["d"], tmp_path / "d.json")
    written = draw_walk(path)
    assert [p.name for p in written] == ["d.steps.png", "d.kv.png", "d.slots.png"]
    assert not walkdata.pool_view(_facts(path)).from_pool and walkdata.slot_view(_facts(path)).notes
    assert all(_png_size(p)[0] >= 600 for p in written)


def test_evidence_without_steps_is_a_user_error(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"facts": {"case": "A", "step_digest": []}}))
    with pytest.raises(UserError, match="no step log"):
        draw_walk(path)
    with pytest.raises(UserError, match="no evidence file"):
        draw_walk(tmp_path / "missing.json")


# --------------------------------------------------------------------------- the explorer


def test_explorer_inlines_the_steps_unchanged_and_needs_no_network(walks, tmp_path):
    from labkit.pictures.explorer import embedded_data

    path = _schema_copy(walks, "d", tmp_path)
    page_path = [p for p in draw_all(path) if p.suffix == ".html"][0]
    assert page_path == tmp_path / "d-schema.html"
    page = page_path.read_text()
    data = embedded_data(page)
    assert data["steps"] == _facts(path)["steps"]
    assert len(data["views"]) == len(data["steps"])
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=", page) and "http://" not in page and "https://" not in page


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "headless_shell"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def _dump_dom(browser: str, page: Path, step: int, tmp_path: Path) -> str:
    args = [browser, "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
            "--virtual-time-budget=3000", "--dump-dom", f"{page.as_uri()}#step={step}"]
    res = subprocess.run(args, capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": str(tmp_path)})
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


def test_explorer_in_a_headless_browser_shows_the_step_the_url_names(walks, tmp_path):
    browser = _chromium()
    if browser is None:
        pytest.skip("no chromium / google-chrome on this machine (CI installs Debian's chromium; `apt-get install chromium`)")
    path = _schema_copy(walks, "d", tmp_path)
    page = [p for p in draw_all(path) if p.suffix == ".html"][0]
    doms = {n: _dump_dom(browser, page, n, tmp_path) for n in (1, 3)}
    for n, dom in doms.items():
        assert re.search(rf'<b id="shown-step">{n}</b>', dom), f"step {n} not shown"
        assert f'data-step="{n}"' in dom
    # step 1: A's 512-token chunk alone; step 3: both decode one token each
        strip = re.findall(r'<td data-col="(\d+)"([^>]*)>', dom)     # the walk-at-a-glance grid
        assert len(strip) == len(_facts(path)["steps"]) * len(_facts(path)["requests"])
        assert {col for col, attrs in strip if 'class="now"' in attrs} == {str(n - 1)}
    def section(dom, name):
        return re.search(rf'<div id="{name}">(.*?)</div>', dom, re.S).group(1)

    cells = {n: re.findall(r"<td[^>]*>(prefill chunk|prefill|decode)</td>", section(dom, "batch")) for n, dom in doms.items()}
    assert cells == {1: ["prefill chunk"], 3: ["decode", "decode"]}
    # the route and attention branch section: A's first chunk attends to itself, then both decode from the pages
    branches = {n: re.findall(r"<td[^>]*>(prefill-fresh|prefill-cached|decode)</td>", section(dom, "attention"))
                for n, dom in doms.items()}
    assert branches == {1: ["prefill-fresh"], 3: ["decode", "decode"]}
    assert "route: eager (plain path" in section(doms[3], "attention") and "TorchAttention._decode" in doms[3]
    assert re.search(r'built by <a href="[^"]*engine/step_inputs.py"', section(doms[1], "tables"))
    shot = tmp_path / "explorer.png"
    res = subprocess.run([browser, "--headless", "--disable-gpu", "--no-sandbox", f"--user-data-dir={tmp_path / 'profile'}",
                          f"--screenshot={shot}", "--window-size=1280,1000", f"{page.as_uri()}#step=2"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": str(tmp_path)})
    assert res.returncode == 0 and _png_size(shot) == (1280, 1000)


# --------------------------------------------------------------------------- the commands


def test_picture_command_redraws_and_rejects_bad_input(walks, tmp_path, cli_app):
    from typer.testing import CliRunner

    path = tmp_path / "d.json"
    shutil.copy(walks["d"], path)
    res = CliRunner().invoke(cli_app, ["picture", str(path)])
    assert res.exit_code == 0, res.output
    assert "d.steps.png" in res.output and (tmp_path / "d.html").is_file()
    res = CliRunner().invoke(cli_app, ["picture", str(tmp_path / "nope.json")])
    assert res.exit_code == 2 and res.output.strip().startswith("error:") and len(res.output.strip().splitlines()) == 1
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"facts": {"case": "A"}}))
    res = CliRunner().invoke(cli_app, ["picture", str(bare)])
    assert res.exit_code == 2 and "no step log" in res.output and "Traceback" not in res.output


def test_quick_walk_writes_its_pictures_next_to_the_evidence(tiny_model_dir, tmp_path, cli_app, monkeypatch):
    from typer.testing import CliRunner

    monkeypatch.setenv("LABKIT_RUNS_DIR", str(tmp_path))
    res = CliRunner().invoke(cli_app, ["quick-walk", "--case", "A", "--trace", "--model", str(tiny_model_dir), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    evidence = tmp_path / "quick-walk-a.json"
    digest = json.loads(evidence.read_text())["digest"]
    for name in ("steps", "kv", "slots"):
        assert picture_path(evidence, name).is_file() and picture_path(evidence, name).name in res.output
    assert (tmp_path / "quick-walk-a.html").is_file()
    assert json.loads(evidence.read_text())["digest"] == digest
    from labkit.checks import check_evidence, get_checkpoint

    assert check_evidence(get_checkpoint("setup.quick-walk-a"), evidence)[0] == "PASS"


def test_the_slot_picture_names_one_token_rows_and_keeps_crowded_boundaries_readable():
    """A mixed step's decode rows are one token each, too narrow for a name inside the bar: they are named above it,
    and their cu_seqlens boundaries (closer than 0.2 inch) share one label instead of printing over each other."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from labkit.pictures.slots import _draw_batch
    from labkit.pictures.walkdata import SlotView, Span

    labels = ["A", "B", "C", "D"]
    spans = [Span("A", 0, 1, 40, 0, 40), Span("B", 1, 1, 55, 1, 567), Span("C", 2, 1, 70, 2, 1094),
             Span("D", 3, 300, 0, 3, 1536)]
    view = SlotView(step=5, phase="mixed", num_tokens=303, block_size=512, labels=labels,
                    cu_seqlens_q=[0, 1, 2, 3, 303], spans=spans, tables={k: [i] for i, k in enumerate(labels)},
                    cached={"A": 40, "B": 55, "C": 70, "D": 0})
    fig, ax = plt.subplots()
    try:
        _draw_batch(ax, view, labels)
        texts = [t.get_text() for t in ax.texts]
    finally:
        plt.close(fig)
    assert "A pos 40  B pos 55  C pos 70" in texts
    assert "0, 1, 2, 3" in texts and "303" in texts
    assert "D  pos 0–299\n300 tokens" in texts
