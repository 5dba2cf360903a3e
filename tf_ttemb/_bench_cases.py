"""The cases of `python -m tf_ttemb bench` and how they are timed; tf_ttemb/bench.py is the
command (its options, presets and report) and its docstring says what each case measures.

A case builder (`build_gather_reduce_sum`, `build_tt_rows`, `build_tt_bag`,
`build_pkm`) makes the case's data on the current device and returns a `Case`: its
implementations (`Impl`: a forward and a forward + backward of one input, traced inside
a `tf.function`), `--in-graph-steps` inputs (the first one is the input of the per-call
times), torch's steps when torch runs in this process, and the implementations'
agreement with the baseline, checked before anything is timed. `time_case` times it and
returns the rows of the result table.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from tf_ttemb import _bench_torch, _timing

CASES = ("gather_reduce_sum", "tt_rows", "tt_bag", "pkm")
DTYPES = ("float16", "bfloat16", "float32", "float64")
BASELINES = {
    "gather_reduce_sum": "tf_gather",
    "tt_rows": "tf_gather",
    "tt_bag": "composite",
    "pkm": "composite",
}
# torch's CPU embedding_bag has no float16 per-sample weights.
TORCH_CPU_DTYPES = ("bfloat16", "float32", "float64")
# The timed measurements of a row, in the order of the table.
MEASUREMENTS = ("fwd", "fwd_in_graph", "fwd_chained", "fwd_bwd", "fwd_bwd_in_graph")
# Bags of a tt_bag case compared with the numpy reference (float64, `tf_ttemb.tt.rows`).
REFERENCE_BAGS = 64
# Most bags of a gather_reduce_sum case whose output and gradients are compared with the
# baseline's (the first ones of its first batch).
COMPARE_BAGS = 2048
# The learning rate of the tt_bag case's fused SGD step.
TT_LEARNING_RATE = 0.01


@dataclasses.dataclass
class Impl:
    """One TensorFlow implementation of a case: `fwd(x)` and `fwd_bwd(x)` build, inside a
    `tf.function`, its forward and its forward + backward (a list of tensors) of input x."""

    name: str
    fwd: Callable[[Any], Any]
    fwd_bwd: Callable[[Any], Any]


@dataclasses.dataclass
class ForeignStep:
    """torch in this process (on the CPU): `fwd()` and `fwd_bwd()` on the case's first
    input, each returning once its work is done."""

    name: str
    fwd: Callable[[], Any]
    fwd_bwd: Callable[[], Any]


@dataclasses.dataclass
class Case:
    """A built case (see the module docstring). `diffs[impl][kind]` is the impl's
    `max_rel_diff` against the baseline (`fwd`, `fwd_bwd`) or against the numpy reference
    (`fwd_reference`); `torch_check` holds the baseline's first bags for a torch child's
    results; `data` the case's variables and arrays, for tests."""

    case: str
    label: str
    dtype: str
    shape: str
    impls: List[Impl]
    inputs: List[Any]
    diffs: Dict[str, Dict[str, float]]
    foreign: List[ForeignStep] = dataclasses.field(default_factory=list)
    lookups: int = 0
    gathered_bytes: int = 0
    torch_check: Optional[Dict[str, Any]] = None
    data: Dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def baseline(self) -> str:
        return BASELINES[self.case]


# ----------------------------------------------------------------------------------------
# Agreement.


