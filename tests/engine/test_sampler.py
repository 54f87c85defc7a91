import torch

from engine.sampling.sampler import sample


def test_greedy_at_temperature_zero():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 0.0]])
    g = torch.Generator().manual_seed(0)
    assert sample(logits, [0.0, 0.0], [g, g]) == [1, 0]


def test_seeded_sampling_is_reproducible_and_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.66524, 0.24473, 0.09003]])).repeat(4000, 1)
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    a = sample(logits, [1.0] * 4000, [g1] * 4000)
    b = sample(logits, [1.0] * 4000, [g2] * 4000)
    assert a == b
    freq = torch.bincount(torch.tensor(a), minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.66524, 0.24473, 0.09003]), atol=0.03)


def test_per_request_generators_are_independent_of_batch_mates():
    logits = torch.zeros(3, 50)
    shared = torch.Generator().manual_seed(1)
    own = torch.Generator().manual_seed(99)
    first = sample(logits, [1.0, 1.0, 0.0], [shared, own, shared])[1]
    own2 = torch.Generator().manual_seed(99)
    again = sample(logits[:2], [1.0, 1.0], [torch.Generator().manual_seed(5), own2])[1]
    assert first == again
