"""Quick walk, cases A-D of handbook 5.2: follow requests step by step through the real engine.

Every step is observed at three points: before the forward (scheduled), the runner's tensors (inputs)
and after postprocess. The facts are judged by the checkpoint that matches the case and options, when
the command line is that checkpoint's command (else the run claims no checkpoint and says why).
"""
from __future__ import annotations

from pathlib import Path

from engine import SamplingParams
from engine.observe import EngineEvent
from labkit.cases import CASES
from labkit.errors import UserError
from labkit.evidence import write_claimed
from labkit.experiments.walk_inputs import inputs_facts
from labkit.lab_engine import build_engine, install_env_trace, synthetic_note


def checkpoint_for(case: str, budget: int, max_num_seqs: int | None, block_size: int,
                   shuffle_blocks: int | None = None, shapes: bool = False,
                   num_kvcache_blocks: int | None = None, mixed_batches: bool = False) -> str | None:
    """The checkpoint that states the handbook's expectations for these options, if there is one (none for a
    shuffled block order: the checkpoints keep the default order 0, 1, 2, ...; none for a pool of a given size).
    Case E is claimed with --mixed-batches only (scheduler.quick-walk-mixed); cases A-D only without it."""
    if case == "E" or mixed_batches:
        defaults = (budget, max_num_seqs, block_size, shuffle_blocks, shapes, num_kvcache_blocks) == \
            (512, None, 256, None, False, None)
        return "scheduler.quick-walk-mixed" if case == "E" and mixed_batches and defaults else None
    if (case, block_size, budget, max_num_seqs, shuffle_blocks, shapes, num_kvcache_blocks) == \
            ("C", 16, 512, None, None, False, None):
        return "course.quick-walk-c-bs16"        # lesson 6's exercise (docs/COURSE.md)
    if block_size != 256 or shuffle_blocks is not None or num_kvcache_blocks is not None:
        return None
    if shapes:      # --shapes: case A's model-internal shapes, case D's chunk rows (default options only)
        ok = case in ("A", "D") and budget == 512 and max_num_seqs is None
        return f"setup.quick-walk-{case.lower()}-shapes" if ok else None
    if case == "B" and max_num_seqs == 1 and budget == 512:
        return "setup.quick-walk-b-seqs1"
    if max_num_seqs not in (None, 2) and case == "B":
        return None
    if case == "D" and budget == 256:
        return "setup.quick-walk-d-256"
    if budget != 512:
        return None
    return f"setup.quick-walk-{case.lower()}"


class StepRecorder:
    """Every engine step as the schema of docs/LAB.md (and /work/briefs/schema.md) has it: ``before`` (the
    scheduled sequences), ``inputs`` (the runner's tensors exactly as the model received them) and ``after``
    (postprocess, with the KV pool's blocks in use or still hashed)."""

    def __init__(self, labels: dict[int, str]):
        self.labels = labels
        self.steps: list[dict] = []

    def _label(self, seq_id: int) -> str:
        return self.labels.get(seq_id, str(seq_id))

    def __call__(self, event: EngineEvent) -> None:
        lab = self.labels
        if event.name == "scheduled":
            self.steps.append({"step": event.step, "phase": event.phase, "before": [
                {"label": lab[s["seq_id"]], **{k: s[k] for k in ("seq_id", "total", "cached", "scheduled", "block_table")}}
                for s in event.data["seqs"]]})
        elif event.name == "inputs":
            d = event.data
            self.steps[-1]["inputs"] = {
                "input_shape": d["input_shape"], "input_ids": d["input_ids"], "positions": d["positions"],
                "cu_seqlens_q": d["cu_seqlens_q"], "cu_seqlens_k": d["cu_seqlens_k"],
                "max_seqlen_q": d["max_seqlen_q"], "max_seqlen_k": d["max_seqlen_k"],
                "slot_mapping": d["slot_mapping"], "context_lens": d["context_lens"],
                "block_tables": d["block_tables"], "has_block_tables": d["block_tables"] is not None}
            self.steps[-1]["attention"] = attention_branches(self.steps[-1], d.get("num_decodes") or 0)
        elif event.name == "postprocessed":
            d = event.data
            pool = d["pool"]
            self.steps[-1]["after"] = {
                "accepted": {lab[int(k)]: v for k, v in d["accepted"].items()},
                "discarded": [lab[i] for i in d["discarded"]],
                "finished": [lab[i] for i in d["finished"]],
                "freed_blocks": d["freed_blocks"],
                "seqs": [{"label": lab[s["seq_id"]], **{k: s[k] for k in ("total", "cached", "completion", "status", "block_table")}}
                         for s in d["seqs"]],
                "running": [lab[i] for i in d["running"]],
                "waiting": [lab[i] for i in d["waiting"]],
                "free_blocks": d["free_blocks"],
                "pool": {"num_blocks": pool["num_blocks"], "block_size": pool["block_size"],
                         "blocks": [{**b, "owners": [self._label(i) for i in b["owners"]]} for b in pool["blocks"]]}}


    def run(self, engine, fused: bool, probe=None) -> list[dict]:
        """Step `engine` until every request finished, each step's route recorded (:meth:`route`); the shape
        probe, if any, is closed however the steps end. Returns the steps."""
        try:
            while not engine.is_finished():
                self.route(engine.step(), fused)
        finally:
            if probe is not None:
                probe.close()
        return self.steps

    def route(self, out, fused: bool) -> None:
        """The route the step's forward took (``StepOutput.route``, ModelRunner.route_for's choice: eager, a
        decode graph's bucket, a prefill graph) and whether the fused kernels ran in it (CUDA with fused ops;
        a CPU always runs the plain path)."""
        for st in reversed(self.steps):
            if st["step"] == out.step:
                st["route"] = {"kind": out.route.kind, "bucket": out.route.bucket, "route": str(out.route),
                               "fused": bool(fused)}
                return


