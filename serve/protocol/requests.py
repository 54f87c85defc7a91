"""Request bodies of the native and the OpenAI-compatible API: parse, validate, or say why not.

Every problem a client can cause becomes an :class:`ApiError` with an HTTP status (400, 404, 413,
429, 503) and an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``; the server
never answers a bad input with 500. Checks here are the ones that need no engine (types, ranges,
shapes); the worker adds the ones that do (token ids vs the vocabulary, prompt length vs
max_model_len, KV pool size) and they come back as 400 too.

OpenAI parameters the server does not implement are refused with a 400 that names them (``param``),
unless the value given is a no-op (``suffix=""``, ``tools=[]`` ...): see :data:`NOOP_PARAMS` and
docs/OPENAI.md; vLLM's are in :mod:`serve.protocol.vllm_fields` (implemented ones in
:class:`~serve.protocol.vllm_fields.VllmOptions`, ``GenRequest.vllm``; the others in its ``REFUSED``). The
shared field checks live in :mod:`serve.protocol.sampling` (re-exported here). The sampling parameters (:data:`SAMPLING_CHECKS`), ``n``, ``logprobs`` /
``top_logprobs`` and ``echo`` (completions) map onto :class:`engine.SamplingParams`. Fields no OpenAI or vLLM request has are ignored, as vLLM
does by default.

Bodies arrive as strict JSON (:func:`serve.protocol.wire.loads_strict`); the error shape is
:class:`serve.protocol.wire.ApiError`. The OpenAI parameter table (supported, no-op, refused) lives next to
the code that enforces it, so the two cannot drift apart.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from engine import MAX_LOGPROBS, RequestError, SamplingParams
from serve.protocol import vllm_fields as vf
from serve.protocol.chat import chat_request, constrain, parse_messages
from serve.protocol.sampling import (PARAM_FIELDS, SAMPLING_CHECKS, bad, int_check, is_int, number_check, read_bool,  # noqa: F401
                                     read_int, read_number, sampling_fields, seed_of, show, type_check)
from serve.protocol.structured import source as structured_source, structured_outputs
from serve.protocol.wire import ApiError

ROLES = ("system", "developer", "user", "assistant", "tool")
TAG_VALUE_TYPES = (str, int, float, bool, type(None))
REQUEST_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}")
#: Event field names a request's tags may not use.
RESERVED_FIELDS = frozenset({"event", "request_id", "worker_id", "round", "round_", "t_ns", "observer",
                             "prompt_tokens", "max_tokens", "queue_depth", "index", "token_id", "reason", "cause",
                             "message", "logprob", "prompt_logprobs"})
TAG_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_.\-]{0,63}")
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


def _token_ids(value: Any, param: str) -> list[int]:
    if not isinstance(value, list) or not all(is_int(t) for t in value):
        raise bad(f"{param} must be a list of integer token ids", param, "invalid_type")
    if not value:
        raise bad(f"{param} is empty", param, "empty_prompt")
    return value


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise bad(f"{param} must be a string", param, "invalid_type")
    if not value:
        raise bad(f"{param} is empty", param, "empty_prompt")
    return value


def _messages(value: Any) -> list[dict]:
    return parse_messages(value)


def _request_id(body: dict) -> str | None:
    rid = body.get("request_id")
    if rid is None:
        return None
    if not isinstance(rid, str) or not rid:
        raise bad("request_id must be a non-empty string", "request_id", "invalid_type")
    if not REQUEST_ID_RE.fullmatch(rid):
        raise bad(f"request_id must match {REQUEST_ID_RE.pattern}", "request_id")
    return rid


def _tags(body: dict) -> dict:
    tags = body.get("tags", {})
    if tags is None:
        return {}
    if not isinstance(tags, dict) or len(tags) > 16:
        raise bad("tags must be an object of at most 16 fields", "tags", "invalid_type")
    for k, v in tags.items():
        if not isinstance(k, str) or not TAG_NAME_RE.fullmatch(k) or k in RESERVED_FIELDS:
            raise bad(f"tag name {show(k)} is not allowed (a letter, then letters, digits, '_', '.', '-', "
                      f"at most 64; not an event field)", "tags")
        if not isinstance(v, TAG_VALUE_TYPES) or (isinstance(v, str) and len(v) > 256) \
                or (isinstance(v, float) and not math.isfinite(v)) or (isinstance(v, int) and abs(v) >= 2 ** 63):
            raise bad(f"tag {k} must be a short scalar (a string of at most 256 characters, a finite number, "
                      f"true, false or null)", f"tags.{k}", "invalid_type")
    return dict(tags)


# --------------------------------------------------------------------------- parameters we do not implement




_ANY = lambda name, v: None   # noqa: E731  (any value is well-formed; only the no-op ones are accepted)

#: Parameters of OpenAI's and vLLM's completion requests that this server does not implement:
#: name -> (the values that change nothing and are accepted, the well-formedness check, why refused).
#: A value outside the no-op set is refused with 400 ``unsupported_parameter`` naming the parameter;
#: a malformed one with 400 ``invalid_value``/``invalid_type``.
NOOP_PARAMS: dict[str, tuple[tuple, Callable[[str, Any], None], str]] = {
    "length_penalty": ((1, 1.0), number_check(-2 ** 31, 2 ** 31), "no beam search"),
    "use_beam_search": ((False,), type_check(bool, what="true or false"), "no beam search"),
    "bad_words": (([],), type_check(list, what="a list of strings"), "the sampler has temperature only"),
    "top_logprobs": ((0,), int_check(0, 20), "completions take the count in logprobs"),
    "suffix": (("",), type_check(str, what="a string"), "no insertion mode"),
    "tools": (([],), type_check(list, what="a list"), "tool calling is a chat feature"),
    "tool_choice": (("none",), _ANY, "tool calling is a chat feature"),
    "functions": ((), _ANY, "the legacy functions API: send tools"),
    "function_call": ((), _ANY, "the legacy functions API: send tool_choice"),
    "skip_special_tokens": ((True,), type_check(bool, what="true or false"), "special tokens are always skipped"),
    "spaces_between_special_tokens": ((True,), type_check(bool, what="true or false"),
                                      "special tokens are always skipped"),
    "chat_template": ((), _ANY, "the model's own chat template only"),
    "chat_template_kwargs": (({},), type_check(dict, what="an object"), "a chat feature"),
    "audio": ((), _ANY, "text only"),
    "modalities": ((["text"],), type_check(list, what="a list"), "text only"),
    "prediction": ((), _ANY, "no predicted outputs"),
    "web_search_options": ((), _ANY, "no web search"),
}
#: Accepted and without effect on generation (metadata, or a choice that has no alternative here;
#: parallel_tool_calls only on completions: chat honours it). priority is vLLM's, refused unless 0 (vllm_fields).
IGNORED_PARAMS = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "reasoning_effort",
                  "documents")


def _is_noop(value: Any, noops: tuple) -> bool:
    for n in noops:
        if isinstance(n, bool) or isinstance(value, bool):
            if value is n:
                return True
        elif isinstance(n, (int, float)):
            if isinstance(value, (int, float)) and value == n:
                return True
        elif value == n:
            return True
    return False


#: Per route, the NOOP_PARAMS entries that the route implements (parsed by _params / _logprobs).
SUPPORTED_HERE = {"completions": {"echo"}, "chat": {"top_logprobs", "tools", "tool_choice", "chat_template_kwargs"}}


def _refuse_unsupported(body: dict, api: str) -> None:
    """Each NOOP_PARAMS field: absent, null or a no-op value passes; malformed is invalid; anything else refused."""
    for name, (noops, check, why) in {**NOOP_PARAMS, **vf.REFUSED}.items():     # OpenAI's, then vLLM's
        if name not in body or body[name] is None or name in SUPPORTED_HERE.get(api, ()):
            continue
        value = body[name]
        check(name, value)
        if _is_noop(value, noops):
            continue
        noop_text = " or ".join(json.dumps(n) for n in noops)
        raise bad(f"{name}={show(value)} is not supported by this server ({why}); "
                  + (f"omit it or send {noop_text}" if noops else "omit it"), name, "unsupported_parameter")


def _stops(body: dict) -> tuple[list[str], list[int], bool]:
    """Stop strings, stop token ids (their vocabulary is the engine's check, at submit) and
    include_stop_str_in_output."""
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise bad(f"stop must be a string or a list of strings, got {show(stop)}", "stop", "invalid_type")
    if len(stops) > MAX_STOPS:
        raise bad(f"stop may hold at most {MAX_STOPS} strings, got {len(stops)}", "stop")
    if any(not s for s in stops):
        raise bad("stop strings must not be empty", "stop")
    if any(len(s) > 256 for s in stops):
        raise bad("stop strings may be at most 256 characters", "stop")
    ids = body.get("stop_token_ids")
    if ids is None:
        ids = []
    if not isinstance(ids, list) or not all(is_int(t) for t in ids):
        raise bad(f"stop_token_ids must be a list of integer token ids, got {show(ids)}", "stop_token_ids",
                  "invalid_type")
    if len(ids) > 64:
        raise bad(f"stop_token_ids may hold at most 64 ids, got {len(ids)}", "stop_token_ids")
    if any(t < 0 for t in ids):
        raise bad(f"stop_token_ids must be token ids >= 0, got {show(ids)}", "stop_token_ids")
    include = read_bool(body, "include_stop_str_in_output", False)
    return stops, list(dict.fromkeys(ids)), include


def _choices_per_prompt(body: dict) -> int:
    n = read_int(body, "n", 1, 1, MAX_CHOICES)
    best_of = body.get("best_of")
    if best_of is not None:
        int_check(1, MAX_CHOICES)("best_of", best_of)
        if best_of != n:
            raise bad(f"best_of must equal n ({n}): there is no ranking of extra samples, got {best_of}", "best_of",
                      "unsupported_parameter")
    return n


def _logprobs(body: dict, api: str) -> int | None:
    """How many alternatives per token the answer's logprobs carry; None: no logprobs."""
    value = body.get("logprobs")
    if api == "completions":
        if value is None:
            return None
        if not is_int(value):
            raise bad(f"logprobs must be an integer or null, got {show(value)}", "logprobs", "invalid_type")
        return value                # its range: SamplingParams.logprobs'
    if value is not None:
        type_check(bool, what="true or false")("logprobs", value)
    top = body.get("top_logprobs")
    if top is not None:
        int_check(0, MAX_LOGPROBS)("top_logprobs", top)      # SamplingParams.logprobs' range, under chat's name
    if not value:
        if top:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        return None
    return top or 0


def _params(body: dict, limits: Limits, default_temperature: float, max_tokens_names=("max_tokens",),
            default_max_tokens: int | None = None, api: str = "native",
            prompt_logprobs: int | None = None) -> tuple[SamplingParams, bool]:
    """The sampling parameters and whether max_tokens was given. Without it: ``default_max_tokens``, or
    (None) the rest of the context, which the worker fills in once it knows the prompt's length. Every route
    checks the sampling parameters with the same function (sampling.sampling_fields); log-probs are the OpenAI
    routes'. ``prompt_logprobs``: vLLM's field (else echo with logprobs asks for them)."""
    hi = limits.max_model_len - 1
    max_tokens = None
    for name in max_tokens_names:
        if body.get(name) is not None:
            max_tokens = read_int(body, name, None, 1, hi)
            break
    given = max_tokens is not None
    if max_tokens is None:
        max_tokens = min(default_max_tokens or hi, hi)
    temperature = read_number(body, "temperature", default_temperature, 0.0, 100.0)
    seed = seed_of(body)
    ignore_eos = read_bool(body, "ignore_eos", False)
    extra: dict[str, Any] = {"structured_outputs": structured_outputs(body), **sampling_fields(body)}   # one parser
    if api != "native":
        logprobs = _logprobs(body, api)
        if logprobs is not None:
            extra["logprobs"] = logprobs
            if api == "completions" and read_bool(body, "echo", False):
                extra["prompt_logprobs"] = logprobs
        if prompt_logprobs is not None:
            extra["prompt_logprobs"] = prompt_logprobs
    try:
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=ignore_eos, seed=seed,
                                **extra)
    except RequestError as e:        # a combination the ranges alone do not catch (min_tokens > max_tokens)
        raise bad(str(e), param_of(e.code)) from None
    return params, given or default_max_tokens is not None


