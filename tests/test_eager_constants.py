"""The wrapper's eager caches. Its constants (row_splits of dense batches, empty vectors):
a cached tensor is reused only for the same shape, dtype and device, the cache stays
within its byte budget, and lookups of changing dense shapes in one process stay right.
Its remembered forwards (eager lookups of a table tensor by dense [B, L] ids): a call
like an earlier one takes the forward that call chose, and gives the same numbers,
gradients and errors as the full path."""

from __future__ import annotations

import numpy as np
import pytest
import reference
import tensorflow as tf
from bags import (
    DTYPES,
    assert_close,
    dense_bags,
    make_inputs,
    ragged_bags,
    reference_all,
    weights_like,
)
from processes import run_fresh_python

import tf_ttemb
from tf_ttemb.ops import _common
from tf_ttemb.ops import gather_reduce_sum as lookup_module


def test_same_key_reuses_and_graphs_build_their_own():
    first = _common.eager_constant(("test-reuse", 3), "", lambda: tf.range(4))
    again = _common.eager_constant(("test-reuse", 3), "", lambda: tf.range(5))
    assert again is first
    other = _common.eager_constant(("test-reuse", 4), "", lambda: tf.range(5))
    assert other.shape == [5]

    @tf.function
    def traced():
        return _common.eager_constant(("test-reuse", 3), "", lambda: tf.range(7))

    assert traced().shape == [7]  # a graph never takes an eager tensor from the cache


