"""`python -m tf_ttemb bench`: the op benchmarks, on this machine, as a table and JSON.

Cases (`--cases`, all by default, or those of a `--preset`), each timed forward (`fwd`)
and forward + backward (`fwd+bwd`), for every dtype of `--dtypes`:

* `gather_reduce_sum`: a weighted-sum EmbeddingBag, a `[rows, dim]` table variable and
  `bags x bag_size` uniform ids with weights. `custom_op` is
  `tf_ttemb.gather_reduce_sum(..., implementation="custom_op")`; the baseline `tf_gather`
  is what plain TensorFlow users write, `tf.reduce_sum(tf.gather(table, ids) * w[..., None],
  axis=-2)`. fwd+bwd: the output and the gradients w.r.t. the table (`IndexedSlices`) and
  the weights of a random upstream gradient. When torch is installed, `torch` is
  `torch.nn.functional.embedding_bag(..., mode="sum", per_sample_weights=w, sparse=True)`
  on the same data: in this process on the CPU, in a child process on a GPU (see
  `--torch`).
* `tt_rows`: rows of a Tensor-Train table (`tf_ttemb.layers.TTEmbeddingBag`'s cores for
  `tt_rows x tt_dim`, ranks `tt_rank`), decompressed by `tf_ttemb.tt_rows` with the custom
  op, against `tf.gather` from the same table stored densely (the baseline; decompressed
  by numpy in float64, `tf_ttemb.tt.to_dense`). Gradients w.r.t. the cores and w.r.t. the
  dense table (fwd+bwd compares the outputs only).
* `tt_bag`: sums of `tt_bags x tt_bag_size` rows of the same kind of TT table:
  `tf_ttemb.tt_embedding_bag` forward with the custom op (`custom_op`) and the
  plain-TensorFlow composite (`composite`, the baseline); fwd+bwd is one training step of
  `TTEmbeddingBag(sparse=True, optimizer="sgd")` (forward, backward and the fused
  in-place SGD update of the cores' touched rows). The forward is also compared with
  numpy's (float64, `tf_ttemb.tt.rows`) on the first 64 bags, and the step by the
  updated cores. Times also per lookup (one id of a bag).
* `pkm`: a `tf_ttemb.layers.ProductKeyMemory` layer on `pkm_tokens` tokens (query
  network, product-key top-k, softmax, memory read) with the memory read by the custom op
  (`custom_op`) and by tf_ttemb's plain-TensorFlow composite (`composite`, the baseline);
  fwd in inference mode, fwd+bwd in training mode w.r.t. the inputs and every trainable
  weight. float32 only (the layer keeps float32 variables under every policy).

How it measures: every step is a `tf.function` (graph mode, no XLA) run on `--device`;
after `--warmup` untimed calls, the median and minimum wall-clock time of `--repeats`
calls. Each call ends by fetching a scalar that depends on every tensor of its result
(output and gradients), so its time includes all the work, also on a GPU. The
implementations of a case are timed alternately, call by call, so load from other
processes on a shared machine affects them alike. Before timing, each implementation's
output (and for fwd+bwd, its gradients, summed per table row) is compared with the
baseline's: `max_rel_diff` is the largest absolute difference divided by the largest
absolute baseline value, over the output and all gradients.

The agreement of `gather_reduce_sum` is checked on the first batch's first 2,048 bags
(all of them at smaller batches); torch's rows are compared on their first 8 bags' output
and weights gradient, in this process or in the child.

`in graph` leaves out TensorFlow's per-call cost, which at small sizes, above all on a
GPU, can be most of a single call's time: `--in-graph-steps` independent steps (each on
its own ids) in one `tf.function` call, divided by that count, as a model with many
tables runs its lookups; for fwd and fwd+bwd. `chained`: the forward as many times in
one `tf.while_loop`, one iteration after the other (the latency of one lookup inside a
graph). Neither exists for torch, nor, with `--baseline-per-call-only` (the pkm preset),
for the baselines. A step that fails (out of memory, say) is reported as
`failed`, with its error under the table, and the rest goes on.

Per lookup: microseconds per id of a bag (per call and in graph), and for
`gather_reduce_sum` `gathered TB/s`: the bytes of the rows the forward reads (bags x
bag_size x dim x itemsize) over its in-graph time.

torch on a GPU runs in a child process (`tf_ttemb/_bench_torch.py`, which never imports
TensorFlow; torch initialising CUDA in a process that already ran TensorFlow on the GPU
died of SIGFPE on an H200), started before this process uses the GPU, on the same
shapes and seeds; timed with CUDA events around each call (device time), compared with
the baseline on the first 8 bags' output and weights gradient. A missing or failing
torch prints one line, and the command goes on.

`--quick` shrinks every size and the repeats (under a minute on 2 CPU cores); the
defaults take a few minutes there (7 minutes measured while other builds loaded the
machine). The table goes to stdout, progress to stderr; `--json PATH`
writes the table's numbers with the machine, TensorFlow and build facts.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import importlib.util
import json
import os
import platform
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from tf_ttemb import _bench_cases, _timing

CASES = _bench_cases.CASES
DTYPES = _bench_cases.DTYPES
INDEX_DTYPES = ("int32", "int64")
TORCH_MODES = ("auto", "child", "off")


@dataclasses.dataclass(frozen=True)
class Preset:
    """Sizes of a model that users know, with the cases and dtypes they concern; `quick`
    replaces some of them under `--quick` (the same shape at smaller sizes)."""

    text: str
    cpu_cost: str
    cases: Tuple[str, ...]
    dtypes: Tuple[str, ...]
    index_dtype: str
    sizes: Dict[str, Any]
    quick: Dict[str, Any]
    # The baseline timed per call only: its in-graph steps would hold --in-graph-steps
    # copies of its intermediates at once.
    baseline_per_call_only: bool = False


PRESETS: Dict[str, Preset] = {
    "dlrm": Preset(
        "a DLRM embedding table: gather_reduce_sum, weighted sum, 10,000,000 x 64 float32 "
        "table (2.4 GiB), 8,192 bags x 20 int64 ids (--quick: 100,000 rows, 1,024 bags)",
        "about 8 GiB of memory and minutes",
        ("gather_reduce_sum",),
        ("float32",),
        "int64",
        {"rows": 10_000_000, "dim": 64, "bags": 8192, "bag_size": 20},
        {"rows": 100_000, "bags": 1024},
    ),
    "pkm": Preset(
        "the memory read of a product-key memory: gather_reduce_sum, weighted sum, "
        "262,144 x 1024 values table (1 GiB in float32), 16,384 bags (tokens) x 128 ids "
        "(heads x knn), float32 and bfloat16; the tf_gather baseline's [bags, 128, 1024] "
        "intermediates take 8 GiB each in float32 (--quick: 16,384 rows, 256 bags)",
        "well over 32 GiB of memory and hours",
        ("gather_reduce_sum",),
        ("float32", "bfloat16"),
        "int64",
        {"rows": 262_144, "dim": 1024, "bags": 16_384, "bag_size": 128},
        {"rows": 16_384, "bags": 256},
        baseline_per_call_only=True,
    ),
    "fbtt": Preset(
        "FBTT-Embedding's benchmark table: tt_bag, N = 11,000,000, p = [200, 220, 250], "
        "q = [4, 4, 4], ranks [32, 32] (958,720 parameters), sums of bags of 20 ids, 512 "
        "and 65,536 bags (--quick: 64 and 512 bags)",
        "a few GiB of memory, and hours for the 65,536-bag run",
        ("tt_bag",),
        ("float32",),
        "int64",
        {
            "tt_rows": 11_000_000,
            "tt_dim": 64,
            "tt_rank": 32,
            "tt_p": [200, 220, 250],
            "tt_q": [4, 4, 4],
            "tt_bags": [512, 65_536],
            "tt_bag_size": 20,
        },
        {"tt_bags": [64, 512]},
    ),
}

# name -> (default, --quick value, help); a list value is a comma-separated option.
SIZES: Dict[str, tuple] = {
    "rows": (1 << 18, 1 << 14, "gather_reduce_sum: rows of the table"),
    "dim": (128, 32, "gather_reduce_sum: columns of the table"),
    "bags": (1024, 256, "gather_reduce_sum: bags per batch"),
    "bag_size": (64, 16, "gather_reduce_sum: ids per bag"),
    "tt_rows": (1_000_000, 100_000, "tt_rows, tt_bag: rows of the TT table"),
    "tt_dim": (64, 16, "tt_rows, tt_bag: columns of the TT table"),
    "tt_rank": (16, 4, "tt_rows, tt_bag: TT rank (every inner rank)"),
    "tt_p": (None, None, "tt_rows, tt_bag: the TT row factors, comma-separated"),
    "tt_q": (None, None, "tt_rows, tt_bag: the TT column factors, comma-separated"),
    "tt_lookups": (16384, 2048, "tt_rows: ids per batch"),
    "tt_bags": ([1024], [128], "tt_bag: bags per batch, comma-separated for several runs"),
    "tt_bag_size": (20, 8, "tt_bag: ids per bag"),
    "pkm_tokens": (512, 128, "pkm: tokens per batch"),
    "pkm_dim": (256, 64, "pkm: input and value size"),
    "pkm_keys": (128, 32, "pkm: sub-keys per half (the memory has pkm_keys**2 slots)"),
    "pkm_heads": (4, 2, "pkm: heads"),
    "pkm_knn": (32, 8, "pkm: slots read per token and head"),
    "repeats": (20, 3, "timed calls per step"),
    "in_graph_steps": (10, 2, "steps inside one call for the in-graph and chained times"),
    "warmup": (2, 1, "untimed calls before timing"),
}
LIST_SIZES = ("tt_p", "tt_q", "tt_bags")

EPILOG = """examples:
  python -m tf_ttemb bench                       # a few minutes on 2 CPU cores
  python -m tf_ttemb bench --quick               # under a minute
  python -m tf_ttemb bench --cases gather_reduce_sum --dtypes float32,bfloat16 \\
      --rows 1000000 --dim 64 --threads 2 --json bench.json
  python -m tf_ttemb bench --preset dlrm,pkm,fbtt --device GPU:0 --json gpu.json
  python -m tf_ttemb bench --preset fbtt --quick # the FBTT shape at 64 and 512 bags, here
  python -m tf_ttemb bench --preset dlrm --bags 2048 --device GPU:0   # explicit sizes win

