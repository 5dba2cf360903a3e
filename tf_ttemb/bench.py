"""`python -m tf_ttemb bench`: the op benchmarks, on this machine, as a table and JSON.

Cases (`--cases`, all by default), each timed forward (`fwd`) and forward + backward
(`fwd+bwd`: the output and the gradients of a random upstream gradient), for every
dtype of `--dtypes`:

* `gather_reduce_sum`: a weighted-sum EmbeddingBag, a `[rows, dim]` table variable and
  `bags x bag_size` uniform ids with weights. `custom_op` is
  `tf_ttemb.gather_reduce_sum(..., implementation="custom_op")`; the baseline `tf_gather`
  is what plain TensorFlow users write, `tf.reduce_sum(tf.gather(table, ids) * w[..., None],
  axis=-2)`. Gradients w.r.t. the table and the weights. On the CPU, when torch is
  installed, `torch` is `torch.nn.functional.embedding_bag(..., mode="sum",
  per_sample_weights=w, sparse=True)` on the same data (float32, float64, bfloat16).
* `tt_rows`: rows of a Tensor-Train table (`tf_ttemb.layers.TTEmbeddingBag`'s cores for
  `tt_rows x tt_dim`, ranks `tt_rank`), decompressed by `tf_ttemb.tt_rows` with the custom
  op, against `tf.gather` from the same table stored densely (the baseline; decompressed
  by numpy in float64, `tf_ttemb.tt.to_dense`). Gradients w.r.t. the cores and w.r.t. the
  dense table (fwd+bwd compares the outputs only).
* `pkm`: a `tf_ttemb.layers.ProductKeyMemory` layer on `pkm_tokens` tokens (query
  network, product-key top-k, softmax, memory read) with the memory read by the custom op
  (`custom_op`) and by tf_ttemb's plain-TensorFlow composite (`composite`, the baseline);
  fwd in inference mode, fwd+bwd in training mode w.r.t. the inputs and every trainable
  weight. float32 only (the layer keeps float32 variables under every policy).

How it measures: every step is a `tf.function` (graph mode, no XLA) run on `--device`;
after `--warmup` untimed calls, the median and minimum wall-clock time of `--repeats`
calls (each call ends by fetching one element of its result, so the time includes all
the work also on a GPU). The implementations of a case are timed alternately, call by
call, so load from other processes on a shared machine affects them alike. Before
timing, each implementation's output (and for fwd+bwd, its gradients, densified) is
compared with the baseline's: `max_rel_diff` is the largest absolute difference divided
by the largest absolute baseline value, over the output and all gradients.

`in graph` is the forward's time without TensorFlow's per-call cost: `--in-graph-steps`
forwards in one `tf.while_loop` inside one `tf.function` call, divided by that count
(n/a for torch). A single call also pays TensorFlow's Python and runtime overhead, which
at small sizes, above all on a GPU, can be most of its time.

`--quick` shrinks every size and the repeats (seconds); the defaults take about a
minute on 2 CPU cores. The table goes to stdout, progress to stderr; `--json PATH`
writes the table's numbers with the machine, TensorFlow and build facts.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import time
from typing import Any, Callable, Dict, List, Sequence

from tf_ttemb import _timing

CASES = ("gather_reduce_sum", "tt_rows", "pkm")
DTYPES = ("float16", "bfloat16", "float32", "float64")
BASELINES = {"gather_reduce_sum": "tf_gather", "tt_rows": "tf_gather", "pkm": "composite"}

# name -> (default, --quick value, help)
SIZES: Dict[str, tuple] = {
    "rows": (1 << 18, 1 << 14, "gather_reduce_sum: rows of the table"),
    "dim": (128, 32, "gather_reduce_sum: columns of the table"),
    "bags": (1024, 256, "gather_reduce_sum: bags per batch"),
    "bag_size": (64, 16, "gather_reduce_sum: ids per bag"),
    "tt_rows": (1_000_000, 100_000, "tt_rows: rows of the TT table"),
    "tt_dim": (64, 16, "tt_rows: columns of the TT table"),
    "tt_rank": (16, 4, "tt_rows: TT rank (every inner rank)"),
    "tt_lookups": (16384, 2048, "tt_rows: ids per batch"),
    "pkm_tokens": (512, 128, "pkm: tokens per batch"),
    "pkm_dim": (256, 64, "pkm: input and value size"),
    "pkm_keys": (128, 32, "pkm: sub-keys per half (the memory has pkm_keys**2 slots)"),
    "pkm_heads": (4, 2, "pkm: heads"),
    "pkm_knn": (32, 8, "pkm: slots read per token and head"),
    "repeats": (20, 3, "timed calls per step"),
    "in_graph_steps": (10, 2, "forward steps inside one call for the in-graph time"),
    "warmup": (2, 1, "untimed calls before timing"),
}

EPILOG = """examples:
  python -m tf_ttemb bench                       # about 1 minute on 2 CPU cores
  python -m tf_ttemb bench --quick               # seconds
  python -m tf_ttemb bench --cases gather_reduce_sum --dtypes float32,bfloat16 \\
      --rows 1000000 --dim 64 --threads 2 --json bench.json
  python -m tf_ttemb bench --device GPU:0        # where a GPU and CUDA kernels exist

