"""tf_ttemb.layers.ProductKeyMemory against a float64 numpy re-implementation of PKM.

The reference below is written from the algorithm (Lample et al. 2019), not from the
layer: query = BatchNorm(x W + b); per head, each half of the query scored against its
own sub-keys, the best knn of each half, the best knn of the knn x knn sums, a softmax,
slot = i1 * n_keys + i2, output = sum of weight * value over heads and slots. Gradients
are checked against central finite differences of the reference.
"""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
import reference
import tensorflow as tf
from processes import served_in_fresh_process

from tf_ttemb.layers import ProductKeyMemory
from tf_ttemb.layers.product_key_memory import MemoryStats, memory_usage

EPS_BN = 1e-5
SMALL = dict(n_keys=6, k_dim=6, heads=2, knn=3)  # finite-difference shapes
MEDIUM = dict(n_keys=16, k_dim=8, heads=2, knn=4)


@pytest.fixture
def global_policy():
    """Sets the global dtype policy for one test and always restores the previous one."""
    previous = keras.config.dtype_policy()
    yield keras.config.set_dtype_policy
    keras.config.set_dtype_policy(previous)


# --------------------------------------------------------------------------------------
# The float64 reference.
# --------------------------------------------------------------------------------------

WEIGHT_NAMES = ("query_kernel", "query_bias", "keys", "values")
BN_NAMES = ("query_bn_gamma", "query_bn_beta", "query_bn_moving_mean", "query_bn_moving_variance")


def layer_weights64(layer) -> dict:
    names = WEIGHT_NAMES + (BN_NAMES if layer.query_batchnorm else ())
    return {name: np.asarray(getattr(layer, name).numpy(), np.float64) for name in names}


def _top(scores, k):
    """Indices of the k largest along the last axis, best first (ties: lower index first)."""
    return np.argsort(-scores, axis=-1, kind="stable")[..., :k]


