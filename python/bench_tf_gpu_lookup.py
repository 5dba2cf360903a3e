"""EmbeddingBag through TensorFlow on the GPU: per-call and in-graph times, torch alongside.

On the GPU machine through ../shared/tf_gpu/:

  bash .tfgpu/run.sh python3 python/bench_tf_gpu_lookup.py --json "$OUT/lookup.json"

Cases (uniform ids, weighted sum, the public `tf_ttemb.gather_reduce_sum` on a
`tf.Variable` table and dense `[bags, L]` ids, as a layer calls it):
  dlrm       10M x 64 float32 table, 8,192 bags x 20
  pkm        262,144 x 1024 table (PKM values), 16,384 x 128, float32 and bfloat16

Times, all through TensorFlow, medians:
  fwd per call        one `tf.function` call running the lookup and fetching one element
  fwd in graph        `--steps` lookups in a `tf.while_loop` inside one call, divided
  fwd+bwd per call    output, IndexedSlices table gradient and weights gradient of a
                      random upstream gradient, one call
torch (when importable, CUDA events in this process): `embedding_bag(mode="sum",
per_sample_weights=...)`, forward, and forward + backward with a sparse table gradient.
The verdict column compares with the targets of issue 17. `gathered TB/s` is the bytes of
the rows the forward reads (bags x L x D x itemsize) over its in-graph time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_util

_bench_util.add_checkout_to_path()

import tensorflow as tf

import tf_ttemb

# name, rows, dim, bags, L, dtype, targets (ms; None: no target)
CASES = [
    ("dlrm", 10_000_000, 64, 8192, 20, "float32",
     {"fwd_in_graph": 0.07, "fwd_bwd_per_call": 0.5}),
    ("pkm", 262_144, 1024, 16_384, 128, "float32", {"fwd_bwd_per_call": 4.0}),
    ("pkm", 262_144, 1024, 16_384, 128, "bfloat16", {"fwd_bwd_per_call": 2.5}),
]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", default=None)
    return parser.parse_args(argv)


def time_tf(args, rows, dim, bags, length, dtype, rng) -> dict:
    dt = tf.as_dtype(dtype)
    with tf.device("/GPU:0"):
        table = tf.Variable(tf.cast(tf.random.normal([rows, dim], stddev=0.02), dt))
        ids = tf.constant(rng.integers(0, rows, size=(bags, length)), tf.int64)
        weights = tf.cast(tf.constant(rng.random((bags, length), np.float32)), dt)
        upstream = tf.cast(tf.constant(rng.standard_normal((bags, dim), np.float32)), dt)

    def fwd():
        return tf.cast(tf_ttemb.gather_reduce_sum(table, ids, weights)[0, 0], tf.float32)

    def fwd_bwd():
        with tf.GradientTape() as tape:
            tape.watch(weights)
            out = tf_ttemb.gather_reduce_sum(table, ids, weights)
        g_table, g_w = tape.gradient(out, [table, weights], output_gradients=upstream)
        return (tf.cast(g_table.values[0, 0], tf.float32) + tf.cast(g_w[0, 0], tf.float32)
                + tf.cast(out[0, 0], tf.float32))

    with tf.device("/GPU:0"):
        once = tf.function(fwd)
        both = tf.function(fwd_bwd)

        @tf.function
        def many():
            return tf.while_loop(lambda i, acc: i < args.steps,
                                 lambda i, acc: (i + 1, acc + fwd()),
                                 (tf.constant(0), tf.constant(0.0)))[1]

    out = {
        "fwd_per_call": _bench_util.time_calls(lambda: once().numpy(), 3, args.repeats).median_ms,
        "fwd_in_graph": _bench_util.time_calls(lambda: many().numpy(), 2,
                                               max(3, args.repeats // 3)).median_ms / args.steps,
        "fwd_bwd_per_call": _bench_util.time_calls(lambda: both().numpy(), 3,
                                                   args.repeats).median_ms,
    }
    out["gathered_tb_s"] = bags * length * dim * dt.size / (out["fwd_in_graph"] * 1e-3) / 1e12
    return out


def time_torch(args, rows, dim, bags, length, dtype, rng):
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    table = torch.nn.Parameter((torch.randn(rows, dim, device="cuda") * 0.02).to(dt))
    ids = torch.as_tensor(rng.integers(0, rows, size=(bags, length)), device="cuda")
    weights = torch.rand(bags, length, device="cuda", dtype=dt, requires_grad=True)
    upstream = torch.randn(bags, dim, device="cuda", dtype=dt)

    def fwd():
        return torch.nn.functional.embedding_bag(ids, table, mode="sum",
                                                 per_sample_weights=weights, sparse=True)

    def fwd_bwd():
        out = fwd()
        table.grad = None
        weights.grad = None
        out.backward(upstream)

    def cuda_ms(fn):
        for _ in range(3):
            fn()
        times = []
        for _ in range(args.repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return float(np.median(times))

    with torch.no_grad():
        fwd_ms = cuda_ms(fwd)
    return {"fwd": fwd_ms, "fwd_bwd": cuda_ms(fwd_bwd)}


def main(argv=None) -> int:
    args = parse_args(argv)
    if not tf.config.list_physical_devices("GPU"):
        raise SystemExit("needs a GPU that TensorFlow sees")
    rng = np.random.default_rng(0)
    results = []
    for name, rows, dim, bags, length, dtype, targets in CASES:
        tf_times = time_tf(args, rows, dim, bags, length, dtype, rng)
        torch_times = time_torch(args, rows, dim, bags, length, dtype, rng)
        row = {"case": name, "rows": rows, "dim": dim, "bags": bags, "L": length,
               "dtype": dtype, "tf": tf_times, "torch": torch_times, "targets": targets}
        results.append(row)
        verdicts = ", ".join(
            f"{k} {tf_times[k]:.3f} <= {v} {'PASS' if tf_times[k] <= v else 'MISS'}"
            for k, v in targets.items())
        torch_text = ("torch fwd {fwd:.3f} / fwd+bwd {fwd_bwd:.3f} ms".format(**torch_times)
                      if torch_times else "torch: not available")
        print(f"{name} {rows}x{dim} {bags}x{length} {dtype}: fwd per call "
              f"{tf_times['fwd_per_call']:.3f} ms, in graph {tf_times['fwd_in_graph']:.3f} ms "
              f"({tf_times['gathered_tb_s']:.2f} TB/s), fwd+bwd per call "
              f"{tf_times['fwd_bwd_per_call']:.3f} ms; {torch_text}; {verdicts}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
