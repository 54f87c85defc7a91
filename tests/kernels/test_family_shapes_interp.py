"""Our Triton kernels at the shapes of the Llama and Qwen2 families, on the CPU through Triton's
interpreter: head_dim 64 and GQA groups of 3 (SmolLM2-135M: 9 q / 3 kv heads) and 7 (Qwen2-0.5B: 14 q / 2 kv
heads, and its TP-2 share of 7 q / 1 kv head), the kernels of the plain route those families take on CUDA:

- the paged decode (one split, several splits with the fused reduce and with the reduce kernel; pages of 16 and
  256; a padding row, one position, a partial tile, a page boundary) against the float32 dense reference;
- the paged prefill (a cached prefix plus new tokens, and the fresh varlen prefill) against the reference, and
  from a first sequence on (a mixed step's chunks) equal to the whole batch's rows;
- the KV store (the plain route's backend.store_kv) against indexing;
- the batch-1 GEMV at SmolLM2's projections (qkv [960, 576], o [576, 576], gate_up [3072, 576], down with the
  SiLU-and-mul prologue [576, 1536]) and the normed GEMV against rms_norm then F.linear.

bf16 and float32. The sm_90 compile of the same shapes is tests/kernels/test_sm90_compile.py's smollm2-135m
preset. Skipped where triton is not installed or its interpreter cannot run a kernel here.
"""
from __future__ import annotations

import json

import pytest

from interp import interpreted, interpreter_ready

# (name, kv heads, q heads per kv head, head_dim)
ATTN_SHAPES = [("smollm2", 3, 3, 64), ("qwen2-0.5b", 2, 7, 64), ("qwen2-0.5b-tp2", 1, 7, 64)]
LENGTHS = [0, 1, 37, 300]
# (name, N, K, mode): mode plain, silu (x is gate_up [1, 2K]) or normed
GEMV_SHAPES = [("qkv", 960, 576, "normed"), ("o", 576, 576, "plain"), ("gate_up", 3072, 576, "normed"),
               ("down", 576, 1536, "silu")]
DTYPES = ("float32", "bfloat16")


@pytest.fixture(scope="module")
def results():
    return interpreted(__file__, timeout=900)


def _tol(dtype: str) -> float:
    from labkit.bench.attention import OUTPUT_TOL
    return 1e-4 if dtype == "float32" else OUTPUT_TOL


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [s[0] for s in ATTN_SHAPES])
def test_paged_decode(results, shape, dtype):
    for key, r in results["decode"].items():
        if key.startswith(f"{shape}/{dtype}/"):
            assert "error" not in r, (key, r)
            assert r["padding_zero"] and r["same_shape"], (key, r)
            assert r["max_abs_err"] <= _tol(dtype), (key, r)
    assert sum(k.startswith(f"{shape}/{dtype}/") for k in results["decode"]) == 6      # 2 pages x 3 reduce modes


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [s[0] for s in ATTN_SHAPES])
def test_prefill_and_store(results, shape, dtype):
    r = results["prefill"][f"{shape}/{dtype}"]
    assert "error" not in r, r
    assert r["paged_err"] <= _tol(dtype) and r["varlen_err"] <= _tol(dtype), r
    assert r["store_equal"] and r["first_seq_equal"], r


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_at_smollm2s_projections(results, dtype):
    for name, *_ in GEMV_SHAPES:
        r = results["gemv"][f"{name}/{dtype}"]
        assert "error" not in r, (name, r)
        # as test_gemv_interp: float32 another summation order; bfloat16 the output's rounding (and the
        # activation's with the prologue; the normed input's with the norm)
        assert r["max_rel_err"] <= (1e-5 if dtype == "float32" else 2e-2), (name, r)


