"""Per-request sampling through the real engine (tiny model, CPU, float32): logprobs against the
log-softmax of teacher-forced logits, prompt logprobs, seeds, n samples sharing the prompt's KV,
logit_bias / min_tokens / stop_token_ids, greedy with penalties, and the overlapped loop."""
from __future__ import annotations

import pytest
import torch

from testkit import forced_logits

from engine import LLMEngine, SamplingParams

tf = pytest.importorskip("transformers")

KW = dict(max_model_len=128, max_num_batched_tokens=128)         # and testkit.ENGINE_DEFAULTS
PROMPT = list(range(300, 340))           # 40 tokens: two full blocks of 16 and 8 more
TOL = dict(atol=2e-4, rtol=0)


@pytest.fixture(scope="module")
def engine(engine_factory) -> LLMEngine:
    return engine_factory(**KW)


@pytest.fixture(scope="module")
def processed_engine(engine_factory) -> LLMEngine:
    return engine_factory(logprobs_mode="processed_logprobs", **KW)


@pytest.fixture(scope="module")
def overlapped_engine(engine_factory) -> LLMEngine:
    """The overlapped loop's engine, shared by the two overlap tests (each leaves it idle)."""
    return engine_factory(overlap=True, **KW)


def reference_processed(x: torch.Tensor, history: list[int], sp: SamplingParams) -> torch.Tensor:
    """transformers' processors in vLLM's order: repetition penalty, temperature, top_k, top_p."""
    ids = torch.tensor([history])
    x = tf.RepetitionPenaltyLogitsProcessor(sp.repetition_penalty)(ids, x[None].clone())
    x = tf.TemperatureLogitsWarper(sp.temperature)(ids, x)
    x = tf.TopKLogitsWarper(sp.top_k)(ids, x)
    return tf.TopPLogitsWarper(sp.top_p)(ids, x)[0]


HEAVY = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.3, max_tokens=6, seed=11,
                       logprobs=5, ignore_eos=True)


def test_logprobs_are_the_raw_log_softmax_of_the_teacher_forced_logits(engine):
    out = engine.generate([PROMPT], HEAVY)[0]
    assert len(out["logprobs"]) == len(out["token_ids"]) == 6
    for i, (tok, rec) in enumerate(zip(out["token_ids"], out["logprobs"])):
        ref = torch.log_softmax(forced_logits(engine, PROMPT + out["token_ids"][:i]), dim=-1)
        assert rec.token_id == tok
        torch.testing.assert_close(torch.tensor(rec.logprob), ref[tok], **TOL)
        assert rec.rank == int((ref > ref[tok]).sum()) + 1
        top_lps, top_ids = ref.topk(5)
        assert [t for t, _ in rec.top] == top_ids.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in rec.top]), top_lps, **TOL)


def test_processed_logprobs_are_of_the_distribution_the_token_was_drawn_from(processed_engine):
    e = processed_engine
    out = e.generate([PROMPT], HEAVY)[0]
    for i, (tok, rec) in enumerate(zip(out["token_ids"], out["logprobs"])):
        history = PROMPT + out["token_ids"][:i]
        ref = torch.log_softmax(reference_processed(forced_logits(e, history), history, HEAVY), dim=-1)
        assert torch.isfinite(ref[tok])                   # the drawn token survived the truncation
        torch.testing.assert_close(torch.tensor(rec.logprob), ref[tok], **TOL)
        finite = [(t, v) for t, v in rec.top if v != float("-inf")]
        top_lps, top_ids = ref.topk(len(finite))
        assert [t for t, _ in finite] == top_ids.tolist()


