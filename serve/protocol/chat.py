"""A chat request as the model's chat template sees it (vLLM's ``chat_utils``): messages (text, an assistant's
``tool_calls``, ``tool`` results), ``tools``, ``tool_choice``, ``parallel_tool_calls`` and
``chat_template_kwargs``, validated; and :func:`render`, the one rendering of them the server uses.

The prompt is exactly ``tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
tokenize=False, **chat_template_kwargs)`` (a ``developer`` message as ``system``): the template's own default for thinking (Qwen3: on), as vLLM
serves it. ``chat_template_kwargs`` go to the template as given (a key the template does not read changes
nothing, as in vLLM), except the names of ``apply_chat_template``'s own arguments, which are refused.
An assistant's ``tool_calls[j].function.arguments`` (a JSON string, as OpenAI sends it) is parsed into an
object before rendering, as vLLM does, so the template writes it with its own ``tojson``.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from serve.protocol.chat_output import ChatOutputOptions
from serve.protocol.wire import ApiError

ROLES = ("system", "developer", "user", "assistant", "tool")
#: apply_chat_template's own arguments: not for chat_template_kwargs.
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                      "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                                      "truncation", "max_length", "return_tensors", "return_dict",
                                      "return_assistant_tokens_mask", "tokenizer_kwargs"})
TOOL_CHOICES = ("none", "auto", "required")
MAX_TOOLS = 128


def bad(message: str, param: str | None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code, param)


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


def parse_messages(value: Any) -> list[dict]:
    """Validated messages: role, text content (string or text parts), an assistant's tool_calls, a tool's
    tool_call_id; each a 400 naming ``messages[i]...`` when malformed."""
    if not isinstance(value, list) or not value:
        raise bad("messages must be a non-empty list of {role, content} objects", "messages", "invalid_type")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(value)]


def _message(m: Any, where: str) -> dict:
    if not isinstance(m, dict):
        raise bad(f"{where} must be an object", where, "invalid_type")
    role = m.get("role")
    if role not in ROLES:
        raise bad(f"{where}.role must be one of {', '.join(ROLES)}, got {_short(role)}", f"{where}.role")
    content = _content(m.get("content"), where)
    calls = m.get("tool_calls")
    if content is None and role == "assistant":
        content = ""
    if content is None:
        raise bad(f"{where}.content must be a string", f"{where}.content", "invalid_type")
    out: dict[str, Any] = {"role": role, "content": content}
    if calls is not None:
        if role != "assistant":
            raise bad(f"{where}.tool_calls is only allowed in assistant messages", f"{where}.tool_calls")
        out["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
    if role == "tool" and m.get("tool_call_id") is not None:
        if not isinstance(m["tool_call_id"], str):
            raise bad(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id", "invalid_type")
        out["tool_call_id"] = m["tool_call_id"]
    for key in ("name", "reasoning_content"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    return out


def _content(content: Any, where: str) -> str | None:
    if isinstance(content, list):        # content parts: only text is understood
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad(f"{where}.content[{j}] must be a text part {{type: text, text}}", f"{where}.content",
                          "unsupported_content")
            texts.append(part["text"])
        return "".join(texts)
    if content is not None and not isinstance(content, str):
        raise bad(f"{where}.content must be a string", f"{where}.content", "invalid_type")
    return content


def _tool_calls(calls: Any, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise bad(f"{where} must be a list", where, "invalid_type")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"{at} must be {{id, type: function, function: {{name, arguments}}}}", at, "invalid_type")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except ValueError:
                raise bad(f"{at}.function.arguments must be a JSON object string, got {_short(args)}",
                          f"{at}.function.arguments") from None
        if not isinstance(args, dict):
            raise bad(f"{at}.function.arguments must be a JSON object", f"{at}.function.arguments", "invalid_type")
        one = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call.get("id"), str):
            one["id"] = call["id"]
        out.append(one)
    return out


# --------------------------------------------------------------------------- tools and template kwargs


def parse_tools(value: Any) -> list[dict] | None:
    """``tools``: a list of {type: function, function: {name, description?, parameters? (a JSON schema object),
    strict?}}; None or [] for none."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad(f"tools must be a list, got {_short(value)}", "tools", "invalid_type")
    if len(value) > MAX_TOOLS:
        raise bad(f"tools may hold at most {MAX_TOOLS} functions, got {len(value)}", "tools")
    out, names = [], set()
    for i, tool in enumerate(value):
        at = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise bad(f"{at} must be {{type: function, function: {{name, description, parameters}}}}", at,
                      "invalid_type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad(f"{at}.function must be an object {{name, description, parameters}}", f"{at}.function",
                      "invalid_type")
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64 or not all(c.isalnum() or c in "_-" for c in name):
            raise bad(f"{at}.function.name must be 1-64 letters, digits, '_' or '-', got {_short(name)}",
                      f"{at}.function.name")
        if name in names:
            raise bad(f"{at}.function.name {name!r} is given twice", f"{at}.function.name")
        names.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise bad(f"{at}.function.description must be a string", f"{at}.function.description", "invalid_type")
        params = fn.get("parameters")
        if params is not None:
            _check_schema(params, f"{at}.function.parameters")
        clean = {k: fn[k] for k in ("name", "description", "parameters", "strict") if fn.get(k) is not None}
        out.append({"type": "function", "function": clean})
    return out or None


