"""Quick walk A-D and smoke end to end on the tiny synthetic model, judged by their checkpoints.

Each checkpoint's walk (``--trace``, its checkpoint's command) runs once per module (``walks``), and so does the
smoke (``smoke``); the tests that read or re-judge a walk take a copy of it. A test that breaks the engine, or
runs another option, runs its own walk."""
import copy
import json
import shutil

import pytest
from testkit import checkpoint_command

from labkit.checks import check_evidence, get_checkpoint
from labkit.experiments.quick_walk import run_quick_walk
from labkit.experiments.smoke import run_smoke

pytestmark = pytest.mark.usefixtures("one_tokenizer")     # tests/conftest.py: one tokenizer per model directory

VARIANTS = [
    ("A", {}, "setup.quick-walk-a"),
    ("B", {}, "setup.quick-walk-b"),
    ("B", {"max_num_seqs": 1}, "setup.quick-walk-b-seqs1"),
    ("C", {}, "setup.quick-walk-c"),
    ("D", {}, "setup.quick-walk-d"),
    ("D", {"budget": 256}, "setup.quick-walk-d-256"),
    ("E", {"mixed_batches": True}, "scheduler.quick-walk-mixed"),
]


@pytest.fixture(scope="module")
def walks(tiny_model_dir, tmp_path_factory):
    """Each VARIANT's walk with --trace, as its checkpoint's command runs it: {checkpoint: (record, evidence file)}."""
    d = tmp_path_factory.mktemp("walks")
    made = {}
    for case, options, cp in VARIANTS:
        out = d / f"{cp}.json"
        with checkpoint_command(cp):
            made[cp] = run_quick_walk(case, out=out, model=str(tiny_model_dir), trace=True, **options), out
    return made


def walk(walks, cp: str) -> dict:
    """A copy of checkpoint cp's shared walk record (a test may change it)."""
    return copy.deepcopy(walks[cp][0])


@pytest.mark.parametrize("case,options,cp", VARIANTS, ids=[v[2] for v in VARIANTS])
def test_quick_walk_case_passes_its_checkpoint(walks, case, options, cp):
    record, out = walk(walks, cp), walks[cp][1]
    failed = [c for c in record["checks"] if not c["passed"]]
    assert record["checkpoint"] == cp and record["verdict"] == "PASS", failed
    assert record["kind"] == "cpu-real-engine" and record["model"]["synthetic"]
    verdict, _ = check_evidence(get_checkpoint(cp), out)      # labkit check re-judges the same file
    assert verdict == "PASS"


