"""One step's flat batch and where its tokens' K/V land (``<stem>.slots.png``).

Top: the step's input row as the model receives it (all requests' tokens one after another,
``cu_seqlens_q`` marking where each request starts). Bottom: the KV blocks of the batch's block tables,
each ``block_size`` slots wide, drawn in block-id order (the pages as they lie in the pool). An arrow
goes from each *span* (a run of one request's tokens that lands in one block, slot after slot) to the
slots it is written to. Per-span, not per-token: with the lab's block size of 256 and hundreds of tokens
per step, one arrow per token is a grey smear; one per span shows what the runner computed
(slot = block_table[pos // B] * B + pos % B). With small batches (<= 96 tokens) and small blocks
(<= 32 slots) the token and slot boundaries are drawn too. The part of a block that was already in
the cache before the step (an earlier chunk, a prefix hit) is hatched.
"""
from __future__ import annotations

import itertools
from pathlib import Path

from labkit.pictures import style
from labkit.pictures.walkdata import SlotView

GAP = 0.18          # between two blocks, in blocks
MAX_BLOCKS = 14


def shown_blocks(view: SlotView) -> list[int]:
    """The blocks drawn: those the batch writes to, then the rest of its tables, in block-id order."""
    written = {s.block_id for s in view.spans}
    others = {b for t in view.tables.values() for b in t} - written
    return sorted(written) + sorted(others)[:max(0, MAX_BLOCKS - len(written))]


def _block_x(view: SlotView, blocks: list[int]) -> dict[int, float]:
    order = sorted(blocks)
    return {b: k * view.block_size * (1 + GAP) for k, b in enumerate(order)}


def _span_text(s, width_in: float) -> str:
    last = s.position + s.length - 1
    pos = f"pos {s.position}" if s.length == 1 else f"pos {s.position}–{last}"
    if width_in >= 1.3:
        return f"{s.label}  {pos}\n{s.length} token{'s' if s.length != 1 else ''}"
    return s.label if width_in >= 0.25 else ""


def _draw_batch(top, view: SlotView, labels: list[str]) -> None:
    """The flat input row: one bar per span, cu_seqlens_q boundaries above it."""
    from matplotlib.patches import Rectangle

    T = view.num_tokens
    inch_per_token = 9.0 / max(T, 1)
    texts = [_span_text(s, s.length * inch_per_token) for s in view.spans]
    for s, text in zip(view.spans, texts):
        top.add_patch(Rectangle((s.batch_start, 0), s.length, 1, facecolor=style.owner_colour(labels, s.label),
                                edgecolor="white", linewidth=1.2))
        if text:
            top.text(s.batch_start + s.length / 2, 0.5, text, ha="center", va="center", fontsize=8, color="white")
    # runs of spans too narrow for their text (a mixed step's decode rows): one name each, above the bar beside it
    for narrow, run in itertools.groupby(zip(view.spans, texts), key=lambda st: not st[1]):
        if narrow:
            thin = [t for t, _ in run]
            name = "  ".join(f"{t.label} pos {t.position}" + (f"–{t.position + t.length - 1}" if t.length > 1 else "")
                             for t in thin)
            top.text(thin[-1].batch_start + thin[-1].length + T * 0.004, 1.08, name, ha="left", va="bottom",
                     fontsize=8, color=style.owner_colour(labels, thin[0].label) if len(thin) == 1 else "black",
                     bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5})
    if T <= 96:                    # token boundaries: short white ticks at the bar's bottom edge
        for k in range(1, T):
            top.plot([k, k], [0, 0.18], color="white", linewidth=0.8)
    ends = (0, len(view.cu_seqlens_q) - 1)
    groups: list[list[int]] = []           # boundaries closer than 0.2 inch (one-token rows) share one label
    for k, c in enumerate(view.cu_seqlens_q):
        top.plot([c, c], [-0.05, 1.35], color="black", linewidth=1.4 if k in ends else 1.0,
                 linestyle="-" if k in ends else "--")
        if groups and (c - groups[-1][-1]) * inch_per_token < 0.2:
            groups[-1].append(c)
        else:
            groups.append([c])
    for g in groups:
        top.text(g[0], 1.4, ", ".join(map(str, g)), ha="center" if len(g) == 1 else "left", va="bottom", fontsize=8)
    top.set_xlim(-T * 0.01, T * 1.01)
    top.set_ylim(-0.1, 1.75)
    top.axis("off")
    top.set_title(f"the flat batch as the model receives it: T = {T} tokens in input_ids "
                  "(numbers above: cu_seqlens_q)", fontsize=9, loc="left")


