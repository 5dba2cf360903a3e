"""tf_ttemb.layers.EmbeddingBag: forward, training, mixed precision, serialization, export."""

from __future__ import annotations

import json
import pathlib

import keras
import numpy as np
import pytest
import reference
import tensorflow as tf
from bags import (
    COMBINER_WEIGHTING,
    assert_close,
    combiner_id,
    dense_bags,
    make_bags,
    ragged_bags,
    sparse_bags,
    weights_like,
)
from processes import run_fresh_python, served_in_fresh_process

import tf_ttemb
from tf_ttemb.layers import EmbeddingBag

COMBINER_IDS = [combiner_id(v) for v in COMBINER_WEIGHTING]
REPO_ROOT = pathlib.Path(tf_ttemb.__file__).resolve().parent.parent


@pytest.fixture
def global_policy():
    """Sets the global dtype policy for one test and always restores the previous one."""
    previous = keras.config.dtype_policy()
    yield keras.config.set_dtype_policy
    keras.config.set_dtype_policy(previous)


def layer_reference(layer, bags, weights64=None, padding_id=None):
    table = layer.embeddings.numpy().astype(np.float64)
    out, scale = reference.forward(
        table, bags.flat_ids, bags.splits, weights64, layer.combiner, padding_id
    )
    dim = table.shape[1]
    return out.reshape(bags.lead_shape + (dim,)), scale.reshape(bags.lead_shape + (dim,))


# --------------------------------------------------------------------------------------
# Forward.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", ["auto", "custom_op", "composite"])
@pytest.mark.parametrize("form", ["dense2d", "dense3d", "ragged", "sparse"])
@pytest.mark.parametrize("combiner,weighted", COMBINER_WEIGHTING, ids=COMBINER_IDS)
def test_forward_matches_reference(rng, combiner, weighted, form, implementation):
    layer = EmbeddingBag(13, 4, combiner=combiner, padding_id=-1, implementation=implementation)
    bags = make_bags(rng, form, 13, tf.int64, padding_id=-1)
    weights, weights64 = None, None
    if weighted:
        weights64 = rng.uniform(0.5, 1.5, size=bags.nnz)
        values = tf.constant(bags.values_from_csr(weights64), dtype=tf.float32)
        weights64 = bags.csr_from_values(values.numpy())
        weights = weights_like(bags.ids, values)
    out = layer(bags.ids, weights=weights) if weighted else layer(bags.ids)
    assert out.dtype == tf.float32
    want, scale = layer_reference(layer, bags, weights64, padding_id=-1)
    assert_close(out.numpy(), want, scale, tf.float32, "layer output")


def test_forward_in_tf_function(rng):
    layer = EmbeddingBag(13, 4, combiner="mean", padding_id=0)
    bags = make_bags(rng, "ragged", 13, tf.int32, padding_id=0)
    out = tf.function(layer)(bags.ids)
    want, scale = layer_reference(layer, bags, padding_id=0)
    assert_close(out.numpy(), want, scale, tf.float32, "layer output")


def test_embeddings_variable(rng):
    layer = EmbeddingBag(13, 4)
    layer.build((None, 3))
    assert tuple(layer.embeddings.shape) == (13, 4)
    assert layer.embeddings.dtype == "float32"
    assert layer.embeddings.trainable
    assert len(layer.trainable_weights) == 1


# --------------------------------------------------------------------------------------
# Training.
# --------------------------------------------------------------------------------------

N_FIT, D_FIT, L_FIT, PAD_FIT = 50, 4, 5, 1


def _training_data(rng, form, count=64):
    """Ids only from rows 0..29 (row 1 is padding): rows 30..49 are never touched."""
    lengths = rng.integers(1, L_FIT + 1, size=count)
    ids = rng.integers(0, 30, size=int(lengths.sum()))
    if form == "dense2d":
        dense = rng.integers(0, 30, size=(count, L_FIT))
        dense[rng.random(dense.shape) < 0.3] = PAD_FIT
        bags = dense_bags(rng, None, N_FIT, tf.int32, ids=dense)
        spec = keras.Input(shape=(L_FIT,), dtype="int32")
    elif form == "ragged":
        bags = ragged_bags(rng, lengths, N_FIT, tf.int64, ids=ids)
        spec = keras.Input(shape=(None,), dtype="int64", ragged=True)
    else:
        bags = sparse_bags(rng, lengths, N_FIT, tf.int64, ids=ids, width=L_FIT + 3)
        bags.ids = tf.sparse.reorder(bags.ids)  # tf.data slices sparse rows in canonical order
        spec = keras.Input(shape=(L_FIT + 3,), dtype="int64", sparse=True)
    # A learnable target: the bag mean of a random per-row teacher value.
    teacher = rng.normal(size=(N_FIT, 1))
    targets, _ = reference.forward(teacher, bags.flat_ids, bags.splits, None, "mean", PAD_FIT)
    return bags, spec, targets.astype(np.float32)


