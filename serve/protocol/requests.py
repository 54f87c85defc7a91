"""Request bodies of the native and the OpenAI-compatible API as pydantic models (vLLM's field names):
:class:`GenerateRequest` (``/generate``), :class:`CompletionRequest`, :class:`ChatCompletionRequest`,
:class:`CancelRequest`; each ``parse_*`` validates a body and returns the one :class:`GenRequest` the routes serve.

Every problem a client can cause becomes an :class:`ApiError` with an HTTP status (400, 404, 413,
429, 503) and an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``; the server
never answers a bad input with 500. pydantic's errors become one line naming the field
(:func:`serve.protocol.sampling.api_error`). Checks here are the ones that need no engine (types, shapes);
the sampling ranges are ``SamplingParams``' (its refusal is the 400's message), and the worker adds the checks
that need the engine (token ids vs the vocabulary, prompt length vs max_model_len, KV pool size).

OpenAI parameters the server does not implement are refused with a 400 that names them (``param``),
unless the value given is a no-op (``suffix=""``, ``tools=[]`` ...): see :data:`NOOP_PARAMS` and
docs/OPENAI.md; vLLM's are in :mod:`serve.protocol.vllm_fields` (implemented ones in
:class:`~serve.protocol.vllm_fields.VllmFields`, ``GenRequest.vllm``; the others in its ``REFUSED``). Fields no
OpenAI or vLLM request has are ignored, as vLLM does by default; ``null`` is a field's absence.

Bodies arrive as strict JSON (:func:`serve.protocol.wire.loads_strict`); the error shape is
:class:`serve.protocol.wire.ApiError`. The OpenAI parameter table (supported, no-op, refused) lives next to
the code that enforces it, so the two cannot drift apart.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Optional, Union

from pydantic import (AfterValidator, Discriminator, Field, StringConstraints, Tag, ValidationInfo, create_model,
                      field_validator, model_validator)
from pydantic_core import PydanticCustomError

from engine import MAX_LOGPROBS, RequestError, SamplingParams
from serve.protocol import vllm_fields as vf
from serve.protocol.chat import ChatTools, Messages, constrain
from serve.protocol.sampling import PARAM_FIELDS, SamplingFields, StrictBody, bad, by_type, show  # noqa: F401
from serve.protocol.structured import StructuredFields
from serve.protocol.wire import ApiError

REQUEST_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}")
#: Event field names a request's tags may not use.
RESERVED_FIELDS = frozenset({"event", "request_id", "worker_id", "round", "round_", "t_ns", "observer",
                             "prompt_tokens", "max_tokens", "queue_depth", "index", "token_id", "reason", "cause",
                             "message", "logprob", "prompt_logprobs"})
TAG_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_.\-]{0,63}")
TAG_VALUE_TYPES = (str, int, float, bool, type(None))
MAX_STOPS = 4                  # stop strings per request, as OpenAI
MAX_PROMPTS = 64               # prompts in one /v1/completions request
MAX_CHOICES = 128              # prompts x n in one request
DEFAULT_COMPLETION_TOKENS = 16   # /v1/completions without max_tokens, as OpenAI and vLLM (chat: the rest of the context)


@dataclass
class Limits:
    max_model_len: int
    served_model_name: str
    max_body_bytes: int = 1 << 20
    enable_auto_tool_choice: bool = True   # tool_choice auto (vLLM: --enable-auto-tool-choice --tool-call-parser)
    reasoning_parser: str | None = None    # qwen3: the <think> part goes to the message's reasoning fields
    model_aliases: frozenset = frozenset()  # other ids of the served model (the path or name it was started with)

    def serves(self, model: str) -> bool:
        """Whether a request's ``model`` names the served model (empty: any)."""
        return model in ("", self.served_model_name) or model in self.model_aliases