def _draw_blocks(bottom, view: SlotView, labels: list[str], blocks: list[int], xs: dict[int, float]) -> bool:
    """The blocks as bars of block_size slots, the part cached before the step hatched; True if any was."""
    from matplotlib.patches import Rectangle

    bs, cached_patch = view.block_size, False
    for b in blocks:
        x0 = xs[b]
        bottom.add_patch(Rectangle((x0, 0), bs, 1, facecolor="white", edgecolor="#666666", linewidth=1.0))
        for lab, table in view.tables.items():
            done = min(bs, max(0, view.cached[lab] - table.index(b) * bs)) if b in table else 0
            if done:
                cached_patch = True
                bottom.add_patch(Rectangle((x0, 0), done, 1, facecolor=style.owner_colour(labels, lab), alpha=0.35,
                                           hatch="///", edgecolor="#666666", linewidth=0))
        owners = [lab for lab, t in view.tables.items() if b in t]
        bottom.text(x0 + bs / 2, -0.12, f"block {b}\nslots {b * bs}–{b * bs + bs - 1}\n{'+'.join(owners)}",
                    ha="center", va="top", fontsize=8)
        if bs <= 32:               # slot boundaries: short ticks at the block's bottom edge
            for k in range(1, bs):
                bottom.plot([x0 + k, x0 + k], [0, 0.15], color="#999999", linewidth=0.6, zorder=3)
    width = max(xs.values()) + bs if xs else bs
    bottom.set_xlim(-width * 0.01, width * 1.01)
    bottom.set_ylim(-1.5, 1.1)
    bottom.axis("off")
    # the caption under the blocks, not above them: the arrows come down from above
    bottom.text(-width * 0.01, -0.92, f"above: the KV blocks of this step's block tables ({bs} slots each, "
                "in block-id order)", ha="left", va="top", fontsize=9)
    return cached_patch


def _draw_arrows(fig, top, bottom, view: SlotView, labels: list[str], xs: dict[int, float]) -> None:
    """Each span written into its slots, and an arrow from the span in the batch to them."""
    from matplotlib.patches import ConnectionPatch, Rectangle

    bs = view.block_size
    width = max(xs.values()) + bs if xs else bs
    for s in view.spans:
        colour = style.owner_colour(labels, s.label)
        x0 = xs.get(s.block_id)
        if x0 is None:
            continue
        off = s.first_slot - s.block_id * bs
        bottom.add_patch(Rectangle((x0 + off, 0), s.length, 1, facecolor=colour, edgecolor="none"))
        fig.add_artist(ConnectionPatch(xyA=(s.batch_start + s.length / 2, -0.05), coordsA=top.transData,
                                       xyB=(x0 + off + s.length / 2, 1.02), coordsB=bottom.transData,
                                       arrowstyle="-|>", color=colour, linewidth=1.3, mutation_scale=12))
        text = f"slots {s.first_slot}–{s.first_slot + s.length - 1}" if s.length > 1 else f"slot {s.first_slot}"
        if s.length * 9.0 / width >= 0.9:
            bottom.text(x0 + off + s.length / 2, 0.5, text, ha="center", va="center", fontsize=8, color="white")
        else:                           # too narrow to hold its text: beside it, inside the block
            bottom.text(x0 + off + s.length + bs * 0.02, 0.5, text, ha="left", va="center", fontsize=8)


def draw_slots(view: SlotView, labels: list[str], path: Path, title: str) -> Path:
    from matplotlib.patches import Patch

    blocks = shown_blocks(view)
    xs = _block_x(view, blocks)
    bs = view.block_size
    fig = style.figure(12.0, 6.2 + 0.3 * len(view.notes))
    top, bottom = fig.subplots(2, 1, height_ratios=[1, 1.35])
    _draw_batch(top, view, labels)
    cached_patch = _draw_blocks(bottom, view, labels, blocks, xs)
    _draw_arrows(fig, top, bottom, view, labels, xs)
    fig.suptitle(f"{title}\nstep {view.step} ({view.phase}): each token's K/V goes to slot = "
                 f"block_table[pos // {bs}] × {bs} + pos % {bs}", fontsize=10, x=0.01, ha="left")
    handles = [Patch(facecolor=style.owner_colour(labels, lab), label=lab) for lab in view.labels]
    if cached_patch:
        handles.append(Patch(facecolor="#cccccc", hatch="///", edgecolor="#666666",
                             label="in the cache before this step"))
    handles.append(Patch(facecolor="white", edgecolor="#666666", label="free slots of the block"))
    bottom.legend(handles=handles, loc="lower left", ncols=len(handles), fontsize=8, frameon=False)
    notes = list(view.notes)
    left_out = len({b for t in view.tables.values() for b in t}) - len(blocks)
    if left_out > 0:
        notes.append(f"{left_out} more blocks of the tables not drawn")
    style.add_notes(fig, notes)
    return style.save(fig, path)
