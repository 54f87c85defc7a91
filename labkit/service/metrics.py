"""Counters, gauges and histograms of one Worker, rendered as Prometheus text for ``GET /metrics``.

The owner thread updates them; the HTTP thread renders them. One lock guards both, held only for
the few additions of a step. Names follow vLLM's where the meaning is the same
(``num_requests_running``, ``time_to_first_token_seconds``, ``inter_token_latency_seconds``) with
the ``labkit_`` prefix; TTFT and ITL here are engine-observed (from submit to the step that
produced the token).
"""
from __future__ import annotations

import bisect
import threading

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)   # last: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, acc = [], 0
        for bound, n in zip(self.buckets, self.counts):
            acc += n
            out.append(f'{name}_bucket{{{labels},le="{bound:g}"}} {acc}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.count}')
        out.append(f"{name}_sum{{{labels}}} {self.sum:.6f}")
        out.append(f"{name}_count{{{labels}}} {self.count}")
        return out


class ServiceStats:
    """What /metrics shows. Gauges are set from the owner's published snapshot."""

    def __init__(self, worker_id: str):
        self.worker_id = worker_id
        self.lock = threading.Lock()
        self.finished: dict[str, int] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.steps = {"prefill": 0, "decode": 0}
        self.step_seconds = {"prefill": 0.0, "decode": 0.0}
        self.engine_errors = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)

    def count_finished(self, reason: str) -> None:
        with self.lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1

    def render(self, gauges: dict[str, float]) -> str:
        labels = f'worker_id="{_escape(self.worker_id)}"'
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[str]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(samples)

        gauge_help = {
            "labkit_num_requests_waiting": "Requests submitted and not yet admitted (the worker queue).",
            "labkit_num_requests_running": "Requests admitted and not finished (engine waiting + running).",
            "labkit_engine_waiting": "Sequences in the engine scheduler's waiting queue.",
            "labkit_engine_running": "Sequences in the engine scheduler's running queue.",
            "labkit_kv_blocks_total": "KV blocks in the paged pool.",
            "labkit_kv_blocks_used": "KV blocks referenced by sequences.",
            "labkit_kv_blocks_free": "KV blocks on the free list.",
            "labkit_round": "Engine steps done by this worker.",
            "labkit_healthy": "1 while the worker accepts work, else 0.",
        }
        for name, help_ in gauge_help.items():
            metric(name, "gauge", help_, [f"{name}{{{labels}}} {gauges.get(name, 0):g}"])
        with self.lock:
            metric("labkit_requests_finished_total", "counter", "Finished requests by reason.",
                   [f'labkit_requests_finished_total{{{labels},reason="{r}"}} {n}'
                    for r, n in sorted(self.finished.items())] or
                   [f'labkit_requests_finished_total{{{labels},reason="length"}} 0'])
            metric("labkit_requests_rejected_total", "counter", "Requests rejected because the queue was full.",
                   [f"labkit_requests_rejected_total{{{labels}}} {self.finished.get('rejected', 0)}"])
            metric("labkit_prompt_tokens_total", "counter", "Prompt tokens of admitted requests.",
                   [f"labkit_prompt_tokens_total{{{labels}}} {self.prompt_tokens}"])
            metric("labkit_generation_tokens_total", "counter", "Output tokens produced.",
                   [f"labkit_generation_tokens_total{{{labels}}} {self.generation_tokens}"])
            metric("labkit_steps_total", "counter", "Engine steps by phase.",
                   [f'labkit_steps_total{{{labels},phase="{p}"}} {n}' for p, n in self.steps.items()])
            metric("labkit_step_seconds_total", "counter", "Wall seconds inside engine.step() by phase.",
                   [f'labkit_step_seconds_total{{{labels},phase="{p}"}} {s:.6f}' for p, s in self.step_seconds.items()])
            metric("labkit_engine_errors_total", "counter", "Engine steps that raised.",
                   [f"labkit_engine_errors_total{{{labels}}} {self.engine_errors}"])
            metric("labkit_time_to_first_token_seconds", "histogram",
                   "Engine-observed TTFT: submit to the step that produced the first token.",
                   self.ttft.lines("labkit_time_to_first_token_seconds", labels))
            metric("labkit_inter_token_latency_seconds", "histogram",
                   "Engine-observed gap between consecutive output tokens of a request.",
                   self.itl.lines("labkit_inter_token_latency_seconds", labels))
        return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
