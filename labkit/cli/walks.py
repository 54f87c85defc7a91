"""``labkit quick-walk --case lifecycle|prefix``: the walks of docs/LAB.md §4 and §18, beside cases A-D.

Called by the ``quick-walk`` command in labkit/cli/app.py (which ends it through ``finish``); the walks
themselves are plain functions in labkit/experiments/lifecycle.py and prefix_walk.py.
"""
from __future__ import annotations

from labkit.console import console, dict_table, kv_table, note, readable
from labkit.console.setup import render_quick_walk
from labkit.errors import UserError


def walk_case(case: str, *, out, model, device: str, attention: str, budget: int, max_num_seqs, block_size: int,
              trace: bool, debug: bool, shapes: bool, json_out: bool, shuffle_blocks: int | None = None) -> dict:
    """Run the walk and print its tables (unless json_out); returns the record."""
    case = case.lower()
    if shapes and case != "lifecycle":
        raise UserError("--shapes is for cases A-E and lifecycle")
    if case == "lifecycle":
        from labkit.experiments.lifecycle import run_lifecycle

        record = run_lifecycle(out, model, device, attention, budget, max_num_seqs, block_size, shapes=shapes, trace=trace,
                               shuffle_blocks=shuffle_blocks, debug=debug)
        if not json_out:
            render_quick_walk(record)
            if record["facts"].get("model_note"):
                note(record["facts"]["model_note"])
    else:
        from labkit.experiments.prefix_walk import run_prefix

        record = run_prefix(out, model, device, attention, budget, max_num_seqs, block_size, trace=trace,
                            shuffle_blocks=shuffle_blocks, debug=debug)
        if not json_out:
            render_prefix(record)
    return record


def render_prefix(record: dict) -> None:
    """B's first schedule, the runner's tensors, the ref-count trace."""
    f = record["facts"]
    b, i = f["b_first"], f["b_inputs"]
    console.print(kv_table({
        "A": f"{f['a']['total']} tokens, blocks {f['a']['block_table']}",
        "B first schedule (total/cached/scheduled)": f"{b['total']}/{b['cached']}/{b['scheduled']}, blocks {b['block_table']}",
        "cu_seqlens_q / cu_seqlens_k": f"{i['cu_seqlens_q']} / {i['cu_seqlens_k']}",
        "positions": f"{i['first_position']}..{i['last_position']}",
        "block_tables given": readable(i["has_block_tables"]),
        f"ref counts of blocks {f['watched_blocks']}": " -> ".join(str(c) for c in f["ref_count_trace"]),
        "exactly 512 tokens (total/cached/scheduled)": f"{f['exact_512']['total']}/{f['exact_512']['cached']}/{f['exact_512']['scheduled']}",
    }, title=f"quick-walk prefix: {f['title']}"))
    if record["checkpoint"] is None:
        note("no checkpoint states the expectations for these options: facts recorded, nothing asserted")


def elide(values: list | None, head: int = 3, tail: int = 1, limit: int = 8) -> str:
    """A list in one short line: whole when it has at most ``limit`` items, else its first ``head`` and last
    ``tail`` items around an ellipsis, with the count: ``[0, 1, 2, … 511] (512)``."""
    if values is None:
        return "none"
    if len(values) <= limit:
        return "[" + ", ".join(map(str, values)) + "]"
    return "[" + ", ".join(map(str, values[:head])) + ", … " + ", ".join(map(str, values[-tail:])) + f"] ({len(values)})"


def inputs_rows(step: dict) -> dict[str, str]:
    """One step's runner inputs as (field, value) rows for a table."""
    inp, labels = step["inputs"], [s["label"] for s in step["before"]]
    if inp["block_tables"] is None:
        tables = "none (a fresh prefill: attention reads only this step's K/V)"
    else:
        tables = "\n".join(f"{lab}: {elide(row)}" for lab, row in zip(labels, inp["block_tables"]))
    return {
        "sequences (N)": f"{', '.join(labels)} ({len(labels)})",
        "input_shape": str(inp["input_shape"]),
        "input_ids": elide(inp["input_ids"]),
        "positions": elide(inp["positions"]),
        "slot_mapping": elide(inp["slot_mapping"]),
        "cu_seqlens_q": elide(inp["cu_seqlens_q"]),
        "cu_seqlens_k": elide(inp["cu_seqlens_k"]),
        "max_seqlen_q / max_seqlen_k": f"{inp['max_seqlen_q']} / {inp['max_seqlen_k']}",
        "context_lens": elide(inp["context_lens"]),
        "block_tables (-1 = padding)": tables,
    }


def render_inputs(record: dict) -> None:
    """``--inputs``: one table per step of the evidence's ``facts.steps``, exactly as the model received them."""
    from rich.table import Table

    for step in record["facts"].get("steps") or []:
        table = Table(title=f"step {step['step']} ({step['phase']}): the runner's inputs", title_justify="left",
                      show_header=False)
        table.add_column("field", style="bold", no_wrap=True)
        table.add_column("value", overflow="fold")
        for k, v in inputs_rows(step).items():
            table.add_row(k, v)
        console.print(table)
    derived = record["facts"].get("derived") or {}
    if "inputs_consistent" in derived:
        console.print(f"inputs consistent with the scheduled batch: {str(derived['inputs_consistent']).lower()} "
                      f"({derived['inputs_checked']} steps checked)")
def render_walk_shapes(record: dict) -> None:
    """--shapes on cases A-D: each step's T/N, the shapes every layer's hooks saw and the LM head's rows."""
    sh = record["facts"].get("shapes")
    if not sh:
        return
    m = sh["model"]
    rows = [{"step": s["step"], "phase": s["phase"], "embed [T,h]": _dims(s["embed"]),
             "Q": _dims((s["layer0"] or {}).get("q")), "K, V": _dims((s["layer0"] or {}).get("k")),
             "logits [N,V]": _dims(s["logits"]), "LM head rows": _list(s["lm_head_rows"]),
             "rule": _list(s["rows_by_rule"])} for s in sh["steps"]]
    console.print(dict_table(rows, title=f"model shapes per step (hidden {m['hidden']}, {m['q_heads']} q heads, "
                                         f"{m['kv_heads']} kv heads, head_dim {m['head_dim']}, {m['layers']} layers)"))
    console.print("Q, K, V of layer 0; every layer's are recorded ("
                  f"{'the same in all layers' if all(s['layers_same_as_layer0'] for s in sh['steps']) else 'they differ'}); "
                  "rule: cu_seqlens_q[1:] - 1 on a prefill, every row on a decode")
    console.print(f"shapes match the model's config: {readable(sh['shapes_match_config'])} "
                  f"({len(sh['mismatches'])} mismatches); LM head rows follow the rule: "
                  f"{readable(sh['lm_head_rows_follow_rule'])}")


def _dims(shape) -> str:
    return "-" if shape is None else "x".join(str(d) for d in shape)


def _list(values) -> str:
    return "-" if values is None else ",".join(str(v) for v in values)
