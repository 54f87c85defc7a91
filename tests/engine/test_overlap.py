"""Overlapped decode (Config.overlap): the same tokens as one-step-at-a-time, whatever ends a request."""
from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest

from engine import LLMEngine, SamplingParams
from engine.config import ConfigError

KW = dict(device="cpu", enforce_eager=True, max_num_batched_tokens=128, max_model_len=160, kvcache_block_size=16)


def run(build, overlap: bool, prompts, params, **kw):
    """``build`` is the test's ``tiny_engine``: a fresh engine per run, closed here."""
    engine = build(overlap=overlap, **(KW | kw))
    outs = engine.generate(prompts, params)
    free = engine.block_manager.num_free_blocks
    engine.close()
    return [(o["token_ids"], o["finish_reason"]) for o in outs], free


def workload(n=6):
    prompts = [[(1000 + 37 * i + j) % 150000 for j in range(5 + 9 * i)] for i in range(n)]
    params = [SamplingParams(temperature=0.0, max_tokens=3 + 5 * i, ignore_eos=True) for i in range(n)]
    return prompts, params


def test_overlap_gives_the_same_greedy_tokens(tiny_engine):
    prompts, params = workload()
    sync, free_sync = run(tiny_engine, False, prompts, params)
    over, free_over = run(tiny_engine, True, prompts, params)
    assert over == sync
    assert free_over == free_sync                       # every block came back
    # and the overlap really happened: most calls leave the next decode step in flight
    engine = tiny_engine(overlap=True, **KW)
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp)
    calls = ahead = 0
    while not engine.is_finished():
        engine.step()
        calls, ahead = calls + 1, ahead + (engine._inflight is not None)
    assert ahead >= calls // 2
    engine.close()


def test_overlap_handles_eos_and_max_model_len(tiny_engine):
    prompts, params = workload()
    sync, _ = run(tiny_engine, False, prompts, params)
    # make a token that greedy decoding emits mid-way an EOS: requests stop there, found out one step late
    eos = sync[3][0][4]
    # the one admission rule: prompt + max_tokens fits max_model_len, so the long ones end at exactly 64
    stop = [SamplingParams(temperature=0.0, max_tokens=min(30, 64 - len(p))) for p in prompts]
    a, fa = run(tiny_engine, False, prompts, stop, eos_token_ids=(eos,), max_model_len=64)
    b, fb = run(tiny_engine, True, prompts, stop, eos_token_ids=(eos,), max_model_len=64)
    assert b == a and fb == fa
    reasons = {r for _, r in a}
    assert "stop" in reasons and "length" in reasons


def test_overlap_seeded_sampling_matches(tiny_engine):
    prompts, _ = workload(4)
    params = [SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=7 + i) for i in range(4)]
    assert run(tiny_engine, True, prompts, params)[0] == run(tiny_engine, False, prompts, params)[0]


def test_overlap_survives_an_abort_while_a_step_is_in_flight(tiny_engine):
    engine = tiny_engine(overlap=True, **KW)
    prompts, params = workload(3)
    seqs = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)) for p in prompts]
    while not engine._inflight:
        engine.step()
    engine.abort(seqs[1])
    while not engine.is_finished():
        engine.step()
    assert seqs[1].finish_reason == "cancelled" and len(seqs[0].completion_token_ids) == 20
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.close()


def test_overlap_refuses_tensor_parallel(tiny_model_dir):
    with pytest.raises(ConfigError, match="overlap"):
        LLMEngine(str(tiny_model_dir), overlap=True, tensor_parallel_size=2, device="cpu", enforce_eager=True)


