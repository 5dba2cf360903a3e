"""TensorFlow ops per `tf_ttemb.gather_reduce_sum` lookup, forward and forward + backward.

  .venv/bin/python python/bench/count_lookup_ops.py

Traces one lookup on a `tf.Variable` table inside a `tf.function` for dense `[B, L]` ids
and for ragged ids, each with weights, and counts the ops of the traced graph by type
(placeholders, constants, identities and variable reads left out). These are the ops
TensorFlow builds; Grappler may fold the shape arithmetic of static shapes before it runs
the graph. Prints one line per case; `--json PATH` writes the counts.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_util

_bench_util.add_checkout_to_path()

import tensorflow as tf

import tf_ttemb

SKIPPED = ("Placeholder", "Const", "NoOp", "Identity", "ReadVariableOp")


def count_ops(fn, *specs) -> collections.Counter:
    graph = tf.function(fn).get_concrete_function(*specs).graph
    return collections.Counter(op.type for op in graph.get_operations() if op.type not in SKIPPED)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    table = tf.Variable(tf.zeros([1000, 16]))

    def forward(ids, weights):
        return tf_ttemb.gather_reduce_sum(table, ids, weights)

    def forward_backward(ids, weights):
        with tf.GradientTape() as tape:
            tape.watch(weights)
            out = tf_ttemb.gather_reduce_sum(table, ids, weights)
        return tape.gradient(out, [table, weights])

    forms = {
        "dense [B, L]": (tf.TensorSpec([64, 20], tf.int64), tf.TensorSpec([64, 20], tf.float32)),
        "ragged": (
            tf.RaggedTensorSpec([64, None], tf.int64, ragged_rank=1),
            tf.RaggedTensorSpec([64, None], tf.float32, ragged_rank=1),
        ),
    }
    results = {}
    for form, specs in forms.items():
        for step, fn in (("forward", forward), ("forward + backward", forward_backward)):
            counts = count_ops(fn, *specs)
            results[f"{form}, {step}"] = dict(counts)
            listed = ", ".join(f"{name} {n}" for name, n in sorted(counts.items()))
            print(f"{form}, {step}: {sum(counts.values())} ops ({listed})")
    if args.json:
        _bench_util.write_json(args.json, results, indent=1, announce=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
