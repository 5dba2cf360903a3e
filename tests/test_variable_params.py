"""gather_reduce_sum on variables: the table is read in place, never copied per call.

A `tf.Variable` (or a Keras variable) passed as `params` goes to the resource-variable op,
which reads the table under the variable's lock instead of through a ReadVariableOp (which
copies the whole table once the variable has been updated sparsely). These tests check
that path against the float64 reference, that tapes see the variable without an explicit
`watch`, and that no dense read of the table appears in the traced graph.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import reference
import tensorflow as tf
from bags import (
    RTOL,
    assert_close,
    dense_value,
    make_bags,
    make_inputs,
    quantize,
    weights_like,
)

import tf_ttemb

DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64]
COMBINERS = ["sum", "mean", "sqrtn", "max"]


def _run(variable, bags, values, upstream, combiner, dense_grad, padding_id, use_function):
    def step():
        # No tape.watch of the variable: the tape must learn of it from the op call itself.
        with tf.GradientTape() as tape:
            weights = None
            if values is not None:
                tape.watch(values)
                weights = weights_like(bags.ids, values)
            out = tf_ttemb.gather_reduce_sum(
                variable,
                bags.ids,
                weights,
                combiner=combiner,
                padding_id=padding_id,
                dense_grad=dense_grad,
                implementation="custom_op",
            )
            loss = tf.reduce_sum(tf.cast(out, tf.float64) * tf.cast(upstream, tf.float64))
        sources = [variable] + ([values] if values is not None else [])
        return out, tape.gradient(loss, sources)

    if use_function:
        step = tf.function(step)
    return step()


@pytest.mark.parametrize("use_function", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("dense_grad", [False, True], ids=["sparse_grad", "dense_grad"])
@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_variable_matches_reference(rng, dtype, combiner, dense_grad, use_function):
    num_rows, dim, padding_id = 23, 5, 4
    bags = make_bags(rng, "ragged", num_rows, tf.int64, padding_id=padding_id)
    (params, params64), (weights, weights64), (upstream, upstream64) = make_inputs(
        rng, bags, num_rows, dim, dtype, combiner, weighted=combiner != "max"
    )
    variable = tf.Variable(params)

    out, grads = _run(
        variable, bags, weights, upstream, combiner, dense_grad, padding_id, use_function
    )

    want, scale = reference.forward(
        params64, bags.flat_ids, bags.splits, weights64, combiner, padding_id
    )
    assert out.dtype == dtype
    assert_close(dense_value(out).reshape(want.shape), want, scale, dtype, "output")
    params_grad = grads[0]
    if dense_grad:
        assert isinstance(params_grad, tf.Tensor)
    else:
        assert isinstance(params_grad, tf.IndexedSlices)
        ids = params_grad.indices.numpy()
        assert np.all(np.diff(ids) > 0), f"gradient ids not sorted and unique: {ids}"
        np.testing.assert_array_equal(ids, reference.touched_rows(bags.flat_ids, padding_id))
    want_dp, scale_dp = reference.params_grad(
        params64, bags.flat_ids, bags.splits, upstream64, weights64, combiner, padding_id
    )
    assert_close(dense_value(params_grad), want_dp, scale_dp, dtype, "params grad")
    if weights is not None:
        want_dw, scale_dw = reference.weights_grad(
            params64, bags.flat_ids, bags.splits, weights64, upstream64, combiner, padding_id
        )
        got_dw = bags.csr_from_values(dense_value(grads[1]))
        assert_close(got_dw, want_dw, scale_dw, dtype, "weights grad")


def test_keras_variable_reads_in_place(rng):
    num_rows, dim = 40, 7
    values = rng.normal(size=(num_rows, dim))
    variable = keras.Variable(values, dtype="float32")
    bags = make_bags(rng, "dense2d", num_rows, tf.int32)
    out = tf_ttemb.gather_reduce_sum(variable, bags.ids, combiner="mean")
    want, scale = reference.forward(
        tf.cast(tf.constant(values, tf.float32), tf.float64).numpy(),
        bags.flat_ids,
        bags.splits,
        None,
        "mean",
        None,
    )
    assert_close(dense_value(out).reshape(want.shape), want, scale, tf.float32, "output")


def test_sees_sparse_updates(rng):
    """After a scatter update (which puts the variable in copy-on-read mode) the op reads
    the updated rows."""
    num_rows, dim = 30, 4
    params, params64 = quantize(rng.normal(size=(num_rows, dim)), tf.float64)
    variable = tf.Variable(params)
    bags = make_bags(rng, "ragged", num_rows, tf.int64)
    delta = rng.normal(size=(3, dim))
    rows = np.array([1, 7, 29])
    variable.scatter_sub(tf.IndexedSlices(tf.constant(delta), tf.constant(rows)))
    params64 = params64.copy()
    params64[rows] -= delta
    out = tf_ttemb.gather_reduce_sum(variable, bags.ids)
    want, scale = reference.forward(params64, bags.flat_ids, bags.splits, None, "sum", None)
    assert_close(out.numpy(), want, scale, tf.float64, "output after scatter_sub")


@pytest.mark.parametrize("weighted", [False, True])
def test_traced_graph_has_no_dense_table_read_and_no_reshape(rng, weighted):
    # The op reads the table in place and the dense [B, L] ids and weights as they are
    # (no reshape before it); the weights gradient comes back in the weights' shape.
    variable = tf.Variable(rng.normal(size=(50, 8)).astype(np.float32))
    ids = tf.constant(rng.integers(0, 50, size=(6, 3)))
    weights = tf.constant(rng.uniform(0.5, 1.5, size=(6, 3)).astype(np.float32))

    @tf.function
    def step(ids, weights):
        with tf.GradientTape() as tape:
            tape.watch(weights)
            out = tf_ttemb.gather_reduce_sum(variable, ids, weights if weighted else None)
        return out, tape.gradient(out, [variable, weights], tf.ones_like(out))

    graph = step.get_concrete_function(ids, weights).graph
    op_types = {op.type for op in graph.get_operations()}
    assert "ReadVariableOp" not in op_types, sorted(op_types)
    assert "Reshape" not in op_types, sorted(op_types)
    lookup = [op for op in graph.get_operations() if op.type == "TfTtemb>ResourceGatherReduceSum"]
    assert len(lookup) == 1 and lookup[0].inputs[1].op.type == "Placeholder"
    out, (table_grad, weights_grad) = step(ids, weights)
    assert isinstance(table_grad, tf.IndexedSlices)
    rows = variable.numpy()[ids.numpy()]  # [6, 3, 8]
    w = weights.numpy() if weighted else np.ones((6, 3), np.float32)
    np.testing.assert_allclose(out.numpy(), (rows * w[..., None]).sum(1), rtol=1e-5, atol=1e-6)
    if weighted:  # d out.sum() / d w_j = the sum of row j
        assert tuple(weights_grad.shape) == (6, 3)
        np.testing.assert_allclose(weights_grad.numpy(), rows.sum(-1), rtol=1e-5, atol=1e-5)
    else:
        assert weights_grad is None


@pytest.mark.parametrize("use_variable", [True, False])
@pytest.mark.parametrize("dense_grad", [False, True])
def test_backward_row_count_is_sliced_on_the_host(rng, use_variable, dense_grad):
    # The backward ops read num_rows from host memory; a StridedSlice of the table's shape
    # placed on a GPU would copy the shape to the device behind the forward's kernels and
    # back, so the backward would wait for the GPU to run the forward.
    table = rng.normal(size=(50, 8)).astype(np.float32)
    params = tf.Variable(table) if use_variable else tf.constant(table)
    ids = tf.constant(rng.integers(0, 50, size=(6, 3)))

    @tf.function
    def step(ids):
        with tf.GradientTape() as tape:
            tape.watch(params)
            out = tf_ttemb.gather_reduce_sum(params, ids, dense_grad=dense_grad)
        return tape.gradient(out, params, tf.ones_like(out))

    graph = step.get_concrete_function(ids).graph
    backward = [
        op
        for op in graph.get_operations()
        if op.type in ("TfTtemb>GatherReduceSumGrad", "TfTtemb>GatherReduceSumDenseGrad")
    ]
    assert len(backward) == 1, sorted({op.type for op in graph.get_operations()})
    num_rows = backward[0].inputs[5].op
    assert num_rows.type == "StridedSlice", num_rows.type
    assert tf.DeviceSpec.from_string(num_rows.device).device_type == "CPU", num_rows.device
    grad = step(ids)
    dense = tf.convert_to_tensor(grad).numpy()
    want = np.zeros_like(table)
    np.add.at(want, ids.numpy().reshape(-1), 1.0)
    np.testing.assert_allclose(dense, want, rtol=0, atol=0)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_layer_mixed_precision_accumulates_in_variable_dtype(rng, policy):
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        layer = tf_ttemb.layers.EmbeddingBag(60, 9, combiner="sqrtn")
        ids = tf.constant(rng.integers(0, 60, size=(5, 4)))
        weights = tf.constant(rng.uniform(0.5, 1.5, size=(5, 4)), tf.float16)
        out = layer(ids, weights=weights)
    finally:
        keras.config.set_dtype_policy(previous)
    compute_dtype = tf.float16 if policy == "mixed_float16" else tf.bfloat16
    assert out.dtype == compute_dtype
    assert layer.embeddings.dtype == "float32"
    table64 = tf.cast(layer.embeddings.value, tf.float64).numpy()
    weights64 = tf.cast(tf.cast(weights, tf.float32), tf.float64).numpy().reshape(-1)
    flat_ids = ids.numpy().reshape(-1)
    splits = np.arange(0, flat_ids.size + 1, 4)
    want, scale = reference.forward(table64, flat_ids, splits, weights64, "sqrtn", None)
    # Only the final cast rounds to the half type: one rounding of the result.
    assert_close(dense_value(out), want, scale, compute_dtype, "mixed-precision output")
    assert RTOL[compute_dtype] <= 1e-2


@pytest.mark.parametrize("use_variable", [False, True], ids=["tensor", "variable"])
@pytest.mark.parametrize("dense_grad", [False, True], ids=["sparse_grad", "dense_grad"])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_fused_and_two_op_backward_agree(rng, monkeypatch, combiner, dense_grad, use_variable):
    """The weighted backward runs as one fused op (CPU and GPU kernels); the two-op
    backward (params gradient, weights gradient) must give the same gradients. The params
    gradients agree bit for bit on either device (same summation order); so do the
    weights gradients on the CPU, while on the GPU the fused kernel sums each entry's dot
    product by column chunks and the weights-gradient kernel by lanes (float32 rounding)."""
    from tf_ttemb.ops import _custom_op as grs_module

    num_rows, dim = 31, 6
    bags = make_bags(rng, "ragged", num_rows, tf.int32, padding_id=2)
    (params, _), (values, _), (upstream, _) = make_inputs(
        rng, bags, num_rows, dim, tf.float32, combiner, weighted=True
    )

    def gradients():
        table = tf.Variable(params) if use_variable else params
        with tf.GradientTape() as tape:
            tape.watch(values)
            if not use_variable:
                tape.watch(table)
            out = tf_ttemb.gather_reduce_sum(
                table,
                bags.ids,
                weights_like(bags.ids, values),
                combiner=combiner,
                padding_id=2,
                dense_grad=dense_grad,
                implementation="custom_op",
            )
            loss = tf.reduce_sum(out * upstream)
        return tape.gradient(loss, [table, values])

    assert grs_module._use_fused_backward({"has_weights": True, "combiner": combiner})
    fused = gradients()
    consulted = []
    monkeypatch.setattr(
        grs_module, "_use_fused_backward", lambda attrs: consulted.append(attrs) and False
    )
    two_op = gradients()
    assert consulted, "the gradient never chose between the fused and the two-op backward"
    for name, got, want in zip(["params", "weights"], two_op, fused):
        assert type(got) is type(want)
        if isinstance(want, tf.IndexedSlices):
            np.testing.assert_array_equal(got.indices.numpy(), want.indices.numpy())
            got, want = got.values, want.values
        if name == "weights" and tf.config.list_physical_devices("GPU"):
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_array_equal(got.numpy(), want.numpy())
