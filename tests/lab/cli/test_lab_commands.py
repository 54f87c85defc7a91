"""docs/LAB.md's commands land on the checkpoints the guide names next to them.

Nothing is run: each ``labkit ...`` command written in a bullet that names checkpoints (or, for a bullet
with no command of its own, in its section's ``Run:`` bullet) is matched against the named checkpoints'
commands with the judge's own matcher (``command_mismatch``, the one ``claim`` uses). A command of the same
subcommand as a named checkpoint must land on one of them (else the reader's run is evidence for nothing),
and every named checkpoint must have a command in its block that lands on it.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from labkit.checks import command_mismatch, load_checkpoints
from labkit.checks.judging import _parse_words

LAB = Path(__file__).resolve().parents[3] / "docs" / "LAB.md"
_CODE_RE = re.compile(r"`([^`]+)`")
_LABEL_RE = re.compile(r"\b[Cc]heckpoints?:?\s")


def _sections(text: str) -> list[tuple[str, list[str]]]:
    """(heading, [bullet text joined on one line, ...]) for every ``## `` section."""
    out: list[tuple[str, list[str]]] = []
    bullets: list[str] | None = None
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        if line.startswith("## "):
            bullets = []
            out.append((line[3:].strip(), bullets))
        elif bullets is None:
            continue
        elif line.startswith("- "):
            bullets.append(line[2:])
        elif line.startswith("  ") and bullets and line.strip():
            bullets[-1] += " " + line.strip()
    return out


def _commands(bullet: str) -> list[str]:
    return [c for c in _CODE_RE.findall(bullet) if c.startswith("labkit ")]


def _named(bullet: str, stages: set[str]) -> list[str]:
    """The checkpoint ids a bullet names: backticked ``<stage>.<name>`` after its first ``Checkpoint`` label."""
    m = _LABEL_RE.search(bullet)
    if not m:
        return []
    return [c for c in _CODE_RE.findall(bullet[m.start():]) if re.fullmatch(r"[a-z]+\.[a-z0-9_.\-]+", c)
            and c.split(".", 1)[0] in stages]


def _head(words: list[str]) -> list[str]:
    return _parse_words(words)[0]


def lab_blocks(text: str) -> list[tuple[str, list[str], list[str]]]:
    """(section, [checkpoint ids it names], [its commands]) per section; the commands are those of the
    bullets that name checkpoints and of the section's ``Run`` bullet (where most sections give them)."""
    stages = {cp.stage for cp in load_checkpoints()}
    out = []
    for heading, bullets in _sections(text):
        ids: list[str] = []
        commands: list[str] = []
        for bullet in bullets:
            named = _named(bullet, stages)
            ids += [i for i in named if i not in ids]
            if named or bullet.startswith("Run"):
                commands += [c for c in _commands(bullet) if c not in commands]
        if ids:
            out.append((heading, ids, commands))
    return out


def problems(text: str) -> list[str]:
    """Every way the guide's commands miss the checkpoints it names beside them."""
    cps = {cp.id: cp for cp in load_checkpoints()}
    out = []
    for heading, ids, commands in lab_blocks(text):
        unknown = [i for i in ids if i not in cps]
        out += [f"§{heading}: names {i}, which is no checkpoint" for i in unknown]
        ids = [i for i in ids if i in cps]
        for cid in ids:
            if not any(not command_mismatch(cps[cid].command, c) for c in commands):
                out.append(f"§{heading}: no command next to {cid} lands on it "
                           f"(its command: {' '.join(cps[cid].command)})")
        for c in commands:
            same = [i for i in ids if _head(cps[i].command) == _head(shlex.split(c))]
            if same and all(command_mismatch(cps[i].command, c) for i in same):
                why = "; ".join(f"{i}: {command_mismatch(cps[i].command, c)}" for i in same)
                out.append(f"§{heading}: `{c}` lands on none of {', '.join(same)} ({why})")
    return out


def test_every_lab_command_lands_on_the_checkpoint_it_names():
    text = LAB.read_text(encoding="utf-8")
    assert sum(len(ids) for _, ids, _ in lab_blocks(text)) >= 40  # the guide names most checkpoints; a parser that finds none fails here
    assert problems(text) == []


def test_the_matcher_sees_a_command_that_misses_its_checkpoint():
    """§5's old text: `--max-num-batched-tokens 256` without --trace is evidence for no checkpoint."""
    text = ("## 5. x\n\n- Run: `labkit quick-walk --case D --max-num-batched-tokens 256`.\n"
            "- Checkpoints: `setup.quick-walk-d-256`, `setup.nope`.\n")
    found = problems(text)
    assert any("no command next to setup.quick-walk-d-256" in p for p in found), found
    assert any("lands on none of setup.quick-walk-d-256" in p and "--trace not given" in p for p in found), found
    assert any("setup.nope, which is no checkpoint" in p for p in found), found


@pytest.mark.parametrize("bullet, ids", [
    ("Checkpoint: `setup.smoke` (`facts.prompt_head`).", ["setup.smoke"]),
    ("`labkit smoke`. Checkpoints: `principles.tokenizer`, `principles.softmax`.",
     ["principles.tokenizer", "principles.softmax"]),
    ("no label `setup.smoke`", []),
])
def test_named_reads_only_checkpoint_ids_after_the_label(bullet, ids):
    assert _named(bullet, {cp.stage for cp in load_checkpoints()}) == ids
