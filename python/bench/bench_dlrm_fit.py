"""A small DLRM trained by `model.fit`: tf_ttemb's EmbeddingBag against Keras' Embedding,
and GroupedEmbeddingBag against the per-table EmbeddingBag model (`--parity`).

  .venv/bin/python python/bench/bench_dlrm_fit.py --quick                  # CPU smoke, seconds
  bash .tfgpu/run.sh python3 python/bench/bench_dlrm_fit.py --json out.json  # the GPU machine
  .venv/bin/python python/bench/bench_dlrm_fit.py --parity --arch dlrm --quick  # losses

The model (issue 17's, `--arch mlp`): `--tables` sparse features, each a table of `--rows`
x `--dim` float32 rows looked up by a weighted bag of `--bag` ids per example, plus 13
dense features; the pooled embeddings and the dense features are concatenated into an MLP
512-256-1 with a logistic loss; plain SGD (learning rate `--lr`, 0.01), whose updates of
the tables are sparse in both models (Keras scatters IndexedSlices gradients). `--arch dlrm`
is DLRM's own layout: a bottom MLP (512-256-`--dim`, ReLU) on the dense features, the
pairwise dot products of its output and the pooled embeddings (the interaction), those
concatenated with the bottom output into the top MLP 512-256-1.

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

`--parity` times nothing: it builds the per-table `tf_ttemb` model, copies its tables
(stacked) and dense weights into the `grouped` model, trains both by `model.fit` for
`--steps` steps on the same batches under the Keras dtype policy `--policy`, and prints
each step's loss of both and the largest relative differences of the losses and of the
tables after training (the issue's "same loss as the per-table model").
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
ARCHS = ("mlp", "dlrm")
POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")


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
    parser.add_argument("--lr", type=float, default=0.01, help="SGD's learning rate")
    parser.add_argument(
        "--arch", choices=ARCHS, default="mlp", help="mlp: issue 17's model; dlrm: see above"
    )
    parser.add_argument(
        "--parity",
        action="store_true",
        help="train grouped and per-table from the same weights and compare (no timing)",
    )
    parser.add_argument("--policy", choices=POLICIES, default="float32", help="with --parity")
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


def _mlp(x, widths, name: str, last_activation: str | None = "relu"):
    for i, width in enumerate(widths):
        activation = "relu" if i + 1 < len(widths) else last_activation
        x = keras.layers.Dense(width, activation=activation, name=f"{name}{i}")(x)
    return x


class DotInteraction(keras.layers.Layer):
    """DLRM's interaction: the dot products of every pair of the [B, D] inputs (i < j),
    [B, n (n - 1) / 2]."""

    def call(self, vectors):
        stacked = tf.stack(vectors, axis=1)  # [B, n, D]
        dots = tf.matmul(stacked, stacked, transpose_b=True)  # [B, n, n]
        n = len(vectors)
        pairs = [i * n + j for i in range(n) for j in range(i + 1, n)]
        return tf.gather(tf.reshape(dots, [-1, n * n]), pairs, axis=1)


def build_model(args, kind: str, hidden=HIDDEN) -> keras.Model:
    """The model of `kind` ("tf_ttemb", "grouped" or "keras") and `args.arch`; its dense
    layers are named ("top0", "bottom0", ...), its tables "table<t>" or "tables"."""
    inputs = {"numeric": keras.Input((DENSE_FEATURES,), name="numeric")}
    arch = getattr(args, "arch", "mlp")
    dense = inputs["numeric"]
    if arch == "dlrm":
        dense = _mlp(dense, tuple(hidden) + (args.dim,), "bottom")
    pooled = [dense]
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
        mode = "list" if arch == "dlrm" else "concat"  # the interaction takes each feature
        layer = tf_ttemb.layers.GroupedEmbeddingBag(features, output_mode=mode, name="tables")
        out = layer(ids, weights)
        pooled += out if mode == "list" else [out]
    for t in range(args.tables if kind != "grouped" else 0):
        ids, w = inputs[f"ids{t}"], inputs[f"w{t}"]
        if kind == "tf_ttemb":
            layer = tf_ttemb.layers.EmbeddingBag(args.rows, args.dim, name=f"table{t}")
        else:
            layer = KerasEmbeddingBag(args.rows, args.dim, name=f"table{t}")
        pooled.append(layer(ids, w))
    if arch == "dlrm":
        x = keras.layers.Concatenate()([dense, DotInteraction(name="interaction")(pooled)])
    else:
        x = keras.layers.Concatenate()(pooled)
    logits = _mlp(x, tuple(hidden) + (1,), "top", last_activation=None)
    # The logits in float32 (under a mixed policy, a float16 logit would round the loss).
    logits = keras.layers.Activation("linear", dtype="float32", name="logits")(logits)
    model = keras.Model(inputs, logits)
    model.compile(
        optimizer=keras.optimizers.SGD(getattr(args, "lr", 0.01)),
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
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


class StepLosses(keras.callbacks.Callback):
    """Each step's loss (`fit` with steps_per_epoch=1: an epoch's loss is its one step's)."""

    def __init__(self):
        super().__init__()
        self.losses = []

    def on_epoch_end(self, epoch, logs=None):
        self.losses.append(float(logs["loss"]))


