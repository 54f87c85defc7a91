"""Detokenizing for the HTTP front (vLLM's ``detokenizer.py`` and ``logprobs.py``): token ids to text pieces
that never split a UTF-8 character (:class:`IncrementalText`, over :func:`text_decoder`), stop strings on the
streamed text (:class:`StopStrings`) and token log-probs in OpenAI's shapes (:class:`LogprobsFormat`).

Stop strings: a piece of text that could be the start of a stop string is held back until the next piece says
whether it is one, so nothing sent is ever retracted: the text that reaches a client is exactly the
prefix of the full output before the first stop string (plus the stop string itself with vLLM's
``include_stop_str_in_output``), however the output was cut into pieces. When stop strings
overlap, the one whose last character comes first wins (with ``["acc", "a"]``, "bacc" stops at
"a"): the only rule a stream can follow without waiting for text that may never come.
"""
from __future__ import annotations

import functools
from typing import Callable


@functools.lru_cache(maxsize=8)
def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """``tokenizer.decode(ids, skip_special_tokens=True)`` as a function. For a fast tokenizer without space
    clean-up that is its Rust tokenizer's decode under a Python layer that costs about twice the decode;
    that decode is used directly once it gave the same text on a probe set (every special id, ids across
    the vocabulary, split multi-byte characters), else the tokenizer's own."""
    def full(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "decode") or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return full

    def fast(ids: list[int]) -> str:
        return backend.decode(ids, skip_special_tokens=True)

    size = len(tokenizer)
    specials = list(getattr(tokenizer, "all_special_ids", []) or [])
    spread = [(i * 7919 + 13) % size for i in range(256)]
    probes = [[t] for t in specials + spread] + [spread[i:i + 5] for i in range(0, 256, 5)] \
        + [specials + spread[:8], tokenizer.encode("héllo wörld ✓ 你好 🙂 \n\t x")]
    probes += [p[:k] for p in probes[-1:] for k in range(1, len(p))]
    try:
        same = all(fast(p) == full(p) for p in probes)
    except Exception:
        same = False
    return fast if same else full


class IncrementalText:
    """Turns a growing list of token ids into text pieces without splitting a UTF-8 character.

    The window ids[prefix:] after a clean boundary is decoded once per token and compared with the text
    it had when last emitted (kept, not decoded again); a piece that ends in the replacement character
    (an incomplete multi-byte sequence) is held back until the next token. Once the window is longer
    than ``WINDOW`` ids it restarts at the previous emit boundary (one more decode then), so a decode
    never covers more than about WINDOW ids and always keeps one emitted piece of left context.

    Hand-written rather than tokenizers' ``DecodeStream``, which gives the same pieces but has no flush: an
    output cut inside a multi-byte character (max_tokens) never streams the U+FFFD its full decode ends with, so
    the streamed text would differ from the whole answer's (test_detokenize_library.py shows it).
    """

    WINDOW = 8

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0          # ids[:prefix] are settled text
        self.read = 0            # ids[:read] have been emitted
        self._seen = ""          # the text of ids[prefix:read]
        self._decoder = text_decoder(tokenizer) if tokenizer is not None else None

    def _decode(self, ids: list[int]) -> str:
        return self._decoder(ids) if ids else ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self.tokenizer is None:
            return ""
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(self._seen) and not after.endswith("\ufffd"):
            piece = after[len(self._seen):]
            last, self.read = self.read, len(self.ids)
            if self.read - self.prefix > self.WINDOW:
                self.prefix = last
                self._seen = self._decode(self.ids[last:self.read])
            else:
                self._seen = after
            return piece
        return ""

    def flush(self) -> str:
        """At the end of the output: what push() held back (an incomplete character decodes as U+FFFD)."""
        if self.tokenizer is None or self.read == len(self.ids):
            return ""
        before = self._seen
        after = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        self._seen = ""
        return after[len(before):] if after.startswith(before) else after

    def text(self) -> str:
        return self._decode(self.ids) if self.tokenizer is not None else ""



class StopStrings:
    """Feed text pieces with :meth:`push`; each call returns the text that is safe to send now.

    Once a stop string is found :attr:`matched` is that string and every later push returns "".
    At the end of the output :meth:`flush` returns what was held back (no stop string came)."""

    def __init__(self, stops: list[str], include_stop: bool = False):
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop
        self.matched: str | None = None
        self._held = ""

    def push(self, piece: str) -> str:
        if self.matched is not None or not piece:
            return ""
        if not self.stops:
            return piece
        text = self._held + piece
        # the stop string that is complete first (smallest end; then the longest), as a stream sees it
        hits = [(i + len(s), i, s) for s in self.stops if (i := text.find(s)) >= 0]
        if hits:
            _, i, stop = min(hits)
            self.matched = stop
            self._held = ""
            return text[:i] + (stop if self.include_stop else "")
        keep = self._partial(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        out, self._held = self._held, ""
        return out if self.matched is None else ""

    def _partial(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best


class LogprobsFormat:
    """Token log-probs (the worker's ``[id, log-prob, rank, [[id, log-prob], ...]]``) in OpenAI's shapes:
    completions ``{tokens, token_logprobs, top_logprobs, text_offset}`` (top_logprobs maps token text to
    log-prob, the chosen token first, as vLLM), chat ``{content: [{token, logprob, bytes,
    top_logprobs: [{token, logprob, bytes}]}]}``. A token's text is its own decode; -inf (a token a
    processor removed, processed_logprobs only) is sent as -9999.0, as vLLM does."""

    def __init__(self, tokenizer, chat: bool, as_ids: bool = False):
        self.tokenizer = tokenizer
        self.chat = chat
        self.as_ids = as_ids          # vLLM's return_tokens_as_token_ids: "token_id:N" instead of the text

    def _text(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self.tokenizer.decode([token_id])

    @staticmethod
    def _num(v: float | None) -> float | None:
        return None if v is None else max(float(v), -9999.0)

    def item(self, entry: list | None, c, token_id: int | None = None):
        """One token's item; entry None (the first prompt token) has no log-prob. ``c`` is the choice the item
        belongs to: completions advance its ``text_offset``."""
        tid = entry[0] if entry is not None else token_id
        text = self._text(tid)
        if self.chat:
            return {"token": text, "logprob": self._num(entry[1]), "bytes": list(text.encode("utf-8")),
                    "top_logprobs": [{"token": (t := self._text(i)), "logprob": self._num(v),
                                      "bytes": list(t.encode("utf-8"))} for i, v in entry[3]]}
        offset = c.text_offset
        c.text_offset += len(text)
        if entry is None:
            return (text, None, None, offset)
        top = {text: self._num(entry[1])}          # vLLM's order: the chosen token first, then the alternatives
        for i, v in entry[3]:
            top.setdefault(self._text(i), self._num(v))
        return (text, self._num(entry[1]), top, offset)

    def obj(self, items: list) -> dict:
        if self.chat:
            return {"content": list(items), "refusal": None}
        return {"tokens": [i[0] for i in items], "token_logprobs": [i[1] for i in items],
                "top_logprobs": [i[2] for i in items], "text_offset": [i[3] for i in items]}
