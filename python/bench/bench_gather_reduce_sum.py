"""Benchmarks `tf_ttemb.gather_reduce_sum` on CPU against what users write today.

Run from the checkout after `bash configure.sh` (which builds tf_ttemb/_tf_ttemb_ops.so):

  .venv/bin/python python/bench/bench_gather_reduce_sum.py                  # the issue's target
  .venv/bin/python python/bench/bench_gather_reduce_sum.py --bags 64 --repeats 3 --json out.json
  .venv/bin/python python/bench/bench_gather_reduce_sum.py --sweep --json sweep.json  # issue 19
  .venv/bin/python python/bench/bench_gather_reduce_sum.py --sweep --sweep-threads 2,1  # + scaling
  .venv/bin/python python/bench/bench_gather_reduce_sum.py --help

The default case is the target of the issue: a float32 table of N=65,536 rows × D=256,
2,048 bags of 128 ids each (uniform random), weighted sum.

Implementations (`--impls`, all by default; torch only where it is importable):

  custom_op  tf_ttemb.gather_reduce_sum(params, ids, w, implementation="custom_op")
  composite  tf_ttemb.gather_reduce_sum(params, ids, w, implementation="composite")
  tf_gather  tf.reduce_sum(tf.gather(params, ids) * w[..., None], axis=-2), the TF
             composite users write today and the baseline of the speed-ups
  tf_sparse  tf.nn.embedding_lookup_sparse(params, sp_ids, sp_weights, combiner="sum")
  torch      torch.nn.functional.embedding_bag(ids, params, mode="sum",
             per_sample_weights=w, sparse=True) on CPU, with torch.set_num_threads equal
             to TensorFlow's intra-op thread count (torch is never a dependency of tf_ttemb)

What is measured, per implementation:

* fwd: one call producing the [B, D] output.
* fwd+bwd: the output plus the gradients w.r.t. the table (a `tf.Variable`) and w.r.t. the
  weights, for a random upstream gradient (`GradientTape.gradient(..., output_gradients=)`;
  `backward(upstream)` for torch). TensorFlow steps run as `tf.function`s (graph mode,
  no XLA); "eager f+b" times the same step without `tf.function`.
* Times are the median and the minimum over `--repeats` calls after `--warmup` calls.
* Peak memory growth of one fwd+bwd step, i.e. how far memory rises above what the
  inputs already hold, outputs and gradients included:
  - "TF alloc": TensorFlow's own CPU allocator statistics (`TF_CPU_ALLOCATOR_USE_BFC=true`,
    `tf.config.experimental.reset_memory_stats` / `get_memory_info("CPU:0")["peak"]`).
    They count whole allocator chunks, and the BFC allocator hands out a free chunk of up
    to twice the size asked for without splitting it, so a tensor can count up to 2x its
    size; and they miss scratch a kernel takes from `malloc` directly;
  - "RSS": growth of the process's peak resident set size over the first full-size step
    (after a warm-up on 4 bags), which sees everything and is comparable with torch.
  Every implementation is measured in fresh processes (one for timing and RSS with the
  default allocator, one for the allocator statistics), so peaks never mix and the
  timings use the allocator users get.
* A check that every implementation computes the same numbers as the baseline: inner
  products of the output, the (densified) table gradient and the weights gradient with
  fixed random probes, compared relative to the norms involved.

The "(output + gradient) size" printed with the table is the least any fwd+bwd step must
hold: output [B, D] + table gradient [U, D] (U = unique ids, deduplicated) + weights
gradient [nnz].
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import _bench_util as util
import numpy as np

IMPLS: Dict[str, str] = {
    "custom_op": "tf_ttemb custom op",
    "composite": "tf_ttemb composite",
    "tf_gather": "TF gather*w+reduce_sum",
    "tf_sparse": "tf.nn.embedding_lookup_sparse",
    "torch": "torch embedding_bag (CPU)",
}
BASELINE = "tf_gather"
DTYPES = ("float16", "bfloat16", "float32", "float64")
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
# Largest accepted difference of the probe inner products, relative to the norms involved.
AGREEMENT_TOLERANCE = {"float16": 5e-2, "bfloat16": 5e-2, "float32": 1e-4, "float64": 1e-10}
WARMUP_BAGS = 4


@dataclasses.dataclass(frozen=True)
class Problem:
    """One benchmark case: a [num_rows, dim] table and bags × bag_size weighted ids."""

    num_rows: int
    dim: int
    bags: int
    bag_size: int
    dtype: str
    index_dtype: str
    seed: int

    @property
    def nnz(self) -> int:
        """Number of lookups (ids) in the batch."""
        return self.bags * self.bag_size

    def describe(self) -> str:
        """A one-line description for the report."""
        return (
            f"N={self.num_rows:,} x D={self.dim}, {self.bags:,} bags x {self.bag_size} ids "
            f"({self.nnz:,} lookups), {self.dtype} values, {self.index_dtype} ids, weighted sum"
        )


# ----------------------------------------------------------------------------------------
# Data: numpy only, reproducible from the seed, so every process builds the same case.


def _rng(problem: Problem, stream: int) -> np.random.Generator:
    return np.random.default_rng([problem.seed, stream])


def _float_dtype(problem: Problem) -> type:
    """The numpy dtype data is generated in (half types are cast by the frameworks)."""
    return np.float64 if problem.dtype == "float64" else np.float32


def make_ids(problem: Problem, bags: Optional[int] = None) -> np.ndarray:
    """[bags, bag_size] ids, uniform in [0, num_rows)."""
    shape = (problem.bags if bags is None else bags, problem.bag_size)
    return _rng(problem, 0).integers(0, problem.num_rows, size=shape, dtype=problem.index_dtype)


def make_arrays(problem: Problem, bags: Optional[int] = None) -> Dict[str, np.ndarray]:
    """The table [N, D], positive weights [bags, L] and an upstream gradient [bags, D]."""
    bags = problem.bags if bags is None else bags
    dtype = _float_dtype(problem)
    return {
        "ids": make_ids(problem, bags),
        "params": _rng(problem, 1).standard_normal((problem.num_rows, problem.dim), dtype=dtype),
        "weights": _rng(problem, 2).uniform(0.0, 1.0, (bags, problem.bag_size)).astype(dtype),
        "upstream": _rng(problem, 3).standard_normal((bags, problem.dim), dtype=dtype),
    }


def make_probes(problem: Problem) -> Dict[str, np.ndarray]:
    """Fixed random float64 probes for the table and weights gradients."""
    rng = _rng(problem, 4)
    return {
        "params_grad": rng.standard_normal((problem.num_rows, problem.dim)),
        "weights_grad": rng.standard_normal((problem.bags, problem.bag_size)),
    }


def reference_bytes(problem: Problem) -> Dict[str, int]:
    """Bytes of the output [B, D], the deduplicated table gradient [U, D] and weights grad."""
    itemsize = ITEMSIZE[problem.dtype]
    unique = int(np.unique(make_ids(problem)).size)
    sizes = {
        "unique_ids": unique,
        "output": problem.bags * problem.dim * itemsize,
        "params_grad": unique * problem.dim * itemsize,
        "weights_grad": problem.nnz * itemsize,
    }
    sizes["total"] = sizes["output"] + sizes["params_grad"] + sizes["weights_grad"]
    return sizes


def fingerprints(
    output: np.ndarray,
    params_grad: np.ndarray,
    weights_grad: np.ndarray,
    upstream: np.ndarray,
    probes: Dict[str, np.ndarray],
) -> Dict[str, List[float]]:
    """Inner products of the results with probes, and the norm products that bound them."""

    def pair(x: np.ndarray, probe: np.ndarray) -> List[float]:
        x = np.asarray(x, np.float64).reshape(probe.shape)
        return [float(np.vdot(x, probe)), float(np.linalg.norm(x) * np.linalg.norm(probe))]

    return {
        "output": pair(output, np.asarray(upstream, np.float64)),
        "params_grad": pair(params_grad, probes["params_grad"]),
        "weights_grad": pair(weights_grad, probes["weights_grad"]),
    }


def max_disagreement(result: Dict[str, List[float]], reference: Dict[str, List[float]]) -> float:
    """Largest |<x, p> - <x_ref, p>| / (|x_ref| |p|) over the fingerprints."""
    worst = 0.0
    for key, (value, _) in result.items():
        ref_value, ref_norms = reference[key]
        worst = max(worst, abs(value - ref_value) / max(ref_norms, 1e-300))
    return worst


# ----------------------------------------------------------------------------------------
# Workers: one process per (implementation, measurement), see `_bench_util.run_worker`.


def _tf_call(tf: Any, impl: str) -> Callable[[Any, Any, Any], Any]:
    """The implementation as `call(params, ids [B, L], weights [B, L]) -> [B, D]`."""
    if impl in ("custom_op", "composite"):
        import tf_ttemb

        def call(params, ids, weights):
            return tf_ttemb.gather_reduce_sum(
                params, ids, weights, combiner="sum", implementation=impl
            )

    elif impl == "tf_gather":

        def call(params, ids, weights):
            return tf.reduce_sum(tf.gather(params, ids) * weights[..., None], axis=-2)

    elif impl == "tf_sparse":

        @functools.lru_cache(maxsize=None)
        def positions(bags: int, bag_size: int):
            # [B * L, 2] (bag, slot) coordinates: the SparseTensor form users would hold.
            # Built eagerly (init_scope) so every traced step captures the same tensor.
            grid = np.stack(np.indices((bags, bag_size)), axis=-1).reshape(-1, 2)
            with tf.init_scope():
                return tf.constant(grid, tf.int64)

        def call(params, ids, weights):
            bags, bag_size = ids.shape
            where = positions(bags, bag_size)
            shape = [bags, bag_size]
            sp_ids = tf.SparseTensor(where, tf.reshape(ids, [-1]), shape)
            sp_weights = tf.SparseTensor(where, tf.reshape(weights, [-1]), shape)
            return tf.nn.embedding_lookup_sparse(params, sp_ids, sp_weights, combiner="sum")

    else:
        raise ValueError(f"not a TensorFlow implementation: {impl!r}")
    return call


def _tf_worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Measures one TensorFlow implementation: `mode` "time" (times, RSS, fingerprints)
    or "allocator" (the BFC allocator's peak; needs TF_CPU_ALLOCATOR_USE_BFC=true)."""
    import tensorflow as tf

    util.add_checkout_to_path()
    problem = Problem(**spec["problem"])
    threads = spec["threads"]
    if threads:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
    dtype = tf.as_dtype(problem.dtype)
    call = _tf_call(tf, spec["impl"])

    def tensors(arrays: Dict[str, np.ndarray]) -> Tuple[Any, Any, Any]:
        return (
            tf.constant(arrays["ids"]),
            tf.cast(arrays["weights"], dtype),
            tf.cast(arrays["upstream"], dtype),
        )

    arrays = make_arrays(problem)
    params = tf.Variable(tf.cast(arrays["params"], dtype), name="params")
    if spec["sparse_updated"]:
        # What a sparse optimizer update (scatter) leaves behind: TensorFlow then copies
        # the whole variable on every later dense read (ReadVariableOp).
        params.scatter_add(tf.IndexedSlices(tf.zeros([1, problem.dim], dtype), tf.constant([0])))
    ids, weights, upstream = tensors(arrays)

    def forward_backward_eager(ids, weights, upstream):
        with tf.GradientTape() as tape:
            tape.watch(weights)
            output = call(params, ids, weights)
        params_grad, weights_grad = tape.gradient(
            output, [params, weights], output_gradients=upstream
        )
        return output, params_grad, weights_grad

    forward = tf.function(lambda ids, weights: call(params, ids, weights))
    forward_backward = tf.function(forward_backward_eager)
    versions = {"tensorflow": tf.__version__, "numpy": np.__version__}
    if spec["impl"] in ("custom_op", "composite"):
        import tf_ttemb

        versions["tf_ttemb"] = tf_ttemb.__version__
        versions["tf_ttemb_path"] = os.path.dirname(tf_ttemb.__file__)

    if spec["mode"] == "allocator":
        for _ in range(max(1, spec["warmup"])):
            forward_backward(ids, weights, upstream)
        peak = util.tensorflow_peak_bytes(tf, lambda: forward_backward(ids, weights, upstream))
        return {"ok": True, "allocator_peak": peak, "versions": versions}

    # Trace the full-size step and run a small one first, so the RSS growth of the first
    # full-size call is that of the computation, not of tracing or thread-pool start-up.
    forward_backward.get_concrete_function(ids, weights, upstream)
    forward_backward(*tensors(make_arrays(problem, bags=WARMUP_BAGS)))

    def as_numpy(x):
        if isinstance(x, tf.IndexedSlices):
            x = tf.math.unsorted_segment_sum(
                tf.cast(x.values, tf.float64), x.indices, problem.num_rows
            )
        return tf.cast(x, tf.float64).numpy()

    inputs = (ids, weights, upstream)
    first = _first_step(problem, arrays, forward_backward, inputs, as_numpy)
    threads = threads or util.usable_cpus()
    result = _timed_result(spec, versions, threads, first, forward, forward_backward, inputs)
    if spec["eager"]:
        result["eager_fwd_bwd"] = util.time_calls(
            lambda: forward_backward_eager(ids, weights, upstream), spec["warmup"], spec["repeats"]
        ).to_json()
    return result