def test_prompt_logprobs_match_teacher_forcing_even_chunked_and_after_a_prefix_hit(tiny_engine, engine):
    prompt = PROMPT[:20]
    refs = [torch.log_softmax(forced_logits(engine, prompt[:p]), dim=-1) for p in range(1, len(prompt))]
    small = tiny_engine(**(KW | dict(max_num_batched_tokens=8)))                      # 3 chunks
    small.generate([prompt], SamplingParams(max_tokens=1, temperature=0))               # fills the prefix cache
    out = small.generate([prompt], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))[0]
    plp = out["prompt_logprobs"]
    assert len(plp) == len(prompt) and plp[0] is None
    for p in range(1, len(prompt)):
        ref = refs[p - 1]
        assert plp[p].token_id == prompt[p]
        torch.testing.assert_close(torch.tensor(plp[p].logprob), ref[prompt[p]], **TOL)
        assert [t for t, _ in plp[p].top] == ref.topk(3).indices.tolist()


def test_greedy_with_penalties_follows_the_penalized_argmax(engine):
    x_id = PROMPT[3]                                          # a prompt token, made the favourite by a bias
    bias = {x_id: 20.0}
    sp = SamplingParams(temperature=0, logit_bias=bias, repetition_penalty=3.0, presence_penalty=1.0,
                        max_tokens=6, ignore_eos=True)
    out = engine.generate([PROMPT], sp)[0]["token_ids"]
    plain = engine.generate([PROMPT], SamplingParams(temperature=0, logit_bias=bias, max_tokens=6,
                                                     ignore_eos=True))[0]["token_ids"]
    assert plain == [x_id] * 6 and x_id not in out            # the penalties changed the greedy choice
    for i, tok in enumerate(out):
        hist = PROMPT + out[:i]
        x = forced_logits(engine, hist)
        x[x_id] += 20.0
        x = tf.RepetitionPenaltyLogitsProcessor(3.0)(torch.tensor([hist]), x[None])[0]
        for t in set(out[:i]):
            x[t] -= 1.0
        assert tok == int(x.argmax()), i


def test_same_seed_same_tokens_and_n_samples_are_the_seeds_plus_i(engine):
    sp = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=5, seed=42, ignore_eos=True)
    a = engine.generate([PROMPT, PROMPT[:30]], [sp, SamplingParams(temperature=1.0, max_tokens=5)])[0]["token_ids"]
    b = engine.generate([PROMPT], sp)[0]["token_ids"]
    assert a == b
    import dataclasses
    many = engine.generate([PROMPT], dataclasses.replace(sp, n=3))[0]
    samples = [o["token_ids"] for o in many["outputs"]]
    assert samples[0] == a and len({tuple(s) for s in samples}) == 3
    for i in (1, 2):
        assert samples[i] == engine.generate([PROMPT], dataclasses.replace(sp, seed=42 + i))[0]["token_ids"]


def test_plain_seeded_sampling_unchanged_by_the_processing_path(engine):
    """A plain seeded row draws the same tokens whether or not a batch mate needs processing."""
    sp = SamplingParams(temperature=1.0, max_tokens=5, seed=9, ignore_eos=True)
    alone = engine.generate([PROMPT], sp)[0]["token_ids"]
    mixed = engine.generate([PROMPT, PROMPT[:25]], [sp, HEAVY])[0]["token_ids"]
    assert alone == mixed


def test_n_samples_share_the_prompt_blocks_through_the_prefix_cache(engine):
    engine.reset_prefix_cache()
    steps = []
    out = engine.generate([PROMPT + [7]], SamplingParams(n=3, max_tokens=2, temperature=1.0, seed=1),
                          on_step=steps.append)[0]
    assert len(out["outputs"]) == 3
    prefills = [n for s in steps if s.is_prefill for _, n in s.scheduled]
    assert prefills == [41, 9, 9]            # the first computes the prompt; the others hit its 2 full blocks


def test_logit_bias_forces_a_token_and_stop_token_ids_end_on_it(engine):
    forced = 4242
    sp = SamplingParams(temperature=1.0, max_tokens=4, logit_bias={forced: 100.0}, ignore_eos=True)
    assert engine.generate([PROMPT], sp)[0]["token_ids"] == [forced] * 4
    out = engine.generate([PROMPT], SamplingParams(temperature=1.0, max_tokens=4, logit_bias={forced: 100.0},
                                                  stop_token_ids=[forced]))[0]
    assert out["token_ids"] == [forced] and out["finish_reason"] == "stop"


