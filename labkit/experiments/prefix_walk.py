"""Quick-walk case ``prefix`` (handbook B.6): a 512-token prefix hit and the shared blocks' ref counts.

Through the real engine (block size 256, prefill budget 512):

1. A (620 tokens: 512 shared + 108 of its own) runs to the end. Its full blocks are hashed; when it
   finishes they go back to the free list with ref count 0, their hashes kept.
2. B (the same 512 + 108 others) is submitted after A finished. Its first schedule (the ``scheduled``
   event) and the runner's tensors (the ``inputs`` event) show the hit: cached=512, scheduled=108,
   cu_seqlens_q [0,108], cu_seqlens_k [0,620], positions from 512, block_tables given.
3. C (the same 512 + 108 others) joins while B runs; B finishes first, then C.
   The ref counts of A's first two blocks (``EngineProbe.ref_counts``), read after every step and kept
   when they change: [0,0] -> [1,1] -> [2,2] -> [1,1] -> [0,0].
4. D is exactly the 512 shared tokens: only num_blocks - 1 = 1 block is looked up, so cached=256.
"""
from __future__ import annotations

from pathlib import Path

from engine import SamplingParams
from labkit.evidence import write_claimed
from labkit.experiments.hash_chain import hash_chain
from labkit.experiments.quick_walk import StepRecorder, slot_mismatches
from labkit.experiments.walk_inputs import inputs_facts
from labkit.lab_engine import build_engine, install_env_trace, synthetic_note

SHARED = tuple(range(1000, 1512))                       # 512 tokens = 2 full blocks of 256
TAILS = {"A": range(5000, 5108), "B": range(6000, 6108), "C": range(7000, 7108)}
MAX_TOKENS = {"A": 2, "B": 3, "C": 5, "D": 1}


def _first(steps: list[dict], label: str) -> tuple[dict, dict]:
    """The first step that scheduled ``label``: its snapshot and the step."""
    for st in steps:
        for s in st["before"]:
            if s["label"] == label:
                return s, st
    raise RuntimeError(f"{label} was never scheduled")


def _step_facts(steps: list[dict], prompts: dict[str, list[int]], block_size: int) -> dict:
    """Every slot against the block tables, the runner's inputs against the scheduled batches, and each
    request's blocks in admission order (ids, chained hashes, hits: the prefix picture's data)."""
    checked, bad = slot_mismatches(steps, block_size)
    return {"slots_checked": checked, "slot_mismatches": bad, "derived_slots_follow_formula": checked > 0 and not bad,
            **{f"derived_{k}": v for k, v in inputs_facts(steps).items()},
            "hash_chain": hash_chain(steps, prompts, block_size)}


def run_prefix(out: Path | None = None, model: str | None = None, device: str = "auto", attention: str = "auto",
               budget: int = 512, max_num_seqs: int | None = None, block_size: int = 256, trace: bool = False,
               shuffle_blocks: int | None = None, debug: bool = False) -> dict:
    built = build_engine(model, device, attention, max_num_batched_tokens=budget,
                         max_num_seqs=max_num_seqs, kvcache_block_size=block_size,
                         shuffle_blocks=shuffle_blocks)
    engine = built.engine
    install_env_trace(engine)
    if debug:                      # --debug: pdb before A is added (lesson 4's breakpoint stops at B's hit)
        from labkit.experiments.walk_debug import debug_prompt

        debug_prompt(engine)
    labels: dict[int, str] = {}
    recorder = StepRecorder(labels)
    engine.events.subscribe(recorder)
    seqs: dict[str, object] = {}

    def add(label: str, ids: list[int]):
        seq = engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[label], ignore_eos=True))
        labels[seq.seq_id] = label
        seqs[label] = seq
        return seq

    trace_counts: list[list[int]] = []
    watched: list[int] = []

    fused = bool(built.describe().get("fused_ops"))

    def step_and_read() -> None:
        recorder.route(engine.step(), fused)
        counts = engine.probe.ref_counts(watched)
        if not trace_counts or trace_counts[-1] != counts:
            trace_counts.append(counts)

    add("A", [*SHARED, *TAILS["A"]])
    while not engine.is_finished():
        recorder.route(engine.step(), fused)
    a_first, _ = _first(recorder.steps, "A")
    a_blocks = [s for st in recorder.steps for s in st["before"] if s["label"] == "A"][-1]["block_table"]
    watched[:] = a_blocks[:len(SHARED) // block_size]
    trace_counts.append(engine.probe.ref_counts(watched))
    add("B", [*SHARED, *TAILS["B"]])
    step_and_read()                                    # B's prefill (the hit)
    add("C", [*SHARED, *TAILS["C"]])
    while not engine.is_finished():
        step_and_read()
    add("D", list(SHARED))
    while not engine.is_finished():
        recorder.route(engine.step(), fused)
    steps = recorder.steps
    b_first, b_step = _first(steps, "B")
    d_first, _ = _first(steps, "D")
    inp = b_step["inputs"]
    facts = {
        "case": "prefix", "title": "a 620-token prompt after a cached 512-token prefix; ref counts (B.6)",
        "options": {"budget": budget, "max_num_seqs": engine.config.max_num_seqs, "block_size": block_size,
                    "max_model_len": engine.config.max_model_len, "shuffle_blocks": engine.config.shuffle_blocks},
        "requests": [{"label": k, "prompt_len": s.num_prompt_tokens,
                      "max_tokens": MAX_TOKENS[k]} for k, s in seqs.items()],
        "shared_prefix_tokens": len(SHARED),
        "a": {"total": a_first["total"], "cached": a_first["cached"], "block_table": a_blocks},
        "b_first": {k: b_first[k] for k in ("total", "cached", "scheduled", "block_table")},
        "b_inputs": {"input_shape": inp["input_shape"], "cu_seqlens_q": inp["cu_seqlens_q"],
                     "cu_seqlens_k": inp["cu_seqlens_k"], "first_position": inp["positions"][0],
                     "last_position": inp["positions"][-1], "has_block_tables": inp["has_block_tables"],
                     "batch": [s["label"] for s in b_step["before"]]},
        "b_shares_a_blocks": b_first["block_table"][:len(watched)] == watched and bool(watched),
        "watched_blocks": watched,
        "ref_count_trace": trace_counts,
        "exact_512": {k: d_first[k] for k in ("total", "cached", "scheduled")},
        "finished_order": [lab for st in steps for lab in st["after"]["finished"]],
        **_step_facts(steps, {k: s.prompt_token_ids for k, s in seqs.items()}, block_size),
        "free_blocks_end": engine.stats().free_blocks,
        "num_blocks": engine.stats().num_blocks,
        "note": synthetic_note(built.model),
    }
    facts["steps"] = steps          # always (its checkpoint's command has no --trace): the pictures read them
    default_opts = budget == 512 and block_size == 256 and max_num_seqs is None and shuffle_blocks is None
    record = write_claimed("principles.prefix-cache" if default_opts else None, out, "prefix-cache-check.json", unclaimed_name="quick-walk-prefix-custom.json",
                           kind=built.kind, facts=facts, device=built.device, model=built.model,
                           seed=engine.config.seed, engine=built.describe())
    engine.close()
    return record
