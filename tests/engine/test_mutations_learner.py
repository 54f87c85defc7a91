"""Mutation tests a learner cares about: a fault in a mechanism the lab teaches must turn
the checkpoint that judges it FAIL.

``test_mutations.py`` breaks numerics in a copy of the tree and runs each checkpoint as a subprocess; the
faults here are in scheduling and block bookkeeping, so they are monkeypatches on the live engine (or on the
patch check's probe runner) and each checkpoint's own command runs in this process through the real Typer app,
with the command line its checkpoint names (plus ``--out`` and ``--model``), and is judged from its evidence
by ``check_evidence`` against that checkpoint's own data, as ``labkit check`` would. A command that crashes
under a mutant writes no evidence; ``labkit run`` counts that as FAIL (``run_all._judge_run``), and so does
:func:`outcome` here (a crash is a FAIL, never a NOT-RUN).

Every mutant is an exact fault with one switch: ``MUTANTS[name] = (checkpoint, install)``; ``install(mp)``
applies it with pytest's ``MonkeyPatch``. The unmutated run of each checkpoint (shared by its mutants) must
PASS first.
"""
from __future__ import annotations

import copy
import json

import pytest

from engine.block_manager import BlockManager
from engine.llm_engine import LLMEngine
from engine.scheduler import Scheduler
from engine.sequence import SequenceStatus
from engine.step_inputs import InputBuilder

pytestmark = pytest.mark.usefixtures("one_tokenizer")     # tests/conftest.py: one tokenizer per model directory


# --------------------------------------------------------------------------- the faults


def extra_block_per_sequence(mp):
    """Every admitted sequence takes one block more than its tokens need."""
    allocate = BlockManager.allocate

    def mutant(self, seq, hits=None):
        allocate(self, seq, hits)
        seq.block_table.append(self._take_free_block())

    mp.setattr(BlockManager, "allocate", mutant)


def prefix_hash_never_registered(mp):
    """Computed full blocks are never entered in the prefix cache (hash_blocks does nothing)."""
    mp.setattr(BlockManager, "hash_blocks", lambda self, seq: None)


def prefill_budget_ignored(mp):
    """The prefill selection reads no token budget: a whole prompt (and the next ones) in one round."""
    select = Scheduler._schedule_prefill

    def mutant(self):
        budget, self.max_num_batched_tokens = self.max_num_batched_tokens, 1 << 30
        try:
            return select(self)
        finally:
            self.max_num_batched_tokens = budget

    mp.setattr(Scheduler, "_schedule_prefill", mutant)


def decode_slot_off_by_one(mp):
    """A decode step writes its new K/V one slot further than the block table says."""
    plan = InputBuilder.plan_decode

    def mutant(self, seqs, ahead=0):
        p = plan(self, seqs, ahead)
        p.slot_mapping = [s + 1 for s in p.slot_mapping]
        return p

    mp.setattr(InputBuilder, "plan_decode", mutant)


def blocks_never_freed(mp):
    """deallocate drops the sequence's references but gives no block back to the free list."""
    def mutant(self, seq):
        seq.num_cached_tokens = 0
        seq.num_hashed_blocks = 0
        seq.last_block_hash = -1
        seq.block_table.clear()
        return []

    mp.setattr(BlockManager, "deallocate", mutant)


def preemption_never_happens(mp):
    """When KV runs short in a decode, the running tail is dropped from the queue, not preempted back to
    waiting with its blocks given back."""
    mp.setattr(Scheduler, "preempt", lambda self, seq: None)


def policy_rule_swapped(mp):
    """The decode queue placement of the two policies swapped: balanced keeps served requests in front,
    prefill_first moves them to the back."""
    decode = Scheduler._schedule_decode
    other = {"balanced": "prefill_first", "prefill_first": "balanced"}

    def mutant(self):
        policy, self.policy = self.policy, other.get(self.policy, self.policy)
        try:
            return decode(self)
        finally:
            self.policy = policy

    mp.setattr(Scheduler, "_schedule_decode", mutant)


