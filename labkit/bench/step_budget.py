"""`labkit bench --workload step-budget`: what each ms of one decode step is spent on.

B sequences (default 256) are prefilled at C prompt tokens (default 1024) and then decode; only decode
steps are timed. The engine runs its synchronous step (schedule -> prepare -> forward -> sample with
the token readback -> postprocess), so one step's wall time is the time between two tokens of a request.

Passes over the same running batch, each after W warm steps:

- ``graph`` (CUDA only: the engine's default route on CUDA): N steps timed by the host clock with no
  profiler (the true step time), then N steps under torch.profiler (CUDA activities) with a range per
  step and per engine phase (engine/observe.py StepHooks).
- ``eager``: the same with the graphs set aside (the runner's eager route), N steps timed, then N
  steps profiled with one ``torch.profiler.record_function`` range per leaf module (forward pre/post
  hooks on the embedding, each GEMM, each norm, the rotary, the activation, the attention; the
  backend's KV store wrapped) and per phase. The hooks exist only while this pass runs.

Attribution (:mod:`labkit.bench.step_attribution`): each device item goes to the module range that
launched it; kernels inside a CUDA graph replay take their eager twins' categories; the host time
outside the device is split by phase.

Bounds (labkit.bench.bound.category_bounds): per category, the bytes it must move and the FLOPs it must
do at this batch and these contexts, at the copy roof and the matmul peak measured in the same run.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

from engine.observe import PHASES, StepHooks
from labkit.bench.step_attribution import (CATEGORIES, GEMM_ROLES, HOST_PARTS, PHASE_RANGE, RANGE, STEP_RANGE,
                                           attribute_steps, mean_steps, top_kernels, load_trace, split_steps,
                                           trace_items)
# names the tests read here: the trace side of one budget
from labkit.bench.step_attribution import Item, innermost_spans, align_graph_step, is_graph_launch  # noqa: F401

if TYPE_CHECKING:
    from labkit.lab_engine import LabEngine

#: leaf module attribute name -> category (Qwen3ForCausalLM's modules, engine/models/qwen3.py)
MODULE_CATEGORY = {"embed_tokens": "embedding", "qkv_proj": "gemm.qkv", "o_proj": "gemm.o",
                   "gate_up_proj": "gemm.gate_up", "down_proj": "gemm.down", "lm_head": "gemm.lm_head",
                   "input_layernorm": "norm", "post_attention_layernorm": "norm", "q_norm": "norm",
                   "k_norm": "norm", "norm": "norm", "rotary_emb": "rotary", "act_fn": "activation",
                   "attn": "attention"}


# -- instrumentation -------------------------------------------------------------------------------
def module_categories(modules: dict) -> dict[str, str]:
    """Module name -> category for every leaf module the budget ranges cover (modules: name -> module)."""
    return {name: MODULE_CATEGORY[name.rsplit(".", 1)[-1]] for name in modules
            if name and name.rsplit(".", 1)[-1] in MODULE_CATEGORY}


class _Ranges:
    """record_function ranges opened and closed by hooks (always in nested order on the engine's thread)."""

    def __init__(self):
        self.open: list = []

    def enter(self, name: str) -> None:
        import torch
        rf = torch.profiler.record_function(name)
        rf.__enter__()
        self.open.append(rf)

    def exit(self) -> None:
        self.open.pop().__exit__(None, None, None)


class _PhaseRanges(StepHooks):
    def __init__(self, ranges: _Ranges):
        self.ranges = ranges

    def phase_start(self, name: str, step: int) -> None:
        self.ranges.enter(PHASE_RANGE + name)

    def phase_end(self, name: str, step: int, seconds: float) -> None:
        self.ranges.exit()


class _PhaseClock(StepHooks):
    """Host seconds per phase of each step (no sync: the timed passes stay as the engine runs)."""

    def __init__(self):
        self.seconds: dict[str, float] = {p: 0.0 for p in PHASES}

    def phase_end(self, name: str, step: int, seconds: float) -> None:
        self.seconds[name] += seconds


def _wrap_in_range(obj, attr: str, ranges: _Ranges, name: str) -> "callable":
    """obj.attr (a method) wrapped on the instance in the range `name`; returns the function that unwraps it."""
    had_own = attr in vars(obj)
    original = getattr(obj, attr)

    def wrapped(*args, **kwargs):
        ranges.enter(name)
        try:
            return original(*args, **kwargs)
        finally:
            ranges.exit()

    setattr(obj, attr, wrapped)

    def unwrap() -> None:
        if had_own:
            setattr(obj, attr, original)
        else:
            delattr(obj, attr)
    return unwrap


def install_module_ranges(engine, ranges: _Ranges) -> "callable":
    """Forward pre/post hooks on every leaf module of MODULE_CATEGORY; a wrapper on the attention backend's
    store_kv and on each column GEMM's ``normed`` (the one-token path runs its norm inside the qkv and gate_up
    GEMVs through that method, not through forward); returns the function that removes them all."""
    handles, undo = [], []
    modules = dict(engine.probe.named_modules())
    for name, category in module_categories(modules).items():
        mod = modules[name]
        handles.append(mod.register_forward_pre_hook(lambda m, a, c=category: ranges.enter(RANGE + c)))
        handles.append(mod.register_forward_hook(lambda m, a, o: ranges.exit()))
        if category.startswith("gemm.") and hasattr(mod, "normed"):
            undo.append(_wrap_in_range(mod, "normed", ranges, RANGE + category))
    # the attention layers share one backend; its store_kv is wrapped on the instance and unwrapped after
    backend = next(m.backend for n, m in modules.items() if n.rsplit(".", 1)[-1] == "attn")
    undo.append(_wrap_in_range(backend, "store_kv", ranges, RANGE + "kv_store"))

    def remove() -> None:
        for h in handles:
            h.remove()
        for u in undo:
            u()
    return remove


# -- the run ---------------------------------------------------------------------------------------
def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize()


class _Driver:
    """Steps the engine's running batch one decode step at a time and checks it stays whole."""

    def __init__(self, engine, batch: int):
        self.engine = engine
        self.batch = batch
        self.contexts: list[int] = []

    def step(self):
        out = self.engine.step()
        if out.is_prefill or len(out.seqs) != self.batch:
            from labkit.errors import UserError
            raise UserError(f"step-budget: expected a decode step of {self.batch} sequences, got a "
                            f"{'prefill' if out.is_prefill else 'decode'} of {len(out.seqs)} (a KV pool too small "
                            f"for --batch x --context preempts sequences: lower one of them)")
        self.contexts.append(sum(s.num_tokens - 1 for s in out.seqs))
        return out

    def timed(self, n: int, device: str) -> dict:
        clock = _PhaseClock()
        remove = self.engine.add_hooks(clock)
        walls, routes = [], set()
        first = len(self.contexts)
        try:
            for _ in range(n):
                _sync(device)
                t0 = time.perf_counter()
                out = self.step()
                walls.append(time.perf_counter() - t0)
                routes.add(str(out.route))
        finally:
            remove()
        ms = [w * 1e3 for w in walls]
        return {"steps": n, "routes": sorted(routes), "route_kinds": sorted({r.split(":")[0] for r in routes}),
                "wall_ms_median": round(statistics.median(ms), 4),
                "wall_ms_mean": round(statistics.fmean(ms), 4), "wall_ms_min": round(min(ms), 4),
                "wall_ms_max": round(max(ms), 4),
                "phase_ms_mean": {p: round(s / n * 1e3, 4) for p, s in clock.seconds.items()},
                "mean_context": round(statistics.fmean(self.contexts[first:]) / self.batch, 2)}

    def profiled(self, n: int, device: str, trace_path: Path, modules: bool) -> tuple[dict, list[dict]]:
        from torch.profiler import ProfilerActivity, profile, record_function

        cuda = device.startswith("cuda")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        ranges = _Ranges()
        remove_phases = self.engine.add_hooks(_PhaseRanges(ranges))
        remove_modules = install_module_ranges(self.engine, ranges) if modules else (lambda: None)
        first = len(self.contexts)
        routes = set()
        try:
            _sync(device)
            with profile(activities=activities) as prof:
                for _ in range(n):
                    with record_function(STEP_RANGE):
                        routes.add(str(self.step().route))
                _sync(device)
        finally:
            remove_modules()
            remove_phases()
        prof.export_chrome_trace(str(trace_path))
        events = load_trace(trace_path)
        items, spans = trace_items(events, cuda)
        steps = split_steps(items, spans)
        device_events = sum(1 for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
        return {"steps": len(steps), "routes": sorted(routes), "trace": str(trace_path),
                "device_events_in_trace": device_events,
                "device_events_without_launch": device_events - len(items) if cuda else 0,
                "mean_context": round(statistics.fmean(self.contexts[first:]) / self.batch, 2)}, steps


@dataclass
class BudgetSpec:
    batch: int = 256
    context: int = 1024
    warm: int = 5
    steps: int = 20
    temperature: float = 0.6

    def decode_steps(self, graphs: bool) -> int:
        passes = 2 if graphs else 1
        return passes * (self.warm + 2 * self.steps) + 4     # + the first decode step, and a margin

    def check(self) -> None:
        from labkit.errors import UserError
        for name in ("batch", "context", "steps"):
            if getattr(self, name) < 1:
                raise UserError(f"step-budget: {name} must be at least 1, got {getattr(self, name)}")
        if self.warm < 0:
            raise UserError(f"step-budget: warm must be at least 0, got {self.warm}")


def step_budget(spec: BudgetSpec, out_dir: Path, model: str | None = None, device: str = "auto",
                attention: str = "auto", kv_cache_dtype: str = "auto") -> tuple[dict, "LabEngine"]:
    """Build the engine, reach a decode batch of spec.batch at spec.context, run the passes of the module
    doc; returns the facts and the engine (still open: the caller describes and closes it). The trace
    files are written to out_dir."""
    from engine import SamplingParams
    from labkit.bench.run import engine_facts, fixed_workload
    from labkit.lab_engine import build_engine, detect_device

    spec.check()
    device = detect_device(device)
    cuda = device.startswith("cuda")
    decode = spec.decode_steps(cuda)
    block = 256                          # the lab's KV block
    max_len = -(-(spec.context + decode + 1) // block) * block
    built = build_engine(model, device, attention, max_num_seqs=spec.batch, max_model_len=max_len,
                         max_num_batched_tokens=max(16384, max_len), kvcache_block_size=block,
                         enforce_eager=not cuda, gpu_memory_utilization=0.9 if cuda else None,
                         kv_cache_dtype=kv_cache_dtype,
                         pdl=False)     # with PDL a kernel's span holds its wait on the one before (engine/pdl.py)
    engine = built.engine
    try:
        prompts, _ = fixed_workload(spec.batch, spec.context, decode)
        params = SamplingParams(temperature=spec.temperature, ignore_eos=True, max_tokens=decode)
        for p in prompts:
            engine.add_request(p, params)
        prefill_steps = 0
        t0 = time.perf_counter()
        while True:                      # prefill every prompt; stop after the first decode step
            last = engine.step()
            prefill_steps += last.is_prefill
            if not last.is_prefill and not engine.stats().waiting:
                break
        _sync(device)
        prefill_s = time.perf_counter() - t0
        drive = _Driver(engine, spec.batch)
        out_dir.mkdir(parents=True, exist_ok=True)
        passes: dict[str, dict] = {}
        steps_of: dict[str, list[dict]] = {}
        modes = ("graph", "eager") if engine.describe()["graph"]["enabled"] else ("eager",)
        for mode in modes:
            with engine.eager_decode() if mode == "eager" else contextlib.nullcontext():
                for _ in range(spec.warm):
                    drive.step()
                timed = drive.timed(spec.steps, device)
                prof, steps = drive.profiled(spec.steps, device, out_dir / f"trace-{mode}.json.gz",
                                             modules=mode == "eager")
            passes[mode] = {"timed": timed, "profiled": prof}
            steps_of[mode] = steps
        attribution = attribute_steps(passes, steps_of)
        for mode, steps in steps_of.items():
            passes[mode]["profiled"] |= mean_steps(steps)
            passes[mode]["profiled"]["top_items"] = top_kernels(steps)
        facts = {"workload": {"name": "step-budget", "batch": spec.batch, "prompt_tokens": spec.context,
                              "warm_steps": spec.warm, "profiled_steps": spec.steps, "temperature": spec.temperature,
                              "ignore_eos": True, "step_path": "synchronous (engine overlap off): each step reads its tokens back",
                              "pdl": "off: a kernel launched with PDL starts before the one ahead of it ends, so its "
                                     "profiled span would hold that wait; the latency workload times the default",
                              "max_model_len": max_len},
                 "engine": engine_facts(engine), "prefill": {"steps": prefill_steps, "seconds": round(prefill_s, 3)},
                 "passes": passes, "attribution": attribution, "categories": list(CATEGORIES),
                 "torch": _torch_version(), "device": device}
        primary = "graph" if "graph" in passes else "eager"
        split_from = attribution["split_from"]
        facts["budget"] = budget_table(passes, primary, split_from, engine, device)
        return facts, built
    except BaseException:
        engine.close()
        raise


def _torch_version() -> str:
    import torch
    return torch.__version__


def budget_table(passes: dict, primary: str, split_from: str, engine, device: str) -> dict:
    """Rows category | ms/step | share of step | bound ms | bound/ms, plus host rows and totals."""
    from labkit.bench.bound import category_bounds

    prof = passes[split_from]["profiled"]
    wall = prof["wall_ms"]
    bounds = None
    roofs: dict = {"why": "bounds need a device copy roof and matmul peak (CUDA)"}
    if device.startswith("cuda"):
        import torch

        from labkit.bench.timing import copy_roof_gbs, matmul_peak_tflops

        roofs = {"copy_roof_gb_s": round(copy_roof_gbs(), 3),
                 "matmul_peak_tflops": round(matmul_peak_tflops(dtype=engine.describe()["dtype"]), 3)}
        weight_element = torch.empty(0, dtype=getattr(torch, engine.describe()["dtype"])).element_size()
        batch = engine.config.max_num_seqs
        model = engine.describe().get("model") or {}
        route = str(model.get("qk_norm_rope_kv") or "")
        bounds = category_bounds(engine.config.shape, weight_element, engine.probe.kv_cache().element_size(), batch,
                                 prof["mean_context"], bool(engine.describe()["fused_ops"]), roofs["copy_roof_gb_s"],
                                 roofs["matmul_peak_tflops"], decode_prologue=route.startswith("decode-prologue"),
                                 decode_layer=bool(model.get("decode_layer")) and batch == 1)
    rows = []
    for c in CATEGORIES:
        ms = prof["by_category_ms"][c]
        b = (bounds or {}).get(c)
        if ms == 0 and not b:
            continue
        row = {"category": c, "ms_per_step": ms, "share_of_step": round(ms / wall, 4) if wall else None}
        if "eager" in passes and split_from != "eager":
            row["eager_ms_per_step"] = passes["eager"]["profiled"]["by_category_ms"][c]
        if b:
            row["bound_ms"] = b["bound_ms"]
            row["bound_by"] = b["bound_by"]
            row["achieved_share_of_bound"] = round(b["bound_ms"] / ms, 4) if ms > 0 else None
        rows.append(row)
    host = [{"part": p, "ms_per_step": prof["host_outside_ms"][p],
             "share_of_step": round(prof["host_outside_ms"][p] / wall, 4) if wall else None} for p in HOST_PARTS]
    device_sum = round(sum(prof["by_category_ms"].values()), 4)
    return {"pass": split_from, "primary_route": primary,
            "step_ms_timed": passes[primary]["timed"]["wall_ms_mean"],
            "step_ms_profiled": wall, "device_ms": prof["device_ms"], "device_busy_ms": prof["device_busy_ms"],
            "categories_sum_ms": device_sum,
            "categories_sum_over_device": round(device_sum / prof["device_ms"], 6) if prof["device_ms"] else None,
            "host_outside_ms": prof["host_outside_total_ms"],
            "busy_plus_host_over_wall": round((prof["device_busy_ms"] + prof["host_outside_total_ms"]) / wall, 6) if wall else None,
            "gemm_roles_ms": {r: prof["by_category_ms"][f"gemm.{r}"] for r in GEMM_ROLES},
            "layer_ms": prof["by_category_ms"]["layer"],
            "rows": rows, "host_rows": host, "roofs": roofs,
            "note": (f"ms/step and shares are the {split_from} pass's profiled steps; the step's true time is "
                     f"step_ms_timed ({primary} route, no profiler)")}


# -- evidence and table ----------------------------------------------------------------------------
#: the projections the persistent decode layer (LAB_DECODE_LAYER=1) runs inside its one kernel: no GEMM of their own
LAYER_ROLES = ("qkv", "o", "gate_up", "down")


def budget_assertions(graph: bool, layer_kernel: bool) -> list[dict]:
    """The step budget's own assertions over its facts: the categories cover the device time once, each GEMM role
    was attributed (with the layer kernel on, the four inside it are its category instead), each pass took its
    route."""
    from labkit.checks import run_assertion

    assertions = [
        run_assertion("facts.budget.categories_sum_over_device", "abs_le", [1.0, 0.001],
                      name="categories sum to the device time",
                      why="every profiled device item of the steps is in exactly one category"),
        run_assertion("facts.budget.busy_plus_host_over_wall", "abs_le", [1.0, 0.001], name="busy + host outside = step wall",
                      why="the device-busy time and the host time outside it add up to the profiled step"),
        *[run_assertion(f"facts.budget.gemm_roles_ms.{r}", "gt", 0, name=f"GEMM role {r} attributed",
                        why="its module's range saw its kernels") for r in GEMM_ROLES
          if not (layer_kernel and r in LAYER_ROLES)],
        *([run_assertion("facts.budget.layer_ms", "gt", 0, name="layer kernel attributed",
                         why="LAB_DECODE_LAYER=1: the layer kernel holds qkv, o, gate_up and down, and ran")]
          if layer_kernel else []),
        run_assertion("facts.passes.eager.timed.route_kinds", "all_eq", "eager", name="eager pass ran eagerly",
                      why="every step of the eager pass took the eager route"),
    ]
    if graph:
        assertions.append(run_assertion("facts.passes.graph.timed.route_kinds", "all_eq", "graph",
                                        name="graph pass replayed graphs",
                                        why="every step of the graph pass replayed a captured decode graph"))
    return assertions


def run_step_budget(out: Path, spec: BudgetSpec, model: str | None = None, device: str = "auto",
                    attention: str = "auto", kv_cache_dtype: str = "auto") -> dict:
    """The step budget as evidence at `out`, its Chrome traces next to it (<stem>.trace-<pass>.json.gz)."""
    from labkit.evidence import write_evidence

    out = Path(out)
    facts, built = step_budget(spec, out.parent / f"{out.stem}.traces", model, device, attention, kv_cache_dtype)
    try:
        describe = built.describe()
    finally:
        built.engine.close()
    assertions = budget_assertions(graph="graph" in facts["passes"],
                                   layer_kernel=bool(describe.get("model", {}).get("decode_layer")))
    return write_evidence(out, checkpoint=None, kind=built.kind, facts=facts, device=built.device,
                          model=built.model, seed=built.engine.config.seed, engine=describe,
                          run_assertions=assertions)


def render_budget(record: dict) -> None:
    from rich.table import Table

    from labkit.console import console

    f = record["facts"]
    b = f["budget"]
    w = f["workload"]
    eager_col = any("eager_ms_per_step" in r for r in b["rows"])
    eng = f.get("engine") or {}
    attention = eng.get("attention_backend", "?") + (f", q/k norm + RoPE + KV store {eng['qk_norm_rope_kv']}"
                                                     if eng.get("qk_norm_rope_kv") else "")
    t = Table(title=f"decode step budget: batch {w['batch']} x {w['prompt_tokens']} prompt tokens, attention "
                    f"{attention} ({b['pass']} pass profiled; {b['primary_route']} step {b['step_ms_timed']:.3f} ms "
                    f"timed)")
    t.add_column("category")
    t.add_column("ms/step", justify="right")
    if eager_col:
        t.add_column("eager ms/step", justify="right")
    t.add_column("share of step", justify="right")
    t.add_column("bound ms", justify="right")
    t.add_column("share of bound", justify="right")

    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    for r in b["rows"]:
        cells = [r["category"], f"{r['ms_per_step']:.4f}"]
        if eager_col:
            cells.append(f"{r.get('eager_ms_per_step', 0.0):.4f}")
        bound = f"{r['bound_ms']:.4f} ({r['bound_by'][0]})" if "bound_ms" in r else "-"
        cells += [pct(r["share_of_step"]), bound, pct(r.get("achieved_share_of_bound"))]
        t.add_row(*cells)
    blank = [""] * (1 if eager_col else 0)
    t.add_row("device busy", f"{b['device_busy_ms']:.4f}", *blank, pct(b["device_busy_ms"] / b["step_ms_profiled"]), "", "",
              end_section=True)
    for r in b["host_rows"]:
        t.add_row(f"host: {r['part']}", f"{r['ms_per_step']:.4f}", *blank, pct(r["share_of_step"]), "", "")
    t.add_row("step (profiled)", f"{b['step_ms_profiled']:.4f}", *blank, "100.0%", "", "", end_section=True)
    console.print(t)
    console.print(f"roofs: {b['roofs']}; attribution: {f['attribution'].get('graph') or f['attribution']['eager']}",
                  markup=False, highlight=False)
    console.print(b["note"], markup=False, highlight=False)


def step_budget_command(out: Path | None, model: str | None, device: str, attention: str, sizes: dict,
                        others: dict, show: bool = True, kv_cache_dtype: str = "auto") -> dict:
    """`labkit bench --workload step-budget`: the options checked, the evidence written, the table shown.
    The record's ``_paths`` lists the evidence file, then the traces."""
    from labkit.errors import UserError
    from labkit.paths import default_out

    given = [name for name, v in others.items() if v not in (None, False)]
    if given:
        raise UserError(f"--workload step-budget takes --batch, --context, --steps, --warm-steps, --model, --device, "
                        f"--attention and --out only (not {', '.join(given)})")
    spec = BudgetSpec(**{k: v for k, v in sizes.items() if v is not None})
    path = Path(out) if out is not None else default_out("bench-step-budget.json")
    record = run_step_budget(path, spec, model=model, device=device, attention=attention, kv_cache_dtype=kv_cache_dtype)
    if show:
        render_budget(record)
    record["_paths"] = [path, *(p["profiled"]["trace"] for p in record["facts"]["passes"].values())]
    return record
