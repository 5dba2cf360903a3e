#!/usr/bin/env bash
# One GPU-machine call for the cached TT forward (issue 5's cache target) and the final
# sanitizer pass of the TT kernels. Logs and JSON go to $OUT.
#
#   bash python/gpu_harness/device_run_tt_cache.sh [LIB]
#
# LIB: a prebuilt libtf_ttemb_gpu_harness.so carried from the build machine (then the
# library is also rebuilt here in the background, into /tmp/h, to check that it builds);
# without it the library is built here first (bash python/gpu_harness/build_gpu_harness.sh /tmp/h).
# Steps: python/gpu_harness/gpu_check.py --only tt_cache (checks + benchmark, alone on the GPU), then in
# parallel: compute-sanitizer memcheck over `--only tt_cache --small`, racecheck over
# `--only tt --small --max-cases RACE_CASES` (0, the default: the whole 36-case small sweep,
# ~50 s of sweep under racecheck on the H200) and racecheck over `--only tt_cache --small
# --max-cases CACHE_RACE_CASES`.
set -uo pipefail
LIB="${1:-}"
source "$(dirname "${BASH_SOURCE[0]}")/device_run_common.sh"
LOG="$OUT/tt_cache.log"

gpu_facts "$LOG"
prepare_library /tmp/h /tmp/h

timeout "${CHECK_TIMEOUT:-200}" python3 python/gpu_harness/gpu_check.py --only tt_cache \
  --max-cases "${CACHE_CASES:-48}" --lib "$LIB" 2>&1 | tee -a "$LOG"
echo "check rc=${PIPESTATUS[0]}" | tee -a "$LOG"

export PYTORCH_NO_CUDA_MEMORY_CACHING=1
timeout "${MEMCHECK_TIMEOUT:-120}" compute-sanitizer --tool memcheck --leak-check no \
  --print-limit 20 python3 python/gpu_harness/gpu_check.py --only tt_cache --small --lib "$LIB" \
  > "$OUT/memcheck_tt_cache.log" 2>&1 &
MC=$!
timeout "${RACECHECK_TIMEOUT:-200}" compute-sanitizer --tool racecheck --print-limit 20 \
  python3 python/gpu_harness/gpu_check.py --only tt --small --max-cases "${RACE_CASES:-0}" --lib "$LIB" \
  > "$OUT/racecheck_tt.log" 2>&1 &
RC=$!
timeout "${RACECHECK_TIMEOUT:-170}" compute-sanitizer --tool racecheck --print-limit 20 \
  python3 python/gpu_harness/gpu_check.py --only tt_cache --small --max-cases "${CACHE_RACE_CASES:-6}" \
  --lib "$LIB" > "$OUT/racecheck_tt_cache.log" 2>&1 &
RC2=$!
wait "$MC"; echo "memcheck rc=$?" >> "$OUT/memcheck_tt_cache.log"
wait "$RC"; echo "racecheck rc=$?" >> "$OUT/racecheck_tt.log"
wait "$RC2"; echo "racecheck rc=$?" >> "$OUT/racecheck_tt_cache.log"
[ -n "$BUILD" ] && wait "$BUILD"
echo "== tails"
tail -n 5 "$OUT/memcheck_tt_cache.log" "$OUT/racecheck_tt.log" "$OUT/racecheck_tt_cache.log" \
  "$OUT/build_on_device.log"
