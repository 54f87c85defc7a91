"""Each logits processor against a straightforward reference: transformers' warpers / processors where
they exist (top_p, top_k, min_p, repetition penalty, temperature), a plain per-row loop otherwise
(presence / frequency penalties, logit_bias, min_tokens); then the sampler's use of them."""
from __future__ import annotations

import pytest
import torch

from engine.errors import RequestError
from engine.sampling import processors as lp
from engine.sampling.sampler import sample_processed, sample_tensor
from engine.sampling.params import SamplingParams

tf = pytest.importorskip("transformers")

V = 64


def logits(rows: int = 4, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g) * 3


def row(sp: SamplingParams, prompt=(1, 2, 3), output=(), eos=(0,)) -> lp.RowInputs:
    return lp.RowInputs.of(sp, list(prompt), list(output), tuple(eos))


def finite_set(x: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(torch.isfinite(r)).flatten().tolist()) for r in x]


@pytest.mark.parametrize("p", [0.05, 0.3, 0.9, 0.999, 1.0])
def test_top_p_keeps_what_transformers_keeps(p):
    x = logits()
    ours = lp.apply_top_k_top_p(x.clone(), [-1] * 4, [p] * 4)
    ref = tf.TopPLogitsWarper(top_p=p)(None, x.clone())
    assert finite_set(ours) == finite_set(ref)
    if p == 1.0:
        assert torch.equal(ours, x)                     # off: untouched


@pytest.mark.parametrize("k", [1, 5, 63, 64, 100])
def test_top_k_keeps_what_transformers_keeps(k):
    x = logits()
    ours = lp.apply_top_k_top_p(x.clone(), [k] * 4, [1.0] * 4)
    ref = tf.TopKLogitsWarper(top_k=min(k, V))(None, x.clone())
    assert finite_set(ours) == finite_set(ref)


@pytest.mark.parametrize("off", [-1, 0])
def test_top_k_off_values_leave_the_row_alone(off):
    x = logits()
    assert torch.equal(lp.apply_top_k_top_p(x.clone(), [off] * 4, [1.0] * 4), x)


def test_top_k_then_top_p_mixed_per_row():
    x = logits()
    ks, ps = [5, -1, 0, 20], [1.0, 0.5, 1.0, 0.8]
    ours = lp.apply_top_k_top_p(x.clone(), ks, ps)
    for i, (k, p) in enumerate(zip(ks, ps)):
        ref = x[i:i + 1].clone()
        if k > 0:
            ref = tf.TopKLogitsWarper(top_k=k)(None, ref)
        if p < 1:
            ref = tf.TopPLogitsWarper(top_p=p)(None, ref)
        assert finite_set(ours[i:i + 1]) == finite_set(ref), i


@pytest.mark.parametrize("m", [0.0, 0.05, 0.3, 1.0])
def test_min_p_keeps_what_transformers_keeps(m):
    x = logits()
    ours = x.clone()
    lp.apply_min_p(ours, [m] * 4)
    if m == 0.0:
        assert torch.equal(ours, x)
        return
    ref = tf.MinPLogitsWarper(min_p=m)(None, x.clone())
    assert finite_set(ours) == finite_set(ref)


@pytest.mark.parametrize("penalty", [0.5, 1.0, 1.3])
def test_repetition_penalty_matches_transformers_over_prompt_and_output(penalty):
    x = logits(2)
    prompt, output = [3, 7, 7, 10], [10, 20]
    ours = x.clone()
    lp.apply_penalties(ours, [row(SamplingParams(repetition_penalty=penalty), prompt, output)] * 2)
    ids = torch.tensor([prompt + output] * 2)
    ref = tf.RepetitionPenaltyLogitsProcessor(penalty=penalty)(ids, x.clone())
    torch.testing.assert_close(ours, ref)


def test_presence_and_frequency_penalties_count_output_tokens_only():
    x = logits(1)
    prompt, output = [5, 6], [6, 6, 9]
    sp = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    ours = x.clone()
    lp.apply_penalties(ours, [row(sp, prompt, output)])
    ref = x.clone()
    for t in set(output):
        ref[0, t] -= 0.25 * output.count(t) + 0.5
    torch.testing.assert_close(ours, ref)
    assert ours[0, 5] == x[0, 5]                      # a prompt-only token is not penalized


