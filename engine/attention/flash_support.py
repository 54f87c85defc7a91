"""What the installed flash-attn can run, read without importing it (the flash backend's refusals, ``--attention
auto``'s choice and ``labkit doctor`` ask here).

A full flash-attn 2 build runs fp16 and bf16 at every head dim up to 256 (a multiple of 8). The minimal build of
tools/build_flash_attn.sh (the forward and split-KV forward kernels only, bf16, the head dims it was asked for)
leaves ``flash_attn/labkit_build.json`` beside the package saying what it compiled; FA2 has no float32 kernels
in either, and no FP8 KV cache.
"""
from __future__ import annotations

import importlib.util
import json
from functools import lru_cache
from pathlib import Path

BUILD_FILE = "labkit_build.json"
FULL_HEAD_DIMS = tuple(range(8, 257, 8))          # FA2: head dims up to 256, multiples of 8
FULL_DTYPES = ("float16", "bfloat16")


@lru_cache(maxsize=1)
def installed() -> dict | None:
    """The flash-attn this interpreter would import: its location, version and what it can run (None: none).
    ``build`` is ``labkit-minimal`` (tools/build_flash_attn.sh's, with its labkit_build.json) or ``full``."""
    try:
        spec = importlib.util.find_spec("flash_attn")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    where = Path(next(iter(spec.submodule_search_locations)))
    info = {"location": str(where), "version": _version(where), "build": "full",
            "head_dims": list(FULL_HEAD_DIMS), "dtypes": list(FULL_DTYPES), "archs": None}
    build = where / BUILD_FILE
    if build.is_file():
        try:
            b = json.loads(build.read_text())
            info.update(build="labkit-minimal", head_dims=[int(d) for d in b["head_dims"]],
                        dtypes=[str(t) for t in b["dtypes"]], archs=[str(a) for a in b["archs"]],
                        sdist_sha256=b.get("sdist_sha256"))
        except (OSError, ValueError, KeyError, TypeError) as e:
            info["build_file_error"] = f"{build}: {e}"
    return info


def _version(where: Path) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flash_attn")
    except PackageNotFoundError:
        init = where / "__init__.py"
        for line in init.read_text().splitlines() if init.is_file() else []:
            if line.startswith("__version__"):
                return line.split("=", 1)[1].strip().strip("\"'")
    return None


def unsupported_model(dtype: str | None = None, head_dim: int | None = None,
                      kv_cache_dtype: str = "auto") -> str | None:
    """Why the installed flash-attn cannot run a model of this dtype (torch's name: bfloat16, float32, ...),
    head dim and KV cache dtype; None: it can (or nothing is known to refuse). One line, for a ConfigError."""
    info = installed()
    if info is None:
        return None                                   # not installed: the registry says "needs flash_attn"
    if dtype == "float32":
        return "FlashAttention-2 has no float32 kernels (use --dtype bfloat16, or --attention triton)"
    if dtype is not None and dtype not in info["dtypes"]:
        return (f"this flash-attn build runs {'/'.join(info['dtypes'])} only, not {dtype} "
                f"({info['build']} build at {info['location']})")
    if head_dim is not None and head_dim not in info["head_dims"]:
        dims = info["head_dims"] if info["build"] != "full" else ["multiples of 8 up to 256"]
        return (f"this flash-attn build has no kernels for head dim {head_dim} (it has {', '.join(map(str, dims))}; "
                f"tools/build_flash_attn.sh --head-dims adds one)")
    if kv_cache_dtype != "auto":
        return f"FlashAttention-2 reads no {kv_cache_dtype} KV cache (use --attention triton or torch)"
    return None
