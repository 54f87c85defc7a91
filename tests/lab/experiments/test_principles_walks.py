"""The principles checkpoints (checkpoints/principles.json): each PASSes when run the way `labkit run` runs it
(its command, --out, and --model where it takes one), and FAILs on a deliberately broken engine or input."""
from __future__ import annotations

import json

import pytest

from labkit.checks import check_evidence, get_checkpoint, load_checkpoints

pytestmark = pytest.mark.usefixtures("one_tokenizer")     # tests/conftest.py: one tokenizer per model directory


@pytest.fixture(scope="session")
def qwen_shape_model_dir(tmp_path_factory):
    """Qwen3-0.6B's widths and vocabulary with 2 layers (the lifecycle walk's handbook shapes on a CPU)."""
    from labkit.assets.synth import synth_model

    return synth_model("qwen3-0.6b-2l", tmp_path_factory.mktemp("qwen-2l") / "qwen3-0.6b-2l", seed=0)


def _model_for(cp, tiny, qwen_shape) -> str:
    return str(qwen_shape if cp.id == "principles.lifecycle" else tiny)


PRINCIPLES = [cp.id for cp in load_checkpoints() if cp.stage == "principles"]


def test_the_stage_has_its_twelve_checkpoints():
    assert PRINCIPLES == ["principles.tokenizer", "principles.softmax", "principles.attention",
                          "principles.uncached-walkthrough", "principles.memory",
                          "principles.slots", "principles.timing", "principles.lifecycle", "principles.residual",
                          "principles.prefix-cache", "principles.hash", "principles.multiturn"]
    assert all(get_checkpoint(c).needs == "cpu" for c in PRINCIPLES)


def _run_as_labkit_run(cli_app, cp, model: str):
    """run_all.build_command's arguments (its command, --out, --model where it takes one) through the CLI in process."""
    from typer.testing import CliRunner

    out = cp.evidence_path()
    args = [*cp.command[1:], "--out", str(out)]
    if cp.takes_model:
        args += ["--model", model]
    return CliRunner().invoke(cli_app, args), out


@pytest.fixture(scope="module")
def prefix_cache_run(cli_app, tiny_model_dir, tmp_path_factory):
    """principles.prefix-cache as `labkit run` runs it, once per module (its checkpoint test and the hash-chain
    test read it): (runs dir, CLI result, evidence path)."""
    runs = tmp_path_factory.mktemp("prefix-cache") / "runs"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LABKIT_RUNS_DIR", str(runs))
        res, out = _run_as_labkit_run(cli_app, get_checkpoint("principles.prefix-cache"), str(tiny_model_dir))
    return runs, res, out


@pytest.mark.parametrize("cid", PRINCIPLES)
def test_checkpoint_passes_as_labkit_run_runs_it(cid, cli_app, tiny_model_dir, qwen_shape_model_dir, tmp_path,
                                                 monkeypatch, request):
    """run_all.build_command's arguments, through the real CLI in process; then `labkit check` re-judges."""
    cp = get_checkpoint(cid)
    if cid == "principles.prefix-cache":                   # the module's one run of it
        runs, res, out = request.getfixturevalue("prefix_cache_run")
        monkeypatch.setenv("LABKIT_RUNS_DIR", str(runs))
    else:
        monkeypatch.setenv("LABKIT_RUNS_DIR", str(tmp_path / "runs"))
        res, out = _run_as_labkit_run(cli_app, cp, _model_for(cp, tiny_model_dir, qwen_shape_model_dir))
    assert res.exit_code == 0, res.output
    rec = json.loads(out.read_text())
    assert rec["checkpoint"] == cid and rec["verdict"] == "PASS"
    verdict, checks = check_evidence(cp)
    assert verdict == "PASS", [c for c in checks if not c.get("passed")]


# --------------------------------------------------------------------------- deliberate breaks


def _failed(record: dict) -> list[str]:
    assert record["checkpoint"] is not None, record["facts"].get("checkpoint_not_claimed")
    return [c["name"] for c in record["checks"] if c.get("status", "pass" if c.get("passed") else "fail") == "fail"]


