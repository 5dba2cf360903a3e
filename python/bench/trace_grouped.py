"""Where a grouped step's time goes, call by call: a TensorFlow profiler trace of
`--calls` calls of the grouped fwd+bwd step of bench_grouped.py, summarised per thread.

  bash .tfgpu/run.sh python3 python/bench/trace_grouped.py --device GPU:0 --out "$OUT/trace"

Prints, for the traced calls: each host thread's busy time per call and its events by
total time (TensorFlow op names, function calls, EventMgr and stream callbacks), the
device's kernels and copies by total time, and one call's host timeline (events of the
busiest threads in start order, µs from the call's start).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_util

_bench_util.add_checkout_to_path()

import numpy as np
import tensorflow as tf
from bench_grouped import DIM, criteo_config, id_batch

from tf_ttemb.layers import GroupedEmbeddingBag


def build_step(device: str, scale: float, batch: int):
    rows, lengths, features = criteo_config(device, scale)
    rng = np.random.default_rng(0)
    with tf.device(device):
        ids = id_batch(rng, rows, lengths, batch)
        upstream = tf.constant(rng.standard_normal((batch, DIM * len(rows)), np.float32))
        grouped = GroupedEmbeddingBag(features)
        grouped.build()
        stacked = grouped.stacked[DIM]

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            out = grouped(ids)
        grad = tape.gradient(out, stacked, upstream)
        return out[0, 0] + grad.values[0, 0]

    return step


def summarise(logdir: str, calls: int, timeline_events: int) -> None:
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    paths = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True))
    space = xplane_pb2.XSpace()
    with open(paths[-1], "rb") as f:
        space.ParseFromString(f.read())
    device_events = []
    for plane in space.planes:
        names = {k: m.name for k, m in plane.event_metadata.items()}
        stat_names = {k: m.name for k, m in plane.stat_metadata.items()}
        if plane.name.startswith("/device:"):
            # Device events named by the TensorFlow op that issued them, where the trace
            # says (the `tf_op` stat, or the op's annotation).
            for line in plane.lines:
                for e in line.events:
                    op = ""
                    for st in e.stats:
                        if stat_names.get(st.metadata_id) in ("tf_op", "kernel_annotation"):
                            op = st.str_value or stat_names.get(st.ref_value, "")
                    start = line.timestamp_ns * 1000 + e.offset_ps
                    label = f"[{op.split(':')[0][-60:]}] " if op else ""
                    device_events.append(
                        (
                            start,
                            e.duration_ps,
                            line.id,
                            "D " + label + names.get(e.metadata_id, "?"),
                        )
                    )
        lines = [line for line in plane.lines if line.events]
        if not lines:
            continue
        print(f"\n== plane {plane.name!r}: {len(lines)} lines with events")
        busy = []
        for line in lines:
            total = collections.Counter()
            count = collections.Counter()
            for e in line.events:
                total[names.get(e.metadata_id, "?")] += e.duration_ps / 1e6
                count[names.get(e.metadata_id, "?")] += 1
            busy.append((sum(total.values()), line, total, count))
        busy.sort(key=lambda b: -b[0])
        for spent, line, total, count in busy[:8]:
            print(
                f"-- line {line.name or line.display_name!r} (id {line.id}): "
                f"{spent / calls:.1f} us of events per call (nested events add up)"
            )
            for name, us in total.most_common(14):
                print(f"   {us / calls:9.1f} us/call  x{count[name] / calls:5.1f}  {name[:110]}")
        if plane.name.startswith("/host:CPU"):
            # One call's timeline: the events of the busiest lines, in start order.
            events = []
            for _, line, _, _ in busy[:6]:
                for e in line.events:
                    start = line.timestamp_ns * 1000 + e.offset_ps
                    name = names.get(e.metadata_id, "?")
                    if not name.startswith(("ThreadpoolListener", "Memory")):
                        events.append((start, e.duration_ps, line.id, name))
            events.extend(device_events)
            events.sort()
            if not events:
                continue
            # The last call: from the last event named like the step function's call.
            marks = [ev for ev in events if "__inference_step" in ev[3]]
            t0 = marks[-1][0] if marks else events[-len(events) // calls][0]
            print("-- the last call's host timeline (us from its start; line id; duration):")
            shown = 0
            for start, dur, line_id, name in events:
                if start < t0:
                    continue
                print(f"   {(start - t0) / 1e6:9.1f}  L{line_id:<6} {dur / 1e6:8.1f}  {name[:100]}")
                shown += 1
                if shown >= timeline_events:
                    break


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="CPU:0")
    parser.add_argument("--scale", type=float, default=None, help="default: GPU 1, CPU 0.02")
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--timeline-events", type=int, default=120)
    parser.add_argument("--out", default="/tmp/trace_grouped")
    args = parser.parse_args(argv)
    step = build_step(args.device, args.scale, args.batch)
    for _ in range(5):
        step().numpy()
    times = []
    for _ in range(args.calls):
        start = time.perf_counter()
        step().numpy()
        times.append((time.perf_counter() - start) * 1e3)
    print(f"untraced: {np.median(times):.3f} ms per call (median of {args.calls})")
    tf.profiler.experimental.start(
        args.out,
        options=tf.profiler.experimental.ProfilerOptions(
            host_tracer_level=3, device_tracer_level=1
        ),
    )
    times = []
    for _ in range(args.calls):
        start = time.perf_counter()
        step().numpy()
        times.append((time.perf_counter() - start) * 1e3)
    tf.profiler.experimental.stop()
    print(f"traced: {np.median(times):.3f} ms per call (median of {args.calls})")
    summarise(args.out, args.calls, args.timeline_events)
    return 0


if __name__ == "__main__":
    sys.exit(main())
