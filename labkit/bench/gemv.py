"""`labkit bench --workload gemv`: the one-token GEMV (engine/layers/gemv.py) at a model's batch-1 shapes.

Each projection a decode step at batch 1 runs (qkv and gate_up with their RMSNorm inside, o, down with the
SiLU-and-mul inside, the LM head) is timed as the engine runs it: one call per layer, each on its own weight
(so no call reads another's from L2), captured in one CUDA graph, with programmatic dependent launch where the
GPU has it. Each figure stands beside the weight read at the copy roof measured in the same run. With
``--sweep`` every tile setting (BLOCK_N, BLOCK_K, warps) is timed as well, fastest first, so a row of
``gemv_config`` comes with its evidence. The current tile (and with ``--sweep`` the five fastest) is timed again
with the first K chunk's peel flipped (``peel_first_chunk``: whether its weight tile loads before the PDL wait).
Random weights of the model's shapes: no checkpoint is loaded.
"""
from __future__ import annotations

from engine.config import ModelShape

#: the settings --sweep tries: tiles of 1 K to 64 K elements, BLOCK_K at most the row
BLOCK_NS = (1, 2, 4, 8, 16, 32, 64)
BLOCK_KS = (256, 512, 1024, 2048, 4096)
WARPS = (4, 8)
TILE_ELEMENTS = (1024, 65536)
#: the graph holds at most this many weight bytes (the LM head gets fewer calls than there are layers)
GRAPH_BYTES = 8 << 30


def gemv_shapes(shape: ModelShape) -> dict[str, tuple[int, int, str]]:
    """name -> (N, K, mode) of one token's projections, mode plain | normed | silu (the kernel's prologue)."""
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    return {"qkv": (q + 2 * kv, shape.hidden_size, "normed"), "o": (shape.hidden_size, q, "plain"),
            "gate_up": (2 * shape.intermediate_size, shape.hidden_size, "normed"),
            "down": (shape.hidden_size, shape.intermediate_size, "silu"),
            "lm_head": (shape.vocab_size, shape.hidden_size, "plain")}


def launched(config: tuple[int, int, int], mode: str) -> tuple[int, int, int]:
    """The tile a gemv_config row launches (the normed GEMV's: engine.layers.gemv.normed_tile)."""
    from engine.layers.gemv import normed_tile

    return normed_tile(config) if mode == "normed" else config


def candidates(n: int, k: int, mode: str, current: tuple[int, int, int]) -> list[tuple[int, int, int]]:
    """Every setting --sweep times at [n, k] (launched tiles), the current one included."""
    from engine.layers.fused_kernels import NORM_WARPS

    out = {launched(current, mode)}
    for block_n in BLOCK_NS:
        for block_k in BLOCK_KS:
            if block_k > max(k, BLOCK_KS[0]) or not TILE_ELEMENTS[0] <= block_n * block_k <= TILE_ELEMENTS[1]:
                continue
            for warps in ((NORM_WARPS,) if mode == "normed" else WARPS):
                out.add((block_n, block_k, warps))
    return sorted(out)


