"""`labkit multiturn` (handbook B.7): the second turn of a chat reuses the first turn's KV blocks.

Turn 1 is a user message through the chat template (thinking off), generated to its end. Turn 2 is the
same message, turn 1's answer as the assistant message, and a new question, through the template again.
Both token lists are compared: their common prefix, and where each continues after it. Turn 2 is then
scheduled in the same engine (its first ``scheduled`` event: cached / scheduled / block_table) and in a
fresh engine, the cold-cache control.

What can be reused is decided by the block manager, not by strings or session ids: only full blocks
whose tokens match, whose KV turn 1 computed (its last token never gets KV), and not turn 2's last
block (one token is always left to compute).
"""
from __future__ import annotations

from pathlib import Path

from engine import SamplingParams
from labkit.evidence import write_claimed
from labkit.lab_engine import build_engine

#: A long first question, so that turn 1 spans more than one 256-token block.
FIRST_QUESTION = " ".join(
    f"Note {i}: a request's KV cache keeps the keys and values of every position it has computed, "
    f"block by block." for i in range(1, 21)) + " Summarise these notes in one sentence."
SECOND_QUESTION = "Now say which blocks a second turn of this chat can reuse."


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _first_schedule(engine, ids: list[int]) -> dict:
    """Submit ``ids`` and run one step; the request's state as that step scheduled it."""
    seen: dict = {}

    def watch(event) -> None:
        if event.name == "scheduled" and not seen:
            for s in event.data["seqs"]:
                if s["seq_id"] == seq.seq_id:
                    seen.update({k: s[k] for k in ("total", "cached", "scheduled", "block_table")})

    unsubscribe = engine.events.subscribe(watch)
    seq = engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    try:
        while not engine.is_finished():
            engine.step()
    finally:
        unsubscribe()
    return seen


def run_multiturn(out: Path | None = None, model: str | None = None, device: str = "auto", attention: str = "auto",
                  max_tokens: int = 16) -> dict:
    built = build_engine(model, device, attention)
    engine = built.engine
    bs = engine.config.kvcache_block_size
    described = built.describe()
    try:
        turn1 = [{"role": "user", "content": FIRST_QUESTION}]
        ids1 = engine.encode(turn1)
        result = engine.generate([ids1], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))[0]
        answer_ids = result["token_ids"]
        answer = engine.tokenizer.decode(answer_ids, skip_special_tokens=True)
        turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": SECOND_QUESTION}]
        ids2 = engine.encode(turn2)
        full1 = ids1 + answer_ids                       # what turn 1 left in the cache (KV for all but the last)
        common_prompt = _common_prefix(ids1, ids2)
        common = _common_prefix(full1, ids2)
        computed1 = len(full1) - 1                       # positions turn 1 computed KV for
        lookup_blocks = -(-len(ids2) // bs) - 1          # turn 2's blocks minus its last one
        expected = bs * min(common // bs, computed1 // bs, lookup_blocks)
        same = _first_schedule(engine, ids2)
    finally:
        engine.close()
    fresh_built = build_engine(model, device, attention)
    try:
        fresh = _first_schedule(fresh_built.engine, ids2)
    finally:
        fresh_built.engine.close()
    tok = engine.tokenizer                               # loaded by turn 1 (the fresh engine's is the same files)
    show = lambda ids: tok.decode(ids)  # noqa: E731
    same["scheduled_is_rest"] = same.get("scheduled") == len(ids2) - same.get("cached", -1)
    facts = {
        "block_size": bs,
        "turn1": {"prompt_tokens": len(ids1), "answer_tokens": len(answer_ids), "tokens_with_answer": len(full1),
                  "head": show(ids1[:12]), "tail": show(ids1[-12:])},
        "turn2": {"prompt_tokens": len(ids2), "head": show(ids2[:12])},
        "answer_text": answer,
        "common_prefix_with_turn1_prompt": common_prompt,
        "common_prefix_tokens": common,
        "after_common": {"turn1": show(full1[common:common + 8]), "turn2": show(ids2[common:common + 8])},
        "expected_cached": expected,
        "expected_rule": "block_size x min(common prefix // B, positions turn 1 computed // B, turn 2's blocks - 1)",
        "turn2_same_engine": same,
        "turn2_fresh_engine": fresh,
        "cached_is_block_aligned_common_prefix": same.get("cached") == expected and expected % bs == 0,
        "suffix_starts_before_turn1_end": same.get("cached", 0) < len(full1),
        "recomputed_suffix_tokens": len(ids2) - same.get("cached", 0),
        "note": "synthetic model: the answer is random tokens; the template and the cache behave as with real weights"
        if built.model.get("synthetic") else None,
    }
    return write_claimed("principles.multiturn", out, "multiturn.json", kind=built.kind, facts=facts,
                         device=built.device, model=built.model, seed=built.engine.config.seed, engine=described)
