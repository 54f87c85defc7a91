"""nano-lab's embedded inference engine: paged KV with prefix cache, chunked prefill, Qwen3.

A request's path, in reading order: ``llm_engine.py`` (``LLMEngine.step``: schedule -> run -> postprocess;
admission in ``admission.py``), ``scheduler.py`` and ``block_manager.py``, ``model_runner.py`` (its inputs
``step_inputs.py``, the model ``models/qwen3.py`` over ``layers/`` and ``attention/``, graphs ``graph.py``),
``sampling/``. Start-up: ``kv_pool.py`` (the pool's size), ``warmup.py``. Tensor parallel: ``distributed.py``,
``tp_workers.py``. Its options: ``args.py`` (``EngineArgs``, each option and default once), read by ``config.py``
(``Config``: the options plus what the model directory says). Watching it: ``observe.py`` (hooks, events), ``device_clock.py`` (each step on the GPU).
"""
from engine.args import EngineArgs
from engine.config import Config, ConfigError
from engine.llm import LLM
from engine.errors import RequestError
from engine.llm_engine import LLMEngine
from engine.sampling.params import MAX_LOGIT_BIAS, SamplingParams
from engine.sampling.structured import StructuredOutputsParams

# The scheduler and its paged block manager also run on their own, built from plain limits, with no model
# (the lab's cpu-real-scheduler experiments); a running LLMEngine keeps its own instances private.
from engine.block_manager import BlockManager, chain_hash  # noqa: E402  (chain_hash: the prefix cache's block hash)
from engine.config import SchedulerLimits  # noqa: E402
from engine.scheduler import Scheduler  # noqa: E402
# the runner's route rule (ModelRunner.route_for) is called by the lab on given graph buckets, on a CPU
from engine.model_runner import ModelRunner  # noqa: E402

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "StructuredOutputsParams", "Config", "ConfigError", "RequestError",
           "Scheduler", "BlockManager", "SchedulerLimits", "chain_hash", "MAX_LOGIT_BIAS", "ModelRunner"]
