"""tf_ttemb.gather_reduce_sum against the float64 numpy reference (tests/reference.py).

The big cross-product (combiner x value dtype x index dtype x input form x
weighting x padding) runs on small shapes; large and odd dims, long bags, empty
batches, gradients' structure, finite differences, the composite fallback and XLA
have dedicated tests; the error messages are in test_gather_reduce_sum_errors.py.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import reference
import tensorflow as tf
from bags import (
    COMBINER_WEIGHTING,
    DTYPES,
    FORMS,
    ID_DTYPES,
    assert_close,
    combiner_cases,
    combiner_id,
    dense_bags,
    dense_value,
    make_bags,
    make_inputs,
    make_params,
    make_upstream,
    make_weights,
    quantize,
    ragged_bags,
    reference_all,
    sparse_bags,
    weights_like,
)
from processes import built_with_cuda

import tf_ttemb

COMBINER_IDS = [combiner_id(v) for v in COMBINER_WEIGHTING]
IMPLEMENTATIONS = ("custom_op", "composite")


def run_op(params, bags, w_values, upstream, mode="eager", **kwargs):
    """Forward plus gradients w.r.t. params and the weights' values, in one of three modes."""

    def body(params, ids, w_values, upstream):
        with tf.GradientTape() as tape:
            tape.watch(params)
            weights = None
            if w_values is not None:
                tape.watch(w_values)
                weights = weights_like(ids, w_values)
            out = tf_ttemb.gather_reduce_sum(params, ids, weights, **kwargs)
        sources = [params] if w_values is None else [params, w_values]
        grads = tape.gradient(out, sources, output_gradients=upstream)
        return out, grads

    if mode == "function":
        body = tf.function(body)
    elif mode == "jit":
        body = tf.function(body, jit_compile=True)
    else:
        assert mode == "eager", mode
    out, grads = body(params, bags.ids, w_values, upstream)
    return out, grads[0], (grads[1] if len(grads) > 1 else None)


def check_case(
    rng, bags, dtype, combiner, weighted, padding_id, num_rows, dim, mode="eager", **kwargs
):
    """Runs the op on `bags`; compares forward, params grad and weights grad with the reference."""
    (params, params64), (w, w64), (up, up64) = make_inputs(
        rng, bags, num_rows, dim, dtype, combiner, weighted
    )
    out, dp, dw = run_op(
        params, bags, w, up, mode, combiner=combiner, padding_id=padding_id, **kwargs
    )
    (ref_out, s_out), (ref_dp, s_dp), ref_dw = reference_all(
        params64, bags, w64, up64, combiner, padding_id
    )
    assert out.dtype == dtype
    assert tuple(out.shape) == bags.lead_shape + (dim,)
    assert_close(dense_value(out).reshape(-1, dim), ref_out, s_out, dtype, "forward")
    assert dp is not None, "no gradient w.r.t. params"
    assert dp.dtype == dtype
    assert_close(dense_value(dp), ref_dp, s_dp, dtype, "params grad")
    if weighted:
        assert dw is not None, "no gradient w.r.t. weights"
        assert tuple(dw.shape) == tuple(w.shape)
        assert_close(bags.csr_from_values(dense_value(dw)), *ref_dw, dtype, "weights grad")
    return out, dp, dw


# --------------------------------------------------------------------------------------
# The cross-product on small shapes: N = 11 rows so ids repeat inside and across bags.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("padding_id", [None, -1, 0], ids=lambda p: f"pad{p}")
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("ids_dtype", list(ID_DTYPES))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("combiner,weighted", COMBINER_WEIGHTING, ids=COMBINER_IDS)
def test_matches_reference_eager(rng, combiner, weighted, dtype, ids_dtype, form, padding_id):
    bags = make_bags(rng, form, 11, ID_DTYPES[ids_dtype], padding_id)
    check_case(rng, bags, DTYPES[dtype], combiner, weighted, padding_id, 11, 3)


# Graph mode exercises the wrapper's graph path (static shapes, shape functions, the
# registered gradient inside a FuncGraph); the kernels are the eager ones, so value and
# index dtypes are paired here instead of crossed to keep tracing time down.
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(
    "dtype,ids_dtype", [("float32", "int32"), ("bfloat16", "int64")], ids=["f32-i32", "bf16-i64"]
)
@pytest.mark.parametrize("combiner,weighted", COMBINER_WEIGHTING, ids=COMBINER_IDS)
def test_matches_reference_in_tf_function(rng, combiner, weighted, dtype, ids_dtype, form):
    bags = make_bags(rng, form, 11, ID_DTYPES[ids_dtype], padding_id=-1)
    check_case(rng, bags, DTYPES[dtype], combiner, weighted, -1, 11, 3, mode="function")


# --------------------------------------------------------------------------------------
# Dims, long bags, empty batches, repeated ids.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("combiner,weighted", COMBINER_WEIGHTING, ids=COMBINER_IDS)
@pytest.mark.parametrize("dim", [1, 3, 33, 1000])
def test_dims(rng, dim, combiner, weighted, dtype):
    bags = ragged_bags(rng, rng.integers(0, 12, size=7), 40, tf.int64, padding_id=-1)
    check_case(rng, bags, DTYPES[dtype], combiner, weighted, -1, 40, dim)


