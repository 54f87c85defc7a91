"""The mixed step (decodes and prefill chunks in one step) and the scheduler's rules in both step models.

The rules are judged on what the scheduler does, not only on what comes out: every step within its token
budget, the newest running request preempted, a preempted request back before newcomers, prefix-cache hits
counted in tokens. The engine tests run the tiny model in float32 on the CPU: the mixed step gives the same
greedy tokens as nano-vllm's step model and as transformers.
"""
import random

import pytest
import torch

from engine import SamplingParams
from engine.block_manager import BlockManager
from engine.config import SchedulerLimits
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus

GREEDY = dict(temperature=0.0, ignore_eos=True)


class Sched:
    """A scheduler on plain limits and a counter of sequence ids."""

    def __init__(self, num_blocks, block_size, **limits):
        self.bm = BlockManager(num_blocks, block_size)
        self.s = Scheduler(SchedulerLimits(**limits), self.bm)
        self.block_size = block_size
        self.next_id = 0

    def add(self, n_tokens, max_tokens=4, first=0):
        self.next_id += 1
        ids = list(range(first or 1000 * self.next_id, (first or 1000 * self.next_id) + n_tokens))
        seq = Sequence(self.next_id, ids, SamplingParams(max_tokens=max_tokens, **GREEDY), self.block_size)
        self.s.add(seq)
        return seq

    def step(self, token=7):
        seqs, pf = self.s.schedule()
        scheduled = [(q, q.num_scheduled_tokens) for q in seqs]
        self.s.postprocess(seqs, [token] * len(seqs), pf)
        return scheduled, pf


def test_a_mixed_step_runs_decodes_first_then_chunks_in_what_is_left():
    t = Sched(64, 16, max_num_batched_tokens=64, mixed_batches=True)
    a, b = t.add(20), t.add(20)
    (rows, pf) = t.step()
    assert pf and [(q, n) for q, n in rows] == [(a, 20), (b, 20)]
    c = t.add(100)                                  # arrives while a and b decode
    rows, pf = t.step()
    # a and b decode (one token each), c's first chunk takes the 62 tokens left of the 64
    assert pf and rows == [(a, 1), (b, 1), (c, 62)]
    assert c.status == SequenceStatus.WAITING and c.num_cached_tokens == 62
    rows, pf = t.step()
    assert rows == [(a, 1), (b, 1), (c, 38)] and c.status == SequenceStatus.RUNNING
    rows, pf = t.step()
    assert not pf and rows == [(a, 1), (b, 1), (c, 1)]


def test_a_mixed_step_may_chunk_a_request_that_is_not_first():
    t = Sched(64, 16, max_num_batched_tokens=50, mixed_batches=True)
    a, b = t.add(10), t.add(100)
    rows, _ = t.step()
    assert rows == [(a, 10), (b, 40)]            # the step model would stop at a (only the first may be chunked)
    t2 = Sched(64, 16, max_num_batched_tokens=50)
    a2, b2 = t2.add(10), t2.add(100)
    rows, _ = t2.step()
    assert rows == [(a2, 10)]


def _random_run(mixed: bool, seed: int, budget: int = 96):
    """A random workload (arrivals between steps, a tight pool); yields each step's rows."""
    rng = random.Random(seed)
    t = Sched(24, 8, max_num_batched_tokens=budget, max_num_seqs=6, mixed_batches=mixed)
    pending = [(rng.randint(0, 30), rng.randint(5, 120), rng.randint(1, 12)) for _ in range(12)]
    step = 0
    while pending or not t.s.is_finished():
        for item in [p for p in pending if p[0] <= step]:
            t.add(item[1], max_tokens=item[2])
            pending.remove(item)
        if not t.s.is_finished():
            yield t, t.step()[0]
        step += 1
        assert step < 2000


