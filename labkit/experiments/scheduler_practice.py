"""``labkit scheduler practice``: the handbook's scheduler cases (5.4.2, 5.4.3, B.2.2) on the real scheduler.

The engine's own ``Scheduler`` and ``BlockManager`` are driven with synthetic sampled token ids (no model,
no forward): each round is ``schedule()`` then ``postprocess()`` with one made-up id per scheduled sequence.
Every case records what the scheduler did, round by round; the expectations live in
``checkpoints/scheduler.json``. The cases:

- ``interference``: two short requests decoding when a 768-token prompt arrives (budget 256: three chunks).
- ``rotation``: six decode-ready requests, two per batch: who is served in three decode rounds.
- ``chunk``: a 700-token and a 32-token prompt under budget 512 (the first chunk's candidate is discarded).
- ``kv_short``: a waiting request the KV pool cannot hold yet: the other phase runs, and it is admitted
  once the running request finishes and its blocks come back.
- ``preempt`` (B.2.2): block size 4, 4 blocks, A/B/C of 4 tokens: at the first decode C is preempted.
- ``knob``: the interference case with ``max_consecutive_prefill`` (the 5.4.3 exercise) unset, 2 and 1.

The same cases (those that need no knob and no balanced policy) also run against ``upstream``, in a process
of their own: a copy of ``engine/`` whose ``scheduler.py`` is upstream's, pinned in
``patches/upstream/scheduler.py`` (``engine/scheduler.py`` as ``patches/03-no-balanced-policy.patch`` makes
it, frozen; ``checkpoints/scheduler.json`` holds its sha256). The working tree's scheduler never reaches that
side, so the evidence says whether today's ``prefill_first`` (a learner's edit included) is upstream's
scheduler round by round.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

CHECKPOINT = "scheduler.practice"
#: Upstream's scheduler, pinned (relative to the repository root); it replaces engine/scheduler.py on the
#: upstream side's copy of engine/.
UPSTREAM_SCHEDULER = "patches/upstream/scheduler.py"
SIDE_TIMEOUT_S = 300
TOKEN = 7                                  # the synthetic "sampled" id every step returns


# --------------------------------------------------------------------------- driving the real scheduler


def _scheduler(policy: str, *, num_blocks: int, block_size: int, max_num_seqs: int, budget: int,
               knob: int | None = None):
    from engine import BlockManager, Scheduler, SchedulerLimits

    kw: dict[str, Any] = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=4096,
                              scheduling_policy=policy)
    if knob is not None:
        kw["max_consecutive_prefill"] = knob
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(SchedulerLimits(**kw), bm), bm


def _seq(sid: int, n: int, max_tokens: int, block_size: int):
    from engine.sampling.params import SamplingParams
    from engine.sequence import Sequence

    return Sequence(sid, list(range(1000 * sid, 1000 * sid + n)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    block_size)


class Driver:
    """Rounds of schedule + postprocess; one record per round, sequences named by ``names``."""

    def __init__(self, s, bm, names: dict[int, str]):
        self.s, self.bm, self.names, self.rounds = s, bm, names, []
        self.tokens: dict[str, list[int]] = {}          # name -> round index of each accepted token

    def name(self, seq) -> str:
        return self.names.get(seq.seq_id, str(seq.seq_id))

    def step(self) -> dict | None:
        s = self.s
        waiting_before = [self.name(q) for q in s.waiting]
        seqs, is_prefill = s.schedule()
        if not seqs:
            return None
        rec = {"round": len(self.rounds), "phase": "prefill" if is_prefill else "decode",
               "seqs": [self.name(q) for q in seqs], "scheduled": [q.num_scheduled_tokens for q in seqs],
               "waiting_before": waiting_before, "waiting": [self.name(q) for q in s.waiting],
               "free_blocks": self.bm.num_free_blocks}
        out = s.postprocess(seqs, [TOKEN] * len(seqs), is_prefill)
        rec["accepted"] = [self.name(q) for q in seqs if q.seq_id in out.accepted]
        rec["discarded"] = [self.names.get(i, str(i)) for i in out.discarded]
        rec["finished"] = [self.name(q) for q in out.finished]
        rec["totals"] = [q.num_tokens for q in seqs]
        rec["cached"] = [q.num_cached_tokens for q in seqs]
        rec["free_blocks_after"] = self.bm.num_free_blocks
        for n in rec["accepted"]:
            self.tokens.setdefault(n, []).append(rec["round"])
        self.rounds.append(rec)
        return rec

    def run(self, rounds: int) -> list[dict]:
        done = []
        for _ in range(rounds):
            rec = self.step()
            if rec is None:
                break
            done.append(rec)
        return done

    def max_gap(self, names: list[str], after_round: int = 0) -> int:
        """The longest wait, in rounds, between two consecutive tokens of ``names`` (tokens after ``after_round``)."""
        gaps = [b - a for n in names for a, b in zip(self.tokens.get(n, []), self.tokens.get(n, [])[1:])
                if a >= after_round]
        return max(gaps, default=0)


def longest_run(phases: list[str], what: str = "prefill") -> int:
    best = run = 0
    for p in phases:
        run = run + 1 if p == what else 0
        best = max(best, run)
    return best


def case_interference(policy: str, knob: int | None = None) -> dict:
    """Two 32-token requests are decoding when a 768-token prompt arrives; budget 256 chunks it in three."""
    s, bm = _scheduler(policy, num_blocks=64, block_size=16, max_num_seqs=4, budget=256, knob=knob)
    d = Driver(s, bm, {1: "S1", 2: "S2", 3: "L"})
    for sid in (1, 2):
        s.add(_seq(sid, 32, 16, 16))
    warmup = d.run(2)                            # the shorts' prefill and their first decode
    s.add(_seq(3, 768, 4, 16))
    start = len(d.rounds)
    rounds = d.run(9)
    phases = [r["phase"] for r in rounds]
    prefills = [i for i, p in enumerate(phases) if p == "prefill"]
    return {"warmup_phases": [r["phase"] for r in warmup], "rounds": rounds, "phases": phases,
            "longest_prefill_run": longest_run(phases),
            "decode_between_chunks": len(prefills) > 1 and all(b - a >= 2 for a, b in zip(prefills, prefills[1:])),
            "short_max_gap_rounds": d.max_gap(["S1", "S2"], after_round=start - 1),
            "long_first_token_round": (d.tokens.get("L") or [None])[0] - start if d.tokens.get("L") else None}


def case_rotation(policy: str) -> dict:
    """Six decode-ready requests, two per batch: rotation reaches all six in three decode rounds."""
    s, bm = _scheduler(policy, num_blocks=64, block_size=16, max_num_seqs=2, budget=512)
    names = {i: f"R{i}" for i in range(1, 7)}
    d = Driver(s, bm, names)
    for sid in names:
        s.add(_seq(sid, 8, 16, 16))
    warmup: list[dict] = []
    while s.waiting and len(warmup) < 12:
        warmup += d.run(1)
    decodes = d.run(3)
    served = sorted({n for r in decodes for n in r["seqs"]})
    return {"warmup_phases": [r["phase"] for r in warmup], "decode_rounds": [r["seqs"] for r in decodes],
            "phases": [r["phase"] for r in decodes], "served_in_3_decodes": served,
            "num_served_in_3_decodes": len(served)}


def case_chunk(policy: str) -> dict:
    """Quick-walk D on the scheduler alone: 700 + 32 tokens under budget 512, block size 256."""
    s, bm = _scheduler(policy, num_blocks=16, block_size=256, max_num_seqs=8, budget=512)
    d = Driver(s, bm, {1: "A", 2: "B"})
    s.add(_seq(1, 700, 4, 256))
    s.add(_seq(2, 32, 4, 256))
    rounds = d.run(3)
    return {"rounds": rounds, "phases": [r["phase"] for r in rounds], "scheduled": [r["scheduled"] for r in rounds],
            "discarded": [r["discarded"] for r in rounds], "totals": [r["totals"] for r in rounds],
            "cached": [r["cached"] for r in rounds]}


def case_kv_short(policy: str) -> dict:
    """Block size 4, 4 blocks. R1 (8 tokens, 3 outputs) runs; R2 (12 tokens: 3 blocks) arrives when only
    2 are free. The waiting prefill cannot be placed, so decode runs (for ``balanced`` right after a decode,
    the phase it would not prefer); when R1 finishes its blocks come back and R2 is prefilled."""
    s, bm = _scheduler(policy, num_blocks=4, block_size=4, max_num_seqs=4, budget=64)
    d = Driver(s, bm, {1: "R1", 2: "R2"})
    s.add(_seq(1, 8, 3, 4))
    d.run(1)
    r2 = _seq(2, 12, 1, 4)
    s.add(r2)
    r2_blocks_while_waiting: list[list[int]] = []
    for _ in range(8):
        rec = d.step()
        if rec is None:
            break
        if "R2" in rec["waiting"]:
            r2_blocks_while_waiting.append(list(r2.block_table))
    rounds = d.rounds
    phases = [r["phase"] for r in rounds]
    blocked = [r["round"] for r in rounds if r["phase"] == "decode" and "R2" in r["waiting_before"]
               and "R2" in r["waiting"]]
    switch = [i for i in blocked if i > 0 and phases[i - 1] == "decode"]
    r2_prefill = next((r["round"] for r in rounds if r["phase"] == "prefill" and "R2" in r["seqs"]), None)
    r1_finished = next((r["round"] for r in rounds if "R1" in r["finished"]), None)
    return {"rounds": rounds, "phases": phases,
            "decode_while_prefill_waits": blocked,
            "decode_after_decode_while_prefill_waits": switch,
            "r2_blocks_while_waiting": r2_blocks_while_waiting,
            "r1_finished_round": r1_finished, "r2_prefill_round": r2_prefill,
            "r2_admitted_after_r1_freed": r1_finished is not None and r2_prefill is not None and r2_prefill > r1_finished,
            "free_blocks_at_end": bm.num_free_blocks, "num_blocks": bm.num_blocks,
            "finished": s.is_finished()}


def case_preempt(policy: str) -> dict:
    """B.2.2: block size 4, 4 blocks, A/B/C of 4 tokens each; every prefill samples one token (totals 5),
    so each next decode needs a new block: A takes the last one, B needs one, the running tail C yields."""
    s, bm = _scheduler(policy, num_blocks=4, block_size=4, max_num_seqs=8, budget=512)
    names = {1: "A", 2: "B", 3: "C"}
    d = Driver(s, bm, names)
    seqs = {n: _seq(sid, 4, 4, 4) for sid, n in names.items()}
    for q in seqs.values():
        s.add(q)
    prefill = d.run(1)
    decode = d.run(1)
    c = seqs["C"]
    return {"prefill": prefill, "selected": decode[0]["seqs"] if decode else [],
            "phase": decode[0]["phase"] if decode else None,
            "waiting": [names[q.seq_id] for q in s.waiting], "running": [names[q.seq_id] for q in s.running],
            "C": {"status": c.status.name, "cached": c.num_cached_tokens, "blocks": list(c.block_table),
                  "total": c.num_tokens},
            "free_blocks": bm.num_free_blocks}


def side(policies: list[str], knob: bool = True) -> dict:
    """Every case under each policy (plus the knob case when this engine has the knob)."""
    out: dict[str, Any] = {}
    for p in policies:
        out[p] = {"interference": case_interference(p), "rotation": case_rotation(p), "chunk": case_chunk(p),
                  "kv_short": case_kv_short(p), "preempt": case_preempt(p)}
    if knob:
        key = lambda n: "unset" if n is None else str(n)  # noqa: E731  (the knob's value; unset: the policy's own)
        out["knob"] = {"prefill_first": {key(n): case_interference("prefill_first", n) for n in (None, 2, 1)},
                       "balanced": {key(n): case_interference("balanced", n) for n in (None, 2)}}
    return out


# --------------------------------------------------------------------------- upstream, in its own process


def run_upstream(root: Path | None = None) -> dict:
    """The prefill_first cases against upstream's pinned scheduler (:data:`UPSTREAM_SCHEDULER`), on a copy of
    ``root``'s engine/ (default: the one labkit drives) with its scheduler.py replaced, in its own process."""
    from labkit.experiments.patch_check import run_module_in
    from labkit.paths import repo_root
    from labkit.patches.store import engine_root

    pinned = repo_root() / UPSTREAM_SCHEDULER
    if not pinned.is_file():
        return {"ok": False, "error": f"no pinned upstream scheduler at {pinned}"}
    with tempfile.TemporaryDirectory(prefix="labkit-upstream-") as tmp:
        copy = Path(tmp)
        shutil.copytree((root or engine_root()) / "engine", copy / "engine",
                        ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copyfile(pinned, copy / "engine" / "scheduler.py")
        out, error = run_module_in(copy, ["labkit.experiments.scheduler_practice", "--upstream-side"],
                                   SIDE_TIMEOUT_S, "upstream side")
    if out is None:
        return {"ok": False, "error": error}
    out["pinned"] = UPSTREAM_SCHEDULER
    return out


def _upstream_main() -> int:
    import engine
    from engine.config import SCHEDULING_POLICIES
    from labkit.evidence_format import engine_dir, source_hash

    try:
        out = {"ok": True, "policies": list(SCHEDULING_POLICIES), **side(["prefill_first"], knob=False)}
    except Exception as exc:  # noqa: BLE001 - reported to the parent as data
        out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    out["engine_source_hash"] = source_hash(engine_dir())
    # the scheduler this process imported, by content: the judge holds it to the pin
    out["scheduler_sha256"] = hashlib.sha256((Path(engine.__file__).parent / "scheduler.py").read_bytes()).hexdigest()
    print("\n" + json.dumps(out))
    return 0


# --------------------------------------------------------------------------- the command


def run_practice(out: Path) -> dict:
    from engine.config import SCHEDULING_POLICIES
    from labkit.evidence import write_evidence

    facts: dict[str, Any] = {"policies": list(SCHEDULING_POLICIES), **side(["prefill_first", "balanced"])}
    upstream = run_upstream()
    facts["upstream"] = upstream
    if upstream.get("ok"):
        same = {case: upstream["prefill_first"][case] == facts["prefill_first"][case]
                for case in facts["prefill_first"]}
        facts["prefill_first_vs_upstream"] = {"same_per_case": same, "all_same": all(same.values())}
    knob = facts["knob"]
    facts["knob_summary"] = {
        f"{pol}/{n}": {k: knob[pol][n][k] for k in ("longest_prefill_run", "short_max_gap_rounds",
                                                     "long_first_token_round", "phases")}
        for pol in knob for n in knob[pol]}
    return write_evidence(out, checkpoint=CHECKPOINT, kind="cpu-real-scheduler", facts=facts, device="cpu")


if __name__ == "__main__":
    if sys.argv[1:] == ["--upstream-side"]:
        sys.exit(_upstream_main())
    sys.exit(f"usage: python -m {__spec__.name if __spec__ else 'scheduler_practice'} --upstream-side")
