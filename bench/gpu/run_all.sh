#!/usr/bin/env bash
# One GPU session's checks (issue 33), in order of value. Built so that a first run on a device
# host cannot fail for a packaging reason and always returns what it measured:
# - the kit (.gpu-kit: models, traces and wheels of what the host may lack; `make gpu-kit` on
#   the build host) is installed first without pip or network (bench/gpu/kit.py install), and
#   every module the parts import is checked before minutes are spent (kit check);
# - every part runs under `timeout` and writes into one work folder ($WORK, the parts' $OUT),
#   packed into $OUT/gpu-results.tar.gz after each part (a timeout still returns everything
#   so far); the caller's $OUT holds only that archive, summary.txt and results.txt (the
#   device returns 8 files at most);
# - the whole script stays within BUDGET_S seconds (default 540: a part gets min(its limit,
#   what is left); the policy comparison gets the rest but ~40 s); a failing part does not
#   stop the others; results.txt ends with each part's RESULT line.
# `--dry-run`: every part on the CPU with a tiny model (the GPU tests collected, CUDA-only parts:
# their imports and arguments, `--help`), the same files and archive: tests/bench/test_gpu_run_all.py
# runs it.
#
# Before (on the build host): make gpu-kit
# On the device machine (carry .gpu-kit):  bash bench/gpu/run_all.sh
set -u
DRY_RUN=0
[[ "${1:-}" == "--dry-run" ]] && DRY_RUN=1
export PYTHONUNBUFFERED=1
RESULTS=${OUT:-$(pwd)/gpu-out}  # what comes back: the archive and the two summaries
WORK=${WORK:-$(mktemp -d)}
mkdir -p "$RESULTS" "$WORK"
export OUT=$WORK WORK  # the parts write their files (logs, JSON) into the work folder
PY=${PYTHON:-python3}
export PY
export SUPERINFER_KIT=${SUPERINFER_KIT:-$(pwd)/.gpu-kit}
export PYTHONPATH=$(pwd):$SUPERINFER_KIT/site${PYTHONPATH:+:$PYTHONPATH}
unset TRITON_INTERPRET
BUDGET_S=${BUDGET_S:-540}
START=$(date +%s)
PARTS=()

left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }

pack() {  # everything so far, into the one archive (and the two summaries beside it)
  cp "$WORK/summary.txt" "$RESULTS/summary.txt" 2>/dev/null
  tar -czf "$RESULTS/gpu-results.tar.gz.tmp" -C "$WORK" . && \
    mv "$RESULTS/gpu-results.tar.gz.tmp" "$RESULTS/gpu-results.tar.gz"
}

run() {  # name, limit seconds, command...
  local name=$1 limit=$2; shift 2
  local remaining
  remaining=$(left)
  PARTS+=("$name")
  if (( remaining < 20 )); then
    echo "=== $name skipped: ${remaining}s of the budget left" | tee -a "$WORK/summary.txt"
    return
  fi
  (( limit > remaining )) && limit=$remaining
  echo "=== $name (limit ${limit}s, $(( $(date +%s) - START ))s in)" | tee -a "$WORK/summary.txt"
  local t0
  t0=$(date +%s)
  # via bash -c: a part may be one of the functions below (exported)
  timeout -k 5 "$limit" bash -c '"$@"' _ "$@" >"$WORK/$name.log" 2>&1
  local rc=$?
  echo "rc=$rc took=$(( $(date +%s) - t0 ))s" | tee -a "$WORK/summary.txt"
  tail -n 3 "$WORK/$name.log" | tee -a "$WORK/summary.txt"
  pack
  return $rc
}

# pytest's summary as a RESULT line: the GPU tests' verdict sits with the benchmarks'.
gpu_tests() {
  "$PY" -m pytest -q -p no:cacheprovider -rfE "$@"
  local rc=$? summary counts="" kind n
  summary=$(grep -E '[0-9]+ (passed|failed|error|skipped)' "$WORK/gpu_tests.log" | tail -n 1)
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
  "$PY" - "$WORK/profile.json" <<'EOF'
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

# A CUDA-only part in the dry run: its imports and arguments (no RESULT to give on a CPU).
help_only() {  # name, command...
  local name=$1; shift
  "$@" --help >/dev/null && echo "RESULT $name dry_run=help_ok"
}
export -f gpu_tests profile help_only

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | head -n 3
  "$PY" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"
  "$PY" -c "import triton; print('triton', triton.__version__)" 2>&1 | tail -n 1
  "$PY" -c "import transformers; print('transformers', transformers.__version__)" 2>&1 | tail -n 1
  ls "$SUPERINFER_KIT" 2>&1
  echo "dry_run=$DRY_RUN"
} >"$WORK/gpu.txt" 2>&1

