"""Lesson 7's picture (``<stem>.attention.png``): the branches of ``Attention.forward`` and which one each
request took in each step of a walk, from the evidence's ``facts.steps[*].attention`` (the recorder's
per-sequence record) and ``facts.steps[*].route`` (the route ``ModelRunner.route_for`` chose).

Left: the call tree of one attention layer: the K/V write (``store_kv``, skipped when the fused q/k-norm +
RoPE kernel already wrote them), then the backend's three branches and the call each makes on the walk's
backend. Right: a step x request grid coloured by branch, each step's route under its column.
"""
from __future__ import annotations

from pathlib import Path

from labkit.pictures import style

BRANCHES = ("prefill-fresh", "prefill-cached", "decode")
BRANCH_COLOURS = {"prefill-fresh": "#3a7dc9", "prefill-cached": "#b07aa1", "decode": "#59a14f"}
BRANCH_TEXT = {
    "prefill-fresh": "prefill, nothing cached:\nattend to this step's own K/V",
    "prefill-cached": "prefill with a cached part (prefix hit\nor a later chunk): read K/V from the pages",
    "decode": "decode: one query per sequence,\nits whole context from the pages",
}
# the call each branch makes, per backend (engine/attention/*_backend.py)
BRANCH_CALLS = {
    "torch": {"prefill-fresh": "TorchAttention._prefill: SDPA on k, v (causal)",
              "prefill-cached": "TorchAttention._prefill: gather_kv(k_cache, table), masked SDPA",
              "decode": "TorchAttention._decode: pages masked by context_lens"},
    "triton": {"prefill-fresh": "fresh_prefill -> prefill_kernels.varlen_prefill",
               "prefill-cached": "prefill_kernels.paged_prefill (the whole step)",
               "decode": "triton_kernels.paged_decode"},
    "flash_attn": {"prefill-fresh": "flash_attn_varlen_func(q, k, v)",
                   "prefill-cached": "flash_attn_varlen_func(q, k_cache, v_cache, block_table) (the whole step)",
                   "decode": "flash_attn_with_kvcache(q, k_cache, v_cache)"},
}
# the torch backend picks a branch per sequence; triton and flash_attn per prefill step (block_tables given:
# every sequence of the step reads through the pages)
PER_STEP = {"triton", "flash_attn"}


def call_for(backend: str, branch: str) -> str:
    return BRANCH_CALLS.get(backend, BRANCH_CALLS["torch"]).get(branch, "?")


def taken(step: dict, backend: str) -> dict[str, str]:
    """label -> the branch the backend ran for it in this step (a per-step backend reads every prefill
    sequence of a step that has block_tables through the pages)."""
    rows = {a["label"]: a["branch"] for a in step.get("attention") or []}
    if backend in PER_STEP and step.get("phase") == "prefill" and (step.get("inputs") or {}).get("has_block_tables"):
        rows = {lab: "prefill-cached" for lab in rows}
    return rows


def has_branches(facts: dict) -> bool:
    return any(st.get("attention") for st in facts.get("steps") or [])


