"""Where the time of a TT lookup goes through TensorFlow: its parts, per call and in graph.

At FBTT-Embedding's benchmark shape (N = 11M rows as TT, p = [200, 220, 250],
q = [4, 4, 4], ranks [32, 32]) and `--bags` bags of 20 uniform ids, each part is one
`tf.function` ending in a 1-element fetch, timed per call and in graph (`--steps`
independent lookups in one call, divided by the count), all parts alternately:

* `empty`: a `tf.function` returning a constant (TensorFlow's per-call floor);
* `unique`: `TTUniqueIds` alone (the batch's distinct global ids and every entry's slot);
* `unique+rows`: and `TTRows` on those ids;
* `forward`: `tf_ttemb.tt_embedding_bag` (the two, and the sum of each bag's rows);
* `fwd+grad`: forward and the cores' gradients (`TTEmbeddingBag(sparse=False)`, a tape);
* `sgd step`: one training step of `TTEmbeddingBag(sparse=True, optimizer="sgd")` (the
  backward applies SGD to the cores' touched rows in place): what `python -m tf_ttemb
  bench --preset fbtt` times as fwd+bwd.

On a CPU device two more parts time the two forms of the cores' gradient, each step built
from the raw ops (`unique+rows`, the bags' sum, then the backward for `upstream`):

* `fwd+bwd two ops`: `GatherReduceSumDenseGrad` writes the rows' gradient [U, D], then
  `TTRowsGrad` (the GPU's path, and the CPU's with a cache or max);
* `fwd+bwd bags grad`: `TTRowsBagsGrad` from the bags' gradient [B, D] (what `fwd+grad`
  runs on a CPU).

On the GPU machine: `bash .tfgpu/run.sh python3 python/bench/bench_tt_step_parts.py`.
`--quick` (a small table) checks the program on a CPU.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_util

_bench_util.add_checkout_to_path()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="GPU:0")
    _bench_util.add_int_options(parser, bags=512, steps=20, repeats=20, warmup=3)
    parser.add_argument("--quick", action="store_true", help="a small table, a few repeats")
    parser.add_argument("--json", default=None)
    return parser.parse_args(argv)


def parts(args):
    """name -> fn(ids) of each part, and the inputs."""
    import numpy as np
    import tensorflow as tf

    import tf_ttemb
    from tf_ttemb.layers import TTEmbeddingBag
    from tf_ttemb.ops import _loader

    rows, p, q, rank = (11_000_000, [200, 220, 250], [4, 4, 4], 32)
    if args.quick:
        rows, p, q, rank = (200, [5, 6, 7], [2, 2, 2], 4)
    length = 20
    rng = np.random.default_rng(0)
    inputs = [
        tf.constant(rng.integers(0, rows, size=(args.bags, length)), tf.int64)
        for _ in range(args.steps)
    ]
    upstream = tf.constant(rng.standard_normal((args.bags, int(np.prod(q)))).astype("float32"))

    def layer(sparse):
        made = TTEmbeddingBag(
            rows,
            int(np.prod(q)),
            tt_ranks=rank,
            tt_p_shapes=p,
            tt_q_shapes=q,
            combiner="sum",
            sparse=sparse,
            optimizer="sgd",
            learning_rate=0.01,
            seed=1,
            implementation="custom_op",
        )
        made.build(None)
        return made

    dense_layer, sparse_layer = layer(False), layer(True)
    cores = dense_layer.cores
    lib = _loader.load_op_library()
    attrs = dict(p_shapes=p, q_shapes=q, ranks=[rank, rank], num_tables=1)
    splits = tf.constant([0, args.bags * length], tf.int64)

    def unique(ids):
        return lib.tf_ttemb_tt_unique_ids(
            tf.reshape(ids, [-1]), splits, num_embeddings=rows, stride=int(np.prod(p))
        )

    def unique_rows(ids):
        unique_ids, _ = unique(ids)
        return lib.tf_ttemb_tt_rows(
            unique_ids, [tf.convert_to_tensor(c) for c in cores], **attrs
        ).rows

    def forward(ids):
        return tf_ttemb.tt_embedding_bag(
            cores,
            ids,
            num_embeddings=rows,
            p_shapes=p,
            q_shapes=q,
            ranks=[rank, rank],
            combiner="sum",
            implementation="custom_op",
        )

    def fwd_grad(ids):
        with tf.GradientTape() as tape:
            out = dense_layer(ids)
        return [out] + tape.gradient(out, dense_layer.trainable_variables, upstream)

    def sgd_step(ids):
        with tf.GradientTape() as tape:
            out = sparse_layer(ids)
        return [out] + tape.gradient(out, sparse_layer.trainable_variables, upstream)

    bag_attrs = dict(combiner="sum", has_weights=False, padding_id=-1, has_padding_id=True)
    empty = tf.zeros([0], tf.float32)

    def by_hand(two_ops):
        def step(ids):
            unique_ids, slots = unique(ids)
            core_values = [tf.convert_to_tensor(c) for c in cores]
            rows_out = lib.tf_ttemb_tt_rows(unique_ids, core_values, **attrs).rows
            row_splits = tf.range(0, args.bags * length + 1, length, dtype=tf.int64)
            out = lib.tf_ttemb_gather_reduce_sum(rows_out, slots, row_splits, empty, **bag_attrs)
            if two_ops:
                rows_grad = lib.tf_ttemb_gather_reduce_sum_dense_grad(
                    upstream,
                    slots,
                    row_splits,
                    empty,
                    out.argmax,
                    tf.shape(unique_ids, out_type=tf.int64)[0],
                    **bag_attrs,
                )
                grads = lib.tf_ttemb_tt_rows_grad(
                    unique_ids, core_values, rows_grad, empty, **attrs
                ).core_grad_values
            else:
                grads = lib.tf_ttemb_tt_rows_bags_grad(
                    unique_ids,
                    core_values,
                    upstream,
                    slots,
                    row_splits,
                    empty,
                    combiner="sum",
                    has_weights=False,
                    **attrs,
                ).core_grad_values
            return [out.output] + list(grads)

        return step

    on_cpu = {}
    if "CPU" in args.device.upper():  # TTRowsBagsGrad has no GPU kernel
        on_cpu = {"fwd+bwd two ops": by_hand(True), "fwd+bwd bags grad": by_hand(False)}
    return {
        **on_cpu,
        "empty": lambda ids: tf.constant([0.0]),
        "unique": lambda ids: unique(ids)[0],
        "unique+rows": unique_rows,
        "forward": forward,
        "fwd+grad": fwd_grad,
        "sgd step": sgd_step,
    }, inputs


def measure(args) -> list:
    import tensorflow as tf

    def probe(result):
        items = result if isinstance(result, (list, tuple)) else [result]
        total = tf.constant(0.0)
        for item in items:
            if isinstance(item, tf.IndexedSlices):
                item = item.values
            if item is not None:
                total += tf.cast(tf.reduce_sum(tf.reshape(item, [-1])[:1]), tf.float32)
        return total

    with tf.device(args.device):
        fns, inputs = parts(args)
        timed = _bench_util.time_per_call_and_in_graph(
            tf,
            {name: (lambda x, fn=fn: probe(fn(x))) for name, fn in fns.items()},
            inputs,
            args.warmup,
            args.repeats,
        )
    lookups = args.bags * 20
    return [
        dict(
            part=r["key"],
            kind=r["kind"],
            median_ms=r["median_ms"],
            min_ms=r["min_ms"],
            us_per_lookup=r["median_ms"] * 1e3 / lookups,
        )
        for r in timed
    ]


def main(argv=None) -> int:
    args = parse_args(argv)
    results = measure(args)
    print(f"device {args.device}; {args.bags:,} bags x 20; in graph: {args.steps} per call")
    rows = [
        [
            r["part"],
            r["kind"],
            f"{r['median_ms']:.4f}",
            f"{r['min_ms']:.4f}",
            f"{r['us_per_lookup']:.4f}",
        ]
        for r in results
    ]
    print(_bench_util.format_table(["part", "timing", "median ms", "min ms", "us/lookup"], rows))
    _bench_util.write_json_if_asked(args.json, {"device": args.device, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
