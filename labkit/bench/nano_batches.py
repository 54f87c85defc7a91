"""What overlap inside a decode step could give, measured before it is built (NanoFlow's idea).

NanoFlow splits a step's batch into nano-batches and runs them at once, so one's GEMMs run under the other's
attention. Before the engine learns to do that, this bench times the unscheduled version of it: one decode
step's forward and LM head at ``batch`` x ``context``, captured three ways, each a CUDA graph timed by replay:

    full     the whole batch on one stream (what the engine runs)
    halves   two half batches one after the other on one stream (what splitting alone costs: every weight
             is read twice, every kernel launched twice)
    overlap  the two halves on two streams, forked and joined inside the graph (the GPU interleaves them)

``overlap / full`` below 1 says the lever pays at this shape; ``halves / full`` says what it must win back.
The sequences read distinct KV blocks (row i: blocks i * per_row ..; the engine's pool starts as zeros, and
the time of attention does not depend on what it reads) and write nothing (slots -1). The second half's
fused-reduce counters are a tensor of its own, so the two halves never count on the same counter while they
run at once. Each way's logits are checked against the full batch's.
"""
from __future__ import annotations

import contextlib
import statistics

#: the bench's default shape: the nano-vllm workload's wide decode (the step budget's wide shape, 256 x 1024)
BATCH, CONTEXT = 256, 1024


def decode_rows(engine, first: int, count: int, context: int) -> list:
    """Sequences for rows first .. first + count - 1 of a batch of `context` tokens each: row i decodes token
    7 + i (rows in another order give other logits) and reads blocks i * per_row .. (i + 1) * per_row - 1, so
    a half batch reads what the same rows of the full batch read."""
    from engine.sequence import Sequence

    bs = engine.config.kvcache_block_size
    per_row = -(-context // bs)
    blocks = engine.probe.kv_cache().shape[2]
    if (first + count) * per_row > blocks:
        raise ValueError(f"{first + count} rows x {per_row} blocks do not fit the pool's {blocks}")
    seqs = []
    for i in range(first, first + count):
        s = Sequence(-1, [7 + i % 1000] * context, None, bs)  # type: ignore[arg-type] (a token per row)
        s.block_table = list(range(i * per_row, (i + 1) * per_row))
        seqs.append(s)
    return seqs


def with_locks(fn, locks=None):
    """fn() with the decode kernel's fused-reduce counters set to `locks` while it runs (paged_decode reads
    engine.attention.triton_kernels.decode_locks when it launches, so a graph captures the ones set then)."""
    if locks is None:
        return fn()
    import engine.attention.triton_kernels as tk

    own = tk._locks.get(locks.device)
    tk._locks[locks.device] = locks
    try:
        return fn()
    finally:
        if own is None:
            tk._locks.pop(locks.device, None)
        else:
            tk._locks[locks.device] = own


def ways(engine, batch: int, context: int, side=None) -> dict:
    """way -> a function running one step that way and returning its logits (rows in batch order). `side`: a
    function returning the context manager the overlap's second half runs in (a side stream on CUDA), or
    None for the halves one after the other (the overlap's plumbing without the concurrency)."""
    import torch

    half = batch // 2
    full = engine.probe.decode_step_fn(decode_rows(engine, 0, batch, context))
    h1 = engine.probe.decode_step_fn(decode_rows(engine, 0, half, context))
    h2 = engine.probe.decode_step_fn(decode_rows(engine, half, batch - half, context))
    device = engine.probe.kv_cache().device
    locks2 = None
    if device.type == "cuda":
        import engine.attention.triton_kernels as tk
        locks2 = torch.zeros_like(tk.decode_locks(device))

    def overlap():
        a = h1()
        with (side() if side is not None else contextlib.nullcontext()):
            b = with_locks(h2, locks2)
        return torch.cat([a, b])

    return {"full": full, "halves": lambda: torch.cat([h1(), with_locks(h2, locks2)]), "overlap": overlap}


@contextlib.contextmanager
def forked(side):
    """Run the body on stream `side`, forked from the current stream and joined back into it (inside a graph
    capture the two become parallel branches of the graph)."""
    import torch

    main = torch.cuda.current_stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        yield
    main.wait_stream(side)


def max_rel_diff(a, b) -> float:
    """max |a - b| over max |b| (bf16 logits of a synthetic model run to the thousands: their last bit is ~8)."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def bench_nano_batches(engine, batch: int = BATCH, context: int = CONTEXT, replays: int = 30, rounds: int = 3) -> dict:
    """Capture each way in a CUDA graph on `engine` (built eager: no graphs of its own) and time
    `rounds` x `replays` replays, the ways alternated round by round."""
    import torch

    from labkit.bench.timing import time_ms

    if batch < 2:
        raise ValueError("the overlap splits the batch in two: --batch must be at least 2")
    side = torch.cuda.Stream()
    fns = ways(engine, batch, context, side=lambda: forked(side))
    graphs, outs = {}, {}
    with torch.inference_mode():
        for name, fn in fns.items():
            fn()                                     # every kernel variant compiled before the capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                outs[name] = fn()
            graphs[name] = g
        for g in graphs.values():
            g.replay()
        torch.cuda.synchronize()
        ms = {name: [] for name in graphs}
        for _ in range(rounds):
            for name, g in graphs.items():
                ms[name].append(round(time_ms(g.replay, replays), 4))
    med = {name: statistics.median(v) for name, v in ms.items()}
    return {"batch": batch, "context": context, "rounds_ms": ms, "median_ms": med,
            "halves_over_full": round(med["halves"] / med["full"], 4),
            "overlap_over_full": round(med["overlap"] / med["full"], 4),
            "logits_rel_diff_vs_full": {n: round(max_rel_diff(outs[n], outs["full"]), 6) for n in ("halves", "overlap")},
            "method": f"each way one CUDA graph; median of {replays} replays per round, {rounds} rounds alternated; "
                      "each row its own blocks and token, slots -1"}
