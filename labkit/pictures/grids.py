"""Two grids of a walk: who runs in each step (``<stem>.steps.png``) and the KV pool after each step
(``<stem>.kv.png``). Drawn from :mod:`labkit.pictures.walkdata` (the evidence only)."""
from __future__ import annotations

from pathlib import Path

from labkit.pictures import style
from labkit.pictures.walkdata import KINDS, PoolView, StepGrid


def steps_size(grid: StepGrid) -> tuple[float, float]:
    """Figure size in inches: a column per step, a row per request, the legend on the right."""
    cell_w = style.clamp(11.0 / max(len(grid.steps), 1), 0.42, 0.85)
    width = max(1.4 + cell_w * len(grid.steps) + 2.6, 6.5)
    height = 1.6 + 0.5 * len(grid.labels)
    return round(width, 2), round(max(height, 2.6), 2)


def draw_steps(grid: StepGrid, path: Path, title: str, notes: list[str] | None = None) -> Path:
    from matplotlib.patches import Patch, Rectangle

    fig = style.figure(*steps_size(grid))
    ax = fig.add_subplot()
    n_rows, n_cols = len(grid.labels), len(grid.steps)
    small = n_cols > 16
    for i, row in enumerate(grid.cells):
        for j, cell in enumerate(row):
            if cell.kind is None:
                continue
            ax.add_patch(Rectangle((j, i), 1, 1, facecolor=style.KIND_COLOURS[cell.kind],
                                   edgecolor="black" if cell.finished_here else "white",
                                   linewidth=2.2 if cell.finished_here else 1.0))
            text = "" if cell.tokens is None else str(cell.tokens)
            if cell.finished_here:
                text = f"{text} ✓".strip()
            if text:
                ax.text(j + 0.5, i + 0.5, text, ha="center", va="center", fontsize=7 if small else 9,
                        color=style.KIND_TEXT.get(cell.kind, "black"))
    ax.set_xlim(0, n_cols)
    ax.set_ylim(n_rows, 0)
    ax.set_yticks([i + 0.5 for i in range(n_rows)], grid.labels)
    phase = {"prefill": "P", "decode": "D"}
    ax.set_xticks([j + 0.5 for j in range(n_cols)],
                  [f"{s}\n{phase.get(p, p)}" for s, p in zip(grid.steps, grid.phases)], fontsize=8 if small else 9)
    ax.set_xlabel("engine step (P = prefill step, D = decode step)")
    ax.set_ylabel("request")
    ax.tick_params(length=0)
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)
    style.title(fig, title, reserve_in=2.6)
    present = [k for k in KINDS if any(c.kind == k for row in grid.cells for c in row)]
    handles = [Patch(facecolor=style.KIND_COLOURS[k], edgecolor="#999999", label=k) for k in present]
    handles.append(Patch(facecolor="white", edgecolor="black", linewidth=2.2, label="✓ finished in this step"))
    fig.legend(handles=handles, loc="outside right upper", fontsize=8, title="cell: tokens scheduled",
               title_fontsize=8, frameon=False)
    style.add_notes(fig, notes or [])
    return style.save(fig, path)


def kv_size(view: PoolView) -> tuple[float, float]:
    n = max(len(view.shown), 1)
    cell_w = style.clamp(9.0 / n, 0.22, 0.7)
    width = max(1.4 + cell_w * n + 2.6, 7.0)         # a one-block walk still has room for its title
    height = 1.7 + 0.42 * len(view.steps) + 0.3 * len(view.notes)
    return round(width, 2), round(max(height, 2.8), 2)


