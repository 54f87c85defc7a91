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
    hint = download_hint(repo_id)
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
        raise ModelError(f"{repo_id}: not in the Hugging Face cache ({_home(cache)}) and HF_HUB_OFFLINE is set; {hint}")
    try:
        return Path(snapshot_download(repo_id, cache_dir=str(cache), allow_patterns=PATTERNS, etag_timeout=10))
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - every hub/network failure becomes one line
        raise ModelError(f"{repo_id}: not in the Hugging Face cache ({_home(cache)}) and not downloadable "
                         f"({_reason(exc)}); {hint}") from None


def download_hint(repo_id: str) -> str:
    """How to get ``repo_id`` by hand: the hub CLI that is installed (``hf``, formerly ``huggingface-cli``),
    else labkit's own download of Qwen3-0.6B."""
    import shutil
    import sys

    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])   # the venv's bin too
    cli = next((c for c in ("hf", "huggingface-cli") if shutil.which(c, path=path)), None)
    how = f"`{cli} download {repo_id}`" if cli else "`labkit model download` (Qwen/Qwen3-0.6B)"
    return f"get it with {how} where the hub is reachable, then pass --model DIR"


def _home(path: Path) -> str:
    home = str(Path.home())
    return "~" + str(path)[len(home):] if str(path).startswith(home + os.sep) else str(path)


def _reason(exc: BaseException, limit: int = 60) -> str:
    """The root cause of a hub failure in a few words, cut at a word, never mid-word: no network, or the innermost
    exception's first sentence."""
    chain, e = [], exc
    while e is not None and len(chain) < 8:
        chain.append(e)
        e = e.__cause__ or e.__context__
    text = " ".join(" ".join(str(x) for x in chain).split()).lower()
    if any(k in text for k in ("name or service not known", "connecterror", "connection", "network is unreachable",
                               "temporary failure in name resolution", "timed out")):
        return "the hub cannot be reached"
    words = " ".join(str(chain[-1]).split()).split(". ")[0] or type(chain[-1]).__name__
    if len(words) > limit:
        words = words[:limit].rsplit(" ", 1)[0] + " ..."
    return words