def _relative_difference(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def parity(args, data: tf.data.Dataset, hidden=HIDDEN) -> dict:
    """The per-table model and the grouped one from the same weights, `args.steps` steps
    of `model.fit` each on the same batches under the dtype policy `args.policy`.

    Returns each step's losses, the tables before and after (per table, [rows, dim]) and
    the largest relative differences: of the losses, and of each table's change.
    """
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(args.policy)
    try:
        keras.utils.set_random_seed(0)
        models = {kind: build_model(args, kind, hidden) for kind in ("tf_ttemb", "grouped")}
    finally:
        keras.mixed_precision.set_global_policy(previous)
    separate, grouped = models["tf_ttemb"], models["grouped"]
    stack = grouped.get_layer("tables").stacked[args.dim]
    start = [separate.get_layer(f"table{t}").embeddings.numpy() for t in range(args.tables)]
    stack.assign(np.concatenate(start))
    for layer in separate.layers:
        if isinstance(layer, keras.layers.Dense):
            grouped.get_layer(layer.name).set_weights(layer.get_weights())
    losses, tables = {}, {}
    for kind, model in models.items():
        recorder = StepLosses()
        model.fit(
            data,
            epochs=args.steps,
            steps_per_epoch=1,
            callbacks=[recorder],
            shuffle=False,
            verbose=0,
        )
        losses[kind] = recorder.losses
    tables["tf_ttemb"] = [
        separate.get_layer(f"table{t}").embeddings.numpy() for t in range(args.tables)
    ]
    layer = grouped.get_layer("tables")
    tables["grouped"] = [layer.table(f"ids{t}").numpy() for t in range(args.tables)]
    moved = [g - s for g, s in zip(tables["tf_ttemb"], start)]
    return {
        "losses": losses,
        "start": start,
        "tables": tables,
        "loss_difference": _relative_difference(losses["grouped"], losses["tf_ttemb"]),
        "table_difference": max(
            _relative_difference(g - s, m) for g, s, m in zip(tables["grouped"], start, moved)
        ),
    }


def main_parity(args, data: tf.data.Dataset) -> int:
    result = parity(args, data)
    for kind in ("tf_ttemb", "grouped"):
        print(f"{kind:8s} loss " + " ".join(f"{x:.7f}" for x in result["losses"][kind]))
    print(
        f"{args.arch} model, {args.tables} tables {args.rows:,} x {args.dim}, batch "
        f"{args.batch:,} x bags of {args.bag}, policy {args.policy}, {args.steps} steps of "
        f"SGD: GroupedEmbeddingBag against the per-table EmbeddingBag model: losses differ "
        f"by {result['loss_difference']:.3g}, the tables' changes by "
        f"{result['table_difference']:.3g} (relative)",
        flush=True,
    )
    _bench_util.write_json_if_asked(
        args.json,
        {
            "args": vars(args),
            "losses": result["losses"],
            "loss_difference": result["loss_difference"],
            "table_difference": result["table_difference"],
        },
    )
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    device = "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"
    data = make_dataset(args)
    if args.parity:
        return main_parity(args, data)
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
        f"{args.batch:,} x bags of {args.bag}, {args.arch} model (MLP "
        f"{'-'.join(map(str, HIDDEN))}-1), SGD: "
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