The benchmark programs in the checkout's python/bench/ directory measure more
(peak memory, PyTorch, FLOP rates); this command is the one that ships in the wheel."""


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the command's options to its subparser."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__.split("\n", 2)[2].split("How it measures")[0].strip()
    parser.epilog = EPILOG
    parser.add_argument(
        "--cases",
        type=_timing.choice_list(CASES),
        default=list(CASES),
        help=f"comma-separated cases to run (default: all: {','.join(CASES)})",
    )
    parser.add_argument(
        "--dtypes",
        type=_timing.choice_list(DTYPES),
        default=["float32"],
        help="comma-separated value dtypes of gather_reduce_sum and tt_rows "
        f"(from {','.join(DTYPES)}; default: float32)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small sizes and 3 repeats: seconds instead of minutes (explicit sizes win)",
    )
    parser.add_argument(
        "--threads",
        type=_positive,
        default=None,
        help="TensorFlow intra-op threads (default: TensorFlow's choice, one per core)",
    )
    parser.add_argument("--device", default="CPU:0", help="device to run on (default: CPU:0)")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the data")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    sizes = parser.add_argument_group("sizes (default / with --quick)")
    for name, (default, quick, text) in SIZES.items():
        sizes.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            type=_positive,
            default=None,
            help=f"{text} ({default:,} / {quick:,})",
        )


# ----------------------------------------------------------------------------------------
# Timing.


@dataclasses.dataclass
class Step:
    """One implementation's step: `fn()` runs it and returns its numbers. A TensorFlow
    step is a `tf.function`; a step of another framework (`tensorflow=False`, torch on
    the CPU) returns its results as that framework's tensors."""

    impl: str
    fn: Callable[[], Any]
    tensorflow: bool = True


def _sync(result: Any) -> None:
    """Fetches one element of the step's first tensor, so the step's work is finished
    (torch on the CPU has finished when it returns)."""
    import tensorflow as tf

    first = tf.nest.flatten(result, expand_composites=True)[0]
    if isinstance(first, (tf.Tensor, tf.Variable)):
        tf.reshape(first, [-1])[:1].numpy()


def in_graph(fn: Callable[[], Any], steps: int) -> Callable[[], Any]:
    """A `tf.function` running the step `fn` `steps` times in one `tf.while_loop` (each
    iteration adds one element of its first output to a sum, so none is pruned): timing
    it and dividing by `steps` leaves out the per-call cost of TensorFlow's Python and
    runtime, which a single call includes."""
    import tensorflow as tf

    @tf.function
    def many():
        def body(i, total):
            first = tf.nest.flatten(fn(), expand_composites=True)[0]
            return i + 1, total + tf.cast(tf.reshape(first, [-1])[0], tf.float32)

        start = (tf.constant(0), tf.constant(0.0))
        return tf.while_loop(lambda i, _: i < steps, body, start)[1]

    return many