def test_cache_stays_within_its_bytes():
    budget = _common.EAGER_CACHE_BYTES
    big = _common.eager_constant(("test-big",), "", lambda: tf.zeros([budget // 8], tf.int64))
    assert big.shape == [budget // 8]
    for i in range(40):
        _common.eager_constant(("test-many", i), "", lambda: tf.zeros([1 << 18], tf.int64))
    entries = _common.eager_cache_entries()
    keys = [key for key, _ in entries]
    assert ("test-big",) not in keys  # larger than a quarter of the budget: not kept
    assert sum(size for _, size in entries) <= budget
    assert ("test-many", 39) in keys and ("test-many", 0) not in keys  # oldest out first


@pytest.mark.parametrize("weighted", [False, True])
def test_dense_lookups_of_changing_shapes(rng, weighted):
    num_rows, dim = 30, 5
    table64 = rng.standard_normal((num_rows, dim))
    table = tf.Variable(table64.astype(np.float32))
    for shape in [(3, 4), (3, 5), (4, 4), (3, 4), (2, 0), (2, 3, 4), (7, 1), (3, 4)]:
        ids = rng.integers(0, num_rows, size=shape)
        weights = rng.random(shape) if weighted else None
        got = tf_ttemb.gather_reduce_sum(
            table, tf.constant(ids), None if weights is None else tf.constant(weights, tf.float32)
        )
        flat = ids.reshape(-1, shape[-1]) if shape[-1] else np.zeros((np.prod(shape[:-1]), 0))
        splits = np.arange(flat.shape[0] + 1) * shape[-1]
        w = None if weights is None else weights.reshape(-1)
        want, scale = reference.forward(
            table64, flat.reshape(-1).astype(np.int64), splits, w, "sum", None
        )
        assert_close(got.numpy().reshape(-1, dim), want, scale, tf.float32, f"output {shape}")
        assert got.shape == shape[:-1] + (dim,)


# Calls that share shapes, dtypes and devices but differ in what the remembered forward
# fixes (combiner, weighting, padding id): taken in turn, each must keep its own.
REMEMBERED_CASES = [
    ("sum", True, None),
    ("sum", False, None),
    ("mean", True, 2),
    ("mean", False, None),
    ("sqrtn", True, None),
    ("max", False, 2),
    ("sum", True, 2),
]


@pytest.mark.parametrize("form", ["dense", "ragged"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("ids_dtype", [tf.int32, tf.int64], ids=["int32", "int64"])
def test_repeated_eager_lookups_match_the_reference(rng, form, dtype, ids_dtype):
    num_rows, dim = 23, 7
    dtype = DTYPES[dtype]
    for round_ in range(3):  # round 0 takes the full path, rounds 1 and 2 the kept forwards
        for combiner, weighted, padding_id in REMEMBERED_CASES:
            if form == "dense":
                bags = dense_bags(rng, (5, 4), num_rows, ids_dtype, padding_id)
            else:  # new lengths each call, an empty bag among them
                lengths = [0, *rng.integers(0, 6, size=int(rng.integers(1, 6)))]
                bags = ragged_bags(rng, lengths, num_rows, ids_dtype, padding_id)
            (params, params64), (values, weights64), (upstream, upstream64) = make_inputs(
                rng, bags, num_rows, dim, dtype, combiner, weighted
            )
            with tf.GradientTape() as tape:
                tape.watch(params)
                weights = None
                if weighted:
                    tape.watch(values)
                    weights = weights_like(bags.ids, values)
                got = tf_ttemb.gather_reduce_sum(
                    params, bags.ids, weights, combiner=combiner, padding_id=padding_id
                )
            grads = tape.gradient(got, [params, values] if weighted else [params], upstream)
            (want, scale), (dp, dp_scale), dw = reference_all(
                params64, bags, weights64, upstream64, combiner, padding_id
            )
            what = f"round {round_} {combiner} weighted={weighted} padding_id={padding_id}"
            assert_close(got.numpy(), want, scale, dtype, f"{what}: output")
            assert isinstance(grads[0], tf.IndexedSlices)
            assert_close(
                tf.convert_to_tensor(grads[0]).numpy(), dp, dp_scale, dtype, f"{what}: params grad"
            )
            if weighted:
                assert_close(grads[1].numpy().reshape(-1), dw[0], dw[1], dtype, f"{what}: w grad")
    keys = lookup_module.eager_forward_keys()
    for combiner, weighted, padding_id in REMEMBERED_CASES:
        assert any(
            k[3:5] == (combiner, padding_id) and form in k and (k[-1] is not None) == weighted
            for k in keys
        ), (form, combiner, weighted, padding_id)


def test_remembered_forward_still_checks_ids():
    table = tf.constant(np.arange(12, dtype=np.float32).reshape(4, 3))
    good = tf.constant([[0, 3], [1, 2]])
    before = len(lookup_module.eager_forward_keys())
    tf_ttemb.gather_reduce_sum(table, good)
    assert len(lookup_module.eager_forward_keys()) == before + 1
    for bad, position, value in (([[0, 3], [4, 2]], 2, 4), ([[-1, 3], [1, 2]], 0, -1)):
        with pytest.raises(tf.errors.InvalidArgumentError) as error:
            tf_ttemb.gather_reduce_sum(table, tf.constant(bad))
        assert f"indices[{position}] = {value} is not in [0, 4)" in str(error.value)
    weights = tf.ones([2, 2])
    tf_ttemb.gather_reduce_sum(table, good, weights, padding_id=1)
    for kwargs, message in (
        (dict(combiner="bogus"), "combiner"),
        (dict(combiner="max"), "does not take weights"),
        (dict(padding_id=True), "padding_id"),
        (dict(padding_id=2**63), "padding_id"),
        (dict(implementation="fast"), "implementation"),
    ):
        with pytest.raises(ValueError, match=message):
            tf_ttemb.gather_reduce_sum(table, good, weights, **kwargs)


def test_only_eager_dense_lookups_of_tensors_are_remembered(rng):
    table64 = rng.standard_normal((9, 4))
    table = tf.constant(table64.astype(np.float32))
    ids = tf.constant(rng.integers(0, 9, size=(3, 2)))
    want = table64[ids.numpy()].sum(axis=1)
    before = set(lookup_module.eager_forward_keys())
    calls = {
        "variable": lambda: tf_ttemb.gather_reduce_sum(tf.Variable(table), ids),
        "dense_grad": lambda: tf_ttemb.gather_reduce_sum(table, ids, dense_grad=True),
        "composite": lambda: tf_ttemb.gather_reduce_sum(table, ids, implementation="composite"),
        "rank 3": lambda: tf_ttemb.gather_reduce_sum(table, ids[None])[0],
        "sparse": lambda: tf_ttemb.gather_reduce_sum(
            table,
            tf.SparseTensor(
                [[b, j] for b in range(3) for j in range(2)], tf.reshape(ids, [-1]), [3, 2]
            ),
        ),
        "ragged, weights with own row_splits": lambda: tf_ttemb.gather_reduce_sum(
            table,
            tf.RaggedTensor.from_tensor(ids),
            tf.RaggedTensor.from_tensor(tf.ones([3, 2])),
        ),
        "ragged, int32 row_splits": lambda: tf_ttemb.gather_reduce_sum(
            table, tf.RaggedTensor.from_tensor(ids, row_splits_dtype=tf.int32)
        ),
        "traced": tf.function(lambda: tf_ttemb.gather_reduce_sum(table, ids)),
    }
    for what, call in calls.items():
        np.testing.assert_allclose(call().numpy(), want, rtol=1e-5, err_msg=what)
    assert set(lookup_module.eager_forward_keys()) == before


def test_remembered_forwards_stay_bounded(rng):
    table = tf.constant(rng.standard_normal((5, 2)).astype(np.float32))
    before = set(lookup_module.eager_forward_keys())
    many = tf.constant(rng.integers(0, 5, size=((1 << 16) + 1, 1)))
    got = tf_ttemb.gather_reduce_sum(table, many)  # more bags than a kept forward may have
    np.testing.assert_array_equal(got.numpy(), tf.gather(table, many[:, 0]).numpy())
    assert set(lookup_module.eager_forward_keys()) == before
    for bags in range(1, 70):
        tf_ttemb.gather_reduce_sum(table, tf.zeros([bags, 1], tf.int64))
        assert len(lookup_module.eager_forward_keys()) <= 64


def test_importing_the_package_leaves_tensorflow_configurable():
    # Nothing at import may start TensorFlow's runtime (creating a tensor does): a user
    # sets its thread pools and visible devices after the imports.
    script = """
        import tensorflow as tf
        import tf_ttemb, tf_ttemb.layers, tf_ttemb.optimizers, tf_ttemb.distribute
        import tf_ttemb.serving, tf_ttemb.ops.gather_reduce_sum
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
        tf.config.set_visible_devices([], "GPU")
        print("configured", tf.config.threading.get_intra_op_parallelism_threads())
    """
    assert run_fresh_python(script) == "configured 1"