def param_of(code: str) -> str | None:
    """The request parameter an engine RequestError code (``invalid_<param>``) names, if any."""
    name = code[len("invalid_"):] if code.startswith("invalid_") else ""
    return name if name in PARAM_FIELDS else None


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None, "invalid_body")
    return body


def _check_model(body: dict, limits: Limits) -> str | None:
    model = body.get("model")
    if model is None:
        return None
    if not isinstance(model, str):
        raise bad("model must be a string", "model", "invalid_type")
    if not limits.serves(model):
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {limits.served_model_name!r}",
                       "model_not_found", "model")
    return model


# --------------------------------------------------------------------------- the three APIs


def parse_native(body: Any, limits: Limits) -> GenRequest:
    """``POST /generate``: one of prompt (text), prompt_token_ids, messages; greedy by default.

    Optional: max_tokens, temperature, seed, ignore_eos, the sampling parameters of SAMPLING_CHECKS (top_p,
    top_k, min_p, penalties, min_tokens, logit_bias, allowed_token_ids: the OpenAI routes' checks, the same
    function), stream (default true), request_id, tags
    (short scalars copied into the submitted event, e.g. the trace's class), detokenize (default
    true: token events carry their text piece; load replay turns it off)."""
    body = _object(body)
    given = [k for k in ("prompt", "prompt_token_ids", "messages") if body.get(k) is not None]
    if len(given) != 1:
        raise bad("give exactly one of prompt, prompt_token_ids, messages" +
                  (f" (got {', '.join(given)})" if given else ""), None, "missing_prompt" if not given else "invalid_value")
    key = given[0]
    if key == "prompt":
        prompt: Any = _text(body["prompt"], "prompt")
    elif key == "prompt_token_ids":
        prompt = _token_ids(body["prompt_token_ids"], "prompt_token_ids")
    else:
        prompt = _messages(body["messages"])
    params, _ = _params(body, limits, default_temperature=0.0, default_max_tokens=64)
    return GenRequest("native", prompt, params, stream=read_bool(body, "stream", True), request_id=_request_id(body),
                      tags=_tags(body), detokenize=read_bool(body, "detokenize", True),
                      structured_param=structured_source(body))