@pytest.mark.parametrize("dense_grad", [False, True], ids=["sparse_grad", "dense_grad"])
@pytest.mark.parametrize("implementation", ["auto", "composite"])
@pytest.mark.parametrize("form", ["dense2d", "ragged", "sparse"])
def test_fit(rng, form, implementation, dense_grad):
    keras.utils.set_random_seed(int(rng.integers(2**31)))
    bags, inputs, targets = _training_data(rng, form)
    layer = EmbeddingBag(
        N_FIT,
        D_FIT,
        combiner="mean",
        padding_id=PAD_FIT,
        dense_grad=dense_grad,
        implementation=implementation,
    )
    outputs = keras.layers.Dense(1)(layer(inputs))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.2), loss="mse")
    before = layer.embeddings.numpy().copy()
    data = tf.data.Dataset.from_tensor_slices((bags.ids, targets)).batch(16)
    history = model.fit(data, epochs=8, verbose=0, shuffle=False)
    losses = history.history["loss"]
    assert losses[-1] < losses[0], losses
    after = layer.embeddings.numpy()
    touched = reference.touched_rows(bags.flat_ids, PAD_FIT)
    untouched = np.setdiff1d(np.arange(N_FIT), touched)
    assert PAD_FIT in untouched
    np.testing.assert_array_equal(after[untouched], before[untouched])
    assert np.all(np.any(after[touched] != before[touched], axis=1))


def test_jit_support_flags():
    assert EmbeddingBag(5, 2, implementation="custom_op").supports_jit is False
    assert EmbeddingBag(5, 2).supports_jit is False  # "auto" runs the custom op outside XLA
    assert EmbeddingBag(5, 2, implementation="composite").supports_jit is True


def test_model_with_custom_op_layer_is_not_jit_compiled():
    inputs = keras.Input(shape=(3,), dtype="int32")
    model = keras.Model(inputs, EmbeddingBag(5, 2, implementation="custom_op")(inputs))
    with pytest.warns(UserWarning, match="jit_compile"):
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    assert model.jit_compile is False


