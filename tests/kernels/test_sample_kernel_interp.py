"""The fused Gumbel-max sampler (engine/sampling/gumbel_kernel.py) on the CPU through Triton's interpreter:
greedy rows give torch.argmax (the first index on ties); a row's draw follows softmax(logits / T) at a
vocabulary that is not a multiple of the four draws of one Philox call, each of the four lanes included;
the same seeds give the same ids and other seeds other ids; a vocabulary of several chunks is drawn from
across all of them. (Four lanes given one draw would always keep the quad's largest logit: caught.)

The interpreter runs a kernel's programs one after another, and each tile iteration costs about 25 ms of CPU at
any tile size (mostly the Philox rounds): the cost is the count of sampled tiles. So the draws' frequencies are
judged against each column's own binomial spread at ROWS rows, and the chunked case runs at a CHUNK of two
BLOCKs (a runtime argument of the kernel; shipped: four), which still gives every chunk several tiles and
their Philox counters.

Skipped where triton is not installed or its interpreter cannot run a kernel here.
"""
from __future__ import annotations

import json
import math
import sys

import pytest

from interp import interpreter_ready

PROBS = [0.30, 0.05, 0.20, 0.10, 0.15, 0.02, 0.08, 0.10]      # lanes 0-3 and 4-7 of two quads differ
ROWS = 1000             # sampled rows at T = 0.5: one interpreted program (one tile) each
SDS = 4                 # a column's frequency may miss its probability by this many binomial sds at ROWS rows
REPEAT_ROWS = 20        # the rows drawn again (same seeds, then others)
CHUNK_ROWS = 20         # flat rows over 3 chunks: all 3 chunks won by 20 rows but with chance 3 * (2/3)^20 < 0.001


def test_greedy_rows_are_the_first_argmax(results):
    r = results["greedy"]
    assert r["ids"] == r["want"], r


def test_draws_follow_softmax_over_t_in_every_lane(results):
    freq = results["freq"]
    # T = 0.5 sharpens PROBS to p^2 / sum(p^2); column j's count at ROWS rows is binomial (ROWS, want[j])
    sq = [p * p for p in PROBS]
    want = [p / sum(sq) for p in sq] + [0.0]            # the 9th column is -inf: never drawn (tolerance 0)
    assert len(freq) == len(want) and sum(freq) == pytest.approx(1.0)
    for j, (f, w) in enumerate(zip(freq, want)):
        assert abs(f - w) <= SDS * math.sqrt(w * (1 - w) / ROWS), (j, f, w, freq)


def test_seeds_reproduce_and_differ(results):
    assert results["same_seeds_same_ids"] is True
    assert results["other_seeds_other_ids"] is True


def test_a_vocabulary_of_several_chunks_is_drawn_across_them(results):
    r = results["chunks"]
    assert r["chunks"] >= 3 and r["tiles_per_chunk"] > 1, r
    assert r["distinct_chunks_drawn"] == r["chunks"], r          # flat logits: every chunk wins sometimes
    assert r["greedy_far"] == r["want_far"], r                   # the max in the last chunk


def _run() -> dict:
    import math

    import torch

    from engine.sampling import gumbel_kernel as sk

    out = {}
    # greedy, with ties: the first index wins
    x = torch.randn(4, 37, generator=torch.Generator().manual_seed(0))
    x[1, 5] = x[1, 30] = x[1].max() + 1.0
    x[2, :] = 0.0
    ids = sk.gumbel_argmax(x, torch.zeros(4), torch.arange(4, dtype=torch.int64))
    out["greedy"] = {"ids": ids.tolist(), "want": x.argmax(dim=1).tolist()}
    # sampled at T = 0.5 over 9 columns (the last masked by -inf), ROWS rows with their own seeds
    row = torch.tensor([math.log(p) for p in PROBS] + [float("-inf")])
    logits = row.repeat(ROWS, 1)
    temps = torch.full((ROWS,), 0.5)
    seeds = torch.randint(0, 2**31 - 1, (ROWS,), generator=torch.Generator().manual_seed(1))
    ids = sk.gumbel_argmax(logits, temps, seeds)
    out["freq"] = (torch.bincount(ids, minlength=9).float() / ROWS).tolist()
    n = REPEAT_ROWS
    again = sk.gumbel_argmax(logits[:n], temps[:n], seeds[:n])
    other = sk.gumbel_argmax(logits[:n], temps[:n], seeds[:n] + 7)
    out["same_seeds_same_ids"] = bool(torch.equal(again, ids[:n]))
    out["other_seeds_other_ids"] = not torch.equal(other, ids[:n])
    # several chunks: one greedy row across 3 shipped chunks (no noise: cheap), its max in the last one; then
    # flat logits over 3 chunks of two tiles (gumbel_argmax reads CHUNK at each call), CHUNK_ROWS sampled rows
    far = torch.zeros(1, 3 * sk.CHUNK)
    far[0, -3] = 1.0
    greedy_far = sk.gumbel_argmax(far, torch.zeros(1), torch.zeros(1, dtype=torch.int64)).tolist()
    sk.CHUNK = 2 * sk.BLOCK
    flat = torch.zeros(CHUNK_ROWS, 3 * sk.CHUNK)
    drawn = sk.gumbel_argmax(flat, torch.ones(CHUNK_ROWS), torch.arange(CHUNK_ROWS, dtype=torch.int64) * 7919)
    out["chunks"] = {"chunks": -(-flat.shape[1] // sk.CHUNK), "tiles_per_chunk": sk.CHUNK // sk.BLOCK,
                     "distinct_chunks_drawn": len(set((drawn // sk.CHUNK).tolist())),
                     "greedy_far": greedy_far, "want_far": [far.shape[1] - 3]}
    return out


if __name__ == "__main__":
    def probe():
        import torch
        from engine.sampling.gumbel_kernel import gumbel_argmax
        gumbel_argmax(torch.zeros(1, 8), torch.ones(1), torch.zeros(1, dtype=torch.int64))

    if interpreter_ready(probe):
        print(json.dumps(_run()))
    sys.exit(0)
