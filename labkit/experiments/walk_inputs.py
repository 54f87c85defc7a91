"""The runner's inputs of a walk, judged against the scheduler's view of the same step.

A step recorded by :class:`labkit.experiments.quick_walk.StepRecorder` holds what the scheduler handed the
runner (``before``: each sequence's total, cached, scheduled tokens and block table) and what the model
received (``inputs``). :func:`inputs_mismatches` recomputes, step by step, what the inputs must be from
``before`` alone and lists every disagreement:

- T = len(input_ids) = len(positions) = len(slot_mapping) = input_shape[0];
- prefill: cu_seqlens_q = [0, scheduled...] accumulated (so T = cu_seqlens_q[-1]), cu_seqlens_k the same
  over cached + scheduled, max_seqlen_q / max_seqlen_k their widest row, positions cached..cached+scheduled-1;
- mixed (decodes and prefill chunks in one step): as a prefill, and its leading decode rows' context_lens are
  their totals and their input ids the tokens they accepted last;
- decode: T = N, context_lens = the totals, max_seqlen_q = 1, max_seqlen_k = max(context_lens), each input
  id the token the sequence accepted last;
- block_tables given exactly when the attention reads pages (decode, or a prefill with a cached prefix), one
  row per sequence: its block table padded with -1 to the widest.
"""
from __future__ import annotations

from itertools import accumulate


def _cumulative(values: list[int]) -> list[int]:
    return [0, *accumulate(values)]


def _padded(tables: list[list[int]]) -> list[list[int]]:
    width = max((len(t) for t in tables), default=0)
    return [list(t) + [-1] * (width - len(t)) for t in tables]


def _expected(st: dict, last_token: dict[str, int]) -> dict:
    """What the runner's inputs of step ``st`` must be, from its scheduled sequences."""
    before = st["before"]
    if st["phase"] in ("prefill", "mixed"):
        lens_q = [s["scheduled"] for s in before]
        lens_k = [s["cached"] + s["scheduled"] for s in before]
        # a mixed step's leading decodes (one new token after all the rest) carry their context lengths
        decodes = []
        for s in before if st["phase"] == "mixed" else []:
            if s["scheduled"] != 1 or s["cached"] != s["total"] - 1:
                break
            decodes.append(s)
        want = {"cu_seqlens_q": _cumulative(lens_q), "cu_seqlens_k": _cumulative(lens_k),
                "max_seqlen_q": max(lens_q), "max_seqlen_k": max(lens_k),
                "context_lens": [s["total"] for s in decodes] or None,
                "positions": [p for s in before for p in range(s["cached"], s["cached"] + s["scheduled"])]}
        if decodes:
            want["input_ids_head"] = [last_token.get(s["label"]) for s in decodes]
        paged = any(s["cached"] for s in before)
    else:
        totals = [s["total"] for s in before]
        want = {"cu_seqlens_q": None, "cu_seqlens_k": None, "max_seqlen_q": 1, "max_seqlen_k": max(totals),
                "context_lens": totals, "positions": [t - 1 for t in totals],
                "input_ids": [last_token.get(s["label"]) for s in before]}
        paged = True
    want["T"] = len(want["positions"])
    want["block_tables"] = _padded([s["block_table"] for s in before]) if paged else None
    return want


def _step_mismatches(st: dict, last_token: dict[str, int]) -> list[dict]:
    inp, want = st["inputs"], _expected(st, last_token)
    bad = []
    lengths = {"input_shape[0]": inp["input_shape"][0], "input_ids": len(inp["input_ids"]),
               "positions": len(inp["positions"]), "slot_mapping": len(inp["slot_mapping"])}
    if any(n != want["T"] for n in lengths.values()):
        bad.append({"field": "T", "want": want["T"], "got": lengths})
    for key in ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "context_lens", "positions",
                "input_ids", "block_tables"):
        if key in want and inp[key] != want[key]:
            bad.append({"field": key, "want": want[key], "got": inp[key]})
    head = want.get("input_ids_head")
    if head is not None and inp["input_ids"][:len(head)] != head:
        bad.append({"field": "input_ids", "want": head, "got": inp["input_ids"][:len(head)]})
    if inp["has_block_tables"] != (inp["block_tables"] is not None):
        bad.append({"field": "has_block_tables", "want": inp["block_tables"] is not None, "got": inp["has_block_tables"]})
    return [{"step": st["step"], "phase": st["phase"], **b} for b in bad]


def inputs_mismatches(steps: list[dict]) -> tuple[int, list[dict]]:
    """(steps checked, every field of the runner's inputs that disagrees with the scheduled batch)."""
    last_token: dict[str, int] = {}
    bad: list[dict] = []
    for st in steps:
        bad += _step_mismatches(st, last_token)
        last_token.update(st["after"]["accepted"])
    return len(steps), bad


def inputs_facts(steps: list[dict]) -> dict:
    """The derived facts: ``inputs_checked``, ``inputs_mismatches`` (the first 20), ``inputs_consistent``."""
    checked, bad = inputs_mismatches(steps)
    return {"inputs_checked": checked, "inputs_mismatches": bad[:20], "inputs_consistent": checked > 0 and not bad}
