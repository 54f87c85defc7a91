"""Admission: a request's prompt as token ids, and the one rule it must pass before it is queued
(vLLM's input processor). Offline (``LLMEngine.add_request`` / ``generate``) and online (labkit serve,
also in a front end whose engine runs in another process) check the same rule; every refusal is a
:class:`RequestError` with a code."""
from __future__ import annotations

from engine.config import Config
from engine.errors import RequestError
from engine.sampling.params import SamplingParams


def encode(tokenizer, prompt, *, add_generation_prompt: bool = True, continue_final_message: bool = False,
           add_special_tokens: bool | None = None) -> list[int]:
    """Text as is, chat messages through the chat template, or token ids. ``continue_final_message`` (with
    ``add_generation_prompt=False``): the last message is left open for the model to continue (assistant
    prefill, transformers' and vLLM's meaning). ``add_special_tokens``: passed to the tokenizer (None: its
    default)."""
    special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, **special)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, enable_thinking=False)
        return tokenizer.encode(text, **special)
    return list(prompt)


def check_request(cfg: Config, num_blocks: int, token_ids: list[int],
                  sampling_params: SamplingParams | None = None) -> None:
    """A non-empty prompt of vocabulary ids that leaves room for max_tokens outputs within max_model_len
    and fits in a KV pool of num_blocks; token ids inside the sampling parameters in the vocabulary."""
    if not token_ids:
        raise RequestError("the prompt is empty", "empty_prompt")
    vocab = cfg.vocab_size
    # plain ints in range: checked at C speed (a per-id Python test took 130 ms for nano-vllm's 143k
    # prompt ids); anything else is looked at id by id
    if not set(map(type, token_ids)) <= {int} or min(token_ids) < 0 or max(token_ids) >= vocab:
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token id {bad[0]!r} is outside the vocabulary [0, {vocab})",
                               "token_out_of_vocabulary")
    if len(token_ids) >= cfg.max_model_len:
        raise RequestError(f"prompt has {len(token_ids)} tokens; max_model_len is {cfg.max_model_len} "
                           f"(the prompt must leave room for at least one output token)",
                           "context_length_exceeded")
    if sampling_params is not None and len(token_ids) + sampling_params.max_tokens > cfg.max_model_len:
        raise RequestError(f"prompt ({len(token_ids)} tokens) + max_tokens ({sampling_params.max_tokens}) "
                           f"exceeds max_model_len ({cfg.max_model_len})", "context_length_exceeded")
    if sampling_params is not None:
        check_params(cfg, sampling_params)
    blocks = (len(token_ids) + 1 + cfg.kvcache_block_size - 1) // cfg.kvcache_block_size
    if blocks > num_blocks:
        raise RequestError(f"prompt needs {blocks} KV blocks but the pool has {num_blocks}",
                           "pool_too_small")


def check_params(cfg: Config, sp: SamplingParams) -> None:
    """Token ids inside sampling parameters must be in the vocabulary; prompt log-probs need one rank."""
    vocab = cfg.vocab_size
    for name, ids in (("logit_bias", list(sp.logit_bias or ())), ("stop_token_ids", sp.stop_token_ids),
                      ("allowed_token_ids", sp.allowed_token_ids or ())):
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab})",
                               f"invalid_{name}")
    if sp.prompt_logprobs is not None and cfg.tensor_parallel_size > 1:
        raise RequestError("prompt_logprobs needs tensor_parallel_size 1 (the prompt's logits are computed "
                           "on rank 0 only)", "invalid_prompt_logprobs")
