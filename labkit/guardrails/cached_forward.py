"""Principles experiments (handbook appendix B.1): cached vs uncached forward in transformers (B.1.6).

Both paths walk the same token trajectory: a prompt of S seeded ids, then G-1 preset next ids.

- uncached: step k feeds the whole prefix again (width S+k, ``use_cache=False``): widths S..S+G-1,
  G*S + G*(G-1)/2 positions in all (540 for S=64, G=8).
- cached: step 0 feeds the prompt once (prefill, width S) and keeps the KV cache; each later step
  feeds one id with the cache: widths [S, 1, ..., 1], S + G - 1 positions (71).

Step k's last-position logits of the two paths are compared (max abs, relative L2 against the
uncached reference, same top-1). Prefill (step 0) and decode (steps 1..G-1) are timed apart; the
count ratio is about positions processed, not a speedup measurement.
"""
from __future__ import annotations

import inspect
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from labkit.checks import run_assertion
from labkit.errors import UserError
from labkit.evidence import claim, write_evidence
from labkit.paths import default_out

CHECKPOINT_CACHED_FORWARD = "guardrails.cached-forward"
DEFAULT_PROMPT_LEN = 64
DEFAULT_STEPS = 8


def expected_counts(prompt_len: int, steps: int) -> dict:
    """The input widths and position totals both paths must show for S=prompt_len, G=steps."""
    s, g = prompt_len, steps
    uncached = [s + k for k in range(g)]
    cached = [s] + [1] * (g - 1)
    return {"widths_uncached": uncached, "widths_cached": cached,
            "positions_uncached": g * s + g * (g - 1) // 2, "positions_cached": s + g - 1,
            "cache_lengths": [s + k for k in range(g)]}


def _cache_io(model) -> tuple[str, str]:
    """(forward keyword, output field) of the KV cache: ``cache`` in transformers >= 5.2x, else past_key_values."""
    params = inspect.signature(model.forward).parameters
    return ("cache", "cache") if "cache" in params else ("past_key_values", "past_key_values")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _run_paths(model, tokens: list[int], prompt_len: int, steps: int, device: str) -> dict:
    """One repeat of both paths: per-step logits and seconds, and per path what the model received (a
    forward pre-hook): the input widths, whether the ids were the trajectory's and the positions followed."""
    import torch

    kw, field = _cache_io(model)
    ids = torch.tensor([tokens], dtype=torch.long, device=device)
    out: dict[str, Any] = {"uncached": {"logits": [], "seconds": [], "returned_cache": []},
                           "cached": {"logits": [], "seconds": [], "cache_lengths": []}}
    calls: list[dict] = []

    def seen(_module, _args, kwargs):
        pos = kwargs.get("position_ids")
        calls.append({"cached": bool(kwargs.get("use_cache")), "ids": kwargs["input_ids"][0].tolist(),
                      "positions": pos[0].tolist() if pos is not None else None})

    hook = model.register_forward_pre_hook(seen, with_kwargs=True)
    try:
        with torch.no_grad():
            for k in range(steps):                          # no cache: the whole prefix every step
                n = prompt_len + k
                _sync(device)
                t0 = time.perf_counter()
                res = model(input_ids=ids[:, :n], position_ids=torch.arange(n, device=device)[None],
                            use_cache=False, logits_to_keep=1)
                _sync(device)
                out["uncached"]["seconds"].append(time.perf_counter() - t0)
                out["uncached"]["logits"].append(res.logits[0, -1].float().cpu())
                out["uncached"]["returned_cache"].append(res.get(field) is not None)
            cache = None
            for k in range(steps):                          # with cache: prompt once, then one id per step
                start, end = (0, prompt_len) if k == 0 else (prompt_len + k - 1, prompt_len + k)
                extra = {} if cache is None else {kw: cache}
                _sync(device)
                t0 = time.perf_counter()
                res = model(input_ids=ids[:, start:end], position_ids=torch.arange(start, end, device=device)[None],
                            use_cache=True, logits_to_keep=1, **extra)
                _sync(device)
                out["cached"]["seconds"].append(time.perf_counter() - t0)
                out["cached"]["logits"].append(res.logits[0, -1].float().cpu())
                cache = res.get(field)
                if cache is None:
                    raise RuntimeError(f"transformers returned no {field} with use_cache=True")
                out["cached"]["cache_lengths"].append(_cache_length(cache))
    finally:
        hook.remove()
    for path, cached in (("uncached", False), ("cached", True)):
        got = [c for c in calls if c["cached"] is cached]
        out[path]["widths"] = [len(c["ids"]) for c in got]
        done, ids_ok, pos_ok = 0, True, True
        for c in got:
            start = done if cached else 0               # a cached call continues where the last one ended
            span = list(range(start, start + len(c["ids"])))
            ids_ok = ids_ok and c["ids"] == tokens[span[0]:span[-1] + 1] if span else False
            pos_ok = pos_ok and c["positions"] == span
            done = start + len(c["ids"])
        out[path]["inputs_follow"] = bool(got) and ids_ok
        out[path]["positions_follow"] = bool(got) and pos_ok
    return out