The presets are sized for a GPU: on a small CPU machine add --quick (each preset's shape
at smaller sizes; up to about a minute each on 2 CPU cores). In full on a CPU (estimated
from the --quick sizes, not measured): dlrm needs about 8 GiB of memory and minutes;
pkm well over 32 GiB (the tf_gather baseline's [bags, 128, 1024] intermediates) and
hours; fbtt a few GiB, and hours for its 65,536-bag run.

The benchmark programs in the checkout's python/bench/ directory measure more
(peak memory, FLOP rates, more shapes); this command is the one that ships in the wheel."""


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(f"{v:,}" for v in value)
    return f"{value:,}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the command's options to its subparser."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__.split("\n", 2)[2].split("How it measures")[0].strip()
    parser.epilog = EPILOG
    _timing.add_choice_list(
        parser,
        "--preset",
        list(PRESETS),
        "model-shaped sizes, cases and dtypes (one run each; explicit options win): "
        + "; ".join(f"{name}: {p.text}" for name, p in PRESETS.items()),
        metavar="NAME[,NAME...]",
    )
    _timing.add_choice_list(
        parser,
        "--cases",
        CASES,
        f"comma-separated cases to run (default: the preset's, else all: {','.join(CASES)})",
    )
    _timing.add_choice_list(
        parser,
        "--dtypes",
        DTYPES,
        "comma-separated value dtypes of gather_reduce_sum, tt_rows and tt_bag "
        f"(from {','.join(DTYPES)}; default: the preset's, else float32)",
    )
    parser.add_argument(
        "--index-dtype",
        choices=INDEX_DTYPES,
        default=None,
        help="gather_reduce_sum's ids (default: the preset's, int64, else int32)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small sizes and 3 repeats: under a minute instead of minutes; with a preset, the "
        "preset's shape at smaller sizes (explicit sizes win)",
    )
    parser.add_argument(
        "--threads",
        type=_timing.positive_int,
        default=None,
        help="TensorFlow intra-op threads (default: TensorFlow's choice, one per core)",
    )
    parser.add_argument("--device", default="CPU:0", help="device to run on (default: CPU:0)")
    parser.add_argument(
        "--torch",
        choices=TORCH_MODES,
        default="auto",
        help="torch's embedding_bag beside gather_reduce_sum, where torch is installed: "
        "auto (default): in this process on the CPU, in a child process on a GPU; child: "
        "in a child process on any device; off: not at all",
    )
    parser.add_argument(
        "--baseline-per-call-only",
        action="store_true",
        help="time the baselines per call only, not in graph (their in-graph steps hold "
        "--in-graph-steps copies of their intermediates at once; the pkm preset sets it)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed of the data")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    sizes = parser.add_argument_group(
        "sizes (default / with --quick; a preset sets its own, explicit options win)"
    )
    for name, (default, quick, text) in SIZES.items():
        sizes.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            type=_timing.positive_int_list if name in LIST_SIZES else _timing.positive_int,
            default=None,
            metavar="N[,N...]" if name in LIST_SIZES else "N",
            help=f"{text} ({_shown(default)} / {_shown(quick)})"
            if default is not None
            else f"{text} (default: the layer's choice)",
        )


# ----------------------------------------------------------------------------------------
# Runs: one per preset (or one without), with every option resolved.


def resolve(args: argparse.Namespace, preset_name: Optional[str]) -> argparse.Namespace:
    """The options of one run: explicit options, else the preset's (its `quick` values
    under --quick), else the defaults (their --quick values under --quick)."""
    preset = PRESETS.get(preset_name) if preset_name else None
    opts = copy.copy(args)
    opts.preset = preset_name
    for name, (default, quick, _) in SIZES.items():
        if getattr(args, name) is not None:
            continue
        value = quick if args.quick else default
        if preset and name in preset.sizes:
            value = preset.sizes[name]
            if args.quick and name in preset.quick:
                value = preset.quick[name]
        setattr(opts, name, copy.copy(value))
    opts.cases = args.cases or (list(preset.cases) if preset else list(CASES))
    opts.dtypes = args.dtypes or (list(preset.dtypes) if preset else ["float32"])
    opts.index_dtype = args.index_dtype or (preset.index_dtype if preset else "int32")
    opts.baseline_per_call_only = args.baseline_per_call_only or bool(
        preset and preset.baseline_per_call_only
    )
    return opts


@dataclasses.dataclass
class Item:
    """One case of one run at one dtype (and for tt_bag one batch size)."""

    opts: argparse.Namespace
    case: str
    dtype: str
    bags: Optional[int]

    @property
    def label(self) -> str:
        prefix = f"{self.opts.preset}:" if self.opts.preset else ""
        suffix = f"[{self.bags}x{self.opts.tt_bag_size}]" if self.case == "tt_bag" else ""
        return prefix + self.case + suffix

    @property
    def seed(self) -> List[int]:
        seed = [self.opts.seed, CASES.index(self.case), DTYPES.index(self.dtype)]
        return seed + ([self.bags] if self.bags else [])


def plan(runs: Sequence[argparse.Namespace]) -> List[Item]:
    items = []
    for opts in runs:
        for case in opts.cases:
            for dtype in opts.dtypes if case != "pkm" else ["float32"]:
                for bags in opts.tt_bags if case == "tt_bag" else [None]:
                    items.append(Item(opts, case, dtype, bags))
    return items


def build(item: Item) -> _bench_cases.Case:
    opts, dtype, seed, label = item.opts, item.dtype, item.seed, item.label
    if item.case == "gather_reduce_sum":
        return _bench_cases.build_gather_reduce_sum(opts, dtype, seed, label)
    if item.case == "tt_rows":
        return _bench_cases.build_tt_rows(opts, dtype, seed, label)
    if item.case == "tt_bag":
        return _bench_cases.build_tt_bag(opts, dtype, seed, label, item.bags)
    return _bench_cases.build_pkm(opts, dtype, seed, label)


# ----------------------------------------------------------------------------------------
# torch.


def torch_mode(args: argparse.Namespace, items: Sequence[Item], notes: List[str]) -> str:
    """ "here" (in this process), "child" or "off"; a note says why torch is left out."""
    if args.torch == "off" or not any(i.case == "gather_reduce_sum" for i in items):
        return "off"
    on_cpu = "CPU" in args.device.upper()
    mode = "here" if args.torch == "auto" and on_cpu else "child"
    if importlib.util.find_spec("torch") is None:
        notes.append(
            "torch: not installed, so not timed (pip install torch adds "
            "torch.nn.functional.embedding_bag to gather_reduce_sum; never a dependency)"
        )
        return "off"
    if mode == "here":
        try:
            import torch
        except Exception as e:  # noqa: BLE001 -- a broken install is reported, not raised
            notes.append(f"torch: does not import ({_timing.error_summary(e)}), so not timed")
            return "off"
        if args.threads:
            torch.set_num_threads(args.threads)
        if any(i.case == "gather_reduce_sum" and i.dtype == "float16" for i in items):
            notes.append("torch: float16 left out on the CPU (no float16 per-sample weights)")
    return mode


def torch_device(device: str) -> str:
    """torch's name for a TensorFlow device: GPU:N is cuda:N (the same CUDA ordinal)."""
    kind, _, index = device.upper().removeprefix("/DEVICE:").lstrip("/").partition(":")
    return f"cuda:{index or 0}" if kind == "GPU" else "cpu"


