"""tf_ttemb.optimizers: LazyAdam and RowWiseAdagrad against float64 numpy references.

Sparse steps must change exactly the rows they touch (every other row of the variable
and of its state bitwise unchanged) and reach `update_step` as `tf.IndexedSlices` (no
densifying, checked on the traced graphs); dense steps are Adam / row-wise Adagrad; the
Keras options (weight decay, clipping, loss scaling, EMA, gradient accumulation),
serialization, checkpoints, mixed precision, `model.fit` and MirroredStrategy work.
"""

from __future__ import annotations

import copy
import doctest
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_ttemb
from tf_ttemb.layers import EmbeddingBag
from tf_ttemb.optimizers import LazyAdam, LossScaleOptimizer, RowWiseAdagrad

REPO_ROOT = pathlib.Path(tf_ttemb.__file__).resolve().parent.parent
TOLERANCE = {  # rtol, atol
    "float64": (1e-10, 1e-12),
    "float32": (1e-5, 1e-6),
    "float16": (1e-2, 1e-2),
    "bfloat16": (1e-2, 1e-2),
}
OPTIMIZERS = ["lazy_adam", "row_wise_adagrad"]
# The learning rate as the optimizers hold it (a float32 variable), for the references.
LR = float(np.float32(0.05))


# --------------------------------------------------------------------------------------
# float64 numpy references.
# --------------------------------------------------------------------------------------


class Reference:
    """Per-row optimizer state in float64; a scalar variable is one row."""

    def __init__(self, kind, value, weight_decay=None, **hyper):
        self.kind = kind
        self.scalar = np.ndim(value) == 0
        self.w = np.array(value, np.float64).reshape((1,) if self.scalar else np.shape(value))
        self.weight_decay = weight_decay
        self.hyper = hyper
        rows = self.w.shape[0]
        if kind == "lazy_adam":
            self.m = np.zeros_like(self.w)
            self.v = np.zeros_like(self.w)
            self.k = np.zeros(rows, np.int64)
        else:
            init = hyper.get("initial_accumulator_value", 0.0)
            self.a = np.full(rows, init, np.float64)

    def sparse(self, lr, indices, values):
        rows, inverse = np.unique(np.asarray(indices), return_inverse=True)
        grad = np.zeros((len(rows),) + self.w.shape[1:])
        np.add.at(grad, inverse.reshape(-1), np.asarray(values, np.float64))
        self._rows(lr, rows, grad)

    def dense(self, lr, gradient):
        grad = np.asarray(gradient, np.float64).reshape(self.w.shape)
        self._rows(lr, np.arange(self.w.shape[0]), grad)

    def _rows(self, lr, rows, g):
        w = self.w[rows]
        if self.weight_decay is not None:
            w = w - w * self.weight_decay * lr
        per_row = (len(rows),) + (1,) * (self.w.ndim - 1)
        if self.kind == "lazy_adam":
            b1, b2, eps = self.hyper["beta_1"], self.hyper["beta_2"], self.hyper["epsilon"]
            self.k[rows] += 1
            k = self.k[rows].astype(np.float64)
            m = b1 * self.m[rows] + (1 - b1) * g
            v = b2 * self.v[rows] + (1 - b2) * g * g
            alpha = (lr * np.sqrt(1 - b2**k) / (1 - b1**k)).reshape(per_row)
            self.w[rows] = w - alpha * m / (np.sqrt(v) + eps)
            self.m[rows], self.v[rows] = m, v
        else:
            eps = self.hyper["epsilon"]
            mean_square = (g * g).reshape(len(rows), -1).mean(axis=1)
            self.a[rows] += mean_square
            scale = (lr / (np.sqrt(self.a[rows]) + eps)).reshape(per_row)
            self.w[rows] = w - scale * g

    def state(self):
        shape = () if self.scalar else self.w.shape
        if self.kind == "lazy_adam":
            row_shape = () if self.scalar else self.k.shape
            return {
                "w": self.w.reshape(shape),
                "m": self.m.reshape(shape),
                "v": self.v.reshape(shape),
                "k": self.k.reshape(row_shape),
            }
        return {"w": self.w.reshape(shape), "a": self.a.reshape(() if self.scalar else -1)}


HYPER = {
    "lazy_adam": {"beta_1": 0.8, "beta_2": 0.95, "epsilon": 1e-3},
    "row_wise_adagrad": {"initial_accumulator_value": 0.1, "epsilon": 1e-3},
}


