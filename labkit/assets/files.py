"""The files under the lab's model directories: ModelError, the cache directory, atomic writes, sha256, the synth marker.

The bottom of the package: every other ``labkit.assets`` module imports from here, nothing here
imports them.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from labkit.errors import UserError


class ModelError(UserError):
    """A user-caused model problem (bad path, malformed directory, hub unreachable).

    ``str(e)`` is always a single line.
    """

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).strip().splitlines()))

SYNTH_MARKER = "labkit_synth.json"
#: Bumped whenever the synthesized layout or weights change; a cached default model with another
#: version is rebuilt by resolve_model. 2: norm weights are seeded per tensor (1 + 0.1 N(0, 1)).
#: 3: the marker names its init; qwen3-0.6b defaults to the BF16-tame init (labkit/assets/synth_tame.py).
#: 4: the chat template is Qwen3's own (tools, tool calls, tool results, its thinking default).
SYNTH_FORMAT_VERSION = 4


def default_cache_dir() -> Path:
    """``$LABKIT_CACHE`` if set, else ``~/.cache/labkit``."""
    env = os.environ.get("LABKIT_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "labkit"


def sha256_file(path: Path, h: "hashlib._Hash | None" = None) -> "hashlib._Hash":
    h = h or hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(8 << 20)
            if not block:
                break
            h.update(block)
    return h


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def atomic_write_text(path: Path, text: str) -> None:
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


def apply_umask(directory: Path) -> None:
    """mkdtemp/mkstemp create private (0700/0600) entries; give them the usual permissions."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(directory, 0o777 & ~mask)
    for f in directory.iterdir():
        if f.is_file():
            os.chmod(f, 0o666 & ~mask)


def read_marker(path: Path) -> dict | None:
    marker = path / SYNTH_MARKER
    if not marker.is_file():
        return None
    try:
        data = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {"synthetic": True}
    return data if isinstance(data, dict) else {"synthetic": True}
