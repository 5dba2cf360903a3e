"""What the device-side id checks of the GPU ops cost, through TensorFlow (issue 17).

A GPU forward (`GatherReduceSum`) and `TTRows` return without waiting for the device; what
they find wrong in the ids is in their `report` output, and a check op beside them
(`CheckBagReport`, `CheckTTRowsReport`) raises the CPU kernel's InvalidArgument from it
once the stream has run the op. This program times each op alone and with its check, on
the same inputs, per call (one `tf.function` call ending in a 1-element fetch) and in
graph (`--steps` independent lookups in one call, divided by the count):

* `gather_reduce_sum`: 10M x 64 float32 table, 8,192 bags x 20 int64 ids, weighted sum
  (the DLRM preset of `python -m tf_ttemb bench`);
* `tt_rows`: FBTT-Embedding's table (p = [200, 220, 250], q = [4, 4, 4], ranks [32, 32])
  at 10,240 sorted distinct ids (512 bags x 20).

On the GPU machine: `bash .tfgpu/run.sh python3 python/bench/bench_report_check.py`.
`--quick` (small sizes) checks the program on a CPU, where the ops check the ids
themselves and their reports are empty.
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
    _bench_util.add_int_options(parser, steps=20, repeats=30, warmup=3)
    parser.add_argument("--quick", action="store_true", help="small sizes, a few repeats")
    parser.add_argument("--json", default=None)
    return parser.parse_args(argv)


def _bag_ops(lib, tf, rng, args):
    """name -> (op only, op and check) builders of one lookup on ids `x`."""
    rows, dim, bags, length = (10_000_000, 64, 8192, 20) if not args.quick else (10_000, 16, 64, 5)
    table = tf.Variable(rng.standard_normal((rows, dim)).astype("float32"))
    splits = tf.range(0, bags * length + 1, length, dtype=tf.int64)
    weights = tf.constant(rng.random(bags * length).astype("float32"))
    attrs = dict(combiner="sum", has_weights=True, padding_id=-1, has_padding_id=False)
    inputs = [
        tf.constant(rng.integers(0, rows, bags * length), tf.int64) for _ in range(args.steps)
    ]

    def lookup(ids, checked):
        out, _, report = lib.tf_ttemb_resource_gather_reduce_sum(
            table.handle, ids, splits, weights, **attrs
        )
        if checked:
            lib.tf_ttemb_check_bag_report(report, padding_id=-1, has_padding_id=False)
        return out

    shape = f"{rows:,} x {dim} float32, {bags:,} bags x {length}"
    return "gather_reduce_sum", shape, lookup, inputs


def _tt_ops(lib, tf, rng, args):
    p, q, ranks = (
        ([200, 220, 250], [4, 4, 4], [32, 32])
        if not args.quick
        else (
            [5, 6, 7],
            [2, 2, 2],
            [4, 4],
        )
    )
    full = [1, *ranks, 1]
    cores = [
        tf.Variable(
            (0.1 * rng.standard_normal((p[k], full[k] * q[k] * full[k + 1]))).astype("float32")
        )
        for k in range(3)
    ]
    total = p[0] * p[1] * p[2]
    count = 10_240 if not args.quick else 64
    inputs = [
        tf.constant(sorted(rng.choice(total, count, replace=False)), tf.int64)
        for _ in range(args.steps)
    ]
    attrs = dict(p_shapes=p, q_shapes=q, ranks=ranks, num_tables=1)

    def lookup(ids, checked):
        rows, _, report = lib.tf_ttemb_tt_rows(ids, [c.read_value() for c in cores], **attrs)
        if checked:
            lib.tf_ttemb_check_tt_rows_report(report, limit=total)
        return rows

    shape = f"p={p} q={q} ranks={ranks}, {count:,} ids"
    return "tt_rows", shape, lookup, inputs


def measure(args) -> list:
    import numpy as np
    import tensorflow as tf

    from tf_ttemb.ops import _loader

    lib = _loader.load_op_library()
    rng = np.random.default_rng(0)
    results = []
    with tf.device(args.device):
        for build in (_bag_ops, _tt_ops):
            name, shape, lookup, inputs = build(lib, tf, rng, args)
            probes = {
                label: (
                    lambda x, lookup=lookup, checked=checked: tf.reduce_sum(lookup(x, checked)[:1])
                )
                for label, checked in (("op only", False), ("op and check", True))
            }
            for r in _bench_util.time_per_call_and_in_graph(
                tf, probes, inputs, args.warmup, args.repeats
            ):
                results.append(dict(case=name, shape=shape, variant=r.pop("key"), **r))
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    results = measure(args)
    rows = [
        [r["case"], r["kind"], r["variant"], f"{r['median_ms']:.4f}", f"{r['min_ms']:.4f}"]
        for r in results
    ]
    print(f"device {args.device}; in graph: {args.steps} lookups per call, per lookup")
    for r in results[:: len(results) // 2]:
        print(f"  {r['case']}: {r['shape']}")
    print(_bench_util.format_table(["case", "timing", "variant", "median ms", "min ms"], rows))
    _bench_util.write_json_if_asked(args.json, {"device": args.device, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