def make_optimizer(kind, learning_rate=0.05, **kwargs):
    cls = LazyAdam if kind == "lazy_adam" else RowWiseAdagrad
    return cls(learning_rate=learning_rate, **{**HYPER[kind], **kwargs})


def state_of(optimizer, variable):
    """The optimizer's state for `variable` (and its value) as float64 numpy arrays."""
    index = optimizer._get_variable_index(variable)
    out = {"w": np.asarray(tf.cast(variable, tf.float64))}
    if isinstance(optimizer, LazyAdam):
        out["m"] = optimizer._momentums[index].numpy().astype(np.float64)
        out["v"] = optimizer._velocities[index].numpy().astype(np.float64)
        out["k"] = optimizer._row_steps[index].numpy()
    else:
        out["a"] = optimizer._accumulators[index].numpy().astype(np.float64)
    return out


def raw_state(optimizer, variable):
    """The same, in the stored dtypes (for bitwise comparisons)."""
    index = optimizer._get_variable_index(variable)
    out = {"w": variable.numpy()}
    if isinstance(optimizer, LazyAdam):
        out.update(
            m=optimizer._momentums[index].numpy(),
            v=optimizer._velocities[index].numpy(),
            k=optimizer._row_steps[index].numpy(),
        )
    else:
        out["a"] = optimizer._accumulators[index].numpy()
    return out


def assert_state_close(got, want, dtype):
    rtol, atol = TOLERANCE[dtype]
    for key in want:
        if key == "k":
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        else:
            np.testing.assert_allclose(got[key], want[key], rtol=rtol, atol=atol, err_msg=key)


def assert_rows_unchanged(before, after, touched):
    """Every state array of `after` equals `before` bitwise outside the `touched` rows."""
    for key, old in before.items():
        if old.ndim == 0:
            continue
        keep = np.ones(old.shape[0], bool)
        keep[np.asarray(touched, np.int64)] = False
        np.testing.assert_array_equal(after[key][keep], old[keep], err_msg=key)


def random_slices(rng, num_rows, row_shape, dtype, max_entries=12, sorted_unique=False):
    """A random IndexedSlices gradient with a repeated row, or with strictly increasing
    rows (as `gather_reduce_sum` gives, which skips deduplication)."""
    count = int(rng.integers(1, max_entries + 1))
    if sorted_unique:
        indices = np.sort(rng.choice(num_rows, size=count, replace=False))
    else:
        indices = rng.integers(0, num_rows, size=count)
        indices[-1] = indices[0]
    values = rng.normal(size=(count,) + tuple(row_shape))
    slices = tf.IndexedSlices(
        tf.constant(values, dtype),
        tf.constant(indices, tf.int64),
        tf.constant([num_rows] + list(row_shape), tf.int64),
    )
    return slices, indices, values


class Recorder:
    """Wraps `update_step` of an optimizer instance to record the gradient types it gets."""

    def __init__(self, optimizer):
        self.types = []
        inner = (
            optimizer.inner_optimizer
            if isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
            else optimizer
        )
        original = inner.update_step

        def update_step(gradient, variable, learning_rate):
            self.types.append((variable.name, type(gradient).__name__))
            return original(gradient, variable, learning_rate)

        inner.update_step = update_step

    def kinds_for(self, name_part):
        return {kind for name, kind in self.types if name_part in name}


@pytest.fixture
def global_policy():
    previous = keras.config.dtype_policy()
    yield keras.config.set_dtype_policy
    keras.config.set_dtype_policy(previous)


# --------------------------------------------------------------------------------------
# Update rules.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "row_shape,in_function",
    [((), False), ((5,), False), ((5,), True), ((3, 2), False)],
    ids=["rank1", "rank2", "rank2-function", "rank3"],
)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_sparse_steps_match_reference(rng, kind, dtype, row_shape, in_function):
    num_rows = 40
    init = rng.normal(size=(num_rows,) + row_shape)
    variable = tf.Variable(init.astype(dtype))
    optimizer = make_optimizer(kind)
    optimizer.build([variable])
    reference = Reference(kind, init, **HYPER[kind])

    def apply(gradient):
        optimizer.apply([gradient], [variable])

    if in_function:
        apply = tf.function(apply)
    for step in range(5):
        slices, indices, values = random_slices(
            rng, num_rows, row_shape, dtype, sorted_unique=step % 2 == 1
        )
        before = raw_state(optimizer, variable)
        apply(slices)
        reference.sparse(LR, indices, values)
        assert_rows_unchanged(before, raw_state(optimizer, variable), indices)
        assert_state_close(state_of(optimizer, variable), reference.state(), dtype)
    assert int(optimizer.iterations) == 5


