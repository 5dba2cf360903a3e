"""Hostile inputs that once crashed the process or gave errors that named nothing.

Each case runs in a fresh interpreter (a crash there fails the test instead of killing
the test run), on every device TensorFlow sees, through the public API or the raw op
that any graph can call, and must raise the documented error naming the size or the
argument that is wrong. (Issue "Hostile inputs": cases 1, 2, 3, 5, 7, 10, 11 and 12.)
"""

from __future__ import annotations

import json
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from processes import run_fresh_python, visible_devices
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
    "tt_layer_custom_op": ("ResourceExhaustedError",
                           r"partial product of one id after core 2 has .* = 68719476736 "
                           r"elements, more than the 268435456"),
    "tt_layer_composite": ("ResourceExhaustedError", r""),
    "tt_rows_huge_dim": ("ResourceExhaustedError",
                         r"partial product of one id after core 1 .* = 4398046511104 "
                         r"elements"),
    "grs_huge_output_custom_op": ("InvalidArgumentError",
                                  r"output \[num_bags, D\] would have shape "
                                  r"\[4, 4611686018427387904\]: more elements than a tensor"),
    "grs_huge_output_composite": ("InvalidArgumentError", r""),
    "dense_grad_huge_rows": ("InvalidArgumentError",
                             r"params_grad \[num_rows, D\] would have shape "
                             r"\[4611686018427387904, 2\]"),
    "padding_too_large": ("ValueError",
                          r"padding_id must be in int64's range .* got 1180591620717411303424"),
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

    @tf.function(input_signature=[tf.TensorSpec([None, None, 7]), tf.TensorSpec([None, None], tf.bool)])
    def read(x, mask):
        return layer(x, mask=mask)

    x = tf.constant(rng.normal(size=(2, 6, 7)), tf.float32)
    read(x, tf.ones([2, 6], tf.bool))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="mask must have the shape of the inputs without their last axis"):
        read(x, tf.ones([6, 2], tf.bool))  # 12 elements, as many as the right shape


# --------------------------------------------------------------------------------------
# SparseTensor ids outside their dense_shape (case 5) and an empty table (case 7): the
# same result or the same error from every implementation, eagerly and in a function.

IMPLEMENTATIONS = ["custom_op", "composite"]


def _maybe_function(fn, in_function):
    return tf.function(fn) if in_function else fn


@pytest.mark.parametrize("in_function", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("coords", [[[0, 0], [-1, 1]], [[0, 0], [5, 0]], [[0, 1], [1, 7]]],
                         ids=["negative_row", "row_past_shape", "column_past_shape"])
def test_sparse_ids_outside_dense_shape_are_named(rng, implementation, in_function, coords):
    import tf_ttemb

    table = tf.constant(rng.normal(size=(6, 3)), tf.float32)
    sparse = tf.SparseTensor(tf.constant(coords, tf.int64), tf.constant([1, 2], tf.int64),
                             [2, 2])
    run = _maybe_function(
        lambda: tf_ttemb.gather_reduce_sum(table, sparse, implementation=implementation),
        in_function,
    )
    bad = coords[1]
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=re.escape(f"sparse indices: indices[1] = [{bad[0]}, {bad[1]}] "
                                       "is out of bounds for dense_shape [2, 2]")):
        run()


@pytest.mark.parametrize("dense_grad", [False, True], ids=["sparse_grad", "dense_grad"])
@pytest.mark.parametrize("combiner", ["sum", "mean", "max"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_empty_table_with_padding_only_bags_gives_zeros(implementation, combiner, dense_grad):
    import tf_ttemb

    table = tf.Variable(tf.zeros([0, 3]))
    ids = tf.constant([[-1, -1], [-1, -1], [-1, -1]], tf.int64)
    with tf.GradientTape() as tape:
        out = tf_ttemb.gather_reduce_sum(table, ids, padding_id=-1, combiner=combiner,
                                         implementation=implementation, dense_grad=dense_grad)
    np.testing.assert_array_equal(out.numpy(), np.zeros((3, 3), np.float32))
    grad = tf.convert_to_tensor(tape.gradient(out, table, output_gradients=tf.ones([3, 3])))
    assert tuple(grad.shape) == (0, 3)
    read = tf.function(lambda t: tf_ttemb.gather_reduce_sum(
        t, ids, padding_id=-1, combiner=combiner, implementation=implementation))
    np.testing.assert_array_equal(read(tf.zeros([0, 3])).numpy(), np.zeros((3, 3), np.float32))


# --------------------------------------------------------------------------------------
# A TT core whose shape TensorFlow does not know statically (case 11): both
# implementations name the core and the shape it must have.


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("bad_shape", [[5, 4], [1, 4], [3, 3]],
                         ids=["more_rows", "fewer_rows", "other_width"])
@pytest.mark.parametrize("api", ["tt_rows", "tt_embedding_bag"])
def test_tt_core_of_the_wrong_shape_is_named(rng, api, bad_shape, implementation):
    from tf_ttemb.ops import tt_embedding as tte

    p, q, ranks = [2, 3], [2, 2], [2]
    cores = [tf.Variable(rng.normal(size=(2, 4)), dtype=tf.float32),
             tf.Variable(rng.normal(size=bad_shape), dtype=tf.float32,
                         shape=tf.TensorShape(None))]
    kwargs = dict(p_shapes=p, q_shapes=q, ranks=ranks, implementation=implementation)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=re.escape("cores[1] must be [num_tables * p_shapes[1], "
                                       "r_1 * q_1 * r_2] = [3, 4]")):
        if api == "tt_rows":
            tte.tt_rows(cores, tf.constant([0, 5], tf.int64), **kwargs)
        else:
            tte.tt_embedding_bag(cores, tf.constant([[0, 5], [1, 2]], tf.int64),
                                 num_embeddings=6, **kwargs)
