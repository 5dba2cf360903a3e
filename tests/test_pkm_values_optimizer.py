"""ProductKeyMemory(values_optimizer=...): the values updated inside the backward pass.

The fused step (memory read + GatherReduceSumSparseApply) must equal the unfused step
(the same layer with trainable values, its values gradient taken) followed by the same
optimizer applied to the values by an independent float64 numpy update; every other
gradient must be unchanged. The unfused fallbacks (composite, XLA, "GPU visible") must
give the same numbers, Model.fit must drive the update, and the options must validate
and serialise.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_ttemb.layers import ProductKeyMemory

SHAPE = dict(n_keys=9, k_dim=6, heads=2, knn=3)
OPTIMIZERS = ["sgd", "rowwise_adagrad", "adagrad"]
RTOL = {"float32": 1e-5, "float64": 1e-10}
LR, EPS = 0.3, 1e-3


def make_pair(rng, optimizer, dtype, **kwargs):
    """A fused layer and an unfused twin with the same weights (accumulators random)."""
    x = tf.constant(rng.normal(size=(3, 7, 10)), dtype)
    fused = ProductKeyMemory(
        values_optimizer=optimizer,
        values_learning_rate=LR,
        values_epsilon=EPS,
        dtype=dtype,
        **SHAPE,
        **kwargs,
    )
    plain = ProductKeyMemory(dtype=dtype, **SHAPE, **kwargs)
    fused.build(x.shape)
    plain.build(x.shape)
    for name in ("query_kernel", "query_bias", "query_bn_gamma", "query_bn_beta", "keys", "values"):
        value = rng.normal(size=getattr(plain, name).shape) * 0.5
        getattr(plain, name).assign(value)
        getattr(fused, name).assign(value)
    if optimizer != "sgd":
        fused.values_accumulator.assign(rng.uniform(0.05, 1.0, size=fused.values_accumulator.shape))
    return fused, plain, x


def step(layer, x, upstream, mask=None):
    """Gradients of <layer(x), upstream> w.r.t. the inputs and every trainable variable."""
    variables = layer.trainable_variables

    @tf.function
    def run(x, upstream):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True, mask=mask)
        return y, tape.gradient(y, [x] + variables, output_gradients=upstream)

    y, grads = run(x, upstream)
    return y, dict(zip(["inputs"] + [v.name for v in variables], grads))


def numpy_update(values, grad, optimizer, accumulator):
    """float64 update of the rows with a nonzero gradient ("gradient then update")."""
    values = values.copy()
    accumulator = None if accumulator is None else accumulator.copy()
    for r in np.flatnonzero(np.any(grad != 0, axis=1)):
        g = grad[r]
        if optimizer == "sgd":
            values[r] -= LR * g
        elif optimizer == "rowwise_adagrad":
            accumulator[r] += np.mean(g * g)
            values[r] -= LR * g / (np.sqrt(accumulator[r]) + EPS)
        else:
            accumulator[r] += g * g
            values[r] -= LR * g / (np.sqrt(accumulator[r]) + EPS)
    return values, accumulator


def dense(x):
    return tf.cast(tf.convert_to_tensor(x), tf.float64).numpy()


def close(got, want, rtol, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(np.max(np.abs(want)), 1e-30)
    err = np.max(np.abs(got - want)) if got.size else 0.0
    assert got.shape == want.shape, f"{what}: shape {got.shape} vs {want.shape}"
    assert err <= rtol * scale * 10, f"{what}: max error {err:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "mask"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_fused_step_is_unfused_step_plus_optimizer(rng, optimizer, dtype, masked):
    fused, plain, x = make_pair(rng, optimizer, dtype)
    mask = tf.constant(rng.random(size=x.shape[:-1]) < 0.7) if masked else None
    upstream = tf.constant(rng.normal(size=(3, 7, 10)), dtype)
    values0 = dense(fused.values)
    acc0 = dense(fused.values_accumulator) if optimizer != "sgd" else None

    y_plain, g_plain = step(plain, x, upstream, mask)
    y_fused, g_fused = step(fused, x, upstream, mask)

    rtol = RTOL[dtype]
    close(dense(y_fused), dense(y_plain), rtol, "output")
    for name, grad in g_plain.items():
        if name == "values":
            continue
        close(dense(g_fused[name]), dense(grad), rtol, f"gradient of {name}")
    assert tuple(g_fused["values_update_trigger"].shape) == (0,)
    values_grad = dense(g_plain["values"])
    want_values, want_acc = numpy_update(values0, values_grad, optimizer, acc0)
    got_values = dense(fused.values)
    close(got_values, want_values, rtol, "updated values")
    # Slots not read (no gradient) are bitwise unchanged; the read ones moved.
    unread = ~np.any(values_grad != 0, axis=1)
    assert unread.any() and (~unread).any()
    np.testing.assert_array_equal(got_values[unread], values0[unread])
    assert np.all(np.any(got_values[~unread] != values0[~unread], axis=1))
    if optimizer != "sgd":
        close(dense(fused.values_accumulator), want_acc, rtol, "accumulator")
    # The unfused twin's values were not touched by anything.
    np.testing.assert_array_equal(dense(plain.values), values0)


def _fused_result(rng, optimizer, **kwargs):
    fused, _, x = make_pair(rng, optimizer, "float64", **kwargs)
    upstream = tf.constant(rng.normal(size=(3, 7, 10)))
    _, grads = step(fused, x, upstream)
    return dense(fused.values), grads, fused


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("fallback", ["composite", "xla"])
def test_unfused_fallbacks_give_the_same_step(rng, optimizer, fallback):
    seed = int(rng.integers(2**31))
    want_values, want_grads, _ = _fused_result(np.random.default_rng(seed), optimizer)
    kwargs = {}
    if fallback == "composite":
        kwargs = dict(implementation="composite")
    same_rng = np.random.default_rng(seed)
    fused, _, x = make_pair(same_rng, optimizer, "float64", **kwargs)
    upstream = tf.constant(same_rng.normal(size=(3, 7, 10)))
    if fallback == "xla":
        variables = fused.trainable_variables
        fused(x)  # nothing to trace lazily under XLA

        @tf.function(jit_compile=True)
        def run(x, upstream):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = fused(x, training=True)
            return tape.gradient(y, [x] + variables, output_gradients=upstream)

        grads = dict(zip(["inputs"] + [v.name for v in variables], run(x, upstream)))
    else:
        assert not fused._fused_values_update()
        _, grads = step(fused, x, upstream)
    close(dense(fused.values), want_values, 1e-10, "updated values")
    for name in ("inputs", "keys", "query_kernel"):
        close(dense(grads[name]), dense(want_grads[name]), 1e-10, f"gradient of {name}")


def test_fused_path_is_taken(rng):
    fused, _, _ = make_pair(rng, "sgd", "float32")
    assert fused._fused_values_update()

    @tf.function
    def run(x):
        with tf.GradientTape() as tape:
            y = fused(x, training=True)
        return tape.gradient(y, fused.values_update_trigger)

    graph = run.get_concrete_function(tf.TensorSpec([4, 10], tf.float32)).graph
    ops = {op.type for op in graph.get_operations()}
    assert "TfTtemb>GatherReduceSumSparseApply" in ops
    # No values gradient op and no dense read of the values in the fused step.
    assert "TfTtemb>GatherReduceSumGrad" not in ops
    assert "TfTtemb>ResourceGatherReduceSumFusedGrad" not in ops


def test_trigger_only_gradient_updates_and_inference_never_does(rng):
    fused, _, x = make_pair(rng, "rowwise_adagrad", "float32")
    before = fused.values.numpy().copy()
    with tf.GradientTape() as tape:
        y = fused(x, training=False)
    tape.gradient(y, fused.values_update_trigger)
    np.testing.assert_array_equal(fused.values.numpy(), before)
    with tf.GradientTape() as tape:
        y = fused(x, training=True)
    grad = tape.gradient(y, fused.values_update_trigger)
    assert tuple(grad.shape) == (0,)
    assert not np.array_equal(fused.values.numpy(), before)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_model_fit_updates_values_not_the_keras_optimizer(rng, optimizer):
    keras.utils.set_random_seed(int(rng.integers(2**31)))
    inputs = keras.Input(shape=(5, 10))
    layer = ProductKeyMemory(values_optimizer=optimizer, values_learning_rate=0.05, **SHAPE)
    outputs = keras.layers.Dense(1)(layer(inputs))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    x = rng.normal(size=(16, 5, 10)).astype(np.float32)
    y = rng.normal(size=(16, 5, 1)).astype(np.float32)
    values0 = layer.values.numpy().copy()
    keys0 = layer.keys.numpy().copy()
    # The first batch's slots (batch statistics, keys not trained yet).
    ids, _ = layer.lookup(x[:8], training=True)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    moved = np.any(layer.values.numpy() != values0, axis=1)
    assert moved.sum() > 0
    assert set(np.unique(ids.numpy())) <= set(np.flatnonzero(moved))
    assert not np.array_equal(layer.keys.numpy(), keys0)  # Adam trained the keys
    if optimizer != "sgd":
        assert np.array_equal(layer.values_accumulator.numpy() > 0, moved)
    # Adam keeps no moments for the values: the table is not among its variables.
    table = tuple(layer.values.shape)
    assert all(tuple(v.shape) != table for v in model.optimizer.variables)


def test_config_round_trip_and_keras_save(rng, tmp_path):
    layer = ProductKeyMemory(
        values_optimizer="adagrad", values_learning_rate=0.02, values_epsilon=1e-5, **SHAPE
    )
    config = layer.get_config()
    assert (
        config["values_optimizer"],
        config["values_learning_rate"],
        config["values_epsilon"],
    ) == ("adagrad", 0.02, 1e-5)
    clone = ProductKeyMemory.from_config(config)
    assert clone.get_config() == config
    inputs = keras.Input(shape=(4, 10))
    model = keras.Model(inputs, layer(inputs))
    layer.values_accumulator.assign(rng.uniform(size=layer.values_accumulator.shape))
    path = str(tmp_path / "pkm.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    restored = loaded.layers[-1]
    assert restored.values_optimizer == "adagrad"
    np.testing.assert_array_equal(
        restored.values_accumulator.numpy(), layer.values_accumulator.numpy()
    )
    x = rng.normal(size=(2, 4, 10)).astype(np.float32)
    np.testing.assert_allclose(loaded(x).numpy(), model(x).numpy(), rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            dict(values_optimizer="adam"),
            "values_optimizer must be one of 'sgd', 'rowwise_adagrad', 'adagrad', got 'adam'",
        ),
        (
            dict(values_optimizer="sgd", dense_grad=True),
            "dense_grad=True has no effect with values_optimizer",
        ),
        (
            dict(values_learning_rate=0.0),
            "values_learning_rate must be a finite number > 0, got 0.0",
        ),
        (
            dict(values_learning_rate=float("nan")),
            "values_learning_rate must be a finite number > 0, got nan",
        ),
        (dict(values_epsilon=-1e-3), "values_epsilon must be a finite number >= 0, got -0.001"),
        (dict(values_epsilon="1"), "values_epsilon must be a finite number >= 0, got '1'"),
        (
            dict(values_optimizer="sgd", dtype="mixed_float16"),
            "cannot undo the loss scaling of the mixed_float16 policy",
        ),
    ],
)
def test_argument_errors(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ProductKeyMemory(**SHAPE, **kwargs)


def test_distribution_strategy_refused(rng):
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        layer = ProductKeyMemory(values_optimizer="sgd", **SHAPE)
        layer.build((None, 10))
    x = tf.constant(rng.normal(size=(4, 10)), tf.float32)

    def replica_step():
        with tf.GradientTape() as tape:
            y = layer(x, training=True)
        return tape.gradient(y, layer.values_update_trigger)

    with pytest.raises(ValueError, match="values_optimizer does not support tf.distribute"):
        strategy.run(replica_step)


def test_mixed_bfloat16_fused_step_matches_unfused(rng):
    # Values stay float32 variables; the update sees the float32 gradient of the read.
    x = tf.constant(rng.normal(size=(2, 6, 10)), tf.float32)
    fused = ProductKeyMemory(
        values_optimizer="rowwise_adagrad",
        values_learning_rate=LR,
        values_epsilon=EPS,
        dtype="mixed_bfloat16",
        **SHAPE,
    )
    plain = ProductKeyMemory(dtype="mixed_bfloat16", **SHAPE)
    for layer in (fused, plain):
        layer.build(x.shape)
    for name in ("query_kernel", "query_bias", "keys", "values"):
        value = rng.normal(size=getattr(plain, name).shape) * 0.5
        getattr(plain, name).assign(value)
        getattr(fused, name).assign(value)
    assert fused.values.dtype == "float32"
    upstream = tf.constant(rng.normal(size=(2, 6, 10)), tf.bfloat16)
    values0 = dense(fused.values)
    _, g_plain = step(plain, x, upstream)
    _, g_fused = step(fused, x, upstream)
    close(dense(g_fused["keys"]), dense(g_plain["keys"]), 1e-5, "gradient of keys")
    want, _ = numpy_update(
        values0,
        dense(g_plain["values"]),
        "rowwise_adagrad",
        np.zeros(fused.values_accumulator.shape),
    )
    close(dense(fused.values), want, 1e-5, "updated values")
