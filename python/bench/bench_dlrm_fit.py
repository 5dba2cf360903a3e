"""A small DLRM trained by `model.fit`: tf_ttemb's EmbeddingBag against Keras' Embedding.

  .venv/bin/python python/bench/bench_dlrm_fit.py --quick                  # CPU smoke, seconds
  bash .tfgpu/run.sh python3 python/bench/bench_dlrm_fit.py --json out.json  # the GPU machine

The model (issue 17's): `--tables` sparse features, each a table of `--rows` x `--dim`
float32 rows looked up by a weighted bag of `--bag` ids per example, plus 13 dense
features; the pooled embeddings and the dense features are concatenated into an MLP
512-256-1 with a logistic loss; plain SGD (learning rate 0.01), whose updates of the
tables are sparse in both models (Keras scatters IndexedSlices gradients).

* `tf_ttemb`: one `tf_ttemb.layers.EmbeddingBag(rows, dim)` per table, called with the
  ids and the weights: one fused op, the table gradient deduplicated IndexedSlices.
* `grouped`: one `tf_ttemb.layers.GroupedEmbeddingBag` of every table (one stacked
  table, one lookup, one IndexedSlices gradient).
* `keras`: one `keras.layers.Embedding(rows, dim)` per table, then
  `reduce_sum(rows * weights[..., None], axis=1)`: the [batch, bag, dim] rows are
  gathered, and the gradient has one row per looked-up id.

Both train on the same batches (uniform random ids, a fixed set of `--distinct-batches`
batches cycled, labels from a planted rule so the loss can fall) in the same process, one
after the other, then again in the other order; steps/s is taken from the wall-clock
time of the epochs after the first (which traces and warms up), ending on a fetched loss.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_util

_bench_util.add_checkout_to_path()

import keras
import tensorflow as tf

import tf_ttemb

DENSE_FEATURES = 13
HIDDEN = (512, 256)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--bag", type=int, default=20)
    parser.add_argument("--steps", type=int, default=50, help="steps per timed epoch")
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs (after one warm-up)")
    parser.add_argument("--distinct-batches", type=int, default=8)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="CPU smoke sizes: 4 tables of 10,000 x 16, batch 256, 5 steps",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.tables, args.rows, args.dim, args.batch, args.steps = 4, 10_000, 16, 256, 5
        args.epochs, args.distinct_batches = 1, 2
    return args


def make_dataset(args) -> tf.data.Dataset:
    """`distinct_batches` batches of (inputs, labels), cycled; labels from a planted rule."""
    rng = np.random.default_rng(0)
    n = args.batch * args.distinct_batches
    inputs = {"numeric": rng.standard_normal((n, DENSE_FEATURES)).astype(np.float32)}
    logit = inputs["numeric"][:, 0].copy()
    for t in range(args.tables):
        ids = rng.integers(0, args.rows, size=(n, args.bag), dtype=np.int64)
        inputs[f"ids{t}"] = ids
        inputs[f"w{t}"] = rng.random((n, args.bag), dtype=np.float32)
        logit += np.where(ids[:, 0] % 2 == 0, 0.5, -0.5)
    labels = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)[:, None]
    data = tf.data.Dataset.from_tensor_slices((inputs, labels)).batch(args.batch)
    return data.cache().repeat().prefetch(tf.data.AUTOTUNE)


class KerasEmbeddingBag(keras.layers.Layer):
    """`keras.layers.Embedding` followed by a weighted sum over the bag."""

    def __init__(self, rows: int, dim: int, **kwargs):
        super().__init__(**kwargs)
        self.embedding = keras.layers.Embedding(rows, dim)

    def call(self, ids, weights):
        return tf.reduce_sum(self.embedding(ids) * weights[..., None], axis=1)


def build_model(args, kind: str) -> keras.Model:
    inputs = {"numeric": keras.Input((DENSE_FEATURES,), name="numeric")}
    pooled = [inputs["numeric"]]
    for t in range(args.tables):
        inputs[f"ids{t}"] = keras.Input((args.bag,), dtype="int64", name=f"ids{t}")
        inputs[f"w{t}"] = keras.Input((args.bag,), name=f"w{t}")
    if kind == "grouped":
        features = [
            {"name": f"ids{t}", "input_dim": args.rows, "output_dim": args.dim}
            for t in range(args.tables)
        ]
        ids = {f"ids{t}": inputs[f"ids{t}"] for t in range(args.tables)}
        weights = {f"ids{t}": inputs[f"w{t}"] for t in range(args.tables)}
        pooled.append(tf_ttemb.layers.GroupedEmbeddingBag(features, name="tables")(ids, weights))
    for t in range(args.tables if kind != "grouped" else 0):
        ids, w = inputs[f"ids{t}"], inputs[f"w{t}"]
        if kind == "tf_ttemb":
            layer = tf_ttemb.layers.EmbeddingBag(args.rows, args.dim, name=f"table{t}")
        else:
            layer = KerasEmbeddingBag(args.rows, args.dim, name=f"table{t}")
        pooled.append(layer(ids, w))
    x = keras.layers.Concatenate()(pooled)
    for width in HIDDEN:
        x = keras.layers.Dense(width, activation="relu")(x)
    model = keras.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(
        optimizer=keras.optimizers.SGD(0.01), loss=keras.losses.BinaryCrossentropy(from_logits=True)
    )
    return model


class EpochTimer(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        # logs holds the epoch's loss as a Python float: the steps are done.
        self.seconds.append(time.perf_counter() - self.start)


def train(args, kind: str, data: tf.data.Dataset) -> dict:
    model = build_model(args, kind)
    timer = EpochTimer()
    history = model.fit(
        data, epochs=1 + args.epochs, steps_per_epoch=args.steps, callbacks=[timer], verbose=0
    )
    timed = timer.seconds[1:]
    return {
        "steps_per_s": args.steps * len(timed) / sum(timed),
        "loss": [float(x) for x in history.history["loss"]],
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    device = "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"
    data = make_dataset(args)
    runs = {"tf_ttemb": [], "grouped": [], "keras": []}
    for kind in ("tf_ttemb", "grouped", "keras", "keras", "grouped", "tf_ttemb"):
        result = train(args, kind, data)
        runs[kind].append(result)
        print(
            f"{kind:8s} {result['steps_per_s']:8.2f} steps/s, loss "
            + " -> ".join(f"{x:.4f}" for x in result["loss"]),
            flush=True,
        )
    best = {kind: max(r["steps_per_s"] for r in rs) for kind, rs in runs.items()}
    ratio = best["tf_ttemb"] / best["keras"]
    print(
        f"device {device}: {args.tables} tables {args.rows:,} x {args.dim}, batch "
        f"{args.batch:,} x bags of {args.bag}, MLP {'-'.join(map(str, HIDDEN))}-1, SGD: "
        f"tf_ttemb {best['tf_ttemb']:.2f} steps/s, keras Embedding {best['keras']:.2f} "
        f"steps/s = {ratio:.2f}x (target >= 2x: {'PASS' if ratio >= 2 else 'MISS'}); "
        f"GroupedEmbeddingBag {best['grouped']:.2f} steps/s = "
        f"{best['grouped'] / best['tf_ttemb']:.2f}x the EmbeddingBag layers",
        flush=True,
    )
    _bench_util.write_json_if_asked(
        args.json, {"args": vars(args), "device": device, "runs": runs, "ratio": ratio}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
