"""The demo's `gather_reduce_sum` section: a Product-Key-Memory-like lookup, fused against
plain TensorFlow.

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
import subprocess
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import keras
import numpy as np
import tensorflow as tf

import tf_ttemb
from tf_ttemb import _timing
from tf_ttemb.demo import _util
from tf_ttemb.ops import _loader

# Printed before each line the memory worker sends to the demo process.
_RECORD_MARK = "@tf_ttemb-demo-record "


_status_kib = _timing.status_kib

RSS = "peak resident set size"
TF_ALLOCATOR = "TensorFlow BFC allocator statistics"
GPU_ALLOCATOR = "TensorFlow GPU allocator statistics"


def memory_method() -> str:
    """`GPU_ALLOCATOR` where TensorFlow sees a GPU (the steps run there); else `RSS` where
    this process may reset its peak RSS (Linux), else `TF_ALLOCATOR`."""
    if _util.gpu_visible():
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
            f"({self.slots * self.dim * 4 / _util.MIB:,.1f} MiB); per token {self.heads} heads x "
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
    gpu = _util.gpu_visible()
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
            spec = {
                "shape": dataclasses.asdict(shape),
                "tokens": tokens,
                "lookup": lookup,
                "seed": seed,
                "method": method,
            }
            if method == GPU_ALLOCATOR:
                # The GPU allocator counts the bytes in use, and its peak restarts at
                # reset_memory_stats: what an earlier step left pooled or peaked at cannot
                # hide a step's growth, so this process measures (a fresh one would spend
                # ~20 s starting TensorFlow on the GPU).
                growth = first_step_growth(shape, lookup, tokens, seed, method)
                records.append(
                    _checked({"lookup": lookup, "tokens": tokens, "bytes": growth}, shape)
                )
                on_record(records[-1])
                continue
            command = [
                sys.executable,
                "-c",
                "import sys; from tf_ttemb.demo import gather_reduce_sum as section; "
                "section._memory_worker(sys.argv[1])",
                json.dumps(spec),
            ]
            proc = subprocess.run(command, env=env, capture_output=True, text=True)
            lines = proc.stdout.splitlines()
            found = [
                json.loads(line[len(_RECORD_MARK) :])
                for line in lines
                if line.startswith(_RECORD_MARK)
            ]
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
            value.values[start : start + step], value.indices[start : start + step], num_rows
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
            sweep[name][tokens]["time_ms"] = _util.median_time_ms(
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
        _util.format_table(
            ["", "time ms", "peak memory growth MiB"],
            [[name, f"{r['time_ms']:,.1f}", _util.mib(r["bytes"])] for name, r in headline.items()],
        )
    )
    memory_ratio = _util.ratio(plain["bytes"], fused["bytes"])
    if memory_ratio == _util.NOT_MEASURED:
        memory_claim = (
            "memory not measured (the plain step measured less than the "
            f"{gathered_bytes(shape, tokens) / _util.MIB:,.0f} MiB of rows it must gather)"
        )
    else:
        memory_claim = f"{memory_ratio} less memory"
    print(f"=> tf_ttemb: {memory_claim}, {_util.ratio(plain['time_ms'], fused['time_ms'])} faster.")
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
                _util.ratio(plain["time_ms"], fused["time_ms"]),
                _util.mib(plain["bytes"]),
                _util.mib(fused["bytes"]),
                _util.ratio(plain["bytes"], fused["bytes"]),
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
    print(_util.format_table(headers, rows))

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
        f"({gathered_bytes(shape, tokens) / _util.MIB:,.0f} MiB at {tokens:,} tokens)."
    )


def _plot(
    path: str,
    shape: PkmShape,
    token_counts: Sequence[int],
    sweep: Dict[str, Dict[int, Dict[str, Any]]],
) -> bool:
    """Saves time and memory vs tokens as a PNG; False when matplotlib is missing."""

    def draw(all_axes):
        from matplotlib import ticker

        panels = (
            ("time_ms", "training step time (ms)", 1.0),
            ("bytes", "peak memory growth (MiB)", _util.MIB),
        )
        for axes, (key, label, unit) in zip(all_axes, panels):
            for name in LOOKUPS:
                ys = [(sweep[name][t][key] or np.nan) / unit for t in token_counts]
                axes.plot(token_counts, ys, marker="o", label=name)
            last = token_counts[-1]
            ratio = _util.ratio(sweep[BASELINE][last][key], sweep[FUSED][last][key])
            note = f"{ratio} {'less' if key == 'bytes' else 'faster'}"
            axes.annotate(
                note if ratio != _util.NOT_MEASURED else "plain TF: memory not measured",
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

    title = (
        f"PKM-like lookup: {shape.slots:,} x {shape.dim} values, {shape.bag_size} slots per "
        "token; forward + gradients"
    )
    return _util.save_two_panel_plot(path, title, draw)


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
    _util.save_results(
        args, "gather_reduce_sum", result, lambda path: _plot(path, shape, token_counts, sweep)
    )
    return result