def test_a_plain_run_claims_no_checkpoint_and_says_so(tiny_model_dir, tmp_path, cli_app, monkeypatch):
    """`labkit quick-walk --case A` without --trace: not the checkpoint's command, so not its evidence (and not
    a FAIL of it); its own file, a note naming the checkpoint's command. With --trace it claims and PASSes."""
    from typer.testing import CliRunner

    runs = tmp_path / "runs"
    monkeypatch.setenv("LABKIT_RUNS_DIR", str(runs))
    res = CliRunner().invoke(cli_app, ["quick-walk", "--case", "A", "--model", str(tiny_model_dir), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    rec = json.loads((runs / "quick-walk-a-custom.json").read_text())
    assert rec["checkpoint"] is None and rec["verdict"] != "FAIL"
    assert rec["facts"]["checkpoint_not_claimed"] == {"checkpoint": "setup.quick-walk-a",
                                                      "command": "labkit quick-walk --case A --trace",
                                                      "why": "--trace not given"}
    assert "note: not evidence for setup.quick-walk-a: --trace not given" in " ".join(res.output.split())
    cp = get_checkpoint("setup.quick-walk-a")
    assert not cp.evidence_path().exists() and check_evidence(cp)[0] == "NOT-RUN"
    res = CliRunner().invoke(cli_app, ["quick-walk", "--case", "A", "--trace", "--model", str(tiny_model_dir),
                                       "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert json.loads(cp.evidence_path().read_text())["checkpoint"] == cp.id and check_evidence(cp)[0] == "PASS"


def test_a_trace_records_before_and_after_each_step(walks):
    rec = walk(walks, "setup.quick-walk-a")
    steps = rec["facts"]["steps"]
    assert [s["before"][0]["scheduled"] for s in steps] == [3, 1, 1]
    assert all(len(s["after"]["accepted"]) == 1 for s in steps)
    assert steps[-1]["after"]["freed_blocks"] and steps[-1]["after"]["seqs"][0]["block_table"] == []
    # each step names the route its forward took (a CPU runs every step eagerly, the plain kernels)
    assert [s.get("route") for s in steps] == [{"kind": "eager", "bucket": None, "route": "eager", "fused": False}] * 3


def test_without_trace_the_step_log_is_left_out(tiny_model_dir, tmp_path):
    rec = run_quick_walk("A", out=tmp_path / "a.json", model=str(tiny_model_dir), trace=False)
    assert "steps" not in rec["facts"]
    assert rec["facts"]["derived"]["tcs_first"] == [[3, 0, 3], [4, 3, 1], [5, 4, 1]]


def test_a_tampered_evidence_file_fails_the_recheck(walks, tmp_path):
    out = tmp_path / "d.json"
    shutil.copy(walks["setup.quick-walk-d"][1], out)
    assert check_evidence(get_checkpoint("setup.quick-walk-d"), out)[0] == "PASS"
    data = json.loads(out.read_text())
    data["facts"]["step_digest"][1]["cu_seqlens_q"] = [0, 187, 220]
    out.write_text(json.dumps(data))
    verdict, checks = check_evidence(get_checkpoint("setup.quick-walk-d"), out)
    assert verdict == "FAIL"


def test_env_trace_prints_one_line_per_step(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LABKIT_TRACE", "1")
    run_quick_walk("A", out=tmp_path / "a.json", model=str(tiny_model_dir))
    lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("event=engine_step")]
    assert len(lines) == 3
    assert ":3/0/3" in lines[0] and ":4/3/1" in lines[1] and ":5/4/1" in lines[2]


@pytest.fixture(scope="module")
def smoke(tiny_model_dir, tmp_path_factory):
    """`labkit smoke` as its checkpoint runs it, once per module."""
    with checkpoint_command("setup.smoke"):
        return run_smoke(out=tmp_path_factory.mktemp("smoke") / "smoke.json", model=str(tiny_model_dir))


def test_smoke_two_tokens_through_the_chat_template(smoke):
    rec = copy.deepcopy(smoke)
    assert rec["verdict"] == "PASS"
    assert rec["facts"]["output_token_counts"] == [2] and rec["facts"]["kv_blocks"] > 0
    assert "synthetic" in rec["facts"]["note"]


def _rejudge(record: dict, cp: str) -> dict:
    from labkit.checks import judge
    return {c["name"]: c for c in judge(get_checkpoint(cp), record)}


@pytest.mark.parametrize("cp,options", [("setup.quick-walk-b", {}), ("setup.quick-walk-b-seqs1", {"max_num_seqs": 1})])
def test_b_cases_fail_on_a_wrong_slot_or_context_len(walks, cp, options):
    """The derived facts are recomputed from the engine's recorded slot_mapping, block tables and
    context_lens: one wrong slot or one wrong decode context_len in what the engine recorded FAILs."""
    from labkit.experiments.quick_walk import derive

    rec = walk(walks, cp)
    derived = rec["facts"]["derived"]
    assert rec["verdict"] == "PASS" and derived["slots_checked"] == 7 + 5 and derived["decode_steps_checked"] > 0
    labels = [r["label"] for r in rec["facts"]["requests"]]

    bad_slot = json.loads(json.dumps(rec["facts"]["steps"]))
    bad_slot[-1]["inputs"]["slot_mapping"][0] += 1
    rec["facts"]["derived"] = derive(bad_slot, labels, 256)
    checks = _rejudge(rec, cp)
    assert not checks["facts.derived.slots_follow_formula"]["passed"]
    assert rec["facts"]["derived"]["slot_mismatches"][0]["step"] == bad_slot[-1]["step"]

    bad_ctx = json.loads(json.dumps(rec["facts"]["steps"]))
    bad_ctx[-1]["inputs"]["context_lens"][0] -= 1
    rec["facts"]["derived"] = derive(bad_ctx, labels, 256)
    checks = _rejudge(rec, cp)
    assert not checks["facts.derived.decode_context_lens_are_totals"]["passed"]
    assert checks["facts.derived.slots_follow_formula"]["passed"]


def test_a_walk_that_leaks_blocks_fails(tiny_model_dir, tmp_path, monkeypatch, labkit_argv):
    """Break the subject: a block manager that forgets to return one block per finished sequence."""
    from engine.block_manager import BlockManager

    real = BlockManager.deallocate

    def leaky(self, seq):
        keep = seq.block_table[-1:]
        freed = real(self, seq)
        for b in keep:                       # take the last block back out of the free list
            self.free_block_ids.remove(b)
            self.used_block_ids.add(b)
        return [b for b in freed if b not in keep]

    monkeypatch.setattr(BlockManager, "deallocate", leaky)
    labkit_argv.checkpoint("setup.quick-walk-b")
    rec = run_quick_walk("B", out=tmp_path / "b.json", model=str(tiny_model_dir), trace=True)
    assert rec["checkpoint"] == "setup.quick-walk-b"
    checks = {c["name"]: c for c in rec["checks"]}
    assert rec["verdict"] == "FAIL"
    assert not checks["facts.blocks_in_use_end"]["passed"] and checks["facts.blocks_in_use_end"]["actual"] == 2


def test_smoke_records_the_template_tokens_the_model_received(smoke):
    rec = copy.deepcopy(smoke)
    f = rec["facts"]
    assert f["prompt_token_ids"][:3] == [151644, 872, 198] and f["prompt_token_ids"][-7:-5] == [151644, 77091]
    assert f["prompt_tokens"] == len(f["prompt_token_ids"]) == 23 and f["prefill_forwards"] == 1
    assert "chat_template" not in f                       # no literal claim: the tokens show it


def test_smoke_fails_when_the_engine_skips_the_chat_template(tiny_model_dir, tmp_path, monkeypatch):
    """Break the subject: an engine whose encode() of chat messages ignores the template."""
    from engine import LLMEngine

    real = LLMEngine.encode
    monkeypatch.setattr(LLMEngine, "encode", lambda self, p: real(self, p[0]["content"])
                        if isinstance(p, list) and p and isinstance(p[0], dict) else real(self, p))
    rec = run_smoke(out=tmp_path / "smoke.json", model=str(tiny_model_dir))
    failed = {c["name"] for c in rec["checks"] if not c["passed"]}
    assert rec["verdict"] == "FAIL"
    assert {"facts.prompt_head", "facts.prompt_tail", "facts.prompt_im_end_count"} <= failed


INPUT_KEYS = {"input_shape", "input_ids", "positions", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
              "slot_mapping", "context_lens", "block_tables", "has_block_tables"}


def test_steps_record_the_runner_inputs_and_the_pool(walks):
    """Case D (700 + 32 tokens, budget 512), default block order: the schema's inputs and pool per step."""
    rec = walk(walks, "setup.quick-walk-d")
    steps = rec["facts"]["steps"]
    assert all(set(st["inputs"]) == INPUT_KEYS for st in steps)
    first, second, last = steps
    assert first["inputs"]["input_ids"] == list(range(20000, 20512)) and first["inputs"]["block_tables"] is None
    assert (first["inputs"]["max_seqlen_q"], first["inputs"]["max_seqlen_k"]) == (512, 512)
    # round 2: A's last 188 after its cached 512, B's 32: block tables given, padded with -1 to the widest
    assert second["inputs"]["block_tables"] == [[0, 1, 2], [3, -1, -1]] and second["inputs"]["has_block_tables"]
    assert (second["inputs"]["max_seqlen_q"], second["inputs"]["max_seqlen_k"]) == (188, 700)
    assert last["inputs"]["input_ids"] == [second["after"]["accepted"]["A"], second["after"]["accepted"]["B"]]
    pool = second["after"]["pool"]
    assert (pool["num_blocks"], pool["block_size"]) == (rec["facts"]["num_blocks"], 256)
    assert pool["blocks"] == [{"id": 0, "ref_count": 1, "hashed": True, "owners": ["A"]},
                              {"id": 1, "ref_count": 1, "hashed": True, "owners": ["A"]},
                              {"id": 2, "ref_count": 1, "hashed": False, "owners": ["A"]},
                              {"id": 3, "ref_count": 1, "hashed": False, "owners": ["B"]}]
    # after the last step every block is free: only the two hashed ones are still listed (cached, no owner)
    assert last["after"]["pool"]["blocks"] == [{"id": 0, "ref_count": 0, "hashed": True, "owners": []},
                                               {"id": 1, "ref_count": 0, "hashed": True, "owners": []}]
    derived = rec["facts"]["derived"]
    assert derived["inputs_consistent"] and derived["inputs_checked"] == 3 and derived["inputs_mismatches"] == []
    assert rec["facts"]["step_digest"][1]["before_blocks"] == [[0, 1, 2], [3]]


def test_inputs_consistent_fails_on_each_wrong_input(walks):
    """One wrong field of what the runner received (a block_tables row, the padding, max_seqlen_q, a decode id,
    cu_seqlens_q, a lost slot) makes the derived fact false and the checkpoint FAIL."""
    from labkit.experiments.quick_walk import derive

    rec = walk(walks, "setup.quick-walk-d")
    assert rec["verdict"] == "PASS"

    def row(steps):
        steps[1]["inputs"]["block_tables"][1][0] += 1

    def pad(steps):
        for r in steps[2]["inputs"]["block_tables"]:
            r.append(-1)

    def seqlen(steps):
        steps[1]["inputs"]["max_seqlen_q"] = 220

    def decode_id(steps):
        steps[2]["inputs"]["input_ids"][0] += 1

    def cu(steps):
        steps[1]["inputs"]["cu_seqlens_q"][1] -= 1

    def slot(steps):
        steps[0]["inputs"]["slot_mapping"].pop()

    for name, edit in (("row", row), ("pad", pad), ("seqlen", seqlen), ("decode_id", decode_id), ("cu", cu),
                       ("slot", slot)):
        steps = json.loads(json.dumps(rec["facts"]["steps"]))
        edit(steps)
        rec["facts"]["derived"] = derive(steps, ["A", "B"], 256)
        assert not _rejudge(rec, "setup.quick-walk-d")["facts.derived.inputs_consistent"]["passed"], name
        assert rec["facts"]["derived"]["inputs_mismatches"], name


def test_shuffled_blocks_move_slots_off_positions_and_claim_no_checkpoint(walks, tiny_model_dir, tmp_path,
                                                                          labkit_argv):
    """--shuffle-blocks SEED: case A's slots are no longer its positions, the slot formula still holds; no
    checkpoint is claimed, and the judge refuses the file for setup.quick-walk-a. Without it: slot = position."""
    plain = walk(walks, "setup.quick-walk-a")
    assert all(st["inputs"]["slot_mapping"] == st["inputs"]["positions"] for st in plain["facts"]["steps"])
    labkit_argv.checkpoint("setup.quick-walk-a", "--shuffle-blocks", "7")
    rec = run_quick_walk("A", out=tmp_path / "s.json", model=str(tiny_model_dir), trace=True, shuffle_blocks=7)
    assert rec["checkpoint"] is None and rec["engine"]["config"]["shuffle_blocks"] == 7
    assert rec["facts"]["options"]["shuffle_blocks"] == 7
    assert any(s != p for st in rec["facts"]["steps"] for s, p in zip(st["inputs"]["slot_mapping"], st["inputs"]["positions"]))
    derived = rec["facts"]["derived"]
    assert derived["slots_follow_formula"] and derived["slots_checked"] == 5 and derived["inputs_consistent"]
    checks = _rejudge(rec, "setup.quick-walk-a")
    assert not checks["facts.derived.blocks_handed_out_in_order"]["passed"]   # block ids no longer 0, 1, 2, ...
    assert checks["facts.num_steps"]["passed"]              # the walk itself is the same


def test_cli_inputs_prints_each_step_and_block_ids(tiny_model_dir, tmp_path, cli_app, monkeypatch):
    from typer.testing import CliRunner

    monkeypatch.setenv("LABKIT_RUNS_DIR", str(tmp_path / "runs"))
    res = CliRunner().invoke(cli_app, ["quick-walk", "--case", "D", "--inputs", "--model", str(tiny_model_dir),
                                       "--device", "cpu"], env={"COLUMNS": "160"})
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    for n in (1, 2, 3):
        assert f"step {n} (" in text and "the runner's inputs" in text
    assert "[0, 1, 2, … 511] (512)" in text                 # step 1's positions, elided with their count
    assert "A: [0, 1, 2]" in text and "B: [3, -1, -1]" in text
    assert "blocks [0, 1, 2]" in text and "blocks [3]" in text  # the console shows block ids, not counts
    rec = json.loads((tmp_path / "runs" / "quick-walk-d.json").read_text())
    assert len(rec["facts"]["steps"]) == 3                   # what it printed is in the evidence
    assert rec["checkpoint"] == "setup.quick-walk-d"         # --inputs stores the steps as --trace: D's own command


def test_the_mixed_walk_draws_its_mixed_step(walks):
    """Case E with mixed steps: the slot picture's default step is the mixed one, its flat batch S's one decode
    token (slot 32, block 0) and then L's 220 tokens across blocks 2 and 3."""
    from labkit.pictures.walkdata import slot_view

    rec = walk(walks, "scheduler.quick-walk-mixed")
    view = slot_view(rec["facts"])
    assert view.step == 2 and view.phase == "mixed"
    assert [(sp.label, sp.length, sp.position, sp.first_slot) for sp in view.spans] == \
        [("S", 1, 32, 32), ("L", 32, 480, 736), ("L", 188, 512, 768)]


def test_the_mixed_walk_fails_when_a_decode_row_reads_one_position_short(tiny_model_dir, tmp_path, monkeypatch):
    """Break the subject: the runner plans a mixed step's decode rows one position short."""
    from engine.step_inputs import InputBuilder

    real = InputBuilder.plan_prefill

    def short(self, seqs):
        plan = real(self, seqs)
        if plan.context_lens:
            plan.context_lens = [n - 1 for n in plan.context_lens]
        return plan

    monkeypatch.setattr(InputBuilder, "plan_prefill", short)
    with checkpoint_command("scheduler.quick-walk-mixed"):
        rec = run_quick_walk("E", out=tmp_path / "e.json", model=str(tiny_model_dir), trace=True, mixed_batches=True)
    failed = {c["name"] for c in rec["checks"] if not c["passed"]}
    assert rec["verdict"] == "FAIL" and "facts.step_digest.1.context_lens" in failed


def test_a_preempted_requests_recompute_is_a_prefill_step_not_a_mixed_one(tiny_model_dir, tmp_path):
    """Case B in a pool of 2 blocks of 4: R2 is preempted, then re-admitted with a prefix hit and one token to
    compute. That step prefills (a recompute), it decodes nothing: its kind is prefill, and its inputs carry no
    decode context lengths."""
    rec = run_quick_walk("B", out=tmp_path / "b.json", model=str(tiny_model_dir), trace=True, block_size=4,
                         num_kvcache_blocks=2)
    facts = rec["facts"]
    assert facts["preemptions"] >= 1 and "mixed" not in facts["step_kinds"]
    assert facts["derived"]["inputs_consistent"]
