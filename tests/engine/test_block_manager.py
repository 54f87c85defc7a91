"""BlockManager against the handbook: prefix hits, ref counts (B.6), growth at the block edge (5.2.3)."""
import pytest

from engine.block_manager import BlockManager
from engine.sampling.params import SamplingParams
from engine.sequence import Sequence


def seq(ids, block_size=256, sid=[0]):
    sid[0] += 1
    return Sequence(sid[0], list(ids), SamplingParams(max_tokens=8), block_size)


def computed(bm: BlockManager, s: Sequence) -> None:
    """Pretend the prefill ran: every prompt position now has KV, register full blocks."""
    s.num_cached_tokens = s.num_tokens
    bm.hash_blocks(s)


def test_allocate_and_deallocate_return_every_block():
    bm = BlockManager(8, 4)
    s = seq(range(10), 4)
    assert bm.can_allocate(s)
    bm.allocate(s)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    freed = bm.deallocate(s)
    assert sorted(freed) == sorted([0, 1, 2]) and bm.num_free_blocks == 8
    assert s.block_table == [] and s.num_cached_tokens == 0


def test_prefix_refcounts_follow_handbook_b6():
    bm = BlockManager(16, 256)
    shared = list(range(1000, 1512))
    a = seq(shared + list(range(5000, 5108)))           # 620 tokens, first 512 shared
    bm.allocate(a)
    computed(bm, a)
    first_two = a.block_table[:2]
    bm.deallocate(a)
    counts = [bm.ref_counts(first_two)]                 # [0, 0]: freed, hashes kept
    b = seq(shared + list(range(6000, 6108)))
    assert bm.num_cached_tokens_for(b) == 512           # 620 tokens hit 2 blocks
    bm.allocate(b)
    assert b.block_table[:2] == first_two and b.num_cached_tokens == 512
    counts.append(bm.ref_counts(first_two))             # [1, 1]
    c = seq(shared + list(range(7000, 7108)))
    bm.allocate(c)
    counts.append(bm.ref_counts(first_two))             # [2, 2]
    bm.deallocate(b)
    counts.append(bm.ref_counts(first_two))             # [1, 1]
    bm.deallocate(c)
    counts.append(bm.ref_counts(first_two))             # [0, 0]
    assert counts == [[0, 0], [1, 1], [2, 2], [1, 1], [0, 0]]


@pytest.mark.parametrize("enabled, hit", [(True, 512), (False, 0)])
def test_prefix_caching_switch_and_the_first_admissions_hits(enabled, hit):
    """enable_prefix_caching=False (vLLM's --no-enable-prefix-caching): the same 620-token prompt computes
    in full; num_prefix_hit_tokens keeps the first admission's hits (a preempted re-admission keeps it)."""
    bm = BlockManager(16, 256, enable_prefix_caching=enabled)
    a = seq(range(1000, 1620))
    bm.allocate(a)
    assert a.num_prefix_hit_tokens == 0
    computed(bm, a)
    bm.deallocate(a)
    b = seq(range(1000, 1620))
    bm.allocate(b)
    assert b.num_cached_tokens == hit and b.num_prefix_hit_tokens == hit
    computed(bm, b)
    bm.deallocate(b)                                    # preempted, and the cache forgotten meanwhile
    bm.reset_prefix_cache()
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and b.num_prefix_hit_tokens == hit


def test_exactly_512_tokens_hit_at_most_one_block():
    bm = BlockManager(16, 256)
    a = seq(range(1000, 1512))
    bm.allocate(a)
    computed(bm, a)
    bm.deallocate(a)
    same = seq(range(1000, 1512))
    assert bm.num_cached_tokens_for(same) == 256        # range(num_blocks - 1): one token is left to compute
    bm.allocate(same)
    assert same.num_cached_tokens == 256


def test_hash_hit_must_match_token_ids():
    bm = BlockManager(8, 4)
    a = seq([1, 2, 3, 4, 5], 4)
    bm.allocate(a)
    computed(bm, a)
    bm.deallocate(a)
    assert bm.num_cached_tokens_for(seq([1, 2, 3, 4, 5], 4)) == 4      # intact: the first block hits
    # corrupt the stored ids behind the hash: a lookup must not trust the hash alone
    (h, block_id), = bm.hash_to_block_id.items()
    bm.blocks[block_id].token_ids = [9, 9, 9, 9]
    assert bm.num_cached_tokens_for(seq([1, 2, 3, 4, 5], 4)) == 0


