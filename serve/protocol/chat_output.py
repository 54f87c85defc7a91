"""A chat answer's text as OpenAI's message and deltas: the reasoning (``--reasoning-parser qwen3``), the content
and the tool calls (the hermes parser, when the request's tools are parsed), vLLM's serving_chat shapes.

:class:`ChatOutput` takes the answer's text piece by piece (the stream's pieces, or the whole text at once) and
returns delta objects: ``{"reasoning_content", "reasoning"}`` (vLLM's field and its 0.11+ name, both),
``{"content"}``, and per tool call a first delta ``{"tool_calls": [{"index", "id", "type", "function": {"name",
"arguments": ""}}]}`` then ``{"tool_calls": [{"index", "function": {"arguments"}}]}``. :meth:`ChatOutput.message`
is the same text as one message: ``content`` null when empty, ``tool_calls`` when any, and the reasoning;
``finish_reason`` becomes ``tool_calls`` once a call was parsed (vLLM's rule).
"""
from __future__ import annotations

from dataclasses import dataclass

from serve.protocol.reasoning import Qwen3ReasoningParser
from serve.protocol.tool_parser import HermesToolParser, new_call_id


@dataclass(frozen=True)
class ChatOutputOptions:
    """How a chat request's answer is read: the reasoning split off, tool calls parsed (at most max_calls)."""
    reasoning: bool = False
    parse_tools: bool = False
    max_calls: int | None = None
    tool_choice: "str | dict" = "none"     # none | auto | required | {type: function, function: {name}}
    constraint: str | None = None           # required / named: the grammar of the calls (tool_constraint.py)
    think_opened: bool = False              # the prompt opened <think>: the answer starts in the reasoning

    @property
    def active(self) -> bool:
        return self.reasoning or self.parse_tools


class ChatOutput:
    """One choice's answer through the reasoning and tool-call parsers; see the module docstring."""

    def __init__(self, options: ChatOutputOptions):
        self.options = options
        self._reasoning = Qwen3ReasoningParser(options.think_opened) if options.reasoning else None
        self._tools = HermesToolParser(options.max_calls, options.constraint is not None) \
            if options.parse_tools else None
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: list[dict] = []

    def push(self, text: str) -> list[dict]:
        """The deltas this piece of text makes (maybe none: text held back until the next piece decides)."""
        parts = self._reasoning.push(text) if self._reasoning is not None else [("content", text)]
        return self._deltas(parts, final=False)

    def finish(self, cut: bool = False) -> list[dict]:
        """The deltas of the text still held back, at the end of the answer; ``cut``: the answer was cut by
        ``max_tokens`` (a tool call's tag or block it ends inside is not content)."""
        parts = self._reasoning.finish() if self._reasoning is not None else []
        return self._deltas(parts, final=True, cut=cut)

    def _deltas(self, parts: list[tuple[str, str]], final: bool, cut: bool = False) -> list[dict]:
        out: list[dict] = []
        for kind, text in parts:
            if kind == "reasoning":
                self.reasoning.append(text)
                out.append({"reasoning_content": text, "reasoning": text})
            else:
                out += self._content(self._tools.push(text) if self._tools is not None else [("content", text)])
        if final and self._tools is not None:
            out += self._content(self._tools.finish(cut))
        return out

    def _content(self, events: list[tuple[str, object]]) -> list[dict]:
        out: list[dict] = []
        for kind, value in events:
            if kind == "content":
                if value:
                    self.content.append(value)
                    out.append({"content": value})
                continue
            index = len(self.calls)
            call = {"id": new_call_id(), "type": "function",
                    "function": {"name": value["name"], "arguments": value["arguments"]}}
            self.calls.append(call)
            out.append({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                        "function": {"name": value["name"], "arguments": ""}}]})
            out.append({"tool_calls": [{"index": index, "function": {"arguments": value["arguments"]}}]})
        return out

    def message(self) -> dict:
        """The answer read so far (after :meth:`finish`) as one assistant message."""
        msg: dict = {"role": "assistant", "content": "".join(self.content) or None}
        if self.options.reasoning:
            reasoning = "".join(self.reasoning) or None
            msg["reasoning_content"] = msg["reasoning"] = reasoning
        if self.calls:
            msg["tool_calls"] = self.calls
        return msg

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.calls and reason in ("stop", "length") else reason


def read_message(options: ChatOutputOptions, text: str, cut: bool = False) -> tuple[dict, "ChatOutput"]:
    """A whole answer's text as one message (the stream's parser over one piece); ``cut``: by ``max_tokens``."""
    out = ChatOutput(options)
    out.push(text)
    out.finish(cut)
    return out.message(), out