@dataclass
class GenRequest:
    """One validated request, whichever API it came through."""
    api: str                              # native | completions | chat
    prompt: Any                           # str | list[int] | list[message dict]
    params: SamplingParams
    stream: bool = True
    request_id: str | None = None
    tags: dict = field(default_factory=dict)
    include_usage: bool = False
    model: str | None = None
    detokenize: bool = True               # native: add "text" to token events
    fill_context: bool = False            # no max_tokens: generate up to max_model_len - prompt tokens
    stop: list[str] = field(default_factory=list)           # stop strings (OpenAI APIs)
    include_stop_str_in_output: bool = False
    prompts: list | None = None           # /v1/completions: every prompt (one choice each); prompt is the first
    n: int = 1                            # choices per prompt (sample i: seed + i when a seed is given)
    logprobs: int | None = None           # alternatives per token in the answer's logprobs objects (None: no logprobs)
    echo: bool = False                    # completions: the prompt (and its log-probs) before the output; chat: vLLM's
    chat_output: Any = None               # chat: how the answer is read (chat_output.ChatOutputOptions)
    structured_param: str | None = None   # the field its structured-output constraint came from (serve/protocol/structured.py)
    vllm: vf.VllmOptions = field(default_factory=vf.VllmOptions)   # vLLM's extra fields (vllm_fields.py)


# --------------------------------------------------------------------------- field types


def _not_empty(value):
    """By hand: pydantic's min_length refusal has its own type (too_short), where an empty prompt's code is
    empty_prompt (tests/service/entrypoints/test_service_http.py)."""
    if not value:
        raise PydanticCustomError("empty_prompt", "is empty")
    return value


Text = Annotated[str, AfterValidator(_not_empty)]
TokenIds = Annotated[list[int], AfterValidator(_not_empty)]
RequestId = Annotated[str, StringConstraints(pattern=f"^{REQUEST_ID_RE.pattern}$")]


def _many(value: Any) -> bool:
    """Whether a completions prompt is a list of prompts (rather than one text or one list of token ids)."""
    return isinstance(value, list) and bool(value) and all(isinstance(p, (str, list)) for p in value)


OnePrompt = Annotated[Union[Annotated[Text, Tag("text")], Annotated[TokenIds, Tag("ids")]],
                      by_type("a string or a list of token ids", text=str, ids=list)]
#: /v1/completions' prompt: text, token ids, or a list of either (one choice per prompt).
Prompts = Annotated[Union[Annotated[OnePrompt, Tag("one")],
                          Annotated[list[OnePrompt], Field(max_length=MAX_PROMPTS), Tag("many")]],
                    Discriminator(lambda v: "many" if _many(v) else "one")]      # "one" says what a prompt is
StopString = Annotated[str, StringConstraints(min_length=1, max_length=256)]
Stops = Annotated[Union[Annotated[StopString, Tag("one")],
                        Annotated[list[StopString], Field(max_length=MAX_STOPS), Tag("many")]],
                  by_type("a string or a list of strings", one=str, many=list)]


def _tags(tags: Any) -> dict:
    """Tags: up to 16 short scalars. By hand: pydantic words an integer outside int64 as a value out of range,
    where a tag's value is refused by its type (tests/service/entrypoints/test_service_hardening.py, tag-big-int),
    and names a bad key by the map, not the tag."""
    if not isinstance(tags, dict) or len(tags) > 16:
        raise bad("tags must be an object of at most 16 fields", "tags", "invalid_type")
    for k, v in tags.items():
        if not isinstance(k, str) or not TAG_NAME_RE.fullmatch(k) or k in RESERVED_FIELDS:
            raise bad(f"tag name {show(k)} is not allowed (a letter, then letters, digits, '_', '.', '-', "
                      f"at most 64; not an event field)", "tags")
        if not isinstance(v, TAG_VALUE_TYPES) or (isinstance(v, str) and len(v) > 256) \
                or (isinstance(v, int) and abs(v) >= 2 ** 63):
            raise bad(f"tag {k} must be a short scalar (a string of at most 256 characters, a finite number, "
                      f"true, false or null)", f"tags.{k}", "invalid_type")
    return dict(tags)


