"""Whether a constrained request can produce anything at all, checked at admission: a grammar, together with the
request's other token restrictions, that leaves no token is refused before it runs, naming what makes it
impossible.

What is checked (each a :class:`RequestError` whose code names the field: ``invalid_structured_outputs``,
``invalid_allowed_token_ids``, ``invalid_min_tokens``):

- the grammar's first step allows no token at all (an empty language, e.g. the regex ``[^\\s\\S]``);
- ``allowed_token_ids`` holds none of the tokens the grammar allows first;
- ``min_tokens`` holds back EOS while the grammar allows nothing but its end first;
- a ``choice``: no choice can be spelled with ``allowed_token_ids`` alone, or ``min_tokens`` is more than the
  most tokens any choice can be spelled in (its UTF-8 bytes, at most).

What only a path through the grammar decides (a regex that ends after a few tokens with a large ``min_tokens``,
a late token outside ``allowed_token_ids``) is not searched for here: such a request ends when the grammar leaves
no token, without emitting one, with ``finish_reason`` ``abort`` (engine/scheduler.py).
"""
from __future__ import annotations

import weakref

import numpy as np
import torch

from engine.errors import RequestError


def _allowed(bitmask: torch.Tensor, vocab_size: int) -> np.ndarray:
    """A one-row xgrammar bitmask (int32 words, token i at bit i % 32 of word i // 32) as one bool per token id."""
    bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")
    return bits[:vocab_size].astype(bool)


_SPELLINGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()     # Grammars -> its _spellings


def _spellings(grammars, info) -> tuple[list[bytes], dict[bytes, int], int]:
    """Each token's bytes, each ordinary token's bytes -> a token id, and the longest token (special tokens
    cannot spell a choice); made once per engine's Grammars."""
    hit = _SPELLINGS.get(grammars)
    if hit is None:
        decoded = list(info.decoded_vocab)
        special = set(info.special_token_ids) | set(info.stop_token_ids)
        vocab = {b: i for i, b in enumerate(decoded) if b and i not in special}
        hit = _SPELLINGS[grammars] = (decoded, vocab, max(map(len, vocab), default=1))
    return hit


def _most_tokens(text: bytes, vocab: dict[bytes, int], longest: int, allowed: set[int] | None) -> int | None:
    """The most tokens ``text`` can be spelled in (None: it cannot be spelled)."""
    best: list[int | None] = [0] + [None] * len(text)
    for i in range(len(text)):
        if best[i] is None:
            continue
        for j in range(i + 1, min(len(text), i + longest) + 1):
            tid = vocab.get(text[i:j])
            if tid is not None and (allowed is None or tid in allowed):
                best[j] = max(best[j] or 0, best[i] + 1)
    return best[-1]


def _most_tokens_any(text: bytes, grammars, info, allowed: set[int] | None) -> int | None:
    decoded, vocab, longest = _spellings(grammars, info)
    if allowed is not None:         # a few allowed ids: their own spellings (one token may share another's bytes)
        vocab = {decoded[t]: t for t in allowed if t < len(decoded) and decoded[t]}
        longest = max(map(len, vocab), default=1)
    return _most_tokens(text, vocab, longest, allowed)


def check(grammars, params) -> None:
    """Refuse ``params`` (a SamplingParams with structured_outputs) when it can produce nothing; see the module
    docstring. ``grammars``: the engine's :class:`~engine.sampling.structured.Grammars` (None: not checked).
    One mask of the grammar's first step; the choice spellings only when min_tokens or allowed_token_ids ask."""
    so = params.structured_outputs
    if grammars is None or so is None or params.max_tokens == 0:
        return
    import xgrammar as xgr

    compiled = grammars.compile(so)
    mask = xgr.allocate_token_bitmask(1, grammars.vocab_size)
    grammars.matcher(so).matcher.fill_next_token_bitmask(mask, 0)
    first = _allowed(mask, grammars.vocab_size)
    if not bool(first.any()):
        raise RequestError(f"structured_outputs.{so.kind} allows no output at all (its language is empty)",
                           "invalid_structured_outputs")
    allowed = None
    if params.allowed_token_ids is not None:
        allowed = {t for t in params.allowed_token_ids if 0 <= t < grammars.vocab_size}
        keep = np.zeros_like(first)
        keep[sorted(allowed)] = True
        first = first & keep
        if not bool(first.any()):
            raise RequestError(f"allowed_token_ids holds none of the tokens structured_outputs.{so.kind} allows "
                               f"first: the output could not start", "invalid_allowed_token_ids")
    held = {t for t in set(params.stop_token_ids) | (set() if params.ignore_eos else set(grammars.eos_token_ids))
            if 0 <= t < grammars.vocab_size}
    if params.min_tokens > 0 and int(first.sum()) == sum(bool(first[t]) for t in held):
        raise RequestError(f"min_tokens={params.min_tokens} holds back the end of output, the only token "
                           f"structured_outputs.{so.kind} allows first", "invalid_min_tokens")
    if so.kind != "choice" or (allowed is None and params.min_tokens == 0):
        return
    info = compiled.tokenizer_info
    counts = [_most_tokens_any(c.encode("utf-8"), grammars, info, allowed) for c in so.choice]
    spelled = [n for n in counts if n is not None]
    if not spelled:
        raise RequestError("allowed_token_ids cannot spell any of structured_outputs.choice",
                           "invalid_allowed_token_ids")
    if params.min_tokens > max(spelled) and held & set(grammars.eos_token_ids):
        raise RequestError(f"min_tokens={params.min_tokens} is more than the {max(spelled)} tokens the longest "
                           f"spelling of any structured_outputs.choice takes", "invalid_min_tokens")