def test_overwritten_block_drops_its_old_hash():
    bm = BlockManager(2, 4)
    a = seq([1, 2, 3, 4, 5], 4)
    bm.allocate(a)
    computed(bm, a)
    old_hashes = dict(bm.hash_to_block_id)
    assert len(old_hashes) == 1
    bm.deallocate(a)
    b = seq([7, 7, 7, 7, 8, 8, 8], 4)                   # takes both blocks, overwriting a's
    bm.allocate(b)
    assert not set(old_hashes) & set(bm.hash_to_block_id)
    assert bm.num_cached_tokens_for(seq([1, 2, 3, 4, 5], 4)) == 0


def test_may_append_allocates_when_len_mod_b_is_1():
    bm = BlockManager(4, 256)
    s = seq(range(100, 356))                            # case C: exactly one block
    bm.allocate(s)
    s.num_cached_tokens = 256
    s.append_token(7)                                   # total 257, cached 256
    assert len(s.block_table) == 1 and s.num_blocks == 2
    assert bm.can_append(s)
    bm.may_append(s)
    assert len(s.block_table) == 2
    s.num_cached_tokens = 257
    s.append_token(8)                                   # 258: still two blocks
    bm.may_append(s)
    assert len(s.block_table) == 2


def test_can_allocate_counts_revived_free_blocks():
    bm = BlockManager(3, 4)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)             # 3 blocks
    bm.allocate(a)
    computed(bm, a)
    bm.deallocate(a)
    b = seq([1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 14], 4)   # 4 blocks, 2 hits: needs 4 of 3
    assert not bm.can_allocate(b)


def test_reset_prefix_cache_makes_the_next_identical_prompt_miss(tiny_engine):
    from engine import SamplingParams

    engine = tiny_engine(max_model_len=256, max_num_batched_tokens=256)
    prompt, sp = list(range(1000, 1040)), SamplingParams(temperature=0, max_tokens=2)
    engine.generate([prompt], sp)
    hit = engine.add_request(prompt, sp)
    engine.scheduler.schedule()
    assert hit.num_cached_tokens == 32 and hit.num_scheduled_tokens == 8    # 2 full blocks from the cache
    engine.abort(hit)
    assert engine.reset_prefix_cache() > 0
    cold = engine.add_request(prompt, sp)
    engine.scheduler.schedule()
    assert cold.num_cached_tokens == 0 and cold.num_scheduled_tokens == 40
    with pytest.raises(RuntimeError, match="in flight"):
        engine.reset_prefix_cache()


def test_shuffle_blocks_starts_the_free_list_in_a_seeded_order():
    """shuffle_blocks=SEED: the same permutation for the same seed, not 0, 1, 2, ...; None keeps 0, 1, 2, ..."""
    assert list(BlockManager(16, 4).free_block_ids) == list(range(16))
    a, b, c = (list(BlockManager(16, 4, shuffle_blocks=s).free_block_ids) for s in (7, 7, 8))
    assert a == b and a != c and sorted(a) == list(range(16)) and a != list(range(16))
    bm = BlockManager(16, 4, shuffle_blocks=7)
    s = seq(range(10), 4)
    bm.allocate(s)
    assert s.block_table == a[:3]                        # handed out in that order


def test_pool_snapshot_lists_blocks_in_use_or_still_hashed():
    bm = BlockManager(8, 4)
    s = seq(range(10), 4)                                # 2 full blocks + 2 tokens
    bm.allocate(s)
    computed(bm, s)
    assert bm.pool_snapshot() == [{"id": 0, "ref_count": 1, "hashed": True}, {"id": 1, "ref_count": 1, "hashed": True},
                                  {"id": 2, "ref_count": 1, "hashed": False}]
    bm.deallocate(s)                                     # free: the partial block drops out, the hashed ones stay
    assert bm.pool_snapshot() == [{"id": 0, "ref_count": 0, "hashed": True}, {"id": 1, "ref_count": 0, "hashed": True}]
    assert bm.block_hashes([0, 2])[1] is None and isinstance(bm.block_hashes([0])[0], int)