def run_torch_child(args, items: Sequence[Item], notes: List[str]) -> Dict[str, Any]:
    """The child's result for the gather_reduce_sum items, keyed by label and dtype ({}
    with a note when it failed)."""
    cases = [
        {
            "key": f"{i.label} {i.dtype}",
            "seed": i.seed,
            "rows": i.opts.rows,
            "dim": i.opts.dim,
            "bags": i.opts.bags,
            "bag_size": i.opts.bag_size,
            "dtype": i.dtype,
        }
        for i in items
        if i.case == "gather_reduce_sum"
    ]
    device = torch_device(args.device)
    _log(f"bench: torch in a child process on {device} ({len(cases)} cases) ...")
    result = _bench_cases.torch_child(cases, device, items[0].opts)
    if not result.get("ok"):
        lines = [line.strip() for line in str(result.get("error", "")).splitlines()]
        text = " ... ".join(line for line in (lines[:1] + lines[-1:]) if line)
        notes.append(f"torch: the child process failed ({text}), so not timed")
        return {}
    return result


# ----------------------------------------------------------------------------------------
# Reporting.


def _ms(timing: Optional[Dict], errors: Dict, kind: str, places: int = 3) -> str:
    if timing is None:
        return "failed" if kind in errors else "n/a"
    return f"{timing['median_ms']:.{places}f}"


