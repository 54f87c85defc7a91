"""Programmatic dependent launch (engine/pdl.py): every Triton kernel of the step, compiled for Hopper on this
CPU (Triton's own ptxas), waits on its predecessor with PDL and never without it; the launch keywords stay
empty off CUDA. The kernels' numerics with PDL on are the GPU suite's (tests -m gpu, graphs and guards)."""
from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from engine import pdl  # noqa: E402
from engine.attention import triton_kernels as tk  # noqa: E402
from engine.attention import prefill_kernels as pk  # noqa: E402
from engine.layers import fused_kernels as fk, gemv  # noqa: E402
from engine.sampling import gumbel_kernel as gk  # noqa: E402

FLOATS = {"eps", "scale"}

# kernel, its constexprs (PDL added by the test), pointer dtypes other than bf16
KERNELS = {
    "gemv": (gemv._gemv_kernel, dict(BLOCK_N=8, BLOCK_K=512, EVEN_K=True, SILU_MUL=False), {}),
    "normed_gemv": (gemv._gemv_kernel, dict(BLOCK_N=8, BLOCK_K=512, EVEN_K=True, SILU_MUL=False, NORM=True,
                                            HAS_RES=True, BLOCK_ROW=1024), {}),
    "rms_norm": (fk._rms_norm_kernel, dict(HAS_RES=True, BLOCK=1024), {}),
    "qk_norm_rope": (fk._qk_norm_rope_kernel, dict(HQ=16, HK=8, D=128, BLOCK_H=32, STORE=True),
                     {"pos_ptr": "*i32", "slot_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}),
    "qk_norm_rope_head": (fk._qk_norm_rope_kernel, dict(HQ=16, HK=8, D=128, BLOCK_H=1, STORE=True),
                          {"pos_ptr": "*i32", "slot_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}),
    "silu_mul": (fk._silu_mul_kernel, dict(BLOCK=1024), {}),
    "store_kv": (tk._store_kv_kernel, dict(WIDTH=1024, BLOCK=1024), {"slot_ptr": "*i64"}),
    "decode": (tk._decode_split_kernel, dict(PAGE=256, HK=8, G=2, BLOCK_G=16, D=128, BLOCK_N=64, IEEE=False,
                                             DIRECT=False, FUSED_REDUCE=True),
               {"bt_ptr": "*i32", "ctx_ptr": "*i32", "acc_ptr": "*fp32", "ml_ptr": "*fp32", "order_ptr": "*i32",
                "lock_ptr": "*i32"}),
    "decode_reduce": (tk._decode_reduce_kernel, dict(HQ=16, D=128, BLOCK_S=8),
                      {"acc_ptr": "*fp32", "ml_ptr": "*fp32", "ctx_ptr": "*i32"}),
    "prefill": (pk._prefill_kernel, dict(PAGE=256, HK=8, G=2, D=128, BLOCK_M=64, BLOCK_N=64, IEEE=False, PAGED=True),
                {"bt_ptr": "*i32", "cu_q_ptr": "*i32", "cu_k_ptr": "*i32"}),
    "prefill_packed": (pk._prefill_kernel, dict(PAGE=256, HK=8, G=2, D=128, BLOCK_M=64, BLOCK_N=64, IEEE=False,
                                                PAGED=True, PACKED=True),
                       {"bt_ptr": "*i32", "cu_q_ptr": "*i32", "cu_k_ptr": "*i32"}),
    "gumbel": (gk._gumbel_argmax_kernel, dict(BLOCK=2048), {"temp_ptr": "*fp32", "seed_ptr": "*i64",
                                                              "val_ptr": "*fp32", "idx_ptr": "*i32"}),
}


def hopper_ptx(name: str, on: bool) -> str:
    fn, constexprs, ptr_types = KERNELS[name]
    constexprs = {**constexprs, "PDL": on}
    signature = {}
    for p in fn.params:
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            constexprs.setdefault(p.name, p.default)
        elif p.name.endswith("_ptr"):
            signature[p.name] = ptr_types.get(p.name, "*bf16")
        else:
            signature[p.name] = "fp32" if p.name in FLOATS else "i32"
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    import triton
    return triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_every_step_kernel_waits_before_it_reads_with_pdl(name):
    ptx = hopper_ptx(name, True)
    body = ptx[ptx.index(".entry"):]
    assert "griddepcontrol.wait" in body and "griddepcontrol.launch_dependents" in body
    wait = body.index("griddepcontrol.wait")
    # nothing an earlier kernel wrote is read before the wait: only the GEMV's weight tile may be loaded first
    early = re.findall(r"ld\.global[^\n]*", body[:wait])
    if name in ("gemv", "normed_gemv"):
        assert early, "the GEMV prefetches its first weight tile before the wait"
    else:
        assert not early, f"{name} loads before griddepcontrol.wait: {early[:2]}"
    assert "st.global" not in body[:wait] and "ret;" not in body[:wait]


def test_no_grid_dependency_control_without_pdl():
    assert "griddepcontrol" not in hopper_ptx("normed_gemv", False)


def test_pdl_stays_off_the_cpu():
    assert pdl.enable("cpu") is False
    assert pdl.launch(torch.zeros(2)) == {}
