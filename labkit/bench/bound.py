"""A memory-bandwidth bound on decode throughput, derived from the model's shape, the workload and a roof
measured in the same run (no typed-in number).

Every decode step reads each weight of the decoder layers and the LM head at least once, and every
sequence in the step reads the K and V of its whole context. However the scheduler batches, a workload
whose longest request decodes ``d_max`` tokens needs at least ``d_max`` decode steps, and its decode
tokens read ``sum over requests of sum over its decode tokens of (context length) x KV bytes per token``.
Moving those bytes at the device's copy bandwidth takes at least::

    bound_seconds = (weight_bytes_per_step * d_max + kv_read_bytes) / copy_roof_bytes_per_s

so no run of the workload outputs faster than ``output_tokens / bound_seconds``. The prefill, the
sampling and every launch are left out (they only add time), so the bound is optimistic: a measured
throughput above it means the bound's inputs or the measurement are wrong.

Pure Python: unit-testable on CPU; the bench supplies the measured roof.
"""
from __future__ import annotations

from typing import Sequence


def decode_weight_bytes(shape, element_size: int) -> int:
    """Bytes of the weights one decode step reads: every decoder layer's projections and norms, the final
    norm and the LM head (the embedding's rows for the step's tokens are negligible and left out)."""
    h, hd = shape.hidden_size, shape.head_dim
    q, kv = shape.num_heads * hd, shape.num_kv_heads * hd
    per_layer = h * (q + 2 * kv) + q * h + 2 * h * shape.intermediate_size + shape.intermediate_size * h
    per_layer += 2 * h + 2 * hd                      # input/post-attention layernorms, q_norm and k_norm
    params = shape.num_layers * per_layer + h + shape.vocab_size * h
    return params * element_size


def kv_read_bytes(prompt_lens: Sequence[int], output_lens: Sequence[int], kv_bytes_per_token: int) -> int:
    """K/V bytes the decode steps read: the token that yields output k (k >= 1; output 0 comes from the
    prefill) attends to ``prompt + k`` positions."""
    positions = 0
    for p, n in zip(prompt_lens, output_lens, strict=True):
        d = max(n - 1, 0)                            # decode steps of this request
        positions += d * p + d * (d + 1) // 2        # sum over k = 1..d of (p + k)
    return positions * kv_bytes_per_token


def decode_bound(shape, weight_element_size: int, kv_element_size: int, prompt_lens: Sequence[int],
                 output_lens: Sequence[int], copy_roof_gb_s: float) -> dict:
    """The bound and every input of its derivation (for the evidence)."""
    if copy_roof_gb_s <= 0:
        raise ValueError(f"copy roof must be positive, got {copy_roof_gb_s}")
    weights = decode_weight_bytes(shape, weight_element_size)
    kv_token = shape.kv_bytes_per_token(kv_element_size)
    min_steps = max((max(n - 1, 0) for n in output_lens), default=0)
    kv = kv_read_bytes(prompt_lens, output_lens, kv_token)
    total = weights * min_steps + kv
    seconds = total / (copy_roof_gb_s * 1e9)
    outputs = sum(output_lens)
    return {
        "model_shape": {"hidden": shape.hidden_size, "layers": shape.num_layers, "q_heads": shape.num_heads,
                        "kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim,
                        "intermediate": shape.intermediate_size, "vocab": shape.vocab_size},
        "weight_element_size": weight_element_size,
        "kv_element_size": kv_element_size,
        "weight_bytes_per_decode_step": weights,
        "kv_bytes_per_token": kv_token,
        "requests": len(output_lens),
        "prompt_tokens": sum(prompt_lens),
        "output_tokens": outputs,
        "min_decode_steps": min_steps,
        "kv_read_bytes": kv,
        "bytes_moved": total,
        "copy_roof_gb_s": round(copy_roof_gb_s, 1),
        "bound_seconds": seconds,
        "bound_tok_s": round(outputs / seconds, 1) if seconds > 0 else None,
        "formula": "(weight_bytes_per_decode_step * min_decode_steps + kv_read_bytes) / copy roof",
    }


def step_bound(shape, weight_element_size: int, kv_element_size: int, batch: int, context: float,
               copy_roof_gb_s: float) -> dict:
    """The memory-bandwidth bound of one decode step of `batch` sequences at mean context `context`: the
    step reads every decode weight once and each sequence's K/V; at batch 1 this is the weight-read
    bound on the time per output token."""
    if copy_roof_gb_s <= 0:
        raise ValueError(f"copy roof must be positive, got {copy_roof_gb_s}")
    weights = decode_weight_bytes(shape, weight_element_size)
    kv = int(batch * context * shape.kv_bytes_per_token(kv_element_size))
    ms = (weights + kv) / (copy_roof_gb_s * 1e9) * 1e3
    return {"batch": batch, "mean_context": context, "weight_bytes": weights, "kv_read_bytes": kv,
            "copy_roof_gb_s": round(copy_roof_gb_s, 1), "bound_ms_per_step": round(ms, 4),
            "formula": "(weight_bytes_per_decode_step + batch x mean context x kv_bytes_per_token) / copy roof"}