def time_alternating(steps: Sequence[Step], warmup: int, repeats: int) -> Dict[str, Dict]:
    """impl -> {"median_ms", "min_ms", "repeats"}: the steps timed in alternation."""
    timings = _timing.time_alternating(
        {step.impl: step.fn for step in steps}, warmup, repeats, sync=_sync
    )
    return {impl: t.to_json() for impl, t in timings.items()}


def _dense_numpy(value: Any):
    import numpy as np
    import tensorflow as tf

    if isinstance(value, tf.IndexedSlices):
        value = tf.convert_to_tensor(value)
    if not isinstance(value, (tf.Tensor, tf.Variable)):  # a torch tensor
        if getattr(value, "is_sparse", False):
            value = value.to_dense()
        return value.detach().double().numpy()
    return np.asarray(tf.cast(value, tf.float64).numpy())


def max_rel_diff(got: Any, want: Any) -> float:
    """Largest |got - want| over the largest |want|, both across all tensors of a result.

    One scale for the whole result (output and gradients): a gradient that is zero up to
    rounding (the bias of a projection followed by batch norm) is not divided by its own
    rounding noise. Gradients are densified first.
    """
    import numpy as np
    import tensorflow as tf

    got_list = [_dense_numpy(g) for g in tf.nest.flatten(got)]
    want_list = [_dense_numpy(w) for w in tf.nest.flatten(want)]
    if len(got_list) != len(want_list):
        raise ValueError(f"{len(got_list)} results against {len(want_list)}")
    diff = scale = 0.0
    for g, w in zip(got_list, want_list):
        if g.shape != w.shape:
            raise ValueError(f"result shapes differ: {g.shape} against {w.shape}")
        if w.size:
            diff = max(diff, float(np.abs(g - w).max()))
            scale = max(scale, float(np.abs(w).max()))
    return diff / max(scale, 1e-30)


# ----------------------------------------------------------------------------------------
# Cases. Each returns rows of the result table.


def _row(case, impl, dtype, shape, fwd, in_graph_fwd, fwdbwd, diffs, baseline) -> Dict[str, Any]:
    return {
        "case": case,
        "impl": impl,
        "dtype": dtype,
        "shape": shape,
        "baseline": baseline,
        "fwd": fwd,
        "fwd_in_graph": in_graph_fwd,
        "fwd_bwd": fwdbwd,
        "max_rel_diff": diffs,
    }


def _run_case(
    case, dtype, shape, fwd_steps, bwd_steps, opts, compared=lambda result: result
) -> List[Dict[str, Any]]:
    """Checks the implementations against the baseline, then times them."""
    baseline = BASELINES[case]
    diffs: Dict[str, Dict[str, float]] = {}
    for kind, steps in (("fwd", fwd_steps), ("fwd_bwd", bwd_steps)):
        pick = compared if kind == "fwd_bwd" else (lambda result: result)
        want = pick(next(s for s in steps if s.impl == baseline).fn())
        for step in steps:
            diffs.setdefault(step.impl, {})[kind] = max_rel_diff(pick(step.fn()), want)
    fwd = time_alternating(fwd_steps, opts.warmup, opts.repeats)
    bwd = time_alternating(bwd_steps, opts.warmup, opts.repeats)
    loops = [Step(s.impl, in_graph(s.fn, opts.in_graph_steps)) for s in fwd_steps if s.tensorflow]
    per_loop = time_alternating(loops, opts.warmup, opts.repeats)
    in_graph_fwd = {
        impl: {key: value / opts.in_graph_steps for key, value in t.items() if key != "repeats"}
        for impl, t in per_loop.items()
    }
    return [
        _row(
            case,
            s.impl,
            dtype,
            shape,
            fwd[s.impl],
            in_graph_fwd.get(s.impl),
            bwd[s.impl],
            diffs[s.impl],
            s.impl == baseline,
        )
        for s in fwd_steps
    ]


