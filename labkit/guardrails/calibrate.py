"""The guardrail checkpoints' one command (:func:`guard`) and the threshold calibration (:func:`calibrate`)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

from labkit.errors import UserError
from labkit.guardrails.collect import collect_hf, collect_nano
from labkit.guardrails.compare import compare
from labkit.guardrails.suites import (
    CHECKPOINT_BASELINE,
    CHECKPOINT_BF16_GPU,
    CHECKPOINT_GRAPH,
    CHECKPOINT_KV_FP8,
    CHECKPOINT_ROPE,
    CHECKPOINT_TP_CPU,
    CHECKPOINT_TP_GPU,
    DEFAULT_KV_MAX_ABS,
    DEFAULT_SEED,
    validate_choices,
    build_suite,
    prefix_of,
)


def _guard_checkpoint(suite: str, device: str, dtype: str, tp: int, rope_scaling: str | None,
                      model: str | None) -> tuple[str | None, str | None, bool]:
    """(checkpoint id or None, the model both sides run, whether this is the BF16 guard)."""
    if suite == "graph" and not device.startswith("cuda"):
        raise UserError("graph execution needs CUDA")
    if tp > 1 and suite != "baseline":
        raise UserError("--tp applies to the baseline suite")
    cp = CHECKPOINT_BASELINE if suite == "baseline" else CHECKPOINT_GRAPH
    bf16 = suite == "baseline" and dtype == "bfloat16" and tp == 1
    if bf16 and device.startswith("cuda"):      # the BF16 guard: its own checkpoint (thresholds cuda/bfloat16)
        cp = CHECKPOINT_BF16_GPU
    if tp > 1:
        cp = CHECKPOINT_TP_GPU if device.startswith("cuda") else CHECKPOINT_TP_CPU
    if rope_scaling is not None:
        from labkit.assets.resolve import resolve_model
        from labkit.assets.rope import parse_rope_spec, with_rope_scaling

        if suite != "baseline":
            raise UserError("--rope-scaling applies to the baseline suite")
        kind, _ = parse_rope_spec(rope_scaling)
        model = str(with_rope_scaling(resolve_model(model, device).path, rope_scaling))
        cp = CHECKPOINT_ROPE.get(kind) if tp == 1 else None
    return cp, model, bf16


def _kv_fp8_checkpoint(suite: str, device: str, dtype: str, tp: int, rope_scaling: str | None) -> str | None:
    """The FP8 KV cache guard's checkpoint (the baseline suite in bfloat16 on CUDA, one rank), or None (its
    evidence then claims none); refuses the combinations it does not compare."""
    if suite != "baseline":
        raise UserError("--kv-cache-dtype fp8 applies to the baseline suite (engine fp8 cache vs its own cache)")
    if tp > 1 or rope_scaling is not None:
        raise UserError("--kv-cache-dtype fp8 takes no --tp or --rope-scaling")
    return CHECKPOINT_KV_FP8 if device.startswith("cuda") and dtype == "bfloat16" else None


def _guard_paths(suite: str, out: str | Path | None, cp: str | None, tp: int, bf16: bool, rope_scaling: str | None,
                 lhs_out: str | Path | None, rhs_out: str | Path | None) -> tuple[Path, Path, Path]:
    """(the comparison's file, the lhs and rhs collection prefixes): the checkpoint's own files only for
    the checkpoint's run."""
    from labkit.checks import get_checkpoint
    from labkit.paths import default_out

    if out is not None:
        out_path = Path(out)
    elif cp is not None:
        out_path = get_checkpoint(cp).evidence_path()
    else:                       # not the checkpoint's run: its own file, never the checkpoint's
        from labkit.assets.rope import spec_name

        rope_tag = f"-{spec_name(rope_scaling)}" if rope_scaling is not None else ""
        out_path = default_out(f"logits-guard-{suite}" + (f"-tp{tp}" if tp > 1 else "") + rope_tag + ".json")
    names = ("engine-nano", "engine-hf") if suite == "baseline" else ("graph-patched", "graph-eager")
    if bf16:                    # its own collections: the float32 checkpoint's stay as they are
        names = (f"{names[0]}-bf16", f"{names[1]}-bf16")
    if tp > 1:
        names = (f"engine-nano-tp{tp}", "engine-hf")
    if cp is None or rope_scaling is not None:              # nor the checkpoint's collections
        names = (f"{out_path.stem}-{names[0]}", f"{out_path.stem}-{names[1]}")
    lhs_p = prefix_of(lhs_out) if lhs_out else out_path.parent / names[0]
    rhs_p = prefix_of(rhs_out) if rhs_out else out_path.parent / names[1]
    return out_path, lhs_p, rhs_p


def guard(suite: str, out: str | Path | None = None, *, model: str | None = None, device: str = "auto",
          attention: str = "auto", graph_buckets: tuple[int, ...] | None = None, seed: int = DEFAULT_SEED,
          dtype: str = "auto", max_abs: float | None = None, rel_l2: float | None = None,
          kv_max_abs: float = DEFAULT_KV_MAX_ABS,
          lhs_out: str | Path | None = None, rhs_out: str | Path | None = None,
          progress: Callable[[str, int], Callable[[int], None]] | None = None, tp: int = 1,
          rope_scaling: str | None = None, kv_cache_dtype: str = "auto") -> dict:
    """Collect a suite's guardrail pair and compare it (the checkpoint's one command).

    baseline: nano eager (lhs, ``tp`` ranks) against hf (rhs). graph: nano graph (lhs) against nano eager (rhs).
    The logits thresholds are the table's (see :func:`compare`) unless ``max_abs``/``rel_l2`` override them.
    ``rope_scaling`` (``yarn:4``, baseline suite only): both sides run a copy of the model whose config.json
    carries that rope scaling (:func:`labkit.assets.rope.with_rope_scaling`); its own checkpoint and files.
    ``kv_cache_dtype`` fp8 (baseline suite): the engine with an FP8 KV cache (lhs) against the engine with its
    cache in the model's dtype (rhs), both eager, held to the kv-fp8 threshold table (checkpoints/guardrails.json).
    """
    from labkit.evidence import claim
    from labkit.lab_engine import detect_device

    validate_choices(suite, "nano", "eager", attention, dtype)
    device = detect_device(device)
    if kv_cache_dtype == "fp8":
        return _kv_fp8_guard(out, model=model, device=device, attention=attention, seed=seed, dtype=dtype,
                             max_abs=max_abs, rel_l2=rel_l2, kv_max_abs=kv_max_abs,
                             cp=_kv_fp8_checkpoint(suite, device, dtype, tp, rope_scaling),
                             lhs_out=lhs_out, rhs_out=rhs_out, progress=progress)
    if kv_cache_dtype != "auto":
        raise UserError(f"--kv-cache-dtype must be auto or fp8, got {kv_cache_dtype!r}")
    cp, model, bf16 = _guard_checkpoint(suite, device, dtype, tp, rope_scaling, model)
    overrides = [n for n, v in (("--max-abs", max_abs), ("--rel-l2", rel_l2)) if v is not None]
    cp, unclaimed = claim(cp, also=f"{' and '.join(overrides)} given (a checkpoint is held to the logits threshold "
                                   "table)" if overrides else "")
    out_path, lhs_p, rhs_p = _guard_paths(suite, out, cp, tp, bf16, rope_scaling, lhs_out, rhs_out)
    rows = build_suite(suite, seed).expected_rows

    def tick(label: str) -> Callable[[int], None] | None:
        return progress(label, rows) if progress is not None else None

    if suite == "baseline":
        collect_nano(suite, lhs_p, model=model, device=device, attention=attention, execution="eager", seed=seed,
                     dtype=dtype, progress=tick("nano eager"), tp=tp)
        collect_hf(suite, rhs_p, model=model, device=device, dtype=dtype, seed=seed, progress=tick("hf"))
    else:
        collect_nano(suite, lhs_p, model=model, device=device, attention=attention, execution="graph",
                     graph_buckets=graph_buckets, seed=seed, dtype=dtype, progress=tick("nano graph"))
        collect_nano(suite, rhs_p, model=model, device=device, attention=attention, execution="eager", seed=seed,
                     dtype=dtype, progress=tick("nano eager"))
    return compare(lhs_p, rhs_p, out_path, max_abs=max_abs, rel_l2=rel_l2, kv_max_abs=kv_max_abs, checkpoint=cp,
                   unclaimed=unclaimed)


def _kv_fp8_guard(out, *, model, device, attention, seed, dtype, max_abs, rel_l2, kv_max_abs, cp, lhs_out, rhs_out,
                  progress) -> dict:
    """The baseline suite twice, eager, on one engine configuration but the KV cache: e4m3 (lhs) and the
    model's dtype (rhs); compared row by row (teacher-forced logits and each row's top-1, the greedy token)."""
    from labkit.checks import get_checkpoint
    from labkit.evidence import claim
    from labkit.paths import default_out

    overrides = [n for n, v in (("--max-abs", max_abs), ("--rel-l2", rel_l2)) if v is not None]
    cp, unclaimed = claim(cp, also=f"{' and '.join(overrides)} given (a checkpoint is held to the kv-fp8 threshold "
                                   "table)" if overrides else "")
    out_path = Path(out) if out is not None else (get_checkpoint(cp).evidence_path() if cp is not None
                                                  else default_out(f"logits-guard-kv-fp8-{dtype}.json"))
    lhs_p = prefix_of(lhs_out) if lhs_out else out_path.parent / f"{out_path.stem}-engine-nano-fp8"
    rhs_p = prefix_of(rhs_out) if rhs_out else out_path.parent / f"{out_path.stem}-engine-nano"
    rows = build_suite("baseline", seed).expected_rows

    def tick(label: str) -> Callable[[int], None] | None:
        return progress(label, rows) if progress is not None else None

    for prefix, kv, label in ((lhs_p, "fp8", "nano eager, fp8 KV"), (rhs_p, "auto", "nano eager")):
        collect_nano("baseline", prefix, model=model, device=device, attention=attention, execution="eager", seed=seed,
                     dtype=dtype, progress=tick(label), kv_cache_dtype=kv)
    return compare(lhs_p, rhs_p, out_path, max_abs=max_abs, rel_l2=rel_l2, kv_max_abs=kv_max_abs, checkpoint=cp,
                   unclaimed=unclaimed)


def _calibrate_backend(suite: str, execution: str, dtype: str, backend: str, ref: Path, work: Path, repeats: int,
                       model: str | None, device: str, seed: int) -> dict:
    """``repeats`` engine collections of one suite, dtype and backend, each compared with the reference
    ``ref``: their error summaries and the distribution over the repeats."""
    import statistics

    runs = []
    for r in range(repeats):
        lhs = work / f"nano-{suite}-{dtype}-{backend}-{r}"
        collect_nano(suite, lhs, model=model, device=device, attention=backend, execution=execution,
                     seed=seed, dtype=dtype)
        f = compare(lhs, ref, work / f"cmp-{suite}-{dtype}-{backend}-{r}.json", checkpoint=None)["facts"]
        runs.append({k: f[k] for k in ("worst_max_abs", "median_max_abs", "worst_rel_l2",
                                        "median_rel_l2", "top1_agree", "num_rows")}
                    | {"verdict": f["comparison_verdict"]})
        lhs.with_suffix(".npz").unlink(missing_ok=True)
    return {
        "suite": suite, "execution": execution, "dtype": dtype, "backend": backend, "repeats": runs,
        "worst_max_abs": max(x["worst_max_abs"] for x in runs),
        "median_max_abs": statistics.median(x["median_max_abs"] for x in runs),
        "worst_rel_l2": max(x["worst_rel_l2"] for x in runs),
        "median_rel_l2": statistics.median(x["median_rel_l2"] for x in runs),
        "min_top1_agree": min(x["top1_agree"] for x in runs),
        "num_rows": runs[0]["num_rows"],
        "repeat_spread_max_abs": max(x["worst_max_abs"] for x in runs) - min(x["worst_max_abs"] for x in runs),
    }


def calibrate(suites: tuple[str, ...] = ("baseline", "graph"), backends: tuple[str, ...] | None = None,
              dtypes: tuple[str, ...] = ("auto",), repeats: int = 3, out: str | Path | None = None, *,
              model: str | None = None, device: str = "auto", seed: int = DEFAULT_SEED,
              work_dir: str | Path | None = None) -> dict:
    """Error distributions of the engine against transformers (issue: calibrate the thresholds).

    For every suite, dtype and attention backend available here, ``repeats`` engine collections are each
    compared with one transformers collection of the same suite and dtype. On CUDA the graph suite runs
    with graph execution. Only the per-comparison summaries are kept (the NPZ arrays are deleted).
    """
    import shutil

    from engine.attention import available_backends
    from labkit.evidence import write_evidence
    from labkit.paths import default_out
    from labkit.lab_engine import detect_device
    from labkit.assets.identity import model_identity
    from labkit.assets.resolve import resolve_model

    if repeats < 1:
        raise UserError(f"--repeats must be >= 1, got {repeats}")
    device = detect_device(device)
    backends = tuple(backends or available_backends(device))
    for suite in suites:
        for backend in backends:
            for dtype in dtypes:
                validate_choices(suite, "nano", "eager", backend, dtype)
    work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="labkit-calibrate-"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        for suite in suites:
            execution = "graph" if suite == "graph" and device.startswith("cuda") else "eager"
            for dtype in dtypes:
                ref = work / f"hf-{suite}-{dtype}"
                collect_hf(suite, ref, model=model, device=device, dtype=dtype, seed=seed)
                results += [_calibrate_backend(suite, execution, dtype, backend, ref, work, repeats, model, device, seed)
                            for backend in backends]
    finally:
        if work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    ref_model = resolve_model(model, device)
    facts = {"device": device, "suites": list(suites), "dtypes": list(dtypes), "backends": list(backends),
             "repeats": repeats, "seed": seed, "results": results}
    return write_evidence(out or default_out("logits-calibration.json"), checkpoint=None,
                          kind="gpu-measured" if device.startswith("cuda") else "cpu-real-engine", facts=facts,
                          device=device, model=dict(model_identity(ref_model.path)), seed=seed)
