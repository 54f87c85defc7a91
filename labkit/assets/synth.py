"""Synthetic model directories (Qwen3, and a Llama of SmolLM2's shapes): presets, seeded weights, :func:`synth_model`.

Two inits (``INITS``): ``random`` (i.i.d. weights, below) and ``tame`` (:mod:`labkit.assets.synth_tame`: a
seeded bigram language whose forward pass is numerically tame in BF16). Each preset has a default
(``PRESET_INIT``); the other stays reachable with ``init=`` / ``labkit model synth --init``.

A directory made here loads with ``transformers`` exactly like the real Qwen/Qwen3-0.6B and holds
``labkit_synth.json`` (written last), which marks it synthetic.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from labkit.assets.files import SYNTH_FORMAT_VERSION, SYNTH_MARKER, ModelError, apply_umask, write_json
from labkit.assets.tokenizer import (
    QWEN_BOS_ID,
    QWEN_EOS_ID,
    QWEN_VOCAB_SIZE,
    cached_tokenizer_json,
    generation_config_doc,
    tokenizer_config_doc,
)


_COMMON_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": QWEN_BOS_ID,
    "eos_token_id": QWEN_EOS_ID,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "use_sliding_window": False,
    "use_cache": True,
    "tie_word_embeddings": True,
    "vocab_size": QWEN_VOCAB_SIZE,
}


def _preset(dtype: str, **shape: Any) -> dict[str, Any]:
    cfg = dict(_COMMON_CONFIG)
    cfg.update(shape)
    cfg["max_window_layers"] = cfg["num_hidden_layers"]
    cfg["torch_dtype"] = dtype
    cfg["dtype"] = dtype
    return dict(sorted(cfg.items()))


#: Hugging Face Qwen3 ``config.json`` dicts by preset name.
PRESETS: dict[str, dict] = {
    "tiny": _preset(
        "float32",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
    ),
    "qwen3-0.6b": _preset(
        "bfloat16",
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
    ),
    # Qwen3-0.6B's widths (hidden, heads, head_dim, intermediate, vocab) with 2 of its 28 layers: the
    # lifecycle walk's layer-0 shapes and logits width on a CPU, where 28 layers are slow.
    "qwen3-0.6b-2l": _preset(
        "bfloat16",
        hidden_size=1024,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
    ),
}

# Larger members of the Qwen3 family, so scale can be measured. The shape values (hidden /
# intermediate / layers / q heads / kv heads / head_dim / tied embeddings) are those of the published
# Hugging Face configs of Qwen/Qwen3-1.7B, Qwen/Qwen3-4B and Qwen/Qwen3-8B. No machine here reaches the
# hub; they were checked against copies of those config.json files quoted in public repositories (4B:
# a model card's full config.json; 1.7B and 8B: test fixtures naming the model), all agreeing with the
# values below (that 4B card is the 2507 release, whose rope_theta and context differ; shapes are the
# same). All three here: vocab 151936, rope_theta 1e6, rms_norm_eps 1e-6, bf16, as in the first release.
PRESETS.update({
    "qwen3-1.7b": _preset(
        "bfloat16",
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "qwen3-4b": _preset(
        "bfloat16",
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": _preset(
        "bfloat16",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,          # the 8B model has its own lm_head
    ),
})

# SmolLM2-135M(-Instruct)'s shapes: a Llama, as the model `labkit model fetch smollm2` converts
# (its config.json: 30 layers, hidden 576, 9 q / 3 kv heads of 64, intermediate 1536, vocab 49,152, tied
# embeddings, rope_theta 1e5, rms_norm_eps 1e-5, context 8192, bos 1 / eos 2). The synthetic directory's
# tokenizer is Qwen's BPE cut to 49,152 ids with the added tokens first (labkit/assets/tokenizer.py:
# cut_layout), so <|im_start|> 1 and <|im_end|> 2 sit where SmolLM2's own are.
_LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "rope_scaling": None,
    "use_cache": True,
}
PRESETS["smollm2-135m"] = dict(sorted({
    **_LLAMA_CONFIG, "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152,
    "tie_word_embeddings": True, "rope_theta": 100000.0, "rms_norm_eps": 1e-05,
    "max_position_embeddings": 8192, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
    "torch_dtype": "bfloat16", "dtype": "bfloat16"}.items()))

#: One line per preset for help texts and the synth marker.
PRESET_NOTES: dict[str, str] = {
    "tiny": "tiny shapes, fast on a CPU",
    "qwen3-0.6b": "Qwen3-0.6B's shapes",
    "qwen3-1.7b": "Qwen3-1.7B's shapes (published config values)",
    "qwen3-4b": "Qwen3-4B's shapes (published config values)",
    "qwen3-8b": "Qwen3-8B's shapes (published config values; untied lm_head)",
    "smollm2-135m": "SmolLM2-135M's shapes (llama: head_dim 64, 9 q / 3 kv heads, vocab 49,152, tied)",
}

_DTYPES = ("float32", "bfloat16", "float16")
SYNTH_DEVICES = ("cpu", "cuda")

#: Weight inits: ``random`` (i.i.d., the tests' tiny model) and ``tame`` (BF16-tame; see synth_tame).
INITS = ("random", "tame")
#: The init a preset gets when none is asked for: qwen3-0.6b is what the BF16 guard runs on, on CUDA.
PRESET_INIT: dict[str, str] = {"tiny": "random", "qwen3-0.6b": "tame", "smollm2-135m": "tame"}


def default_init(preset: str) -> str:
    return PRESET_INIT.get(preset, "random")


# Synthetic weight scales (chosen by measuring greedy continuations of random prompts on both
# presets: with all-ones norms and N(0, 1/hidden) embeddings the tied lm_head strongly favours
# the input token, so greedy output loops on one token and ignores the context).
SYNTH_EMBED_STD = 0.02      # embeddings; small, so the residual is dominated by the blocks
SYNTH_LOGIT_STD = 3.0       # model.norm weight is set so that logits have about this std
SYNTH_QK_NORM = 2.0         # q_norm/k_norm weight: attention scores with std ~4 (peaked, context-sensitive)
# Every norm weight is its scale times (1 + SYNTH_NORM_JITTER * N(0, 1)), seeded by the tensor's name:
# distinct per layer and per kind (q_norm, k_norm, input/post-attention layernorm, final norm), so a
# loader that swaps two norms (q_norm for k_norm, one layer's for another's) changes the logits instead
# of hiding behind identical constants.
SYNTH_NORM_JITTER = 0.1


def _param_specs(cfg: dict) -> list[tuple[str, tuple[int, ...], str, float]]:
    """(name, shape, kind, value) per parameter; kind "normal" (value = std) or "norm" (value = the scale
    a seeded 1 + SYNTH_NORM_JITTER * N(0, 1) multiplies)."""
    h = int(cfg["hidden_size"])
    n_layers = int(cfg["num_hidden_layers"])
    n_heads = int(cfg["num_attention_heads"])
    n_kv = int(cfg.get("num_key_value_heads") or n_heads)
    hd = int(cfg.get("head_dim") or h // n_heads)
    inter = int(cfg["intermediate_size"])
    vocab = int(cfg["vocab_size"])
    # Projections ~ N(0, 1/fan_in) keep every branch at unit scale (the residual stream grows
    # like sqrt(layers), harmless in bf16 behind RMSNorm). The final norm weight turns the unit-RMS
    # hidden state into logits with std ~SYNTH_LOGIT_STD against N(0, SYNTH_EMBED_STD) rows.
    final_norm = SYNTH_LOGIT_STD / (SYNTH_EMBED_STD * h**0.5)
    from engine.families import family_for

    qk_norm = family_for(cfg).qk_norm             # Qwen3's q/k norm; the Llama presets have none
    specs: list[tuple[str, tuple[int, ...], str, float]] = [
        ("model.embed_tokens.weight", (vocab, h), "normal", SYNTH_EMBED_STD)
    ]
    for i in range(n_layers):
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", (h,), "norm", 1.0),
            (p + "self_attn.q_proj.weight", (n_heads * hd, h), "normal", h**-0.5),
            (p + "self_attn.k_proj.weight", (n_kv * hd, h), "normal", h**-0.5),
            (p + "self_attn.v_proj.weight", (n_kv * hd, h), "normal", h**-0.5),
            (p + "self_attn.o_proj.weight", (h, n_heads * hd), "normal", (n_heads * hd) ** -0.5),
            *([(p + "self_attn.q_norm.weight", (hd,), "norm", SYNTH_QK_NORM),
               (p + "self_attn.k_norm.weight", (hd,), "norm", SYNTH_QK_NORM)] if qk_norm else []),
            (p + "post_attention_layernorm.weight", (h,), "norm", 1.0),
            (p + "mlp.gate_proj.weight", (inter, h), "normal", h**-0.5),
            (p + "mlp.up_proj.weight", (inter, h), "normal", h**-0.5),
            (p + "mlp.down_proj.weight", (h, inter), "normal", inter**-0.5),
        ]
    specs.append(("model.norm.weight", (h,), "norm", final_norm))
    if not cfg.get("tie_word_embeddings", True):
        specs.append(("lm_head.weight", (vocab, h), "normal", SYNTH_EMBED_STD))
    return specs


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"labkit-synth:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _make_weights(cfg: dict, seed: int, dtype: str, init: str = "random", device: str = "cpu") -> dict[str, Any]:
    """Every tensor from its own seeded generator on `device`. CPU (the default) gives the bytes every
    earlier directory of this seed has; CUDA draws from the GPU's generator (other values, same
    distribution, seconds instead of minutes for 8B shapes) and the marker records which device drew.
    The tame init is always drawn on the CPU (its structure is cheap at 0.6B)."""
    import torch

    if init == "tame":
        from labkit.assets.synth_tame import make_tame_weights

        return make_tame_weights(cfg, seed, dtype, _param_specs(cfg), _tensor_seed)

    tdtype = getattr(torch, dtype)
    gen = torch.Generator(device=device)
    chunk_elems = 1 << 22 if device == "cpu" else 1 << 28
    out: dict[str, Any] = {}
    for name, shape, kind, std in _param_specs(cfg):
        # Every tensor has its own seed (derived from seed + name), so a tensor's values do not
        # depend on the others; rows are drawn in fixed-size float32 chunks, then cast.
        gen.manual_seed(_tensor_seed(seed, name))
        if kind == "norm":
            noise = torch.randn(shape, generator=gen, dtype=torch.float32, device=device)
            out[name] = (std * (1.0 + SYNTH_NORM_JITTER * noise)).to(tdtype).cpu()
            continue
        t = torch.empty(shape, dtype=tdtype, device=device)
        flat = t.view(-1)
        for start in range(0, flat.numel(), chunk_elems):
            stop = min(start + chunk_elems, flat.numel())
            buf = torch.randn(stop - start, generator=gen, dtype=torch.float32, device=device)
            buf.mul_(std)
            flat[start:stop].copy_(buf)
        out[name] = t.cpu()
    return out


# --------------------------------------------------------------------------------------------
# synth_model
# --------------------------------------------------------------------------------------------


def _check_preset(preset: str) -> dict:
    if preset not in PRESETS:
        raise ModelError(f"unknown model preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    return PRESETS[preset]


def _transformers_version() -> str:
    try:
        from importlib.metadata import version
        return version("transformers")
    except Exception:  # noqa: BLE001 - metadata missing: an honest placeholder, still a parsable version
        return "0.0.0"


def _check_init(init: str) -> str:
    if init not in INITS:
        raise ModelError(f"unknown init {init!r}; choose one of: {', '.join(INITS)}")
    return init


_INIT_NOTES = {
    "random": "random weights: generated text is meaningless",
    "tame": "tame synthetic weights (a seeded bigram language, BF16-tame): generated text is meaningless",
}


def _write_synth_files(directory: Path, preset: str, seed: int, dtype: str | None,
                       rope_scaling: str | None = None, device: str = "cpu", init: str = "random") -> None:
    from safetensors.torch import save_file

    cfg = dict(_check_preset(preset))
    if rope_scaling is not None:
        from labkit.assets.rope import apply_rope_scaling

        cfg = apply_rope_scaling(cfg, rope_scaling)
    if dtype is not None:
        if dtype not in _DTYPES:
            raise ModelError(f"unsupported dtype {dtype!r}; choose one of: {', '.join(_DTYPES)}")
        cfg["torch_dtype"] = dtype
        cfg["dtype"] = dtype
    vocab = int(cfg["vocab_size"])       # Qwen's 151,936, or a cut of Qwen's BPE (tokenizer.cut_layout)
    tok_json = cached_tokenizer_json(vocab)
    shutil.copyfile(tok_json, directory / "tokenizer.json")
    write_json(directory / "tokenizer_config.json", tokenizer_config_doc(vocab))
    write_json(directory / "generation_config.json", generation_config_doc(vocab))
    # like save_pretrained: without it, transformers 5.x (before 5.2x) takes a local tokenizer for a
    # possibly broken Mistral one and warns about its regex on every load
    cfg = {**cfg, "transformers_version": _transformers_version()}
    write_json(directory / "config.json", cfg)
    weights = _make_weights(cfg, seed, cfg["dtype"], init, device if init == "random" else "cpu")
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    del weights
    write_json(
        directory / SYNTH_MARKER,
        {
            "synthetic": True,
            "preset": preset,
            "seed": seed,
            "init": init,
            "dtype": cfg["dtype"],
            "generator": "labkit model synth",
            "format_version": SYNTH_FORMAT_VERSION,
            "note": _INIT_NOTES[init],
            **({"rope_scaling": rope_scaling} if rope_scaling is not None else {}),
            **({"weights_device": device} if device != "cpu" and init == "random" else {}),
        },
    )


def _check_synth_args(preset: str, seed: int, dtype: str | None, rope_scaling: str | None, device: str,
                      init: str | None) -> str:
    """ModelError for a bad argument; the init to use (the preset's default when None)."""
    _check_preset(preset)
    if rope_scaling is not None:
        from labkit.assets.rope import parse_rope_spec

        parse_rope_spec(rope_scaling)
    init = _check_init(default_init(preset) if init is None else init)
    if dtype is not None and dtype not in _DTYPES:
        raise ModelError(f"unsupported dtype {dtype!r}; choose one of: {', '.join(_DTYPES)}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ModelError(f"seed must be an integer, got {seed!r}")
    if device not in SYNTH_DEVICES:
        raise ModelError(f"--device must be one of {', '.join(SYNTH_DEVICES)}, got {device!r}")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ModelError("--device cuda: CUDA is not available on this machine")
    return init


def _move_into_place(tmp: Path, out: Path, non_empty: bool) -> None:
    """The finished files of ``tmp`` become ``out``: renamed whole when ``out`` is absent or empty, else
    moved in one by one over the old ones (stale weight shards removed, the marker last)."""
    if not out.exists():
        os.rename(tmp, out)
    elif not non_empty:
        out.rmdir()
        os.rename(tmp, out)
    else:
        ours = {p.name for p in tmp.iterdir()}
        for stale in list(out.glob("*.safetensors")) + list(out.glob("*.safetensors.index.json")):
            if stale.name not in ours:
                stale.unlink()
        # the marker goes last so the directory only claims to be synthetic when complete
        for name in sorted(ours, key=lambda s: s == SYNTH_MARKER):
            os.replace(tmp / name, out / name)
        tmp.rmdir()


def synth_model(
    preset: str,
    out: str | Path,
    seed: int = 0,
    dtype: str | None = None,
    force: bool = False,
    rope_scaling: str | None = None,
    device: str = "cpu",
    init: str | None = None,
) -> Path:
    """Write a loadable Hugging Face Qwen3 model directory with seeded weights (``init``: ``random`` or
    ``tame``; None: the preset's default, :data:`PRESET_INIT`).

    The files are written into a temporary sibling directory first and moved into place at the
    end, so an interrupted run never leaves a directory that looks complete. A non-empty ``out``
    is refused unless ``force``; with ``force`` the model files in it are replaced (other files
    are left alone, stale ``*.safetensors`` shards are removed). ``rope_scaling`` (``yarn:4``, ``linear:2``,
    see :mod:`labkit.assets.rope`) writes a rope scaling block into config.json; ``device="cuda"`` draws
    the weights on the GPU (see _make_weights). Returns the resolved path.
    """
    init = _check_synth_args(preset, seed, dtype, rope_scaling, device, init)
    out = Path(out).expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise ModelError(f"cannot write model to {out}: it exists and is not a directory")
    non_empty = out.is_dir() and any(out.iterdir())
    if non_empty and not force:
        raise ModelError(f"{out} is not empty; pass --force to overwrite it or choose another directory")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.synth-", dir=out.parent))
    except OSError as exc:
        raise ModelError(f"cannot create model directory {out}: {exc.strerror or exc}") from None
    try:
        _write_synth_files(tmp, preset, seed, dtype, rope_scaling, device, init)
        apply_umask(tmp)
        _move_into_place(tmp, out, non_empty)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelError(f"cannot write model to {out}: {exc.strerror or exc}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
