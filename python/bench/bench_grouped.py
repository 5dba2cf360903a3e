"""GroupedEmbeddingBag against 26 separate EmbeddingBag layers on a Criteo-like config, and
against one lookup of the same total rows (the device-time floor).

  .venv/bin/python python/bench/bench_grouped.py [--device GPU:0] [--scale 0.01]
  bash .tfgpu/run.sh python3 python/bench/bench_grouped.py --device GPU:0 --json "$OUT/g.json"

The config: 26 tables of D = 64 float32, row counts from 10 to 10M (Criteo's spread, times
`--scale`, at least 10), 23 one-hot features (bags of 1) and 3 multi-hot features (bags of
20), `--batch` examples (8,192), uniform ids. Cases, each a `tf.function` computing the
forward and the gradients of a random upstream gradient (IndexedSlices for the tables):
  grouped     one `GroupedEmbeddingBag` (one stacked [sum of rows, 64] table)
  separate    26 `EmbeddingBag` layers, outputs concatenated
  one_lookup  one `gather_reduce_sum` of all the ids at once on the stacked table, bags of
              the same sizes (what a single fused lookup of these rows costs)
`--parts` adds two cases, parts of the grouped step:
  group_bags  the features' ids through GroupBags and its check (`grouped.grouped_bags`)
  forward     the grouped forward alone
Times: per call (one call, ending in a 1-element fetch) and in graph (`--steps` steps with
their own ids inside one call, divided): medians of `--repeats` rounds (half as many in
graph) in which every case runs once, so that all cases see the same machine; and the
process's CPU time per call (all its threads), the figure to compare on a shared machine,
whose load (printed) moves the wall-clock times of a one-op step and of 26 ops run side by
side differently. Ratios: separate /
grouped (target >= 5x on the GPU, >= 2x on the CPU) and grouped / one_lookup (target
<= 1.5x on the GPU), from the in-graph times.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_util

_bench_util.add_checkout_to_path()

import numpy as np
import tensorflow as tf
from criteo import CRITEO_ROWS, DIM, MULTI_HOT

import tf_ttemb
from tf_ttemb.layers import EmbeddingBag, GroupedEmbeddingBag
from tf_ttemb.ops.grouped import grouped_bags


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="CPU:0")
    parser.add_argument(
        "--scale", type=float, default=None, help="row-count scale (GPU 1, CPU 0.02)"
    )
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--parts",
        action="store_true",
        help="also time the grouped step's parts: GroupBags alone and the forward alone",
    )
    return parser.parse_args(argv)


def criteo_config(device: str, scale=None):
    """(rows, bag sizes, GroupedEmbeddingBag feature configs) of the Criteo-like config,
    row counts times `scale` (default: 1 on a GPU, 0.02 on the CPU), at least 10."""
    scale = scale if scale is not None else (1.0 if "GPU" in device else 0.02)
    rows = [max(10, int(n * scale)) for n in CRITEO_ROWS]
    lengths = [MULTI_HOT.get(t, 1) for t in range(len(rows))]
    features = [
        {"name": f"c{t}", "input_dim": n, "output_dim": DIM, "initializer": "zeros"}
        for t, n in enumerate(rows)
    ]
    return rows, lengths, features


def id_batch(rng, rows, lengths, batch: int) -> list:
    """One batch of uniform ids: a [batch, L_t] int64 tensor per feature."""
    return [
        tf.constant(rng.integers(0, n, size=(batch, L)), tf.int64) for n, L in zip(rows, lengths)
    ]


def main(argv=None) -> int:
    args = parse_args(argv)
    scale = args.scale if args.scale is not None else (1.0 if "GPU" in args.device else 0.02)
    rows, lengths, features = criteo_config(args.device, scale)
    rng = np.random.default_rng(0)

    def batches(count):
        return [id_batch(rng, rows, lengths, args.batch) for _ in range(count)]

    _bench_util.log(
        f"{len(rows)} tables, {sum(rows):,} rows x {DIM}, batch {args.batch}, {args.device}"
    )
    with tf.device(args.device):
        data = batches(args.steps)
        upstream = tf.constant(rng.standard_normal((args.batch, DIM * len(rows)), np.float32))
        grouped = GroupedEmbeddingBag(features)
        grouped.build()
        stacked = grouped.stacked[DIM]
        separate = [EmbeddingBag(n, DIM, embeddings_initializer="zeros") for n in rows]
        for layer in separate:
            layer.build()
        offsets = np.concatenate([[0], np.cumsum(rows)[:-1]])

    def step_grouped(ids):
        with tf.GradientTape() as tape:
            out = grouped(ids)
        grad = tape.gradient(out, stacked, upstream)
        return out[0, 0] + grad.values[0, 0]

    def step_separate(ids):
        with tf.GradientTape() as tape:
            out = tf.concat([layer(i) for layer, i in zip(separate, ids)], 1)
        grads = tape.gradient(out, [layer.embeddings for layer in separate], upstream)
        return out[0, 0] + tf.add_n([g.values[0, 0] for g in grads])

    def step_one_lookup(ids):
        flat = tf.concat([tf.reshape(i + int(o), [-1]) for i, o in zip(ids, offsets)], 0)
        splits = tf.constant(
            np.concatenate([[0], np.cumsum(np.tile(lengths, args.batch))]), tf.int64
        )
        with tf.GradientTape() as tape:
            out = tf_ttemb.gather_reduce_sum(stacked, tf.RaggedTensor.from_row_splits(flat, splits))
        grad = tape.gradient(out, stacked, tf.reshape(upstream, [-1, DIM]))
        return out[0, 0] + grad.values[0, 0]

    def step_group_bags(ids):
        flat, _, _ = grouped_bags(tf.TensorSpec(stacked.shape, stacked.dtype), ids, num_rows=rows)
        return tf.cast(flat.flat_values[0] + flat.row_splits[-1], tf.float32)

    def step_forward(ids):
        return grouped(ids)[0, 0]

    cases = {"grouped": step_grouped, "separate": step_separate, "one_lookup": step_one_lookup}
    if args.parts:
        cases.update(group_bags=step_group_bags, forward=step_forward)
    once, many = {}, {}
    for name, step in cases.items():
        with tf.device(args.device):
            once[name] = tf.function(lambda step=step: step(data[0]))
            many[name] = tf.function(lambda step=step: tf.add_n([step(ids) for ids in data]))
        for _ in range(3):
            once[name]().numpy()
        for _ in range(2):
            many[name]().numpy()
    # Round-robin: each round times one call of every case, so that the cases' samples
    # see the same machine (a loaded host moves the per-call times by up to 1.6x between
    # runs; a ratio of medians taken at different moments moves with it).
    samples = {name: {"per_call": [], "cpu": [], "in_graph": []} for name in cases}
    for round_ in range(args.repeats):
        for name in cases:
            start, cpu_start = time.perf_counter(), time.process_time()
            once[name]().numpy()
            samples[name]["per_call"].append((time.perf_counter() - start) * 1e3)
            samples[name]["cpu"].append((time.process_time() - cpu_start) * 1e3)
        if round_ < max(3, args.repeats // 2):
            for name in cases:
                start = time.perf_counter()
                many[name]().numpy()
                samples[name]["in_graph"].append((time.perf_counter() - start) * 1e3 / args.steps)
    results = {}
    for name in cases:
        per_call, cpu_ms, in_graph = (
            statistics.median(samples[name][k]) for k in ("per_call", "cpu", "in_graph")
        )
        results[name] = {"per_call_ms": per_call, "in_graph_ms": in_graph, "cpu_ms": cpu_ms}
        _bench_util.log(
            f"{name}: {'fwd+bwd ' if name in ('grouped', 'separate', 'one_lookup') else ''}"
            f"{per_call:.3f} ms per call, {in_graph:.3f} ms in graph, "
            f"{cpu_ms:.3f} ms of CPU time per call"
        )
    g, s, o = (results[k]["in_graph_ms"] for k in ("grouped", "separate", "one_lookup"))
    gp, sp = results["grouped"]["per_call_ms"], results["separate"]["per_call_ms"]
    print(
        f"grouped fwd+bwd: {gp:.3f} ms per call, {g:.3f} ms in graph; separate layers "
        f"{sp:.3f} / {s:.3f} ms: {sp / gp:.2f}x per call, {s / g:.2f}x in graph; one lookup of "
        f"the same rows {o:.3f} ms in graph: grouped / one lookup = {g / o:.2f}x; CPU time per "
        f"call {results['grouped']['cpu_ms']:.3f} / {results['separate']['cpu_ms']:.3f} ms: "
        f"{results['separate']['cpu_ms'] / results['grouped']['cpu_ms']:.2f}x; load average "
        f"{os.getloadavg()[0]:.2f}"
    )
    if args.json:
        results.update(device=args.device, scale=scale, rows=rows, batch=args.batch)
        _bench_util.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
