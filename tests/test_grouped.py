"""grouped_gather_reduce_sum (GroupBags + one gather_reduce_sum) against the numpy float64
reference of each feature's own lookup, and its errors."""

from __future__ import annotations

import numpy as np
import pytest
import reference
import tensorflow as tf
from bags import (
    COMBINER_WEIGHTING,
    DTYPES,
    assert_close,
    combiner_id,
    dense_bags,
    dense_value,
    make_params,
    quantize,
    ragged_bags,
    sparse_bags,
    weights_like,
)

import tf_ttemb
from tf_ttemb.ops import _loader

IMPLEMENTATIONS = ("custom_op", "composite")
DEVICES = ("/CPU:0", pytest.param("/GPU:0", marks=pytest.mark.gpu))
BATCH = 5


def _features(rng, num_rows, forms, ids_dtype, padding_ids):
    """One test Bags per feature, every feature with BATCH bags, some empty."""
    out = []
    for t, (form, rows) in enumerate(zip(forms, num_rows)):
        pad = padding_ids[t]
        if form == "dense":
            out.append(dense_bags(rng, (BATCH, 1 + t % 3), rows, ids_dtype, pad))
            continue
        lengths = rng.integers(0, 5, size=BATCH)
        lengths[t % BATCH] = 0
        if form == "ragged":
            out.append(ragged_bags(rng, lengths, rows, ids_dtype, pad))
        else:
            out.append(sparse_bags(rng, lengths, rows, ids_dtype, pad))
    return out