def _first_step(problem, arrays, forward_backward, inputs, as_numpy) -> Dict[str, Any]:
    """The RSS growth of the first full-size `forward_backward(*inputs)` and the
    fingerprints of its output and gradients (`as_numpy` makes each a float64 array, the
    table gradient dense); the results are freed before anything is timed."""
    meter = util.PeakRss()
    meter.start()
    output, params_grad, weights_grad = forward_backward(*inputs)
    rss_growth = meter.growth_bytes()
    prints = fingerprints(
        *map(as_numpy, (output, params_grad, weights_grad)),
        arrays["upstream"],
        make_probes(problem),
    )
    return {"rss_growth_bytes": rss_growth, "rss_method": meter.method, "fingerprints": prints}


def _timed_result(spec, versions, threads, first, forward, forward_backward, inputs):
    """A worker's result: the first step's measures (`_first_step`), then forward(ids,
    weights) and forward_backward(ids, weights, upstream) timed on `inputs`."""
    warmup, repeats = spec["warmup"], spec["repeats"]
    fwd = lambda: forward(*inputs[:2])  # noqa: E731
    fwd_bwd = lambda: forward_backward(*inputs)  # noqa: E731
    return {
        "ok": True,
        "versions": versions,
        "threads": threads,
        **first,
        "fwd": util.time_calls(fwd, warmup, repeats).to_json(),
        "fwd_bwd": util.time_calls(fwd_bwd, warmup, repeats).to_json(),
    }