def _cache_length(cache) -> int | None:
    """Positions the KV cache transformers returned holds (layer 0's keys), None when it cannot say."""
    if hasattr(cache, "get_seq_length"):
        return int(cache.get_seq_length())
    try:
        return int(cache[0][0].shape[-2])           # legacy tuple cache: ((k, v), ...), k [B, H, T, D]
    except (TypeError, IndexError, AttributeError):
        return None


def _timing(runs: list[dict], path: str) -> dict:
    prefill = [r[path]["seconds"][0] for r in runs]
    decode = [sum(r[path]["seconds"][1:]) for r in runs]
    return {"prefill_s": prefill, "decode_s": decode,
            "median_prefill_s": statistics.median(prefill), "median_decode_s": statistics.median(decode),
            "median_step_s": [statistics.median(r[path]["seconds"][k] for r in runs)
                              for k in range(len(runs[0][path]["seconds"]))]}


def _check_args(prompt_len: int, steps: int, repeats: int, dtype: str) -> None:
    from labkit.guardrails.suites import DTYPE_CHOICES

    for name, v in (("--prompt-len", prompt_len), ("--steps", steps), ("--repeats", repeats)):
        if not isinstance(v, int) or v < 1:
            raise UserError(f"{name} must be a positive integer, got {v!r}")
    if dtype not in DTYPE_CHOICES:
        raise UserError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPE_CHOICES)}")


def _walk_both_paths(path: Path, device: str, dtype: str, prompt_len: int, steps: int, repeats: int,
                     seed: int) -> tuple[list[int], list[dict]]:
    """(the seeded trajectory, one ``_run_paths`` result per repeat) of transformers on ``path``."""
    import torch

    from labkit.guardrails.collect import load_reference_model
    from labkit.guardrails.suites import TOKEN_HIGH

    hf = load_reference_model(path, device, dtype)
    try:
        limit = int(getattr(hf.config, "max_position_embeddings", 0) or 0)
        total = prompt_len + steps - 1
        if limit and total > limit:
            raise UserError(f"--prompt-len + --steps - 1 = {total} exceeds the model's {limit} positions")
        vocab = int(hf.config.vocab_size)
        rng = np.random.default_rng([seed, 1016])
        tokens = [int(x) for x in rng.integers(0, min(TOKEN_HIGH, vocab), size=total)]
        return tokens, [_run_paths(hf, tokens, prompt_len, steps, device) for _ in range(repeats)]
    finally:
        del hf
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def _per_step(first: dict, steps: int) -> list[dict]:
    """Step k's cached logits against the uncached reference: max abs, relative L2, top-1 of each."""
    per_step = []
    for k in range(steps):
        ref_l = first["uncached"]["logits"][k].double()
        got = first["cached"]["logits"][k].double()
        diff = got - ref_l
        norm = float(ref_l.norm())
        per_step.append({
            "step": k, "width_uncached": first["uncached"]["widths"][k], "width_cached": first["cached"]["widths"][k],
            "max_abs": float(diff.abs().max()), "rel_l2": float(diff.norm() / norm) if norm > 0 else float(diff.norm()),
            "top1_uncached": int(ref_l.argmax()), "top1_cached": int(got.argmax()),
            "same_top1": int(ref_l.argmax()) == int(got.argmax())})
    return per_step


def _cached_facts(runs: list[dict], tokens: list[int], prompt_len: int, steps: int, th: dict) -> dict[str, Any]:
    """What both paths showed (from the first repeat; every repeat for the input checks), against the
    counts S and G give."""
    from labkit.guardrails.suites import tokens_sha256

    first = runs[0]
    per_step = _per_step(first, steps)
    exp = expected_counts(prompt_len, steps)
    widths_u, widths_c = first["uncached"]["widths"], first["cached"]["widths"]
    max_abs = max(s["max_abs"] for s in per_step)
    rel = max(s["rel_l2"] for s in per_step)
    same = sum(s["same_top1"] for s in per_step)
    return {
        "trajectory_sha256": tokens_sha256(tokens), "trajectory_len": len(tokens),
        "forward_calls": len(first["uncached"]["widths"]) + len(first["cached"]["widths"]),
        "widths_uncached": widths_u, "widths_cached": widths_c,
        "positions_uncached": sum(widths_u), "positions_cached": sum(widths_c),
        # what the model kept: the cache it returned after each cached step holds S + k positions (it grew by
        # the one position each decode fed); the uncached calls returned no cache
        "cache_lengths": first["cached"]["cache_lengths"], "expected_cache_lengths": exp["cache_lengths"],
        "uncached_returned_cache": any(first["uncached"]["returned_cache"]),
        "inputs_follow_trajectory": all(r[p]["inputs_follow"] for r in runs for p in ("uncached", "cached")),
        "positions_follow": all(r[p]["positions_follow"] for r in runs for p in ("uncached", "cached")),
        "expected": exp,
        "counts_match": (widths_u == exp["widths_uncached"] and widths_c == exp["widths_cached"]
                         and sum(widths_u) == exp["positions_uncached"] and sum(widths_c) == exp["positions_cached"]),
        "position_ratio": sum(widths_u) / sum(widths_c) if sum(widths_c) else None,
        "max_abs_logit_error": max_abs, "relative_l2_logit_error": rel,
        "errors_finite": bool(np.isfinite(max_abs) and np.isfinite(rel)),
        "thresholds": th,
        "same_top1_steps": same, "top1_flips": steps - same, "per_step": per_step,
        "timing": {"uncached": _timing(runs, "uncached"), "cached": _timing(runs, "cached"),
                   "note": "prefill = step 0; decode = steps 1..G-1 summed (uncached decode recomputes the whole prefix)"},
    }