# The CPU forward sums a bag's columns in chunks of up to 8 vectors (8 float lanes, 4
# double lanes; 16 vectors of 16 lanes on AVX-512) held in registers, the last vector
# partial when the lanes do not divide D, and takes its maxes in chunks of half as many
# vectors: every D below takes another (chunks, vectors, tail) path for float32 or
# float64 (and half types load 8 or 16 values at a time, partially in the tail). The
# backward's half-typed row sums and stores run 8 columns at a time with a scalar tail.
VECTOR_PATH_DIMS = [*range(1, 18), 20, 24, 31, 32, 33, 40, 48, 56, 63, 64, 65, 72, 100]
VECTOR_PATH_DIMS += [127, 128, 129, 255, 256, 257, 1023, 1024, 1025]


@pytest.mark.parametrize(
    "combiner,weighted", [("sum", False), ("sum", True), ("sqrtn", True), ("max", False)]
)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("dim", VECTOR_PATH_DIMS)
def test_forward_vector_paths(rng, dim, dtype, combiner, weighted):
    """Every column-chunk path of the CPU forward, with short, empty and blocked (> 256) bags."""
    bags = ragged_bags(rng, [0, 1, 3, 17, 257, 5], 40, tf.int32, padding_id=-1)
    check_case(rng, bags, DTYPES[dtype], combiner, weighted, -1, 40, dim)


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint16)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize(
    "combiner,weighted", [("sum", True), ("mean", True), ("sqrtn", False), ("max", False)]
)
@pytest.mark.parametrize("dim", [7, 8, 13, 64, 67])
def test_half_outputs_are_the_float32_results_rounded_to_nearest_even(
    rng, dim, dtype, combiner, weighted
):
    """A half-typed table's output is its float32 sums rounded once, to nearest even: the
    same lookup on the table widened to float32 (exactly), rounded by numpy (ml_dtypes
    for bfloat16), bit for bit. Bags of two crafted rows land on ties, overflow to Inf
    and carry a negative NaN, whose sign survives (bfloat16's quiet NaN 0xFFC0). Pinned
    to the CPU, whose vector rounding of 8 columns at a time (and scalar tail) this is."""
    np_dtype = tf.as_dtype(dtype).as_numpy_dtype
    rows = 30
    table = (rng.standard_normal((rows, dim)) * 3).astype(np.float32).astype(np_dtype)
    half_ulp_at_one = 2.0**-11 if dtype == "float16" else 2.0**-8
    table[0] = 1.0
    table[1] = half_ulp_at_one  # 1 + half an ulp: a tie, rounded down to 1 (even)
    table[2] = 1.0 + 2 * half_ulp_at_one  # + half an ulp: a tie, rounded up (even)
    table[3] = 40000.0 if dtype == "float16" else 3e38  # two of them overflow
    table[4, ::2] = -np.nan
    crafted = [[0, 1], [2, 1], [3, 3], [4, 0], [1, 0, 2]]
    lengths = rng.integers(0, 6, size=9)
    random_bags = [list(rng.integers(0, rows, size=n)) for n in lengths]
    bag_list = crafted + random_bags
    ids = tf.ragged.constant(bag_list, dtype=tf.int64)
    weights = None
    if weighted:
        w = rng.uniform(0.5, 2.0, size=ids.values.shape[0]).astype(np.float32).astype(np_dtype)
        w[: sum(len(b) for b in crafted)] = 1.0  # the crafted sums stay exact in float32
        weights = ids.with_values(tf.constant(w))
    with tf.device("/CPU:0"):
        out = tf_ttemb.gather_reduce_sum(tf.constant(table), ids, weights, combiner=combiner)
        wide = tf_ttemb.gather_reduce_sum(
            tf.constant(table.astype(np.float32)),
            ids,
            None if weights is None else tf.cast(weights, tf.float32),
            combiner=combiner,
        )
    got = out.numpy()
    with np.errstate(over="ignore"):
        expected = wide.numpy().astype(np_dtype)
    nan = np.isnan(expected.astype(np.float32))
    assert nan.any()
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
    np.testing.assert_array_equal(_bits(got)[~nan], _bits(expected)[~nan])
    np.testing.assert_array_equal(_bits(got)[nan] >> 15, _bits(expected)[nan] >> 15)
    if combiner == "sum":
        # The two ties, to even: 1, and 1 + 2 ulps; two large rows overflow.
        np.testing.assert_array_equal(got[:2, 0].astype(np.float32), [1, 1 + 4 * half_ulp_at_one])
        assert np.isinf(got[2].astype(np.float32)).all()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("combiner,weighted", COMBINER_WEIGHTING, ids=COMBINER_IDS)
@pytest.mark.parametrize("form", ["dense2d", "ragged", "sparse"])
def test_long_bags(rng, form, combiner, weighted, dtype):
    """Bags of 0 to 5000 entries drawn from 200 rows."""
    if form == "dense2d":
        bags = dense_bags(rng, (3, 5000), 200, tf.int32, padding_id=-1, pad_fraction=0.05)
    elif form == "ragged":
        bags = ragged_bags(rng, [0, 5000, 1, 2, 4999, 17], 200, tf.int64, padding_id=-1)
    else:
        bags = sparse_bags(rng, [4999, 0, 3, 5000], 200, tf.int32, padding_id=7)
    padding_id = 7 if form == "sparse" else -1
    check_case(rng, bags, DTYPES[dtype], combiner, weighted, padding_id, 200, 8)