def _torch_worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Measures torch's CPU embedding_bag: times (forward under no_grad), RSS, fingerprints."""
    import torch
    import torch.nn.functional as F

    problem = Problem(**spec["problem"])
    threads = spec["threads"] or util.usable_cpus()
    torch.set_num_threads(threads)
    dtype = getattr(torch, problem.dtype)

    arrays = make_arrays(problem)
    table = torch.nn.Parameter(torch.from_numpy(arrays["params"]).to(dtype))

    def tensors(arrays: Dict[str, np.ndarray]) -> Tuple[Any, Any, Any]:
        return (
            torch.from_numpy(arrays["ids"]),
            torch.from_numpy(arrays["weights"]).to(dtype).requires_grad_(),
            torch.from_numpy(arrays["upstream"]).to(dtype),
        )

    def call(ids, weights):
        return F.embedding_bag(ids, table, mode="sum", per_sample_weights=weights, sparse=True)

    def forward(ids, weights):
        with torch.no_grad():
            return call(ids, weights)

    def forward_backward(ids, weights, upstream):
        table.grad = None
        weights.grad = None
        output = call(ids, weights)
        output.backward(upstream)
        return output, table.grad, weights.grad

    inputs = tensors(arrays)
    forward_backward(*tensors(make_arrays(problem, bags=WARMUP_BAGS)))

    def as_numpy(x):
        if x.is_sparse:
            x = x.coalesce().to_dense()
        return x.detach().to(torch.float64).numpy()

    first = _first_step(problem, arrays, forward_backward, inputs, as_numpy)
    versions = {"torch": torch.__version__, "numpy": np.__version__}
    return _timed_result(spec, versions, threads, first, forward, forward_backward, inputs)


# ----------------------------------------------------------------------------------------
# --sweep: issue 19's shapes, ours against torch, one process per side and shape.

# (num_rows, dim, bags, bag_size): issue 19's table, float32, weighted sum, then two more
# (a small table where per-call overhead shows, and a mid-size D = 128 one).
SWEEP_SHAPES: Tuple[Tuple[int, int, int, int], ...] = (
    (65_536, 256, 2_048, 128),
    (1_048_576, 64, 8_192, 20),
    (100_000, 16, 16_384, 40),
    (262_144, 1_024, 512, 128),
    (10_000, 32, 4_096, 10),
    (500_000, 128, 4_096, 50),
)
# Ours only, at one shape: each combiner and table dtype against float32 weighted sum
# (issue 19: mean/sqrtn/max within 1.2x of sum, half types within 1.2x of float32 per byte).
SWEEP_VARIANT_SHAPE = (1_048_576, 64, 8_192, 20)
SWEEP_VARIANTS: Tuple[Tuple[str, str], ...] = (
    ("sum", "float32"),
    ("mean", "float32"),
    ("sqrtn", "float32"),
    ("max", "float32"),
    ("sum", "float16"),
    ("sum", "bfloat16"),
)
SWEEP_COLUMNS = ("fwd", "fwd_bwd_sparse", "fwd_bwd_dense")
# Forwards in one tf.while_loop for the in-graph forward time (ours; torch has no per-call
# cost to leave out, so its per-call forward is the comparison).
SWEEP_CHAIN = 10


