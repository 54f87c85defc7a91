"""StepProfiler: torch.profiler around the owner's steps (handbook 5.5.1), started after warmup.

Ranges (``record_function``): ``step`` (one ``engine.step()``), ``prepare_prefill`` /
``prepare_decode`` (the runner's input building: host lists and their tensors), ``run_model`` (the
forward and logits). The engine is not edited: the runner's methods are wrapped on the instance
while profiling and restored afterwards. Start and stop run on the owner thread (``Worker.run_on_owner``), so the
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

RANGES = ("step", "prepare_prefill", "prepare_decode", "run_model")


class StepProfiler:
    def __init__(self, out_dir: str | Path, device: str = "cpu", row_limit: int = 30):
        self.out_dir = Path(out_dir)
        self.device = device
        self.row_limit = row_limit
        self._prof = None
        self._worker = None
        self._wrapped: list[str] = []

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
        self._wrapped = _wrap_runner(engine.runner, record_function)
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
        for name in self._wrapped:
            engine.runner.__dict__.pop(name, None)        # back to the class's method
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


def _wrap_runner(runner, record_function) -> list[str]:
    """Instance-level wrappers that open the ranges; returns the wrapped attribute names.

    ``prepare_prefill``/``prepare_decode`` cover the runner's whole input building: the host lists
    (``plan_*``) and their tensors (``to_inputs``, copies to the device)."""
    names: list[str] = []

    def wrap(name: str, make):
        setattr(runner, name, make(getattr(runner, name)))
        names.append(name)

    def ranged(label: str):
        def make(f):
            def wrapped(*args, **kwargs):
                with record_function(label):
                    return f(*args, **kwargs)
            return wrapped
        return make

    wrap("prepare_prefill", ranged("prepare_prefill"))
    wrap("prepare_decode", ranged("prepare_decode"))
    wrap("run_model", ranged("run_model"))
    return names


def _device_us(evt) -> float:
    for attr in ("device_time_total", "cuda_time_total"):
        v = getattr(evt, attr, None)
        if v is not None:
            return float(v)
    return 0.0


def _self_device_us(evt) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total"):
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
    ops.sort(key=lambda e: (_self_device_us(e), e.self_cpu_time_total), reverse=True)
    return [{"name": e.key, "count": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3),
             "self_device_ms": round(_self_device_us(e) / 1e3, 3)} for e in ops[:n]]
