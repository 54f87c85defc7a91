"""What the engine pictures show, built from walk evidence only (``facts.steps``, ``facts.hash_chain``).

Plain data, no matplotlib: the drawing modules and the explorer read these, and the tests check them
against the evidence (a grid's cells are the steps x requests of the walk, a slot span's slots are the
runner's slot_mapping). The field names are those of /work/briefs/schema.md (the shared evidence schema).
Where a field is missing (evidence written before ``after.pool`` or ``inputs.block_tables`` were
recorded), the builders fall back to what is there and say so in ``notes``, which the pictures print.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from labkit.errors import UserError

# the kinds of a step x request cell, in legend order
KINDS = ("prefill chunk", "prefill", "decode", "running, not in this step", "waiting", "preempted", "finished")


def load_walk(path: Path) -> tuple[dict, dict]:
    """(record, facts) of an evidence file a picture can be drawn from; UserError otherwise."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"no evidence file at {path}")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path} is not JSON evidence ({e})") from None
    facts = record.get("facts") if isinstance(record, dict) else None
    if not isinstance(facts, dict):
        raise UserError(f"{path} has no facts: not evidence written by labkit")
    steps, chain = facts.get("steps"), facts.get("hash_chain")
    if not (isinstance(steps, list) and steps) and not (isinstance(chain, list) and chain):
        raise UserError(f"{path} has no step log (facts.steps) and no hash chain (facts.hash_chain): "
                        "nothing to draw (quick-walk evidence keeps its steps with --trace)")
    return record, facts


def request_labels(facts: dict) -> list[str]:
    """Request labels in the walk's order (facts.requests), then any others in order of appearance."""
    out = [r["label"] for r in facts.get("requests") or [] if isinstance(r, dict) and "label" in r]
    for st in facts.get("steps") or []:
        for s in [*st.get("before", []), *st.get("after", {}).get("seqs", [])]:
            if s["label"] not in out:
                out.append(s["label"])
        for lab in [*st.get("after", {}).get("waiting", []), *st.get("after", {}).get("running", [])]:
            if lab not in out:
                out.append(lab)
    return out


# --------------------------------------------------------------------------- step x request grid


@dataclass
class Cell:
    kind: str | None              # one of KINDS, None: not submitted yet
    tokens: int | None = None     # tokens scheduled in this step (None: not in the batch)
    finished_here: bool = False   # the request finished in this step


@dataclass
class StepGrid:
    labels: list[str]
    steps: list[int]
    phases: list[str]
    cells: list[list[Cell]]       # cells[row = request][column = step]


def step_grid(facts: dict) -> StepGrid:
    labels = request_labels(facts)
    steps = facts["steps"]
    cells = [[Cell(None) for _ in steps] for _ in labels]
    prefilled: set[str] = set()    # requests whose prompt is all in the KV cache (a wait after that = preempted)
    done: set[str] = set()
    for j, st in enumerate(steps):
        after = st.get("after", {})
        scheduled = {s["label"]: s for s in st.get("before", [])}
        decoding = {a["label"] for a in st.get("attention") or [] if a["branch"] == "decode"}   # a mixed step's decodes
        for i, lab in enumerate(labels):
            cell = cells[i][j]
            if lab in scheduled:
                s = scheduled[lab]
                cell.tokens = s["scheduled"]
                if st["phase"] == "decode" or lab in decoding:
                    cell.kind = "decode"
                elif s["cached"] + s["scheduled"] < s["total"]:
                    cell.kind = "prefill chunk"
                    prefilled.discard(lab)
                else:
                    cell.kind = "prefill"
                    prefilled.add(lab)
            elif lab in done:
                cell.kind = "finished"
            elif lab in after.get("waiting", []):
                cell.kind = "preempted" if lab in prefilled else "waiting"
            elif lab in after.get("running", []):
                cell.kind = "running, not in this step"
            if lab in after.get("finished", []):
                cell.finished_here = True
                done.add(lab)
    return StepGrid(labels, [st["step"] for st in steps], [st["phase"] for st in steps], cells)


# --------------------------------------------------------------------------- KV pool per step


@dataclass
class BlockState:
    owners: list[str]
    ref_count: int
    hashed: bool


@dataclass
class PoolView:
    steps: list[int]
    rows: list[dict[int, BlockState]]   # per step (after postprocess): block id -> state, free blocks absent
    num_blocks: int | None
    block_size: int | None
    shown: list[int]                    # the block ids drawn, in id order (a range, or the used ones)
    from_pool: bool                     # True: after.pool; False: derived from the block tables
    notes: list[str] = field(default_factory=list)
    released: list[dict[int, str]] = field(default_factory=list)   # per step: blocks the batch held, no longer owned after
    preempted: list[dict[int, str]] = field(default_factory=list)  # per step: blocks a preempted request gave back


