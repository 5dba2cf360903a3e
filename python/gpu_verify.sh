#!/usr/bin/env bash
# The GPU checks of a session, on the GPU machine through ../shared/tf_gpu/, in two calls
# of under 10 minutes each; logs go to $OUT (or ./gpu_verify_out):
#
#   bash .tfgpu/run.sh bash python/gpu_verify.sh suite      # ~5 min
#   bash .tfgpu/run.sh bash python/gpu_verify.sh sanitize   # ~8 min
#
# suite:    the whole test suite with TensorFlow seeing the GPU (pytest -n 14), then the
#           lookup and sparse-apply benchmarks through TensorFlow.
# sanitize: the demo's first section on the GPU (its GPU case, 16,384 tokens at dim 1024),
#           then compute-sanitizer memcheck over the GPU test files (the jit tests apart: XLA's
#           own generated kernels are not ours) and racecheck over a float32 subset, at once.
# Each step has a time limit, so that a hang still leaves the other steps' logs.
set -u
out="${OUT:-gpu_verify_out}"
mkdir -p "$out"
case "${1:-}" in
  suite)
    timeout 330 python3 -m pytest -q -n 14 -p no:cacheprovider -rfE --tb=short tests \
      > "$out/suite.txt" 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed" "$out/suite.txt" | tail -40
    timeout 90 python3 python/bench_tf_gpu_lookup.py --repeats 9 --json "$out/lookup.json" \
      > "$out/lookup.txt" 2>&1
    grep -E "^(dlrm|pkm)|Error" "$out/lookup.txt"
    timeout 90 python3 python/bench_sparse_apply.py --json "$out/sparse_apply.json" \
      > "$out/sparse_apply.txt" 2>&1
    grep -E "per call|target" "$out/sparse_apply.txt"
    ;;
  sanitize)
    timeout 170 python3 -m tf_ttemb demo --sections gather_reduce_sum --out "$out/demo" \
      > "$out/demo.txt" 2>&1
    grep -v -E "^[IWE][0-9]{4} |━|^$" "$out/demo.txt" | tail -25
    files="tests/test_gather_reduce_sum.py tests/test_gather_reduce_sum_sparse_apply.py
      tests/test_tt_ops.py tests/test_tt_embedding.py tests/test_gpu_parity.py
      tests/test_variable_params.py tests/test_pkm_values_optimizer.py"
    # shellcheck disable=SC2086
    python3 python/gpu_memcheck.py --tool memcheck --shards 11 --timeout 360 \
      --out "$out/memcheck" -k "not jit and not xla" $files > "$out/memcheck.txt" 2>&1 &
    python3 python/gpu_memcheck.py --tool racecheck --shards 3 --timeout 360 \
      --out "$out/racecheck" -k "float32 and not jit and not xla and (params_grad or sparse_apply or forward)" \
      tests/test_gather_reduce_sum.py tests/test_gpu_parity.py > "$out/racecheck.txt" 2>&1
    wait
    grep -v "^          " "$out/memcheck.txt" | tail -15
    tail -6 "$out/racecheck.txt"
    ;;
  *)
    echo "usage: bash python/gpu_verify.sh suite|sanitize" >&2
    exit 2
    ;;
esac
