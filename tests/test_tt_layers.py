"""TTEmbeddingBag and TableBatchedTTEmbeddingBag: lookups, fused updates, cache, Keras plumbing.

References: `tf_ttemb.tt.to_dense` of the layer's cores (float64) reduced by
`reference.forward`, and dense core gradients from the numpy chain rule of
test_tt_embedding.py.
"""

from __future__ import annotations

import doctest
import importlib
import json
import math
import pathlib

import keras
import numpy as np
import pytest
import reference
import tensorflow as tf
from bags import assert_close, dense_bags, make_bags, ragged_bags, some_combiners, weights_like
from processes import run_fresh_python
from test_tt_embedding import (
    CASES,
    DEFAULT_IMPLEMENTATION,
    IMPLEMENTATIONS,
    core_grads_reference,
    dense_tables,
    forward_reference,
    needs_cache_count,
    random_cores,
)

import tf_ttemb
from tf_ttemb import tt
from tf_ttemb.layers import TableBatchedTTEmbeddingBag, TTEmbeddingBag
from tf_ttemb.layers import tt_embedding_bag as tt_layers
from tf_ttemb.ops import tt_embedding as tte

REPO_ROOT = pathlib.Path(tf_ttemb.__file__).resolve().parent.parent
EMPTY = tte.EMPTY_CACHE_ID


@pytest.fixture
def global_policy():
    """Sets the global dtype policy for one test and always restores the previous one."""
    previous = keras.config.dtype_policy()
    yield keras.config.set_dtype_policy
    keras.config.set_dtype_policy(previous)


def layer_cores64(layer):
    return [c.numpy().astype(np.float64) for c in layer.cores]


def layer_tables(layer):
    """[num_tables, N, D] float64 tables of the layer's cores (ignoring its cache)."""
    return dense_tables(
        layer_cores64(layer),
        layer.num_embeddings,
        layer.tt_p_shapes,
        layer.tt_q_shapes,
        layer.tt_ranks,
        layer.num_tables,
    )


def make_layer(rng, case="3cores-d3", cls=TTEmbeddingBag, num_tables=1, **kwargs):
    """A layer of CASES[case] built from random cores of order-1 rows."""
    n, p, q, ranks = CASES[case]
    kwargs.setdefault("implementation", DEFAULT_IMPLEMENTATION)
    if cls is TableBatchedTTEmbeddingBag:
        kwargs["num_tables"] = num_tables
    else:
        num_tables = 1
    cores = random_cores(rng, p, q, ranks, num_tables)
    return cls.from_cores(cores, n, p, q, ranks, **kwargs)


# --------------------------------------------------------------------------------------
# Lookups.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("form", ["dense2d", "dense3d", "ragged", "sparse"])
@some_combiners("sum-weighted", "mean", "max")
def test_forward_matches_reference(rng, combiner, weighted, form, implementation):
    layer = make_layer(rng, combiner=combiner, padding_id=-1, implementation=implementation)
    bags = make_bags(rng, form, layer.num_embeddings, tf.int64, padding_id=-1)
    weights = w64 = None
    if weighted:
        values = tf.constant(rng.uniform(0.5, 1.5, size=bags.values_shape), tf.float32)
        weights = weights_like(bags.ids, values)
        w64 = bags.csr_from_values(values.numpy())
    out = layer(bags.ids, weights)
    assert out.dtype == tf.float32
    want, scale = forward_reference(
        layer_cores64(layer),
        layer.num_embeddings,
        layer.tt_p_shapes,
        layer.tt_q_shapes,
        layer.tt_ranks,
        (bags.flat_ids, bags.splits),
        w64,
        combiner,
        -1,
    )
    assert tuple(out.shape) == bags.lead_shape + (layer.embedding_dim,)
    assert_close(out.numpy().reshape(want.shape), want, scale, tf.float32, "layer output")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", list(CASES))
