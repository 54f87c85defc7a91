"""tools/build_flash_attn.py on the CPU: the sdist's hash is checked, the minimal project names only the forward
and split-KV kernel files for the asked head dims with FA2's DISABLE switches and the sm targets, and the pinned
dtype/head-dim switches and the backward stub are valid C++ that dispatch as asked (compiled and run with the
host compiler against stand-ins for torch and cutlass). The CUDA build itself runs on a GPU machine
(tools/gpu/h200_session.sh check)."""
from __future__ import annotations

import importlib.util
import io
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("build_flash_attn", ROOT / "tools" / "build_flash_attn.py")
bfa = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bfa)

KERNELS_128 = {"flash_fwd_hdim128_bf16_sm80.cu", "flash_fwd_hdim128_bf16_causal_sm80.cu",
               "flash_fwd_split_hdim128_bf16_sm80.cu", "flash_fwd_split_hdim128_bf16_causal_sm80.cu"}


def _fake_sdist(path: Path) -> Path:
    """A tarball with the sdist's layout (file names as in flash-attn 2.8.3; contents stand-ins)."""
    names = [f"csrc/flash_attn/src/flash_{kind}_hdim{d}_{t}{c}_sm80.cu" for kind in ("fwd", "fwd_split", "bwd")
             for d in (32, 64, 96, 128, 192, 256) for t in ("fp16", "bf16") for c in ("", "_causal")]
    names += ["csrc/flash_attn/flash_api.cpp", "csrc/flash_attn/src/static_switch.h", "csrc/flash_attn/src/flash.h",
              "csrc/cutlass/include/cutlass/numeric_types.h", "flash_attn/__init__.py",
              "flash_attn/flash_attn_interface.py", "flash_attn/bert_padding.py"]
    with tarfile.open(path, "w:gz") as t:
        for n in names:
            data = b"#define FP16_SWITCH(COND, ...) original\n" if n.endswith("static_switch.h") else b"// " + n.encode()
            info = tarfile.TarInfo(f"flash_attn-{bfa.VERSION}/{n}")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return path


def test_the_sdist_is_checked_against_its_pinned_hash(tmp_path):
    bad = tmp_path / bfa.SDIST
    bad.write_bytes(b"not flash-attn")
    with pytest.raises(bfa.BuildError, match=f"sha256 .*, expected {bfa.SHA256}"):
        bfa.checked_sdist(bad)
    with pytest.raises(bfa.BuildError, match="--fetch"):
        bfa.checked_sdist(tmp_path / "missing.tar.gz")
    assert bfa.main(["--sdist", str(bad)]) == 2                        # one line, exit 2


@pytest.mark.parametrize("head_dims, archs", [((128,), ("90",)), ((128, 64), ("80", "90"))])
def test_the_project_holds_only_the_forward_kernels_asked_for(tmp_path, head_dims, archs):
    proj = bfa.prepare(_fake_sdist(tmp_path / "s.tar.gz"), tmp_path / "w", head_dims, archs, threads=2)
    b = json.loads((proj / "flash_attn" / "labkit_build.json").read_text())
    kernels = {Path(s).name for s in b["sources"] if s.endswith("_sm80.cu")}
    expected = {k.replace("128", str(d)) for d in head_dims for k in KERNELS_128}
    assert kernels == expected and not any("bwd" in k or "fp16" in k for k in kernels)
    assert {Path(s).name for s in b["sources"]} - kernels == {"flash_api.cpp", "flash_bwd_stub.cu"}
    for d in bfa.DISABLE:
        assert f"-DFLASHATTENTION_DISABLE_{d}" in b["nvcc_flags"]
    assert [f for f in b["nvcc_flags"] if f.startswith("arch=")] == [f"arch=compute_{a},code=sm_{a}" for a in archs]
    assert b["head_dims"] == sorted(head_dims) and b["dtypes"] == ["bfloat16"] and b["sdist_sha256"] == bfa.SHA256
    assert b["include_dirs"][0] == str(proj / "include")          # the pinned static_switch.h before the sdist's
    pinned = (proj / "include" / "static_switch.h").read_text()
    assert pinned.startswith("#define FP16_SWITCH(COND, ...) original") and "#undef HEADDIM_SWITCH" in pinned
    assert sorted(p.name for p in (proj / "flash_attn").iterdir()) == ["__init__.py", "flash_attn_interface.py",
                                                                       "labkit_build.json"]


