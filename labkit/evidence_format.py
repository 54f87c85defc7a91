"""What an evidence file is, shared by its writer (``labkit.evidence``) and its judge (``labkit.checks``).

The schema version, the evidence kinds, the digest that seals a written file, and the fingerprint of the
engine source a run used. Imports only ``labkit.paths``: the writer imports the judge, the judge imports
this, and nothing imports back.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from functools import lru_cache
from pathlib import Path

from labkit.paths import repo_root

#: 2: a file carries ``run_assertions`` (re-judged from its facts) and a ``digest`` over its body.
SCHEMA_VERSION = 2

#: How the data was made. ``reference``: a reference implementation (transformers), not our engine, made
#: it. ``static``: computed from source or configuration, no model ran.
KINDS = ("gpu-measured", "cpu-real-engine", "cpu-real-scheduler", "simulated", "static", "reference", "profile")

#: Kinds whose data the engine's code did not produce: engine edits do not make them stale.
ENGINE_FREE_KINDS = ("reference",)

#: The device class a kind claims: gpu-measured data came from a CUDA device, cpu-* data from the CPU.
KIND_DEVICE = {"gpu-measured": "cuda", "cpu-real-engine": "cpu", "cpu-real-scheduler": "cpu"}

VERDICTS = ("PASS", "FAIL", "REVIEW", "NOT-RUN")

#: The key that holds the digest; the digest covers every other key of the record.
DIGEST_KEY = "digest"


def digest(record: dict) -> str:
    """``sha256:<hex>`` of the canonical JSON (sorted keys, ASCII, no spaces) of ``record`` without its
    digest. Compute it over the JSON form (what ``json.loads`` gives back), as the judge does."""
    body = {k: v for k, v in record.items() if k != DIGEST_KEY}
    text = json.dumps(body, sort_keys=True, ensure_ascii=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode("ascii")).hexdigest()


# --------------------------------------------------------------------------- engine source


def engine_dir() -> Path | None:
    """The directory of the ``engine`` package Python would import (without importing it)."""
    mod = sys.modules.get("engine")
    if mod is not None and getattr(mod, "__file__", None):
        return Path(mod.__file__).resolve().parent
    try:
        spec = importlib.util.find_spec("engine")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0]).resolve()
    local = repo_root() / "engine"
    return local if local.is_dir() else None


def source_hash(directory: Path | None) -> str | None:
    """sha256 over every ``*.py`` below ``directory``: sorted relative path + bytes of each."""
    if directory is None or not directory.is_dir():
        return None
    files = sorted(
        (p for p in directory.rglob("*.py") if "__pycache__" not in p.parts),
        key=lambda p: p.relative_to(directory).as_posix(),
    )
    h = hashlib.sha256()
    for p in files:
        h.update(p.relative_to(directory).as_posix().encode())
        h.update(b"\0")
        h.update(p.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


@lru_cache(maxsize=4)
def _cached_source_hash(directory: str | None) -> str | None:
    return source_hash(Path(directory)) if directory is not None else None


def engine_source_hash() -> str | None:
    """``source_hash`` of the engine this process imports, computed once per process (per directory): the
    code a process runs is the code it imported, and the judge compares many files against one tree."""
    d = engine_dir()
    return _cached_source_hash(str(d) if d is not None else None)
