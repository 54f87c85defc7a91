#!/usr/bin/env bash
# The serving figures on an H200 in one command (qwen3-0.6b synthetic unless MODEL_DIR is set), each server a
# `labkit serve` process of its own (--serve-process):
#   1. the rate sweep on workloads/sweep-random.jsonl at 8..128 req/s and all at once, then the same
#      requests offline on an engine with the same options (the cuda.rate-sweep checkpoint's command):
#      the rate at which TTFT p99 passes 1 s, throughput at saturation as a share of offline, the picture;
#   2. workloads/sweep-prefix.jsonl and workloads/sweep-multi-turn.jsonl at one rate, with and without
#      the prefix cache (--enable-prefix-caching / --no-enable-prefix-caching): TTFT p50 and hit rate.
# Then a summary table of those numbers, read from the evidence files.
#
# usage: tools/sweep_h200.sh [OUT_DIR]      (default runs/sweep-h200; LABKIT_RUNS_DIR is set to it, so
#        `LABKIT_RUNS_DIR=OUT_DIR labkit check cuda.rate-sweep` re-judges the sweep afterwards)
# Overrides (for a CPU try-out): WORKLOADS (a folder with the three sweep-*.jsonl headers), RATES,
# CACHE_RATE, ENGINE (the engine/admission options), DEVICE.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mkdir -p "${1:-runs/sweep-h200}" && cd "${1:-runs/sweep-h200}" && pwd)
export LABKIT_RUNS_DIR="$out" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
wl=${WORKLOADS:-workloads}
rates=${RATES:-8,16,32,64,128,inf}
cache_rate=${CACHE_RATE:-32}
engine=${ENGINE:---max-num-seqs 256 --max-active 256 --queue-size 1024 --max-num-batched-tokens 16384 --max-model-len 2048 --graph --overlap}
device=${DEVICE:-auto}
model_args=(); [ -n "${MODEL_DIR:-}" ] && model_args=(--model "$MODEL_DIR")
start=$(date +%s)

# shellcheck disable=SC2086  # $engine is a list of options
$py -m labkit load "${model_args[@]}" --device "$device" --trace "$wl/sweep-random.jsonl" --request-rates "$rates" \
  --goodput ttft:1000,tpot:50 $engine --offline-baseline --serve-process \
  $([ "$wl" = workloads ] && [ "$rates" = 8,16,32,64,128,inf ] && echo --checkpoint cuda.rate-sweep) \
  --out "$out/sweep-random.json" > "$out/sweep-random.txt" 2>&1 || echo "sweep: exit $? (see $out/sweep-random.txt)"

for ds in prefix multi-turn; do
  for pc in enable no-enable; do
    # shellcheck disable=SC2086
    $py -m labkit load "${model_args[@]}" --device "$device" --trace "$wl/sweep-$ds.jsonl" --request-rates "$cache_rate" \
      $engine --serve-process --$pc-prefix-caching --out "$out/$ds-$pc-prefix-caching.json" \
      > "$out/$ds-$pc-prefix-caching.txt" 2>&1 || echo "$ds --$pc-prefix-caching: exit $? (see $out/$ds-$pc-prefix-caching.txt)"
  done
done

$py - "$out" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
def load(name):
    p = out / f"{name}.json"
    return json.loads(p.read_text()) if p.is_file() else None

sweep = load("sweep-random")
if sweep:
    f, s = sweep["facts"], sweep["facts"]["summary"]
    print(f"sweep ({sweep['kind']}, verdict {sweep['verdict']}), output tok/s per offered rate:")
    for r in f["per_rate"]:
        print(f"  {r['offered_rate']:>5} req/s: {r['request_throughput']} req/s, {r['output_throughput_tok_s']} tok/s, "
              f"TTFT p50/p99 {r['ttft_ms'].get('p50')}/{r['ttft_ms'].get('p99')} ms, TPOT p50 {r['tpot_ms'].get('p50')} ms, "
              f"goodput {(r['goodput'] or {}).get('req_s')} req/s, {r['completed']}/{r['sent']} completed, {r['rejected']} rejected")
    print(f"TTFT p99 passes {s['ttft_p99_limit_ms']:g} ms at {s['first_rate_ttft_p99_over_limit']} req/s "
          f"(last within: {s['last_rate_ttft_p99_within_limit']}); first saturated rate {s['first_saturated_rate']}")
    print(f"best served {s['max_output_throughput_tok_s']} tok/s, offline {(f.get('offline') or {}).get('tok_s')} tok/s: "
          f"served/offline {s.get('served_over_offline')}; picture {f['picture']}")
for ds in ("prefix", "multi-turn"):
    row = {}
    for pc in ("enable", "no-enable"):
        rec = load(f"{ds}-{pc}-prefix-caching")
        row[pc] = rec["facts"]["per_rate"][0] if rec else None
    on, off = row["enable"], row["no-enable"]
    if on and off:
        a, b = on["ttft_ms"].get("p50"), off["ttft_ms"].get("p50")
        print(f"{ds}: TTFT p50 {a} ms with the prefix cache (hit rate {on['prefix_cache_hit_rate']}), {b} ms without "
              f"(hit rate {off['prefix_cache_hit_rate']}): without/with {round(b / a, 2) if a and b else None}; "
              f"out tok/s {on['output_throughput_tok_s']} vs {off['output_throughput_tok_s']}")
PY
echo "total $(( $(date +%s) - start )) s; evidence, logs and pictures in $out"