def _sweep_tf_worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Ours: the raw op and the wrapper (dense and ragged ids) eagerly on a tensor table,
    then (as the default run) forward, fwd+bwd with IndexedSlices and fwd+bwd with a dense
    gradient as tf.functions on a tf.Variable table."""
    import tensorflow as tf

    util.add_checkout_to_path()
    import tf_ttemb
    from tf_ttemb.ops import _loader

    problem = Problem(**spec["problem"])
    if spec["threads"]:
        tf.config.threading.set_intra_op_parallelism_threads(spec["threads"])
    arrays = make_arrays(problem)
    table = tf.constant(arrays["params"])
    params = tf.Variable(table, name="params")
    ids = tf.constant(arrays["ids"])
    weights = tf.constant(arrays["weights"])
    upstream = tf.constant(arrays["upstream"])
    flat_ids, flat_weights = tf.reshape(ids, [-1]), tf.reshape(weights, [-1])
    row_splits = tf.range(problem.bags + 1, dtype=tf.int64) * problem.bag_size
    lib = _loader.load_op_library()

    def raw():
        return lib.tf_ttemb_gather_reduce_sum(
            table,
            flat_ids,
            row_splits,
            flat_weights,
            combiner="sum",
            has_weights=True,
            padding_id=-1,
            has_padding_id=False,
        )[0].numpy()

    def wrapper():
        return tf_ttemb.gather_reduce_sum(table, ids, weights).numpy()

    # The same bags as ragged ids, weights on the ids' row_splits: the raw op's CSR exactly.
    ragged_ids = tf.RaggedTensor.from_row_splits(flat_ids, row_splits, validate=False)
    ragged_weights = ragged_ids.with_flat_values(flat_weights)

    def wrapper_ragged():
        return tf_ttemb.gather_reduce_sum(table, ragged_ids, ragged_weights).numpy()

    def step(dense_grad: bool):
        @tf.function
        def run(ids, weights, upstream):
            with tf.GradientTape() as tape:
                tape.watch(weights)
                output = tf_ttemb.gather_reduce_sum(params, ids, weights, dense_grad=dense_grad)
            return output, tape.gradient(output, [params, weights], output_gradients=upstream)

        return lambda: run(ids, weights, upstream)

    forward = tf.function(lambda ids, weights: tf_ttemb.gather_reduce_sum(params, ids, weights))

    # SWEEP_CHAIN forwards one after the other in one call: the lookup's time inside a graph,
    # without TensorFlow's per-call cost (0.2-0.6 ms for a tf.function adding 1 to a scalar
    # on the 2-core machine), which torch's eager call does not pay.
    chained = util.chained_steps(
        tf, lambda: tf_ttemb.gather_reduce_sum(params, ids, weights)[0, 0], SWEEP_CHAIN
    )

    warmup, repeats = spec["warmup"], spec["repeats"]
    # raw and the wrappers alternate in one loop, so that both see the same machine load.
    timings = {
        key: timing.to_json()
        for key, timing in util.time_alternating(
            {"raw_op": raw, "wrapper": wrapper, "wrapper_ragged": wrapper_ragged}, warmup, repeats
        ).items()
    }
    timings["fwd"] = util.time_calls(lambda: forward(ids, weights), warmup, repeats).to_json()
    in_graph = util.time_calls(chained, warmup, repeats)
    timings["fwd_in_graph"] = util.Timing(
        in_graph.median_ms / SWEEP_CHAIN, in_graph.min_ms / SWEEP_CHAIN, repeats
    ).to_json()
    timings["fwd_bwd_sparse"] = util.time_calls(step(False), warmup, repeats).to_json()
    timings["fwd_bwd_dense"] = util.time_calls(step(True), warmup, repeats).to_json()
    return {"ok": True, "timings": timings, "versions": {"tensorflow": tf.__version__}}


def _sweep_variants_worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Ours, tf.functions on a tf.Variable table: forward and fwd+bwd (IndexedSlices) for
    each of SWEEP_VARIANTS (combiner, dtype) at one shape, per call and in graph
    (SWEEP_CHAIN steps in one call, which leaves out TensorFlow's cost of a call: the same
    for every variant, it would make a faster variant's ratio look worse), the variants
    timed in turn (one call of each per round), so that each ratio to float32 sum compares
    samples taken side by side on this noisy machine."""
    import tensorflow as tf

    util.add_checkout_to_path()
    import tf_ttemb

    problem = Problem(**spec["problem"])
    if spec["threads"]:
        tf.config.threading.set_intra_op_parallelism_threads(spec["threads"])
    arrays = make_arrays(problem)
    warmup, repeats = spec["warmup"], spec["repeats"]
    ids = tf.constant(arrays["ids"])
    forwards, steps, chained_forwards, chained_steps = {}, {}, {}, {}
    for combiner, dtype in SWEEP_VARIANTS:
        params = tf.Variable(tf.cast(arrays["params"], dtype))
        weights = tf.cast(arrays["weights"], dtype)
        upstream = tf.cast(arrays["upstream"], dtype)

        # max takes no weights: its fwd+bwd has the table gradient only.
        weighted = combiner != "max"

        @tf.function
        def forward(ids, weights, params=params, combiner=combiner, weighted=weighted):
            return tf_ttemb.gather_reduce_sum(
                params, ids, weights if weighted else None, combiner=combiner
            )

        @tf.function
        def step(ids, weights, upstream, params=params, combiner=combiner, weighted=weighted):
            with tf.GradientTape() as tape:
                tape.watch(weights)
                output = tf_ttemb.gather_reduce_sum(
                    params, ids, weights if weighted else None, combiner=combiner
                )
            sources = [params, weights] if weighted else [params]
            return output, tape.gradient(output, sources, output_gradients=upstream)

        def chained_step(params=params, weights=weights, upstream=upstream, combiner=combiner):
            # One element of each result: the step's ops all run (one op makes both grads).
            weighted = combiner != "max"
            with tf.GradientTape() as tape:
                tape.watch(weights)
                output = tf_ttemb.gather_reduce_sum(
                    params, ids, weights if weighted else None, combiner=combiner
                )
            grads = tape.gradient(
                output, [params, weights] if weighted else [params], output_gradients=upstream
            )
            total = tf.cast(output[0, 0] + grads[0].values[0, 0], tf.float32)
            return total + tf.cast(grads[1][0, 0], tf.float32) if weighted else total

        key = f"{combiner}/{dtype}"
        forwards[key] = lambda forward=forward, weights=weights: forward(ids, weights)
        steps[key] = lambda step=step, weights=weights, upstream=upstream: step(
            ids, weights, upstream
        )
        chained_forwards[key] = util.chained_steps(
            tf,
            lambda forward=forward, weights=weights: tf.cast(
                forward(ids, weights)[0, 0], tf.float32
            ),
            SWEEP_CHAIN,
        )
        chained_steps[key] = util.chained_steps(tf, chained_step, SWEEP_CHAIN)
    timings: Dict[str, Dict[str, Any]] = {key: {} for key in forwards}
    for column, fns, chain in (
        ("fwd", forwards, 1),
        ("fwd_bwd_sparse", steps, 1),
        ("fwd_in_graph", chained_forwards, SWEEP_CHAIN),
        ("fwd_bwd_in_graph", chained_steps, SWEEP_CHAIN),
    ):
        for key, timing in util.time_alternating(fns, warmup, repeats).items():
            timings[key][column] = util.Timing(
                timing.median_ms / chain, timing.min_ms / chain, repeats
            ).to_json()
    return {"ok": True, "timings": timings, "versions": {"tensorflow": tf.__version__}}


