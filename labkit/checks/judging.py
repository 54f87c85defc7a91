"""The judge: an evidence file re-judged from its own content, against its checkpoint.

The judge re-derives what it can from the file: ``check_evidence`` verifies the digest (and, with an
evidence key here, the HMAC signature; without one, evidence of a checkpoint this machine cannot run is
"unverified", REVIEW at best: nothing here tells it from a made-up file), re-evaluates the checkpoint's and the run's assertions from the
facts, checks the envelope against the checkpoint (kind, device class, synthetic flag, command and
options) and compares the engine source hash with the current tree (stale evidence is NOT-RUN). ``verdict`` folds the checks into PASS / FAIL /
REVIEW / NOT-RUN and ``reason`` says why in one line.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

from labkit.checks.language import (
    MISSING_TEXT,
    CheckpointError,
    _device_class,
    _result,
    _short,
    evaluate,
    parse_run_assertions,
)
from labkit.checks.spec import Checkpoint, get_checkpoint
from labkit.evidence_format import (
    DIGEST_KEY,
    ENGINE_FREE_KINDS,
    KIND_DEVICE,
    SCHEMA_VERSION,
    SIGNATURE_KEY,
    digest,
    engine_source_hash,
    KEY_ENV,
    evidence_key,
    key_id,
    signature_problem,
)

#: Where an older writer kept checks a command judged itself (a stored ``passed``); the judge no longer
#: accepts them: a file that holds them FAILs (run the command again).
UNJUDGED_KEY = "unjudged_checks"


# --------------------------------------------------------------------------- run assertions


def _run_checks(record: dict) -> list[dict]:
    """The run's own assertions, re-evaluated from the record's facts; a malformed list is one failure."""
    try:
        assertions = parse_run_assertions(record.get("run_assertions", []))
    except CheckpointError as e:
        return [_result("run_assertions", False, "valid assertions", MISSING_TEXT, str(e), source="run")]
    return [evaluate(a, record, "run") for a in assertions]


def _unjudged_checks(record: dict) -> list[dict]:
    """A file with checks its command judged itself (an older writer's ``unjudged_checks``) FAILs: a stored
    result is not evidence, the judge re-evaluates assertions over facts."""
    if UNJUDGED_KEY not in record:
        return []
    return [_result(UNJUDGED_KEY, False, "none (checks are run assertions over facts)", _short(record[UNJUDGED_KEY]),
                    "checks the command judged itself are not accepted: run it again with this labkit",
                    source="integrity")]


# --------------------------------------------------------------------------- envelope vs checkpoint

_OPTION_VALUE_RE = re.compile(r"-\d[\d.eE+-]*")


def _is_option(word: str) -> bool:
    return word.startswith("-") and len(word) > 1 and not _OPTION_VALUE_RE.fullmatch(word)


def _parse_words(words: list[str]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """(the words before the first option, [(option, the non-option words after it), ...])."""
    i = 0
    while i < len(words) and not _is_option(words[i]):
        i += 1
    head, opts = words[:i], []
    while i < len(words):
        word = words[i]
        i += 1
        if word.startswith("--") and "=" in word:
            name, value = word.split("=", 1)
            opts.append((name, [value]))
            continue
        values = []
        while i < len(words) and not _is_option(words[i]):
            values.append(words[i])
            i += 1
        opts.append((word, values))
    return head, opts


def command_mismatch(expected: list[str], recorded: Any) -> str:
    """Why the recorded command line is not ``expected`` (the checkpoint's command), or "" when it is.

    The subcommand words must be the same; every option the checkpoint names must be given, with its
    value(s), at its last occurrence (later ones win), and a flag must not be undone by ``--no-FLAG``
    after it. Options the checkpoint does not name (``--out``, ``--model``, ``--json``) are free."""
    if not isinstance(recorded, str) or not recorded.strip():
        return "no command line recorded"
    try:
        words = shlex.split(recorded)
    except ValueError as e:
        return f"unparsable command line ({e})"
    want_head, want_opts = _parse_words(list(expected))
    head, opts = _parse_words(words)
    if head != want_head:
        return f"ran {' '.join(head) or '(nothing)'}, not {' '.join(want_head)}"
    for name, values in want_opts:
        negation = "--no-" + name[2:] if name.startswith("--") else None
        last = [(n, v) for n, v in opts if n == name or n == negation]
        if not last or last[-1][0] != name:
            return f"{name} not given" if not last else f"{name} undone by {negation}"
        got = last[-1][1][: len(values)]
        if got != values:
            return f"{name} {' '.join(got) or '(no value)'}, not {name} {' '.join(values)}"
    return ""


def _envelope_checks(cp: Checkpoint | None, record: dict) -> list[dict]:
    """What the envelope says about how the data was made, against itself and against ``cp``."""
    out = []
    kind, device, model = record.get("kind"), record.get("device", MISSING_TEXT), record.get("model")
    want = KIND_DEVICE.get(kind) if isinstance(kind, str) else None
    if want is not None:
        out.append(_result("device", _device_class(device) == want, f"a {want} device", device,
                           f"{kind} evidence comes from a {want} device", source="envelope"))
    synthetic = model.get("synthetic") if isinstance(model, dict) else None
    if isinstance(model, dict) and isinstance(synthetic, bool) and "preset" in model:
        made = model.get("preset") is not None
        out.append(_result("model.synthetic", synthetic == made,
                           f"true (preset {model['preset']})" if made else "false (no preset)",
                           synthetic, "a synthesized model names its preset; real weights name none",
                           source="envelope"))
    if cp is None:
        return out
    if cp.synthetic != "any":
        out.append(_result("model.synthetic required", synthetic is cp.synthetic, cp.synthetic,
                           synthetic if isinstance(model, dict) else MISSING_TEXT,
                           "this checkpoint needs " + ("synthetic weights" if cp.synthetic else "real weights"),
                           source="envelope"))
    problem = command_mismatch(cp.command, record.get("command", MISSING_TEXT))
    out.append(_result("command", not problem, " ".join(cp.command), record.get("command", MISSING_TEXT),
                       problem or "written by the checkpoint's command with its options", source="envelope"))
    return out


# --------------------------------------------------------------------------- judging


def judge(cp: Checkpoint | None, record: Any) -> list[dict]:
    """Judge ``record`` from its own content: identity, kind and schema against ``cp``, the envelope
    (device class, synthetic flag, command), ``cp``'s assertions, then the run's own assertions.

    The writer stores this list (and its verdict) in the file as a copy for humans; ``check_evidence``
    calls it again and never reads that copy for the verdict."""
    if not isinstance(record, dict):
        return [_result("evidence", False, "a JSON object", type(record).__name__, "evidence is not an object",
                        source="integrity")]
    out = []
    if cp is not None:
        out += [
            _result("checkpoint", record.get("checkpoint") == cp.id, cp.id, record.get("checkpoint", MISSING_TEXT),
                    "evidence was written for this checkpoint", source="envelope"),
            _result("kind", record.get("kind") in cp.kind, cp.kind, record.get("kind", MISSING_TEXT),
                    "evidence kind is one this checkpoint accepts", source="envelope"),
            _result("schema_version", record.get("schema_version") == SCHEMA_VERSION, SCHEMA_VERSION,
                    record.get("schema_version", MISSING_TEXT), "evidence schema is current", source="envelope"),
        ]
    out += _envelope_checks(cp, record)
    if cp is not None:
        out.extend(evaluate(a, record) for a in cp.assertions)
    out += _run_checks(record)
    out += _unjudged_checks(record)
    return out


def _status(c: dict) -> str:
    return c.get("status") or ("pass" if c.get("passed") else "fail")


def verdict(checks: list[dict]) -> str:
    """FAIL if any check failed, else NOT-RUN if any could not run, else REVIEW if any needs review or
    nothing was asserted (only envelope checks, or none), else PASS."""
    statuses = [_status(c) for c in checks]
    if "fail" in statuses:
        return "FAIL"
    if "not-run" in statuses:
        return "NOT-RUN"
    asserted = [c for c in checks if c.get("source") != "envelope"]
    if "review" in statuses or not asserted:
        return "REVIEW"
    return "PASS"


#: Checks whose ``why`` is the whole story (reason() says it alone).
_PLAIN_SOURCES = ("integrity", "freshness")


def reason(verdict_: str, checks: list[dict]) -> str:
    """One line saying why a verdict came out the way it did."""
    if verdict_ == "PASS":
        return f"{len(checks)} checks passed"
    want = {"FAIL": "fail", "REVIEW": "review", "NOT-RUN": "not-run"}.get(verdict_)
    for c in checks:
        if _status(c) == want:
            if c.get("name") == "evidence" or c.get("source") in _PLAIN_SOURCES:
                return str(c.get("why", ""))
            actual = json.dumps(c.get("actual"), ensure_ascii=False, default=str)
            text = f"{c.get('name')}: expected {c.get('expected')}, got {actual}"
            return f"{text} ({c['why']})" if c.get("why") else text
    return ""


def _digest_check(record: dict) -> dict:
    stored = record.get(DIGEST_KEY)
    if stored is None:
        return _result("digest", False, "a digest", MISSING_TEXT, "no digest: not written by this labkit version",
                       source="integrity")
    actual = digest(record)
    return _result("digest", stored == actual, stored, actual,
                   "edited after it was written (its body no longer matches its digest)" if stored != actual
                   else "the body is what the writer sealed", source="integrity")


def _signature_check(record: dict) -> dict | None:
    """With an evidence key here: the file must carry its HMAC (else FAIL "not signed by this key").
    Without one: None (nothing can be verified; :func:`provenance` says so)."""
    key = evidence_key()
    if key is None:
        return None
    problem = signature_problem(record, key)
    return _result("signature", not problem, f"HMAC-SHA256 by key {key_id(key)}",
                   (record.get(SIGNATURE_KEY) or {}).get("key_id", MISSING_TEXT)
                   if isinstance(record.get(SIGNATURE_KEY), dict) else MISSING_TEXT,
                   problem or "signed by a holder of this key", source="integrity")


#: How many CUDA devices a checkpoint's ``needs`` asks for.
NEEDS_DEVICES = {"cpu": 0, "cuda": 1, "2gpu": 2}


def cuda_device_count() -> int:
    """CUDA devices this process can use (0 without torch or CUDA). Imports torch: called only for
    evidence that claims a GPU and carries no signature a key here verified."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def _devices_claimed(cp: Checkpoint | None, record: dict) -> int:
    """CUDA devices the evidence says it needed: its checkpoint's ``needs``, and at least one for a kind
    measured on a CUDA device (``gpu-measured``)."""
    need = NEEDS_DEVICES.get(cp.needs, 0) if cp is not None else 0
    if KIND_DEVICE.get(record.get("kind")) == "cuda":  # type: ignore[arg-type]
        need = max(need, 1)
    return need


def _unverified_check(cp: Checkpoint | None, record: dict) -> dict | None:
    """REVIEW "unverified" for evidence this machine could not have made (its checkpoint needs CUDA or two
    GPUs, or it claims a CUDA measurement, and this machine has fewer devices) when no evidence key is held
    here: a digest anyone can recompute and a signature no one here can check tell a real run from a
    made-up, resealed or relabelled file in no way, so such evidence never PASSes here. With a key held,
    :func:`_signature_check` decides (a file not signed by it FAILs). None when the rule does not apply."""
    need = _devices_claimed(cp, record)
    if need == 0 or evidence_key() is not None:
        return None
    have = cuda_device_count()
    if have >= need:
        return None
    sig = record.get(SIGNATURE_KEY)
    held = "a signature no key here can check" if isinstance(sig, dict) else "no signature"
    machine = f"{have} CUDA device{'s' if have != 1 else ''}"
    why = (f"unverified: the evidence needs {need} CUDA device{'s' if need > 1 else ''}, this machine has "
           f"{machine} and holds no evidence key, and the file carries {held}: it cannot be told from a "
           f"made-up file here (set {KEY_ENV} to the key of the machine that ran it)")
    return _result("provenance", False, "signed by an evidence key held here", "unverified", why, "review",
                   source="integrity")


def provenance(path: str | Path) -> str:
    """Who can have written the evidence at ``path``, in a word or three: ``signed`` (verified with the key
    here), ``NOT SIGNED BY THIS KEY``, ``signature not checked (no key here)`` (a signature this machine
    cannot verify: anyone can write one), ``unsigned``, or ``-`` (no readable file)."""
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return "-"
    if not isinstance(record, dict):
        return "-"
    key = evidence_key()
    if key is not None:
        return "NOT SIGNED BY THIS KEY" if signature_problem(record, key) else "signed"
    return "signature not checked (no key here)" if isinstance(record.get(SIGNATURE_KEY), dict) else "unsigned"


def _stored_verdict_check(record: dict, rejudged: str) -> dict:
    stored = record.get("verdict", MISSING_TEXT)
    ok = stored == rejudged
    why = ("the verdict the file states is the one its facts give" if ok else
           f"the file says {stored}, its facts judge {rejudged}: edited after it was written, "
           "or the checkpoint changed since (run it again)")
    return _result("stored verdict", ok, rejudged, stored, why, source="integrity")


def _freshness_check(record: dict) -> dict | None:
    """NOT-RUN when the engine source changed since the evidence was written (not for reference kinds)."""
    if record.get("kind") in ENGINE_FREE_KINDS:
        return None
    recorded, current = record.get("engine_source_hash"), engine_source_hash()
    ok = recorded == current
    why = ("the engine source is the one the evidence was written with" if ok
           else "stale: engine changed since this evidence was written")
    return _result("engine_source_hash", ok, current, recorded, why, "not-run", source="freshness")


def check_evidence(cp: Checkpoint, path: str | Path | None = None) -> tuple[str, list[dict]]:
    """Judge the evidence file of ``cp`` (default: its ``evidence`` path) from scratch.

    FAIL: unreadable, not sealed by its digest (edited, or an old labkit), not signed by the evidence key
    this process holds (when it holds one), a stored verdict its facts do
    not give, or any failed check. NOT-RUN: no file, or stale (the engine source changed since; not for
    ``reference`` evidence, which our engine did not make). REVIEW ("unverified"): evidence of a checkpoint
    this machine cannot run (CUDA, two GPUs) with no evidence key here to verify it. Otherwise the verdict
    of the re-judged checks."""
    return check_file(path if path is not None else cp.evidence_path(), cp)


def check_file(path: str | Path, cp: Checkpoint | None = None) -> tuple[str, list[dict]]:
    """Judge any evidence file from scratch, as :func:`check_evidence` does. With ``cp`` None, a file that
    claims a checkpoint is judged against it (an unknown id FAILs) and one that claims none (a collection,
    an experiment with custom options) by its own run assertions, digest, stored verdict and freshness."""
    path = Path(path)
    if not path.is_file():
        return "NOT-RUN", [_result("evidence", False, "a file", MISSING_TEXT, f"no evidence at {path}", "not-run",
                                   source="integrity")]
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return "FAIL", [_result("evidence", False, "valid JSON", "<unreadable>", f"unreadable evidence at {path}: {e}",
                                source="integrity")]
    if cp is None and isinstance(record, dict) and record.get("checkpoint") is not None:
        try:
            cp = get_checkpoint(str(record["checkpoint"]))
        except CheckpointError as e:
            return "FAIL", [_result("checkpoint", False, "a known checkpoint", record["checkpoint"], str(e),
                                    source="integrity")]
    judged = judge(cp, record)
    if not isinstance(record, dict):
        return "FAIL", judged
    rejudged = verdict(judged)
    integrity = [_digest_check(record)]
    signed = _signature_check(record)
    if signed is not None:
        integrity.append(signed)
    if record.get("checkpoint") == (cp.id if cp is not None else None):  # else it judged another checkpoint
        integrity.append(_stored_verdict_check(record, rejudged))
    unverified = _unverified_check(cp, record)
    if unverified is not None:
        integrity.append(unverified)
    fresh = _freshness_check(record)
    checks = integrity + ([fresh] if fresh else []) + judged
    if any(_status(c) == "fail" for c in integrity):
        return "FAIL", checks
    if fresh is not None and _status(fresh) == "not-run":
        return "NOT-RUN", checks
    if unverified is not None and rejudged != "FAIL":  # never PASS: say why first
        return "REVIEW", [unverified] + [c for c in checks if c is not unverified]
    return rejudged, checks
