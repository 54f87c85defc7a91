"""The lab's levers: LAB_* environment settings that switch an engine mechanism under measurement, each read
here once, with its default, through one reader (:func:`_setting`) that refuses a value it does not know in one line
(ConfigError). The engine reads them at start-up (ModelRunner: the decode prologue, the GEMV rows and the decode
layer; LLMEngine: prefill ahead); ``describe()`` reports what each took, and ``labkit serve``'s banner names each
one away from its default (labkit/console/serving.py).

- LAB_PREFILL_AHEAD  (prefill_ahead): prefill | 1 | prefills | 0, how far nano-vllm's step model launches ahead of
  the overlapped decode
- LAB_DECODE_PROLOGUE  (decode_prologue_mode): 1 | noprefetch | 0, the q/k norm + RoPE + KV store inside the
  Triton decode kernel
- LAB_GEMV_ROWS  (gemv_rows_setting): 1..8, the decode batches the GEMV kernels take
- LAB_DECODE_LAYER  (decode_layer_on): 0 | 1, a batch-1 decode step's layers each as one persistent kernel
  (engine/layers/decode_layer.py)
- LAB_L2_PREFETCH  (l2_prefetch_mode): 0 | mlp | layer, the weights a small decode's attention kernel asks L2 for
  (engine/l2_prefetch.py)
- LAB_FP8_V_T  (fp8_v_transposed): 0 | 1, an e4m3 V cache's blocks hold each head's positions contiguous
  (engine/attention/kv_quant.py: v_t)
- LAB_FP8_DECODE  (fp8_decode_knobs): e.g. ``warps=8,stages=4,page_tile=0,v_in_tile=1,maxnreg=none``, the Triton
  decode kernel's knobs on an e4m3 cache in place of engine/attention/splits.py's DECODE_FP8_* lines (a sweep's
  candidate timed on a whole workload before those lines change)
- LAB_ADMIT_IN_FLIGHT  (admit_in_flight): 1 | 0, whether a serving engine admits requests that arrive while a prefill
  is in flight with nothing launched behind it, and launches their prefill behind it
- LAB_DECODE  (decode_knobs): e.g. ``kv_per_prog=4,page_tile=1,block_n=32,warps=8,stages=3``, the same kernel's
  knobs on a cache in the model's dtype in place of splits.py's DECODE_* lines, the splits' too (block_n, waves,
  kv_per_prog: the warm-up compiles the variants they make)
"""
from __future__ import annotations

import os

from engine.config import Config, ConfigError


#: nano-vllm's step model with the overlapped decode: "prefill" launches a waiting prefill behind the decode in
#: flight; "1" that, and the decode after a prefill behind that prefill; "prefills" (the default) that, and a waiting
#: prefill behind a prefill in flight too; "0" none (nano-vllm's order). Each mode's three switches:
#: (Scheduler.prefill_ahead, Scheduler.decode_behind_prefill, Scheduler.prefill_behind_prefill)
PREFILL_AHEAD_ENV = "LAB_PREFILL_AHEAD"
PREFILL_AHEAD_MODES = {"0": (False, False, False), "prefill": (True, False, False), "1": (True, True, False),
                       "prefills": (True, False, True)}
PREFILL_AHEAD_DEFAULT = "prefills"


def _setting(env: str, choices, default: str, expected: str = "") -> str:
    """The value of lever ``env`` (unset or blank: ``default``), refused in one line unless one of ``choices``
    (the refusal says ``expected``, else lists them)."""
    text = os.environ.get(env, default).strip() or default
    if text not in choices:
        raise ConfigError(f"{env}={text!r}: expected {expected or 'one of ' + ', '.join(choices)}")
    return text


