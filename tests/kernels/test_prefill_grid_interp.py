"""The prefill kernel's packed grid on the CPU through Triton's interpreter: a prefill of at most PACKED_SEQS
sequences launches one program per (query tile of any sequence, head), each finding its sequence and tile; it
must give the (tile, sequence, head) grid's output bit for bit, and the float32 reference's, at ragged lengths
(a sequence of no tokens in the middle, lengths that end inside a tile, a cached prefix or none), from a first
sequence on (a mixed step's chunks), with padding sequences and padding tokens after the last (a graph bucket),
on the paged and the fresh route.

Skipped where triton is not installed or its interpreter cannot run a kernel here.
"""
from __future__ import annotations

import json

import pytest

from interp import interpreter_ready

HK, G, D, PAGE, BLOCK = 2, 2, 16, 16, 16
# (new tokens, cached prefix) per sequence; then the same after two one-token rows (first_seq 2)
CASES = {"ragged": [(70, 10), (0, 0), (1, 0), (64, 5), (33, 40)],
         "mixed": [(1, 20), (1, 7), (45, 16), (17, 0)]}


@pytest.mark.parametrize("case", list(CASES))
def test_packed_grid_gives_the_full_grids_output_and_the_reference(results, case):
    r = results[case]
    assert r["packed_programs"] <= r["full_programs"], r
    if case == "ragged":                                      # one long sequence among short ones: far fewer
        assert r["packed_programs"] < r["full_programs"], r
    assert r["paged_equal"] and r["fresh_equal"], r          # bit for bit, every row the kernel writes
    assert r["paged_err"] <= 1e-5 and r["fresh_err"] <= 1e-5, r


def test_padding_sequences_and_tokens_leave_the_real_rows_as_they_were(results):
    r = results["padded"]
    assert r["equal"], r


def _case(pk, lens, first_seq=0, pad_seqs=0, pad_tokens=0, seed=0):
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(seed)
    n = len(lens)
    q_lens = [q for q, _ in lens]
    k_lens = [q + p for q, p in lens]
    per_seq = max(1, max((k + PAGE - 1) // PAGE for k in k_lens))
    blocks = n * per_seq
    kc = torch.randn(blocks, PAGE, HK, D, generator=gen)
    vc = torch.randn(blocks, PAGE, HK, D, generator=gen)
    tables = torch.randperm(blocks, generator=gen).view(n, per_seq).int()
    t = sum(q_lens)
    q = torch.randn(t, HK * G, D, generator=gen)
    # the fresh route: each sequence's new K/V alone (no prefix), rows laid out as q's
    k_new = torch.randn(t, HK, D, generator=gen)
    v_new = torch.randn(t, HK, D, generator=gen)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()] + [t] * pad_seqs, dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()] + [0] * pad_seqs, dtype=torch.int32)
    if pad_seqs:        # a graph bucket's padding: sequences of no tokens, rows of no sequence (drawn last)
        tables = torch.cat([tables, torch.zeros(pad_seqs, per_seq, dtype=torch.int32)])
    if pad_tokens:
        q, k_new, v_new = (torch.cat([x, torch.randn(pad_tokens, *x.shape[1:], generator=gen)]) for x in (q, k_new, v_new))
    scale = D ** -0.5
    max_q = max(q_lens)

    def run(packed: bool):
        saved = pk.PACKED_SEQS
        pk.PACKED_SEQS = saved if packed else -1
        try:
            paged = pk.paged_prefill(q, kc, vc, tables, cu_q, cu_k, max_q, scale, block_m=BLOCK, block_n=BLOCK,
                                     first_seq=first_seq)
            fresh = pk.varlen_prefill(q, k_new, v_new, cu_q, max_q, scale, block_m=BLOCK, block_n=BLOCK)
        finally:
            pk.PACKED_SEQS = saved
        return paged, fresh

    rows = torch.cat([torch.arange(int(cu_q[i]), int(cu_q[i + 1])) for i in range(first_seq, n)]).long()
    fresh_rows = torch.arange(t).long()

    def reference(fresh: bool):
        outs = []
        for i in range(n):
            lq, lk = q_lens[i], (q_lens[i] if fresh else k_lens[i])
            if lq == 0:
                outs.append(torch.zeros(0, HK * G, D))
                continue
            s = int(cu_q[i])
            if fresh:
                k, v = k_new[s:s + lq], v_new[s:s + lq]
            else:
                pos = torch.arange(lk)
                slots = tables[i].long()[pos // PAGE] * PAGE + pos % PAGE
                k, v = kc.view(-1, HK, D)[slots], vc.view(-1, HK, D)[slots]
            qi = q[s:s + lq].transpose(0, 1)                                   # [Hq, lq, D]
            mask = torch.arange(lk)[None, :] <= (torch.arange(lq) + lk - lq)[:, None]
            o = F.scaled_dot_product_attention(qi, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                               scale=scale, enable_gqa=True)
            outs.append(o.transpose(0, 1))
        return torch.cat(outs)

    (p_paged, p_fresh), (f_paged, f_fresh) = run(True), run(False)
    ref_paged, ref_fresh = reference(False), reference(True)
    return {"paged_equal": bool(torch.equal(p_paged[rows], f_paged[rows])),
            "fresh_equal": bool(torch.equal(p_fresh[fresh_rows], f_fresh[fresh_rows])),
            "paged_err": (p_paged[rows] - ref_paged[rows]).abs().max().item(),
            "fresh_err": (p_fresh[fresh_rows] - ref_fresh).abs().max().item(),
            "packed_programs": (t + pad_tokens + BLOCK - 1) // BLOCK + n + pad_seqs - first_seq,
            "full_programs": (max_q + BLOCK - 1) // BLOCK * (n + pad_seqs - first_seq),
            "paged": p_paged, "rows": rows}


def _padded(pk) -> dict:
    """The "mixed" case from its first chunk, alone and as a graph bucket loads it: padding sequences of no
    tokens and padding tokens after the last sequence."""
    import torch

    plain = _case(pk, CASES["mixed"], first_seq=2)
    padded = _case(pk, CASES["mixed"], first_seq=2, pad_seqs=5, pad_tokens=23)
    rows = plain["rows"]
    return {"equal": bool(torch.equal(plain["paged"][rows], padded["paged"][rows]))}


def main() -> None:
    from engine.attention import prefill_kernels as pk

    if not interpreter_ready(lambda: _case(pk, [(3, 1)])):
        return
    out = {}
    for name, lens in CASES.items():
        r = _case(pk, lens, first_seq=2 if name == "mixed" else 0)
        out[name] = {k: v for k, v in r.items() if k not in ("paged", "rows")}
    out["padded"] = _padded(pk)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