def draw_attention(facts: dict, labels: list[str], backend: str, path: Path, title: str) -> Path:
    from matplotlib.patches import FancyBboxPatch, Patch, Rectangle

    steps = [st for st in facts["steps"] if st.get("attention")]
    fused = any((st.get("route") or {}).get("fused") for st in steps)
    n_cols = len(steps)
    cell_w = style.clamp(7.0 / max(n_cols, 1), 0.42, 0.8)
    fig = style.figure(7.4 + 1.6 + cell_w * n_cols + 2.2, max(5.6, 1.9 + 0.55 * len(labels)))
    tree, grid = fig.subplots(1, 2, width_ratios=[7.4, 1.6 + cell_w * n_cols])

    # the call tree
    tree.set_xlim(0, 10)
    tree.set_ylim(0, 10)
    tree.axis("off")

    def box(x, y, w, h, text, colour="#f2f2f2", edge="#666666", size=8, weight="normal", fg="black"):
        tree.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.08", facecolor=colour, edgecolor=edge))
        tree.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, color=fg, weight=weight)

    def arrow(x0, y0, x1, y1, text=""):
        tree.annotate("", (x1, y1), (x0, y0), arrowprops={"arrowstyle": "->", "color": "#444444"})
        if text:
            tree.text((x0 + x1) / 2 + 0.1, (y0 + y1) / 2, text, fontsize=7, color="#444444", va="center")

    box(0.2, 8.6, 9.6, 1.0, "Attention.forward(q, k, v, meta, stored)  (engine/models/qwen3.py)", weight="bold")
    store = ("fused ops: qk_norm_rope wrote K/V (stored=True), store_kv skipped" if fused else
             "backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)\n(slot -1: no write; the plain path)")
    box(0.2, 6.8, 9.6, 1.2, store)
    arrow(5, 8.6, 5, 8.0)
    box(0.2, 5.0, 9.6, 1.2, f"backend.forward(q, k, v, k_cache, v_cache, meta)  [{backend}]\n"
        "branch: meta.is_prefill?  then does the sequence have a cached part (seqlen_k > seqlen_q)?")
    arrow(5, 6.8, 5, 6.2)
    xs = (0.2, 3.45, 6.7)
    for x, br in zip(xs, BRANCHES):
        arrow(5, 5.0, x + 1.55, 4.0, "")
        box(x, 2.2, 3.1, 1.7, BRANCH_TEXT[br], colour=BRANCH_COLOURS[br], edge=BRANCH_COLOURS[br], size=7, fg="white")
        tree.text(x + 1.55, 1.6, call_for(backend, br).replace(": ", ":\n", 1).replace(" (", "\n("), ha="center",
                  va="top", fontsize=6.5, family="monospace")

    # the walk: which branch each request took, per step
    for j, st in enumerate(steps):
        rows = taken(st, backend)
        for i, lab in enumerate(labels):
            br = rows.get(lab)
            if br is None:
                continue
            grid.add_patch(Rectangle((j, i), 1, 1, facecolor=BRANCH_COLOURS[br], edgecolor="white"))
            a = next(x for x in st["attention"] if x["label"] == lab)
            grid.text(j + 0.5, i + 0.5, f"{a['queries']}/{a['keys']}", ha="center", va="center", fontsize=7,
                      color="white")
    grid.set_xlim(0, max(n_cols, 1))
    grid.set_ylim(len(labels), 0)
    grid.set_yticks([i + 0.5 for i in range(len(labels))], labels)
    routes = [(st.get("route") or {}).get("route") or "?" for st in steps]
    grid.set_xticks([j + 0.5 for j in range(n_cols)], [f"{st['step']}\n{r}" for st, r in zip(steps, routes)],
                    fontsize=7)
    grid.set_xlabel("engine step, and its route (route_for)")
    grid.tick_params(length=0)
    for side in ("top", "right", "left", "bottom"):
        grid.spines[side].set_visible(False)
    grid.set_title("branch per request (cell: queries/keys)", fontsize=9, loc="left")
    style.title(fig, f"{title}\nlesson 7: Attention.forward's branches, and the one each request took", reserve_in=2.2)
    present = [b for b in BRANCHES if any(b in taken(st, backend).values() for st in steps)]
    fig.legend(handles=[Patch(facecolor=BRANCH_COLOURS[b], label=b) for b in present], loc="outside right upper",
               fontsize=8, frameon=False)
    notes = []
    if backend in PER_STEP:
        notes.append(f"{backend}: a prefill step with block_tables reads every sequence through the pages")
    if not fused:
        notes.append("plain path (no fused kernels: a CPU, or --no-fused-ops): store_kv writes K/V in every layer")
    style.add_notes(fig, notes)
    return style.save(fig, path)