def test_tokenizer_fails_when_decode_loses_a_token(tiny_model_dir, tmp_path, labkit_argv, monkeypatch):
    from transformers import PreTrainedTokenizerBase

    from labkit.experiments.principles import run_tokenizer

    decode = PreTrainedTokenizerBase.decode
    monkeypatch.setattr(PreTrainedTokenizerBase, "decode", lambda self, ids, **kw: decode(self, list(ids)[:-1], **kw))
    labkit_argv.checkpoint("principles.tokenizer")
    rec = run_tokenizer(tmp_path / "t.json", str(tiny_model_dir))
    assert rec["verdict"] == "FAIL" and {"facts.roundtrip_equal", "facts.decoded"} <= set(_failed(rec))


def test_softmax_fails_when_the_sampler_ignores_the_temperature(tmp_path, labkit_argv, monkeypatch):
    import engine.sampling.sampler as sampler

    from labkit.experiments.principles import run_softmax

    real = sampler.sample_tensor
    monkeypatch.setattr(sampler, "sample_tensor", lambda logits, temps, gens: real(logits, [t * 2 for t in temps], gens))
    labkit_argv.checkpoint("principles.softmax")
    rec = run_softmax(tmp_path / "s.json")
    assert rec["verdict"] == "FAIL" and "facts.sampled_frequencies.0" in _failed(rec)


def _no_causal_mask(monkeypatch):
    """The engine's torch backend attends every position to every other (a prefill without its causal mask)."""
    from engine.attention.torch_backend import TorchAttention

    attend = TorchAttention._attend
    monkeypatch.setattr(TorchAttention, "_attend", staticmethod(lambda q, k, v, mask, scale, causal: attend(q, k, v, mask, scale, False)))


def _decode_stores_no_kv(monkeypatch):
    """A one-token step writes no K/V into the paged cache."""
    from engine.attention.torch_backend import TorchAttention

    store = TorchAttention.store_kv
    monkeypatch.setattr(TorchAttention, "store_kv",
                        lambda self, k, v, kc, vc, slots: None if k.shape[0] == 1 else store(self, k, v, kc, vc, slots))


def test_attention_fails_without_the_causal_mask(tmp_path, labkit_argv, monkeypatch):
    from labkit.experiments.principles import run_attention

    _no_causal_mask(monkeypatch)
    labkit_argv.checkpoint("principles.attention")
    rec = run_attention(tmp_path / "a.json")
    failed = _failed(rec)
    # the last row reads every position either way; the earlier rows now read the future
    assert rec["verdict"] == "FAIL" and {"facts.masked_earlier_delta", "facts.upper_triangle_max"} <= set(failed)


def test_uncached_walkthrough_fails_without_the_causal_mask(tmp_path, labkit_argv, monkeypatch):
    from labkit.experiments.uncached_walk import run_uncached

    _no_causal_mask(monkeypatch)
    labkit_argv.checkpoint("principles.uncached-walkthrough")
    rec = run_uncached(tmp_path / "u.json")
    # earlier rows read the future: they move when a position is appended, and the cached path no longer agrees
    assert rec["verdict"] == "FAIL"
    assert {"facts.causal_prefix_error", "facts.traced_position_error", "facts.attention_hand_vs_engine_max_error",
            "facts.cached.max_last_logit_error"} <= set(_failed(rec))
    assert "facts.total_input_positions" not in _failed(rec)


def test_uncached_walkthrough_fails_when_a_decode_reads_one_position_short(tmp_path, labkit_argv, monkeypatch):
    """The cached path's decode misses its newest K/V (context one short): only the cached assertions FAIL."""
    import engine.models.qwen3 as qwen3
    from labkit.experiments.uncached_walk import run_uncached

    forward = qwen3.Attention.forward

    def short(self, q, k, v, meta, **kw):
        if not meta.is_prefill:
            meta.context_lens = meta.context_lens - 1
            meta.seqlens_k = [n - 1 for n in meta.seqlens_k]
        return forward(self, q, k, v, meta, **kw)

    monkeypatch.setattr(qwen3.Attention, "forward", short)
    labkit_argv.checkpoint("principles.uncached-walkthrough")
    rec = run_uncached(tmp_path / "u.json")
    assert rec["verdict"] == "FAIL" and "facts.cached.max_last_logit_error" in _failed(rec)
    assert not {k for k in _failed(rec) if not k.startswith(("facts.cached.", "facts.attention_hand"))}


