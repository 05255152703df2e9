#!/usr/bin/env bash
# One GPU session's checks (GPU data-path issue), in order of value. Every part writes under
# $OUT, runs under `timeout`, and the whole script stays within BUDGET_S seconds (default 480:
# a part gets min(its limit, what is left); the policy comparison gets the rest but ~40 s and
# drops rates that would not fit). A part that fails does not stop the others. Ends by
# printing each part's RESULT line (results.txt).
#
# Before (on the build host): mkdir -p .gpu-kit && cp -r ../shared/models ../shared/traces .gpu-kit/
# On the device machine (carry .gpu-kit):
#   SUPERINFER_KIT=$(pwd)/.gpu-kit PYTHONPATH=$(pwd) bash bench/gpu/run_all.sh
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-$(pwd)/gpu-out}
mkdir -p "$OUT"
export OUT
PY=${PYTHON:-python3}
export PY
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
export SUPERINFER_KIT=${SUPERINFER_KIT:-$(pwd)/.gpu-kit}
unset TRITON_INTERPRET
BUDGET_S=${BUDGET_S:-480}
START=$(date +%s)
PARTS=()

left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }

run() {  # name, limit seconds, command...
  local name=$1 limit=$2; shift 2
  local remaining
  remaining=$(left)
  PARTS+=("$name")
  if (( remaining < 20 )); then
    echo "=== $name skipped: ${remaining}s of the budget left" | tee -a "$OUT/summary.txt"
    return
  fi
  (( limit > remaining )) && limit=$remaining
  echo "=== $name (limit ${limit}s, $(( $(date +%s) - START ))s in)" | tee -a "$OUT/summary.txt"
  local t0
  t0=$(date +%s)
  # via bash -c: a part may be one of the functions below (exported)
  timeout -k 5 "$limit" bash -c '"$@"' _ "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "rc=$rc took=$(( $(date +%s) - t0 ))s" | tee -a "$OUT/summary.txt"
  tail -n 3 "$OUT/$name.log" | tee -a "$OUT/summary.txt"
}

# pytest's summary as a RESULT line: the GPU tests' verdict sits with the benchmarks'.
gpu_tests() {
  "$PY" -m pytest -q -p no:cacheprovider -rfE "$@"
  local rc=$? summary counts="" kind n
  summary=$(grep -E '[0-9]+ (passed|failed|error)' "$OUT/gpu_tests.log" | tail -n 1)
  for kind in passed failed errors skipped; do
    n=$(grep -oE "[0-9]+ ${kind%s}s?" <<<"$summary" | head -n 1 | cut -d' ' -f1)
    counts+=" $kind=${n:-0}"
  done
  echo "RESULT gpu_tests rc=$rc$counts"
  return $rc
}

# `superinfer profile` (lab/profile.py) without the CLI's other imports, then its fit.
profile() {
  "$PY" - "$@" <<'EOF' || return $?
import argparse, sys
from lab.profile import add_profile_arguments, run_profile
parser = argparse.ArgumentParser(prog="superinfer profile")
add_profile_arguments(parser)
sys.exit(run_profile(parser.parse_args(sys.argv[1:])))
EOF
  "$PY" - "$OUT/profile_cuda.json" <<'EOF'
import json, sys
p = json.load(open(sys.argv[1]))
f = p["_fit"]
print(f"RESULT profile intercept_ms={1e3 * f['intercept_s']:.3f}"
      f" us_per_prefill_token={1e6 * f['prefill_token_s']:.3f}"
      f" us_per_context_token={1e6 * f['context_token_s']:.4f} r2={f['r_squared']:.3f}"
      f" link_h2d_gbps={p['link_h2d_bytes_s'] / 1e9:.1f} link_d2h_gbps={p['link_d2h_bytes_s'] / 1e9:.1f}"
      f" link_duplex_gbps={p['link_duplex_bytes_s'] / 1e9:.1f}")
EOF
}
export -f gpu_tests profile

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$PY" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"
  "$PY" -c "import triton; print('triton', triton.__version__)"
  "$PY" -c "import transformers; print('transformers', transformers.__version__)"
  ls "$SUPERINFER_KIT" 2>&1
} >"$OUT/gpu.txt" 2>&1

# Correctness first: kernels (compiled) against the torch path, graphs, engine vs CPU.
run gpu_tests 80 gpu_tests tests/data_plane/test_triton_attention.py \
  tests/data_plane/test_cuda_graphs.py tests/data_plane/test_gpu_engine.py \
  tests/data_plane/test_transfer_cuda.py
# (a) decode step: ours (graph / eager / torch path) vs transformers eager and + CUDA graph
run decode_step 75 "$PY" bench/gpu/decode_step.py
# (b) iteration time with and without B_xfer rotation traffic, overlap from CUDA events
run rotation_overlap 45 "$PY" bench/gpu/rotation_overlap.py
# the batched sampler against the per-row one it replaced, on the device
run sampler 20 "$PY" bench/sampler.py --repeats 1 --device cuda
# (d) vllm vs lvf, the engine in real time on the 8B shape: what is left but ~40 s (it drops
# its last rate when that would not fit)
E2E_BUDGET=$(( $(left) - 40 ))
run policy_e2e "$E2E_BUDGET" "$PY" bench/gpu/policy_e2e.py --budget-s "$(( E2E_BUDGET - 5 ))"
# (c) DuplexKV bandwidth against the same run's ceiling (measured before at 4 GiB each way)
run duplexkv 25 "$PY" bench/gpu/duplexkv.py --gib-each-way 1
# (e) the fitted profile of the engine on this device (`superinfer profile --device cuda`)
run profile 25 profile --model tiny-random --device cuda --transfer-backend cuda --repeats 2 \
  --out "$OUT/profile_cuda.json"

echo "=== RESULT lines ($(( $(date +%s) - START ))s)" | tee -a "$OUT/summary.txt"
: >"$OUT/results.txt"
for name in "${PARTS[@]}"; do
  line=$(grep -h '^RESULT' "$OUT/$name.log" 2>/dev/null | tail -n 1)
  echo "${line:-RESULT $name missing (see $name.log)}" | tee -a "$OUT/results.txt"
done