EMPTY_CASES = [
    ("dense2d", (0, 4)),
    ("dense2d", (5, 0)),
    ("dense2d", (0, 0)),
    ("dense3d", (0, 3, 4)),
    ("dense3d", (2, 0, 4)),
    ("dense3d", (2, 3, 0)),
    ("ragged", []),
    ("ragged", [0, 0, 0]),
    ("sparse", []),
    ("sparse", [0, 0, 0]),
]


def empty_bags(rng, form, spec, ids_dtype):
    if form.startswith("dense"):
        return dense_bags(rng, spec, 5, ids_dtype, ids=np.zeros(spec, dtype=np.int64))
    if form == "ragged":
        return ragged_bags(rng, spec, 5, ids_dtype)
    return sparse_bags(rng, spec, 5, ids_dtype, width=0 if spec else 4)


EMPTY_MODES = [(c, w, "eager") for c, w in COMBINER_WEIGHTING] + [
    ("sum", True, "function"),
    ("max", False, "function"),
]


@combiner_cases("combiner,weighted,mode", EMPTY_MODES)
@pytest.mark.parametrize("form,spec", EMPTY_CASES, ids=[f"{f}-{s}" for f, s in EMPTY_CASES])
def test_empty_batches_and_empty_bags(rng, form, spec, combiner, weighted, mode):
    bags = empty_bags(rng, form, spec, tf.int32)
    out, dp, dw = check_case(rng, bags, tf.float32, combiner, weighted, None, 5, 3, mode=mode)
    assert not np.any(out.numpy())
    if isinstance(dp, tf.IndexedSlices):
        assert dp.indices.shape[0] == 0
        assert tuple(dp.values.shape) == (0, 3)


@pytest.mark.parametrize("combiner,weighted", COMBINER_WEIGHTING, ids=COMBINER_IDS)
def test_one_row_repeated_in_every_bag(rng, combiner, weighted):
    bags = ragged_bags(rng, [3, 1, 4], 6, tf.int64, ids=[2, 2, 2, 2, 2, 5, 2, 2])
    _, dp, _ = check_case(rng, bags, tf.float64, combiner, weighted, None, 6, 4)
    np.testing.assert_array_equal(dp.indices.numpy(), [2, 5])


@pytest.mark.parametrize("form", ["dense2d", "ragged", "sparse"])
@pytest.mark.parametrize("combiner", ["mean", "sqrtn"])
def test_zero_denominator_gives_zeros(rng, form, combiner):
    """mean with weights summing to 0, sqrtn with all-zero weights: zeros, zero gradients."""
    csr = {"mean": [1.0, -0.5, -0.5, 2.0, 1.0], "sqrtn": [0.0, 0.0, 0.0, 2.0, 1.0]}[combiner]
    ids = [[1, 3, 1], [0, 4, -1]]  # second bag: padding entry carries no weight
    if form == "dense2d":
        bags = dense_bags(rng, None, 5, tf.int32, ids=ids)
        csr = csr + [7.0]
    elif form == "ragged":
        bags = ragged_bags(rng, [3, 2], 5, tf.int32, ids=[1, 3, 1, 0, 4])
    else:
        bags = sparse_bags(rng, [3, 2], 5, tf.int32, ids=[1, 3, 1, 0, 4])
    params, params64 = make_params(rng, 5, 3, tf.float64)
    w = tf.constant(bags.values_from_csr(np.array(csr)), dtype=tf.float64)
    up, up64 = make_upstream(rng, bags, 3, tf.float64)
    out, dp, dw = run_op(params, bags, w, up, combiner=combiner, padding_id=-1)
    (ref_out, s_out), (ref_dp, s_dp), (ref_dw, s_dw) = reference_all(
        params64, bags, np.array(csr), up64, combiner, -1
    )
    assert not np.any(ref_out[0]) and not np.any(ref_dp[[1, 3]])
    assert_close(dense_value(out).reshape(-1, 3), ref_out, s_out, tf.float64, "forward")
    assert_close(dense_value(dp), ref_dp, s_dp, tf.float64, "params grad")
    assert_close(bags.csr_from_values(dense_value(dw)), ref_dw, s_dw, tf.float64, "weights grad")


@pytest.mark.parametrize("form", ["dense2d", "ragged", "sparse"])
def test_max_of_negative_values_and_empty_bag(rng, form):
    """max starts from the first entry, not from 0; an empty bag gives 0, not -inf."""
    params64 = -rng.uniform(1.0, 2.0, size=(6, 5))
    params = tf.constant(params64)
    if form == "dense2d":
        bags = dense_bags(rng, None, 6, tf.int64, ids=[[1, 4, 2], [-1, -1, -1]])
    elif form == "ragged":
        bags = ragged_bags(rng, [3, 0], 6, tf.int64, ids=[1, 4, 2])
    else:
        bags = sparse_bags(rng, [3, 0], 6, tf.int64, ids=[1, 4, 2])
    out = tf_ttemb.gather_reduce_sum(params, bags.ids, combiner="max", padding_id=-1)
    want = np.stack([params64[[1, 4, 2]].max(axis=0), np.zeros(5)])
    np.testing.assert_allclose(out.numpy(), want, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["eager", "function", "jit"])