# --------------------------------------------------------------------------- parameters we do not implement

#: Parameters of OpenAI's and vLLM's completion requests that this server does not implement:
#: name -> (the values that change nothing and are accepted, the field's type, why refused).
#: A value outside the no-op set is refused with 400 ``unsupported_parameter`` naming the parameter;
#: a malformed one with 400 ``invalid_value``/``invalid_type``.
NOOP_PARAMS: dict[str, tuple[tuple, Any, str]] = {
    "length_penalty": ((1.0,), float, "no beam search"),
    "use_beam_search": ((False,), bool, "no beam search"),
    "bad_words": (([],), list[str], "the sampler has temperature only"),
    "top_logprobs": ((0,), Annotated[int, Field(ge=0, le=MAX_LOGPROBS)], "completions take the count in logprobs"),
    "suffix": (("",), str, "no insertion mode"),
    "tools": (([],), list, "tool calling is a chat feature"),
    "tool_choice": (("none",), Any, "tool calling is a chat feature"),
    "functions": ((), Any, "the legacy functions API: send tools"),
    "function_call": ((), Any, "the legacy functions API: send tool_choice"),
    "skip_special_tokens": ((True,), bool, "special tokens are always skipped"),
    "spaces_between_special_tokens": ((True,), bool, "special tokens are always skipped"),
    "chat_template": ((), Any, "the model's own chat template only"),
    "chat_template_kwargs": (({},), dict, "a chat feature"),
    "audio": ((), Any, "text only"),
    "modalities": ((["text"],), list, "text only"),
    "prediction": ((), Any, "no predicted outputs"),
    "web_search_options": ((), Any, "no web search"),
}
#: Accepted and without effect on generation (metadata, or a choice that has no alternative here;
#: parallel_tool_calls only on completions: chat honours it). priority is vLLM's, refused unless 0 (vllm_fields).
IGNORED_PARAMS = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "reasoning_effort",
                  "documents")

_REFUSABLE = {**NOOP_PARAMS, **vf.REFUSED}         # OpenAI's, then vLLM's
#: Every refusable field, typed: a malformed value is refused as malformed (invalid_type/invalid_value).
Refusable = create_model("Refusable", __base__=StrictBody,
                         **{name: (Optional[kind], None) for name, (_, kind, _) in _REFUSABLE.items()})


class ServedModel(StrictBody):
    """``model``: when given, the served model's name or one of its aliases. Another is a 404, raised as the field
    is read, so it comes before any 400 of the body (a request for another model is answered as such)."""
    model: Optional[str] = None

    @field_validator("model")
    @classmethod
    def _served(cls, model: str, info: ValidationInfo) -> str:
        limits = (info.context or {}).get("limits")
        if limits is not None and not limits.serves(model):
            raise ApiError(404, f"the model {show(model)} does not exist; this server serves "
                                f"{limits.served_model_name!r}", "model_not_found", "model")
        return model


