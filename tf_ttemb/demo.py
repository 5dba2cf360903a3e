"""`python -m tf_ttemb demo`: what tf_ttemb buys you, measured on your machine.

The demo is a list of sections (`SECTIONS`), one per feature; each one runs its
measurements, prints a summary and saves a plot and a JSON file under `--out`.

* `gather_reduce_sum`: a Product-Key-Memory-like lookup (a value table, and per token
  heads × knn slots with softmax weights), done by `tf_ttemb.gather_reduce_sum` and by
  the plain TensorFlow composite `tf.reduce_sum(tf.gather(values, ids) * w[..., None], -2)`.
  It compares one training step (forward and the gradients w.r.t. the values and the
  weights) in time and peak memory, checks that both give the same numbers, and sweeps
  the number of tokens.
* `tt_quality`: a small CTR model (3 sparse features over tables of 1,000,000 rows, 4 dense
  features, an MLP) trained on data from a planted logistic model, once with full
  `EmbeddingBag` tables and once per TT rank with `TTEmbeddingBag` tables: embedding
  parameters, compression, held-out logloss and AUC, and the time of a training step,
  against the dense-features-only model and the planted model itself (the best possible).
  `--sections tt_quality` runs only this section; `--tt-*` options set its sizes.
* `pkm_lm`: a small byte-level transformer language model trained on the Python standard
  library's own source files (those of the interpreter running the demo), once as is and
  once with the feed-forward block of its middle layer replaced by a
  `tf_ttemb.layers.ProductKeyMemory`, at equal steps and batches: validation bits per
  byte (learning curves), training steps/s, parameter counts and the memory's slot usage.
  The corpus, split and models are described in `tf_ttemb/_demo_lm.py`; `--lm-*` options
  set its length (`--lm-long` for a longer run).

How the `gather_reduce_sum` section measures:

* Times: median wall-clock time of the step as a `tf.function`, after a warm-up call,
  in this process, with TensorFlow's default CPU allocator (the one users get).
* Peak memory growth: how far memory rises above its level before the step, the step's
  output and gradients included, over the step's first run (traced beforehand, which
  runs nothing) in a fresh worker process per measurement: memory that an allocator kept
  from an earlier step, or an earlier peak, cannot hide it (after a warm-up step they
  did: the plain step read 0 MiB). A plain-TF step measured below the float32 rows it
  must gather is reported as not measured. On Linux it is the peak resident set size
  (VmHWM, which writing "5" to /proc/self/clear_refs resets before the step); the worker
  runs with
  `MALLOC_MMAP_THRESHOLD_=65536`, so every buffer of 64 KiB or more is mapped when
  allocated and returned to the OS when freed, and the peak is that of live memory, kernel
  scratch included. Elsewhere it falls back to TensorFlow's BFC CPU allocator statistics
  (`TF_CPU_ALLOCATOR_USE_BFC=true`, `tf.config.experimental.get_memory_info`), which count
  whole allocator chunks and so can overstate a tensor by up to 2x. Where TensorFlow sees a
  GPU the step runs there and the peak is the GPU allocator's
  (`tf.config.experimental.get_memory_info("GPU:0")`, bytes in use, its peak reset before
  the step), taken in the demo's own process. The output says which method was used.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import keras
import numpy as np
import tensorflow as tf

import tf_ttemb
from tf_ttemb.ops import _loader

DEFAULT_OUT = "demo_output"
MIB = float(1 << 20)

# Printed before each line the memory worker sends to the demo process.
_RECORD_MARK = "@tf_ttemb-demo-record "


# ----------------------------------------------------------------------------------------
# Measuring.


def gpu_visible() -> bool:
    """Whether TensorFlow sees a GPU (then the demo's steps run there)."""
    return bool(tf.config.list_physical_devices("GPU"))


def median_time_ms(fn: Callable[[], Any], warmup: int, repeats: int) -> float:
    """Median wall-clock milliseconds of `fn()` over `repeats` calls after `warmup` calls.

    Each call is timed until every device is done with it (on a GPU a call returns once
    its kernels are queued).
    """
    sync = tf.test.experimental.sync_devices if gpu_visible() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _status_kib(field: str) -> Optional[int]:
    """A `kB` field of /proc/self/status (Linux), or None."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


RSS = "peak resident set size"
TF_ALLOCATOR = "TensorFlow BFC allocator statistics"
GPU_ALLOCATOR = "TensorFlow GPU allocator statistics"


def memory_method() -> str:
    """`GPU_ALLOCATOR` where TensorFlow sees a GPU (the steps run there); else `RSS` where
    this process may reset its peak RSS (Linux), else `TF_ALLOCATOR`."""
    if gpu_visible():
        return GPU_ALLOCATOR
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return TF_ALLOCATOR
    return RSS if _status_kib("VmHWM") is not None else TF_ALLOCATOR


def memory_worker_env(method: str) -> Dict[str, Optional[str]]:
    """Environment changes that `method` needs in a fresh process (None removes a name)."""
    if method == GPU_ALLOCATOR:
        return {}
    if method == RSS:
        # Fixed (not adaptive) mmap threshold: freed buffers >= 64 KiB leave the RSS.
        return {"MALLOC_MMAP_THRESHOLD_": "65536", "TF_CPU_ALLOCATOR_USE_BFC": None}
    return {"TF_CPU_ALLOCATOR_USE_BFC": "true"}


def peak_growth_bytes(fn: Callable[[], Any], method: str) -> int:
    """How far memory rises above its current level while `fn()` runs and is held.

    Args:
      fn: The computation; its result stays alive until the peak is read.
      method: `RSS`, `TF_ALLOCATOR` or `GPU_ALLOCATOR`, in a process started with
        `memory_worker_env`.

    Returns:
      The growth in bytes.
    """
    if method == RSS:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")  # resets VmHWM, the peak resident set size, to the current size
        before = _status_kib("VmRSS")
        result = fn()
        peak = _status_kib("VmHWM")
        del result
        return (peak - before) * 1024
    device = "GPU:0" if method == GPU_ALLOCATOR else "CPU:0"
    tf.config.experimental.reset_memory_stats(device)
    before = tf.config.experimental.get_memory_info(device)["current"]
    result = fn()
    peak = tf.config.experimental.get_memory_info(device)["peak"]
    del result
    return peak - before


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table: first column left-aligned, the others right-aligned."""
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows)]

    def line(cells: Sequence[str]) -> str:
        return " | ".join(
            cell.ljust(width) if i == 0 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(cells, widths))
        )

    return "\n".join(
        [line(headers), "-+-".join("-" * width for width in widths)] + [line(r) for r in rows]
    )


NOT_MEASURED = "not measured"


def _ratio(numerator: Optional[float], denominator: Optional[float]) -> str:
    if numerator is None or denominator is None:
        return NOT_MEASURED
    if denominator <= 0:
        return "n/a (zero)"
    return f"{numerator / denominator:.1f}x"


def _mib(num_bytes: Optional[float]) -> str:
    return NOT_MEASURED if num_bytes is None else f"{num_bytes / MIB:,.1f}"


