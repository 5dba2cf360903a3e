"""GatherReduceSumSparseApply: the gather_reduce_sum backward with the optimizer fused in.

`tf_ttemb.ops.sparse_apply.gather_reduce_sum_sparse_apply` looks rows up like
`gather_reduce_sum`; a gradient through it applies SGD, row-wise Adagrad or Adagrad to
the rows read, in place. Checked against an independent float64 numpy reference of
"gradient, then update" (`reference.params_grad` + the update rule written here), for
every dtype, both index dtypes, every combiner with and without weights, padding, empty
bags and duplicate ids, on the inline and the multithreaded kernel paths; and every
error message of the op and the wrapper.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import reference
import tensorflow as tf
from bags import (
    COMBINER_WEIGHTING,
    assert_close,
    combiner_id,
    make_bags,
    make_inputs,
    make_params,
    quantize,
    ragged_bags,
    weights_like,
)

from tf_ttemb.ops import _loader
from tf_ttemb.ops.sparse_apply import gather_reduce_sum_sparse_apply

DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64]
OPTIMIZERS = ["sgd", "rowwise_adagrad", "adagrad"]


def _acc_dtype(dtype):
    return tf.float64 if dtype == tf.float64 else tf.float32


def reference_update(params64, dparams64, gscale64, rows, optimizer, lr, eps, acc64):
    """float64 "gradient then update" of `rows`; returns (params, accumulator, scale).

    `scale` bounds the magnitude of the terms of each updated element, for tolerances.
    """
    params = params64.copy()
    scale = np.abs(params64).copy()
    acc = None if acc64 is None else acc64.copy()
    for r in rows:
        g = dparams64[r]
        if optimizer == "sgd":
            params[r] = params64[r] - lr * g
            scale[r] += abs(lr) * gscale64[r]
            continue
        if optimizer == "rowwise_adagrad":
            acc[r] += np.mean(g * g)
            denominator = np.sqrt(acc[r]) + eps
        else:
            acc[r] += g * g
            denominator = np.sqrt(acc[r]) + eps
        params[r] = params64[r] - lr * g / denominator
        scale[r] += abs(lr) * gscale64[r] / denominator
    return params, acc, scale


def make_accumulator(rng, optimizer, num_rows, dim, dtype):
    """A random positive accumulator variable (None for SGD) and its float64 value."""
    if optimizer == "sgd":
        return None, None
    shape = (num_rows,) if optimizer == "rowwise_adagrad" else (num_rows, dim)
    t, acc64 = quantize(rng.uniform(0.05, 2.0, size=shape), _acc_dtype(dtype))
    return tf.Variable(t), acc64


def run_step(variable, bags, weights, upstream, use_function=False, **update):
    """One gradient through the lookup (which updates `variable`); returns (out, dw, trig).

    `update`: the other arguments of gather_reduce_sum_sparse_apply (optimizer,
    learning_rate, accumulator, epsilon, combiner, padding_id)."""
    trigger = tf.Variable(tf.zeros([0], tf.float32))

    def step():
        with tf.GradientTape() as tape:
            if weights is not None:
                tape.watch(weights)
            w = None if weights is None else weights_like(bags.ids, weights)
            out = gather_reduce_sum_sparse_apply(variable, bags.ids, w, trigger=trigger, **update)
        sources = [trigger] + ([weights] if weights is not None else [])
        grads = tape.gradient(out, sources, output_gradients=upstream)
        return out, grads

    if use_function:
        step = tf.function(step)
    out, grads = step()
    return out, (grads[1] if weights is not None else None), grads[0]


def check_against_reference(
    rng, bags, num_rows, dim, dtype, optimizer, combiner, weighted, padding_id, use_function=False
):
    (params, params64), (weights, weights64), (upstream, upstream64) = make_inputs(
        rng, bags, num_rows, dim, dtype, combiner, weighted
    )
    variable = tf.Variable(params)
    accumulator, acc64 = make_accumulator(rng, optimizer, num_rows, dim, dtype)
    lr = float(rng.uniform(0.05, 0.5))
    eps = float(rng.uniform(1e-3, 1e-1))
    lr_acc = float(tf.cast(tf.constant(lr, _acc_dtype(dtype)), tf.float64))
    eps_acc = float(tf.cast(tf.constant(eps, _acc_dtype(dtype)), tf.float64))

    out, dw, trigger_grad = run_step(
        variable,
        bags,
        weights,
        upstream,
        use_function,
        optimizer=optimizer,
        learning_rate=lr,
        accumulator=accumulator,
        epsilon=eps,
        combiner=combiner,
        padding_id=padding_id,
    )

    out_want, out_scale = reference.forward(
        params64, bags.flat_ids, bags.splits, weights64, combiner, padding_id
    )
    assert_close(
        tf.cast(out, tf.float64).numpy().reshape(out_want.shape),
        out_want,
        out_scale,
        dtype,
        "output",
    )
    dparams, gscale = reference.params_grad(
        params64, bags.flat_ids, bags.splits, upstream64, weights64, combiner, padding_id
    )
    rows = reference.touched_rows(bags.flat_ids, padding_id)
    want, acc_want, scale = reference_update(
        params64, dparams, gscale, rows, optimizer, lr_acc, eps_acc, acc64
    )
    got = tf.cast(variable, tf.float64).numpy()
    assert_close(got, want, scale, dtype, "updated params")
    untouched = np.setdiff1d(np.arange(num_rows), rows)
    np.testing.assert_array_equal(got[untouched], params64[untouched])
    if accumulator is not None:
        acc_got = tf.cast(accumulator, tf.float64).numpy()
        # Terms of an accumulator: its old value plus the squares of the gradient's terms.
        acc_scale = acc64 + (
            np.mean(gscale**2, axis=1) if optimizer == "rowwise_adagrad" else gscale**2
        )
        assert_close(acc_got, acc_want, acc_scale, dtype, "accumulator")
        np.testing.assert_array_equal(acc_got[untouched], acc64[untouched])
    assert tuple(trigger_grad.shape) == (0,)
    if weighted:
        dw_want, dw_scale = reference.weights_grad(
            params64, bags.flat_ids, bags.splits, weights64, upstream64, combiner, padding_id
        )
        dw_got = bags.csr_from_values(tf.cast(dw, tf.float64).numpy())
        assert_close(dw_got, dw_want, dw_scale, dtype, "weights gradient")


@pytest.mark.parametrize("ids_dtype", [tf.int32, tf.int64], ids=lambda d: d.name)
@pytest.mark.parametrize("padding_id", [None, 3], ids=["no_padding", "padding"])
@pytest.mark.parametrize("combiner_weighted", COMBINER_WEIGHTING, ids=combiner_id)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_matches_gradient_then_update(
    rng, dtype, optimizer, combiner_weighted, padding_id, ids_dtype
):
    combiner, weighted = combiner_weighted
    # 11 rows for ~25 entries: duplicate ids within and across bags; an empty bag.
    bags = make_bags(rng, "ragged", 11, ids_dtype, padding_id=padding_id, num_bags=7)
    check_against_reference(rng, bags, 11, 5, dtype, optimizer, combiner, weighted, padding_id)


@pytest.mark.parametrize("form", ["dense2d", "dense3d", "sparse"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_input_forms_in_a_function(rng, form, optimizer):
    bags = make_bags(rng, form, 13, tf.int64, padding_id=2)
    check_against_reference(
        rng, bags, 13, 3, tf.float64, optimizer, "mean", True, 2, use_function=True
    )


@pytest.mark.parametrize(
    "combiner_weighted", [("sum", True), ("sqrtn", True), ("max", False)], ids=combiner_id
)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("dtype", [tf.float32, tf.float64], ids=lambda d: d.name)
def test_multithreaded_path(rng, dtype, optimizer, combiner_weighted):
    # (entries + rows) * dim well above the kernel's inline threshold: the pool is used.
    combiner, weighted = combiner_weighted
    num_rows, dim = 257 if combiner == "max" else 600, 67
    lengths = rng.integers(0, 40, size=120)
    bags = ragged_bags(rng, lengths, num_rows, tf.int32, padding_id=5)
    check_against_reference(rng, bags, num_rows, dim, dtype, optimizer, combiner, weighted, 5)


def test_all_padding_and_empty_batch_leave_the_table(rng):
    params, _ = make_params(rng, 6, 4, tf.float32)
    for ids in (
        tf.ragged.constant([[1, 1], [], [1]], dtype=tf.int64),
        tf.ragged.constant([], dtype=tf.int64, ragged_rank=1),
    ):
        variable = tf.Variable(params)
        accumulator = tf.Variable(rng.uniform(0.1, 1.0, size=6).astype(np.float32))
        trigger = tf.Variable(tf.zeros([0]))
        with tf.GradientTape() as tape:
            out = gather_reduce_sum_sparse_apply(
                variable,
                ids,
                trigger=trigger,
                optimizer="rowwise_adagrad",
                accumulator=accumulator,
                learning_rate=0.3,
                padding_id=1,
            )
        upstream = tf.constant(rng.normal(size=out.shape), tf.float32)
        tape.gradient(out, trigger, output_gradients=upstream)
        np.testing.assert_array_equal(variable.numpy(), params.numpy())
        np.testing.assert_array_equal(out.numpy(), np.zeros(out.shape, np.float32))


def test_deterministic_across_runs(rng):
    num_rows, dim = 300, 33
    lengths = rng.integers(0, 60, size=90)
    bags = ragged_bags(rng, lengths, num_rows, tf.int64)
    combiner = "sqrtn"
    (params, _), (weights, _), (upstream, _) = make_inputs(
        rng, bags, num_rows, dim, tf.float32, combiner, weighted=True
    )
    results = []
    for _ in range(3):
        variable = tf.Variable(params)
        accumulator = tf.Variable(tf.fill([num_rows, dim], 0.5))
        update = dict(optimizer="adagrad", learning_rate=0.1, epsilon=1e-3, combiner=combiner)
        _, dw, _ = run_step(variable, bags, weights, upstream, accumulator=accumulator, **update)
        results.append((variable.numpy(), accumulator.numpy(), dw.numpy()))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)


def test_zero_denominator_leaves_row(rng):
    # epsilon 0 and a zero accumulator: a row whose gradient is 0 stays as it was.
    variable = tf.Variable(rng.normal(size=(4, 3)).astype(np.float32))
    before = variable.numpy()
    accumulator = tf.Variable(tf.zeros([4]))
    trigger = tf.Variable(tf.zeros([0]))
    ids = tf.constant([[0, 2]])
    weights = tf.constant([[1.5, 0.0]])
    with tf.GradientTape() as tape:
        out = gather_reduce_sum_sparse_apply(
            variable,
            ids,
            weights,
            trigger=trigger,
            optimizer="rowwise_adagrad",
            accumulator=accumulator,
            learning_rate=0.5,
            epsilon=0.0,
        )
    upstream = tf.constant(rng.normal(size=(1, 3)), tf.float32)
    tape.gradient(out, trigger, output_gradients=upstream)
    after = variable.numpy()
    assert np.all(np.isfinite(after))
    np.testing.assert_array_equal(after[2], before[2])
    g = 1.5 * upstream.numpy()[0]
    np.testing.assert_allclose(after[0], before[0] - 0.5 * g / np.sqrt(np.mean(g * g)), rtol=1e-5)


def test_shared_buffer_is_not_written(rng):
    # A tensor read from the variable before the update keeps the old values.
    variable = tf.Variable(rng.normal(size=(5, 2)).astype(np.float32))
    before = variable.read_value()
    kept = before.numpy().copy()
    trigger = tf.Variable(tf.zeros([0]))
    with tf.GradientTape() as tape:
        out = gather_reduce_sum_sparse_apply(
            variable, tf.constant([[1, 4]]), trigger=trigger, learning_rate=0.25
        )
    tape.gradient(out, trigger, output_gradients=tf.ones_like(out) * 2.0)
    np.testing.assert_array_equal(before.numpy(), kept)
    assert not np.array_equal(variable.numpy(), kept)


# ----------------------------------------------------------------------------------------
# Error paths of the raw op.


@pytest.fixture(scope="module")
def lib():
    return _loader.load_op_library()


def call_op(
    lib,
    *,
    params=None,
    indices=(0, 1, 2),
    row_splits=(0, 1, 3),
    weights=None,
    grad=None,
    output=None,
    argmax=None,
    lr=0.1,
    eps=1e-3,
    accumulators=(),
    optimizer="sgd",
    combiner="sum",
    padding_id=None,
    acc_dtype=tf.float32,
    num_accumulators=None,
    dtype=tf.float32,
    rng=None,
):
    if params is None:
        params = tf.Variable(rng.normal(size=(8, 3)), dtype=dtype)
    num_bags = len(row_splits) - 1
    dim = 3
    if grad is None:
        grad = tf.constant(rng.normal(size=(num_bags, dim)), dtype)
    if output is None:
        output = tf.constant(rng.normal(size=(num_bags, dim)), dtype)
    if argmax is None:
        argmax = tf.zeros([num_bags if combiner == "max" else 0, dim], tf.int32)
    has_weights = weights is not None
    attrs = dict(
        combiner=combiner,
        has_weights=has_weights,
        padding_id=-1 if padding_id is None else padding_id,
        has_padding_id=padding_id is not None,
    )
    if num_accumulators is not None:  # an inconsistent count: build the node by hand
        accumulators = list(accumulators)
        assert len(accumulators) == num_accumulators
    return lib.tf_ttemb_gather_reduce_sum_sparse_apply(
        grad=grad,
        params=params.handle,
        indices=tf.constant(indices, tf.int64),
        row_splits=tf.constant(row_splits, tf.int64),
        weights=tf.constant(weights if has_weights else [], dtype),
        output=output,
        argmax=argmax,
        learning_rate=tf.constant(lr, acc_dtype),
        epsilon=tf.constant(eps, acc_dtype),
        accumulators=[a.handle for a in accumulators],
        optimizer=optimizer,
        **attrs,
    )


def raises(message):
    return pytest.raises(tf.errors.InvalidArgumentError, match=re.escape(message))


@pytest.mark.parametrize(
    "row_splits,message",
    [
        ((3, 1, 3), "row_splits[0] = 3 must be 0"),
        ((0, 2, 1, 3), "row_splits must be non-decreasing: row_splits[2] = 1 < row_splits[1] = 2"),
        ((0, 1, 2), "row_splits[2] = 2 must equal the number of indices (3)"),
    ],
    ids=["first", "decreasing", "last"],
)
def test_op_row_splits_errors(lib, rng, row_splits, message):
    with raises(message):
        call_op(lib, row_splits=row_splits, rng=rng)


@pytest.mark.parametrize("padding_id", [None, 6])
def test_op_bad_ids_raise_and_leave_the_table(lib, rng, padding_id):
    params = tf.Variable(rng.normal(size=(4096, 3)), dtype=tf.float32)
    before = params.numpy()
    message = "indices[3] = 9001 is not in [0, 4096)"
    if padding_id is not None:
        message += " and is not padding_id (6)"
    with raises(message):
        call_op(
            lib,
            params=params,
            indices=(0, 6, 2, 9001, 1),
            row_splits=(0, 2, 5),
            padding_id=padding_id,
            rng=rng,
        )
    with raises("indices[1] = -2 is not in [0, 4096)"):
        call_op(lib, params=params, indices=(0, -2), row_splits=(0, 2), rng=rng)
    np.testing.assert_array_equal(params.numpy(), before)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_op_reads_ids_and_weights_of_any_shape_flat(lib, rng, optimizer):
    # As the lookup ops: 2-D ids and weights give the flat inputs' update and weights
    # gradient, bit for bit, the gradient in the weights' shape.
    ids = rng.integers(0, 8, size=(2, 6))
    weights = rng.uniform(0.5, 1.5, size=(2, 6))
    table = rng.normal(size=(8, 3))
    grad = tf.constant(rng.normal(size=(3, 3)), tf.float32)
    output = tf.constant(rng.normal(size=(3, 3)), tf.float32)
    results = []
    for shape in ((2, 6), (12,)):
        params = tf.Variable(table, dtype=tf.float32)
        accumulators = [tf.Variable(tf.fill([8], 0.1))] if optimizer != "sgd" else []
        dw = call_op(
            lib,
            params=params,
            indices=ids.reshape(shape),
            row_splits=(0, 5, 5, 12),
            weights=weights.reshape(shape),
            grad=grad,
            output=output,
            accumulators=accumulators,
            optimizer=optimizer,
            rng=rng,
        )
        assert tuple(dw.shape) == shape
        results.append((params.numpy(), dw.numpy().reshape(-1)))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])
    assert not np.array_equal(results[0][0], table)  # the rows moved


def test_op_shape_errors(lib, rng):
    with raises("weights has 2 entries but indices has 3"):
        call_op(lib, weights=[0.5, 1.0], rng=rng)
    with raises("grad must have shape [2,3], got [2,4]"):
        call_op(lib, grad=tf.zeros([2, 4]), rng=rng)
    with raises("output must have shape [2,3], got [3,3]"):
        call_op(lib, output=tf.zeros([3, 3]), rng=rng)
    with raises("argmax must have shape [2, 3], got [2,2]"):
        call_op(lib, combiner="max", argmax=tf.zeros([2, 2], tf.int32), rng=rng)
    with raises("argmax must have shape [0, 3], got [2,3]"):
        call_op(lib, argmax=tf.zeros([2, 3], tf.int32), rng=rng)
    with raises("params must be a matrix [N, D], got shape [8]"):
        call_op(lib, params=tf.Variable(rng.normal(size=8), dtype=tf.float32), rng=rng)


def test_op_scalar_errors(lib, rng):
    with raises("learning_rate = nan must be finite"):
        call_op(lib, lr=float("nan"), rng=rng)
    with raises("learning_rate = inf must be finite"):
        call_op(lib, lr=float("inf"), rng=rng)
    with raises("epsilon = -0.5 must be finite and >= 0"):
        call_op(lib, eps=-0.5, rng=rng)
    for learning_rate, epsilon, message in (
        ([0.1], 0.1, "learning_rate must be a scalar, got shape [1]"),
        (0.1, [0.1, 0.2], "epsilon must be a scalar, got shape [2]"),
    ):
        with raises(message):
            lib.tf_ttemb_gather_reduce_sum_sparse_apply(
                grad=tf.zeros([1, 3]),
                params=tf.Variable(tf.zeros([4, 3])).handle,
                indices=tf.constant([0], tf.int64),
                row_splits=tf.constant([0, 1], tf.int64),
                weights=tf.zeros([0]),
                output=tf.zeros([1, 3]),
                argmax=tf.zeros([0, 3], tf.int32),
                learning_rate=tf.constant(learning_rate),
                epsilon=tf.constant(epsilon),
                accumulators=[],
            )


def test_op_attr_errors(lib, rng):
    accumulator = tf.Variable(tf.zeros([8]))
    with raises("optimizer 'sgd' takes 0 accumulator variable(s), got 1"):
        call_op(lib, accumulators=[accumulator], rng=rng)
    with raises("optimizer 'adagrad' takes 1 accumulator variable(s), got 0"):
        call_op(lib, optimizer="adagrad", rng=rng)
    with raises(
        "learning_rate, epsilon and the accumulator must be float for params of type "
        "float, got double"
    ):
        call_op(lib, acc_dtype=tf.float64, rng=rng)
    with raises(
        "learning_rate, epsilon and the accumulator must be double for params of type "
        "double, got float"
    ):
        call_op(lib, dtype=tf.float64, rng=rng)
    with raises("combiner 'max' does not take weights"):
        call_op(lib, combiner="max", weights=[1.0, 2.0, 3.0], rng=rng)
    with pytest.raises((tf.errors.InvalidArgumentError, TypeError, ValueError), match="optimizer"):
        call_op(lib, optimizer="adam", rng=rng)


def test_op_variable_errors(lib, rng):
    params = tf.Variable(rng.normal(size=(8, 3)), dtype=tf.float32)
    with raises("params variable has dtype double but the op expects float"):
        call_op(lib, params=tf.Variable(tf.zeros([8, 3], tf.float64)), rng=rng)
    with raises("accumulator variable has dtype double but the op expects float"):
        call_op(
            lib,
            optimizer="rowwise_adagrad",
            accumulators=[tf.Variable(tf.zeros([8], tf.float64))],
            rng=rng,
        )
    with raises(
        "accumulator must have shape [8] for optimizer 'rowwise_adagrad' and params of "
        "shape [8,3], got [8,3]"
    ):
        call_op(
            lib, optimizer="rowwise_adagrad", accumulators=[tf.Variable(tf.zeros([8, 3]))], rng=rng
        )
    with raises(
        "accumulator must have shape [8,3] for optimizer 'adagrad' and params of shape "
        "[8,3], got [8]"
    ):
        call_op(lib, optimizer="adagrad", accumulators=[tf.Variable(tf.zeros([8]))], rng=rng)
    same = tf.Variable(tf.zeros([8, 3]))
    with raises("the accumulator must be another variable than params"):
        call_op(lib, params=same, optimizer="adagrad", accumulators=[same], rng=rng)
    del params


class _Handle:
    """A bare resource handle where call_op expects a variable."""

    def __init__(self, handle):
        self.handle = handle


@pytest.mark.parametrize("optimizer,shape", [("rowwise_adagrad", [8]), ("adagrad", [8, 3])])
def test_op_missing_accumulator_raises_and_leaves_the_table(lib, rng, optimizer, shape):
    """An accumulator handle with no variable behind it (never assigned): the op fails
    before touching params. TensorFlow's resource lookup reports it (NotFound); the
    kernel's own "not initialized" check is for a Var that exists uninitialised, which
    Python cannot build in eager mode."""
    params = tf.Variable(rng.normal(size=(8, 3)), dtype=tf.float32)
    before = params.numpy()
    never_assigned = tf.raw_ops.VarHandleOp(
        dtype=tf.float32, shape=shape, shared_name=f"never_assigned_{optimizer}"
    )
    with pytest.raises(
        (tf.errors.NotFoundError, tf.errors.FailedPreconditionError),
        match="does not exist|not initialized",
    ):
        call_op(
            lib, params=params, optimizer=optimizer, accumulators=[_Handle(never_assigned)], rng=rng
        )
    np.testing.assert_array_equal(params.numpy(), before)


# ----------------------------------------------------------------------------------------
# Wrapper errors.


def test_wrapper_errors(rng):
    variable = tf.Variable(tf.zeros([4, 2]))
    trigger = tf.zeros([0])
    ids = tf.constant([[0, 1]])
    with pytest.raises(ValueError, match="params must be a resource variable"):
        gather_reduce_sum_sparse_apply(tf.zeros([4, 2]), ids, trigger=trigger)
    with pytest.raises(ValueError, match="optimizer 'rowwise_adagrad' needs an accumulator"):
        gather_reduce_sum_sparse_apply(variable, ids, trigger=trigger, optimizer="rowwise_adagrad")
    with pytest.raises(ValueError, match="optimizer 'sgd' takes no accumulator"):
        gather_reduce_sum_sparse_apply(
            variable, ids, trigger=trigger, accumulator=tf.Variable(tf.zeros([4]))
        )
    with pytest.raises(
        ValueError, match="optimizer must be one of 'sgd', 'rowwise_adagrad', 'adagrad', got 'adam'"
    ):
        gather_reduce_sum_sparse_apply(variable, ids, trigger=trigger, optimizer="adam")
    with pytest.raises(ValueError, match=re.escape("epsilon must be >= 0, got -1.0")):
        gather_reduce_sum_sparse_apply(variable, ids, trigger=trigger, epsilon=-1.0)
    with pytest.raises(ValueError, match="combiner 'max' does not take weights"):
        gather_reduce_sum_sparse_apply(
            variable, ids, tf.ones([1, 2]), trigger=trigger, combiner="max"
        )

    @tf.function(jit_compile=True)
    def compiled():
        return gather_reduce_sum_sparse_apply(variable, ids, trigger=trigger)

    with pytest.raises(ValueError, match="has no XLA kernel"):
        compiled()


def test_wrapper_bad_accumulator_dtype_raises_in_backward(rng):
    variable = tf.Variable(rng.normal(size=(4, 2)).astype(np.float64))
    accumulator = tf.Variable(tf.zeros([4], tf.float32))
    trigger = tf.Variable(tf.zeros([0]))
    with tf.GradientTape() as tape:
        out = gather_reduce_sum_sparse_apply(
            variable,
            tf.constant([[0, 1]]),
            trigger=trigger,
            optimizer="rowwise_adagrad",
            accumulator=accumulator,
        )
    with raises("accumulator variable has dtype float but the op expects double"):
        tape.gradient(out, trigger)


def test_docstring_example_runs():
    import doctest

    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(
        gather_reduce_sum_sparse_apply, "gather_reduce_sum_sparse_apply", globs={}
    ):
        runner.run(test)
    assert runner.tries > 0 and runner.failures == 0


def test_wrapper_refuses_distribution_strategies(rng):
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        variable = tf.Variable(rng.normal(size=(4, 2)).astype(np.float32))

    def replica_fn():
        return gather_reduce_sum_sparse_apply(
            variable, tf.constant([[0, 1]]), trigger=tf.zeros([0])
        )

    with pytest.raises(ValueError, match="does not support tf.distribute strategies"):
        strategy.run(replica_fn)