def _cached_assertions(exp: dict, th: dict) -> list[dict]:
    return [
        # the widths fed are this command's own loop (reported, not asserted); what the model kept is asserted
        run_assertion("facts.cache_lengths", "eq", exp["cache_lengths"], name="cache grows one position per step",
                      why="the KV cache the model returned after cached step k holds S + k positions"),
        run_assertion("facts.uncached_returned_cache", "is_false", name="no cache without use_cache",
                      why="the uncached calls (use_cache=False) returned no KV cache"),
        run_assertion("facts.inputs_follow_trajectory", "is_true", name="inputs follow the trajectory",
                      why="every call received the trajectory's ids for its span (every repeat)"),
        run_assertion("facts.positions_follow", "is_true", name="positions follow",
                      why="uncached calls received positions 0..n-1, cached calls continued where the last ended"),
        run_assertion("facts.errors_finite", "is_true", name="logit errors finite",
                      why="max abs and relative L2 over all steps"),
        *_threshold_assertions(th),
        run_assertion("facts.top1_flips", "eq", 0, name="same top-1 on every step",
                      why="cached and uncached pick the same next token at every step"),
    ]


def run_cached_forward(out: str | Path | None = None, *, model: str | None = None, device: str = "auto",
                       prompt_len: int = DEFAULT_PROMPT_LEN, steps: int = DEFAULT_STEPS, repeats: int = 1,
                       seed: int = 0, dtype: str = "auto") -> dict:
    """``labkit principles cached-forward``: both paths, ``repeats`` times; errors from the first repeat."""
    from labkit.lab_engine import detect_device, synthetic_note
    from labkit.guardrails.collect import hf_dtype
    from labkit.assets.identity import model_identity
    from labkit.assets.resolve import resolve_model

    _check_args(prompt_len, steps, repeats, dtype)
    device = detect_device(device)
    ref = resolve_model(model, device)
    identity = dict(model_identity(ref.path))
    identity["source"] = ref.source
    tokens, runs = _walk_both_paths(ref.path, device, dtype, prompt_len, steps, repeats, seed)
    dtype_name = str(hf_dtype(device, dtype)).replace("torch.", "")
    th = _thresholds(device, dtype_name)
    facts = {"prompt_len": prompt_len, "steps": steps, "repeats": repeats, "seed": seed,
             "device": device, "dtype": dtype_name, "attn_implementation": "eager",
             **_cached_facts(runs, tokens, prompt_len, steps, th), "note": synthetic_note(identity)}
    assertions = _cached_assertions(facts["expected"], th)
    default = prompt_len == DEFAULT_PROMPT_LEN and steps == DEFAULT_STEPS
    cp, unclaimed = claim(CHECKPOINT_CACHED_FORWARD if default else None)
    if unclaimed:
        facts["checkpoint_not_claimed"] = unclaimed
    if out is None:
        out = default_out("cached-forward.json" if cp else f"cached-forward-s{prompt_len}-g{steps}.json")
    engine_info = {"implementation": "transformers", "attn_implementation": "eager",
                   "dtype": facts["dtype"], "device": device}
    # transformers made both paths' logits, not our engine: reference evidence
    record = write_evidence(out, checkpoint=cp, kind="reference", facts=facts, device=device, model=identity, seed=seed,
                            engine=engine_info, run_assertions=assertions)
    record["_paths"] = {"json": str(out)}
    return record


def _thresholds(device: str, dtype: str) -> dict:
    """The logits table's entry for this device class and dtype (the one the judge holds the checkpoint to)."""
    from labkit.checks import threshold_entry

    key, entry = threshold_entry("logits", device, dtype)
    return {"key": key, "max_abs": (entry or {}).get("max_abs"), "rel_l2": (entry or {}).get("rel_l2"),
            "source": f"table logits {key}" if entry else f"no entry for {key} in the logits table"}


def _threshold_assertions(th: dict) -> list[dict]:
    out = []
    for metric, fact in (("max_abs", "max_abs_logit_error"), ("rel_l2", "relative_l2_logit_error")):
        if th[metric] is None:
            out.append(run_assertion(f"facts.thresholds.{metric}", "ge", 0, name=f"a logits {metric} threshold",
                                     why=f"{th['source']} (checkpoints/guardrails.json)"))
        else:
            out.append(run_assertion(f"facts.{fact}", "le", th[metric], name=f"cached vs uncached {metric}",
                                     why=f"worst step, cached against the uncached reference [{th['source']}]"))
    return out
