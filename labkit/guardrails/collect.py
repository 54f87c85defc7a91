"""Collect teacher-forced logits along a suite: the embedded engine (nano) or transformers (hf).

Both implementations walk the same fixed token trajectory. Each *row* is the full logits vector of the
last position of one request at one step: the step where its prefill completes (step 0) and every
decode step after it. The next input id is preset (seeded), never sampled, so two implementations see
identical inputs at every row no matter how close their top-2 scores are.

- nano: the real Scheduler, BlockManager, ModelRunner and paged KV cache (see :mod:`.forcing`).
- hf: transformers' Qwen3ForCausalLM on the same directory, eager attention, ``use_cache=False``: every
  row recomputes its whole prefix with position ids 0..n-1. BF16 on CUDA, float32 on CPU.

PREFIX.npz holds ``logits`` [rows, vocab] float32; for the nano graph suite also ``kv_new``
[decode rows, 2, layers, kv heads, head dim] and ``kv_rows``, the row index of each of them.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from labkit.checks import run_assertion
from labkit.errors import UserError
from labkit.evidence import claim, write_evidence
from labkit.guardrails.forcing import ForcedRecord, KVProbe, drive_teacher_forced
from labkit.guardrails.suites import (
    DEFAULT_SEED,
    DTYPE_CHOICES,
    GRAPH_MAX_NUM_SEQS,
    UNCOVERED_BATCH,
    UNCOVERED_BUCKETS,
    CHECKPOINT_UNCOVERED,
    json_of,
    npz_of,
    validate_choices,
    build_suite,
    default_collect_prefix,
    prefix_of,
    save_npz,
    suite_requests,
    tokens_sha256,
    trajectory,
    trajectory_sha256,
)


def _free_torch(device: str) -> None:
    gc.collect()
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.empty_cache()



def _finite(rows: np.ndarray) -> bool:
    """Every collected logit is finite (measured over the rows actually collected)."""
    import torch

    return bool(torch.isfinite(torch.from_numpy(np.ascontiguousarray(rows))).all())


def _row_assertions(expected_rows: int) -> list[dict]:
    """What every collection asserts over what it measured: the row count, the inputs, finite logits."""
    return [
        run_assertion("facts.num_rows", "eq", expected_rows, name="rows collected",
                      why="one row per accepted output of the suite; intermediate chunk candidates are not rows"),
        run_assertion("facts.rows_follow_trajectory", "is_true", name="rows follow the preset trajectory",
                      why="each row's input, as the model received it, is the prompt plus the preset ids before it"),
        run_assertion("facts.logits_finite", "is_true", name="logits finite",
                      why="torch.isfinite over every collected row"),
    ]


def expected_route(execution: str, phase: str, batch: int, buckets: list[int] | None, tokens: int = 0,
                   fresh: bool = False, prefill_buckets: list[int] | None = None,
                   prefill_seqs: int = 0, piecewise_buckets: list[int] | None = None,
                   piecewise_seqs: int = 0, paged_prefill: bool = False, decodes: int = 0) -> tuple[str, int | None]:
    """Eager execution runs eagerly. Under graph execution a decode replays the smallest covering batch
    bucket, a fresh prefill (nothing cached) of at most ``prefill_seqs`` sequences the smallest covering
    token bucket, and so does a prefill that reads a cached prefix where paged prefill graphs were captured
    (``paged_prefill``) and it has no decode rows; any other prefill (a mixed step, more sequences or tokens)
    the smallest piecewise token bucket whose rows (the bucket, at most ``piecewise_seqs``) hold its
    sequences; anything uncovered runs eagerly."""
    if execution != "graph":
        return "eager", None
    if phase == "prefill":
        graphed = fresh or (paged_prefill and not decodes)
        covering = [t for t in (prefill_buckets or []) if t >= tokens] if graphed and batch <= prefill_seqs else []
        if covering:
            return ("prefill-graph" if fresh else "paged-prefill-graph"), min(covering)
        pieces = [t for t in (piecewise_buckets or []) if t >= tokens and min(t, piecewise_seqs) >= batch]
        return ("piecewise", min(pieces)) if pieces else ("eager", None)
    covering = [b for b in (buckets or []) if b >= batch]
    return ("graph", min(covering)) if covering else ("eager", None)


def _check_nano_options(suite_name: str, device: str, execution: str, graph_buckets: tuple[int, ...] | None,
                        expect_uncovered: bool, tp: int) -> tuple[int, ...] | None:
    """UserError for options that do not go together; the graph buckets to use (``--expect-uncovered``'s
    default when it gives none)."""
    if execution == "graph" and not device.startswith("cuda"):
        raise UserError("graph execution needs CUDA")
    if graph_buckets and execution != "graph":
        raise UserError("--graph-buckets only applies to --execution graph")
    if expect_uncovered:
        if suite_name != "graph" or execution != "graph":
            raise UserError("--expect-uncovered needs --suite graph --execution graph")
        graph_buckets = graph_buckets or UNCOVERED_BUCKETS
        if any(UNCOVERED_BATCH <= b <= GRAPH_MAX_NUM_SEQS for b in graph_buckets):
            raise UserError(f"--expect-uncovered needs --graph-buckets that leave batch {UNCOVERED_BATCH} uncovered "
                            f"(max_num_seqs {GRAPH_MAX_NUM_SEQS}), got {','.join(map(str, graph_buckets))}")
    if tp < 1:
        raise UserError(f"--tp must be >= 1, got {tp}")
    if tp > 1 and suite_name != "baseline":
        raise UserError("--tp applies to the baseline suite (the graph suite's KV probe reads one rank's cache)")
    return graph_buckets


@dataclass
class _NanoRun:
    """What driving a suite through the engine gathered: the rows, whether they followed the trajectory,
    each engine step with its route, and the fault that stopped it (only when one was expected)."""
    suite: Any
    rows: list
    logits: np.ndarray
    got: np.ndarray
    follows: bool = True
    steps: list[dict] = field(default_factory=list)
    error: str | None = None
    failed_group: str | None = None

    def row_at(self) -> dict:
        return {(r.group, r.request_index, r.step): r for r in self.rows}


def _step_entry(group, st, execution: str, buckets: list[int] | None, prefill_graphs: dict) -> dict:
    """One engine step of a group: its batch and route, against the route the graph buckets predict."""
    batch = len(st.requests)
    exp_route, exp_bucket = expected_route(execution, st.phase, batch, buckets, st.route["tokens"],
                                           st.route["fresh"], decodes=st.route.get("decodes", 0), **prefill_graphs)
    return {"group": group.name, "engine_step": st.engine_step, "phase": st.phase,
            "batch": batch, "requests": [group.requests[i].label for i in st.requests],
            "discarded": [group.requests[i].label for i, c in zip(st.requests, st.completing) if not c],
            **st.route, "expected_route": exp_route, "expected_bucket": exp_bucket,
            "route_as_expected": st.route["route"] == exp_route and st.route["bucket"] == exp_bucket}


def _drive_suite(engine, run: _NanoRun, probe: KVProbe | None, execution: str, buckets: list[int] | None,
                 prefill_graphs: dict, expect_uncovered: bool, progress: Callable[[int], None] | None) -> None:
    """Every group of the suite through the engine, teacher-forced; fills ``run``."""
    row_at = run.row_at()
    for group in run.suite.groups:
        engine.reset_scheduling()
        if probe is not None:
            probe.group = group.name

        def on_row(rec: ForcedRecord, group=group) -> None:
            spec = row_at[(group.name, rec.request, rec.output_index)]
            run.logits[spec.index] = rec.logits.numpy()
            run.got[spec.index] = True
            run.follows = run.follows and tuple(rec.tokens) == spec.tokens
            if progress is not None:
                progress(1)

        try:
            _, steps = drive_teacher_forced(engine, [r.prompt for r in group.requests],
                                            [r.continuation for r in group.requests], probe=probe, on_row=on_row)
        except Exception as exc:  # noqa: BLE001 - recorded as the finding when a fault is expected
            if not expect_uncovered:
                raise
            run.error, run.failed_group = f"{type(exc).__name__}: {exc}".strip(), group.name
            break
        run.steps += [_step_entry(group, st, execution, buckets, prefill_graphs) for st in steps]


def _nano_facts(run: _NanoRun, suite_name: str, seed: int, execution: str, engine, described: dict,
                buckets: list[int] | None, prefix: Path, note: str) -> dict[str, Any]:
    step_log = run.steps
    return {
        "status": "COLLECTED" if run.error is None else "INCOMPLETE",
        "suite": suite_name, "seed": seed, "backend": "nano", "execution": execution,
        "tensor_parallel_size": engine.config.tensor_parallel_size,
        "attention": described["attention_backend"], "dtype": described["dtype"],
        "kv_cache_dtype": described["kv_cache"]["kv_cache_dtype"], "kv_cache": described["kv_cache"],
        "rope": described["config"].get("rope"),
        "logits_dtype": "float32", "vocab_size": engine.config.vocab_size,
        "num_rows": int(run.got.sum()), "expected_rows": run.suite.expected_rows,
        "trajectory_sha256": trajectory_sha256(run.rows), "rows": trajectory(run.rows),
        "rows_follow_trajectory": run.follows,
        "requests": suite_requests(run.suite),
        "groups": [{"name": g.name, "title": g.title, "requests": len(g.requests)} for g in run.suite.groups],
        "graph_buckets": buckets, "steps": step_log,
        "routes_as_expected": bool(step_log) and all(s["route_as_expected"] for s in step_log),
        "decode_routes": {str(s["batch"]): {k: s[k] for k in ("route", "bucket", "expected_route", "expected_bucket")}
                          for s in step_log if s["phase"] == "decode"},
        "npz": str(npz_of(prefix)),
        "note": note,
        "logits_finite": _finite(run.logits[run.got]),
    }


def _kv_amax(engine) -> dict[str, float]:
    """The largest |K| and |V| in the pool after the suite, as attention reads them (an FP8 pool's values times
    its scale): what an FP8 cache's fixed scale of 1.0 must hold (e4m3 saturates at 448, and keeps 3 mantissa
    bits down to 2^-6; engine/attention/kv_quant.py)."""
    pool = engine.probe.kv_cache()                     # [2, layers, blocks, block size, kv heads, head dim]
    scales = engine.describe()["kv_cache"]["scales"] or {"k": 1.0, "v": 1.0}
    if not pool.numel():
        return {"k": 0.0, "v": 0.0}
    return {name: float(pool[i].float().abs().max()) * scales[name] for i, name in enumerate(("k", "v"))}


def _kv_facts(run: _NanoRun, probe: KVProbe, arrays: dict[str, np.ndarray]) -> tuple[dict, list[dict]]:
    """The KV probe's findings (its arrays go into ``arrays``) and what the collection asserts over them."""
    row_at = run.row_at()
    order = {row_at[key].index: key for key in probe.new_kv}
    kv_rows = sorted(order)
    if kv_rows:
        arrays["kv_new"] = np.stack([probe.new_kv[order[r]] for r in kv_rows])
    arrays["kv_rows"] = np.asarray(kv_rows, dtype=np.int64)
    hist = all(s["history_unchanged"] for s in probe.steps)
    free = all(s["free_blocks_unchanged"] for s in probe.steps)
    facts = {"decode_steps": probe.steps, "decode_steps_probed": len(probe.steps),
             "history_unchanged": hist, "padding_wrote_nothing": free,
             "new_kv_rows": len(kv_rows),
             "new_kv_shape": list(arrays["kv_new"].shape) if kv_rows else None}
    assertions = []
    decode_rows = sum(1 for r in run.rows if r.phase == "decode")
    if decode_rows:
        assertions += [
            run_assertion("facts.kv.decode_steps_probed", "gt", 0, name="decode steps probed",
                          why="the KV probe saw at least one decode step (else 'unchanged' says nothing)"),
            run_assertion("facts.kv.new_kv_rows", "eq", decode_rows, name="new KV of every decode row",
                          why="the probe read the new K/V of each of the suite's decode rows"),
        ]
    assertions += [
        run_assertion("facts.kv.history_unchanged", "is_true", name="history KV unchanged by decode",
                      why="every cached position of the batch reads back bit-identical after the decode step"),
        run_assertion("facts.kv.padding_wrote_nothing", "is_true", name="padding rows wrote nothing",
                      why="unreferenced blocks (incl. block 0 and the last block when free) are bit-identical"),
    ]
    return facts, assertions


