"""StepProfiler: torch.profiler around the owner's steps (handbook 5.5.1), started after warmup.

Ranges (``record_function``): ``step`` (one ``engine.step()``) and the engine's step phases from its
hooks (engine/observe.py): ``schedule``, ``prepare`` (host lists and their tensors), ``forward`` (the
model and the logits), ``sample``, ``postprocess``. The hooks are registered while profiling and removed
afterwards; both step paths (one at a time, overlapped) call them. Start and stop run on the owner thread (``Worker.run_on_owner``), so the
profiler sees the thread that does the work. Output in ``DIR``: ``trace.json`` (Chrome trace:
chrome://tracing or Perfetto), ``operators.txt`` (the operator summary table), ``profile.json``
(evidence kind ``profile``: range counts and times, top operators). Profiling adds overhead: its
numbers locate time, they are not performance results.

The profiler is thread-local: started on the main thread it would not see the owner's ops, which is
why it starts on the owner. Kineto prints a few ``USDT ... profiler_start/stop`` lines on stderr.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.observe import StepHooks

RANGES = ("step", "schedule", "prepare", "forward", "sample", "postprocess")


class _RangeHooks(StepHooks):
    """Opens a profiler range for each engine phase."""

    def __init__(self, record_function):
        self._record_function = record_function
        self._open: list = []

    def phase_start(self, name: str, step: int) -> None:
        rng = self._record_function(name)
        rng.__enter__()
        self._open.append(rng)

    def phase_end(self, name: str, step: int, seconds: float) -> None:
        self._open.pop().__exit__(None, None, None)


class StepProfiler:
    def __init__(self, out_dir: str | Path, device: str = "cpu", row_limit: int = 30):
        self.out_dir = Path(out_dir)
        self.device = device
        self.row_limit = row_limit
        self._prof = None
        self._worker = None
        self._remove_hooks = None

    def prime(self) -> None:
        """An empty profile on the calling (main) thread first, so Kineto initialises on the thread
        that registered it and does not complain when the owner thread starts the real one."""
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]):
            pass

    # start and stop run on the owner thread
    def start(self, worker, engine) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile, record_function

        activities = [ProfilerActivity.CPU]
        if self.device.startswith("cuda") and torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._remove_hooks = engine.add_hooks(_RangeHooks(record_function))
        worker._range = record_function
        self._worker = worker
        self._prof = profile(activities=activities, record_shapes=False)
        self._prof.__enter__()

    def stop(self, worker, engine) -> dict:
        import torch

        if self._prof is None:
            return {}
        if self.device.startswith("cuda") and torch.cuda.is_available():
            torch.cuda.synchronize()
        self._prof.__exit__(None, None, None)
        worker._range = None
        if self._remove_hooks is not None:
            self._remove_hooks()
            self._remove_hooks = None
        prof, self._prof = self._prof, None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        trace = self.out_dir / "trace.json"
        prof.export_chrome_trace(str(trace))
        averages = prof.key_averages()
        device_sort = "self_device_time_total" if self.device.startswith("cuda") else "self_cpu_time_total"
        table = averages.table(sort_by=device_sort, row_limit=self.row_limit)
        (self.out_dir / "operators.txt").write_text(table + "\n", encoding="utf-8")
        return {"trace": str(trace), "operators": str(self.out_dir / "operators.txt"),
                "ranges": _ranges(averages), "top_operators": _top(averages, self.row_limit)}


def _device_us(evt, prefix: str = "") -> float:
    """An event's device time (``prefix="self_"``: its own, without its children), under torch's current name
    or the older cuda one; 0 where neither is there."""
    for attr in (f"{prefix}device_time_total", f"{prefix}cuda_time_total"):
        v = getattr(evt, attr, None)
        if v is not None:
            return float(v)
    return 0.0


def _ranges(averages) -> dict[str, Any]:
    out = {}
    for evt in averages:
        if evt.key in RANGES:
            out[evt.key] = {"count": evt.count, "cpu_ms": round(evt.cpu_time_total / 1e3, 3),
                            "device_ms": round(_device_us(evt) / 1e3, 3)}
    return {k: out.get(k, {"count": 0, "cpu_ms": 0.0, "device_ms": 0.0}) for k in RANGES}


def _top(averages, n: int) -> list[dict]:
    ops = [e for e in averages if e.key not in RANGES]
    ops.sort(key=lambda e: (_device_us(e, "self_"), e.self_cpu_time_total), reverse=True)
    return [{"name": e.key, "count": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3),
             "self_device_ms": round(_device_us(e, "self_") / 1e3, 3)} for e in ops[:n]]
