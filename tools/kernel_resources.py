"""What each Triton paged-decode variant costs an H100/H200 SM, read on this machine without a GPU: the kernel is
compiled for sm_90 (the stand-in driver of tests/kernels/test_sm90_compile.py), and each build's registers per
thread (cuobjdump -res-usage on its cubin, the tools Triton's wheel ships) and shared memory give the programs one
SM holds at once and so the K/V bytes it has in its tiles' buffers. A decode is bound by how many bytes are in
flight, so a variant that fits fewer programs an SM, or buffers fewer bytes per program, reads its cache slower.

    python tools/kernel_resources.py [--batch 256] [--context 1024] [--cache bf16,fp8] [--sweep] [--json]
    python tools/kernel_resources.py --layer [--json]

Default rows: the decode as the engine launches it (engine/attention/splits.py's knobs; an e4m3 cache's own
DECODE_FP8_* ones) on a bf16 and an e4m3 cache, the e4m3 cache at the bf16 cache's knobs (``bf16-knobs``), the
decode prologue (triton_kernels.NewTokens), and the e4m3 cache with its V blocks holding each head's positions
contiguous (``v_t``: LAB_FP8_V_T). --layer: the persistent decode layer at Qwen3-0.6B's and Qwen3-8B's
shapes instead. --sweep: the tile / warps / stages grid instead (on an e4m3 cache also the V
scale's place and a 128-register cap). Each row also gives its SASS instruction count and a hash of the
instructions: a refactor that leaves a row's hash alone compiles to the same instructions; and its context loop's
instructions (one pass: a K and a V tile), per KB of those tiles over the program's warps (the issue slots a byte
costs; --json adds the loop's opcodes, most frequent first): an e4m3 tile is half the bytes of a bf16 one, and each of
its values is converted on the way. These are compiled figures, not timings: `labkit bench --workload attention
--sweep` on the GPU times the same variants.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# an sm_90 SM (H100 and H200 alike): what bounds the programs it holds at once
SM_REGISTERS = 65536
SM_SHARED = 228 * 1024           # per SM; each resident program also takes 1 KB of the runtime's own
SM_MAX_PROGRAMS = 32
SM_MAX_WARPS = 64
REGISTER_GRANULE = 8             # registers a thread are allocated in steps of 8 (256 a warp)


def programs_per_sm(registers: int, shared: int, warps: int) -> int:
    """Programs (CTAs) one sm_90 SM holds at once with `registers` a thread, `shared` bytes and `warps` warps."""
    per_warp = -(-registers // REGISTER_GRANULE) * REGISTER_GRANULE * 32
    by_registers = SM_REGISTERS // (per_warp * warps)
    by_shared = SM_SHARED // (shared + 1024)
    return max(0, min(by_registers, by_shared, SM_MAX_PROGRAMS, SM_MAX_WARPS // warps))


def _cuobjdump(cubin: bytes, flag: str) -> str:
    """cuobjdump FLAG on a cubin (Triton's wheel ships cuobjdump)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([str(tool), flag, f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def cubin_registers(cubin: bytes) -> int:
    """Registers a thread of the cubin's one kernel, from cuobjdump -res-usage."""
    return next(int(tok[4:]) for tok in _cuobjdump(cubin, "-res-usage").split() if tok.startswith("REG:"))


def sass_instructions(sass: str) -> list[str]:
    """The SASS instructions of a cubin's listing (``_cuobjdump(cubin, "-sass")``) in order, without their addresses
    and encodings: two builds with the same list run the same instructions (a refactor that leaves a kernel's list
    alone cannot change its speed)."""
    out = []
    for line in sass.splitlines():
        parts = line.strip().split("*/")
        if line.strip().startswith("/*") and len(parts) > 1 and parts[1].strip():
            out.append(parts[1].strip())
    return out


def loop_body(sass: str) -> list[str]:
    """The instructions of a cubin's longest loop in its SASS listing (the span of its longest backward branch): the
    decode's context loop, one tile of K and V per pass."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    spans = [(int(t.group(1), 16), at) for at, text in ins if "BRA" in text
             for t in [re.search(r"0x([0-9a-f]+)", text)] if t and int(t.group(1), 16) < at]
    if not spans:
        return []
    lo, hi = max(spans, key=lambda s: s[1] - s[0])
    return [text for at, text in ins if lo <= at <= hi]


def opcode(instruction: str) -> str:
    """An instruction's opcode without its predicate and modifiers: '@!P0 IMAD.MOV.U32 R1, ...' -> 'IMAD'."""
    words = instruction.split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


def _compiler(name: str = "_decode_split_kernel"):
    """Triton's sm_90 stand-in driver (every launch compiles, nothing runs), PDL on as on Hopper; returns the list
    the compiled builds of the kernel ``name`` are appended to."""
    sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "kernels"), str(ROOT / "tests")]
    import torch
    from triton.runtime.jit import JITFunction

    import engine.pdl as pdl
    from test_sm90_compile import stand_in_driver

    calls, errors, targets = [], [], set()
    stand_in_driver(calls, errors, targets)
    built = []
    compile_only = JITFunction.run

    def keep(self, *args, **kwargs):
        kernel = compile_only(self, *args, **kwargs)
        if self.fn.__name__ == name:
            built.append(kernel)
        return kernel
    JITFunction.run = keep
    pdl.launch = lambda t: {"PDL": True, "launch_pdl": True}
    import engine.attention.triton_kernels as tk
    tk.decode_locks(torch.device("cpu"))
    return built, errors


