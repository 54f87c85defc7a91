"""Qwen3's reasoning in generated text (vLLM's ``--reasoning-parser qwen3``): the ``<think>...</think>`` block
is the reasoning, the text after it the content.

One incremental parser serves the stream and the whole answer, so a stream's deltas put together are the
non-stream result. Text before ``<think>`` is content (as vLLM's stream sends it); after ``</think>`` every
byte is content (the ``\\n\\n`` the model writes after the tag included, as vLLM returns it); a think block the
output ends inside (max_tokens) stays reasoning, as vLLM's stream has sent it. Without ``<think>`` the whole
text is content, so ``enable_thinking: false`` (the template's empty block is in the prompt) gives content
only. A tag cut between two pieces is held back until the next piece decides.

A template that opens the block itself (Qwen3's thinking models write ``<think>\n`` after the generation
prompt) leaves the output to start inside it: ``reasoning</think>answer``. :func:`opened_in_prompt` finds that
in the prompt's token ids, and the parser built with ``opened=True`` starts in the reasoning.
"""
from __future__ import annotations

from serve.protocol.tool_parser import held_prefix

THINK_START, THINK_END = "<think>", "</think>"


class Qwen3ReasoningParser:
    """Feed text with :meth:`push`, end with :meth:`finish`; both return ``("reasoning" | "content", text)``."""

    def __init__(self, opened: bool = False):
        self._state = "reasoning" if opened else "before"     # before <think> | reasoning | after </think>
        self._buf = ""

    def push(self, text: str) -> list[tuple[str, str]]:
        self._buf += text
        out: list[tuple[str, str]] = []
        while self._buf:
            if self._state == "after":
                out.append(("content", self._buf))
                self._buf = ""
                break
            tag, kind = (THINK_START, "content") if self._state == "before" else (THINK_END, "reasoning")
            i = self._buf.find(tag)
            if i < 0:
                keep = held_prefix(self._buf, tag)
                ready = self._buf[:len(self._buf) - keep]
                if ready:
                    out.append((kind, ready))
                self._buf = self._buf[len(ready):]
                break
            if i:
                out.append((kind, self._buf[:i]))
            self._buf = self._buf[i + len(tag):]
            self._state = "reasoning" if self._state == "before" else "after"
        return out

    def finish(self) -> list[tuple[str, str]]:
        rest, self._buf = self._buf, ""
        if not rest:
            return []
        return [("reasoning" if self._state == "reasoning" else "content", rest)]


def opened_in_prompt(tokenizer, prompt_token_ids) -> bool:
    """Whether the prompt ends inside a think block its template opened: a ``<think>`` token with no
    ``</think>`` after it (special-token text a client writes in a message stays text, so only the template
    makes these ids)."""
    if not prompt_token_ids or tokenizer is None:
        return False
    ids = [tokenizer.convert_tokens_to_ids(t) for t in (THINK_START, THINK_END)]
    if any(not isinstance(i, int) or i == getattr(tokenizer, "unk_token_id", None) for i in ids):
        return False
    start, end = ids
    for t in reversed(prompt_token_ids):
        if t == end:
            return False
        if t == start:
            return True
    return False
