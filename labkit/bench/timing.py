"""Timing on a CUDA device, for the benches: CUDA events around calls, the kernels' own GPU time, and the two roofs a
bound is measured against in the same run (a device-to-device copy's bandwidth, a dense matmul's rate).

:func:`time_ms` brackets each call with events on an idle stream: right for work longer than its launch (a copy of
1 GB, a graph replay); :func:`graph_us` captures a function's launches in one CUDA graph and times its replay.
:func:`kernel_ms` times one kernel call as the GPU ran it: its host launch hidden behind a spin kernel and the L2
flushed first, as each layer of a step reads its own K/V.
"""
from __future__ import annotations

import statistics


def time_ms(fn, repeats: int = 20, warmups: int = 5) -> float:
    for _ in range(warmups):
        fn()
    return median_event_ms(fn, repeats)


def graph_us(fn, calls: int = 1, replays: int = 10) -> float:
    """Median µs per call of ``fn`` (``calls`` launches) captured in one CUDA graph: run once outside the capture
    (compiles), captured on a side stream, the replay timed by :func:`time_ms` and divided by ``calls``."""
    import torch

    fn()
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        fn()
    return time_ms(graph.replay, repeats=replays, warmups=3) * 1e3 / calls


def median_event_ms(fn, repeats: int, before=None) -> float:
    """The median ms between CUDA events recorded around each of `repeats` calls of fn (``before()`` first, outside
    the events)."""
    import torch
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


#: what a kernel_ms figure is (the evidence that holds one says so)
KERNEL_TIMING = "one call's GPU time, its host launch hidden behind a spin kernel, the L2 flushed first (kernel_ms)"
#: bytes written before each timed kernel call: more than any GPU's L2, so a call reads its K/V from memory, as each
#: layer of a step does (a repeated small case would otherwise be timed out of the L2)
FLUSH_BYTES = 256 << 20


def kernel_ms(fn, repeats: int = 10, warmups: int = 2) -> float:
    """GPU ms of one call of ``fn`` (median of the repeats), without its host launch path and with a cold L2.

    :func:`time_ms` brackets a call with events on an idle stream, so a call whose kernels are shorter than the
    host's Python path to launch them measures that path (a decode of one sequence: about 0.1 ms of host for
    microseconds of GPU). Here each timed call waits behind an L2 flush and a spin kernel that holds the GPU
    longer than ``fn`` takes to launch, so its kernels run back to back between the events. A ``fn`` that waits
    for the GPU itself (a host sync) still measures its own wait."""
    import time

    import torch

    for _ in range(warmups):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    launch_s = time.perf_counter() - t0              # host time to launch one call (its GPU work runs on)
    torch.cuda.synchronize()
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    spin = spin_cycles(2 * launch_s + 50e-6)
    return median_event_ms(fn, repeats, before=lambda: (flush.zero_(), torch.cuda._sleep(spin)))


def spin_cycles(seconds: float) -> int:
    """GPU clock cycles that torch.cuda._sleep spins for about `seconds` (calibrated once a process)."""
    global _CYCLES_PER_S
    if _CYCLES_PER_S is None:
        import torch
        cycles = 1_000_000
        torch.cuda._sleep(cycles)                    # its first launch off the clock
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(cycles)
        b.record()
        b.synchronize()
        _CYCLES_PER_S = cycles / (a.elapsed_time(b) * 1e-3)
    return max(1, int(_CYCLES_PER_S * seconds))


_CYCLES_PER_S: float | None = None


def copy_roof_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth (read + write bytes per second): the roof a streaming kernel can reach."""
    import torch
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x), repeats=10, warmups=3)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def matmul_peak_tflops(n: int = 8192, dtype: str = "bfloat16") -> float:
    """The dense matmul rate reachable here (TFLOP/s): an n x n x n product in the model's dtype, median of
    repeats; the compute roof of the bounds, measured in the same run as the copy roof."""
    import torch
    a = torch.randn(n, n, dtype=getattr(torch, dtype), device="cuda")
    b = torch.randn(n, n, dtype=getattr(torch, dtype), device="cuda")
    ms = time_ms(lambda: a @ b, repeats=10, warmups=3)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12
