"""vLLM's request fields beyond OpenAI's: the ones this server implements, parsed into :class:`VllmOptions`, and
every other one of vLLM's ``ChatCompletionRequest`` / ``CompletionRequest`` fields in :data:`REFUSED` (a 400
naming it unless its value changes nothing), so that no vLLM field is accepted and silently ignored.

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
from typing import Any

from engine import MAX_LOGPROBS
from serve.protocol.sampling import read_bool, int_check, is_int, show, type_check, bad

MAX_PROMPT_LOGPROBS = MAX_LOGPROBS   # as logprobs; vLLM's -1 (the whole vocabulary) is refused


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


_ANY = lambda name, v: None   # noqa: E731


def _dict_check(name: str, v: Any) -> None:
    type_check(dict, what="an object")(name, v)


#: vLLM request fields this server does not implement: name -> (no-op values, well-formedness check, why).
#: Same rule as protocol.NOOP_PARAMS (which covers OpenAI's): absent, null or a no-op value passes; else 400.
REFUSED: dict[str, tuple[tuple, Any, str]] = {
    "prompt_embeds": ((), _ANY, "prompts are text or token ids"),
    "cache_salt": ((), type_check(str, what="a string"), "one prefix cache for every request of this server"),
    "kv_transfer_params": (({},), _dict_check, "no disaggregated prefill"),
    "ec_transfer_params": (({},), _dict_check, "no disaggregated encoder cache"),
    "vllm_xargs": (({},), _dict_check, "no custom extensions"),
    "mm_processor_kwargs": (({},), _dict_check, "text only"),
    "media_io_kwargs": (({},), _dict_check, "text only"),
    "logits_processors": (([],), type_check(list, what="a list"), "no custom logits processors"),
    "logprob_token_ids": ((), type_check(list, what="a list of token ids"), "log-probs of the top alternatives only"),
    "min_characters": ((0,), int_check(0), "no minimum output length in characters"),
    "thinking_token_budget": ((-1,), int_check(-1), "no thinking budget"),
    "repetition_detection": ((), _ANY, "no repetition detection"),
    "watermarking": ((False,), type_check(bool, what="true or false"), "no watermarking"),
    "stream_interval": ((1,), int_check(1), "one chunk per token"),
    "return_prompt_text": ((False,), type_check(bool, what="true or false"), "the rendered prompt is not returned"),
    "return_token_offsets": ((False,), type_check(bool, what="true or false"), "vLLM's render endpoints only"),
    "return_mm_kwargs": ((True,), type_check(bool, what="true or false"), "vLLM's render endpoints only"),
    "routed_experts_prompt_start": ((0,), int_check(0), "no expert routing data"),
    "priority": ((0,), type_check(int, what="an integer"), "no priority scheduling (vLLM refuses it too "
                                                            "without --scheduling-policy priority)"),
    "include_reasoning": ((True,), type_check(bool, what="true or false"),
                          "the reasoning parser's output is always returned (reasoning_content)"),
}

#: vLLM fields with no server-side meaning here, accepted and ignored (as OpenAI's user, metadata ...).
IGNORED = ("session_id",)


def _prompt_logprobs(body: dict, stream: bool) -> int | None:
    value = body.get("prompt_logprobs")
    if value is None:
        return None
    if not is_int(value):
        raise bad(f"prompt_logprobs must be an integer, got {show(value)}", "prompt_logprobs", "invalid_type")
    if not 0 <= value <= MAX_PROMPT_LOGPROBS:
        raise bad(f"prompt_logprobs must be between 0 and {MAX_PROMPT_LOGPROBS} (the whole vocabulary, -1, is not "
                  f"served), got {value}", "prompt_logprobs")
    if stream:
        raise bad("prompt_logprobs are not available with stream=true (as vLLM)", "prompt_logprobs")
    return value


def _truncate(body: dict, max_model_len: int) -> tuple[int | None, str]:
    k = body.get("truncate_prompt_tokens")
    side = body.get("truncation_side")
    if side is not None and side not in ("left", "right"):
        raise bad(f"truncation_side must be left or right, got {show(side)}", "truncation_side")
    if k is None:
        return None, side or "left"
    if not is_int(k):
        raise bad(f"truncate_prompt_tokens must be an integer, got {show(k)}", "truncate_prompt_tokens",
                  "invalid_type")
    if k == -1:
        k = max_model_len
    if not 1 <= k <= max_model_len:
        raise bad(f"truncate_prompt_tokens must be -1 (max_model_len) or in [1, max_model_len={max_model_len}], "
                  f"got {k}", "truncate_prompt_tokens")
    return k, side or "left"


def parse(body: dict, api: str, stream: bool, max_model_len: int) -> VllmOptions:
    """The vLLM-only options of a completions or chat body (their checks; the refused ones are in REFUSED)."""
    chat = api == "chat"
    add_gen = read_bool(body, "add_generation_prompt", True) if chat else True
    cont = read_bool(body, "continue_final_message", False) if chat else False
    if add_gen and cont:
        raise bad("continue_final_message and add_generation_prompt cannot both be true (send "
                  "add_generation_prompt: false to continue the last message)", "continue_final_message")
    opts = body.get("stream_options")
    continuous = read_bool(opts, "continuous_usage_stats", False) if isinstance(opts, dict) else False
    # vLLM's rule: usage on every chunk only where include_usage is on too; alone it asks for nothing
    continuous = continuous and read_bool(opts, "include_usage", False)
    k, side = _truncate(body, max_model_len)
    special = body.get("add_special_tokens")
    if special is not None:
        type_check(bool, what="true or false")("add_special_tokens", special)
    return VllmOptions(return_token_ids=read_bool(body, "return_token_ids", False), continuous_usage_stats=continuous,
                       prompt_logprobs=_prompt_logprobs(body, stream), add_generation_prompt=add_gen,
                       continue_final_message=cont, add_special_tokens=special, truncate_prompt_tokens=k,
                       truncation_side=side,
                       return_tokens_as_token_ids=read_bool(body, "return_tokens_as_token_ids", False))


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
