"""Hostile inputs that once crashed the process or gave errors that named nothing.

Each case runs in a fresh interpreter (a crash there fails the test instead of killing
the test run), on every device TensorFlow sees, through the public API or the raw op
that any graph can call, and must raise the documented error naming the size or the
argument that is wrong. (Issue "Hostile inputs": cases 1, 2, 3, 5, 7, 10, 11 and 12.)
NaN and Inf in the table (cases 4 and 8) must give one result, exactly the reference's,
from every implementation on every device.
"""

from __future__ import annotations

import json
import re

import keras
import numpy as np
import pytest
import reference
import tensorflow as tf
from bags import DTYPES, dense_value, quantize, ragged_bags, reference_all, weights_like
from processes import run_fresh_python, visible_devices
from test_gather_reduce_sum import run_op

from tf_ttemb.layers import ProductKeyMemory

CASES_SCRIPT = """
    import json, sys
    import tensorflow as tf
    import tf_ttemb
    from tf_ttemb.ops import _loader

    device = sys.argv[1]
    lib = _loader.load_op_library()

    def tt_layer(implementation):
        layer = tf_ttemb.layers.TTEmbeddingBag(
            1, 65536, tt_ranks=[1, 1, 2**20], tt_p_shapes=[1, 1, 1, 1],
            tt_q_shapes=[256, 256, 1, 1], implementation=implementation)
        return layer(tf.constant([[0]]))

    def tt_rows_huge_dim():
        q = [2**21, 2**21, 2**20]
        cores = [tf.zeros([1, q[0]]), tf.zeros([1, q[1]]), tf.zeros([1, q[2]])]
        return lib.tf_ttemb_tt_rows(tf.constant([0, 0, 0, 0], tf.int64), cores,
                                    p_shapes=[1, 1, 1], q_shapes=q, ranks=[1, 1],
                                    num_tables=1)

    def grs_huge_output(implementation):
        return tf_ttemb.gather_reduce_sum(tf.zeros([0, 2**62]), tf.zeros([4, 0], tf.int64),
                                          implementation=implementation)

    def dense_grad_huge_rows():
        return lib.tf_ttemb_gather_reduce_sum_dense_grad(
            tf.zeros([1, 2]), tf.zeros([0], tf.int64), tf.constant([0, 0], tf.int64),
            tf.zeros([0]), tf.zeros([0, 2], tf.int32), tf.constant(2**62, tf.int64))

    def padding_too_large():
        return tf_ttemb.gather_reduce_sum(tf.zeros([3, 2]), tf.constant([[0, 1]]),
                                          padding_id=2**70)

    cases = {
        "tt_layer_custom_op": lambda: tt_layer("custom_op"),
        "tt_layer_composite": lambda: tt_layer("composite"),
        "tt_rows_huge_dim": tt_rows_huge_dim,
        "grs_huge_output_custom_op": lambda: grs_huge_output("custom_op"),
        "grs_huge_output_composite": lambda: grs_huge_output("composite"),
        "dense_grad_huge_rows": dense_grad_huge_rows,
        "padding_too_large": padding_too_large,
    }
    report = {}
    for name, case in cases.items():
        try:
            with tf.device(device):
                tf.nest.map_structure(lambda t: t.numpy(), case())
            report[name] = ["no error", ""]
        except Exception as e:  # noqa: BLE001 - the type is what the test checks
            report[name] = [type(e).__name__, str(e)]
    print(json.dumps(report))
"""

# case -> (error type, a regex the message must match: the size or the argument named).
EXPECTED = {
    "tt_layer_custom_op": (
        "ResourceExhaustedError",
        r"partial product of one id after core 2 has .* = 68719476736 "
        r"elements, more than the 268435456",
    ),
    "tt_layer_composite": ("ResourceExhaustedError", r""),
    "tt_rows_huge_dim": (
        "ResourceExhaustedError",
        r"partial product of one id after core 1 .* = 4398046511104 "
        r"elements",
    ),
    "grs_huge_output_custom_op": (
        "InvalidArgumentError",
        r"output \[num_bags, D\] would have shape "
        r"\[4, 4611686018427387904\]: more elements than a tensor",
    ),
    "grs_huge_output_composite": ("InvalidArgumentError", r""),
    "dense_grad_huge_rows": (
        "InvalidArgumentError",
        r"params_grad \[num_rows, D\] would have shape "
        r"\[4611686018427387904, 2\]",
    ),
    "padding_too_large": (
        "ValueError",
        r"padding_id must be in int64's range .* got 1180591620717411303424",
    ),
}