def _uncovered_facts(run: _NanoRun, graph_buckets: tuple[int, ...] | None) -> dict:
    """What happened to the batch no graph bucket covers (``--expect-uncovered``)."""
    s17 = [s for s in run.steps if s["phase"] == "decode" and s["batch"] == UNCOVERED_BATCH]
    g17 = f"batch-{UNCOVERED_BATCH}"
    done17 = all(run.got[r.index] for r in run.rows if r.group == g17)
    return {
        "buckets": list(graph_buckets or ()), "batch": UNCOVERED_BATCH,
        "route": s17[0]["route"] if s17 else None, "bucket": s17[0]["bucket"] if s17 else None,
        "completed": bool(done17 and s17), "error": run.error, "failed_group": run.failed_group,
    }


def _build_nano(suite_name: str, seed: int, model: str | None, device: str, attention: str, execution: str,
                graph_buckets: tuple[int, ...] | None, dtype: str, tp: int, kv_cache_dtype: str = "auto"):
    """The engine sized for the suite (its budget, batch, block size, context and pool)."""
    from labkit.lab_engine import build_engine

    overrides: dict[str, Any] = {"tensor_parallel_size": tp, "kv_cache_dtype": kv_cache_dtype}
    if graph_buckets:
        overrides["graph_buckets"] = tuple(graph_buckets)
    probe_suite = build_suite(suite_name, seed)
    return build_engine(model, device, attention, max_num_batched_tokens=probe_suite.budget,
                        max_num_seqs=probe_suite.max_num_seqs, kvcache_block_size=probe_suite.block_size,
                        max_model_len=probe_suite.max_model_len, num_kvcache_blocks=probe_suite.num_kvcache_blocks,
                        enforce_eager=execution == "eager", dtype=dtype, **overrides)