def arrivals(build, mode: str, monkeypatch, overlap: bool = True):
    """Requests arriving while others decode, two before every third step() call: each request's tokens and
    finish, the step() calls that returned with a prefill in flight, those that returned a prefill's tokens with
    the decode after it in flight, and whether every block came back. mode: LAB_PREFILL_AHEAD's value."""
    monkeypatch.setenv("LAB_PREFILL_AHEAD", mode)
    engine = build(overlap=overlap, **KW)
    d = engine.describe()
    assert (d["prefill_ahead"], d["decode_behind_prefill"], d["prefill_behind_prefill"]) == \
        (mode != "0" and overlap, mode == "1" and overlap, mode == "prefills" and overlap)
    prompts, params = workload(8)
    seqs, calls, prefill_in_flight, decode_behind = [], 0, 0, 0
    while len(seqs) < len(prompts) or not engine.is_finished():
        if calls % 3 == 0 and len(seqs) < len(prompts):
            seqs += [engine.add_request(p, sp) for p, sp in
                     zip(prompts[len(seqs):len(seqs) + 2], params[len(seqs):len(seqs) + 2])]
        out = engine.step()
        calls += 1
        prefill_in_flight += engine._inflight is not None and engine._inflight.is_prefill
        decode_behind += out.is_prefill and engine._inflight is not None and not engine._inflight.is_prefill
    out = [(list(s.completion_token_ids), s.finish_reason) for s in seqs]
    free = engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.close()
    return out, (prefill_in_flight, decode_behind), free


def test_prefill_ahead_launches_waiting_prefills_behind_a_decode_and_keeps_the_tokens(tiny_engine, monkeypatch):
    """LAB_PREFILL_AHEAD=1 (nano-vllm's step model, overlapped decode): a request that arrives while a decode is in
    flight has its prefill launched behind it, before that decode's tokens are read, and the decode after a
    prefill (the prefill's rows fed on the device, the others' ids from the host) behind the prefill; the greedy
    tokens are those of one step at a time, and of the overlap without it."""
    sync, none_sync, free_sync = arrivals(tiny_engine, "1", monkeypatch, overlap=False)
    plain, none_plain, free_plain = arrivals(tiny_engine, "0", monkeypatch)
    ahead, launched, free_ahead = arrivals(tiny_engine, "1", monkeypatch)
    assert ahead == plain == sync and free_sync and free_plain and free_ahead
    assert none_sync == none_plain == (0, 0) and launched[0] >= 2 and launched[1] >= 2, launched


def test_prefill_ahead_prefill_only_launches_the_prefill_early_and_keeps_the_step_models_steps(tiny_engine,
                                                                                              tiny_model_dir,
                                                                                              monkeypatch):
    """LAB_PREFILL_AHEAD=prefill: a waiting prefill is launched behind the decode in flight (a step() call returns
    with it in flight), never a decode behind a prefill; the greedy tokens are those without it, and with one
    arrival per step() call (tools/prefill_ahead_steps.py) the steps are the step model's, kind for kind."""
    plain, _, _ = arrivals(tiny_engine, "0", monkeypatch)
    ahead, launched, free = arrivals(tiny_engine, "prefill", monkeypatch)
    assert ahead == plain and free
    assert launched[0] >= 2 and launched[1] == 0, launched
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    from prefill_ahead_steps import run

    off, early = (run(str(tiny_model_dir), mode, per_call=1, requests=16, prompt=32, output=8)
                  for mode in ("0", "prefill"))
    assert (early["prefill_ahead"], early["decode_behind_prefill"]) == (True, False), early
    assert early["steps"] == off["steps"] and early["mean_prefill_seqs"] == off["mean_prefill_seqs"], (off, early)


