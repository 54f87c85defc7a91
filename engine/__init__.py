"""nano-lab's embedded inference engine: paged KV with prefix cache, chunked prefill, Qwen3.

A request's path, in reading order: ``llm_engine.py`` (``LLMEngine.step``: schedule -> run -> postprocess;
admission in ``admission.py``; the overlapped step in ``overlap.py``; what a step returns in ``step_output.py``),
``scheduler.py`` and ``block_manager.py``, ``model_runner.py`` (its inputs ``step_inputs.py``, the model
``models/qwen3.py`` over ``layers/`` and ``attention/``, graphs ``graph.py``), ``sampling/``. Start-up:
``kv_pool.py`` (the pool's size), ``warmup.py``. Tensor parallel: ``distributed.py``, ``tp_workers.py``. Its
options: ``args.py`` (``EngineArgs``, each option and default once), read by ``config.py`` (``Config``: the options
plus what the model directory says). Watching it: ``observe.py`` (hooks, events),
``device_clock.py`` (each step on the GPU), ``probe.py`` (``LLMEngine.probe``: ref counts, the pool, the model's
modules, read by the lab).
"""
import importlib
import os

# Triton fuses a * b + c into one FMA in our kernels: its default through 3.9, and the setting every figure and
# test here ran under; Triton 3.10 turns the default off, which would change the kernels' float results. A
# value set outside the engine wins.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

#: What ``from engine import X`` gives, and the module each comes from. They are imported on first use, so that
#: reading the options (``engine.args``: a command line's flags) does not import torch and the model code.
_EXPORTS = {
    "LLM": "engine.llm", "LLMEngine": "engine.llm_engine", "EngineArgs": "engine.args",
    "SamplingParams": "engine.sampling.params", "MAX_LOGIT_BIAS": "engine.sampling.params",
    "MAX_LOGPROBS": "engine.sampling.params",
    "StructuredOutputsParams": "engine.sampling.structured", "Config": "engine.config",
    "ConfigError": "engine.errors", "RequestError": "engine.errors",
    # The scheduler and its paged block manager also run on their own, built from plain limits, with no model
    # (the lab's cpu-real-scheduler experiments); a running LLMEngine keeps its own instances private.
    "Scheduler": "engine.scheduler", "BlockManager": "engine.block_manager", "SchedulerLimits": "engine.config",
    "chain_hash": "engine.block_manager",        # the prefix cache's block hash
    # the runner's route rule (ModelRunner.route_for) is called by the lab on given graph buckets, on a CPU
    "ModelRunner": "engine.model_runner",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