def bench_gather_reduce_sum(dtype: str, opts, rng) -> List[Dict[str, Any]]:
    import tensorflow as tf

    import tf_ttemb

    n, d, b, length = opts.rows, opts.dim, opts.bags, opts.bag_size
    table = tf.Variable(tf.cast(rng.normal(size=(n, d)), dtype), name="table")
    ids = tf.constant(rng.integers(0, n, size=(b, length)), tf.int32)
    weights = tf.constant(rng.uniform(0.5, 1.5, size=(b, length)), dtype)
    upstream = tf.constant(rng.normal(size=(b, d)), dtype)

    def custom(w):
        return tf_ttemb.gather_reduce_sum(table, ids, w, implementation="custom_op")

    def plain(w):
        return tf.reduce_sum(tf.gather(table, ids) * w[..., None], axis=-2)

    def fwd_bwd(lookup):
        @tf.function
        def step():
            with tf.GradientTape() as tape:
                tape.watch(weights)
                out = lookup(weights)
            return [out] + tape.gradient(out, [table, weights], output_gradients=upstream)

        return step

    shape = f"{n:,}x{d} table, {b:,} bags x {length} ids, weighted sum"
    fwd = [
        Step("custom_op", tf.function(lambda: custom(weights))),
        Step("tf_gather", tf.function(lambda: plain(weights))),
    ]
    bwd = [Step("custom_op", fwd_bwd(custom)), Step("tf_gather", fwd_bwd(plain))]
    fwd_torch, bwd_torch = _torch_embedding_bag_steps(table, ids, weights, upstream, opts)
    return _run_case("gather_reduce_sum", dtype, shape, fwd + fwd_torch, bwd + bwd_torch, opts)


def _torch_embedding_bag_steps(table, ids, weights, upstream, opts) -> tuple:
    """torch's `embedding_bag` on the same data (sum with per-sample weights, sparse table
    gradient), when torch is installed and the benchmark runs on the CPU; else no steps.

    On a GPU, torch initialising CUDA inside a process that already runs TensorFlow there
    died (SIGFPE) on the H200 machine, so this command leaves it out there;
    python/bench/bench_tf_gpu_lookup.py times it in a child process.
    """
    if "CPU" not in opts.device.upper():
        return [], []
    try:
        import torch
    except ImportError:
        return [], []
    dtypes = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
    name = table.dtype.name
    if name not in dtypes:  # torch's CPU embedding_bag has no float16 per-sample weights
        return [], []
    t_table = torch.nn.Parameter(torch.from_numpy(table.numpy().astype("float64")).to(dtypes[name]))
    t_ids = torch.from_numpy(ids.numpy().astype("int64"))
    t_weights = torch.from_numpy(weights.numpy().astype("float64")).to(dtypes[name])
    t_weights.requires_grad_(True)
    t_upstream = torch.from_numpy(upstream.numpy().astype("float64")).to(dtypes[name])

    def forward():
        return torch.nn.functional.embedding_bag(
            t_ids, t_table, mode="sum", per_sample_weights=t_weights, sparse=True
        )

    def fwd():
        with torch.no_grad():
            return forward()

    def fwd_bwd():
        out = forward()
        table_grad, weights_grad = torch.autograd.grad(out, [t_table, t_weights], t_upstream)
        return [out, table_grad, weights_grad]

    return [Step("torch", fwd, tensorflow=False)], [Step("torch", fwd_bwd, tensorflow=False)]