def test_bad_choices_are_one_line(tmp_path):
    sdist = _fake_sdist(tmp_path / "s.tar.gz")
    with pytest.raises(bfa.BuildError, match="--arch must be among 80, 90, got 75"):
        bfa.prepare(sdist, tmp_path / "w", (128,), ("75",), 1)
    with pytest.raises(bfa.BuildError, match="not 80"):
        bfa.prepare(sdist, tmp_path / "w", (80,), ("90",), 1)


HARNESS = r"""
#include <cstdio>
#include <stdexcept>
#define TORCH_CHECK(cond, msg) do { if (!(cond)) throw std::runtime_error(msg); } while (0)
namespace cutlass { struct bfloat16_t {}; }
#define FP16_SWITCH(COND, ...) original_would_not_compile
#define HEADDIM_SWITCH(HEADDIM, ...) original_would_not_compile
%s
template <typename T, int D> int run() { return D; }
int dispatch(bool fp16, int d) {
  return FP16_SWITCH(fp16, [&] { return HEADDIM_SWITCH(d, [&] { return run<elem_type, kHeadDim>(); }); });
}
int main() {
  int ok = dispatch(false, 128) == 128 && dispatch(false, 64) == 64;
  int refused = 0;
  try { dispatch(false, 96); } catch (const std::exception &) { refused++; }
  try { dispatch(true, 128); } catch (const std::exception &) { refused++; }
  std::printf("%%d %%d\n", ok, refused);
}
"""


def test_the_pinned_switches_dispatch_the_built_head_dims_and_refuse_the_rest(tmp_path):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler here")
    src = tmp_path / "h.cpp"
    src.write_text(HARNESS % bfa.switch_pins((128, 64)))
    subprocess.run([cxx, "-std=c++17", "-o", str(tmp_path / "h"), str(src)], check=True, capture_output=True)
    out = subprocess.run([str(tmp_path / "h")], check=True, capture_output=True, text=True).stdout.split()
    assert out == ["1", "2"]                 # 128 and 64 dispatch; head dim 96 and fp16 are refused


def test_the_backward_stub_instantiates_each_built_head_dim():
    stub = bfa.bwd_stub((128, 64))
    for d in (64, 128):
        for c in ("false", "true"):
            assert f"template void run_mha_bwd_<cutlass::bfloat16_t, {d}, {c}>" in stub
    assert "TORCH_CHECK(false" in stub


def test_doctor_says_which_flash_attn_it_found_and_what_it_runs(tmp_path, monkeypatch):
    """labkit doctor's flash-attn facts: none found, then a minimal build (a stand-in package with the build's
    labkit_build.json, as tools/build_flash_attn.py installs it)."""
    import sys

    import torch

    from engine.attention import flash_support
    from labkit.console.setup import _flash_line
    from labkit.doctor import check_flash_attn

    monkeypatch.setattr(flash_support, "installed", lambda: None)
    none = check_flash_attn(torch.device("cpu"))
    assert none == {"found": False, "why": "not installed (tools/build_flash_attn.sh builds it on a CUDA machine)"}
    assert _flash_line(none) == none["why"]
    monkeypatch.undo()
    pkg = tmp_path / "flash_attn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('__version__ = "2.8.3"\n')
    (pkg / "labkit_build.json").write_text(json.dumps({"head_dims": [64, 128], "dtypes": ["bfloat16"], "archs": ["90"]}))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    flash_support.installed.cache_clear()
    try:
        f = check_flash_attn(torch.device("cpu"))
    finally:
        flash_support.installed.cache_clear()
    assert f["found"] and f["build"] == "labkit-minimal" and f["head_dims"] == [64, 128] and f["archs"] == ["90"]
    assert f["runs"] == ("bfloat16, head dims 64, 128, causal and not, paged KV in blocks of a multiple of 256 tokens; "
                         "no float32, no FP8 KV cache")
    assert _flash_line(f).startswith(f"2.8.3 (labkit-minimal build, {pkg}): bfloat16, head dims 64, 128")
