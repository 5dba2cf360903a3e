"""TTRowsBagsGrad: the cores' gradients of gather_reduce_sum over TTRows' rows, from the
bags' output gradient, against float64 references and against the two ops it replaces
(GatherReduceSumDenseGrad, then TTRowsGrad); its errors; and that `tt_embedding_bag`
picks it on the CPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import reference
import tensorflow as tf
from processes import gpu_visible
from test_tt_ops import attrs_of, random_cores, reference_core_grads

import tf_ttemb
from tf_ttemb.ops import _loader

COMBINERS = ["sum", "mean", "sqrtn"]
SHAPES = [
    # (p_shapes, q_shapes, ranks, num_tables)
    ([3, 5], [2, 3], [4], 1),
    ([4, 3, 5], [3, 1, 11], [3, 2], 2),  # D = 33, two tables
    ([2, 3, 2, 3], [1, 3, 1, 1], [2, 3, 2], 1),  # four cores, D = 3
    ([6, 5, 7], [2, 3, 4], [8, 16], 1),  # the register-blocked float32 paths
]
# (value dtype, slots dtype): every value dtype, and both slot dtypes.
DTYPES = [
    (tf.float64, tf.int64),
    (tf.float32, tf.int32),
    (tf.float16, tf.int64),
    (tf.bfloat16, tf.int32),
]
TOLERANCE = {tf.float64: 1e-10, tf.float32: 1e-4, tf.float16: 2e-2, tf.bfloat16: 3e-2}


def lib():
    return _loader.load_op_library()


def shape_id(s):
    return f"p{s[0]}q{s[1]}r{s[2]}t{s[3]}"


def random_bags(rng, num_ids, num_bags, max_len, pad_fraction=0.2, used=None):
    """CSR bags whose entries are slots in [0, num_ids) (from `used` where given), with
    padding (-1) and empty bags."""
    lengths = rng.integers(0, max_len + 1, size=num_bags)
    lengths[rng.integers(0, num_bags)] = 0  # at least one empty bag
    splits = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    pool = np.arange(num_ids) if used is None else used
    slots = pool[rng.integers(0, len(pool), size=int(splits[-1]))] if len(pool) else []
    slots = np.asarray(slots, np.int64).reshape(-1)
    slots[rng.random(len(slots)) < pad_fraction] = -1
    return slots, splits


def bags_grad(ids, cores, grad, slots, splits, weights, combiner, attrs, slots_dtype):
    """TTRowsBagsGrad (a CPU op)."""
    dtype = cores[0].dtype
    return lib().tf_ttemb_tt_rows_bags_grad(
        tf.constant(ids, tf.int64),
        cores,
        grad,
        tf.constant(slots, slots_dtype),
        tf.constant(splits, tf.int64),
        tf.zeros([0], dtype) if weights is None else weights,
        combiner=combiner,
        has_weights=weights is not None,
        **attrs,
    )


def two_ops(ids, cores, grad, slots, splits, weights, combiner, attrs, slots_dtype):
    """The rows' dense gradient [U, D] (GatherReduceSumDenseGrad), then TTRowsGrad, on the
    CPU as TTRowsBagsGrad (their GPU kernels sum in another order)."""
    dtype = cores[0].dtype
    with tf.device("/CPU:0"):
        rows_grad = lib().tf_ttemb_gather_reduce_sum_dense_grad(
            grad,
            tf.constant(slots, slots_dtype),
            tf.constant(splits, tf.int64),
            tf.zeros([0], dtype) if weights is None else weights,
            tf.zeros([0, grad.shape[1]], tf.int32),
            tf.constant(len(ids), tf.int64),
            combiner=combiner,
            has_weights=weights is not None,
            padding_id=-1,
            has_padding_id=True,
        )
        return lib().tf_ttemb_tt_rows_grad(
            tf.constant(ids, tf.int64), cores, rows_grad, tf.zeros([0], dtype), **attrs
        )


def touched(ids, p, k):
    return np.unique((ids // np.prod(p)) * p[k] + (ids % np.prod(p)) // np.prod(p[k + 1 :]) % p[k])


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("dtype,slots_dtype", DTYPES, ids=lambda d: d.name)
def test_matches_float64_reference(rng, shape, combiner, weighted, dtype, slots_dtype):
    p, q, ranks, num_tables = shape
    dim = int(np.prod(q))
    total = num_tables * int(np.prod(p))
    ids = np.unique(rng.integers(0, total, size=25)).astype(np.int64)
    # Some ids get no entry: their rows' gradient is zero, their core rows still listed.
    used = rng.choice(len(ids), size=max(1, len(ids) - 3), replace=False)
    slots, splits = random_bags(rng, len(ids), 11, 6, used=used)
    num_bags = len(splits) - 1
    cores = [tf.cast(c, dtype) for c in random_cores(rng, p, q, ranks, num_tables)]
    grad = tf.cast(rng.standard_normal((num_bags, dim)), dtype)
    weights = tf.cast(rng.uniform(0.5, 1.5, size=len(slots)), dtype) if weighted else None
    indices, values = bags_grad(
        ids,
        cores,
        grad,
        slots,
        splits,
        weights,
        combiner,
        attrs_of(p, q, ranks, num_tables),
        slots_dtype,
    )
    # The reference sees the values as the op does (rounded to dtype).
    seen = [c.numpy().astype(np.float64) for c in cores]
    w64 = None if weights is None else weights.numpy().astype(np.float64)
    rows_grad, _ = reference.params_grad(
        np.zeros((len(ids), dim)),
        slots,
        splits,
        grad.numpy().astype(np.float64),
        w64,
        combiner,
        -1,
    )
    expected = reference_core_grads(seen, p, q, ranks, ids, rows_grad)
    for k in range(len(p)):
        np.testing.assert_array_equal(indices[k].numpy(), touched(ids, p, k))
        assert values[k].dtype == dtype
        dense = np.zeros_like(seen[k])
        dense[indices[k].numpy()] = values[k].numpy().astype(np.float64)
        scale = np.abs(expected[k]).max() + 1
        np.testing.assert_allclose(dense, expected[k], atol=TOLERANCE[dtype] * scale, rtol=0)


@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("dtype", [tf.float32, tf.float64], ids=lambda d: d.name)
@pytest.mark.parametrize(
    "case",
    [
        # (p, q, ranks, number of ids, number of bags): many ids and wide rows take
        # several of the op's internal chunks.
        ([40, 50, 60], [10, 10, 10], [24, 24], 5000, 700),
        ([20, 30, 25], [4, 4, 4], [32, 32], 3000, 300),
    ],
    ids=["chunked", "fbtt-like"],
)
def test_bitwise_equal_to_the_two_ops(rng, combiner, weighted, dtype, case):
    # Each unique id's row gradient is summed over its entries in the same order as
    # GatherReduceSumDenseGrad sums it, and the rest is TTRowsGrad's arithmetic.
    p, q, ranks, num_ids, num_bags = case
    ids = np.sort(rng.choice(int(np.prod(p)), size=num_ids, replace=False)).astype(np.int64)
    slots, splits = random_bags(rng, num_ids, num_bags, 30)
    cores = [tf.constant(c, dtype) for c in random_cores(rng, p, q, ranks, 1)]
    grad = tf.constant(rng.standard_normal((num_bags, int(np.prod(q)))), dtype)
    weights = tf.constant(rng.uniform(0.5, 1.5, size=len(slots)), dtype) if weighted else None
    args = (ids, cores, grad, slots, splits, weights, combiner, attrs_of(p, q, ranks, 1), tf.int64)
    got_i, got_v = bags_grad(*args)
    want_i, want_v = two_ops(*args)
    for k in range(3):
        np.testing.assert_array_equal(got_i[k].numpy(), want_i[k].numpy())
        np.testing.assert_array_equal(got_v[k].numpy(), want_v[k].numpy())


def test_repeated_ids_sum_their_entries(rng):
    # ids in any order with repeats (a leaf of several ids): as the two ops, to rounding.
    p, q, ranks = [5, 4, 3], [2, 3, 2], [3, 4]
    ids = rng.integers(0, 60, size=40).astype(np.int64)
    slots, splits = random_bags(rng, len(ids), 15, 8)
    cores = [tf.constant(c) for c in random_cores(rng, p, q, ranks, 1)]
    grad = tf.constant(rng.standard_normal((len(splits) - 1, 12)))
    args = (ids, cores, grad, slots, splits, None, "mean", attrs_of(p, q, ranks, 1), tf.int32)
    got_i, got_v = bags_grad(*args)
    want_i, want_v = two_ops(*args)
    for k in range(3):
        np.testing.assert_array_equal(got_i[k].numpy(), want_i[k].numpy())
        np.testing.assert_allclose(got_v[k].numpy(), want_v[k].numpy(), rtol=0, atol=1e-12)


def test_is_bitwise_deterministic(rng):
    p, q, ranks = [20, 30, 25], [4, 4, 4], [32, 32]
    ids = np.sort(rng.choice(15000, size=3000, replace=False)).astype(np.int64)
    slots, splits = random_bags(rng, len(ids), 300, 30)
    cores = [tf.constant(c, tf.float32) for c in random_cores(rng, p, q, ranks, 1)]
    grad = tf.constant(rng.standard_normal((300, 64)), tf.float32)
    args = (ids, cores, grad, slots, splits, None, "sum", attrs_of(p, q, ranks, 1), tf.int64)
    first = [v.numpy() for v in bags_grad(*args)[1]]
    for _ in range(3):
        for a, b in zip(first, bags_grad(*args)[1]):
            np.testing.assert_array_equal(a, b.numpy())


@pytest.mark.parametrize(
    "num_ids,slots,splits",
    [
        (0, [], [0]),  # no ids, no bags
        (0, [-1, -1], [0, 2, 2]),  # only padding
        (4, [], [0, 0, 0]),  # ids but empty bags: zero gradients for their rows
    ],
    ids=["nothing", "padding-only", "empty-bags"],
)
def test_empty_inputs(rng, num_ids, slots, splits):
    p, q, ranks = [3, 4], [2, 2], [2]
    cores = [tf.constant(c) for c in random_cores(rng, p, q, ranks, 1)]
    ids = np.sort(rng.choice(12, size=num_ids, replace=False)).astype(np.int64)
    grad = tf.constant(rng.standard_normal((len(splits) - 1, 4)))
    indices, values = bags_grad(
        ids,
        cores,
        grad,
        np.array(slots, np.int64),
        splits,
        None,
        "sum",
        attrs_of(p, q, ranks, 1),
        tf.int64,
    )
    for k in range(2):
        np.testing.assert_array_equal(indices[k].numpy(), touched(ids, p, k))
        np.testing.assert_array_equal(values[k].numpy(), np.zeros((len(touched(ids, p, k)), 4)))


ERRORS = [
    # (what to change, message)
    (
        {"slots": [0, 3, 7]},
        r"TTRowsBagsGrad's slots \(indices into ids, a table of 4 rows\) and row_splits: "
        r"indices\[2\] = 7 is not in \[0, 4\) and is not padding_id \(-1\)",
    ),
    ({"slots": [0, -2, 1]}, r"indices\[1\] = -2 is not in \[0, 4\)"),
    ({"splits": [0, 2, 1, 3]}, r"row_splits must be non-decreasing"),
    ({"splits": [0, 1, 2, 2]}, r"row_splits\[3\] = 2 must equal the number of indices \(3\)"),
    ({"grad": (3, 5)}, r"grad must be \[3, 4\] like the bags' output, got shape \[3,5\]"),
    ({"grad": (2, 4)}, r"grad must be \[3, 4\] like the bags' output, got shape \[2,4\]"),
    ({"weights": 2}, r"weights has 2 entries but indices has 3"),
    ({"ids": [0, 1, 2, 12]}, r"ids\[3\] = 12 is not in \[0, 12\)"),
]


@pytest.mark.parametrize("change,message", ERRORS, ids=[m[:30] for _, m in ERRORS])
def test_bad_inputs_raise_invalid_argument(rng, change, message):
    p, q, ranks = [3, 4], [2, 2], [2]
    cores = [tf.constant(c) for c in random_cores(rng, p, q, ranks, 1)]
    ids = np.array(change.get("ids", [0, 1, 2, 3]), np.int64)
    slots = np.array(change.get("slots", [0, 3, 1]), np.int64)
    splits = change.get("splits", [0, 1, 1, 3])
    grad = tf.zeros(change.get("grad", (3, 4)), tf.float64)
    weights = tf.ones([change.get("weights", 3)], tf.float64)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match=message):
        bags_grad(
            ids, cores, grad, slots, splits, weights, "sum", attrs_of(p, q, ranks, 1), tf.int64
        )


def test_max_is_not_an_attr_value(rng):
    p, q, ranks = [3, 4], [2, 2], [2]
    cores = [tf.constant(c) for c in random_cores(rng, p, q, ranks, 1)]
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="combiner"):
        bags_grad(
            np.arange(2),
            cores,
            tf.zeros([1, 4], tf.float64),
            np.array([0, 1]),
            [0, 2],
            None,
            "max",
            attrs_of(p, q, ranks, 1),
            tf.int64,
        )


def _gradient_op_types(combiner, cache):
    """The op types of a tf.function's graph that takes the cores' gradients of a
    `tt_embedding_bag` call (with a cache of rows where `cache`)."""
    layer_kwargs = dict(num_embeddings=60, p_shapes=[3, 4, 5], q_shapes=[2, 2, 2], ranks=[3, 3])
    cores = [
        tf.Variable(c)
        for c in random_cores(np.random.default_rng(0), [3, 4, 5], [2, 2, 2], [3, 3], 1)
    ]
    ids = tf.constant([[0, 5, 7], [59, 5, 1]], tf.int64)
    extra = {}
    if cache:
        extra = dict(cache_ids=tf.constant([5], tf.int64), cache_rows=tf.zeros([1, 8], tf.float64))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            out = tf_ttemb.tt_embedding_bag(cores, ids, combiner=combiner, **layer_kwargs, **extra)
            loss = tf.reduce_sum(out * out)
        return tape.gradient(loss, cores)

    graph = step.get_concrete_function().graph
    return {op.type for op in graph.get_operations()}


@pytest.mark.parametrize(
    "combiner,cache,fused",
    [("sum", False, True), ("sqrtn", False, True), ("max", False, False), ("sum", True, False)],
    ids=["sum", "sqrtn", "max", "sum-cached"],
)
def test_tt_embedding_bag_picks_the_fused_gradient_on_the_cpu(combiner, cache, fused):
    # Where TensorFlow sees a GPU, the two ops run there (TTRowsBagsGrad has no GPU kernel).
    fused = fused and not gpu_visible()
    types = _gradient_op_types(combiner, cache)
    assert ("TfTtemb>TTRowsBagsGrad" in types) == fused, sorted(types)
    assert ("TfTtemb>TTRowsGrad" in types) == (not fused), sorted(types)
    assert ("TfTtemb>GatherReduceSumDenseGrad" in types) == (not fused), sorted(types)