@pytest.mark.parametrize("mixed", [False, True], ids=["step-model", "mixed"])
def test_every_step_stays_within_its_token_budget_and_seat_count(mixed):
    steps = 0
    for seed in range(4):
        for t, rows in _random_run(mixed, seed):
            steps += 1
            assert sum(n for _, n in rows) <= t.s.max_num_batched_tokens
            assert len(rows) <= t.s.max_num_seqs
            assert len({q.seq_id for q, _ in rows}) == len(rows)
    assert steps > 40


@pytest.mark.parametrize("mixed", [False, True], ids=["step-model", "mixed"])
def test_preemption_takes_the_newest_running_request(mixed):
    t = Sched(6, 4, max_num_batched_tokens=64, mixed_batches=mixed)
    a, b, c = t.add(4, max_tokens=8), t.add(4, max_tokens=8), t.add(4, max_tokens=8)
    rows, _ = t.step()                          # 3 blocks used, each request's next token needs a new block
    assert [q for q, _ in rows] == [a, b, c]
    t.step()                                    # 3 more blocks: the pool (6) is full
    assert t.bm.num_free_blocks == 0
    rows, _ = t.step()                          # positions 5..: still in their second block, no preemption
    assert t.s.num_preemptions == 0
    for _ in range(3):
        rows, _ = t.step()
        if t.s.num_preemptions:
            break
    assert t.s.num_preemptions == 1
    assert c.status == SequenceStatus.WAITING and c.block_table == []     # c was admitted last
    assert a.status == b.status == SequenceStatus.RUNNING


@pytest.mark.parametrize("mixed", [False, True], ids=["step-model", "mixed"])
def test_a_preempted_request_comes_back_before_newcomers(mixed):
    t = Sched(6, 4, max_num_batched_tokens=64, mixed_batches=mixed)
    a, b, c = t.add(4, max_tokens=9), t.add(4, max_tokens=9), t.add(4, max_tokens=9)
    t.step()
    t.step()                                    # the pool is full
    d = t.add(4, max_tokens=2)                  # a newcomer: waits, no block for it
    while not t.s.num_preemptions:
        t.step()
    assert c.status == SequenceStatus.WAITING and d.status == SequenceStatus.WAITING
    assert list(t.s.waiting) == [c, d]
    order = []
    while not t.s.is_finished():
        rows, _ = t.step()
        order += [q for q, n in rows if n > 1 and q not in order]     # prefills, in the order they ran
    assert order.index(c) < order.index(d)


@pytest.mark.parametrize("mixed", [False, True], ids=["step-model", "mixed"])
def test_prefix_cache_hits_are_counted_in_tokens(mixed):
    t = Sched(32, 16, max_num_batched_tokens=256, mixed_batches=mixed)
    first = t.add(40, max_tokens=1, first=500)        # 2 full blocks + 8 tokens
    while not t.s.is_finished():
        t.step()
    assert (t.s.prefix_queries, t.s.prefix_hits) == (40, 0)
    again = t.add(45, max_tokens=1, first=500)        # the same 40 tokens, then 5 more: the 2 full blocks hit
    rows, _ = t.step()
    assert rows == [(again, 45 - 32)]
    assert (t.s.prefix_queries, t.s.prefix_hits) == (85, 32)
    assert first.finish_reason == "length"


# -- the engine, tiny model, float32 ----------------------------------------------------------------------

def _arrivals(engine, prompts, at, sp, after_step=None):
    """Run prompts[i] added before step at[i]; returns the completions and the kind of each step run.
    after_step(engine), if given, looks at the engine after each step."""
    kinds = []
    seqs, step = {}, 0
    while len(seqs) < len(prompts) or not engine.is_finished():
        for i, p in enumerate(prompts):
            if at[i] == step:
                seqs[i] = engine.add_request(p, sp)
        if not engine.is_finished():
            out = engine.step()
            if out.seqs:
                kinds.append(out.kind)
            if after_step is not None:
                after_step(engine)
        step += 1
    return [seqs[i].completion_token_ids for i in range(len(prompts))], kinds