@pytest.mark.parametrize("device", visible_devices())
def test_hostile_sizes_raise_errors_that_name_them(device):
    report = json.loads(run_fresh_python(CASES_SCRIPT, device))
    assert set(report) == set(EXPECTED)
    for name, (kind, pattern) in EXPECTED.items():
        got_kind, message = report[name]
        assert got_kind == kind, (name, report[name])
        assert re.search(pattern, message), (name, message)


# --------------------------------------------------------------------------------------
# ProductKeyMemory masks (cases 3 and 10): masked tokens update nothing, whatever they
# hold; a mask of another shape is an error also where shapes are only known at run time.


def _pkm_gradients(layer, x, mask):
    with tf.GradientTape() as tape:
        y = layer(x, training=True, mask=mask)
        loss = tf.reduce_sum(tf.sin(y))
    names = [v.name for v in layer.trainable_variables]
    return dict(zip(names, tape.gradient(loss, layer.trainable_variables)))


@pytest.mark.parametrize("hostile", [np.nan, np.inf, 1e30])
def test_pkm_masked_token_contents_change_nothing(rng, hostile):
    keras.utils.set_random_seed(int(rng.integers(2**31)))
    layer = ProductKeyMemory(8, n_keys=6, k_dim=4, heads=2, knn=3)
    x = rng.normal(size=(2, 5, 7)).astype(np.float32)
    mask = np.ones((2, 5), bool)
    mask[0, 1] = mask[1, 4] = False
    layer(x)  # build
    start = [v.numpy() for v in layer.weights]
    clean = x.copy()
    clean[~mask] = 0.0
    want = _pkm_gradients(layer, tf.constant(clean), tf.constant(mask))
    for v, value in zip(layer.weights, start):  # undo the batch-norm statistics update
        v.assign(value)
    dirty = x.copy()
    dirty[~mask] = hostile
    got = _pkm_gradients(layer, tf.constant(dirty), tf.constant(mask))
    for name, g in got.items():
        assert g is not None, name
        g = tf.convert_to_tensor(g).numpy()
        assert np.all(np.isfinite(g)), name
        np.testing.assert_array_equal(g, tf.convert_to_tensor(want[name]).numpy(), err_msg=name)


def test_pkm_mask_of_another_shape_raises_in_a_function(rng):
    layer = ProductKeyMemory(8, n_keys=6, k_dim=4, heads=2, knn=3)

    @tf.function(
        input_signature=[tf.TensorSpec([None, None, 7]), tf.TensorSpec([None, None], tf.bool)]
    )
    def read(x, mask):
        return layer(x, mask=mask)

    x = tf.constant(rng.normal(size=(2, 6, 7)), tf.float32)
    read(x, tf.ones([2, 6], tf.bool))
    with pytest.raises(
        tf.errors.InvalidArgumentError,
        match="mask must have the shape of the inputs without their last axis",
    ):
        read(x, tf.ones([6, 2], tf.bool))  # 12 elements, as many as the right shape


# --------------------------------------------------------------------------------------
# SparseTensor ids outside their dense_shape (case 5) and an empty table (case 7): the
# same result or the same error from every implementation, eagerly and in a function.

IMPLEMENTATIONS = ["custom_op", "composite"]


def _maybe_function(fn, in_function):
    return tf.function(fn) if in_function else fn


@pytest.mark.parametrize("in_function", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "coords",
    [[[0, 0], [-1, 1]], [[0, 0], [5, 0]], [[0, 1], [1, 7]]],
    ids=["negative_row", "row_past_shape", "column_past_shape"],
)
def test_sparse_ids_outside_dense_shape_are_named(rng, implementation, in_function, coords):
    import tf_ttemb

    table = tf.constant(rng.normal(size=(6, 3)), tf.float32)
    sparse = tf.SparseTensor(tf.constant(coords, tf.int64), tf.constant([1, 2], tf.int64), [2, 2])
    run = _maybe_function(
        lambda: tf_ttemb.gather_reduce_sum(table, sparse, implementation=implementation),
        in_function,
    )
    bad = coords[1]
    with pytest.raises(
        tf.errors.InvalidArgumentError,
        match=re.escape(
            f"sparse indices: indices[1] = [{bad[0]}, {bad[1]}] "
            "is out of bounds for dense_shape [2, 2]"
        ),
    ):
        run()


