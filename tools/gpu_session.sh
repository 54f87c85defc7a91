#!/usr/bin/env bash
# One measurement session on a GPU box: every checkpoint this machine can run (`labkit run`), then the
# service comparison of handbook 5.6 on workloads/mixed.jsonl: one engine, two replicas (one per GPU),
# one TP=2 engine over both GPUs, and `labkit report` over the three. On a CPU box it runs the same
# chain (replicas and TP=2 share the CPU), which is how this script is tested.
#
# usage: tools/gpu_session.sh OUT_DIR [MODEL_DIR]
# Leaves OUT_DIR/evidence.tgz (JSON, Markdown, logs; no NPZ) and prints a summary.
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd); model=${2:-${MODEL_DIR:-}}
runs="$out/runs"; mkdir -p "$runs"
export LABKIT_RUNS_DIR="$runs" PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
model_args=(); [ -n "$model" ] && model_args=(--model "$model")
gpus=$($py -c "import torch; print(torch.cuda.device_count())")
gpu() { [ "$gpus" -ge 1 ] && echo "$1" || echo ""; }      # CUDA_VISIBLE_DEVICES value, empty on CPU

$py -m labkit run "${model_args[@]}" > "$out/run.txt" 2>&1; echo "labkit run: exit $?"

pids=()
start() {   # start GPUS PORT WORKER_ID [extra serve options]: a server in the background, its PID recorded
  local devices=$1 port=$2 id=$3; shift 3
  CUDA_VISIBLE_DEVICES=$devices $py -m labkit serve "${model_args[@]}" --port "$port" --worker-id "$id" \
    --scheduling-policy prefill_first --max-num-batched-tokens 256 --max-model-len 1024 --enforce-eager --out "$runs/server-$id.jsonl" "$@" > "$runs/serve-$id.log" 2>&1 &
  pids+=($!)
}
ready() {   # ready URL WORKER_ID: wait (90 s at most) until /health is ok and names this worker
  $py - "$1" "$2" <<'PY'
import json, sys, time, urllib.request
deadline = time.time() + 90
while time.time() < deadline:
    try:
        with urllib.request.urlopen(sys.argv[1] + "/health", timeout=1) as r:
            worker = json.load(r).get("worker_id")
            if worker == sys.argv[2]:
                sys.exit(0)
            sys.exit(f"{sys.argv[1]} is served by worker {worker!r}, not {sys.argv[2]!r}: a stale server?")
    except OSError:
        time.sleep(0.5)
sys.exit(f"{sys.argv[1]} did not become ready")
PY
}
stop_all() {  # SIGTERM every server started here and wait until each has exited (its GPU memory is free)
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do
    for _ in $(seq 60); do kill -0 "$p" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$p" 2>/dev/null; wait "$p" 2>/dev/null
  done
  pids=()
}
load() {    # load ENDPOINTS NAME
  timeout 300 $py -m labkit load --trace workloads/mixed.jsonl --mode wall --warmup-requests 2 \
    --endpoints "$1" --out "$runs/$2.jsonl" > "$runs/load-$2.log" 2>&1
  echo "load $2: exit $?"
}
trap stop_all EXIT

start "$(gpu 0)" 8801 single --max-num-seqs 4 --max-active 8
ready http://127.0.0.1:8801 single && load http://127.0.0.1:8801 single; stop_all

start "$(gpu 0)" 8801 replica-a --max-num-seqs 4 --max-active 8
start "$(gpu 1)" 8802 replica-b --max-num-seqs 4 --max-active 8
ready http://127.0.0.1:8801 replica-a && ready http://127.0.0.1:8802 replica-b && load http://127.0.0.1:8801,http://127.0.0.1:8802 replicas
stop_all

tp_devices=$([ "$gpus" -ge 2 ] && echo 0,1 || echo "")
start "$tp_devices" 8803 tp-two --tensor-parallel-size 2 --max-num-seqs 8 --max-active 16
ready http://127.0.0.1:8803 tp-two && load http://127.0.0.1:8803 tp2; stop_all

inputs=$(for n in single replicas tp2; do [ -s "$runs/$n.jsonl" ] && printf '%s,' "$runs/$n.jsonl"; done)
$py -m labkit report --inputs "${inputs%,}" --out "$runs/parallel-comparison.json" > "$runs/report.log" 2>&1
echo "report: exit $?"
tail -n 3 "$out/run.txt"
(cd "$out" && tar czf evidence.tgz --exclude='*.npz' --exclude='*.png' run.txt runs)
echo "evidence: $out/evidence.tgz ($(du -h "$out/evidence.tgz" | cut -f1))"
