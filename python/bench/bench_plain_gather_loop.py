"""How a table's dtype changes a plain gather-sum's time on this CPU, against our op's.

`plain_gather_loop.cc` (beside this file) is the simplest weighted random-row gather-sum
that keeps rows prefetched ahead: no validation, no framework, persistent threads released
by a spin barrier. This program builds it with the host's compiler for the host's CPU
(`-march=native`), runs it for float32, float16 and bfloat16 tables at each shape, keeps the
fastest of its prefetch settings (the first line or every line of a row, several distances
ahead), and prints its times and the half types' time per byte against float32's. Where rows
are a line or two, a row costs about one memory round trip whatever its width, and the plain
loop's half types are slower per byte than its float32 too: that share is the machine's, not
a kernel's. `--ours` also times `tf_ttemb.gather_reduce_sum`'s forward in graph (weighted
sum, uniform ids, the sweep's `SWEEP_CHAIN` lookups in one `tf.function`, the three dtypes
in turn) and prints ours against the plain loop; `--torch` times torch's `embedding_bag`
forward (no grad, the same weighting, a table in torch's own allocation) for each dtype too,
where torch imports. The plain loop is not a lower bound: for rows of more than 16 vectors
(over 256 columns with AVX-512, over 128 with AVX2) it sums in memory with a plain prefetch,
and the op's tuned prefetches beat it.

The loop's data is exact in every dtype, so every run of a shape must give the same checksum
whatever its dtype or setting (checked), and a small shape's checksum is checked against
numpy.

    python python/bench/bench_plain_gather_loop.py --ours
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_util as util
import bench_gather_reduce_sum

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plain_gather_loop.cc")
DTYPES = ("float32", "float16", "bfloat16")
# The sweep's shapes (issue 19's four and two more) and its in-graph chain.
SHAPES = bench_gather_reduce_sum.SWEEP_SHAPES
SWEEP_CHAIN = bench_gather_reduce_sum.SWEEP_CHAIN
CHECK_SHAPE = (1_000, 48, 37, 5)
Shape = Tuple[int, int, int, int]


def build(compiler: str = "c++") -> str:
    """The plain loop's binary for this CPU, built once per source and compiler into the
    temporary directory."""
    with open(SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read() + compiler.encode()).hexdigest()[:16]
    path = os.path.join(tempfile.gettempdir(), f"tf_ttemb_plain_gather_loop_{digest}")
    if not os.path.exists(path):
        flags = ["-O2", "-march=native", "-std=c++17", "-pthread"]
        subprocess.run([compiler, *flags, SOURCE, "-o", path + ".tmp"], check=True)
        os.replace(path + ".tmp", path)
    return path


def run_loop(
    binary: str,
    shape: Shape,
    dtype: str,
    lines: str,
    aheads: Sequence[int],
    threads: int,
    repeats: int,
) -> List[Dict[str, Any]]:
    """One run of the binary: a result per distance ahead."""
    args = [binary, *map(str, shape), str(threads), str(repeats), dtype, lines]
    args.append(",".join(map(str, aheads)))
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def _splitmix64(x):
    import numpy as np

    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def expected_checksum(shape: Shape) -> float:
    """plain_gather_loop.cc's checksum of `shape`, from its data's definition, in float64."""
    import numpy as np

    rows, dim, bags, bag_len = shape
    entries = np.arange(bags * bag_len, dtype=np.uint64)
    ids = (_splitmix64(entries) % np.uint64(rows)).astype(np.int64)
    weights = (np.arange(bags * bag_len) % 4 + 1) * 0.25
    cols = np.arange(dim)
    values = ((7 * ids[:, None] + 3 * cols[None, :]) % 16 - 8) * 0.125
    out = (values * weights[:, None]).reshape(bags, bag_len, dim).sum(axis=1).reshape(-1)
    return float((out * (np.arange(out.size) % 7 + 1)).sum())


def fastest_setting(
    binary: str, shape: Shape, dtype: str, aheads: Sequence[int], threads: int, repeats: int
) -> Dict[str, Any]:
    """The fastest setting's result for one dtype at one shape, with every checksum seen."""
    results = []
    for lines in ("first", "all"):
        results += run_loop(binary, shape, dtype, lines, aheads, threads, repeats)
    best = min(results, key=lambda r: r["median_ms"])
    return dict(best, checksums=sorted({r["checksum"] for r in results}))


