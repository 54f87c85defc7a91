"""Download the real Qwen/Qwen3-0.6B from the Hugging Face hub at a pinned revision."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from labkit.assets.files import ModelError, default_cache_dir


DEFAULT_REPO_ID = "Qwen/Qwen3-0.6B"
#: Pinned revision (commit) of Qwen/Qwen3-0.6B on the Hugging Face hub used by download_model.
DEFAULT_REVISION = "c1899de289a04d12100db370d81485cdf75e47ca"


def default_download_dir() -> Path:
    """Where ``labkit model download`` puts Qwen3-0.6B without ``--out``: under the lab's cache."""
    return default_cache_dir() / "models" / "Qwen3-0.6B"


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
