"""The pictures' shared look: matplotlib on Agg, one colour per request in every picture, one per cell
kind, the saved size (figure inches x DPI, no tight crop, so the size is known before drawing)."""
from __future__ import annotations

from pathlib import Path

DPI = 100

# one colour per request label, the same in every picture of a walk (and in the explorer)
OWNER_COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#9c755f", "#ff9da7")
CACHED_COLOUR = "#c9c3e6"        # free but still hashed: a prefix-cache hit can take it back
HIT_COLOUR = "#8fd19e"
MISS_COLOUR = "#d9d9d9"

KIND_COLOURS = {
    "prefill chunk": "#a6c8ec",
    "prefill": "#3a7dc9",
    "decode": "#59a14f",
    "running, not in this step": "#eef4ea",
    "waiting": "#f6e7a6",
    "preempted": "#e15759",
    "finished": "#e6e6e6",
}
# text on a cell of this kind: white on the dark ones
KIND_TEXT = {"prefill": "white", "decode": "white", "preempted": "white"}


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def owner_colour(labels: list[str], label: str) -> str:
    return OWNER_COLOURS[labels.index(label) % len(OWNER_COLOURS)] if label in labels else "#999999"


def figure(width_in: float, height_in: float):
    plt = pyplot()
    fig = plt.figure(figsize=(width_in, height_in), dpi=DPI, layout="constrained")
    return fig


def title(fig, text: str, reserve_in: float = 0.0) -> None:
    """The figure's title, top left, each line wrapped to the width left of a legend ``reserve_in`` wide."""
    import textwrap

    width = max(30, int((fig.get_figwidth() - reserve_in) * DPI / 7.2))   # characters of 10 pt text
    lines = [w for line in text.split("\n") for w in textwrap.wrap(line, width)]
    fig.suptitle("\n".join(lines), fontsize=10, x=0.01, ha="left")


def add_notes(fig, notes: list[str]) -> None:
    """The picture's caveats (missing fields, blocks not drawn), one line each, under the plot."""
    import textwrap

    if notes:
        width = int(fig.get_figwidth() * DPI / 6.2)       # characters of 8 pt text that fit on one line
        lines = [line for n in notes for line in textwrap.wrap(f"note: {n}", width, subsequent_indent="  ")]
        fig.supxlabel("\n".join(lines), fontsize=8, color="#555555", ha="left", x=0.01)


def save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=DPI)
    pyplot().close(fig)
    return path


def clamp(value: float, lo: float, hi: float) -> float:
    return max(lo, min(hi, value))
