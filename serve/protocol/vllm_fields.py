"""vLLM's request fields beyond OpenAI's: the ones this server implements (:class:`VllmFields`, resolved into
:class:`VllmOptions`), and every other one of vLLM's ``ChatCompletionRequest`` / ``CompletionRequest`` fields in
:data:`REFUSED` (a 400 naming it unless its value changes nothing), so that no vLLM field is accepted and
silently ignored.

Implemented (docs/OPENAI.md, "vLLM fields"):

- ``return_token_ids``: ``prompt_token_ids`` (chat: on the response, and on a stream's first chunk; completions:
  on each choice) and ``token_ids`` on each choice (streams: the chunk's own tokens), as vLLM.
- ``stream_options.continuous_usage_stats`` (with ``include_usage``): ``usage`` so far on every chunk.
- ``prompt_logprobs``: vLLM's shape, a list with ``null`` first, then per prompt position a dict token id ->
  ``{logprob, rank, decoded_token}`` (the prompt's token and the top alternatives); not with ``stream`` (vLLM
  refuses it there too).
- chat ``add_generation_prompt`` / ``continue_final_message`` (assistant prefill: the last message continued;
  both true is a 400 as in vLLM) and chat ``echo`` (the last message's content before the output when it has the
  answer's role, as vLLM).
- ``add_special_tokens``, ``truncate_prompt_tokens`` (keep the last k prompt tokens; -1: max_model_len, vLLM's
  meaning; at most max_model_len) with ``truncation_side`` (``left`` default, ``right`` keeps the first k),
  ``return_tokens_as_token_ids`` (``token_id:N`` strings in log-probs). ``allowed_token_ids`` is a sampling
  parameter (:mod:`serve.protocol.sampling`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional

from pydantic import Field, model_validator

from serve.protocol.sampling import StrictBody, bad


@dataclass
class VllmOptions:
    """The vLLM-only options of one request (defaults: vLLM's)."""
    return_token_ids: bool = False
    continuous_usage_stats: bool = False
    prompt_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None      # None: the route's default (the tokenizer's / the template's)
    truncate_prompt_tokens: int | None = None    # resolved: a count of tokens to keep, or None
    truncation_side: str = "left"
    return_tokens_as_token_ids: bool = False

    def prompt_options(self, chat: bool) -> dict:
        """What the worker's encoding takes (WorkerFront.submit's prompt_options); {} when all are defaults."""
        out: dict[str, Any] = {}
        if chat and not self.add_generation_prompt:
            out["add_generation_prompt"] = False
        if chat and self.continue_final_message:
            out["continue_final_message"] = True
        if self.add_special_tokens is not None:
            out["add_special_tokens"] = self.add_special_tokens
        if self.truncate_prompt_tokens is not None:
            out["truncate_prompt_tokens"] = self.truncate_prompt_tokens
            out["truncation_side"] = self.truncation_side
        return out


NonNegative = Annotated[int, Field(ge=0)]

#: vLLM request fields this server does not implement: name -> (no-op values, the field's type, why).
#: Same rule as protocol.NOOP_PARAMS (which covers OpenAI's): absent, null or a no-op value passes; else 400.
REFUSED: dict[str, tuple[tuple, Any, str]] = {
    "prompt_embeds": ((), Any, "prompts are text or token ids"),
    "cache_salt": ((), str, "one prefix cache for every request of this server"),
    "kv_transfer_params": (({},), dict, "no disaggregated prefill"),
    "ec_transfer_params": (({},), dict, "no disaggregated encoder cache"),
    "vllm_xargs": (({},), dict, "no custom extensions"),
    "mm_processor_kwargs": (({},), dict, "text only"),
    "media_io_kwargs": (({},), dict, "text only"),
    "logits_processors": (([],), list, "no custom logits processors"),
    "logprob_token_ids": ((), list, "log-probs of the top alternatives only"),
    "min_characters": ((0,), NonNegative, "no minimum output length in characters"),
    "thinking_token_budget": ((-1,), Annotated[int, Field(ge=-1)], "no thinking budget"),
    "repetition_detection": ((), Any, "no repetition detection"),
    "watermarking": ((False,), bool, "no watermarking"),
    "stream_interval": ((1,), Annotated[int, Field(ge=1)], "one chunk per token"),
    "return_prompt_text": ((False,), bool, "the rendered prompt is not returned"),
    "return_token_offsets": ((False,), bool, "vLLM's render endpoints only"),
    "return_mm_kwargs": ((True,), bool, "vLLM's render endpoints only"),
    "routed_experts_prompt_start": ((0,), NonNegative, "no expert routing data"),
    "priority": ((0,), int, "no priority scheduling (vLLM refuses it too without --scheduling-policy priority)"),
    "include_reasoning": ((True,), bool, "the reasoning parser's output is always returned (reasoning_content)"),
}

#: vLLM fields with no server-side meaning here, accepted and ignored (as OpenAI's user, metadata ...).
IGNORED = ("session_id",)


class StreamOptions(StrictBody):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class VllmFields(StrictBody):
    """vLLM's fields of a completions or chat request that this server implements (the refused ones: REFUSED)."""
    return_token_ids: bool = False
    prompt_logprobs: Optional[int] = None       # its range: SamplingParams.prompt_logprobs' (vLLM's -1 is refused)
    add_special_tokens: Optional[bool] = None
    truncate_prompt_tokens: Optional[int] = None   # -1: max_model_len; its range: the route's (options())
    truncation_side: Literal["left", "right"] = "left"
    return_tokens_as_token_ids: bool = False
    stream: bool = False
    stream_options: Optional[StreamOptions] = None

    @model_validator(mode="after")
    def _stream_rules(self):
        if self.stream_options is not None and not self.stream:
            raise bad("stream_options is only allowed with stream=true", "stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise bad("prompt_logprobs are not available with stream=true (as vLLM)", "prompt_logprobs")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def options(self, max_model_len: int, add_generation_prompt: bool = True,
                continue_final_message: bool = False) -> VllmOptions:
        """The resolved options (truncate_prompt_tokens: a count of tokens to keep)."""
        k = self.truncate_prompt_tokens
        k = max_model_len if k == -1 else k
        if k is not None and not 1 <= k <= max_model_len:
            raise bad(f"truncate_prompt_tokens must be -1 (max_model_len) or in [1, max_model_len={max_model_len}], "
                      f"got {k}", "truncate_prompt_tokens")
        so = self.stream_options
        # vLLM's rule: usage on every chunk only where include_usage is on too; alone it asks for nothing
        continuous = so is not None and so.continuous_usage_stats and so.include_usage
        return VllmOptions(return_token_ids=self.return_token_ids, continuous_usage_stats=continuous,
                           prompt_logprobs=self.prompt_logprobs, add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, add_special_tokens=self.add_special_tokens,
                           truncate_prompt_tokens=k, truncation_side=self.truncation_side,
                           return_tokens_as_token_ids=self.return_tokens_as_token_ids)


def chat_echo(messages: list[dict], add_generation_prompt: bool) -> str:
    """vLLM's chat echo: the last message's content when it has the answer's role (the assistant's with a
    generation prompt, else the last message's own), otherwise nothing."""
    role = "assistant" if add_generation_prompt else messages[-1]["role"]
    return messages[-1]["content"] if messages[-1]["role"] == role else ""


def prompt_logprobs_json(entries: list | None, decode) -> list | None:
    """The worker's prompt log-probs (``[None, [id, lp, rank, [[id, lp], ...]], ...]``) in vLLM's shape:
    ``[null, {"id": {"logprob", "rank", "decoded_token"}}, ...]`` (the prompt's token, then the alternatives
    ranked 1..k)."""
    if entries is None:
        return None
    out: list = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        tid, lp, rank, top = e
        d = {str(tid): {"logprob": max(float(lp), -9999.0), "rank": int(rank), "decoded_token": decode(tid)}}
        for r, (i, v) in enumerate(top, 1):
            d.setdefault(str(i), {"logprob": max(float(v), -9999.0), "rank": r, "decoded_token": decode(i)})
        out.append(d)
    return out
