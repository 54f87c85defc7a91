"""Scheduler against the handbook: chunked prefill (5.2.4), preemption (B.2.2 step 2), finishing."""
import pytest

from engine.block_manager import BlockManager
from engine.config import SchedulerLimits
from engine.sampling.params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus


@pytest.fixture
def make():
    """A scheduler from plain limits: no model directory, no engine."""
    def _make(num_blocks, block_size, **kw):
        bm = BlockManager(num_blocks, block_size)
        return Scheduler(SchedulerLimits(**kw), bm), bm
    return _make


def add(s, ids, max_tokens=4, block_size=256, sid=[100]):
    sid[0] += 1
    seq = Sequence(sid[0], list(ids), SamplingParams(max_tokens=max_tokens, ignore_eos=True), block_size)
    s.add(seq)
    return seq


def test_chunked_prefill_700_and_32_under_budget_512(make):
    s, bm = make(16, 256, max_num_batched_tokens=512)
    a = add(s, range(20000, 20700))
    b = add(s, range(40000, 40032))
    seqs, pf = s.schedule()
    assert pf and seqs == [a] and (a.num_tokens, a.num_cached_tokens, a.num_scheduled_tokens) == (700, 0, 512)
    s.postprocess(seqs, [1], pf)
    assert (a.num_tokens, a.num_cached_tokens, a.num_completion_tokens) == (700, 512, 0)
    seqs, pf = s.schedule()
    assert pf and seqs == [a, b] and [x.num_scheduled_tokens for x in seqs] == [188, 32]
    s.postprocess(seqs, [5, 6], pf)
    assert (a.num_tokens, a.num_cached_tokens) == (701, 700) and a.completion_token_ids == [5]
    seqs, pf = s.schedule()
    assert not pf and seqs == [a, b]


def test_only_the_first_sequence_may_be_chunked(make):
    s, bm = make(16, 256, max_num_batched_tokens=100)
    a = add(s, range(10, 60))          # 50 tokens
    b = add(s, range(100, 200))        # 100 tokens: does not fit the 50 left
    seqs, _ = s.schedule()
    assert seqs == [a] and a.num_scheduled_tokens == 50 and not b.block_table


def test_preemption_of_running_tail_b22(make):
    s, bm = make(4, 4, max_num_batched_tokens=512)
    a, b, c = add(s, [1, 2, 3, 4], block_size=4), add(s, [5, 6, 7, 8], block_size=4), add(s, [9, 10, 11, 12], block_size=4)
    seqs, pf = s.schedule()
    assert pf and seqs == [a, b, c] and bm.num_free_blocks == 1
    s.postprocess(seqs, [13, 14, 15], pf)            # each samples one token: totals 5, next decode needs a block each
    seqs, pf = s.schedule()
    assert not pf and seqs == [a, b]
    assert list(s.waiting) == [c] and c.status == SequenceStatus.WAITING
    assert c.num_cached_tokens == 0 and c.block_table == [] and c.num_tokens == 5


def test_finish_frees_blocks_at_once_and_discards_chunk_candidates(make):
    s, bm = make(8, 4, max_num_batched_tokens=4)
    a = add(s, range(30, 36), max_tokens=1, block_size=4)    # 6 tokens, budget 4: two chunks
    seqs, pf = s.schedule()
    out = s.postprocess(seqs, [99], pf)
    assert out.discarded == [a.seq_id] and a.num_completion_tokens == 0
    seqs, pf = s.schedule()
    out = s.postprocess(seqs, [42], pf)
    assert out.accepted == {a.seq_id: 42} and out.finished == [a]
    assert a.finish_reason == "length" and a.block_table == [] and bm.num_free_blocks == 8
    assert s.is_finished()


def test_eos_stops_unless_ignored(make):
    eos = 151645                                   # Qwen3's <|im_end|>
    s, bm = make(8, 4, eos_token_ids=(eos,))
    stop = Sequence(1, [1, 2], SamplingParams(max_tokens=5), 4)
    keep = Sequence(2, [3, 4], SamplingParams(max_tokens=5, ignore_eos=True), 4)
    s.add(stop)
    s.add(keep)
    seqs, pf = s.schedule()
    s.postprocess(seqs, [eos, eos], pf)
    assert stop.finish_reason == "stop" and not keep.is_finished


def test_balanced_policy_alternates_and_rotates(make):
    s, bm = make(32, 4, max_num_batched_tokens=8, max_num_seqs=2, scheduling_policy="balanced")
    first = [add(s, [i, i + 1], max_tokens=8, block_size=4) for i in (1, 11)]
    seqs, pf = s.schedule()
    s.postprocess(seqs, [0, 0], pf)
    late = add(s, [50, 51], max_tokens=8, block_size=4)
    seqs, pf = s.schedule()
    assert not pf and seqs == first          # a prefill ran last: decode gets the turn
    s.postprocess(seqs, [0, 0], pf)
    seqs, pf = s.schedule()
    assert pf and seqs == [late]


def test_preempted_requests_finish_with_the_same_greedy_outputs(tiny_engine):
    """A pool too small for every request at once forces preemption (recompute); outputs must not change."""

    prompts = [list(range(1000 + 97 * i, 1006 + 97 * i)) for i in range(4)]
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

    def run(num_blocks):
        eng = tiny_engine(device="cpu", kvcache_block_size=4, num_kvcache_blocks=num_blocks)
        seqs = [eng.add_request(p, sp) for p in prompts]
        preempted = 0
        while not eng.is_finished():
            before = {s.seq_id for s in eng.scheduler.running}
            eng.step()
            preempted += len(before & {s.seq_id for s in eng.scheduler.waiting})
        assert eng.block_manager.num_free_blocks == num_blocks
        return [s.completion_token_ids for s in seqs], preempted

    roomy, none = run(64)
    tight, some = run(12)              # 4 requests x 4 blocks at the end > 12 blocks
    assert none == 0 and some > 0
    assert tight == roomy
