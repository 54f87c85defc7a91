"""nano-lab's embedded inference engine: paged KV with prefix cache, chunked prefill, Qwen3."""
from engine.config import Config, ConfigError
from engine.llm import LLM
from engine.errors import RequestError
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "Config", "ConfigError", "RequestError"]
