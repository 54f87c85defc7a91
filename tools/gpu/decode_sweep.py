"""The Triton paged decode's kernel sweep on one cache dtype, compiled in parallel first (CUDA only).

    python3 tools/gpu/decode_sweep.py --kv-cache-dtype fp8 --shapes 256x1024,64x1024,1x4096 --out sweep.json

Times every setting of labkit.bench.attention.kernel_sweep_settings (on an e4m3 cache: tiles x warps x stages x
the V scale's place x a register cap) on each shape, as a share of the copy roof measured in the same run, with its
error against the float32 reference (a wrong output never ranks). Prints each shape's five fastest, the default's
place, and the robust setting (the best worst share of each shape's best): a change of engine/attention/splits.py's
DECODE_* lines is read off this table, then timed on the whole workload. On the e4m3 cache it also prints the
robust setting among those the LAB_FP8_DECODE lever can set (the default's kv heads a program, tile and waves: warps,
stages, the block-table load per tile, the V scale's place, the register cap) as that lever's value, so one lease can
time the candidate on a workload before any line changes.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _compile(args: tuple) -> int:
    from labkit.bench.attention import compile_kernel_sweep
    part, parts, dtype, shapes = args
    return compile_kernel_sweep(part, parts, dtype, shapes)


def _row(r: dict) -> str:
    knobs = " ".join(f"{k}={r[k]}" for k in ("kv_per_prog", "page_tile", "block_n", "num_warps", "num_stages",
                                              "waves", "fp8_v_in_tile", "max_registers") if k in r)
    if "error" in r:
        return f"{knobs}: error {r['error']}"
    return f"{r['us']:9.1f} us  {r['share_of_roof']:.3f} of roof  err {r['max_abs_err']:.2e}  {knobs}"


TILE = ("kv_per_prog", "block_n", "waves")     # what LAB_FP8_DECODE cannot set


def lever_candidate(res: dict) -> dict | None:
    """The robust setting (labkit.bench.attention.rank_kernel_sweep) among the sweep's results in the default's
    tile, with its LAB_FP8_DECODE spelling; None when none ran on every shape."""
    from engine.levers import FP8_DECODE_KNOBS, decode_knobs_text
    from labkit.bench.attention import rank_kernel_sweep

    tile = {k: res["default"][k] for k in TILE}
    shapes = [sh | {"results": [r for r in sh["results"] if all(r.get(k) == v for k, v in tile.items())]}
              for sh in res["shapes"]]
    robust = rank_kernel_sweep(shapes)["robust"]
    if robust is None:
        return None
    return robust | {"lab_fp8_decode": decode_knobs_text({arg: robust.get(arg) for arg, _ in FP8_DECODE_KNOBS.values()})}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    ap.add_argument("--shapes", default="256x1024,64x1024,1x4096", help="batch x context, comma separated")
    ap.add_argument("--jobs", type=int, default=8, help="compiling processes")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    shapes = tuple(tuple(int(x) for x in s.split("x")) for s in a.shapes.split(","))

    t0 = time.time()
    with mp.get_context("spawn").Pool(a.jobs) as pool:
        n = sum(pool.map(_compile, [(i, a.jobs, a.kv_cache_dtype, shapes) for i in range(a.jobs)]))
    print(f"compiled {n} settings on {len(shapes)} shapes in {time.time() - t0:.0f} s", flush=True)

    from labkit.bench.attention import sweep_kernel
    t0 = time.time()
    res = sweep_kernel(shapes=shapes, repeats=a.repeats, kv_cache_dtype=a.kv_cache_dtype)
    print(f"timed in {time.time() - t0:.0f} s; copy roof {res['copy_roof_gb_s']} GB/s; {res['shape']}; each figure "
          f"{res['timing']}")
    for sh in res["shapes"]:
        print(f"\n{sh['batch']} x {sh['context']}: {sh['tried']} tried, {sh['wrong_outputs']} wrong, "
              f"{sh['errors']} refused")
        for r in sh["best"]:
            print("  " + _row(r))
        print("  default: " + (_row(sh["default"]) if sh["default"] else "not timed"))
    print("\nrobust:", json.dumps(res["robust"]))
    if a.kv_cache_dtype == "fp8":
        res["lever_candidate"] = lever_candidate(res)
        print("in the default tile (LAB_FP8_DECODE's reach):", json.dumps(res["lever_candidate"]))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"kind": "measured", "kv_cache_dtype": a.kv_cache_dtype} | res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