def test_logit_bias_adds_and_can_force_a_token():
    x = logits(1)
    low = int(x[0].argmin())
    ours = x.clone()
    lp.apply_logit_bias(ours, [row(SamplingParams(logit_bias={low: 100.0, 3: -2.5}))])
    assert ours[0, low] == x[0, low] + 100 and ours[0, 3] == x[0, 3] - 2.5
    out = lp.process(x, [row(SamplingParams(temperature=0, logit_bias={low: 100.0}))])
    assert int(out[0].argmax()) == low


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    x = torch.zeros(3, V)
    x[:, 0] = 50.0                                     # EOS would win
    sp = SamplingParams(min_tokens=2, stop_token_ids=[7])
    rows = [row(sp, output=()), row(sp, output=(4,)), row(sp, output=(4, 5))]
    lp.apply_min_tokens(x, rows)
    assert torch.isinf(x[0, 0]) and torch.isinf(x[0, 7]) and torch.isinf(x[1, 0])
    assert x[2, 0] == 50.0 and x[2, 7] == 0.0           # reached: nothing masked
    ign = SamplingParams(min_tokens=2, ignore_eos=True)
    y = torch.zeros(1, V)
    lp.apply_min_tokens(y, [row(ign)])
    assert torch.isfinite(y).all()                      # ignore_eos: EOS is not a stop to mask


def test_process_order_penalties_then_temperature_then_truncation():
    x = logits(2)
    sp = SamplingParams(temperature=0.7, top_k=10, top_p=0.8, min_p=0.02, repetition_penalty=1.2,
                        frequency_penalty=0.3, logit_bias={4: 1.5})
    r = row(sp, [1, 2, 4], [4, 8])
    ours = lp.process(x, [r, r])
    ids = torch.tensor([[1, 2, 4, 4, 8]] * 2)
    ref = x.clone()
    ref[:, 4] += 1.5
    ref = tf.RepetitionPenaltyLogitsProcessor(penalty=1.2)(ids, ref)
    ref[:, 4] -= 0.3
    ref[:, 8] -= 0.3
    ref = tf.TemperatureLogitsWarper(0.7)(ids, ref)
    ref = tf.MinPLogitsWarper(0.02)(ids, ref)
    ref = tf.TopKLogitsWarper(10)(ids, ref)
    ref = tf.TopPLogitsWarper(0.8)(ids, ref)
    assert finite_set(ours) == finite_set(ref)
    keep = torch.isfinite(ref)
    torch.testing.assert_close(ours[keep], ref[keep])


def test_greedy_still_applies_penalties_and_bias_but_no_truncation():
    x = logits(1)
    top = int(x[0].argmax())
    sp = SamplingParams(temperature=0, repetition_penalty=100.0, top_k=1)
    out = lp.process(x, [row(sp, [top], [])])
    assert int(out[0].argmax()) != top                   # the repeated token lost its place
    assert torch.isfinite(out).all()                     # top_k does not apply at temperature 0


def test_sampled_rows_follow_the_processed_distribution():
    x = logits(1).repeat(4000, 1)
    sp = SamplingParams(temperature=0.9, top_k=4, top_p=0.9)
    rows = {i: row(sp) for i in range(4000)}
    g = torch.Generator().manual_seed(0)
    ids, _ = sample_processed(x, [0.9] * 4000, [g] * 4000, rows)
    probs = torch.softmax(lp.process(x[:1], [row(sp)]), dim=-1)[0]
    freq = torch.bincount(ids, minlength=V).float() / 4000
    assert set(torch.nonzero(freq).flatten().tolist()) <= set(torch.nonzero(probs).flatten().tolist())
    torch.testing.assert_close(freq, probs, atol=0.03, rtol=0)


def test_seeded_processed_rows_reproduce_whatever_the_batch_mates():
    x = logits(3)
    sp = SamplingParams(temperature=1.0, top_p=0.95, seed=5)

    def draw(seed: int, mate_processed: bool) -> list[int]:
        gens = [torch.Generator().manual_seed(1000 + seed), torch.Generator().manual_seed(seed),
                torch.Generator().manual_seed(2000 + seed)]
        rows = {1: row(sp)} | ({0: row(SamplingParams(repetition_penalty=1.1))} if mate_processed else {})
        return [int(sample_processed(x, [1.0, 1.0, 0.0], gens, rows)[0][1]) for _ in range(5)]

    first = [draw(s, False) for s in range(8)]
    assert first == [draw(s, True) for s in range(8)]
    assert len({tuple(d) for d in first}) > 1          # the seed matters


def test_plain_rows_of_a_mixed_batch_are_drawn_as_on_the_plain_path():
    x = logits(3)
    plain = sample_tensor(x[[0, 2]], [0.0, 0.0], [torch.Generator()] * 2)
    mixed, _ = sample_processed(x, [0.0, 1.0, 0.0], [torch.Generator()] * 3, {1: row(SamplingParams(top_k=3))})
    assert mixed[[0, 2]].tolist() == plain.tolist()