def rows(batch: int, context: int, caches: list[str], sweep: bool, hq: int = 16, hk: int = 8, d: int = 128,
         page: int = 256) -> list[dict]:
    """One row per compiled decode variant at Qwen3-0.6B's heads: its knobs, registers, shared bytes, programs an
    SM and the K/V bytes of their tile buffers."""
    built, errors = _compiler()
    import torch

    import engine.attention.triton_kernels as tk
    from engine.attention import kv_quant, splits
    from labkit.bench.attention import default_decode_setting

    bf16 = torch.bfloat16
    e = lambda *s, dtype=bf16: torch.empty(*s, dtype=dtype)          # noqa: E731 (never read: nothing runs)
    blocks = batch * (-(-context // page)) + 1
    tables = torch.zeros(batch, -(-context // page), dtype=torch.int32)
    ctx = torch.full((batch,), context, dtype=torch.int32)
    out = []
    for cache in caches:
        fp8 = cache == "fp8"
        grid = [default_decode_setting(cache if fp8 else "auto")]      # each cache's own defaults (splits.py)
        if sweep:
            grid = [dict(block_n=bn, num_warps=w, num_stages=st) for bn, w, st in
                    itertools.product((32, 64, 128), (4, 8), (2, 3, 4, 5))]
            if fp8:             # and the V scale's place and a register cap (the FP8 kernel sweep's knobs)
                grid = [g | dict(fp8_v_in_tile=vt, max_registers=mr) for g in grid
                        for vt, mr in itertools.product((False, True), (0, 128))]
        kc, vc = e(blocks, page, hk, d), e(blocks, page, hk, d)
        if fp8:
            kc, vc = (kv_quant.mark(e(blocks, page, hk, d, dtype=kv_quant.FP8), 1.0, bf16) for _ in range(2))
        routes = [("plain", {})]
        if fp8 and not sweep:       # the e4m3 cache at the bf16 cache's knobs
            routes.append(("bf16-knobs", {"page_tile": splits.DECODE_PAGE_TILE, "fp8_v_in_tile": False,
                                          "num_stages": splits.DECODE_NUM_STAGES,
                                          "max_registers": 0}))
        routes.append(("prologue", {"new": True}))
        if fp8 and not sweep:       # the V cache's blocks with each head's positions contiguous (LAB_FP8_V_T)
            routes.append(("v_t", {"v_t": True}))
        vt = kv_quant.mark(e(blocks, page, hk, d, dtype=kv_quant.FP8), 1.0, bf16, v_t=True) if fp8 else vc
        for knobs, (route, extra) in itertools.product(grid, routes):
            q, kw = e(batch, hq, d), knobs | extra
            v_cache = vt if kw.pop("v_t", False) else vc
            if kw.pop("new", False):
                cos, zeros = e(context, d, dtype=torch.float32), torch.zeros(batch, dtype=torch.int64)
                q, kw["new"] = None, tk.NewTokens(e(batch, (hq + 2 * hk) * d), zeros, e(d), e(d), cos, cos, 1e-6,
                                                  zeros, hq)
            before = len(built)
            tk.paged_decode(q, kc, v_cache, tables, ctx, d ** -0.5, context, 132, **kw)
            row = {"cache": cache, "route": route, **{k: v for k, v in kw.items() if k != "new"}}
            if len(built) == before or built[-1] is None:
                out.append(row | {"error": (errors or ["not compiled"])[-1][:160]})
                continue
            kernel = built[-1]
            regs, shared = cubin_registers(kernel.asm["cubin"]), kernel.metadata.shared
            n = programs_per_sm(regs, shared, knobs["num_warps"])
            listing = _cuobjdump(kernel.asm["cubin"], "-sass")
            sass, loop = sass_instructions(listing), loop_body(listing)
            tile_kb = 2 * knobs["block_n"] * d * (1 if fp8 else 2) / 1024      # one pass: a K and a V tile
            out.append(row | {"registers": regs, "shared_bytes": shared, "programs_per_sm": n,
                              "buffered_kb_per_sm": round(n * shared / 1024), "sass_instructions": len(sass),
                              "sass_sha": hashlib.sha1("\n".join(sass).encode()).hexdigest()[:12],
                              "loop_instructions": len(loop),
                              "loop_instructions_per_kb": round(len(loop) * knobs["num_warps"] / tile_kb, 1),
                              "loop_mix": dict(collections.Counter(map(opcode, loop)).most_common())})
    return out


def layer_rows(presets=("qwen3-0.6b", "qwen3-8b")) -> list[dict]:
    """The persistent decode layer (engine/layers/decode_layer.py, LAB_DECODE_LAYER) at each preset's shapes, a
    later layer's variant over 132 SMs: registers, shared bytes, the programs an SM holds (its grid barriers need
    every program resident: at least one), and its weight loads before the PDL wait (128-bit LDGs before the first
    ACQBULK: the first qkv tile, loaded while the kernel before it finishes)."""
    built, errors = _compiler("_decode_layer_kernel")
    import torch
    from test_sm90_compile import launch_decode_layer

    from engine.config import ModelShape
    from engine.layers.decode_layer import NUM_WARPS
    from labkit.assets.synth import PRESETS

    bf16 = torch.bfloat16
    e = lambda *s, dtype=bf16: torch.empty(*s, dtype=dtype)          # noqa: E731 (never read: nothing runs)
    out = []
    for name in presets:
        cfg = PRESETS[name]
        shape = ModelShape.from_hf(cfg)
        hk, d = shape.num_kv_heads, shape.head_dim
        before = len(built)
        launch_decode_layer(e, shape, cfg, e(8, 256, hk, d), e(8, 256, hk, d), 4096, 132)
        if len(built) == before or built[-1] is None:
            out.append({"preset": name, "error": (errors or ["not compiled"])[-1][:160]})
            continue
        cubin = built[-1].asm["cubin"]
        regs, shared = cubin_registers(cubin), built[-1].metadata.shared
        sass = sass_instructions(_cuobjdump(cubin, "-sass"))
        wait = next((i for i, ins in enumerate(sass) if ins.startswith("ACQBULK")), len(sass))
        out.append({"preset": name, "registers": regs, "shared_bytes": shared,
                    "programs_per_sm": programs_per_sm(regs, shared, NUM_WARPS),
                    "weight_loads_before_wait": sum("LDG.E.128 " in ins for ins in sass[:wait]),
                    "sass_instructions": len(sass), "sass_sha": hashlib.sha1("\n".join(sass).encode()).hexdigest()[:12]})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--cache", default="bf16,fp8", help="bf16, fp8 or both (comma-separated)")
    ap.add_argument("--sweep", action="store_true", help="every block_n x warps x stages setting, not only the default")
    ap.add_argument("--layer", action="store_true", help="the persistent decode layer (LAB_DECODE_LAYER) instead")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    caches = a.cache.split(",")
    if not set(caches) <= {"bf16", "fp8"}:
        print(f"--cache {a.cache}: bf16, fp8 or bf16,fp8", file=sys.stderr)
        return 2
    try:
        found = layer_rows() if a.layer else rows(a.batch, a.context, caches, a.sweep)
    except (ImportError, subprocess.CalledProcessError, FileNotFoundError) as e:
        print(f"cannot compile for sm_90 here: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps(found))
        return 0
    if a.layer:
        print("the persistent decode layer (a later layer, 132 SMs), compiled for sm_90")
        for r in found:
            print(" ".join(f"{k}={v}" for k, v in r.items()))
        return 0
    print(f"paged decode at batch {a.batch} x context {a.context}, 16 q / 8 kv heads of 128, compiled for sm_90")
    print(f"{'cache':5} {'route':10} {'block_n':>7} {'page':>4} {'warps':>5} {'stages':>6} {'v_tile':>6} {'cap':>4} "
          f"{'regs':>5} "
          f"{'shared':>7} {'prog/SM':>7} {'KB/SM':>6} {'SASS':>5} {'sha':>12} {'loop':>5} {'ins/KB':>6}")
    for r in found:
        v_tile = "-" if "fp8_v_in_tile" not in r else ("yes" if r["fp8_v_in_tile"] else "no")
        page = "-" if "page_tile" not in r else ("tile" if r["page_tile"] else "pos")      # block-table loads
        head = (f"{r['cache']:5} {r['route']:10} {r['block_n']:>7} {page:>4} {r['num_warps']:>5} {r['num_stages']:>6} "
                f"{v_tile:>6} "
                f"{r.get('max_registers') or '-':>4}")
        if "error" in r:
            print(f"{head}  {r['error']}")
        else:
            print(f"{head} {r['registers']:>5} {r['shared_bytes']:>7} {r['programs_per_sm']:>7} "
                  f"{r['buffered_kb_per_sm']:>6} {r['sass_instructions']:>5} {r['sass_sha']:>12} "
                  f"{r['loop_instructions']:>5} {r['loop_instructions_per_kb']:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