@pytest.mark.parametrize(
    "shape", [(), (7,), (6, 4), (5, 3, 2)], ids=["scalar", "rank1", "rank2", "rank3"]
)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_dense_steps_match_reference(rng, kind, dtype, shape):
    init = rng.normal(size=shape)
    variable = tf.Variable(np.asarray(init, dtype))
    optimizer = make_optimizer(kind)
    reference = Reference(kind, init, **HYPER[kind])
    for _ in range(3):
        gradient = rng.normal(size=shape)
        optimizer.apply([tf.constant(gradient, dtype)], [variable])
        reference.dense(LR, gradient)
        assert_state_close(state_of(optimizer, variable), reference.state(), dtype)
    if kind == "row_wise_adagrad":  # one accumulator per row, one per element of rank 1
        assert tuple(optimizer._accumulators[0].shape) == shape[:1]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_lazy_adam_dense_is_keras_adam(rng, dtype):
    init = rng.normal(size=(8, 5)).astype(dtype)
    ours, theirs = tf.Variable(init), tf.Variable(init)
    lazy = LazyAdam(learning_rate=0.01, weight_decay=0.1)
    adam = keras.optimizers.Adam(learning_rate=0.01, weight_decay=0.1)
    for _ in range(4):
        gradient = tf.constant(rng.normal(size=init.shape), dtype)
        lazy.apply([gradient], [ours])
        adam.apply([gradient], [theirs])
    # Keras rounds beta_1 and beta_2 to float32 in the bias correction (even for float64
    # variables); LazyAdam does not.
    rtol = 1e-6
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=rtol, atol=rtol)
    np.testing.assert_allclose(
        lazy._momentums[0].numpy(), adam._momentums[0].numpy(), rtol=rtol, atol=rtol
    )
    np.testing.assert_array_equal(lazy._row_steps[0].numpy(), np.full(8, 4))


def _sparse_and_dense_steps(rng, kind, rows, steps, check_untouched=False, **decay):
    """Sparse steps with a dense one (step 2) among them, on the optimizer and the reference,
    whose states must agree at the end; with `check_untouched`, each sparse step must also
    leave the raw state of the rows it does not touch as it was."""
    init = rng.normal(size=(rows, 3))
    variable = tf.Variable(init)
    optimizer = make_optimizer(kind, **decay)
    if check_untouched:
        optimizer.build([variable])
    reference = Reference(kind, init, **decay, **HYPER[kind])
    for step in range(steps):
        if step == 2:
            gradient = rng.normal(size=init.shape)
            optimizer.apply([tf.constant(gradient)], [variable])
            reference.dense(LR, gradient)
        else:
            slices, indices, values = random_slices(rng, rows, (3,), "float64")
            before = raw_state(optimizer, variable) if check_untouched else None
            optimizer.apply([slices], [variable])
            reference.sparse(LR, indices, values)
            if check_untouched:
                assert_rows_unchanged(before, raw_state(optimizer, variable), indices)
    assert_state_close(state_of(optimizer, variable), reference.state(), "float64")


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_sparse_and_dense_steps_mix(rng, kind):
    """A dense step counts as a touch of every row (per-row step counts all advance)."""
    _sparse_and_dense_steps(rng, kind, 20, 5)