def as_float64(value: Any, rows: Any = None):
    """`value` (a TensorFlow tensor, variable or `IndexedSlices`, a torch tensor, dense or
    sparse, or an array) as a float64 numpy array.

    A gradient w.r.t. a table (`IndexedSlices`, torch's sparse tensor) is summed per row:
    with `rows` (sorted row ids, every row the gradient may touch) into `[len(rows), D]`,
    so that a 10M-row table's gradient is never built densely; else into the dense table.
    A gradient on a row outside `rows` gives NaN (it then differs from anything).
    """
    import numpy as np
    import tensorflow as tf

    if isinstance(value, tf.IndexedSlices):
        if rows is None:
            return tf.cast(tf.convert_to_tensor(value), tf.float64).numpy()
        indices = value.indices.numpy().astype(np.int64)
        positions = np.minimum(np.searchsorted(rows, indices), len(rows) - 1)
        # Summed in float32 (float64 for float64), not in float64: a [nnz, D] float64
        # copy of a large gradient would not fit where the float32 one just does.
        sum_dtype = tf.float64 if value.values.dtype == tf.float64 else tf.float32
        # On the CPU: TensorFlow's GPU kernel counts elements in int32, and a PKM-sized
        # gradient (2^21 rows of 1024) has 2^31 of them.
        with tf.device("/CPU:0"):
            summed = tf.math.unsorted_segment_sum(
                tf.cast(value.values, sum_dtype), tf.constant(positions), len(rows)
            ).numpy()
        summed = summed.astype(np.float64)
        if not np.array_equal(rows[positions], indices):
            summed[:] = np.nan
        return summed
    if isinstance(value, (tf.Tensor, tf.Variable)):
        return tf.cast(value, tf.float64).numpy()
    if hasattr(value, "detach"):  # a torch tensor
        if getattr(value, "is_sparse", False):
            value = value.coalesce()
            if rows is not None:
                indices = value.indices()[0].numpy()
                values = value.values().detach().double().numpy()
                positions = np.minimum(np.searchsorted(rows, indices), len(rows) - 1)
                out = np.zeros((len(rows),) + values.shape[1:])
                out[positions] = values
                if not np.array_equal(rows[positions], indices):
                    out[:] = np.nan
                return out
            value = value.to_dense()
        return value.detach().double().cpu().numpy()
    return np.asarray(value, dtype=np.float64)


def max_rel_diff(got: Any, want: Any, rows: Any = None) -> float:
    """Largest |got - want| over the largest |want|, both across all tensors of a result.

    One scale for the whole result (output and gradients): a gradient that is zero up to
    rounding (the bias of a projection followed by batch norm) is not divided by its own
    rounding noise. Table gradients are summed per row first (`as_float64`).
    """
    import numpy as np

    got_list = [as_float64(g, rows) for g in _flat(got)]
    want_list = [as_float64(w, rows) for w in _flat(want)]
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


def _flat(result: Any) -> list:
    return list(result) if isinstance(result, (list, tuple)) else [result]


def compare(results: Mapping[str, Any], baseline: str, rows: Any = None) -> Dict[str, float]:
    """impl -> `max_rel_diff` of its result against the baseline's (0 for the baseline)."""
    return {name: max_rel_diff(r, results[baseline], rows) for name, r in results.items()}


def _full_results(impls: Sequence[Impl], foreign: Sequence[ForeignStep], x: Any, kind: str):
    import tensorflow as tf

    results = {i.name: tf.function(getattr(i, kind))(x) for i in impls}
    results.update({s.name: getattr(s, kind)() for s in foreign})
    return results


def _check_both(impls, foreign, x, baseline, rows=None) -> Dict[str, Dict[str, float]]:
    """diffs[impl] = {"fwd", "fwd_bwd"} against the baseline, on input x."""
    diffs: Dict[str, Dict[str, float]] = {}
    for kind in ("fwd", "fwd_bwd"):
        for name, d in compare(_full_results(impls, foreign, x, kind), baseline, rows).items():
            diffs.setdefault(name, {})[kind] = d
    return diffs


# ----------------------------------------------------------------------------------------
# Cases.


def _torch_cpu_steps(data, dtype: str, opts) -> List[ForeignStep]:
    """torch's embedding_bag in this process, when the bench runs it here (--torch auto
    on the CPU) and torch imports; else no steps (the command's notes say why)."""
    if opts.torch_mode != "here" or dtype not in TORCH_CPU_DTYPES:
        return []
    try:
        import torch
    except ImportError:
        return []
    fwd, fwd_bwd = _bench_torch.embedding_bag_steps(torch, data, dtype, "cpu")
    return [ForeignStep("torch", fwd, fwd_bwd)]


