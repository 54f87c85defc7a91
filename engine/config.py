"""The engine's configuration: :class:`Config` = the options (``engine/args.py``'s :class:`EngineArgs`, held
whole as ``config.args``) plus what the model directory says (:class:`ModelShape`, :class:`RopeScaling`, eos ids,
the context length capped or fitted); :class:`SchedulerLimits`, what the scheduler reads, built from it in one
place (:meth:`Config.scheduler_limits`)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, asdict
from pathlib import Path

from engine.args import (ATTENTION_BACKENDS, DEFAULTS, DTYPES, OPTION_NAMES, SCHEDULING_POLICIES,  # noqa: F401
                         EngineArgs)
from engine.errors import ConfigError  # re-exported: engine.config.ConfigError


ROPE_TYPES = ("default", "linear", "yarn", "llama3")
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
    ``max_position_embeddings``; llama3 (Llama-3.1/3.2's): ``factor``, ``low_freq_factor`` (1),
    ``high_freq_factor`` (4) and the block's ``original_max_position_embeddings``. Any other type is refused
    with one line before weights load."""
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
    low_freq_factor: float | None = None        # llama3
    high_freq_factor: float | None = None       # llama3

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
        elif rope_type == "llama3":
            orig = block.get("original_max_position_embeddings")
            if block.get("factor") is None or orig is None:
                raise ConfigError("config.json rope scaling llama3 needs factor and original_max_position_embeddings")
            out.update(factor=_number(block["factor"], "factor"),
                       original_max_position_embeddings=int(_number(orig, "original_max_position_embeddings")),
                       low_freq_factor=_number(block.get("low_freq_factor", 1.0), "low_freq_factor"),
                       high_freq_factor=_number(block.get("high_freq_factor", 4.0), "high_freq_factor"))
            if out["high_freq_factor"] <= out["low_freq_factor"]:
                raise ConfigError("config.json rope scaling llama3: high_freq_factor must exceed low_freq_factor")
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
    max_num_seqs: int = DEFAULTS.max_num_seqs                  # every default: the engine's (engine/args.py)
    max_num_batched_tokens: int = DEFAULTS.max_num_batched_tokens
    max_model_len: int = DEFAULTS.max_model_len
    scheduling_policy: str = DEFAULTS.scheduling_policy
    eos_token_ids: tuple[int, ...] = DEFAULTS.eos_token_ids
    max_consecutive_prefill: int | None = DEFAULTS.max_consecutive_prefill   # None: the policy's own (balanced 1,
                                                                            # prefill_first no limit)
    mixed_batches: bool = DEFAULTS.mixed_batches             # decodes and prefill chunks in one step


def read_model_dir(model: str | Path) -> dict:
    """The one model-directory check: the directory, a readable config.json, a supported architecture
    (engine/families.py: Llama, Qwen2, Qwen3), a supported rope scaling. Returns the parsed config;
    raises ConfigError with one line otherwise."""
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
    from engine.families import family_for

    family_for(cfg)                 # an unsupported architecture fails here, with what is supported
    RopeScaling.from_hf(cfg)        # an unsupported rope scaling fails here, before any weights load
    return cfg


class Config:
    """The engine's configuration: the options it was asked for (``args``, an :class:`EngineArgs`, kept whole)
    and what the model directory adds: ``hf_config``, ``shape``, ``rope``, the eos ids (``eos_token_ids``: the
    given ones, else the model's) and the context length (``max_model_len``: the asked one capped at the
    model's; "auto": the model's, fitted to the pool by :meth:`fit_to_pool`). Every other option reads through
    ``config.<name>`` straight from ``args`` (read-only properties, nothing copied).

    ``Config(args)``, or ``Config(model, **options)`` as a shorthand for ``Config(EngineArgs(model, **options))``."""

    def __init__(self, args: EngineArgs | str | None = None, **options) -> None:
        if not isinstance(args, EngineArgs):
            model = options.pop("model", args)
            args = EngineArgs(None if model is None else str(model), **options)
        elif options:
            args = dataclasses.replace(args, **options)
        if args.model is None:
            raise ConfigError("no model directory given (EngineArgs.model is unset)")
        self.args = args
        path = Path(args.model)
        self.hf_config = read_model_dir(path)
        self.shape = ModelShape.from_hf(self.hf_config)
        self.rope = RopeScaling.from_hf(self.hf_config)
        self.max_model_len_auto = args.max_model_len == "auto"   # fitted to the pool (fit_to_pool)
        asked = self.shape.max_position_embeddings if self.max_model_len_auto else args.max_model_len
        self.max_model_len = min(asked, self.shape.max_position_embeddings)
        heads, kv_heads, tp = self.shape.num_heads, self.shape.num_kv_heads, args.tensor_parallel_size
        if heads % tp or kv_heads % tp:
            raise ConfigError(f"tensor_parallel_size {tp} must divide {heads} q heads and {kv_heads} kv heads")
        self.eos_token_ids = args.eos_token_ids or _model_eos_ids(path, self.hf_config)

    def __repr__(self) -> str:
        return f"Config({self.args!r}, max_model_len={self.max_model_len})"

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
                               self.scheduling_policy, tuple(self.eos_token_ids), self.max_consecutive_prefill,
                               self.mixed_batches)

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
        resolve_backend_name(self.attention_backend, device, self.kvcache_block_size, self.attention_needs(device))
        if device.startswith("cuda") and self.tensor_parallel_size > torch.cuda.device_count():
            raise ConfigError(f"tensor_parallel_size {self.tensor_parallel_size} needs that many GPUs; "
                              f"this machine has {torch.cuda.device_count()}")
        if self.kv_cache_dtype == "fp8" and device.startswith("cuda"):
            major, minor = torch.cuda.get_device_capability(torch.device(device))
            if (major, minor) < (8, 9):         # Triton converts e4m3 (float8e4nv) from sm_89 on
                raise ConfigError(f"kv_cache_dtype fp8 needs a GPU of compute capability 8.9 or later (Ada, Hopper); "
                                  f"this one is {major}.{minor}")
        return device

    def attention_needs(self, device: str):
        """What the model asks of its attention backend on ``device`` (engine/attention: ModelNeeds)."""
        from engine.attention import ModelNeeds

        dtype = str(self.resolved_dtype(device)).replace("torch.", "")
        return ModelNeeds(dtype, self.shape.head_dim, self.kv_cache_dtype)

    def resolved_dtype(self, device: str):
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if device.startswith("cuda") else torch.float32
        return getattr(torch, self.dtype)

    def summary(self) -> dict:
        """The options (the context length as fitted) and what the model adds, under the options' names."""
        d = asdict(self.args)
        d["max_model_len"] = self.max_model_len
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["rope"] = self.rope.summary()
        d["max_model_len_auto"] = self.max_model_len_auto
        return d


def _model_eos_ids(path: Path, hf_config: dict) -> tuple[int, ...]:
    """The model's eos ids: generation_config.json's, else config.json's."""
    eos = hf_config.get("eos_token_id")
    gen = path / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id", eos)
        except (OSError, json.JSONDecodeError):
            pass
    ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    return tuple(int(i) for i in ids)


def _read_option(name: str) -> property:
    return property(lambda self: getattr(self.args, name), doc=f"``args.{name}`` (engine/args.py)")


#: Config reads each option from ``args``; the two it derives (context length, eos ids) are its own attributes.
DERIVED = ("max_model_len", "eos_token_ids")
for _name in OPTION_NAMES:
    if _name not in DERIVED:
        setattr(Config, _name, _read_option(_name))
del _name
