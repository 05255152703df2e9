#!/usr/bin/env bash
# One GPU session's checks, in order of value; every part writes under $OUT and is time-boxed.
# Usage on the device machine: OUT=/some/dir bash bench/gpu/run_all.sh
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-$(pwd)/gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
run() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s)" | tee -a "$OUT/summary.txt"
  local start=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "rc=$rc took=$(( $(date +%s) - start ))s" | tee -a "$OUT/summary.txt"
  tail -n 3 "$OUT/$name.log" | tee -a "$OUT/summary.txt"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
$PY -c "import torch, sys; print(sys.version, torch.__version__, torch.version.cuda)" >> "$OUT/gpu.txt" 2>&1
export SUPERINFER_KIT=$(pwd)/.gpu-kit
run gpu_tests 120 $PY -m pytest -q -m gpu -p no:cacheprovider tests/data_plane/test_transfer_cuda.py tests/data_plane/test_gpu_engine.py
run duplexkv 120 $PY bench/gpu/duplexkv.py
run decode_step 90 $PY bench/gpu/decode_step.py
grep -h '^RESULT' "$OUT"/*.log | tee "$OUT/results.txt"
