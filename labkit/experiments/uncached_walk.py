"""`labkit principles uncached`: the handbook's optional uncached walkthrough (B.1.4), on the engine's parts.

A toy network, seeded and untrained: six token ids, a 4-wide hidden state with an additive position vector, two
single-head blocks (the engine's ``RMSNorm``; Q/K/V; the engine's ``Attention`` layer on the torch backend;
the residual add; a ReLU MLP), a final norm and an LM head. It generates three tokens from a three-id prompt
twice:

- **uncached**, the way a model runs with no KV cache: every round feeds the whole known sequence (widths 3, 4,
  5: 12 input positions) through a fresh, empty cache and keeps only the last row's logits;
- **cached**, the engine's way: round 1 prefills the prompt into each block's paged cache, rounds 2 and 3 feed
  the one new id and decode over the cache (widths 3, 1, 1: 5 input positions).

What it shows: each round's input ids, the hidden state's shape (rows grow, 4 columns always), each block's
attention score matrix as the engine layer ran it (the query rows it returned x the K/V slots its cache holds:
[3,3], [4,4], [5,5]), the same attention by hand beside the layer's output, and one position
(the prompt's last) traced through embedding, norm, Q/K/V, attention, residual, MLP and LM head in every
round. The causal prefix error is how much an earlier position's final hidden row moved when a later position
was appended: zero up to float rounding, since causal attention never reads the future. That is why the cached
path may keep the old K/V and compute only the new row; its logits match the uncached ones.
"""
from __future__ import annotations

from pathlib import Path

from labkit.evidence import write_claimed

#: the toy network: hidden width, blocks, token ids, MLP width, seed; the prompt and the rounds
WIDTH, BLOCKS, VOCAB, MLP, SEED = 4, 2, 6, 8, 0
PROMPT = (1, 4, 2)
ROUNDS = 3
#: the position every round traces (the prompt's last)
TRACE = len(PROMPT) - 1


def _rounded(t) -> list:
    return [round(float(x), 6) for x in t.reshape(-1).tolist()]


class ToyNetwork:
    """Seeded float32 weights and the engine's layers; :meth:`forward` runs ids at positions start.. through
    both blocks, on fresh caches (uncached) or on the ones it keeps (cached)."""

    def __init__(self, seed: int = SEED):
        import torch

        from engine.layers.layernorm import RMSNorm
        from labkit.experiments.principles import attention_layer

        g = torch.Generator().manual_seed(seed)

        def w(*shape, scale=0.5):
            return torch.randn(*shape, generator=g) * scale

        self.embed, self.pos = w(VOCAB, WIDTH, scale=1.0), w(ROUNDS + len(PROMPT), WIDTH)
        self.blocks = [{"norm1": RMSNorm(WIDTH), "wq": w(WIDTH, WIDTH), "wk": w(WIDTH, WIDTH), "wv": w(WIDTH, WIDTH),
                        "wo": w(WIDTH, WIDTH), "norm2": RMSNorm(WIDTH), "w1": w(WIDTH, MLP), "w2": w(MLP, WIDTH)}
                       for _ in range(BLOCKS)]
        self.norm, self.head = RMSNorm(WIDTH), w(WIDTH, VOCAB, scale=1.0)
        self._layer = lambda: attention_layer(WIDTH, block_size=8, num_blocks=1)
        self.caches = [self._layer() for _ in range(BLOCKS)]

    def forward(self, ids: list[int], start: int, cached: bool) -> dict:
        """Logits of every input row, per block the hidden and score shapes, the hand-vs-engine attention error,
        and the trace of position TRACE when it is among the inputs."""
        import torch

        from labkit.experiments.principles import decode_meta, prefill_meta

        n = len(ids)
        positions = list(range(start, start + n))
        x = self.embed[torch.tensor(ids)] + self.pos[start:start + n]
        row = TRACE - start if start <= TRACE < start + n else None
        trace = {} if row is None else {"embedding": _rounded(x[row])}
        shapes, scores_shapes, hand_err = [], [], 0.0
        for b, blk in enumerate(self.blocks):
            layer = self.caches[b] if cached else self._layer()
            h = blk["norm1"](x)
            q, k, v = h @ blk["wq"], h @ blk["wk"], h @ blk["wv"]
            if start == 0:
                meta = prefill_meta(n, positions)
            else:                     # one new row (the cached path) over the start + 1 positions held
                meta = decode_meta(n, start + n, positions, [0])
            a = layer(q[:, None, :], k[:, None, :], v[:, None, :], meta)[:, 0, :]
            # the same attention by hand over every position known so far (the cache's rows, then these)
            keys = layer.k_cache[0, :start + n, 0, :].float()
            vals = layer.v_cache[0, :start + n, 0, :].float()
            scores = q @ keys.T / WIDTH ** 0.5
            future = torch.arange(start + n)[None, :] > torch.tensor(positions)[:, None]
            by_hand = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ vals
            hand_err = max(hand_err, float((by_hand - a).abs().max()))
            # the score matrix the engine layer attended with: its query rows x the K/V slots its cache holds
            held = int((layer.k_cache.abs().sum(dim=(-1, -2)) != 0).sum())
            scores_shapes.append([int(a.shape[0]), held])
            attn = a @ blk["wo"]
            x = x + attn
            mlp = torch.relu(blk["norm2"](x) @ blk["w1"]) @ blk["w2"]
            out = x + mlp
            if row is not None:
                trace[f"block{b}"] = {"norm": _rounded(h[row]), "q": _rounded(q[row]), "k": _rounded(k[row]),
                                      "v": _rounded(v[row]), "attention": _rounded(attn[row]),
                                      "residual": _rounded(x[row]), "mlp": _rounded(mlp[row]),
                                      "output": _rounded(out[row])}
            x = out
            shapes.append(list(x.shape))
        logits = self.norm(x) @ self.head
        if row is not None:
            trace["logits"] = _rounded(logits[row])
        return {"hidden": x, "logits": logits, "hidden_shapes": shapes, "score_shapes": scores_shapes,
                "hand_vs_engine": hand_err, "trace": trace}