class OpenAIRequest(ServedModel, SamplingFields, StructuredFields, vf.VllmFields, Refusable):
    """What /v1/completions and /v1/chat/completions share (vLLM's field names)."""
    #: the refusable fields a route implements (its own model states their type)
    implemented: ClassVar[frozenset] = frozenset()
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    best_of: Optional[Annotated[int, Field(ge=1, le=MAX_CHOICES)]] = None
    stop: Optional[Stops] = None
    stop_token_ids: Annotated[list[int], Field(max_length=64)] = []     # ids: SamplingParams' check
    include_stop_str_in_output: bool = False
    echo: bool = False
    request_id: Optional[RequestId] = None

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        """Each refusable field: absent, null or a no-op value passes; anything else is refused, naming it."""
        given = self.model_fields_set
        for name, (noops, _, why) in _REFUSABLE.items():          # in the table's order: one answer per body
            if name not in given or name in self.implemented or getattr(self, name) in noops:
                continue
            value = getattr(self, name)
            noop_text = " or ".join(json.dumps(n) for n in noops)
            raise bad(f"{name}={show(value)} is not supported by this server ({why}); "
                      + (f"omit it or send {noop_text}" if noops else "omit it"), name, "unsupported_parameter")
        if self.best_of is not None and self.best_of != self.n:
            raise bad(f"best_of must equal n ({self.n}): there is no ranking of extra samples, got {self.best_of}",
                      "best_of", "unsupported_parameter")
        return self

    def gen_request(self, api: str, prompt: Any, params: SamplingParams, given: bool, opts: vf.VllmOptions,
                    **more) -> GenRequest:
        """The validated request as the routes serve it (``given``: whether max_tokens was)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return GenRequest(api, prompt, params, stream=self.stream, request_id=self.request_id,
                          include_usage=self.include_usage, model=self.model, fill_context=not given,
                          stop=stops, include_stop_str_in_output=self.include_stop_str_in_output, n=self.n,
                          logprobs=params.logprobs, echo=self.echo, vllm=opts, **more)


class CompletionRequest(OpenAIRequest):
    """``POST /v1/completions``."""
    prompt: Prompts
    logprobs: Optional[int] = None          # its range: SamplingParams.logprobs'

    def prompts(self) -> list:
        return list(self.prompt) if _many(self.prompt) else [self.prompt]


class ChatCompletionRequest(ChatTools, OpenAIRequest):
    """``POST /v1/chat/completions``: messages through the model's chat template."""
    implemented: ClassVar[frozenset] = frozenset({"top_logprobs", "tools", "tool_choice", "chat_template_kwargs"})
    messages: Messages
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _chat_rules(self):
        if self.add_generation_prompt and self.continue_final_message:
            raise bad("continue_final_message and add_generation_prompt cannot both be true (send "
                      "add_generation_prompt: false to continue the last message)", "continue_final_message")
        if not self.logprobs and self.top_logprobs:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        return self


class GenerateRequest(SamplingFields, StructuredFields):
    """``POST /generate``: one of prompt (text), prompt_token_ids, messages; greedy by default."""
    prompt: Optional[Text] = None
    prompt_token_ids: Optional[TokenIds] = None
    messages: Optional[Messages] = None
    stream: bool = True
    request_id: Optional[RequestId] = None
    tags: dict = {}
    detokenize: bool = True

    @field_validator("tags", mode="before")
    @classmethod
    def _tags(cls, value):
        return _tags(value)

    @model_validator(mode="after")
    def _one_prompt(self):
        given = [k for k in ("prompt", "prompt_token_ids", "messages") if getattr(self, k) is not None]
        if len(given) != 1:
            raise bad("give exactly one of prompt, prompt_token_ids, messages" +
                      (f" (got {', '.join(given)})" if given else ""), None,
                      "missing_prompt" if not given else "invalid_value")
        return self


class CancelRequest(StrictBody):
    """``POST /cancel``: the request's id and the X-Cancel-Token of its answer."""
    request_id: RequestId
    cancel_token: Optional[Annotated[str, StringConstraints(min_length=1, max_length=256)]] = None


# --------------------------------------------------------------------------- one SamplingParams per request


def _params(req: SamplingFields | StructuredFields, limits: Limits, default_temperature: float,
            max_tokens_name: str = "max_tokens", default_max_tokens: int | None = None,
            **extra) -> tuple[SamplingParams, bool]:
    """The sampling parameters and whether max_tokens was given. Without it: ``default_max_tokens``, or
    (None) the rest of the context, which the worker fills in once it knows the prompt's length. Every route
    builds them from the same model (SamplingFields); a range the engine refuses is a 400 in its words."""
    hi = limits.max_model_len - 1
    max_tokens = getattr(req, max_tokens_name)
    if max_tokens is not None and not 1 <= max_tokens <= hi:
        raise bad(f"{max_tokens_name} must be between 1 and {hi}, got {max_tokens}", max_tokens_name)
    given = max_tokens is not None
    if max_tokens is None:
        max_tokens = min(default_max_tokens or hi, hi)
    temperature = default_temperature if req.temperature is None else req.temperature
    try:
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=req.ignore_eos,
                                seed=req.seed, structured_outputs=req.constraint(),
                                **req.sampling_kwargs(), **{k: v for k, v in extra.items() if v not in (None, [])})
    except RequestError as e:        # a range (SamplingParams states them), or min_tokens > max_tokens
        raise bad(str(e), param_of(e.code)) from None
    return params, given or default_max_tokens is not None


