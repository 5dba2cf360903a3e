# What every GPU-machine session of the CUDA kernels starts with; sourced (not run) by
# device_run.sh and device_run_tt_cache.sh, with LIB set to their first argument:
# goes to the checkout root, makes $OUT (default /tmp/out) and defines gpu_facts and
# prepare_library.
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

# gpu_facts FILE: the GPU's name, memory, clocks and power limit (CSV) into FILE.
gpu_facts() {
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,clocks.mem,power.limit \
    --format=csv > "$1" 2>&1
}

# prepare_library REBUILD_DIR [BUILD_DIR]: when LIB is a prebuilt library that loads here,
# rebuilds it into REBUILD_DIR in the background, to check that it builds on this machine
# (BUILD = that job's pid); else builds it here first into BUILD_DIR (default
# build/gpu_harness), exits 1 if that fails, and points LIB at it (BUILD empty). The
# build's log: $OUT/build_on_device.log.
prepare_library() {
  local log="$OUT/build_on_device.log"
  BUILD=""
  if [ -n "$LIB" ] && python3 -c "import ctypes,sys; ctypes.CDLL(sys.argv[1])" "$LIB"; then
    (time bash python/gpu_harness/build_gpu_harness.sh "$1" > "$log" 2>&1;
     echo "rc=$?" >> "$log") 2>> "$log" &
    BUILD=$!
  else
    echo "no usable prebuilt library: building here" | tee "$log"
    (time bash python/gpu_harness/build_gpu_harness.sh ${2:+"$2"}) >> "$log" 2>&1 || exit 1
    LIB="${2:-build/gpu_harness}/libtf_ttemb_gpu_harness.so"
  fi
}
