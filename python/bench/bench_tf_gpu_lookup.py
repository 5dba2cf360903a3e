"""The lookup targets of issue 17 through TensorFlow on the GPU: `python -m tf_ttemb bench`
measures them, this program runs it and gives each target its verdict.

On the GPU machine through ../shared/tf_gpu/:

  bash .tfgpu/run.sh python3 python/bench/bench_tf_gpu_lookup.py --json "$OUT/lookup.json"

runs, in this process,

  python -m tf_ttemb bench --preset dlrm,pkm,fbtt --device GPU:0 --in-graph-steps 20 \\
      --repeats 15 --json ...

(the cases: `dlrm`, a weighted sum over a 10M x 64 float32 table, 8,192 bags x 20; `pkm`,
the same over a 262,144 x 1024 table, 16,384 x 128, float32 and bfloat16; `fbtt`,
`tt_embedding_bag` and one `TTEmbeddingBag(sparse=True, optimizer="sgd")` training step
at FBTT-Embedding's benchmark shape, 512 and 65,536 bags of 20; each per call, in graph
(`--steps` independent lookups in one call) and chained, forward and forward + backward,
torch's `embedding_bag` timed with CUDA events in a child process; see `python -m
tf_ttemb bench --help`). The bench's table comes first, then one line per target:
`target <case> <dtype> <what>: <measured> <= <target> PASS|MISS (<ratio>)`. `--json`
writes the bench's JSON with the verdicts added.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_util

_bench_util.add_checkout_to_path()


@dataclasses.dataclass(frozen=True)
class Target:
    """A target of issue 17 on one row of the bench (the custom op's)."""

    label: str
    dtype: str
    what: str  # a measurement of the row, "us_per_lookup:<measurement>" or "gathered_tb_s"
    limit: float
    unit: str
    at_least: bool = False

    def value(self, row: Dict[str, Any]) -> Optional[float]:
        if self.what == "gathered_tb_s":
            return row.get("gathered_tb_s")
        if self.what.startswith("us_per_lookup:"):
            return (row.get("us_per_lookup") or {}).get(self.what.split(":", 1)[1])
        timing = row.get(self.what)
        return None if timing is None else timing["median_ms"]


PRESETS = ("dlrm", "pkm", "fbtt")
TARGETS = [
    Target("dlrm:gather_reduce_sum", "float32", "fwd_in_graph", 0.07, "ms"),
    Target("dlrm:gather_reduce_sum", "float32", "fwd_bwd", 0.5, "ms"),
    Target("pkm:gather_reduce_sum", "float32", "gathered_tb_s", 4.0, "TB/s", at_least=True),
    Target("pkm:gather_reduce_sum", "float32", "fwd_bwd", 4.0, "ms"),
    Target("pkm:gather_reduce_sum", "bfloat16", "fwd_bwd", 2.5, "ms"),
    Target("fbtt:tt_bag[512x20]", "float32", "us_per_lookup:fwd", 0.03, "us/lookup"),
    Target("fbtt:tt_bag[512x20]", "float32", "us_per_lookup:fwd_bwd", 0.06, "us/lookup"),
    Target("fbtt:tt_bag[65536x20]", "float32", "us_per_lookup:fwd_bwd", 0.003, "us/lookup"),
]
NAMES = {
    "fwd_in_graph": "fwd in graph",
    "fwd_bwd": "fwd+bwd per call",
    "gathered_tb_s": "gathered",
    "us_per_lookup:fwd": "fwd per call",
    "us_per_lookup:fwd_bwd": "fused-SGD step per call",
}


def verdicts(rows: List[Dict[str, Any]], presets=PRESETS) -> List[Dict[str, Any]]:
    """One verdict per target of `presets`: the custom op's measured value, PASS or MISS
    (or NOT MEASURED when the bench has no such row or measurement)."""
    by_key = {(r["label"], r["dtype"]): r for r in rows if r["impl"] == "custom_op"}
    out = []
    for t in TARGETS:
        if t.label.split(":")[0] not in presets:
            continue
        row = by_key.get((t.label, t.dtype))
        value = None if row is None else t.value(row)
        if value is None:
            verdict, ratio = "NOT MEASURED", None
        else:
            met = value >= t.limit if t.at_least else value <= t.limit
            verdict = "PASS" if met else "MISS"
            ratio = t.limit / value if t.at_least else value / t.limit
        out.append(dict(dataclasses.asdict(t), value=value, verdict=verdict, ratio=ratio))
    return out


def format_verdict(v: Dict[str, Any]) -> str:
    sign = ">=" if v["at_least"] else "<="
    head = f"target {v['label']} {v['dtype']} {NAMES[v['what']]}"
    if v["value"] is None:
        return f"{head}: {v['verdict']} (target {sign} {v['limit']} {v['unit']})"
    return (
        f"{head}: {v['value']:.4g} {sign} {v['limit']} {v['unit']} {v['verdict']} "
        f"({v['ratio']:.2f}x)"
    )


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="--in-graph-steps of the bench")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--device", default="GPU:0")
    _bench_util.add_choice_list(
        parser,
        "--presets",
        PRESETS,
        "comma-separated presets to run (default: all three; one per call keeps a device "
        "call short)",
        default=list(PRESETS),
    )
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the presets' --quick sizes (a check of this program, e.g. on the CPU; the "
        "targets are for the full sizes, so no verdicts)",
    )
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from tf_ttemb.__main__ import main as tf_ttemb_main

    with tempfile.TemporaryDirectory(prefix="bench_tf_gpu_lookup_") as folder:
        path = os.path.join(folder, "bench.json")
        command = [
            "bench",
            "--preset",
            ",".join(args.presets),
            "--device",
            args.device,
            "--in-graph-steps",
            str(args.steps),
            "--repeats",
            str(args.repeats),
            "--json",
            path,
        ] + (["--quick"] if args.quick else [])
        shown = [c for c in command if c not in ("--json", path)]
        print("python -m tf_ttemb " + " ".join(shown), flush=True)
        status = tf_ttemb_main(command)
        if status:
            return status
        with open(path, encoding="utf-8") as f:
            result = json.load(f)
    print()
    if args.quick:
        print("--quick: smaller sizes than the targets'; no verdicts")
        result["verdicts"] = []
    else:
        result["verdicts"] = verdicts(result["results"], args.presets)
        for v in result["verdicts"]:
            print(format_verdict(v))
    sys.stdout.flush()
    if args.json:
        _bench_util.write_json(args.json, result, indent=1, announce=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
