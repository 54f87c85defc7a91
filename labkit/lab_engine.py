"""The lab's engine session: model resolution, engine construction with the lab defaults, evidence identity."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from engine import LLMEngine
from engine.observe import EngineEvent
from labkit.errors import UserError

# The handbook's entry defaults: eager, TP=1, KV block 256, context 1024, prefill budget 512, util 0.5;
# the fused kernels on (they only run on CUDA; --no-fused-ops takes the plain path there).
LAB_DEFAULTS = dict(kvcache_block_size=256, max_model_len=1024, max_num_batched_tokens=512,
                    gpu_memory_utilization=0.5, enforce_eager=True, tensor_parallel_size=1, fused_ops=True)


def detect_device(device: str = "auto") -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device}: CUDA is not available on this machine")
    return device


@dataclass
class LabEngine:
    """An engine built for the lab, with the model identity and device its evidence names."""

    engine: LLMEngine
    model: dict          # identity for evidence
    device: str

    @property
    def kind(self) -> str:
        return "gpu-measured" if self.device.startswith("cuda") else "cpu-real-engine"

    def describe(self) -> dict:
        return self.engine.describe()


def build_engine(model: str | None = None, device: str = "auto", attention: str = "auto", **overrides) -> LabEngine:
    from labkit.assets.identity import model_identity
    from labkit.assets.resolve import resolve_model

    device = detect_device(device)
    ref = resolve_model(model, device)
    options = {**LAB_DEFAULTS, **{k: v for k, v in overrides.items() if v is not None}}
    engine = LLMEngine(str(ref.path), device=device, attention_backend=attention, **options)
    identity = dict(model_identity(ref.path))
    identity["source"] = ref.source
    return LabEngine(engine, identity, device)


def synthetic_note(model: dict) -> str | None:
    if model.get("synthetic"):
        return (f"synthetic model ({model.get('preset')}, {model.get('init') or 'random'} weights): "
                "generated text is meaningless")
    return None


def env_trace_printer(event: EngineEvent) -> None:
    """LABKIT_TRACE=1: one event=engine_step line per step, before the forward."""
    if event.name != "scheduled":
        return
    seqs = " ".join(f"seq={s['seq_id']}:{s['total']}/{s['cached']}/{s['scheduled']}" for s in event.data["seqs"])
    print(f"event=engine_step step={event.step} phase={event.phase} total/cached/scheduled {seqs}",
          file=sys.stderr, flush=True)


def install_env_trace(engine: LLMEngine) -> None:
    if os.environ.get("LABKIT_TRACE", "") not in ("", "0"):
        engine.events.subscribe(env_trace_printer)
