"""``labkit patch check NAME``: the before/after pair of one patch, as one piece of evidence.

Each side runs in its own process (``python -m labkit.experiments.patch_probes``) against a copy of ``engine/``:
the before side with the patch applied, the after side without it. The live working tree is never
touched, so the checkpoint judges the same pair whichever state the learner's tree is in; the evidence
says which state that is (``facts.live_state``) next to each side's engine source hash.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from labkit.checks import run_assertion
from labkit.errors import UserError
from labkit.evidence import write_evidence
from labkit.paths import repo_root
from labkit.patches.store import Patch, engine_copy, engine_root, find, is_applied

PROBE_TIMEOUT_S = 900
CUDA_PATCHES = {"no-graph-fallback"}


def run_on_engine_copy(patch: Patch, applied: bool, args: list[str], timeout_s: float,
                       what: str) -> tuple[dict | None, str | None]:
    """``python -m ARGS`` against a copy of engine/ with the patch applied or not (the live tree untouched).
    Returns (the JSON of its last stdout line, None), or (None, one line saying why there is none)."""
    with tempfile.TemporaryDirectory(prefix=f"labkit-{patch.name}-") as tmp:
        return run_module_in(engine_copy(Path(tmp), patch, applied), args, timeout_s, what)


def run_module_in(root: Path, args: list[str], timeout_s: float, what: str) -> tuple[dict | None, str | None]:
    """``python -m ARGS`` with ``root/engine`` as the engine it imports (``root`` first on the path). Returns
    (the JSON of its last stdout line, None), or (None, one line saying why there is none)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(repo_root()),
                                                      os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    try:
        proc = subprocess.run([sys.executable, "-m", *args], cwd=root, env=env, capture_output=True, text=True,
                              timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return None, f"{what} timed out after {timeout_s:g} s"
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    try:
        return json.loads(lines[-1]), None
    except (IndexError, json.JSONDecodeError):
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"{what} exited {proc.returncode}: {tail}"


def run_side(patch: Patch, applied: bool, model: str | None = None) -> dict:
    """One side's probe facts: ``{"ok", "kind", "facts", "engine_source_hash", ...}``."""
    out, error = run_on_engine_copy(patch, applied, ["labkit.experiments.patch_probes", patch.name, model or ""],
                                    PROBE_TIMEOUT_S, "probe")
    if out is None:
        return {"ok": False, "error": error}
    out["engine_import_path"] = "copy of engine/ " + ("with" if applied else "without") + f" {patch.file}"
    return out


def _derived(name: str, before: dict, after: dict) -> dict:
    """Facts that compare the two sides (the judge reads one path at a time)."""
    if name == "no-balanced-policy" and before.get("ok") and after.get("ok"):
        return {"prefill_first_unchanged": before["facts"]["prefill_first"] == after["facts"]["prefill_first"]}
    return {}


def run_patch_check(name: str, out: Path, model: str | None = None) -> dict:
    patch = find(name)
    if patch.name in CUDA_PATCHES:
        try:
            import torch

            has_cuda = torch.cuda.is_available()
        except Exception:  # noqa: BLE001
            has_cuda = False
        if not has_cuda:
            raise UserError(f"patch check {patch.name} needs CUDA (CUDA graphs); this machine has none")
    live = is_applied(patch, engine_root())
    before = run_side(patch, True, model)
    after = run_side(patch, False, model)
    facts: dict = {"patch": patch.name, "file": patch.file, "restores": patch.restores,
                   "live_state": "before (applied)" if live else "after (not applied)"}
    for side, res in (("before", before), ("after", after)):
        facts[side] = {"ok": res.get("ok", False), "error": res.get("error"),
                       "engine_source_hash": res.get("engine_source_hash"), **(res.get("facts") or {})}
    facts["after"].update(_derived(patch.name, before, after))
    kind = before.get("kind") or after.get("kind") or ("gpu-measured" if patch.name in CUDA_PATCHES else "cpu-real-engine")
    ran = [run_assertion(f"facts.{side}.ok", "is_true", name=f"{side} probe ran",
                         why=f"the {side} side's probe process completed and reported its facts")
           for side in ("before", "after")]
    return write_evidence(out, checkpoint=patch.checkpoint, kind=kind, facts=facts,
                          device="cuda" if patch.name in CUDA_PATCHES else "cpu", run_assertions=ran)
