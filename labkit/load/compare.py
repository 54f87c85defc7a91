"""``labkit scheduler compare PAIR``: one change, both sides, the same trace, with repeats (handbook 5.4.3, 5.5.2, 5.6).

Each side of a pair is a fresh engine (or fresh servers) replaying the same arrival trace with the same
warmup, through :func:`labkit.load.replay.run_load`; repeats alternate the sides (A1 B1 A2 B2 ...). The
evidence keeps every run's event log and summary and states, per side and repeat, the numbers the
handbook reads: short-request ITL p99 and long-request TTFT (p50, p99), throughput over the common
window. It is judged first on equal work: the same request ids and the same output-token count per
request on every run.

Pairs
    ``policy``         prefill_first vs balanced (in process, CPU or GPU)
    ``prefill-knob``   prefill_first vs prefill_first with ``--max-consecutive-prefill 2`` (the 5.4.3 exercise)
    ``execution``      eager vs CUDA graphs, balanced (CUDA)
    ``step-model``     nano-vllm's step model (all-prefill or all-decode) vs mixed steps (in process, CPU or GPU)
    ``deployments``    one engine vs two replicas (one per GPU, round robin) vs one TP=2 engine, each as
                       ``labkit serve`` processes driven over HTTP (2 GPUs)

Mechanism facts come from the event log's step records: ``longest_prefill_run_while_decoding`` is the
longest run of consecutive prefill steps during which some measured request had its first token and was
still waiting for more (the interference of 5.4.1, in steps rather than milliseconds). A mixed step (it
prefills and decodes) is not such a step: the requests mid-decode get their token in it.

Who pays (5.4.3) is judged in engine steps too, where one step is one scheduler round: the short requests'
ITL p99 in steps (gaps between a request's consecutive token rounds) and the long requests' TTFT p50 in
steps (first-token round minus submission round). ``who_pays`` holds the second side over the first, repeat
by repeat (the sides of one repeat run back to back), with the worst repeat of each. Milliseconds are
reported next to them; on a shared CPU they swing by 2x between repeats, steps do not.
"""
from __future__ import annotations

import shutil
import statistics
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from engine.args import preset
from labkit.errors import UserError
from labkit.load.server_process import ServerProcess

TRACE = Path("workloads/mixed.jsonl")
READY_S = 180.0      # a served deployment's start, model load included
#: The handbook's load settings (5.3, 5.4.3): engine/args.py's load-compare preset (1024 context, 256-token
#: budget, 4 per batch) and 8 active requests.
LOAD_SETTINGS = {**{k: getattr(preset("load-compare"), k)
                    for k in ("max_model_len", "max_num_batched_tokens", "max_num_seqs")}, "max_active": 8}


@dataclass(frozen=True)
class Side:
    name: str
    worker: dict                       # WorkerConfig fields of this side
    serve: list[dict] = field(default_factory=list)   # deployments: one entry per server (gpus, worker options)


@dataclass(frozen=True)
class Pair:
    name: str
    checkpoint: str
    needs: str                         # cpu | cuda | 2gpu
    sides: tuple[Side, ...]
    what: str