# (forms, num_rows, row_offsets): the last case shares table 0 between features 0 and 2.
LAYOUTS = {
    "three_tables": (("dense", "ragged", "sparse"), (7, 3, 11), None),
    "one_feature": (("ragged",), (9,), None),
    "shared_table": (("dense", "ragged", "dense", "sparse"), (6, 4, 6, 1), (0, 6, 0, 10)),
}


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(
    "combiner,weighted", COMBINER_WEIGHTING, ids=map(combiner_id, COMBINER_WEIGHTING)
)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("ids_dtype", [tf.int32, tf.int64], ids=["int32", "int64"])
def test_matches_each_features_own_lookup(
    rng, implementation, layout, combiner, weighted, dtype_name, ids_dtype
):
    dtype = DTYPES[dtype_name]
    forms, num_rows, row_offsets = LAYOUTS[layout]
    offsets = row_offsets or tuple(int(x) for x in np.cumsum((0,) + num_rows[:-1]))
    total = max(o + n for o, n in zip(offsets, num_rows))
    dim = int(rng.choice([1, 3, 8, 17]))
    padding_ids = [None if t % 2 else int(num_rows[t] + 2) for t in range(len(forms))]
    features = _features(rng, num_rows, forms, ids_dtype, padding_ids)
    params, params64 = make_params(rng, total, dim, dtype, distinct=combiner == "max")
    weights, weights64 = [], []
    for t, bags in enumerate(features):
        if not weighted or t == 1:  # feature 1 always unweighted: its entries weigh 1
            weights.append(None)
            weights64.append(None if not weighted else np.ones(bags.nnz))
            continue
        w, w64 = quantize(rng.uniform(0.5, 1.5, size=bags.nnz), dtype)
        weights.append(tf.constant(bags.values_from_csr(w.numpy()), dtype=dtype))
        weights64.append(w64)
    upstream, upstream64 = quantize(rng.normal(size=(BATCH, len(forms) * dim)), dtype)

    watched = [w for w in weights if w is not None]
    with tf.GradientTape() as tape:
        tape.watch(params)
        tape.watch(watched)
        out = tf_ttemb.grouped_gather_reduce_sum(
            params,
            [b.ids for b in features],
            None
            if not weighted
            else [None if w is None else weights_like(b.ids, w) for b, w in zip(features, weights)],
            num_rows=num_rows,
            row_offsets=row_offsets,
            combiner=combiner,
            padding_ids=padding_ids,
            implementation=implementation,
        )
    params_grad, *weights_grads = tape.gradient(out, [params] + watched, upstream)
    assert out.shape == (BATCH, len(forms) * dim) and out.dtype == dtype

    want_grad = np.zeros((total, dim))
    grad_scale = np.zeros((total, dim))
    watched_grads = iter(weights_grads)
    for t, bags in enumerate(features):
        table64 = params64[offsets[t] : offsets[t] + num_rows[t]]
        g64 = upstream64.reshape(BATCH, len(forms), dim)[:, t]
        w64 = weights64[t]
        want, scale = reference.forward(
            table64, bags.flat_ids, bags.splits, w64, combiner, padding_ids[t]
        )
        got = tf.cast(out, tf.float64).numpy().reshape(BATCH, len(forms), dim)[:, t]
        assert_close(got, want, scale, dtype, f"feature {t} output")
        dp, dp_scale = reference.params_grad(
            table64, bags.flat_ids, bags.splits, g64, w64, combiner, padding_ids[t]
        )
        want_grad[offsets[t] : offsets[t] + num_rows[t]] += dp
        grad_scale[offsets[t] : offsets[t] + num_rows[t]] += dp_scale
        if weights[t] is not None:
            dw, dw_scale = reference.weights_grad(
                table64, bags.flat_ids, bags.splits, w64, g64, combiner, padding_ids[t]
            )
            got_dw = bags.csr_from_values(dense_value(next(watched_grads)))
            assert_close(got_dw, dw, dw_scale, dtype, f"feature {t} weights grad")
    assert_close(dense_value(params_grad), want_grad, grad_scale, dtype, "params grad")
    if implementation == "custom_op" and isinstance(params_grad, tf.IndexedSlices):
        rows = params_grad.indices.numpy()
        assert np.all(np.diff(rows) > 0), "the IndexedSlices rows are sorted and unique"


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("use_function", [False, True], ids=["eager", "function"])
def test_bad_id_names_the_feature_position_and_range(implementation, use_function):
    table = tf.zeros([9, 2])
    ids = [tf.constant([[0, 1], [1, 0]]), tf.ragged.constant([[2], [0, 7, 1]], tf.int64)]
    lookup = tf_ttemb.grouped_gather_reduce_sum
    if use_function:
        lookup = tf.function(lookup, reduce_retracing=True)
    kwargs = dict(num_rows=[2, 7], labels=["user", "item"], implementation=implementation)
    want = r"feature item: indices\[2\] = 7 is not in \[0, 7\)"
    with pytest.raises(tf.errors.InvalidArgumentError, match=want):
        lookup(table, ids, **kwargs)
    with pytest.raises(
        tf.errors.InvalidArgumentError, match=want + r" and is not padding_id \(5\)"
    ):
        lookup(table, ids, padding_ids=[None, 5], **kwargs)
    # The padding id of feature 1 is skipped; feature 0's ids are in range.
    got = lookup(table, ids, padding_ids=[None, 7], **kwargs)
    assert got.shape == (2, 4)


def test_padding_is_per_feature(rng):
    table = tf.constant(np.arange(10, dtype=np.float64)[:, None])
    ids = [tf.constant([[0, 3]]), tf.constant([[3, 0]])]  # 3 pads feature 0 only
    got = tf_ttemb.grouped_gather_reduce_sum(
        table, ids, num_rows=[4, 6], padding_ids=[3, None], combiner="mean"
    )
    np.testing.assert_allclose(got.numpy(), [[0.0, (4 + 3 + 4 + 0) / 2]])


def test_variable_table_gives_sorted_indexed_slices(rng):
    table = tf.Variable(rng.normal(size=(12, 4)).astype(np.float32))
    ids = [tf.constant([[3, 1], [1, 1]]), tf.ragged.constant([[4], [], [0]][:2], tf.int64)]
    with tf.GradientTape() as tape:
        out = tf_ttemb.grouped_gather_reduce_sum(table, ids, num_rows=[5, 7])
    grad = tape.gradient(out, table, tf.ones_like(out))
    assert isinstance(grad, tf.IndexedSlices)
    np.testing.assert_array_equal(grad.indices.numpy(), [1, 3, 9])
    np.testing.assert_allclose(grad.values.numpy(), np.full((3, 4), [[3.0], [1.0], [1.0]]))


