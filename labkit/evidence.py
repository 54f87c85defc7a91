"""The one writer of ``runs/``.

Every evidence file is one JSON object: the same envelope everywhere (schema version, command line,
git head, engine source hash, versions, device, model identity, seed, evidence kind, engine config),
then the run's ``checkpoint`` id, its ``facts`` and its ``run_assertions`` (assertions over those facts,
in the checkpoints' language), then the ``checks`` and ``verdict`` the judge gave when the file was
written (a copy for humans: ``labkit check`` re-judges from the facts and never trusts them), the
``signature`` (an HMAC-SHA256 of the body) when the runner holds an evidence key, and last the ``digest``
that seals the body, so an accidental edit is seen.

Nothing here imports torch or the engine: versions are read from modules already imported or from
package metadata, so writing evidence never costs an import and never crashes on a broken install.
The writer imports the judge (``labkit.checks``); the judge never imports the writer.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import enum
import functools
import importlib.metadata
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

from labkit import checks as _checks
from labkit import paths
from labkit.errors import UserError
from labkit.patches.store import applied_patches
from labkit.evidence_format import (
    DIGEST_KEY,
    KINDS,
    SCHEMA_VERSION,
    SIGNATURE_KEY,
    digest,
    engine_dir,
    engine_source_hash,
    evidence_key,
    sign,
)

_VERSIONED = ("python", "torch", "triton", "transformers", "flash_attn")


# --------------------------------------------------------------------------- envelope pieces


def utc_stamp() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def command_line(argv: list[str] | None = None) -> str:
    """``sys.argv`` joined for a shell, with argv[0] reduced to its basename."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return ""
    prog = os.path.basename(argv[0]) or argv[0]
    if prog == "__main__.py" and os.path.basename(os.path.dirname(argv[0])) == "labkit":  # python -m labkit
        prog = "labkit"
    return shlex.join([prog, *argv[1:]])


def _run_git(args: list[str], cwd: Path) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def _git(args: list[str], root: Path | None) -> str | None:
    """stdout of ``git ARGS`` at ``root`` (default: the project root), or None: not a git checkout (also when
    ``root`` merely lies inside some other repository, whose head says nothing about this code), no git, an
    error, a timeout."""
    root = Path(root or paths.repo_root())
    top = (_run_git(["rev-parse", "--show-toplevel"], root) or "").strip()
    try:
        if not top or Path(top).resolve() != root.resolve():
            return None
    except OSError:
        return None
    return _run_git(args, root)


def git_head(root: Path | None = None) -> str | None:
    """The commit checked out at ``root``, or None: not a git checkout (``root`` is not the top of a
    repository), no commits, no git, timeout."""
    head = (_git(["rev-parse", "HEAD"], root) or "").strip()
    return head or None


def git_dirty(root: Path | None = None) -> bool | None:
    """True when tracked files differ from ``git_head`` (the evidence came from uncommitted code), None
    when git cannot tell."""
    out = _git(["status", "--porcelain", "--untracked-files=no"], root)
    return None if out is None else bool(out.strip())


