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

With a matmul peak measured in the same run (``matmul_tflops``) the bound is a roofline per phase, each
phase at least the larger of its bytes over the copy roof and its FLOPs over the matmul peak, the phases
one after another as this engine runs them (a step is all-prefill or all-decode, its kernels in order)::

    decode GEMMs      max(weight_bytes_per_step * d_max,  2 * matmul_params * decode_tokens / peak)
    decode attention  max(kv_read_bytes / roof,           4 * q_heads * head_dim * layers * positions / peak)
    prefill           max(weight_bytes + KV written / roof, (2 * layer_params * prompt tokens
                          + 2 * lm_head_params * requests + causal attention FLOPs) / peak)

At large models and wide batches the GEMMs are compute-bound, which the bandwidth-only form misses.

Pure Python: unit-testable on CPU; the bench supplies the measured roofs.
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


def matmul_params(shape) -> tuple[int, int]:
    """(weights one token multiplies in the decoder layers' projections, in the LM head)."""
    h, hd = shape.hidden_size, shape.head_dim
    q, kv = shape.num_heads * hd, shape.num_kv_heads * hd
    per_layer = h * (q + 2 * kv) + q * h + 2 * h * shape.intermediate_size + shape.intermediate_size * h
    return shape.num_layers * per_layer, shape.vocab_size * h


def attention_flops_per_position(shape) -> int:
    """FLOPs one query token spends on one attended position over all layers: q.k and p.v per q head."""
    return 4 * shape.num_heads * shape.head_dim * shape.num_layers


def kv_read_bytes(prompt_lens: Sequence[int], output_lens: Sequence[int], kv_bytes_per_token: int) -> int:
    """K/V bytes the decode steps read: the token that yields output k (k >= 1; output 0 comes from the
    prefill) attends to ``prompt + k`` positions."""
    positions = 0
    for p, n in zip(prompt_lens, output_lens, strict=True):
        d = max(n - 1, 0)                            # decode steps of this request
        positions += d * p + d * (d + 1) // 2        # sum over k = 1..d of (p + k)
    return positions * kv_bytes_per_token


def decode_bound(shape, weight_element_size: int, kv_element_size: int, prompt_lens: Sequence[int],
                 output_lens: Sequence[int], copy_roof_gb_s: float, matmul_tflops: float | None = None) -> dict:
    """The bound and every input of its derivation (for the evidence); with ``matmul_tflops`` the per-phase
    roofline (module docstring), else the decode bytes over the copy roof."""
    if copy_roof_gb_s <= 0:
        raise ValueError(f"copy roof must be positive, got {copy_roof_gb_s}")
    weights = decode_weight_bytes(shape, weight_element_size)
    kv_token = shape.kv_bytes_per_token(kv_element_size)
    min_steps = max((max(n - 1, 0) for n in output_lens), default=0)
    kv = kv_read_bytes(prompt_lens, output_lens, kv_token)
    total = weights * min_steps + kv
    seconds = total / (copy_roof_gb_s * 1e9)
    outputs = sum(output_lens)
    roofline = None
    if matmul_tflops is not None:
        roofline = _roofline(shape, weights, kv, kv_token, prompt_lens, output_lens, min_steps, copy_roof_gb_s,
                             matmul_tflops)
        seconds = roofline["seconds"]
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
        "formula": ("(weight_bytes_per_decode_step * min_decode_steps + kv_read_bytes) / copy roof" if roofline is None
                    else "roofline per phase: decode GEMMs + decode attention + prefill, each max(bytes / copy roof, "
                         "FLOPs / matmul peak)"),
        **({"roofline": roofline} if roofline is not None else {}),
    }


