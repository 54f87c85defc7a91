from engine.llm_engine import LLMEngine
from engine.sampling.params import SamplingParams


class LLM(LLMEngine):
    """Offline entry point: LLM(model_dir).generate(prompts, SamplingParams(...))."""

    def chat(self, messages_list: list[list[dict]], sampling_params: SamplingParams | None = None,
             use_progress: bool = False) -> list[dict]:
        return self.generate(messages_list, sampling_params, use_progress=use_progress)