def collect_nano(suite_name: str, out: str | Path | None = None, *, model: str | None = None, device: str = "auto",
                 attention: str = "auto", execution: str = "eager", graph_buckets: tuple[int, ...] | None = None,
                 expect_uncovered: bool = False, seed: int = DEFAULT_SEED, dtype: str = "auto",
                 progress: Callable[[int], None] | None = None, tp: int = 1, kv_cache_dtype: str = "auto") -> dict:
    """Teacher-forced logits of the embedded engine along ``suite_name``; writes PREFIX.json and PREFIX.npz.
    ``kv_cache_dtype`` fp8: the engine's KV cache in e4m3 (engine/attention/kv_quant.py)."""
    from labkit.lab_engine import detect_device, synthetic_note

    validate_choices(suite_name, "nano", execution, attention, dtype)
    device = detect_device(device)
    graph_buckets = _check_nano_options(suite_name, device, execution, graph_buckets, expect_uncovered, tp)
    prefix = prefix_of(out) if out is not None else default_collect_prefix("nano", suite_name, execution)
    built = _build_nano(suite_name, seed, model, device, attention, execution, graph_buckets, dtype, tp, kv_cache_dtype)
    engine = built.engine
    try:
        suite = build_suite(suite_name, seed, engine.config.vocab_size)
        rows = suite.rows()
        run = _NanoRun(suite, rows, np.zeros((len(rows), engine.config.vocab_size), dtype=np.float32),
                       np.zeros(len(rows), dtype=bool))
        probe = KVProbe() if suite_name == "graph" else None
        described = engine.describe()
        buckets = sorted(described["graph"]["buckets"]) if execution == "graph" else None
        prefill_graphs = dict(prefill_buckets=sorted(described["graph"].get("prefill_buckets", [])),
                              prefill_seqs=described["graph"].get("prefill_seqs", 0),
                              piecewise_buckets=sorted(described["graph"].get("piecewise_buckets", [])),
                              piecewise_seqs=described["graph"].get("piecewise_seqs", 0),
                              paged_prefill=described["graph"].get("paged_prefill", False))
        _drive_suite(engine, run, probe, execution, buckets, prefill_graphs, expect_uncovered, progress)
        arrays: dict[str, np.ndarray] = {"logits": run.logits}
        facts = _nano_facts(run, suite_name, seed, execution, engine, described, buckets, prefix,
                            synthetic_note(built.model))
        facts["kv_amax"] = _kv_amax(engine)
        assertions = _row_assertions(suite.expected_rows) + [
            run_assertion("facts.routes_as_expected", "is_true", name="routes as expected",
                          why="prefill eager; decode replays the smallest covering graph bucket, else eager"),
        ]
        if probe is not None:
            facts["kv"], kv_assertions = _kv_facts(run, probe, arrays)
            assertions += kv_assertions
        checkpoint = None
        if expect_uncovered:
            checkpoint, unclaimed = claim(CHECKPOINT_UNCOVERED)      # only with the checkpoint's command line
            if unclaimed:
                facts["checkpoint_not_claimed"] = unclaimed
            facts["expect_uncovered"] = _uncovered_facts(run, graph_buckets)
        arrays_path = save_npz(npz_of(prefix), arrays)
        facts["npz_arrays"] = {k: list(v.shape) for k, v in arrays.items()}
        engine_info = {**built.describe(), "execution": execution, "graph_buckets": buckets,
                       "capture_seconds": described["graph"]["capture_seconds"]}
        record = write_evidence(json_of(prefix), checkpoint=checkpoint, kind=built.kind, facts=facts,
                                device=built.device, model=built.model, seed=seed, engine=engine_info,
                                run_assertions=assertions)
        record["_paths"] = {"json": str(json_of(prefix)), "npz": str(arrays_path)}
        return record
    finally:
        engine.close()
        del engine, built
        _free_torch(device)