def _roofline(shape, weights: int, kv: int, kv_token: int, prompt_lens: Sequence[int], output_lens: Sequence[int],
              min_steps: int, copy_roof_gb_s: float, matmul_tflops: float) -> dict:
    if matmul_tflops <= 0:
        raise ValueError(f"matmul peak must be positive, got {matmul_tflops}")
    bw, peak = copy_roof_gb_s * 1e9, matmul_tflops * 1e12
    layer_params, head_params = matmul_params(shape)
    per_position = attention_flops_per_position(shape)
    decode_tokens = sum(max(n - 1, 0) for n in output_lens)
    positions = kv // kv_token if kv_token else 0
    prompt_tokens = sum(prompt_lens)
    terms = {
        "decode_gemm": {"bytes": weights * min_steps, "flops": 2 * (layer_params + head_params) * decode_tokens},
        "decode_attention": {"bytes": kv, "flops": per_position * positions},
        "prefill": {"bytes": weights + prompt_tokens * kv_token,
                    "flops": 2 * layer_params * prompt_tokens + 2 * head_params * len(prompt_lens)
                    + per_position * sum(p * (p + 1) // 2 for p in prompt_lens)},
    }
    for t in terms.values():
        t["memory_s"], t["compute_s"] = t["bytes"] / bw, t["flops"] / peak
        t["seconds"] = max(t["memory_s"], t["compute_s"])
        t["bound_by"] = "compute" if t["compute_s"] > t["memory_s"] else "memory"
    return {"matmul_peak_tflops": round(matmul_tflops, 1), "decode_tokens": decode_tokens,
            "attended_positions": positions, "terms": terms, "seconds": sum(t["seconds"] for t in terms.values())}


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


def category_bytes_flops(shape, weight_element_size: int, kv_element_size: int, batch: int, mean_context: float,
                         fused_qk_norm_rope: bool, decode_prologue: bool = False,
                         decode_layer: bool = False) -> dict[str, tuple[int, int]]:
    """Per category of a decode step of `batch` sequences at mean context `mean_context` (the step budget's,
    labkit.bench.step_budget): (bytes it must read and write at least, FLOPs it must do). Weights are read
    once, activations read and written once, each sequence reads the K/V of its whole context; the q/k norm
    is counted in ``qk_norm_rope`` when the fused kernel runs it, else in ``norm`` (and RoPE in ``rotary``).
    The fused kernel also writes the step's K/V into the cache, so its ``kv_store`` bytes are counted there
    (engine/layers/fused_kernels.py::qk_norm_rope; no separate store kernel runs). With the decode prologue
    (engine/levers.py::decode_prologue_mode) the attention kernel does that work, and ``attention`` holds
    those bytes too. With the decode layer (engine/layers/decode_layer.py: a batch-1 step's layer in one kernel)
    ``layer`` holds what its kernel does: the four projections, the attention with its prologue, the SiLU and the
    layers' norms (the model's final norm too, a row's read and write: it runs outside the layers)."""
    e, ekv, b, n = weight_element_size, kv_element_size, batch, shape.num_layers
    h, hd, inter, vocab = shape.hidden_size, shape.head_dim, shape.intermediate_size, shape.vocab_size
    q, kv = shape.num_heads * hd, shape.num_kv_heads * hd

    def gemm(k: int, m: int, layers: int = n) -> tuple[int, int]:     # [b, k] @ [k, m]
        return layers * (k * m + b * k + b * m) * e, layers * 2 * b * k * m

    qk_io = n * 2 * b * (q + kv) * e                  # read q and k, write them back
    norm = n * (2 * h * e + 8 * b * h * e) - 2 * b * h * e + (h * e + 4 * b * h * e)   # layer 0: no residual in
    if not fused_qk_norm_rope:
        norm += qk_io + n * 2 * hd * e
    context = b * mean_context
    out = {
        "gemm.qkv": gemm(h, q + 2 * kv), "gemm.o": gemm(q, h), "gemm.gate_up": gemm(h, 2 * inter),
        "gemm.down": gemm(inter, h), "gemm.lm_head": gemm(h, vocab, layers=1),
        "attention": (int(n * (context * 2 * kv * ekv + 2 * b * q * e)), int(n * 4 * context * q)),
        "kv_store": (n * b * 2 * kv * (e + ekv), 0),
        "norm": (norm, 0),
        "activation": (n * b * 3 * inter * e, 0),
        "embedding": (2 * b * h * e, 0),
        "sampler": (b * vocab * e, 0),
    }
    if fused_qk_norm_rope or decode_prologue:
        out["qk_norm_rope"] = (qk_io + n * 2 * hd * e + out.pop("kv_store")[0], 0)
        if decode_prologue:
            nbytes, flops = out["attention"]
            out["attention"] = (nbytes + out.pop("qk_norm_rope")[0], flops)
    else:
        out["rotary"] = (qk_io, 0)
    if decode_layer:
        parts = [out.pop(c) for c in ("gemm.qkv", "gemm.o", "gemm.gate_up", "gemm.down", "attention", "activation",
                                      "norm", "qk_norm_rope", "kv_store", "rotary") if c in out]
        out["layer"] = (sum(p[0] for p in parts), sum(p[1] for p in parts))
    return out


def category_bounds(shape, weight_element_size: int, kv_element_size: int, batch: int, mean_context: float,
                    fused_qk_norm_rope: bool, copy_roof_gb_s: float, matmul_tflops: float,
                    decode_prologue: bool = False, decode_layer: bool = False) -> dict[str, dict]:
    """Each category's bound: the larger of its bytes at the copy roof and its FLOPs at the matmul peak
    (both measured in the same run), and which of the two binds."""
    if copy_roof_gb_s <= 0 or matmul_tflops <= 0:
        raise ValueError(f"roofs must be positive, got {copy_roof_gb_s} GB/s, {matmul_tflops} TFLOP/s")
    out = {}
    for cat, (nbytes, flops) in category_bytes_flops(shape, weight_element_size, kv_element_size, batch,
                                                      mean_context, fused_qk_norm_rope, decode_prologue,
                                                      decode_layer).items():
        mem_ms = nbytes / (copy_roof_gb_s * 1e9) * 1e3
        flop_ms = flops / (matmul_tflops * 1e12) * 1e3
        out[cat] = {"bytes": nbytes, "flops": flops, "memory_ms": round(mem_ms, 5), "compute_ms": round(flop_ms, 5),
                    "bound_ms": round(max(mem_ms, flop_ms), 5), "bound_by": "compute" if flop_ms > mem_ms else "memory"}
    return out