@pytest.mark.parametrize("form", ["dense2d", "ragged", "sparse"])
def test_max_ties_go_to_the_first_entry(rng, form, mode):
    """Rows 1, 3 and 4 are equal and larger than all others: the first of them in each bag wins.

    For the SparseTensor the entries are handed over shuffled; the bag order is the column
    order, so the entry with the smallest column is the first.
    """
    params64 = rng.uniform(-1.0, 0.0, size=(6, 4))
    params64[[1, 3, 4]] = rng.uniform(1.0, 2.0, size=4)
    params64[5, 2] = 5.0  # row 5 wins column 2 wherever it appears
    bag_ids = [[3, 1, 4, -1], [-1, 4, 0, 1], [0, 1, 5, 3]]
    if form == "dense2d":
        bags = dense_bags(rng, None, 6, tf.int32, ids=bag_ids)
    else:
        flat = [i for bag in bag_ids for i in bag if i != -1]
        lengths = [sum(i != -1 for i in bag) for bag in bag_ids]
        make = ragged_bags if form == "ragged" else sparse_bags
        bags = make(rng, lengths, 6, tf.int32, ids=flat)
    up, up64 = make_upstream(rng, bags, 4, tf.float64)
    _, dp, _ = run_op(tf.constant(params64), bags, None, up, mode, combiner="max", padding_id=-1)
    want = np.zeros((6, 4))
    want[3] += up64[0]
    want[4] += up64[1]
    want[1] += np.where(np.arange(4) == 2, 0.0, up64[2])
    want[5, 2] += up64[2, 2]
    np.testing.assert_allclose(dense_value(dp), want, rtol=0, atol=1e-12)
    ref, _ = reference.params_grad(params64, bags.flat_ids, bags.splits, up64, None, "max", -1)
    np.testing.assert_allclose(ref, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("params_dtype", ["float16", "bfloat16", "float64"])
def test_weights_are_cast_to_the_params_dtype(rng, params_dtype):
    dtype = DTYPES[params_dtype]
    bags = ragged_bags(rng, [2, 0, 3], 7, tf.int32, padding_id=-1)
    params, params64 = make_params(rng, 7, 3, dtype)
    w32 = tf.constant(rng.uniform(0.5, 1.5, size=bags.nnz), dtype=tf.float32)
    w64 = tf.cast(tf.cast(w32, dtype), tf.float64).numpy()
    up, up64 = make_upstream(rng, bags, 3, dtype)
    out, _, dw = run_op(params, bags, w32, up, combiner="mean", padding_id=-1)
    (ref_out, s_out), _, (ref_dw, s_dw) = reference_all(params64, bags, w64, up64, "mean", -1)
    assert out.dtype == dtype
    assert dw.dtype == tf.float32
    assert_close(dense_value(out), ref_out, s_out, dtype, "forward")
    # The gradient flows back through the cast to the weights' float32.
    dw_dtype = tf.float32 if dtype == tf.float64 else dtype
    assert_close(dense_value(dw), ref_dw, s_dw, dw_dtype, "weights grad")


# --------------------------------------------------------------------------------------
# Gradient structure: deduplicated sorted IndexedSlices, or dense with dense_grad=True.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("padding_id", [None, -1, 2], ids=lambda p: f"pad{p}")
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("ids_dtype", list(ID_DTYPES))
@pytest.mark.parametrize(
    "combiner,weighted", [("sum", True), ("max", False)], ids=["sum-weighted", "max"]
)
def test_params_grad_is_deduplicated_sorted_indexed_slices(
    rng, combiner, weighted, ids_dtype, form, padding_id, implementation
):
    num_rows, dim = 9, 4
    bags = make_bags(rng, form, num_rows, ID_DTYPES[ids_dtype], padding_id, max_len=8)
    (params, params64), (w, w64), (up, up64) = make_inputs(
        rng, bags, num_rows, dim, tf.float32, combiner, weighted
    )
    _, dp, _ = run_op(
        params,
        bags,
        w,
        up,
        combiner=combiner,
        padding_id=padding_id,
        implementation=implementation,
    )
    assert isinstance(dp, tf.IndexedSlices), type(dp)
    rows = reference.touched_rows(bags.flat_ids, padding_id)
    np.testing.assert_array_equal(dp.indices.numpy(), rows)
    assert tuple(dp.values.shape) == (len(rows), dim)
    np.testing.assert_array_equal(np.asarray(dp.dense_shape), [num_rows, dim])
    ref_dp, s_dp = reference.params_grad(
        params64, bags.flat_ids, bags.splits, up64, w64, combiner, padding_id
    )
    assert_close(dp.values.numpy(), ref_dp[rows], s_dp[rows], tf.float32, "slice values")


@pytest.mark.parametrize(
    "form,ids_dtype,implementation",
    [(f, i, "custom_op") for f in FORMS for i in ID_DTYPES]
    + [("ragged", "int32", "composite"), ("dense3d", "int64", "composite")],
)
def test_indexed_slices_in_tf_function(rng, ids_dtype, form, implementation):
    bags = make_bags(rng, form, 9, ID_DTYPES[ids_dtype], padding_id=-1, max_len=8)
    params, _ = make_params(rng, 9, 2, tf.float64)
    up, _ = make_upstream(rng, bags, 2, tf.float64)
    _, dp, _ = run_op(
        params, bags, None, up, "function", padding_id=-1, implementation=implementation
    )
    assert isinstance(dp, tf.IndexedSlices), type(dp)
    np.testing.assert_array_equal(dp.indices.numpy(), reference.touched_rows(bags.flat_ids, -1))


def _check_dense_grad(rng, combiner, weighted, form, implementation, mode):
    bags = make_bags(rng, form, 10, tf.int64, padding_id=-1)
    _, dp, _ = check_case(
        rng,
        bags,
        tf.float32,
        combiner,
        weighted,
        -1,
        10,
        3,
        mode=mode,
        dense_grad=True,
        implementation=implementation,
    )
    assert not isinstance(dp, tf.IndexedSlices)
    assert isinstance(dp, tf.Tensor)
    assert tuple(dp.shape) == (10, 3)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("combiner,weighted", COMBINER_WEIGHTING, ids=COMBINER_IDS)
def test_dense_grad(rng, combiner, weighted, form, implementation):
    _check_dense_grad(rng, combiner, weighted, form, implementation, "eager")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "combiner,weighted", [("sum", True), ("max", False)], ids=["sum-weighted", "max"]
)
@pytest.mark.parametrize("form", ["dense2d", "ragged", "sparse"])
def test_dense_grad_in_tf_function(rng, form, combiner, weighted, implementation):
    _check_dense_grad(rng, combiner, weighted, form, implementation, "function")


