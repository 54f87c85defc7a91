"""The engine against transformers on the tiny model in float32, teacher-forced.

Each row: the engine's logits for the last position of a sequence (through the real scheduler,
paged KV cache, chunked prefill and decode) vs transformers recomputing the whole prefix.
"""
import pytest
import torch

from engine import SamplingParams
from labkit.guardrails.forcing import teacher_forced

TOLERANCE = 1e-4     # measured worst on the tiny model: ~1e-6


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), attn_implementation="eager",
                                                dtype=torch.float32).eval()


@pytest.mark.parametrize("block_size,budget", [(256, 512), (16, 64), (4, 40)])
def test_teacher_forced_logits_match_transformers(tiny_engine, hf_model, block_size, budget):
    g = torch.Generator().manual_seed(block_size)
    lengths = (3, 130, 17, 300)
    prompts = [torch.randint(0, 151000, (n,), generator=g).tolist() for n in lengths]
    conts = [torch.randint(0, 151000, (5,), generator=g).tolist() for _ in prompts]
    engine = tiny_engine(kvcache_block_size=block_size, max_num_batched_tokens=budget, device="cpu", max_model_len=1024)
    rows = teacher_forced(engine, prompts, conts)
    assert len(rows) == sum(len(c) for c in conts)
    assert {"prefill", "decode"} == {r[2] for r in rows}
    worst = 0.0
    with torch.no_grad():
        for tokens, row, _ in rows:
            ref = hf_model(torch.tensor([tokens]), use_cache=False).logits[0, -1].float()
            worst = max(worst, (ref - row).abs().max().item())
            assert ref.argmax() == row.argmax()
    print(f"worst max-abs logit error (block {block_size}, budget {budget}): {worst:.3e}")
    assert worst < TOLERANCE


def test_prefix_cache_hit_gives_the_same_logits(tiny_engine, hf_model):
    engine = tiny_engine(kvcache_block_size=16, device="cpu")
    shared = list(range(1000, 1064))
    first = teacher_forced(engine, [shared + [5, 6, 7]], [[8, 9]])      # fills the prefix cache
    assert len(first) == 2
    seq = engine.add_request(shared + [11, 12, 13], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    seqs, is_prefill = engine.schedule()
    assert seq.num_cached_tokens == 64 and seq.num_scheduled_tokens == 3      # 4 blocks reused
    row = engine.forward_logits(seqs, is_prefill)[0][0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([shared + [11, 12, 13]]), use_cache=False).logits[0, -1]
        first_refs = [hf_model(torch.tensor([tokens]), use_cache=False).logits[0, -1] for tokens, _, _ in first]
    assert (ref - row).abs().max().item() < TOLERANCE
    assert all((r - got).abs().max().item() < TOLERANCE for r, (_, got, _) in zip(first_refs, first))
