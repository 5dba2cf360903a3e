"""Training-step time and optimizer-state memory of sparse vs Keras optimizers, on CPU.

Run from the checkout after `bash configure.sh`:

  .venv/bin/python python/bench/bench_optimizers.py                 # the issue's case, ~5 min
  .venv/bin/python python/bench/bench_optimizers.py -N 1000000 --repeats 3      # quicker
  .venv/bin/python python/bench/bench_optimizers.py --help

The case is the target of the issue: a float32 `tf_ttemb.layers.EmbeddingBag` table of
N = 10,000,000 rows × D = 64 (2.56 GB), 8,192 bags × 20 uniformly random ids per step
(about 160k distinct rows touched), summed per bag; loss = sum(output · u) for a fixed
random u [bags, D]. Its table gradient is a deduplicated `tf.IndexedSlices`.

Optimizers (`--optimizers`, all by default), each with its default hyperparameters:

  keras_adam        keras.optimizers.Adam: densifies the sparse gradient and rewrites
                    both moments and every row of the table on every step (the baseline)
  lazy_adam         tf_ttemb.optimizers.LazyAdam: Adam on the touched rows only
  row_wise_adagrad  tf_ttemb.optimizers.RowWiseAdagrad: one accumulator per row, touched
                    rows only
  keras_adagrad     keras.optimizers.Adagrad, for reference (its accumulator update is
                    sparse, its weight update dense)
  none              forward + backward only, no update: the floor every step pays

One step = forward + table gradient + `optimizer.apply`, one `tf.function` (no XLA), on
a different batch of ids each call (cycling through `--batches` pre-drawn batches).

What is measured, per optimizer, each in a fresh worker process (only one 2.56 GB table,
and at most one optimizer's state, alive at a time):

* Step time: median (and min) wall-clock time over `--repeats` steps after `--warmup`
  steps. The machine may be shared: the load average is recorded before and after each
  worker; the workers run one after another, so they do not see the same load.
* Optimizer-state memory: the bytes of the optimizer's variables (moments, accumulators,
  per-row step counts, iteration and learning-rate scalars).
* Peak extra memory of one step: how far the resident set size rises above its level
  before the step (VmHWM reset through /proc/self/clear_refs), in a worker started with
  `MALLOC_MMAP_THRESHOLD_=65536` so freed buffers go back to the OS and the peak is that
  of live memory: the dense temporaries Keras' optimizers make, or their absence.
* The kind of table gradient `update_step` received (IndexedSlices = not densified).
* A first-step check: from the same seeded table, LazyAdam's first step must equal Keras
  Adam's on the touched rows (both are Adam; untouched rows have zero moments, so Keras'
  dense step leaves them where they are). Compared through inner products of the update
  of 512 touched rows with fixed random probes.

Targets (from the issue), printed as PASS / MISS: LazyAdam's step at least 10× faster
than Keras Adam's (medians), RowWiseAdagrad's optimizer state at most 1/32 of Adam's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import _bench_util as util
import numpy as np

OPTIMIZERS: Dict[str, str] = {
    "keras_adam": "keras Adam",
    "lazy_adam": "tf_ttemb LazyAdam",
    "row_wise_adagrad": "tf_ttemb RowWiseAdagrad",
    "keras_adagrad": "keras Adagrad",
    "none": "no update (fwd+bwd only)",
}
BASELINE = "keras_adam"
SPEEDUP_TARGET = 10.0
STATE_RATIO_TARGET = 1.0 / 32
SAMPLE_ROWS = 512
PROBES = 4
FIRST_STEP_TOLERANCE = 1e-4  # relative, float32 Adam steps computed two ways


@dataclasses.dataclass(frozen=True)
class Problem:
    """The table and the batches of one run; its sizes come from the command line (see
    `parse_args` for the defaults, the issue's case)."""

    num_rows: int
    dim: int
    bags: int
    bag_size: int
    batches: int
    seed: int

    def describe(self) -> str:
        table_gb = self.num_rows * self.dim * 4 / 1e9
        return (
            f"float32 table {self.num_rows:,} x {self.dim} ({table_gb:.2f} GB), "
            f"{self.bags:,} bags x {self.bag_size} ids (uniform), sum"
        )


def make_batches(problem: Problem) -> List[np.ndarray]:
    rng = np.random.default_rng(problem.seed)
    return [
        rng.integers(0, problem.num_rows, size=(problem.bags, problem.bag_size), dtype=np.int64)
        for _ in range(problem.batches)
    ]


# ----------------------------------------------------------------------------------------
# Worker.


def _make_optimizer(name: str) -> Any:
    import keras

    import tf_ttemb

    return {
        "keras_adam": keras.optimizers.Adam,
        "lazy_adam": tf_ttemb.optimizers.LazyAdam,
        "row_wise_adagrad": tf_ttemb.optimizers.RowWiseAdagrad,
        "keras_adagrad": keras.optimizers.Adagrad,
        "none": lambda: None,
    }[name]()


def _worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    load_before = os.getloadavg()
    import keras
    import tensorflow as tf

    util.add_checkout_to_path()
    import tf_ttemb

    problem = Problem(**spec["problem"])
    threads = spec["threads"]
    if threads:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
    batches = [tf.constant(b) for b in make_batches(problem)]
    rng = np.random.default_rng(problem.seed + 1)
    upstream = tf.constant(rng.standard_normal((problem.bags, problem.dim)), tf.float32)

    start = time.perf_counter()
    layer = tf_ttemb.layers.EmbeddingBag(
        problem.num_rows,
        problem.dim,
        embeddings_initializer=keras.initializers.RandomUniform(-0.05, 0.05, seed=problem.seed),
    )
    layer.build()
    table = layer.embeddings
    optimizer = _make_optimizer(spec["optimizer"])
    gradient_kinds: List[str] = []
    state_bytes = 0
    if optimizer is not None:
        optimizer.build([table])
        state_bytes = int(
            sum(
                np.prod(v.shape, dtype=np.int64) * np.dtype(v.dtype).itemsize
                for v in optimizer.variables
            )
        )
        update_step = optimizer.update_step

        def recording_update_step(gradient: Any, variable: Any, learning_rate: Any) -> Any:
            gradient_kinds.append(type(gradient).__name__)
            return update_step(gradient, variable, learning_rate)

        optimizer.update_step = recording_update_step
    setup_s = time.perf_counter() - start

    @tf.function(input_signature=[tf.TensorSpec([problem.bags, problem.bag_size], tf.int64)])
    def step(ids: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(ids) * upstream)
        (gradient,) = tape.gradient(loss, [table])
        if optimizer is None:
            # Keep the gradient alive (an unused one would be pruned from the graph).
            values = gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient
            return tf.reduce_sum(values)
        optimizer.apply([gradient], [table])
        return loss

    # First step, checked: the update of a sample of touched rows, through fixed probes.
    touched = np.unique(batches[0].numpy())
    sample = tf.constant(
        np.sort(rng.choice(touched, size=min(SAMPLE_ROWS, len(touched)), replace=False))
    )
    before = tf.gather(table, sample).numpy().astype(np.float64)
    start = time.perf_counter()
    step(batches[0])
    first_step_s = time.perf_counter() - start
    delta = tf.gather(table, sample).numpy().astype(np.float64) - before
    probes = np.random.default_rng(problem.seed + 2).standard_normal((PROBES,) + delta.shape)
    fingerprints = [float(np.sum(p * delta)) for p in probes]
    update_norm = float(np.linalg.norm(delta))

    calls = {"n": 1}

    def next_step() -> None:
        step(batches[calls["n"] % len(batches)])
        calls["n"] += 1

    timing = util.time_calls(next_step, max(0, spec["warmup"] - 1), spec["repeats"])
    meter = util.PeakRss()
    meter.start()
    next_step()
    rss_growth = meter.growth_bytes()
    return {
        "ok": True,
        "optimizer": spec["optimizer"],
        "versions": {"tensorflow": tf.__version__, "keras": keras.__version__},
        "threads": threads or util.usable_cpus(),
        "setup_s": setup_s,
        "first_step_s": first_step_s,
        "step": timing.to_json(),
        "state_bytes": state_bytes,
        "rss_growth_bytes": rss_growth,
        "rss_method": meter.method,
        "gradient_kinds": sorted(set(gradient_kinds)),
        "touched_rows_first_batch": int(len(touched)),
        "first_step_fingerprints": fingerprints,
        "first_step_update_norm": update_norm,
        "load_before": list(load_before),
        "load_after": list(os.getloadavg()),
    }


def worker_main(spec: Dict[str, Any]) -> None:
    util.worker_main(spec, _worker)


# ----------------------------------------------------------------------------------------
# Driver.


def measure(args: argparse.Namespace, problem: Problem) -> List[Dict[str, Any]]:
    script = os.path.abspath(__file__)
    results = []
    for i, name in enumerate(args.optimizers, 1):
        util.log(f"[{i}/{len(args.optimizers)}] {OPTIMIZERS[name]} ... (load {_load()})")
        spec = {
            "problem": dataclasses.asdict(problem),
            "optimizer": name,
            "threads": args.threads,
            "warmup": args.warmup,
            "repeats": args.repeats,
        }
        result = util.run_worker(script, spec, {"MALLOC_MMAP_THRESHOLD_": "65536"})
        result["optimizer"] = name
        if result.get("ok"):
            util.log(f"    step {result['step']['median_ms']:,.1f} ms (median)")
        else:
            util.log(f"    failed: {result.get('error')}")
        results.append(result)
    return results


def _load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _first_step_disagreement(a: Dict[str, Any], b: Dict[str, Any]) -> float:
    fa, fb = np.array(a["first_step_fingerprints"]), np.array(b["first_step_fingerprints"])
    scale = max(a["first_step_update_norm"], b["first_step_update_norm"], 1e-30)
    return float(np.max(np.abs(fa - fb)) / scale)


def verdicts(results: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """The targets of the issue, as PASS / MISS (None where a result is missing)."""
    ok = {r["optimizer"]: r for r in results if r.get("ok")}
    out: Dict[str, Any] = {}
    adam, lazy, rowwise = ok.get("keras_adam"), ok.get("lazy_adam"), ok.get("row_wise_adagrad")
    if adam and lazy:
        speedup = adam["step"]["median_ms"] / lazy["step"]["median_ms"]
        out["lazy_adam_speedup"] = {
            "value": speedup,
            "target": SPEEDUP_TARGET,
            "pass": speedup >= SPEEDUP_TARGET,
        }
        out["first_step_disagreement"] = _first_step_disagreement(lazy, adam)
    if adam and rowwise:
        ratio = rowwise["state_bytes"] / adam["state_bytes"]
        out["row_wise_adagrad_state_ratio"] = {
            "value": ratio,
            "target": STATE_RATIO_TARGET,
            "pass": ratio <= STATE_RATIO_TARGET,
        }
    return out


def report(problem: Problem, results: Sequence[Dict[str, Any]], checks: Dict[str, Any]) -> str:
    ok = {r["optimizer"]: r for r in results if r.get("ok")}
    baseline = ok.get(BASELINE)
    headers = [
        "optimizer",
        "step ms median (min)",
        "speed-up",
        "state MiB",
        "state / Adam",
        "step peak MiB (RSS)",
        "table grad",
        "load before/after",
    ]

    def row_of(result, label):
        step = result["step"]
        speedup = "-"
        ratio = "-"
        if baseline:
            speedup = f"{baseline['step']['median_ms'] / step['median_ms']:.1f}x"
            if result["state_bytes"]:
                ratio = f"1/{baseline['state_bytes'] / result['state_bytes']:.1f}"
        return [
            label,
            f"{step['median_ms']:,.1f} ({step['min_ms']:,.1f})",
            speedup,
            util.mib_text(result["state_bytes"]),
            ratio,
            util.mib_text(result["rss_growth_bytes"]),
            "/".join(result["gradient_kinds"]) or "-",
            f"{result['load_before'][0]:.1f}/{result['load_after'][0]:.1f}",
        ]

    rows, failures = util.result_rows(
        results, lambda r: OPTIMIZERS[r["optimizer"]], len(headers), row_of
    )
    touched = next((r["touched_rows_first_batch"] for r in ok.values()), None)
    threads = sorted({r["threads"] for r in ok.values()})
    repeats = next((r["step"]["repeats"] for r in ok.values()), "?")
    title = f"optimizer step, CPU: {problem.describe()}"
    if touched:
        title += f"; {touched:,} distinct rows in the first batch"
    lines = [
        title,
        f"threads: {', '.join(map(str, threads)) or '?'}",
        "",
        util.format_table(headers, rows),
        "",
        f"step: forward + table gradient + optimizer.apply in one tf.function, median (min) "
        f"over {repeats} steps after warm-up; speed-up and state ratio vs {OPTIMIZERS[BASELINE]}.",
        "state: bytes of the optimizer's variables. step peak: RSS growth over one step "
        "(VmHWM, MALLOC_MMAP_THRESHOLD_=65536). table grad: what update_step received. "
        "load: 1-minute load average before/after each worker (the machine may be shared).",
        "",
    ]
    speed = checks.get("lazy_adam_speedup")
    if speed:
        lines.append(
            f"LazyAdam step >= {SPEEDUP_TARGET:.0f}x faster than Keras Adam: "
            f"{speed['value']:.1f}x  {'PASS' if speed['pass'] else 'MISS'}"
        )
    else:
        lines.append("LazyAdam step >= 10x faster than Keras Adam: not measured")
    state = checks.get("row_wise_adagrad_state_ratio")
    if state:
        lines.append(
            f"RowWiseAdagrad state <= 1/32 of Adam's: 1/{1 / state['value']:.1f}  "
            f"{'PASS' if state['pass'] else 'MISS'}"
        )
    else:
        lines.append("RowWiseAdagrad state <= 1/32 of Adam's: not measured")
    if "first_step_disagreement" in checks:
        worst = checks["first_step_disagreement"]
        verdict = "agree" if worst <= FIRST_STEP_TOLERANCE else "DISAGREE"
        lines.append(
            f"first step, LazyAdam vs Keras Adam on touched rows: {verdict} "
            f"(max probe difference {worst:.1e} of the update's norm)"
        )
    return util.report_text(lines, failures)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = util.choices_parser(
        "Training-step time and optimizer-state memory of LazyAdam and RowWiseAdagrad "
        "against Keras' Adam and Adagrad on an EmbeddingBag table, on CPU.",
        "Optimizers",
        OPTIMIZERS,
        "Each runs in a fresh process. See the module docstring for the method.",
    )
    util.add_int_options(
        parser,
        num_rows=10_000_000,
        dim=64,
        bags=8_192,
        bag_size=20,
        batches=(4, "distinct batches of ids the steps cycle through (default: %(default)s)"),
    )
    util.add_choice_list(
        parser,
        "--optimizers",
        OPTIMIZERS,
        "comma-separated optimizers to run (default: all)",
        default=list(OPTIMIZERS),
    )
    util.add_timing_options(
        parser,
        repeats=(5, "timed steps per optimizer (default: %(default)s)"),
        warmup=(2, "untimed steps first, the checked first step included (default: %(default)s)"),
        threads_help="TF intra-op threads (default: 0 = one per usable CPU)",
        warmup_type=util.positive_int,
    )
    parser.add_argument("--seed", type=int, default=0, help="data seed (default: %(default)s)")
    parser.add_argument(
        "--json",
        metavar="PATH",
        default=os.path.join(util.CHECKOUT_ROOT, "bench_results", "optimizers_cpu.json"),
        help="where to write all results and machine information (default: %(default)s)",
    )
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the benchmark; the exit status is 1 when an optimizer failed or a target missed."""
    args = parse_args(argv)
    problem = util.from_options(Problem, args)
    util.log(f"optimizer benchmark: {problem.describe()}")
    load_start = os.getloadavg()
    results = measure(args, problem)
    checks = verdicts(results)
    print(report(problem, results, checks))
    document = {
        "benchmark": "optimizers",
        "machine": util.machine_info(),
        "load_average_start": list(load_start),
        "load_average_end": list(os.getloadavg()),
        "problem": dataclasses.asdict(problem),
        "settings": dict(
            util.option_values(args, "repeats", "warmup", "threads"),
            baseline=BASELINE,
            targets={"lazy_adam_speedup": SPEEDUP_TARGET, "state_ratio": STATE_RATIO_TARGET},
        ),
        "checks": checks,
        "results": results,
    }
    util.write_json(args.json, document)
    failed = not all(r.get("ok") for r in results)
    missed = any(not c["pass"] for c in checks.values() if isinstance(c, dict))
    return 1 if failed or missed else 0


if __name__ == "__main__":
    sys.exit(util.main_or_worker(main, worker_main))
