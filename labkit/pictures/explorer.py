"""The walk explorer: one self-contained HTML page per walk (``runs/<stem>.html``).

No network, no CDN, no library: the walk's data is inlined as JSON (``<script type="application/json"
id="walk-data">``) and a small hand-written script (:mod:`labkit.pictures.explorer_page`) draws the chosen
step: the batch, the KV pool, the block tables, the slot mapping, cu_seqlens / max_seqlen and the input
shapes. A slider, the Prev/Next buttons and the arrow keys change the step; the URL's ``#step=N`` selects
one (so a page can be opened, or tested, at a given step).

The inlined ``steps`` are the evidence's ``facts.steps`` unchanged; ``views`` holds, per step, what the
pictures derive from them (:mod:`labkit.pictures.walkdata`): the pool's blocks and the batch's spans.
"""
from __future__ import annotations

import html
import json
from dataclasses import asdict

from labkit.errors import UserError
from labkit.pictures import style, walkdata
from labkit.pictures.explorer_page import CSS, SCRIPT


def _views(facts: dict) -> tuple[list[dict], walkdata.PoolView]:
    pool = walkdata.pool_view(facts, max_blocks=256)
    out = []
    for j, (st, row) in enumerate(zip(facts["steps"], pool.rows)):
        blocks = [{"id": b, **asdict(row[b])} if b in row else {"id": b, "owners": [], "ref_count": 0, "hashed": False,
                                                                   "free": True}
                  for b in pool.shown]
        spans = []
        if (st.get("inputs") or {}).get("slot_mapping"):
            try:
                spans = [asdict(s) for s in walkdata.slot_view(facts, st).spans]
            except UserError:      # a step whose inputs cannot be cut into spans shows its raw slots only
                spans = []
        gone = pool.preempted[j] if j < len(pool.preempted) else {}
        out.append({"blocks": blocks, "spans": spans, "preempted": {str(b): lab for b, lab in gone.items()}})
    return out, pool


# the engine function that builds what each section shows: (file, qualified name), lines read at drawing time
BUILT_BY = {
    "batch": [("engine/scheduler.py", "Scheduler.schedule"), ("engine/scheduler.py", "Scheduler.postprocess")],
    "pool": [("engine/block_manager.py", "BlockManager.allocate"), ("engine/block_manager.py", "BlockManager.may_append"),
             ("engine/block_manager.py", "BlockManager.hash_blocks"), ("engine/block_manager.py", "BlockManager.deallocate")],
    "tables": [("engine/step_inputs.py", "InputBuilder._padded_tables")],
    "slots": [("engine/step_inputs.py", "InputBuilder.slots"), ("engine/step_inputs.py", "InputBuilder.plan_decode")],
    "shapes": [("engine/step_inputs.py", "InputBuilder.plan_prefill"), ("engine/step_inputs.py", "InputBuilder.to_inputs")],
    "attention": [("engine/models/qwen3.py", "Attention.forward"), ("engine/model_runner.py", "ModelRunner.route_for")],
}


def built_by(page_dir=None) -> dict[str, list[dict]]:
    """BUILT_BY with each function's definition line, read from the source now, and a link relative to
    the page's folder (the page sits in runs/ of the clone)."""
    import os

    from labkit.paths import definition_line, repo_root

    root = repo_root()
    out: dict[str, list[dict]] = {}
    for section, funcs in BUILT_BY.items():
        rows = []
        for path, name in funcs:
            file = root / path
            line = definition_line(file, name) if file.is_file() else None
            href = os.path.relpath(file, page_dir) if page_dir is not None else str(file)
            rows.append({"name": name, "file": path, "line": line, "href": href.replace(os.sep, "/")})
        out[section] = rows
    return out


def _attention_calls(record: dict) -> dict:
    from labkit.pictures.attention import BRANCH_CALLS, PER_STEP

    backend = (record.get("engine") or {}).get("attention_backend") or "torch"
    return {"backend": backend, "calls": BRANCH_CALLS.get(backend, BRANCH_CALLS["torch"]),
            "per_step": backend in PER_STEP}


def explorer_data(record: dict, facts: dict, title: str, page_dir=None) -> dict:
    """Everything the page shows: the evidence's steps as they are, plus the derived views."""
    labels = walkdata.request_labels(facts)
    views, pool = _views(facts)
    grid = walkdata.step_grid(facts)
    return {
        "grid": {"labels": grid.labels, "kinds": [[c.kind for c in row] for row in grid.cells],
                 "tokens": [[c.tokens for c in row] for row in grid.cells],
                 "finished": [[c.finished_here for c in row] for row in grid.cells]},
        "kind_colours": style.KIND_COLOURS,
        "title": title,
        "command": " ".join(record.get("command") or []) if isinstance(record.get("command"), list) else record.get("command"),
        "kind": record.get("kind"),
        "labels": labels,
        "colours": {lab: style.owner_colour(labels, lab) for lab in labels},
        "cached_colour": style.CACHED_COLOUR,
        "num_blocks": pool.num_blocks,
        "block_size": pool.block_size,
        "pool_from_evidence": pool.from_pool,
        "pool_notes": pool.notes,
        "steps": facts["steps"],
        "views": views,
        "built_by": built_by(page_dir),
        "attention": _attention_calls(record),
    }


def _inline_json(data: dict) -> str:
    """JSON that cannot end its <script> element early: every '<' written as the escape \\u003c."""
    return json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")


def explorer_html(record: dict, facts: dict, title: str, page_dir=None) -> str:
    data = explorer_data(record, facts, title, page_dir)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)}</title>
<style>{CSS}</style>
</head>
<body>
<header>
  <h1>{html.escape(title)}</h1>
  <p class="sub">{html.escape(str(data.get("command") or ""))} &middot; evidence kind {html.escape(str(data.get("kind")))}
  &middot; drawn from the evidence file only</p>
  <div id="controls">
    <button id="prev" title="previous step (left arrow)">&larr; Prev</button>
    <input id="slider" type="range" min="0" max="{len(data["steps"]) - 1}" value="0" step="1" aria-label="step">
    <button id="next" title="next step (right arrow)">Next &rarr;</button>
    <span id="where">step <b id="shown-step">?</b> of {len(data["steps"])} &middot; <span id="shown-phase"></span></span>
  </div>
</header>
<main>
  <section class="wide"><h2>The walk at a glance: who runs in each step (click a step; number: tokens scheduled, &#10003; finished)</h2><div id="strip"></div></section>
  <section><h2>The batch (as scheduled, and after postprocess)</h2><div id="batch"></div></section>
  <section><h2>The KV pool after this step</h2><div id="pool"></div></section>
  <section><h2>Block tables</h2><div id="tables"></div></section>
  <section><h2>Slot mapping (position &rarr; slot)</h2><div id="slots"></div></section>
  <section><h2>Shapes, cu_seqlens, max_seqlen</h2><div id="shapes"></div></section>
  <section><h2>Route and attention branch (lessons 7, 8)</h2><div id="attention"></div></section>
</main>
<noscript>This page needs JavaScript (no network: everything is in this file).</noscript>
<script type="application/json" id="walk-data">{_inline_json(data)}</script>
<script>{SCRIPT}</script>
</body>
</html>
"""


def embedded_data(page: str) -> dict:
    """The JSON a page inlines (for tests and for tools that read a page back)."""
    start = page.index('<script type="application/json" id="walk-data">') + len('<script type="application/json" id="walk-data">')
    end = page.index("</script>", start)
    return json.loads(page[start:end])