def _released(steps: list[dict], rows: list[dict[int, BlockState]]) -> list[dict[int, str]]:
    """Per step, the blocks a scheduled request held during the step that nobody owns after it (the
    request finished in the step and gave them back), with that request's label."""
    out = []
    for st, row in zip(steps, rows):
        held = {b: s["label"] for s in st.get("before", []) for b in s["block_table"]}
        out.append({b: lab for b, lab in held.items() if not (b in row and row[b].owners)})
    return out


def _preempted(steps: list[dict]) -> list[dict[int, str]]:
    """Per step, the blocks of each request preempted by its schedule (not in the batch, back in waiting
    after the step while it held blocks before it), with that request's label: Scheduler.preempt freed them."""
    tables: dict[str, list[int]] = {}
    out = []
    for st in steps:
        after = st.get("after", {})
        batch = {s["label"] for s in st.get("before", [])}
        gone = {}
        for lab in after.get("waiting", []):
            if lab not in batch and tables.get(lab):
                gone.update({b: lab for b in tables[lab]})
                tables[lab] = []
        _follow_tables(tables, st)
        out.append(gone)
    return out


def _follow_tables(tables: dict[str, list[int]], st: dict) -> None:
    """Each request's latest block table after step ``st`` (as scheduled, then after postprocess); a finished
    request's is dropped."""
    after = st.get("after", {})
    for s in st.get("before", []) + after.get("seqs", []):
        tables[s["label"]] = list(s["block_table"])
    for lab in after.get("finished", []):
        tables.pop(lab, None)


def _derived_rows(steps: list[dict]) -> list[dict[int, BlockState]]:
    """Owners from the block tables alone (evidence without after.pool): each live request's latest
    table; a block in two tables is shared. Cached (free but hashed) blocks cannot be known."""
    tables: dict[str, list[int]] = {}
    rows = []
    for st in steps:
        _follow_tables(tables, st)
        row: dict[int, BlockState] = {}
        for lab, table in tables.items():
            for b in table:
                row.setdefault(b, BlockState([], 0, False)).owners.append(lab)
        for b in row.values():
            b.ref_count = len(b.owners)
        rows.append(row)
    return rows


def _shown_blocks(used: list[int], num_blocks: int | None, max_blocks: int, notes: list[str]) -> tuple[list[int], list[str]]:
    """The whole pool when it is small; else the used id range, or only the used ids when they lie far
    apart (a shuffled free list); at most ``max_blocks``. Each choice is said in a note."""
    if num_blocks and num_blocks <= max_blocks:
        return list(range(num_blocks)), notes
    if used and used[-1] - used[0] + 1 <= max_blocks:
        shown = list(range(used[0], used[-1] + 1))
    else:
        shown = used[:max_blocks]
        if used:
            notes.append("only the blocks the walk used are drawn (their ids are not contiguous)")
        if len(used) > max_blocks:
            notes.append(f"{len(used) - max_blocks} more used blocks (ids {used[max_blocks]}..{used[-1]}) not drawn")
    if num_blocks:
        notes.append(f"pool: {num_blocks} blocks; the {num_blocks - len(shown)} not drawn stay free in every step")
    else:
        notes.append("pool size not in this evidence: the blocks the walk used are drawn")
    return shown, notes


def pool_view(facts: dict, max_blocks: int = 48) -> PoolView:
    steps = facts["steps"]
    pools = [st.get("after", {}).get("pool") for st in steps]
    notes: list[str] = []
    if all(isinstance(p, dict) for p in pools):
        rows = [{int(b["id"]): BlockState(list(b.get("owners", [])), int(b["ref_count"]), bool(b["hashed"]))
                 for b in p["blocks"]} for p in pools]
        num_blocks, block_size, from_pool = pools[0]["num_blocks"], pools[0]["block_size"], True
    else:
        rows = _derived_rows(steps)
        num_blocks = facts.get("num_blocks")
        block_size = (facts.get("options") or {}).get("block_size")
        from_pool = False
        notes.append("after.pool not in this evidence: owners from the block tables; "
                     "ref counts = tables holding the block; cached (free, hashed) blocks not known")
    used = sorted({b for row in rows for b in row} | {b for st in steps for s in st.get("before", []) for b in s["block_table"]})
    shown, notes = _shown_blocks(used, num_blocks, max_blocks, notes)
    return PoolView([st["step"] for st in steps], rows, num_blocks, block_size, shown, from_pool, notes,
                    _released(steps, rows), _preempted(steps))


# --------------------------------------------------------------------------- one step's flat batch


@dataclass
class Span:
    """A run of one request's tokens in the flat batch that lands in one KV block, slot after slot."""
    label: str
    batch_start: int      # index in the flat batch (input_ids row)
    length: int
    position: int         # the first token's position in its request
    block_id: int
    first_slot: int       # the first token's slot (block_id * block_size + offset)


