"""TensorFlow ops per `tf_ttemb.gather_reduce_sum` lookup, forward and forward + backward.

  .venv/bin/python python/bench/count_lookup_ops.py [--executed] [--json PATH]

Traces one lookup on a `tf.Variable` table inside a `tf.function` for dense `[B, L]` ids
and for ragged ids (weights on their own row_splits, or on the ids'), each with weights,
and counts the ops of the traced graph by type (placeholders, constants, identities,
variable handles and reads left out). These are the ops TensorFlow builds; Grappler may
fold the shape arithmetic of static shapes before it runs the graph.

`--executed` also counts the ops TensorFlow runs: the same lookups built in a
`tf.compat.v1` graph and run once by a session that returns its partition graphs (the
graphs after Grappler, split by device), counted per device with the same ops left out
and TensorFlow's own transfer and argument nodes (`_Send`, `_Recv`, `_Arg`, `_Retval`,
`_HostSend`, `_HostRecv`) left out too. On a GPU machine this is the number of kernels
of ours and of TensorFlow's that one lookup dispatches. Prints one line per case.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_util

_bench_util.add_checkout_to_path()

import numpy as np
import tensorflow as tf

import tf_ttemb

SKIPPED = ("Placeholder", "Const", "NoOp", "Identity", "ReadVariableOp", "VarHandleOp")
RUNTIME = ("_Send", "_Recv", "_Arg", "_Retval", "_HostSend", "_HostRecv", "_DeviceArg")
ROWS, DIM, BAGS, LENGTH = 1000, 16, 64, 20
SHARED = "ragged, weights on the ids' row_splits"


def count_ops(fn, *specs) -> collections.Counter:
    graph = tf.function(fn).get_concrete_function(*specs).graph
    return collections.Counter(op.type for op in graph.get_operations() if op.type not in SKIPPED)


def _lookup(table, ids, weights, backward: bool):
    if not backward:
        return [tf_ttemb.gather_reduce_sum(table, ids, weights)]
    with tf.GradientTape() as tape:
        tape.watch(weights if isinstance(weights, tf.Tensor) else weights.flat_values)
        out = tf_ttemb.gather_reduce_sum(table, ids, weights)
    watched = weights if isinstance(weights, tf.Tensor) else weights.flat_values
    table_grad, weights_grad = tape.gradient(out, [table, watched])
    return [out, table_grad.values, table_grad.indices, weights_grad]


def _feeds(form: str, rng: np.random.Generator):
    """Placeholders of one form and the values fed to them: (ids, weights, feed_dict)."""
    if form == "dense [B, L]":
        ids = tf.compat.v1.placeholder(tf.int64, [BAGS, LENGTH])
        weights = tf.compat.v1.placeholder(tf.float32, [BAGS, LENGTH])
        feed = {
            ids: rng.integers(0, ROWS, size=(BAGS, LENGTH)),
            weights: rng.random((BAGS, LENGTH), dtype=np.float32),
        }
        return ids, weights, feed
    values = tf.compat.v1.placeholder(tf.int64, [None])
    splits = tf.compat.v1.placeholder(tf.int64, [BAGS + 1])
    weight_splits = tf.compat.v1.placeholder(tf.int64, [BAGS + 1])  # equal, not the same
    flat_weights = tf.compat.v1.placeholder(tf.float32, [None])
    lengths = rng.integers(0, 2 * LENGTH, size=BAGS)
    row_splits = np.concatenate([[0], np.cumsum(lengths)])
    feed = {
        values: rng.integers(0, ROWS, size=row_splits[-1]),
        splits: row_splits,
        weight_splits: row_splits,
        flat_weights: rng.random(row_splits[-1], dtype=np.float32),
    }
    ids = tf.RaggedTensor.from_row_splits(values, splits, validate=False)
    if form == SHARED:
        del feed[weight_splits]
        return ids, ids.with_values(flat_weights), feed
    weights = tf.RaggedTensor.from_row_splits(flat_weights, weight_splits, validate=False)
    return ids, weights, feed


def count_executed(form: str, backward: bool) -> dict:
    """{device: Counter of op types} that a session runs for one lookup."""
    graph = tf.Graph()
    with graph.as_default():
        table = tf.Variable(tf.zeros([ROWS, DIM]))
        ids, weights, feed = _feeds(form, np.random.default_rng(0))
        fetches = _lookup(table, ids, weights, backward)
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(table.initializer)
            metadata = tf.compat.v1.RunMetadata()
            options = tf.compat.v1.RunOptions(output_partition_graphs=True)
            session.run(fetches, feed, options=options, run_metadata=metadata)
    by_device = {}
    for partition in metadata.partition_graphs:
        for node in partition.node:
            if node.op in SKIPPED or node.op in RUNTIME:
                continue
            device = node.device.rsplit("/", 1)[-1].replace("device:", "")
            by_device.setdefault(device, collections.Counter())[node.op] += 1
    return by_device


def _listed(counts: collections.Counter) -> str:
    return ", ".join(f"{name} {n}" for name, n in sorted(counts.items()))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--executed", action="store_true", help="also count the ops run")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    table = tf.Variable(tf.zeros([ROWS, DIM]))
    specs = {
        "dense [B, L]": (
            tf.TensorSpec([BAGS, LENGTH], tf.int64),
            tf.TensorSpec([BAGS, LENGTH], tf.float32),
        ),
        "ragged": (
            tf.RaggedTensorSpec([BAGS, None], tf.int64, ragged_rank=1),
            tf.RaggedTensorSpec([BAGS, None], tf.float32, ragged_rank=1),
        ),
        SHARED: (
            tf.RaggedTensorSpec([BAGS, None], tf.int64, ragged_rank=1),
            tf.TensorSpec([None], tf.float32),
        ),
    }
    results = {}
    for form, spec in specs.items():
        for step, backward in (("forward", False), ("forward + backward", True)):

            def lookup(ids, weights, backward=backward, form=form):
                if form == SHARED:
                    weights = ids.with_values(weights)
                return _lookup(table, ids, weights, backward)

            counts = count_ops(lookup, *spec)
            results[f"{form}, {step}"] = {"traced": dict(counts)}
            print(f"{form}, {step}: traced {sum(counts.values())} ops ({_listed(counts)})")
            if not args.executed:
                continue
            executed = count_executed(form, backward)
            results[f"{form}, {step}"]["executed"] = {d: dict(c) for d, c in executed.items()}
            for device, ran in sorted(executed.items()):
                print(f"  executed on {device}: {sum(ran.values())} ops ({_listed(ran)})")
    _bench_util.write_json_if_asked(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