def pkm_reference(w, x, mask, cfg, training):
    """Forward pass of a product-key memory in float64.

    Returns a dict: out [..., v], ids / weights [..., heads * knn] (-1 / 0 for masked
    tokens), margin [...] (per token, the smallest gap between consecutive scores among
    the best knn + 1 of all n_keys**2 slots, over heads: selections are stable under
    perturbations well below it), and the moving statistics after the call.
    """
    n, k_dim, heads, knn = cfg["n_keys"], cfg["k_dim"], cfg["heads"], cfg["knn"]
    half = k_dim // 2
    lead = x.shape[:-1]
    xs = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    tokens = xs.shape[0]
    live = np.ones(tokens, bool) if mask is None else np.asarray(mask, bool).reshape(-1)
    q = xs @ w["query_kernel"] + w["query_bias"]
    result = {}
    if cfg.get("query_batchnorm", True):
        mean, var = w["query_bn_moving_mean"], w["query_bn_moving_variance"]
        if training:
            count = int(live.sum())
            if count:
                batch_mean = q[live].mean(axis=0)
                batch_var = q[live].var(axis=0)
                unbiased = batch_var * count / max(count - 1, 1)
                result["moving_mean"] = 0.9 * mean + 0.1 * batch_mean
                result["moving_variance"] = 0.9 * var + 0.1 * unbiased
                mean, var = batch_mean, batch_var
            else:
                result["moving_mean"], result["moving_variance"] = mean, var
        q = (q - mean) / np.sqrt(var + EPS_BN) * w["query_bn_gamma"] + w["query_bn_beta"]
    q = q.reshape(tokens, heads, k_dim)
    keys = w["keys"]  # [heads, 2, n, half]
    s1 = np.einsum("thd,hnd->thn", q[..., :half], keys[:, 0])
    s2 = np.einsum("thd,hnd->thn", q[..., half:], keys[:, 1])
    # The product-key search: best knn per half, then best knn of the knn x knn sums.
    a = _top(s1, knn)  # [T, H, knn]
    b = _top(s2, knn)
    cand = np.take_along_axis(s1, a, -1)[..., :, None] + np.take_along_axis(s2, b, -1)[..., None, :]
    cand = cand.reshape(tokens, heads, knn * knn)
    pick = _top(cand, knn)
    scores = np.take_along_axis(cand, pick, -1)
    ids = np.take_along_axis(a, pick // knn, -1) * n + np.take_along_axis(b, pick % knn, -1)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    # Margins from all n**2 slots.
    every = np.sort((s1[..., :, None] + s2[..., None, :]).reshape(tokens, heads, n * n), -1)
    best = every[..., ::-1][..., : knn + 1]
    gaps = -np.diff(best, axis=-1) if best.shape[-1] > 1 else np.full(best.shape, np.inf)
    margin = gaps.min(axis=(-1, -2))
    ids = ids.reshape(tokens, heads * knn)
    weights = weights.reshape(tokens, heads * knn)
    out = np.einsum("tj,tjd->td", weights, w["values"][ids])
    ids = np.where(live[:, None], ids, -1)
    weights = np.where(live[:, None], weights, 0.0)
    out = np.where(live[:, None], out, 0.0)
    margin = np.where(live, margin, np.inf)
    bag = heads * knn
    result.update(
        out=out.reshape(lead + (-1,)),
        ids=ids.reshape(lead + (bag,)),
        weights=weights.reshape(lead + (bag,)),
        margin=margin.reshape(lead),
    )
    return result


def brute_force_top(q_flat, keys, n, knn):
    """Best knn of all n**2 slots per token and head, scored directly: (ids, scores)."""
    half = keys.shape[-1]
    heads = keys.shape[0]
    q = q_flat.reshape(q_flat.shape[0], heads, 2 * half)
    slots = np.arange(n * n)
    full_keys = np.concatenate([keys[:, 0][:, slots // n], keys[:, 1][:, slots % n]], -1)
    scores = np.einsum("thd,hsd->ths", q, full_keys)  # [T, H, n**2]
    top = _top(scores, knn)
    return top, np.take_along_axis(scores, top, -1)


def make_layer(rng, d_in, dtype="float32", bn_random=True, **kwargs):
    """A built layer with random weights (moving statistics too, so inference is non-trivial)."""
    cfg = dict(MEDIUM)
    cfg.update(kwargs)
    layer = ProductKeyMemory(dtype=dtype, **cfg)
    layer.build((None, d_in))
    if layer.query_batchnorm and bn_random:
        size = layer.heads * layer.k_dim
        layer.query_bn_gamma.assign(rng.uniform(0.5, 1.5, size))
        layer.query_bn_beta.assign(rng.normal(0, 0.2, size))
        layer.query_bn_moving_mean.assign(rng.normal(0, 0.3, size))
        layer.query_bn_moving_variance.assign(rng.uniform(0.3, 0.8, size))
    return layer


def cfg_of(layer) -> dict:
    return dict(
        n_keys=layer.n_keys,
        k_dim=layer.k_dim,
        heads=layer.heads,
        knn=layer.knn,
        query_batchnorm=layer.query_batchnorm,
    )


def clear_inputs(rng, layer, shape, mask=None, training=False, min_margin=1e-3, tries=50):
    """Random inputs whose selections all have margins >= min_margin (stable under FD)."""
    for _ in range(tries):
        x = rng.normal(size=shape)
        ref = pkm_reference(layer_weights64(layer), x, mask, cfg_of(layer), training)
        if ref["margin"].min() >= min_margin:
            return x
    raise AssertionError("no inputs with clear selection margins found")


def close(got, want, rtol, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(float(np.abs(want).max()), 1e-30) if want.size else 1.0
    np.testing.assert_allclose(got, want, rtol=0, atol=rtol * scale, err_msg=what)


# --------------------------------------------------------------------------------------
# Forward against the reference.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("query_batchnorm", [True, False], ids=["bn", "no_bn"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_forward_matches_reference(rng, dtype, query_batchnorm, training):
    layer = make_layer(rng, 10, dtype, query_batchnorm=query_batchnorm)
    weights = layer_weights64(layer)
    x = rng.normal(size=(4, 6, 10))
    ref = pkm_reference(weights, x, None, cfg_of(layer), training)
    ids, probs = layer.lookup(tf.constant(x, dtype), training=False)
    out = layer(tf.constant(x, dtype), training=training)
    assert out.shape == (4, 6, layer.value_dim) and out.dtype == dtype
    # Selections can only flip where the reference's scores nearly tie.
    clear = ref["margin"] > (1e-9 if dtype == "float64" else 1e-4)
    assert clear.mean() > 0.8, clear.mean()
    rtol = 1e-10 if dtype == "float64" else 2e-5
    close(out.numpy()[clear], ref["out"][clear], rtol, "output")
    if not training:
        np.testing.assert_array_equal(ids.numpy()[clear], ref["ids"][clear])
        close(probs.numpy()[clear], ref["weights"][clear], rtol, "weights")
        assert ids.dtype == tf.int32
        assert probs.dtype == (tf.float64 if dtype == "float64" else tf.float32)
    if training and query_batchnorm:
        close(layer.query_bn_moving_mean.numpy(), ref["moving_mean"], rtol, "moving mean")
        close(layer.query_bn_moving_variance.numpy(), ref["moving_variance"], rtol, "moving var")


@pytest.mark.parametrize(
    "n_keys,knn", [(8, 1), (8, 3), (8, 8), (12, 5), (5, 4)], ids=lambda v: str(v)
)
def test_product_search_is_exact(rng, n_keys, knn):
    """The two-stage search returns the best knn of all n_keys**2 slots, in order."""
    layer = make_layer(
        rng, 7, "float64", n_keys=n_keys, knn=knn, heads=3, k_dim=6, query_batchnorm=False
    )
    x = rng.normal(size=(20, 7))
    ids, probs = layer.lookup(tf.constant(x))
    q = x @ layer.query_kernel.numpy() + layer.query_bias.numpy()
    top, scores = brute_force_top(q, layer.keys.numpy(), n_keys, knn)
    np.testing.assert_array_equal(ids.numpy(), top.reshape(20, -1))
    soft = np.exp(scores - scores.max(-1, keepdims=True))
    soft /= soft.sum(-1, keepdims=True)
    close(probs.numpy(), soft.reshape(20, -1), 1e-12, "softmax weights")
    np.testing.assert_allclose(probs.numpy().reshape(20, 3, knn).sum(-1), 1.0, rtol=1e-12)


def test_one_memory_read_per_call(rng):
    layer = make_layer(rng, 10)
    graph = tf.function(layer).get_concrete_function(tf.TensorSpec([None, 7, 10])).graph
    reads = [op for op in graph.get_operations() if "GatherReduceSum" in op.type]
    assert len(reads) == 1, [op.type for op in reads]


@pytest.mark.parametrize(
    "shape", [(10,), (7, 10), (2, 3, 4, 10), (0, 5, 10)], ids=["1d", "2d", "4d", "empty"]
)
def test_extra_batch_dims(rng, shape):
    layer = make_layer(rng, 10, output_dim=3)
    x = rng.normal(size=shape).astype(np.float32)
    out = layer(x)
    assert out.shape == shape[:-1] + (3,)
    flat = layer(x.reshape(-1, 10))
    np.testing.assert_array_equal(out.numpy().reshape(-1, 3), flat.numpy())
    ids, _ = layer.lookup(x)
    assert ids.shape == shape[:-1] + (layer.heads * layer.knn,)
    assert layer.compute_output_shape(shape) == shape[:-1] + (3,)


def test_dynamic_shapes_in_tf_function(rng):
    layer = make_layer(rng, 10)
    fn = tf.function(layer, input_signature=[tf.TensorSpec([None, None, 10])])
    for shape in [(2, 5, 10), (3, 1, 10)]:
        x = rng.normal(size=shape).astype(np.float32)
        np.testing.assert_allclose(fn(x).numpy(), layer(x).numpy(), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------
# Gradients against finite differences of the reference.
# --------------------------------------------------------------------------------------


def _layer_gradients(layer, x, mask, upstream, training=True):
    x = tf.constant(x, layer.compute_dtype)
    variables = [layer.query_kernel, layer.keys, layer.values]
    with tf.GradientTape() as tape:
        tape.watch(x)
        out = layer(x, training=training, mask=mask)
        loss = tf.reduce_sum(tf.cast(out, tf.float64) * upstream)
    return tape.gradient(loss, [x] + variables)


def _reference_gradients(layer, x, mask, upstream, training=True):
    weights = layer_weights64(layer)
    cfg = cfg_of(layer)

    def loss_of(name):
        def loss(value):
            if name == "x":
                return float(
                    np.sum(pkm_reference(weights, value, mask, cfg, training)["out"] * upstream)
                )
            changed = dict(weights, **{name: value})
            return float(np.sum(pkm_reference(changed, x, mask, cfg, training)["out"] * upstream))

        return loss

    return [reference.finite_difference(loss_of("x"), x.copy())] + [
        reference.finite_difference(loss_of(name), weights[name].copy())
        for name in ("query_kernel", "keys", "values")
    ]


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_gradients_match_finite_differences(rng, dtype, masked):
    layer = make_layer(rng, 5, dtype, output_dim=4, **SMALL)
    mask = None
    if masked:
        mask = np.array([[True, False, True, True], [False, True, True, False]])
    x = clear_inputs(rng, layer, (2, 4, 5), mask, training=True)
    upstream = rng.normal(size=(2, 4, 4))
    got = _layer_gradients(layer, x, mask, upstream)
    want = _reference_gradients(layer, x, mask, upstream)
    rtol = 1e-7 if dtype == "float64" else 2e-3
    names = ("inputs", "query_kernel", "keys", "values")
    for name, g, expected in zip(names, got, want):
        close(tf.convert_to_tensor(g).numpy(), expected, rtol, f"gradient w.r.t. {name}")
    values_grad = got[-1]
    assert isinstance(values_grad, tf.IndexedSlices)
    ref = pkm_reference(layer_weights64(layer), x, mask, cfg_of(layer), True)
    read = np.unique(ref["ids"][ref["ids"] >= 0])
    np.testing.assert_array_equal(values_grad.indices.numpy(), read)
    if masked:
        assert np.all(got[0].numpy()[~mask] == 0)


@pytest.mark.parametrize("implementation", ["custom_op", "composite"])
def test_dense_grad(rng, implementation):
    dense = make_layer(rng, 6, dense_grad=True, implementation=implementation)
    sparse = make_layer(rng, 6, implementation=implementation)
    sparse.set_weights(dense.get_weights())
    x = tf.constant(rng.normal(size=(5, 6)), tf.float32)
    upstream = tf.constant(rng.normal(size=(5, 6)), tf.float32)
    grads = []
    for layer in (dense, sparse):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(x) * upstream)
        grads.append(tape.gradient(loss, layer.values))
    assert isinstance(grads[0], tf.Tensor) and grads[0].shape == (256, 6)
    assert isinstance(grads[1], tf.IndexedSlices)
    np.testing.assert_allclose(
        grads[0].numpy(), tf.convert_to_tensor(grads[1]).numpy(), rtol=1e-6, atol=1e-7
    )


def test_implementations_agree_in_graph_mode(rng):
    custom = make_layer(rng, 8, implementation="custom_op")
    composite = make_layer(rng, 8, implementation="composite")
    composite.set_weights(custom.get_weights())
    x = tf.constant(rng.normal(size=(3, 5, 8)), tf.float32)
    upstream = tf.constant(rng.normal(size=(3, 5, 8)), tf.float32)

    def step(layer):
        @tf.function
        def run(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                out = layer(x, training=True)
            return out, tape.gradient(out, [x, layer.keys, layer.values], upstream)

        return run(x)

    for got, want in zip(tf.nest.flatten(step(composite)), tf.nest.flatten(step(custom))):
        close(tf.convert_to_tensor(got).numpy(), tf.convert_to_tensor(want).numpy(), 1e-5, "")


# --------------------------------------------------------------------------------------
# Masking.
# --------------------------------------------------------------------------------------


def test_masked_tokens_neither_read_nor_update(rng):
    """With a mask, live tokens behave exactly as if the padded ones were not there."""
    layer = make_layer(rng, 8)
    alone = make_layer(rng, 8)
    alone.set_weights(layer.get_weights())
    x = rng.normal(size=(3, 5, 8)).astype(np.float32)
    mask = rng.random((3, 5)) < 0.6
    mask[0, 0] = True
    x[~mask] = 1e3  # padding with wild values must not matter
    upstream = rng.normal(size=(3, 5, 8)).astype(np.float32)
    with tf.GradientTape(persistent=True) as tape:
        xt = tf.constant(x)
        live_x = tf.constant(x[mask])
        tape.watch([xt, live_x])
        out = layer(xt, training=True, mask=tf.constant(mask))
        out_alone = alone(live_x, training=True)
        loss = tf.reduce_sum(out * upstream)
        loss_alone = tf.reduce_sum(out_alone * upstream[mask])
    np.testing.assert_allclose(out.numpy()[mask], out_alone.numpy(), rtol=1e-5, atol=1e-6)
    assert np.all(out.numpy()[~mask] == 0)
    for a, b in zip(layer.non_trainable_weights, alone.non_trainable_weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-7)
    grads = tape.gradient(loss, [xt] + layer.trainable_weights)
    grads_alone = tape.gradient(loss_alone, [live_x] + alone.trainable_weights)
    assert np.all(grads[0].numpy()[~mask] == 0)
    np.testing.assert_allclose(grads[0].numpy()[mask], grads_alone[0].numpy(), rtol=1e-4, atol=1e-6)
    for g, h in zip(grads[1:], grads_alone[1:]):
        np.testing.assert_allclose(
            tf.convert_to_tensor(g).numpy(), tf.convert_to_tensor(h).numpy(), rtol=1e-4, atol=1e-6
        )
    ids, weights = layer.lookup(x, mask=mask)
    assert np.all(ids.numpy()[~mask] == -1) and np.all(weights.numpy()[~mask] == 0)
    assert np.all(ids.numpy()[mask] >= 0)


def test_fully_masked_batch(rng):
    layer = make_layer(rng, 8)
    before = [w.numpy().copy() for w in layer.non_trainable_weights]
    x = tf.constant(rng.normal(size=(2, 3, 8)), tf.float32)
    with tf.GradientTape() as tape:
        tape.watch(x)
        out = layer(x, training=True, mask=tf.zeros([2, 3], tf.bool))
        loss = tf.reduce_sum(out)
    assert np.all(out.numpy() == 0)
    for b, w in zip(before, layer.non_trainable_weights):
        np.testing.assert_array_equal(w.numpy(), b)
    grads = tape.gradient(loss, [x] + layer.trainable_weights)
    for g in grads:
        g = tf.convert_to_tensor(g).numpy()
        assert np.all(g == 0), g


def test_keras_mask_is_used_and_passed_on(rng):
    keras.utils.set_random_seed(int(rng.integers(2**31)))
    tokens = keras.Input(shape=(None,), dtype="int32")
    embedding = keras.layers.Embedding(30, 8, mask_zero=True)
    pkm = ProductKeyMemory(n_keys=8, k_dim=4, heads=2, knn=2)
    hidden = embedding(tokens)
    model = keras.Model(tokens, pkm(hidden))
    ids = np.array([[3, 4, 5, 0, 0], [7, 0, 0, 0, 0]], np.int32)
    out = model(ids).numpy()
    explicit = pkm(embedding(ids), mask=ids != 0).numpy()
    np.testing.assert_array_equal(out, explicit)
    assert np.all(out[ids == 0] == 0) and np.all(np.any(out[ids != 0] != 0, axis=-1))
    assert pkm.supports_masking
    np.testing.assert_array_equal(np.asarray(pkm.compute_mask(embedding(ids), ids != 0)), ids != 0)


def test_mask_shape_error(rng):
    layer = make_layer(rng, 8)
    with pytest.raises(ValueError, match=r"mask must have the shape .*\(2, 3\).*\(2, 4\)"):
        layer(tf.zeros([2, 3, 8]), mask=tf.ones([2, 4], tf.bool))


# --------------------------------------------------------------------------------------
# Memory statistics.
# --------------------------------------------------------------------------------------


def _stats_by_hand(ids, weights, num_slots):
    totals = {}
    for i, w in zip(np.ravel(ids), np.ravel(weights)):
        if i >= 0:
            totals[int(i)] = totals.get(int(i), 0.0) + float(w)
    total = sum(totals.values())
    kl = sum((t / total) * math.log((t / total) * num_slots) for t in totals.values() if t > 0)
    return len(totals), kl


def test_memory_usage_by_hand(rng):
    ids = rng.integers(-1, 50, size=(40, 6))
    weights = rng.random((40, 6))
    stats = memory_usage(ids, weights, num_slots=64)
    used, kl = _stats_by_hand(ids, weights, 64)
    assert stats.used_slots == used and stats.num_slots == 64
    assert stats.usage == used / 64 and stats.usage_percent == 100 * used / 64
    assert stats.kl_from_uniform == pytest.approx(kl, rel=1e-12)
    assert stats.tokens == int(np.sum(np.any(ids >= 0, axis=1)))
    assert stats.selections == int(np.sum(ids >= 0))
    assert stats.as_dict()["usage_percent"] == stats.usage_percent


def test_memory_usage_extremes():
    uniform = memory_usage(np.arange(16).reshape(4, 4), np.full((4, 4), 0.25), 16)
    assert uniform.usage == 1.0 and uniform.kl_from_uniform == pytest.approx(0.0, abs=1e-12)
    single = memory_usage(np.zeros((3, 2), np.int64), np.ones((3, 2)), 16)
    assert single.used_slots == 1 and single.kl_from_uniform == pytest.approx(math.log(16))


def test_memory_stats_over_data(rng):
    layer = make_layer(rng, 8)
    batches = [rng.normal(size=(3, 7, 8)).astype(np.float32) for _ in range(3)]
    masks = [rng.random((3, 7)) < 0.7 for _ in batches]
    ids = np.concatenate(
        [layer.lookup(b, m)[0].numpy().reshape(-1, 8) for b, m in zip(batches, masks)]
    )
    weights = np.concatenate(
        [layer.lookup(b, m)[1].numpy().reshape(-1, 8) for b, m in zip(batches, masks)]
    )
    want = memory_usage(ids, weights, layer.num_slots)
    got = layer.memory_stats(list(zip(batches, masks)))
    assert got.used_slots == want.used_slots and got.tokens == sum(m.sum() for m in masks)
    assert got.kl_from_uniform == pytest.approx(want.kl_from_uniform, rel=1e-6)
    # A dataset of (x, y) pairs through inputs_fn, and `steps`.
    data = tf.data.Dataset.from_tensor_slices((np.stack(batches), np.zeros(3)))
    unmasked = layer.memory_stats(data, inputs_fn=lambda batch: batch[0])
    assert unmasked.tokens == 3 * 3 * 7
    first = layer.memory_stats(data, steps=1, inputs_fn=lambda batch: batch[0])
    assert first.as_dict() == pytest.approx(layer.memory_stats(batches[0]).as_dict())
    assert isinstance(first, MemoryStats) and first.tokens == 21


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: memory_usage([1, 2], [1.0], 4), r"ids \(2,\) and weights \(1,\)"),
        (lambda: memory_usage([1, 4], [1.0, 1.0], 4), "ids must be < num_slots = 4, got id 4"),
        (lambda: memory_usage([-1, -1], [1.0, 1.0], 4), "got 0 tokens and 0 slot selections"),
        (lambda: memory_usage([0.5], [1.0], 4), "ids must be integers"),
        (lambda: memory_usage([0], [1.0], 0), "num_slots must be an integer >= 1, got 0"),
    ],
    ids=["shape", "range", "empty", "dtype", "num_slots"],
)
def test_memory_usage_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_memory_stats_errors(rng):
    layer = make_layer(rng, 8)
    x = rng.normal(size=(2, 3, 8)).astype(np.float32)
    with pytest.raises(ValueError, match="got 0 tokens"):
        layer.memory_stats((x, np.zeros((2, 3), bool)))
    with pytest.raises(ValueError, match="steps must be an integer >= 1, got 0"):
        layer.memory_stats(x, steps=0)
    with pytest.raises(ValueError, match="got int"):
        layer.memory_stats(3)


# --------------------------------------------------------------------------------------
# Training, XLA, mixed precision, dropout.
# --------------------------------------------------------------------------------------


def _pkm_model(rng, implementation="auto", dense_grad=False, **kwargs):
    keras.utils.set_random_seed(int(rng.integers(2**31)))
    tokens = keras.Input(shape=(6,), dtype="int32")
    hidden = keras.layers.Embedding(40, 8, mask_zero=True, name="embed")(tokens)
    pkm = ProductKeyMemory(
        n_keys=8,
        k_dim=4,
        heads=2,
        knn=2,
        implementation=implementation,
        dense_grad=dense_grad,
        name="pkm",
        **kwargs,
    )
    pooled = keras.layers.GlobalAveragePooling1D()(pkm(hidden))
    return keras.Model(tokens, keras.layers.Dense(1, dtype="float32")(pooled)), pkm


def _token_data(rng, count=48):
    ids = rng.integers(1, 40, size=(count, 6)).astype(np.int32)
    ids[:, 4:] = 0  # padding
    targets = (ids[:, 0] % 3).astype(np.float32)[:, None]
    return ids, targets


@pytest.mark.parametrize(
    "implementation,dense_grad", [("auto", False), ("auto", True), ("composite", False)]
)
def test_fit_updates_only_read_slots(rng, implementation, dense_grad):
    model, pkm = _pkm_model(rng, implementation, dense_grad)
    ids, targets = _token_data(rng)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.5), loss="mse")
    losses = model.fit(ids, targets, batch_size=16, epochs=4, verbose=0, shuffle=False)
    losses = losses.history["loss"]
    assert losses[-1] < losses[0], losses
    # One more step on one batch: exactly the slots its real tokens read change.
    batch, batch_targets = ids[:16], targets[:16]
    hidden = model.get_layer("embed")(batch)
    read, _ = pkm.lookup(hidden, mask=batch != 0, training=True)
    read = np.unique(read.numpy()[read.numpy() >= 0])
    before = pkm.values.numpy().copy()
    model.train_on_batch(batch, batch_targets)
    changed = np.flatnonzero(np.any(pkm.values.numpy() != before, axis=1))
    np.testing.assert_array_equal(changed, read)
    assert 0 < len(read) < pkm.num_slots


def test_jit_compile_uses_composite(rng):
    layer = make_layer(rng, 8)
    x = tf.constant(rng.normal(size=(3, 4, 8)), tf.float32)
    upstream = tf.constant(rng.normal(size=(3, 4, 8)), tf.float32)

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            out = layer(x)
        return out, tape.gradient(out, [x, layer.keys, layer.values], upstream)

    out, grads = tf.function(step, jit_compile=True)(x)
    want_out, want_grads = step(x)
    close(out.numpy(), want_out.numpy(), 1e-5, "output under XLA")
    for got, want in zip(grads, want_grads):
        close(tf.convert_to_tensor(got).numpy(), tf.convert_to_tensor(want).numpy(), 1e-5, "")
    assert isinstance(grads[2], tf.Tensor)  # dense under XLA
    assert isinstance(want_grads[2], tf.IndexedSlices)


def test_jit_support_flags(rng):
    assert ProductKeyMemory(implementation="composite").supports_jit is True
    assert ProductKeyMemory().supports_jit is False
    model, _ = _pkm_model(rng, "composite")
    model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    assert model.jit_compile is True
    ids, targets = _token_data(rng, 16)
    model.fit(ids, targets, batch_size=8, epochs=1, verbose=0)
    model, _ = _pkm_model(rng, "auto")
    with pytest.warns(UserWarning, match="jit_compile"):
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    assert model.jit_compile is False


@pytest.mark.parametrize(
    "policy,compute_dtype", [("mixed_float16", tf.float16), ("mixed_bfloat16", tf.bfloat16)]
)
def test_mixed_precision(rng, global_policy, policy, compute_dtype):
    reference_layer = make_layer(rng, 8)
    x = rng.normal(size=(4, 6, 8)).astype(np.float32)
    mask = rng.random((4, 6)) < 0.8
    want = reference_layer(x, mask=mask).numpy()
    global_policy(policy)
    layer = ProductKeyMemory(**MEDIUM)
    layer.build((None, 8))
    layer.set_weights(reference_layer.get_weights())
    for variable in (layer.keys, layer.values, layer.query_bn_moving_mean):
        assert variable.dtype == "float32"
    ids, weights = layer.lookup(x, mask=mask)
    assert weights.dtype == tf.float32
    out = layer(tf.cast(x, compute_dtype), mask=mask)
    assert out.dtype == compute_dtype
    out = out.numpy().astype(np.float64)
    # The half-precision query can reorder near-ties; compare tokens with the same slots.
    ref_ids = reference_layer.lookup(x, mask=mask)[0].numpy()
    same = np.all(np.sort(ids.numpy(), -1) == np.sort(ref_ids, -1), axis=-1)
    assert same.mean() > 0.5, same.mean()
    np.testing.assert_allclose(out[same], want[same], rtol=0, atol=3e-2 * np.abs(want).max())
    with tf.GradientTape() as tape:
        out = layer(tf.cast(x, compute_dtype), training=True, mask=mask)
        loss = tf.reduce_sum(tf.cast(out, tf.float32) ** 2)
    grads = tape.gradient(loss, layer.trainable_weights)
    for variable, grad in zip(layer.trainable_weights, grads):
        grad = tf.convert_to_tensor(grad)
        assert grad.dtype == tf.float32, variable.name
        assert np.all(np.isfinite(grad.numpy())), variable.name


def test_fit_mixed_float16(rng, global_policy):
    global_policy("mixed_float16")
    model, pkm = _pkm_model(rng)
    ids, targets = _token_data(rng, 32)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.5), loss="mse")
    before = pkm.values.numpy().copy()
    losses = model.fit(ids, targets, batch_size=16, epochs=3, verbose=0).history["loss"]
    assert np.all(np.isfinite(losses))
    assert pkm.values.dtype == "float32" and np.any(pkm.values.numpy() != before)


