"""Device time of the gather_reduce_sum kernels on the grouped layout of bench_grouped.py,
through the ctypes harness (no TensorFlow), against torch's embedding_bag on the same data.

  python3 python/gpu_harness/bench_grouped_kernels.py [--lib PATH] [--json OUT]

The layout is GroupedEmbeddingBag's: the 26 Criteo-like tables (python/bench/criteo.py)
stacked into one [sum of rows, 64] float32 table, bags example-major (bag b * 26 + t is
feature t of example b), uniform ids, batch 8,192. Cases: every feature ("all"), the 23
one-hot features alone and the 3 multi-hot features alone. For each: the forward (sum) and
the deduplicated params gradient, medians of CUDA-event timings, with torch's
`embedding_bag` (forward) beside them, the bytes the forward gathers per microsecond, and a
checksum of the forward's bits, so that two builds' outputs can be compared
(`--lib` picks the build).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness
from check_common import bench
from criteo import CRITEO_ROWS, DIM, MULTI_HOT


def layout(features, rows, batch, gen):
    """(ids, offsets) of the given features' bags, example-major, ids into the stacked table."""
    row_offsets = torch.tensor([0] + rows[:-1], dtype=torch.int64).cumsum(0)
    lengths = [MULTI_HOT.get(t, 1) for t in features]
    per_feature = [
        torch.randint(0, rows[t], (batch, n), generator=gen) + row_offsets[t]
        for t, n in zip(features, lengths)
    ]
    ids = torch.cat(per_feature, 1).reshape(-1)  # example-major: [batch, sum of lengths]
    bag_lengths = torch.tensor(lengths, dtype=torch.int64).repeat(batch)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), bag_lengths.cumsum(0)])
    return ids.cuda(), offsets.cuda()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lib", default=None, help="harness library (default: build/)")
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    harness.load(args.lib)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(sum(CRITEO_ROWS), DIM, device="cuda")
    all_features = list(range(len(CRITEO_ROWS)))
    cases = {
        "all": all_features,
        "one_hot": [t for t in all_features if t not in MULTI_HOT],
        "multi_hot": sorted(MULTI_HOT),
    }
    results = {"lib": args.lib, "gpu": torch.cuda.get_device_name()}
    for name, features in cases.items():
        ids, offsets = layout(features, CRITEO_ROWS, args.batch, gen)
        grad_out = torch.randn(offsets.numel() - 1, DIM, device="cuda")
        out = harness.gather_reduce_sum(table, ids, offsets)
        ref = torch.nn.functional.embedding_bag(ids, table, offsets[:-1], mode="sum")
        err = (out - ref).abs().max().item()
        fwd = bench(lambda i: harness.forward_async(table, ids, offsets), args.iters)
        torch_fwd = bench(
            lambda i: torch.nn.functional.embedding_bag(ids, table, offsets[:-1], mode="sum"),
            args.iters,
        )
        bwd = bench(
            lambda i: harness.backward_async(table, ids, offsets, None, grad_out, dense=False),
            args.iters,
        )
        gathered = ids.numel() * DIM * table.element_size()
        r = {
            "lookups": ids.numel(),
            "bags": offsets.numel() - 1,
            "forward_ms": fwd,
            "torch_forward_ms": torch_fwd,
            "forward_gb_per_s": gathered / fwd / 1e6,
            "backward_sparse_ms": bwd,
            "max_abs_err_vs_torch": err,
            "forward_sha1": hashlib.sha1(out.cpu().numpy().tobytes()).hexdigest()[:16],
        }
        results[name] = r
        print(
            f"{name}: {r['lookups']:,} lookups in {r['bags']:,} bags: forward {fwd:.3f} ms "
            f"({r['forward_gb_per_s']:.0f} GB/s gathered), torch {torch_fwd:.3f} ms; "
            f"backward (sparse) {bwd:.3f} ms; |ours - torch| {err:.2e}; bits {r['forward_sha1']}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