def _bag_impls(table, weights, upstream) -> List[Impl]:
    """`custom_op` and `tf_gather` on ids shaped like `weights`, their fwd+bwd against
    `upstream`."""
    import tensorflow as tf

    import tf_ttemb

    def custom(ids):
        return tf_ttemb.gather_reduce_sum(table, ids, weights, implementation="custom_op")

    def plain(ids):
        return tf.reduce_sum(tf.gather(table, ids) * weights[..., None], axis=-2)

    def fwd_bwd(lookup):
        def step(ids):
            with tf.GradientTape() as tape:
                tape.watch(weights)
                out = lookup(ids)
            return [out] + tape.gradient(out, [table, weights], output_gradients=upstream)

        return step

    return [Impl("custom_op", custom, fwd_bwd(custom)), Impl("tf_gather", plain, fwd_bwd(plain))]


def _first_bags(kind: str, result: Any, count: int) -> list:
    """What torch's rows are compared on: the first `count` bags' output, and for fwd+bwd
    their weights gradient (`_bench_torch`'s check)."""
    return [result[:count]] if kind == "fwd" else [result[0][:count], result[2][:count]]


def build_gather_reduce_sum(opts, dtype: str, seed: Sequence[int], label: str) -> Case:
    """A weighted-sum EmbeddingBag: `custom_op` against `tf_gather` (and torch).

    The agreement is checked on the first batch's first `COMPARE_BAGS` bags (all of them
    at the CPU sizes): at the PKM preset's 16,384 bags the baseline's table gradient alone
    is 8 GiB, summed per row on the host."""
    import numpy as np
    import tensorflow as tf

    n, d, b, length = opts.rows, opts.dim, opts.bags, opts.bag_size
    data = _bench_torch.bag_data(seed, n, d, b, length, batches=opts.in_graph_steps)
    table = tf.Variable(tf.cast(data["table"], dtype), name="table")
    inputs = [tf.constant(ids, tf.as_dtype(opts.index_dtype)) for ids in data["ids"]]
    weights = tf.cast(tf.constant(data["weights"]), dtype)
    upstream = tf.cast(tf.constant(data["upstream"]), dtype)
    impls = _bag_impls(table, weights, upstream)
    compared = min(b, COMPARE_BAGS)
    check_impls = impls
    if compared < b:
        check_impls = _bag_impls(table, weights[:compared], upstream[:compared])
    foreign = _torch_cpu_steps(data, dtype, opts)
    rows = np.unique(data["ids"][0][:compared])
    diffs: Dict[str, Dict[str, float]] = {}
    check: Dict[str, Any] = {}
    count = _bench_torch.CHECK_BAGS
    for kind in ("fwd", "fwd_bwd"):
        results = _full_results(check_impls, [], inputs[0][:compared], kind)
        for name, diff in compare(results, "tf_gather", rows).items():
            diffs.setdefault(name, {})[kind] = diff
        check[kind] = _first_bags(kind, results["tf_gather"], count)
        for step in foreign:
            got = _first_bags(kind, getattr(step, kind)(), count)
            diffs.setdefault(step.name, {})[kind] = max_rel_diff(got, check[kind])
        del results
    shape = f"{n:,}x{d} table, {b:,} bags x {length} {opts.index_dtype} ids, weighted sum"
    return Case(
        "gather_reduce_sum",
        label,
        dtype,
        shape,
        impls,
        inputs,
        diffs,
        foreign,
        lookups=b * length,
        gathered_bytes=b * length * d * tf.as_dtype(dtype).size,
        torch_check={k: [as_float64(v) for v in c] for k, c in check.items()},
        data={"table": table, "weights": weights, "upstream": upstream},
    )