# --------------------------------------------------------------------------------------
# Mixed precision.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("form", ["dense2d", "ragged", "sparse"])
@pytest.mark.parametrize(
    "policy,compute_dtype", [("mixed_float16", tf.float16), ("mixed_bfloat16", tf.bfloat16)]
)
def test_mixed_precision(rng, global_policy, policy, compute_dtype, form, weighted):
    bags = make_bags(rng, form, 13, tf.int64, padding_id=-1)
    float32_layer = EmbeddingBag(13, 6, combiner="sqrtn", padding_id=-1)
    weights, weights64 = None, None
    if weighted:
        values = tf.constant(rng.uniform(0.5, 1.5, size=bags.values_shape), tf.float32)
        weights = weights_like(bags.ids, values)
        weights64 = bags.csr_from_values(values.numpy())
    want32 = float32_layer(bags.ids, weights=weights)
    global_policy(policy)
    layer = EmbeddingBag(13, 6, combiner="sqrtn", padding_id=-1)
    layer(bags.ids)
    layer.set_weights(float32_layer.get_weights())
    assert layer.embeddings.dtype == "float32"
    with tf.GradientTape() as tape:
        out = layer(bags.ids, weights=weights)
        loss = tf.reduce_sum(tf.cast(out, tf.float32) ** 2)
    assert out.dtype == compute_dtype
    want, scale = layer_reference(float32_layer, bags, weights64, padding_id=-1)
    got = tf.cast(out, tf.float64).numpy()
    assert_close(got, want, scale, compute_dtype, "mixed precision vs float64 reference")
    assert_close(got, want32.numpy(), scale, compute_dtype, "mixed precision vs float32 layer")
    grad = tape.gradient(loss, layer.embeddings)
    assert grad is not None and grad.dtype == tf.float32
    assert np.all(np.isfinite(tf.convert_to_tensor(grad).numpy()))


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_fit_mixed_precision(rng, global_policy, policy):
    """Training under a mixed policy (loss scaling for float16) updates only touched rows."""
    keras.utils.set_random_seed(int(rng.integers(2**31)))
    bags, _, targets = _training_data(rng, "ragged")
    global_policy(policy)
    inputs = keras.Input(shape=(None,), dtype="int64", ragged=True)
    layer = EmbeddingBag(N_FIT, D_FIT, combiner="mean", padding_id=PAD_FIT)
    outputs = keras.layers.Dense(1, dtype="float32")(layer(inputs))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.2), loss="mse")
    before = layer.embeddings.numpy().copy()
    data = tf.data.Dataset.from_tensor_slices((bags.ids, targets)).batch(16)
    losses = model.fit(data, epochs=8, verbose=0, shuffle=False).history["loss"]
    assert losses[-1] < losses[0], losses
    assert layer.embeddings.dtype == "float32"
    after = layer.embeddings.numpy()
    untouched = np.setdiff1d(np.arange(N_FIT), reference.touched_rows(bags.flat_ids, PAD_FIT))
    np.testing.assert_array_equal(after[untouched], before[untouched])
    assert np.any(after != before)


# --------------------------------------------------------------------------------------
# Serialization and export.
# --------------------------------------------------------------------------------------

FULL_CONFIG = dict(
    input_dim=17,
    output_dim=5,
    combiner="sqrtn",
    padding_id=3,
    embeddings_initializer="glorot_uniform",
    embeddings_regularizer="l2",
    embeddings_constraint="non_neg",
    dense_grad=True,
    implementation="composite",
)


def test_get_config_from_config(rng):
    layer = EmbeddingBag(**FULL_CONFIG)
    config = layer.get_config()
    plain = ("input_dim", "output_dim", "combiner", "padding_id", "dense_grad", "implementation")
    for key in plain:
        assert config[key] == FULL_CONFIG[key], key
    for key in ("embeddings_initializer", "embeddings_regularizer", "embeddings_constraint"):
        assert config[key] is not None, key
    clone = EmbeddingBag.from_config(config)
    assert clone.get_config() == config
    again = keras.layers.deserialize(keras.layers.serialize(layer))
    assert isinstance(again, EmbeddingBag)
    assert again.get_config() == config
    ids = tf.constant(rng.integers(0, 17, size=(4, 6)))
    layer(ids)
    clone(ids)
    clone.set_weights(layer.get_weights())
    # implementation="composite": on a GPU TensorFlow's segment sum adds with float atomics,
    # so two runs may differ in the last bit (bitwise only under op determinism).
    np.testing.assert_allclose(clone(ids).numpy(), layer(ids).numpy(), rtol=1e-6, atol=1e-7)


def test_default_config():
    config = EmbeddingBag(7, 3).get_config()
    assert config["combiner"] == "sum"
    assert config["padding_id"] is None
    assert config["dense_grad"] is False
    assert config["implementation"] == "auto"


def _small_model(rng, form):
    if form == "ragged":
        inputs = keras.Input(shape=(None,), dtype="int64", ragged=True)
    else:
        inputs = keras.Input(shape=(5,), dtype="int64")
    x = EmbeddingBag(20, 6, combiner="mean", padding_id=0, name="bag")(inputs)
    outputs = keras.layers.Dense(2)(x)
    return keras.Model(inputs, outputs)


@pytest.mark.parametrize("form", ["dense2d", "ragged"])
def test_keras_file_round_trip(rng, tmp_path, form):
    keras.utils.set_random_seed(int(rng.integers(2**31)))
    model = _small_model(rng, form)
    bags = make_bags(rng, form, 20, tf.int64, padding_id=0)
    want = model(bags.ids).numpy()
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.get_layer("bag"), EmbeddingBag)
    assert loaded.get_layer("bag").get_config() == model.get_layer("bag").get_config()
    np.testing.assert_array_equal(loaded(bags.ids).numpy(), want)