def test_dropout_only_in_training(rng):
    layer = make_layer(rng, 8, input_dropout=0.3, query_dropout=0.3, value_dropout=0.5)
    plain = make_layer(rng, 8)
    plain.set_weights(layer.get_weights())
    x = rng.normal(size=(4, 5, 8)).astype(np.float32)
    np.testing.assert_array_equal(layer(x).numpy(), plain(x).numpy())
    np.testing.assert_array_equal(layer.lookup(x)[0].numpy(), plain.lookup(x)[0].numpy())
    trained = layer(x, training=True).numpy()
    assert np.mean(trained == 0) > 0.3  # value dropout zeroes about half of the output


# --------------------------------------------------------------------------------------
# Serialization and export.
# --------------------------------------------------------------------------------------

# Each constructor argument the config tests cover: (its value in FULL_CONFIG, its default).
CONFIG_VALUES = {
    "output_dim": (5, None),
    "n_keys": (7, 512),
    "k_dim": (6, 256),
    "heads": (3, 4),
    "knn": (4, 32),
    "query_batchnorm": (False, True),
    "input_dropout": (0.1, 0.0),
    "query_dropout": (0.2, 0.0),
    "value_dropout": (0.3, 0.0),
    "keys_initializer": ("glorot_uniform", None),
    "values_initializer": (keras.initializers.RandomNormal(0, 2.0), None),
    "dense_grad": (True, False),
    "implementation": ("composite", "auto"),
}
FULL_CONFIG = {key: full for key, (full, _) in CONFIG_VALUES.items()}


