#!/usr/bin/env bash
# One full GPU-machine session for the CUDA kernels: check sweep + benchmarks,
# then compute-sanitizer memcheck and racecheck on a small sweep. Logs and JSON
# go to $OUT (at most 8 files come back).
#
#   bash python/gpu_harness/device_run.sh [LIB]   (e.g. .gpu_harness/libtf_ttemb_gpu_harness.so)
#
# LIB: a prebuilt libtf_ttemb_gpu_harness.so (carried from the build machine);
# without it the library is built here first. The build is also run here in
# the background into /tmp to check that it builds on this machine.
# ONLY=grs or ONLY=tt runs one section of python/gpu_harness/gpu_check.py (gather_reduce_sum
# or the TT embedding bags); unset runs both. The sanitizers run the same
# section's small sweep.
set -uo pipefail
LIB="${1:-}"
source "$(dirname "${BASH_SOURCE[0]}")/device_run_common.sh"
SECTION=()
[ -n "${ONLY:-}" ] && SECTION=(--only "$ONLY")

gpu_facts "$OUT/check.log"
prepare_library /tmp/rebuild
LIB_ARG=(--lib "$LIB")

timeout "${CHECK_TIMEOUT:-260}" python3 python/gpu_harness/gpu_check.py "${SECTION[@]}" "${LIB_ARG[@]}" 2>&1 | tee -a "$OUT/check.log"
echo "check rc=${PIPESTATUS[0]}" | tee -a "$OUT/check.log"

export PYTORCH_NO_CUDA_MEMORY_CACHING=1
timeout "${MEMCHECK_TIMEOUT:-110}" compute-sanitizer --tool memcheck --leak-check no \
  --print-limit 20 python3 python/gpu_harness/gpu_check.py --small "${SECTION[@]}" "${LIB_ARG[@]}" \
  > "$OUT/memcheck.log" 2>&1
echo "memcheck rc=$?" >> "$OUT/memcheck.log"
timeout "${RACECHECK_TIMEOUT:-60}" compute-sanitizer --tool racecheck --print-limit 20 \
  python3 python/gpu_harness/gpu_check.py --small --max-cases 40 "${SECTION[@]}" "${LIB_ARG[@]}" \
  > "$OUT/racecheck.log" 2>&1
echo "racecheck rc=$?" >> "$OUT/racecheck.log"
if [ "${NCU:-1}" = 1 ]; then
  timeout "${NCU_TIMEOUT:-90}" ncu --clock-control none \
    -k regex:"ForwardKernel|ReduceRunsKernel|ReduceSegmentsKernel|SortedEntryInfo|FusedWeightsGrad|DeviceRadixSort|LevelForwardKernel|LevelBackwardAKernel|CorePieceKernel" \
    --launch-count 14 --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section WarpStateStats --section MemoryWorkloadAnalysis \
    python3 python/gpu_harness/gpu_check.py --profile "${SECTION[@]}" "${LIB_ARG[@]}" > "$OUT/ncu.txt" 2>&1
  echo "ncu rc=$?" >> "$OUT/ncu.txt"
fi
[ -n "$BUILD" ] && wait "$BUILD"
echo "== tails"
tail -n 4 "$OUT/memcheck.log" "$OUT/racecheck.log" "$OUT/build_on_device.log"
