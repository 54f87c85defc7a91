"""Attention backends behind one interface (backend.py), chosen once at engine start.

The registry lists them in order of preference; each says what it needs (packages, CUDA, a KV block
size it can page, and for flash_attn what the installed build runs: dtypes, head dims, no FP8 KV cache,
engine/attention/flash_support.py). ``auto`` takes the first one the machine, the block size and the model
support.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.errors import ConfigError


@dataclass(frozen=True)
class ModelNeeds:
    """What a model asks of its attention backend: its activations' dtype (torch's name), the head dim and the KV
    cache's dtype (auto | fp8). A field left None is not checked. (Not the options' names: these are what the
    options resolved to for one model on one device, Config.attention_needs.)"""
    activations: str | None = None
    head_dim: int | None = None
    cache: str = "auto"


@dataclass(frozen=True)
class BackendSpec:
    name: str
    module: str                 # engine.attention.<module> holds the class
    cls: str
    packages: tuple[str, ...]   # must be importable
    cuda_only: bool
    block_multiple: int = 1     # the KV block size must be a multiple of this
    flash: bool = False         # what it runs is the installed flash-attn build's (flash_support.py)

    def unsupported(self, device: str, block_size: int | None = None, needs: ModelNeeds | None = None) -> str | None:
        """Why this backend cannot run here (None: it can)."""
        if self.cuda_only and not device.startswith("cuda"):
            return "needs CUDA"
        missing = [p for p in self.packages if not _importable(p)]
        if missing:
            return f"needs {', '.join(missing)}"
        if block_size is not None and block_size % self.block_multiple:
            return f"needs a KV block size that is a multiple of {self.block_multiple}, got {block_size}"
        if self.flash:
            return _flash_unsupported(needs)
        return None


def _flash_unsupported(needs: ModelNeeds | None) -> str | None:
    """flash-attn refuses what its build has no kernels for, and a build that does not import (one line)."""
    from engine.attention import flash_support

    if needs is not None:
        why = flash_support.unsupported_model(needs.activations, needs.head_dim, needs.cache)
        if why:
            return why
    try:
        importlib.import_module("flash_attn")
    except Exception as e:          # noqa: BLE001 (a build for another torch or CUDA raises anything)
        return f"flash_attn does not import: {' '.join(f'{type(e).__name__}: {e}'.split())[:200]}"
    return None


REGISTRY = (
    BackendSpec("flash_attn", "flash_backend", "FlashAttention", ("flash_attn",), True, 256, flash=True),
    BackendSpec("triton", "triton_backend", "TritonAttention", ("triton",), True),
    BackendSpec("torch", "torch_backend", "TorchAttention", (), False),
)
_BY_NAME = {s.name: s for s in REGISTRY}


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def available_backends(device: str, block_size: int | None = None, needs: ModelNeeds | None = None) -> list[str]:
    """Backends that can run on this device (and page this block size, and run a model with these needs),
    most preferred first."""
    return [s.name for s in REGISTRY if s.unsupported(device, block_size, needs) is None]


def resolve_backend_name(requested: str, device: str, block_size: int | None = None,
                         needs: ModelNeeds | None = None) -> str:
    """``auto``: the first backend that can run here (flash_attn where its build runs the model, else triton on
    CUDA, else torch); a named one, or one line saying why it cannot."""
    if requested == "auto":
        return available_backends(device, block_size, needs)[0]
    spec = _BY_NAME.get(requested)
    if spec is None:
        raise ConfigError(f"unknown attention backend {requested!r} (known: {', '.join(_BY_NAME)})")
    why = spec.unsupported(device, block_size, needs)
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


__all__ = ["AttentionBackend", "AttentionMetadata", "BackendSpec", "ModelNeeds", "REGISTRY", "available_backends",
           "resolve_backend_name", "create_backend"]
