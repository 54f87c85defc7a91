"""``labkit doctor``: is this machine ready for the lab?

Checks that the packages import (and which versions), which device is there, that a small seeded
matmul on that device matches a float64 CPU reference, that ``runs/`` is writable, and that this
project's engine imports and runs: ``import engine`` must resolve to the ``engine/`` directory next to
``labkit/`` (a stale install or a shadow package on PYTHONPATH fails), and that engine builds the
default model (the synthetic one the other commands use, made on first use) and generates one greedy
token on the chosen device. It records the toolchain beside them (handbook 5.1.4): ``pip check``,
``nvcc --version`` and ``nvidia-smi``'s GPUs (index, name, uuid, memory, driver). Writes the evidence of
checkpoint ``setup.doctor``.
"""

from __future__ import annotations

import importlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from labkit.checks import get_checkpoint
from labkit.errors import UserError
from labkit.evidence import describe_device, package_version, write_evidence
from labkit.paths import repo_root, runs_dir

CHECKPOINT = "setup.doctor"
REQUIRED = ("torch", "transformers", "typer", "rich", "numpy", "safetensors", "xxhash", "tokenizers",
            "huggingface_hub")
OPTIONAL = ("triton", "flash_attn")
MATMUL_SIZE = 256
MATMUL_TOL = 1e-3


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())[:300]


def check_imports() -> dict[str, dict]:
    out: dict[str, dict] = {}
    for name in REQUIRED + OPTIONAL:
        entry = {"required": name in REQUIRED, "ok": False, "version": None, "error": None}
        try:
            mod = importlib.import_module(name)
            entry["ok"] = True
            entry["version"] = str(getattr(mod, "__version__", None) or package_version(name) or "")
        except Exception as e:  # ImportError, or a broken binary raising anything
            entry["error"] = _one_line(e)
        out[name] = entry
    return out


def check_flash_attn(dev) -> dict:
    """Which flash-attn this interpreter finds (engine/attention/flash_support.py: where, which version, a full
    or a minimal tools/build_flash_attn.sh build) and what it can run: its dtypes and head dims, and on CUDA
    whether it imports and was built for this GPU (the engine run says which backend ``--attention auto`` took)."""
    from engine.attention import flash_support

    info = flash_support.installed()
    if info is None:
        return {"found": False, "why": "not installed (tools/build_flash_attn.sh builds it on a CUDA machine)"}
    out = {"found": True, **info}
    if dev.type == "cuda":
        try:
            importlib.import_module("flash_attn")
            out["imports"] = True
        except Exception as e:  # a build for another torch or CUDA raises anything
            out["imports"], out["import_error"] = False, _one_line(e)
        major, minor = __import__("torch").cuda.get_device_capability(dev)
        out["device_arch"] = f"{major}{minor}"
        if info.get("archs") and out["device_arch"] not in info["archs"]:
            out["arch_note"] = f"built for sm_{', sm_'.join(info['archs'])}, this GPU is sm_{out['device_arch']}"
    out["runs"] = (f"{'/'.join(info['dtypes'])}, head dims {_dims(info['head_dims'])}, causal and not, paged KV "
                   "in blocks of a multiple of 256 tokens; no float32, no FP8 KV cache")
    return out


def _dims(dims: list[int]) -> str:
    return "8..256 (multiples of 8)" if len(dims) > 8 else ", ".join(map(str, dims))


def project_engine_dir() -> Path:
    """The ``engine/`` directory of this project (next to ``labkit/``)."""
    return (repo_root() / "engine").resolve()


def check_engine_import() -> dict:
    """``import engine``: whether it works, from where, and whether that is this project's engine/."""
    expected = project_engine_dir()
    try:
        mod = importlib.import_module("engine")
        path = Path(mod.__file__).resolve().parent if getattr(mod, "__file__", None) else None
    except Exception as e:
        return {"ok": False, "path": None, "expected": str(expected), "inside_project": False, "error": _one_line(e)}
    return {"ok": True, "path": str(path) if path else None, "expected": str(expected),
            "inside_project": path == expected, "error": None}


DOCTOR_PROMPT = [9000, 9001, 9002]       # three token ids; the generated id is recorded, not judged


