#!/usr/bin/env bash
# The GPU checks of a session, on the GPU machine through ../shared/tf_gpu/; logs go to
# $OUT (or ./gpu_verify_out). Steps run in the order given, each under a time limit, so
# that a hang still leaves the other steps' logs; keep one call under 10 minutes:
#
#   bash .tfgpu/run.sh bash python/gpu_harness/gpu_verify.sh suite                # ~5 min
#   bash .tfgpu/run.sh bash python/gpu_harness/gpu_verify.sh benches              # the lookups, fit
#   bash .tfgpu/run.sh bash python/gpu_harness/gpu_verify.sh demo sanitize        # ~8 min
#   TESTS="tests/test_fuzz.py tests/test_hostile_inputs.py" \
#     bash .tfgpu/run.sh bash python/gpu_harness/gpu_verify.sh tests              # the files named
#
# suite:    the whole test suite with TensorFlow seeing the GPU (pytest -n 14).
# tests:    the test files or node ids in $TESTS, the same way.
# benches:  the lookup (EmbeddingBag, TT) and DLRM model.fit benchmarks through TensorFlow
#           (python -X faulthandler: a crash names its Python line). The lookups are
#           `python -m tf_ttemb bench --preset dlrm,pkm,fbtt --device GPU:0`, run by
#           python/bench/bench_tf_gpu_lookup.py, which adds issue 17's targets' verdicts.
#           (*) Timed before the lookups ran through the bench (baselines, in-graph
#           fwd+bwd and chained times added): if suite + benches nears 10 minutes, run
#           benches in a call of its own.
# lookups:  the lookup part of benches alone; PRESETS=dlrm (or pkm, fbtt, comma-separated)
#           runs those presets only, LOOKUP_TIMEOUT its time limit (default 360 s).
# check_cost: what the GPU ops' id checks cost (bench_report_check.py): the forward and
#           TTRows with and without their report's check op, per call and in graph.
# grouped:  GroupedEmbeddingBag against separate layers (bench_grouped.py) and the ops a
#           lookup runs per device (count_lookup_ops.py --executed).
# trace:    a profiler trace of the grouped step (trace_grouped.py): per-thread host time,
#           device kernels, and one call's host and device timeline, in $out/trace.txt.
# sparse_apply: the sparse-apply benchmark against the plain backward.
# demo:     the demo's first section on the GPU (its GPU case, 16,384 tokens at dim 1024).
# demo_all: the whole demo (every section) on the GPU.
# sanitize: compute-sanitizer memcheck over the GPU test files (the jit tests apart: XLA's
#           own generated kernels are not ours) and racecheck over a float32 subset, at once.
# sanitize_quick: memcheck over the files of the gradients, the sparse apply, the TT ops and
#           the parity tests only (14 shards, ~2 min), or over the files in $FILES.
set -u
out="${OUT:-gpu_verify_out}"
mkdir -p "$out"
pytest_gpu() {  # log name, time limit, pytest arguments
  local log="$1" limit="$2"; shift 2
  timeout "$limit" python3 -m pytest -q -n 14 -p no:cacheprovider -rfEs --tb=short "$@" \
    > "$out/$log.txt" 2>&1
  grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$out/$log.txt" | tail -40
}
# Not under the sanitizers: the jit tests (XLA's generated kernels are not ours) and the
# determinism test whose training runs in fresh child processes, which
# `--target-processes application-only` leaves untracked (under the sanitizer it does not
# finish in 80 s; it runs in the suite).
sanitize_k="not jit and not xla and not bitwise_repeatable_under_op_determinism"
for step in "$@"; do
  echo "== $step"
  case "$step" in
    suite) pytest_gpu suite 540 tests ;;  # ~5 min; 330 s once cut the summary off
    # shellcheck disable=SC2086
    tests) pytest_gpu tests 300 ${TESTS:?set TESTS to the test files} ;;
    benches|lookups)
      presets="${PRESETS:-dlrm,pkm,fbtt}"
      timeout "${LOOKUP_TIMEOUT:-360}" python3 -X faulthandler python/bench/bench_tf_gpu_lookup.py \
        --repeats 9 --presets "$presets" --json "$out/lookup_${presets//,/_}.json" \
        > "$out/lookup_${presets//,/_}.txt" 2>&1
      echo "exit $?"
      grep -v -E "^[IWE][0-9]{4} |^WARNING|^bench: |^Wrote |^ *$" "$out/lookup_${presets//,/_}.txt" | head -60
      [ "$step" = lookups ] && continue
      timeout 150 python3 -X faulthandler python/bench/bench_dlrm_fit.py --steps 30 \
        --json "$out/dlrm_fit.json" > "$out/dlrm_fit.txt" 2>&1
      echo "exit $?"
      grep -E "steps/s|Error|Fatal|File " "$out/dlrm_fit.txt" | head -10
      ;;
    grouped)
      timeout 200 python3 -X faulthandler python/bench/bench_grouped.py --device GPU:0 ${GROUPED_ARGS:-} \
        --json "$out/grouped.json" > "$out/grouped.txt" 2>&1
      echo "exit $?"
      grep -E "^grouped|ms per call|Error|Fatal|File " "$out/grouped.txt" | head -10
      timeout 120 python3 python/bench/count_lookup_ops.py --executed --json "$out/ops.json" \
        > "$out/ops.txt" 2>&1
      grep -E "traced|executed" "$out/ops.txt" | head -30
      ;;
    trace)
      timeout 120 python3 python/bench/trace_grouped.py --device GPU:0 --out /tmp/trace_grouped \
        > "$out/trace.txt" 2>&1
      echo "exit $?"
      grep -E "traced:" "$out/trace.txt"
      ;;
    check_cost)
      timeout 150 python3 python/bench/bench_report_check.py --json "$out/check_cost.json" \
        > "$out/check_cost.txt" 2>&1
      echo "exit $?"
      grep -v -E "^[IWE][0-9]{4} |^WARNING|^ *$" "$out/check_cost.txt" | tail -14
      ;;
    sparse_apply)
      timeout 90 python3 python/bench/bench_sparse_apply.py --json "$out/sparse_apply.json" \
        > "$out/sparse_apply.txt" 2>&1
      grep -E "per call|target" "$out/sparse_apply.txt"
      ;;
    demo_all)
      timeout 300 python3 -m tf_ttemb demo --out "$out/demo_all" > "$out/demo_all.txt" 2>&1
      echo "exit $?"
      grep -v -E "^[IWE][0-9]{4} |━|^$" "$out/demo_all.txt" | grep -E "==|=>|AUC|bits|tokens|x " | tail -40
      ;;
    sanitize_quick)
      # shellcheck disable=SC2086
      python3 python/gpu_harness/gpu_memcheck.py --tool memcheck --shards 14 --timeout "${SANITIZE_TIMEOUT:-240}" \
        --out "$out/memcheck_quick" -k "$sanitize_k" ${FILES:-tests/test_variable_params.py \
        tests/test_gather_reduce_sum_sparse_apply.py tests/test_tt_ops.py tests/test_gpu_parity.py} \
        > "$out/memcheck_quick.txt" 2>&1
      grep -v "^          " "$out/memcheck_quick.txt" | tail -18
      ;;
    demo)
      timeout 150 python3 -m tf_ttemb demo --sections gather_reduce_sum --out "$out/demo" \
        > "$out/demo.txt" 2>&1
      echo "exit $?"
      grep -v -E "^[IWE][0-9]{4} |━|^$" "$out/demo.txt" | tail -25
      ;;
    sanitize)
      files="tests/test_gather_reduce_sum.py tests/test_gather_reduce_sum_errors.py
        tests/test_gather_reduce_sum_sparse_apply.py
        tests/test_tt_ops.py tests/test_tt_embedding.py tests/test_gpu_parity.py
        tests/test_variable_params.py tests/test_pkm_values_optimizer.py"
      # shellcheck disable=SC2086
      python3 python/gpu_harness/gpu_memcheck.py --tool memcheck --shards 11 --timeout 360 \
        --out "$out/memcheck" -k "$sanitize_k" $files > "$out/memcheck.txt" 2>&1 &
      python3 python/gpu_harness/gpu_memcheck.py --tool racecheck --shards 3 --timeout 360 \
        --out "$out/racecheck" \
        -k "float32 and not jit and not xla and (params_grad or sparse_apply or forward)" \
        tests/test_gather_reduce_sum.py tests/test_gpu_parity.py > "$out/racecheck.txt" 2>&1
      wait
      grep -v "^          " "$out/memcheck.txt" | tail -15
      tail -6 "$out/racecheck.txt"
      ;;
    *)
      echo "usage: bash python/gpu_harness/gpu_verify.sh suite|tests|benches|lookups|check_cost|grouped|trace|sparse_apply|demo|demo_all|sanitize|sanitize_quick ..." >&2
      exit 2
      ;;
  esac
done
