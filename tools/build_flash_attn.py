"""A minimal FlashAttention-2 for this engine, built from flash-attn's own sdist on a CUDA machine.

flash-attn 2.8.3's full build compiles 72 kernel files (over 25 minutes on 16 cores). The engine calls two of
its entry points, ``flash_attn_varlen_func`` (prefill, paged through a block table) and
``flash_attn_with_kvcache`` (decode): the forward and the split-KV forward kernels, bf16, causal and not. This
builds only those, for the head dims asked for (default 128 and 64: four kernel files each), with FA2's own
switches turning the rest off:

- ``FLASHATTENTION_DISABLE_BACKWARD``, ``_DROPOUT``, ``_ALIBI``, ``_SOFTCAP``, ``_LOCAL``, ``_UNEVEN_K`` (nvcc
  defines; static_switch.h pins each branch to its off side and flash_api.cpp refuses the feature);
- static_switch.h's dtype and head-dim switches pinned to bf16 and the asked head dims (appended
  ``#undef``/``#define`` of ``FP16_SWITCH`` and ``HEADDIM_SWITCH``: other inputs fail with one line);
- ``run_mha_bwd_``, which flash_api.cpp names for every (dtype, head dim) its switch reaches, defined once in a
  stub file that refuses (mha_bwd already refuses first with the backward disabled), so no backward kernel is
  compiled.

The sdist is checked against its sha256 (pinned below) and never fetched here: the GPU machines reach no
package index, so fetch it where one is reachable (``--fetch`` downloads it from PyPI into ``.gpu/wheels/``,
which .gitignore keeps out of git and a GPU run carries). The wheel goes to ``--out`` and is installed with pip
(into this python3's environment, or ``--target DIR``), where ``import flash_attn`` and so ``--attention auto``
find it; ``flash_attn/labkit_build.json`` says what was built (``labkit doctor`` shows it).

    tools/build_flash_attn.sh [--arch 90|80|80,90] [--head-dims 128,64] [--jobs N] [--out DIR] [--target DIR]
    tools/build_flash_attn.sh --fetch          # on a machine with the package index: the sdist, checked
    tools/build_flash_attn.sh --prepare DIR    # only the source tree and setup.py (no CUDA needed)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

VERSION = "2.8.3"
SDIST = f"flash_attn-{VERSION}.tar.gz"
SHA256 = "1e71dd64a9e0280e0447b8a0c2541bad4bf6ac65bdeaa2f90e51a9e57de0370d"
URL = ("https://files.pythonhosted.org/packages/3b/b2/8d76c41ad7974ee264754709c22963447f7f8134613fd9ce80984ed0dab7/"
       + SDIST)
ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".gpu" / "wheels"
HEAD_DIMS = (128, 64)
ARCHS = ("80", "90")
DISABLE = ("BACKWARD", "DROPOUT", "ALIBI", "SOFTCAP", "LOCAL", "UNEVEN_K")
# flash-attn 2.8.3's setup.py nvcc flags (its commented-out DISABLE lines are ours, below)
NVCC_FLAGS = ["-O3", "-std=c++17", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
              "-U__CUDA_NO_HALF2_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "--expt-relaxed-constexpr",
              "--expt-extended-lambda", "--use_fast_math"]


class BuildError(Exception):
    """One line for the user; the script exits 2."""


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def checked_sdist(path: Path) -> Path:
    if not path.is_file():
        raise BuildError(f"no {path} (fetch it where the package index is reachable: tools/build_flash_attn.sh --fetch)")
    got = sha256_of(path)
    if got != SHA256:
        raise BuildError(f"{path}: sha256 {got}, expected {SHA256} (flash-attn {VERSION}'s sdist)")
    return path


def fetch(dest_dir: Path) -> Path:
    """The sdist from PyPI (pip download fails at its metadata step without CUDA: the file itself is fetched)."""
    import urllib.request

    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / SDIST
    if dest.is_file() and sha256_of(dest) == SHA256:
        return dest
    tmp = dest.with_suffix(".part")
    with urllib.request.urlopen(URL, timeout=300) as r, open(tmp, "wb") as f:
        shutil.copyfileobj(r, f)
    tmp.replace(dest)
    return checked_sdist(dest)


def kernel_files(head_dims: tuple[int, ...]) -> list[str]:
    """The forward and split-KV forward kernels, bf16, causal and not, for each head dim."""
    return [f"flash_fwd{split}_hdim{d}_bf16{causal}_sm80.cu"
            for d in head_dims for split in ("", "_split") for causal in ("", "_causal")]


def switch_pins(head_dims: tuple[int, ...]) -> str:
    """What is appended to static_switch.h: bf16 only, and the asked head dims only (exactly: uneven K is off)."""
    dims = sorted(head_dims)
    branches = "".join(f"    {'else ' if i else ''}if (HEADDIM == {d}) {{ constexpr static int kHeadDim = {d}; "
                       "return __VA_ARGS__(); } \\\n" for i, d in enumerate(dims[:-1]))
    last = dims[-1]
    return f"""
