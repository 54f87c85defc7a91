#!/usr/bin/env bash
# Both step models in one command: tools/sweep_h200.sh (the rate sweep on workloads/sweep-random.jsonl, then
# sweep-prefix and sweep-multi-turn with and without the prefix cache) once in nano-vllm's step model
# (--no-mixed-batches) and once with mixed steps (--mixed-batches), each into a folder of its own, then both
# summaries one after the other.
#
# usage: tools/step_models_h200.sh [OUT_DIR]     (default runs/step-models; OUT_DIR/step-model and OUT_DIR/mixed)
# The same overrides as tools/sweep_h200.sh (MODEL_DIR, RATES, CACHE_RATE, WORKLOADS, DEVICE); ENGINE is the
# engine options both runs share (the step model's switch is added here).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/step-models}
engine=${ENGINE:---max-num-seqs 256 --max-active 256 --queue-size 1024 --max-num-batched-tokens 16384 --max-model-len 2048 --graph --overlap}
for side in step-model mixed; do
  flag=--no-mixed-batches; [ "$side" = mixed ] && flag=--mixed-batches
  echo "== $side ($flag)"
  ENGINE="$engine $flag" tools/sweep_h200.sh "$out/$side" > "$out-$side.log" 2>&1 || true
  sed -n '/^sweep (/,$p' "$out-$side.log"
done
