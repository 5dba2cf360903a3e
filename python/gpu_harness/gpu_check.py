"""Checks and benchmarks the CUDA kernels on a GPU, without TensorFlow: the one driver.

One module per op family holds its checks and benchmarks (check_gather_reduce_sum.py,
check_tt.py, check_tt_cache.py, check_tt_update.py; what they share is check_common.py),
over the ctypes bindings harness.py and harness_cache.py.

    python3 python/gpu_harness/gpu_check.py            # build, full check sweep, benchmarks
    python3 python/gpu_harness/gpu_check.py --small    # a small sweep, for compute-sanitizer
    python3 python/gpu_harness/gpu_check.py --lib PATH # use a built library instead of building

Correctness: every combiner, value dtype (f16, bf16, f32, f64) and id dtype (int32,
int64) over shapes with D in {1, 3, 64, 127, 1024, 4096}, bag lengths from 0 to 4096,
uniform and Zipf(1.1) ids (so some rows are very hot), padding ids, zero denominators,
empty bags and batches; forward (output, argmax), params gradient (dense and
deduplicated), weights gradient (fused and stand-alone), all against float64
references computed on the CPU by torch. Outputs are poisoned with NaN first, so an
element the kernels never write fails. Also: bitwise determinism over repeated runs,
out-of-range ids and bad offsets (messages of the TF op).

Benchmarks (CUDA-event medians, inputs rotated between fresh random sets): the issue's
PKM and DLRM shapes against torch.nn.functional.embedding_bag in the same run.
Prints a table; writes JSON to $OUT/gpu_check.json when OUT is set.

Section "tt" (--only tt; also run after the gather_reduce_sum section when --only is not
given): TT embedding bags (cuda/tt_embedding_{forward,backward}.cu
through gpu_harness.tt_embedding_bag / tt_embedding_bag_backward) over 2-5 cores, odd shapes,
tables, padding, empty bags, Zipf ids, every dtype and combiner, against float64 references; error
messages; bitwise determinism; benchmarks at FBTT's shape (B = 512 and 65,536, uniform and
Zipf) with the TT-math and executed FLOP rates and a plain torch TT (gather core slices +
bmm, autograd) in the same run. JSON to $OUT/gpu_check_tt.json.

Section "tt_cache" (--only tt_cache; only when asked for): the TT forward with the device-side
row cache (harness_cache.tt_embedding_bag_forward_cached: unique
ids -> cache lookup -> TTRows of the misses -> stitch -> bag reduction, no host sync), with
caches populated the layer's way (count, populate, TT rows of the fresh ids), against float64
and the uncached forward; then the issue's cache benchmark at FBTT's shape (cache = hottest
1% of 11M rows, Zipf(1.1), B = 65,536 and 512). JSON to $OUT/gpu_check_tt_cache.json.

Section "tt_zipf" (--only tt_zipf; only when asked for): issue 5's Zipf target (Zipf(1.1) >= 2x
faster than uniform) at FBTT's shape, B = 65,536 and 512,
forward and forward + backward, along the TF GPU ops' path (U and n_k read back to the host,
buffers sized exactly; eager CUDA-event medians with the read-backs inside) next to the
harness's device-count path (graph replay), checked against each other first. JSON to
$OUT/gpu_check_tt_zipf.json.

Section "tt_update" (--only tt_update; only when asked for): the fused TT update and the
device-side row cache's launchers (check_tt_update.py, which also runs on its own and
takes --bench-only and --crosscheck-cpu-op). JSON to $OUT/tt_update*.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import check_tt_update  # noqa: E402
import harness as gh  # noqa: E402
from check_common import REPO, build, log  # noqa: E402
from check_gather_reduce_sum import (  # noqa: E402
    grs_main,
    profile_run,
)
from check_tt import tt_main, tt_profile_run  # noqa: E402
from check_tt_cache import tt_cache_main, tt_zipf_main  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="small sweep, no benchmarks")
    ap.add_argument("--lib", help="use this built library instead of building")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--max-cases", type=int, help="cap the sweep at this many cases")
    ap.add_argument("--profile", action="store_true", help="only run the PKM shapes once")
    ap.add_argument(
        "--only",
        choices=["grs", "tt", "tt_cache", "tt_zipf", "tt_update"],
        help="run one section: grs (gather_reduce_sum), tt (TT embedding bags), "
        "tt_cache (TT forward with the device row cache) or tt_zipf (the "
        "Zipf target along the TF ops' host-sizes path); the last two are "
        "not run by default",
    )
    args = ap.parse_args()
    if args.only == "tt_update":
        argv = ["--lib", args.lib] if args.lib else []
        argv += ["--small"] * args.small + ["--no-bench"] * args.no_bench
        return check_tt_update.main(argv)

    report = {"argv": sys.argv, "host": platform.node()}
    if args.lib:
        lib = pathlib.Path(args.lib)
    else:
        lib_dir = REPO / "build" / "gpu_harness"
        report["build_s"] = build(lib_dir)
        lib = lib_dir / "libtf_ttemb_gpu_harness.so"
    gh.load(lib)
    if args.profile:
        if args.only != "tt":
            profile_run()
        if args.only != "grs":
            tt_profile_run()
        return 0
    props = torch.cuda.get_device_properties(0)
    report["gpu"] = props.name
    report["torch"] = torch.__version__
    log(f"GPU {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}")
    sections = {
        "tt_cache": (tt_cache_main, "gpu_check_tt_cache"),
        "tt_zipf": (tt_zipf_main, "gpu_check_tt_zipf"),
        "tt": (tt_main, "gpu_check_tt"),
    }
    if args.only in sections:
        run, name = sections[args.only]
        passed = run(args, report)
        # tt_zipf has no small form: its JSON keeps one name.
        small = args.small and args.only != "tt_zipf"
        return _finish(report, passed, name + ("_small" if small else ""))
    passed = True
    if args.only in (None, "grs"):
        passed = grs_main(args, report)
    if args.only is None:
        passed = tt_main(args, report) and passed
    return _finish(report, passed, "gpu_check_small" if args.small else "gpu_check")


def _finish(report, passed, name):
    """Writes the report to $OUT/<name>.json when OUT is set; logs PASSED or FAILED."""
    report["passed"] = passed
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, name + ".json"), "w") as f:
            json.dump(report, f, indent=1, default=str)
    log("PASSED" if passed else "FAILED")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