def cancel_leaks_blocks(mp):
    """A cancelled request is finished and taken out of the queues, but its KV blocks are never freed."""
    def mutant(self, seq, reason="cancelled"):
        if seq.is_finished:
            return []
        self.runner.sampler.forget(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        for queue in (self.scheduler.running, self.scheduler.waiting):
            if seq in queue:
                queue.remove(seq)
        return []

    mp.setattr(LLMEngine, "abort", mutant)


def probe_runs_after_on_both_sides(mp):
    """The patch check's before side runs the engine without the patch, like the after side (the sides are
    the module's replayed ones: see ``subprocess_sides_once``)."""
    from labkit.experiments import patch_check

    run_side = patch_check.run_side
    mp.setattr(patch_check, "run_side", lambda patch, applied, model=None: run_side(patch, False, model))


#: name -> (the checkpoint that must FAIL, the fault)
MUTANTS = {
    "extra-block-per-sequence": ("setup.quick-walk-c", extra_block_per_sequence),
    "prefix-hash-never-registered": ("principles.prefix-cache", prefix_hash_never_registered),
    "prefill-budget-ignored": ("setup.quick-walk-d", prefill_budget_ignored),
    "decode-slot-off-by-one": ("setup.quick-walk-c", decode_slot_off_by_one),
    "blocks-never-freed": ("setup.quick-walk-c", blocks_never_freed),
    "preemption-never-happens": ("scheduler.practice", preemption_never_happens),
    "policy-rule-swapped": ("scheduler.practice", policy_rule_swapped),
    "cancel-leaks-blocks": ("service.simulate", cancel_leaks_blocks),
    "probe-runs-after-on-both-sides": ("patches.no-balanced-policy", probe_runs_after_on_both_sides),
}


# --------------------------------------------------------------------------- running a checkpoint in process


def outcome(cli_app, cid: str, model, out_dir) -> tuple[str, str]:
    """Run checkpoint ``cid``'s own command in this process and judge what it wrote against ``cid``:
    (verdict, why). No evidence (the command crashed or wrote nothing) is FAIL, as in ``labkit run``."""
    from typer.testing import CliRunner

    from labkit.checks import check_evidence, get_checkpoint, reason

    cp = get_checkpoint(cid)
    evidence = out_dir / f"{cid}.json"
    args = [*cp.command[1:], "--out", str(evidence)] + (["--model", str(model)] if cp.takes_model else [])
    result = CliRunner().invoke(cli_app, args)
    if not evidence.is_file():
        return "FAIL", f"exit {result.exit_code}, no evidence: {result.exception!r}"
    verdict, checks = check_evidence(cp, evidence)
    return verdict, f"exit {result.exit_code}: {reason(verdict, checks)}"


def _memo(fn, key):
    seen: dict = {}

    def once(*args, **kw):
        k = key(*args, **kw)
        if k not in seen:
            seen[k] = fn(*args, **kw)
        return copy.deepcopy(seen[k])

    return once


def _sides_of(evidence) -> dict:
    """The (patch, applied) -> ``run_side`` results a patch check's evidence recorded, as run_side returns them."""
    record = json.loads(evidence.read_text())
    out = {}
    for side, applied in (("before", True), ("after", False)):
        facts = dict(record["facts"][side])
        facts.pop("prefill_first_unchanged", None)          # derived by the check from both sides, not a side's
        res = {k: facts.pop(k) for k in ("ok", "error", "engine_source_hash")}
        out[(record["facts"]["patch"], applied)] = {**res, "kind": record["kind"], "facts": facts}
    return out


@pytest.fixture(scope="module")
def subprocess_sides_once(balanced_evidence):
    """The sides that run in their own process against a copy of engine/ are out of a monkeypatch's reach, so
    the same for the control and every mutant: the upstream scheduler of ``scheduler practice`` runs once per
    module, and the patch check's probes are replayed from the session's real no-balanced-policy check
    (``balanced_evidence``: both probes ran there); the control then re-runs the check on them and must PASS."""
    from labkit.experiments import patch_check, scheduler_practice

    replay = _sides_of(balanced_evidence)
    run_side = patch_check.run_side

    def side(patch, applied, model=None):
        got = replay.get((patch.name, applied))
        return copy.deepcopy(got) if got is not None else run_side(patch, applied, model)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scheduler_practice, "run_upstream", _memo(scheduler_practice.run_upstream, lambda: ()))
        mp.setattr(patch_check, "run_side", side)
        yield


@pytest.fixture(scope="module")
def controls(cli_app, tiny_model_dir, tmp_path_factory, subprocess_sides_once):
    """The unmutated run of each checkpoint the mutants break, once per module: cid -> (verdict, why)."""
    done: dict[str, tuple[str, str]] = {}

    def control(cid: str) -> tuple[str, str]:
        if cid not in done:
            done[cid] = outcome(cli_app, cid, tiny_model_dir, tmp_path_factory.mktemp("control"))
        return done[cid]

    return control


@pytest.mark.parametrize("name", list(MUTANTS))
def test_a_learner_s_mutant_fails_its_checkpoint(name, controls, cli_app, tiny_model_dir, tmp_path, monkeypatch):
    cid, install = MUTANTS[name]
    assert controls(cid)[0] == "PASS", f"control {cid}: {controls(cid)}"
    with monkeypatch.context() as mp:
        install(mp)
        verdict, why = outcome(cli_app, cid, tiny_model_dir, tmp_path)
    print(f"mutant {name}: {cid} {verdict} ({why})")
    assert verdict == "FAIL", f"mutant {name}: {cid} gave {verdict} ({why})"


def test_a_crash_is_a_fail_not_a_not_run(tmp_path):
    """``labkit run``: a command that exits without writing evidence (a crash, a mutant that raises) is a
    FAIL whose reason quotes its log, never NOT-RUN."""
    from labkit.checks import get_checkpoint
    from labkit.run_all import _judge_run

    log = tmp_path / "walk.log"
    log.write_text("Traceback (most recent call last):\nRuntimeError: the KV pool cannot hold it\n")
    for rc in (1, 70, -9):
        row = _judge_run(get_checkpoint("setup.quick-walk-c"), rc, 1.0, 300, tmp_path / "none.json", log)
        assert row["verdict"] == "FAIL", row
        assert "no evidence written" in row["reason"] and "KV pool" in row["reason"], row
