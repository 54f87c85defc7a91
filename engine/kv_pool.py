"""The paged KV pool: how many blocks fit, and the one tensor that holds them.

vLLM's split (the worker measures the memory left, the runner allocates the cache): on CUDA the budget is
what ``gpu_memory_utilization`` of the GPU leaves after the weights and the peak work memory of one prefill
at the step's token budget (``engine/warmup.py: profile_run``, run before the pool exists); on CPU it is
``cpu_kv_cache_bytes``; a fixed ``num_kvcache_blocks`` overrides both. ``ModelRunner.allocate_kv_cache``
takes these steps in order, keeps every tensor-parallel rank at the same block count (the smallest any
rank can hold) and resolves ``max_model_len="auto"`` to the pool it got (``Config.fit_to_pool``).
"""
from __future__ import annotations

import torch

from engine.attention import kv_quant
from engine.config import Config


def bytes_per_block(config: Config, dtype: torch.dtype, tp_size: int = 1) -> int:
    """K and V of one block of tokens over every layer, on one rank, in the cache's dtype (``dtype``, the
    model's, unless ``kv_cache_dtype`` is fp8: one byte a value)."""
    elem = torch.tensor([], dtype=kv_quant.cache_dtype(config.kv_cache_dtype, dtype)).element_size()
    return config.kvcache_block_size * config.shape.kv_bytes_per_token(elem, tp_size)


def cpu_blocks(config: Config, block_bytes: int) -> tuple[int, dict]:
    """Blocks in the CPU byte budget, at most enough for max_num_seqs sequences of max_model_len (+1)."""
    blocks_per_seq = (config.max_model_len + config.kvcache_block_size - 1) // config.kvcache_block_size
    budget = config.cpu_kv_cache_bytes
    cap = config.max_num_seqs * blocks_per_seq + 1
    return max(1, min(budget // block_bytes, cap)), {"kv_budget_bytes": budget, "source": "cpu_kv_cache_bytes"}


def gpu_blocks(config: Config, block_bytes: int, model: torch.nn.Module) -> tuple[int, dict]:
    """Blocks in what the GPU has left, read after the profile run: gpu_memory_utilization of the total,
    less what is in use, less the peak work memory the run needed beyond what it still holds."""
    free, total = torch.cuda.mem_get_info()
    used = total - free
    peak = torch.cuda.max_memory_allocated()
    current = torch.cuda.memory_allocated()
    budget = int(total * config.gpu_memory_utilization - used - peak + current)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    memory = {"total_bytes": total, "weights_bytes": weights, "peak_work_bytes": peak - current,
              "used_before_kv_bytes": used, "kv_budget_bytes": budget,
              "gpu_memory_utilization": config.gpu_memory_utilization}
    return budget // block_bytes, memory


def allocate(layers: list, num_blocks: int, config: Config, dtype: torch.dtype, device: str,
             tp_size: int = 1, v_t: bool = False) -> torch.Tensor:
    """The pool [2, layers, blocks, block_size, kv heads on this rank, head dim] in the cache's dtype (the
    model's ``dtype``, or e4m3 for ``kv_cache_dtype`` fp8); each attention layer gets its views of it (k_cache,
    v_cache). FP8 views carry their scale (engine/attention/kv_quant.py: fixed, DEFAULT_SCALE), and with ``v_t``
    the V views their other layout (each block's head positions contiguous: LAB_FP8_V_T)."""
    shape = config.shape
    cache_dtype = kv_quant.cache_dtype(config.kv_cache_dtype, dtype)
    kv_cache = torch.zeros(2, len(layers), num_blocks, config.kvcache_block_size, shape.num_kv_heads // tp_size,
                           shape.head_dim, dtype=cache_dtype, device=device)
    for i, layer in enumerate(layers):
        layer.k_cache = kv_cache[0, i]
        layer.v_cache = kv_cache[1, i]
        if cache_dtype == kv_quant.FP8:
            kv_quant.mark(layer.k_cache, kv_quant.DEFAULT_SCALE, dtype)
            kv_quant.mark(layer.v_cache, kv_quant.DEFAULT_SCALE, dtype, v_t=v_t)
    return kv_cache
