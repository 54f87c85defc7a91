"""Synthetic Qwen3 weights that are numerically tame in BF16 and still a real test (``--init tame``).

The random init (:mod:`labkit.assets.synth`) gives every block a unit-scale random branch and peaked
attention: a deep stack of such blocks is chaotic in BF16 (two correct implementations disagree by a
relative L2 of ~0.8). Here the forward pass computes a small, legible "language" instead:

- Residual stream, split by coordinate into three parts: ``a`` (the token's identity), ``b`` (what it
  predicts) and ``u`` (a constant, the same in every token's embedding: a bias the positional heads read).
- A bigram: the normal tokens form one seeded cycle ``next``; token s's ``b`` part is ``Q a[prev(s)]``
  (``Q`` a fixed map with orthonormal rows). The embeddings are tied, so a hidden state whose ``b`` part
  is ``Q a[t]`` gives ``next(t)`` a logit far above every other (a healthy top-1 margin), and greedy
  decoding walks the cycle instead of repeating one token.
- Content heads (the first half of the KV groups): q and k from the same projection, so each position
  attends mostly to itself; their values read ``a`` and ``o_proj`` writes ``Q a`` into ``b``, a share of
  ``SYNTH_TAME_TRANSITION / layers`` per layer. Every layer carries part of the prediction.
- Positional heads (the other half): q and k read only ``u``, and RoPE turns them into a preference for
  one relative distance (1, 2 or 3 positions back) that falls off smoothly: attention that depends on
  positions, neither uniform nor one-hot. Their values and the MLP are random, with output projections
  scaled by ``SYNTH_TAME_BRANCH / sqrt(2 * layers)``: the context moves the logits (by much more than
  BF16 rounding does) without a chaotic residual stream.
- Norm weights are near 1 with seeded jitter (distinct per tensor, as in the random init); the final
  norm weighs ``b`` and nearly ignores ``a`` and ``u``.

Everything is drawn from per-name seeds, so the same (preset, seed) always gives the same weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

#: Total weight of the bigram transition summed over the layers (``b`` gets about this times ``Q a``).
SYNTH_TAME_TRANSITION = 3.0
#: Output scale of the random branches (positional heads' o_proj, MLP down_proj), over sqrt(2 * layers).
SYNTH_TAME_BRANCH = 1.0
#: q_norm / k_norm scale: a head's best score is about 11.3 * this**2 over a random one (head_dim 128).
SYNTH_TAME_QK_NORM = 0.8
#: Final norm weight of the ``b`` part, times ``SYNTH_TAME_LOGIT / d_b``: the next token's logit.
SYNTH_TAME_LOGIT = 12.0
#: Final norm weight of the ``a`` and ``u`` parts relative to ``b``'s.
SYNTH_TAME_FINAL_A = 0.1
#: Relative noise between the q and k projections of a content head.
SYNTH_TAME_QK_NOISE = 0.2
#: Relative distances the positional KV groups prefer, in turn.
SYNTH_TAME_DISTANCES = (1, 2, 3)
#: Seeded per-tensor jitter of every norm weight (as SYNTH_NORM_JITTER of the random init).
SYNTH_TAME_NORM_JITTER = 0.1
#: Continuation ids below this (Qwen's first special token) form the bigram cycle.
NORMAL_TOKENS = 151643


def split_dims(cfg: dict) -> tuple[int, int, int]:
    """(d_a, d_b, d_u): the sizes of the residual parts a | b | u (contiguous, in this order)."""
    h = int(cfg["hidden_size"])
    n_kv = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    hd = int(cfg.get("head_dim") or h // int(cfg["num_attention_heads"]))
    d_a, d_u = max(1, n_kv // 2) * hd, max(2, hd // 2)
    return d_a, h - d_a - d_u, d_u


def bigram_next(cfg: dict, seed: int, seeder: Callable[[int, str], int]):
    """next[t] for every token id: one seeded cycle over the normal tokens; special tokens point into it."""
    import torch

    vocab = int(cfg["vocab_size"])
    n = min(vocab, NORMAL_TOKENS)
    gen = torch.Generator().manual_seed(seeder(seed, "tame:cycle"))
    order = torch.randperm(n, generator=gen)
    nxt = torch.empty(vocab, dtype=torch.long)
    nxt[order] = order.roll(-1)
    if vocab > n:
        nxt[n:] = torch.randint(0, n, (vocab - n,), generator=gen)
    return nxt


def _rope(x, position: float, theta: float):
    """Neox-style RoPE of the vectors ``x`` [..., head_dim] at one (possibly negative) position."""
    import torch

    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.cat([inv, inv]) * position
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    rot = torch.cat([-x2, x1], dim=-1)
    return (x.double() * ang.cos() + rot.double() * ang.sin()).float()


@dataclass(frozen=True)
class _Shape:
    """The sizes the tame init works with, read from a Qwen3 config once."""
    h: int
    n_layers: int
    n_heads: int
    n_kv: int
    hd: int
    vocab: int
    theta: float
    d_a: int
    d_b: int
    d_u: int

    @property
    def rep(self) -> int:
        """q heads per KV group."""
        return self.n_heads // self.n_kv

    @property
    def n_content(self) -> int:
        """KV groups that are content heads (the rest are positional)."""
        return self.n_kv // 2

    @property
    def parts(self) -> tuple[slice, slice, slice]:
        """The residual parts a | b | u as slices of the hidden size."""
        return slice(0, self.d_a), slice(self.d_a, self.d_a + self.d_b), slice(self.d_a + self.d_b, self.h)


def _shape(cfg: dict) -> _Shape:
    h, n_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    n_kv = int(cfg.get("num_key_value_heads") or n_heads)
    hd = int(cfg.get("head_dim") or h // n_heads)
    d_a, d_b, d_u = split_dims(cfg)
    if d_b < 1 or n_kv < 2 or hd < 8:
        raise ValueError(f"the tame init needs at least 2 KV heads and room for the b part (hidden {h})")
    return _Shape(h=h, n_layers=int(cfg["num_hidden_layers"]), n_heads=n_heads, n_kv=n_kv, hd=hd,
                  vocab=int(cfg["vocab_size"]), theta=float(cfg.get("rope_theta") or 1e6), d_a=d_a, d_b=d_b, d_u=d_u)


class _Draw:
    """Seeded float32 normals, one generator per name: a tensor's values never depend on the others'."""

    def __init__(self, seed: int, seeder: Callable[[int, str], int]):
        self.seed, self.seeder = seed, seeder

    def __call__(self, name: str, *shape: int):
        import torch

        gen = torch.Generator().manual_seed(self.seeder(self.seed, name))
        return torch.randn(*shape, generator=gen, dtype=torch.float32)


def _transition(sh: _Shape, randn: _Draw):
    """(Q, u): Q [d_b, d_a] with orthonormal rows (d_b <= d_a) or columns, scaled so Q a has unit RMS like
    a; u the constant part, at unit RMS."""
    import torch

    qmat = torch.linalg.qr(randn("tame:Q", max(sh.d_a, sh.d_b), min(sh.d_a, sh.d_b)))[0]
    qmat = (qmat.T if sh.d_b <= sh.d_a else qmat) * math.sqrt(sh.d_a / sh.d_b)          # [d_b, d_a]
    c_u = randn("tame:u", sh.d_u)
    return qmat, c_u / c_u.pow(2).mean().sqrt()


def _embeddings(cfg: dict, sh: _Shape, seed: int, seeder: Callable[[int, str], int], randn: _Draw,
                qmat, c_u, tdtype):
    """Embeddings [vocab, h]: a random, b = Q a[prev], u constant; built in float32 row chunks."""
    import torch

    A, B, U = sh.parts
    nxt = bigram_next(cfg, seed, seeder)
    emb = torch.empty(sh.vocab, sh.h, dtype=tdtype)
    a_all = randn("model.embed_tokens.weight:a", sh.vocab, sh.d_a)
    b_all = randn("model.embed_tokens.weight:b", sh.vocab, sh.d_b)         # kept for tokens nothing precedes
    n_normal = min(sh.vocab, NORMAL_TOKENS)
    src = torch.arange(n_normal)
    dst = nxt[:n_normal]
    chunk = 1 << 15
    for start in range(0, n_normal, chunk):
        s, d = src[start:start + chunk], dst[start:start + chunk]
        b_all[d] = a_all[s] @ qmat.T
    for start in range(0, sh.vocab, chunk):
        stop = min(start + chunk, sh.vocab)
        emb[start:stop, A] = a_all[start:stop].to(tdtype)
        emb[start:stop, B] = b_all[start:stop].to(tdtype)
        emb[start:stop, U] = c_u.to(tdtype)
    return emb


def _content_group(sh: _Shape, randn: _Draw, p: str, g: int, qkvo: tuple, qmat, share: float) -> None:
    """Content KV group g: q ~ k (self-attention mostly), v = the a slice, o writes Q a into b."""
    import torch

    q, k, v, o = qkvo
    B, hd, rep = sh.parts[1], sh.hd, sh.rep
    rows = slice(g * hd, (g + 1) * hd)
    s = randn(f"{p}content.{g}.k", hd, sh.d_a + sh.d_b) / math.sqrt(sh.d_a + sh.d_b)
    k[rows, : sh.d_a + sh.d_b] = s
    lo = g * hd                                   # d_a = n_content * hd: one slice per group
    v[rows, lo:lo + hd] = torch.eye(hd)
    for j in range(g * rep, (g + 1) * rep):
        noise = randn(f"{p}content.{j}.q", hd, sh.d_a + sh.d_b) / math.sqrt(sh.d_a + sh.d_b)
        q[j * hd:(j + 1) * hd, : sh.d_a + sh.d_b] = s + SYNTH_TAME_QK_NOISE * noise
        o[B, j * hd:(j + 1) * hd] = (share / rep) * qmat[:, lo:lo + hd]


def _positional_group(sh: _Shape, randn: _Draw, p: str, g: int, qkvo: tuple, c_u, branch: float) -> None:
    """Positional KV group g: q, k read only the constant u; RoPE makes the score peak at distance delta."""
    import torch

    q, k, v, o = qkvo
    A, _, U = sh.parts
    hd, rep = sh.hd, sh.rep
    rows = slice(g * hd, (g + 1) * hd)
    delta = SYNTH_TAME_DISTANCES[(g - sh.n_content) % len(SYNTH_TAME_DISTANCES)]
    n_pairs = max(1, hd // 16)
    k0 = torch.zeros(hd)
    k0[:n_pairs] = randn(f"{p}positional.{g}.k1", n_pairs)
    k0[hd // 2: hd // 2 + n_pairs] = randn(f"{p}positional.{g}.k2", n_pairs)
    q0 = _rope(k0, -float(delta), sh.theta)
    k[rows, U] = torch.outer(k0, c_u) / sh.d_u
    v[rows, : sh.d_a + sh.d_b] = randn(f"{p}positional.{g}.v", hd, sh.d_a + sh.d_b) / math.sqrt(sh.d_a + sh.d_b)
    for j in range(g * rep, (g + 1) * rep):
        q[j * hd:(j + 1) * hd, U] = torch.outer(q0, c_u) / sh.d_u
        # the values average over the attended positions: a 2x larger projection keeps the
        # branch near its nominal scale
        o[A, j * hd:(j + 1) * hd] = randn(f"{p}positional.{j}.o", sh.d_a, hd) * (
            2.0 * branch / math.sqrt((sh.n_kv - sh.n_content) * rep * hd))


def _layer(cfg: dict, sh: _Shape, randn: _Draw, i: int, qmat, c_u) -> dict[str, Any]:
    """Layer i's attention and MLP projections (its norms come with the others)."""
    import torch

    p = f"model.layers.{i}."
    branch = SYNTH_TAME_BRANCH / math.sqrt(2 * sh.n_layers)
    # the transition's share ramps from 0.5x (first layer) to 1.5x (last) of the mean: the last layers,
    # which nothing downstream amplifies, still move the logits by more than BF16 rounding does
    share = SYNTH_TAME_TRANSITION / sh.n_layers * (0.5 + (i / (sh.n_layers - 1) if sh.n_layers > 1 else 0.5))
    qkvo = (torch.zeros(sh.n_heads * sh.hd, sh.h), torch.zeros(sh.n_kv * sh.hd, sh.h),
            torch.zeros(sh.n_kv * sh.hd, sh.h), torch.zeros(sh.h, sh.n_heads * sh.hd))
    for g in range(sh.n_kv):
        if g < sh.n_content:
            _content_group(sh, randn, p, g, qkvo, qmat, share)
        else:
            _positional_group(sh, randn, p, g, qkvo, c_u, branch)
    out = dict(zip((p + f"self_attn.{x}_proj.weight" for x in "qkvo"), qkvo))
    inter, h = int(cfg["intermediate_size"]), sh.h
    out[p + "mlp.gate_proj.weight"] = randn(p + "mlp.gate_proj.weight", inter, h) / math.sqrt(h)
    out[p + "mlp.up_proj.weight"] = randn(p + "mlp.up_proj.weight", inter, h) / math.sqrt(h)
    down = torch.zeros(h, inter)
    # silu(g) * u with g, u ~ N(0, 1) has RMS ~0.6: scale the projection so the branch has RMS `branch`
    down[sh.parts[0]] = randn(p + "mlp.down_proj.weight", sh.d_a, inter) * (branch / (0.6 * math.sqrt(inter)))
    out[p + "mlp.down_proj.weight"] = down
    return out