def build_tt_rows(opts, dtype: str, seed: Sequence[int], label: str) -> Case:
    """Rows of a TT table by `tf_ttemb.tt_rows` against `tf.gather` from the same table
    stored densely (decompressed by numpy in float64)."""
    import numpy as np
    import tensorflow as tf

    import tf_ttemb
    from tf_ttemb import tt
    from tf_ttemb.layers import TTEmbeddingBag

    rng = np.random.default_rng(seed)
    n, d, rank, count = opts.tt_rows, opts.tt_dim, opts.tt_rank, opts.tt_lookups
    layer = TTEmbeddingBag(
        n,
        d,
        tt_ranks=rank,
        tt_p_shapes=opts.tt_p,
        tt_q_shapes=opts.tt_q,
        seed=int(rng.integers(1 << 30)),
        dtype=dtype,
        implementation="custom_op",
    )
    layer.build(None)
    p, q, ranks = layer.tt_p_shapes, layer.tt_q_shapes, layer.tt_ranks
    cores = list(layer.cores)
    # The dense table, decompressed independently of the op (numpy, float64).
    dense = tt.to_dense([c.numpy() for c in cores], p, q, ranks, n, dtype=np.float64)
    table = tf.Variable(tf.cast(dense, dtype), name="dense_table")
    del dense
    inputs = [
        tf.constant(rng.integers(0, n, size=count), tf.int64) for _ in range(opts.in_graph_steps)
    ]
    upstream = tf.constant(rng.normal(size=(count, d)), dtype)

    def custom(ids):
        return tf_ttemb.tt_rows(
            cores, ids, p_shapes=p, q_shapes=q, ranks=ranks, implementation="custom_op"
        )

    def plain(ids):
        return tf.gather(table, ids)

    def fwd_bwd(lookup, variables):
        def step(ids):
            with tf.GradientTape() as tape:
                out = lookup(ids)
            return [out] + tape.gradient(out, variables, output_gradients=upstream)

        return step

    impls = [
        Impl("custom_op", custom, fwd_bwd(custom, cores)),
        Impl("tf_gather", plain, fwd_bwd(plain, [table])),
    ]
    # The gradients are w.r.t. different variables (cores, dense table): fwd+bwd compares
    # the outputs only.
    diffs = {"custom_op": {}, "tf_gather": {}}
    for kind in ("fwd", "fwd_bwd"):
        results = _full_results(impls, [], inputs[0], kind)
        outputs = {k: _flat(v)[0] for k, v in results.items()}
        for name, diff in compare(outputs, "tf_gather").items():
            diffs[name][kind] = diff
    shape = (
        f"{n:,}x{d} table as TT p={p} q={q} ranks={ranks} "
        f"({sum(int(c.shape.num_elements()) for c in cores):,} parameters), {count:,} ids"
    )
    return Case("tt_rows", label, dtype, shape, impls, inputs, diffs, lookups=count)


