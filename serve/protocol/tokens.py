"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` bodies, field by field as vLLM names them.

``/tokenize`` takes either a ``prompt`` (text; ``add_special_tokens`` default true) or chat ``messages``
rendered through the model's chat template exactly as a chat completion's prompt is (``add_generation_prompt``
default true, ``continue_final_message`` default false, ``add_special_tokens`` default false, ``tools``,
``chat_template_kwargs``); ``return_token_strs`` adds each token's string. ``/detokenize`` takes ``tokens``, a
list of ids of the model's vocabulary. ``model``, when given, must name the served model (404 otherwise).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from pydantic import model_validator

from serve.protocol.chat import ChatPrompt, ChatTools, Messages
from serve.protocol.requests import ServedModel
from serve.protocol.sampling import bad


@dataclass
class TokenizeRequest:
    prompt: str | ChatPrompt
    options: dict               # the encoder's: add_special_tokens, add_generation_prompt, continue_final_message
    return_token_strs: bool = False

    @property
    def param(self) -> str:
        return "messages" if isinstance(self.prompt, ChatPrompt) else "prompt"


class TokenizeBody(ChatTools, ServedModel):
    prompt: Optional[str] = None
    messages: Optional[Messages] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: Optional[bool] = None       # default: true for a prompt, false for messages (vLLM's)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_prompt(self):
        if self.messages is not None and self.prompt is not None:
            raise bad("give prompt or messages, not both", "prompt")
        if self.messages is None and self.prompt is None:
            raise bad("prompt (text) or messages is required", "prompt", "missing_prompt")
        if self.add_generation_prompt and self.continue_final_message:
            raise bad("continue_final_message and add_generation_prompt cannot both be true",
                      "continue_final_message")
        return self


class DetokenizeBody(ServedModel):
    tokens: list[int]


def parse_tokenize(body: Any, limits) -> TokenizeRequest:
    req = TokenizeBody.parse(body, limits)
    if req.messages is not None:
        chat = ChatPrompt(req.messages, req.tool_list(), dict(req.chat_template_kwargs or {}))
        options = {"add_generation_prompt": req.add_generation_prompt,
                   "continue_final_message": req.continue_final_message,
                   "add_special_tokens": bool(req.add_special_tokens)}
        return TokenizeRequest(chat, options, req.return_token_strs)
    special = True if req.add_special_tokens is None else req.add_special_tokens
    return TokenizeRequest(req.prompt, {"add_special_tokens": special}, req.return_token_strs)


def parse_detokenize(body: Any, limits, vocab_size: int) -> list[int]:
    req = DetokenizeBody.parse(body, limits)
    wrong = [t for t in req.tokens if not 0 <= t < vocab_size]
    if wrong:
        raise bad(f"tokens: {wrong[0]} is not a token id of this model (0 .. {vocab_size - 1})", "tokens",
                  "token_out_of_vocabulary")
    return req.tokens