def attention_branches(step: dict, num_decodes: int = 0) -> list[dict]:
    """Which branch of the attention backend each sequence of a step takes (lesson 7), from the runner's
    inputs: a decode reads its whole context from the paged cache (every row of a decode step, the first
    ``num_decodes`` rows of a mixed one); a prefill row whose keys are its queries (seqlen_k == seqlen_q)
    attends to the new K/V alone (fresh); one with more keys than queries reads the cached part through its
    block table (a prefix hit or a later chunk)."""
    inp, before = step["inputs"], step["before"]
    cu_q, cu_k = inp["cu_seqlens_q"], inp["cu_seqlens_k"]
    out = []
    for i, s in enumerate(before):
        if step["phase"] == "decode":
            q, k, branch = 1, (inp["context_lens"] or [s["total"]] * len(before))[i], "decode"
        else:           # a prefill or mixed step: each row's queries and keys from cu_seqlens
            q, k = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
            branch = "decode" if i < num_decodes else "prefill-fresh" if k == q else "prefill-cached"
        out.append({"label": s["label"], "branch": branch, "queries": q, "keys": k})
    return out


def slot_mismatches(steps: list[dict], block_size: int) -> tuple[int, list[dict]]:
    """Recompute every slot the runner wrote as block_table[pos // B] * B + pos % B, from the block table
    the scheduler handed out (the ``scheduled`` event) and the runner's positions and slot_mapping (the
    ``inputs`` event). Returns (slots checked, the ones that disagree)."""
    checked, bad = 0, []
    for st in steps:
        inp = st["inputs"]
        owners = []
        if st["phase"] == "prefill":
            for i, s in enumerate(st["before"]):
                owners += [s] * (inp["cu_seqlens_q"][i + 1] - inp["cu_seqlens_q"][i])
        else:
            owners = st["before"]
        if not (len(owners) == len(inp["positions"]) == len(inp["slot_mapping"])):
            bad.append({"step": st["step"], "why": "positions, slot_mapping and scheduled tokens differ in length",
                        "lengths": [len(owners), len(inp["positions"]), len(inp["slot_mapping"])]})
            continue
        for pos, slot, s in zip(inp["positions"], inp["slot_mapping"], owners):
            checked += 1
            table = s["block_table"]
            want = table[pos // block_size] * block_size + pos % block_size if pos // block_size < len(table) else None
            if slot != want:
                bad.append({"step": st["step"], "label": s["label"], "position": pos, "slot": slot, "formula": want})
    return checked, bad


def slots_follow_formula(steps: list[dict], block_size: int) -> bool:
    """True when at least one slot was written and every slot follows the block table."""
    checked, bad = slot_mismatches(steps, block_size)
    return checked > 0 and not bad


def derive(steps: list[dict], labels: list[str], block_size: int) -> dict:
    first = labels[0]
    tcs = [[s["total"], s["cached"], s["scheduled"]] for st in steps for s in st["before"] if s["label"] == first]
    finished_in_batch = {}
    for st in steps:
        for lab in st["after"]["finished"]:
            finished_in_batch[lab] = {"step": st["step"], "in_batch": lab in [s["label"] for s in st["before"]]}
    decodes = [st for st in steps if st["phase"] == "decode"]
    ctx_bad = [{"step": st["step"], "context_lens": st["inputs"]["context_lens"],
                "totals": [s["total"] for s in st["before"]]}
               for st in decodes if st["inputs"]["context_lens"] != [s["total"] for s in st["before"]]]
    checked, slot_bad = slot_mismatches(steps, block_size)
    first_use = list(dict.fromkeys(b for st in steps for s in st["before"] for b in s["block_table"]))
    return {
        "tcs_first": tcs,
        # the block ids the engine handed out, in the order they first appear in a scheduled block table:
        # 0, 1, 2, ... from the default free list (a shuffled pool or a skipped block breaks it)
        "blocks_in_first_use_order": first_use,
        "blocks_handed_out_in_order": bool(first_use) and first_use == list(range(len(first_use))),
        "batch_labels": [[s["label"] for s in st["before"]] for st in steps],
        "phases": [st["phase"] for st in steps],
        "prefill_rounds": sum(st["phase"] == "prefill" for st in steps),
        # the runner's slot_mapping against the scheduler's block tables, slot by slot
        "slots_checked": checked,
        "slot_mismatches": slot_bad,
        "slots_follow_formula": checked > 0 and not slot_bad,
        # each decode step's context_lens (runner) against the scheduled sequences' totals (scheduler)
        "decode_steps_checked": len(decodes),
        "decode_context_lens_mismatches": ctx_bad,
        "decode_context_lens_are_totals": bool(decodes) and not ctx_bad,
        "finished_in_batch": finished_in_batch,
        "accepted_total": sum(len(st["after"]["accepted"]) for st in steps),
        # the runner's inputs (lengths, cu_seqlens, max_seqlen, positions, ids, padded block tables) against
        # the scheduled batch, field by field (labkit/experiments/walk_inputs.py)
        **inputs_facts(steps),
    }


def custom_name(case: str, budget: int, max_num_seqs: int | None, block_size: int, shuffle_blocks: int | None,
                shapes: bool, num_kvcache_blocks: int | None, mixed_batches: bool = False) -> str:
    """The evidence file of a run no checkpoint claims, named by its options so that two option sets keep
    two files: quick-walk-c-bs16.json, quick-walk-b-bs4-blocks2.json, ... (quick-walk-x-custom.json when
    only the claim is missing, e.g. a default run without --trace)."""
    parts = [f"budget{budget}" if budget != 512 else "", f"seqs{max_num_seqs}" if max_num_seqs else "",
             f"bs{block_size}" if block_size != 256 else "", f"shuffle{shuffle_blocks}" if shuffle_blocks is not None else "",
             f"blocks{num_kvcache_blocks}" if num_kvcache_blocks is not None else "", "shapes" if shapes else "",
             "mixed" if mixed_batches else ""]
    tail = "-".join(p for p in parts if p) or "custom"
    return f"quick-walk-{case.lower()}-{tail}.json"


def preempted_at(steps: list[dict]) -> list[dict]:
    """Each preemption the step log shows: a request that held blocks, left out of a step's batch and back
    in waiting after it ({step, label, blocks})."""
    tables: dict[str, list[int]] = {}
    out = []
    for st in steps:
        batch = {s["label"] for s in st["before"]}
        for lab in st["after"]["waiting"]:
            if lab not in batch and tables.get(lab):
                out.append({"step": st["step"], "label": lab, "blocks": tables[lab]})
                tables[lab] = []
        for s in st["before"] + st["after"]["seqs"]:
            tables[s["label"]] = list(s["block_table"])
    return out


def step_blocks(st: dict) -> dict:
    """A step's block tables by label, before the forward and after postprocess (the console shows ids)."""
    return {"before_blocks": [s["block_table"] for s in st["before"]],
            "after_blocks": [s["block_table"] for s in st["after"]["seqs"]]}


def run_quick_walk(case: str, out: Path | None = None, model: str | None = None, device: str = "auto",
                   attention: str = "auto", budget: int = 512, max_num_seqs: int | None = None,
                   block_size: int = 256, trace: bool = False, debug: bool = False,
                   shuffle_blocks: int | None = None, shapes: bool = False, fused_ops: bool = True,
                   num_kvcache_blocks: int | None = None, mixed_batches: bool = False) -> dict:
    case = case.upper()
    if case not in CASES:
        raise UserError(f"unknown case {case!r}: choose one of {', '.join(CASES)}")
    spec = CASES[case]
    built = build_engine(model, device, attention, max_num_batched_tokens=budget,
                         max_num_seqs=max_num_seqs, kvcache_block_size=block_size,
                         shuffle_blocks=shuffle_blocks, fused_ops=fused_ops, num_kvcache_blocks=num_kvcache_blocks,
                         mixed_batches=mixed_batches)
    engine = built.engine
    install_env_trace(engine)
    if debug:
        _debug_prompt(engine)
    seqs = [engine.add_request(list(p), SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True))
            for p, m in zip(spec.prompts, spec.max_tokens)]
    names = spec.labels
    recorder = StepRecorder({s.seq_id: n for s, n in zip(seqs, names)})
    engine.events.subscribe(recorder)
    probe = _shape_probe(engine) if shapes else None
    steps = recorder.run(engine, bool(built.describe().get("fused_ops")), probe)
    stats = engine.stats()
    facts = {
        "case": case, "title": spec.title,
        "options": {"budget": budget, "max_num_seqs": engine.config.max_num_seqs, "block_size": block_size,
                    "max_model_len": engine.config.max_model_len, "shuffle_blocks": engine.config.shuffle_blocks,
                    "num_kvcache_blocks": num_kvcache_blocks, "mixed_batches": mixed_batches},
        "requests": [{"label": n, "prompt_len": len(p), "max_tokens": m}
                     for n, p, m in zip(names, spec.prompts, spec.max_tokens)],
        "preemptions": stats.preemptions,
        "preempted_at": preempted_at(steps),
        "num_steps": len(steps),
        "step_kinds": [st["phase"] for st in steps],
        "num_mixed_steps": sum(st["phase"] == "mixed" for st in steps),
        "output_counts": [s.num_completion_tokens for s in seqs],
        "final": [{"label": n, "cached": s.num_cached_tokens, "block_table": list(s.block_table),
                   "status": s.status.name, "finish_reason": s.finish_reason} for n, s in zip(names, seqs)],
        "free_blocks_end": stats.free_blocks,
        "num_blocks": stats.num_blocks,
        "blocks_in_use_end": stats.num_blocks - stats.free_blocks,     # the pool is whole again after the walk
        "derived": derive(steps, names, block_size),
        "step_digest": [{"step": st["step"], "phase": st["phase"],
                         "before": [[s["label"], s["total"], s["cached"], s["scheduled"], len(s["block_table"])] for s in st["before"]],
                         "input_shape": st["inputs"]["input_shape"], "positions": st["inputs"]["positions"],
                         "cu_seqlens_q": st["inputs"]["cu_seqlens_q"], "cu_seqlens_k": st["inputs"]["cu_seqlens_k"],
                         "context_lens": st["inputs"]["context_lens"],
                         "after": [[s["label"], s["total"], s["cached"], len(s["block_table"])] for s in st["after"]["seqs"]],
                         "discarded": st["after"]["discarded"], "finished": st["after"]["finished"],
                         "freed_blocks": st["after"]["freed_blocks"], **step_blocks(st),
                         "route": (st.get("route") or {}).get("route")}
                        for st in steps],
        "note": synthetic_note(built.model),
    }
    if probe is not None:
        from labkit.experiments.walk_shapes import model_dims, shape_facts

        facts["shapes"] = shape_facts(probe, steps, model_dims(engine.config.shape))
    if trace:
        facts["steps"] = steps
    # the checkpoint these options call for, claimed only when the command line is that checkpoint's command
    # (a plain run without --trace is evidence for no checkpoint, not a FAIL of one, and says so)
    checkpoint = checkpoint_for(case, budget, max_num_seqs, block_size, shuffle_blocks, shapes, num_kvcache_blocks,
                                mixed_batches)
    custom = custom_name(case, budget, max_num_seqs, block_size, shuffle_blocks, shapes, num_kvcache_blocks,
                         mixed_batches)
    record = write_claimed(checkpoint, out, f"{checkpoint.split('.', 1)[1]}.json" if checkpoint else custom,
                           unclaimed_name=custom, kind=built.kind, facts=facts, device=built.device,
                           model=built.model, seed=engine.config.seed, engine=built.describe())
    engine.close()
    return record


def _shape_probe(engine):
    """--shapes: forward hooks on the model (labkit/experiments/walk_shapes.py), told each step's number."""
    from labkit.experiments.walk_shapes import LayerShapeProbe

    probe = LayerShapeProbe(engine)
    engine.events.subscribe(probe)
    return probe


def _debug_prompt(engine) -> None:
    """Handbook 5.1.7: drop into pdb after initialization, with the engine's parts in scope (walk_debug.py)."""
    from labkit.experiments.walk_debug import debug_prompt

    debug_prompt(engine)
