"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` bodies, field by field as vLLM names them.

``/tokenize`` takes either a ``prompt`` (text; ``add_special_tokens`` default true) or chat ``messages``
rendered through the model's chat template exactly as a chat completion's prompt is (``add_generation_prompt``
default true, ``continue_final_message`` default false, ``add_special_tokens`` default false, ``tools``,
``chat_template_kwargs``); ``return_token_strs`` adds each token's string. ``/detokenize`` takes ``tokens``, a
list of ids of the model's vocabulary. ``model``, when given, must name the served model (404 otherwise).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from serve.protocol.chat import ChatPrompt, parse_messages, parse_template_kwargs, parse_tools
from serve.protocol.sampling import bad, is_int, read_bool, show
from serve.protocol.wire import ApiError


@dataclass
class TokenizeRequest:
    prompt: str | ChatPrompt
    options: dict               # the encoder's: add_special_tokens, add_generation_prompt, continue_final_message
    return_token_strs: bool = False

    @property
    def param(self) -> str:
        return "messages" if isinstance(self.prompt, ChatPrompt) else "prompt"


def _body(body: Any, limits) -> dict:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None, "invalid_body")
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise bad("model must be a string", "model", "invalid_type")
        if not limits.serves(model):
            raise ApiError(404, f"the model {show(model)} does not exist; this server serves "
                                f"{limits.served_model_name!r}", "model_not_found", "model")
    return body


def parse_tokenize(body: Any, limits) -> TokenizeRequest:
    body = _body(body, limits)
    strs = read_bool(body, "return_token_strs", False)
    if "messages" in body:
        if "prompt" in body:
            raise bad("give prompt or messages, not both", "prompt")
        generation = read_bool(body, "add_generation_prompt", True)
        cont = read_bool(body, "continue_final_message", False)
        if generation and cont:
            raise bad("continue_final_message and add_generation_prompt cannot both be true",
                      "continue_final_message")
        chat = ChatPrompt(parse_messages(body["messages"]), parse_tools(body.get("tools")),
                          parse_template_kwargs(body.get("chat_template_kwargs")))
        options = {"add_generation_prompt": generation, "continue_final_message": cont,
                   "add_special_tokens": read_bool(body, "add_special_tokens", False)}
        return TokenizeRequest(chat, options, strs)
    if "prompt" not in body:
        raise bad("prompt (text) or messages is required", "prompt", "missing_prompt")
    if not isinstance(body["prompt"], str):
        raise bad(f"prompt must be a string, got {show(body['prompt'])}", "prompt", "invalid_type")
    return TokenizeRequest(body["prompt"], {"add_special_tokens": read_bool(body, "add_special_tokens", True)}, strs)


def parse_detokenize(body: Any, limits, vocab_size: int) -> list[int]:
    body = _body(body, limits)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(is_int(t) for t in tokens):
        raise bad("tokens must be a list of integer token ids", "tokens", "invalid_type")
    wrong = [t for t in tokens if not 0 <= t < vocab_size]
    if wrong:
        raise bad(f"tokens: {wrong[0]} is not a token id of this model (0 .. {vocab_size - 1})", "tokens",
                  "token_out_of_vocabulary")
    return tokens
