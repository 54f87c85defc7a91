"""Where a bench run's time goes (`labkit bench --profile`).

Two views of one extra, untimed pass over the workload:

- phases: every step timed by part (schedule, prepare inputs, forward + logits on the device, sample,
  postprocess), prefill and decode apart, decode also by batch band. The forward is followed by a
  device sync so its time is the GPU's; sample() syncs anyway (``tolist``), so the sync adds little.
- kernels: torch.profiler over a window of full-batch decode steps; the device kernels by self time,
  and how much of the window the GPU was busy (the rest is host time not hidden behind the GPU).

Both add overhead: they locate time, the timed repeats are the performance figures.
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict

PARTS = ("schedule", "prepare", "forward", "sample", "postprocess")
BANDS = ((192, "batch>=192"), (64, "batch 64-191"), (16, "batch 16-63"), (1, "batch 1-15"))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize()


class _PartTimer:
    """Wraps the engine's parts on the instance (restored by close) and adds their wall time per step."""

    def __init__(self, engine):
        self.engine = engine
        self.device = engine.runner.device
        self.current: dict[str, float] = defaultdict(float)
        self._restore: list[tuple[object, str]] = []
        runner = engine.runner
        self._wrap(engine, "schedule", "schedule")
        self._wrap(runner, "prepare", "prepare")
        self._wrap(runner, "run_model", "forward", sync=True)
        self._wrap(runner, "sample", "sample")
        self._wrap(engine, "postprocess", "postprocess")

    def _wrap(self, obj, attr: str, part: str, sync: bool = False) -> None:
        inner = getattr(obj, attr)
        device = self.device

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if sync:
                    _sync(device)
                self.current[part] += time.perf_counter() - t0

        setattr(obj, attr, timed)
        self._restore.append((obj, attr))

    def take(self) -> dict[str, float]:
        out, self.current = dict(self.current), defaultdict(float)
        return out

    def close(self) -> None:
        for obj, attr in self._restore:
            obj.__dict__.pop(attr, None)


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

    device = engine.runner.device
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp)
    timer = _PartTimer(engine)
    steps: list[dict] = []
    prof = None
    window: dict = {}
    decode_index = 0
    full_batch = min(len(prompts), engine.config.max_num_seqs)
    try:
        _sync(device)
        t_all = time.perf_counter()
        while not engine.is_finished():
            decode_next = not engine.scheduler.waiting   # prefill runs while anything waits (prefill_first)
            if (prof is None and not window and decode_next and decode_index >= window_start
                    and len(engine.scheduler.running) >= full_batch):
                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
                prof = profile(activities=activities)
                prof.__enter__()
                window = {"first_decode_step": decode_index, "t0": time.perf_counter()}
            t0 = time.perf_counter()
            out = engine.step()
            seconds = time.perf_counter() - t0
            parts = timer.take()
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
        timer.close()
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