SERVE_SAVED_MODEL = """
    import json, sys
    import numpy as np
    import tensorflow as tf
    import tf_ttemb  # registers the ops the SavedModel uses

    path, dense_file, values_file, splits_file = sys.argv[1:]
    loaded = tf.saved_model.load(path)
    dense = loaded.serve_dense(tf.constant(np.load(dense_file)))
    ragged = loaded.serve_ragged(
        tf.RaggedTensor.from_row_splits(np.load(values_file), np.load(splits_file)))
    print(json.dumps({"dense": dense.numpy().tolist(), "ragged": ragged.numpy().tolist()}))
"""


@pytest.mark.slow
def test_saved_model_served_in_fresh_process(rng, tmp_path):
    layer = EmbeddingBag(30, 4, combiner="mean", padding_id=-1)
    layer(tf.zeros([1, 6], tf.int64))

    class Serving(tf.Module):
        def __init__(self, layer):
            super().__init__()
            self.layer = layer

        @tf.function(input_signature=[tf.TensorSpec([None, 6], tf.int64)])
        def serve_dense(self, ids):
            return self.layer(ids)

        @tf.function(input_signature=[tf.RaggedTensorSpec([None, None], tf.int64)])
        def serve_ragged(self, ids):
            return self.layer(ids)

    module = Serving(layer)
    path = tmp_path / "saved_model"
    tf.saved_model.save(module, str(path))

    dense = dense_bags(rng, (5, 6), 30, tf.int64, padding_id=-1)
    ragged = ragged_bags(rng, [3, 0, 7, 1], 30, tf.int64)
    np.save(tmp_path / "dense.npy", dense.ids.numpy())
    np.save(tmp_path / "values.npy", ragged.ids.flat_values.numpy())
    np.save(tmp_path / "splits.npy", ragged.ids.row_splits.numpy())
    got = json.loads(
        run_fresh_python(
            SERVE_SAVED_MODEL,
            str(path),
            *(str(tmp_path / f) for f in ("dense.npy", "values.npy", "splits.npy")),
        )
    )
    want_dense, scale = layer_reference(layer, dense, padding_id=-1)
    assert_close(np.array(got["dense"]), want_dense, scale, tf.float32, "served dense")
    want_ragged, scale = layer_reference(layer, ragged, padding_id=-1)
    assert_close(np.array(got["ragged"]), want_ragged, scale, tf.float32, "served ragged")
    np.testing.assert_array_equal(np.array(got["dense"], np.float32), layer(dense.ids).numpy())


@pytest.mark.slow
def test_model_export_served_in_fresh_process(rng, tmp_path):
    keras.utils.set_random_seed(int(rng.integers(2**31)))
    model = _small_model(rng, "dense2d")
    bags = dense_bags(rng, (7, 5), 20, tf.int64, padding_id=0)
    want = model(bags.ids).numpy()
    path = tmp_path / "exported"
    model.export(str(path), format="tf_saved_model")
    got = served_in_fresh_process(path, bags.ids.numpy(), tmp_path)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------
# Constructor validation.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,name,quoted",
    [
        (dict(input_dim=0), "input_dim", "0"),
        (dict(input_dim=-3), "input_dim", "-3"),
        (dict(output_dim=0), "output_dim", "0"),
        (dict(output_dim=-1), "output_dim", "-1"),
        (dict(combiner="avg"), "combiner", "avg"),
        (dict(implementation="fast"), "implementation", "fast"),
        (dict(padding_id=-2), "padding_id", "-2"),
        (dict(padding_id=10), "padding_id", "10"),
        (dict(padding_id="x"), "padding_id", "'x'"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_constructor_validation(kwargs, name, quoted):
    args = dict(input_dim=10, output_dim=4)
    args.update(kwargs)
    with pytest.raises(ValueError) as info:
        EmbeddingBag(**args)
    message = str(info.value)
    assert name in message, message
    assert quoted in message, message


def test_layer_rejects_weights_with_max():
    layer = EmbeddingBag(10, 4, combiner="max")
    ids = tf.constant([[1, 2], [3, 4]])
    with pytest.raises(ValueError, match="max"):
        layer(ids, weights=tf.ones([2, 2]))