def _text_table(headers: Sequence[str], table: Sequence[Sequence[str]], left: int = 3) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *table)]

    def line(cells):
        return "  ".join(
            str(c).ljust(w) if i < left else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths))
        )

    return "\n".join(
        [line(headers), "  ".join("-" * w for w in widths)] + [line(row) for row in table]
    )


def _speedup(base: Dict, row: Dict, kind: str) -> str:
    if base[kind] is None or row[kind] is None:
        return "n/a"
    return f"{base[kind]['median_ms'] / row[kind]['median_ms']:.2f}x"


def format_table(rows: Sequence[Dict[str, Any]]) -> str:
    """An aligned table: one line per case, dtype and implementation (milliseconds)."""
    headers = [
        "case",
        "dtype",
        "impl",
        "fwd ms",
        "(min)",
        "in graph",
        "chained",
        "fwd+bwd ms",
        "(min)",
        "in graph",
        "fwd speed-up",
        "f+b speed-up",
        "max rel diff",
    ]
    base = {(r["label"], r["dtype"]): r for r in rows if r["baseline"]}
    table = []
    for r in rows:
        b, e = base[(r["label"], r["dtype"])], r["errors"]
        diffs = r["max_rel_diff"].values()
        table.append(
            [
                r["label"],
                r["dtype"],
                r["impl"] + (" (baseline)" if r["baseline"] else ""),
                _ms(r["fwd"], e, "fwd"),
                "n/a" if r["fwd"] is None else f"{r['fwd']['min_ms']:.3f}",
                _ms(r["fwd_in_graph"], e, "fwd_in_graph"),
                _ms(r["fwd_chained"], e, "fwd_chained"),
                _ms(r["fwd_bwd"], e, "fwd_bwd"),
                "n/a" if r["fwd_bwd"] is None else f"{r['fwd_bwd']['min_ms']:.3f}",
                _ms(r["fwd_bwd_in_graph"], e, "fwd_bwd_in_graph"),
                _speedup(b, r, "fwd"),
                _speedup(b, r, "fwd_bwd"),
                f"{max(diffs):.1e}" if diffs else "n/a",
            ]
        )
    return _text_table(headers, table)