def _ours(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Our forward in graph for each dtype at one shape, the dtypes in turn."""
    import numpy as np
    import tensorflow as tf

    util.add_checkout_to_path()
    import tf_ttemb

    rows, dim, bags, bag_len = spec["shape"]
    if spec["threads"]:
        tf.config.threading.set_intra_op_parallelism_threads(spec["threads"])
    rng = np.random.default_rng(0)
    ids = tf.constant(rng.integers(0, rows, size=(bags, bag_len)))
    table = rng.standard_normal((rows, dim)).astype(np.float32)
    weights = rng.uniform(0.5, 2.0, size=(bags, bag_len)).astype(np.float32)
    steps = {}
    for dtype in DTYPES:
        params = tf.Variable(tf.cast(table, dtype))
        w = tf.cast(weights, dtype)

        def step(params=params, w=w):
            return tf.cast(tf_ttemb.gather_reduce_sum(params, ids, w)[0, 0], tf.float32)

        steps[dtype] = util.chained_steps(tf, step, SWEEP_CHAIN)
    timings = util.time_alternating(steps, spec["warmup"], spec["repeats"])
    return {
        "ok": True,
        "ms": {dtype: t.median_ms / SWEEP_CHAIN for dtype, t in timings.items()},
    }


def _torch(spec: Dict[str, Any]) -> Dict[str, Any]:
    """torch's embedding_bag forward for each dtype at one shape, the dtypes in turn."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    rows, dim, bags, bag_len = spec["shape"]
    torch.set_num_threads(spec["threads"] or util.usable_cpus())
    rng = np.random.default_rng(0)
    ids = torch.from_numpy(rng.integers(0, rows, size=(bags, bag_len)))
    table = torch.from_numpy(rng.standard_normal((rows, dim)).astype(np.float32))
    weights = torch.from_numpy(rng.uniform(0.5, 2.0, size=(bags, bag_len)).astype(np.float32))
    steps = {}
    for dtype in DTYPES:
        kind = getattr(torch, dtype)
        t, w = table.to(kind), weights.to(kind)

        def step(t=t, w=w):
            with torch.no_grad():
                return F.embedding_bag(ids, t, mode="sum", per_sample_weights=w)

        steps[dtype] = step
    timings = util.time_alternating(steps, spec["warmup"], spec["repeats"])
    return {"ok": True, "ms": {dtype: t.median_ms for dtype, t in timings.items()}}


WORKERS = {"ours": _ours, "torch": _torch}


def per_byte(ms: Dict[str, float], dtype: str) -> float:
    """A half type's time per byte against float32's (1 = as fast per byte)."""
    return 2.0 * ms[dtype] / ms["float32"]


def measure(args: argparse.Namespace) -> Dict[str, Any]:
    binary = build(args.compiler)
    threads = args.threads or util.usable_cpus()
    check = run_loop(binary, CHECK_SHAPE, "float32", "first", [4], 1, 1)[0]["checksum"]
    if check != expected_checksum(CHECK_SHAPE):
        raise SystemExit(
            f"plain_gather_loop's checksum {check} at {CHECK_SHAPE} is not numpy's "
            f"{expected_checksum(CHECK_SHAPE)}"
        )
    cases = []
    for shape in args.shapes:
        util.log(f"plain loop at {shape} ...")
        loops = {
            d: fastest_setting(binary, shape, d, args.aheads, threads, args.repeats) for d in DTYPES
        }
        sums = {c for f in loops.values() for c in f["checksums"]}
        if len(sums) != 1:
            raise SystemExit(f"plain_gather_loop gave different sums at {shape}: {sorted(sums)}")
        case = {"shape": list(shape), "plain_loop": loops}
        for side, key in (("ours", "ours_in_graph_ms"), ("torch", "torch_ms")):
            if getattr(args, side):
                util.log(f"{side} at {shape} ...")
                spec = {"side": side, "shape": list(shape), "threads": args.threads}
                spec.update(util.option_values(args, "warmup", "repeats"))
                result = util.run_worker(os.path.abspath(__file__), spec, {})
                if not result["ok"]:
                    raise SystemExit(f"{side} at {shape} failed: {result['error']}")
                case[key] = result["ms"]
        cases.append(case)
    return {"threads": threads, "cases": cases, "machine": util.machine_info()}


def report(document: Dict[str, Any]) -> str:
    headers = ["N x D, bags x L", "plain loop f32 ms", "f16 ms (per byte)", "bf16 ms (per byte)"]
    ours = any("ours_in_graph_ms" in c for c in document["cases"])
    torch = any("torch_ms" in c for c in document["cases"])
    if ours:
        headers += ["ours f32 / f16 / bf16 ms", "ours per byte f16 / bf16", "ours / plain loop"]
    if torch:
        headers += ["torch f32 / f16 / bf16 ms", "torch per byte f16 / bf16"]
    rows = []
    for case in document["cases"]:
        rows_, dim, bags, bag_len = case["shape"]
        loop = {d: case["plain_loop"][d]["median_ms"] for d in DTYPES}
        row = [
            f"{rows_:,} x {dim}, {bags:,} x {bag_len}",
            f"{loop['float32']:.3f}",
            f"{loop['float16']:.3f} ({per_byte(loop, 'float16'):.2f})",
            f"{loop['bfloat16']:.3f} ({per_byte(loop, 'bfloat16'):.2f})",
        ]
        if ours:
            mine = case["ours_in_graph_ms"]
            row += [
                " / ".join(f"{mine[d]:.3f}" for d in DTYPES),
                f"{per_byte(mine, 'float16'):.2f} / {per_byte(mine, 'bfloat16'):.2f}",
                " / ".join(f"{mine[d] / loop[d]:.2f}" for d in DTYPES),
            ]
        if torch:
            theirs = case["torch_ms"]
            row += [
                " / ".join(f"{theirs[d]:.3f}" for d in DTYPES),
                f"{per_byte(theirs, 'float16'):.2f} / {per_byte(theirs, 'bfloat16'):.2f}",
            ]
        rows.append(row)
    title = (
        "plain gather-sum loop (plain_gather_loop.cc, -march=native, "
        f"{document['threads']} thread(s), weighted, uniform ids; medians; per byte = a half "
        "type's time x 2 / float32's)"
    )
    return title + "\n" + util.format_table(headers, rows)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--shapes",
        type=lambda s: [tuple(int(x) for x in part.split(",")) for part in s.split(";")],
        default=list(SHAPES),
        help="rows,dim,bags,bag_size;... (default: the sweep's six shapes)",
    )
    parser.add_argument("--aheads", type=util.positive_int_list, default=[8, 16, 32, 64])
    parser.add_argument(
        "--threads", type=util.non_negative_int, default=0, help="0: one per usable CPU"
    )
    util.add_int_options(parser, repeats=25, warmup=5)
    parser.add_argument("--ours", action="store_true", help="also time our forward in graph")
    parser.add_argument(
        "--torch", action="store_true", help="also time torch's embedding_bag forward"
    )
    parser.add_argument("--compiler", default="c++")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.torch and importlib.util.find_spec("torch") is None:
        parser.error("--torch: torch is not importable here (pip install torch==2.13.0)")
    for shape in args.shapes:
        if len(shape) != 4 or min(shape) < 1:
            parser.error(f"--shapes: {shape} is not four positive integers")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    document = measure(args)
    print(report(document))
    util.write_json_if_asked(args.json, document)
    return 0


if __name__ == "__main__":
    sys.exit(util.main_or_worker(main, lambda spec: util.worker_main(spec, WORKERS[spec["side"]])))