def test_uncached_walkthrough_fails_when_a_decode_stores_no_kv(tmp_path, labkit_argv, monkeypatch):
    from labkit.experiments.uncached_walk import run_uncached

    _decode_stores_no_kv(monkeypatch)
    labkit_argv.checkpoint("principles.uncached-walkthrough")
    rec = run_uncached(tmp_path / "u.json")
    assert rec["verdict"] == "FAIL" and {"facts.cached.score_shapes", "facts.cached.max_last_logit_error"} <= set(_failed(rec))


def test_memory_fails_when_counting_q_heads(tmp_path, labkit_argv, monkeypatch):
    """The handbook's own pitfall: 16 Q heads instead of 8 KV heads."""
    from engine.config import ModelShape
    from labkit.experiments.principles import run_memory

    monkeypatch.setattr(ModelShape, "kv_bytes_per_token",
                        lambda self, elem, tp=1: 2 * self.num_layers * self.num_heads * self.head_dim * elem)
    labkit_argv.checkpoint("principles.memory")
    rec = run_memory(tmp_path / "m.json")
    assert rec["verdict"] == "FAIL" and {"facts.kv_bytes_per_token", "facts.kv_mib_per_block"} <= set(_failed(rec))


def test_memory_fails_when_the_engine_pool_holds_q_heads(tmp_path, labkit_argv, monkeypatch):
    """The formula right, the pool the engine lays out wrong (16 Q heads per token): the pool assertions FAIL."""
    import torch

    import engine.kv_pool as kv_pool
    from labkit.experiments.principles import run_memory

    def allocate(layers, n, config, dtype, device, tp_size=1):
        s = config.shape
        return torch.zeros(2, len(layers), n, config.kvcache_block_size, s.num_heads, s.head_dim, dtype=dtype,
                           device=device)

    monkeypatch.setattr(kv_pool, "allocate", allocate)
    labkit_argv.checkpoint("principles.memory")
    rec = run_memory(tmp_path / "m.json")
    assert rec["verdict"] == "FAIL" and set(_failed(rec)) == {"facts.engine_pool_block.kv_heads_in_pool",
                                                              "facts.engine_pool_block_matches_formula"}


def test_softmax_fails_when_the_engine_log_probs_are_wrong(tmp_path, labkit_argv, monkeypatch):
    import engine.sampling.sampler as sampler

    from labkit.experiments.principles import run_softmax

    real = sampler.logprobs_of
    monkeypatch.setattr(sampler, "logprobs_of", lambda lp, targets, k: real(lp * 2, targets, k))
    labkit_argv.checkpoint("principles.softmax")
    rec = run_softmax(tmp_path / "s.json")
    assert rec["verdict"] == "FAIL" and {f"facts.engine_probabilities.{i}" for i in range(3)} == set(_failed(rec))


def test_attention_fails_when_a_decode_stores_no_kv(tmp_path, labkit_argv, monkeypatch):
    from labkit.experiments.principles import run_attention

    _decode_stores_no_kv(monkeypatch)
    labkit_argv.checkpoint("principles.attention")
    rec = run_attention(tmp_path / "a.json")
    assert rec["verdict"] == "FAIL" and "facts.cache.kv_slots_written" in _failed(rec)


def test_slots_fail_with_a_wrong_block_size(tiny_model_dir, tmp_path, labkit_argv):
    from labkit.experiments.principles import run_slots

    labkit_argv.checkpoint("principles.slots")
    rec = run_slots(tmp_path / "k.json", str(tiny_model_dir), block_size=8)
    assert rec["facts"]["teaching"]["slots"] == [136, 142, 40]
    assert rec["verdict"] == "FAIL" and {"facts.runtime.max_blocks_per_sequence", "facts.teaching.slots"} <= set(_failed(rec))