def build_tt_bag(opts, dtype: str, seed: Sequence[int], label: str, bags: int) -> Case:
    """Bags of a TT table: `tf_ttemb.tt_embedding_bag` forward, and as fwd+bwd one training
    step of `TTEmbeddingBag(sparse=True, optimizer="sgd")` (forward, backward and the
    fused in-place core update), custom op against the composite."""
    import numpy as np
    import tensorflow as tf

    import tf_ttemb
    from tf_ttemb import tt
    from tf_ttemb.layers import TTEmbeddingBag

    rng = np.random.default_rng(seed)
    n, d, rank, length = opts.tt_rows, opts.tt_dim, opts.tt_rank, opts.tt_bag_size
    layer_seed = int(rng.integers(1 << 30))
    layers = {}
    for impl in ("custom_op", "composite"):
        layers[impl] = TTEmbeddingBag(
            n,
            d,
            tt_ranks=rank,
            tt_p_shapes=opts.tt_p,
            tt_q_shapes=opts.tt_q,
            combiner="sum",
            sparse=True,
            optimizer="sgd",
            learning_rate=TT_LEARNING_RATE,
            seed=layer_seed,
            dtype=dtype,
            implementation=impl,
        )
        layers[impl].build(None)
    layers["composite"].set_weights(layers["custom_op"].get_weights())
    first = layers["custom_op"]
    p, q, ranks = first.tt_p_shapes, first.tt_q_shapes, first.tt_ranks
    ids_arrays = [rng.integers(0, n, size=(bags, length)) for _ in range(opts.in_graph_steps)]
    inputs = [tf.constant(ids, tf.int64) for ids in ids_arrays]
    upstream = tf.cast(tf.constant(rng.standard_normal((bags, d))), dtype)

    def forward(impl):
        layer = layers[impl]

        def fwd(ids):
            return tf_ttemb.tt_embedding_bag(
                layer.cores,
                ids,
                num_embeddings=n,
                p_shapes=p,
                q_shapes=q,
                ranks=ranks,
                combiner="sum",
                implementation=impl,
            )

        return fwd

    def training_step(impl):
        layer = layers[impl]

        def step(ids):
            # With sparse=True the backward pass applies SGD to the cores' touched rows in
            # place; the (empty) gradient of the layer's trigger variable carries it.
            with tf.GradientTape() as tape:
                out = layer(ids)
            grads = tape.gradient(out, layer.trainable_variables, output_gradients=upstream)
            return [out] + grads

        return step

    impls = [Impl(i, forward(i), training_step(i)) for i in ("custom_op", "composite")]
    initial = [c.numpy().astype(np.float64) for c in first.cores]
    diffs: Dict[str, Dict[str, float]] = {i.name: {} for i in impls}
    outputs = _full_results(impls, [], inputs[0], "fwd")
    checked = min(bags, REFERENCE_BAGS)
    reference = tt.rows(initial, p, q, ranks, ids_arrays[0][:checked]).sum(axis=-2)
    for name, diff in compare(outputs, "composite").items():
        diffs[name]["fwd"] = diff
        diffs[name]["fwd_reference"] = max_rel_diff(outputs[name][:checked], reference)
    # One step of each from the same cores: the outputs and the updated cores agree.
    stepped = {}
    for impl in impls:
        result = tf.function(impl.fwd_bwd)(inputs[0])
        stepped[impl.name] = [result[0]] + [c.numpy() for c in layers[impl.name].cores]
    for name, diff in compare(stepped, "composite").items():
        diffs[name]["fwd_bwd"] = diff
    params = tt.num_parameters(p, q, ranks)
    shape = (
        f"{n:,}x{d} table as TT p={p} q={q} ranks={ranks} ({params:,} parameters), "
        f"{bags:,} bags x {length} ids, sum; fwd+bwd = one training step of "
        "TTEmbeddingBag(sparse=True, optimizer='sgd')"
    )
    return Case(
        "tt_bag",
        label,
        dtype,
        shape,
        impls,
        inputs,
        diffs,
        lookups=bags * length,
        data={
            "initial_cores": initial,
            "p": p,
            "q": q,
            "ranks": ranks,
            "layers": layers,
            "upstream": upstream,
        },
    )


def build_pkm(opts, dtype: str, seed: Sequence[int], label: str) -> Case:
    """A `ProductKeyMemory` layer with the memory read by the custom op against the
    composite (float32: the layer keeps float32 variables under every policy)."""
    import numpy as np
    import tensorflow as tf

    from tf_ttemb.layers import ProductKeyMemory

    rng = np.random.default_rng(seed)
    tokens, dim = opts.pkm_tokens, opts.pkm_dim
    keys, heads, knn = opts.pkm_keys, opts.pkm_heads, min(opts.pkm_knn, opts.pkm_keys)
    inputs = [
        tf.constant(rng.normal(size=(tokens, dim)), tf.float32) for _ in range(opts.in_graph_steps)
    ]
    upstream = tf.constant(rng.normal(size=(tokens, dim)), tf.float32)
    layers = {}
    for impl in ("custom_op", "composite"):
        layer = ProductKeyMemory(
            output_dim=dim, n_keys=keys, k_dim=64, heads=heads, knn=knn, implementation=impl
        )
        layer.build(inputs[0].shape)
        layers[impl] = layer
    layers["composite"].set_weights(layers["custom_op"].get_weights())

    def fwd(layer):
        return lambda x: layer(x, training=False)

    def fwd_bwd(layer):
        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                out = layer(x, training=True)
            variables = layer.trainable_variables
            return [out] + tape.gradient(out, [x] + variables, output_gradients=upstream)

        return step

    impls = [Impl(i, fwd(layer), fwd_bwd(layer)) for i, layer in layers.items()]
    diffs = _check_both(impls, [], inputs[0], "composite")
    shape = (
        f"{tokens:,} tokens x {dim}, {keys}**2 = {keys * keys:,} slots, {heads} heads x {knn} knn"
    )
    return Case("pkm", label, "float32", shape, impls, inputs, diffs)