def test_xla_composite_matches_and_treats_bad_ids_as_padding(rng):
    table = tf.constant(rng.normal(size=(10, 3)))
    ids = [tf.constant([[0, 4], [3, 3]]), tf.constant([[5], [9]])]  # 9: bad for feature 1

    @tf.function(jit_compile=True)
    def lookup(table, a, b):
        return tf_ttemb.grouped_gather_reduce_sum(table, [a, b], num_rows=[4, 6])

    got = lookup(table, *ids).numpy()
    t = table.numpy()
    want = np.concatenate([np.stack([t[0], 2 * t[3]]), np.stack([t[4 + 5], np.zeros(3)])], axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_argument_errors():
    table = tf.zeros([6, 2])
    ids = [tf.constant([[0]]), tf.constant([[1]])]
    with pytest.raises(ValueError, match=r"num_rows must have one entry per feature \(2\), got 1"):
        tf_ttemb.grouped_gather_reduce_sum(table, ids, num_rows=[3])
    with pytest.raises(ValueError, match=r"num_rows\[1\] must be an integer >= 0, got -1"):
        tf_ttemb.grouped_gather_reduce_sum(table, ids, num_rows=[3, -1])
    with pytest.raises(ValueError, match=r"params has 6 rows but the features' tables need 7"):
        tf_ttemb.grouped_gather_reduce_sum(table, ids, num_rows=[3, 4])
    with pytest.raises(ValueError, match=r"weights must have one entry per feature \(2\), got 1"):
        tf_ttemb.grouped_gather_reduce_sum(table, ids, [None], num_rows=[3, 3])
    with pytest.raises(ValueError, match="'max' does not take weights"):
        tf_ttemb.grouped_gather_reduce_sum(
            table, ids, [tf.ones([1, 1]), None], num_rows=[3, 3], combiner="max"
        )
    with pytest.raises(ValueError, match="indices must hold at least one feature"):
        tf_ttemb.grouped_gather_reduce_sum(table, [], num_rows=[])
    with pytest.raises(tf.errors.InvalidArgumentError, match="same number of bags"):
        tf_ttemb.grouped_gather_reduce_sum(
            table, [tf.ragged.constant([[0], [1]]), tf.ragged.constant([[1]])], num_rows=[3, 3]
        )


def _group_bags(ids, splits, weights=None, parts=None, ids_dtype=tf.int64, **attrs):
    """GroupBags on `ids` given as one part, or as the parts of `parts` (shapes, read in
    order: each takes the next ids, reshaped)."""
    lib = _loader.load_op_library()
    base = dict(
        num_rows=[3, 4],
        row_offsets=[0, 3],
        padding_ids=[-1, -1],
        has_padding_ids=[False, False],
        labels=["a", "b"],
    )
    base.update(attrs)
    has_weights = weights is not None
    flat = np.asarray(ids, np.int64)
    shapes = [flat.shape] if parts is None else parts
    assert sum(int(np.prod(shape)) for shape in shapes) == flat.size
    cuts = np.cumsum([0] + [int(np.prod(shape)) for shape in shapes])
    return lib.tf_ttemb_group_bags(
        [
            tf.constant(flat[a:b].reshape(shape), ids_dtype)
            for a, b, shape in zip(cuts[:-1], cuts[1:], shapes)
        ],
        tf.constant(splits, tf.int64),
        tf.constant(weights if has_weights else [], tf.float32),
        has_weights=has_weights,
        **base,
    )


def _group_bags_reference(ids, splits, weights, num_rows, row_offsets, padding_ids):
    """numpy GroupBags on good input: (ids, row_splits, weights, positions)."""
    count = len(num_rows)
    batch = (len(splits) - 1) // count
    out_ids, out_splits, out_weights, positions = [], [0], [], np.zeros(len(ids), np.int64)
    for b in range(batch):
        for t in range(count):
            for j in range(splits[t * batch + b], splits[t * batch + b + 1]):
                positions[j] = len(out_ids)
                pad = padding_ids[t] is not None and ids[j] == padding_ids[t]
                out_ids.append(-1 if pad else row_offsets[t] + ids[j])
                out_weights.append(weights[j])
            out_splits.append(len(out_ids))
    return np.array(out_ids, np.int64), np.array(out_splits), np.array(out_weights), positions


@pytest.mark.parametrize("ids_dtype", [tf.int32, tf.int64])
@pytest.mark.parametrize("device", DEVICES)
def test_group_bags_reads_its_parts_end_to_end(rng, ids_dtype, device):
    """The ids as any number of parts of any shape (empty ones too), cut anywhere, even
    inside a bag or a feature: the op reads them as one flat vector."""
    num_rows, row_offsets, padding_ids = [5, 1, 9], [0, 5, 2], [None, 0, 4]
    batch = int(rng.integers(1, 5))
    lengths = rng.integers(0, 4, size=3 * batch)
    splits = np.concatenate([[0], np.cumsum(lengths)])
    ids = np.concatenate(
        [rng.integers(0, num_rows[k // batch], size=n) for k, n in enumerate(lengths)]
        + [np.zeros(0, np.int64)]
    ).astype(np.int64)
    weights = rng.uniform(0.5, 2.0, size=ids.size).astype(np.float32)
    sizes = []
    left = ids.size
    while left > 0:
        size = int(rng.integers(0, min(left, 6) + 1))
        sizes.append(size)
        left -= size
    parts = [(s,) if s % 2 else (s // 2, 2) for s in sizes] + [(0,), (0, 3)]
    rng.shuffle(parts)
    attrs = dict(
        num_rows=num_rows,
        row_offsets=row_offsets,
        padding_ids=[-1 if p is None else p for p in padding_ids],
        has_padding_ids=[p is not None for p in padding_ids],
        labels=["a", "b", "c"],
    )
    with tf.device(device):
        got = _group_bags(ids, splits, weights, parts=parts, ids_dtype=ids_dtype, **attrs)
    want = _group_bags_reference(ids, splits, weights, num_rows, row_offsets, padding_ids)
    for g, w in zip(got[:4], want):
        np.testing.assert_array_equal(g.numpy(), w)


def test_group_bags_reorders_example_by_example():
    # feature a: bags [0, 1], [2]; feature b: bags [], [3, 0, 1]
    ids, splits, weights, positions, _ = _group_bags(
        [0, 1, 2, 3, 0, 1], [0, 2, 3, 3, 6], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    )
    np.testing.assert_array_equal(ids.numpy(), [0, 1, 2, 6, 3, 4])
    np.testing.assert_array_equal(splits.numpy(), [0, 2, 2, 3, 6])
    np.testing.assert_array_equal(weights.numpy(), [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    np.testing.assert_array_equal(positions.numpy(), [0, 1, 2, 3, 4, 5])
    ids, splits, _, _, _ = _group_bags([2, 0, 1, 1, 2], [0, 1, 3, 4, 5])
    # a: [2], [0, 1]; b: [1], [2] -> example 0: a [2], b [1]; example 1: a [0, 1], b [2]
    np.testing.assert_array_equal(ids.numpy(), [2, 4, 0, 1, 5])
    np.testing.assert_array_equal(splits.numpy(), [0, 1, 2, 4, 5])


@pytest.mark.parametrize(
    "ids,splits,attrs,message",
    [
        (
            [0, 1],
            [0, 1, 2, 2],
            {},
            r"row_splits has 4 entries, not one more than a multiple of the 2",
        ),
        ([0, 1], [1, 1, 2, 2, 2], {}, r"row_splits\[0\] = 1 must be 0"),
        ([0, 1], [0, 2, 1, 2, 2], {}, r"row_splits must be non-decreasing: row_splits\[2\] = 1"),
        (
            [0, 1],
            [0, 1, 1, 1, 1],
            {},
            r"row_splits\[4\] = 1 must equal the number of indices \(2\)",
        ),
        ([0, 3], [0, 1, 2, 2, 2], {}, r"feature a: indices\[1\] = 3 is not in \[0, 3\)"),
        (
            [0, 1, 2, 9],
            [0, 1, 2, 2, 4],
            {"parts": [(1, 1), (0,), (2,), (1,)]},
            r"feature b: indices\[1\] = 9 is not in \[0, 4\)",
        ),
        ([0, -1], [0, 1, 1, 1, 2], {}, r"feature b: indices\[0\] = -1 is not in \[0, 4\)"),
        ([0], [0, 1, 1], {"row_offsets": [0]}, r"row_offsets has 1 entries but num_rows has 2"),
        ([0], [0, 1, 1], {"num_rows": [3, -4]}, r"num_rows\[1\] = -4 is not in \[0, "),
    ],
)
def test_group_bags_errors(ids, splits, attrs, message):
    """The CPU kernel's messages (the GPU kernel's report raises the same ones:
    test_gpu_group_bags_matches_the_cpu)."""
    with tf.device("/CPU:0"), pytest.raises(tf.errors.InvalidArgumentError, match=message):
        _group_bags(ids, splits, **attrs)


def test_check_group_report_rejects_a_report_of_another_size():
    lib = _loader.load_op_library()
    with pytest.raises(tf.errors.InvalidArgumentError, match="report must be empty or hold 11"):
        lib.tf_ttemb_check_group_report(
            tf.zeros([3], tf.int64),
            num_rows=[1],
            row_offsets=[0],
            padding_ids=[0],
            has_padding_ids=[False],
            labels=["a"],
        )


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adagrad"])
def test_sparse_apply_updates_every_tables_rows_in_one_step(rng, optimizer):
    from tf_ttemb.ops.grouped import grouped_gather_reduce_sum_sparse_apply

    num_rows, offsets = (6, 4, 6), (0, 6, 0)  # features 0 and 2 share a table
    start = rng.normal(size=(10, 3))
    ids = [
        tf.constant(rng.integers(0, 6, size=(4, 2))),
        tf.ragged.constant([list(rng.integers(0, 4, size=n)) for n in (0, 3, 1, 2)], tf.int64),
        tf.constant(rng.integers(0, 6, size=(4, 3))),
    ]
    weights = [None, None, tf.constant(rng.uniform(0.5, 1.5, size=(4, 3)))]
    upstream = tf.constant(rng.normal(size=(4, 9)))
    kwargs = dict(num_rows=num_rows, row_offsets=offsets, combiner="sqrtn")

    plain = tf.Variable(start)
    with tf.GradientTape() as tape:
        want_out = tf_ttemb.grouped_gather_reduce_sum(plain, ids, weights, **kwargs)
    grad = dense_value(tape.gradient(want_out, plain, upstream))
    lr, eps = 0.3, 1e-7
    if optimizer == "sgd":
        want_table, accumulator = start - lr * grad, None
    elif optimizer == "rowwise_adagrad":
        acc = (grad**2).mean(axis=1)
        want_table = start - lr * grad / (np.sqrt(acc) + eps)[:, None]
        want_table[acc == 0] = start[acc == 0]
        accumulator = tf.Variable(tf.zeros([10], tf.float64))
    else:
        acc = grad**2
        want_table = np.where(acc > 0, start - lr * grad / (np.sqrt(acc) + eps), start)
        accumulator = tf.Variable(tf.zeros([10, 3], tf.float64))

    table = tf.Variable(start)
    trigger = tf.Variable(tf.zeros([0], tf.float64))
    with tf.GradientTape() as tape:
        tape.watch(weights[2])
        out = grouped_gather_reduce_sum_sparse_apply(
            table,
            ids,
            weights,
            trigger=trigger,
            optimizer=optimizer,
            learning_rate=lr,
            accumulator=accumulator,
            epsilon=eps,
            **kwargs,
        )
    weights_grad, _ = tape.gradient(out, [weights[2], trigger], upstream)
    np.testing.assert_allclose(out.numpy(), want_out.numpy(), rtol=1e-12)
    np.testing.assert_allclose(table.numpy(), want_table, rtol=1e-10, atol=1e-12)
    with tf.GradientTape() as tape:
        tape.watch(weights[2])
        again = tf_ttemb.grouped_gather_reduce_sum(tf.constant(start), ids, weights, **kwargs)
    np.testing.assert_allclose(
        weights_grad.numpy(), tape.gradient(again, weights[2], upstream).numpy(), rtol=1e-10
    )


GPU_BAD_CASES = {
    "ok": ([0, 1, 2, 3, 0, 1], [0, 2, 3, 3, 6]),
    "bad_id": ([0, 1, 2, 3, 9, 1], [0, 2, 3, 3, 6]),
    "negative_id": ([0, -3, 2, 3, 0, 1], [0, 2, 3, 3, 6]),
    "start": ([0, 1, 2, 3, 0, 1], [1, 2, 3, 3, 6]),
    "order": ([0, 1, 2, 3, 0, 1], [0, 4, 3, 3, 6]),
    "end": ([0, 1, 2, 3, 0, 1], [0, 2, 3, 3, 5]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_BAD_CASES))
@pytest.mark.parametrize("check_device", ["/CPU:0", "/GPU:0"])
@pytest.mark.parametrize("parts", [None, [(1, 2), (0,), (4,)]], ids=["one_part", "parts"])
def test_gpu_group_bags_matches_the_cpu(case, check_device, parts):
    """The GPU GroupBags returns without waiting; its outputs equal the CPU kernel's on
    good input, and its report raises the CPU kernel's message wherever it is checked."""
    lib = _loader.load_op_library()
    ids, splits = GPU_BAD_CASES[case]
    attrs = dict(
        num_rows=[3, 4],
        row_offsets=[0, 3],
        padding_ids=[-1, 1],
        has_padding_ids=[False, True],
        labels=["a", "b"],
    )
    results = {}
    for device in ("/CPU:0", "/GPU:0"):
        with tf.device(device):
            try:
                results[device] = _group_bags(
                    ids, splits, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], parts=parts, **attrs
                )
            except tf.errors.InvalidArgumentError as error:
                results[device] = error
    cpu, gpu = results["/CPU:0"], results["/GPU:0"]
    assert not isinstance(gpu, Exception), gpu
    assert gpu[4].shape == [11] and "GPU" in gpu[4].device
    with tf.device(check_device):
        if isinstance(cpu, Exception):
            with pytest.raises(tf.errors.InvalidArgumentError) as info:
                lib.tf_ttemb_check_group_report(gpu[4], **attrs)
            assert (
                info.value.message.split("[Op:")[0]
                .strip()
                .endswith(cpu.message.split("[Op:")[0].strip().split("}} ")[-1])
            ), (info.value.message, cpu.message)
            return
        lib.tf_ttemb_check_group_report(gpu[4], **attrs)
    for got, want in zip(gpu[:4], cpu[:4]):
        np.testing.assert_array_equal(got.numpy(), want.numpy())


@pytest.mark.gpu
@pytest.mark.parametrize("combiner,weighted", [("sum", True), ("mean", False), ("max", False)])
def test_gpu_grouped_lookup_and_gradient_match_the_cpu(rng, combiner, weighted):
    num_rows = (50, 7, 33)
    ids = [
        rng.integers(0, 50, size=(64, 3)),
        rng.integers(0, 7, size=(64, 1)),
        rng.integers(0, 33, size=(64, 20)),
    ]
    weights = [rng.uniform(0.5, 1.5, size=i.shape).astype(np.float32) for i in ids]
    table0 = rng.normal(size=(90, 16)).astype(np.float32)
    upstream = tf.constant(rng.normal(size=(64, 48)).astype(np.float32))
    results = []
    for device in ("/CPU:0", "/GPU:0"):
        with tf.device(device):
            table = tf.Variable(table0)
            w = [tf.constant(x) for x in weights] if weighted else None
            with tf.GradientTape() as tape:
                if w:
                    tape.watch(w)
                out = tf_ttemb.grouped_gather_reduce_sum(
                    table, [tf.constant(i) for i in ids], w, num_rows=num_rows, combiner=combiner
                )
            grads = tape.gradient(out, [table] + (w or []), upstream)
            results.append([out.numpy()] + [dense_value(g) for g in grads])
    for got, want in zip(results[1], results[0]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