// tools/build_flash_attn.py: this build has bf16 kernels for head dims {', '.join(map(str, dims))} only
#undef FP16_SWITCH
#define FP16_SWITCH(COND, ...) \\
  [&] {{ \\
    TORCH_CHECK(!(COND), "this flash-attn build runs bf16 only"); \\
    using elem_type = cutlass::bfloat16_t; \\
    return __VA_ARGS__(); \\
  }}()
#undef HEADDIM_SWITCH
#define HEADDIM_SWITCH(HEADDIM, ...) \\
  [&] {{ \\
{branches}    TORCH_CHECK(HEADDIM == {last}, "this flash-attn build has head dims {', '.join(map(str, dims))} only"); \\
    constexpr static int kHeadDim = {last}; \\
    return __VA_ARGS__(); \\
  }}()
"""


def bwd_stub(head_dims: tuple[int, ...]) -> str:
    inst = "".join(f"template void run_mha_bwd_<cutlass::bfloat16_t, {d}, {c}>(Flash_bwd_params &, cudaStream_t);\n"
                   for d in sorted(head_dims) for c in ("false", "true"))
    return f"""// tools/build_flash_attn.py: no backward kernels in this build (FLASHATTENTION_DISABLE_BACKWARD; mha_bwd
// refuses before it gets here). flash_api.cpp names run_mha_bwd_ for each (dtype, head dim) its switch reaches.
#include <c10/util/Exception.h>
#include <cutlass/numeric_types.h>
#include "namespace_config.h"
#include "flash.h"

