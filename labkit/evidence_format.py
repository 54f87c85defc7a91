"""What an evidence file is, shared by its writer (``labkit.evidence``) and its judge (``labkit.checks``).

The schema version, the evidence kinds, the digest that seals a written file, the HMAC signature a key
holder adds, and the fingerprint of the engine source a run used. Imports only ``labkit.paths`` and
``labkit.errors``: the writer imports the judge, the judge imports this, and nothing imports back.
"""

from __future__ import annotations

import hashlib
import hmac
import importlib.util
import json
import os
import sys
from functools import lru_cache
from pathlib import Path

from labkit.errors import UserError
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


#: The key that holds the HMAC signature (``{"hmac_sha256": hex, "key_id": hex}``), when a key signed it.
SIGNATURE_KEY = "signature"

#: The key itself (text), or a file holding it: the runner that signs and the judge that verifies hold it.
KEY_ENV, KEY_FILE_ENV = "LABKIT_EVIDENCE_KEY", "LABKIT_EVIDENCE_KEY_FILE"
_MIN_KEY_BYTES = 16


def _body_text(record: dict) -> bytes:
    """The canonical JSON (sorted keys, ASCII, no spaces) of ``record`` without its digest and signature."""
    body = {k: v for k, v in record.items() if k not in (DIGEST_KEY, SIGNATURE_KEY)}
    return json.dumps(body, sort_keys=True, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def digest(record: dict) -> str:
    """``sha256:<hex>`` of the canonical JSON of ``record`` without its digest (and signature). Compute it
    over the JSON form (what ``json.loads`` gives back), as the judge does. Anyone can recompute it: it
    shows a file was not changed by accident, not who wrote it."""
    return "sha256:" + hashlib.sha256(_body_text(record)).hexdigest()


def evidence_key() -> bytes | None:
    """The signing key: ``$LABKIT_EVIDENCE_KEY`` (the key as text) or the bytes of the file
    ``$LABKIT_EVIDENCE_KEY_FILE`` (a trailing newline dropped); None when neither is set. A missing file or
    a key shorter than 16 bytes is a UserError (one line)."""
    text, file = os.environ.get(KEY_ENV), os.environ.get(KEY_FILE_ENV)
    if text and file:
        raise UserError(f"set {KEY_ENV} or {KEY_FILE_ENV}, not both")
    if file:
        try:
            key = Path(file).expanduser().read_bytes().rstrip(b"\r\n")
        except OSError as e:
            raise UserError(f"{KEY_FILE_ENV}={file}: cannot read the key ({e.strerror or e})") from None
        where = f"{KEY_FILE_ENV}={file}"
    elif text:
        key, where = text.encode("utf-8"), KEY_ENV
    else:
        return None
    if len(key) < _MIN_KEY_BYTES:
        raise UserError(f"{where}: the evidence key must be at least {_MIN_KEY_BYTES} bytes (e.g. `openssl rand -hex 32`)")
    return key


def key_id(key: bytes) -> str:
    """A short public name for a key (an HMAC of a fixed text, not the key's own hash)."""
    return hmac.new(key, b"labkit evidence key id", hashlib.sha256).hexdigest()[:16]


def sign(record: dict, key: bytes) -> dict:
    """``{"hmac_sha256": HMAC-SHA256(key, canonical body), "key_id": key_id(key)}``: only a holder of the key
    can make it, and any change to the body breaks it."""
    return {"hmac_sha256": hmac.new(key, _body_text(record), hashlib.sha256).hexdigest(), "key_id": key_id(key)}


def signature_problem(record: dict, key: bytes) -> str:
    """Why ``record`` is not signed by ``key`` ("" when it is)."""
    sig = record.get(SIGNATURE_KEY)
    if not isinstance(sig, dict) or not isinstance(sig.get("hmac_sha256"), str):
        return "not signed by this key: the file carries no signature"
    if sig.get("key_id") != key_id(key):
        return f"not signed by this key: signed by key {sig.get('key_id')!r}, this key is {key_id(key)!r}"
    if not hmac.compare_digest(sig["hmac_sha256"], sign(record, key)["hmac_sha256"]):
        return "not signed by this key: the signature does not match the body (edited, or forged)"
    return ""


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