def hf_dtype(device: str, dtype: str = "auto"):
    import torch

    if dtype == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if dtype not in DTYPE_CHOICES:
        raise UserError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPE_CHOICES)}")
    return getattr(torch, dtype)


def load_reference_model(path: str | Path, device: str, dtype: str = "auto"):
    """transformers' causal LM on ``path``: eager attention, BF16 on CUDA / float32 on CPU (auto), eval mode."""
    import transformers
    from transformers import AutoModelForCausalLM

    try:
        transformers.utils.logging.disable_progress_bar()
    except AttributeError:
        pass
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager",
                                                     dtype=hf_dtype(device, dtype))
    except (OSError, ValueError) as exc:
        raise UserError(f"transformers cannot load {path}: {' '.join(str(exc).split())[:200]}") from None
    return model.to(device).eval()


def reference_last_logits(model, tokens, device: str):
    """Logits of the last position, recomputing the whole prefix (use_cache=False, positions 0..n-1)."""
    import torch

    ids = torch.tensor([list(tokens)], dtype=torch.long, device=device)
    pos = torch.arange(ids.shape[1], device=device)[None]
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=1)
    return out.logits[0, -1].float().cpu()


def _hf_rope(hf) -> dict | None:
    """What transformers built for RoPE: its type, the cos/sin scaling and the config's block."""
    rot = getattr(getattr(hf, "model", None), "rotary_emb", None)
    if rot is None:
        return None
    params = getattr(hf.config, "rope_parameters", None) or {}
    return {"rope_type": str(getattr(rot, "rope_type", "default")),
            "attention_scaling": float(getattr(rot, "attention_scaling", 1.0)),
            "parameters": {k: v for k, v in params.items() if isinstance(v, (int, float, str, bool))}}


