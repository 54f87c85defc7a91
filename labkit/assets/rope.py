"""Rope scaling for model directories: ``TYPE:FACTOR`` specs (``yarn:4``, ``linear:2``), the config.json
block they stand for, and a model directory's copy that carries one (:func:`with_rope_scaling`).

The block is written as ``rope_scaling`` (what Qwen3's model cards show; transformers 5 reads it into
``rope_parameters``). A yarn block's ``original_max_position_embeddings`` is the model's
``max_position_embeddings`` divided by the factor, so its low frequencies change at every length.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from labkit.assets.files import SYNTH_MARKER, ModelError, default_cache_dir

#: Types a spec may name. ``dynamic`` is accepted so that a model the engine refuses can be written.
SPEC_TYPES = ("yarn", "linear", "dynamic")


def parse_rope_spec(spec: str) -> tuple[str, float]:
    """``"yarn:4"`` -> ``("yarn", 4.0)``; a ModelError (one line) for anything else."""
    kind, sep, factor = str(spec).strip().partition(":")
    try:
        value = float(factor) if sep else float("nan")
    except ValueError:
        value = float("nan")
    if kind not in SPEC_TYPES or not value > 1.0 or value == float("inf"):
        raise ModelError(f"rope scaling {spec!r}: expected TYPE:FACTOR with TYPE one of {', '.join(SPEC_TYPES)} "
                         "and FACTOR > 1 (e.g. yarn:4)")
    return kind, value


def rope_scaling_block(spec: str, max_position_embeddings: int) -> dict:
    """The config.json ``rope_scaling`` block of ``spec`` for a model of ``max_position_embeddings``."""
    kind, factor = parse_rope_spec(spec)
    block: dict = {"rope_type": kind, "factor": factor}
    if kind == "yarn":
        block["original_max_position_embeddings"] = int(max_position_embeddings / factor)
    return block


def spec_name(spec: str) -> str:
    kind, factor = parse_rope_spec(spec)
    return f"{kind}{factor:g}"


def apply_rope_scaling(cfg: dict, spec: str) -> dict:
    """``cfg`` with ``spec``'s block as its only rope scaling (a ``rope_parameters`` block is replaced)."""
    out = {k: v for k, v in cfg.items() if k != "rope_parameters"}
    out["rope_scaling"] = rope_scaling_block(spec, int(cfg.get("max_position_embeddings", 40960)))
    return out


def with_rope_scaling(source: str | Path, spec: str) -> Path:
    """A model directory that is ``source`` with ``spec``'s rope scaling in its config.json: every other file
    is a symlink to ``source``'s (same weights, same tokenizer); a synthetic marker gains ``rope_scaling``.
    Kept under the cache (``models/rope/``), keyed by the source's path and config, and reused."""
    src = Path(source).resolve()
    try:
        cfg_text = (src / "config.json").read_text(encoding="utf-8")
        cfg = json.loads(cfg_text)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read {src / 'config.json'}: {exc}") from None
    key = hashlib.sha256(f"{src}\n{cfg_text}".encode()).hexdigest()[:12]
    target = default_cache_dir() / "models" / "rope" / f"{src.name}-{key}-{spec_name(spec)}"
    new_cfg = json.dumps(apply_rope_scaling(cfg, spec), indent=2) + "\n"
    if (target / "config.json").is_file() and (target / "config.json").read_text(encoding="utf-8") == new_cfg:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        for f in src.iterdir():
            if f.name in ("config.json", SYNTH_MARKER) or f.name.startswith("."):
                continue
            os.symlink(f, tmp / f.name)
        (tmp / "config.json").write_text(new_cfg, encoding="utf-8")
        marker = src / SYNTH_MARKER
        if marker.is_file():
            data = json.loads(marker.read_text(encoding="utf-8"))
            data["rope_scaling"] = spec
            (tmp / SYNTH_MARKER).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        shutil.rmtree(target, ignore_errors=True)
        os.rename(tmp, target)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if (target / "config.json").is_file():      # another process made the same copy first
            return target
        raise ModelError(f"cannot write the rope-scaled copy of {src}: {exc.strerror or exc}") from None
    return target