def _prompt_one(prompt: Any, param: str) -> Any:
    if isinstance(prompt, str):
        return _text(prompt, param)
    return _token_ids(prompt, param)


def parse_completion(body: Any, limits: Limits) -> GenRequest:
    """``POST /v1/completions``: prompt is a string, token ids, or a list of either (one choice per prompt)."""
    body = _object(body)
    model = _check_model(body, limits)
    _refuse_unsupported(body, "completions")
    if "prompt" not in body or body["prompt"] is None:
        raise bad("prompt is required", "prompt", "missing_prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise bad(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}", "prompt")
        prompts = [_prompt_one(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    else:
        prompts = [_prompt_one(prompt, "prompt")]
    n = _choices_per_prompt(body)
    if n * len(prompts) > MAX_CHOICES:
        raise bad(f"prompts x n may be at most {MAX_CHOICES}, got {len(prompts)} x {n}", "n")
    stream = read_bool(body, "stream", False)
    usage = _include_usage(body, stream)
    opts = vf.parse(body, "completions", stream, limits.max_model_len)
    params, given = _params(body, limits, default_temperature=1.0, api="completions",       # max_tokens: 16,
                            default_max_tokens=DEFAULT_COMPLETION_TOKENS, prompt_logprobs=opts.prompt_logprobs)
    stop, stop_ids, include = _stops(body)
    params = _with_stop_ids(params, stop_ids)
    return GenRequest("completions", prompts[0], params, stream=stream, request_id=_request_id(body),
                      include_usage=usage, model=model, fill_context=not given,
                      stop=stop, include_stop_str_in_output=include, prompts=prompts,
                      n=n, logprobs=params.logprobs, echo=read_bool(body, "echo", False), vllm=opts,
                      structured_param=structured_source(body))


def _with_stop_ids(params: SamplingParams, stop_ids: list[int]) -> SamplingParams:
    """stop_token_ids are the engine's (SamplingParams.stop_token_ids): it finishes the request with reason stop
    at one, and min_tokens holds them back like EOS."""
    if not stop_ids:
        return params
    import dataclasses
    return dataclasses.replace(params, stop_token_ids=list(stop_ids))


def parse_chat(body: Any, limits: Limits) -> GenRequest:
    """``POST /v1/chat/completions``: messages through the model's chat template."""
    body = _object(body)
    model = _check_model(body, limits)
    _refuse_unsupported(body, "chat")
    if "messages" not in body:
        raise bad("messages is required", "messages", "missing_prompt")
    chat, chat_output = chat_request(body, _messages(body["messages"]), limits.enable_auto_tool_choice,
                                     limits.reasoning_parser)
    n = _choices_per_prompt(body)
    stream = read_bool(body, "stream", False)
    usage = _include_usage(body, stream)
    opts = vf.parse(body, "chat", stream, limits.max_model_len)
    params, given = _params(body, limits, default_temperature=1.0, prompt_logprobs=opts.prompt_logprobs,
                            max_tokens_names=("max_completion_tokens", "max_tokens"), api="chat")
    stop, stop_ids, include = _stops(body)
    params = constrain(_with_stop_ids(params, stop_ids), chat_output)
    return GenRequest("chat", chat, params, stream=stream, request_id=_request_id(body),
                      include_usage=usage, model=model, fill_context=not given,
                      stop=stop, include_stop_str_in_output=include, n=n,
                      logprobs=params.logprobs, echo=read_bool(body, "echo", False), vllm=opts, chat_output=chat_output,
                      structured_param="tool_choice" if chat_output.constraint else structured_source(body))


def _include_usage(body: dict, stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise bad("stream_options must be an object", "stream_options", "invalid_type")
    if not stream:
        raise bad("stream_options is only allowed with stream=true", "stream_options")
    return read_bool(opts, "include_usage", False)


def parse_cancel(body: Any) -> tuple[str, str | None]:
    """``POST /cancel``: (request_id, cancel_token); the token is the X-Cancel-Token of the request's answer."""
    body = _object(body)
    rid = _request_id(body)
    if rid is None:
        raise bad("request_id is required", "request_id", "missing_request_id")
    token = body.get("cancel_token")
    if token is not None and (not isinstance(token, str) or not 0 < len(token) <= 256):
        raise bad("cancel_token must be the X-Cancel-Token string of the request's answer", "cancel_token",
                  "invalid_type")
    return rid, token
