"""Validate, inspect and fingerprint a model directory (with a cached weights hash)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from labkit.assets.files import ModelError, atomic_write_text, read_marker, sha256_file, default_cache_dir


_REQUIRED_CONFIG_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "intermediate_size",
)


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
    """Check that ``path`` is a usable model directory of a family the engine runs (engine/families.py:
    Llama, Qwen2, Qwen3); return it resolved.

    Raises :class:`ModelError` (one line) when the directory is missing, has no/malformed
    ``config.json``, is of another architecture, lacks weights or ``tokenizer.json``.
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
    from engine.errors import ConfigError
    from engine.families import family_for

    try:
        family_for(cfg)             # the engine's families (Llama, Qwen2, Qwen3): one line naming them otherwise
    except ConfigError as exc:
        raise ModelError(f"{p}: {exc}") from None
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
    marker = read_marker(p)
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
        "max_position_embeddings": cfg.get("max_position_embeddings"),
        "rope_theta": cfg.get("rope_theta"),
        "rope_scaling": cfg.get("rope_scaling"),
        "tokenizer_class": type(tok).__name__,
        "tokenizer_size": len(tok),
        "synthetic": marker is not None,
        "preset": (marker or {}).get("preset"),
        "seed": (marker or {}).get("seed"),
        "init": (marker or {}).get("init", "random") if marker is not None else None,
        "config_sha256": sha256_file(p / "config.json").hexdigest(),
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
        sha256_file(f, h)
    digest = h.hexdigest()
    _HASH_CACHE[key] = digest
    disk[key] = digest
    if len(disk) > 256:  # keep the file small
        disk = dict(list(disk.items())[-256:])
    try:
        atomic_write_text(cache_file, json.dumps(disk, indent=1) + "\n")
    except OSError:
        pass
    return digest


def model_identity(path: str | Path) -> dict:
    """Fingerprint of a model directory for evidence files."""
    p = validate_model_dir(path)
    marker = read_marker(p)
    return {
        "path": str(p),
        "config_sha256": sha256_file(p / "config.json").hexdigest(),
        "weights_sha256": _weights_sha256(p),
        "synthetic": marker is not None,
        "preset": (marker or {}).get("preset"),
        "seed": (marker or {}).get("seed"),
        "init": (marker or {}).get("init", "random") if marker is not None else None,
    }