def format_per_lookup(rows: Sequence[Dict[str, Any]]) -> str:
    """Microseconds per lookup and the gathered bandwidth, for the rows with lookups."""
    headers = [
        "case",
        "dtype",
        "impl",
        "lookups",
        "fwd us/lookup",
        "in graph",
        "fwd+bwd us/lookup",
        "in graph",
        "gathered TB/s",
    ]
    table = []
    for r in rows:
        if not r["lookups"]:
            continue
        per = r["us_per_lookup"]

        def cell(kind, per=per, r=r):
            return f"{per[kind]:.4f}" if kind in per else _ms(None, r["errors"], kind)

        tb_s = r["gathered_tb_s"]
        table.append(
            [
                r["label"],
                r["dtype"],
                r["impl"],
                f"{r['lookups']:,}",
                cell("fwd"),
                cell("fwd_in_graph"),
                cell("fwd_bwd"),
                cell("fwd_bwd_in_graph"),
                "n/a" if tb_s is None else f"{tb_s:.3g}",
            ]
        )
    return _text_table(headers, table) if table else ""


def _environment(args, torch_info: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    import tensorflow as tf

    import tf_ttemb
    from tf_ttemb.ops import _loader

    return {
        "tf_ttemb_version": tf_ttemb.__version__,
        "tf_version": tf.__version__,
        "build": _loader.read_build_info(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": _timing.cpu_model(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": _timing.usable_cpus(),
        "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
        "device": args.device,
        "torch": torch_info,
        "command_line": [sys.executable, "-m", "tf_ttemb"] + sys.argv[1:],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


_log = _timing.log


def _options(opts: argparse.Namespace) -> Dict[str, Any]:
    return {k: v for k, v in vars(opts).items() if k != "func"}


def _device_error(args: argparse.Namespace) -> Optional[str]:
    """Why --device is not a device here, or None. Asked of the physical devices, so that
    TensorFlow does not start using the GPU before torch's child process has run."""
    import tensorflow as tf

    devices = [
        d.name.replace("/physical_device:", "/device:") for d in tf.config.list_physical_devices()
    ]
    wanted = args.device.upper().removeprefix("/DEVICE:").lstrip("/")
    if any(name.upper().endswith(wanted) for name in devices):
        return None
    return (
        f"bench: error: --device {args.device} is not one of TensorFlow's devices here: "
        f"{', '.join(devices)}"
    )


def main(args: argparse.Namespace) -> int:
    """Runs the benchmarks; returns the exit status."""
    runs = [resolve(args, name) for name in (args.preset or [None])]
    import tensorflow as tf

    # Every step is a tf.function of its own: TensorFlow's warnings about functions traced
    # many times say nothing here.
    tf.get_logger().setLevel("ERROR")
    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    from tf_ttemb.ops import _loader

    error = _device_error(args)
    if error:
        print(error, file=sys.stderr)
        return 2
    items = plan(runs)
    if "CPU" in args.device.upper() and not args.quick:
        for name in args.preset or []:
            _log(
                f"bench: --preset {name} at full size on the CPU: expect "
                f"{PRESETS[name].cpu_cost} (estimated); --quick runs its shape smaller"
            )
    notes: List[str] = []
    start = time.perf_counter()
    mode = torch_mode(args, items, notes)
    for opts in runs:
        opts.torch_mode = mode
    child = run_torch_child(args, items, notes) if mode == "child" else {}
    _loader.load_op_library()  # fails here, with the loader's advice, when not built
    rows: List[Dict[str, Any]] = []
    with tf.device(args.device):
        for item in items:
            _log(f"bench: {item.label} {item.dtype} ...")
            case = build(item)
            rows += _bench_cases.time_case(case, item.opts)
            entry = child.get("results", {}).get(f"{item.label} {item.dtype}")
            if entry is not None:
                rows.append(_bench_cases.torch_child_row(case, entry, child["timer"]))
            del case
    elapsed = time.perf_counter() - start
    repeats = sorted({o.repeats for o in runs})
    steps = sorted({o.in_graph_steps for o in runs})
    print(
        f"tf_ttemb {__import__('tf_ttemb').__version__} op benchmarks on {args.device}, "
        f"TensorFlow {tf.__version__}: median of {'/'.join(map(str, repeats))} calls after "
        f"{args.warmup or runs[0].warmup} warm-up calls (ms); in graph and chained: per step "
        f"of {'/'.join(map(str, steps))} in one call; speed-up = baseline time / time"
    )
    if child.get("ok"):
        print(
            f"  torch {child['torch_version']} on {child['device_name']} in a child process, "
            f"timed with {child['timer']}"
        )
    for label, shape in dict.fromkeys((r["label"], r["shape"]) for r in rows):
        print(f"  {label}: {shape}")
    print()
    print(format_table(rows))
    per_lookup = format_per_lookup(rows)
    if per_lookup:
        print("\nPer lookup (one id of a bag), microseconds; gathered TB/s: rows read / in graph")
        print(per_lookup)
    failures = [
        f"  {r['label']} {r['dtype']} {r['impl']} {kind}: {text}"
        for r in rows
        for kind, text in r["errors"].items()
    ]
    if failures:
        print("\nFailed:")
        print("\n".join(failures))
    if notes:
        print()
        print("\n".join(notes))
    print(f"\n({elapsed:.1f} s)")
    if args.json:
        torch_info = {k: v for k, v in child.items() if k != "results"} or None
        result = {
            "environment": _environment(args, torch_info),
            "options": _options(args),
            "runs": [_options(o) for o in runs],
            "notes": notes,
            "seconds": elapsed,
            "results": rows,
        }
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2, default=str)
            f.write("\n")
        print(f"Wrote {args.json}")
    return 0
