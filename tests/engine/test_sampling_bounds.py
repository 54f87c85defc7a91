"""Bounded sampling inputs: logit_bias (at most MAX_LOGIT_BIAS entries, applied as one scatter from tensors made
once per request), allowed_token_ids (a mask on the logits, ids checked against the vocabulary) and prompt
log-probs computed in chunks of positions (peak extra memory O(chunk x vocab), values as unchunked)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.admission import check_params
from engine.errors import RequestError
from engine.sampling import logprobs as lpm
from engine.sampling import processors as lp
from engine.sampling.params import MAX_LOGIT_BIAS, SamplingParams

V = 64


def _row(sp: SamplingParams) -> lp.RowInputs:
    return lp.RowInputs.of(sp, [1, 2, 3], [], (0,))


def test_logit_bias_is_bounded():
    SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS)})
    with pytest.raises(RequestError, match="at most") as e:
        SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)})
    assert e.value.code == "invalid_logit_bias"


def test_logit_bias_is_one_scatter_from_tensors_made_once(monkeypatch):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, V, generator=g)
    a, b = SamplingParams(logit_bias={5: 2.0, 9: -1.5}), SamplingParams(logit_bias={5: -3.0, 60: 4.0})
    rows = [_row(a), _row(SamplingParams(temperature=0.5, top_k=3)), _row(b)]
    ref = x.clone()
    for i, sp in ((0, a), (2, b)):
        for t, v in sp.logit_bias.items():
            ref[i, t] += v
    out = x.clone()
    lp.apply_logit_bias(out, rows)
    torch.testing.assert_close(out, ref)
    calls = []
    monkeypatch.setattr(lp, "to_device", lambda *args, **kw: calls.append(args) or torch.tensor(args[0]))
    puts = []
    real = torch.Tensor.index_put_
    monkeypatch.setattr(torch.Tensor, "index_put_", lambda self, *args, **kw: puts.append(1) or real(self, *args, **kw))
    again = x.clone()
    lp.apply_logit_bias(again, rows)          # the next step: the requests' tensors are reused, one scatter
    torch.testing.assert_close(again, ref)
    assert calls == [] and len(puts) == 1


def test_allowed_token_ids_mask_and_vocabulary():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, V, generator=g)
    allowed = [3, 17, 40]
    rows = [_row(SamplingParams(temperature=0, allowed_token_ids=allowed)), _row(SamplingParams(temperature=0))]
    out = lp.process(x, rows)
    assert set(torch.nonzero(torch.isfinite(out[0])).flatten().tolist()) == set(allowed)
    assert int(out[0].argmax()) == max(allowed, key=lambda t: float(x[0, t]))
    assert torch.isfinite(out[1]).all()                               # the other row untouched
    assert SamplingParams(allowed_token_ids=[1]).needs_processing(0)
    with pytest.raises(RequestError):
        SamplingParams(allowed_token_ids=[])
    cfg = SimpleNamespace(vocab_size=V, tensor_parallel_size=1)
    with pytest.raises(RequestError, match="allowed_token_ids") as e:
        check_params(cfg, SamplingParams(allowed_token_ids=[1, V]))
    assert e.value.code == "invalid_allowed_token_ids"


class _Seq(SimpleNamespace):
    @property
    def prompt_logprobs_done(self) -> bool:
        return len(self.prompt_logprobs) >= self.num_prompt_tokens


def _prompt_lps(n_prompt: int, chunk: int | None, head: torch.nn.Linear, hidden: torch.Tensor, widths: list):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (n_prompt,), generator=g).tolist()
    seq = _Seq(num_cached_tokens=0, prompt_logprobs=[None], num_prompt_tokens=n_prompt, token_ids=ids,
               sampling_params=SamplingParams(prompt_logprobs=2))

    def compute_logits(rows):
        widths.append(rows.shape[0])
        return head(rows)

    lpm.record_prompt_logprobs([seq], [n_prompt], hidden, compute_logits, chunk=chunk)
    return seq.prompt_logprobs


@torch.inference_mode()
def test_prompt_logprobs_in_bounded_chunks_equal_unchunked():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, V)
    n = 50
    hidden = torch.randn(n, 16)
    whole, chunked = [], []
    ref = _prompt_lps(n, 10 ** 6, head, hidden, whole)
    got = _prompt_lps(n, 8, head, hidden, chunked)
    assert whole == [n - 1]                                   # the unchunked run: every position at once
    assert max(chunked) <= 8 and sum(chunked) == n - 1        # bounded chunks covering every position once
    assert len(got) == len(ref) == n and got[0] is None
    for a, b in zip(got[1:], ref[1:]):
        assert (a.token_id, a.rank, [t for t, _ in a.top]) == (b.token_id, b.rank, [t for t, _ in b.top])
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
    assert lpm.PROMPT_LOGPROBS_CHUNK <= 256