@pytest.mark.parametrize(
    "num_rows,dim,untouched",
    [(300, 17, 0), (300, 17, 5), (40_000, 8, 30_000)],
    ids=["every-row-touched", "few-untouched", "many-untouched"],
)
def test_dense_grad_op_zeroes_exactly_the_untouched_rows(rng, num_rows, dim, untouched):
    # The raw op: rows no entry touches are zeroed (on this thread below 256 KiB of zeros,
    # on the pool above), touched rows hold their sums, and with every row touched
    # nothing is zeroed. A first call of the same shape leaves nonzero values in the
    # memory the allocator hands out next.
    from tf_ttemb.ops import _loader

    lib = _loader.load_op_library()
    skipped = rng.choice(num_rows, size=untouched, replace=False)
    touched = np.setdiff1d(np.arange(num_rows), skipped)
    ids = rng.permutation(np.concatenate([touched, rng.choice(touched, size=len(touched) // 3)]))
    num_bags = 64
    cuts = np.sort(rng.integers(0, len(ids) + 1, size=num_bags - 1))
    splits = np.concatenate([[0], cuts, [len(ids)]]).astype(np.int64)
    upstream = rng.standard_normal((num_bags, dim)).astype(np.float32)
    bag_of = np.repeat(np.arange(num_bags), np.diff(splits))
    expected = np.zeros((num_rows, dim))
    np.add.at(expected, ids, upstream[bag_of].astype(np.float64))

    def dense_grad(ids, upstream):
        return lib.tf_ttemb_gather_reduce_sum_dense_grad(
            tf.constant(upstream),
            tf.constant(ids.astype(np.int64)),
            tf.constant(splits),
            tf.zeros([0]),
            tf.zeros([0, dim], tf.int32),
            tf.constant(num_rows, tf.int64),
        ).numpy()

    everywhere = np.concatenate([np.arange(num_rows), rng.integers(0, num_rows, len(ids))])
    filled = dense_grad(everywhere[: len(ids)], np.abs(upstream) + 1)
    assert np.count_nonzero(filled) > 0
    out = dense_grad(ids, upstream)
    np.testing.assert_array_equal(out[skipped], 0)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------
# Finite differences in float64.
# --------------------------------------------------------------------------------------


# The composite path is slow eagerly (~0.1 s a call, and finite differences call it
# 2 * N * D times), so it is checked on the combiners whose gradients differ most.
FD_CASES = [
    (c, w, f, "custom_op") for c, w in COMBINER_WEIGHTING for f in ("dense2d", "ragged", "sparse")
] + [
    ("sqrtn", True, "ragged", "composite"),
    ("max", False, "dense2d", "composite"),
]


@combiner_cases("combiner,weighted,form,implementation", FD_CASES)
def test_compute_gradient_float64(rng, combiner, weighted, form, implementation):
    num_rows, dim = 5, 3
    bags = make_bags(rng, form, num_rows, tf.int32, padding_id=-1, num_bags=3, max_len=4)
    params, _ = make_params(rng, num_rows, dim, tf.float64, distinct=combiner == "max")
    w, _ = make_weights(rng, bags, tf.float64) if weighted else (None, None)
    kwargs = dict(combiner=combiner, padding_id=-1, implementation=implementation)

    def of_params(p):
        weights = None if w is None else weights_like(bags.ids, w)
        return tf_ttemb.gather_reduce_sum(p, bags.ids, weights, **kwargs)

    theoretical, numerical = tf.test.compute_gradient(of_params, [params], delta=1e-6)
    np.testing.assert_allclose(theoretical[0], numerical[0], rtol=0, atol=1e-8)
    assert np.any(theoretical[0])

    if weighted:

        def of_weights(values):
            weights = weights_like(bags.ids, values)
            return tf_ttemb.gather_reduce_sum(params, bags.ids, weights, **kwargs)

        theoretical, numerical = tf.test.compute_gradient(of_weights, [w], delta=1e-6)
        np.testing.assert_allclose(theoretical[0], numerical[0], rtol=0, atol=1e-8)
        assert np.any(theoretical[0])


# --------------------------------------------------------------------------------------
# Custom op vs composite fallback, and XLA.
# --------------------------------------------------------------------------------------


def _both_implementations(rng, form, ids_dtype, dtype, combiner, weighted, modes):
    """Runs each (mode, implementation) of `modes` on the same bags of `form` (11 rows,
    padding -1, D = 5); compares each with the reference and with the first."""
    padding_id, num_rows, dim = -1, 11, 5
    bags = make_bags(rng, form, num_rows, ids_dtype, padding_id=padding_id)
    (params, params64), (w, w64), (up, up64) = make_inputs(
        rng, bags, num_rows, dim, dtype, combiner, weighted
    )
    (ref_out, s_out), (ref_dp, s_dp), ref_dw = reference_all(
        params64, bags, w64, up64, combiner, padding_id
    )
    results = []
    for mode, implementation in modes:
        out, dp, dw = run_op(
            params,
            bags,
            w,
            up,
            mode,
            combiner=combiner,
            padding_id=padding_id,
            implementation=implementation,
        )
        what = f"{implementation} ({mode})"
        assert out.dtype == dtype
        assert_close(dense_value(out).reshape(-1, dim), ref_out, s_out, dtype, f"{what} forward")
        assert_close(dense_value(dp), ref_dp, s_dp, dtype, f"{what} params grad")
        if weighted:
            dw64 = bags.csr_from_values(dense_value(dw))
            assert_close(dw64, *ref_dw, dtype, f"{what} weights grad")
        results.append((dense_value(out), dense_value(dp)))
    # Same numbers within tolerance, pairwise (scale of the reference terms).
    first = results[0]
    for (mode, implementation), other in zip(modes[1:], results[1:]):
        assert_close(
            other[0].reshape(-1, dim),
            first[0].reshape(-1, dim),
            s_out,
            dtype,
            f"{implementation} ({mode}) vs {modes[0][1]} forward",
        )
        assert_close(
            other[1],
            first[1],
            s_dp,
            dtype,
            f"{implementation} ({mode}) vs {modes[0][1]} params grad",
        )


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("combiner,weighted", COMBINER_WEIGHTING, ids=COMBINER_IDS)
def test_custom_op_matches_composite(rng, combiner, weighted, form, dtype):
    modes = [("eager", "custom_op"), ("eager", "composite")]
    _both_implementations(rng, form, tf.int32, DTYPES[dtype], combiner, weighted, modes)


# Tracing the composite path (a while loop plus its custom gradient) takes seconds.
COMPOSITE_FUNCTION_CASES = [(c, w, "ragged") for c, w in COMBINER_WEIGHTING] + [
    ("sum", True, "dense2d"),
    ("sum", True, "dense3d"),
    ("sum", True, "sparse"),
]


@combiner_cases("combiner,weighted,form", COMPOSITE_FUNCTION_CASES)
def test_custom_op_matches_composite_in_tf_function(rng, combiner, weighted, form):
    modes = [("function", "custom_op"), ("function", "composite")]
    _both_implementations(rng, form, tf.int64, tf.float32, combiner, weighted, modes)


# Each XLA compilation takes seconds: every combiner once (ragged ids), every form once.
JIT_CASES = [(c, w, "ragged", "auto") for c, w in COMBINER_WEIGHTING] + [
    ("mean", True, "dense2d", "auto"),
    ("max", False, "dense3d", "composite"),
    ("sum", True, "sparse", "auto"),
]


@combiner_cases("combiner,weighted,form,implementation", JIT_CASES)
def test_jit_compile_matches_custom_op(rng, combiner, weighted, form, implementation):
    modes = [("eager", "custom_op"), ("jit", implementation)]
    _both_implementations(rng, form, tf.int64, tf.float32, combiner, weighted, modes)


@pytest.mark.parametrize(
    "dtype,combiner,weighted",
    [("float16", "mean", True), ("bfloat16", "max", False), ("float64", "sqrtn", True)],
    ids=["float16-mean-weighted", "bfloat16-max", "float64-sqrtn-weighted"],
)
def test_jit_compile_other_dtypes(rng, combiner, weighted, dtype):
    modes = [("eager", "custom_op"), ("jit", "auto")]
    _both_implementations(rng, "ragged", tf.int32, DTYPES[dtype], combiner, weighted, modes)


def _composite_module():
    return importlib.import_module("tf_ttemb.ops.composite")


CHUNK_CASES = [
    (c, w, f, "eager") for c, w in COMBINER_WEIGHTING for f in ("dense2d", "ragged", "sparse")
] + [
    ("mean", True, "ragged", "jit"),
    ("max", False, "dense2d", "jit"),
    ("sqrtn", True, "sparse", "jit"),
]


@combiner_cases("combiner,weighted,form,mode", CHUNK_CASES)
def test_composite_across_many_chunks(rng, monkeypatch, combiner, weighted, form, mode):
    """A tiny chunk budget makes the composite loop over many chunks, the last one partial."""
    monkeypatch.setattr(_composite_module(), "COMPOSITE_CHUNK_BYTES", 40)
    if form == "dense2d":
        bags = dense_bags(rng, (7, 9), 11, tf.int32, padding_id=-1)
    else:
        make = ragged_bags if form == "ragged" else sparse_bags
        bags = make(rng, [5, 0, 13, 1, 9, 0, 4], 11, tf.int64, padding_id=-1)
    check_case(
        rng, bags, tf.float32, combiner, weighted, -1, 11, 3, mode=mode, implementation="composite"
    )


def test_out_of_range_ids_under_jit_count_as_padding(rng):
    """Under XLA the composite cannot raise; documented: bad ids behave like padding."""
    params, params64 = make_params(rng, 6, 3, tf.float32)
    ids = np.array([[0, 9001, 2], [-5, 4, 4]])
    bags = dense_bags(rng, None, 6, tf.int64, ids=ids)
    up, up64 = make_upstream(rng, bags, 3, tf.float32)
    out, dp, _ = run_op(params, bags, None, up, "jit", combiner="mean")
    as_padding = np.where((ids < 0) | (ids >= 6), -1, ids).reshape(-1)
    want, scale = reference.forward(params64, as_padding, bags.splits, None, "mean", -1)
    assert_close(out.numpy(), want, scale, tf.float32, "forward")
    want_dp, scale = reference.params_grad(
        params64, as_padding, bags.splits, up64, None, "mean", -1
    )
    assert_close(dense_value(dp), want_dp, scale, tf.float32, "params grad")


def _op_types(concrete_function):
    """Every op type in a traced function, including nested functions of its library."""
    graph_def = concrete_function.graph.as_graph_def()
    types = {node.op for node in graph_def.node}
    for fn in graph_def.library.function:
        types.update(node.op for node in fn.node_def)
    return types


@pytest.mark.parametrize("jit_compile", [False, True])
def test_auto_picks_composite_only_under_jit(rng, jit_compile):
    bags = make_bags(rng, "ragged", 11, tf.int32, padding_id=-1)
    params, _ = make_params(rng, 11, 3, tf.float32)

    @tf.function(jit_compile=jit_compile)
    def f(params, ids):
        with tf.GradientTape() as tape:
            tape.watch(params)
            out = tf_ttemb.gather_reduce_sum(params, ids, padding_id=-1)
        return out, tf.convert_to_tensor(tape.gradient(out, params))

    f(params, bags.ids)
    custom = {t for t in _op_types(f.get_concrete_function(params, bags.ids)) if "TfTtemb" in t}
    if jit_compile:
        assert not custom, f"custom ops traced under jit_compile=True: {sorted(custom)}"
    else:
        assert "TfTtemb>GatherReduceSum" in custom, sorted(custom)


def test_sparse_weights_in_another_entry_order(rng):
    """Sparse weights are matched to ids by coordinate, not by position in `values`."""
    bags = sparse_bags(rng, [3, 0, 4, 2], 9, tf.int64, padding_id=-1)
    params, params64 = make_params(rng, 9, 3, tf.float64)
    w64 = rng.uniform(0.5, 1.5, size=bags.nnz)
    shuffled = rng.permutation(bags.nnz)
    values = bags.values_from_csr(w64)
    weights = tf.SparseTensor(
        tf.gather(bags.ids.indices, shuffled),
        tf.constant(values[shuffled]),
        bags.ids.dense_shape,
    )
    out = tf_ttemb.gather_reduce_sum(params, bags.ids, weights, combiner="mean", padding_id=-1)
    want, scale = reference.forward(params64, bags.flat_ids, bags.splits, w64, "mean", -1)
    assert_close(out.numpy(), want, scale, tf.float64, "forward")


# --------------------------------------------------------------------------------------
# Shapes in graphs: static where known, dynamic where not.
# --------------------------------------------------------------------------------------

SIGNATURES = {
    "dense2d": tf.TensorSpec([None, 5], tf.int32),
    "dense3d": tf.TensorSpec([2, None, 4], tf.int32),
    "ragged": tf.RaggedTensorSpec([None, None], tf.int32, ragged_rank=1),
    "sparse": tf.SparseTensorSpec([None, None], tf.int32),
}
STATIC_SHAPES = {
    "dense2d": [None, 3],
    "dense3d": [2, None, 3],
    "ragged": [None, 3],
    "sparse": [None, 3],
}


@pytest.mark.parametrize("form", FORMS)
def test_static_and_dynamic_shapes_in_tf_function(rng, form):
    bags = make_bags(rng, form, 11, tf.int32, padding_id=-1)
    params, params64 = make_params(rng, 11, 3, tf.float32)
    seen = []

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32), SIGNATURES[form]])
    def f(params, ids):
        out = tf_ttemb.gather_reduce_sum(params, ids, combiner="sqrtn", padding_id=-1)
        seen.append(out.shape.as_list())
        return out

    out = f(params, bags.ids)
    assert seen == [STATIC_SHAPES[form]]
    want, scale = reference.forward(params64, bags.flat_ids, bags.splits, None, "sqrtn", -1)
    assert_close(out.numpy().reshape(-1, 3), want, scale, tf.float32, "forward")


def test_eager_lookup_reads_no_rows_unless_a_tape_records(rng, monkeypatch):
    # The no-row read that tells a tape about the variable is one more eager op per call:
    # it runs only under a tape.
    table = tf.Variable(rng.normal(size=(20, 4)).astype(np.float32))
    ids = tf.constant(rng.integers(0, 20, size=(5, 3)))
    reads = []
    original = type(table).sparse_read

    def counting_read(self, *args, **kwargs):
        reads.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(table), "sparse_read", counting_read)
    out = tf_ttemb.gather_reduce_sum(table, ids)
    assert reads == []
    with tf.GradientTape() as tape:
        out_taped = tf_ttemb.gather_reduce_sum(table, ids)
    assert reads == [1]
    np.testing.assert_array_equal(out.numpy(), out_taped.numpy())
    grad = tape.gradient(out_taped, table)
    assert isinstance(grad, tf.IndexedSlices)
    counts = np.bincount(ids.numpy().reshape(-1), minlength=20)
    np.testing.assert_allclose(
        tf.convert_to_tensor(grad).numpy(), counts[:, None] * np.ones((1, 4)), rtol=0, atol=0
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("combiner,weighted", COMBINER_WEIGHTING, ids=COMBINER_IDS)
def test_on_gpu(rng, combiner, weighted, form, dtype):
    if not built_with_cuda():
        pytest.skip("op library built without CUDA")
    with tf.device("/GPU:0"):
        bags = make_bags(rng, form, 11, tf.int64, padding_id=-1, max_len=40)
        out, _, _ = check_case(rng, bags, DTYPES[dtype], combiner, weighted, -1, 11, 33)
    assert "GPU" in out.device, out.device


# Edge shapes the fuzz test (test_fuzz.py) found failing in the composite: a weighted
# backward with no bags at all (its per-chunk TensorArray was empty), a one-row table or a
# single bag under XLA (the loop state's static dim of 1 was lost to broadcasting), and no
# entries under XLA (the loop body sliced a chunk of an array with no chunks).
@pytest.mark.parametrize(
    "implementation,mode",
    [("custom_op", "eager"), ("composite", "eager"), ("composite", "function"), ("auto", "jit")],
)
@pytest.mark.parametrize(
    "shape,num_rows",
    [((0, 3), 4), ((2, 0), 4), ((3, 4), 1), ((1, 5), 6)],
    ids=["no_bags", "empty_bags", "one_row_table", "one_bag"],
)
@pytest.mark.parametrize(
    "combiner,weighted",
    [("sqrtn", True), ("sum", False), ("max", False)],
    ids=["sqrtn_weighted", "sum", "max"],
)
def test_edge_shapes_on_every_path(rng, combiner, weighted, shape, num_rows, implementation, mode):
    bags = dense_bags(rng, shape, num_rows, tf.int64)
    check_case(
        rng,
        bags,
        tf.float32,
        combiner,
        weighted,
        None,
        num_rows,
        3,
        mode=mode,
        implementation=implementation,
    )


# One bag of a million entries (issue 18, case 6): the CPU kernel adds a bag's terms in
# blocks of 256 whose sums are combined pairwise, so its float32 error is at most about
# (256 + log2(L / 256)) ulps of the sum of the terms' magnitudes (1.6e-5 here), not
# L ulps. The test holds it to 1e-6, where this blocked sum lands (5e-8 in a numpy
# simulation over 5 seeds): a sequential float32 sum of these positive terms is off by
# 7e-6 to 2e-5, so the test fails on one.
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_long_bag_error_is_blocked_not_sequential(rng, combiner):
    length, num_rows, dim = 1_000_000, 50, 4
    params, params64 = quantize(rng.uniform(0.5, 1.5, size=(num_rows, dim)), tf.float32)
    weights, weights64 = quantize(rng.uniform(0.5, 1.5, size=length), tf.float32)
    ids = rng.integers(0, num_rows, size=length)
    with tf.device("/CPU:0"):
        out = tf_ttemb.gather_reduce_sum(
            params,
            tf.constant(ids[None, :]),
            weights[None, :],
            combiner=combiner,
            implementation="custom_op",
        )
    totals = np.bincount(ids, weights=weights64, minlength=num_rows) @ params64  # float64
    denominator = {
        "sum": 1.0,
        "mean": weights64.sum(),
        "sqrtn": np.sqrt(np.square(weights64).sum()),
    }[combiner]
    want = totals / denominator  # all terms are positive: the sum is their magnitudes' too
    error = np.max(np.abs(out.numpy()[0].astype(np.float64) - want) / want)
    assert error <= 1e-6, error
