#!/usr/bin/env bash
# The FP8 KV cache and FlashAttention-2 on an H200, in four phases, each meant to fit a device call (10 minutes):
#
#   tools/gpu/fp8_and_flash.sh fp8-guards   # GPU kernel tests (fp8 and the default path), the kv-fp8 guard on triton
#                                           # and torch and as its checkpoint's command, the bf16 guard
#   tools/gpu/fp8_and_flash.sh fp8-bench    # nano-vllm workload with the bf16 cache, then the fp8 cache (one lease),
#                                           # the fp8 step budget at 256 x 1024
#   tools/gpu/fp8_and_flash.sh flash        # flash-attn built from .gpu/wheels/flash_attn-2.8.3.tar.gz (or a wheel
#                                           # built before, if .gpu/wheels holds one), doctor, GPU tests, the bf16 and
#                                           # graph guards with flash_attn, its float32/fp8 refusals, auto at float32
#   tools/gpu/fp8_and_flash.sh flash-bench  # (after flash, same machine) nano-vllm flash vs triton, attention bench
#
# Run from the repository root with `.gpu/wheels` carried (the sdist, 8.4 MB; `tools/build_flash_attn.sh --fetch`
# puts it there where PyPI is reachable). Logs and evidence go under $OUT (default ./gpu-out); the flash phase also
# leaves the wheel it built in $OUT/wheels (carry it back into .gpu/wheels to skip the build next time).
set -uo pipefail
cd "$(dirname "$0")/../.."
case "${1:-}" in
  fp8-guards|fp8-bench|flash|flash-bench) ;;
  *) echo "usage: tools/gpu/fp8_and_flash.sh fp8-guards|fp8-bench|flash|flash-bench" >&2; exit 2 ;;
esac
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT/logs" "$OUT/runs"
export PYTHONPATH="$PWD:$PWD/.gpu/site${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
status=0

step() {            # step NAME COMMAND...: run it, log it, note its exit code, go on
  local name=$1; shift
  local t0=$SECONDS
  echo "== $name: $*" | tee -a "$OUT/steps.txt"
  "$@" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  echo "   rc=$rc, $((SECONDS - t0)) s, last lines:" | tee -a "$OUT/steps.txt"
  tail -n 4 "$OUT/logs/$name.log" | sed 's/^/   | /' | tee -a "$OUT/steps.txt"
  [ $rc -eq 0 ] || status=1
  return 0
}

expect_refusal() {  # expect_refusal NAME COMMAND...: exit 2 with one line on stderr
  local name=$1; shift
  "$@" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  echo "== $name (expects exit 2, one line): rc=$rc: $(tail -n 1 "$OUT/logs/$name.log")" | tee -a "$OUT/steps.txt"
  [ $rc -eq 2 ] || status=1
}

fp8_guards() {
  step gpu-tests-fp8 $PY -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_gpu_kv_fp8.py tests/kernels/test_gpu_kernels.py
  step guard-kv-fp8-triton $PY -m labkit logits guard --suite baseline --kv-cache-dtype fp8 --dtype bfloat16 --device cuda \
       --attention triton --out "$OUT/runs/kv-fp8-triton.json"
  step guard-kv-fp8-torch $PY -m labkit logits guard --suite baseline --kv-cache-dtype fp8 --dtype bfloat16 --device cuda \
       --attention torch --out "$OUT/runs/kv-fp8-torch.json"
  step guard-kv-fp8-checkpoint $PY -m labkit logits guard --suite baseline --kv-cache-dtype fp8 --dtype bfloat16 --device cuda
  step guard-bf16-default $PY -m labkit logits guard --suite baseline --dtype bfloat16 --device cuda
  summary
}

fp8_bench() {
  step bench-nano-vllm-bf16 $PY -m labkit bench --workload nano-vllm --out "$OUT/runs/bench-nano-vllm-bf16.json"
  step bench-nano-vllm-fp8 $PY -m labkit bench --workload nano-vllm --kv-cache-dtype fp8 --out "$OUT/runs/bench-nano-vllm-fp8.json"
  step step-budget-fp8 $PY -m labkit bench --workload step-budget --kv-cache-dtype fp8 --out "$OUT/runs/step-budget-fp8.json"
  summary
}