def graph_calls(n: int, k: int, layers: int, element_size: int) -> int:
    """Calls (distinct weights) in one timed graph: one per layer, fewer where they would pass GRAPH_BYTES."""
    return max(1, min(layers, GRAPH_BYTES // (n * k * element_size)))


def step_summary(rows: dict, layers: int, roof_gbs: float) -> dict:
    """The step's GEMV time at the current tiles (every projection once per layer, the LM head once) against
    its weight read at the copy roof."""
    us = sum(r["current"]["us"] * (1 if name == "lm_head" else layers) for name, r in rows.items())
    nbytes = sum(r["weight_bytes"] * (1 if name == "lm_head" else layers) for name, r in rows.items())
    bound_us = nbytes / (roof_gbs * 1e9) * 1e6
    return {"gemv_us_per_step": round(us, 1), "weight_bytes_per_step": nbytes,
            "bound_us_per_step": round(bound_us, 1), "share_of_roof": round(bound_us / us, 3)}


def _time_setting(n: int, k: int, mode: str, weights, config: tuple[int, int, int], peel: bool) -> float:
    import torch

    from engine.layers.gemv import gemv, normed_gemv

    dev, dt = weights[0].device, weights[0].dtype
    x = torch.randn(1, 2 * k if mode == "silu" else k, device=dev, dtype=dt)
    residual, norm_weight = torch.randn(1, k, device=dev, dtype=dt), torch.ones(k, device=dev, dtype=dt)

    def calls():
        for w in weights:
            if mode == "normed":
                normed_gemv(x, w, norm_weight, 1e-6, residual, config=config, peel=peel)
            else:
                gemv(x, w, silu_mul=mode == "silu", config=config, peel=peel)
    from labkit.bench.timing import graph_us

    return graph_us(calls, len(weights))


def _bench_shape(n: int, k: int, mode: str, layers: int, dtype, roof: float, sweep: bool,
                 device: str = "cuda") -> dict:
    """One projection: its current tile (peel as the rule says, and flipped), with ``sweep`` every candidate."""
    import torch
    import triton

    from engine.layers.gemv import gemv_config, peel_first_chunk
    from labkit.console import err_console

    element = torch.empty(0, dtype=dtype).element_size()
    calls = graph_calls(n, k, layers, element)
    weights = [torch.randn(n, k, device=device, dtype=dtype) * k ** -0.5 for _ in range(calls)]
    row_config = gemv_config(n, k)
    current = launched(row_config, mode)

    def timed(config, peel):
        us = _time_setting(n, k, mode, weights, config, peel)
        gbs = n * k * element / (us * 1e-6) / 1e9
        return {"tile": list(config), "peel": peel, "chunks": triton.cdiv(k, config[1]), "us": round(us, 3),
                "gb_s": round(gbs, 1), "share_of_roof": round(gbs / roof, 3)}

    settings = candidates(n, k, mode, row_config) if sweep else [current]
    err_console.print(f"bench gemv: [{n} x {k}] {mode}, {len(settings)} tile{'s' * (len(settings) > 1)} to compile and time")
    ranked = sorted((timed(c, peel_first_chunk(k, c[1])) for c in settings), key=lambda t: t["us"])
    now = next(t for t in ranked if tuple(t["tile"]) == current)
    row = {"n": n, "k": k, "mode": mode, "calls_per_graph": calls, "weight_bytes": n * k * element,
           "current": now, "current_peel_flipped": timed(current, not now["peel"])}
    if sweep:       # the rule's peel at every tile; the five fastest again with it flipped
        row.update(best=ranked[:5], tried=len(ranked), current_rank=ranked.index(now) + 1,
                   best_peel_flipped=[timed(tuple(t["tile"]), not t["peel"]) for t in ranked[:5]])
    return row


def bench_gemv(shape: ModelShape, sweep: bool = False, dtype: str = "bfloat16") -> dict:
    """Every batch-1 projection of ``shape`` at its gemv_config tile (and with ``sweep`` every candidate)."""
    import torch

    from engine import pdl
    from labkit.bench.timing import copy_roof_gbs

    pdl_on = pdl.enable("cuda")
    roof = copy_roof_gbs()
    rows = {}
    for name, (n, k, mode) in gemv_shapes(shape).items():
        rows[name] = _bench_shape(n, k, mode, shape.num_layers, getattr(torch, dtype), roof, sweep)
        torch.cuda.empty_cache()
    return {"dtype": dtype, "pdl": pdl_on, "copy_roof_gb_s": round(roof, 1), "sweep": sweep, "shapes": rows,
            "step": step_summary(rows, shape.num_layers, roof),
            "method": "one call per layer (distinct weights) in a CUDA graph, median of 10 replays, µs per call"}