def prefill_ahead(config: Config) -> tuple[bool, bool, bool]:
    """(Scheduler.prefill_ahead, Scheduler.decode_behind_prefill, Scheduler.prefill_behind_prefill): whether the
    scheduler's lookahead may launch a waiting prefill behind a decode in flight, the decode after a prefill behind
    that prefill, and a waiting prefill behind a prefill in flight. With the overlapped decode and nano-vllm's step
    model only, from LAB_PREFILL_AHEAD (unset: "prefills"). "prefill" keeps the step model's choice of steps and only
    launches the prefill early, so a request that arrives during a decode does not also wait for that decode's
    tokens to be read (docs/MEASURED.md has the TTFT it saved); "prefills", the default, also launches the prefill
    of requests still waiting behind a prefill in flight (in a burst of arrivals: the step the step model takes
    next), so the host builds its inputs while the GPU computes, where a prompt that shares a prefix with the
    prefill in flight misses that hit (a prefill's blocks enter the prefix cache when its tokens are read; on an
    H100 it removed the GPU's idle before each prefill of a burst, docs/MEASURED.md); "1" decides the step after a
    prefill before its tokens (and so before later arrivals) are in; "0" launches each prefill once the step before
    it has been read, as nano-vllm does."""
    text = _setting(PREFILL_AHEAD_ENV, PREFILL_AHEAD_MODES, PREFILL_AHEAD_DEFAULT)
    if not config.overlap or config.mixed_batches:
        return False, False, False
    return PREFILL_AHEAD_MODES[text]


def prefill_ahead_name(prefill_ahead: bool, decode_behind_prefill: bool, prefill_behind_prefill: bool = False) -> str:
    """The LAB_PREFILL_AHEAD value of a scheduler's three switches (describe()'s prefill_ahead, decode_behind_prefill
    and prefill_behind_prefill)."""
    switches = (prefill_ahead, decode_behind_prefill, prefill_behind_prefill)
    return next(k for k, v in PREFILL_AHEAD_MODES.items() if v == switches)


ADMIT_IN_FLIGHT_ENV = "LAB_ADMIT_IN_FLIGHT"
ADMIT_IN_FLIGHT_DEFAULT = "1"


def admit_in_flight(config: Config) -> bool:
    """Whether the overlapped step, with a prefill in flight and nothing launched behind it, asks its host for
    requests that arrived meanwhile (LLMEngine.arrivals, which a serving worker sets) until that prefill ends, and
    launches their prefill behind it: on unless LAB_ADMIT_IN_FLIGHT=0, in nano-vllm's step model with the overlapped
    decode and LAB_PREFILL_AHEAD=prefills (the default) only. Without it a prefill is launched behind a prefill only
    for prompts already waiting when the lookahead runs, so a burst that reaches the engine no faster than its
    prefills take it leaves each prefill to start after the one before was read, its inputs built with the GPU idle;
    with it the owner thread polls for arrivals while the GPU computes (on an H200 it took the served/offline ratio
    of the rate sweep from 0.94 to 0.97, docs/MEASURED.md)."""
    on = _setting(ADMIT_IN_FLIGHT_ENV, ("0", "1"), ADMIT_IN_FLIGHT_DEFAULT) == "1"
    return on and prefill_ahead(config)[2]


#: unset or 1: decode steps take the decode prologue with its first tile prefetched; noprefetch: without; 0: off
#: (decode_prologue_mode)
DECODE_PROLOGUE_ENV = "LAB_DECODE_PROLOGUE"
DECODE_PROLOGUE_MODES = {"1": "prefetch", "noprefetch": "plain", "0": ""}


def decode_prologue_mode(config: Config, attention_backend: str) -> str:
    """How an engine with fused ops takes the decode prologue (triton_kernels.NewTokens), one kernel fewer per
    layer and decode step: "prefetch" (each split's first K/V tile read before the PDL wait) unless
    LAB_DECODE_PROLOGUE says noprefetch ("plain": read after it) or 0 ("": off, the q/k norm + RoPE + store
    kernel before the decode kernel); another value is refused. The Triton backend only, and nano-vllm's step
    model only: with mixed batches a step's decode rows keep the plain decode kernel, whose compiled variants the
    warm-up then meets."""
    mode = DECODE_PROLOGUE_MODES[_setting(DECODE_PROLOGUE_ENV, DECODE_PROLOGUE_MODES, "1")]
    if attention_backend != "triton" or config.mixed_batches:
        return ""
    return mode


GEMV_ROWS_ENV = "LAB_GEMV_ROWS"


