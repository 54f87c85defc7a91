"""A Hugging Face hub id (``org/name``, vLLM's ``serve Qwen/Qwen3-0.6B``) as a model directory.

:func:`resolve_hub_id` looks in the local Hugging Face cache first (``HF_HUB_CACHE``, else ``HF_HOME/hub``,
else ``~/.cache/huggingface/hub``; read when called, not when huggingface_hub was imported), downloads the
config, tokenizer and weights when the hub can be reached (never with ``HF_HUB_OFFLINE`` set), and otherwise
raises one :class:`ModelError` line that names ``labkit model download``. A path that exists always wins: a
local directory called ``org/name`` is a directory, not a hub id.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from labkit.assets.files import ModelError

HUB_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
PATTERNS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "*.safetensors",
            "model.safetensors.index.json"]
_TRUE = ("1", "true", "yes", "on")


def is_hub_id(model: str | Path) -> bool:
    """``org/name`` that is not an existing path (and not a path spelled with ./, ~ or a leading /)."""
    text = str(model)
    return bool(HUB_ID_RE.fullmatch(text)) and ".." not in text and not Path(text).expanduser().exists()


def hub_cache_dir() -> Path:
    explicit = os.environ.get("HF_HUB_CACHE", "").strip()
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME", "").strip()
    return (Path(home).expanduser() if home else Path.home() / ".cache" / "huggingface") / "hub"


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def resolve_hub_id(repo_id: str) -> Path:
    """The snapshot directory of ``repo_id``: cached, else downloaded (hub reachable), else one ModelError line."""
    hint = (f"download it first (`labkit model download` for Qwen/Qwen3-0.6B, or `huggingface-cli download "
            f"{repo_id}` where the hub can be reached), then pass --model DIR")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelError(f"{repo_id} looks like a Hugging Face hub id but huggingface_hub is not installed; "
                         f"{hint}") from None
    cache = hub_cache_dir()
    try:
        return Path(snapshot_download(repo_id, cache_dir=str(cache), local_files_only=True,
                                      allow_patterns=PATTERNS))
    except KeyboardInterrupt:
        raise
    except Exception:  # noqa: BLE001 - not cached (or a broken cache entry): try the hub below
        pass
    if offline():
        raise ModelError(f"{repo_id} is not in the local Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set; "
                         f"{hint}")
    try:
        return Path(snapshot_download(repo_id, cache_dir=str(cache), allow_patterns=PATTERNS, etag_timeout=10))
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - every hub/network failure becomes one line
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:160]
        raise ModelError(f"{repo_id} is not in the local Hugging Face cache ({cache}) and cannot be downloaded "
                         f"({reason}); {hint}") from None
