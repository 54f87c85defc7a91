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
from engine.attention import kv_store, triton_kernels as tk  # noqa: E402
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
    "store_kv": (kv_store._store_kv_kernel, dict(WIDTH=1024, BLOCK=1024), {"slot_ptr": "*i64"}),
    "decode": (tk._decode_split_kernel, dict(PAGE=256, HK=8, G=2, BLOCK_G=16, D=128, BLOCK_N=64, IEEE=False,
                                             DIRECT=False, FUSED_REDUCE=True),
               {"bt_ptr": "*i32", "ctx_ptr": "*i32", "acc_ptr": "*fp32", "ml_ptr": "*fp32", "order_ptr": "*i32",
                "lock_ptr": "*i32"}),
    "decode_prologue_prefetch": (tk._decode_split_kernel, dict(PAGE=256, HK=8, G=2, BLOCK_G=16, D=128, BLOCK_N=64,
                                                               IEEE=False, DIRECT=False, PROLOGUE=True, PREFETCH=True),
                                 {"bt_ptr": "*i32", "ctx_ptr": "*i32", "acc_ptr": "*fp32", "ml_ptr": "*fp32",
                                  "order_ptr": "*i32", "lock_ptr": "*i32", "pos_ptr": "*i64", "slot_ptr": "*i64",
                                  "cos_ptr": "*fp32", "sin_ptr": "*fp32"}),
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


# what a kernel may load before its wait (engine/pdl.py, step 1): weights and tables, which no kernel writes, and in
# the small decodes the step's inputs, which were copied in before the step's first kernel; every other pointer
# (activations, partials, outputs) only after it
EARLY = {
    "gemv": {"w_ptr"},
    "normed_gemv": {"w_ptr"},
    "decode_prologue_prefetch": {"kc_ptr", "vc_ptr", "bt_ptr", "ctx_ptr", "order_ptr", "pos_ptr", "slot_ptr", "qw_ptr",
                                 "kw_ptr", "cos_ptr", "sin_ptr"},
    "decode_reduce": {"ctx_ptr"},
}


def hopper_ptx(name: str, on: bool, **override) -> str:
    fn, constexprs, ptr_types = KERNELS[name]
    constexprs = {**constexprs, "PDL": on, **override}
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


def body_lines(ptx: str) -> list[str]:
    return ptx[ptx.index(".entry"):].splitlines()


def wait_line(lines: list[str]) -> int:
    """The index of griddepcontrol.wait among a kernel's body lines (:func:`body_lines`)."""
    return next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)


def traced_loads(name: str, ptx: str) -> list[tuple[int, str, set[str]]]:
    """Each global load of the kernel's body (line index, line, the kernel pointers its address derives from): every
    PTX register carries the parameters it was computed from (a loaded value carries its address's, so a block
    table's entry leads to the cache it indexes)."""
    fn = KERNELS[name][0]
    params = [p.name for p in fn.params if not p.is_constexpr]
    sources: dict[str, set[str]] = {}
    loads = []
    for i, line in enumerate(body_lines(ptx)):
        m = re.match(r"\s*(?:@!?%\w+\s+)?([a-z][\w.]*)\s+(.*?);", line)
        if not m:
            continue
        op, args = m.groups()
        regs = re.findall(r"%[a-z]+\d+", args)
        if op.startswith("ld.param"):
            index = int(re.search(r"_param_(\d+)", args).group(1))
            sources[regs[0]] = {params[index]}
            continue
        if op.startswith("ld.global"):
            dests, addr = args.split("[", 1)
            dest_regs = re.findall(r"%[a-z]+\d+", dests)
            origin = set().union(*(sources.get(r, set()) for r in re.findall(r"%[a-z]+\d+", addr)))
            loads.append((i, line.strip(), {p for p in origin if p.endswith("_ptr")}))
            for r in dest_regs:
                sources[r] = set(origin)
            continue
        if regs:
            sources[regs[0]] = sources.get(regs[0], set()) | set().union(*(sources.get(r, set()) for r in regs[1:]))
    return loads


def early_loads(name: str, ptx: str) -> list[tuple[str, set[str]]]:
    """Each global load before griddepcontrol.wait with the kernel pointers its address derives from."""
    wait = wait_line(body_lines(ptx))
    return [(line, origin) for i, line, origin in traced_loads(name, ptx) if i < wait]


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_every_step_kernel_waits_before_it_reads_with_pdl(name):
    ptx = hopper_ptx(name, True)
    body = ptx[ptx.index(".entry"):]
    assert "griddepcontrol.wait" in body and "griddepcontrol.launch_dependents" in body
    wait = body.index("griddepcontrol.wait")
    allowed = EARLY.get(name, set())
    early = early_loads(name, ptx)
    wrong = [(line, sorted(origin - allowed)) for line, origin in early if not origin or origin - allowed]
    assert not wrong, f"{name} loads before griddepcontrol.wait from what an earlier kernel writes: {wrong[:2]}"
    if allowed:
        assert early, f"{name} loads what it may before the wait (weights, tables, the step's inputs)"
    assert "st.global" not in body[:wait] and "ret;" not in body[:wait]


def test_the_small_decode_loads_the_qkv_row_only_after_the_wait():
    """The prologue's q/k come from the qkv projection just before it: after the wait, whatever else came first."""
    late = hopper_ptx("decode_prologue_prefetch", True)
    loaded_early = set().union(*(origin for _, origin in early_loads("decode_prologue_prefetch", late)))
    assert {"pos_ptr", "slot_ptr", "cos_ptr", "qw_ptr", "kc_ptr"} <= loaded_early
    assert "qkv_ptr" not in loaded_early


def qkv_loads_after_first_exchange(ptx: str) -> tuple[list[str], int]:
    """The decode prologue's qkv row loads after the wait that come after its first exchange between threads (the q
    norm's reductions), and how many qkv row loads it has in all."""
    lines = body_lines(ptx)
    exchange = next(i for i in range(wait_line(lines), len(lines)) if re.search(r"\b(shfl\.sync|bar\.sync)", lines[i]))
    qkv = [i for i, _, origin in traced_loads("decode_prologue_prefetch", ptx) if "qkv_ptr" in origin]
    return [lines[i].strip() for i in qkv if i > exchange], len(qkv)


def test_the_small_decode_loads_the_new_tokens_k_and_v_with_its_q():
    """After the wait the small decode's one dependent round is the qkv row's: the split that holds the new token
    issues its k and v rows' loads with its q heads', none after the q norm's first exchange between threads. The
    wide prologue (no PREFETCH) loads them inside the new token's branch, after its q is made: the same loads, the
    second round this test finds there."""
    late, count = qkv_loads_after_first_exchange(hopper_ptx("decode_prologue_prefetch", True))
    assert not late, f"qkv row loads after the prologue's first exchange (a second dependent round): {late[:2]}"
    wide_late, wide_count = qkv_loads_after_first_exchange(hopper_ptx("decode_prologue_prefetch", True, PREFETCH=False))
    assert wide_late and count == wide_count, (count, wide_count, len(wide_late))


def test_no_grid_dependency_control_without_pdl():
    assert "griddepcontrol" not in hopper_ptx("normed_gemv", False)


def test_pdl_stays_off_the_cpu():
    assert pdl.enable("cpu") is False
    assert pdl.launch(torch.zeros(2)) == {}