def _sweep_torch_worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    """torch's embedding_bag: forward (no_grad), fwd+bwd with sparse=True and sparse=False.
    The table is numpy's memory (numpy asks for transparent huge pages on Linux); "fwd
    torch-alloc" repeats the forward on a copy in torch's own allocation (4 KiB pages
    unless THP is "always"), the page size TensorFlow's tables get."""
    import torch
    import torch.nn.functional as F

    problem = Problem(**spec["problem"])
    torch.set_num_threads(spec["threads"] or util.usable_cpus())
    arrays = make_arrays(problem)
    ids = torch.from_numpy(arrays["ids"])
    weights = torch.from_numpy(arrays["weights"]).requires_grad_()
    upstream = torch.from_numpy(arrays["upstream"])
    tables = {
        "numpy": torch.nn.Parameter(torch.from_numpy(arrays["params"])),
        "torch": torch.nn.Parameter(torch.from_numpy(arrays["params"]).clone()),
    }

    def forward(table):
        with torch.no_grad():
            return F.embedding_bag(ids, table, mode="sum", per_sample_weights=weights)

    def step(sparse: bool):
        table = tables["numpy"]

        def run():
            table.grad = None
            weights.grad = None
            output = F.embedding_bag(
                ids, table, mode="sum", per_sample_weights=weights, sparse=sparse
            )
            output.backward(upstream)
            return table.grad

        return run

    warmup, repeats = spec["warmup"], spec["repeats"]
    timings = {
        "fwd": util.time_calls(lambda: forward(tables["numpy"]), warmup, repeats).to_json(),
        "fwd_torch_alloc": util.time_calls(
            lambda: forward(tables["torch"]), warmup, repeats
        ).to_json(),
        "fwd_bwd_sparse": util.time_calls(step(True), warmup, repeats).to_json(),
        "fwd_bwd_dense": util.time_calls(step(False), warmup, repeats).to_json(),
    }
    return {"ok": True, "timings": timings, "versions": {"torch": torch.__version__}}


def _sweep_spec(
    args: argparse.Namespace, threads: int, shape: Sequence[int], **extra: Any
) -> Tuple[Problem, Dict[str, Any]]:
    """The float32 Problem of a sweep shape (rows, dim, bags, bag size) and its workers' spec
    (`extra` added)."""
    problem = Problem(*shape, "float32", args.index_dtype, args.seed)
    spec = {"problem": dataclasses.asdict(problem), "threads": threads}
    return problem, dict(spec, **util.option_values(args, "warmup", "repeats"), **extra)