def _norm_weights(sh: _Shape, randn: _Draw, specs: list[tuple[str, tuple[int, ...], str, float]]) -> dict[str, Any]:
    """Every norm weight near 1 with seeded jitter; the final norm weighs b and nearly ignores a and u."""
    import torch

    out: dict[str, Any] = {}
    for name, shape, kind, _ in specs:
        if kind != "norm":
            continue
        jitter = 1.0 + SYNTH_TAME_NORM_JITTER * randn(name, *shape)
        if name == "model.norm.weight":
            gamma = SYNTH_TAME_LOGIT / sh.d_b
            w = torch.full(shape, gamma * SYNTH_TAME_FINAL_A)
            w[sh.parts[1]] = gamma
            out[name] = w * jitter
        elif "q_norm" in name or "k_norm" in name:
            out[name] = SYNTH_TAME_QK_NORM * jitter
        else:
            out[name] = jitter
    return out


def make_tame_weights(cfg: dict, seed: int, dtype: str, specs: list[tuple[str, tuple[int, ...], str, float]],
                      seeder: Callable[[int, str], int]) -> dict[str, Any]:
    """The tame state dict: the same names and shapes as ``specs`` (the random init's), other values."""
    import torch

    sh = _shape(cfg)
    tdtype = getattr(torch, dtype)
    randn = _Draw(seed, seeder)
    qmat, c_u = _transition(sh, randn)
    out: dict[str, Any] = {"model.embed_tokens.weight": _embeddings(cfg, sh, seed, seeder, randn, qmat, c_u, tdtype)}
    for i in range(sh.n_layers):
        out.update(_layer(cfg, sh, randn, i, qmat, c_u))
    out.update(_norm_weights(sh, randn, specs))
    if "lm_head.weight" in {n for n, *_ in specs}:
        out["lm_head.weight"] = out["model.embed_tokens.weight"].clone()
    missing = {n for n, *_ in specs} - set(out)
    if missing:
        raise AssertionError(f"tame init left out {sorted(missing)}")
    return {n: (t if t.dtype == tdtype else t.to(tdtype)).contiguous() for n, t in out.items()}
