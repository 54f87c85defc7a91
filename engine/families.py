"""The model families the engine runs, and what differs between them, declared in one place.

config.json's ``architectures`` (else its ``model_type``) picks the family; every family shares one decoder
(engine/models/qwen3.py: RMSNorm, GQA attention with neox RoPE, a SiLU-gated MLP, a tied or untied head).
What a family changes is a row of :data:`FAMILIES`:

================  ===========  ========================  ==================  =================
family            q/k norm     q/k/v bias                o bias              MLP bias
================  ===========  ========================  ==================  =================
qwen3             yes          attention_bias (false)    attention_bias      no
qwen2             no           always                    never               no
llama             no           attention_bias (false)    attention_bias      mlp_bias (false)
================  ===========  ========================  ==================  =================

The tied head (``tie_word_embeddings``) and RoPE (``rope_theta``, ``rope_scaling``/``rope_parameters``:
default, linear, yarn, llama3) are read from config.json for every family (engine/config.py). The fused CUDA
q/k-norm + RoPE + KV-store kernel (engine/layers/fused_kernels.py) is Qwen3's q/k norm: the families without
q/k norm take the plain route there (RoPE in torch, ``backend.store_kv``); ``LLMEngine.describe()["model"]``
says which route each engine took.

This module imports nothing of the engine but its errors: engine/config.py reads it to refuse an unsupported
model before any weights load, and engine/models builds each family's layers from it.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ConfigError


@dataclass(frozen=True)
class ModelFamily:
    """One family: its names in config.json and what its layers hold. A bias is ``True``/``False`` or the
    name of the config.json key that says (absent: False)."""
    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    qk_norm: bool
    qkv_bias: bool | str = False
    o_bias: bool | str = False
    mlp_bias: bool | str = False
    notes: str = ""

    def bias(self, cfg: dict, where: str) -> bool:
        """The bias of ``where`` ("qkv", "o" or "mlp") for this config."""
        value = getattr(self, f"{where}_bias")
        return bool(cfg.get(value, False)) if isinstance(value, str) else value

    def summary(self, cfg: dict) -> dict:
        return {"family": self.name, "qk_norm": self.qk_norm, "qkv_bias": self.bias(cfg, "qkv"),
                "o_bias": self.bias(cfg, "o"), "mlp_bias": self.bias(cfg, "mlp"),
                "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False))}


FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), qk_norm=True,
                qkv_bias="attention_bias", o_bias="attention_bias",
                notes="Qwen3: RMSNorm on each q and k head before RoPE (the fused CUDA kernel's case)"),
    ModelFamily("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), qk_norm=False, qkv_bias=True, o_bias=False,
                notes="Qwen2 / Qwen2.5: q, k and v biased, o not"),
    ModelFamily("llama", ("LlamaForCausalLM",), ("llama",), qk_norm=False,
                qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias",
                notes="Llama 2/3 layout (SmolLM2, TinyLlama, Llama-3.x): llama3 rope scaling included"),
)


def supported() -> str:
    """``LlamaForCausalLM (llama), ...``: what the one refusal names."""
    return ", ".join(f"{a} ({t})" for f in sorted(FAMILIES, key=lambda f: f.name)
                     for a, t in zip(f.architectures, f.model_types))


def family_for(cfg: dict) -> ModelFamily:
    """The family of a parsed config.json: its first ``architectures`` entry, else its ``model_type``; one
    ConfigError naming the supported ones otherwise (an architecture and a model_type that disagree included)."""
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    arch = archs[0] if isinstance(archs, list) and archs else None
    for family in FAMILIES:
        if arch in family.architectures or (arch is None and model_type in family.model_types):
            if model_type is not None and model_type not in family.model_types:
                break
            _check_layout(cfg, family)
            return family
    what = " ".join(filter(None, (f"architecture {arch!r}" if arch else None,
                                  f"model_type {model_type!r}")))
    raise ConfigError(f"{what} in config.json is not supported (supported: {supported()})")


def _check_layout(cfg: dict, family: ModelFamily) -> None:
    """What no family here runs, refused with one line: another activation, a sliding window."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"config.json hidden_act {act!r} is not supported ({family.name}: the engine's MLP is SiLU-gated)")
    if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        raise ConfigError(f"config.json use_sliding_window is set ({family.name}): sliding-window attention is not "
                          "supported (every layer attends to the whole context)")