def _sweep_table(args: argparse.Namespace, threads: int, script: str, have_torch: bool):
    """One thread count: both workers on every SWEEP_SHAPES case; the printed table."""
    rows, cases = [], []
    for n, shape in enumerate(SWEEP_SHAPES, 1):
        problem, base = _sweep_spec(args, threads, shape)
        util.log(f"[{threads} thread(s), {n}/{len(SWEEP_SHAPES)}] {problem.describe()}")
        ours = util.run_worker(script, dict(base, impl="sweep_tf"), {})
        theirs = (
            util.run_worker(script, dict(base, impl="sweep_torch"), {})
            if have_torch
            else {"ok": False, "error": "torch is not importable"}
        )
        cases.append(
            {"problem": base["problem"], "threads": threads, "ours": ours, "torch": theirs}
        )
        mine = ours.get("timings", {})
        other = theirs.get("timings", {})

        def ms(timings, key):
            return f"{timings[key]['median_ms']:.2f}" if key in timings else "-"

        def cell(key, their_key=None):
            their_key = their_key or key
            if key not in mine or their_key not in other:
                return f"- / {ms(mine, key)}"
            ratio = other[their_key]["median_ms"] / mine[key]["median_ms"]
            return f"{ms(other, their_key)} / {ms(mine, key)} = {ratio:.2f}x"

        def over_raw(key):
            if key not in mine or "raw_op" not in mine:
                return "-"
            return f"{mine[key]['median_ms'] / mine['raw_op']['median_ms']:.2f}x"

        rows.append(
            [
                f"{problem.num_rows:,} x {problem.dim}, {problem.bags:,} x {problem.bag_size}",
                ms(mine, "raw_op"),
                f"{ms(mine, 'wrapper')} ({over_raw('wrapper')})",
                f"{ms(mine, 'wrapper_ragged')} ({over_raw('wrapper_ragged')})",
                ms(other, "fwd_torch_alloc"),
                cell("fwd"),
                cell("fwd_in_graph", "fwd"),
                cell("fwd_bwd_sparse"),
                cell("fwd_bwd_dense"),
            ]
        )
        for side, result in (("ours", ours), ("torch", theirs)):
            if not result.get("ok"):
                util.log(f"  {side} failed: {result.get('error')}")
    headers = [
        "N x D, bags x L",
        "raw op ms",
        "wrapper ms (/ raw)",
        "ragged ms (/ raw)",
        "torch fwd, torch-alloc table",
        "fwd: torch / ours",
        "fwd in graph: torch / ours",
        "fwd+bwd sparse: torch / ours",
        "fwd+bwd dense: torch / ours",
    ]
    print(
        f"gather_reduce_sum sweep: float32, weighted sum, {args.index_dtype} ids, "
        f"{threads} thread(s)"
        + util.environment_suffix()
        + f", median of {args.repeats} calls (ms); a ratio >= 1 means "
        "ours is at least as fast as torch; 'in graph': ours per forward of "
        f"{SWEEP_CHAIN} in one tf.function call, against torch's per call"
    )
    print(util.format_table(headers, rows))
    print()
    return cases


def _sweep_scaling(cases: List[Dict[str, Any]], thread_counts: List[int]) -> None:
    """Prints time at the first thread count over time at each other, per shape and side."""
    if len(thread_counts) < 2:
        return
    first = thread_counts[0]
    by_key = {(tuple(c["problem"].values()), c["threads"]): c for c in cases}
    headers = ["N x D, bags x L", "side"] + [
        f"{key} {t} -> {first} thr" for t in thread_counts[1:] for key in SWEEP_COLUMNS
    ]
    rows = []
    for c in cases:
        if c["threads"] != first:
            continue
        p = c["problem"]
        for side in ("ours", "torch"):
            row = [f"{p['num_rows']:,} x {p['dim']}, {p['bags']:,} x {p['bag_size']}", side]
            for t in thread_counts[1:]:
                other = by_key.get((tuple(p.values()), t), {}).get(side, {}).get("timings", {})
                mine = c[side].get("timings", {})
                for key in SWEEP_COLUMNS:
                    if key in mine and key in other:
                        row.append(f"{other[key]['median_ms'] / mine[key]['median_ms']:.2f}x")
                    else:
                        row.append("-")
            rows.append(row)
    print(
        f"thread scaling: speed-up at {first} threads over t threads "
        f"(median time at t / at {first})"
    )
    print(util.format_table(headers, rows))
    print()


def _sweep_variants(args: argparse.Namespace, threads: int, script: str) -> Dict[str, Any]:
    """Ours: every combiner and table dtype against float32 sum at SWEEP_VARIANT_SHAPE."""
    problem, spec = _sweep_spec(args, threads, SWEEP_VARIANT_SHAPE, impl="sweep_variants")
    util.log(f"[{threads} thread(s)] combiners and dtypes at {problem.describe()}")
    result = util.run_worker(script, spec, {})
    timings = result.get("timings", {})
    ref = timings.get("sum/float32", {})
    rows = []
    for combiner, dtype in SWEEP_VARIANTS:
        t = timings.get(f"{combiner}/{dtype}", {})
        row = [combiner, dtype]
        for key in ("fwd", "fwd_bwd_sparse", "fwd_in_graph", "fwd_bwd_in_graph"):
            if key not in t or key not in ref:
                row += ["-", "-"]
                continue
            ratio = t[key]["median_ms"] / ref[key]["median_ms"]
            # Per byte: a half table moves half the bytes of a float32 one.
            per_byte = ratio * ITEMSIZE["float32"] / ITEMSIZE[dtype]
            row += [f"{t[key]['median_ms']:.2f}", f"{ratio:.2f}x ({per_byte:.2f}x/byte)"]
        rows.append(row)
    headers = [
        "combiner",
        "table dtype",
        "fwd ms",
        "fwd / f32 sum",
        "fwd+bwd sparse ms",
        "fwd+bwd / f32 sum",
        "fwd in graph ms",
        "/ f32 sum",
        "fwd+bwd in graph ms",
        "/ f32 sum",
    ]
    print(
        f"ours, {problem.num_rows:,} x {problem.dim}, {problem.bags:,} x {problem.bag_size}, "
        "weighted (max: unweighted), "
        f"{threads} thread(s): "
        "each combiner and table dtype against float32 sum (target: <= 1.2x; per byte for "
        f"the half types); per call, then in graph ({SWEEP_CHAIN} steps in one tf.function "
        "call, per step)"
    )
    print(util.format_table(headers, rows))
    if not result.get("ok"):
        util.log(f"  variants failed: {result.get('error')}")
    return result