BAD = [("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("top_k", 1.5), ("min_p", -0.1), ("min_p", 1.1),
       ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0.0),
       ("logit_bias", {5: 101}), ("logit_bias", {-1: 1}), ("min_tokens", 65), ("min_tokens", -1),
       ("logprobs", 21), ("logprobs", -1), ("prompt_logprobs", 21), ("n", 0), ("best_of", 3),
       ("stop_token_ids", [-4]), ("seed", 1.5)]


@pytest.mark.parametrize("name,value", BAD, ids=[f"{n}={v}" for n, v in BAD])
def test_out_of_range_values_raise_a_request_error_naming_the_parameter(name, value):
    with pytest.raises(RequestError) as e:
        SamplingParams(max_tokens=64, **{name: value})
    assert e.value.code == f"invalid_{name}" and name in str(e.value)


def test_edge_values_are_accepted():
    SamplingParams(top_p=1, top_k=0, min_p=0, min_tokens=64, max_tokens=64, logprobs=0, prompt_logprobs=20,
                   repetition_penalty=1e-3, presence_penalty=-2, frequency_penalty=2, best_of=1)


def test_token_history_keeps_counts_across_steps_like_a_rebuild():
    """The runner's TokenHistory (one scatter of new tokens per step, slots reused after forget) gives
    the same penalized logits as building the counts from the lists every step."""
    hist = lp.TokenHistory(V, "cpu")
    hist.GROW = 2                                       # force growth and slot reuse in a short test
    sp = SamplingParams(repetition_penalty=1.4, presence_penalty=0.3, frequency_penalty=0.2)
    seqs = {k: [k, k + 1, 2 * k] for k in range(4)}
    g = torch.Generator().manual_seed(3)
    for step in range(6):
        live = [k for k in seqs if not (step >= 3 and k == 1)]
        if step == 3:
            hist.forget(1)
            seqs[9] = [9, 9, 40]                         # a new sequence takes the freed slot
            live.append(9)
        rows = [lp.RowInputs(sp, seqs[k], 3, (), k) for k in live]
        x = logits(len(rows), seed=step)
        kept, rebuilt = x.clone(), x.clone()
        lp.apply_penalties(kept, rows, hist)
        lp.apply_penalties(rebuilt, [lp.RowInputs.of(sp, r.prompt_ids, r.output_ids) for r in rows])
        torch.testing.assert_close(kept, rebuilt)
        for k in live:
            seqs[k].append(int(torch.randint(0, 8, (1,), generator=g)))


def test_top_k_first_path_keeps_what_the_full_sort_keeps():
    """Every row with a top_k takes the top-k selection instead of the full sort: same kept sets (no ties)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 4096, generator=g) * 2
    ks = [1, 2, 7, 50, 50, 200, 1000, 1024]
    ps = [0.9, 1.0, 0.5, 0.9, 0.05, 0.95, 0.999, 1.0]
    assert all(0 < k <= lp.TOP_K_FIRST_MAX for k in ks)
    fast = lp._top_k_first(x.clone(), ks, ps)
    full = torch.cat([lp.apply_top_k_top_p(torch.cat([x[i:i + 1], x[i:i + 1]]), [k, -1], [p, 1.0])[:1]
                      for i, (k, p) in enumerate(zip(ks, ps))])
    assert finite_set(fast) == finite_set(full)
    assert torch.equal(lp.apply_top_k_top_p(x.clone(), ks, ps), fast)       # the dispatcher takes it


def test_top_k_first_path_keeps_ties_at_the_kth_value_as_transformers_does():
    x = (torch.randn(4, 512, generator=torch.Generator().manual_seed(4)) * 2).to(torch.bfloat16).float()
    for k in (5, 50, 300):
        ours = lp.apply_top_k_top_p(x.clone(), [k] * 4, [1.0] * 4)
        ref = tf.TopKLogitsWarper(top_k=k)(None, x.clone())
        assert finite_set(ours) == finite_set(ref)
        for p in (0.5, 0.9):
            both = lp.apply_top_k_top_p(x.clone(), [k] * 4, [p] * 4)
            ref_p = tf.TopPLogitsWarper(top_p=p)(None, tf.TopKLogitsWarper(top_k=k)(None, x.clone()))
            for a, b in zip(finite_set(both), finite_set(ref_p)):
                assert b <= a and len(a - b) <= 8    # at most the ties at the cut differ
