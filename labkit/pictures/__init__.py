"""Pictures of the engine, drawn from walk evidence (never from a second run).

``draw_walk(EVIDENCE)`` writes, next to the evidence file, each picture its facts support:

- ``<stem>.steps.png``  step x request grid: phase and tokens scheduled per cell (facts.steps)
- ``<stem>.kv.png``     the KV pool after each step: owner, sharing, cached blocks (facts.steps[].after)
- ``<stem>.slots.png``  one step's flat batch, position -> slot into the KV blocks (facts.steps[].inputs);
  ``draw_step(EVIDENCE, N)`` draws step N's as ``<stem>.step-N.slots.png``
- ``<stem>.hash.png``   the prefix hash chain, hit or miss per block (facts.hash_chain)
- ``<stem>.attention.png``  Attention.forward's branches and the one each request took per step
  (facts.steps[].attention, .route)

``write_explorer(EVIDENCE)`` writes ``<stem>.html``, one offline page to step through the walk. The
evidence file is only read: pictures are derived, they change neither the file nor its digest.
"""
from __future__ import annotations

from pathlib import Path

from labkit.pictures.walkdata import load_walk


def picture_path(evidence: Path, name: str) -> Path:
    """``runs/quick-walk-a.json`` + ``steps`` -> ``runs/quick-walk-a.steps.png`` (``html``: ``.html``)."""
    evidence = Path(evidence)
    return evidence.with_name(f"{evidence.stem}.html") if name == "html" else evidence.with_name(f"{evidence.stem}.{name}.png")


def _title(record: dict, facts: dict) -> str:
    case = facts.get("case")
    head = f"quick-walk {case}" if case else (record.get("checkpoint") or "walk")
    return f"{head}: {facts['title']}" if facts.get("title") else head


def step_named(facts: dict, number: int) -> dict:
    """The step numbered ``number`` in facts.steps (UserError naming the steps there are)."""
    from labkit.errors import UserError

    steps = facts.get("steps") or []
    for st in steps:
        if st["step"] == number:
            if not (st.get("inputs") or {}).get("slot_mapping"):
                raise UserError(f"--step {number}: that step has no recorded slot_mapping")
            return st
    have = [st["step"] for st in steps]
    raise UserError(f"--step {number}: no such step in this evidence (steps {have[0]}..{have[-1]})" if have else
                    f"--step {number}: this evidence has no step log (facts.steps)")


def draw_step(evidence_path: str | Path, number: int) -> Path:
    """The slot picture of step ``number``: ``<stem>.step-N.slots.png``."""
    from labkit.pictures import slots, walkdata

    evidence_path = Path(evidence_path)
    record, facts = load_walk(evidence_path)
    st = step_named(facts, number)
    grid = walkdata.step_grid(facts)
    return slots.draw_slots(walkdata.slot_view(facts, st), grid.labels,
                            picture_path(evidence_path, f"step-{number}.slots"), _title(record, facts))


def draw_walk(evidence_path: str | Path) -> list[Path]:
    """Draw every picture the evidence supports; returns the files written (UserError: nothing to draw)."""
    from labkit.pictures import grids, walkdata

    evidence_path = Path(evidence_path)
    record, facts = load_walk(evidence_path)
    title = _title(record, facts)
    written: list[Path] = []
    if facts.get("steps"):
        grid = walkdata.step_grid(facts)
        written.append(grids.draw_steps(grid, picture_path(evidence_path, "steps"),
                                        f"{title}\nwho runs in each step, and how many tokens"))
        view = walkdata.pool_view(facts)
        written.append(grids.draw_kv(view, grid.labels, grid.phases, picture_path(evidence_path, "kv"),
                                     f"{title}\nthe KV pool after each step: which request owns each block"))
        if any(st.get("inputs", {}).get("slot_mapping") for st in facts["steps"]):
            from labkit.pictures import slots

            sv = walkdata.slot_view(facts)
            written.append(slots.draw_slots(sv, grid.labels, picture_path(evidence_path, "slots"), title))
        from labkit.pictures import attention

        if attention.has_branches(facts):
            backend = (record.get("engine") or {}).get("attention_backend") or "torch"
            written.append(attention.draw_attention(facts, grid.labels, backend,
                                                    picture_path(evidence_path, "attention"), title))
    if facts.get("hash_chain"):
        from labkit.pictures import hashes

        rows = walkdata.hash_rows(facts)
        written.append(hashes.draw_hash(rows, request_order(facts, rows), picture_path(evidence_path, "hash"), title))
    return written


def request_order(facts: dict, rows: list[dict]) -> list[str]:
    from labkit.pictures.walkdata import request_labels

    labels = request_labels(facts)
    return labels + [r["label"] for r in rows if r["label"] not in labels]


def write_explorer(evidence_path: str | Path) -> Path:
    """Write the walk's offline explorer page ``<stem>.html`` next to the evidence."""
    from labkit.pictures.explorer import explorer_html

    evidence_path = Path(evidence_path)
    record, facts = load_walk(evidence_path)
    out = picture_path(evidence_path, "html")
    out.write_text(explorer_html(record, facts, _title(record, facts), out.parent), encoding="utf-8")
    return out


def draw_all(evidence_path: str | Path) -> list[Path]:
    """The pictures and, when the evidence has a step log, the explorer page."""
    written = draw_walk(evidence_path)
    _, facts = load_walk(Path(evidence_path))
    if facts.get("steps"):
        written.append(write_explorer(evidence_path))
    return written


__all__ = ["draw_all", "draw_step", "draw_walk", "picture_path", "write_explorer"]