PAIRS: dict[str, Pair] = {p.name: p for p in (
    Pair("policy", "scheduler.policy-comparison", "cpu",
         (Side("prefill_first", {"scheduling_policy": "prefill_first"}),
          Side("balanced", {"scheduling_policy": "balanced"})),
         "5.4.3: the same trace under prefill_first and balanced"),
    Pair("prefill-knob", "scheduler.prefill-knob", "cpu",
         (Side("unset", {"scheduling_policy": "prefill_first"}),
          Side("max2", {"scheduling_policy": "prefill_first", "max_consecutive_prefill": 2})),
         "5.4.3 exercise: prefill_first without and with --max-consecutive-prefill 2"),
    Pair("execution", "scheduler.eager-vs-graph", "cuda",
         (Side("eager", {"scheduling_policy": "balanced", "enforce_eager": True}),
          Side("graph", {"scheduling_policy": "balanced", "enforce_eager": False})),
         "5.5.2: the same trace, eager vs CUDA graphs (balanced)"),
    Pair("step-model", "scheduler.mixed-step", "cpu",
         (Side("step-model", {"scheduling_policy": "prefill_first", "mixed_batches": False}),
          Side("mixed", {"scheduling_policy": "prefill_first", "mixed_batches": True})),
         "the same trace in nano-vllm's step model (each step all-prefill or all-decode) and in mixed steps "
         "(the running decodes first, prefill chunks in the rest of the budget)"),
    Pair("deployments", "scheduler.deployments", "2gpu",
         (Side("single", {"scheduling_policy": "balanced"}, [{"gpus": "0", "id": "single"}]),
          Side("replicas", {"scheduling_policy": "balanced"},
               [{"gpus": "0", "id": "replica-a"}, {"gpus": "1", "id": "replica-b"}]),
          Side("tp2", {"scheduling_policy": "balanced"},
               # the two replicas' capacity in one engine: twice the sequences a step and the admitted requests
               [{"gpus": "0,1", "id": "tp-two", "tp": 2, "max_num_seqs": 2 * LOAD_SETTINGS["max_num_seqs"],
                 "max_active": 2 * LOAD_SETTINGS["max_active"]}])),
         "5.6: one engine vs two replicas vs one TP=2 engine (balanced)"),
)}


# --------------------------------------------------------------------------- reading one run


def longest_prefill_run_while_decoding(steps: list[dict], tokens: dict[str, list[int]]) -> int:
    """Steps are the log's step records (round, phase); tokens maps a measured request to its token rounds."""
    live = [(ts[0], ts[-1]) for ts in tokens.values() if len(ts) >= 2]
    best = run = 0
    for st in sorted(steps, key=lambda s: s["round"]):
        r = st["round"]
        if st.get("phase") == "prefill" and any(first < r < last for first, last in live):
            run += 1
            best = max(best, run)
        else:
            run = 0
    return best


def step_latencies(tokens: dict[str, list[int]], submitted: dict[str, int], cls: dict[str, str]) -> dict:
    """Who pays, in engine steps: the short requests' ITL p99 (gaps between consecutive token rounds, over
    every short request) and the long requests' TTFT p50 (first-token round minus submission round)."""
    from labkit.load.report import percentile

    gaps = [b - a for r, ts in tokens.items() if cls.get(r) == "short" for a, b in zip(ts, ts[1:])]
    ttft = [ts[0] - submitted[r] for r, ts in tokens.items() if cls.get(r) == "long" and ts and r in submitted]
    return {"short_itl_p99_steps": round(percentile(gaps, 99), 3) if gaps else None,
            "long_ttft_p50_steps": round(percentile(ttft, 50), 3) if ttft else None}