def test_slots_fail_when_the_runner_ignores_the_block_table(tiny_model_dir, tmp_path, labkit_argv, monkeypatch):
    from engine.step_inputs import InputBuilder
    from labkit.experiments.principles import run_slots

    monkeypatch.setattr(InputBuilder, "slot", lambda self, seq, position: position)   # the runner's inputs
    labkit_argv.checkpoint("principles.slots")
    rec = run_slots(tmp_path / "k.json", str(tiny_model_dir))
    assert rec["verdict"] == "FAIL" and "facts.teaching.slots" in _failed(rec)


def test_timing_fails_with_an_off_by_one_tpot(tmp_path, labkit_argv, monkeypatch):
    import labkit.load.report as report
    from labkit.experiments.principles import run_timing

    monkeypatch.setattr(report, "tpot_ms", lambda r: (r.token_ns[-1] - r.token_ns[0]) / 1e6 / len(r.token_ns))
    labkit_argv.checkpoint("principles.timing")
    rec = run_timing(tmp_path / "t.json")
    assert rec["verdict"] == "FAIL" and _failed(rec) == ["facts.tpot_ms"]


def test_lifecycle_fails_when_the_runner_reads_the_wrong_rows(qwen_shape_model_dir, tmp_path, labkit_argv, monkeypatch):
    """A runner that hands the LM head each sequence's first row instead of its last: the measured rows
    are [0,64], not [63,159]."""
    import torch

    from engine.model_runner import ModelRunner
    from labkit.experiments.lifecycle import run_lifecycle

    def first_rows(self, inputs, route=None):
        with torch.inference_mode():
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
            if inputs.is_prefill:
                hidden = hidden[inputs.meta.cu_seqlens_q[:-1].long()]
            return self.model.compute_logits(hidden)

    monkeypatch.setattr(ModelRunner, "run_model", first_rows)
    labkit_argv.checkpoint("principles.lifecycle")
    rec = run_lifecycle(tmp_path / "l.json", str(qwen_shape_model_dir), "cpu", "torch", shapes=True)
    assert rec["facts"]["shapes"]["prefill_last_rows"] == [0, 64]
    assert rec["verdict"] == "FAIL" and set(_failed(rec)) == {"facts.shapes.prefill_last_rows",
                                                              "facts.shapes.last_rows_are_cu_seqlens_q_minus_1"}


def test_lifecycle_fails_on_a_model_of_another_shape(tiny_model_dir, tmp_path, labkit_argv):
    from labkit.experiments.lifecycle import run_lifecycle

    labkit_argv.checkpoint("principles.lifecycle")
    rec = run_lifecycle(tmp_path / "l.json", str(tiny_model_dir), "cpu", "torch", shapes=True)
    failed = _failed(rec)
    assert rec["verdict"] == "FAIL" and "facts.shapes.prefill.qkv_proj" in failed
    assert "facts.prefill.cu_seqlens_q" not in failed          # the runner metadata does not depend on the model


@pytest.fixture
def no_prefix_hashes(monkeypatch):
    """An engine that never registers its full blocks' hashes: nothing can hit the prefix cache."""
    from engine.block_manager import BlockManager

    monkeypatch.setattr(BlockManager, "hash_blocks", lambda self, seq: None)


def test_prefix_walk_fails_without_prefix_hashes(no_prefix_hashes, tiny_model_dir, tmp_path, labkit_argv):
    from labkit.experiments.prefix_walk import run_prefix

    labkit_argv.checkpoint("principles.prefix-cache")
    rec = run_prefix(tmp_path / "p.json", str(tiny_model_dir), "cpu", "torch")
    assert rec["facts"]["b_first"]["cached"] == 0
    assert rec["verdict"] == "FAIL" and {"facts.b_first.cached", "facts.ref_count_trace",
                                         "facts.exact_512.cached"} <= set(_failed(rec))


