"""A test fixture: a real walk's evidence brought up to the shared evidence schema (/work/briefs/schema.md).

The step recorder of today's tree keeps ``before``, ``after`` and part of ``inputs``; the schema adds
``inputs.input_ids``, ``inputs.max_seqlen_q/k``, ``inputs.block_tables``, ``after.pool`` and, for prefix
evidence, ``facts.hash_chain``. ``to_schema`` fills *only the fields that are missing*, from what the
evidence already holds (the prompts, the accepted tokens, the block tables, cu_seqlens) so that the
pictures can be developed and tested against the schema's shape while the recorder is being extended on
another branch. Once evidence carries these fields, ``to_schema`` leaves them as they are.

The pool is modelled as the engine keeps it: a block is owned while a live request's table holds it,
hashed once it is full (all its tokens in the cache), and a freed hashed block keeps its hash (free but
cached) until a table takes it again.
"""
from __future__ import annotations

import copy

import xxhash


def _pad(rows: list[list[int]]) -> list[list[int]]:
    width = max((len(r) for r in rows), default=0)
    return [r + [-1] * (width - len(r)) for r in rows]


def _fill_inputs(st: dict, tokens: dict[str, list[int]]) -> None:
    inp, before = st["inputs"], st["before"]
    if "input_ids" not in inp:
        if st["phase"] == "prefill":
            inp["input_ids"] = [t for s in before for t in tokens[s["label"]][s["cached"]:s["cached"] + s["scheduled"]]]
        else:
            inp["input_ids"] = [tokens[s["label"]][s["total"] - 1] for s in before]
    cu_q, cu_k = inp.get("cu_seqlens_q"), inp.get("cu_seqlens_k")
    if "max_seqlen_q" not in inp:
        inp["max_seqlen_q"] = max(b - a for a, b in zip(cu_q, cu_q[1:])) if cu_q else 1
        inp["max_seqlen_k"] = max(b - a for a, b in zip(cu_k, cu_k[1:])) if cu_k else max(inp["context_lens"])
    if "block_tables" not in inp:
        given = inp.get("has_block_tables", st["phase"] == "decode")
        inp["block_tables"] = _pad([s["block_table"] for s in before]) if given else None


def _fill_pool(st: dict, tables: dict[str, list[int]], cached: dict[str, int], hashed: set[int],
               num_blocks: int, block_size: int) -> None:
    after = st["after"]
    for s in after["seqs"]:
        tables[s["label"]], cached[s["label"]] = list(s["block_table"]), s["cached"]
    for lab in after["finished"]:
        tables.pop(lab, None)
    owners: dict[int, list[str]] = {}
    for lab, table in tables.items():
        for b in table:
            owners.setdefault(b, []).append(lab)
    full = {b for lab, table in tables.items() for k, b in enumerate(table) if (k + 1) * block_size <= cached[lab]}
    kept = {b for b in hashed if b not in owners}       # freed blocks keep their hash; a block taken again loses it
    hashed.clear()
    hashed.update(full | kept)
    if "pool" not in after:
        ids = sorted(set(owners) | hashed)
        after["pool"] = {"num_blocks": num_blocks, "block_size": block_size,
                         "blocks": [{"id": b, "ref_count": len(owners.get(b, [])), "hashed": b in hashed,
                                     "owners": owners.get(b, [])} for b in ids]}


def hash_chain(steps: list[dict], prompts: dict[str, list[int]], block_size: int) -> list[dict]:
    """One entry per request in admission order: its blocks at its first schedule, chained hashes of the
    full blocks (xxh64 of the parent's hash and the block's tokens), hit = the block was cached then."""
    out, seen = [], set()
    for st in steps:
        for s in st["before"]:
            if s["label"] in seen:
                continue
            seen.add(s["label"])
            toks, parent, blocks = prompts[s["label"]], None, []
            for i, b in enumerate(s["block_table"]):
                chunk = toks[i * block_size:(i + 1) * block_size]
                if not chunk:
                    break
                full = len(chunk) == block_size
                h = xxhash.xxh64(((parent or "") + ",".join(map(str, chunk))).encode()).hexdigest() if full else None
                blocks.append({"index": i, "block_id": b, "hash": h, "parent": parent,
                               "hit": full and (i + 1) * block_size <= s["cached"],
                               "first_token": i * block_size, "last_token": i * block_size + len(chunk) - 1})
                parent = h
            out.append({"label": s["label"], "num_tokens": len(toks), "blocks": blocks})
    return out


def to_schema(record: dict, prompts: dict[str, list[int]], num_blocks: int | None = None,
              with_hash_chain: bool = False) -> dict:
    """A deep copy of ``record`` whose facts follow schema.md (missing fields filled, present ones kept)."""
    rec = copy.deepcopy(record)
    facts = rec["facts"]
    bs = facts["options"]["block_size"]
    num_blocks = num_blocks or facts.get("num_blocks") or 64
    tokens = {lab: list(p) for lab, p in prompts.items()}
    tables: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    hashed: set[int] = set()
    for st in facts["steps"]:
        _fill_inputs(st, tokens)
        for lab, tok in st["after"]["accepted"].items():
            tokens[lab].append(tok)
        _fill_pool(st, tables, cached, hashed, num_blocks, bs)
    if with_hash_chain and "hash_chain" not in facts:
        facts["hash_chain"] = hash_chain(facts["steps"], prompts, bs)
    return rec