def read_run(events_path: Path, observer: str = "engine") -> dict:
    """Per-request facts and the mechanism facts of one run's event log."""
    from labkit.load.report import read_log

    log = read_log(events_path)
    warm: set[str] = set()
    tokens: dict[str, list[int]] = {}
    ids: dict[str, list[int]] = {}
    cls: dict[str, str] = {}
    submitted: dict[str, int] = {}
    worker: dict[str, str] = {}
    steps: dict[str, list[dict]] = {}
    for ev in log.events:
        name, rid = ev.get("event"), ev.get("request_id")
        if name == "step" and ev.get("observer", "engine") == "engine":
            steps.setdefault(ev.get("worker_id") or "?", []).append(ev)
        if rid is None or ev.get("observer", "engine") != observer:
            continue
        if name == "submitted":
            cls[rid] = str(ev.get("class", "all"))
            if isinstance(ev.get("round"), int):
                submitted[rid] = ev["round"]
            if ev.get("warmup"):
                warm.add(rid)
        elif name == "token":
            tokens.setdefault(rid, []).append(int(ev.get("round", -1)))
            ids.setdefault(rid, []).append(ev.get("token_id"))
            if ev.get("worker_id"):
                worker[rid] = ev["worker_id"]
    measured = sorted(r for r in cls if r not in warm)
    by_worker: dict[str, dict[str, list[int]]] = {}
    for r in measured:
        by_worker.setdefault(worker.get(r, "?"), {})[r] = tokens.get(r, [])
    runs = [longest_prefill_run_while_decoding(steps.get(w, []), t) for w, t in by_worker.items()]
    return {"request_ids": measured,
            "output_tokens_by_request": {r: len(tokens.get(r, [])) for r in measured},
            "output_ids_by_request": {r: ids.get(r, []) for r in measured},
            "class_by_request": {r: cls[r] for r in measured},
            "requests_by_worker": {w: len(t) for w, t in sorted(by_worker.items())},
            "steps": {p: sum(s.get("phase") == p for ss in steps.values() for s in ss)
                      for p in ("prefill", "decode", "mixed")},
            "longest_prefill_run_while_decoding": max(runs, default=0),
            **step_latencies({r: tokens.get(r, []) for r in measured}, submitted, cls)}