def gemv_rows_setting() -> int:
    """The most tokens a projection takes through the GEMV kernels (engine/layers/gemv.py) with fused ops:
    LAB_GEMV_ROWS, 1 (batch-1 decode only; unset or blank) unless it names 2..8 (small decode batches too)."""
    from engine.layers import MAX_GEMV_ROWS

    return int(_setting(GEMV_ROWS_ENV, [str(n) for n in range(1, MAX_GEMV_ROWS + 1)], "1",
                        f"a whole number from 1 to {MAX_GEMV_ROWS}"))


SKINNY_GEMM_ENV = "LAB_SKINNY_GEMM"


def skinny_rows_setting() -> int:
    """The most tokens a projection takes through the split-K GEMM (engine/layers/skinny_gemm.py) with fused ops:
    LAB_SKINNY_GEMM, 0 (off; unset or blank) or 2..64 (a small decode batch's projections, cuBLAS's beyond). Off
    unless asked until a lease times it against cuBLAS (tools/gpu/h200_session.sh skinny)."""
    from engine.layers import MAX_SKINNY_ROWS

    return int(_setting(SKINNY_GEMM_ENV, ["0", *(str(n) for n in range(2, MAX_SKINNY_ROWS + 1))], "0",
                        f"0 (off) or a whole number from 2 to {MAX_SKINNY_ROWS}"))


DECODE_LAYER_ENV = "LAB_DECODE_LAYER"


def decode_layer_on(attention_backend: str) -> bool:
    """Whether a batch-1 decode step runs each decoder layer as one persistent kernel (engine/layers/decode_layer.py;
    the layer takes it where its case holds: Qwen3DecoderLayer.decode_layer_ok): LAB_DECODE_LAYER=1, with the Triton
    backend (the kernel's attention is the Triton decode's). Off unless asked: timed against the six kernels a layer
    it replaces (tools/gpu/h200_session.sh layer), it ran slower from CUDA graphs (docs/MEASURED.md)."""
    return _setting(DECODE_LAYER_ENV, ("0", "1"), "0") == "1" and attention_backend == "triton"


L2_PREFETCH_ENV = "LAB_L2_PREFETCH"


def l2_prefetch_mode(prologue: str) -> str:
    """Which weights each layer's decode attention asks L2 for while it runs (engine/l2_prefetch.py): LAB_L2_PREFETCH
    mlp (the layer's o, gate_up and down), layer (those and the next layer's qkv) or 0 (none, unset or blank);
    another value is refused. Only through the decode prologue (``prologue``, decode_prologue_mode's): "0" without
    it. Off unless asked: timed at batch 1 (tools/gpu/h200_session.sh l2) it was slower (docs/MEASURED.md)."""
    from engine.l2_prefetch import MODES

    mode = _setting(L2_PREFETCH_ENV, MODES, "0")
    return mode if prologue else "0"


FP8_V_T_ENV = "LAB_FP8_V_T"


def fp8_v_transposed(config: Config) -> bool:
    """Whether an e4m3 KV pool lays its V blocks out [Hk, D, block_size], each head's positions contiguous, so the
    decode kernel's V tile reaches the P.V dot as position runs instead of one byte at a time
    (engine/attention/kv_quant.py: v_t): LAB_FP8_V_T=1 with ``--kv-cache-dtype fp8``; 0 (unset or blank) keeps V
    as K is laid out. Read (and a bad value refused) whatever the cache. Compiled for sm_90 its decode loop takes
    482 instructions a tile against 662 (tools/kernel_resources.py), yet timed on an H100's nano-vllm workload it was
    slower (docs/MEASURED.md): off unless asked."""
    on = _setting(FP8_V_T_ENV, ("0", "1"), "0") == "1"
    return on and config.kv_cache_dtype == "fp8"


FP8_DECODE_ENV = "LAB_FP8_DECODE"
#: LAB_FP8_DECODE's keys: each one's paged_decode argument and the values it takes
FP8_DECODE_KNOBS = {"warps": ("num_warps", ("2", "4", "8", "16")), "stages": ("num_stages", tuple("12345678")),
                    "page_tile": ("page_tile", ("0", "1")), "v_in_tile": ("fp8_v_in_tile", ("0", "1")),
                    "maxnreg": ("max_registers", ("none", *(str(n) for n in range(32, 257, 8))))}