def test_lazy_adam_bias_correction_is_per_row():
    """A row first touched at step 51 takes Adam's first step, lr·sign(g) (epsilon = 0)."""
    variable = tf.Variable(tf.zeros([4, 2], tf.float64))
    optimizer = LazyAdam(learning_rate=0.1, epsilon=0.0)
    row0 = tf.IndexedSlices(tf.constant([[1.0, -2.0]], tf.float64), tf.constant([0]))
    for _ in range(50):
        optimizer.apply([row0], [variable])
    late = tf.IndexedSlices(tf.constant([[3.0, -0.5]], tf.float64), tf.constant([2]))
    optimizer.apply([late], [variable])
    np.testing.assert_allclose(variable.numpy()[2], [-0.1, 0.1], rtol=1e-7)  # lr in float32
    np.testing.assert_array_equal(optimizer._row_steps[0].numpy(), [50, 0, 1, 0])


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_empty_gradient_changes_nothing(rng, kind):
    variable = tf.Variable(rng.normal(size=(10, 3)).astype(np.float32))
    optimizer = make_optimizer(kind)
    optimizer.apply([random_slices(rng, 10, (3,), "float32")[0]], [variable])
    before = raw_state(optimizer, variable)
    empty = tf.IndexedSlices(
        tf.zeros([0, 3]), tf.zeros([0], tf.int64), tf.constant([10, 3], tf.int64)
    )
    tf.function(lambda g: optimizer.apply([g], [variable]))(empty)
    optimizer.apply([empty], [variable])
    after = raw_state(optimizer, variable)
    for key in before:
        np.testing.assert_array_equal(after[key], before[key], err_msg=key)
    assert int(optimizer.iterations) == 3


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_half_precision_variable(rng, kind, dtype):
    """Half variables keep float32 state and compute in float32."""
    init = rng.normal(size=(12, 4))
    variable = tf.Variable(tf.cast(init, dtype))
    reference = Reference(kind, np.asarray(variable.numpy(), np.float64), **HYPER[kind])
    optimizer = make_optimizer(kind)
    for step in range(3):
        if step == 1:
            gradient = rng.normal(size=init.shape)
            optimizer.apply([tf.cast(gradient, dtype)], [variable])
            reference.dense(LR, tf.cast(tf.cast(gradient, dtype), tf.float64).numpy())
        else:
            slices, indices, _ = random_slices(rng, 12, (4,), dtype)
            optimizer.apply([slices], [variable])
            reference.sparse(LR, indices, tf.cast(slices.values, tf.float64).numpy())
    assert all(v.dtype in ("float32", "int32", "int64") for v in optimizer.variables)
    got, want = state_of(optimizer, variable), reference.state()
    rtol, atol = TOLERANCE[dtype]
    np.testing.assert_allclose(got["w"], want["w"], rtol=rtol, atol=atol)


def test_out_of_range_row_raises():
    variable = tf.Variable(tf.zeros([5, 2]))
    slices = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([7]))
    with pytest.raises(
        tf.errors.InvalidArgumentError, match=r"indices\[0\] = 7 is not in \[0, 5\)"
    ):
        LazyAdam().apply([slices], [variable])


# --------------------------------------------------------------------------------------
# Sparse stays sparse.
# --------------------------------------------------------------------------------------


def _all_ops(graph):
    yield from graph.get_operations()
    for function in getattr(graph, "_functions", {}).values():
        yield from _all_ops(function.graph)


def assert_no_full_table_tensor(function, num_rows):
    """No op of the traced step (nested branches included) makes a [num_rows, ...] tensor."""
    big = []
    for op in _all_ops(function.get_concrete_function().graph):
        for output in op.outputs:
            shape = output.shape
            if shape.rank and shape.rank >= 1 and shape[0] is not None and shape[0] >= num_rows:
                big.append(f"{op.type} {op.name} {shape}")
    assert not big, "dense table-sized tensors in a sparse step:\n" + "\n".join(big)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"weight_decay": 0.1},
        {"global_clipnorm": 1.0},
        {"clipnorm": 1.0},
        {"clipvalue": 0.1},
        {"loss_scale_factor": 8.0},
        {"lso": True},
    ],
    ids=lambda o: "-".join(o) or "plain",
)
@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_sparse_step_never_densifies(rng, kind, options):
    num_rows = 4096
    table = tf.Variable(rng.normal(size=(num_rows, 8)).astype(np.float32), name="table")
    bias = tf.Variable(tf.zeros([3]), name="bias")
    options = dict(options)
    optimizer = make_optimizer(kind, **{k: v for k, v in options.items() if k != "lso"})
    if options.get("lso"):
        optimizer = LossScaleOptimizer(optimizer)
    recorder = Recorder(optimizer)
    ids = tf.constant([[5, 9, 9], [4000, 5, 17]], tf.int64)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            out = tf_ttemb.gather_reduce_sum(table, ids)
            loss = tf.reduce_sum(out * out) + tf.reduce_sum(bias * bias)
            loss = optimizer.scale_loss(loss)
        optimizer.apply(tape.gradient(loss, [table, bias]), [table, bias])

    optimizer.build([table, bias])
    before = raw_state(optimizer.inner_optimizer if options.get("lso") else optimizer, table)
    step()
    assert_no_full_table_tensor(step, num_rows)
    assert recorder.kinds_for(table.name) == {"IndexedSlices"}
    inner = optimizer.inner_optimizer if options.get("lso") else optimizer
    assert_rows_unchanged(before, raw_state(inner, table), [4, 5, 9, 17, 4000])
    assert not np.array_equal(table.numpy()[5], before["w"][5])


