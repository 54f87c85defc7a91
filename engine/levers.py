"""The lab's levers: LAB_* environment settings that switch an engine mechanism under measurement, each read
here once, with its default. LAB_PREFILL_AHEAD and LAB_GEMV_ROWS refuse a bad value in one line (ConfigError);
LAB_DECODE_PROLOGUE takes anything but 1 and noprefetch as off. The engine reads them at start-up (ModelRunner:
the decode prologue and the GEMV rows; LLMEngine: prefill ahead); ``describe()`` reports what each took, and
``labkit serve``'s banner names LAB_PREFILL_AHEAD and LAB_GEMV_ROWS where they are away from their defaults
(labkit/console/serving.py).

- LAB_PREFILL_AHEAD  (prefill_ahead): prefill | 1 | 0, how far nano-vllm's step model launches ahead of the
  overlapped decode
- LAB_DECODE_PROLOGUE  (decode_prologue_mode): 1 | noprefetch | 0, the q/k norm + RoPE + KV store inside the
  Triton decode kernel
- LAB_GEMV_ROWS  (gemv_rows_setting): 1..8, the decode batches the GEMV kernels take
"""
from __future__ import annotations

import os

from engine.config import Config, ConfigError


#: nano-vllm's step model with the overlapped decode: "prefill" (the default) launches a waiting prefill behind the
#: decode in flight; "1" that, and the decode after a prefill behind that prefill; "0" neither (nano-vllm's order)
PREFILL_AHEAD_ENV = "LAB_PREFILL_AHEAD"
PREFILL_AHEAD_MODES = {"0": (False, False), "prefill": (True, False), "1": (True, True)}
PREFILL_AHEAD_DEFAULT = "prefill"


def prefill_ahead(config: Config) -> tuple[bool, bool]:
    """(Scheduler.prefill_ahead, Scheduler.decode_behind_prefill): whether the scheduler's lookahead may launch a
    waiting prefill behind a decode in flight, and the decode after a prefill behind that prefill. With the
    overlapped decode and nano-vllm's step model only, from LAB_PREFILL_AHEAD (unset: "prefill"). "prefill" keeps
    the step model's choice of steps and only launches the prefill early, so a request that arrives during a decode
    does not also wait for that decode's tokens to be read (docs/MEASURED.md has the TTFT it saved); "1" also
    decides the step after a prefill before its tokens (and so before later arrivals) are in; "0" launches each
    prefill once the decode before it has been read, as nano-vllm does."""
    text = os.environ.get(PREFILL_AHEAD_ENV, PREFILL_AHEAD_DEFAULT).strip() or PREFILL_AHEAD_DEFAULT
    if text not in PREFILL_AHEAD_MODES:
        raise ConfigError(f"{PREFILL_AHEAD_ENV}={text!r}: expected one of {', '.join(PREFILL_AHEAD_MODES)}")
    if not config.overlap or config.mixed_batches:
        return False, False
    return PREFILL_AHEAD_MODES[text]


def prefill_ahead_name(prefill_ahead: bool, decode_behind_prefill: bool) -> str:
    """The LAB_PREFILL_AHEAD value of a scheduler's two switches (describe()'s prefill_ahead, decode_behind_prefill)."""
    return next(k for k, v in PREFILL_AHEAD_MODES.items() if v == (prefill_ahead, decode_behind_prefill))


#: unset or 1: decode steps take the decode prologue with its first tile prefetched; noprefetch: without; 0: off
#: (decode_prologue_mode)
DECODE_PROLOGUE_ENV = "LAB_DECODE_PROLOGUE"
DECODE_PROLOGUE_MODES = {"1": "prefetch", "noprefetch": "plain"}


def decode_prologue_mode(config: Config, attention_backend: str) -> str:
    """How an engine with fused ops takes the decode prologue (triton_kernels.NewTokens), one kernel fewer per
    layer and decode step: "prefetch" (each split's first K/V tile read before the PDL wait) unless
    LAB_DECODE_PROLOGUE says noprefetch ("plain": read after it) or 0 ("": off, the q/k norm + RoPE + store
    kernel before the decode kernel). The Triton backend only, and nano-vllm's step model only: with mixed
    batches a step's decode rows keep the plain decode kernel, whose compiled variants the warm-up then meets."""
    if attention_backend != "triton" or config.mixed_batches:
        return ""
    return DECODE_PROLOGUE_MODES.get(os.environ.get(DECODE_PROLOGUE_ENV, "1"), "")


GEMV_ROWS_ENV = "LAB_GEMV_ROWS"


def gemv_rows_setting() -> int:
    """The most tokens a projection takes through the GEMV kernels (engine/layers/gemv.py) with fused ops:
    LAB_GEMV_ROWS, 1 (batch-1 decode only) unless it names 2..8 (small decode batches too)."""
    from engine.layers import MAX_GEMV_ROWS

    text = os.environ.get(GEMV_ROWS_ENV, "1").strip()
    if not text.isdigit() or not 1 <= int(text) <= MAX_GEMV_ROWS:
        raise ConfigError(f"{GEMV_ROWS_ENV}={text!r}: expected a whole number from 1 to {MAX_GEMV_ROWS}")
    return int(text)