# -- the interpreted process ------------------------------------------------------------------------------------
def _decode(hk: int, g: int, d: int, dtype: str, page: int, mode: str) -> dict:
    import torch

    import engine.attention.triton_kernels as tk
    from labkit.bench.attention import decode_reference

    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(hk * 100 + g * 10 + page)
    pages = [(n + page - 1) // page for n in LENGTHS]
    blocks = sum(pages) + 2
    kc = torch.randn(blocks, page, hk, d, generator=gen).to(dt)
    vc = torch.randn(blocks, page, hk, d, generator=gen).to(dt)
    perm = torch.randperm(blocks, generator=gen).tolist()
    width, tables, i = max(pages), [], 0
    for p in pages:
        tables.append(perm[i:i + p] + [-1] * (width - p))
        i += p
    bt, ctx = torch.tensor(tables, dtype=torch.int32), torch.tensor(LENGTHS, dtype=torch.int32)
    q = torch.randn(len(LENGTHS), hk * g, d, generator=gen).to(dt)
    sm, fuse = {"one-split": (1, None), "fused-reduce": (16, True), "reduce-kernel": (16, False)}[mode]
    try:
        out = tk.paged_decode(q, kc, vc, bt, ctx, d ** -0.5, int(ctx.max()), sm, fuse_reduce=fuse)
    except Exception as e:                                  # noqa: BLE001 (the test reports it)
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    ref = decode_reference(q, kc, vc, bt, ctx, d ** -0.5)
    ref[ctx == 0] = 0.0
    err = (out.float() - ref).abs().max().item()
    return {"max_abs_err": err if err == err else float("inf"), "same_shape": out.shape == q.shape,
            "padding_zero": out[ctx == 0].abs().max().item() == 0}


def _prefill(hk: int, g: int, d: int, dtype: str) -> dict:
    import torch


    from engine.attention import kv_store
    import engine.attention.prefill_kernels as pk
    from labkit.bench.attention import prefill_reference

    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(hk * 100 + g)
    seqs, prefix, new, page = 2, 48, 40, 16
    per_seq = (prefix + new + page - 1) // page
    blocks = seqs * per_seq + 1
    k_new = torch.randn(seqs * (prefix + new), hk, d, generator=gen).to(dt)
    v_new = torch.randn(seqs * (prefix + new), hk, d, generator=gen).to(dt)
    kc = torch.zeros(blocks, page, hk, d, dtype=dt)
    vc = torch.zeros(blocks, page, hk, d, dtype=dt)
    perm = torch.randperm(blocks, generator=gen)[:seqs * per_seq].view(seqs, per_seq).int()
    slots = torch.cat([perm[s].long().repeat_interleave(page) * page + torch.arange(per_seq * page) % page
                       for s in range(seqs)][:seqs])
    slots = slots.view(seqs, -1)[:, :prefix + new].reshape(-1)
    try:
        kv_store.store_kv(k_new, v_new, kc, vc, slots)              # every position, prefix and new, into the pages
        store_equal = bool(torch.equal(kc.view(-1, hk, d)[slots], k_new) and
                           torch.equal(vc.view(-1, hk, d)[slots], v_new))
        q = torch.randn(seqs * new, hk * g, d, generator=gen).to(dt)
        cu_q = torch.arange(0, seqs * new + 1, new, dtype=torch.int32)
        cu_k = torch.arange(0, seqs * (prefix + new) + 1, prefix + new, dtype=torch.int32)
        out = pk.paged_prefill(q, kc, vc, perm, cu_q, cu_k, new, d ** -0.5)
        ref = prefill_reference(q, kc, vc, perm, seqs, prefix, new, d ** -0.5)
        # the sequences from the second on (a mixed step's chunks after its decode rows): their rows, bit for bit
        tail = pk.paged_prefill(q, kc, vc, perm, cu_q, cu_k, new, d ** -0.5, first_seq=1)
        # the fresh prefill: the new tokens only, nothing cached
        kf, vf = (t.view(seqs, prefix + new, hk, d)[:, prefix:].reshape(-1, hk, d).contiguous() for t in (k_new, v_new))
        fresh = pk.varlen_prefill(q, kf, vf, cu_q, new, d ** -0.5)
        fresh_ref = prefill_reference(q, kf.view(seqs, new, hk, d), vf.view(seqs, new, hk, d),
                                      torch.arange(seqs, dtype=torch.int32)[:, None], seqs, 0, new, d ** -0.5)
    except Exception as e:                                  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return {"paged_err": (out.float() - ref).abs().max().item(), "varlen_err": (fresh.float() - fresh_ref).abs().max().item(),
            "store_equal": store_equal, "first_seq_equal": bool(torch.equal(tail[new:], out[new:]))}


def _gemv(n: int, k: int, mode: str, dtype: str) -> dict:
    import torch
    import torch.nn.functional as F

    from engine.layers.gemv import gemv, normed_gemv

    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dt)
    try:
        if mode == "normed":
            x, res, nw = (torch.randn(1, k, generator=gen).to(dt), torch.randn(1, k, generator=gen).to(dt),
                          (torch.rand(k, generator=gen) + 0.5).to(dt))
            y, _ = normed_gemv(x, w, nw, 1e-5, res)
            h = (x.float() + res.float())
            h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dt).float() * nw.float()
            ref = F.linear(h, w.float())
        else:
            x = torch.randn(1, 2 * k if mode == "silu" else k, generator=gen).to(dt)
            y = gemv(x, w, silu_mul=mode == "silu")
            if mode == "silu":
                gt, up = x.chunk(2, dim=-1)
                x = (F.silu(gt.float()).to(dt).float() * up.float()).to(dt)
            ref = F.linear(x.float(), w.float())
    except Exception as e:                                  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return {"max_rel_err": ((y.float() - ref).abs().max() / ref.abs().max()).item()}


def main() -> None:
    if not interpreter_ready(lambda: _gemv(16, 64, "plain", "float32")):
        return
    import triton.runtime.interpreter as interp
    from test_decode_kernel_interp import _bf16_dot_fix       # the interpreter's bf16 tl.dot, as the decode test

    interp.InterpreterBuilder.create_dot = _bf16_dot_fix(interp.InterpreterBuilder.create_dot)
    decode, prefill, gemv = {}, {}, {}
    for name, hk, g, d in ATTN_SHAPES:
        for dtype in DTYPES:
            for page in (16, 256):
                for mode in ("one-split", "fused-reduce", "reduce-kernel"):
                    decode[f"{name}/{dtype}/{page}/{mode}"] = _decode(hk, g, d, dtype, page, mode)
            prefill[f"{name}/{dtype}"] = _prefill(hk, g, d, dtype)
    for name, n, k, mode in GEMV_SHAPES:
        for dtype in DTYPES:
            gemv[f"{name}/{dtype}"] = _gemv(n, k, mode, dtype)
    print(json.dumps({"decode": decode, "prefill": prefill, "gemv": gemv}))


if __name__ == "__main__":
    main()