# The kit first: what the host lacks, unpacked from its wheels; then every part's imports.
"$PY" bench/gpu/kit.py install --kit "$SUPERINFER_KIT" >"$WORK/kit_install.log" 2>&1
if ! run kit_check 60 "$PY" bench/gpu/kit.py check; then
  echo "=== stopped: a module the parts import does not import (kit_check.log)" \
    | tee -a "$WORK/summary.txt"
fi

if (( DRY_RUN )); then
  TESTS=(--collect-only)  # the suite runs these tests' CPU parts itself: collection suffices
  DECODE=("$PY" bench/gpu/decode_step.py --device cpu --tiny --no-hf --batches 1,2 --context 64 --repeats 1)
  OVERLAP=(help_only rotation_overlap "$PY" bench/gpu/rotation_overlap.py)
  SAMPLER=("$PY" bench/sampler.py --quick --repeats 1 --device cpu)
  E2E=(--device cpu --tiny --duration 2 --drain 1 --rates 3 --no-sim --hbm-kv-gib 0.01 --dram-kv-gib 0.02)
  DUPLEX=(help_only duplexkv "$PY" bench/gpu/duplexkv.py)
  PROFILE=(profile --model tiny-random --device cpu --transfer-backend cpu --repeats 1 --out "$WORK/profile.json")
else
  TESTS=()
  DECODE=("$PY" bench/gpu/decode_step.py)
  OVERLAP=("$PY" bench/gpu/rotation_overlap.py)
  SAMPLER=("$PY" bench/sampler.py --repeats 1 --device cuda)
  E2E=()
  DUPLEX=("$PY" bench/gpu/duplexkv.py --gib-each-way 1)
  PROFILE=(profile --model tiny-random --device cuda --transfer-backend cuda --repeats 2 --out "$WORK/profile.json")
fi

if grep -q '^RESULT kit_check .* failed=0' "$WORK/kit_check.log" 2>/dev/null; then
  # Correctness first: kernels (compiled) against the torch path, graphs, engine vs CPU. A cold
  # Triton cache compiles 42+ kernels at 1-1.7 s each: the cap allows for it.
  run gpu_tests 240 gpu_tests "${TESTS[@]}" tests/data_plane/test_triton_attention.py \
    tests/data_plane/test_cuda_graphs.py tests/data_plane/test_gpu_engine.py \
    tests/data_plane/test_transfer_cuda.py
  # (a) decode step: ours (graph / eager / torch path) vs transformers eager and + CUDA graph
  run decode_step 75 "${DECODE[@]}"
  # (b) iteration time with and without B_xfer rotation traffic, overlap from CUDA events
  run rotation_overlap 45 "${OVERLAP[@]}"
  # the batched sampler against the per-row one it replaced, on the device
  run sampler 30 "${SAMPLER[@]}"
  # (d) vllm vs lvf, the engine in real time on the 8B shape: what is left but ~40 s (it drops
  # its last rate when that would not fit)
  E2E_BUDGET=$(( $(left) - 40 ))
  (( DRY_RUN )) && E2E_BUDGET=60
  run policy_e2e "$E2E_BUDGET" "$PY" bench/gpu/policy_e2e.py --budget-s "$(( E2E_BUDGET - 5 ))" \
    "${E2E[@]}"
  # (c) DuplexKV bandwidth against the same run's ceiling (measured before at 4 GiB each way)
  run duplexkv 25 "${DUPLEX[@]}"
  # (e) the fitted profile of the engine on this device (`superinfer profile`)
  run profile 25 "${PROFILE[@]}"
fi

echo "=== RESULT lines ($(( $(date +%s) - START ))s)" | tee -a "$WORK/summary.txt"
: >"$WORK/results.txt"
for name in "${PARTS[@]}"; do
  line=$(grep -h '^RESULT' "$WORK/$name.log" 2>/dev/null | tail -n 1)
  echo "${line:-RESULT $name missing (see $name.log)}" | tee -a "$WORK/results.txt"
done
cp "$WORK/results.txt" "$RESULTS/results.txt"
pack