def test_multiturn_fails_without_prefix_hashes(no_prefix_hashes, tiny_model_dir, tmp_path, labkit_argv):
    from labkit.experiments.multiturn import run_multiturn

    labkit_argv.checkpoint("principles.multiturn")
    rec = run_multiturn(tmp_path / "m.json", str(tiny_model_dir), "cpu", "torch")
    assert rec["facts"]["turn2_same_engine"]["cached"] == 0 and rec["facts"]["expected_cached"] == 512
    assert rec["verdict"] == "FAIL" and {"facts.turn2_same_engine.cached",
                                         "facts.cached_is_block_aligned_common_prefix"} <= set(_failed(rec))


def test_shapes_is_refused_for_the_prefix_walk(cli_app, tiny_model_dir):
    from typer.testing import CliRunner

    res = CliRunner().invoke(cli_app, ["quick-walk", "--case", "prefix", "--shapes", "--model", str(tiny_model_dir)])
    assert res.exit_code == 2 and "--shapes is for cases A-E and lifecycle" in res.output


def test_prefix_walk_records_the_hash_chain(prefix_cache_run):
    """facts.hash_chain in admission order: B and C hit A's 2 shared blocks (A's block ids, A's hashes), D
    (exactly the 512 shared tokens) only block 0; partial blocks carry no hash. (The walk: the module's run of
    principles.prefix-cache: run_prefix on the tiny model; the hash chain does not depend on the device.)"""
    f = json.loads(prefix_cache_run[2].read_text())["facts"]
    chain = {c["label"]: c for c in f["hash_chain"]}
    assert [c["label"] for c in f["hash_chain"]] == ["A", "B", "C", "D"]
    a, b, d = chain["A"]["blocks"], chain["B"]["blocks"], chain["D"]["blocks"]
    assert [x["hit"] for x in a] == [False] * 3 and [x["hit"] for x in b] == [True, True, False]
    assert [x["hit"] for x in d] == [True, False]
    assert [x["block_id"] for x in b[:2]] == [x["block_id"] for x in a[:2]] == f["watched_blocks"]
    assert [x["hash"] for x in b[:2]] == [x["hash"] for x in a[:2]] and a[2]["hash"] is None
    assert b[1]["parent"] == b[0]["hash"] and b[0]["parent"] is None and len(b[0]["hash"]) == 16
    assert (a[2]["first_token"], a[2]["last_token"]) == (512, 619)
    assert f["derived_inputs_consistent"]


def test_hash_fails_when_blocks_are_hashed_without_their_parent(tiny_model_dir, tmp_path, labkit_argv, monkeypatch):
    """Break the chain: chain_hash ignores the previous block's hash (in the engine and in what the lab reads,
    as a broken engine.chain_hash would be). P2's blocks 1 and 2 then get P1's hashes back: FAIL."""
    import engine.block_manager as bm
    import labkit.experiments.hash_chain as hc

    real = bm.chain_hash
    monkeypatch.setattr(bm, "chain_hash", lambda ids, prefix=-1: real(ids))
    monkeypatch.setattr(hc, "chain_hash", lambda ids, prefix=-1: real(ids))
    labkit_argv.checkpoint("principles.hash")
    rec = hc.run_hash(tmp_path / "h.json", str(tiny_model_dir), "cpu", "torch")
    assert rec["verdict"] == "FAIL" and _failed(rec) == ["facts.p2_same_hash_as_p1"]
    assert rec["facts"]["p2_same_hash_as_p1"] == [False, True, True]


def test_hash_fails_when_the_engine_does_not_hash(no_prefix_hashes, tiny_model_dir, tmp_path, labkit_argv):
    """An engine that never registers block hashes: P3 hits nothing and the stored hashes are not the chain."""
    from labkit.experiments.hash_chain import run_hash

    labkit_argv.checkpoint("principles.hash")
    rec = run_hash(tmp_path / "h.json", str(tiny_model_dir), "cpu", "torch")
    assert rec["verdict"] == "FAIL" and {"facts.hits.P3", "facts.cached.P3", "facts.p3_shares_p1_blocks",
                                         "facts.engine_hashes_match"} <= set(_failed(rec))