# ----------------------------------------------------------------------------------------
# Timing.


def probe(result: Any):
    """A float32 scalar that depends on every floating-point tensor of `result` (outputs,
    gradients, an `IndexedSlices`' values): the sum of each one's first element (0 for an
    empty one). Fetching it waits for all of the result's work (on a GPU, fetching the
    output alone would not wait for its gradients), and keeps every part of it from
    being pruned."""
    import tensorflow as tf

    parts = [
        tf.reduce_sum(tf.cast(tf.reshape(t, [-1])[:1], tf.float32))
        for t in tf.nest.flatten(result, expand_composites=True)
        if t.dtype.is_floating
    ]
    if not parts:
        raise ValueError("a step must return at least one floating-point tensor")
    return tf.add_n(parts)


def _per_call(fn: Callable[[Any], Any], x: Any):
    import tensorflow as tf

    return tf.function(lambda: probe(fn(x)))


def _in_graph(fn: Callable[[Any], Any], inputs: Sequence[Any]):
    """All the inputs' steps in one `tf.function`, independent of each other (each its
    own input), as a model with many tables runs them; summed at the end."""
    import tensorflow as tf

    return tf.function(lambda: tf.add_n([probe(fn(x)) for x in inputs]))


def _chained(fn: Callable[[Any], Any], x: Any, steps: int):
    """`steps` iterations of a `tf.while_loop`, each running the step on x and adding its
    probe to the loop's sum: one lookup after the other inside one call."""
    import tensorflow as tf

    return _timing.chained_steps(tf, lambda: probe(fn(x)), steps)


def _sync(result: Any) -> None:
    """Fetches a TensorFlow step's probe (torch on the CPU is done when it returns)."""
    if hasattr(result, "numpy") and not hasattr(result, "detach"):
        result.numpy()


def time_steps(steps: Mapping[str, Callable[[], Any]], opts, errors: Dict[str, str]) -> Dict:
    """name -> {"median_ms", "min_ms", "repeats"} of the steps, timed in alternation
    (`_timing.time_alternating`) after one trial call of each. A step whose trial call
    raises (out of memory, say) is left out; `errors[name]` says why."""
    ok = {}
    for name, fn in steps.items():
        try:
            _sync(fn())
            ok[name] = fn
        except Exception as e:  # noqa: BLE001 -- reported in the table
            errors[name] = _timing.error_summary(e)
    if not ok:
        return {}
    timings = _timing.time_alternating(ok, max(0, opts.warmup - 1), opts.repeats, sync=_sync)
    return {name: t.to_json() for name, t in timings.items()}


def _scaled(timing: Optional[Dict], divisor: int) -> Optional[Dict]:
    """A timing of `divisor` steps in one call, per step."""
    if timing is None:
        return None
    return {k: v if k == "repeats" else v / divisor for k, v in timing.items()}


def _derived(row: Dict[str, Any], lookups: int, gathered_bytes: int) -> None:
    """Adds `us_per_lookup` (per measurement) and `gathered_tb_s` (the bytes of the rows
    the forward reads over its in-graph time) to a row."""
    per_lookup = {}
    for kind in MEASUREMENTS:
        if lookups and row[kind] is not None:
            per_lookup[kind] = row[kind]["median_ms"] * 1e3 / lookups
    row["lookups"] = lookups or None
    row["us_per_lookup"] = per_lookup if lookups else None
    loop = row["fwd_in_graph"]
    row["gathered_bytes"] = gathered_bytes or None
    row["gathered_tb_s"] = (
        gathered_bytes / (loop["median_ms"] * 1e-3) / 1e12 if gathered_bytes and loop else None
    )


