"""Engine configuration: every knob in one validated dataclass."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, asdict
from pathlib import Path

from engine.errors import ConfigError  # re-exported: engine.config.ConfigError

ATTENTION_BACKENDS = ("auto", "flash_attn", "triton", "torch")
SCHEDULING_POLICIES = ("prefill_first", "balanced")
DTYPES = ("auto", "float32", "bfloat16", "float16")


ROPE_TYPES = ("default", "linear", "yarn")
DEFAULT_ROPE_THETA = 10000.0   # transformers' default when a config names no rope_theta


def _number(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"config.json rope scaling: {what} must be a number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class RopeScaling:
    """RoPE as config.json asks for it: ``rope_scaling`` (transformers 4.x, Qwen3's model cards) or
    ``rope_parameters`` (transformers 5.x), type ``default``, ``linear`` or ``yarn``. Every default is
    transformers' (modeling_rope_utils): beta_fast 32, beta_slow 1, truncate true, the attention factor
    from ``factor`` (and ``mscale``/``mscale_all_dim`` when both are given), yarn's
    ``original_max_position_embeddings`` from the top level first, then the block, then
    ``max_position_embeddings``. Any other type is refused with one line before weights load."""
    rope_type: str = "default"
    theta: float = DEFAULT_ROPE_THETA
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @classmethod
    def from_hf(cls, cfg: dict) -> "RopeScaling":
        block = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        if not isinstance(block, dict):
            raise ConfigError(f"config.json rope scaling must be a JSON object, got {block!r}")
        if any(isinstance(v, dict) for v in block.values()):
            raise ConfigError("config.json rope scaling per layer type is not supported (one block for every layer)")
        rope_type = block.get("rope_type", block.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ConfigError(f"rope scaling type {rope_type!r} in config.json is not supported "
                              f"(supported: {', '.join(ROPE_TYPES)})")
        partial = block.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        if partial not in (None, 1, 1.0):
            raise ConfigError(f"config.json partial_rotary_factor {partial!r} is not supported (Qwen3 rotates the whole head)")
        theta = block.get("rope_theta") or cfg.get("rope_theta") or DEFAULT_ROPE_THETA
        out = {"rope_type": rope_type, "theta": _number(theta, "rope_theta")}
        if rope_type == "linear":
            if block.get("factor") is None:
                raise ConfigError("config.json rope scaling linear needs a factor")
            out["factor"] = _number(block["factor"], "factor")
        elif rope_type == "yarn":
            orig = cfg.get("original_max_position_embeddings") or block.get("original_max_position_embeddings") \
                or cfg.get("max_position_embeddings")
            if orig is None:
                raise ConfigError("config.json rope scaling yarn needs original_max_position_embeddings")
            orig = int(_number(orig, "original_max_position_embeddings"))
            factor = block.get("factor")
            if factor is None:
                factor = int(cfg.get("max_position_embeddings", orig)) / orig
            out.update(factor=_number(factor, "factor"), original_max_position_embeddings=orig,
                       beta_fast=_number(block.get("beta_fast") or 32, "beta_fast"),
                       beta_slow=_number(block.get("beta_slow") or 1, "beta_slow"),
                       truncate=bool(block.get("truncate", True)))
            for key in ("attention_factor", "mscale", "mscale_all_dim"):
                if block.get(key) is not None:
                    out[key] = _number(block[key], key)
        if out.get("factor", 1.0) <= 0:
            raise ConfigError(f"config.json rope scaling factor must be > 0, got {out['factor']}")
        return cls(**out)

    def summary(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class ModelShape:
    """The model's shapes, read once from a Hugging Face config (the one place head_dim is derived)."""
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelShape":
        try:
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            return cls(hidden_size=hidden, num_layers=int(cfg["num_hidden_layers"]), num_heads=heads,
                       num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
                       head_dim=int(cfg.get("head_dim") or hidden // heads),
                       intermediate_size=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]),
                       max_position_embeddings=int(cfg.get("max_position_embeddings", 1 << 30)),
                       tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))
        except KeyError as e:
            raise ConfigError(f"config.json lacks {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ConfigError(f"config.json has a non-integer shape: {e}") from None

    def kv_bytes_per_token(self, element_size: int, tp: int = 1) -> int:
        """K and V of one token over every layer, on one rank of a `tp`-way engine."""
        return 2 * self.num_layers * (self.num_kv_heads // tp) * self.head_dim * element_size


@dataclass(frozen=True)
class SchedulerLimits:
    """What the scheduler needs to know; tests build it from plain values, no model directory."""
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 512
    max_model_len: int = 1024
    scheduling_policy: str = "prefill_first"
    eos_token_ids: tuple[int, ...] = ()
    max_consecutive_prefill: int | None = None   # None: the policy's own (balanced 1, prefill_first no limit)


def read_model_dir(model: str | Path) -> dict:
    """The one model-directory check: the directory, a readable config.json, model_type qwen3.
    Returns the parsed config; raises ConfigError with one line otherwise."""
    path = Path(model)
    if not path.is_dir():
        raise ConfigError(f"model directory not found: {model}")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"no config.json in model directory {model}")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {cfg_file}: {exc}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{cfg_file} is not a JSON object")
    if cfg.get("model_type") != "qwen3":
        raise ConfigError(f"model_type must be qwen3, got {cfg.get('model_type')!r} in {cfg_file}")
    RopeScaling.from_hf(cfg)        # an unsupported rope scaling fails here, before any weights load
    return cfg


@dataclass
class Config:
    model: str
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
    attention_backend: str = "auto"
    scheduling_policy: str = "prefill_first"
    max_consecutive_prefill: int | None = None     # at most N prefill steps in a row while decodes wait (None: the policy's)
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
    logprobs_mode: str = "raw_logprobs"            # vLLM's: raw_logprobs (the model's) | processed_logprobs
    hf_config: dict = field(default_factory=dict, repr=False)
    eos_token_ids: tuple[int, ...] = ()
    shape: ModelShape | None = field(default=None, init=False, repr=False)
    rope: RopeScaling | None = field(default=None, init=False, repr=False)
    max_model_len_auto: bool = field(default=False, init=False)   # asked "auto": fitted to the pool (fit_to_pool)

    def __post_init__(self) -> None:
        path = Path(self.model)
        self.hf_config = read_model_dir(path)
        self.shape = ModelShape.from_hf(self.hf_config)
        self.rope = RopeScaling.from_hf(self.hf_config)
        if self.max_model_len == "auto":
            self.max_model_len_auto = True
            self.max_model_len = self.shape.max_position_embeddings   # until the pool is sized (fit_to_pool)
        elif isinstance(self.max_model_len, str):
            raise ConfigError(f'max_model_len must be a positive integer or "auto", got {self.max_model_len!r}')
        self._check_positive("max_num_batched_tokens", "max_num_seqs", "max_model_len",
                             "kvcache_block_size", "tensor_parallel_size", "cpu_kv_cache_bytes")
        bs = self.kvcache_block_size
        if bs & (bs - 1):
            raise ConfigError(f"kvcache_block_size must be a power of two, got {bs}")
        if self.num_kvcache_blocks != -1 and self.num_kvcache_blocks < 1:
            raise ConfigError(f"num_kvcache_blocks must be -1 (derive) or >= 1, got {self.num_kvcache_blocks}")
        if not 0.05 <= self.gpu_memory_utilization <= 0.99:
            raise ConfigError(f"gpu_memory_utilization must be in [0.05, 0.99], got {self.gpu_memory_utilization}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        if self.overlap and self.tensor_parallel_size > 1:
            raise ConfigError("overlap needs tensor_parallel_size 1 (the other ranks replay host-side inputs)")
        if self.logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise ConfigError(f"logprobs_mode must be raw_logprobs or processed_logprobs, got {self.logprobs_mode!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}")
        if self.max_consecutive_prefill is not None and (
                isinstance(self.max_consecutive_prefill, bool) or not isinstance(self.max_consecutive_prefill, int)
                or self.max_consecutive_prefill < 1):
            raise ConfigError(f"max_consecutive_prefill must be a positive integer (or unset), got {self.max_consecutive_prefill!r}")
        if self.shuffle_blocks is not None and (isinstance(self.shuffle_blocks, bool)
                                                or not isinstance(self.shuffle_blocks, int)):
            raise ConfigError(f"shuffle_blocks must be an integer seed (or unset), got {self.shuffle_blocks!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.graph_buckets is not None:
            self.graph_buckets = tuple(sorted(set(int(b) for b in self.graph_buckets)))
            if not self.graph_buckets or self.graph_buckets[0] < 1:
                raise ConfigError(f"graph buckets must be positive integers, got {self.graph_buckets}")
        self.max_model_len = min(self.max_model_len, self.shape.max_position_embeddings)
        heads, kv_heads = self.shape.num_heads, self.shape.num_kv_heads
        if heads % self.tensor_parallel_size or kv_heads % self.tensor_parallel_size:
            raise ConfigError(f"tensor_parallel_size {self.tensor_parallel_size} must divide {heads} q heads and {kv_heads} kv heads")
        if not self.eos_token_ids:
            eos = self.hf_config.get("eos_token_id")
            gen = path / "generation_config.json"
            if gen.is_file():
                try:
                    eos = json.loads(gen.read_text()).get("eos_token_id", eos)
                except (OSError, json.JSONDecodeError):
                    pass
            ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
            self.eos_token_ids = tuple(int(i) for i in ids)

    def _check_positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")

    def fit_to_pool(self, num_blocks: int) -> None:
        """max_model_len "auto": the model's context capped to what a pool of num_blocks holds (called once,
        by the runner, when the pool is sized; the other settings are left as they are)."""
        if self.max_model_len_auto:
            self.max_model_len = min(self.shape.max_position_embeddings, num_blocks * self.kvcache_block_size)

    @property
    def vocab_size(self) -> int:
        return self.shape.vocab_size

    def scheduler_limits(self) -> SchedulerLimits:
        return SchedulerLimits(self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len,
                               self.scheduling_policy, tuple(self.eos_token_ids), self.max_consecutive_prefill)

    def resolved_device(self) -> str:
        import torch

        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError("device cuda was asked for but CUDA is not available on this machine")
        return self.device

    def check_machine(self) -> str:
        """Before anything is loaded: the choices this machine cannot honour (graphs without CUDA, an
        attention backend it lacks, more TP ranks than GPUs) as one-line ConfigErrors. Returns the device."""
        import torch

        from engine.attention import resolve_backend_name

        device = self.resolved_device()
        if not self.enforce_eager and not device.startswith("cuda"):
            raise ConfigError("graph execution needs CUDA (use enforce_eager on CPU)")
        resolve_backend_name(self.attention_backend, device, self.kvcache_block_size)
        if device.startswith("cuda") and self.tensor_parallel_size > torch.cuda.device_count():
            raise ConfigError(f"tensor_parallel_size {self.tensor_parallel_size} needs that many GPUs; "
                              f"this machine has {torch.cuda.device_count()}")
        return device

    def resolved_dtype(self, device: str):
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if device.startswith("cuda") else torch.float32
        return getattr(torch, self.dtype)

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("hf_config")
        d.pop("shape")
        d["rope"] = self.rope.summary()
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

