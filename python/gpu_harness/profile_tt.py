"""Per-kernel device time of the TT embedding-bag forward and backward on the GPU.

    python3 python/gpu_harness/profile_tt.py --lib build/gpu_harness/libtf_ttemb_gpu_harness.so \
        [--json OUT.json] [--bags 512 65536] [--dist uniform zipf]

For each (batch, id distribution) at FBTT's benchmark shape (p = [200, 220, 250],
q = [4, 4, 4], R = [32, 32], bag 20, f32, sum), times the two paths of
python/gpu_harness/gpu_check.py's `--only tt_zipf` section under torch.profiler (CUPTI sees the
kernels the ctypes library launches):
  dev    the harness's no-sync path (U and n_k stay on the device, buffers sized by nnz);
  exact  the TF glue's launch sequence with U and n_k given (buffers of the exact sizes).
and prints, per path, the kernels sorted by device time per call, and the phases (forward,
bag backward, TTRowsGrad prepare/compute) timed with CUDA events. Needs torch with CUDA.
"""

import argparse
import collections
import json
import math
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import check_tt as gc  # noqa: E402
import harness as gh  # noqa: E402

P, Q, RANKS = [200, 220, 250], [4, 4, 4], [32, 32]


def paths(bags, length, dist):
    # The first input set of gpu_check.py's TT benchmarks (same cores, ids and dy).
    cores, sets, off, splits = gc.tt_bench_inputs(bags, length, dist, P, Q, RANKS, num_sets=1)
    ((ids, dy),) = sets
    n_rows = math.prod(P)
    shape = gh.TTShape(P, Q, RANKS)

    def dev_fwd_bwd():
        out, st = gh.tt_embedding_bag_forward(
            cores, P, Q, RANKS, ids, off, table_splits=splits, check=False
        )
        gh.tt_embedding_bag_backward_from(st, dy, dense=True, check=False)

    # Sizes for the exact path.
    unique, slots, urep = gh.tt_unique_ids_async(ids, splits, n_rows, n_rows)
    U = int(urep.cpu()[2])
    rows, _ = gh.tt_rows_async(shape, cores, unique[:U])
    drows, _, _, _ = gh.backward_async(rows, slots, off, None, dy, "sum", padding_id=-1, dense=True)
    grads, _ = gh.tt_rows_grad(shape, cores, unique[:U], drows, dense=False)
    counts = [int(g[0].numel()) for g in grads]

    def exact_fwd_bwd(ev=None):
        def mark(i):
            if ev is not None:
                ev[i].record()

        mark(0)
        unique, slots, _ = gh.tt_unique_ids_async(ids, splits, n_rows, n_rows)
        mark(1)
        uq = unique[:U]
        rows, _ = gh.tt_rows_async(shape, cores, uq)
        mark(2)
        gh.forward_async(rows, slots, off, None, "sum", padding_id=-1)
        mark(3)
        drows, _, _, _ = gh.backward_async(
            rows, slots, off, None, dy, "sum", padding_id=-1, dense=True
        )
        mark(4)
        gh.tt_rows_grad(shape, cores, uq, drows, dense=False, counts=counts)
        mark(5)

    return dev_fwd_bwd, exact_fwd_bwd, U, counts


def kernel_table(fn, calls):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    # Every call launches the same sequence: label each launch with its ordinal among the
    # call's launches of the same kernel ("name #2" = the second launch in a call).
    per_call = len(events) // calls if calls else 0
    agg = collections.defaultdict(lambda: [0, 0.0])
    first, last = None, None
    for idx, e in enumerate(events):
        if per_call and idx % per_call == 0:
            seen = collections.Counter()
        seen[e.name] += 1
        name = f"#{seen[e.name]} {e.name}"
        a = agg[name]
        a[0] += 1
        a[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        start, end = e.time_range.start, e.time_range.end
        first = start if first is None else min(first, start)
        last = end if last is None else max(last, end)
    rows = sorted(([n, c / calls, t / calls] for n, (c, t) in agg.items()), key=lambda x: -x[2])
    busy = sum(r[2] for r in rows)
    span = (last - first) / calls if first is not None else None
    return {
        "kernels": rows,
        "busy_us_per_call": busy,
        "span_us_per_call": span,
        "launches_per_call": sum(r[1] for r in rows),
    }


def phases(exact, iters=20):
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(6)]
    acc = [[] for _ in range(5)]
    for _ in range(3):
        exact(ev)
    for _ in range(iters):
        exact(ev)
        torch.cuda.synchronize()
        for i in range(5):
            acc[i].append(ev[i].elapsed_time(ev[i + 1]))
    names = ["unique_ids", "tt_rows", "bag_forward", "bag_backward", "rows_grad"]
    return {n: sorted(a)[len(a) // 2] for n, a in zip(names, acc)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lib", required=True)
    ap.add_argument("--json")
    ap.add_argument("--bags", type=int, nargs="+", default=[512, 65536])
    ap.add_argument("--dist", nargs="+", default=["uniform", "zipf"])
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    gh.load(args.lib)
    out = []
    for bags in args.bags:
        for dist in args.dist:
            dev_fb, exact_fb, U, counts = paths(bags, 20, dist)
            res = {
                "bags": bags,
                "dist": dist,
                "unique": U,
                "core_rows": counts,
                "exact_phases_ms": phases(exact_fb),
            }
            for name, fn in (("dev", dev_fb), ("exact", exact_fb)):
                res[name] = kernel_table(fn, args.calls)
            out.append(res)
            print(f"\n=== B={bags} {dist}: U={U} n_k={counts}")
            print(
                "exact phases (ms, event medians, eager):",
                json.dumps({k: round(v, 4) for k, v in res["exact_phases_ms"].items()}),
            )
            for name in ("dev", "exact"):
                t = res[name]
                print(
                    f"--- {name}: busy {t['busy_us_per_call']:.1f} us/call, span "
                    f"{t['span_us_per_call']:.1f} us, {t['launches_per_call']:.0f} launches"
                )
                for n, c, us in t["kernels"][: args.top]:
                    for junk in (
                        "void ",
                        "tf_ttemb::gpu::(anonymous namespace)::",
                        "cub::CUB_300001_SM_900::detail::",
                        "tf_ttemb::gpu::",
                    ):
                        n = n.replace(junk, "")
                    print(f"  {us:9.1f} us  x{c:4.1f}  {n[:100]}")
            torch.cuda.empty_cache()
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
