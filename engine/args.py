"""The engine's options, declared once: :class:`EngineArgs` (vLLM's ``EngineArgs``: its names, one frozen record).

Every option a user may set and its engine default lives here and nowhere else, with its command-line
spelling and help (:data:`FLAGS`, vLLM's flag names; the lab's commands build their options from it) and the
named settings that change several defaults at once (:data:`PRESETS`, the one table of them). ``LLMEngine(args)``
takes it as it is, ``engine.config.Config(args)`` adds what the model directory says (shape, rope, eos ids, the context
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
    mixed_graphs: bool = True                      # with graphs and mixed steps (TP 1, triton): a mixed step replays one graph
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


@dataclass(frozen=True)
class Flag:
    """An option's command line: its spellings (the first is the one help and errors name; vLLM's are among them)
    and help text, and the type the command line parses (the field's, where the field admits more)."""
    names: tuple[str, ...]
    help: str
    type: type = int
    min: float | None = None            # the command line refuses a value below (above) these
    max: float | None = None


#: Each option a command line may set: spellings and help. ``--enforce-eager/--graph`` style names are switches.
FLAGS: dict[str, Flag] = {
    "device": Flag(("--device",), "auto | cpu | cuda[:N].", str),
    "attention_backend": Flag(("--attention", "--attention-backend"),
                              "Attention backend: auto | flash_attn | triton | torch.", str),
    "dtype": Flag(("--dtype",), "Weights and activations: auto (bfloat16 on CUDA, float32 on CPU) | bfloat16 | "
                                "float16 | float32.", str),
    "kv_cache_dtype": Flag(("--kv-cache-dtype",), "KV cache dtype: auto (the model's dtype) | fp8 (e4m3 K/V with "
                                                  "per-layer scales: half the bytes of bf16; triton and torch "
                                                  "attention).", str),
    "seed": Flag(("--seed",), "The engine's sampling seed (a request's own seed wins)."),
    "max_num_seqs": Flag(("--max-num-seqs",), "Sequences in one step at most.", min=1),
    "max_num_batched_tokens": Flag(("--max-num-batched-tokens",), "Token budget of one step (the prefill budget).",
                                   min=1),
    "max_model_len": Flag(("--max-model-len",), "Context length (prompt + output) at most (auto: the model's, "
                                                "capped by what the KV pool holds, printed at start)."),
    "gpu_memory_utilization": Flag(("--gpu-memory-utilization",), "Fraction of GPU memory the engine may use "
                                   "(weights, work memory, KV cache).", float, 0.0, 1.0),
    "enforce_eager": Flag(("--enforce-eager/--graph",), "Eager execution, or CUDA graphs (decode, fresh prefills on "
                          "the triton backend, piecewise graphs around attention for the other steps; CUDA only). "
                          "Eager on CUDA is for debugging, not speed: a batch-1 decode step launches about 200 "
                          "Triton kernels one by one from Python, tens of microseconds of host time each, for under "
                          "a millisecond of GPU work, so it runs about ten times slower than graphs (docs/MEASURED.md).",
                          bool),
    "overlap": Flag(("--overlap/--no-overlap",), "Overlapped decode (CUDA, tensor-parallel-size 1): launch step k+1 "
                    "before reading step k's tokens, so the host's per-step work hides behind the GPU.", bool),
    "enable_prefix_caching": Flag(("--enable-prefix-caching/--no-enable-prefix-caching",),
                                  "Reuse the KV blocks of a prompt's cached full-block prefix (vLLM's switch); off: "
                                  "every prompt is computed in full.", bool),
    "mixed_batches": Flag(("--mixed-batches/--no-mixed-batches",), "Mixed steps: the running decodes and prefill "
                          "chunks share one step under the token budget (vLLM's step); off: nano-vllm's step model, "
                          "each step all-prefill or all-decode.", bool),
    "fused_ops": Flag(("--fused-ops/--no-fused-ops",), "CUDA: the fused Triton RMSNorm, q/k-norm + RoPE (which also "
                      "writes K/V into the cache) and SiLU-mul kernels, or the plain path where the attention "
                      "backend's store_kv writes K/V. CPU always runs the plain path.", bool),
    "tensor_parallel_size": Flag(("--tensor-parallel-size", "-tp", "--tp"), "Tensor-parallel ranks of the engine.",
                                 min=1),
    "kvcache_block_size": Flag(("--kv-cache-block-size", "--block-size"), "KV block size in tokens (a power of two).",
                               min=1),
    "num_kvcache_blocks": Flag(("--num-kvcache-blocks",), "KV pool size in blocks (default: sized from memory).",
                               min=1),
    "scheduling_policy": Flag(("--scheduling-policy",), "prefill_first | balanced.", str),
    "max_consecutive_prefill": Flag(("--max-consecutive-prefill",), "At most N prefill steps in a row while "
                                    "requests wait to decode (default: the policy's own: balanced 1, prefill_first "
                                    "no limit).", min=1),
    "dist_init": Flag(("--dist-init",), "tcp://HOST:PORT of this engine's TP group (default: a free port).", str),
    "shm_name": Flag(("--shm-name",), "Shared-memory name of this engine's TP channel (default: unique).", str),
}

#: Named settings: the options each changes from the defaults above (the one table of them; a command or an
#: experiment that wants one of these settings names it, :func:`preset`).
PRESETS: dict[str, dict] = {
    # labkit serve on CUDA: a server that serves, at vLLM's scale (CUDA graphs, a 16384-token step budget, the
    # model's own context length as far as the KV pool holds it, overlapped decode)
    "serve-cuda": dict(enforce_eager=False, max_num_batched_tokens=16384, max_model_len="auto", overlap=True),
    # the handbook's practice worker: 8 sequences a step (labkit serve on CPU, labkit load's in-process engine,
    # a worker configured without an engine)
    "practice": dict(max_num_seqs=8),
    # the scheduler comparisons of labkit load (handbook 5.3, 5.4.3): a 256-token budget, 4 sequences a step
    "load-compare": dict(max_num_batched_tokens=256, max_num_seqs=4),
    # nano-vllm's bench.py
    "nano-vllm": dict(max_model_len=4096, max_num_batched_tokens=16384, max_num_seqs=512, gpu_memory_utilization=0.9),
}


def preset(name: str, **given) -> EngineArgs:
    """The arguments of preset ``name`` (:data:`PRESETS`), then each option ``given`` (one given as None keeps
    the preset's or the engine's default)."""
    if name not in PRESETS:
        raise ConfigError(f"no engine preset {name!r}; one of {', '.join(PRESETS)}")
    return EngineArgs(**{**PRESETS[name], **{k: v for k, v in given.items() if v is not None}})