def burst(build, mode: str, monkeypatch, overlap: bool = True):
    """Nine requests added at once, more prompt tokens than one step takes (one prompt longer than a step's budget,
    prefilled in chunks), so prefill steps follow each other: each request's tokens and finish, the step() calls
    that returned a prefill's tokens with another prefill in flight, and whether every block came back. mode:
    LAB_PREFILL_AHEAD's value."""
    monkeypatch.setenv("LAB_PREFILL_AHEAD", mode)
    engine = build(overlap=overlap, **KW)
    prompts, params = workload(8)
    prompts.insert(3, [(7 + 13 * j) % 150000 for j in range(150)])
    params.insert(3, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    prefill_behind = 0
    ahead = collections.Counter()          # the outputs launched behind a step in flight, by kind (StepOutput.ahead)
    while not engine.is_finished():
        out = engine.step()
        prefill_behind += out.is_prefill and engine._inflight is not None and engine._inflight.is_prefill
        ahead[out.kind] += out.ahead
    out = [(list(s.completion_token_ids), s.finish_reason) for s in seqs]
    free = engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.close()
    return out, prefill_behind, free, ahead


def test_prefill_ahead_prefills_launches_a_prefill_behind_a_prefill_and_keeps_the_tokens(tiny_engine, monkeypatch):
    """LAB_PREFILL_AHEAD=prefills: with requests waiting, the prefill after a prefill is launched before the first
    one's tokens are read (the other modes run those one by one); the greedy tokens are those of one step at a time
    and of the other modes, arrivals during decodes included, and every block comes back."""
    sync, none_sync, free_sync, marked_sync = burst(tiny_engine, "prefills", monkeypatch, overlap=False)
    plain, none_plain, free_plain, marked_plain = burst(tiny_engine, "prefill", monkeypatch)
    ahead, behind, free, marked = burst(tiny_engine, "prefills", monkeypatch)
    assert ahead == plain == sync and free_sync and free_plain and free
    assert none_sync == none_plain == 0 and behind >= 2, (none_sync, none_plain, behind)
    # each prefill launched behind a prefill says so in its output (the step records' "ahead"); one step at a time
    # none does, and the overlapped decodes do
    assert marked["prefill"] == behind and marked_plain["prefill"] == 0 and not any(marked_sync.values()), \
        (marked, marked_plain, marked_sync)
    assert marked["decode"] > 0 and marked_plain["decode"] > 0, (marked, marked_plain)
    plain, _, _ = arrivals(tiny_engine, "0", monkeypatch)
    ahead, launched, free = arrivals(tiny_engine, "prefills", monkeypatch)
    assert ahead == plain and free and launched[1] == 0, launched


def test_prefill_ahead_unset_launches_the_prefill_early_with_the_overlapped_decode_only(tiny_engine, monkeypatch):
    """The default (LAB_PREFILL_AHEAD unset or empty) is "prefills": with the overlapped decode in nano-vllm's step
    model a waiting prefill goes behind the decode in flight and behind a prefill in flight, the decode after a
    prefill does not; without the overlap, or with mixed steps, none applies."""
    for unset in (None, ""):
        if unset is None:
            monkeypatch.delenv("LAB_PREFILL_AHEAD", raising=False)
        else:
            monkeypatch.setenv("LAB_PREFILL_AHEAD", unset)
        d = tiny_engine(overlap=True, **KW).describe()
        assert (d["prefill_ahead"], d["decode_behind_prefill"], d["prefill_behind_prefill"]) == (True, False, True)
    for options in ({"overlap": False}, {"overlap": True, "mixed_batches": True}):
        d = tiny_engine(**options, **KW).describe()
        assert (d["prefill_ahead"], d["decode_behind_prefill"], d["prefill_behind_prefill"]) == (False, False, False), \
            options


def test_prefill_ahead_refuses_an_unknown_setting_in_one_line(tiny_engine, monkeypatch):
    monkeypatch.setenv("LAB_PREFILL_AHEAD", "yes")
    with pytest.raises(ConfigError, match=r"LAB_PREFILL_AHEAD='yes': expected one of 0, prefill, 1, prefills"):
        tiny_engine(overlap=True, **KW)


def test_prefill_ahead_interleaves_decodes_with_arrivals(tiny_model_dir):
    """tools/prefill_ahead_steps.py, one arrival per step() call: one step at a time, nano-vllm's step model
    prefills each arrival first and decodes only once they stop; with prefill ahead the step after a prefill is
    decided before the next arrival, a decode, so decodes interleave with fewer, larger prefills (the trade the
    H100 sweeps showed: flatter TPOT under load, less served with every request at once)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    from prefill_ahead_steps import run

    off, on = (run(str(tiny_model_dir), mode, per_call=1, requests=16, prompt=32, output=8) for mode in ("0", "1"))
    assert (off["prefill_ahead"], on["prefill_ahead"]) == (False, True)
    assert off["steps"]["prefill"] == 16 and off["mean_prefill_seqs"] == 1.0, off
    assert on["steps"]["prefill"] < 16 and on["steps"]["decode"] > off["steps"]["decode"], (off, on)


class _SlowEvent:
    """A launched step's ``ready`` event that the GPU reaches only after ``polls`` queries (the CPU's steps end at
    launch): the window LAB_ADMIT_IN_FLIGHT asks for arrivals in."""

    def __init__(self, polls: int):
        self.polls = polls

    def query(self) -> bool:
        self.polls -= 1
        return self.polls < 0

    def synchronize(self) -> None:
        self.polls = -1


def admit_run(build, monkeypatch, on: str, overlap: bool = True):
    """Two requests at first, two more arriving (through the engine's ``arrivals`` hook, as a serving worker admits
    them) while the first prefill is still computing: each request's tokens; whether the step() that returned the
    first prefill left the arrivals' prefill in flight behind it (launched ahead), its rows and the hook's calls by
    then; the hook's calls in all; whether every block came back; the sequences' ids."""
    monkeypatch.setenv("LAB_ADMIT_IN_FLIGHT", on)
    engine = build(overlap=overlap, **KW)
    launch = engine.runner.launch

    def slow_launch(*a, **kw):
        launched = launch(*a, **kw)
        launched.ready = _SlowEvent(3)
        return launched
    engine.runner.launch = slow_launch
    prompts, params = workload(4)
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts[:2], params[:2])]
    calls = []

    def arrivals() -> bool:
        calls.append(len(seqs))
        if len(calls) == 2:                  # they arrive during the second poll
            seqs.extend(engine.add_request(p, sp) for p, sp in zip(prompts[2:], params[2:]))
            return True
        return False
    engine.arrivals = arrivals
    out = engine.step()
    behind = engine._inflight
    first = (out.is_prefill, behind is not None and behind.is_prefill and behind.ahead,
             sorted(s.seq_id for s in behind.seqs) if behind is not None else [], len(calls))
    if not calls:                            # the hook unused: they arrive after the first prefill was read
        seqs.extend(engine.add_request(p, sp) for p, sp in zip(prompts[2:], params[2:]))
    while not engine.is_finished():
        engine.step()
    tokens = [list(s.completion_token_ids) for s in seqs]
    free = engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    ids = [s.seq_id for s in seqs]
    engine.close()
    return tokens, first, len(calls), free, ids


def test_admit_in_flight_prefills_arrivals_behind_the_prefill_in_flight(tiny_engine, monkeypatch):
    """LAB_ADMIT_IN_FLIGHT=1: with a prefill in flight and nothing waiting behind it, the step asks the host for
    arrivals until the GPU ends it, and launches their prefill behind it (ahead); off, the hook is never asked and
    they wait for the next step() call. The greedy tokens are those of one step at a time, every block comes back."""
    sync, _, _, free_sync, _ = admit_run(tiny_engine, monkeypatch, "1", overlap=False)
    off, first_off, calls_off, free_off, _ = admit_run(tiny_engine, monkeypatch, "0")
    on, first_on, calls_on, free_on, ids = admit_run(tiny_engine, monkeypatch, "1")
    assert on == off == sync and free_sync and free_off and free_on
    assert calls_off == 0 and first_off == (True, False, [], 0), first_off
    assert first_on == (True, True, sorted(ids[2:]), 2), first_on      # launched at the poll they arrived in
    assert calls_on > 2                 # and asked again behind their prefill, with nothing left to arrive


def test_admit_in_flight_is_on_by_default_and_needs_prefills(tiny_engine, monkeypatch):
    """The lever reads 1 | 0 (unset: on; another value refused in one line), applies with LAB_PREFILL_AHEAD=prefills
    only (the default) in nano-vllm's step model with the overlapped decode, and describe() says whether it took."""
    monkeypatch.delenv("LAB_ADMIT_IN_FLIGHT", raising=False)
    monkeypatch.delenv("LAB_PREFILL_AHEAD", raising=False)
    assert tiny_engine(overlap=True, **KW).describe()["admit_in_flight"]
    monkeypatch.setenv("LAB_ADMIT_IN_FLIGHT", "0")
    assert not tiny_engine(overlap=True, **KW).describe()["admit_in_flight"]
    monkeypatch.setenv("LAB_ADMIT_IN_FLIGHT", "1")
    for options, ahead in (({"overlap": False}, ""), ({"overlap": True, "mixed_batches": True}, ""),
                           ({"overlap": True}, "prefill")):
        monkeypatch.setenv("LAB_PREFILL_AHEAD", ahead)
        assert not tiny_engine(**options, **KW).describe()["admit_in_flight"], (options, ahead)
    monkeypatch.setenv("LAB_ADMIT_IN_FLIGHT", "yes")
    with pytest.raises(ConfigError, match=r"LAB_ADMIT_IN_FLIGHT='yes': expected one of 0, 1"):
        tiny_engine(overlap=True, **KW)
