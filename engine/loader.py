"""Load Hugging Face safetensors into the engine's packed, shard-aware parameters.

The names are Hugging Face's for every family (engine/families.py): ``model.layers.N.self_attn.{q,k,v}_proj``
(weights and, Qwen2 and biased Llamas, biases) into the packed ``qkv_proj``, ``mlp.{gate,up}_proj`` into
``gate_up_proj``, ``o_proj``/``down_proj`` (and their biases) as they are, ``q_norm``/``k_norm`` for Qwen3 only. A
tied model's ``lm_head.weight`` is skipped (its head is the embedding); an untied model without one is reported
missing by the runner."""
from __future__ import annotations

from pathlib import Path

from safetensors import SafetensorError, safe_open
from torch import nn

from engine.errors import ConfigError
from engine.layers.linear import default_weight_loader


def load_model(model: nn.Module, path: str | Path) -> list[str]:
    """Copy every checkpoint tensor into its parameter; returns parameters the checkpoint did not fill."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    mapping = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters())
    filled: set[str] = set()
    for file in files:
        try:
            opened = safe_open(str(file), "pt", "cpu")
        except SafetensorError as e:        # a truncated download, an interrupted write: the user's file, not a bug
            raise ConfigError(f"{file} is not a complete safetensors file ({e}); download or write it again") from None
        with opened as f:
            for name in f.keys():
                if name == "lm_head.weight" and getattr(model, "tie_word_embeddings", False):
                    continue        # tied: the head is the embedding (a checkpoint may still hold a copy)
                if name.endswith("rotary_emb.inv_freq"):
                    continue        # older Llama checkpoints save RoPE's buffer; the engine computes its own
                target, shard = name, None
                for ckpt_part, (packed_part, shard_id) in mapping.items():
                    if ckpt_part in name:
                        target, shard = name.replace(ckpt_part, packed_part), shard_id
                        break
                if target not in params:
                    raise KeyError(f"checkpoint tensor {name} has no parameter {target} in the model")
                param = params[target]
                loader = getattr(param, "weight_loader", None)
                tensor = f.get_tensor(name)
                if loader is None:
                    default_weight_loader(param, tensor)
                elif shard is None:
                    loader(param, tensor)
                else:
                    loader(param, tensor, shard)
                filled.add(target)
    return sorted(set(params) - filled)