def draw_kv(view: PoolView, labels: list[str], phases: list[str], path: Path, title: str) -> Path:
    from matplotlib.patches import Patch, Rectangle

    width, _ = kv_size(view)
    fig = style.figure(*kv_size(view))
    ax = fig.add_subplot()
    col = {b: x for x, b in enumerate(view.shown)}
    n = max(len(view.shown), 1)
    roomy = (width - 4.0) / n >= 0.42
    owners_seen: list[str] = []
    for i, row in enumerate(view.rows):
        for b, state in row.items():
            if b not in col:
                continue
            x = col[b]
            if not state.owners:
                ax.add_patch(Rectangle((x, i), 1, 1, facecolor=style.CACHED_COLOUR, edgecolor="white"))
                continue
            k = len(state.owners)
            for m, lab in enumerate(state.owners):
                owners_seen += [lab] if lab not in owners_seen else []
                ax.add_patch(Rectangle((x, i + m / k), 1, 1 / k, facecolor=style.owner_colour(labels, lab),
                                       edgecolor="white", linewidth=0.5, hatch="///" if state.ref_count > 1 else None))
            if state.ref_count > 1:        # the ref count in a white box over the owners' stripes
                ax.text(x + 0.5, i + 0.5, str(state.ref_count), ha="center", va="center", fontsize=8,
                        fontweight="bold", bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none"})
            elif roomy:
                mark = " #" if state.hashed and view.from_pool else ""
                ax.text(x + 0.5, i + 0.5, state.owners[0] + mark, ha="center", va="center", fontsize=8, color="white")
    for i, released in enumerate(view.released):      # held during the step, given back at its end
        for b, lab in released.items():
            if b in col:
                ax.add_patch(Rectangle((col[b] + 0.06, i + 0.08), 0.88, 0.84, facecolor="none",
                                       edgecolor=style.owner_colour(labels, lab), linewidth=2.2))
    for i, gone in enumerate(view.preempted):         # freed by Scheduler.preempt before this step's forward
        for b, lab in gone.items():
            if b in col:
                ax.add_patch(Rectangle((col[b] + 0.06, i + 0.08), 0.88, 0.84, facecolor="none",
                                       edgecolor=style.KIND_COLOURS["preempted"], linewidth=2.0, linestyle="--"))
                if roomy:
                    ax.text(col[b] + 0.5, i + 0.5, f"{lab} ✗", ha="center", va="center", fontsize=7,
                            color=style.KIND_COLOURS["preempted"])
    ax.set_xlim(0, n)
    ax.set_ylim(len(view.rows), 0)
    ticks = [x for x in (range(n) if n <= 24 else range(0, n, max(1, n // 12))) if x < len(view.shown)]
    ax.set_xticks([x + 0.5 for x in ticks], [str(view.shown[x]) for x in ticks], fontsize=8)
    for x in range(1, len(view.shown)):        # ids not next to each other: a darker line between them
        if view.shown[x] != view.shown[x - 1] + 1:
            ax.axvline(x, color="#666666", linewidth=1.2, linestyle=":", zorder=3)
    phase = {"prefill": "P", "decode": "D"}
    ax.set_yticks([i + 0.5 for i in range(len(view.steps))],
                  [f"{s} {phase.get(p, p)}" for s, p in zip(view.steps, phases)], fontsize=9)
    ax.set_xlabel(f"KV block id (a block holds {view.block_size} tokens)" if view.block_size else "KV block id")
    ax.set_ylabel("after engine step")
    ax.tick_params(length=0)
    for x in range(n + 1):
        ax.axvline(x, color="#eeeeee", linewidth=0.6, zorder=0)
    style.title(fig, title, reserve_in=2.6)
    owners_seen += [lab for r in view.released for lab in r.values() if lab not in owners_seen]
    handles = [Patch(facecolor=style.owner_colour(labels, lab), label=f"owned by {lab}")
               for lab in labels if lab in owners_seen]
    if any(s.ref_count > 1 for row in view.rows for s in row.values()):
        handles.append(Patch(facecolor="#bbbbbb", hatch="///", edgecolor="white", label="shared (number: ref count)"))
    if view.from_pool:
        handles.append(Patch(facecolor=style.CACHED_COLOUR, label="free, hash kept (cached)"))
        if roomy and any(s.hashed and s.owners for row in view.rows for s in row.values()):
            handles.append(Patch(facecolor="none", edgecolor="none", label="# = full block, hashed"))
    if any(view.released):
        handles.append(Patch(facecolor="white", edgecolor="#555555", linewidth=2.2,
                             label="outline: held in the step,\ngiven back at its end"))
    if any(view.preempted):
        handles.append(Patch(facecolor="white", edgecolor=style.KIND_COLOURS["preempted"], linewidth=2.0,
                             linestyle="--", label="dashed, ✗: freed by a preemption\n(the request went back to waiting)"))
    handles.append(Patch(facecolor="white", edgecolor="#999999", label="free"))
    fig.legend(handles=handles, loc="outside right upper", fontsize=8, frameon=False)
    style.add_notes(fig, view.notes)
    return style.save(fig, path)
