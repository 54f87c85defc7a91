"""The lab's engine session: an engine ``EngineArgs`` from given options (:func:`lab_args`), model
resolution and engine construction (:func:`build_engine`), evidence identity, a timed ``generate``
(:func:`timed_generate`, used by the benches and the rate sweep) and releasing an engine (:func:`release_engine`)."""
from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass

from engine import EngineArgs, LLMEngine
from engine.args import OPTION_NAMES
from engine.observe import EngineEvent
from labkit.errors import UserError
from serve.core.engine_build import BuiltEngine

def lab_args(device: str = "auto", **given) -> EngineArgs:
    """The engine's arguments: the engine's defaults (engine/args.py, the handbook's entry settings: eager,
    TP 1, KV block 256, context 1024, prefill budget 512, util 0.5, the fused kernels on where they run), then
    each option ``given`` (engine names; one given as None keeps the engine's default)."""
    unknown = sorted(set(given) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(f"lab_args got unknown option(s) {', '.join(unknown)}")
    return EngineArgs(**{"device": device, **{k: v for k, v in given.items() if v is not None}})


#: The ``build`` of every server and worker the lab starts: :func:`build_engine` (model presets and hub
#: ids resolved, the model's identity recorded for evidence).
LAB_BUILDER = "labkit.lab_engine:build_engine"


def detect_device(device: str = "auto") -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device}: CUDA is not available on this machine")
    return device


class LabEngine(BuiltEngine):
    """An engine built for the lab, with the model identity (for evidence) and device: the record a server's
    worker is given by its builder (``serve.core.engine_build.BuiltEngine``), so :func:`build_engine` is one."""


def build_engine(args: EngineArgs | str | None = None, device: str = "auto", attention: str = "auto",
                 **overrides) -> LabEngine:
    """The engine for ``args`` (an :class:`EngineArgs`) with its model resolved (None: the lab's default
    model; a hub id or a preset: its directory) and its device detected. The shorthand
    ``build_engine(model, device, attention, **overrides)`` builds the args with :func:`lab_args`."""
    from labkit.assets.identity import model_identity
    from labkit.assets.resolve import resolve_model

    if not isinstance(args, EngineArgs):
        args = lab_args(device, model=args, attention_backend=attention, **overrides)
    elif overrides:
        raise TypeError("build_engine(args) takes no other options (use dataclasses.replace on the args)")
    device = detect_device(args.device)
    ref = resolve_model(args.model, device)
    engine = LLMEngine(dataclasses.replace(args, model=str(ref.path), device=device))
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


# --------------------------------------------------------------------------- timing and releasing an engine


def sync_device() -> None:
    """Wait for the GPU's queued work (a no-op without CUDA): timings end here."""
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def release_engine(engine: LLMEngine | None) -> None:
    """Close ``engine`` and give its GPU memory back before the next one is built."""
    import torch
    if engine is not None:
        engine.close()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass
class Timed:
    seconds: float
    output_tokens: int
    steps: list[tuple[bool, int, float]] | None = None     # (is_prefill, batch, seconds) per step
    output_lens: list[int] | None = None                   # tokens each request generated, in prompt order

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    def record(self) -> dict:
        out = {"seconds": round(self.seconds, 4), "output_tokens": self.output_tokens, "tok_s": round(self.tok_s, 1)}
        if self.steps:
            prefill = [s for p, _, s in self.steps if p]
            decode = [s for p, _, s in self.steps if not p]
            slowest = sorted(self.steps, key=lambda r: r[2], reverse=True)[:5]
            out |= {"prefill_steps": len(prefill), "prefill_seconds": round(sum(prefill), 4),
                    "decode_steps": len(decode), "decode_seconds": round(sum(decode), 4),
                    "decode_ms_median": round(statistics.median(decode) * 1e3, 3) if decode else None,
                    "slowest_steps": [{"phase": "prefill" if p else "decode", "batch": b, "ms": round(t * 1e3, 2)}
                                      for p, b, t in slowest]}
        return out


def timed_generate(engine: LLMEngine, prompts, params, steps: bool = False, also=None) -> Timed:
    """engine.generate, timed; with steps, each step's time too; ``also(out)`` sees every StepOutput."""
    record: list[tuple[bool, int, float]] = []
    on_step = (lambda out: record.append((out.is_prefill, len(out.seqs), out.seconds))) if steps else None
    if also is not None:
        on_step = (lambda out: (record.append((out.is_prefill, len(out.seqs), out.seconds)), also(out))) if steps \
            else also
    sync_device()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, on_step=on_step)
    sync_device()
    lens = [len(o["token_ids"]) for o in outs]
    return Timed(time.perf_counter() - t0, sum(lens), record if steps else None, lens)
