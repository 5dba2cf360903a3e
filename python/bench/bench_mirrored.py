"""MirroredStrategy scaling: steps per second on 2 replicas against 1, and gradient bytes.

On the two-GPU machine through ../shared/tf_gpu/:

  bash .tfgpu/run.sh python3 python/bench/bench_mirrored.py --model dlrm
  bash .tfgpu/run.sh python3 python/bench/bench_mirrored.py --model pkm

Replicas (--replicas): "auto" takes two GPUs with NCCL all-reduce where two are visible;
with one GPU it splits it into two logical GPUs (a dry run of the code path: the two
replicas share one GPU, so the speed is not a scaling figure and the table says so); with
no GPU, two logical CPU devices.

Models, each trained by `model.fit` on synthetic data with the same global batch on 1 and
on 2 replicas (Keras SGD; ids uniform over the table):
  dlrm  8 EmbeddingBag tables of --rows x 64 (sum of bags of 20), features concatenated,
        MLP 512-256-1; global batch 8,192
  pkm   ProductKeyMemory(1024, n_keys=512 (262,144 slots), k_dim=256, heads=4, knn=32)
        on a 512-wide input; global batch 4,096 tokens

Gradient bytes per step, from the ids of one step: under MirroredStrategy TensorFlow
gathers IndexedSlices gradients across replicas instead of all-reducing them, so each
replica sends its deduplicated rows (U_r x D values + U_r ids). "sparse_as_dense" (what
Horovod's workaround sends) all-reduces each replica's dense [N, D] table gradient. The
dense weights (MLP, query network, keys) are all-reduced in both and counted in both.
Writes a JSON copy with --json.
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

import tensorflow as tf


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["dlrm", "pkm"], default="dlrm")
    parser.add_argument(
        "--replicas", choices=["auto", "two_gpus", "one_gpu_split", "cpu"], default="auto"
    )
    parser.add_argument("--rows", type=int, default=1_000_000, help="dlrm: rows per table")
    parser.add_argument("--batch", type=int, default=None, help="global batch")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run")
    parser.add_argument("--json", default=None)
    return parser.parse_args(argv)


def configure(kind: str):
    """Sets the devices up (before TensorFlow initialises them); returns the kind used,
    the two replicas' devices and the cross-device ops."""
    gpus = tf.config.list_physical_devices("GPU")
    if kind == "auto":
        kind = "two_gpus" if len(gpus) >= 2 else "one_gpu_split" if gpus else "cpu"
    if kind == "two_gpus":
        return kind, ["/gpu:0", "/gpu:1"], tf.distribute.NcclAllReduce()
    if kind == "one_gpu_split":
        half = 60 * 1024  # MiB each
        tf.config.set_logical_device_configuration(
            gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=half)] * 2
        )
        return kind, ["/gpu:0", "/gpu:1"], tf.distribute.ReductionToOneDevice("/gpu:0")
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    return kind, ["/cpu:0", "/cpu:1"], None


def make_data(args, rng):
    if args.model == "dlrm":
        batch = args.batch or 8192
        ids = rng.integers(0, args.rows, size=(8, batch, 20))
        x = {f"t{t}": ids[t] for t in range(8)}
        return x, rng.random((batch, 1)).astype("float32"), batch
    batch = args.batch or 4096
    return (
        {"x": rng.standard_normal((batch, 512)).astype("float32")},
        rng.standard_normal((batch, 1024)).astype("float32"),
        batch,
    )


def build(args, strategy):
    import keras

    from tf_ttemb.layers import EmbeddingBag, ProductKeyMemory

    with strategy.scope():
        keras.utils.set_random_seed(1)
        if args.model == "dlrm":
            inputs = [keras.Input((20,), dtype="int64", name=f"t{t}") for t in range(8)]
            feats = [EmbeddingBag(args.rows, 64, name=f"table{t}")(i) for t, i in enumerate(inputs)]
            h = keras.layers.Concatenate()(feats)
            h = keras.layers.Dense(512, activation="relu")(h)
            h = keras.layers.Dense(256, activation="relu")(h)
            out = keras.layers.Dense(1)(h)
            model = keras.Model(inputs, out)
            loss = "mse"
        else:
            x = keras.Input((512,), name="x")
            out = ProductKeyMemory(
                1024, n_keys=512, k_dim=256, heads=4, knn=32, query_batchnorm=False, name="pkm"
            )(x)
            model = keras.Model(x, out)
            loss = "mse"
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss)
    return model


def steps_per_second(args, strategy, x, y, batch) -> float:
    model = build(args, strategy)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True).repeat()
    model.fit(ds, steps_per_epoch=3, epochs=1, verbose=0)  # trace and warm up
    start = time.perf_counter()
    model.fit(ds, steps_per_epoch=args.steps, epochs=1, verbose=0)
    return args.steps / (time.perf_counter() - start)


def gradient_bytes(args, x, batch, replicas: int) -> dict:
    """Bytes entering the cross-replica step for one step, gathered vs. sparse_as_dense."""
    share = batch // replicas
    if args.model == "dlrm":
        tables = [(x[f"t{t}"], args.rows, 64) for t in range(8)]
        dense_params = (8 * 64 * 512 + 512) + (512 * 256 + 256) + (256 + 1)
    else:
        # The values rows a step reads are data dependent (top-k of the query): take the
        # bound of distinct slots per replica, min(tokens x heads x knn, slots).
        tables = [(None, 512 * 512, 1024)]
        dense_params = 512 * 4 * 2 * 256 + 4 * 2 * 256 + 4 * 2 * 512 * 128
    gathered = dense = 0
    for ids, n, d in tables:
        for r in range(replicas):
            if ids is None:
                unique = min(share * 4 * 32, n)
            else:
                unique = np.unique(ids[r * share : (r + 1) * share]).size
            gathered += unique * (d * 4 + 8)
            dense += n * d * 4
    dense_weights = replicas * dense_params * 4
    return {
        "indexed_slices_gathered": gathered + dense_weights,
        "sparse_as_dense": dense + dense_weights,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    kind, devices, cross = configure(args.replicas)
    tf.config.experimental.enable_tensor_float_32_execution(True)  # users' default
    rng = np.random.default_rng(0)
    x, y, batch = make_data(args, rng)
    one = steps_per_second(args, tf.distribute.OneDeviceStrategy(devices[0]), x, y, batch)
    two = steps_per_second(
        args, tf.distribute.MirroredStrategy(devices, cross_device_ops=cross), x, y, batch
    )
    grads = gradient_bytes(args, x, batch, 2)
    note = (
        ""
        if kind == "two_gpus"
        else ("  (not a scaling figure: the two replicas share one device)")
    )
    print(f"{args.model}: global batch {batch}; replicas on {kind} {devices}")
    print(f"  1 replica  {one:8.2f} steps/s")
    print(f"  2 replicas {two:8.2f} steps/s   speed-up {two / one:.2f}x{note}")
    print(
        f"  gradient bytes per step: IndexedSlices gathered "
        f"{grads['indexed_slices_gathered'] / 2**20:,.1f} MiB, sparse_as_dense "
        f"{grads['sparse_as_dense'] / 2**20:,.1f} MiB "
        f"({grads['sparse_as_dense'] / grads['indexed_slices_gathered']:.1f}x more)"
    )
    _bench_util.write_json_if_asked(
        args.json,
        {
            "model": args.model,
            "kind": kind,
            "devices": devices,
            "batch": batch,
            "steps_per_s_1": one,
            "steps_per_s_2": two,
            **grads,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
