"""GroupedEmbeddingBag against separate EmbeddingBag layers on the same tables: outputs,
training with model.fit, saving, mixed precision, and its config errors."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_ttemb
from tf_ttemb.layers import EmbeddingBag, GroupedEmbeddingBag

BATCH = 16
FEATURES = [
    {"name": "user", "input_dim": 40, "output_dim": 8},
    {"name": "item", "input_dim": 30, "output_dim": 8, "combiner": "mean", "padding_id": 0},
    {"name": "history", "input_dim": 30, "output_dim": 8, "table": "item"},
    {"name": "country", "input_dim": 7, "output_dim": 5, "combiner": "sqrtn"},
    {"name": "tags", "input_dim": 11, "output_dim": 8, "combiner": "max"},
]
TABLES = {"user": "user", "item": "item", "history": "item", "country": "country", "tags": "tags"}


def _inputs(rng, batch=BATCH):
    lengths = rng.integers(0, 6, size=batch)
    return {
        "user": rng.integers(0, 40, size=(batch, 1)),
        "item": rng.integers(0, 30, size=(batch, 3)),
        "history": tf.ragged.constant(
            [list(rng.integers(0, 30, size=n)) for n in lengths], dtype=tf.int64
        ),
        "country": rng.integers(0, 7, size=(batch, 2)),
        "tags": rng.integers(0, 11, size=(batch, 4)),
    }


def _separate(grouped: GroupedEmbeddingBag) -> dict:
    """EmbeddingBag layers holding the grouped layer's tables (shared tables shared)."""
    layers = {}
    for f in FEATURES:
        table = TABLES[f["name"]]
        if table not in layers:
            values = grouped.table(table).numpy()
            layer = EmbeddingBag(
                values.shape[0],
                values.shape[1],
                combiner=f.get("combiner", "sum"),
                padding_id=f.get("padding_id"),
            )
            layer.build()
            layer.embeddings.assign(values)
            layers[table] = layer
    return layers


def _separate_call(layers, inputs):
    outs = []
    for f in FEATURES:
        layer = layers[TABLES[f["name"]]]
        # A shared table's features differ in combiner and padding: call the op directly.
        outs.append(
            tf_ttemb.gather_reduce_sum(
                layer.embeddings,
                inputs[f["name"]],
                combiner=f.get("combiner", "sum"),
                padding_id=f.get("padding_id"),
            )
        )
    return tf.concat(outs, axis=1)


def test_matches_separate_lookups_and_keeps_one_table_per_width(rng):
    layer = GroupedEmbeddingBag(FEATURES)
    inputs = _inputs(rng)
    out = layer(inputs)
    assert out.shape == (BATCH, 8 * 4 + 5)
    assert sorted(v.name for v in layer.trainable_variables) == ["embeddings_5", "embeddings_8"]
    assert layer.stacked[8].shape == (40 + 30 + 11, 8)
    want = _separate_call(_separate(layer), inputs)
    np.testing.assert_allclose(out.numpy(), want.numpy(), rtol=1e-6, atol=1e-7)
    as_list = GroupedEmbeddingBag(FEATURES, output_mode="list")
    as_list.build()
    for w in (5, 8):
        as_list.stacked[w].assign(layer.stacked[w])
    parts = as_list([inputs[f["name"]] for f in FEATURES])
    assert [p.shape[1] for p in parts] == [8, 8, 8, 5, 8]
    np.testing.assert_allclose(tf.concat(parts, 1).numpy(), out.numpy(), rtol=1e-6)


def test_weights_by_feature(rng):
    layer = GroupedEmbeddingBag(FEATURES[:2])
    inputs = {k: v for k, v in _inputs(rng).items() if k in ("user", "item")}
    weights = {"item": rng.uniform(0.5, 1.5, size=(BATCH, 3)).astype(np.float32)}
    out = layer(inputs, weights)
    want = tf.concat(
        [
            tf_ttemb.gather_reduce_sum(layer.table("user"), inputs["user"]),
            tf_ttemb.gather_reduce_sum(
                layer.table("item"), inputs["item"], weights["item"], combiner="mean", padding_id=0
            ),
        ],
        axis=1,
    )
    np.testing.assert_allclose(out.numpy(), want.numpy(), rtol=1e-5, atol=1e-7)


def _model(embedding) -> keras.Model:
    inputs = {
        "user": keras.Input(shape=(1,), dtype="int64", name="user"),
        "item": keras.Input(shape=(3,), dtype="int64", name="item"),
        "country": keras.Input(shape=(2,), dtype="int64", name="country"),
    }
    x = embedding(inputs)
    return keras.Model(inputs, keras.layers.Dense(1, kernel_initializer="ones")(x))