def test_gradients_float64(rng, case, implementation):
    """Core and weights gradients of a float64 layer equal the numpy reference."""
    layer = make_layer(
        rng, case, combiner="sqrtn", padding_id=0, dtype="float64", implementation=implementation
    )
    n, p, q, ranks = CASES[case]
    bags = make_bags(rng, "ragged", n, tf.int64, padding_id=0)
    values = tf.constant(rng.uniform(0.5, 1.5, size=bags.nnz))
    up = rng.normal(size=(bags.num_bags, layer.embedding_dim))
    with tf.GradientTape() as tape:
        tape.watch(values)
        loss = tf.reduce_sum(layer(bags.ids, bags.ids.with_flat_values(values)) * up)
    core_grads, w_grad = tape.gradient(loss, [layer.cores, values])
    cores = layer_cores64(layer)
    table = layer_tables(layer)[0]
    dtable, _ = reference.params_grad(
        table, bags.flat_ids, bags.splits, up, values.numpy(), "sqrtn", 0
    )
    want = core_grads_reference(cores, p, q, ranks, np.arange(n), dtable)
    for k, g in enumerate(core_grads):
        np.testing.assert_allclose(
            tf.convert_to_tensor(g).numpy(), want[k], rtol=1e-9, atol=1e-12, err_msg=f"core {k}"
        )
    want_w, _ = reference.weights_grad(
        table, bags.flat_ids, bags.splits, values.numpy(), up, "sqrtn", 0
    )
    np.testing.assert_allclose(w_grad.numpy(), want_w, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "cls", [TTEmbeddingBag, TableBatchedTTEmbeddingBag], ids=["single", "batched"]
)
def test_full_weight(rng, cls, implementation):
    layer = make_layer(rng, "4cores-d8", cls, num_tables=2, implementation=implementation)
    want = layer_tables(layer)
    got = layer.full_weight().numpy()
    if cls is TTEmbeddingBag:
        want = want[0]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_full_weight_in_chunks(rng, monkeypatch):
    monkeypatch.setattr(
        importlib.import_module("tf_ttemb.ops.composite"), "COMPOSITE_CHUNK_BYTES", 4 * 8 * 7
    )
    layer = make_layer(rng, "4cores-d8", TableBatchedTTEmbeddingBag, num_tables=2)
    np.testing.assert_allclose(
        layer.full_weight().numpy(), layer_tables(layer), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("weight_dist", tt.WEIGHT_DISTS)
@pytest.mark.parametrize(
    "cls", [TTEmbeddingBag, TableBatchedTTEmbeddingBag], ids=["single", "batched"]
)
def test_weight_dists(cls, weight_dist):
    args = (2,) if cls is TableBatchedTTEmbeddingBag else ()
    layer = cls(*args, 500, 8, tt_ranks=[4, 4], weight_dist=weight_dist, seed=3)
    out = layer(tf.constant([[1, 2, 499]] * (2 if args else 1)))
    weight = layer.full_weight().numpy()
    want = tt.initial_cores(
        500,
        8,
        layer.tt_p_shapes,
        layer.tt_q_shapes,
        layer.tt_ranks,
        weight_dist,
        3,
        layer.num_tables,
        np.float64,
    )
    for got_core, want_core in zip(layer.cores, want):
        np.testing.assert_allclose(got_core.numpy(), want_core, rtol=1e-6)
    assert np.all(np.isfinite(weight)) and np.all(np.isfinite(out.numpy()))
    if weight_dist == "approx-uniform":
        assert np.abs(weight).max() <= 1 / math.sqrt(500) * (1 + 1e-6)
    if args:  # the tables are initialised independently
        assert not np.allclose(weight[0], weight[1])


def test_seed_makes_layers_reproducible():
    a = TTEmbeddingBag(100, 4, 3, seed=7)
    b = TTEmbeddingBag(100, 4, 3, seed=7)
    a.build(), b.build()
    for x, y in zip(a.cores, b.cores):
        np.testing.assert_array_equal(x.numpy(), y.numpy())
    keras.utils.set_random_seed(11)
    c = TTEmbeddingBag(100, 4, 3)
    keras.utils.set_random_seed(11)
    assert TTEmbeddingBag(100, 4, 3).seed == c.seed


def test_from_decomposition_is_exact_at_full_rank(rng):
    table = rng.normal(size=(50, 6))
    decomposition = tt.from_dense(table, [6, 15], [3, 4, 5], [2, 1, 3])
    layer = TTEmbeddingBag.from_decomposition(decomposition, 50, dtype="float64", combiner="mean")
    np.testing.assert_allclose(layer.full_weight().numpy(), table, rtol=1e-9, atol=1e-9)
    ids = tf.ragged.constant([[3, 49], [7]])
    np.testing.assert_allclose(
        layer(ids).numpy(), [table[[3, 49]].mean(0), table[7]], rtol=1e-9, atol=1e-9
    )


def test_from_cores_checks_shapes(rng):
    n, p, q, ranks = CASES["3cores-d3"]
    cores = random_cores(rng, p, q, ranks)
    with pytest.raises(ValueError, match=r"cores\[1\] must have shape \[4, 18\] .* got \[4, 17\]"):
        TTEmbeddingBag.from_cores([cores[0], cores[1][:, :17], cores[2]], n, p, q, ranks)
    with pytest.raises(ValueError, match=r"expected 3 cores .* got 2"):
        TTEmbeddingBag.from_cores(cores[:2], n, p, q, ranks)
    with pytest.raises(ValueError, match=r"cores\[0\] must have shape \[6, 2\]"):
        TableBatchedTTEmbeddingBag.from_cores(cores, n, p, q, ranks, num_tables=2)


# --------------------------------------------------------------------------------------
# Table batching.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("form", ["dense", "list-ragged", "list-sparse"])
def test_table_batched_equals_separate_layers(rng, form, implementation):
    n, p, q, ranks = CASES["2cores-d33"]
    num_tables = 3
    cores = random_cores(rng, p, q, ranks, num_tables)
    kwargs = dict(combiner="mean", padding_id=-1, implementation=implementation, dtype="float64")
    batched = TableBatchedTTEmbeddingBag.from_cores(
        cores, n, p, q, ranks, num_tables=num_tables, **kwargs
    )
    singles = [
        TTEmbeddingBag.from_cores(
            [c[t * pk : (t + 1) * pk] for c, pk in zip(cores, p)], n, p, q, ranks, **kwargs
        )
        for t in range(num_tables)
    ]
    if form == "dense":
        ids = dense_bags(rng, (num_tables, 5, 3), n, tf.int64, padding_id=-1).ids
        per_table = [ids[t] for t in range(num_tables)]
    else:
        kind = form.split("-")[1]
        per_table = [
            make_bags(rng, kind, n, tf.int64, padding_id=-1, num_bags=5).ids
            for _ in range(num_tables)
        ]
        ids = per_table
    up = rng.normal(size=(num_tables, 5, 33))
    with tf.GradientTape() as tape:
        out = batched(ids)
        loss = tf.reduce_sum(out * up)
    grads = tape.gradient(loss, batched.cores)
    for t, (layer, table_ids) in enumerate(zip(singles, per_table)):
        with tf.GradientTape() as tape:
            single = layer(table_ids)
            loss = tf.reduce_sum(single * up[t])
        np.testing.assert_allclose(out.numpy()[t], single.numpy(), rtol=1e-12, atol=1e-12)
        for k, g in enumerate(tape.gradient(loss, layer.cores)):
            rows = slice(t * p[k], (t + 1) * p[k])
            np.testing.assert_allclose(
                tf.convert_to_tensor(grads[k]).numpy()[rows],
                tf.convert_to_tensor(g).numpy(),
                rtol=1e-10,
                atol=1e-12,
            )


# --------------------------------------------------------------------------------------
# Fused updates (sparse=True).
# --------------------------------------------------------------------------------------

# p_0 = 1000: every one of its rows must be updated (FBTT's fused update missed rows).
FUSED = (12000, [1000, 4, 3], [2, 1, 2], [2, 3])
LR, EPS = 0.05, 1e-10


def _fused_batch(rng, skipped):
    """Dense ids [500, 4] whose leading digits are every value except `skipped`."""
    n, p, _, _ = FUSED
    digits = rng.permutation(np.setdiff1d(np.arange(p[0]), skipped))
    ids = digits * (n // p[0]) + rng.integers(0, n // p[0], size=len(digits))
    extra = rng.integers(0, p[0] * (n // p[0]), size=2000 - len(ids))
    extra = extra[~np.isin(extra // (n // p[0]), skipped)]
    ids = np.concatenate([ids, extra, ids[: 2000 - len(ids) - len(extra)]])
    return rng.permutation(ids).reshape(500, 4)


def _hand_step(cores, accumulators, ids, weights, upstream, optimizer):
    """One update from the dense reference gradient of sum(upstream * mean-bags)."""
    n, p, q, ranks = FUSED
    table = dense_tables(cores, n, p, q, ranks)[0]
    splits = np.arange(ids.shape[0] + 1) * ids.shape[1]
    dtable, _ = reference.params_grad(
        table, ids.reshape(-1), splits, upstream, weights.reshape(-1), "mean"
    )
    grads = core_grads_reference(cores, p, q, ranks, np.arange(n), dtable)
    new_cores, new_accumulators = [], []
    for core, acc, g in zip(cores, accumulators, grads):
        if optimizer == "sgd":
            new_cores.append(core - LR * g)
            new_accumulators.append(acc)
        else:
            acc = acc + g * g
            new_cores.append(core - LR * g / (np.sqrt(acc) + EPS))
            new_accumulators.append(acc)
    return new_cores, new_accumulators, grads


@pytest.mark.parametrize("loop", ["eager", "function", "fit"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_fused_update_matches_dense_step_on_every_row(rng, optimizer, implementation, loop):
    n, p, q, ranks = FUSED
    cores = random_cores(rng, p, q, ranks)
    layer = TTEmbeddingBag.from_cores(
        cores,
        n,
        p,
        q,
        ranks,
        combiner="mean",
        sparse=True,
        optimizer=optimizer,
        learning_rate=LR,
        eps=EPS,
        dtype="float64",
        implementation=implementation,
    )
    assert [v.name for v in layer.trainable_variables] == ["fused_update_trigger"]
    if loop == "fit":
        ids_in = keras.Input(shape=(4,), dtype="int64")
        w_in = keras.Input(shape=(4,), dtype="float64")
        model = keras.Model([ids_in, w_in], layer(ids_in, w_in))
        model.compile(
            optimizer=keras.optimizers.SGD(1.0), loss=lambda y, out: tf.reduce_sum(y * out, axis=-1)
        )

    expected, accumulators = cores, [np.zeros_like(c) for c in cores]
    for step, skipped in enumerate([rng.choice(p[0], 100, replace=False), np.array([], int)]):
        ids = _fused_batch(rng, skipped)
        weights = rng.uniform(0.5, 1.5, size=ids.shape)
        up = rng.normal(size=(ids.shape[0], layer.embedding_dim))
        if loop == "fit":
            model.fit([ids, weights], up, batch_size=len(ids), epochs=1, shuffle=False, verbose=0)
            up = up / len(ids)  # Keras averages the per-bag losses
        else:

            def train_step(ids, weights, up):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(layer(ids, weights, training=True) * up)
                grads = tape.gradient(loss, layer.trainable_variables)
                assert tuple(grads[0].shape) == (0,)
                return loss

            if loop == "function":
                train_step = tf.function(train_step)
            train_step(tf.constant(ids), tf.constant(weights), tf.constant(up))
        previous = expected
        expected, accumulators, grads = _hand_step(
            expected, accumulators, ids, weights, up, optimizer
        )
        # Keras computes the loss (hence the upstream gradient) in float32.
        tol = 1e-5 if loop == "fit" else 1e-10
        for k, core in enumerate(layer.cores):
            step_size = np.abs(expected[k] - previous[k]).max()
            np.testing.assert_allclose(
                core.numpy(),
                expected[k],
                rtol=0,
                atol=tol * step_size,
                err_msg=f"step {step}, core {k}",
            )
            if optimizer == "adagrad":
                np.testing.assert_allclose(
                    layer.core_accumulators[k].numpy(),
                    accumulators[k],
                    rtol=0,
                    atol=tol * accumulators[k].max(),
                )
        # The batch touched every row of core 0 but the skipped ones (rows >= 128
        # included), and the comparison above covered every row, touched or not.
        touched = np.flatnonzero(np.any(grads[0] != 0, axis=1))
        np.testing.assert_array_equal(touched, np.setdiff1d(np.arange(p[0]), skipped))


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_fused_update_of_cache_rows_and_table_batched_cores(rng, optimizer):
    n, p, q, ranks = CASES["3cores-d3"]
    cores = random_cores(rng, p, q, ranks, 2)
    layer = TableBatchedTTEmbeddingBag.from_cores(
        cores,
        n,
        p,
        q,
        ranks,
        num_tables=2,
        sparse=True,
        optimizer=optimizer,
        learning_rate=LR,
        eps=EPS,
        use_cache=True,
        cache_size=4,
        hashtbl_size=64,
        dtype="float64",
    )
    big_p = math.prod(p)
    layer.freq_keys.assign(np.array([3, big_p + 7, 11] + [-1] * 61))
    layer.freq_counts.assign(np.array([5, 4, 1] + [0] * 61))
    layer.cache_populate()
    np.testing.assert_array_equal(layer.cache_ids.numpy(), [3, 11, big_p + 7, EMPTY])
    rows_before = layer.cache_rows.numpy().copy()
    ids = rng.integers(0, n, size=(2, 6, 3))
    ids[0, 0, 0], ids[1, 0, 0] = 3, 7  # cached ids of both tables
    up = rng.normal(size=(2, 6, 3))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(tf.constant(ids), training=True) * up)
    tape.gradient(loss, layer.trainable_variables)
    # Reference: the effective tables (cached rows replaced), their dense gradients.
    tables = dense_tables(cores, n, p, q, ranks, 2)
    tables[0, 3], tables[0, 11], tables[1, 7] = rows_before[:3]
    dtables = [
        reference.params_grad(tables[t], ids[t].reshape(-1), np.arange(7) * 3, up[t])[0]
        for t in range(2)
    ]
    rows_grad = np.stack([dtables[0][3], dtables[0][11], dtables[1][7]])
    dtables[0][[3, 11]] = 0.0
    dtables[1][7] = 0.0
    global_ids = np.concatenate([np.arange(n), big_p + np.arange(n)])
    core_grads = core_grads_reference(cores, p, q, ranks, global_ids, np.concatenate(dtables))

    def step(value, g):
        if optimizer == "sgd":
            return value - LR * g
        return value - LR * g / (np.sqrt(g * g) + EPS)

    np.testing.assert_allclose(
        layer.cache_rows.numpy()[:3], step(rows_before[:3], rows_grad), rtol=1e-9, atol=1e-12
    )
    np.testing.assert_array_equal(layer.cache_rows.numpy()[3], 0.0)
    for k, core in enumerate(layer.cores):
        np.testing.assert_allclose(
            core.numpy(), step(cores[k], core_grads[k]), rtol=1e-9, atol=1e-12, err_msg=f"core {k}"
        )


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_fused_update_under_jit_compile(rng, optimizer):
    """The composite under XLA (no tf.unique there) updates like the eager step."""
    n, p, q, ranks = CASES["4cores-d8"]
    cores = random_cores(rng, p, q, ranks)
    layers = [
        TTEmbeddingBag.from_cores(
            cores,
            n,
            p,
            q,
            ranks,
            sparse=True,
            optimizer=optimizer,
            learning_rate=LR,
            dtype="float64",
            combiner="mean",
            implementation="composite",
        )
        for _ in range(2)
    ]
    ids = tf.constant(rng.integers(0, n, size=(6, 4)))
    up = tf.constant(rng.normal(size=(6, 8)))

    def step(layer):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(ids, training=True) * up)
        return tape.gradient(loss, layer.trainable_variables)

    for _ in range(2):
        step(layers[0])
        tf.function(lambda: step(layers[1]), jit_compile=True)()
    for eager, jitted in zip(*(layer.cores for layer in layers)):
        np.testing.assert_allclose(jitted.numpy(), eager.numpy(), rtol=1e-10, atol=1e-12)
    changed = [np.any(c.numpy() != c0) for c, c0 in zip(layers[1].cores, cores)]
    assert all(changed)


def test_fused_update_needs_training_and_a_gradient(rng):
    layer = make_layer(rng, sparse=True, learning_rate=0.5)
    before = [c.numpy().copy() for c in layer.cores]
    ids = tf.constant([[1, 2], [3, 4]])
    with tf.GradientTape(persistent=True) as tape:
        inference = tf.reduce_sum(layer(ids, training=False))
        training = tf.reduce_sum(layer(ids, training=True))
    assert tape.gradient(inference, layer.trainable_variables)[0] is None
    layer(ids, training=True)  # a forward without a gradient does not update
    for c, b in zip(layer.cores, before):
        np.testing.assert_array_equal(c.numpy(), b)
    tape.gradient(training, layer.trainable_variables)
    assert any(np.any(c.numpy() != b) for c, b in zip(layer.cores, before))


# --------------------------------------------------------------------------------------
# Cache.
# --------------------------------------------------------------------------------------


def _set_counts(layer, counts: dict):
    keys = np.full(layer.hashtbl_size, -1, np.int64)
    values = np.zeros(layer.hashtbl_size, np.int64)
    keys[: len(counts)] = list(counts)
    values[: len(counts)] = list(counts.values())
    layer.freq_keys.assign(keys)
    layer.freq_counts.assign(values)


def _expected_rows(layer, table, trained: dict):
    """Rows lookups should see: the cores' table with the cached rows' values."""
    table = table.copy()
    for g, row in trained.items():
        table[g] = row
    return table


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_cache_populate_and_repopulate(rng, implementation):
    n = CASES["3cores-d3"][0]
    layer = make_layer(
        rng,
        use_cache=True,
        cache_size=4,
        hashtbl_size=64,
        dtype="float64",
        combiner="sum",
        implementation=implementation,
    )
    table = layer_tables(layer)[0]
    ids = tf.constant(np.arange(n).reshape(-1, 5))
    # Empty cache: every lookup reads the cores.
    np.testing.assert_array_equal(layer.cache_ids.numpy(), [EMPTY] * 4)
    np.testing.assert_allclose(layer(ids).numpy(), table.reshape(-1, 5, 3).sum(1), rtol=1e-12)

    # Counts with ties: 9 and 4 tie at 5 (smaller id first), 30 and 2 tie at 3.
    _set_counts(layer, {9: 5, 17: 8, 4: 5, 30: 3, 2: 3, 40: 1})
    layer.cache_populate()
    np.testing.assert_array_equal(layer.cache_ids.numpy(), [2, 4, 9, 17])
    np.testing.assert_allclose(layer.cache_rows.numpy(), table[[2, 4, 9, 17]], rtol=1e-12)

    # "Train" the cached rows, then repopulate: 4 and 17 stay, 2 and 9 are evicted.
    trained = rng.normal(size=(4, 3))
    layer.cache_rows.assign(trained)
    held = dict(zip([2, 4, 9, 17], trained))
    full = layer.full_weight().numpy()
    np.testing.assert_allclose(full, _expected_rows(layer, table, held), rtol=1e-12)
    np.testing.assert_allclose(
        layer(ids).numpy(),
        _expected_rows(layer, table, held).reshape(-1, 5, 3).sum(1),
        rtol=1e-12,
    )
    _set_counts(layer, {17: 20, 4: 19, 33: 18, 0: 2, 2: 1, 9: 1})
    layer.cache_populate()
    np.testing.assert_array_equal(layer.cache_ids.numpy(), [0, 4, 17, 33])
    rows = layer.cache_rows.numpy()
    np.testing.assert_allclose(rows[1], held[4], rtol=1e-12)  # stayed: moved with its id
    np.testing.assert_allclose(rows[2], held[17], rtol=1e-12)
    np.testing.assert_allclose(rows[[0, 3]], table[[0, 33]], rtol=1e-12)  # new: TT value
    now = {4: held[4], 17: held[17], 0: table[0], 33: table[33]}
    want = _expected_rows(layer, table, now)
    np.testing.assert_allclose(want[[2, 9]], table[[2, 9]])  # evicted: back to the TT value
    np.testing.assert_allclose(layer.full_weight().numpy(), want, rtol=1e-12)
    np.testing.assert_allclose(layer(ids).numpy(), want.reshape(-1, 5, 3).sum(1), rtol=1e-12)
    cached_ids, cached_rows = layer.cache_contents()
    np.testing.assert_array_equal(cached_ids, [0, 4, 17, 33])

    # Fewer candidates than slots: the rest stays empty (zero rows).
    _set_counts(layer, {17: 1})
    layer.cache_populate()
    np.testing.assert_array_equal(layer.cache_ids.numpy(), [17, EMPTY, EMPTY, EMPTY])
    np.testing.assert_allclose(layer.cache_rows.numpy()[0], held[17], rtol=1e-12)
    np.testing.assert_array_equal(layer.cache_rows.numpy()[1:], 0.0)


def test_cache_populate_in_tf_function_and_adagrad_state(rng):
    layer = make_layer(
        rng, use_cache=True, cache_size=3, hashtbl_size=32, sparse=True, optimizer="adagrad"
    )
    _set_counts(layer, {1: 3, 2: 2, 3: 1})
    tf.function(layer.cache_populate)()
    np.testing.assert_array_equal(layer.cache_ids.numpy(), [1, 2, 3])
    layer.cache_rows_accumulator.assign(np.full((3, 3), 7.0))
    _set_counts(layer, {2: 9, 5: 8, 1: 7})
    layer.cache_populate()
    np.testing.assert_array_equal(layer.cache_ids.numpy(), [1, 2, 5])
    np.testing.assert_array_equal(
        layer.cache_rows_accumulator.numpy(), [[7.0] * 3, [7.0] * 3, [0.0] * 3]
    )


def test_table_batched_cache_and_full_weight(rng):
    n, p, q, ranks = CASES["3cores-d3"]
    big_p = math.prod(p)
    layer = make_layer(
        rng,
        cls=TableBatchedTTEmbeddingBag,
        num_tables=2,
        use_cache=True,
        cache_size=2,
        hashtbl_size=32,
        dtype="float64",
    )
    tables = layer_tables(layer)
    _set_counts(layer, {big_p + 5: 4, 5: 3, 6: 1})
    layer.cache_populate()
    np.testing.assert_array_equal(layer.cache_ids.numpy(), [5, big_p + 5])
    np.testing.assert_allclose(layer.cache_rows.numpy(), [tables[0, 5], tables[1, 5]])
    layer.cache_rows.assign([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    full = layer.full_weight().numpy()
    np.testing.assert_array_equal(full[0, 5], [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(full[1, 5], [4.0, 5.0, 6.0])
    full[0, 5], full[1, 5] = tables[0, 5], tables[1, 5]
    np.testing.assert_allclose(full, tables, rtol=1e-12)
    out = layer([tf.ragged.constant([[5, 6]]), tf.ragged.constant([[5]])])
    np.testing.assert_allclose(
        out.numpy(),
        [[[1 + tables[0, 6, 0], 2 + tables[0, 6, 1], 3 + tables[0, 6, 2]]], [[4.0, 5.0, 6.0]]],
    )


@needs_cache_count
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_ids_are_counted_in_training_calls_only(rng, implementation):
    layer = make_layer(
        rng,
        use_cache=True,
        cache_size=2,
        hashtbl_size=64,
        padding_id=-1,
        implementation=implementation,
    )
    a = np.array([[1, 1, 7, -1], [7, 7, 3, 2]])
    b = tf.ragged.constant([[3], [], [49, 1, -1]], dtype=tf.int64)
    layer(tf.constant(a), training=True)
    layer(b, training=True)
    layer(tf.constant(a), training=False)
    layer(tf.constant(a))  # training unset: not a training call
    tf.function(lambda x: layer(x, training=True))(b)
    counts = dict(zip(layer.freq_keys.numpy().tolist(), layer.freq_counts.numpy().tolist()))
    counts.pop(-1, None)
    assert counts == {1: 4, 7: 3, 3: 3, 2: 1, 49: 2}
    layer.cache_populate()
    np.testing.assert_array_equal(layer.cache_ids.numpy(), [1, 3])


@needs_cache_count
def test_fit_with_cache_counts_populates_and_trains(rng):
    n = CASES["3cores-d3"][0]
    keras.utils.set_random_seed(int(rng.integers(2**31)))
    layer = make_layer(rng, use_cache=True, cache_size=5, hashtbl_size=64, combiner="mean")
    inputs = keras.Input(shape=(None,), dtype="int64", ragged=True)
    model = keras.Model(inputs, keras.layers.Dense(1)(layer(inputs)))
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    ids = np.minimum(rng.zipf(1.5, size=240), n) - 1  # 30 distinct ids at most
    ids = np.where(ids < 30, ids, rng.integers(0, 30, size=240))
    x = tf.RaggedTensor.from_row_lengths(ids, [4] * 60)
    y = rng.normal(size=(60, 1)).astype(np.float32)
    model.fit(x, y, batch_size=20, epochs=2, verbose=0, shuffle=False)
    counts = dict(zip(layer.freq_keys.numpy().tolist(), layer.freq_counts.numpy().tolist()))
    counts.pop(-1, None)
    distinct, multiplicity = np.unique(ids, return_counts=True)
    assert counts == dict(zip(distinct.tolist(), (2 * multiplicity).tolist()))
    layer.cache_populate()
    top = sorted(sorted(counts, key=lambda i: (-counts[i], i))[:5])
    np.testing.assert_array_equal(layer.cache_ids.numpy(), top)
    before = layer.cache_rows.numpy().copy()
    losses = model.fit(x, y, batch_size=20, epochs=3, verbose=0).history["loss"]
    assert np.all(np.isfinite(losses))
    assert np.all(np.any(layer.cache_rows.numpy() != before, axis=1))  # cached rows train


def test_cache_errors(rng):
    layer = make_layer(rng)
    with pytest.raises(ValueError, match="use_cache=True"):
        layer.cache_populate()
    cached = make_layer(
        rng, use_cache=True, cache_size=2, hashtbl_size=2, implementation="composite"
    )
    with pytest.raises(ValueError, match="cannot run under XLA"):
        tf.function(lambda x: cached(x, training=True), jit_compile=True)(tf.constant([[1]]))


# --------------------------------------------------------------------------------------
# Training with Keras optimizers.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls", [TTEmbeddingBag, TableBatchedTTEmbeddingBag], ids=["single", "batched"]
)
@pytest.mark.parametrize("sparse", [False, True], ids=["keras_optimizer", "fused"])
def test_fit_reduces_the_loss(rng, cls, sparse):
    keras.utils.set_random_seed(int(rng.integers(2**31)))
    n = 60
    args = (2,) if cls is TableBatchedTTEmbeddingBag else ()
    layer = cls(
        *args,
        n,
        4,
        tt_ranks=[3],
        tt_p_shapes=[6, 10],
        combiner="mean",
        sparse=sparse,
        learning_rate=0.5,
    )
    shape = (2, 4) if args else (4,)
    inputs = keras.Input(shape=shape, dtype="int64")
    bags = layer(inputs if not args else keras.ops.transpose(inputs, [1, 0, 2]))
    if args:
        bags = keras.ops.transpose(bags, [1, 0, 2])
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(bags)))
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    x = rng.integers(0, n, size=(96,) + shape)
    teacher = rng.normal(size=n)
    y = teacher[x].mean(axis=-1).reshape(96, -1).sum(axis=1, keepdims=True)
    before = [c.numpy().copy() for c in layer.cores]
    losses = model.fit(x, y, batch_size=32, epochs=10, verbose=0).history["loss"]
    assert losses[-1] < losses[0], losses
    assert all(np.any(c.numpy() != b) for c, b in zip(layer.cores, before))


# --------------------------------------------------------------------------------------
# Mixed precision, tf.function, XLA.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy,compute_dtype", [("mixed_float16", tf.float16), ("mixed_bfloat16", tf.bfloat16)]
)
@pytest.mark.parametrize(
    "cls", [TTEmbeddingBag, TableBatchedTTEmbeddingBag], ids=["single", "batched"]
)
def test_mixed_precision(rng, global_policy, policy, compute_dtype, cls):
    reference_layer = make_layer(rng, "2cores-d33", cls, num_tables=2, combiner="sqrtn")
    ids = tf.constant(rng.integers(0, 20, size=(2, 5, 3) if cls is not TTEmbeddingBag else (5, 3)))
    weights = tf.constant(rng.uniform(0.5, 1.5, size=ids.shape), tf.float16)
    want = reference_layer(ids, tf.cast(weights, tf.float32)).numpy()
    global_policy(policy)
    layer = make_layer(
        rng, "2cores-d33", cls, num_tables=2, combiner="sqrtn", sparse=policy == "mixed_bfloat16"
    )
    for core, value in zip(layer.cores, reference_layer.cores):
        core.assign(value)
    assert all(c.dtype == "float32" for c in layer.cores)
    with tf.GradientTape() as tape:
        out = layer(ids, weights, training=True)
        loss = tf.reduce_sum(tf.cast(out, tf.float32) ** 2)
    assert out.dtype == compute_dtype
    np.testing.assert_allclose(tf.cast(out, tf.float32).numpy(), want, rtol=2e-2, atol=2e-2)
    grads = tape.gradient(loss, layer.trainable_variables)
    assert all(g is not None and g.dtype == tf.float32 for g in grads)


def test_sparse_refuses_mixed_float16(global_policy):
    global_policy("mixed_float16")
    with pytest.raises(ValueError, match="loss scaling of the mixed_float16 policy"):
        TTEmbeddingBag(10, 4, 2, sparse=True)
    TTEmbeddingBag(10, 4, 2, sparse=True, dtype="float32")


@pytest.mark.parametrize(
    "cls", [TTEmbeddingBag, TableBatchedTTEmbeddingBag], ids=["single", "batched"]
)
def test_jit_compile_uses_the_composite(rng, cls):
    layer = make_layer(
        rng, "4cores-d8", cls, num_tables=2, combiner="mean", implementation="auto", padding_id=-1
    )
    shape = (2, 6, 3) if cls is TableBatchedTTEmbeddingBag else (6, 3)
    ids = tf.constant(dense_bags(rng, shape, 100, tf.int64, padding_id=-1).ids)
    up = tf.constant(rng.normal(size=shape[:-1] + (8,)), tf.float32)

    def step(ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(ids) * up)
        return loss, [tf.convert_to_tensor(g) for g in tape.gradient(loss, layer.cores)]

    jitted = tf.function(step, jit_compile=True)
    loss, grads = jitted(ids)
    eager_loss, eager_grads = step(ids)
    np.testing.assert_allclose(loss.numpy(), eager_loss.numpy(), rtol=1e-5)
    for g, e in zip(grads, eager_grads):
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-5, atol=1e-6)
    graph = jitted.get_concrete_function(ids).graph.as_graph_def()
    op_types = {node.op for node in graph.node}
    for fn in graph.library.function:
        op_types.update(node.op for node in fn.node_def)
    assert not [t for t in op_types if t.startswith("TfTtemb")]


def test_supports_jit_flags():
    assert TTEmbeddingBag(10, 4, 2, implementation="composite").supports_jit is True
    assert TTEmbeddingBag(10, 4, 2).supports_jit is False
    assert (
        TTEmbeddingBag(
            10, 4, 2, implementation="composite", use_cache=True, cache_size=1, hashtbl_size=1
        ).supports_jit
        is False
    )


# --------------------------------------------------------------------------------------
# Serialization and export.
# --------------------------------------------------------------------------------------

FULL_CONFIG = dict(
    num_embeddings=50,
    embedding_dim=6,
    tt_ranks=[3, 2],
    tt_p_shapes=[2, 5, 5],
    tt_q_shapes=[1, 2, 3],
    combiner="sqrtn",
    padding_id=0,
    sparse=True,
    optimizer="adagrad",
    learning_rate=0.25,
    eps=1e-6,
    use_cache=True,
    cache_size=3,
    hashtbl_size=32,
    weight_dist="normal",
    seed=5,
    implementation="composite",
)


@pytest.mark.parametrize(
    "cls", [TTEmbeddingBag, TableBatchedTTEmbeddingBag], ids=["single", "batched"]
)
def test_get_config_from_config(rng, cls):
    kwargs = dict(FULL_CONFIG, **({"num_tables": 2} if cls is TableBatchedTTEmbeddingBag else {}))
    layer = cls(**kwargs)
    config = layer.get_config()
    for key, value in kwargs.items():
        assert config[key] == value, key
    clone = cls.from_config(config)
    assert clone.get_config() == config
    again = keras.layers.deserialize(keras.layers.serialize(layer))
    assert type(again) is cls and again.get_config() == config
    ids = tf.constant(rng.integers(0, 50, size=(2, 4, 3) if "num_tables" in kwargs else (4, 3)))
    # Same seed, same cores. implementation="composite": on a GPU TensorFlow's segment sum
    # adds with float atomics, so two runs may differ in the last bit.
    np.testing.assert_allclose(layer(ids).numpy(), clone(ids).numpy(), rtol=1e-6, atol=1e-7)


def test_default_config():
    config = TTEmbeddingBag(1000, 16, 8).get_config()
    assert config["tt_p_shapes"] == [10, 10, 10] and config["tt_ranks"] == [8, 8]
    assert math.prod(config["tt_q_shapes"]) == 16
    assert config["combiner"] == "sum" and config["padding_id"] is None
    assert config["sparse"] is False and config["use_cache"] is False
    assert config["weight_dist"] == "approx-uniform" and config["implementation"] == "auto"
    assert "num_tables" not in config


def test_keras_file_round_trip(rng, tmp_path):
    ids_in = keras.Input(shape=(None,), dtype="int64", ragged=True)
    tables_in = keras.Input(shape=(2, 3), dtype="int64")
    single = TTEmbeddingBag(**FULL_CONFIG, name="single")
    batched = TableBatchedTTEmbeddingBag(
        2, 30, 4, [2], combiner="mean", name="batched", use_cache=True, cache_size=2, hashtbl_size=8
    )
    flat = keras.layers.Flatten()(
        keras.ops.transpose(batched(keras.ops.transpose(tables_in, [1, 0, 2])), [1, 0, 2])
    )
    model = keras.Model([ids_in, tables_in], keras.layers.Concatenate()([single(ids_in), flat]))
    for layer in (single, batched):
        _set_counts(layer, {1: 3, 2: 2, 3: 1})
        layer.cache_populate()
        layer.cache_rows.assign(rng.normal(size=layer.cache_rows.shape))
    x = [
        tf.ragged.constant([[1, 2, 0], [], [49]], dtype=tf.int64),
        tf.constant(rng.integers(0, 30, size=(3, 2, 3))),
    ]
    want = model(x).numpy()
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    for name in ("single", "batched"):
        original, restored = model.get_layer(name), loaded.get_layer(name)
        assert type(restored) is type(original)
        assert restored.get_config() == original.get_config()
        for a, b in zip(original.weights, restored.weights):
            assert a.name == b.name
            np.testing.assert_array_equal(a.numpy(), b.numpy())
    np.testing.assert_array_equal(loaded(x).numpy(), want)


SERVE = """
    import json, sys
    import numpy as np
    import tensorflow as tf
    import tf_ttemb  # registers the ops the SavedModel uses

    path, values_file, splits_file, dense_file = sys.argv[1:]
    loaded = tf.saved_model.load(path)
    ragged = tf.RaggedTensor.from_row_splits(np.load(values_file), np.load(splits_file))
    print(json.dumps({
        "single": loaded.serve_single(ragged).numpy().tolist(),
        "batched": loaded.serve_batched(tf.constant(np.load(dense_file))).numpy().tolist(),
    }))
"""


@pytest.mark.slow
def test_saved_model_served_in_fresh_process(rng, tmp_path):
    single = make_layer(
        rng,
        "3cores-d3",
        combiner="mean",
        padding_id=-1,
        use_cache=True,
        cache_size=2,
        hashtbl_size=8,
    )
    _set_counts(single, {4: 2, 9: 1})
    single.cache_populate()
    single.cache_rows.assign(rng.normal(size=(2, 3)))
    batched = make_layer(rng, "2cores-d33", TableBatchedTTEmbeddingBag, num_tables=2, sparse=True)

    class Serving(tf.Module):
        def __init__(self):
            super().__init__()
            self.single, self.batched = single, batched

        @tf.function(input_signature=[tf.RaggedTensorSpec([None, None], tf.int64)])
        def serve_single(self, ids):
            return self.single(ids, training=False)

        @tf.function(input_signature=[tf.TensorSpec([2, None, 3], tf.int64)])
        def serve_batched(self, ids):
            return self.batched(ids, training=False)

    path = tmp_path / "saved_model"
    tf.saved_model.save(Serving(), str(path))
    ragged = ragged_bags(rng, [3, 0, 5, 1], 50, tf.int64, padding_id=-1)
    ragged.ids = tf.RaggedTensor.from_row_splits(
        tf.concat([[4, 9], ragged.ids.flat_values[2:]], 0), ragged.ids.row_splits
    )
    dense = rng.integers(0, 20, size=(2, 4, 3))
    files = [tmp_path / f for f in ("values.npy", "splits.npy", "dense.npy")]
    np.save(files[0], ragged.ids.flat_values.numpy())
    np.save(files[1], ragged.ids.row_splits.numpy())
    np.save(files[2], dense)
    got = json.loads(run_fresh_python(SERVE, str(path), *map(str, files)))
    np.testing.assert_allclose(got["single"], single(ragged.ids).numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(
        got["batched"], batched(tf.constant(dense)).numpy(), rtol=1e-6, atol=1e-7
    )


# --------------------------------------------------------------------------------------
# Constructor validation and docs.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (dict(num_embeddings=0), r"num_embeddings must be an integer >= 1, got 0"),
        (dict(embedding_dim=-2), r"embedding_dim must be an integer >= 1, got -2"),
        (dict(tt_ranks=0), r"tt_ranks must be a positive integer .* got 0"),
        (
            dict(tt_p_shapes=[10, 10], tt_ranks=[2, 2]),
            r"tt_ranks must have 1 entries for 2 cores, got \[2, 2\]",
        ),
        (dict(tt_p_shapes=[2, 3]), r"prod\(tt_p_shapes\) = 6 must be >= num_embeddings = 100"),
        (dict(tt_q_shapes=[2, 3, 1]), r"prod\(tt_q_shapes\) = 6 must equal embedding_dim = 8"),
        (dict(combiner="avg"), r"combiner must be one of .* got 'avg'"),
        (dict(padding_id=100), r"padding_id must be None, -1 or .* got 100"),
        (dict(padding_id=-3), r"padding_id must be None, -1 or .* got -3"),
        (dict(optimizer="adam"), r"optimizer must be one of 'sgd', 'adagrad', got 'adam'"),
        (dict(learning_rate=0), r"learning_rate must be a positive number, got 0"),
        (dict(eps=-1.0), r"eps must be a non-negative number, got -1.0"),
        (dict(use_cache=True), r"use_cache=True needs cache_size >= 1, got 0"),
        (
            dict(use_cache=True, cache_size=8, hashtbl_size=4),
            r"hashtbl_size >= cache_size = 8 .* got 4",
        ),
        (dict(cache_size=-1), r"cache_size must be an integer >= 0, got -1"),
        (dict(weight_dist="gaussian"), r"weight_dist must be one of .* got 'gaussian'"),
        (dict(seed=-1), r"seed must be an integer >= 0, got -1"),
        (dict(implementation="fast"), r"implementation must be one of .* got 'fast'"),
        (dict(num_tables=0), r"num_tables must be an integer >= 1, got 0"),
    ],
    ids=lambda v: None if isinstance(v, str) else "-".join(f"{k}={v[k]}" for k in v),
)
def test_constructor_validation(kwargs, pattern):
    args = dict(num_embeddings=100, embedding_dim=8, tt_ranks=2)
    args.update(kwargs)
    cls = TableBatchedTTEmbeddingBag if "num_tables" in args else TTEmbeddingBag
    with pytest.raises(ValueError, match=pattern):
        cls(**args)


def test_layer_rejects_weights_with_max(rng):
    layer = make_layer(rng, combiner="max")
    with pytest.raises(ValueError, match="max"):
        layer(tf.constant([[1, 2]]), tf.ones([1, 2]))


def test_docstring_examples():
    result = doctest.testmod(tt_layers, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0
