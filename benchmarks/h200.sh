#!/usr/bin/env bash
# One device session: the GPU tests and the benchmarks named as arguments, logs and JSON to $OUT.
#   bash benchmarks/h200.sh tests movement layer e2e profile recompute precision gemm
# Stages run in the order given; a failing stage is logged and the next one still runs.
set -u
export PYTHONPATH=$PWD MOEC_AUTOTUNE=${MOEC_AUTOTUNE:-0}
OUT=${OUT:-/tmp/moec_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/device.txt"
for stage in "$@"; do
  start=$(date +%s)
  case $stage in
    tests) python -m pytest -q -x tests/gpu ;;
    kernel-tests) python -m pytest -q tests/gpu/test_kernels_ops.py tests/gpu/test_sync_free.py ;;
    sync) python -m pytest -q tests/gpu/test_sync_free.py ;;
    movement) python -m benchmarks.movement --json "$OUT/movement.json" ;;
    layer) python benchmarks/moe_layer.py --json "$OUT/layer.json" ;;
    e2e) python benchmarks/e2e.py --steps 6 --warmup 3 --json "$OUT/e2e.json" ;;
    profile) python -m benchmarks.profile_step --shapes --moec-only --rows 30 ;;
    recompute) python -m benchmarks.recompute --full --steps 4 --out "$OUT/recompute_full.json" ;;
    precision) python benchmarks/precision_gemm.py --out "$OUT/precision_gemm.json" ;;
    gemm) python benchmarks/grouped_gemm.py --json "$OUT/gg.json" ;;
    *) echo "unknown stage $stage"; continue ;;
  esac > "$OUT/$stage.log" 2>&1
  echo "== $stage rc=$? $(( $(date +%s) - start ))s"
  tail -n 25 "$OUT/$stage.log"
done
