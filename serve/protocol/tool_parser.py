"""Qwen3's tool calls in generated text, the way vLLM's ``hermes`` tool parser reads them:
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks.

One incremental parser serves the stream and the whole answer (the whole answer is the stream in one piece),
so a stream's deltas, put together, are the non-stream result by construction:

- text outside the blocks is content; text that might be the start of ``<tool_call>`` is held back until the
  next piece decides, so no raw tag reaches the client;
- a block whose JSON is an object with a string ``name`` and an object ``arguments`` is a call (its arguments
  as a JSON string, vLLM's ``json.dumps(..., ensure_ascii=False)``); any other block stays content as it was
  written, tags included; a block the output ends inside is read the same way (vLLM's unterminated match);
- whitespace between content and a call, or after the last call, is dropped (content that is only the
  newlines around calls is empty); an answer without calls keeps its text exactly;
- ``max_calls`` (``parallel_tool_calls: false``: 1) keeps the first calls and drops the rest, as vLLM does;
- ``constrained`` (``tool_choice`` required or named: the grammar allows only calls): what the output ends inside
  (``max_tokens``) is dropped unless it is a whole call, a tag's first characters and a cut block included, so
  no tag text reaches ``content``; the same for any output cut by ``max_tokens`` (``finish(cut=True)``,
  ``tool_choice`` auto), where the held tag start or the open block may be a call the limit cut (an output
  that ends by itself inside a block keeps it as content, as vLLM does); a block the output ends inside whose
  end tag was begun (``</tool_ca``) is read without that part, so a whole call cut in its end tag is a call.
"""
from __future__ import annotations

import json
import secrets

TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"


def new_call_id() -> str:
    """A tool call's id, vLLM's form (``chatcmpl-tool-`` + 32 hex digits)."""
    return "chatcmpl-tool-" + secrets.token_hex(16)


def parse_call(block: str) -> dict | None:
    """``{"name", "arguments"}`` (arguments a JSON string) from one block's JSON, or None when it is not a call."""
    try:
        obj = json.loads(block.strip())
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if not isinstance(args, dict):
        return None
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


def held_prefix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag`` (held back until decided)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class HermesToolParser:
    """Feed text with :meth:`push`, end with :meth:`finish`; both return events ``("content", text)`` or
    ``("call", {"name", "arguments"})`` in order."""

    def __init__(self, max_calls: int | None = None, constrained: bool = False):
        self.max_calls = max_calls
        self.constrained = constrained  # the output is calls only: an unfinished one at the end is dropped
        self.calls = 0                  # calls emitted
        self._buf = ""                  # text not decided yet
        self._inside = False            # after <tool_call>, before </tool_call>
        self._ws = ""                   # trailing whitespace of the content so far, held back
        self._after_call = False        # the last event was a call: the next content loses its leading whitespace

    def push(self, text: str) -> list[tuple[str, object]]:
        self._buf += text
        out: list[tuple[str, object]] = []
        while True:
            if self._inside:
                j = self._buf.find(TOOL_END)
                if j < 0:
                    return out
                block, self._buf, self._inside = self._buf[:j], self._buf[j + len(TOOL_END):], False
                self._block(block, TOOL_END, out)
            else:
                i = self._buf.find(TOOL_START)
                if i < 0:
                    keep = held_prefix(self._buf, TOOL_START)
                    ready, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                    self._content(ready, out)
                    return out
                self._content(self._buf[:i], out)
                self._buf, self._inside = self._buf[i + len(TOOL_START):], True

    def finish(self, cut: bool = False) -> list[tuple[str, object]]:
        """The events of the text held back; ``cut``: the output was cut by ``max_tokens``."""
        out: list[tuple[str, object]] = []
        rest, self._buf = self._buf, ""
        if self._inside:                # an end tag the output ends inside: the block's JSON may be whole
            rest = rest[:len(rest) - held_prefix(rest, TOOL_END)]
        if self.constrained or (cut and (rest or self._inside)):
            # a cut call: a whole call's JSON is still a call, anything else goes (the whitespace before it too)
            if self._inside and parse_call(rest) is not None:
                self._block(rest, "", out)
            self._inside, self._ws = False, ""
            return out
        if self._inside:
            self._inside = False
            self._block(rest, "", out)
        else:
            self._content(rest, out)
        if self._ws and not self.calls:
            out.append(("content", self._ws))
        self._ws = ""
        return out

    def _block(self, block: str, end: str, out: list) -> None:
        call = parse_call(block)
        if call is None:
            self._content(TOOL_START + block + end, out)
            return
        self._ws = ""
        self._after_call = True
        if self.max_calls is None or self.calls < self.max_calls:
            self.calls += 1
            out.append(("call", call))

    def _content(self, text: str, out: list) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        body = text.rstrip()
        if not body:
            self._ws += text
            return
        out.append(("content", self._ws + body))
        self._ws = text[len(body):]
