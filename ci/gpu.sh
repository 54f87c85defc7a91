#!/usr/bin/env bash
# ci/gpu.sh: the lab's GPU checks on a CI runner, with all evidence under one directory.
#
# Usage:  ci/gpu.sh OUT_DIR [MODEL_DIR]
#
# Contract
#   Needs     a checkout of this repository, a Python with the lab's dependencies already installed
#             (the CUDA build of torch, `pip install -e ".[dev,cuda]"` or the same packages), and
#             NVIDIA GPUs visible to it (CUDA_VISIBLE_DEVICES is respected).
#   Installs  nothing: no pip, no downloads. It runs the repository's code with PYTHONPATH set to the
#             checkout (so an installed copy elsewhere is not picked up). Without MODEL_DIR (or
#             $MODEL_DIR) the synthetic model is built under ~/.cache/labkit, as every lab command does.
#   Runs      1. labkit doctor (the machine: packages, device, a small computation);
#             2. every checkpoint that needs `cuda` or `2gpu` that this machine can run, in the order
#                of CHECKPOINTS.md, each in its own process (the others are NOT-RUN with the reason);
#                CI_ALL=1 runs the CPU checkpoints too (`labkit run`);
#                then `labkit check --strict` over what it ran: a checkpoint this machine can run
#                without current evidence (its command crashed, or the evidence is stale) FAILs;
#             3. labkit report: the final evidence report.
#   Writes    OUT_DIR/runs/      every evidence file, runs/logs/<checkpoint>.log, report.{json,md},
#                                final-report.{json,md,-timeline.png}, environment.txt,
#                                engine-changes.patch, source-head.txt
#             OUT_DIR/logs/      this script's steps (doctor.log, checkpoints.log, report.log)
#             OUT_DIR/nvidia-smi.txt, OUT_DIR/summary.txt
#             Archive OUT_DIR as a whole; nothing is written outside it except the model cache.
#   Signs     with LABKIT_EVIDENCE_KEY (the key as text) or LABKIT_EVIDENCE_KEY_FILE (a file holding it)
#             set, every evidence file carries an HMAC-SHA256 of its body made with that key, and the
#             strict check verifies it; `labkit check` on another machine verifies it when given the same
#             key. Keep the key in the CI secret store, never in OUT_DIR.
#   Exit      0 when nothing FAILs (PASS, REVIEW and NOT-RUN do not fail the job);
#             1 when doctor, any checkpoint or a required item of the final report FAILs;
#             2 for a usage error (no OUT_DIR, labkit not importable).
set -uo pipefail

if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
  sed -n '2,/^[^#]/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  [[ $# -lt 1 ]] && exit 2 || exit 0
fi

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$(mkdir -p "$1" && cd "$1" && pwd)" || { echo "error: cannot create $1" >&2; exit 2; }
MODEL="${2:-${MODEL_DIR:-}}"
PY="${PYTHON:-python3}"

export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export LABKIT_RUNS_DIR="$OUT/runs"
export PYTHONUNBUFFERED=1 COLUMNS="${COLUMNS:-160}"
mkdir -p "$OUT/runs" "$OUT/logs"
cd "$REPO"

if ! "$PY" -c "import labkit, engine" 2>"$OUT/logs/import.log"; then
  echo "error: $PY cannot import labkit/engine from $REPO (see $OUT/logs/import.log)" >&2
  exit 2
fi
if [[ -n "$MODEL" && ! -d "$MODEL" ]]; then
  echo "error: model directory not found: $MODEL" >&2
  exit 2
fi
MODEL_ARGS=()
[[ -n "$MODEL" ]] && MODEL_ARGS=(--model "$MODEL")

status=0
step() { echo "== $*" | tee -a "$OUT/summary.txt"; }

if [[ -n "${LABKIT_EVIDENCE_KEY:-}${LABKIT_EVIDENCE_KEY_FILE:-}" ]]; then
  kid="$("$PY" -c '
import sys
from labkit.errors import UserError
from labkit.evidence_format import evidence_key, key_id
try:
    print(key_id(evidence_key()))
except UserError as e:
    sys.exit(str(e))
' 2>&1)" || { echo "error: $kid" >&2; exit 2; }
  echo "evidence: signed (HMAC-SHA256, key id $kid)" | tee -a "$OUT/summary.txt"
else
  echo "evidence: unsigned (no LABKIT_EVIDENCE_KEY / LABKIT_EVIDENCE_KEY_FILE)" | tee -a "$OUT/summary.txt"
fi

{ nvidia-smi 2>&1 || echo "nvidia-smi not available"; } > "$OUT/nvidia-smi.txt"

step "doctor"
"$PY" -m labkit doctor "${MODEL_ARGS[@]}" >"$OUT/logs/doctor.log" 2>&1
rc=$?; echo "doctor exit $rc" | tee -a "$OUT/summary.txt"; [[ $rc -ne 0 ]] && status=1

step "checkpoints (${CI_ALL:+all}${CI_ALL:-cuda and 2gpu})"
if [[ -n "${CI_ALL:-}" ]]; then
  "$PY" -m labkit run "${MODEL_ARGS[@]}" >"$OUT/logs/checkpoints.log" 2>&1
  rc=$?
  "$PY" -m labkit check --strict >"$OUT/logs/strict-check.log" 2>&1 || rc=1
else
  "$PY" - "$MODEL" >"$OUT/logs/checkpoints.log" 2>&1 <<'EOF'
import sys

from labkit.checks import load_checkpoints
from labkit.run_all import can_run, check_row, not_run, run_checkpoint, write_report

model = sys.argv[1] or None
rows = []
for cp in load_checkpoints():
    if cp.needs == "cpu":
        continue
    ok, why = can_run(cp)
    row = run_checkpoint(cp, model) if ok else not_run(cp, why)
    rows.append(row)
    print(f"{row['verdict']:8} {cp.id}  {row['reason']}", flush=True)
write_report(rows, stage="cuda+2gpu", model=model)
# strict for what ran: no current evidence for a checkpoint this machine can run is a FAIL
strict = [check_row(cp, strict=True) for cp in load_checkpoints() if cp.needs != "cpu" and can_run(cp)[0]]
for row in strict:
    print(f"strict {row['verdict']:8} {row['id']}  {row['reason']}", flush=True)
sys.exit(1 if any(r["verdict"] == "FAIL" for r in rows + strict) else 0)
EOF
  rc=$?
fi
grep -E '^(PASS|FAIL|REVIEW|NOT-RUN) ' "$OUT/logs/checkpoints.log" >> "$OUT/summary.txt"
echo "checkpoints exit $rc" | tee -a "$OUT/summary.txt"; [[ $rc -ne 0 ]] && status=1

step "final report"
"$PY" -m labkit report >"$OUT/logs/report.log" 2>&1
rc=$?; echo "report exit $rc ($OUT/runs/final-report.md)" | tee -a "$OUT/summary.txt"; [[ $rc -ne 0 ]] && status=1

echo "result: $([[ $status -eq 0 ]] && echo OK || echo FAILED); evidence under $OUT" | tee -a "$OUT/summary.txt"
exit $status
