"""The prefix cache's hash chain (``<stem>.hash.png``), from ``facts.hash_chain``.

One row per request in admission order, one box per block of its prompt: the block id it got, the first
8 hex digits of the block's hash and its token range. A block's hash is computed from its parent's
hash and its own tokens, so an arrow goes from each block to the next; green boxes were prefix-cache
hits (the block was reused, not recomputed), grey ones were misses; the last, partial block has no hash
(dashed). Change one token in block 0 and every later hash in that row changes: the row turns grey.
A request's last block is never looked up, even when it is full (BlockManager.cached_prefix walks
num_blocks - 1 blocks, so one token is always left to compute): such a block says so ("last block: not
looked up"), since it misses whatever the cache holds (the prefix walk's D: exactly 512 tokens).
"""
from __future__ import annotations

from pathlib import Path

from labkit.pictures import style

BOX_W, BOX_H, GAP = 1.9, 0.95, 0.55


def hash_size(rows: list[dict]) -> tuple[float, float]:
    n = max((len(r["blocks"]) for r in rows), default=1)
    width = 1.6 + n * (BOX_W + GAP) * 0.95 + 0.4
    height = 1.6 + 1.15 * len(rows)
    return round(style.clamp(width, 6.5, 22.0), 2), round(max(height, 2.8), 2)


def last_not_looked_up(row: dict, b: dict) -> bool:
    """The row's last block, full (hashed) and a miss: cached_prefix never looks the last block up."""
    return b["index"] == len(row["blocks"]) - 1 and b.get("short") is not None and not b.get("hit")


def _box_text(b: dict, last: bool = False) -> str:
    tokens = f"tokens {b['first_token']}–{b['last_token']}"
    if b.get("short") is None:
        return f"block {b['block_id']}\npartial: no hash\n{tokens}"
    if last:
        return f"block {b['block_id']} #{b['short']}\nlast block:\nnot looked up\n{tokens}"
    return f"block {b['block_id']}\n#{b['short']}\n{tokens}"


def draw_hash(rows: list[dict], labels: list[str], path: Path, title: str) -> Path:
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch

    fig = style.figure(*hash_size(rows))
    ax = fig.add_subplot()
    n = max((len(r["blocks"]) for r in rows), default=1)
    for i, row in enumerate(rows):
        y = -i * (BOX_H + 0.35)
        for b in row["blocks"]:
            x = b["index"] * (BOX_W + GAP)
            partial = b.get("short") is None
            face = style.HIT_COLOUR if b.get("hit") else style.MISS_COLOUR
            ax.add_patch(FancyBboxPatch((x, y), BOX_W, BOX_H, boxstyle="round,pad=0.02,rounding_size=0.08",
                                        facecolor=face, edgecolor="#333333", linewidth=1.0,
                                        linestyle="--" if partial else "-"))
            last = last_not_looked_up(row, b)
            ax.text(x + BOX_W / 2, y + BOX_H / 2, _box_text(b, last), ha="center", va="center",
                    fontsize=6.5 if last else 8, family="monospace")
            if b["index"] > 0:
                ax.add_patch(FancyArrowPatch((x - GAP + 0.03, y + BOX_H / 2), (x - 0.03, y + BOX_H / 2),
                                             arrowstyle="-|>", mutation_scale=11, color="#333333"))
        ax.text(-0.25, y + BOX_H / 2, f"{row['label']}\n{row['num_tokens']} tokens", ha="right", va="center",
                fontsize=9, color=style.owner_colour(labels, row["label"]))
    ax.set_xlim(-1.5, n * (BOX_W + GAP))
    ax.set_ylim(-(len(rows) - 1) * (BOX_H + 0.35) - 0.15, BOX_H + 0.15)
    ax.axis("off")
    style.title(fig, f"{title}\nthe prefix hash chain: hash(block) = f(hash(parent block), its tokens); "
                     "one row per request, in admission order")
    handles = [Patch(facecolor=style.HIT_COLOUR, edgecolor="#333333", label="hit: cached block reused"),
               Patch(facecolor=style.MISS_COLOUR, edgecolor="#333333", label="miss: computed"),
               Patch(facecolor=style.MISS_COLOUR, edgecolor="#333333", linestyle="--", label="partial block (no hash)")]
    fig.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=8, frameon=False,
               title="arrow: the child's hash is computed from its parent's; a request's last block is never "
                     "looked up (one token is always left to compute)", title_fontsize=8)
    return style.save(fig, path)