def test_fit_matches_a_model_of_separate_layers(rng):
    features = [FEATURES[0], FEATURES[1], FEATURES[3]]
    keras.utils.set_random_seed(3)
    grouped = GroupedEmbeddingBag(features)
    model = _model(grouped)

    class Separate(keras.layers.Layer):
        def __init__(self, tables):
            super().__init__()
            self.layers_ = [
                EmbeddingBag(
                    f["input_dim"],
                    f["output_dim"],
                    combiner=f.get("combiner", "sum"),
                    padding_id=f.get("padding_id"),
                )
                for f in features
            ]
            self.tables = tables

        def build(self, input_shape=None):
            for layer, table in zip(self.layers_, self.tables):
                layer.build()
                layer.embeddings.assign(table)

        def call(self, inputs):
            return tf.concat(
                [layer(inputs[f["name"]]) for layer, f in zip(self.layers_, features)], 1
            )

    reference = _model(Separate([grouped.table(f["name"]).numpy() for f in features]))
    reference.layers[-1].set_weights(model.layers[-1].get_weights())
    data = {k: v for k, v in _inputs(rng, 64).items() if k in ("user", "item", "country")}
    labels = rng.normal(size=(64, 1)).astype(np.float32)
    losses = []
    for m in (model, reference):
        m.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
        history = m.fit(data, labels, batch_size=16, epochs=2, shuffle=False, verbose=0)
        losses.append(history.history["loss"])
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
    for f, layer in zip(features, reference.layers[-2].layers_):
        np.testing.assert_allclose(
            grouped.table(f["name"]).numpy(), layer.embeddings.numpy(), rtol=1e-5, atol=1e-6
        )


def test_save_and_load(rng, tmp_path):
    model = _model(GroupedEmbeddingBag([FEATURES[0], FEATURES[1], FEATURES[3]]))
    data = {k: v for k, v in _inputs(rng).items() if k in ("user", "item", "country")}
    want = model(data).numpy()
    path = str(tmp_path / "grouped.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_allclose(loaded(data).numpy(), want, rtol=1e-6)
    assert loaded.layers[3].get_config()["features"] == model.layers[3].get_config()["features"]


def test_mixed_precision_keeps_float32_tables(rng):
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        layer = GroupedEmbeddingBag(FEATURES[:2])
        inputs = {k: v for k, v in _inputs(rng).items() if k in ("user", "item")}
        out = layer(inputs)
        assert out.dtype == tf.float16
        assert all(v.dtype == "float32" for v in layer.trainable_variables)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    mask = tf.cast(inputs["item"] != 0, tf.float32)[..., None]
    item = tf.reduce_sum(tf.gather(layer.table("item"), inputs["item"]) * mask, 1)
    item = item / tf.maximum(tf.reduce_sum(mask, 1), 1.0)
    ref = tf.concat([tf.gather(layer.table("user"), inputs["user"][:, 0]), item], axis=1)
    np.testing.assert_allclose(out.numpy().astype(np.float64), ref.numpy(), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize(
    "features,message",
    [
        ([], "at least one feature config"),
        ([{"input_dim": 3, "output_dim": 2}], r"features\[0\] needs a 'name'"),
        (
            [{"name": "a", "input_dim": 0, "output_dim": 2}],
            r"\(a\): input_dim must be an integer >= 1, got 0",
        ),
        (
            [{"name": "a", "input_dim": 3, "output_dim": 2, "combiner": "avg"}],
            "combiner must be one of",
        ),
        ([{"name": "a", "input_dim": 3, "output_dim": 2, "size": 1}], r"unknown keys \['size'\]"),
        (
            [{"name": "a", "input_dim": 3, "output_dim": 2, "padding_id": 3}],
            r"padding_id must be None, -1",
        ),
        (
            [
                {"name": "a", "input_dim": 3, "output_dim": 2},
                {"name": "a", "input_dim": 3, "output_dim": 2},
            ],
            r"feature names must be distinct, got \['a'\]",
        ),
        (
            [
                {"name": "a", "input_dim": 3, "output_dim": 2},
                {"name": "b", "input_dim": 4, "output_dim": 2, "table": "a"},
            ],
            "features sharing table 'a' must agree",
        ),
    ],
)
def test_config_errors(features, message):
    with pytest.raises(ValueError, match=message):
        GroupedEmbeddingBag(features)


def test_call_errors(rng):
    layer = GroupedEmbeddingBag(FEATURES[:2])
    with pytest.raises(ValueError, match=r"inputs is missing features \['item'\]"):
        layer({"user": tf.constant([[1]])})
    with pytest.raises(ValueError, match=r"inputs has unknown features \['x'\]"):
        layer({"user": tf.constant([[1]]), "item": tf.constant([[1]]), "x": tf.constant([[1]])})
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"feature item: indices\[1\] = 30"):
        layer({"user": tf.constant([[1]]), "item": tf.constant([[1, 30]])})
