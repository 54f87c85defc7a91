"""Stop strings on streamed text: the text a client may see now, and whether a stop string ended it.

A piece of text that could be the start of a stop string is held back until the next piece says
whether it is one, so nothing sent is ever retracted: the text that reaches a client is exactly the
prefix of the full output before the first stop string (plus the stop string itself with vLLM's
``include_stop_str_in_output``), however the output was cut into pieces. When stop strings
overlap, the one whose last character comes first wins (with ``["acc", "a"]``, "bacc" stops at
"a"): the only rule a stream can follow without waiting for text that may never come.
"""
from __future__ import annotations


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
