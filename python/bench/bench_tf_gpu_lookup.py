"""EmbeddingBag and TT lookups through TensorFlow on the GPU: per-call and in-graph times,
torch alongside.

On the GPU machine through ../shared/tf_gpu/:

  bash .tfgpu/run.sh python3 python/bench/bench_tf_gpu_lookup.py --json "$OUT/lookup.json"

Cases (uniform ids; the public API on `tf.Variable` tables and dense `[bags, L]` ids, as
a layer calls it):
  dlrm       weighted sum, 10M x 64 float32 table, 8,192 bags x 20
  pkm        weighted sum, 262,144 x 1024 table (PKM values), 16,384 x 128, float32 and
             bfloat16
  tt         FBTT-Embedding's benchmark shape (N = 11M, p = [200, 220, 250], q = [4, 4, 4],
             ranks [32, 32]), sum of bags of 20, 512 and 65,536 bags: `tt_embedding_bag`
             forward, and one step of `TTEmbeddingBag(sparse=True, optimizer="sgd")`
             (forward, backward, the fused in-place core update); per lookup

Times, all through TensorFlow, medians:
  fwd per call        one `tf.function` call running the lookup and fetching one element
  fwd in graph        `--steps` independent lookups (each its own ids) inside one call,
                      summed at the end, divided: what a model of many tables sees
  chained             `--steps` lookups in a `tf.while_loop`, each iteration waiting for
                      the last: the latency of one lookup inside a graph
  fwd+bwd per call    output, IndexedSlices table gradient and weights gradient of a
                      random upstream gradient, one call (tt: the fused SGD step)
  fwd+bwd in graph    `--steps` independent forward + backward inside one call, divided
torch (CUDA events, in a child process started by this one: torch initialising CUDA in a
process that already runs TensorFlow on the GPU died of SIGFPE in torch.randn on the
H200 machine): `embedding_bag(mode="sum", per_sample_weights=...)`, forward, and forward
+ backward with a sparse table gradient. The verdict column compares with the targets of
issue 17. `gathered TB/s` is the bytes of the rows the forward reads (bags x L x D x
itemsize) over its in-graph time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_util

_bench_util.add_checkout_to_path()

tf = tf_ttemb = None  # imported by main(): the torch worker must not load TensorFlow

# name, rows, dim, bags, L, dtype, targets (ms; None: no target)
CASES = [
    ("dlrm", 10_000_000, 64, 8192, 20, "float32", {"fwd_in_graph": 0.07, "fwd_bwd_per_call": 0.5}),
    ("pkm", 262_144, 1024, 16_384, 128, "float32", {"fwd_bwd_per_call": 4.0}),
    ("pkm", 262_144, 1024, 16_384, 128, "bfloat16", {"fwd_bwd_per_call": 2.5}),
]
# name, bags, L, targets (microseconds per lookup)
TT_CASES = [
    ("tt", 512, 20, {"fwd_per_call_us": 0.03, "step_per_call_us": 0.06}),
    ("tt", 65_536, 20, {"step_per_call_us": 0.003}),
]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", default=None)
    parser.add_argument("--torch-worker", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def time_tf(args, rows, dim, bags, length, dtype, rng) -> dict:
    dt = tf.as_dtype(dtype)
    with tf.device("/GPU:0"):
        table = tf.Variable(tf.cast(tf.random.normal([rows, dim], stddev=0.02), dt))
        # One batch of ids per lookup of the in-graph runs, so that no two lookups are alike.
        ids_list = [
            tf.constant(rng.integers(0, rows, size=(bags, length)), tf.int64)
            for _ in range(max(1, args.steps))
        ]
        ids = ids_list[0]
        weights = tf.cast(tf.constant(rng.random((bags, length), np.float32)), dt)
        upstream = tf.cast(tf.constant(rng.standard_normal((bags, dim), np.float32)), dt)

    def fwd(ids=ids):
        return tf.cast(tf_ttemb.gather_reduce_sum(table, ids, weights)[0, 0], tf.float32)

    def fwd_bwd(ids=ids):
        with tf.GradientTape() as tape:
            tape.watch(weights)
            out = tf_ttemb.gather_reduce_sum(table, ids, weights)
        g_table, g_w = tape.gradient(out, [table, weights], output_gradients=upstream)
        return (
            tf.cast(g_table.values[0, 0], tf.float32)
            + tf.cast(g_w[0, 0], tf.float32)
            + tf.cast(out[0, 0], tf.float32)
        )

    with tf.device("/GPU:0"):
        once = tf.function(fwd)
        both = tf.function(fwd_bwd)

        @tf.function
        def chained():
            return tf.while_loop(
                lambda i, acc: i < args.steps,
                lambda i, acc: (i + 1, acc + fwd()),
                (tf.constant(0), tf.constant(0.0)),
            )[1]

        @tf.function
        def independent():
            return tf.add_n([fwd(k) for k in ids_list])

        @tf.function
        def independent_fwd_bwd():
            return tf.add_n([fwd_bwd(k) for k in ids_list])

    steps = len(ids_list)
    in_graph_repeats = max(3, args.repeats // 3)
    out = {
        "fwd_per_call": _bench_util.time_calls(lambda: once().numpy(), 3, args.repeats).median_ms,
        "fwd_in_graph": _bench_util.time_calls(
            lambda: independent().numpy(), 2, in_graph_repeats
        ).median_ms
        / steps,
        "fwd_in_graph_chained": _bench_util.time_calls(
            lambda: chained().numpy(), 2, in_graph_repeats
        ).median_ms
        / args.steps,
        "fwd_bwd_per_call": _bench_util.time_calls(
            lambda: both().numpy(), 3, args.repeats
        ).median_ms,
        "fwd_bwd_in_graph": _bench_util.time_calls(
            lambda: independent_fwd_bwd().numpy(), 2, in_graph_repeats
        ).median_ms
        / steps,
    }
    out["gathered_tb_s"] = bags * length * dim * dt.size / (out["fwd_in_graph"] * 1e-3) / 1e12
    return out


def _torch_times(repeats, rows, dim, bags, length, dtype, seed):
    """Runs in the torch worker process."""
    rng = np.random.default_rng(seed)
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
        return torch.nn.functional.embedding_bag(
            ids, table, mode="sum", per_sample_weights=weights, sparse=True
        )

    def fwd_bwd():
        out = fwd()
        table.grad = None
        weights.grad = None
        out.backward(upstream)

    def cuda_ms(fn):
        for _ in range(3):
            fn()
        times = []
        for _ in range(repeats):
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


def time_torch(args, rows, dim, bags, length, dtype, seed):
    """torch's times for a case, from a child process (None when torch or CUDA is not
    there, or the child fails: its error is printed)."""
    spec = json.dumps(
        {
            "repeats": args.repeats,
            "rows": rows,
            "dim": dim,
            "bags": bags,
            "length": length,
            "dtype": dtype,
            "seed": seed,
        }
    )
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--torch-worker", spec],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("{", "null"))]
    if proc.returncode != 0 or not lines:
        print(f"torch worker failed ({proc.returncode}): {proc.stderr[-500:]}", flush=True)
        return None
    return json.loads(lines[-1])  # null: no torch, or no CUDA for it


def time_tt(args, bags, length, seed) -> dict:
    """TT forward and fused-SGD step at FBTT's shape, microseconds per lookup."""
    import bench_tt

    case = bench_tt.Case("fbtt", 11_000_000, (200, 220, 250), (4, 4, 4), (32, 32))
    rng = np.random.default_rng(seed)
    with tf.device("/GPU:0"):
        ids = tf.constant(rng.integers(0, case.num_embeddings, size=(bags, length)), tf.int64)
        upstream = tf.constant(rng.standard_normal((bags, case.dim), np.float32))
        steps = bench_tt.tt_steps(tf, case, "custom_op", seed)
        sgd_step, why = bench_tt.fused_sgd_step(tf, case, "custom_op")
        if sgd_step is None:
            raise RuntimeError(why)

        ids_list = [ids] + [
            tf.constant(rng.integers(0, case.num_embeddings, size=(bags, length)), tf.int64)
            for _ in range(max(1, args.steps) - 1)
        ]

        def fwd():
            return steps["fwd"](ids)[0, 0]

        @tf.function
        def many():
            return tf.add_n([steps["fwd"](k)[0, 0] for k in ids_list])

        def step():
            return sgd_step(ids, upstream)[0][0, 0]

    lookups = bags * length
    per_lookup = 1e3 / lookups  # ms per call -> microseconds per lookup
    fwd_ms = _bench_util.time_calls(lambda: fwd().numpy(), 3, args.repeats).median_ms
    many_ms = _bench_util.time_calls(
        lambda: many().numpy(), 2, max(3, args.repeats // 3)
    ).median_ms / len(ids_list)
    step_ms = _bench_util.time_calls(lambda: step().numpy(), 3, args.repeats).median_ms
    return {
        "fwd_per_call_ms": fwd_ms,
        "fwd_in_graph_ms": many_ms,
        "step_per_call_ms": step_ms,
        "fwd_per_call_us": fwd_ms * per_lookup,
        "fwd_in_graph_us": many_ms * per_lookup,
        "step_per_call_us": step_ms * per_lookup,
    }


def _verdicts(times, targets):
    return ", ".join(
        f"{k} {times[k]:.4g} <= {v} {'PASS' if times[k] <= v else 'MISS'}"
        for k, v in targets.items()
    )


def main(argv=None) -> int:
    global tf, tf_ttemb
    args = parse_args(argv)
    if args.torch_worker:
        spec = json.loads(args.torch_worker)
        print(json.dumps(_torch_times(**spec)), flush=True)
        return 0
    import tensorflow as tf

    import tf_ttemb

    if not tf.config.list_physical_devices("GPU"):
        raise SystemExit("needs a GPU that TensorFlow sees")
    rng = np.random.default_rng(0)
    results = []
    for index, (name, rows, dim, bags, length, dtype, targets) in enumerate(CASES):
        tf_times = time_tf(args, rows, dim, bags, length, dtype, rng)
        torch_times = time_torch(args, rows, dim, bags, length, dtype, seed=index)
        row = {
            "case": name,
            "rows": rows,
            "dim": dim,
            "bags": bags,
            "L": length,
            "dtype": dtype,
            "tf": tf_times,
            "torch": torch_times,
            "targets": targets,
        }
        results.append(row)
        torch_text = (
            "torch fwd {fwd:.3f} / fwd+bwd {fwd_bwd:.3f} ms".format(**torch_times)
            if torch_times
            else "torch: not available"
        )
        print(
            f"{name} {rows}x{dim} {bags}x{length} {dtype}: fwd per call "
            f"{tf_times['fwd_per_call']:.3f} ms, in graph {tf_times['fwd_in_graph']:.3f} ms "
            f"({tf_times['gathered_tb_s']:.2f} TB/s; chained "
            f"{tf_times['fwd_in_graph_chained']:.3f}), fwd+bwd per call "
            f"{tf_times['fwd_bwd_per_call']:.3f} ms, in graph "
            f"{tf_times['fwd_bwd_in_graph']:.3f} ms; {torch_text}; "
            f"{_verdicts(tf_times, targets)}",
            flush=True,
        )
    for name, bags, length, targets in TT_CASES:
        times = time_tt(args, bags, length, seed=bags)
        results.append({"case": name, "bags": bags, "L": length, "tf": times, "targets": targets})
        print(
            f"{name} FBTT shape {bags}x{length}: fwd per call {times['fwd_per_call_ms']:.3f} "
            f"ms ({times['fwd_per_call_us']:.4f} us/lookup), in graph "
            f"{times['fwd_in_graph_ms']:.3f} ms ({times['fwd_in_graph_us']:.4f}), fused-SGD "
            f"step per call {times['step_per_call_ms']:.3f} ms "
            f"({times['step_per_call_us']:.4f}); {_verdicts(times, targets)}",
            flush=True,
        )
    if args.json:
        _bench_util.write_json(args.json, results, indent=1, announce=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
