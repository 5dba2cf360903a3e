"""The errors of tf_ttemb.gather_reduce_sum and of its raw ops, word for word.

Ids outside [0, N) (the first one named, on every input form and path), malformed
arguments and structures caught by the wrapper, and the C++ checks of the raw ops that
the wrapper would otherwise pre-empt (row_splits, ids, shapes, weights, the GPU report's
wording); the rest of the op's tests are in test_gather_reduce_sum.py.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import reference
import tensorflow as tf
from bags import (
    ID_DTYPES,
    dense_bags,
    make_params,
    ragged_bags,
    sparse_bags,
)

import tf_ttemb

IMPLEMENTATIONS = ("custom_op", "composite")


# --------------------------------------------------------------------------------------
# Errors.
# --------------------------------------------------------------------------------------

N_ERR = 4096


def _bad_ids_case(rng, case, ids_dtype):
    """(bags, padding_id, expected message) for ids outside [0, N)."""
    range_msg = "is not in [0, 4096)"
    if case == "dense2d":
        bags = dense_bags(rng, None, N_ERR, ids_dtype, ids=[[0, 1, 2], [3, 9001, 4]])
        return bags, None, f"indices[4] = 9001 {range_msg}"
    if case == "negative":
        bags = dense_bags(rng, None, N_ERR, ids_dtype, ids=[[0, -5]])
        return bags, None, f"indices[1] = -5 {range_msg}"
    if case == "equal_to_n":
        bags = ragged_bags(rng, [2, 0, 2], N_ERR, ids_dtype, ids=[1, 2, 3, 4096])
        return bags, None, f"indices[3] = 4096 {range_msg}"
    if case == "with_padding":
        bags = dense_bags(rng, None, N_ERR, ids_dtype, ids=[[0, -1, -1], [-7, -1, 5]])
        return bags, -1, f"indices[3] = -7 {range_msg} and is not padding_id (-1)"
    if case == "dense3d":
        ids = np.zeros((2, 2, 3), dtype=np.int64)
        ids[1, 0, 2] = 5000
        bags = dense_bags(rng, None, N_ERR, ids_dtype, ids=ids)
        return bags, None, f"indices[8] = 5000 {range_msg}"
    if case == "ragged":
        bags = ragged_bags(rng, [2, 0, 3], N_ERR, ids_dtype, ids=[1, 2, 3, -2, 4])
        return bags, 4, f"indices[3] = -2 {range_msg} and is not padding_id (4)"
    if case == "sparse":
        bags = sparse_bags(rng, [2, 3], N_ERR, ids_dtype, ids=[1, 2, 3, 4, 9001], shuffle=False)
        return bags, None, f"indices[4] = 9001 {range_msg}"
    if case == "int64_huge":
        bags = dense_bags(rng, None, N_ERR, ids_dtype, ids=[[2**40, 1]])
        return bags, None, f"indices[0] = 1099511627776 {range_msg}"
    raise ValueError(case)


BAD_ID_CASES = ["dense2d", "negative", "equal_to_n", "with_padding", "dense3d", "ragged", "sparse"]


BAD_ID_PARAMS = (
    [
        (c, d, i, "eager")
        for c in BAD_ID_CASES
        for d in ID_DTYPES
        for i in ("custom_op", "composite")
    ]
    + [(c, "int64", "auto", "function") for c in BAD_ID_CASES]
    + [
        ("int64_huge", "int64", "custom_op", "eager"),
        ("int64_huge", "int64", "composite", "eager"),
        ("dense2d", "int32", "composite", "function"),
        ("with_padding", "int64", "composite", "function"),
    ]
)


@pytest.mark.parametrize(
    "case,ids_dtype,implementation,mode",
    BAD_ID_PARAMS,
    ids=["-".join(p) for p in BAD_ID_PARAMS],
)
def test_ids_out_of_range(rng, case, ids_dtype, implementation, mode):
    bags, padding_id, message = _bad_ids_case(rng, case, ID_DTYPES[ids_dtype])
    params, _ = make_params(rng, N_ERR, 2, tf.float32)

    def f(params, ids):
        return tf_ttemb.gather_reduce_sum(
            params, ids, padding_id=padding_id, implementation=implementation
        )

    if mode == "function":
        f = tf.function(f)
    with pytest.raises(tf.errors.InvalidArgumentError, match=re.escape(message)):
        f(params, bags.ids)


@pytest.mark.parametrize("combiner", ["sum", "max"])
@pytest.mark.parametrize("padding_id", [None, -1], ids=lambda p: f"pad{p}")
@pytest.mark.parametrize("ids_dtype", list(ID_DTYPES))
@pytest.mark.parametrize("nnz", [3_000, 70_000])
def test_first_bad_id_of_a_long_batch(rng, nnz, ids_dtype, padding_id, combiner):
    """The CPU check tests blocks of 512 ids at once (in the forward, each thread's block of
    bags its own ids, once there is enough work to split) and scans a failing block in order:
    the first bad id is named, past padding entries and blocks that pass, with a later bad
    id in another block and one after it in its own; the same for the max combiner, whose
    forward has its own bag loop."""
    ids = rng.integers(0, N_ERR, size=nnz)
    if padding_id is not None:
        ids[rng.random(nnz) < 0.3] = padding_id
    first = nnz // 2 + 7
    ids[first] = -3
    ids[first + 1] = N_ERR
    ids[nnz - 5] = N_ERR + 11
    bags = dense_bags(rng, None, N_ERR, ID_DTYPES[ids_dtype], ids=ids.reshape(-1, 10))
    params, _ = make_params(rng, N_ERR, 2, tf.float32)
    message = f"indices[{first}] = -3 is not in [0, 4096)"
    if padding_id is not None:
        message += f" and is not padding_id ({padding_id})"
    with pytest.raises(tf.errors.InvalidArgumentError, match=re.escape(message)):
        tf_ttemb.gather_reduce_sum(params, bags.ids, padding_id=padding_id, combiner=combiner)


@pytest.mark.parametrize("combiner", ["mean", "sqrtn"])
def test_bad_id_in_a_bag_of_zero_weights(rng, combiner):
    """A bag of scale 0 is never gathered, but its ids are still checked."""
    params, _ = make_params(rng, N_ERR, 3, tf.float32)
    ids = tf.constant([[1, 2], [3, 5000]], tf.int64)
    weights = tf.constant([[0.5, 0.25], [0.0, 0.0]], tf.float32)
    with pytest.raises(
        tf.errors.InvalidArgumentError, match=re.escape("indices[3] = 5000 is not in [0, 4096)")
    ):
        tf_ttemb.gather_reduce_sum(params, ids, weights, combiner=combiner)


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (dict(combiner="avg"), "avg"),
        (dict(combiner="max", weights=True), "max"),
        (dict(implementation="fast"), "fast"),
    ],
    ids=["bad_combiner", "max_with_weights", "bad_implementation"],
)
def test_python_argument_errors(rng, kwargs, pattern):
    params, _ = make_params(rng, 5, 2, tf.float32)
    ids = tf.constant([[0, 1], [2, 3]])
    if kwargs.pop("weights", False):
        kwargs["weights"] = tf.ones([2, 2])
    with pytest.raises(ValueError, match=pattern):
        tf_ttemb.gather_reduce_sum(params, ids, **kwargs)


def _wrapper_error_case(case):
    """(params, ids, weights, kwargs) for one input the wrapper must reject."""
    params = tf.constant(np.arange(12.0).reshape(6, 2), tf.float32)
    dense = tf.constant([[0, 1], [2, 3]])
    ragged = tf.ragged.constant([[0, 1], [2]])
    sparse = tf.sparse.from_dense(tf.constant([[1, 0], [2, 3]]))
    return {
        "params_rank_1": (tf.zeros([6]), dense, None, {}),
        "params_int": (tf.zeros([6, 2], tf.int32), dense, None, {}),
        "ids_float": (params, tf.zeros([2, 2]), None, {}),
        "ids_scalar": (params, tf.constant(1), None, {}),
        "padding_id_str": (params, dense, None, dict(padding_id="x")),
        "padding_id_bool": (params, dense, None, dict(padding_id=True)),
        "dense_ids_ragged_weights": (params, dense, tf.ragged.constant([[1.0, 1.0], [1.0]]), {}),
        "ragged_ids_dense_weights": (params, ragged, tf.ones([2, 2]), {}),
        "sparse_ids_dense_weights": (params, sparse, tf.ones([2, 2]), {}),
        "dense_weights_shape": (params, dense, tf.ones([2, 3]), {}),
        "ragged_rank_2": (params, tf.ragged.constant([[[0], [1, 2]], [[3]]]), None, {}),
        "sparse_3d": (params, tf.sparse.from_dense(tf.ones([2, 2, 2], tf.int32)), None, {}),
        "ragged_weights_row_lengths": (params, ragged, tf.ragged.constant([[1.0], [1.0, 1.0]]), {}),
        "sparse_weights_pattern": (
            params,
            sparse,
            tf.sparse.from_dense(tf.constant([[1.0, 1.0], [0.0, 1.0]])),
            {},
        ),
    }[case]


WRAPPER_ERRORS = [
    ("params_rank_1", ValueError, r"params must be a matrix \[N, D\], got shape \(6,\)"),
    ("params_int", TypeError, "params must be float16, bfloat16, float32 or float64, got int32"),
    ("ids_float", TypeError, "indices must be an integer tensor, got dtype float32"),
    ("ids_scalar", ValueError, r"dense indices must have a known rank >= 1"),
    ("padding_id_str", ValueError, "padding_id must be an integer or None, got 'x'"),
    ("padding_id_bool", ValueError, "padding_id must be an integer or None, got True"),
    ("dense_ids_ragged_weights", ValueError, "weights must be dense like the indices"),
    ("ragged_ids_dense_weights", ValueError, "weights must be a RaggedTensor"),
    ("sparse_ids_dense_weights", ValueError, "weights must be a SparseTensor like the indices"),
    ("dense_weights_shape", ValueError, r"weights must have the shape of indices"),
    ("ragged_rank_2", ValueError, "ragged indices must be \\[B, \\(L\\)\\] with ragged_rank 1"),
    ("sparse_3d", ValueError, r"sparse indices must be 2-D \[B, L\]"),
    (
        "ragged_weights_row_lengths",
        tf.errors.InvalidArgumentError,
        "weights must have the same row lengths as indices",
    ),
    (
        "sparse_weights_pattern",
        tf.errors.InvalidArgumentError,
        "weights must have the same sparsity pattern as indices",
    ),
]


@pytest.mark.parametrize(
    "case,error,pattern", WRAPPER_ERRORS, ids=[c for c, _, _ in WRAPPER_ERRORS]
)
def test_wrapper_input_errors(case, error, pattern):
    params, ids, weights, kwargs = _wrapper_error_case(case)
    with pytest.raises(error, match=pattern):
        tf_ttemb.gather_reduce_sum(params, ids, weights, **kwargs)


# Raw ops: the C++ validation that the Python wrapper would otherwise pre-empt.

RAW_OPS = (
    "tf_ttemb_gather_reduce_sum",
    "tf_ttemb_gather_reduce_sum_grad",
    "tf_ttemb_gather_reduce_sum_dense_grad",
    "tf_ttemb_gather_reduce_sum_weights_grad",
)


@pytest.fixture(scope="module")
def raw_ops():
    from tf_ttemb.ops import _loader

    return _loader.load_op_library()


def call_raw(
    raw_ops,
    op,
    params,
    indices,
    row_splits,
    weights=None,
    combiner="sum",
    padding_id=None,
    num_bags=None,
    rng=None,
):
    params = tf.convert_to_tensor(params, dtype=tf.float32)
    indices = tf.convert_to_tensor(indices)
    row_splits = tf.constant(row_splits, dtype=tf.int64)
    has_weights = weights is not None
    weights = tf.constant(weights if has_weights else [], dtype=tf.float32)
    attrs = dict(
        combiner=combiner,
        has_weights=has_weights,
        padding_id=-1 if padding_id is None else padding_id,
        has_padding_id=padding_id is not None,
    )
    if num_bags is None:
        num_bags = max(int(row_splits.shape[0]) - 1, 0)
    dim = int(params.shape[-1]) if params.shape.rank else 1
    grad = tf.constant(rng.normal(size=(num_bags, dim)), dtype=tf.float32)
    inputs = dict(indices=indices, row_splits=row_splits, weights=weights, **attrs)
    if op == "tf_ttemb_gather_reduce_sum":  # with the check of its report, as the wrapper runs it
        outputs = getattr(raw_ops, op)(params=params, **inputs)
        raw_ops.tf_ttemb_check_bag_report(
            outputs[2], padding_id=attrs["padding_id"], has_padding_id=attrs["has_padding_id"]
        )
        return outputs
    if op == "tf_ttemb_gather_reduce_sum_weights_grad":
        return getattr(raw_ops, op)(grad=grad, params=params, output=tf.zeros_like(grad), **inputs)
    argmax = tf.zeros([num_bags if combiner == "max" else 0, dim], dtype=tf.int32)
    num_rows = tf.constant(int(params.shape[0]), dtype=tf.int64)
    return getattr(raw_ops, op)(grad=grad, argmax=argmax, num_rows=num_rows, **inputs)


@pytest.mark.parametrize("op", RAW_OPS)
@pytest.mark.parametrize("shape", [(6, 4), (2, 3, 4)], ids=["2d", "3d"])
def test_raw_ops_read_ids_and_weights_of_any_shape_flat(raw_ops, rng, op, shape):
    # A dense batch goes into the ops as it is (no reshape first): the results are the
    # flat inputs' to the bit, and the weights gradient comes back in the weights' shape.
    nnz = int(np.prod(shape))
    ids = rng.integers(-1, 10, size=shape)
    weights = rng.uniform(0.5, 1.5, size=shape)
    splits = [0, 5, 5, 11, nnz]  # bags cut across the dense rows, one empty
    params = rng.normal(size=(10, 3))
    rng_state = rng.bit_generator.state
    nd = call_raw(raw_ops, op, params, ids, splits, weights, padding_id=-1, rng=rng)
    rng.bit_generator.state = rng_state  # the same upstream gradient
    flat = call_raw(
        raw_ops, op, params, ids.reshape(-1), splits, weights.reshape(-1), padding_id=-1, rng=rng
    )
    nd, flat = tf.nest.flatten(nd), tf.nest.flatten(flat)
    for got, want in zip(nd, flat):
        if op.endswith("weights_grad"):
            assert tuple(got.shape) == shape, got.shape
            got = tf.reshape(got, [-1])
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    if op == "tf_ttemb_gather_reduce_sum":
        want, _ = reference.forward(
            params, ids.reshape(-1), np.array(splits), weights.reshape(-1), "sum", -1
        )
        np.testing.assert_allclose(nd[0].numpy(), want, rtol=1e-5, atol=1e-5)


ROW_SPLITS_CASES = [
    ([3, 5, 9], "row_splits[0] = 3 must be 0"),
    ([0, 5, 2, 9], "row_splits must be non-decreasing: row_splits[2] = 2 < row_splits[1] = 5"),
    ([0, 3, 7], r"row_splits[B] = 7 must equal the number of indices (9)"),
]


@pytest.mark.parametrize("op", RAW_OPS)
@pytest.mark.parametrize(
    "row_splits,message", ROW_SPLITS_CASES, ids=["first", "decreasing", "last"]
)
def test_raw_op_row_splits_errors(raw_ops, rng, op, row_splits, message):
    indices = tf.constant([0, 1, 2, 3, 4, 5, 6, 7, 8], dtype=tf.int32)
    weights = rng.uniform(size=9) if op.endswith("weights_grad") else None
    pattern = re.escape(message)
    if "[B]" in message:  # the last split may be named by B or by its position
        pattern = pattern.replace(r"\[B\]", r"\[(B|2)\]")
    with pytest.raises(tf.errors.InvalidArgumentError, match=pattern):
        call_raw(raw_ops, op, rng.normal(size=(10, 2)), indices, row_splits, weights, rng=rng)


@pytest.mark.parametrize("op", RAW_OPS)
@pytest.mark.parametrize("padding_id", [None, 6])
def test_raw_op_ids_out_of_range(raw_ops, rng, op, padding_id):
    indices = tf.constant([0, 6, 2, 9001, 1], dtype=tf.int64)
    weights = rng.uniform(size=5) if op.endswith("weights_grad") else None
    message = "indices[3] = 9001 is not in [0, 4096)"
    if padding_id is not None:
        message += " and is not padding_id (6)"
    with pytest.raises(tf.errors.InvalidArgumentError, match=re.escape(message)):
        call_raw(
            raw_ops,
            op,
            rng.normal(size=(4096, 2)),
            indices,
            [0, 2, 5],
            weights,
            padding_id=padding_id,
            rng=rng,
        )


@pytest.mark.parametrize("op", RAW_OPS)
@pytest.mark.parametrize("padding_id", [None, -1], ids=lambda p: f"pad{p}")
def test_raw_op_first_bad_id_of_a_long_batch(raw_ops, rng, op, padding_id):
    """Large enough for the CPU to split the bags over its threads, each block checking its
    own ids (the forward and the weights gradient check them block by block as they go):
    the error names the first bad id, with a second bad id in its block and a third in the
    last block, on every raw op."""
    nnz, bag = 70_000, 10
    ids = rng.integers(0, N_ERR, size=nnz)
    if padding_id is not None:
        ids[rng.random(nnz) < 0.3] = padding_id
    first = int(rng.integers(nnz // 4, nnz // 2))
    ids[first], ids[first + 1], ids[nnz - 5] = -3, N_ERR, N_ERR + 11
    weights = rng.uniform(size=nnz) if op.endswith("weights_grad") else None
    message = f"indices[{first}] = -3 is not in [0, 4096)"
    if padding_id is not None:
        message += f" and is not padding_id ({padding_id})"
    with pytest.raises(tf.errors.InvalidArgumentError, match=re.escape(message)):
        call_raw(
            raw_ops,
            op,
            rng.normal(size=(N_ERR, 3)),
            tf.constant(ids, tf.int64),
            np.arange(0, nnz + 1, bag),
            weights,
            padding_id=padding_id,
            rng=rng,
        )


def test_raw_op_params_not_a_matrix(raw_ops, rng):
    with pytest.raises(
        tf.errors.InvalidArgumentError,
        match=re.escape("params must be a matrix [N, D], got shape [3]"),
    ):
        call_raw(raw_ops, RAW_OPS[0], rng.normal(size=3), tf.constant([0, 1]), [0, 2], rng=rng)


@pytest.mark.parametrize("op", RAW_OPS)
@pytest.mark.parametrize(
    "indices,row_splits,num_weights,combiner,message",
    [
        ([0, 1, 2, 3, 4, 5], [0, 3, 6], 5, "sum", "weights has 5 entries but indices has 6"),
        ([0, 1, 2], [0, 1, 3], 3, "max", "combiner 'max' does not take weights"),
    ],
    ids=["count_mismatch", "max_with_weights"],
)
def test_raw_op_weights_errors(
    raw_ops, rng, op, indices, row_splits, num_weights, combiner, message
):
    with pytest.raises(tf.errors.InvalidArgumentError, match=re.escape(message)):
        call_raw(
            raw_ops,
            op,
            rng.normal(size=(8, 2)),
            tf.constant(indices),
            row_splits,
            rng.uniform(size=num_weights),
            combiner=combiner,
            rng=rng,
        )


# --------------------------------------------------------------------------------------
# GPU.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_function", [False, True], ids=["eager", "function"])
def test_ragged_weights_row_lengths_are_checked(use_function):
    table = tf.constant(np.arange(12, dtype=np.float32).reshape(6, 2))
    ids = tf.RaggedTensor.from_row_lengths(tf.constant([0, 1, 2, 3], tf.int64), [1, 3])
    shared = ids.with_values(tf.constant([1.0, 2.0, 3.0, 4.0]))  # one row_splits tensor
    moved = tf.RaggedTensor.from_row_lengths(tf.constant([1.0, 2.0, 3.0, 4.0]), [2, 2])
    lookup = tf_ttemb.gather_reduce_sum
    if use_function:
        lookup = tf.function(lookup)
    got = lookup(table, ids, shared).numpy()
    np.testing.assert_allclose(got, [[0.0, 1.0], [2 * 2 + 3 * 4 + 4 * 6, 2 * 3 + 3 * 5 + 4 * 7]])
    with pytest.raises(tf.errors.InvalidArgumentError, match="same row lengths as indices"):
        lookup(table, ids, moved)


def test_ragged_weights_row_lengths_are_checked_in_a_tf1_graph():
    """A TF1 session runs only what a fetch needs: there the output waits for the check
    (inside a tf.function TensorFlow runs the check beside the lookup)."""
    graph = tf.Graph()
    with graph.as_default():
        table = tf.constant(np.arange(12, dtype=np.float32).reshape(6, 2))
        ids = tf.RaggedTensor.from_row_lengths(tf.constant([0, 1, 2, 3], tf.int64), [1, 3])
        moved = tf.RaggedTensor.from_row_lengths(tf.constant([1.0, 2.0, 3.0, 4.0]), [2, 2])
        output = tf_ttemb.gather_reduce_sum(table, ids, moved)
        with tf.compat.v1.Session(graph=graph) as session:
            with pytest.raises(tf.errors.InvalidArgumentError, match="same row lengths"):
                session.run(output)


def _report(**findings):
    """A DeviceReport (cuda/common_types.h) as the GPU forward writes it: every finding
    unset (-1) but those given, a well-formed 2-bag call over 6 rows and 4 ids."""
    words = dict.fromkeys(
        [
            "first_bad_index",
            "bad_index_value",
            "first_bad_split",
            "bad_split_value",
            "bad_split_prev",
            "first_split",
            "last_split",
            "num_unique",
        ],
        -1,
    )
    words.update(first_split=0, last_split=4, num_rows=6, nnz=4, num_bags=2)
    words.update(findings)
    return tf.constant(list(words.values()), tf.int64)


@pytest.mark.parametrize(
    "findings,padding_id,message",
    [
        ({}, None, None),
        ({"first_bad_index": 2, "bad_index_value": 9}, None, "indices[2] = 9 is not in [0, 6)"),
        (
            {"first_bad_index": 1, "bad_index_value": -3},
            5,
            "indices[1] = -3 is not in [0, 6) and is not padding_id (5)",
        ),
        ({"first_split": 1}, None, "row_splits[0] = 1 must be 0"),
        (
            {"first_bad_split": 0, "bad_split_value": 1, "bad_split_prev": 3},
            None,
            "row_splits must be non-decreasing: row_splits[1] = 1 < row_splits[0] = 3",
        ),
        ({"last_split": 3}, None, "row_splits[2] = 3 must equal the number of indices (4)"),
    ],
)
def test_check_bag_report_words_the_cpu_ops_errors(raw_ops, findings, padding_id, message):
    """CheckBagReport on the CPU (where a GPU forward's report lands when the check is
    placed there) raises the CPU forward's message for what the report holds."""
    attrs = dict(
        padding_id=-1 if padding_id is None else padding_id, has_padding_id=padding_id is not None
    )
    with tf.device("/CPU:0"):
        if message is None:
            raw_ops.tf_ttemb_check_bag_report(_report(), **attrs)
            raw_ops.tf_ttemb_check_bag_report(tf.zeros([0], tf.int64), **attrs)
            return
        with pytest.raises(tf.errors.InvalidArgumentError, match=re.escape(message)):
            raw_ops.tf_ttemb_check_bag_report(_report(**findings), **attrs)


def test_check_bag_report_rejects_a_report_of_another_size(raw_ops):
    with pytest.raises(tf.errors.InvalidArgumentError, match="report must be empty or hold 11"):
        raw_ops.tf_ttemb_check_bag_report(tf.zeros([3], tf.int64))
