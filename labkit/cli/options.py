"""Typer option types shared by the command modules (setup, model, guardrails, service).

Engine options are declared once, here, under vLLM's names (``--max-num-seqs``,
``--max-num-batched-tokens``, ``--enforce-eager/--graph``, ``--tensor-parallel-size``, ...); each
command that takes one reuses it with its own default.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

OutOpt = Annotated[
    Optional[Path],
    typer.Option("--out", "-o", dir_okay=False, help="Evidence file to write (default: the checkpoint's file under runs/)."),
]
ModelOpt = Annotated[
    Optional[Path],
    typer.Option("--model", help="Model directory (Hugging Face layout) or a hub id ORG/NAME (from the local HF cache); default $MODEL_DIR, else a synthetic model."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout instead of tables.")]

# engine options, under the engine's (and vLLM's) names
DeviceOpt = Annotated[str, typer.Option("--device", help="auto | cpu | cuda[:N].")]
AttentionOpt = Annotated[str, typer.Option("--attention", help="Attention backend: auto | flash_attn | triton | torch.")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="auto (bfloat16 on CUDA, float32 on CPU) | bfloat16 | float16 | float32.")]
KvCacheDtypeOpt = Annotated[str, typer.Option("--kv-cache-dtype", help="KV cache dtype: auto (the model's dtype) | fp8 (e4m3 K/V with per-layer scales: half the bytes of bf16; triton and torch attention).")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Random seed (what it seeds: see the command's description).")]
MaxNumSeqsOpt = Annotated[Optional[int], typer.Option("--max-num-seqs", min=1, help="Sequences in one step at most.")]
MaxNumBatchedTokensOpt = Annotated[int, typer.Option("--max-num-batched-tokens", min=1, help="Token budget of one step (the prefill budget).")]
MaxModelLenOpt = Annotated[int, typer.Option("--max-model-len", help="Context length (prompt + output) at most.")]
GpuMemoryUtilizationOpt = Annotated[float, typer.Option("--gpu-memory-utilization", min=0.0, max=1.0, help="Fraction of GPU memory the engine may use (weights, work memory, KV cache).")]
EnforceEagerOpt = Annotated[bool, typer.Option("--enforce-eager/--graph", help="Eager execution, or CUDA graphs for decode and small fresh prefills (CUDA only).")]
EnablePrefixCachingOpt = Annotated[bool, typer.Option("--enable-prefix-caching/--no-enable-prefix-caching", help="Reuse the KV blocks of a prompt's cached full-block prefix (vLLM's switch); off: every prompt is computed in full.")]
MixedBatchesOpt = Annotated[Optional[bool], typer.Option("--mixed-batches/--no-mixed-batches", show_default=False, help="Mixed steps: the running decodes and prefill chunks share one step under the token budget (vLLM's step); off: nano-vllm's step model, each step all-prefill or all-decode. Default: the engine's (EngineArgs.mixed_batches).")]
FusedOpsOpt = Annotated[bool, typer.Option("--fused-ops/--no-fused-ops", help="CUDA: the fused Triton RMSNorm, q/k-norm + RoPE (which also writes K/V into the cache) and SiLU-mul kernels, or the plain path where the attention backend's store_kv writes K/V. CPU always runs the plain path.")]
TensorParallelSizeOpt = Annotated[int, typer.Option("--tensor-parallel-size", "--tp", min=1, help="Tensor-parallel ranks of the engine.")]
KvCacheBlockSizeOpt = Annotated[int, typer.Option("--kv-cache-block-size", min=1, help="KV block size in tokens (a power of two).")]
SchedulingPolicyOpt = Annotated[str, typer.Option("--scheduling-policy", help="prefill_first | balanced.")]
MaxConsecutivePrefillOpt = Annotated[Optional[int], typer.Option("--max-consecutive-prefill", min=1, show_default=False, help="At most N prefill steps in a row while requests wait to decode (default: the policy's own: balanced 1, prefill_first no limit).")]