summary() {
  $PY - "$OUT/runs" <<'PY' 2>&1 | tee -a "$OUT/steps.txt"
import json, sys
from pathlib import Path
d = Path(sys.argv[1])
def facts(name):
    p = d / name
    return json.loads(p.read_text())["facts"] if p.is_file() else None
b, f = facts("bench-nano-vllm-bf16.json"), facts("bench-nano-vllm-fp8.json")
if b and f:
    for name, x in (("bf16 cache", b), ("fp8 cache", f)):
        print(f"nano-vllm {name}: median {x.get('median_tok_s')} tok/s, bound {json.dumps(x.get('bound'))[:300]}")
    if b.get("median_tok_s") and f.get("median_tok_s"):
        print(f"fp8 / bf16 cache: {f['median_tok_s'] / b['median_tok_s']:.3f}x (the issue asks >= 1.4x)")
for g in ("kv-fp8-triton.json", "kv-fp8-torch.json"):
    x = facts(g)
    if x:
        print(g, {k: x.get(k) for k in ("worst_max_abs", "worst_rel_l2", "top1_flips", "unexplained_top1_flips")})
PY
}

flash() {
  if ls .gpu/wheels/flash_attn-2.8.3+labkit-*.whl >/dev/null 2>&1; then
    step flash-install $PY -m pip install --no-deps --no-index --force-reinstall --no-compile --target .gpu/site \
         .gpu/wheels/flash_attn-2.8.3+labkit-*.whl
  else
    step flash-build tools/build_flash_attn.sh --arch 90 --head-dims 128,64 --jobs 16 --out "$OUT/wheels" --target .gpu/site
  fi
  step doctor $PY -m labkit doctor --device cuda --out "$OUT/runs/doctor.json"
  step flash-import $PY -c "import flash_attn, json; from engine.attention import flash_support as f; print(flash_attn.__version__, json.dumps(f.installed()))"
  step gpu-tests-flash $PY -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_gpu_kernels.py
  step guard-bf16-flash $PY -m labkit logits guard --suite baseline --dtype bfloat16 --device cuda --attention flash_attn \
       --out "$OUT/runs/guard-bf16-flash.json"
  step guard-graph-flash $PY -m labkit logits guard --suite graph --device cuda --attention flash_attn \
       --out "$OUT/runs/guard-graph-flash.json"
  expect_refusal refuse-flash-float32 $PY -m labkit logits guard --suite baseline --dtype float32 --device cuda \
       --attention flash_attn --out "$OUT/runs/refused.json"
  expect_refusal refuse-flash-fp8 $PY -m labkit logits guard --suite baseline --kv-cache-dtype fp8 --dtype bfloat16 \
       --device cuda --attention flash_attn --out "$OUT/runs/refused.json"
  step auto-float32-takes-triton $PY -c "
from engine import LLMEngine
from labkit.assets.resolve import resolve_model
e = LLMEngine(str(resolve_model(None, 'cuda').path), device='cuda', dtype='float32', kvcache_block_size=256, max_model_len=512)
print('auto with float32 ->', e.describe()['attention_backend']); assert e.describe()['attention_backend'] == 'triton'"
}

flash_bench() {
  if ! $PY -c "import flash_attn" 2>/dev/null; then flash; fi
  step bench-nano-vllm-flash $PY -m labkit bench --workload nano-vllm --attention flash_attn --out "$OUT/runs/bench-nano-vllm-flash.json"
  step bench-nano-vllm-triton $PY -m labkit bench --workload nano-vllm --attention triton --out "$OUT/runs/bench-nano-vllm-triton.json"
  step bench-attention $PY -m labkit bench --workload attention --out "$OUT/runs/bench-attention.json"
}

case "${1:-}" in
  fp8-guards) fp8_guards ;;
  fp8-bench) fp8_bench ;;
  flash) flash ;;
  flash-bench) flash_bench ;;
esac
cp -r runs/. "$OUT/runs/" 2>/dev/null || true
echo "done: status $status (0: every step exited 0), steps in $OUT/steps.txt"
exit $status
