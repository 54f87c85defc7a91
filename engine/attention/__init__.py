"""Attention backends behind one interface (backend.py), chosen once at engine start.

The registry lists them in order of preference; each says what it needs (packages, CUDA, a KV block
size it can page). ``auto`` takes the first one the machine and the block size support.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.errors import ConfigError


@dataclass(frozen=True)
class BackendSpec:
    name: str
    module: str                 # engine.attention.<module> holds the class
    cls: str
    packages: tuple[str, ...]   # must be importable
    cuda_only: bool
    block_multiple: int = 1     # the KV block size must be a multiple of this

    def unsupported(self, device: str, block_size: int | None = None) -> str | None:
        """Why this backend cannot run here (None: it can)."""
        if self.cuda_only and not device.startswith("cuda"):
            return "needs CUDA"
        missing = [p for p in self.packages if not _importable(p)]
        if missing:
            return f"needs {', '.join(missing)}"
        if block_size is not None and block_size % self.block_multiple:
            return f"needs a KV block size that is a multiple of {self.block_multiple}, got {block_size}"
        return None


REGISTRY = (
    BackendSpec("flash_attn", "flash_backend", "FlashAttention", ("flash_attn",), True, 256),
    BackendSpec("triton", "triton_backend", "TritonAttention", ("triton",), True),
    BackendSpec("torch", "torch_backend", "TorchAttention", (), False),
)
_BY_NAME = {s.name: s for s in REGISTRY}


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def available_backends(device: str, block_size: int | None = None) -> list[str]:
    """Backends that can run on this device (and page this block size), most preferred first."""
    return [s.name for s in REGISTRY if s.unsupported(device, block_size) is None]


def resolve_backend_name(requested: str, device: str, block_size: int | None = None) -> str:
    if requested == "auto":
        return available_backends(device, block_size)[0]
    spec = _BY_NAME.get(requested)
    if spec is None:
        raise ConfigError(f"unknown attention backend {requested!r} (known: {', '.join(_BY_NAME)})")
    why = spec.unsupported(device, block_size)
    if why:
        raise ConfigError(f"attention backend {requested!r} is not available on {device}: {why}")
    return requested


def create_backend(name: str, block_size: int) -> AttentionBackend:
    spec = _BY_NAME.get(name)
    if spec is None:
        raise ConfigError(f"unknown attention backend {name!r} (known: {', '.join(_BY_NAME)})")
    if block_size % spec.block_multiple:
        raise ConfigError(f"{name} needs a KV block size that is a multiple of {spec.block_multiple}, got {block_size}")
    return getattr(importlib.import_module(f"engine.attention.{spec.module}"), spec.cls)()


__all__ = ["AttentionBackend", "AttentionMetadata", "BackendSpec", "REGISTRY", "available_backends",
           "resolve_backend_name", "create_backend"]
