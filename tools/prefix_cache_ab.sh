#!/usr/bin/env bash
# The prefix cache's effect on served latency: workloads/sweep-prefix.jsonl and workloads/sweep-multi-turn.jsonl
# at one rate, with and without the prefix cache, each through a `labkit serve` process of its own; then one line
# per workload (TTFT p50/p99, TPOT p50/p99, hit rate, output tok/s) and the TTFT's split (ingress, queue, prefill,
# delivery: labkit/load/sweep_metrics.py), read from the evidence files.
#
# usage: tools/prefix_cache_ab.sh OUT_DIR [EXTRA LOAD OPTIONS...]
# Overrides: MODEL_DIR, RATE (32), DATASETS ("prefix multi-turn"), CACHES ("enable no-enable": the sides run), ENGINE (the
# sweep's engine options), DEVICE.
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(mkdir -p "$1" && cd "$1" && pwd); shift
export LABKIT_RUNS_DIR="$out" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
engine=${ENGINE:---max-num-seqs 256 --max-active 256 --queue-size 1024 --max-num-batched-tokens 16384 --max-model-len 2048 --graph --overlap}
model_args=(); [ -n "${MODEL_DIR:-}" ] && model_args=(--model "$MODEL_DIR")
for ds in ${DATASETS:-prefix multi-turn}; do
  for pc in ${CACHES:-enable no-enable}; do
    t0=$(date +%s)
    # shellcheck disable=SC2086  # $engine is a list of options
    $py -m labkit load "${model_args[@]}" --device "${DEVICE:-auto}" --trace "workloads/sweep-$ds.jsonl" \
      --request-rates "${RATE:-32}" $engine --serve-process --$pc-prefix-caching "$@" \
      --out "$out/$ds-$pc.json" > "$out/$ds-$pc.txt" 2>&1 || echo "$ds --$pc-prefix-caching: exit $? (see $out/$ds-$pc.txt)"
    echo "$ds --$pc-prefix-caching: $(( $(date +%s) - t0 )) s"
  done
done
$py - "$out" <<'PY'
import json, sys
from pathlib import Path

for p in sorted(Path(sys.argv[1]).glob("*.json")):
    rec = json.loads(p.read_text())
    rows = (rec.get("facts") or {}).get("per_rate") or []
    if not rows:
        continue
    r = rows[0]
    print(f"{p.stem:24s} TTFT p50/p99 {r['ttft_ms'].get('p50')}/{r['ttft_ms'].get('p99')} ms  "
          f"TPOT p50/p99 {r['tpot_ms'].get('p50')}/{r['tpot_ms'].get('p99')} ms  hit rate {r['prefix_cache_hit_rate']}  "
          f"out {r['output_throughput_tok_s']} tok/s  {r['completed']}/{r['sent']} completed")
    split = r.get("ttft_split_ms")
    if split:
        print(f"{'':24s} TTFT p50 split: " + ", ".join(f"{k[:-3]} {v.get('p50')}" for k, v in split.items()) + " ms")
PY