# ----------------------------------------------------------------------------------------
# Section `gather_reduce_sum`: a Product-Key-Memory-like lookup.


@dataclasses.dataclass(frozen=True)
class PkmShape:
    """The lookup of a Product-Key-Memory layer: per token, heads × knn weighted slots."""

    slots: int = 65_536
    dim: int = 256
    heads: int = 4
    knn: int = 32

    @property
    def bag_size(self) -> int:
        """Slots per token: one bag of heads × knn entries."""
        return self.heads * self.knn

    def describe(self) -> str:
        """A one-line description for the report."""
        return (
            f"values table {self.slots:,} x {self.dim} float32 "
            f"({self.slots * self.dim * 4 / MIB:,.1f} MiB); per token {self.heads} heads x "
            f"{self.knn} knn = {self.bag_size} slots with softmax weights"
        )


# With a GPU: the case of the feature request that asked for this op (BERT-large's width,
# batch 32 x 512 tokens, PKM's 4 heads x 32 knn over 512^2 values), whose plain lookup
# gathers [16,384, 128, 1024] float32 rows, 8 GiB, against a 64 MiB output.
GPU_SHAPE = PkmShape(slots=262_144, dim=1024, heads=4, knn=32)
GPU_TOKENS = [2_048, 4_096, 8_192, 16_384]
GPU_HEADLINE_TOKENS = 32 * 512
# Without one: sizes that take seconds on 2 cores.
CPU_TOKENS = [256, 512, 1024, 2048, 4096]
CPU_HEADLINE_TOKENS = 1024


def resolve_sizes(args: argparse.Namespace) -> None:
    """Fills the `gather_reduce_sum` sizes left unset (None) on the command line: the GPU
    case where TensorFlow sees a GPU, else the CPU one."""
    gpu = gpu_visible()
    shape = GPU_SHAPE if gpu else PkmShape()
    defaults = {
        "slots": shape.slots,
        "dim": shape.dim,
        "heads": shape.heads,
        "knn": shape.knn,
        "tokens": GPU_TOKENS if gpu else CPU_TOKENS,
        "headline_tokens": GPU_HEADLINE_TOKENS if gpu else CPU_HEADLINE_TOKENS,
    }
    for name, value in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)


@functools.lru_cache(maxsize=1)
def pkm_values(shape: PkmShape, seed: int) -> np.ndarray:
    """The [slots, dim] value table, initialised like PKM's values: N(0, 1/dim) (cached:
    the GPU case's is 1 GiB; read-only)."""
    rng = np.random.default_rng([seed, 0])
    values = rng.normal(0.0, shape.dim**-0.5, (shape.slots, shape.dim)).astype(np.float32)
    values.flags.writeable = False
    return values


def pkm_batch(shape: PkmShape, tokens: int, seed: int) -> Dict[str, np.ndarray]:
    """Slot ids and weights of `tokens` tokens, and an upstream gradient.

    Returns:
      `ids` [tokens, heads * knn] int64, uniform random slots; `weights` of the same
      shape, a softmax over each head's knn scores (positive, summing to 1 per head);
      `upstream` [tokens, dim], a random gradient of the loss w.r.t. the output.
    """
    rng = np.random.default_rng([seed, 1, tokens])
    ids = rng.integers(0, shape.slots, (tokens, shape.bag_size), dtype=np.int64)
    scores = 2.0 * rng.standard_normal((tokens, shape.heads, shape.knn))
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    upstream = rng.standard_normal((tokens, shape.dim))
    return {
        "ids": ids,
        "weights": weights.reshape(tokens, shape.bag_size).astype(np.float32),
        "upstream": upstream.astype(np.float32),
    }


def fused_lookup(values: tf.Variable, ids: tf.Tensor, weights: tf.Tensor) -> tf.Tensor:
    """The lookup with tf_ttemb: no [tokens, slots, dim] tensor is ever built."""
    return tf_ttemb.gather_reduce_sum(values, ids, weights)


def composite_lookup(values: tf.Variable, ids: tf.Tensor, weights: tf.Tensor) -> tf.Tensor:
    """The lookup as plain TensorFlow: gathers [tokens, slots, dim], weighs it, sums it."""
    return tf.reduce_sum(tf.gather(values, ids) * weights[..., None], axis=-2)


LOOKUPS: Dict[str, Callable[[tf.Variable, tf.Tensor, tf.Tensor], tf.Tensor]] = {
    "plain TF (gather * w, reduce_sum)": composite_lookup,
    "tf_ttemb.gather_reduce_sum": fused_lookup,
}
BASELINE, FUSED = list(LOOKUPS)


def training_step(lookup: Callable, values: tf.Variable) -> Callable:
    """A `tf.function` returning the lookup and its gradients w.r.t. values and weights."""

    @tf.function
    def step(ids: tf.Tensor, weights: tf.Tensor, upstream: tf.Tensor):
        with tf.GradientTape() as tape:
            tape.watch(weights)
            output = lookup(values, ids, weights)
        values_grad, weights_grad = tape.gradient(
            output, [values, weights], output_gradients=upstream
        )
        return output, values_grad, weights_grad

    return step


def table_variables(shape: PkmShape, seed: int) -> Dict[str, tf.Variable]:
    """One copy of the values table per lookup.

    Separate variables matter: once a variable has been read sparsely (`tf.gather`, or a
    sparse optimizer update), TensorFlow copies all of it on every later dense read, so a
    table shared with the plain lookup would charge the fused one a full copy per step.
    """
    initial = pkm_values(shape, seed)
    return {name: tf.Variable(initial, name="values") for name in LOOKUPS}


def _batch_tensors(shape: PkmShape, tokens: int, seed: int) -> Tuple[tf.Tensor, ...]:
    batch = pkm_batch(shape, tokens, seed)
    return tuple(tf.constant(batch[key]) for key in ("ids", "weights", "upstream"))


def gathered_bytes(shape: PkmShape, tokens: int) -> int:
    """Bytes of the [tokens, heads * knn, dim] float32 rows the plain lookup gathers: the
    least its training step can hold, and a check on the memory measurement."""
    return tokens * shape.bag_size * shape.dim * 4


def first_step_growth(shape: PkmShape, lookup: str, tokens: int, seed: int, method: str) -> int:
    """Peak memory growth of the first training step of `lookup` in this process.

    The step is traced first (`get_concrete_function`, which runs nothing), then run
    once: its memory comes from allocations this process has never made, so neither an
    earlier step's peak nor memory an allocator kept from an earlier step can hide it.
    Meant for a fresh process (`_run_memory_worker` starts one per measurement).
    """
    table = tf.Variable(pkm_values(shape, seed), name="values")
    batch = _batch_tensors(shape, tokens, seed)
    step = training_step(LOOKUPS[lookup], table)
    step.get_concrete_function(*batch)
    return peak_growth_bytes(lambda: step(*batch), method)


