"""`labkit principles shapes --tp N`: how Qwen3's layers split across tensor-parallel ranks (static).

The numbers are computed from the model's config.json and the engine's own layer classes (the same
shard arithmetic the weight loaders use), not typed in.
"""
from __future__ import annotations

from pathlib import Path

from labkit.errors import UserError


def tp_shapes(hf_config: dict, tp: int) -> dict:
    from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    hidden = hf_config["hidden_size"]
    heads, kv_heads = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
    head_dim = hf_config.get("head_dim") or hidden // heads
    inter, vocab = hf_config["intermediate_size"], hf_config["vocab_size"]
    if heads % tp or kv_heads % tp:
        raise UserError(f"--tp {tp} must divide {heads} q heads and {kv_heads} kv heads")
    ranks = []
    for rank in range(tp):
        qkv = QKVParallelLinear.__new__(QKVParallelLinear)
        qkv.head_dim, qkv.num_heads, qkv.num_kv_heads = head_dim, heads // tp, kv_heads // tp
        local = {name: qkv.shard_range(name) for name in ("q", "k", "v")}
        full = {"q": (0, heads * head_dim), "k": (heads * head_dim, kv_heads * head_dim),
                "v": ((heads + kv_heads) * head_dim, kv_heads * head_dim)}
        ranks.append({
            "rank": rank,
            "q_heads": heads // tp, "kv_heads": kv_heads // tp,
            "qkv_proj_out": sum(size for _, size in local.values()),
            # rows of the TP=1 packed qkv weight ([0,2048) q, [2048,3072) k, [3072,4096) v for Qwen3-0.6B)
            # this rank holds, and where they land in its own packed qkv weight
            "rows_of_tp1_packed_qkv": {n: [full[n][0] + rank * local[n][1], full[n][0] + (rank + 1) * local[n][1]]
                                         for n in local},
            "qkv_rows_in_packed_weight": {n: [off, off + size] for n, (off, size) in local.items()},
            "gate_up_proj_out": 2 * inter // tp,
            "o_proj_in": heads * head_dim // tp, "down_proj_in": inter // tp,
            "vocab_rows": [rank * ((vocab + tp - 1) // tp), min(vocab, (rank + 1) * ((vocab + tp - 1) // tp))],
        })
    return {
        "tp": tp,
        "model": {"hidden": hidden, "q_heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
                  "intermediate": inter, "vocab": vocab, "layers": hf_config["num_hidden_layers"]},
        "split": {
            "column (output split, no communication)": [QKVParallelLinear.__name__ + " qkv_proj",
                                                         MergedColumnParallelLinear.__name__ + " gate_up_proj"],
            "row (input split, all-reduce of partial sums)": [RowParallelLinear.__name__ + " o_proj",
                                                             RowParallelLinear.__name__ + " down_proj"],
            "vocab (rows split)": ["VocabParallelEmbedding embed_tokens (masked lookup + all-reduce)",
                                   "ParallelLMHead lm_head (all-gather of logits slices)"],
            "replicated": ["RMSNorm input/post_attention/q_norm/k_norm/final", "RotaryEmbedding"],
        },
        "combined_where": ["after o_proj (all-reduce)", "after down_proj (all-reduce)",
                           "after embed_tokens (all-reduce)", "after lm_head (all-gather)"],
        "all_reduces_per_forward": 2 * hf_config["num_hidden_layers"] + 1,
        "ranks": ranks,
    }


def run_shapes(tp: int, model: str | None, out: Path | None) -> dict:
    import json

    from labkit.evidence import write_evidence
    from labkit.paths import default_out
    from labkit.assets.identity import model_identity
    from labkit.assets.resolve import resolve_model
    from labkit.assets.synth import PRESETS

    if model is None:
        cfg, identity = dict(PRESETS["qwen3-0.6b"]), {"preset": "qwen3-0.6b", "synthetic": None,
                                                       "note": "shapes of the qwen3-0.6b preset (config only)"}
    else:
        ref = resolve_model(model, "cpu")
        cfg, identity = json.loads((ref.path / "config.json").read_text()), model_identity(ref.path)
    facts = tp_shapes(cfg, tp)
    return write_evidence(out or default_out(f"tensor-parallel-shapes-tp{tp}.json"),
                          checkpoint="tp.shapes" if tp == 2 else None, kind="static", facts=facts, model=identity)
