"""EngineProbe (``LLMEngine.probe``): each view says what the engine's own state says, and reading it changes nothing."""
from __future__ import annotations

from engine import SamplingParams


def test_the_probe_reads_two_requests_sharing_a_prefix(tiny_engine):
    engine = tiny_engine(max_model_len=256, max_num_batched_tokens=256)
    sp = SamplingParams(temperature=0, max_tokens=4)
    shared = list(range(1000, 1032))                                 # two full blocks of 16
    a = engine.add_request(shared + [7, 8, 9], sp)
    engine.step()                                                    # a's prefill registers the two full blocks
    b = engine.add_request(shared + [4, 5], sp)
    engine.step()                                                    # b hits them
    probe, bm = engine.probe, engine.block_manager
    assert b.block_table[:2] == a.block_table[:2]
    assert probe.ref_counts(a.block_table) == [2, 2, 1]
    hashes = probe.block_hashes(b.block_table)
    assert hashes[0] is not None and hashes[1] is not None and hashes[2] is None     # the partial block has none
    pool = probe.pool()
    owners = {blk["id"]: sorted(blk["owners"]) for blk in pool["blocks"]}
    assert owners[a.block_table[0]] == sorted([a.seq_id, b.seq_id]) and owners[b.block_table[2]] == [b.seq_id]
    assert pool["num_blocks"] == bm.num_blocks and pool["block_size"] == 16
    used = {blk for s in (a, b) for blk in s.block_table}
    assert set(probe.free_block_ids()) == set(range(bm.num_blocks)) - used
    kv = probe.kv_cache()
    cfg = engine.config
    assert kv.shape[:4] == (2, cfg.shape.num_layers, bm.num_blocks, 16)
    assert [probe.slot(b, p) for p in (0, 17, 33)] == [b.block_table[0] * 16, b.block_table[1] * 16 + 1,
                                                       b.block_table[2] * 16 + 1]
    assert "model.layers.0.self_attn" in dict(probe.named_modules())


def test_reading_the_probe_changes_no_token(tiny_engine):
    prompts = [list(range(2000, 2040)), list(range(2000, 2020)) + [9] * 5]
    sp = SamplingParams(temperature=0, max_tokens=6)
    plain = [o["token_ids"] for o in tiny_engine().generate(prompts, sp)]
    engine = tiny_engine()
    probe = engine.probe
    for p in prompts:
        engine.add_request(p, sp)
    seqs = list(engine.scheduler.waiting)
    while not engine.is_finished():
        engine.step()
        probe.pool(), probe.free_block_ids(), probe.kv_cache().sum()
        for s in seqs:
            probe.ref_counts(s.block_table), probe.block_hashes(s.block_table)
    assert [s.completion_token_ids for s in seqs] == plain
