#!/usr/bin/env bash
# Builds the GPU harness library (the cuda/ kernels behind a C ABI, no
# TensorFlow) with nvcc alone:
#
#   bash python/gpu_harness/build_gpu_harness.sh [OUTPUT_DIR]     (default: build/gpu_harness)
#
# Writes OUTPUT_DIR/libtf_ttemb_gpu_harness.so; python/gpu_harness/harness.py loads it.
# NVCC (default: nvcc on PATH, else /usr/local/cuda/bin/nvcc) and
# NVCC_FLAGS (extra flags) may be set.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT_DIR="${1:-build/gpu_harness}"
NVCC="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
mkdir -p "$OUT_DIR"
FLAGS=(-arch=sm_90 -O3 -std=c++17 -Xcompiler -fPIC -I. ${NVCC_FLAGS:-})

# Every kernel family in cuda/, and the harness-only kernels and C-ABI files in
# python/gpu_harness/, compiled
# in parallel (one object each), then linked into one library.
OBJS=()
PIDS=()
for src in cuda/*.cu python/gpu_harness/*.cu; do
  obj="$OUT_DIR/$(echo "${src%.cu}" | tr '/' '_').o"
  "$NVCC" "${FLAGS[@]}" -c "$src" -o "$obj" &
  PIDS+=($!)
  OBJS+=("$obj")
done
for pid in "${PIDS[@]}"; do wait "$pid"; done
"$NVCC" -arch=sm_90 -shared "${OBJS[@]}" -o "$OUT_DIR/libtf_ttemb_gpu_harness.so"
echo "built $OUT_DIR/libtf_ttemb_gpu_harness.so"
