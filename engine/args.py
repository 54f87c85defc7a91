"""The engine's options, declared once: :class:`EngineArgs` (vLLM's ``EngineArgs``: its names, one frozen record).

Every option a user may set and its engine default lives here and nowhere else; ``LLMEngine(args)`` takes it
as it is, ``engine.config.Config(args)`` adds what the model directory says (shape, rope, eos ids, the context
length capped or fitted) and reads every option from ``config.args``. Plain-value checks (positive integers,
the choices, a power-of-two block size) run here, at construction, as one-line ``ConfigError``s; the checks that
need the model (TP dividing the heads) or the machine (CUDA present) stay in ``Config``.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from engine.errors import ConfigError

ATTENTION_BACKENDS = ("auto", "flash_attn", "triton", "torch")
SCHEDULING_POLICIES = ("prefill_first", "balanced")
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
KV_CACHE_DTYPES = ("auto", "fp8")           # engine/attention/kv_quant.py (auto: the model's dtype)


@dataclass(frozen=True)
class EngineArgs:
    """What the engine is asked for. ``model`` is a model directory (None: unset, refused when the engine is
    built; the lab resolves a hub id or a preset to a directory first)."""
    model: str | None = None
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 256
    max_model_len: int | str = 1024       # capped at the model's context; "auto": that, capped to the KV pool
    kvcache_block_size: int = 256
    num_kvcache_blocks: int = -1          # -1: derive from the memory budget
    gpu_memory_utilization: float = 0.5
    cpu_kv_cache_bytes: int = 1 << 30     # KV budget on CPU when num_kvcache_blocks is -1
    tensor_parallel_size: int = 1
    enforce_eager: bool = True
    device: str = "auto"                  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"                   # auto: bfloat16 on CUDA, float32 on CPU
    kv_cache_dtype: str = "auto"          # auto: the model's dtype | fp8: e4m3 K/V with scales (vLLM's spelling)
    attention_backend: str = "auto"
    scheduling_policy: str = "prefill_first"
    max_consecutive_prefill: int | None = None     # at most N prefill steps in a row while decodes wait (None: the policy's)
    mixed_batches: bool = False                    # one step holds decodes and prefill chunks (False: nano-vllm's step model)
    seed: int = 0
    dist_init: str | None = None                   # tcp://HOST:PORT of this engine's TP group (default: a free port)
    shm_name: str | None = None                    # this engine's TP step channel (default: unique per instance)
    tp_timeout_s: float = 120.0                    # a collective waiting longer than this fails instead of hanging
    fused_ops: bool = True                         # Triton RMSNorm / qk-norm+RoPE / SiLU-mul on CUDA
    pdl: bool = True                               # Hopper+: our kernels launch with programmatic dependent launch
    enable_prefix_caching: bool = True             # False: no prefix-cache hits (vLLM's --no-enable-prefix-caching)
    shuffle_blocks: int | None = None              # a seed: the KV free list starts shuffled (teaching; None: 0, 1, 2, ...)
    graph_buckets: tuple[int, ...] | None = None   # None: buckets covering every batch up to max_num_seqs
    overlap: bool = False                          # decode: launch step k+1 before reading step k's tokens
    prefill_graphs: bool = True                    # with graphs (TP 1, triton): small fresh prefills replay a graph too
    piecewise_graphs: bool = True                  # with graphs (TP 1): other steps replay graphs between attention calls
    logprobs_mode: str = "raw_logprobs"            # vLLM's: raw_logprobs (the model's) | processed_logprobs
    eos_token_ids: tuple[int, ...] = ()            # (): the model's (generation_config.json, then config.json)

    def __post_init__(self) -> None:
        if isinstance(self.max_model_len, str) and self.max_model_len != "auto":
            raise ConfigError(f'max_model_len must be a positive integer or "auto", got {self.max_model_len!r}')
        self._check_positive("max_num_batched_tokens", "max_num_seqs", "kvcache_block_size",
                             "tensor_parallel_size", "cpu_kv_cache_bytes")
        if self.max_model_len != "auto":
            self._check_positive("max_model_len")
        bs = self.kvcache_block_size
        if bs & (bs - 1):
            raise ConfigError(f"kvcache_block_size must be a power of two, got {bs}")
        if self.num_kvcache_blocks != -1 and self.num_kvcache_blocks < 1:
            raise ConfigError(f"num_kvcache_blocks must be -1 (derive) or >= 1, got {self.num_kvcache_blocks}")
        if not 0.05 <= self.gpu_memory_utilization <= 0.99:
            raise ConfigError(f"gpu_memory_utilization must be in [0.05, 0.99], got {self.gpu_memory_utilization}")
        self._check_choices()
        if self.overlap and self.tensor_parallel_size > 1:
            raise ConfigError("overlap needs tensor_parallel_size 1 (the other ranks replay host-side inputs)")
        self._check_optional_ints()
        if self.graph_buckets is not None:
            buckets = tuple(sorted(set(int(b) for b in self.graph_buckets)))
            if not buckets or buckets[0] < 1:
                raise ConfigError(f"graph buckets must be positive integers, got {buckets}")
            object.__setattr__(self, "graph_buckets", buckets)
        object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))

    def _check_positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")

    def _check_choices(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                              f"got {self.attention_backend!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"logprobs_mode must be raw_logprobs or processed_logprobs, got {self.logprobs_mode!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                              f"got {self.scheduling_policy!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if not isinstance(self.device, str) or not (self.device in ("auto", "cpu", "cuda")
                                                    or self.device.startswith("cuda:")):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")

    def _check_optional_ints(self) -> None:
        mcp = self.max_consecutive_prefill
        if mcp is not None and (isinstance(mcp, bool) or not isinstance(mcp, int) or mcp < 1):
            raise ConfigError(f"max_consecutive_prefill must be a positive integer (or unset), got {mcp!r}")
        if self.shuffle_blocks is not None and (isinstance(self.shuffle_blocks, bool)
                                                or not isinstance(self.shuffle_blocks, int)):
            raise ConfigError(f"shuffle_blocks must be an integer seed (or unset), got {self.shuffle_blocks!r}")


#: Every option's name, in declaration order.
OPTION_NAMES = tuple(f.name for f in fields(EngineArgs))
#: The engine's defaults (read, never re-declared: ``SchedulerLimits`` takes its from here).
DEFAULTS = EngineArgs()