def sweep(args: argparse.Namespace) -> Dict[str, Any]:
    """Runs both workers on every SWEEP_SHAPES case at each --sweep-threads count, prints the
    tables with torch / ours, the thread scaling, and our combiner and dtype variants."""
    script = os.path.abspath(__file__)
    have_torch = importlib.util.find_spec("torch") is not None
    if not have_torch:
        util.log("torch is not importable: only our times are printed")
    thread_counts = args.sweep_threads or [args.threads or util.usable_cpus()]
    cases: List[Dict[str, Any]] = []
    for threads in thread_counts:
        cases += _sweep_table(args, threads, script, have_torch)
    _sweep_scaling(cases, thread_counts)
    variants = _sweep_variants(args, thread_counts[0], script)
    return {
        "benchmark": "gather_reduce_sum_sweep",
        "machine": util.machine_info(),
        "settings": {
            "repeats": args.repeats,
            "warmup": args.warmup,
            "threads": thread_counts,
            "index_dtype": args.index_dtype,
        },
        "cases": cases,
        "variants": variants,
    }


def worker_main(spec: Dict[str, Any]) -> None:
    """Entry point of a worker process: measures one implementation, writes JSON."""
    workers = {"torch": _torch_worker, "sweep_tf": _sweep_tf_worker}
    workers["sweep_torch"] = _sweep_torch_worker
    workers["sweep_variants"] = _sweep_variants_worker
    util.worker_main(spec, workers.get(spec["impl"], _tf_worker))


# ----------------------------------------------------------------------------------------
# Driver.


def measure(args: argparse.Namespace, problem: Problem) -> List[Dict[str, Any]]:
    """Runs the workers for every requested implementation, in order."""
    script = os.path.abspath(__file__)
    base_spec = {
        "problem": dataclasses.asdict(problem),
        "threads": args.threads,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "eager": args.eager,
        "sparse_updated": args.sparse_updated,
    }
    results = []
    for i, impl in enumerate(args.impls, 1):
        label = IMPLS[impl]
        if impl == "torch" and importlib.util.find_spec("torch") is None:
            util.log(f"[{i}/{len(args.impls)}] {label}: skipped, torch is not importable")
            results.append({"impl": impl, "ok": False, "error": "torch is not importable"})
            continue
        util.log(f"[{i}/{len(args.impls)}] {label}: timing and RSS ...")
        result = util.run_worker(
            script, dict(base_spec, impl=impl, mode="time"), {"TF_CPU_ALLOCATOR_USE_BFC": None}
        )
        if result.get("ok") and impl != "torch" and args.allocator_stats:
            util.log(f"[{i}/{len(args.impls)}] {label}: TensorFlow allocator peak ...")
            stats = util.run_worker(
                script,
                dict(base_spec, impl=impl, mode="allocator"),
                {"TF_CPU_ALLOCATOR_USE_BFC": "true"},
            )
            result["allocator_peak"] = stats.get("allocator_peak") or {
                "ok": False,
                "reason": stats.get("error", "unknown"),
            }
        result["impl"] = impl
        results.append(result)
    return results


def _ms(timing: Optional[Dict[str, float]]) -> str:
    if not timing:
        return "-"
    return f"{timing['median_ms']:.1f} ({timing['min_ms']:.1f})"


def _speedup(result: Dict[str, Any], baseline: Optional[Dict[str, Any]], key: str) -> str:
    if not baseline or not result.get(key) or not baseline.get(key):
        return "-"
    return f"{baseline[key]['median_ms'] / result[key]['median_ms']:.2f}x"


