"""flash_attn's refusals and ``--attention auto``'s fallback, on the CPU with flash-attn stood in for
(engine/attention/flash_support.py, engine/attention/__init__.py): FA2 has no float32 kernels and no FP8 KV
cache; a minimal build (tools/build_flash_attn.sh) has only its head dims and bf16; a build that does not import
is refused. ``auto`` then takes triton; asking for flash_attn by name fails with one line."""
from __future__ import annotations

import json
import sys
import types

import pytest

import engine.attention as attention
from engine.attention import ModelNeeds, available_backends, flash_support, resolve_backend_name
from engine.errors import ConfigError

MINIMAL = {"location": "/x/flash_attn", "version": "2.8.3+labkit", "build": "labkit-minimal",
           "head_dims": [64, 128], "dtypes": ["bfloat16"], "archs": ["90"]}
FULL = {**MINIMAL, "build": "full", "head_dims": list(flash_support.FULL_HEAD_DIMS),
        "dtypes": list(flash_support.FULL_DTYPES), "archs": None}


@pytest.fixture
def flash(monkeypatch):
    """flash_attn and triton importable, flash-attn's build as the test sets it (default: the minimal one)."""
    monkeypatch.setattr(attention, "_importable", lambda name: name in ("flash_attn", "triton"))
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    info = dict(MINIMAL)
    monkeypatch.setattr(flash_support, "installed", lambda: info)
    return info


@pytest.mark.parametrize("needs, picked", [
    (ModelNeeds("bfloat16", 128), "flash_attn"),
    (ModelNeeds("bfloat16", 64), "flash_attn"),
    (ModelNeeds("float32", 128), "triton"),                       # FA2 has no float32
    (ModelNeeds("float16", 128), "triton"),                       # the minimal build is bf16 only
    (ModelNeeds("bfloat16", 96), "triton"),                       # nor this head dim
    (ModelNeeds("bfloat16", 128, cache="fp8"), "triton"),  # nor an FP8 cache
])
def test_auto_takes_flash_only_where_its_build_runs_the_model(flash, needs, picked):
    assert resolve_backend_name("auto", "cuda", 256, needs) == picked
    assert available_backends("cuda", 256, needs)[0] == picked
    assert resolve_backend_name("auto", "cuda", 16, needs) == "triton"      # paged blocks of 256 tokens or more
    assert resolve_backend_name("auto", "cpu", 256, needs) == "torch"


@pytest.mark.parametrize("needs, message", [
    (ModelNeeds("float32", 128), "FlashAttention-2 has no float32 kernels (use --dtype bfloat16, or --attention triton)"),
    (ModelNeeds("float16", 128), "this flash-attn build runs bfloat16 only, not float16"),
    (ModelNeeds("bfloat16", 96), "this flash-attn build has no kernels for head dim 96 (it has 64, 128;"),
    (ModelNeeds("bfloat16", 128, cache="fp8"), "FlashAttention-2 reads no fp8 KV cache"),
])
def test_asking_for_flash_where_it_cannot_run_is_one_line(flash, needs, message):
    with pytest.raises(ConfigError) as e:
        resolve_backend_name("flash_attn", "cuda", 256, needs)
    text = str(e.value)
    assert text.startswith("attention backend 'flash_attn' is not available on cuda: " + message), text
    assert "\n" not in text


def test_a_full_build_runs_fp16_and_other_head_dims_but_never_float32(flash):
    flash.update(FULL)
    assert resolve_backend_name("flash_attn", "cuda", 256, ModelNeeds("float16", 96)) == "flash_attn"
    with pytest.raises(ConfigError, match="no float32 kernels"):
        resolve_backend_name("flash_attn", "cuda", 256, ModelNeeds("float32", 128))


def test_a_flash_attn_that_does_not_import_is_passed_over(flash, monkeypatch):
    def broken(*a, **k):
        raise ImportError("libcudart.so.12: cannot open shared object file")

    monkeypatch.delitem(sys.modules, "flash_attn")
    real = attention.importlib.import_module
    monkeypatch.setattr(attention.importlib, "import_module",
                        lambda name, *a: broken() if name == "flash_attn" else real(name, *a))
    assert resolve_backend_name("auto", "cuda", 256, ModelNeeds("bfloat16", 128)) == "triton"
    with pytest.raises(ConfigError, match="flash_attn does not import: ImportError: libcudart.so.12"):
        resolve_backend_name("flash_attn", "cuda", 256, ModelNeeds("bfloat16", 128))


def test_installed_reads_the_minimal_build_file(tmp_path, monkeypatch):
    pkg = tmp_path / "flash_attn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('__version__ = "2.8.3"\n')
    (pkg / "labkit_build.json").write_text(json.dumps({"head_dims": [64, 128], "dtypes": ["bfloat16"],
                                                       "archs": ["80", "90"], "sdist_sha256": "ab"}))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    flash_support.installed.cache_clear()
    try:
        info = flash_support.installed()
        assert info["build"] == "labkit-minimal" and info["head_dims"] == [64, 128] and info["archs"] == ["80", "90"]
        assert info["location"] == str(pkg) and info["dtypes"] == ["bfloat16"]
        (pkg / "labkit_build.json").unlink()
        flash_support.installed.cache_clear()
        assert flash_support.installed()["build"] == "full"
    finally:
        flash_support.installed.cache_clear()


def test_config_says_what_the_model_needs(tiny_model_dir):
    from engine.config import Config

    cfg = Config(str(tiny_model_dir), kv_cache_dtype="fp8")
    assert cfg.attention_needs("cpu") == ModelNeeds("float32", cfg.shape.head_dim, "fp8")
    assert cfg.attention_needs("cuda").activations == "bfloat16"