def read_jsonl(path: str | Path, missing: str = "no such file",
               contains: tuple[str, ...] = ()) -> Iterator[tuple[int, dict]]:
    """(line number, object) for every non-blank line of a JSONL file; with ``contains``, only the lines holding one
    of those strings are parsed (a server log's step or request events among its many token events). A missing
    file, a line that is not JSON or not an object is one UserError line: ``{missing}: PATH`` or ``PATH:N: why``."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{missing}: {path}")
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip() or (contains and not any(c in line for c in contains)):
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{n}: not JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise UserError(f"{path}:{n}: not a JSON object")
            yield n, rec


def package_version(name: str) -> str | None:
    """Version of an importable package, or None. Never imports it and never raises."""
    try:
        mod = sys.modules.get(name)
        if mod is not None:
            v = getattr(mod, "__version__", None)
            if v is not None:
                return str(v)
        if importlib.util.find_spec(name) is None:
            return None
        return importlib.metadata.version(name)
    except Exception:  # a broken install must not break evidence writing
        return None


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in _VERSIONED[1:]:
        out[name] = package_version(name)
    return out


def describe_device(device: Any) -> str:
    """``"cpu"`` or ``"cuda:0 NVIDIA H200"`` for a torch device (or its string)."""
    text = str(device)
    if not text.startswith("cuda"):
        return text
    try:
        import torch

        dev = torch.device(text)
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        return f"cuda:{index} {torch.cuda.get_device_name(index)}"
    except Exception:
        return text


def envelope(
    *,
    kind: str,
    device: str | None = None,
    model: dict | None = None,
    seed: int | None = None,
    engine: dict | None = None,
) -> dict:
    """The fields every evidence file starts with. ``kind`` must be one of :data:`KINDS`."""
    if kind not in KINDS:
        raise ValueError(f"unknown evidence kind {kind!r}; expected one of {', '.join(KINDS)}")
    edir = engine_dir()
    return {
        "schema_version": SCHEMA_VERSION,
        "created_at": utc_stamp(),
        "command": command_line(),
        "cwd": os.getcwd(),
        "git_head": git_head(),
        "git_dirty": git_dirty(),
        "engine_source_hash": engine_source_hash(),
        "engine_import_path": str(edir) if edir is not None else None,
        "engine_patches": applied_patches(),
        "versions": versions(),
        "device": device,
        "model": model,
        "seed": seed,
        "kind": kind,
        "engine": engine,
    }


# --------------------------------------------------------------------------- JSON


def to_jsonable(obj: Any) -> Any:
    """``default=`` hook for json: numpy, torch, Path, sets, dataclasses, enums."""
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=repr)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, bytes):
        return obj.hex()
    mod = type(obj).__module__
    if mod.startswith("numpy"):
        if hasattr(obj, "tolist"):
            return obj.tolist()  # ndarray and numpy scalars (item via tolist)
    if mod.startswith("torch"):
        if hasattr(obj, "tolist"):
            return obj.detach().cpu().tolist() if hasattr(obj, "detach") else obj.tolist()
        return str(obj)  # torch.dtype, torch.device, torch.Size is a tuple already
    return str(obj)


def dumps(data: Any) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False, default=to_jsonable)


def write_json(path: str | Path, data: Any) -> Path:
    """Write JSON atomically (temp file in the same directory, then rename)."""
    path = Path(path)
    text = dumps(data) + "\n"  # serialize first: a failure leaves nothing behind
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text(path, text)


@functools.cache
def file_mode() -> int:
    """The mode ``open()`` gives a new file: 0o666 less the umask (read once; Python has no getter that does not
    set it). mkstemp's temp files are 0600, and a rename keeps that."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def write_text(path: Path, text: str) -> Path:
    """Write ``text`` atomically (temp file beside it, then rename): a reader never sees half a file. The file
    gets the umask's mode like any other (not mkstemp's 0600)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, file_mode())
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))


# --------------------------------------------------------------------------- claiming a checkpoint


def claim(checkpoint: str | None, argv: list[str] | None = None, *, also: str = "") -> tuple[str | None, dict | None]:
    """Whether this run may write evidence for ``checkpoint``: only when its command line (``sys.argv``, or
    ``argv``) is the checkpoint's command with its options, as the judge will check, and ``also`` (a reason
    the caller found, e.g. threshold overrides) is empty. Returns ``(checkpoint, None)`` when it may, else
    ``(None, {"checkpoint": ID, "command": the checkpoint's command, "why": ...})``: the run is then evidence
    for no checkpoint (not a FAIL of one), and says so."""
    if checkpoint is None:
        return None, None
    cp = _checks.get_checkpoint(checkpoint)
    why = _checks.command_mismatch(cp.command, command_line(argv)) or also
    if not why:
        return checkpoint, None
    return None, {"checkpoint": checkpoint, "command": " ".join(cp.command), "why": why}


# --------------------------------------------------------------------------- patched engine

#: Where evidence made with engine patches applied goes: ``runs/patched/<patch[+patch]>/<its usual path>``.
PATCHED_DIR = "patched"


def _patch_check_paths() -> set[Path]:
    """Evidence of the ``patches`` stage: ``labkit patch check`` runs both sides on copies of engine/, so the
    working tree's patches do not make it."""
    return {cp.evidence_path() for cp in _checks.load_checkpoints() if cp.stage == "patches"}


def is_patched_path(path: str | Path) -> bool:
    """Whether ``path`` lies under ``runs/patched/`` (evidence of a patched engine)."""
    try:
        rel = Path(path).resolve().relative_to(paths.runs_dir().resolve())
    except ValueError:
        return False
    return rel.parts[:1] == (PATCHED_DIR,)


def patched_out(out: str | Path, patches: list[str] | None = None) -> Path:
    """Where evidence meant for ``out`` is written: ``out`` itself for the unpatched engine; with engine
    patches applied (``patches``, default: the working tree's), ``runs/patched/<names>/<out below runs/>``,
    so a patched run never replaces the unpatched engine's evidence. Paths outside ``runs/``, already under
    ``runs/patched/``, or of ``labkit patch check`` are kept."""
    out = Path(out)
    patches = applied_patches() if patches is None else patches
    if not patches:
        return out
    base = paths.runs_dir()
    try:
        rel = out.resolve().relative_to(base.resolve())
    except ValueError:
        return out
    if is_patched_path(out) or out.resolve() in {p.resolve() for p in _patch_check_paths()}:
        return out
    return base / PATCHED_DIR / "+".join(patches) / rel


# --------------------------------------------------------------------------- writing evidence


def write_evidence(
    out: str | Path,
    *,
    checkpoint: str | None,
    kind: str,
    facts: dict,
    device: str | None = None,
    model: dict | None = None,
    seed: int | None = None,
    engine: dict | None = None,
    run_assertions: list[dict] | None = None,
) -> dict:
    """Build the record, judge it against ``checkpoint`` (if any) and its own ``run_assertions``, sign it
    when this process holds an evidence key (``$LABKIT_EVIDENCE_KEY`` / ``_FILE``), seal it with a digest
    and write it to ``out``.

    ``run_assertions`` are assertion objects (``checks.run_assertion(...)``), the language of
    ``checkpoints/*.json``, over the record (``facts.x``); they are stored in the file and ``labkit check``
    re-evaluates them from the facts every time. A command states every check it makes this way, over facts
    it measured: there is no way to store a check's result.

    With engine patches applied the file goes to :func:`patched_out` (``runs/patched/<patch>/...``), never
    over the unpatched engine's evidence; the returned record then says where under ``_written_to``.

    Returns the record: the envelope plus ``checkpoint``, ``facts``, ``run_assertions``, ``checks``,
    ``verdict`` and ``digest``.
    """
    if not isinstance(facts, dict):
        raise TypeError(f"facts must be a dict, not {type(facts).__name__}")
    cp = _checks.get_checkpoint(checkpoint) if checkpoint is not None else None
    raw_assertions = list(run_assertions or [])
    _checks.parse_run_assertions(raw_assertions)  # a malformed assertion is a bug in the command: raise now
    record = envelope(kind=kind, device=device, model=model, seed=seed, engine=engine)
    record["checkpoint"] = checkpoint
    record["facts"] = facts
    record["run_assertions"] = raw_assertions
    # Everything is judged and sealed in its JSON form: exactly what the file will hold and the judge read.
    record = json.loads(json.dumps(record, default=to_jsonable))
    results = _checks.judge(cp, record)
    record["checks"] = results
    record["verdict"] = _checks.verdict(results)
    key = evidence_key()
    if key is not None:  # the runner holds a key: sign the body (the judge verifies when it holds it too)
        record[SIGNATURE_KEY] = sign(record, key)
    record[DIGEST_KEY] = digest(record)
    path = patched_out(out, record.get("engine_patches"))
    write_json(path, record)
    if path != Path(out):  # not part of the file: where it went, for the command's last line
        record["_written_to"] = {"requested": str(out), "path": str(path)}
    return record


def write_claimed(checkpoint: str | None, out: str | Path | None, name: str, *, kind: str, facts: dict,
                  unclaimed_name: str | None = None, **envelope) -> dict:
    """An experiment's usual end: claim(checkpoint) (a checkpoint the command line does not claim is recorded
    as facts.checkpoint_not_claimed), write the evidence to `out`, or to runs/<name> (runs/<unclaimed_name>,
    when given, if the run claims no checkpoint), and return the record with its path under "_paths"."""
    cp, unclaimed = claim(checkpoint)
    if unclaimed:
        facts["checkpoint_not_claimed"] = unclaimed
    default = name if cp or unclaimed_name is None else unclaimed_name
    path = Path(out) if out is not None else paths.default_out(default)
    record = write_evidence(path, checkpoint=cp, kind=kind, facts=facts, **envelope)
    record["_paths"] = {"json": record.get("_written_to", {}).get("path", str(path))}
    return record