def run_engine(model: str | None, device: str) -> tuple[dict, dict | None, dict | None, object | None]:
    """Build the lab's engine on ``device`` (the default model unless ``model``) and generate one greedy
    token. Returns (facts, engine description, model identity, the open LabEngine or None); facts carry
    ``ok: False`` and the error instead of raising."""
    facts: dict = {"ok": False, "prompt_token_ids": DOCTOR_PROMPT, "max_tokens": 1}
    built = None
    try:
        import inspect

        from engine import SamplingParams
        from labkit.lab_engine import build_engine

        t0 = time.perf_counter()
        built = build_engine(model, device)
        facts["init_seconds"] = round(time.perf_counter() - t0, 3)
        eng = built.engine
        facts["engine_class_file"] = str(Path(inspect.getfile(type(eng))).resolve())
        facts["engine_class_inside_project"] = Path(facts["engine_class_file"]).parent == project_engine_dir()
        t0 = time.perf_counter()
        (result,) = eng.generate([DOCTOR_PROMPT], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        facts["generate_seconds"] = round(time.perf_counter() - t0, 4)
        d = built.describe()
        facts.update(device=built.device, attention_backend=d["attention_backend"], dtype=d["dtype"],
                     steps=eng.num_steps, output_token_ids=result["token_ids"],
                     output_tokens=len(result["token_ids"]), ok=True)
        return facts, d, built.model, built
    except Exception as e:  # a broken or shadowed engine raises anything; doctor reports it
        facts["error"] = _one_line(e)
        if built is not None:
            built.engine.close()
        return facts, None, None, None


def pick_device(requested: str = "auto"):
    """``auto`` -> cuda if available else cpu; ``cuda`` without CUDA is a user error."""
    import torch

    req = requested.strip().lower()
    if req == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if req == "cpu":
        return torch.device("cpu")
    if req.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError(f"--device {requested}: CUDA is not available on this machine")
        dev = torch.device("cuda:0" if req == "cuda" else req)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UserError(f"--device {requested}: only {torch.cuda.device_count()} CUDA device(s)")
        return dev
    raise UserError(f"--device must be auto, cpu or cuda[:N], got {requested!r}")


def device_facts(requested: str, dev) -> dict:
    import torch

    facts = {
        "requested": requested,
        "used": str(dev),
        "cuda_available": bool(torch.cuda.is_available()),
        "device_count": int(torch.cuda.device_count()) if torch.cuda.is_available() else 0,
        "name": "cpu",
        "capability": None,
        "total_memory_bytes": None,
        "cuda_version": torch.version.cuda,
    }
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        facts.update(name=props.name, capability=[props.major, props.minor],
                     total_memory_bytes=int(props.total_memory))
    return facts


def tensor_check(dev, seed: int = 0) -> dict:
    """A seeded float32 matmul on ``dev`` against a float64 reference computed on the CPU."""
    import torch

    g = torch.Generator().manual_seed(seed)
    n = MATMUL_SIZE
    a = torch.randn(n, n, generator=g, dtype=torch.float32)
    b = torch.randn(n, n, generator=g, dtype=torch.float32)
    ref = a.double() @ b.double()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # measure float32, not TF32
    try:
        got = (a.to(dev) @ b.to(dev))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        got = got.cpu().double()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    err = float((got - ref).abs().max().item())
    return {
        "device": str(dev),
        "op": "matmul",
        "dtype": "float32",
        "shape": [n, n],
        "seed": seed,
        "reference": "float64 on cpu",
        "max_abs_err": err,
        "tol": MATMUL_TOL,
        "ok": err <= MATMUL_TOL,
    }


def check_runs_writable(directory: Path | None = None) -> dict:
    directory = directory or runs_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".doctor-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write("ok")
        os.unlink(tmp)
        return {"dir": str(directory), "ok": True, "error": None}
    except OSError as e:
        return {"dir": str(directory), "ok": False, "error": _one_line(e)}


def engine_memory(built) -> dict:
    """The KV sizing of an engine built for the lab (appendix B.8.3): weights, peak work memory, KV budget,
    bytes per block and the number of blocks."""
    d = built.describe()
    mem = dict(d["memory"])
    return {
        "attention_backend": d["attention_backend"], "dtype": d["dtype"],
        "block_size": d["config"]["kvcache_block_size"], "num_blocks": d["num_kvcache_blocks"],
        "bytes_per_block": mem.get("bytes_per_block"),
        "mib_per_block": round(mem["bytes_per_block"] / 2**20, 3) if mem.get("bytes_per_block") else None,
        "tokens_in_pool": d["num_kvcache_blocks"] * d["config"]["kvcache_block_size"],
        "memory": mem, "init_seconds": d["init_seconds"],
    }


def _run(args: list[str], timeout: float = 60) -> tuple[int | None, str, str]:
    """(returncode, stdout, the reason it could not run) of a short command; returncode None when it did not run."""
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as e:
        return None, "", _one_line(e)
    return out.returncode, out.stdout + out.stderr, ""


def pip_check() -> dict:
    """``python -m pip check`` in this interpreter: ok (no broken requirements), and what it reported if not."""
    rc, text, why = _run([sys.executable, "-m", "pip", "check"])
    if rc is None:
        return {"ok": None, "reason": why}
    lines = [line for line in text.splitlines() if line.strip()]
    if rc != 0 and any("No module named pip" in line for line in lines):
        return {"ok": None, "reason": "pip is not installed in this interpreter"}
    return {"ok": rc == 0, "problems": [] if rc == 0 else lines[:20]}


def nvcc_version() -> dict:
    """``nvcc --version``'s release line (the CUDA toolkit a source build such as flash-attn's compiles with)."""
    exe = shutil.which("nvcc")
    if exe is None:
        return {"available": False, "reason": "nvcc not found on PATH"}
    rc, text, why = _run([exe, "--version"], timeout=20)
    release = next((line.strip() for line in text.splitlines() if "release" in line), None)
    if rc != 0 or release is None:
        return {"available": False, "reason": why or (text.strip().splitlines() or ["nvcc --version failed"])[-1]}
    return {"available": True, "path": exe, "release": release}


NVIDIA_SMI_FIELDS = ("index", "name", "uuid", "memory.total", "driver_version")


def nvidia_smi() -> dict:
    """Each GPU ``nvidia-smi`` lists: index, name, uuid, memory (memory.total) and driver."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"available": False, "reason": "nvidia-smi not found"}
    rc, text, why = _run([exe, f"--query-gpu={','.join(NVIDIA_SMI_FIELDS)}", "--format=csv,noheader"], timeout=20)
    if rc != 0:
        return {"available": False, "reason": why or (text.strip().splitlines() or ["nvidia-smi failed"])[0]}
    keys = ("index", "name", "uuid", "memory", "driver")
    gpus = [dict(zip(keys, (c.strip() for c in line.split(",")))) for line in text.splitlines() if line.strip()]
    return {"available": True, "gpus": gpus, "driver": gpus[0]["driver"] if gpus else None}


def toolchain() -> dict:
    return {"pip_check": pip_check(), "nvcc": nvcc_version(), "nvidia_smi": nvidia_smi()}


def toolchain_summary(t: dict) -> dict[str, str]:
    """:func:`toolchain`'s facts as one line each (doctor's table, the final report's environment): pip check, nvcc,
    a row a GPU, or why there is none."""
    pc, nvcc, smi = t["pip_check"], t["nvcc"], t["nvidia_smi"]
    rows = {"pip check": "no broken requirements" if pc["ok"] else pc.get("reason") or "; ".join(pc["problems"]),
            "nvcc": nvcc["release"] if nvcc["available"] else nvcc["reason"]}
    if not smi["available"]:
        rows["GPUs (nvidia-smi)"] = smi["reason"]
    for g in smi.get("gpus") or []:
        rows[f"GPU {g['index']}"] = f"{g['name']}, {g['memory']}, driver {g['driver']}, {g['uuid']}"
    return rows


def run_doctor(out: Path | None = None, device: str = "auto", engine: bool = False, model: str | None = None) -> dict:
    """Run every doctor check and write the ``setup.doctor`` evidence; returns the record.

    The engine always runs (one greedy token); with ``engine``, its KV pool sizing is reported too."""
    out = Path(out) if out is not None else get_checkpoint(CHECKPOINT).evidence_path()
    imports = check_imports()
    if not imports["torch"]["ok"]:
        raise UserError(f"torch does not import: {imports['torch']['error']}")
    dev = pick_device(device)
    tensor = tensor_check(dev)
    facts = {
        "python": {"executable": sys.executable, "version": sys.version.split()[0],
                   "platform": platform.platform()},
        "imports": imports,
        "imports_ok": all(v["ok"] for v in imports.values() if v["required"]),
        "missing_required": [k for k, v in imports.items() if v["required"] and not v["ok"]],
        "engine_import": check_engine_import(),
        "device": device_facts(device, dev),
        "tensor_check": tensor,
        "runs_writable": check_runs_writable(),
        "flash_attn": check_flash_attn(dev),
        "toolchain": toolchain(),
    }
    engine_desc = model_identity = None
    if facts["engine_import"]["ok"]:
        facts["engine_run"], engine_desc, model_identity, built = run_engine(model, str(dev))
    else:
        facts["engine_run"], built = {"ok": False, "error": "not run: import engine failed"}, None
    if built is not None:
        try:
            if engine:
                facts["engine"] = engine_memory(built)
        finally:
            built.engine.close()
    # the engine computed on the device (or it did not run, and the evidence says so)
    kind = ("gpu-measured" if dev.type == "cuda" else "cpu-real-engine") if facts["engine_run"]["ok"] else "static"
    return write_evidence(out, checkpoint=CHECKPOINT, kind=kind, facts=facts, device=describe_device(dev), seed=0,
                          engine=engine_desc, model=model_identity)