def bench_tt_rows(dtype: str, opts, rng) -> List[Dict[str, Any]]:
    import numpy as np
    import tensorflow as tf

    import tf_ttemb
    from tf_ttemb import tt
    from tf_ttemb.layers import TTEmbeddingBag

    n, d, rank, count = opts.tt_rows, opts.tt_dim, opts.tt_rank, opts.tt_lookups
    layer = TTEmbeddingBag(
        n,
        d,
        tt_ranks=rank,
        seed=int(rng.integers(1 << 30)),
        dtype=dtype,
        implementation="custom_op",
    )
    layer.build(None)
    p, q, ranks = layer.tt_p_shapes, layer.tt_q_shapes, [rank] * (len(layer.tt_p_shapes) - 1)
    cores = list(layer.cores)
    # The dense table, decompressed independently of the op (numpy, float64).
    dense = tt.to_dense([c.numpy() for c in cores], p, q, ranks, n, dtype=np.float64)
    table = tf.Variable(tf.cast(dense, dtype), name="dense_table")
    ids = tf.constant(rng.integers(0, n, size=count), tf.int64)
    upstream = tf.constant(rng.normal(size=(count, d)), dtype)

    def custom():
        return tf_ttemb.tt_rows(
            cores, ids, p_shapes=p, q_shapes=q, ranks=ranks, implementation="custom_op"
        )

    def plain():
        return tf.gather(table, ids)

    def fwd_bwd(lookup, variables):
        @tf.function
        def step():
            with tf.GradientTape() as tape:
                out = lookup()
            return [out] + tape.gradient(out, variables, output_gradients=upstream)

        return step

    shape = (
        f"{n:,}x{d} table as TT p={p} q={q} ranks={ranks} "
        f"({sum(int(c.shape.num_elements()) for c in cores):,} parameters), "
        f"{count:,} ids"
    )
    fwd = [Step("custom_op", tf.function(custom)), Step("tf_gather", tf.function(plain))]
    bwd = [Step("custom_op", fwd_bwd(custom, cores)), Step("tf_gather", fwd_bwd(plain, [table]))]
    # The gradients are w.r.t. different variables (cores, dense table): fwd+bwd compares
    # the outputs only.
    return _run_case("tt_rows", dtype, shape, fwd, bwd, opts, compared=lambda r: r[0])


def bench_pkm(dtype: str, opts, rng) -> List[Dict[str, Any]]:
    import tensorflow as tf

    from tf_ttemb.layers import ProductKeyMemory

    tokens, dim = opts.pkm_tokens, opts.pkm_dim
    keys, heads, knn = opts.pkm_keys, opts.pkm_heads, min(opts.pkm_knn, opts.pkm_keys)
    x = tf.constant(rng.normal(size=(tokens, dim)), tf.float32)
    upstream = tf.constant(rng.normal(size=(tokens, dim)), tf.float32)
    layers = {}
    for impl in ("custom_op", "composite"):
        layer = ProductKeyMemory(
            output_dim=dim, n_keys=keys, k_dim=64, heads=heads, knn=knn, implementation=impl
        )
        layer.build(x.shape)
        layers[impl] = layer
    layers["composite"].set_weights(layers["custom_op"].get_weights())

    def fwd_step(layer):
        return tf.function(lambda: layer(x, training=False))

    def bwd_step(layer):
        @tf.function
        def step():
            with tf.GradientTape() as tape:
                tape.watch(x)
                out = layer(x, training=True)
            variables = layer.trainable_variables
            return [out] + tape.gradient(out, [x] + variables, output_gradients=upstream)

        return step

    shape = (
        f"{tokens:,} tokens x {dim}, {keys}**2 = {keys * keys:,} slots, {heads} heads x {knn} knn"
    )
    fwd = [Step(i, fwd_step(layer)) for i, layer in layers.items()]
    bwd = [Step(i, bwd_step(layer)) for i, layer in layers.items()]
    return _run_case("pkm", "float32", shape, fwd, bwd, opts)


# ----------------------------------------------------------------------------------------
# Reporting.