def test_keras_loss_scale_optimizer_densifies_its_check_and_ours_does_not(rng):
    """Keras' finiteness check converts the IndexedSlices to a dense tensor; ours does not."""
    table = tf.Variable(tf.zeros([4096, 8]))

    def step_with(optimizer):
        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = optimizer.scale_loss(tf.reduce_sum(tf.gather(table, [1, 2])))
            optimizer.apply(tape.gradient(loss, [table]), [table])

        return step

    with pytest.raises(AssertionError, match="dense table-sized"):
        assert_no_full_table_tensor(
            step_with(keras.optimizers.LossScaleOptimizer(LazyAdam())), 4096
        )
    assert_no_full_table_tensor(step_with(LossScaleOptimizer(LazyAdam())), 4096)


def test_loss_scale_optimizer_skips_non_finite_sparse_steps():
    table = tf.Variable(tf.ones([6, 2]))
    optimizer = LossScaleOptimizer(LazyAdam(learning_rate=0.1), initial_scale=4.0)
    bad = tf.IndexedSlices(tf.constant([[np.inf, 1.0]]), tf.constant([3]))
    optimizer.apply([bad], [table])
    np.testing.assert_array_equal(table.numpy(), np.ones([6, 2]))
    assert float(optimizer.dynamic_scale) == 2.0
    good = tf.IndexedSlices(tf.constant([[2.0, -2.0]]), tf.constant([3]))  # scaled by 2
    optimizer.apply([good], [table])
    np.testing.assert_allclose(table.numpy()[3], [0.9, 1.1], rtol=1e-5)
    np.testing.assert_array_equal(np.delete(table.numpy(), 3, axis=0), np.ones([5, 2]))


# --------------------------------------------------------------------------------------
# Keras optimizer options.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_weight_decay_sparse_touches_only_rows_dense_all(rng, kind):
    _sparse_and_dense_steps(rng, kind, 15, 4, check_untouched=True, weight_decay=0.2)


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_exclude_from_weight_decay(kind):
    decayed, excluded = (
        tf.Variable(tf.ones([3, 2]), name="kernel"),
        tf.Variable(tf.ones([3, 2]), name="bias"),
    )
    optimizer = make_optimizer(kind, weight_decay=0.5)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    zero = tf.IndexedSlices(tf.zeros([1, 2]), tf.constant([1]))
    optimizer.apply([zero, zero], [decayed, excluded])
    np.testing.assert_allclose(decayed.numpy()[:, 0], [1.0, 1 - 0.5 * 0.05, 1.0], rtol=1e-6)
    np.testing.assert_array_equal(excluded.numpy(), np.ones([3, 2]))


@pytest.mark.parametrize(
    "clip",
    [{"clipnorm": 0.5}, {"clipvalue": 0.3}, {"global_clipnorm": 0.7}],
    ids=lambda c: next(iter(c)),
)
@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_clipping_sparse_equals_clipping_the_dense_gradient(rng, kind, clip):
    """Clipping a sparse gradient (duplicates summed first) matches clipping its dense form."""
    init = rng.normal(size=(10, 4))
    slices, _, _ = random_slices(rng, 10, (4,), "float64", max_entries=8)
    slices = tf.IndexedSlices(slices.values * 3.0, slices.indices, slices.dense_shape)
    bias_grad = tf.constant(rng.normal(size=3))
    results = []
    for gradient in (slices, tf.convert_to_tensor(slices)):
        table = tf.Variable(init, name="table")
        bias = tf.Variable(tf.zeros([3], tf.float64), name="bias")
        # A fresh state: a dense step leaves rows with a zero gradient where they are.
        optimizer = make_optimizer(kind, learning_rate=0.1, **clip)
        recorder = Recorder(optimizer)
        optimizer.apply([gradient, bias_grad], [table, bias])
        assert recorder.kinds_for(table.name) == {type(gradient).__name__}
        results.append((table.numpy(), bias.numpy()))
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_loss_scale_factor(rng, kind):
    slices, _, _ = random_slices(rng, 9, (2,), "float64")
    scaled = tf.IndexedSlices(slices.values * 64.0, slices.indices, slices.dense_shape)
    init = rng.normal(size=(9, 2))
    plain, with_scale = tf.Variable(init), tf.Variable(init)
    make_optimizer(kind).apply([slices], [plain])
    optimizer = make_optimizer(kind, loss_scale_factor=64.0)
    optimizer.apply([scaled], [with_scale])
    np.testing.assert_allclose(with_scale.numpy(), plain.numpy(), rtol=1e-12)
    assert float(optimizer.scale_loss(tf.constant(1.0))) == 64.0


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_gradient_accumulation_rejects_sparse(kind):
    table = tf.Variable(tf.ones([4, 2]), name="table")
    optimizer = make_optimizer(kind, gradient_accumulation_steps=3)
    slices = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([1]))
    name = type(optimizer).__name__
    with pytest.raises(
        ValueError,
        match=rf"{name} got tf.IndexedSlices gradients \(for 'table:0'\) with "
        r"gradient_accumulation_steps=3: Keras accumulates gradients in a dense buffer of "
        r"each variable's shape, which would update every row. Use "
        r"gradient_accumulation_steps=None \(e.g. a larger batch\) or dense gradients "
        r"\(EmbeddingBag\(dense_grad=True\)\).",
    ):
        optimizer.apply([slices], [table])