def _hf_rows(hf, rows: list, logits: np.ndarray, device: str, progress: Callable[[int], None] | None) -> list[list[int]]:
    """Each row's last logits into ``logits``; returns the input ids transformers was called with, row by
    row (a forward pre-hook), for the check that they are the trajectory's."""
    received: list[list[int]] = []
    hook = hf.register_forward_pre_hook(
        lambda _m, _a, kw: received.append(kw["input_ids"][0].tolist()), with_kwargs=True)
    try:
        for r in rows:
            logits[r.index] = reference_last_logits(hf, r.tokens, device).numpy()
            if progress is not None:
                progress(1)
    finally:
        hook.remove()
    return received


def collect_hf(suite_name: str, out: str | Path | None = None, *, model: str | None = None, device: str = "auto",
               dtype: str = "auto", seed: int = DEFAULT_SEED, progress: Callable[[int], None] | None = None) -> dict:
    """The reference rows: transformers recomputes each row's whole prefix. Writes PREFIX.json/.npz."""
    import transformers

    from labkit.lab_engine import detect_device, synthetic_note
    from labkit.assets.identity import model_identity
    from labkit.assets.resolve import resolve_model

    validate_choices(suite_name, "hf", "eager", "auto", dtype)
    device = detect_device(device)
    prefix = prefix_of(out) if out is not None else default_collect_prefix("hf", suite_name, "eager")
    ref = resolve_model(model, device)
    identity = dict(model_identity(ref.path))
    identity["source"] = ref.source
    hf = load_reference_model(ref.path, device, dtype)
    try:
        vocab = int(hf.config.vocab_size)
        suite = build_suite(suite_name, seed, vocab)
        rows = suite.rows()
        logits = np.zeros((len(rows), vocab), dtype=np.float32)
        received = _hf_rows(hf, rows, logits, device, progress)
        traj = trajectory(rows)
        follows = len(received) == len(traj) and all(
            tokens_sha256(ids) == row["tokens_sha256"] for ids, row in zip(received, traj))
        dtype = str(hf_dtype(device, dtype)).replace("torch.", "")
        facts = {
            "status": "COLLECTED", "suite": suite_name, "seed": seed, "backend": "hf", "execution": "eager",
            "attention": "eager", "dtype": dtype, "logits_dtype": "float32", "vocab_size": vocab,
            "rope": _hf_rope(hf),
            "num_rows": len(received), "expected_rows": suite.expected_rows,
            "trajectory_sha256": trajectory_sha256(rows), "rows": traj,
            "rows_follow_trajectory": follows, "requests": suite_requests(suite),
            "groups": [{"name": g.name, "title": g.title, "requests": len(g.requests)} for g in suite.groups],
            "steps": [{"row": r.id, "phase": r.phase, "width": len(ids), "backend": "hf-eager", "route": "eager",
                       "bucket": None} for r, ids in zip(rows, received)],
            "npz": str(npz_of(prefix)), "note": synthetic_note(identity),
            "logits_finite": _finite(logits),
        }
        path = save_npz(npz_of(prefix), {"logits": logits})
        facts["npz_arrays"] = {"logits": list(logits.shape)}
        engine_info = {"implementation": "transformers", "version": transformers.__version__,
                       "class": type(hf).__name__, "attn_implementation": "eager", "use_cache": False,
                       "position_ids": "0..n-1", "dtype": dtype, "device": device}
        # transformers made these rows, not our engine: reference evidence (engine edits do not make it stale)
        record = write_evidence(json_of(prefix), checkpoint=None, kind="reference", facts=facts, device=device,
                                model=identity, seed=seed, engine=engine_info,
                                run_assertions=_row_assertions(suite.expected_rows))
        record["_paths"] = {"json": str(json_of(prefix)), "npz": str(path)}
        return record
    finally:
        del hf
        _free_torch(device)




