"""`labkit bench --workload nano-batches` (labkit/bench/nano_batches.py) on the CPU: the pieces its CUDA graphs are
made of. The half batches read what the same rows of the full batch read, so the three ways give the full
batch's logits (the overlap here without its side stream); the second half's counters are swapped in and back
out; a shape the pool cannot hold is refused (the option refusals are rows of test_bench.py's table). The
graphs and the two streams themselves need CUDA (the bench refuses the CPU)."""
from __future__ import annotations

import pytest
import torch

from labkit.bench.nano_batches import decode_rows, max_rel_diff, ways, with_locks

ENGINE = dict(max_num_seqs=8, max_model_len=128, max_num_batched_tokens=256, num_kvcache_blocks=40,
              kvcache_block_size=16)


@pytest.fixture(scope="module")
def engine(lab_engine):
    return lab_engine(**ENGINE)


def test_half_batches_read_the_full_batchs_rows(engine):
    full = decode_rows(engine, 0, 6, 40)
    halves = decode_rows(engine, 0, 3, 40) + decode_rows(engine, 3, 3, 40)
    assert [s.block_table for s in halves] == [s.block_table for s in full]
    assert [s.token_ids[-1] for s in halves] == [s.token_ids[-1] for s in full] == [7, 8, 9, 10, 11, 12]
    blocks = [b for s in full for b in s.block_table]
    assert len(set(blocks)) == len(blocks) == 6 * 3                      # distinct blocks, 3 per row of 40


def test_every_way_gives_the_full_batchs_logits(engine):
    with torch.inference_mode():
        out = {name: fn() for name, fn in ways(engine, 6, 40).items()}
        step = engine.probe.decode_step_fn(decode_rows(engine, 0, 6, 40))
        again = step()
    assert out["full"].shape == (6, engine.config.hf_config["vocab_size"])
    for name in ("halves", "overlap"):
        assert max_rel_diff(out[name], out["full"]) <= 1e-6, name
    # every row its own logits, so halves put back in another order would differ
    assert max_rel_diff(out["full"].flip(0), out["full"]) > 1e-3
    assert torch.equal(again, out["full"])                              # nothing written: a step again is the same
    assert (engine.probe.kv_cache() == 0).all()


def test_the_second_halfs_counters_are_swapped_back():
    import engine.attention.triton_kernels as tk

    cpu = torch.device("cpu")
    own, mine = torch.zeros(4), torch.ones(4)
    seen = []
    tk._locks[cpu] = own
    try:
        with_locks(lambda: seen.append(tk._locks.get(cpu)), mine)
        assert seen[-1] is mine and tk._locks[cpu] is own
    finally:
        tk._locks.pop(cpu, None)
    with_locks(lambda: seen.append(tk._locks.get(cpu)), mine)            # no counters before: none after
    assert seen[-1] is mine and cpu not in tk._locks


def test_a_batch_the_pool_cannot_hold_is_refused(engine):
    with pytest.raises(ValueError, match="do not fit the pool"):
        decode_rows(engine, 0, 20, 40)                   # 20 rows x 3 blocks > 40