namespace FLASH_NAMESPACE {{
template<typename T, int Headdim, bool Is_causal>
void run_mha_bwd_(Flash_bwd_params &params, cudaStream_t stream) {{
    TORCH_CHECK(false, "this flash-attn build has no backward kernels");
}}
{inst}}}  // namespace FLASH_NAMESPACE
"""


SETUP_PY = '''# written by tools/build_flash_attn.py
import json
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension

b = json.load(open("flash_attn/labkit_build.json"))
setup(
    name="flash_attn", version=b["version"] + "+labkit", packages=["flash_attn"],
    package_data={"flash_attn": ["labkit_build.json"]},
    ext_modules=[CUDAExtension(
        name="flash_attn_2_cuda", sources=b["sources"],
        extra_compile_args={"cxx": ["-O3", "-std=c++17"], "nvcc": b["nvcc_flags"]},
        include_dirs=b["include_dirs"])],
    cmdclass={"build_ext": BuildExtension},
)
'''


def prepare(sdist: Path, work: Path, head_dims: tuple[int, ...], archs: tuple[str, ...], threads: int) -> Path:
    """The minimal project in ``work``/project: the sdist unpacked beside it, static_switch.h pinned, the stub,
    the Python package (flash_attn/__init__.py and flash_attn_interface.py only), labkit_build.json, setup.py."""
    for a in archs:
        if a not in ARCHS:
            raise BuildError(f"--arch must be among {', '.join(ARCHS)}, got {a}")
    for d in head_dims:
        if d not in (32, 64, 96, 128, 192, 256):
            raise BuildError(f"--head-dims: flash-attn has kernel files for 32, 64, 96, 128, 192, 256, not {d}")
    src = work / f"flash_attn-{VERSION}"
    if not src.is_dir():
        work.mkdir(parents=True, exist_ok=True)
        with tarfile.open(sdist) as t:
            t.extractall(work, filter="data")
    csrc = src / "csrc" / "flash_attn"
    missing = [f for f in kernel_files(head_dims) if not (csrc / "src" / f).is_file()]
    if missing:
        raise BuildError(f"the sdist has no {', '.join(missing)}")
    proj = work / "project"
    if proj.exists():
        shutil.rmtree(proj)
    (proj / "flash_attn").mkdir(parents=True)
    inc = proj / "include"                         # our copy of src/ (static_switch.h pinned) before the sdist's
    shutil.copytree(csrc / "src", inc, ignore=shutil.ignore_patterns("*.cu"))
    with open(inc / "static_switch.h", "a") as f:
        f.write(switch_pins(head_dims))
    (proj / "flash_bwd_stub.cu").write_text(bwd_stub(head_dims))
    for name in ("__init__.py", "flash_attn_interface.py"):
        shutil.copy(src / "flash_attn" / name, proj / "flash_attn" / name)
    (proj / "csrc").symlink_to(src / "csrc", target_is_directory=True)     # sources by relative path, from here
    gencode = [f for a in archs for f in ("-gencode", f"arch=compute_{a},code=sm_{a}")]
    build = {
        "version": VERSION, "sdist_sha256": SHA256, "head_dims": sorted(head_dims), "dtypes": ["bfloat16"],
        "archs": list(archs), "disabled": [f"FLASHATTENTION_DISABLE_{d}" for d in DISABLE],
        "sources": ["csrc/flash_attn/flash_api.cpp", *(f"csrc/flash_attn/src/{f}" for f in kernel_files(head_dims)),
                    "flash_bwd_stub.cu"],
        "include_dirs": [str(inc), str(csrc), str(src / "csrc" / "cutlass" / "include")],
        "nvcc_flags": NVCC_FLAGS + [f"-DFLASHATTENTION_DISABLE_{d}" for d in DISABLE] + gencode
        + ["--threads", str(threads)],
    }
    (proj / "flash_attn" / "labkit_build.json").write_text(json.dumps(build, indent=1) + "\n")
    (proj / "setup.py").write_text(SETUP_PY)
    return proj


def build(proj: Path, out: Path, jobs: int) -> Path:
    if shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        raise BuildError("no nvcc on PATH and no CUDA_HOME: build on a CUDA machine")
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "MAX_JOBS": str(jobs)}
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(out),
           str(proj)]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)
    wheels = sorted(out.glob(f"flash_attn-{VERSION}+labkit-*.whl"), key=lambda p: p.stat().st_mtime)
    if not wheels:
        raise BuildError(f"pip wheel made no flash_attn-{VERSION}+labkit wheel in {out}")
    return wheels[-1]


def install(wheel: Path, target: Path | None) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--force-reinstall", "--no-compile"]
    cmd += ["--target", str(target)] if target else []
    subprocess.run(cmd + [str(wheel)], check=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sdist", type=Path, default=WHEELS / SDIST, help=f"flash-attn {VERSION}'s sdist (sha256 checked)")
    p.add_argument("--fetch", action="store_true", help="download the sdist from PyPI into .gpu/wheels and stop")
    p.add_argument("--arch", default="90", help="sm targets, comma-separated: 80, 90 (default 90)")
    p.add_argument("--head-dims", default="128,64", help="head dims to compile (default 128,64)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 8, help="files compiled at once (MAX_JOBS)")
    p.add_argument("--work", type=Path, default=Path("/tmp/flash-attn-build"), help="build directory")
    p.add_argument("--out", type=Path, default=WHEELS, help="where the wheel goes (default .gpu/wheels)")
    p.add_argument("--target", type=Path, default=None, help="pip install --target DIR (default: this python3's environment)")
    p.add_argument("--prepare", type=Path, default=None, metavar="DIR", help="only write the project into DIR (no CUDA needed)")
    p.add_argument("--no-install", action="store_true", help="build the wheel only")
    a = p.parse_args(argv)
    try:
        if a.fetch:
            print(fetch(a.sdist.parent))
            return 0
        head_dims = tuple(int(d) for d in a.head_dims.split(",") if d.strip())
        archs = tuple(x.strip() for x in a.arch.split(",") if x.strip())
        if not head_dims or not archs:
            raise BuildError("--head-dims and --arch need at least one value each")
        sdist = checked_sdist(a.sdist)
        files = len(kernel_files(head_dims)) + 2
        threads = max(1, (a.jobs * 2) // max(1, files))     # nvcc --threads: the cores left over per file
        proj = prepare(sdist, a.prepare or a.work, head_dims, archs, threads)
        if a.prepare:
            print(proj)
            return 0
        t0 = time.time()
        wheel = build(proj, a.out, a.jobs)
        print(f"built {wheel} in {time.time() - t0:.0f} s ({files} files, sm_{', sm_'.join(archs)})", flush=True)
        if not a.no_install:
            install(wheel, a.target)
            print(f"installed {wheel.name}" + (f" into {a.target}" if a.target else ""))
        return 0
    except BuildError as e:
        print(f"build_flash_attn: {e}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as e:
        print(f"build_flash_attn: {' '.join(map(str, e.cmd[:4]))} ... failed with exit {e.returncode}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