@pytest.mark.parametrize("dense_grad", [False, True], ids=["sparse_grad", "dense_grad"])
@pytest.mark.parametrize("combiner", ["sum", "mean", "max"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_empty_table_with_padding_only_bags_gives_zeros(implementation, combiner, dense_grad):
    import tf_ttemb

    table = tf.Variable(tf.zeros([0, 3]))
    ids = tf.constant([[-1, -1], [-1, -1], [-1, -1]], tf.int64)
    with tf.GradientTape() as tape:
        out = tf_ttemb.gather_reduce_sum(
            table,
            ids,
            padding_id=-1,
            combiner=combiner,
            implementation=implementation,
            dense_grad=dense_grad,
        )
    np.testing.assert_array_equal(out.numpy(), np.zeros((3, 3), np.float32))
    grad = tf.convert_to_tensor(tape.gradient(out, table, output_gradients=tf.ones([3, 3])))
    assert tuple(grad.shape) == (0, 3)
    read = tf.function(
        lambda t: tf_ttemb.gather_reduce_sum(
            t, ids, padding_id=-1, combiner=combiner, implementation=implementation
        )
    )
    np.testing.assert_array_equal(read(tf.zeros([0, 3])).numpy(), np.zeros((3, 3), np.float32))


# --------------------------------------------------------------------------------------
# A TT core whose shape TensorFlow does not know statically (case 11): both
# implementations name the core and the shape it must have.


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "bad_shape", [[5, 4], [1, 4], [3, 3]], ids=["more_rows", "fewer_rows", "other_width"]
)
@pytest.mark.parametrize("api", ["tt_rows", "tt_embedding_bag"])
def test_tt_core_of_the_wrong_shape_is_named(rng, api, bad_shape, implementation):
    from tf_ttemb.ops import tt_embedding as tte

    p, q, ranks = [2, 3], [2, 2], [2]
    cores = [
        tf.Variable(rng.normal(size=(2, 4)), dtype=tf.float32),
        tf.Variable(rng.normal(size=bad_shape), dtype=tf.float32, shape=tf.TensorShape(None)),
    ]
    kwargs = dict(p_shapes=p, q_shapes=q, ranks=ranks, implementation=implementation)
    with pytest.raises(
        tf.errors.InvalidArgumentError,
        match=re.escape("cores[1] must be [num_tables * p_shapes[1], r_1 * q_1 * r_2] = [3, 4]"),
    ):
        if api == "tt_rows":
            tte.tt_rows(cores, tf.constant([0, 5], tf.int64), **kwargs)
        else:
            tte.tt_embedding_bag(
                cores, tf.constant([[0, 5], [1, 2]], tf.int64), num_embeddings=6, **kwargs
            )


# --------------------------------------------------------------------------------------
# NaN and Inf in the table (cases 4 and 8): one result from every implementation on every
# device. Under max, NaN wins (as in tf.reduce_max) and -inf/+inf are ordinary values; a
# bag's column sends its gradient to the bag's first NaN entry, else to its first maximal
# entry. Under mean and sqrtn, a bag whose denominator is zero gives +0.0 and zero
# gradients, whatever its rows hold. Every value here is exact in every dtype, so every
# path must give the float64 reference's numbers exactly (tests/reference.py: numpy's max
# and argmax, which treat NaN so). "sharded" is tf_ttemb.distribute's lookup on a table in
# two row shards, [0, 2) and [2, N).

NAN, INF = np.nan, np.inf
PATHS = [
    "custom_op/eager",
    "custom_op/function",
    "composite/eager",
    "composite/function",
    "composite/jit",
    "sharded/eager",
]
SHARD_BOUND = 2

MAX_TABLE = [
    [NAN, 1, -INF, 3],
    [0, 2, -INF, INF],
    [5, NAN, -INF, NAN],
    [-INF, -INF, 7, -1],
    [NAN, NAN, -INF, INF],
]
# The four bags (a NaN entry before and after a number), ties of -inf and of
# +inf, an empty bag, padding (-1), NaN entries of different rows, NaN against +inf.
MAX_BAGS = [
    [0, 1],
    [1, 0],
    [1, 2],
    [2, 1],
    [3, 3],
    [],
    [-1, 2],
    [4, 2, 0],
    [1, 4],
    [3, 1],
    [-1, -1],
]

# Rows with Inf and NaN; id 2 is the padding id. In each case every bag but the last has
# a zero denominator (weights summing to 0, all zero, only padding, no entry, padding
# between weights summing to 0); the last is an ordinary bag with an exact result.
ZERO_TABLE = [[INF, -1], [1, 2], [NAN, -INF], [3, 4], [-INF, NAN]]
ZERO_DENOMINATOR_CASES = {
    "mean": (
        [[0, 1], [4, 0], [2, 2], [], [0, 2, 1], [1, 3]],
        [[1, -1], [0, 0], [3, 3], [], [2, 9, -2], [1, 1]],
    ),
    "sqrtn": ([[0, 4], [4], [2, 2], [], [0, 2], [3]], [[0, 0], [0], [3, 3], [], [0, 9], [2]]),
}


def _ragged(rows, ids_dtype=tf.int64):
    flat = [i for row in rows for i in row]
    lengths = [len(row) for row in rows]
    return ragged_bags(None, lengths, 0, ids_dtype, ids=np.array(flat, np.int64))


def _small_upstream(rng, bags, dim, dtype):
    """Random integers 1..8: exact in every dtype, and so are the gradients' sums here."""
    t, g64 = quantize(rng.integers(1, 9, size=(bags.num_bags, dim)), dtype)
    return t, g64


def _assert_same(got, want, what):
    """Exactly the reference's values (NaN where it has NaN); forward zeros are +0.0."""
    got = np.asarray(got, np.float64)
    np.testing.assert_array_equal(got, want, err_msg=what)
    if what == "forward":
        assert not np.signbit(got[got == 0]).any(), f"{what}: -0.0 where zeros are +0.0"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("device", visible_devices())
def test_max_with_nan_and_inf_gives_one_result_everywhere(rng, device, dtype, path):
    implementation, mode = path.split("/")
    dtype = DTYPES[dtype]
    bags = _ragged(MAX_BAGS)
    params, params64 = quantize(MAX_TABLE, dtype)
    up, up64 = _small_upstream(rng, bags, 4, dtype)
    (want, _), (want_grad, _), _ = reference_all(params64, bags, None, up64, "max", -1)
    for b, row in enumerate(MAX_BAGS[:4]):  # the reference follows tf.reduce_max's NaN rule
        np.testing.assert_array_equal(
            want[b], tf.reduce_max(tf.gather(tf.constant(MAX_TABLE, tf.float64), row), 0)
        )
    with tf.device(device):
        if implementation == "sharded":
            out, grad, _ = _sharded(params, bags, None, up, "max", -1)
            # Sharded, a column's gradient goes to the first shard holding NaN (else the
            # max), then to that shard's first such entry: the rule on each bag's entries
            # reordered stably by shard.
            order = np.concatenate(
                [
                    lo + np.argsort(bags.flat_ids[lo:hi] >= SHARD_BOUND, kind="stable")
                    for lo, hi in zip(bags.splits[:-1], bags.splits[1:])
                ]
            ).astype(np.int64)
            want_grad, _ = reference.params_grad(
                params64, bags.flat_ids[order], bags.splits, up64, combiner="max", padding_id=-1
            )
        else:
            out, grad, _ = run_op(
                params,
                bags,
                None,
                up,
                mode,
                combiner="max",
                padding_id=-1,
                implementation=implementation,
            )
    _assert_same(dense_value(out), want, "forward")
    _assert_same(dense_value(grad), want_grad, "params grad")


def _zero_denominator_case(rng, combiner, dtype):
    """bags, then (quantized, float64) table, weights and upstream of one zero-denominator
    case."""
    rows, weight_rows = ZERO_DENOMINATOR_CASES[combiner]
    bags = _ragged(rows)
    params = quantize(ZERO_TABLE, dtype)
    weights = quantize([x for row in weight_rows for x in row], dtype)
    return bags, params, weights, _small_upstream(rng, bags, 2, dtype)


@pytest.mark.parametrize("path", PATHS + ["sparse_apply/eager"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("combiner", list(ZERO_DENOMINATOR_CASES))
@pytest.mark.parametrize("device", visible_devices())
def test_zero_denominator_gives_zeros_whatever_the_rows_hold(rng, device, combiner, dtype, path):
    implementation, mode = path.split("/")
    dtype = DTYPES[dtype]
    bags, (params, params64), (w, w64), (up, up64) = _zero_denominator_case(rng, combiner, dtype)
    (want, _), (want_grad, _), (want_dw, _) = reference_all(params64, bags, w64, up64, combiner, 2)
    with tf.device(device):
        if implementation == "sparse_apply":
            out, grad, dw = _sparse_apply_sgd(params, bags, w, up, combiner, 2)
        elif implementation == "sharded":
            out, grad, dw = _sharded(params, bags, w, up, combiner, 2)
        else:
            out, grad, dw = run_op(
                params,
                bags,
                w,
                up,
                mode,
                combiner=combiner,
                padding_id=2,
                implementation=implementation,
            )
    _assert_same(dense_value(out), want, "forward")
    _assert_same(dense_value(grad), want_grad, "params grad")
    _assert_same(dense_value(dw), want_dw, "weights grad")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("combiner", ["mean", "sqrtn"])
@pytest.mark.parametrize("device", visible_devices())
def test_nan_weight_makes_its_bag_nan_everywhere(rng, device, combiner, dtype, path):
    """A NaN weight is not a zero denominator: its bag is NaN (IEEE) on every path; the
    other bags keep their exact values. (The kernels used to give sqrtn such a bag scale
    0, so zeros, where the composite gave NaN.)"""
    implementation, mode = path.split("/")
    dtype = DTYPES[dtype]
    bags = _ragged([[0, 1], [3], [1, 3, 0]])
    params, _ = quantize([[1, -2], [3, 4], [5, 6], [-7, 8]], dtype)
    w, _ = quantize([NAN, 1, 2, 1, NAN, 1], dtype)
    up, _ = _small_upstream(rng, bags, 2, dtype)
    with tf.device(device):
        if implementation == "sharded":
            out, _, _ = _sharded(params, bags, w, up, combiner, None)
        else:
            out, _, _ = run_op(
                params,
                bags,
                w,
                up,
                mode,
                combiner=combiner,
                padding_id=None,
                implementation=implementation,
            )
    out = np.asarray(dense_value(out), np.float64)
    assert np.isnan(out[[0, 2]]).all(), out
    want_middle = [-7, 8] if combiner == "mean" else [-7 * 2 / 2, 8 * 2 / 2]
    np.testing.assert_array_equal(out[1], want_middle)


def _sharded(params, bags, w, up, combiner, padding_id):
    """sharded_gather_reduce_sum on row shards [0, SHARD_BOUND) and [SHARD_BOUND, N):
    (output, the shards' gradients as one dense [N, D], weights gradient or None)."""
    from tf_ttemb import distribute

    shards = [params[:SHARD_BOUND], params[SHARD_BOUND:]]
    sources = shards + ([] if w is None else [w])
    with tf.GradientTape() as tape:
        tape.watch(sources)
        weights = None if w is None else weights_like(bags.ids, w)
        out = distribute.sharded_gather_reduce_sum(
            shards, bags.ids, weights, combiner=combiner, padding_id=padding_id
        )
    grads = tape.gradient(out, sources, output_gradients=up)
    dense = tf.concat([tf.convert_to_tensor(g) for g in grads[:2]], 0)
    return out, dense, None if w is None else grads[2]


def _sparse_apply_sgd(params, bags, w, up, combiner, padding_id):
    """gather_reduce_sum_sparse_apply with SGD at rate 1: (output, the params gradient
    that the update applied, weights gradient)."""
    from tf_ttemb.ops.sparse_apply import gather_reduce_sum_sparse_apply

    table = tf.Variable(params)
    trigger = tf.Variable(tf.zeros([0]))
    with tf.GradientTape() as tape:
        tape.watch(w)
        out = gather_reduce_sum_sparse_apply(
            table,
            bags.ids,
            weights_like(bags.ids, w),
            trigger=trigger,
            learning_rate=1.0,
            combiner=combiner,
            padding_id=padding_id,
        )
    dw, _ = tape.gradient(out, [w, trigger], output_gradients=up)
    applied = tf.cast(params, tf.float64) - tf.cast(table, tf.float64)
    # Rows holding NaN or Inf keep them (their gradient is 0): NaN - NaN, Inf - Inf.
    applied = tf.where(tf.math.is_finite(tf.cast(params, tf.float64)), applied, 0.0)
    return out, applied, dw


@pytest.mark.parametrize("combiner", list(ZERO_DENOMINATOR_CASES))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("device", visible_devices())
def test_zero_denominator_weights_grad_of_every_backward_op(rng, device, dtype, combiner):
    """The raw ops any graph can call: the fused backward (sparse and dense params
    gradient) and the weights gradient on its own, on tensors and on variables."""
    from tf_ttemb.ops import _loader

    lib = _loader.load_op_library()
    dtype = DTYPES[dtype]
    bags, (params, params64), (w, w64), (up, up64) = _zero_denominator_case(rng, combiner, dtype)
    _, _, (want_dw, _) = reference_all(params64, bags, w64, up64, combiner, 2)
    ids = tf.constant(bags.flat_ids)
    splits = tf.constant(bags.splits)
    attrs = {"combiner": combiner, "has_weights": True, "padding_id": 2, "has_padding_id": True}
    with tf.device(device):
        table = tf.Variable(params)
        out = lib.tf_ttemb_gather_reduce_sum(params, ids, splits, w, **attrs)[0]
        got = {
            "weights_grad": lib.tf_ttemb_gather_reduce_sum_weights_grad(
                up, params, ids, splits, w, out, **attrs
            ),
            "resource_weights_grad": lib.tf_ttemb_resource_gather_reduce_sum_weights_grad(
                up, table.handle, ids, splits, w, out, **attrs
            ),
        }
        for dense_grad in (False, True):
            got[f"fused_grad(dense_grad={dense_grad})"] = lib.tf_ttemb_gather_reduce_sum_fused_grad(
                up, params, ids, splits, w, out, dense_grad=dense_grad, **attrs
            )[2]
            got[f"resource_fused_grad(dense_grad={dense_grad})"] = (
                lib.tf_ttemb_resource_gather_reduce_sum_fused_grad(
                    up, table.handle, ids, splits, w, out, dense_grad=dense_grad, **attrs
                )[2]
            )
    for name, dw in got.items():
        _assert_same(tf.cast(dw, tf.float64).numpy(), want_dw, name)


@pytest.mark.parametrize("path", ["custom_op/eager", "composite/eager", "composite/jit"])
@pytest.mark.parametrize("device", visible_devices())
def test_tt_max_with_nan_matches_the_decompressed_table(device, path):
    """TT bags reduce their decompressed rows with gather_reduce_sum's max: the same rule."""
    from tf_ttemb.ops import tt_embedding as tte

    implementation, mode = path.split("/")
    # A 6 x 4 table, p = [2, 3], q = [2, 2], rank 1; a NaN in core 0 makes NaN the first
    # two columns of the rows of its core row, and the products of integers are exact.
    cores = [
        tf.constant([[1.0, 2.0], [NAN, -3.0]]),
        tf.constant([[1.0, 2.0], [-1.0, 3.0], [2.0, -2.0]]),
    ]
    factors = {"p_shapes": [2, 3], "q_shapes": [2, 2], "ranks": [1]}
    table = (
        tte.tt_rows(cores, tf.range(6, dtype=tf.int64), implementation="composite", **factors)
        .numpy()
        .astype(np.float64)
    )
    assert np.isnan(table).any() and not np.isnan(table).all()
    rows = [[0, 3], [3, 0], [4, 5, 1], [5, 4], [2, 3, 2]]
    bags = _ragged(rows)
    want, _ = reference.forward(table, bags.flat_ids, bags.splits, combiner="max")

    def lookup(cores):
        return tte.tt_embedding_bag(
            cores,
            bags.ids,
            num_embeddings=6,
            combiner="max",
            implementation=implementation,
            **factors,
        )

    with tf.device(device):
        run = tf.function(lookup, jit_compile=True) if mode == "jit" else lookup
        out = run(cores)
    _assert_same(out.numpy(), want, "forward")