def test_get_config_from_config(rng):
    layer = ProductKeyMemory(**FULL_CONFIG)
    config = layer.get_config()
    for key, value in FULL_CONFIG.items():
        if not key.endswith("initializer"):
            assert config[key] == value, key
    assert config["keys_initializer"] is not None and config["values_initializer"] is not None
    clone = ProductKeyMemory.from_config(config)
    assert clone.get_config() == config
    again = keras.layers.deserialize(keras.layers.serialize(layer))
    assert isinstance(again, ProductKeyMemory) and again.get_config() == config
    x = rng.normal(size=(3, 8)).astype(np.float32)
    layer(x)
    clone(x)
    clone.set_weights(layer.get_weights())
    # implementation="composite": on a GPU TensorFlow's segment sum adds with float atomics,
    # so two runs may differ in the last bit (bitwise only under op determinism).
    np.testing.assert_allclose(clone(x).numpy(), layer(x).numpy(), rtol=1e-6, atol=1e-6)


def test_default_config():
    config = ProductKeyMemory().get_config()
    assert {k: config[k] for k in CONFIG_VALUES} == {
        key: default for key, (_, default) in CONFIG_VALUES.items()
    }


def test_default_initialisation(rng):
    keras.utils.set_random_seed(int(rng.integers(2**31)))
    layer = ProductKeyMemory(n_keys=64, k_dim=32, heads=2, knn=4)
    layer.build((None, 50))
    keys, values = layer.keys.numpy(), layer.values.numpy()
    assert keys.shape == (2, 2, 64, 16) and values.shape == (4096, 50)
    bound = 1 / math.sqrt(16)
    assert np.abs(keys).max() <= bound and np.abs(keys).max() > 0.95 * bound
    assert values.std() == pytest.approx(50**-0.5, rel=0.03)
    assert np.abs(layer.query_kernel.numpy()).max() <= 1 / math.sqrt(50)
    assert layer.query_bn_moving_variance.numpy().tolist() == [1.0] * 64
    assert [w.name for w in layer.non_trainable_weights] == [
        "query_bn_moving_mean",
        "query_bn_moving_variance",
    ]