def _check_schema(schema: Any, where: str) -> None:
    """The shape of a JSON schema object (no validator library in the project): an object whose ``type``,
    ``properties`` and ``required`` are well-formed where given."""
    if not isinstance(schema, dict):
        raise bad(f"{where} must be a JSON schema object", where, "invalid_type")
    kind = schema.get("type")
    if kind is not None and not (isinstance(kind, str) or (isinstance(kind, list) and
                                                           all(isinstance(k, str) for k in kind))):
        raise bad(f"{where}.type must be a string or a list of strings", f"{where}.type", "invalid_type")
    props = schema.get("properties")
    if props is not None and not (isinstance(props, dict) and all(isinstance(v, (dict, bool)) for v in props.values())):
        raise bad(f"{where}.properties must be an object of schemas", f"{where}.properties", "invalid_type")
    required = schema.get("required")
    if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        raise bad(f"{where}.required must be a list of property names", f"{where}.required", "invalid_type")


def parse_template_kwargs(value: Any) -> dict:
    """``chat_template_kwargs``: an object passed to the chat template (``enable_thinking`` ...)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad(f"chat_template_kwargs must be an object, got {_short(value)}", "chat_template_kwargs",
                  "invalid_type")
    clash = sorted(k for k in value if k in RESERVED_TEMPLATE_KWARGS)
    if clash:
        raise bad(f"chat_template_kwargs may not set {', '.join(clash)} (arguments of the rendering itself)",
                  "chat_template_kwargs")
    if "enable_thinking" in value and not isinstance(value["enable_thinking"], bool):
        raise bad("chat_template_kwargs.enable_thinking must be true or false", "chat_template_kwargs.enable_thinking",
                  "invalid_type")
    return dict(value)


def parse_tool_choice(value: Any, tools: list[dict] | None) -> str | dict:
    """``tool_choice``: none | auto | required | {type: function, function: {name}} naming one of ``tools``.
    Absent: auto when tools are given, else none (OpenAI's and vLLM's default)."""
    if value is None:
        return "auto" if tools else "none"
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise bad(f"tool_choice must be none, auto, required or {{type: function, function: {{name}}}}, "
                      f"got {_short(value)}", "tool_choice")
        if value != "none" and not tools:
            raise bad(f"tool_choice={value!r} needs tools", "tool_choice")
        return value
    fn = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad(f"tool_choice must be none, auto, required or {{type: function, function: {{name}}}}, "
                  f"got {_short(value)}", "tool_choice", "invalid_type")
    if name not in {t["function"]["name"] for t in tools or []}:
        raise bad(f"tool_choice names the function {name!r}, which is not in tools", "tool_choice")
    return {"type": "function", "function": {"name": name}}


# --------------------------------------------------------------------------- one chat request


def chat_request(body: dict, messages: list[dict], auto_tools: bool = True,
                 reasoning_parser: str | None = None) -> tuple[ChatPrompt, ChatOutputOptions]:
    """The chat prompt and how its answer is read, from a chat body's tools, tool_choice, parallel_tool_calls and
    chat_template_kwargs (vLLM's rules: tools are rendered whatever tool_choice says, ``none`` included, and
    parsed unless it is ``none``; ``auto`` needs the server's auto tool choice)."""
    tools = parse_tools(body.get("tools"))
    choice = parse_tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad(f"parallel_tool_calls must be true or false, got {_short(parallel)}", "parallel_tool_calls",
                  "invalid_type")
    if choice == "auto" and not auto_tools:
        raise bad('"auto" tool choice needs the server started with --enable-auto-tool-choice '
                  '--tool-call-parser hermes (as vLLM)', "tool_choice")
    kwargs = parse_template_kwargs(body.get("chat_template_kwargs"))
    constraint = None
    if choice == "required" or isinstance(choice, dict):
        from serve.protocol.tool_constraint import tool_call_grammar
        constraint = tool_call_grammar(tools, choice, parallel is not False)
    options = ChatOutputOptions(reasoning=reasoning_parser is not None, parse_tools=bool(tools) and choice != "none",
                                max_calls=1 if parallel is False else None, tool_choice=choice, constraint=constraint)
    return ChatPrompt(messages, tools, kwargs), options


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