def format_table(rows: Sequence[Dict[str, Any]]) -> str:
    """An aligned table: one line per case, dtype and implementation."""
    headers = [
        "case",
        "dtype",
        "impl",
        "fwd ms",
        "(min)",
        "in graph",
        "fwd+bwd ms",
        "(min)",
        "fwd speed-up",
        "f+b speed-up",
        "max rel diff",
    ]
    base = {(r["case"], r["dtype"]): r for r in rows if r["baseline"]}
    table = []
    for r in rows:
        b = base[(r["case"], r["dtype"])]
        table.append(
            [
                r["case"],
                r["dtype"],
                r["impl"] + (" (baseline)" if r["baseline"] else ""),
                f"{r['fwd']['median_ms']:.3f}",
                f"{r['fwd']['min_ms']:.3f}",
                "n/a" if r["fwd_in_graph"] is None else f"{r['fwd_in_graph']['median_ms']:.3f}",
                f"{r['fwd_bwd']['median_ms']:.3f}",
                f"{r['fwd_bwd']['min_ms']:.3f}",
                f"{b['fwd']['median_ms'] / r['fwd']['median_ms']:.2f}x",
                f"{b['fwd_bwd']['median_ms'] / r['fwd_bwd']['median_ms']:.2f}x",
                f"{max(r['max_rel_diff'].values()):.1e}",
            ]
        )
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *table)]
    left = 3

    def line(cells):
        return "  ".join(
            str(c).ljust(w) if i < left else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths))
        )

    return "\n".join(
        [line(headers), "  ".join("-" * w for w in widths)] + [line(row) for row in table]
    )


def _environment(opts) -> Dict[str, Any]:
    import tensorflow as tf

    import tf_ttemb
    from tf_ttemb.ops import _loader

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            cpu = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                cpu,
            )
    except OSError:
        pass
    return {
        "tf_ttemb_version": tf_ttemb.__version__,
        "tf_version": tf.__version__,
        "build": _loader.read_build_info(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": cpu,
        "cpu_count": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
        "device": opts.device,
        "command_line": [sys.executable, "-m", "tf_ttemb"] + sys.argv[1:],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


_log = _timing.log


def main(args: argparse.Namespace) -> int:
    """Runs the benchmarks; returns the exit status."""
    for name, (default, quick, _) in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else default)
    import numpy as np
    import tensorflow as tf

    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    from tf_ttemb.ops import _loader

    devices = [d.name for d in tf.config.list_logical_devices()]
    wanted = args.device.upper().removeprefix("/DEVICE:").lstrip("/")
    if not any(name.upper().endswith(wanted) for name in devices):
        print(
            f"bench: error: --device {args.device} is not one of TensorFlow's devices here: "
            f"{', '.join(devices)}",
            file=sys.stderr,
        )
        return 2
    _loader.load_op_library()  # fails here, with the loader's advice, when not built
    runners = {
        "gather_reduce_sum": bench_gather_reduce_sum,
        "tt_rows": bench_tt_rows,
        "pkm": bench_pkm,
    }
    rows: List[Dict[str, Any]] = []
    start = time.perf_counter()
    with tf.device(args.device):
        for case in args.cases:
            for dtype in args.dtypes if case != "pkm" else ["float32"]:
                _log(f"bench: {case} {dtype} ...")
                rng = np.random.default_rng([args.seed, CASES.index(case), DTYPES.index(dtype)])
                rows += runners[case](dtype, args, rng)
    elapsed = time.perf_counter() - start
    print(
        f"tf_ttemb {__import__('tf_ttemb').__version__} op benchmarks on {args.device}, "
        f"TensorFlow {tf.__version__}, median of {args.repeats} calls after {args.warmup} "
        "warm-up calls (ms); speed-up = baseline time / time"
    )
    shapes = dict.fromkeys((r["case"], r["shape"]) for r in rows)
    for case, shape in shapes:
        print(f"  {case}: {shape}")
    print()
    print(format_table(rows))
    print(f"\n({elapsed:.1f} s)")
    if args.json:
        result = {
            "environment": _environment(args),
            "options": {k: v for k, v in vars(args).items() if k not in ("func",)},
            "seconds": elapsed,
            "results": rows,
        }
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2, default=str)
            f.write("\n")
        print(f"Wrote {args.json}")
    return 0
