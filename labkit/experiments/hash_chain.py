"""The prefix cache's hash chain (handbook B.6, course lesson 7): ``labkit principles hash``.

A full block's hash is ``chain_hash(its token ids, the previous block's hash)`` (the engine's own function,
``engine.chain_hash``), so a block's hash names the whole prefix up to its end: change one token and the
hash of its block and of every block after it changes; the blocks before it keep theirs.

Through the real engine (block size 16, each request run to its end before the next is admitted):

- P1: 3 full blocks + a tail of 7 tokens (55 tokens), on a fresh engine: nothing to hit;
- P2: P1 with one token changed in block 0: every hash differs from P1's, so nothing hits;
- P3: P1 with one token changed in block 2: blocks 0 and 1 keep P1's hashes and hit (P1's physical
  blocks, cached = 32), block 2 on misses.

The block ids are the sequences' block tables at their first schedule, the hits the engine's cached count
then (``cached // B`` leading blocks), the hashes ``engine.chain_hash`` over the prompt's blocks; after each
request the hashes the engine stored for its blocks (``EngineProbe.block_hashes``) are read and compared.
"""
from __future__ import annotations

from pathlib import Path

from engine import SamplingParams, chain_hash
from labkit.evidence import write_claimed
from labkit.experiments.quick_walk import StepRecorder
from labkit.lab_engine import build_engine, install_env_trace, synthetic_note

BLOCK_SIZE = 16
TAIL = 7
BASE = tuple(range(3000, 3000 + 3 * BLOCK_SIZE + TAIL))        # P1: 3 full blocks + a tail
CHANGES = {"P2": 0 * BLOCK_SIZE + 5, "P3": 2 * BLOCK_SIZE + 5}  # the one position each variant changes


def _hex(h: int | None) -> str | None:
    return None if h is None else f"{h:016x}"


def first_schedules(steps: list[dict]) -> dict[str, dict]:
    """Each label's first ``before`` snapshot, in admission order (the order they were first scheduled)."""
    out: dict[str, dict] = {}
    for st in steps:
        for s in st["before"]:
            out.setdefault(s["label"], s)
    return out


def chain_entry(label: str, token_ids: list[int], block_table: list[int], cached: int, block_size: int) -> dict:
    """One request's blocks: id, chained hash (None for the partial last block), parent, hit, token range."""
    blocks, parent = [], None
    hit_blocks = cached // block_size
    for i in range(-(-len(token_ids) // block_size)):
        first, last = i * block_size, min(len(token_ids), (i + 1) * block_size) - 1
        full = last - first + 1 == block_size
        h = chain_hash(token_ids[first:last + 1], -1 if parent is None else parent) if full else None
        blocks.append({"index": i, "block_id": block_table[i] if i < len(block_table) else None,
                       "hash": _hex(h), "parent": _hex(parent), "hit": i < hit_blocks,
                       "first_token": first, "last_token": last})
        if h is None:
            break
        parent = h
    return {"label": label, "num_tokens": len(token_ids), "blocks": blocks}


def hash_chain(steps: list[dict], prompts: dict[str, list[int]], block_size: int) -> list[dict]:
    """``facts.hash_chain``: every request of a walk in admission order (its first schedule's block table
    and cached count), hashed with the engine's chain_hash."""
    return [chain_entry(label, list(prompts[label]), s["block_table"], s["cached"], block_size)
            for label, s in first_schedules(steps).items()]


def _variant(label: str) -> list[int]:
    ids = list(BASE)
    if label in CHANGES:
        ids[CHANGES[label]] += 1000                     # a token P1 does not hold
    return ids


def _same_hashes(chain: dict[str, dict], label: str) -> list[bool]:
    """Per full block of P1: whether ``label``'s block at that index has P1's hash."""
    return [a["hash"] == b["hash"] for a, b in zip(chain["P1"]["blocks"], chain[label]["blocks"]) if a["hash"]]


def _walk(engine) -> tuple[list[dict], dict[str, list[int]], dict[str, list[str | None]]]:
    """Run P1, P2, P3 one after the other; the steps, the prompts and the hashes the engine stored."""
    labels: dict[int, str] = {}
    recorder = StepRecorder(labels)
    engine.events.subscribe(recorder)
    prompts, stored = {}, {}
    for label in ("P1", "P2", "P3"):
        prompts[label] = _variant(label)
        seq = engine.add_request(prompts[label], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        labels[seq.seq_id] = label
        while not engine.is_finished():
            engine.step()
        table = first_schedules(recorder.steps)[label]["block_table"]
        stored[label] = [_hex(h) for h in engine.probe.block_hashes(table)]
    return recorder.steps, prompts, stored


def run_hash(out: Path | None = None, model: str | None = None, device: str = "auto", attention: str = "auto") -> dict:
    built = build_engine(model, device, attention, kvcache_block_size=BLOCK_SIZE)
    engine = built.engine
    install_env_trace(engine)
    steps, prompts, stored = _walk(engine)
    chain = hash_chain(steps, prompts, BLOCK_SIZE)
    by_label = {c["label"]: c for c in chain}
    firsts = first_schedules(steps)
    facts = {
        "title": "the prefix cache's hash chain: one token changed in block 0, then in block 2 (B.6)",
        "block_size": BLOCK_SIZE,
        "requests": [{"label": k, "num_tokens": len(v), "changed_position": CHANGES.get(k)} for k, v in prompts.items()],
        "hash_chain": chain,
        "hits": {c["label"]: [b["hit"] for b in c["blocks"]] for c in chain},
        "cached": {k: s["cached"] for k, s in firsts.items()},
        "p2_same_hash_as_p1": _same_hashes(by_label, "P2"),
        "p3_same_hash_as_p1": _same_hashes(by_label, "P3"),
        "p3_hit_block_ids": [b["block_id"] for b in by_label["P3"]["blocks"] if b["hit"]],
        "p1_block_ids": [b["block_id"] for b in by_label["P1"]["blocks"]],
        # what the engine registered for each request's full blocks, read just after it finished
        "engine_stored_hashes": stored,
        "engine_hashes_match": all([b["hash"] for b in by_label[k]["blocks"]] == stored[k] for k in prompts),
        "num_steps": len(steps),
        "steps": steps,
        "note": synthetic_note(built.model),
    }
    facts["p3_shares_p1_blocks"] = bool(facts["p3_hit_block_ids"]) and \
        facts["p3_hit_block_ids"] == facts["p1_block_ids"][:len(facts["p3_hit_block_ids"])]
    record = write_claimed("principles.hash", out, "hash-chain.json", kind=built.kind, facts=facts,
                           device=built.device, model=built.model, seed=engine.config.seed, engine=built.describe())
    engine.close()
    return record