def _workload(seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = (7, 90, 33, 150, 12, 64)
    prompts = [torch.randint(0, 151000, (n,), generator=g).tolist() for n in lengths]
    prompts.append(prompts[1][:64] + [11, 12, 13])      # a prefix hit (block 16: 4 blocks) arriving mid-run
    return prompts, [0, 0, 2, 3, 5, 9, 12]


@pytest.mark.parametrize("overlap", [False, True])
def test_mixed_steps_give_the_step_models_greedy_tokens(tiny_engine, overlap):
    prompts, at = _workload()
    sp = SamplingParams(max_tokens=12, **GREEDY)
    opts = dict(device="cpu", kvcache_block_size=16, max_num_batched_tokens=64, max_model_len=512, overlap=overlap)
    step_model, kinds_a = _arrivals(tiny_engine(**opts), prompts, at, sp)
    mixed, kinds_b = _arrivals(tiny_engine(mixed_batches=True, **opts), prompts, at, sp)
    assert "mixed" not in kinds_a and kinds_b.count("mixed") >= 5
    assert mixed == step_model


def test_overlap_launches_mixed_steps_ahead_with_the_same_tokens(tiny_engine):
    """With overlap, a step that also admits prefill chunks is launched while the step before it (decode,
    prefill or mixed) is still in flight: its decode rows' ids fed on the device, the chunks' from the host."""
    prompts, at = _workload()
    sp = SamplingParams(max_tokens=12, **GREEDY)
    opts = dict(device="cpu", kvcache_block_size=16, max_num_batched_tokens=64, max_model_len=512,
                mixed_batches=True)
    serial, _ = _arrivals(tiny_engine(**opts), prompts, at, sp)
    engine = tiny_engine(overlap=True, **opts)
    ahead = []                         # the kind of the step left in flight after each call
    overlapped, _ = _arrivals(engine, prompts, at, sp,
                              lambda e: e._inflight is not None and ahead.append(e._inflight.kind))
    assert overlapped == serial
    assert ahead.count("mixed") >= 3 and "decode" in ahead
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_mixed_steps_match_transformers_greedy(tiny_engine, tiny_model_dir):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), attn_implementation="eager",
                                              dtype=torch.float32).eval()
    prompts, at = _workload(1)
    sp = SamplingParams(max_tokens=8, **GREEDY)
    engine = tiny_engine(device="cpu", kvcache_block_size=16, max_num_batched_tokens=48, max_model_len=512,
                         mixed_batches=True)
    ours, kinds = _arrivals(engine, prompts, at, sp)
    assert "mixed" in kinds
    with torch.no_grad():
        for p, got in zip(prompts, ours):
            ref = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
            assert got == ref[0, len(p):].tolist()


def test_mixed_steps_under_preemption_give_the_same_tokens(tiny_engine):
    prompts = [list(range(1000 + 97 * i, 1006 + 97 * i)) for i in range(5)]
    sp = SamplingParams(max_tokens=10, **GREEDY)
    at = [0, 0, 1, 1, 4]

    def run(num_blocks, mixed):
        eng = tiny_engine(device="cpu", kvcache_block_size=4, num_kvcache_blocks=num_blocks, mixed_batches=mixed)
        out, _ = _arrivals(eng, prompts, at, sp)
        assert eng.block_manager.num_free_blocks == num_blocks
        return out, eng.scheduler.num_preemptions

    roomy, none = run(64, False)
    tight, some = run(12, True)
    assert none == 0 and some > 0
    assert tight == roomy