@dataclass
class SlotView:
    step: int
    phase: str
    num_tokens: int
    block_size: int
    labels: list[str]                   # the batch's requests in order
    cu_seqlens_q: list[int]
    spans: list[Span]
    tables: dict[str, list[int]]        # each request's block table in this step
    cached: dict[str, int]              # tokens already in the cache before this step (not in the batch)
    notes: list[str] = field(default_factory=list)


def takes_new_block(st: dict, block_size: int | None) -> bool:
    """A decode step that writes some sequence's token into the first slot of a block (the block
    may_append just gave it): a position that is a multiple of the block size."""
    positions = (st.get("inputs") or {}).get("positions") or []
    return st["phase"] == "decode" and bool(block_size) and any(p % block_size == 0 for p in positions)


def step_block_size(facts: dict, st: dict | None = None) -> int | None:
    pool = ((st or {}).get("after") or {}).get("pool") or {}
    return pool.get("block_size") or (facts.get("options") or {}).get("block_size")


def pick_slot_step(steps: list[dict], block_size: int | None = None) -> dict:
    """The first mixed step (decodes and prefill chunks at once), else the first prefill step with more than
    one sequence, else the first prefill that starts after a
    prefix-cache hit (cached > 0 on its first schedule), else the first decode step that takes a new block
    (case C: position 256 goes to the first slot of the request's second block), else the first prefill,
    else the first step."""
    prefills = [st for st in steps if st["phase"] == "prefill"]
    multi = [st for st in prefills if len(st.get("before", [])) > 1]
    seen: set[str] = set()
    hits = []
    for st in prefills:
        if any(s["label"] not in seen and s["cached"] > 0 for s in st.get("before", [])):
            hits.append(st)
        seen |= {s["label"] for s in st.get("before", [])}
    new_block = [st for st in steps if takes_new_block(st, block_size)]
    mixed = [st for st in steps if st["phase"] == "mixed"]
    return (mixed or multi or hits or new_block or prefills or steps)[0]


def _owners(st: dict) -> list[str]:
    inp, before = st["inputs"], st.get("before", [])
    cu = inp.get("cu_seqlens_q")
    if st["phase"] in ("prefill", "mixed") and cu:       # a mixed step's decode rows are one-token rows of cu
        return [before[i]["label"] for i in range(len(before)) for _ in range(cu[i + 1] - cu[i])]
    return [s["label"] for s in before]


def slot_view(facts: dict, step: dict | None = None) -> SlotView:
    """The flat batch of ``step`` (default: :func:`pick_slot_step`) cut into spans."""
    st = step or pick_slot_step(facts["steps"], step_block_size(facts, (facts.get("steps") or [{}])[0]))
    inp = st.get("inputs") or {}
    if not inp.get("slot_mapping"):
        raise UserError(f"step {st['step']} has no recorded slot_mapping")
    bs = (st.get("after", {}).get("pool") or {}).get("block_size") or (facts.get("options") or {}).get("block_size")
    if not bs:
        raise UserError("the evidence names no block size (facts.options.block_size)")
    owners, positions, slots = _owners(st), inp["positions"], inp["slot_mapping"]
    spans: list[Span] = []
    for k, (lab, pos, slot) in enumerate(zip(owners, positions, slots)):
        last = spans[-1] if spans else None
        if (last and last.label == lab and slot // bs == last.block_id and pos == last.position + last.length
                and slot == last.first_slot + last.length):
            last.length += 1
        else:
            spans.append(Span(lab, k, 1, pos, slot // bs, slot))
    labels = [s["label"] for s in st.get("before", [])]
    cu = inp.get("cu_seqlens_q") or list(range(len(labels) + 1))
    notes = [] if "block_tables" in inp else \
        ["inputs.block_tables not in this evidence: tables as scheduled (before)"]
    return SlotView(st["step"], st["phase"], len(slots), int(bs), labels, list(cu), spans,
                    {s["label"]: list(s["block_table"]) for s in st.get("before", [])},
                    {s["label"]: s["cached"] for s in st.get("before", [])}, notes)


# --------------------------------------------------------------------------- prefix hash chain


def hash_rows(facts: dict) -> list[dict]:
    """facts.hash_chain as drawn: per request its label and blocks (index, block_id, short hash, parent,
    hit, token range). Raises UserError when the evidence has no hash chain."""
    chain = facts.get("hash_chain")
    if not isinstance(chain, list) or not chain:
        raise UserError("no facts.hash_chain in this evidence")
    rows = []
    for req in chain:
        blocks = []
        for b in req["blocks"]:
            blocks.append({**b, "short": (b.get("hash") or "")[:8] or None,
                           "parent_short": (b.get("parent") or "")[:8] or None})
        rows.append({"label": req["label"], "num_tokens": req["num_tokens"], "blocks": blocks})
    return rows
