"""A chat request as the model's chat template sees it (vLLM's ``chat_utils``): messages (text, an assistant's
``tool_calls``, ``tool`` results), ``tools``, ``tool_choice``, ``parallel_tool_calls`` and
``chat_template_kwargs``, as pydantic models (:class:`ChatMessage`, :class:`Tool`, :class:`ChatTools`, vLLM's
names); and :func:`render`, the one rendering of them the server uses.

The prompt is exactly ``tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
tokenize=False, **chat_template_kwargs)`` (a ``developer`` message as ``system``): the template's own default
for thinking (Qwen3: on), as vLLM serves it. ``chat_template_kwargs`` go to the template as given (a key the
template does not read changes nothing, as in vLLM), except the names of ``apply_chat_template``'s own
arguments, which are refused.
An assistant's ``tool_calls[j].function.arguments`` (a JSON string, as OpenAI sends it) is parsed into an
object before rendering, as vLLM does, so the template writes it with its own ``tojson``.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, StringConstraints, Tag, TypeAdapter,
                      ValidationError, ValidationInfo, WrapValidator, field_validator, model_validator)
from pydantic_core import PydanticCustomError

from serve.protocol.chat_output import ChatOutputOptions
from serve.protocol.sampling import StrictBody, api_error, bad, by_type

ROLES = ("system", "developer", "user", "assistant", "tool")
#: apply_chat_template's own arguments: not for chat_template_kwargs.
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                      "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                                      "truncation", "max_length", "return_tensors", "return_dict",
                                      "return_assistant_tokens_mask", "tokenizer_kwargs"})
TOOL_CHOICES = ("none", "auto", "required")
MAX_TOOLS = 128


def _short(value: Any) -> str:
    try:
        text = json.dumps(value, ensure_ascii=True, default=repr)
    except (TypeError, ValueError):
        text = type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class ChatPrompt:
    """What the chat template renders: the messages, the tools (None: none rendered) and the template's kwargs."""
    messages: list[dict]
    tools: list[dict] | None = None
    template_kwargs: dict = field(default_factory=dict)

    def contents(self) -> list[str]:
        """Every message's text content (what a client wrote inside the template's turns)."""
        return [str(m.get("content") or "") for m in self.messages]

    def structure_text(self) -> str:
        """The client's text the template writes outside message contents (tool schemas, tool-call arguments)."""
        calls = [m.get("tool_calls") for m in self.messages if m.get("tool_calls")]
        return json.dumps([self.tools or [], calls, self.template_kwargs], ensure_ascii=False, default=str)