def test_gradient_accumulation_dense_is_keras(rng):
    init = rng.normal(size=(5, 3)).astype(np.float32)
    ours, theirs = tf.Variable(init), tf.Variable(init)
    lazy = LazyAdam(learning_rate=0.01, gradient_accumulation_steps=2)
    adam = keras.optimizers.Adam(learning_rate=0.01, gradient_accumulation_steps=2)
    for _ in range(4):
        gradient = tf.constant(rng.normal(size=init.shape), tf.float32)
        lazy.apply([gradient], [ours])
        adam.apply([gradient], [theirs])
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-6)
    np.testing.assert_array_equal(lazy._row_steps[0].numpy(), np.full(5, 2))


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_ema_is_keras_moving_average(rng, kind):
    variable = tf.Variable(rng.normal(size=(6, 2)))
    optimizer = make_optimizer(kind, use_ema=True, ema_momentum=0.7)
    average = None
    for _ in range(3):
        optimizer.apply([random_slices(rng, 6, (2,), "float64")[0]], [variable])
        value = variable.numpy()
        average = value if average is None else 0.7 * average + 0.3 * value
    optimizer.finalize_variable_values([variable])
    np.testing.assert_allclose(variable.numpy(), average, rtol=1e-12)


# --------------------------------------------------------------------------------------
# Errors.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls,kwargs,message",
    [
        (LazyAdam, {"beta_1": 1.0}, "beta_1 must be a number in [0, 1), got 1.0"),
        (LazyAdam, {"beta_1": "0.9"}, "beta_1 must be a number in [0, 1), got '0.9'"),
        (LazyAdam, {"beta_2": -0.1}, "beta_2 must be a number in [0, 1), got -0.1"),
        (LazyAdam, {"epsilon": -1e-7}, "epsilon must be a number >= 0, got -1e-07"),
        (LazyAdam, {"epsilon": True}, "epsilon must be a number >= 0, got True"),
        (RowWiseAdagrad, {"epsilon": float("nan")}, "epsilon must be a number >= 0, got nan"),
        (
            RowWiseAdagrad,
            {"initial_accumulator_value": -0.5},
            "initial_accumulator_value must be a number >= 0, got -0.5",
        ),
        (
            RowWiseAdagrad,
            {"epsilon": 0, "initial_accumulator_value": 0},
            (
                "epsilon and initial_accumulator_value cannot both be 0 (a row whose first "
                "gradient is all zeros would divide 0 by 0), got epsilon=0.0 and "
                "initial_accumulator_value=0.0"
            ),
        ),
    ],
)
def test_constructor_errors(cls, kwargs, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        cls(**kwargs)


# --------------------------------------------------------------------------------------
# Serialization and checkpoints.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "optimizer",
    [
        LazyAdam(0.003, beta_1=0.5, beta_2=0.9, epsilon=1e-4, weight_decay=0.01, clipnorm=2.0),
        RowWiseAdagrad(0.2, initial_accumulator_value=0.5, epsilon=1e-6, global_clipnorm=1.0),
        LazyAdam(keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5), use_ema=True),
        LossScaleOptimizer(RowWiseAdagrad(), initial_scale=1024.0, dynamic_growth_steps=50),
    ],
    ids=["lazy_adam", "row_wise_adagrad", "schedule", "loss_scale"],
)
def test_config_round_trip(optimizer):
    config = optimizer.get_config()
    clone = type(optimizer).from_config(copy.deepcopy(config))
    assert clone.get_config() == config
    serialized = keras.optimizers.serialize(optimizer)
    assert serialized["registered_name"].startswith("tf_ttemb>")
    restored = keras.optimizers.deserialize(serialized)
    assert type(restored) is type(optimizer)
    assert restored.get_config() == config