def _memory_worker(spec_json: str) -> None:
    """Entry point of a memory worker process: one marked JSON line, one measurement."""
    spec = json.loads(spec_json)
    shape = PkmShape(**spec["shape"])
    growth = first_step_growth(shape, spec["lookup"], spec["tokens"], spec["seed"], spec["method"])
    record = {"lookup": spec["lookup"], "tokens": spec["tokens"], "bytes": growth}
    print(_RECORD_MARK + json.dumps(record), flush=True)


def _run_memory_worker(
    shape: PkmShape,
    token_counts: Sequence[int],
    seed: int,
    method: str,
    on_record: Callable[[dict], None],
) -> List[dict]:
    """Measures every (token count, lookup) in a fresh process of its own, set up for
    `method` (in this process for `GPU_ALLOCATOR`, whose statistics need none).

    Separate processes keep the memory settings (which change timings a lot) away from
    the timings taken in this process, and give each step a process whose memory no
    earlier step has touched. A plain-TF step that measures below the rows it must
    gather (`gathered_bytes`) is reported as not measured (bytes None), never as a number.
    """
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    for key, value in memory_worker_env(method).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(tf_ttemb.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
    records = []
    for tokens in token_counts:
        for lookup in LOOKUPS:
            spec = {"shape": dataclasses.asdict(shape), "tokens": tokens, "lookup": lookup,
                    "seed": seed, "method": method}
            if method == GPU_ALLOCATOR:
                # The GPU allocator counts the bytes in use, and its peak restarts at
                # reset_memory_stats: what an earlier step left pooled or peaked at cannot
                # hide a step's growth, so this process measures (a fresh one would spend
                # ~20 s starting TensorFlow on the GPU).
                growth = first_step_growth(shape, lookup, tokens, seed, method)
                records.append(_checked({"lookup": lookup, "tokens": tokens, "bytes": growth},
                                        shape))
                on_record(records[-1])
                continue
            command = [
                sys.executable,
                "-c",
                "import sys; from tf_ttemb import demo; demo._memory_worker(sys.argv[1])",
                json.dumps(spec),
            ]
            proc = subprocess.run(command, env=env, capture_output=True, text=True)
            lines = proc.stdout.splitlines()
            found = [json.loads(line[len(_RECORD_MARK):]) for line in lines
                     if line.startswith(_RECORD_MARK)]
            if proc.returncode != 0 or len(found) != 1:
                tail = (lines + proc.stderr.splitlines())[-20:]
                raise RuntimeError(
                    f"the memory worker failed with status {proc.returncode}:\n" + "\n".join(tail)
                )
            records.append(_checked(found[0], shape))
            on_record(records[-1])
    return records


def _checked(record: dict, shape: PkmShape) -> dict:
    """`record`, with a plain-TF step measured below the rows it must gather marked not
    measured (bytes None)."""
    if record["lookup"] == BASELINE and record["bytes"] < gathered_bytes(shape, record["tokens"]):
        record["bytes"] = None
    return record


DENSIFY_ELEMENTS = 1 << 30  # elements per slice of rows that `_densified` sums at once


def _densified(value: Any) -> tf.Tensor:
    """`value` as a dense tensor; a `tf.IndexedSlices` summed a slice of rows at a time.

    The plain lookup's values gradient at the GPU case has 16,384 x 128 rows of 1,024:
    2^31 elements, which TensorFlow's GPU segment sum (behind `tf.convert_to_tensor`)
    aborts on (its launch configuration counts elements in an int32).
    """
    if not isinstance(value, tf.IndexedSlices):
        return tf.convert_to_tensor(value)
    num_rows = int(value.dense_shape[0])
    dim = int(value.values.shape[1])
    step = max(1, DENSIFY_ELEMENTS // max(dim, 1))
    dense = tf.zeros([num_rows, dim], value.values.dtype)
    for start in range(0, int(value.values.shape[0]), step):
        dense += tf.math.unsorted_segment_sum(
            value.values[start:start + step], value.indices[start:start + step], num_rows
        )
    return dense


def _differences(results: Dict[str, Tuple]) -> Dict[str, Tuple[float, float]]:
    """Max |fused - plain| and max |plain| of output, values gradient and weights gradient.

    The values gradients (IndexedSlices: deduplicated for the fused lookup, one row per
    lookup for the plain one) are compared densified.
    """
    names = ("output", "values gradient", "weights gradient")
    differences = {}
    for name, fused, plain in zip(names, results[FUSED], results[BASELINE]):
        fused, plain = _densified(fused), _densified(plain)
        differences[name] = (
            float(tf.reduce_max(tf.abs(fused - plain))),
            float(tf.reduce_max(tf.abs(plain))),
        )
    return differences


def _measure(
    shape: PkmShape, token_counts: Sequence[int], args: argparse.Namespace
) -> Tuple[Dict[str, Dict[int, Dict[str, Any]]], Dict[str, Tuple[float, float]], str]:
    """Memory (worker process) and time (this process) per lookup and token count.

    Returns:
      `sweep[lookup][tokens] = {"bytes": peak growth, "time_ms": median}`, the
      differences at `args.headline_tokens` (see `_differences`), and the memory method.
    """
    progress = keras.utils.Progbar(
        2 * len(LOOKUPS) * len(token_counts) + 1, unit_name="measurement"
    )
    method = memory_method()
    sweep: Dict[str, Dict[int, Dict[str, Any]]] = {name: {} for name in LOOKUPS}
    for record in _run_memory_worker(
        shape, token_counts, args.seed, method, lambda _: progress.add(1)
    ):
        sweep[record["lookup"]][record["tokens"]] = {"bytes": record["bytes"]}

    tables = table_variables(shape, args.seed)
    differences = {}
    for tokens in token_counts:
        batch = _batch_tensors(shape, tokens, args.seed)
        # One tf.function per token count: each traces once, for its own shapes.
        steps = {name: training_step(lookup, tables[name]) for name, lookup in LOOKUPS.items()}
        for name, step in steps.items():
            sweep[name][tokens]["time_ms"] = median_time_ms(
                lambda: step(*batch), warmup=1, repeats=args.repeats
            )
            progress.add(1)
        if tokens == args.headline_tokens:
            differences = _differences({name: step(*batch) for name, step in steps.items()})
            progress.add(1)
    return sweep, differences, method


def _print_summary(
    shape: PkmShape,
    token_counts: Sequence[int],
    sweep: Dict[str, Dict[int, Dict[str, Any]]],
    differences: Dict[str, Tuple[float, float]],
    memory: str,
    args: argparse.Namespace,
) -> None:
    tokens = args.headline_tokens
    headline = {name: sweep[name][tokens] for name in LOOKUPS}
    plain, fused = headline[BASELINE], headline[FUSED]
    print(f"\nAt {tokens:,} tokens ({tokens * shape.bag_size:,} lookups), one training step:")
    print(
        format_table(
            ["", "time ms", "peak memory growth MiB"],
            [[name, f"{r['time_ms']:,.1f}", _mib(r["bytes"])] for name, r in headline.items()],
        )
    )
    memory_ratio = _ratio(plain["bytes"], fused["bytes"])
    if memory_ratio == NOT_MEASURED:
        memory_claim = (
            "memory not measured (the plain step measured less than the "
            f"{gathered_bytes(shape, tokens) / MIB:,.0f} MiB of rows it must gather)"
        )
    else:
        memory_claim = f"{memory_ratio} less memory"
    print(f"=> tf_ttemb: {memory_claim}, {_ratio(plain['time_ms'], fused['time_ms'])} faster.")
    same = all(diff <= 1e-5 * max(scale, 1.0) for diff, scale in differences.values())
    print(
        ("Same numbers" if same else "DIFFERENT NUMBERS")
        + ": max |tf_ttemb - plain TF| = "
        + ", ".join(
            f"{diff:.1e} ({name}, values up to {scale:.2g})"
            for name, (diff, scale) in differences.items()
        )
    )

    print("\nScaling with the number of tokens:")
    rows = []
    for t in token_counts:
        plain, fused = sweep[BASELINE][t], sweep[FUSED][t]
        rows.append(
            [
                f"{t:,}",
                f"{plain['time_ms']:,.1f}",
                f"{fused['time_ms']:,.1f}",
                _ratio(plain["time_ms"], fused["time_ms"]),
                _mib(plain["bytes"]),
                _mib(fused["bytes"]),
                _ratio(plain["bytes"], fused["bytes"]),
            ]
        )
    headers = [
        "tokens",
        "plain TF ms",
        "tf_ttemb ms",
        "faster",
        "plain TF MiB",
        "tf_ttemb MiB",
        "less memory",
    ]
    print(format_table(headers, rows))

    threads = tf.config.threading.get_intra_op_parallelism_threads() or os.cpu_count()
    if memory == GPU_ALLOCATOR:
        where = "on the GPU, each step timed until the device is done"
    elif os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").lower() in ("1", "true"):
        where = f"TensorFlow's BFC allocator (TF_CPU_ALLOCATOR_USE_BFC is set), {threads} threads"
    else:
        where = f"TensorFlow's default CPU allocator, {threads} threads"
    memory_note = {
        RSS: "each in a fresh process; peak resident set size, allocations of 64 KiB or "
        "more unmapped when freed",
        TF_ALLOCATOR: "each in a fresh process; TensorFlow BFC allocator statistics, which "
        "count whole chunks",
        GPU_ALLOCATOR: "TensorFlow's GPU allocator statistics (get_memory_info('GPU:0'))",
    }[memory]
    print(
        f"Times: median of {args.repeats} steps after a warm-up, tf.function, {where}. "
        f"Memory: peak growth over a step's first run, output and gradients included "
        f"({memory_note}); plain TF's check: "
        f"at least the [tokens, {shape.bag_size}, {shape.dim}] float32 rows it gathers "
        f"({gathered_bytes(shape, tokens) / MIB:,.0f} MiB at {tokens:,} tokens)."
    )


def _plot(
    path: str,
    shape: PkmShape,
    token_counts: Sequence[int],
    sweep: Dict[str, Dict[int, Dict[str, Any]]],
) -> bool:
    """Saves time and memory vs tokens as a PNG; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib import ticker
    except ImportError:
        return False
    figure, all_axes = plt.subplots(1, 2, figsize=(11, 4.2))
    panels = (
        ("time_ms", "training step time (ms)", 1.0),
        ("bytes", "peak memory growth (MiB)", MIB),
    )
    for axes, (key, label, unit) in zip(all_axes, panels):
        for name in LOOKUPS:
            ys = [(sweep[name][t][key] or np.nan) / unit for t in token_counts]
            axes.plot(token_counts, ys, marker="o", label=name)
        last = token_counts[-1]
        ratio = _ratio(sweep[BASELINE][last][key], sweep[FUSED][last][key])
        note = f"{ratio} {'less' if key == 'bytes' else 'faster'}"
        axes.annotate(
            note if ratio != NOT_MEASURED else "plain TF: memory not measured",
            (last, (sweep[FUSED][last][key] or np.nan) / unit),
            textcoords="offset points",
            xytext=(-10, -16),
            ha="right",
        )
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.set_xticks(token_counts, [f"{t:,}" for t in token_counts])
        axes.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:,.4g}"))
        axes.yaxis.set_minor_formatter(ticker.NullFormatter())
        axes.set_xlabel("tokens per batch")
        axes.set_ylabel(label + ", lower is better")
        axes.grid(True, which="both", alpha=0.3)
        axes.legend()
    figure.suptitle(
        f"PKM-like lookup: {shape.slots:,} x {shape.dim} values, {shape.bag_size} slots per "
        "token; forward + gradients"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def section_gather_reduce_sum(args: argparse.Namespace) -> Dict[str, Any]:
    """Fused vs plain-TF PKM-like lookup: time, memory, equality, scaling with tokens."""
    resolve_sizes(args)
    shape = PkmShape(slots=args.slots, dim=args.dim, heads=args.heads, knn=args.knn)
    token_counts = sorted(set(args.tokens) | {args.headline_tokens})
    where = (
        f"on the GPU ({tf.config.experimental.get_device_details(gpu)['device_name']})"
        if (gpu := (tf.config.list_physical_devices("GPU") or [None])[0])
        else f"on the CPU ({os.cpu_count()} cores)"
    )
    print(f"A Product-Key-Memory-like lookup, {where}: {shape.describe()}.")
    print(
        "One training step = the lookup plus its gradients w.r.t. the values (a tf.Variable) "
        f"and the weights; tokens {', '.join(f'{t:,}' for t in token_counts)}."
    )
    _loader.load_op_library()  # fail early, with the loader's advice, when it is not built

    sweep, differences, memory = _measure(shape, token_counts, args)
    _print_summary(shape, token_counts, sweep, differences, memory, args)

    result = {
        "shape": dataclasses.asdict(shape),
        "headline_tokens": args.headline_tokens,
        "repeats": args.repeats,
        "memory_method": memory,
        "max_abs_difference": {name: diff for name, (diff, _) in differences.items()},
        "sweep": {name: {str(t): v for t, v in by_t.items()} for name, by_t in sweep.items()},
    }
    json_path = os.path.join(args.out, "gather_reduce_sum.json")
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    png_path = os.path.join(args.out, "gather_reduce_sum.png")
    if args.no_plot:
        print(f"Saved {json_path}.")
    elif _plot(png_path, shape, token_counts, sweep):
        print(f"Saved {png_path} and {json_path}.")
    else:
        print(f"Saved {json_path} (no plot: matplotlib is not installed).")
    return result


# ----------------------------------------------------------------------------------------
# Section `tt_quality`: a small CTR model with full vs Tensor-Train compressed tables.
#
# The data comes from a planted logistic model, so the best achievable held-out quality is
# known. Each example has `num_features` categorical ids (Zipf-distributed over a table of
# `rows` ids, scattered over the table by a fixed random permutation, as hashed ids are)
# and `dense_features` standard-normal dense features:
#
#   logit = sum_f <u_f[id_f], v_f> + <a, x_dense> + bias,   label ~ Bernoulli(sigmoid(logit))
#
# where u_f[id] is a random `planted_dim`-vector per id (uniform components of unit
# variance, computed on the fly from a seeded hash of (seed, feature, id, component), so
# no planted table is ever stored) and v_f a fixed random direction. Per id this is an
# arbitrary random number (no low-rank structure over the ids), so an embedding table
# genuinely helps, and a compressed table that cannot represent arbitrary per-id values
# genuinely loses something.


@dataclasses.dataclass(frozen=True)
class CtrTask:
    """The planted CTR task: sizes, id distribution and the scale of each logit term."""

    num_features: int = 3
    rows: int = 1_000_000
    dense_features: int = 4
    planted_dim: int = 8
    zipf_exponent: float = 1.1
    embedding_scale: float = 1.0  # std of each feature's term <u_f[id], v_f>
    dense_scale: float = 1.0  # std of <a, x_dense>
    bias: float = -1.0
    seed: int = 0

    def describe(self) -> str:
        """A one-line description for the report."""
        return (
            f"{self.num_features} sparse features (one id each, Zipf({self.zipf_exponent:g}) "
            f"over {self.rows:,} ids) + {self.dense_features} dense features; labels from a "
            f"planted logistic model over random {self.planted_dim}-dim per-id vectors"
        )



def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser on uint64 arrays (wrapping arithmetic): a fast, good hash."""
    with np.errstate(over="ignore"):  # numpy warns on wrapping scalars, not arrays
        x = np.asarray(x, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def planted_vectors(task: CtrTask, feature: int, ids: np.ndarray) -> np.ndarray:
    """The planted vectors u_feature[ids], [..., planted_dim] float64.

    A pure function of (task.seed, feature, id): the same id gets the same vector in every
    batch and process, without storing a [rows, planted_dim] table. Components are uniform
    on [-sqrt(3), sqrt(3)] (mean 0, variance 1), independent across ids and components.
    """
    ids = np.asarray(ids, dtype=np.int64)
    key = _splitmix64(np.uint64(task.seed) * np.uint64(1_000_003) + np.uint64(feature))
    base = _splitmix64(ids.astype(np.uint64) ^ key)
    components = np.arange(task.planted_dim, dtype=np.uint64) * np.uint64(0x632BE59BD9B4E019)
    bits = _splitmix64(base[..., None] + components)
    uniform = (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53  # [0, 1)
    return (2.0 * uniform - 1.0) * np.sqrt(3.0)


@dataclasses.dataclass(frozen=True)
class PlantedModel:
    """The fixed parameters of the planted model (besides the per-id vectors)."""

    directions: np.ndarray  # [num_features, planted_dim], v_f
    dense_weights: np.ndarray  # [dense_features], a
    permutations: np.ndarray  # [num_features, rows]: Zipf rank r -> id
    zipf_cdf: np.ndarray  # [rows], cumulative probabilities of ranks 1..rows


def planted_model(task: CtrTask) -> PlantedModel:
    """Draws v_f, a and the rank -> id permutations from `task.seed`."""
    rng = np.random.default_rng([task.seed, 100])
    directions = rng.standard_normal((task.num_features, task.planted_dim))
    directions *= task.embedding_scale / np.linalg.norm(directions, axis=1, keepdims=True)
    dense_weights = rng.standard_normal(task.dense_features)
    dense_weights *= task.dense_scale / max(np.linalg.norm(dense_weights), 1e-12)
    permutations = np.stack([rng.permutation(task.rows) for _ in range(task.num_features)])
    weights = np.arange(1, task.rows + 1, dtype=np.float64) ** -task.zipf_exponent
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    return PlantedModel(directions, dense_weights, permutations, cdf)


def zipf_ranks(cdf: np.ndarray, size: Any, rng: np.random.Generator) -> np.ndarray:
    """Ranks in [0, len(cdf)) drawn with P(rank r) = cdf[r] - cdf[r - 1] (inverse CDF)."""
    ranks = np.searchsorted(cdf, rng.random(size), side="right")
    return np.minimum(ranks, len(cdf) - 1).astype(np.int64)


def ctr_data(task: CtrTask, model: PlantedModel, examples: int, stream: int) -> Dict[str, np.ndarray]:
    """`examples` examples of the planted task; `stream` picks an independent sample.

    Returns:
      `ids` [examples, num_features] int64, `dense` [examples, dense_features] float32,
      `labels` [examples] float32 in {0, 1}, and `logits` [examples] float64, the planted
      model's logits (the best any model can predict).
    """
    rng = np.random.default_rng([task.seed, 200, stream])
    ranks = zipf_ranks(model.zipf_cdf, (examples, task.num_features), rng)
    ids = np.stack(
        [model.permutations[f][ranks[:, f]] for f in range(task.num_features)], axis=1
    )
    dense = rng.standard_normal((examples, task.dense_features))
    logits = dense @ model.dense_weights + task.bias
    for f in range(task.num_features):
        logits += planted_vectors(task, f, ids[:, f]) @ model.directions[f]
    labels = (rng.random(examples) < 1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
    return {
        "ids": ids.astype(np.int64),
        "dense": dense.astype(np.float32),
        "labels": labels,
        "logits": logits,
    }


def logloss(labels: np.ndarray, logits: np.ndarray) -> float:
    """Mean binary cross-entropy of `labels` in {0, 1} under sigmoid(`logits`), in nats."""
    y = np.asarray(labels, dtype=np.float64)
    z = np.asarray(logits, dtype=np.float64)
    return float(np.mean(np.maximum(z, 0.0) - z * y + np.log1p(np.exp(-np.abs(z)))))


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve from ranks (Mann-Whitney U; ties count one half).

    NaN when `labels` has only one class.
    """
    positive = np.asarray(labels).astype(bool).ravel()
    scores = np.asarray(scores, dtype=np.float64).ravel()
    num_pos = int(positive.sum())
    num_neg = positive.size - num_pos
    if num_pos == 0 or num_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="stable")
    _, first, counts = np.unique(scores[order], return_index=True, return_counts=True)
    ranks = np.empty(scores.size, dtype=np.float64)
    ranks[order] = np.repeat(first + (counts + 1) / 2.0, counts)  # 1-based, ties averaged
    return float((ranks[positive].sum() - num_pos * (num_pos + 1) / 2.0) / (num_pos * num_neg))



class CtrModel(keras.Model):
    """Embedding bags (one per sparse feature) -> concat with the dense features -> MLP -> logit."""

    def __init__(self, bags: Sequence[keras.layers.Layer], hidden: Sequence[int] = (64, 32)):
        super().__init__()
        self.bags = list(bags)
        self.hidden = [keras.layers.Dense(units, activation="relu") for units in hidden]
        self.head = keras.layers.Dense(1)

    def call(self, ids: tf.Tensor, dense: tf.Tensor) -> tf.Tensor:
        parts = [bag(ids[:, f : f + 1]) for f, bag in enumerate(self.bags)] + [dense]
        x = tf.concat(parts, axis=-1)
        for layer in self.hidden:
            x = layer(x)
        return self.head(x)[:, 0]

    def embedding_variables(self) -> List[Any]:
        """The trainable variables of the embedding bags (tables or TT cores)."""
        return [v for bag in self.bags for v in bag.trainable_variables]


def _resource(variable: Any) -> tf.Variable:
    """The tf.Variable behind a Keras variable (or the variable itself)."""
    return getattr(variable, "value", variable) if isinstance(variable, keras.Variable) else variable


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """How every model of the comparison is trained (the same for all of them)."""

    steps: int = 1000
    batch: int = 1024
    embedding_lr: float = 0.05  # Adagrad, on tables and TT cores alike
    adagrad_initial: float = 0.0  # initial accumulator (0 as in PyTorch and FBTT)
    adagrad_epsilon: float = 1e-10
    mlp_lr: float = 0.002  # Adam, on the MLP
    eval_batch: int = 16_384


def train_ctr_model(
    model: CtrModel,
    train: Dict[str, np.ndarray],
    test: Dict[str, np.ndarray],
    config: TrainConfig,
    progress: Optional[Callable[[int, float], None]] = None,
) -> Dict[str, Any]:
    """Trains `model` for `config.steps` steps of one pass over `train`; scores `test`.

    Embedding variables get Adagrad (TensorFlow's fused kernels: the sparse one on the rows
    of an `IndexedSlices` gradient, the dense one otherwise), everything else Adam. Each
    step is one `tf.function` call: forward, gradients and all updates.

    Returns:
      `{"logloss", "auc"}` on `test`, `"train_logloss"` (mean over the last 10% of steps),
      `"step_ms"` (median wall time of a step after 5 warm-up steps), `"train_s"` and
      `"embedding_params"`.
    """
    batch = config.batch
    if config.steps * batch > len(train["labels"]):
        raise ValueError(
            f"{config.steps} steps x {batch} examples need {config.steps * batch:,} training "
            f"examples, got {len(train['labels']):,}"
        )
    ids, dense, labels = (tf.constant(train[k][:1]) for k in ("ids", "dense", "labels"))
    model(ids, dense)  # builds the variables
    embedding_vars = model.embedding_variables()
    embedding_keys = {id(v) for v in embedding_vars}
    mlp_vars = [v for v in model.trainable_variables if id(v) not in embedding_keys]
    accumulators = [
        tf.Variable(tf.fill(v.shape, tf.constant(config.adagrad_initial, v.dtype)), trainable=False)
        for v in embedding_vars
    ]
    adam = keras.optimizers.Adam(config.mlp_lr)
    adam.build(mlp_vars)
    lr = tf.constant(config.embedding_lr, tf.float32)
    epsilon = tf.constant(config.adagrad_epsilon, tf.float32)

    ids_spec = tf.TensorSpec([None, train["ids"].shape[1]], tf.int64)
    dense_spec = tf.TensorSpec([None, train["dense"].shape[1]], tf.float32)

    @tf.function(input_signature=[ids_spec, dense_spec, tf.TensorSpec([None], tf.float32)])
    def step(ids: tf.Tensor, dense: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            logits = model(ids, dense, training=True)
            loss = tf.reduce_mean(
                tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits)
            )
        grads = tape.gradient(loss, embedding_vars + mlp_vars)
        for var, acc, grad in zip(embedding_vars, accumulators, grads[: len(embedding_vars)]):
            if isinstance(grad, tf.IndexedSlices):
                # Rows may repeat (e.g. gathers in a composite lookup): sum them first, so
                # each row takes one Adagrad step on its total gradient.
                rows, position = tf.unique(grad.indices)
                grad = tf.IndexedSlices(
                    tf.math.unsorted_segment_sum(grad.values, position, tf.shape(rows)[0]), rows
                )
                tf.raw_ops.ResourceSparseApplyAdagradV2(
                    var=_resource(var).handle,
                    accum=acc.handle,
                    lr=lr,
                    epsilon=epsilon,
                    grad=grad.values,
                    indices=grad.indices,
                )
            else:
                tf.raw_ops.ResourceApplyAdagradV2(
                    var=_resource(var).handle, accum=acc.handle, lr=lr, epsilon=epsilon, grad=grad
                )
        adam.apply(grads[len(embedding_vars) :], mlp_vars)
        return loss

    @tf.function(input_signature=[ids_spec, dense_spec])
    def predict(ids: tf.Tensor, dense: tf.Tensor) -> tf.Tensor:
        return model(ids, dense, training=False)

    times, losses = [], []
    start_all = time.perf_counter()
    for i in range(config.steps):
        part = slice(i * batch, (i + 1) * batch)
        args = (tf.constant(train[k][part]) for k in ("ids", "dense", "labels"))
        start = time.perf_counter()
        loss = float(step(*args))
        times.append((time.perf_counter() - start) * 1e3)
        losses.append(loss)
        if progress is not None:
            progress(i + 1, loss)
    train_s = time.perf_counter() - start_all

    test_logits = np.concatenate(
        [
            predict(
                tf.constant(test["ids"][i : i + config.eval_batch]),
                tf.constant(test["dense"][i : i + config.eval_batch]),
            ).numpy()
            for i in range(0, len(test["labels"]), config.eval_batch)
        ]
    )
    tail = losses[-max(1, config.steps // 10) :]
    warm = times[5:] if len(times) > 5 else times
    return {
        "logloss": logloss(test["labels"], test_logits),
        "auc": auc(test["labels"], test_logits),
        "train_logloss": float(np.mean(tail)),
        "step_ms": statistics.median(warm),
        "train_s": train_s,
        "embedding_params": int(sum(int(np.prod(v.shape)) for v in embedding_vars)),
    }


def _tt_layer_class() -> Optional[type]:
    """`tf_ttemb.layers.TTEmbeddingBag` once it exists, else None."""
    return getattr(tf_ttemb.layers, "TTEmbeddingBag", None)


def _tt_implementation() -> str:
    """"custom_op" when the op library has the TT ops, else "composite" (plain TF ops)."""
    return "custom_op" if hasattr(_loader.load_op_library(), "tf_ttemb_tt_rows") else "composite"


def _bag_factories(
    task: CtrTask, dim: int, ranks: Sequence[int], tt_implementation: str
) -> Dict[str, Tuple[Optional[int], Callable[[], keras.layers.Layer]]]:
    """name -> (TT rank or None, a function making one embedding bag of `task.rows` x `dim`)."""
    factories: Dict[str, Tuple[Optional[int], Callable[[], keras.layers.Layer]]] = {
        "full EmbeddingBag": (None, lambda: tf_ttemb.layers.EmbeddingBag(task.rows, dim)),
    }
    tt_layer = _tt_layer_class()
    if tt_layer is not None:
        for rank in ranks:
            factories[f"TTEmbeddingBag rank {rank}"] = (
                rank,
                functools.partial(tt_layer, task.rows, dim, rank, implementation=tt_implementation),
            )
    return factories


def _ctr_summary_rows(
    results: Dict[str, Dict[str, Any]], ceiling: Dict[str, float], floor: Dict[str, Any]
) -> List[List[str]]:
    full = results.get("full EmbeddingBag", {}).get("embedding_params")
    gap = floor["logloss"] - ceiling["logloss"]
    rows = []
    for name, r in results.items():
        closed = (floor["logloss"] - r["logloss"]) / gap if gap > 0 else float("nan")
        rows.append(
            [
                name,
                f"{r['embedding_params']:,}",
                f"{full / r['embedding_params']:,.1f}x" if full else "n/a",
                f"{r['logloss']:.4f}",
                f"{r['auc']:.4f}",
                f"{100 * closed:.0f}%",
                f"{r['step_ms']:.1f}",
                f"{r['train_s']:.1f}",
            ]
        )
    rows.append(
        [
            "dense features only (no ids)",
            "0",
            "n/a",
            f"{floor['logloss']:.4f}",
            f"{floor['auc']:.4f}",
            "0%",
            f"{floor['step_ms']:.1f}",
            f"{floor['train_s']:.1f}",
        ]
    )
    rows.append(
        [
            "planted model (best possible)",
            "n/a",
            "n/a",
            f"{ceiling['logloss']:.4f}",
            f"{ceiling['auc']:.4f}",
            "100%",
            "n/a",
            "n/a",
        ]
    )
    return rows


def _plot_tt_quality(
    path: str,
    task: CtrTask,
    results: Dict[str, Dict[str, Any]],
    ceiling: Dict[str, float],
    floor: Dict[str, Any],
) -> bool:
    """Held-out AUC and logloss vs compression ratio (log x); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib import ticker
    except ImportError:
        return False
    full = results["full EmbeddingBag"]["embedding_params"]
    figure, all_axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for axes, key, label in zip(
        all_axes, ("auc", "logloss"), ("held-out AUC, higher is better", "held-out logloss, lower is better")
    ):
        tt_points = sorted(
            (full / r["embedding_params"], r[key], r.get("rank"))
            for r in results.values()
            if r.get("rank") is not None
        )
        if tt_points:
            axes.plot(
                [x for x, _, _ in tt_points],
                [y for _, y, _ in tt_points],
                marker="o",
                label="TTEmbeddingBag",
            )
            for x, y, rank in tt_points:
                axes.annotate(f"rank {rank}", (x, y), textcoords="offset points", xytext=(4, 6))
        axes.plot([1.0], [results["full EmbeddingBag"][key]], marker="s", linestyle="", label="full EmbeddingBag")
        axes.axhline(ceiling[key], color="green", linestyle="--", label="planted model (best possible)")
        axes.axhline(floor[key], color="gray", linestyle=":", label="dense features only")
        axes.set_xscale("log")
        axes.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:,.4g}x"))
        axes.set_xlabel("compression of the embedding tables (log scale)")
        axes.set_ylabel(label)
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize="small", loc="best")
    figure.suptitle(
        f"Planted CTR task: {task.num_features} tables of {task.rows:,} rows, Zipf({task.zipf_exponent:g}) ids"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def section_tt_quality(args: argparse.Namespace) -> Dict[str, Any]:
    """Full vs TT-compressed tables in a small CTR model: size, quality, step time."""
    task = CtrTask(rows=args.tt_rows, seed=args.seed)
    config = TrainConfig(steps=args.tt_steps, batch=args.tt_batch)
    dim = args.tt_dim
    print(f"A small CTR model on a planted task: {task.describe()}.")
    print(
        f"Model: per sparse feature an embedding bag of {task.rows:,} x {dim} -> concat with the "
        f"dense features -> MLP 64-32-1. Training: {config.steps} steps x {config.batch} "
        f"examples (one pass), Adagrad (lr {config.embedding_lr:g}) on the embeddings, "
        f"Adam (lr {config.mlp_lr:g}) on the MLP."
    )
    _loader.load_op_library()

    planted = planted_model(task)
    train = ctr_data(task, planted, config.steps * config.batch, stream=0)
    test = ctr_data(task, planted, args.tt_test_examples, stream=1)
    ceiling = {"logloss": logloss(test["labels"], test["logits"]), "auc": auc(test["labels"], test["logits"])}
    print(
        f"Data: {len(train['labels']):,} training and {len(test['labels']):,} held-out "
        f"examples, {100 * train['labels'].mean():.1f}% positive."
    )

    tt_implementation = _tt_implementation()
    factories = _bag_factories(task, dim, args.tt_ranks, tt_implementation)
    if _tt_layer_class() is None:
        print("tf_ttemb.layers.TTEmbeddingBag is not available yet: only the full tables run.")
    else:
        from tf_ttemb import tt

        p, q, _ = tt.resolve_shapes(task.rows, dim, args.tt_ranks[0])
        print(
            f"TT tables: p = {p}, q = {q}, inner ranks [r, r] for r = "
            f"{', '.join(map(str, args.tt_ranks))}"
            f"; lookups through the {tt_implementation} implementation"
            + (
                " (this op library has no TT ops: rebuild with `bash configure.sh` for the "
                "custom op)."
                if tt_implementation == "composite"
                else "."
            )
        )
    results: Dict[str, Dict[str, Any]] = {}
    runs = list(factories.items()) + [("dense features only (no ids)", (None, None))]
    for index, (name, (rank, make_bag)) in enumerate(runs, 1):
        print(f"[{index}/{len(runs)}] {name}")
        keras.utils.set_random_seed(args.seed)
        bags = [] if make_bag is None else [make_bag() for _ in range(task.num_features)]
        model = CtrModel(bags)
        bar = keras.utils.Progbar(config.steps, unit_name="step")
        result = train_ctr_model(
            model, train, test, config, lambda i, loss: bar.update(i, [("loss", loss)])
        )
        result["rank"] = rank
        results[name] = result
        del model, bags
    floor = results.pop("dense features only (no ids)")

    print(f"\nHeld-out quality ({len(test['labels']):,} examples) after {config.steps} steps:")
    headers = [
        "model",
        "embedding params",
        "compression",
        "logloss",
        "AUC",
        "gap closed",
        "ms/step",
        "train s",
    ]
    print(format_table(headers, _ctr_summary_rows(results, ceiling, floor)))
    full = results["full EmbeddingBag"]
    for name, r in results.items():
        if r["rank"] is None:
            continue
        print(
            f"=> {name}: {full['embedding_params'] / r['embedding_params']:,.0f}x fewer "
            f"embedding parameters; AUC {r['auc'] - full['auc']:+.4f} and logloss "
            f"{r['logloss'] - full['logloss']:+.4f} vs the full tables; a training step takes "
            f"{r['step_ms'] / full['step_ms']:.2f}x the full tables' time."
        )
    threads = tf.config.threading.get_intra_op_parallelism_threads() or os.cpu_count()
    print(
        "gap closed: the share of the logloss gap between the dense-only model and the planted "
        "model that the ids recover. ms/step: median wall time of a training step (forward, "
        f"gradients, optimizer updates; tf.function, {threads} threads) after 5 warm-up steps."
    )

    document = {
        "task": dataclasses.asdict(task),
        "train": dataclasses.asdict(config),
        "embedding_dim": dim,
        "tt_ranks": list(args.tt_ranks),
        "tt_available": _tt_layer_class() is not None,
        "tt_implementation": tt_implementation,
        "train_examples": len(train["labels"]),
        "test_examples": len(test["labels"]),
        "planted_model": ceiling,
        "dense_only": floor,
        "results": results,
    }
    json_path = os.path.join(args.out, "tt_quality.json")
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(document, f, indent=2)
    png_path = os.path.join(args.out, "tt_quality.png")
    if args.no_plot:
        print(f"Saved {json_path}.")
    elif _plot_tt_quality(png_path, task, results, ceiling, floor):
        print(f"Saved {png_path} and {json_path}.")
    else:
        print(f"Saved {json_path} (no plot: matplotlib is not installed).")
    return document


# ----------------------------------------------------------------------------------------
# Section `pkm_lm`: a byte-level language model without and with a Product-Key Memory.


def section_pkm_lm(args: argparse.Namespace) -> Dict[str, Any]:
    """Byte-level LM on the stdlib's source without vs with a ProductKeyMemory layer."""
    from tf_ttemb import _demo_lm  # imports this module: loaded only when the section runs

    return _demo_lm.section(args)


# ----------------------------------------------------------------------------------------
# The command.


@dataclasses.dataclass(frozen=True)
class Section:
    """One part of the demo: a title and a function that runs it and returns its results."""

    title: str
    run: Callable[[argparse.Namespace], Dict[str, Any]]


SECTIONS: Dict[str, Section] = {
    "gather_reduce_sum": Section(
        "fused EmbeddingBag vs plain TensorFlow on a PKM-like lookup", section_gather_reduce_sum
    ),
    "tt_quality": Section(
        "full vs Tensor-Train compressed tables in a small CTR model: size, quality, speed",
        section_tt_quality,
    ),
    "pkm_lm": Section(
        "byte-level language model on Python's stdlib source, without vs with a "
        "ProductKeyMemory layer",
        section_pkm_lm,
    ),
}


def _positive_int(text: str) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _int_list(text: str) -> List[int]:
    try:
        values = [int(item.replace("_", "")) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _sections(text: str) -> List[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown section(s) {unknown or text!r}; choose from {', '.join(SECTIONS)}"
        )
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the demo's options to `parser` (the `demo` subcommand of `python -m tf_ttemb`)."""
    parser.add_argument(
        "--out",
        default=DEFAULT_OUT,
        metavar="DIR",
        help="where the plots and JSON results go (default: %(default)s/)",
    )
    parser.add_argument(
        "--sections",
        type=_sections,
        default=list(SECTIONS),
        help=f"comma-separated sections to run (default: all: {', '.join(SECTIONS)})",
    )
    parser.add_argument(
        "--tokens",
        type=_int_list,
        default=None,
        help="token counts of the scaling sweep (default: 256,512,1024,2048,4096; "
        "2048,4096,8192,16384 with a GPU)",
    )
    parser.add_argument(
        "--headline-tokens",
        type=_positive_int,
        default=None,
        help="token count of the summary and the equality check (default: 1024; 16384 = "
        "32 x 512 with a GPU)",
    )
    parser.add_argument(
        "--repeats",
        type=_positive_int,
        default=3,
        help="timed steps per measurement (default: %(default)s)",
    )
    parser.add_argument(
        "--slots",
        type=_positive_int,
        default=None,
        help=f"rows of the values table (default: {PkmShape.slots}; 262144 with a GPU)",
    )
    parser.add_argument(
        "--dim",
        type=_positive_int,
        default=None,
        help=f"width of the values table (default: {PkmShape.dim}; 1024 with a GPU)",
    )
    parser.add_argument(
        "--heads",
        type=_positive_int,
        default=None,
        help=f"memory heads per token (default: {PkmShape.heads}; 4 with a GPU)",
    )
    parser.add_argument(
        "--knn",
        type=_positive_int,
        default=None,
        help=f"slots per head (default: {PkmShape.knn}; 32 with a GPU)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a short smoke test: tokens 128,256,512, headline 256, 2 repeats; tt_quality "
        "with 100,000-row tables, ranks 4,16, 100 steps, 20,000 held-out examples; pkm_lm "
        "with 30 steps per model and 32 validation windows (overrides those options, except "
        "an explicit --lm-steps)",
    )
    parser.add_argument(
        "--tt-rows",
        type=_positive_int,
        default=1_000_000,
        help="tt_quality: rows of each of the 3 embedding tables (default: %(default)s)",
    )
    parser.add_argument(
        "--tt-dim",
        type=_positive_int,
        default=16,
        help="tt_quality: embedding dimension (default: %(default)s)",
    )
    parser.add_argument(
        "--tt-ranks",
        type=_int_list,
        default=[4, 16, 64],
        help="tt_quality: TT ranks to compare with the full tables (default: 4,16,64)",
    )
    parser.add_argument(
        "--tt-steps",
        type=_positive_int,
        default=TrainConfig.steps,
        help="tt_quality: training steps per model (default: %(default)s)",
    )
    parser.add_argument(
        "--tt-batch",
        type=_positive_int,
        default=TrainConfig.batch,
        help="tt_quality: examples per training step (default: %(default)s)",
    )
    parser.add_argument(
        "--tt-test-examples",
        type=_positive_int,
        default=100_000,
        help="tt_quality: held-out examples (default: %(default)s)",
    )
    parser.add_argument(
        "--lm-steps",
        type=_positive_int,
        default=None,
        help="pkm_lm: training steps per model (default: 200; 2000 with --lm-long)",
    )
    parser.add_argument(
        "--lm-long",
        action="store_true",
        help="pkm_lm: a longer run, 2000 steps per model and 1024 validation windows "
        "(about 10x the default's time)",
    )
    parser.add_argument(
        "--lm-batch",
        type=_positive_int,
        default=16,
        help="pkm_lm: windows of 128 bytes per training step (default: %(default)s)",
    )
    parser.add_argument(
        "--lm-lr",
        type=float,
        default=2e-3,
        help="pkm_lm: peak Adam learning rate of everything but the memory values "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--lm-values-lr",
        type=float,
        default=1e-3,
        help="pkm_lm: peak learning rate of the memory values' sparse Adam (default: "
        "%(default)s, as in the paper)",
    )
    parser.add_argument("--no-plot", action="store_true", help="do not draw the PNG plots")
    parser.add_argument("--seed", type=int, default=0, help="data seed (default: %(default)s)")


def apply_quick(args: argparse.Namespace) -> None:
    """The `--quick` overrides: small sizes for a smoke test."""
    args.tokens, args.headline_tokens, args.repeats = [128, 256, 512], 256, 2
    args.tt_rows, args.tt_ranks, args.tt_steps = 100_000, [4, 16], 100
    args.tt_test_examples = 20_000


def main(args: argparse.Namespace) -> int:
    """Runs the selected sections; returns the process exit status."""
    if args.quick:
        apply_quick(args)
    os.makedirs(args.out, exist_ok=True)
    for index, name in enumerate(args.sections, 1):
        section = SECTIONS[name]
        print(f"\n== [{index}/{len(args.sections)}] {name}: {section.title} ==")
        try:
            section.run(args)
        except _loader.OpLibraryNotFoundError as e:
            print(f"\n{e}", file=sys.stderr)
            return 1
    return 0