def test_keras_file_round_trip(rng, tmp_path):
    model, _ = _pkm_model(rng)
    ids, targets = _token_data(rng, 8)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(ids, targets, epochs=1, verbose=0)  # moving statistics move
    want = model.predict(ids, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.get_layer("pkm"), ProductKeyMemory)
    assert loaded.get_layer("pkm").get_config() == model.get_layer("pkm").get_config()
    np.testing.assert_array_equal(loaded.predict(ids, verbose=0), want)


@pytest.mark.slow
def test_saved_model_served_in_fresh_process(rng, tmp_path):
    model, _ = _pkm_model(rng)
    ids, _ = _token_data(rng, 5)
    want = model(ids).numpy()
    path = tmp_path / "exported"
    model.export(str(path), format="tf_saved_model", verbose=False)
    got = served_in_fresh_process(path, ids, tmp_path)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------
# Constructor and input validation.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(output_dim=0), "output_dim must be an integer >= 1, got 0"),
        (dict(n_keys=0), "n_keys must be an integer >= 1, got 0"),
        (dict(n_keys=2.5), "n_keys must be an integer >= 1, got 2.5"),
        (dict(k_dim=7), "k_dim must be even (it is split in two halves), got 7"),
        (dict(k_dim=-2), "k_dim must be an integer >= 1, got -2"),
        (dict(heads=0), "heads must be an integer >= 1, got 0"),
        (dict(knn=True), "knn must be an integer >= 1, got True"),
        (dict(n_keys=16, knn=17), "knn must be <= n_keys = 16, got knn = 17"),
        (dict(input_dropout=1.0), "input_dropout must be a number in [0, 1), got 1.0"),
        (dict(query_dropout=-0.1), "query_dropout must be a number in [0, 1), got -0.1"),
        (dict(value_dropout="x"), "value_dropout must be a number in [0, 1), got 'x'"),
        (dict(query_batchnorm=1), "query_batchnorm must be True or False, got 1"),
        (dict(dense_grad="yes"), "dense_grad must be True or False, got 'yes'"),
        (dict(implementation="fast"), "implementation must be one of"),
        (dict(keys_initializer="nope"), "nope"),
    ],
    ids=lambda v: None if isinstance(v, dict) else v.split(" ")[0],
)
def test_constructor_validation(kwargs, message):
    with pytest.raises(ValueError) as info:
        ProductKeyMemory(**kwargs)
    assert message in str(info.value), str(info.value)


def test_unknown_input_size():
    layer = ProductKeyMemory(n_keys=8, k_dim=4, knn=2)
    with pytest.raises(ValueError, match=r"known d_in, got shape \(None, None\)"):
        layer.build((None, None))