_FLAGS = ("fp8_v_in_tile", "page_tile")          # the knobs that take 0 | 1 (paged_decode's bools)


def _knobs(env: str, table: dict) -> dict:
    """Lever ``env``'s ``key=value`` pairs (comma separated) as paged_decode's keyword arguments by ``table`` (key ->
    (argument, allowed values)); an unknown key or value refused in one line (ConfigError)."""
    text = os.environ.get(env, "").strip()
    knobs: dict = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        key, value = key.strip(), value.strip().lower()
        if key not in table:
            raise ConfigError(f"{env}={text!r}: {key!r} is not a knob; expected key=value pairs of {', '.join(table)}")
        arg, allowed = table[key]
        if value not in allowed:
            raise ConfigError(f"{env}={text!r}: {key}={value!r}; expected one of "
                              f"{', '.join(allowed) if len(allowed) < 10 else 'none or a multiple of 8 from 32 to 256'}")
        knobs[arg] = 0 if value == "none" else value == "1" if arg in _FLAGS else int(value)     # maxnreg=none: 0
    return knobs


def fp8_decode_knobs(config: Config, attention_backend: str) -> dict:
    """The Triton decode kernel's knobs on an e4m3 cache, from LAB_FP8_DECODE (``key=value`` pairs, comma
    separated: warps, stages, page_tile 0|1, v_in_tile 0|1, maxnreg a multiple of 8 from 32 to 256 or none: no cap), as
    paged_decode's keyword arguments (engine/attention/triton_kernels.py); the knobs left out keep splits.py's
    DECODE_FP8_* values. Read (and a bad value refused in one line) whatever the engine; {} unless the cache is fp8
    and the backend Triton's. None of these knobs changes how a context splits, so the warm-up's compiled variants
    still cover the steps (engine/attention/splits.py: decode_variants)."""
    knobs = _knobs(FP8_DECODE_ENV, FP8_DECODE_KNOBS)
    if config.kv_cache_dtype != "fp8" or attention_backend != "triton":
        return {}
    return knobs


DECODE_ENV = "LAB_DECODE"
#: LAB_DECODE's keys: each one's paged_decode argument and the values it takes
DECODE_KNOBS = {"warps": ("num_warps", ("2", "4", "8", "16")), "stages": ("num_stages", tuple("12345678")),
                "block_n": ("block_n", ("16", "32", "64", "128")), "page_tile": ("page_tile", ("0", "1")),
                "kv_per_prog": ("kv_per_prog", ("1", "2", "4", "8")), "waves": ("waves", ("1", "2", "4", "8", "16"))}
#: the LAB_DECODE knobs that change how a context splits (the warm-up plans the compiled variants with them)
DECODE_SPLIT_KNOBS = ("block_n", "waves", "kv_per_prog")


def decode_knobs(config: Config, attention_backend: str) -> dict:
    """The Triton decode kernel's knobs on a cache in the model's dtype, from LAB_DECODE (``key=value`` pairs, comma
    separated: warps, stages, block_n, page_tile 0|1, kv_per_prog, waves), as paged_decode's keyword arguments; the
    knobs left out keep splits.py's DECODE_* values. Read (and a bad value refused in one line) whatever the engine;
    {} on an fp8 cache (LAB_FP8_DECODE's) and off the Triton backend. block_n, waves and kv_per_prog change the
    splits: the warm-up plans the decode variants with them (engine/warmup.py: warmup_plan)."""
    knobs = _knobs(DECODE_ENV, DECODE_KNOBS)
    if config.kv_cache_dtype == "fp8" or attention_backend != "triton":
        return {}
    return knobs


def decode_knobs_text(knobs: dict) -> str:
    """The lever spelling (LAB_DECODE's or LAB_FP8_DECODE's) of paged_decode knobs: what the lever reads back to
    the same dict."""
    names = {arg: key for key, (arg, _) in (FP8_DECODE_KNOBS | DECODE_KNOBS).items()}
    def spelled(arg, v):
        if v is None or (arg == "max_registers" and not v):          # maxnreg=none: no cap
            return "none"
        return int(v) if isinstance(v, bool) else v
    return ",".join(f"{names[arg]}={spelled(arg, v)}" for arg, v in knobs.items())
