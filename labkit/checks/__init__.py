"""Checkpoints as data, and the judge that re-reads evidence against them.

Three modules, each depending only on the ones before it:

- ``language``: the assertion language (paths into a record, ops, assertions, threshold references),
  parsed and evaluated; ``run_assertion`` states a run's own checks in it.
- ``spec``: the checkpoint definitions in ``checkpoints/*.json`` (and their threshold tables) loaded,
  validated and looked up, and CHECKPOINTS.md rendered from them.
- ``judging``: an evidence file judged from its own content: digest, stored verdict, freshness
  (engine source hash), the envelope against the checkpoint, then every assertion; ``verdict`` and
  ``reason``.

Callers import from ``labkit.checks``; the names below are its face. The writer (``labkit.evidence``)
imports the judge; the judge never imports the writer.
"""

from labkit.checks.judging import (
    UNJUDGED_KEY,
    _run_checks,
    check_evidence,
    check_file,
    command_mismatch,
    judge,
    provenance,
    reason,
    verdict,
)
from labkit.checks.language import (
    MISSING_TEXT,
    OPS,
    Assertion,
    CheckpointError,
    Threshold,
    _resolve,
    evaluate,
    parse_run_assertions,
    resolve,
    run_assertion,
    threshold_key,
)
from labkit.checks.spec import (
    NEEDS,
    NEEDS_REASON,
    STAGE_ORDER,
    Checkpoint,
    checkpoints_dir,
    checkpoints_md_path,
    get_checkpoint,
    load_checkpoints,
    load_file,
    load_thresholds,
    render_checkpoints_md,
    select,
    threshold_entry,
    write_checkpoints_md,
)

__all__ = [
    "MISSING_TEXT", "NEEDS", "NEEDS_REASON", "OPS", "STAGE_ORDER", "UNJUDGED_KEY",
    "Assertion", "Checkpoint", "CheckpointError", "Threshold",
    "check_evidence", "check_file", "checkpoints_dir", "checkpoints_md_path", "command_mismatch", "evaluate",
    "get_checkpoint", "judge", "load_checkpoints", "load_file", "load_thresholds", "parse_run_assertions",
    "provenance", "reason", "render_checkpoints_md", "resolve", "run_assertion", "select", "threshold_entry", "threshold_key",
    "verdict", "write_checkpoints_md",
]
