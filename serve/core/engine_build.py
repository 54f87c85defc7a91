"""How a worker builds its engine. A worker's ``build`` names a function ``"module:name"`` that takes the
engine's ``EngineArgs`` and returns a record with ``engine``, ``model`` (the model's identity), ``device``,
``kind`` and ``describe()`` (:class:`BuiltEngine`'s shape). A name, not a function, so that it crosses to the engine
process as it is. The lab names its own (it resolves presets and hub ids and records the
model's identity); without a name, ``$SERVE_ENGINE_BUILDER``, else :func:`build_engine` here, which takes a model
directory."""
from __future__ import annotations

import dataclasses
import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine import EngineArgs, LLMEngine
from serve.errors import ServeError

BUILDER_ENV = "SERVE_ENGINE_BUILDER"


@dataclass
class BuiltEngine:
    """An engine with the model identity and device a worker's record names."""

    engine: LLMEngine
    model: dict
    device: str

    @property
    def kind(self) -> str:
        return "gpu-measured" if self.device.startswith("cuda") else "cpu-real-engine"

    def describe(self) -> dict:
        return self.engine.describe()


def build_engine(args: EngineArgs) -> BuiltEngine:
    """The engine for ``args``, whose model is a model directory; ``device="auto"``: CUDA when present."""
    import torch

    model = Path(args.model) if args.model else None
    if model is None or not model.is_dir():
        raise ServeError(f"--model {args.model}: not a model directory")
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device.startswith("cuda") and not torch.cuda.is_available():
        raise ServeError(f"--device {device}: CUDA is not available on this machine")
    engine = LLMEngine(dataclasses.replace(args, model=str(model), device=device))
    return BuiltEngine(engine, {"name": model.name, "path": str(model.resolve())}, device)


def builder(name: str | None) -> Callable[[EngineArgs], BuiltEngine]:
    """The function ``name`` (``"module:function"``) names; None or "": ``$SERVE_ENGINE_BUILDER``, else
    :func:`build_engine`."""
    name = name or os.environ.get(BUILDER_ENV, "")
    if not name:
        return build_engine
    module, _, attr = name.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError):
        raise ServeError(f"engine builder {name!r}: no such function (give module:function)") from None