def make_row(case: Case, impl: str, timings: Dict[str, Optional[Dict]], errors, diffs, extra=None):
    """A row of the result table (also one entry of the JSON's `results`)."""
    row = {
        "case": case.case,
        "label": case.label,
        "impl": impl,
        "dtype": case.dtype,
        "shape": case.shape,
        "baseline": impl == case.baseline,
        **{kind: timings.get(kind) for kind in MEASUREMENTS},
        "in_graph_steps": len(case.inputs),
        "max_rel_diff": diffs,
        "errors": errors,
        "timer": "wall clock",
    }
    row.update(extra or {})
    _derived(row, case.lookups, case.gathered_bytes if impl != "torch" else 0)
    return row


def time_case(case: Case, opts) -> List[Dict[str, Any]]:
    """Times the case's implementations (and torch in this process): per call forward and
    forward + backward, in graph forward and forward + backward (`--in-graph-steps`
    independent steps in one call, per step), and the chained forward."""
    x, inputs, steps = case.inputs[0], case.inputs, len(case.inputs)
    errors: Dict[str, Dict[str, str]] = {}
    timings: Dict[str, Dict[str, Optional[Dict]]] = {}

    def run(kind: str, fns: Dict[str, Callable[[], Any]], divisor: int = 1) -> None:
        failed: Dict[str, str] = {}
        got = time_steps(fns, opts, failed)
        for name in fns:
            timings.setdefault(name, {})[kind] = _scaled(got.get(name), divisor)
            if name in failed:
                errors.setdefault(name, {})[kind] = failed[name]

    run(
        "fwd",
        {i.name: _per_call(i.fwd, x) for i in case.impls} | {s.name: s.fwd for s in case.foreign},
    )
    run(
        "fwd_bwd",
        {i.name: _per_call(i.fwd_bwd, x) for i in case.impls}
        | {s.name: s.fwd_bwd for s in case.foreign},
    )
    in_graph = [
        i for i in case.impls if not (opts.baseline_per_call_only and i.name == case.baseline)
    ]
    run("fwd_in_graph", {i.name: _in_graph(i.fwd, inputs) for i in in_graph}, steps)
    run("fwd_chained", {i.name: _chained(i.fwd, x, steps) for i in in_graph}, steps)
    run("fwd_bwd_in_graph", {i.name: _in_graph(i.fwd_bwd, inputs) for i in in_graph}, steps)
    names = [i.name for i in case.impls] + [s.name for s in case.foreign]
    return [
        make_row(case, name, timings[name], errors.get(name, {}), case.diffs[name])
        for name in names
    ]


# ----------------------------------------------------------------------------------------
# torch in a child process.


def torch_child(cases: Sequence[Mapping[str, Any]], device: str, opts) -> Dict[str, Any]:
    """Runs `tf_ttemb/_bench_torch.py` in a fresh interpreter (it never imports TensorFlow)
    on the cases and returns its result (`_bench_torch.measure`), or `{"ok": False,
    "error": ...}` with the tail of its output when it failed."""
    spec = _bench_torch.worker_spec(cases, device, opts.warmup, opts.repeats, opts.threads)
    # PYTHONSAFEPATH: the script's folder, the package's, is not put on sys.path, where
    # its modules (tt, serving, ...) could shadow what torch imports.
    return _timing.run_worker(os.path.abspath(_bench_torch.__file__), spec, {"PYTHONSAFEPATH": "1"})


def torch_child_row(case: Case, entry: Mapping[str, Any], timer: str) -> Dict[str, Any]:
    """The torch row of a case from a child's result entry: its times, and its first bags
    compared with the baseline's (`max_rel_diff` over those bags' output and, for
    fwd+bwd, weights gradient)."""
    diffs = {
        kind: max_rel_diff(entry["check"][kind], case.torch_check[kind])
        for kind in ("fwd", "fwd_bwd")
        if kind in entry.get("check", {})
    }
    timings = {kind: entry.get(kind) for kind in ("fwd", "fwd_bwd")}
    return make_row(case, "torch", timings, dict(entry.get("errors", {})), diffs, {"timer": timer})
