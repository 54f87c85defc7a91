"""Attention backends, chosen once at engine start."""
from __future__ import annotations

import importlib.util

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttention


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def available_backends(device: str) -> list[str]:
    names = ["torch"]
    if device.startswith("cuda"):
        if _importable("triton") and _importable("engine.attention.triton_backend"):
            names.insert(0, "triton")
        if _importable("flash_attn") and _importable("engine.attention.flash_backend"):
            names.insert(0, "flash_attn")
    return names


def resolve_backend_name(requested: str, device: str) -> str:
    available = available_backends(device)
    if requested == "auto":
        return available[0]
    if requested not in available:
        raise ValueError(f"attention backend {requested!r} is not available on {device} (available: {', '.join(available)})")
    return requested


def create_backend(name: str, block_size: int) -> AttentionBackend:
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        from engine.attention.triton_backend import TritonAttention
        return TritonAttention()
    if name == "flash_attn":
        from engine.attention.flash_backend import FlashAttention
        if block_size % 256:
            raise ValueError(f"flash_attn needs a KV block size that is a multiple of 256, got {block_size}")
        return FlashAttention()
    raise ValueError(f"unknown attention backend {name!r}")


__all__ = ["AttentionBackend", "AttentionMetadata", "available_backends", "resolve_backend_name", "create_backend"]
