"""Where a bench run's time goes (`labkit bench --profile`).

Two views of one extra, untimed pass over the workload:

- phases: every step timed by part (schedule, prepare inputs, forward + logits on the device, sample,
  postprocess) through the engine's step hooks (engine/observe.py), prefill and decode apart, decode
  also by batch band. The forward and the sample are followed by a device sync so their times are the
  GPU's. The hooks tag each phase with its step, so an overlapped decode (whose step k+1 is prepared
  and launched before step k is postprocessed) is timed part by part like a synchronous one; the syncs
  take the overlap away while profiling, which is the price of seeing each part.
- kernels: torch.profiler over a window of full-batch decode steps; the device kernels by self time,
  and how much of the window the GPU was busy (the rest is host time not hidden behind the GPU).

Both add overhead: they locate time, the timed repeats are the performance figures.
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict

from engine.observe import PHASES, StepHooks

PARTS = PHASES
BANDS = ((192, "batch>=192"), (64, "batch 64-191"), (16, "batch 16-63"), (1, "batch 1-15"))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize()


class _PartTimer(StepHooks):
    """Step hooks that add each phase's wall time (device-synced for forward and sample) to its step."""

    SYNCED = ("forward", "sample")

    def __init__(self, device: str):
        self.device = device
        self.by_step: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._t0: dict[str, float] = {}

    def phase_start(self, name: str, step: int) -> None:
        self._t0[name] = time.perf_counter()

    def phase_end(self, name: str, step: int, seconds: float) -> None:
        if name in self.SYNCED:
            _sync(self.device)
        self.by_step[step][name] += time.perf_counter() - self._t0.pop(name)

    def take(self, step: int) -> dict[str, float]:
        return dict(self.by_step.pop(step, {}))


def _kernel_table(prof, window_s: float, top: int) -> dict:
    from torch.autograd import DeviceType

    rows = []
    for evt in prof.key_averages():
        if getattr(evt, "device_type", None) != DeviceType.CUDA:
            continue
        us = float(getattr(evt, "self_device_time_total", 0.0) or getattr(evt, "self_cuda_time_total", 0.0))
        if us > 0:
            rows.append((evt.key, evt.count, us))
    rows.sort(key=lambda r: r[2], reverse=True)
    busy_us = sum(r[2] for r in rows)
    return {
        "window_seconds": round(window_s, 5),
        "gpu_busy_seconds": round(busy_us / 1e6, 5),
        "gpu_busy_share": round(busy_us / 1e6 / window_s, 3) if window_s > 0 else None,
        "kernels": [{"name": name[:120], "count": count, "ms": round(us / 1e3, 3),
                     "share_of_busy": round(us / busy_us, 4) if busy_us else None}
                    for name, count, us in rows[:top]],
    }


def profile_run(engine, prompts, params, window_start: int = 32, window_steps: int = 16, top: int = 15) -> dict:
    """Run the workload once more, step by step, and say where the time went (see the module doc)."""
    from torch.profiler import ProfilerActivity, profile

    device = engine.describe()["device"]
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp)
    timer = _PartTimer(device)
    remove_timer = engine.add_hooks(timer)
    steps: list[dict] = []
    prof = None
    window: dict = {}
    decode_index = 0
    full_batch = min(len(prompts), engine.config.max_num_seqs)
    try:
        _sync(device)
        t_all = time.perf_counter()
        while not engine.is_finished():
            queues = engine.stats()
            decode_next = not queues.waiting             # prefill runs while anything waits (prefill_first)
            if (prof is None and not window and decode_next and decode_index >= window_start
                    and queues.running >= full_batch):
                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
                prof = profile(activities=activities)
                prof.__enter__()
                window = {"first_decode_step": decode_index, "t0": time.perf_counter()}
            t0 = time.perf_counter()
            out = engine.step()
            seconds = time.perf_counter() - t0
            parts = timer.take(out.step)
            if not out.seqs:
                continue
            steps.append({"prefill": out.is_prefill, "batch": len(out.seqs), "tokens": out.num_tokens,
                          "seconds": seconds, **parts})
            if not out.is_prefill:
                decode_index += 1
            if prof is not None and decode_index - window["first_decode_step"] >= window_steps:
                _sync(device)
                window_s = time.perf_counter() - window["t0"]
                prof.__exit__(None, None, None)
                window = {"decode_steps": window_steps, "batch": len(out.seqs),
                          "first_decode_step": window["first_decode_step"], **_kernel_table(prof, window_s, top)}
                prof = None
        total_s = time.perf_counter() - t_all
    finally:
        if prof is not None:
            prof.__exit__(None, None, None)
        remove_timer()
    return {"kind_note": "profiled pass (instrumented, untimed): shares locate time, they are not the benchmark",
            "total_seconds": round(total_s, 4), **summarize_steps(steps),
            "kernel_window": window or {"note": "no full-batch decode window was reached"}}


def summarize_steps(steps: list[dict]) -> dict:
    def block(rows: list[dict]) -> dict:
        if not rows:
            return {"steps": 0}
        secs = [r["seconds"] for r in rows]
        out = {"steps": len(rows), "seconds": round(sum(secs), 4), "tokens": sum(r["tokens"] for r in rows),
               "ms_per_step_median": round(statistics.median(secs) * 1e3, 3)}
        out["ms_per_step_by_part"] = {p: round(sum(r.get(p, 0.0) for r in rows) / len(rows) * 1e3, 3) for p in PARTS}
        return out

    total = sum(r["seconds"] for r in steps) or 1.0
    prefill = [r for r in steps if r["prefill"]]
    decode = [r for r in steps if not r["prefill"]]
    bands = {}
    for lo, name in BANDS:
        rows = [r for r in decode if r["batch"] >= lo and not any(r["batch"] >= hi for hi, _ in BANDS if hi > lo)]
        if rows:
            bands[name] = block(rows)
            bands[name]["share_of_time"] = round(bands[name]["seconds"] / total, 3)
    parts_total = {p: round(sum(r.get(p, 0.0) for r in steps), 4) for p in PARTS}
    return {"prefill": {**block(prefill), "share_of_time": round(sum(r["seconds"] for r in prefill) / total, 3)},
            "decode": {**block(decode), "share_of_time": round(sum(r["seconds"] for r in decode) / total, 3),
                       "by_batch": bands},
            "seconds_by_part": parts_total}