def test_min_tokens_holds_eos_back_until_reached(engine):
    eos = engine.config.eos_token_ids[0]
    bias = {eos: 100.0}
    early = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, logit_bias=bias))[0]
    assert early["token_ids"] == [eos] and early["finish_reason"] == "stop"
    held = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, logit_bias=bias, min_tokens=3))[0]
    # vLLM's meaning: min_tokens tokens are generated before EOS may be
    assert len(held["token_ids"]) == 4 and eos not in held["token_ids"][:3]
    assert held["token_ids"][3] == eos and held["finish_reason"] == "stop"


def test_out_of_vocabulary_ids_in_parameters_are_refused_at_admission(engine):
    from engine.errors import RequestError
    vocab = engine.config.vocab_size
    for kw, code in (({"logit_bias": {vocab: 1.0}}, "invalid_logit_bias"),
                     ({"stop_token_ids": [vocab + 3]}, "invalid_stop_token_ids")):
        with pytest.raises(RequestError) as e:
            engine.generate([PROMPT], SamplingParams(max_tokens=2, **kw))
        assert e.value.code == code


def test_prompt_ids_outside_the_vocabulary_or_not_ints_are_refused(engine):
    """The admission rule's id check (ranges checked at C speed, anything else id by id): the first bad id
    is named; bools and ints in range pass."""
    from engine.errors import RequestError
    vocab = engine.config.vocab_size
    for ids, bad in (([1, 2.0], "2.0"), (["a", 1], "'a'"), ([-1, 5], "-1"), ([5, vocab], str(vocab)),
                     ([3, None], "None")):
        with pytest.raises(RequestError) as e:
            engine.validate(ids)
        assert e.value.code == "token_out_of_vocabulary" and f"token id {bad} " in str(e.value), (ids, str(e.value))
    engine.validate([True, 3, vocab - 1, 0])


def test_generate_texts_are_the_decoded_completions(engine):
    """Texts are detokenized as sequences finish (inside the loop): each is its completion's decode."""
    outs = engine.generate([PROMPT, PROMPT[:20]], [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                                   for n in (3, 7)])
    assert [len(o["token_ids"]) for o in outs] == [3, 7]
    assert [o["text"] for o in outs] == [engine.tokenizer.decode(o["token_ids"]) for o in outs]


def test_overlapped_loop_gives_the_same_processed_tokens(overlapped_engine, engine):
    params = [HEAVY, SamplingParams(temperature=0.7, top_k=5, seed=3, max_tokens=6, ignore_eos=True,
                                    frequency_penalty=0.5, min_tokens=2)]
    want = [o["token_ids"] for o in engine.generate([PROMPT, PROMPT[:33]], params)]
    got = overlapped_engine.generate([PROMPT, PROMPT[:33]], params)
    assert [o["token_ids"] for o in got] == want
    assert [r.logprob for r in got[0]["logprobs"]] == pytest.approx(
        [r.logprob for r in engine.generate([PROMPT], HEAVY)[0]["logprobs"]], abs=2e-4)


def test_overlapped_loop_counts_the_in_flight_token_for_min_tokens(overlapped_engine, engine):
    """min_tokens without penalties: a lookahead step must not read a token count that lags by one."""
    eos = engine.config.eos_token_ids[0]
    sp = SamplingParams(temperature=0, max_tokens=8, logit_bias={eos: 100.0}, min_tokens=3)
    want = engine.generate([PROMPT], sp)[0]["token_ids"]
    got = overlapped_engine.generate([PROMPT], sp)[0]["token_ids"]
    assert got == want and len(want) == 4 and want[-1] == eos