def render(tokenizer, chat: "ChatPrompt | list[dict]", add_generation_prompt: bool = True,
           continue_final_message: bool = False) -> str:
    """The prompt text of a chat: the template with the generation prompt (or, vLLM's assistant prefill,
    the last message left open: ``add_generation_prompt=False, continue_final_message=True``), its own
    thinking default."""
    if not isinstance(chat, ChatPrompt):
        chat = ChatPrompt(list(chat))
    kwargs = dict(chat.template_kwargs)
    if chat.tools:
        kwargs["tools"] = chat.tools
    return tokenizer.apply_chat_template(template_messages(chat.messages), add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, tokenize=False, **kwargs)


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages as the template reads them: ``developer`` (OpenAI's newer name for the system turn) as
    ``system``, since Qwen3's template writes no other role's turn and would drop it silently."""
    return [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]


# --------------------------------------------------------------------------- messages


class TextPart(StrictBody):
    """A content part: text only."""
    type: Literal["text"]
    text: str

    @model_validator(mode="wrap")
    @classmethod
    def _text_only(cls, value, handler):
        """Any part pydantic refuses is one unsupported_content (an image part is not a malformed text part;
        tests/service/entrypoints/test_service_http.py asserts the code)."""
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("unsupported_content", "must be a text part {type: text, text}") from None


class CallFunction(StrictBody):
    name: Annotated[str, StringConstraints(min_length=1)]
    arguments: Union[str, dict] = "{}"

    @field_validator("arguments")
    @classmethod
    def _object(cls, args):
        """A JSON object string, as OpenAI sends it, read into the object the template writes (vLLM's)."""
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except ValueError:
                raise PydanticCustomError("invalid_value", "must be a JSON object string, got {value}",
                                          {"value": _short(args)}) from None
        if not isinstance(args, dict):
            raise PydanticCustomError("invalid_type", "must be a JSON object")
        return args


class ToolCall(StrictBody):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: CallFunction


Content = Annotated[Union[Annotated[str, Tag("text")], Annotated[list[TextPart], Tag("parts")]],
                    by_type("a string or a list of text parts", text=str, parts=list)]


class ChatMessage(StrictBody):
    """One message: role, text content (a string or text parts), an assistant's tool_calls, a tool's
    tool_call_id."""
    role: Literal[ROLES]
    content: Optional[Content] = Field(None, validate_default=True)
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None
    name: Optional[str] = None
    reasoning_content: Optional[str] = None

    @field_validator("content")
    @classmethod
    def _content_by_role(cls, content, info: ValidationInfo):
        if content is None and info.data.get("role", "assistant") != "assistant":     # an assistant's may be null
            raise PydanticCustomError("invalid_type", "must be a string")
        return content

    @field_validator("tool_calls")
    @classmethod
    def _calls_by_role(cls, calls, info: ValidationInfo):
        if info.data.get("role", "assistant") != "assistant":
            raise PydanticCustomError("invalid_value", "is only allowed in assistant messages")
        return calls

    def as_template_reads(self) -> dict:
        """The message as the chat template reads it (text parts joined, arguments as objects)."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.tool_calls is not None:
            out["tool_calls"] = [{"type": "function", "function": {"name": c.function.name,
                                                                   "arguments": c.function.arguments},
                                  **({"id": c.id} if c.id is not None else {})} for c in self.tool_calls]
        if self.role == "tool" and self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        for key in ("name", "reasoning_content"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


def _non_empty(value, handler):
    """By hand: an empty list is refused as invalid_type (tests/service/entrypoints/test_service_http.py), where
    pydantic's min_length says too_short."""
    if isinstance(value, list) and not value:
        raise PydanticCustomError("invalid_type", "must be a non-empty list of {role, content} objects")
    return [m.as_template_reads() for m in handler(value)]


#: ``messages``: validated, as the template reads them (a list of dicts).
Messages = Annotated[list[ChatMessage], WrapValidator(_non_empty)]
_MESSAGES = TypeAdapter(Messages)


def parse_messages(value: Any) -> list[dict]:
    """Validated messages as the template reads them; a 400 naming ``messages[i]...`` when malformed."""
    try:
        return _MESSAGES.validate_python(value)
    except ValidationError as e:
        raise api_error(e, value, at="messages") from None


# --------------------------------------------------------------------------- tools and template kwargs


class _Shape(BaseModel):
    """The shape of a JSON schema object (no validator library in the project): ``type``, ``properties`` and
    ``required`` well-formed where given; every other key as the client wrote it."""
    model_config = ConfigDict(strict=True, extra="allow")
    type: Union[str, list[str], None] = None
    properties: Optional[dict[str, Union[dict, bool]]] = None
    required: Optional[list[str]] = None


def _as_written(value, handler):
    handler(value)               # the checks; the value goes on as the client wrote it (key order, nulls)
    return value


JsonSchema = Annotated[_Shape, WrapValidator(_as_written)]


class FunctionDef(StrictBody):
    name: Annotated[str, StringConstraints(pattern=r"^[\p{L}\p{N}_-]{1,64}$")]
    description: Optional[str] = None
    parameters: Optional[JsonSchema] = None
    strict: Optional[bool] = None


class Tool(StrictBody):
    """``{type: function, function: {name, description?, parameters? (a JSON schema object), strict?}}``."""
    type: Literal["function"] = "function"
    function: FunctionDef

    def as_template_reads(self) -> dict:
        fn = self.function
        return {"type": "function", "function": {k: getattr(fn, k) for k in ("name", "description", "parameters",
                                                                             "strict") if getattr(fn, k) is not None}}


class _FunctionName(StrictBody):
    name: str


class NamedToolChoice(StrictBody):
    type: Literal["function"]
    function: _FunctionName


ToolChoice = Annotated[Union[Annotated[Literal[TOOL_CHOICES], Tag("mode")], Annotated[NamedToolChoice, Tag("named")]],
                       by_type("none, auto, required or {type: function, function: {name}}", mode=str, named=dict)]


class _TemplateKwargs(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    enable_thinking: bool = True

    @model_validator(mode="after")
    def _not_rendering_arguments(self):
        clash = sorted(k for k in self.model_extra or {} if k in RESERVED_TEMPLATE_KWARGS)
        if clash:
            raise PydanticCustomError("invalid_value", "may not set {names} (arguments of the rendering itself)",
                                      {"names": ", ".join(clash)})
        return self


#: ``chat_template_kwargs``: an object passed to the chat template as given (``enable_thinking`` ...).
TemplateKwargs = Annotated[_TemplateKwargs, WrapValidator(_as_written)]


class ChatTools(StrictBody):
    """A chat body's tools, tool_choice, parallel_tool_calls and chat_template_kwargs (vLLM's names)."""
    tools: Optional[Annotated[list[Tool], Field(max_length=MAX_TOOLS)]] = None
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: Optional[bool] = None
    chat_template_kwargs: Optional[TemplateKwargs] = None

    @model_validator(mode="after")
    def _tools_and_choice(self):
        names: set[str] = set()
        for i, tool in enumerate(self.tools or []):
            if tool.function.name in names:
                at = f"tools[{i}].function.name"
                raise bad(f"{at} {tool.function.name!r} is given twice", at)
            names.add(tool.function.name)
        choice = self.tool_choice
        if isinstance(choice, str) and choice != "none" and not self.tools:
            raise bad(f"tool_choice={choice!r} needs tools", "tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise bad(f"tool_choice names the function {choice.function.name!r}, which is not in tools", "tool_choice")
        return self

    def tool_list(self) -> list[dict] | None:
        return [t.as_template_reads() for t in self.tools] if self.tools else None

    def choice(self) -> str | dict:
        """none | auto | required | {type: function, function: {name}}; absent: auto when tools are given, else
        none (OpenAI's and vLLM's default)."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        if isinstance(self.tool_choice, str):
            return self.tool_choice
        return {"type": "function", "function": {"name": self.tool_choice.function.name}}

    def chat_prompt(self, messages: list[dict], auto_tools: bool = True,
               reasoning_parser: str | None = None) -> tuple[ChatPrompt, ChatOutputOptions]:
        """The chat prompt and how its answer is read (vLLM's rules: tools are rendered whatever tool_choice
        says, ``none`` included, and parsed unless it is ``none``; ``auto`` needs the server's auto tool
        choice)."""
        tools, choice, parallel = self.tool_list(), self.choice(), self.parallel_tool_calls
        if choice == "auto" and not auto_tools:
            raise bad('"auto" tool choice needs the server started with --enable-auto-tool-choice '
                      '--tool-call-parser hermes (as vLLM)', "tool_choice")
        constraint = None
        if choice == "required" or isinstance(choice, dict):
            from serve.protocol.tool_constraint import tool_call_grammar
            constraint = tool_call_grammar(tools, choice, parallel is not False)
        options = ChatOutputOptions(reasoning=reasoning_parser is not None,
                                    parse_tools=bool(tools) and choice != "none",
                                    max_calls=1 if parallel is False else None, tool_choice=choice,
                                    constraint=constraint)
        return ChatPrompt(messages, tools, dict(self.chat_template_kwargs or {})), options


# --------------------------------------------------------------------------- one chat request


def chat_request(body: dict, messages: list[dict], auto_tools: bool = True,
                 reasoning_parser: str | None = None) -> tuple[ChatPrompt, ChatOutputOptions]:
    """The chat prompt and how its answer is read, from a chat body's tools, tool_choice, parallel_tool_calls and
    chat_template_kwargs (:meth:`ChatTools.chat_prompt`)."""
    return ChatTools.parse(body).chat_prompt(messages, auto_tools, reasoning_parser)


def constrain(params, options: ChatOutputOptions):
    """``params`` with the tool-call grammar of a required or named tool_choice as its structured output."""
    if options.constraint is None:
        return params
    if getattr(params, "structured_outputs", None) is not None:
        raise bad("tool_choice required or a named function cannot be combined with another structured output "
                  "(response_format, structured_outputs)", "tool_choice")
    if "structured_outputs" not in getattr(type(params), "__dataclass_fields__", {}):
        raise bad("tool_choice required or a named function needs the engine's structured outputs, which this "
                  "engine lacks", "tool_choice", "unsupported_parameter")
    return dataclasses.replace(params, structured_outputs={"grammar": options.constraint})