def report(
    args: argparse.Namespace,
    problem: Problem,
    results: Sequence[Dict[str, Any]],
    reference: Dict[str, int],
) -> str:
    """The results table and its legend, as printed."""
    measured = {r["impl"]: r for r in results if r.get("ok")}
    baseline = measured.get(BASELINE)
    check_ref = baseline or next(iter(measured.values()), None)
    tolerance = AGREEMENT_TOLERANCE[problem.dtype]

    headers = ["implementation", "fwd ms", "fwd+bwd ms"]
    if args.eager:
        headers.append("eager f+b ms")
    headers += ["peak MiB (TF alloc)", "peak MiB (RSS)", "speed-up fwd", "speed-up f+b", "agrees"]

    def row_of(result, label):
        allocator = result.get("allocator_peak") or {}
        if check_ref is result:
            agrees = "ref"
        else:
            worst = max_disagreement(result["fingerprints"], check_ref["fingerprints"])
            result["disagreement"] = worst
            agrees = "yes" if worst <= tolerance else f"NO ({worst:.1e})"
        row = [label, _ms(result.get("fwd")), _ms(result.get("fwd_bwd"))]
        if args.eager:
            row.append(_ms(result.get("eager_fwd_bwd")))
        return row + [
            util.mib_text(allocator.get("growth_bytes")) if allocator.get("ok") else "-",
            util.mib_text(result.get("rss_growth_bytes")),
            _speedup(result, baseline, "fwd"),
            _speedup(result, baseline, "fwd_bwd"),
            agrees,
        ]

    rows, failures = util.result_rows(results, lambda r: IMPLS[r["impl"]], len(headers), row_of)

    rss_methods = sorted({r["rss_method"] for r in measured.values() if r.get("rss_method")})
    allocator_notes = sorted(
        {
            r["allocator_peak"]["reason"]
            for r in measured.values()
            if r.get("allocator_peak") and not r["allocator_peak"].get("ok")
        }
    )
    threads = sorted({r["threads"] for r in measured.values() if r.get("threads")})
    lines = [
        f"gather_reduce_sum, CPU: {problem.describe()}"
        + (", table variable sparse-updated before" if args.sparse_updated else ""),
        f"threads: {', '.join(map(str, threads)) or '?'} (TF intra-op = torch)",
        "",
        util.format_table(headers, rows),
        "",
        f"ms: median (min) over {args.repeats} calls after {args.warmup} warm-up calls; TF "
        "steps run as tf.function (graph, no XLA), 'eager f+b' without it; torch is eager.",
        "peak MiB: growth over one fwd+bwd step above the inputs, output and gradients "
        "included; 'TF alloc' = TensorFlow's BFC CPU allocator statistics "
        "(TF_CPU_ALLOCATOR_USE_BFC=true; whole chunks, so up to 2x a tensor's size, "
        "and tensors only), 'RSS' = peak resident set size growth over the first "
        f"full-size step ({'; '.join(rss_methods) or 'n/a'}).",
        f"speed-ups: median vs {IMPLS[BASELINE]}. agrees: probe inner products of output, "
        f"table gradient and weights gradient match "
        f"{IMPLS[check_ref['impl']] if check_ref else '-'} within {tolerance:g} (relative).",
        "",
        "(output + gradient) size, the least a fwd+bwd step holds: "
        f"{util.mib_text(reference['total'])} MiB = output [{problem.bags:,}, {problem.dim}] "
        f"{util.mib_text(reference['output'])} MiB + table gradient "
        f"[U={reference['unique_ids']:,}, {problem.dim}] "
        f"{util.mib_text(reference['params_grad'])} MiB + weights gradient "
        f"[{problem.nnz:,}] {util.mib_text(reference['weights_grad'])} MiB",
    ]
    for note in allocator_notes:
        lines.append(f"TF allocator statistics unavailable: {note}")
    return util.report_text(lines, failures)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line (see `--help`)."""
    parser = util.choices_parser(
        "Time and peak memory of tf_ttemb.gather_reduce_sum against the TF composite, "
        "tf.nn.embedding_lookup_sparse and torch's embedding_bag, on CPU.",
        "Implementations",
        IMPLS,
        "Each one runs in fresh processes. See the module docstring for the method.",
    )
    util.add_int_options(
        parser,
        num_rows=(65_536, "rows of the table (default: %(default)s)"),
        dim=(256, "embedding dimension (default: %(default)s)"),
        bags=(2_048, "number of bags (default: %(default)s)"),
        bag_size=(128, "ids per bag (default: %(default)s)"),
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="table, weights and output dtype (default: %(default)s)",
    )
    parser.add_argument(
        "--index-dtype",
        choices=("int32", "int64"),
        default="int64",
        help="dtype of the ids (default: %(default)s)",
    )
    util.add_timing_options(
        parser,
        repeats=(10, "timed calls per measurement (default: %(default)s)"),
        warmup=(2, "untimed calls before timing (default: %(default)s)"),
        threads_help="TF intra-op threads, and torch threads (default: 0 = TensorFlow's "
        "default, one per usable CPU)",
    )
    util.add_choice_list(
        parser,
        "--impls",
        IMPLS,
        "comma-separated implementations to run (default: all; torch is skipped where it is "
        "not importable)",
    )
    parser.add_argument(
        "--no-eager",
        dest="eager",
        action="store_false",
        help="skip the eager (no tf.function) fwd+bwd timing",
    )
    parser.add_argument(
        "--no-allocator-stats",
        dest="allocator_stats",
        action="store_false",
        help="skip the TensorFlow allocator peak (saves a process per impl)",
    )
    parser.add_argument(
        "--sparse-updated-table",
        dest="sparse_updated",
        action="store_true",
        help="scatter into the table variable before measuring, as a sparse "
        "optimizer update does in training: TensorFlow then copies the whole "
        "table on every dense read of it (not on tf.gather)",
    )
    parser.add_argument("--seed", type=int, default=0, help="data seed (default: %(default)s)")
    parser.add_argument(
        "--json", metavar="PATH", help="also write all results and machine information to PATH"
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="time issue 19's four float32 shapes and two more (raw op, wrapper, forward "
        "per call and in graph, fwd+bwd sparse and dense) against torch's embedding_bag and "
        "print the ratios, the thread scaling and our combiners and half types against "
        "float32 sum; honours --sweep-threads (or --threads), --repeats, --warmup, --index-dtype, "
        "--seed and --json",
    )
    parser.add_argument(
        "--sweep-threads",
        type=util.positive_int_list,
        default=None,
        metavar="N,M",
        help="with --sweep: the thread counts to run the table at, e.g. 2,1 (default: "
        "--threads, or one per usable CPU)",
    )
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the benchmark; the exit status is 1 when an implementation failed."""
    args = parse_args(argv)
    if args.sweep:
        document = sweep(args)
        if args.json:
            util.write_json(args.json, document)
        return 0 if all(c["ours"].get("ok") for c in document["cases"]) else 1

    problem = util.from_options(Problem, args)
    if args.impls is None:
        # torch is optional by default; asked for explicitly, its absence is reported.
        args.impls = list(IMPLS)
        if importlib.util.find_spec("torch") is None:
            args.impls.remove("torch")
            util.log("torch is not importable: its embedding_bag is left out")
    util.log(f"gather_reduce_sum benchmark: {problem.describe()}")

    results = measure(args, problem)
    reference = reference_bytes(problem)
    print(report(args, problem, results, reference))

    if args.json:
        versions: Dict[str, Any] = {}
        for result in results:
            versions.update(result.get("versions", {}))
        document = {
            "benchmark": "gather_reduce_sum",
            "machine": util.machine_info(),
            "versions": versions,
            "problem": dataclasses.asdict(problem),
            "settings": dict(
                util.option_values(args, "repeats", "warmup", "threads", "eager"),
                allocator_stats=args.allocator_stats,
                sparse_updated_table=args.sparse_updated,
                baseline=BASELINE,
                agreement_tolerance=AGREEMENT_TOLERANCE[problem.dtype],
            ),
            "reference_bytes": reference,
            "results": results,
        }
        util.write_json(args.json, document)
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(util.main_or_worker(main, worker_main))
