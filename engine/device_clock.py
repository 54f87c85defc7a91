"""When each step ran on the GPU, on the host's clock: whether the engine waited for Python between steps.

The host sees a step from its launch to the moment its sampled ids are read; under the overlapped decode
that span says little about the GPU (step k+1 is computing while the host does step k's bookkeeping). So
on CUDA every step also records two timing events on the engine's stream: one before its inputs are
copied in (the GPU reaches it once the step before is done AND the host has launched this one) and one
after its sampled ids (Launched.ready). Once the ids are read both have happened; their distance from a
reference event recorded at start (when the host read ``time.monotonic_ns()``) puts the step's span on the
host's monotonic clock, the clock the service's records use.

The gap between one step's end and the next one's start is time the GPU had nothing of the engine's to
run: the engine waited for the host. Anchoring costs one synchronize at start; a step, two event records
and two elapsed-time reads (a few µs). Over minutes the two clocks drift by a few µs.
"""
from __future__ import annotations

import time

import torch


class DeviceClock:
    def __init__(self) -> None:
        self.ref = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        self.ref.record()
        self.ref.synchronize()
        self.ref_ns = time.monotonic_ns()

    @staticmethod
    def mark() -> torch.cuda.Event:
        """An event on the current stream, reached when the GPU gets there."""
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def at_ns(self, event: torch.cuda.Event) -> int:
        """When the GPU reached ``event`` (it must have), in ``time.monotonic_ns()``."""
        return self.ref_ns + int(self.ref.elapsed_time(event) * 1e6)

    def span(self, start: torch.cuda.Event, end: torch.cuda.Event) -> tuple[int, int]:
        return self.at_ns(start), self.at_ns(end)