def collect(backend: str, suite: str, out: str | Path | None = None, *, model: str | None = None,
            device: str = "auto", attention: str = "auto", execution: str = "eager",
            graph_buckets: tuple[int, ...] | None = None, expect_uncovered: bool = False, seed: int = DEFAULT_SEED,
            dtype: str = "auto", progress: Callable[[int], None] | None = None, tp: int = 1,
            kv_cache_dtype: str = "auto") -> dict:
    """``labkit logits collect``: dispatch to the nano or hf collector."""
    validate_choices(suite, backend, execution, attention, dtype)
    if backend == "hf":
        if execution != "eager" or attention != "auto" or graph_buckets or expect_uncovered or tp != 1 \
                or kv_cache_dtype != "auto":
            raise UserError("--backend hf takes no --execution/--attention/--graph-buckets/--expect-uncovered/"
                            "--kv-cache-dtype (it is transformers with eager attention)")
        return collect_hf(suite, out, model=model, device=device, dtype=dtype, seed=seed, progress=progress)
    return collect_nano(suite, out, model=model, device=device, attention=attention, execution=execution,
                        graph_buckets=graph_buckets, expect_uncovered=expect_uncovered, seed=seed, dtype=dtype, tp=tp,
                        progress=progress, kv_cache_dtype=kv_cache_dtype)