def _dig(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def run_facts(record: dict, events_path: Path) -> dict:
    """What the comparison keeps of one load run."""
    f = record.get("facts") or {}
    summary = f.get("summary") or {}
    observers = summary.get("observers") or {}
    obs = "client" if "client" in observers else "engine"
    o = observers.get(obs) or {}
    by = o.get("by_class") or {}
    run = read_run(events_path, observer=obs)
    return {
        "events": str(events_path), "verdict": record.get("verdict"), "observer": obs,
        "requests": o.get("requests"), "completed": o.get("completed"), "rejections": o.get("rejections"),
        "output_tokens": o.get("output_tokens"),
        "short_itl_p99_ms": _dig(by, "short", "itl_ms", "p99"), "short_ttft_p50_ms": _dig(by, "short", "ttft_ms", "p50"),
        "long_ttft_p50_ms": _dig(by, "long", "ttft_ms", "p50"), "long_ttft_p99_ms": _dig(by, "long", "ttft_ms", "p99"),
        "long_itl_p99_ms": _dig(by, "long", "itl_ms", "p99"),
        "throughput_tok_s": o.get("throughput_tok_s"), "window_s": _dig(o, "window", "seconds"),
        "workers": o.get("workers"),
        "engine_config": {k: (f.get("engine_config") or {}).get(k)
                          for k in ("scheduling_policy", "max_consecutive_prefill", "mixed_batches", "enforce_eager",
                                    "max_num_batched_tokens", "max_num_seqs", "max_model_len", "tensor_parallel_size")}
        if f.get("engine_config") else None,
        "kv_free_at_end_equals_total": f.get("kv_free_at_end_equals_total"),
        **run,
    }


# --------------------------------------------------------------------------- judging the set of runs


def _median(xs: list) -> float | None:
    xs = [x for x in xs if isinstance(x, (int, float))]
    return round(statistics.median(xs), 3) if xs else None


METRICS = ("short_itl_p99_ms", "long_ttft_p50_ms", "long_ttft_p99_ms", "short_ttft_p50_ms", "throughput_tok_s",
           "short_itl_p99_steps", "long_ttft_p50_steps")
#: who pays, in steps: (metric, which repeat is the worst for the claim that the second side moves it)
WHO_PAYS = (("short_itl_p99_steps", max), ("long_ttft_p50_steps", min))


def who_pays(runs: dict[str, list[dict]]) -> dict | None:
    """The second side over the first in each repeat, per step metric, and the worst repeat: the largest
    short-ITL ratio (shorts gain when it is below 1) and the smallest long-TTFT ratio (longs pay when it is
    above 1). None for a pair of more than two sides."""
    names = list(runs)
    if len(names) != 2:
        return None
    a, b = runs[names[0]], runs[names[1]]
    out: dict[str, Any] = {"sides": names, "unit": "engine steps (scheduler rounds)"}
    for metric, worst in WHO_PAYS:
        ratios = [round(y[metric] / x[metric], 4) if x.get(metric) and y.get(metric) is not None else None
                  for x, y in zip(a, b)]
        out[f"{metric}_ratio"] = ratios
        known = [r for r in ratios if r is not None]
        out[f"{worst.__name__}_{metric}_ratio"] = worst(known) if known and len(known) == len(ratios) else None
    return out


def compare_runs(runs: dict[str, list[dict]], expected_tokens: int | None = None) -> dict:
    """Per side, per repeat: the handbook's numbers and medians; across every run: equal work."""
    all_runs = [r for rs in runs.values() for r in rs]
    sets = {tuple(r["request_ids"]) for r in all_runs}
    counts = [r["output_tokens_by_request"] for r in all_runs]
    ids = [r.get("output_ids_by_request") for r in all_runs]
    sides: dict[str, dict] = {}
    for name, rs in runs.items():
        side: dict[str, Any] = {m: [r.get(m) for r in rs] for m in METRICS}
        side.update({f"median_{m}": _median(side[m]) for m in METRICS})
        side["longest_prefill_run_while_decoding"] = [r["longest_prefill_run_while_decoding"] for r in rs]
        side["max_longest_prefill_run_while_decoding"] = max(side["longest_prefill_run_while_decoding"], default=None)
        side["completed"] = [r.get("completed") for r in rs]
        side["output_tokens"] = [r.get("output_tokens") for r in rs]
        side["rejections"] = [r.get("rejections") for r in rs]
        side["kv_free_at_end"] = [r.get("kv_free_at_end_equals_total") for r in rs]
        side["mixed_steps"] = [(r.get("steps") or {}).get("mixed", 0) for r in rs]
        side["min_mixed_steps"] = min(side["mixed_steps"], default=None)
        side["engine_config"] = rs[0].get("engine_config") if rs else None
        side["repeats"] = len(rs)
        sides[name] = side
    names = list(runs)
    base = sides[names[0]] if names else {}
    ratios = {n: {m: (round(sides[n][f"median_{m}"] / base[f"median_{m}"], 4)
                      if base.get(f"median_{m}") and sides[n].get(f"median_{m}") is not None else None)
                  for m in METRICS} for n in names[1:]}
    return {"sides": sides, "side_order": names, "ratios_vs_first": ratios, "who_pays": who_pays(runs),
            "same_request_sets": len(sets) == 1 and bool(all_runs),
            "request_ids": list(next(iter(sets))) if len(sets) == 1 else None,
            "same_token_counts": bool(counts) and all(c == counts[0] for c in counts),
            # greedy traces: the same token ids per request on every run, whatever the step model
            "same_output_ids": bool(ids) and None not in ids and all(i == ids[0] for i in ids),
            "total_output_tokens": sum(counts[0].values()) if counts else None,
            "expected_output_tokens": expected_tokens, "runs": len(all_runs)}


# --------------------------------------------------------------------------- running


def _check_machine(pair: Pair, device: str) -> None:
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if pair.needs == "cuda" and (n < 1 or device == "cpu"):
        raise UserError(f"scheduler compare {pair.name} needs CUDA (CUDA graphs); this machine has none")
    if pair.needs == "2gpu" and n < 2:
        raise UserError(f"scheduler compare {pair.name} needs 2 GPUs; this machine has {n}")


def run_compare(pair_name: str, out: Path, *, repeats: int = 3, model: str | None = None, device: str = "auto",
                attention: str = "auto", trace: Path = TRACE, warmup_requests: int = 2,
                on_run: Callable[[str, int], None] | None = None) -> dict:
    from labkit.evidence import write_evidence
    from labkit.load.trace import read_trace

    pair = PAIRS.get(pair_name)
    if pair is None:
        raise UserError(f"unknown pair {pair_name!r}: choose one of {', '.join(PAIRS)}")
    if repeats < 1:
        raise UserError(f"--repeats must be >= 1, got {repeats}")
    _check_machine(pair, device)
    _, reqs = read_trace(trace)
    logs = out.with_suffix("")            # runs/<name>/: one event log (+ its evidence) per run
    if logs.exists():
        shutil.rmtree(logs)
    logs.mkdir(parents=True)
    runs: dict[str, list[dict]] = {s.name: [] for s in pair.sides}
    extra: dict[str, Any] = {}
    for k in range(repeats):
        for side in pair.sides:
            if on_run:
                on_run(side.name, k)
            path = logs / f"{side.name}-r{k + 1}.jsonl"
            if side.serve:
                record, served = _run_served(side, path, model, attention, trace, warmup_requests)
                extra.setdefault(side.name, []).append(served)
            else:
                record = _run_inprocess(side, path, model, device, attention, trace, warmup_requests)
            runs[side.name].append(run_facts(record, path))
    facts: dict[str, Any] = {"pair": pair.name, "what": pair.what, "trace": str(trace), "mode": "wall",
                             "warmup_requests": warmup_requests, "load_settings": LOAD_SETTINGS,
                             "repeats": repeats, "logs": str(logs),
                             **compare_runs(runs, sum(int(r["max_tokens"]) for r in reqs)),
                             "trace_requests": len(reqs), "per_run": runs}
    if pair.name == "execution":
        facts.update(_execution_facts(logs, repeats))
    if pair.name == "deployments":
        facts["deployments"] = _deployment_facts(runs, extra)
    kind = "gpu-measured" if pair.needs != "cpu" or _device_of(runs) == "cuda" else "cpu-real-engine"
    first = (runs[pair.sides[0].name] or [{}])[0]
    return write_evidence(out, checkpoint=pair.checkpoint, kind=kind, facts=facts,
                          device=_device_of(runs) or ("cuda" if pair.needs != "cpu" else "cpu"),
                          model=_model_of(first.get("events")))


def _device_of(runs: dict[str, list[dict]]) -> str | None:
    from labkit.load.report import read_log

    for rs in runs.values():
        for r in rs:
            h = read_log(r["events"]).header or {}
            if h.get("device"):
                return "cuda" if str(h["device"]).startswith("cuda") else str(h["device"])
    return None


def _model_of(events: str | None) -> dict | None:
    if not events:
        return None
    from labkit.load.report import read_log

    return (read_log(events).header or {}).get("model")


def _run_inprocess(side: Side, path: Path, model: str | None, device: str, attention: str, trace: Path,
                   warmup: int) -> dict:
    from labkit.load.replay import LoadOptions, run_load
    from serve.core.config import WorkerConfig

    worker = WorkerConfig(model=model, device=device, attention_backend=attention, **LOAD_SETTINGS, **side.worker)
    return run_load(LoadOptions(trace=trace, out=path, worker=worker, mode="wall", warmup_requests=warmup,
                                show_progress=False))


def _execution_facts(logs: Path, repeats: int) -> dict:
    """eager vs graph: identical output ids per request (repeat by repeat), and graph capture seconds."""
    from labkit.load.report import read_log

    same = []
    for k in range(repeats):
        a = read_run(logs / f"eager-r{k + 1}.jsonl")["output_ids_by_request"]
        b = read_run(logs / f"graph-r{k + 1}.jsonl")["output_ids_by_request"]
        same.append(sum(a[r] == b.get(r) for r in a))
    graph = {}
    for side in ("eager", "graph"):
        h = read_log(logs / f"{side}-r1.jsonl").header or {}
        g = _dig(h, "engine", "graph") or {}
        graph[side] = {"enabled": g.get("enabled"), "capture_seconds": g.get("capture_seconds"),
                       "buckets": g.get("buckets"), "init_seconds": _dig(h, "engine", "init_seconds")}
    return {"requests_with_identical_outputs": same, "graph": graph}


# --------------------------------------------------------------------------- served deployments (2 GPUs)


def _gpu_memory_used_mib() -> list[int] | None:
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=10)
        return [int(x) for x in p.stdout.split()] if p.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def _run_served(side: Side, path: Path, model: str | None, attention: str, trace: Path, warmup: int):
    """Start this side's servers (each its own process and GPUs), replay the trace against them, stop them."""
    import threading

    from labkit.load.replay import LoadOptions, run_load

    servers: list[ServerProcess] = []
    configs: list[dict] = []
    peak: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            used = _gpu_memory_used_mib() or []
            for i, u in enumerate(used):
                if i >= len(peak):
                    peak.append(u)
                peak[i] = max(peak[i], u)
            stop.wait(0.5)

    try:
        for s in side.serve:
            args = ["--worker-id", s["id"],
                    "--scheduling-policy", side.worker["scheduling_policy"], "--enforce-eager",
                    "--max-model-len", str(LOAD_SETTINGS["max_model_len"]),
                    "--max-num-batched-tokens", str(LOAD_SETTINGS["max_num_batched_tokens"]),
                    "--max-num-seqs", str(s.get("max_num_seqs", LOAD_SETTINGS["max_num_seqs"])),
                    "--max-active", str(s.get("max_active", LOAD_SETTINGS["max_active"])),
                    "--tensor-parallel-size", str(s.get("tp", 1)), "--attention", attention,
                    "--out", str(path.with_name(f"{path.stem}-server-{s['id']}.jsonl"))]
            if model:
                args += ["--model", model]
            servers.append(ServerProcess.spawn(args, path.with_name(f"{path.stem}-server-{s['id']}.log"),
                                               env={"CUDA_VISIBLE_DEVICES": s["gpus"]}))
        for server, s in zip(servers, side.serve):
            configs.append(server.wait_ready(READY_S).served_config(s["id"]))
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        record = run_load(LoadOptions(trace=trace, out=path, endpoints=[x.url for x in servers], mode="wall",
                                      warmup_requests=warmup, show_progress=False))
    finally:
        stop.set()
        for server in servers:
            server.stop(60)
    facts = []
    for s, cfg in zip(side.serve, configs):
        eng = cfg.get("engine") or {}
        facts.append({"worker_id": s["id"], "gpus": s["gpus"], "tp": s.get("tp", 1),
                      "num_kvcache_blocks": eng.get("num_kvcache_blocks"), "memory": eng.get("memory")})
    return record, {"servers": facts, "gpu_memory_used_peak_mib": peak or None}


def _deployment_facts(runs: dict[str, list[dict]], extra: dict[str, list[dict]]) -> dict:
    out: dict[str, Any] = {}
    for side, rs in runs.items():
        served = extra.get(side) or []
        workers = [r.get("workers") or {} for r in rs]
        overlaps = [min((w.get("overlap_all_s") for w in ws.values() if w.get("overlap_all_s") is not None),
                        default=None) for ws in workers]
        out[side] = {
            "requests_by_worker": [r.get("requests_by_worker") for r in rs],
            "workers_serving": [sum(1 for n in (r.get("requests_by_worker") or {}).values() if n > 0) for r in rs],
            "overlap_all_s": overlaps,
            "min_overlap_s": (min(overlaps) if overlaps and None not in overlaps else None),
            "throughput_tok_s": [r.get("throughput_tok_s") for r in rs],
            "median_throughput_tok_s": _median([r.get("throughput_tok_s") for r in rs]),
            "servers": served[0]["servers"] if served else None,
            "kv_blocks_per_engine": [s.get("num_kvcache_blocks") for s in (served[0]["servers"] if served else [])],
            "gpu_memory_used_peak_mib": [x.get("gpu_memory_used_peak_mib") for x in served],
        }
    return out