def test_mixed_steps_under_tensor_parallel_give_the_tp1_tokens(tiny_model_dir):
    """TP=2 (gloo): rank 0 sends the mixed step's plan (its decode rows included) to the other rank, which
    plans the same attention split; the greedy tokens are TP=1's."""
    from engine import LLMEngine

    prompts, at = _workload(4)
    sp = SamplingParams(max_tokens=6, **GREEDY)
    opts = dict(device="cpu", kvcache_block_size=16, max_num_batched_tokens=64, max_model_len=512, mixed_batches=True)
    one = LLMEngine(str(tiny_model_dir), **opts)
    try:
        tp1, kinds = _arrivals(one, prompts, at, sp)
    finally:
        one.close()
    two = LLMEngine(str(tiny_model_dir), tensor_parallel_size=2, **opts)
    try:
        tp2, _ = _arrivals(two, prompts, at, sp)
    finally:
        two.close()
    assert "mixed" in kinds
    assert tp2 == tp1


@pytest.mark.parametrize("mixed", [False, True], ids=["step-model", "mixed"])
def test_upstream_bug_cases_hold_in_both_step_models(tiny_engine, mixed):
    """nano-vllm's known failure cases, each against a fresh engine running the request alone: identical
    prompts in one batch, a prompt of exactly two full blocks met again (the cache holds all of it: the last
    token must still be computed), and a context that runs into max_model_len while other requests prefill."""
    sp = SamplingParams(max_tokens=8, **GREEDY)
    opts = dict(device="cpu", kvcache_block_size=16, max_num_batched_tokens=64, max_model_len=160)

    def alone(prompt, params=sp):
        eng = tiny_engine(**opts)
        seq = eng.add_request(prompt, params)
        while not eng.is_finished():
            eng.step()
        return seq.completion_token_ids, seq.finish_reason

    same = list(range(700, 740))
    full = list(range(900, 932))                   # exactly two blocks of 16
    long = list(range(2000, 2150))                 # 150 + 10: up to max_model_len 160 exactly
    engine = tiny_engine(mixed_batches=mixed, **opts)
    first = [engine.add_request(same, sp) for _ in range(4)] + [engine.add_request(full, sp)]
    while not engine.is_finished():
        engine.step()
    again = engine.add_request(full, sp)
    far = engine.add_request(long, SamplingParams(max_tokens=10, **GREEDY))
    late = engine.add_request(same + [5], sp)
    while not engine.is_finished():
        engine.step()
    ref_same = alone(same)[0]
    assert all(s.completion_token_ids == ref_same for s in first[:4])
    assert first[4].completion_token_ids == again.completion_token_ids == alone(full)[0]
    assert again.num_prompt_tokens == 32 and engine.scheduler.prefix_hits >= 16
    assert (far.completion_token_ids, far.finish_reason) == alone(long, SamplingParams(max_tokens=10, **GREEDY))
    assert far.finish_reason == "length" and far.num_tokens == 160
    assert late.completion_token_ids == alone(same + [5])[0]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_mixed_steps_parts_are_made_once_per_step():
    """Every layer's attention asks for the decode rows' metadata: the step's metadata makes it once and hands the
    same one back. The chunks' longest query is the step's (each decode row has one)."""
    from engine.step_inputs import InputBuilder
    from engine.sequence import Sequence

    seqs = []
    for i, (total, cached, decoding) in enumerate(((20, 19, True), (33, 32, True), (40, 16, False), (25, 0, False))):
        s = Sequence(i, list(range(100, 100 + total)), None, 16)  # type: ignore[arg-type]
        s.block_table = list(range(4 * i, 4 * i + 3))
        s.num_cached_tokens, s.num_scheduled_tokens, s.decoding = cached, total - cached, decoding
        seqs.append(s)
    meta = InputBuilder(16, "cpu").prepare_prefill(seqs).meta
    assert meta.num_decodes == 2
    part = meta.decode_part()
    assert part is meta.decode_part() and part.seqlens_k == [20, 33] and part.max_seqlen_k == 33
    assert meta.max_seqlen_q == 25 == max(meta.seqlens_q[meta.num_decodes:])