def param_of(code: str) -> str | None:
    """The request parameter an engine RequestError code (``invalid_<param>``) names, if any."""
    name = code[len("invalid_"):] if code.startswith("invalid_") else ""
    return name if name in PARAM_FIELDS else None


# --------------------------------------------------------------------------- the three APIs


def parse_native(body: Any, limits: Limits) -> GenRequest:
    """``POST /generate``: one of prompt (text), prompt_token_ids, messages; greedy by default.

    Optional: max_tokens, temperature, seed, ignore_eos, the sampling parameters (top_p, top_k, min_p, penalties,
    min_tokens, logit_bias, allowed_token_ids: the OpenAI routes' model, SamplingFields), stream (default true),
    request_id, tags (short scalars copied into the submitted event, e.g. the trace's class), detokenize (default
    true: token events carry their text piece; load replay turns it off)."""
    req = GenerateRequest.parse(body)
    prompt = next(p for p in (req.prompt, req.prompt_token_ids, req.messages) if p is not None)
    params, _ = _params(req, limits, default_temperature=0.0, default_max_tokens=64)
    return GenRequest("native", prompt, params, stream=req.stream, request_id=req.request_id, tags=req.tags,
                      detokenize=req.detokenize, structured_param=req.constraint_source())


def parse_completion(body: Any, limits: Limits) -> GenRequest:
    """``POST /v1/completions``: prompt is a string, token ids, or a list of either (one choice per prompt)."""
    req = CompletionRequest.parse(body, limits)
    prompts = req.prompts()
    if req.n * len(prompts) > MAX_CHOICES:
        raise bad(f"prompts x n may be at most {MAX_CHOICES}, got {len(prompts)} x {req.n}", "n")
    opts = req.options(limits.max_model_len)
    echoed = req.logprobs if req.echo else None           # echo with logprobs: the prompt's too (vLLM's field wins)
    params, given = _params(req, limits, default_temperature=1.0, default_max_tokens=DEFAULT_COMPLETION_TOKENS,
                            logprobs=req.logprobs, stop_token_ids=req.stop_token_ids,
                            prompt_logprobs=echoed if opts.prompt_logprobs is None else opts.prompt_logprobs)
    return req.gen_request("completions", prompts[0], params, given, opts, prompts=prompts,
                           structured_param=req.constraint_source())


def parse_chat(body: Any, limits: Limits) -> GenRequest:
    """``POST /v1/chat/completions``: messages through the model's chat template."""
    req = ChatCompletionRequest.parse(body, limits)
    chat, chat_output = req.chat_prompt(req.messages, limits.enable_auto_tool_choice, limits.reasoning_parser)
    opts = req.options(limits.max_model_len, req.add_generation_prompt, req.continue_final_message)
    name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    params, given = _params(req, limits, default_temperature=1.0, max_tokens_name=name,
                            logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                            stop_token_ids=req.stop_token_ids, prompt_logprobs=opts.prompt_logprobs)
    return req.gen_request("chat", chat, constrain(params, chat_output), given, opts, chat_output=chat_output,
                           structured_param="tool_choice" if chat_output.constraint else req.constraint_source())


def parse_cancel(body: Any) -> tuple[str, str | None]:
    """``POST /cancel``: (request_id, cancel_token); the token is the X-Cancel-Token of the request's answer."""
    req = CancelRequest.parse(body)
    return req.request_id, req.cancel_token