def _train_model(kind, steps, seed=0, optimizer=None, policy=None, jit=False, dense_grad=False):
    keras.utils.set_random_seed(seed)
    ids = keras.Input(shape=(None,), dtype="int64", ragged=True)
    bag = EmbeddingBag(200, 4, combiner="mean", dense_grad=dense_grad, name="bag")(ids)
    model = keras.Model(ids, keras.layers.Dense(1, name="head")(bag))
    model.compile(optimizer=optimizer or make_optimizer(kind), loss="mse")
    rng = np.random.default_rng(seed)
    x = tf.ragged.constant([list(rng.integers(0, 50, size=3)) for _ in range(32)], tf.int64)
    y = rng.normal(size=(32, 1)).astype(np.float32)
    if steps:
        model.fit(x, y, batch_size=8, epochs=steps // 4, shuffle=False, verbose=0)
    return model, x, y


def _optimizer_values(optimizer):
    return [v.numpy() for v in optimizer.variables]


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_fit_with_embedding_bag_is_sparse(kind):
    optimizer = make_optimizer(kind)
    recorder = Recorder(optimizer)
    model, x, y = _train_model(kind, 0, optimizer=optimizer)
    table = model.get_layer("bag").embeddings
    optimizer.build(model.trainable_variables)
    before = raw_state(optimizer, table)
    loss_before = model.evaluate(x, y, verbose=0)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert recorder.kinds_for("embeddings") == {"IndexedSlices"}
    assert recorder.kinds_for("kernel") == {"SymbolicTensor"}
    assert_rows_unchanged(before, raw_state(optimizer, table), np.arange(50))
    assert model.evaluate(x, y, verbose=0) < loss_before


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_tf_train_checkpoint_restores_state(tmp_path, kind):
    model, x, y = _train_model(kind, 4)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    path = checkpoint.save(str(tmp_path / "ckpt"))
    saved = _optimizer_values(model.optimizer)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    after_more = [v.numpy() for v in model.weights] + _optimizer_values(model.optimizer)
    checkpoint.restore(path).assert_consumed()
    for got, want in zip(_optimizer_values(model.optimizer), saved):
        np.testing.assert_array_equal(got, want)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    for got, want in zip(
        [v.numpy() for v in model.weights] + _optimizer_values(model.optimizer), after_more
    ):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_save_weights_and_keras_file_restore_state(tmp_path, kind):
    model, _x, _y = _train_model(kind, 4)
    model.save_weights(tmp_path / "model.weights.h5")
    model.save(tmp_path / "model.keras")
    fresh, _, _ = _train_model(kind, 0, seed=1)
    fresh.optimizer.build(fresh.trainable_variables)
    fresh.load_weights(tmp_path / "model.weights.h5")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    assert type(loaded.optimizer) is type(model.optimizer)
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    for other in (fresh, loaded):
        for got, want in zip(
            _optimizer_values(other.optimizer), _optimizer_values(model.optimizer)
        ):
            np.testing.assert_array_equal(got, want)
        for got, want in zip(other.weights, model.weights):
            np.testing.assert_array_equal(got.numpy(), want.numpy())


# --------------------------------------------------------------------------------------
# Mixed precision.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("wrap", ["keras_lso", "tf_ttemb_lso"])
@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_mixed_float16_fit(global_policy, kind, wrap):
    global_policy("mixed_float16")
    optimizer = make_optimizer(kind)
    if wrap == "tf_ttemb_lso":
        optimizer = LossScaleOptimizer(optimizer)
    recorder = Recorder(optimizer)
    model, x, y = _train_model(kind, 0, optimizer=optimizer)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    if wrap == "keras_lso":
        recorder = Recorder(model.optimizer)
    table = model.get_layer("bag").embeddings
    assert table.dtype == "float32"
    model.optimizer.build(model.trainable_variables)
    before = raw_state(model.optimizer.inner_optimizer, table)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert recorder.kinds_for("embeddings") == {"IndexedSlices"}
    after = raw_state(model.optimizer.inner_optimizer, table)
    assert_rows_unchanged(before, after, np.arange(50))
    assert not np.array_equal(after["w"][:50], before["w"][:50])
    assert all(np.isfinite(w.numpy()).all() for w in model.weights)


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_float16_layer_table_sparse_steps(global_policy, kind):
    """A table created in float16 (policy 'float16') trains with float32 state."""
    global_policy("float16")
    model, x, y = _train_model(kind, 0)
    table = model.get_layer("bag").embeddings
    assert table.dtype == "float16"
    model.optimizer.build(model.trainable_variables)
    before = raw_state(model.optimizer, table)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    after = raw_state(model.optimizer, table)
    assert_rows_unchanged(before, after, np.arange(50))
    assert np.isfinite(after["w"]).all() and not np.array_equal(after["w"], before["w"])
    assert all(v.dtype in ("float32", "int32", "int64") for v in model.optimizer.variables)


# --------------------------------------------------------------------------------------
# MirroredStrategy (two logical CPU devices need a fresh process).
# --------------------------------------------------------------------------------------

MIRRORED = """
    import json
    import numpy as np
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])
    import keras
    import tf_ttemb
    from tf_ttemb.optimizers import LazyAdam, RowWiseAdagrad

    # The custom op reads each replica's own copy of the table in place.
    IMPL = "auto"
    rng = np.random.default_rng(0)
    N, D, B = 64, 4, 8
    init = rng.normal(size=(N, D)).astype(np.float32)
    batches = [(rng.integers(0, 40, size=(B, 3)), rng.normal(size=(B, D)).astype(np.float32))
               for _ in range(3)]
    seen = set()

    def make(kind):
        opt = (LazyAdam(0.05, weight_decay=0.1) if kind == "lazy_adam"
               else RowWiseAdagrad(0.1, global_clipnorm=1e6))  # exercised, never binding
        original = opt.update_step
        def update_step(g, v, lr):
            seen.add(type(g).__name__ if "table" in v.name else "dense")
            return original(g, v, lr)
        opt.update_step = update_step
        return opt

    def run(kind, strategy):
        with strategy.scope():
            table = tf.Variable(init, name="table")
            bias = tf.Variable(tf.zeros([D]), name="bias")
            opt = make(kind)
            opt.build([table, bias])
        def replica_step(ids, target):
            with tf.GradientTape() as tape:
                out = tf_ttemb.gather_reduce_sum(table, ids, implementation=IMPL) + bias
                loss = tf.reduce_sum((out - target) ** 2) / B
            opt.apply(tape.gradient(loss, [table, bias]), [table, bias])
        @tf.function
        def step(ids, target):
            strategy.run(replica_step, (ids, target))
        share = B // strategy.num_replicas_in_sync
        for ids, target in batches:
            # Replica r gets examples [r * share, (r + 1) * share) of the batch.
            local = lambda array: strategy.experimental_distribute_values_from_function(
                lambda context: tf.constant(array[
                    context.replica_id_in_sync_group * share:
                    (context.replica_id_in_sync_group + 1) * share]))
            step(local(ids), local(target))
        values = [table.numpy(), bias.numpy()] + [v.numpy() for v in opt.variables]
        return values

    def fit(kind, strategy):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([
                keras.Input((3,), dtype="int64"),
                tf_ttemb.layers.EmbeddingBag(N, D, name="bag", implementation=IMPL),
                keras.layers.Dense(1)])
            model.compile(optimizer=make(kind), loss="mse")
        x = np.concatenate([b[0] for b in batches])
        y = np.concatenate([b[1][:, :1] for b in batches])
        model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
        return [w.numpy() for w in model.weights]

    mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert mirrored.num_replicas_in_sync == 2
    single = tf.distribute.OneDeviceStrategy("/cpu:0")
    worst = {}
    for kind in ("lazy_adam", "row_wise_adagrad"):
        for name, fn in (("loop", run), ("fit", fit)):
            a, b = fn(kind, mirrored), fn(kind, single)
            assert len(a) == len(b)
            worst[f"{kind}/{name}"] = max(
                float(np.max(np.abs(x - y) / (1e-4 + np.abs(y)))) if x.size else 0.0
                for x, y in zip(a, b))
            # Rows no replica touched stay exactly as initialised.
            if name == "loop":
                np.testing.assert_array_equal(a[0][40:], init[40:])
    print(json.dumps({"worst": worst, "seen": sorted(seen)}))
"""


def test_mirrored_strategy_matches_one_device():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(MIRRORED)],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, f"subprocess failed:\n{result.stderr[-4000:]}"
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["seen"] == ["IndexedSlices", "dense"], report
    for case, worst in report["worst"].items():
        assert worst < 1e-4, (case, worst)


# --------------------------------------------------------------------------------------
# Docstrings.
# --------------------------------------------------------------------------------------


def test_docstring_examples_run():
    from tf_ttemb.optimizers import lazy_adam, loss_scale, row_wise_adagrad

    for module in (lazy_adam, row_wise_adagrad, loss_scale):
        result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
        assert result.failed == 0, f"{result.failed} doctest failures in {module.__name__}"
        assert result.attempted > 0
