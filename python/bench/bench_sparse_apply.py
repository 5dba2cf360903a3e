"""Cost of the fused sparse update (GatherReduceSumSparseApply) against the plain backward.

Run from the checkout after `bash configure.sh` (on the GPU machine through
../shared/tf_gpu/: `bash .tfgpu/run.sh python3 python/bench/bench_sparse_apply.py`):

  .venv/bin/python python/bench/bench_sparse_apply.py                  # the PKM shape
  .venv/bin/python python/bench/bench_sparse_apply.py -N 65536 -D 256 -B 2048 -L 128
  .venv/bin/python python/bench/bench_sparse_apply.py --help

The default case is the PKM values table: N = 262,144 slots x D = 1024, 16,384 tokens x
128 (heads x knn) weighted entries per step (uniform ids), a weighted sum. It runs on the
device TensorFlow places the table on (the GPU when one is visible).

Cases, each the op TensorFlow runs for one training step of the table:

  backward        ResourceGatherReduceSumFusedGrad: the deduplicated IndexedSlices params
                  gradient [U, D] and the weights gradient (what the layer's backward
                  computes without a fused optimizer)
  apply_<opt>     GatherReduceSumSparseApply with optimizer <opt>: the same reduction, the
                  weights gradient, and the update of the U rows (and accumulators) in place
  backward+scatter  the backward, then `ResourceScatterSub(lr * values)`: the unfused SGD
                  update in TensorFlow ops, for reference

Two times per case, both through TensorFlow:

  per call   the median wall-clock time of one `tf.function` call that runs the op once
             and fetches one element (TensorFlow's per-call overhead included)
  in graph   one `tf.function` running the op `--steps` times in a `tf.while_loop`, its
             wall-clock time divided by `--steps` (the device time per op, as a step
             inside a longer graph sees it)

The verdict line compares the in-graph time of apply_sgd with that of backward (the
target: at most 1.3x). A JSON copy of the table is written with `--json`.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_util  # noqa: E402

_bench_util.add_checkout_to_path()

import tensorflow as tf  # noqa: E402

from tf_ttemb.ops import _loader  # noqa: E402

OPTIMIZERS = ("sgd", "rowwise_adagrad", "adagrad")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _bench_util.add_int_options(parser, num_rows=262_144, dim=1024, bags=16_384, bag_size=128)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    _bench_util.add_int_options(
        parser, steps=(20, "ops per in-graph call"), repeats=(10, "timed calls per case")
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the results to this file")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    lib = _loader.load_op_library()
    dtype = tf.as_dtype(args.dtype)
    rng = np.random.default_rng(args.seed)
    nnz = args.bags * args.bag_size
    device = "/GPU:0" if tf.config.list_physical_devices("GPU") else "/CPU:0"
    with tf.device(device):
        table = tf.Variable(
            tf.cast(rng.standard_normal((args.num_rows, args.dim), np.float32) * 0.02, dtype)
        )
        accumulators = {
            "rowwise_adagrad": tf.Variable(tf.zeros([args.num_rows], tf.float32)),
            "adagrad": tf.Variable(tf.zeros([args.num_rows, args.dim], tf.float32)),
        }
        ids = tf.constant(rng.integers(0, args.num_rows, nnz), tf.int64)
        splits = tf.constant(np.arange(args.bags + 1, dtype=np.int64) * args.bag_size)
        weights = tf.cast(tf.constant(rng.random(nnz, np.float32)), dtype)
        grad = tf.cast(tf.constant(rng.standard_normal((args.bags, args.dim), np.float32)), dtype)
        output = tf.zeros([args.bags, args.dim], dtype)  # read by mean/sqrtn only
        argmax = tf.zeros([0, args.dim], tf.int32)
    attrs = dict(combiner="sum", has_weights=True, padding_id=-1, has_padding_id=False)
    lr = tf.constant(1e-3, tf.float32)
    eps = tf.constant(1e-7, tf.float32)

    def backward():
        _, values, wgrad = lib.tf_ttemb_resource_gather_reduce_sum_fused_grad(
            grad, table.handle, ids, splits, weights, output, **attrs
        )
        return tf.cast(values[0, 0], tf.float32) + tf.cast(wgrad[0], tf.float32)

    def backward_scatter():
        unique, values, wgrad = lib.tf_ttemb_resource_gather_reduce_sum_fused_grad(
            grad, table.handle, ids, splits, weights, output, **attrs
        )
        table.scatter_sub(tf.IndexedSlices(values * tf.cast(lr, dtype), unique))
        return tf.cast(wgrad[0], tf.float32)

    def apply(optimizer):
        def run():
            wgrad = lib.tf_ttemb_gather_reduce_sum_sparse_apply(
                grad=grad,
                params=table.handle,
                indices=ids,
                row_splits=splits,
                weights=weights,
                output=output,
                argmax=argmax,
                learning_rate=lr,
                epsilon=eps,
                accumulators=[] if optimizer == "sgd" else [accumulators[optimizer].handle],
                optimizer=optimizer,
                **attrs,
            )
            return tf.cast(wgrad[0], tf.float32)

        return run

    cases = {"backward": backward}
    cases.update({f"apply_{o}": apply(o) for o in OPTIMIZERS})
    cases["backward+scatter"] = backward_scatter

    results = {}
    for name, body in cases.items():
        with tf.device(device):
            once = tf.function(body)
            many = _bench_util.chained_steps(tf, body, args.steps)

        per_call = _bench_util.time_calls(lambda: once().numpy(), 2, args.repeats).median_ms
        in_graph = (
            _bench_util.time_calls(lambda: many().numpy(), 2, max(3, args.repeats // 3)).median_ms
            / args.steps
        )
        results[name] = {"per_call_ms": per_call, "in_graph_ms": in_graph}
        print(f"{name:18s} per call {per_call:8.3f} ms   in graph {in_graph:8.3f} ms", flush=True)

    ratio = results["apply_sgd"]["in_graph_ms"] / results["backward"]["in_graph_ms"]
    verdict = "PASS" if ratio <= 1.3 else "MISS"
    print(
        f"device {device}; N={args.num_rows} D={args.dim} bags={args.bags} x {args.bag_size} "
        f"{args.dtype}: apply_sgd / backward (in graph) = {ratio:.2f}x "
        f"(target <= 1.3x): {verdict}"
    )
    _bench_util.write_json_if_asked(
        args.json,
        {
            "args": vars(args),
            "device": device,
            "results": results,
            "apply_sgd_over_backward": ratio,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