def uncached_facts(seed: int = SEED) -> dict:
    import torch

    with torch.no_grad():
        net = ToyNetwork(seed)
        ids, rounds, finals, last_logits = list(PROMPT), [], [], []
        hand_err = 0.0
        for r in range(ROUNDS):
            got = net.forward(ids, 0, cached=False)
            nxt = int(torch.argmax(got["logits"][-1]))
            rounds.append({"round": r + 1, "input_ids": list(ids), "input_width": len(ids),
                           "engine_query_rows": got["score_shapes"][0][0],
                           "hidden_shapes": got["hidden_shapes"], "score_shapes": got["score_shapes"],
                           "last_logits": _rounded(got["logits"][-1]), "next_id": nxt, "trace": got["trace"]})
            finals.append(got["hidden"])
            last_logits.append(got["logits"][-1])
            hand_err = max(hand_err, got["hand_vs_engine"])
            ids.append(nxt)
        # how far an earlier position's final hidden row moved when later positions were appended
        prefix_err = max(float((finals[r][:finals[r - 1].shape[0]] - finals[r - 1]).abs().max())
                         for r in range(1, ROUNDS))
        first = _flat(rounds[0]["trace"])
        trace_err = max(abs(a - b) for r in rounds[1:] for a, b in zip(_flat(r["trace"]), first))

        cached_net, pending, start = ToyNetwork(seed), list(PROMPT), 0
        cached_rounds, logit_err = [], 0.0
        for r in range(ROUNDS):
            got = cached_net.forward(pending, start, cached=True)
            nxt = int(torch.argmax(got["logits"][-1]))
            err = float((got["logits"][-1] - last_logits[r]).abs().max())
            logit_err = max(logit_err, err)
            hand_err = max(hand_err, got["hand_vs_engine"])
            cached_rounds.append({"round": r + 1, "input_ids": list(pending), "input_width": len(pending),
                                  "engine_query_rows": got["score_shapes"][0][0],
                                  "score_shapes": got["score_shapes"], "next_id": nxt})
            start += len(pending)
            pending = [nxt]
    return {
        "network": {"width": WIDTH, "blocks": BLOCKS, "heads": 1, "vocab": VOCAB, "mlp_width": MLP, "seed": seed,
                    "position": "additive vectors", "norm": "engine.layers.layernorm.RMSNorm",
                    "attention": "engine.models.qwen3.Attention on the torch backend (paged cache)",
                    "weights": "seeded, untrained: the ids are no language"},
        "prompt_ids": list(PROMPT),
        "traced_position": TRACE,
        "rounds": rounds,
        "input_widths": [r["input_width"] for r in rounds],
        "hidden_shapes": [r["hidden_shapes"][-1] for r in rounds],
        "hidden_columns": sorted({s[1] for r in rounds for s in r["hidden_shapes"]}),
        "score_shapes": [r["score_shapes"][0] for r in rounds],
        "engine_query_rows": [r["engine_query_rows"] for r in rounds],
        "total_input_positions": sum(r["engine_query_rows"] for r in rounds),
        "generated_ids": [r["next_id"] for r in rounds],
        "causal_prefix_error": prefix_err,
        "traced_position_error": trace_err,
        "attention_hand_vs_engine_max_error": hand_err,
        "cached": {"input_widths": [r["input_width"] for r in cached_rounds],
                   "engine_query_rows": [r["engine_query_rows"] for r in cached_rounds],
                   "total_input_positions": sum(r["engine_query_rows"] for r in cached_rounds),
                   "score_shapes": [r["score_shapes"][0] for r in cached_rounds],
                   "generated_ids": [r["next_id"] for r in cached_rounds],
                   "same_generated_ids": [r["next_id"] for r in cached_rounds] == [r["next_id"] for r in rounds],
                   "max_last_logit_error": logit_err},
    }


def _flat(trace: dict) -> list[float]:
    out: list[float] = []
    for key in sorted(trace):
        value = trace[key]
        out += _flat(value) if isinstance(value, dict) else value
    return out


def run_uncached(out: Path | None = None, seed: int = SEED) -> dict:
    return write_claimed("principles.uncached-walkthrough", out, "uncached-walkthrough.json", kind="cpu-real-engine",
                         facts=uncached_facts(seed), device="cpu")
