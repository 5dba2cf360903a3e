"""The raw TT ops (TTUniqueIds, TTRows, TTRowsGrad, TTCacheCount) against float64 references.

The layers and the `tt_embedding_bag` wrapper are tested in test_tt_embedding.py and
test_tt_layers.py; this file pins down the ops' own contract (docs/tt_embedding_contract.md):
core layout, global ids of table-batched cores, any id order, dtypes, determinism and errors.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from processes import built_with_cuda, our_message, visible_devices

from tf_ttemb.ops import _loader

SHAPES = [
    # (p_shapes, q_shapes, ranks, num_tables)
    ([3, 5], [2, 3], [4], 1),
    ([7, 2], [1, 1], [3], 1),  # D = 1
    ([4, 3, 5], [3, 1, 11], [3, 2], 2),  # D = 33, two tables
    ([2, 3, 2, 3], [1, 3, 1, 1], [2, 3, 2], 1),  # four cores, D = 3
    ([5, 4, 3], [4, 4, 4], [6, 5], 3),
    # Ranks that are multiples of 8 with narrow blocks take the kernels' register-blocked
    # float32 paths (last core 8 x 4; a middle core 8 x (1 * 8)).
    ([6, 5, 7], [2, 3, 4], [8, 16], 1),
    ([5, 6, 4], [1, 1, 3], [8, 8], 2),
]
TOLERANCE = {tf.float64: 1e-10, tf.float32: 1e-5, tf.float16: 2e-2, tf.bfloat16: 2e-2}


def lib():
    return _loader.load_op_library()


def full_ranks(ranks):
    return [1, *ranks, 1]


def checked_tt_rows(ids, cores, **attrs):
    """TTRows and the check of its report, as the wrapper runs them: the GPU kernel
    leaves a bad id in its report, which CheckTTRowsReport raises from (the CPU kernel
    raises itself and returns an empty report)."""
    out = lib().tf_ttemb_tt_rows(ids, cores, **attrs)
    limit = attrs["num_tables"] * int(np.prod(attrs["p_shapes"]))
    lib().tf_ttemb_check_tt_rows_report(out.report, limit=limit)
    return out


def random_cores(rng, p, q, ranks, num_tables):
    r = full_ranks(ranks)
    return [rng.standard_normal((num_tables * p[k], r[k] * q[k] * r[k + 1])) for k in range(len(p))]


def reference_rows(cores, p, q, ranks, ids):
    """Row g of the table, straight from the definition: a sum over rank paths."""
    r = full_ranks(ranks)
    rows_per_table = int(np.prod(p))
    out = []
    for g in ids:
        table, i = divmod(int(g), rows_per_table)
        digits = [(i // int(np.prod(p[k + 1 :]))) % p[k] for k in range(len(p))]
        blocks = [
            cores[k][table * p[k] + digits[k]].reshape(r[k], q[k], r[k + 1]).astype(np.float64)
            for k in range(len(p))
        ]
        # Contract ranks left to right; the column index (j_0, ..., j_{T-1}) is row-major.
        acc = blocks[0].reshape(q[0], r[1])
        for block in blocks[1:]:
            acc = np.einsum("ja,akb->jkb", acc, block).reshape(-1, block.shape[2])
        out.append(acc.reshape(-1))
    return np.array(out).reshape(len(ids), int(np.prod(q)))


def reference_core_grads(cores, p, q, ranks, ids, grad):
    """d/d cores of sum(rows * grad) by forward-mode perturbation of a float64 reference."""
    r = full_ranks(ranks)
    rows_per_table = int(np.prod(p))
    grads = [np.zeros_like(c, dtype=np.float64) for c in cores]
    for u, g in enumerate(ids):
        table, i = divmod(int(g), rows_per_table)
        digits = [(i // int(np.prod(p[k + 1 :]))) % p[k] for k in range(len(p))]
        blocks = [
            cores[k][table * p[k] + digits[k]].reshape(r[k], q[k], r[k + 1]).astype(np.float64)
            for k in range(len(p))
        ]
        dy = grad[u].reshape(q)
        for k in range(len(p)):
            # Row entry = left[j_<k] (1 x r_k) . block_k[:, j_k, :] . right[j_>k] (r_{k+1} x 1).
            left = np.ones((1, 1))
            for m in range(k):
                left = np.einsum("ja,akb->jkb", left, blocks[m]).reshape(-1, r[m + 1])
            right = np.ones((1, 1))
            for m in range(len(p) - 1, k, -1):
                right = np.einsum("akb,bj->akj", blocks[m], right).reshape(r[m], -1)
            # d entry / d block[a, j_k, b] = left[j_<k, a] * right[b, j_>k]
            d_block = np.einsum(
                "xa,xkz,bz->akb",
                left,
                dy.reshape(left.shape[0], q[k], right.shape[1]),
                right,
            )
            grads[k][table * p[k] + digits[k]] += d_block.reshape(-1)
    return grads


def attrs_of(p, q, ranks, num_tables):
    return {"p_shapes": p, "q_shapes": q, "ranks": ranks, "num_tables": num_tables}


def pick_ids(rng, p, num_tables, count, order):
    total = num_tables * int(np.prod(p))
    ids = rng.integers(0, total, size=count)
    if order == "sorted_unique":
        ids = np.unique(ids)
    elif order == "sorted":
        ids = np.sort(ids)
    return ids.astype(np.int64)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"p{s[0]}q{s[1]}r{s[2]}t{s[3]}")
@pytest.mark.parametrize("order", ["sorted_unique", "sorted", "random"])
@pytest.mark.parametrize("dtype", [tf.float64, tf.float32, tf.float16, tf.bfloat16])
def test_rows_match_reference(rng, shape, order, dtype):
    p, q, ranks, num_tables = shape
    cores = random_cores(rng, p, q, ranks, num_tables)
    cores_t = [tf.cast(c, dtype) for c in cores]
    ids = pick_ids(rng, p, num_tables, 40, order)
    rows = lib().tf_ttemb_tt_rows(ids, cores_t, **attrs_of(p, q, ranks, num_tables)).rows
    assert rows.dtype == dtype
    # The reference uses the cores as the op sees them (rounded to dtype).
    seen = [c.numpy().astype(np.float64) for c in cores_t]
    expected = reference_rows(seen, p, q, ranks, ids)
    scale = np.abs(expected).max() + 1
    np.testing.assert_allclose(
        rows.numpy().astype(np.float64), expected, atol=TOLERANCE[dtype] * scale, rtol=0
    )


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"p{s[0]}q{s[1]}r{s[2]}t{s[3]}")
@pytest.mark.parametrize("order", ["sorted_unique", "random"])
@pytest.mark.parametrize("dtype", [tf.float64, tf.float32])
def test_rows_grad_matches_reference(rng, shape, order, dtype):
    p, q, ranks, num_tables = shape
    cores = random_cores(rng, p, q, ranks, num_tables)
    if dtype == tf.float32:
        cores = [c.astype(np.float32).astype(np.float64) for c in cores]
    ids = pick_ids(rng, p, num_tables, 30, order)
    grad = rng.standard_normal((len(ids), int(np.prod(q))))
    if dtype == tf.float32:
        grad = grad.astype(np.float32).astype(np.float64)
    indices, values = lib().tf_ttemb_tt_rows_grad(
        ids,
        [tf.constant(c, dtype) for c in cores],
        tf.constant(grad, dtype),
        tf.zeros([0], dtype),
        **attrs_of(p, q, ranks, num_tables),
    )
    tolerance = 1e-10 if dtype == tf.float64 else 1e-4
    expected = reference_core_grads(cores, p, q, ranks, ids, grad)
    for k in range(len(p)):
        touched = np.unique(
            (ids // np.prod(p)) * p[k] + (ids % np.prod(p)) // np.prod(p[k + 1 :]) % p[k]
        )
        np.testing.assert_array_equal(indices[k].numpy(), touched)
        dense = np.zeros_like(cores[k])
        dense[indices[k].numpy()] = values[k].numpy()
        scale = np.abs(expected[k]).max() + 1
        np.testing.assert_allclose(dense, expected[k], atol=tolerance * scale, rtol=0)


def test_rows_grad_against_finite_differences(rng):
    p, q, ranks = [3, 4, 2], [2, 1, 3], [2, 3]
    cores = [tf.constant(c) for c in random_cores(rng, p, q, ranks, 1)]
    ids = tf.constant(pick_ids(rng, p, 1, 9, "random"))
    attrs = attrs_of(p, q, ranks, 1)

    upstream = tf.constant(rng.standard_normal((9, 6)))

    def loss(*cores):
        return tf.reduce_sum(lib().tf_ttemb_tt_rows(ids, list(cores), **attrs).rows * upstream)

    indices, values = lib().tf_ttemb_tt_rows_grad(
        ids, cores, upstream, tf.zeros([0], tf.float64), **attrs
    )
    eps = 1e-6
    for k, core in enumerate(cores):
        dense = np.zeros(core.shape)
        dense[indices[k].numpy()] = values[k].numpy()
        flat = core.numpy().reshape(-1)
        for pos in rng.choice(flat.size, size=min(12, flat.size), replace=False):
            plus, minus = flat.copy(), flat.copy()
            plus[pos] += eps
            minus[pos] -= eps
            args_p = list(cores)
            args_m = list(cores)
            args_p[k] = tf.constant(plus.reshape(core.shape))
            args_m[k] = tf.constant(minus.reshape(core.shape))
            numeric = (loss(*args_p) - loss(*args_m)).numpy() / (2 * eps)
            assert abs(numeric - dense.reshape(-1)[pos]) < 1e-6 * (1 + abs(numeric))


@pytest.mark.parametrize("device", visible_devices())
def test_rows_grad_is_bitwise_deterministic(rng, device):
    p, q, ranks = [20, 30, 25], [4, 2, 4], [16, 16]
    with tf.device(device):
        _check_rows_grad_is_bitwise_deterministic(rng, device, p, q, ranks)


def _check_rows_grad_is_bitwise_deterministic(rng, device, p, q, ranks):
    cores = [tf.constant(c.astype(np.float32)) for c in random_cores(rng, p, q, ranks, 1)]
    # Zipf-like ids: hot rows and shared prefixes, in random order with duplicates.
    ids = (rng.zipf(1.2, size=5000) - 1) % int(np.prod(p))
    grad = tf.constant(rng.standard_normal((len(ids), 32)).astype(np.float32))
    attrs = attrs_of(p, q, ranks, 1)
    saved = lib().tf_ttemb_tt_rows(ids, cores, **attrs).saved
    first = lib().tf_ttemb_tt_rows_grad(ids, cores, grad, saved, **attrs)
    for _ in range(3):
        again = lib().tf_ttemb_tt_rows_grad(ids, cores, grad, saved, **attrs)
        for a, b in zip(first.core_grad_values, again.core_grad_values):
            assert np.array_equal(a.numpy(), b.numpy())


def test_every_core_row_gets_its_gradient_for_large_p(rng):
    # FBTT's fused update missed core rows for p_k > ~128: here every row of a
    # p = 1000 core is touched and must get exactly the reference gradient.
    _check_large_p_rows_grad(rng, np.arange(3000, dtype=np.int64), lambda f, *a, **k: f(*a, **k))


def _check_large_p_rows_grad(rng, ids, call):
    """TTRowsGrad of 3,000 ids that touch every row of a p = 1000 core, run as
    `call(op, *args, **attrs)`: every row gets exactly the reference gradient."""
    p, q, ranks = [1000, 3], [2, 2], [3]
    cores = random_cores(rng, p, q, ranks, 1)
    grad = rng.standard_normal((3000, 4))
    indices, values = call(
        lib().tf_ttemb_tt_rows_grad,
        ids,
        [tf.constant(c) for c in cores],
        grad,
        tf.zeros([0], tf.float64),
        **attrs_of(p, q, ranks, 1),
    )
    np.testing.assert_array_equal(indices[0].numpy(), np.arange(1000))
    expected = reference_core_grads(cores, p, q, ranks, ids, grad)
    np.testing.assert_allclose(values[0].numpy(), expected[0], atol=1e-10)
    np.testing.assert_allclose(values[1].numpy(), expected[1], atol=1e-10)


def test_chunked_rows_equal_unchunked_reference(rng):
    # Enough ids and a wide row to take several of the op's internal chunks.
    p, q, ranks = [40, 50, 60], [10, 10, 10], [24, 24]
    cores = random_cores(rng, p, q, ranks, 1)
    ids = np.sort(rng.choice(int(np.prod(p)), size=5000, replace=False)).astype(np.int64)
    cores_t = [tf.constant(c.astype(np.float32)) for c in cores]
    rows = lib().tf_ttemb_tt_rows(ids, cores_t, **attrs_of(p, q, ranks, 1)).rows.numpy()
    sample = rng.choice(len(ids), size=50, replace=False)
    expected = reference_rows(cores, p, q, ranks, ids[sample])
    np.testing.assert_allclose(rows[sample], expected, rtol=1e-4, atol=1e-4)


def test_empty_ids():
    p, q, ranks = [3, 4], [2, 2], [2]
    cores = [tf.zeros([3, 4]), tf.zeros([4, 4])]
    ids = tf.zeros([0], tf.int64)
    rows = lib().tf_ttemb_tt_rows(ids, cores, **attrs_of(p, q, ranks, 1)).rows
    assert rows.shape == (0, 4)
    indices, values = lib().tf_ttemb_tt_rows_grad(
        ids, cores, tf.zeros([0, 4]), tf.zeros([0]), **attrs_of(p, q, ranks, 1)
    )
    assert [i.shape[0] for i in indices] == [0, 0]
    assert values[1].shape == (0, 4)


def test_rows_rejects_bad_ids_and_cores(rng):
    p, q, ranks = [3, 4], [2, 2], [2]
    cores = [tf.constant(c) for c in random_cores(rng, p, q, ranks, 2)]
    attrs = attrs_of(p, q, ranks, 2)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"ids\[1\] = 24 is not in \[0, 24\)"):
        checked_tt_rows(tf.constant([0, 24], tf.int64), cores, **attrs)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"ids\[0\] = -1 is not in \[0, 24\)"):
        checked_tt_rows(tf.constant([-1], tf.int64), cores, **attrs)
    with pytest.raises(
        tf.errors.InvalidArgumentError, match=r"cores\[1\] must be \[num_tables \* p_shapes\[1\]"
    ):
        lib().tf_ttemb_tt_rows(tf.constant([0], tf.int64), [cores[0], cores[1][:7]], **attrs)
    with pytest.raises(
        (tf.errors.InvalidArgumentError, ValueError), match="grad must be|Dimension"
    ):
        lib().tf_ttemb_tt_rows_grad(
            tf.constant([0], tf.int64),
            cores,
            tf.zeros([1, 5], tf.float64),
            tf.zeros([0], tf.float64),
            **attrs,
        )


def _tt_report(**findings):
    """A TTReport (cuda/common_types.h) as the GPU TTRows writes it: the findings given,
    the rest unset (-1), the ids counted (4)."""
    words = [-1] * 16
    words[3] = 4  # num_ids
    for name, value in findings.items():
        words[{"first_bad_index": 0, "bad_index_value": 1}[name]] = value
    return tf.constant(words, tf.int64)


@pytest.mark.parametrize(
    "findings,message",
    [
        ({}, None),
        ({"first_bad_index": 3, "bad_index_value": 99}, "ids[3] = 99 is not in [0, 24)"),
        ({"first_bad_index": 0, "bad_index_value": -5}, "ids[0] = -5 is not in [0, 24)"),
    ],
)
def test_check_tt_rows_report_words_the_cpu_ops_error(findings, message):
    """CheckTTRowsReport on the CPU (where a GPU TTRows' report lands when the check is
    placed there) raises the CPU TTRows' message for what the report holds."""
    with tf.device("/CPU:0"):
        if message is None:
            lib().tf_ttemb_check_tt_rows_report(_tt_report(), limit=24)
            lib().tf_ttemb_check_tt_rows_report(tf.zeros([0], tf.int64), limit=24)
            return
        with pytest.raises(tf.errors.InvalidArgumentError) as info:
            lib().tf_ttemb_check_tt_rows_report(_tt_report(**findings), limit=24)
    assert our_message(info.value.message) == message


def test_check_tt_rows_report_rejects_a_report_of_another_size():
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"report must be empty or hold 16"):
        lib().tf_ttemb_check_tt_rows_report(tf.zeros([11], tf.int64), limit=24)


def test_cpu_rows_report_is_empty(rng):
    """The CPU kernel checks the ids itself: its report is empty, and the wrapper adds
    no check without a GPU."""
    p, q, ranks = [3, 4], [2, 2], [2]
    cores = [tf.constant(c) for c in random_cores(rng, p, q, ranks, 1)]
    with tf.device("/CPU:0"):
        out = lib().tf_ttemb_tt_rows(
            tf.constant([0, 5], tf.int64), cores, **attrs_of(p, q, ranks, 1)
        )
    assert out.report.shape == (0,)


@pytest.mark.parametrize("device", visible_devices())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"p{s[0]}q{s[1]}r{s[2]}t{s[3]}")
@pytest.mark.parametrize("dtype", [tf.float64, tf.float32, tf.float16, tf.bfloat16])
def test_saved_is_empty_and_not_read(rng, device, shape, dtype):
    # TTRows' `saved` output is empty on every device, and TTRowsGrad recomputes the
    # partial products: given any vector as `saved`, it returns the same bits.
    p, q, ranks, num_tables = shape
    with tf.device(device):
        cores = [tf.constant(c, dtype) for c in random_cores(rng, p, q, ranks, num_tables)]
        ids = tf.constant(pick_ids(rng, p, num_tables, 60, "sorted_unique"))
        grad = tf.constant(rng.standard_normal((ids.shape[0], int(np.prod(q)))), dtype)
        attrs = attrs_of(p, q, ranks, num_tables)
        saved = lib().tf_ttemb_tt_rows(ids, cores, **attrs).saved
        assert saved.shape == (0,) and saved.dtype == dtype
        junk = tf.constant(rng.standard_normal(37), dtype)
        runs = [lib().tf_ttemb_tt_rows_grad(ids, cores, grad, s, **attrs) for s in (saved, junk)]
    for a, b in zip(runs[0].core_grad_values, runs[1].core_grad_values):
        assert not np.all(a.numpy() == 0)
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_unique_ids_and_slots(rng):
    ids = rng.integers(0, 50, size=200).astype(np.int32)
    ids[rng.choice(200, size=20, replace=False)] = 77  # padding
    splits = np.array([0, 60, 60, 200], np.int64)  # three tables, the second empty
    unique, slots = lib().tf_ttemb_tt_unique_ids(
        ids, splits, num_embeddings=50, stride=64, padding_id=77, has_padding_id=True
    )
    table = np.searchsorted(splits[1:], np.arange(200), side="right")
    global_ids = table * 64 + ids.astype(np.int64)
    real = ids != 77
    np.testing.assert_array_equal(unique.numpy(), np.unique(global_ids[real]))
    assert slots.dtype == tf.int32
    np.testing.assert_array_equal(slots.numpy()[~real], -1)
    np.testing.assert_array_equal(unique.numpy()[slots.numpy()[real]], global_ids[real])


def test_unique_ids_errors():
    op = lib().tf_ttemb_tt_unique_ids
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        op(
            tf.constant([1, 2, 9], tf.int64),
            tf.constant([0, 3], tf.int64),
            num_embeddings=8,
            stride=8,
        )
    assert our_message(info.value.message) == "indices[2] = 9 is not in [0, 8)"
    # ids in [N, prod(p)) are rejected too: the stride is only the global-id spacing.
    with pytest.raises(
        tf.errors.InvalidArgumentError,
        match=r"indices\[0\] = 8 is not in \[0, 8\) and is not padding_id \(-3\)",
    ):
        op(
            tf.constant([8], tf.int64),
            tf.constant([0, 1], tf.int64),
            num_embeddings=8,
            stride=10,
            padding_id=-3,
            has_padding_id=True,
        )
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"table_splits\[0\] = 1 must be 0"):
        op(tf.constant([1], tf.int64), tf.constant([1, 1], tf.int64), num_embeddings=8, stride=8)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"table_splits\[2\] = 1 must be >="):
        op(
            tf.constant([1, 2], tf.int64),
            tf.constant([0, 2, 1], tf.int64),
            num_embeddings=8,
            stride=8,
        )
    with pytest.raises(tf.errors.InvalidArgumentError, match="must equal the number of ids"):
        op(tf.constant([1, 2], tf.int64), tf.constant([0, 1], tf.int64), num_embeddings=8, stride=8)
    with pytest.raises(
        tf.errors.InvalidArgumentError, match=r"stride \(4\) must be >= num_embeddings"
    ):
        op(tf.constant([1], tf.int64), tf.constant([0, 1], tf.int64), num_embeddings=8, stride=4)


def _count(keys, counts, ids):
    lib().tf_ttemb_tt_cache_count(keys.handle, counts.handle, tf.constant(ids, tf.int64))


def _table(keys, counts):
    k, c = keys.numpy(), counts.numpy()
    return {int(a): int(b) for a, b in zip(k, c) if a >= 0}


def test_cache_count_counts_exactly_while_there_is_room(rng):
    keys = tf.Variable(tf.fill([256], tf.constant(-1, tf.int64)))
    counts = tf.Variable(tf.zeros([256], tf.int64))
    ids = rng.integers(0, 40, size=500)
    ids[::7] = -1  # skipped
    _count(keys, counts, ids[:250])
    _count(keys, counts, ids[250:])
    real = ids[ids >= 0]
    values, freq = np.unique(real, return_counts=True)
    assert _table(keys, counts) == dict(zip(values.tolist(), freq.tolist()))


def test_cache_count_replaces_the_least_frequent_way():
    # Four slots: one set of four ways.
    keys = tf.Variable(tf.fill([4], tf.constant(-1, tf.int64)))
    counts = tf.Variable(tf.zeros([4], tf.int64))
    _count(keys, counts, [10] * 5 + [11] * 3 + [12] * 2 + [13] * 4)
    assert _table(keys, counts) == {10: 5, 11: 3, 12: 2, 13: 4}
    # 14 is new and the set is full: it replaces 12 (the smallest count) with 2 + 1.
    _count(keys, counts, [14])
    assert _table(keys, counts) == {10: 5, 11: 3, 14: 3, 13: 4}
    # A heavy newcomer keeps its weight: 15 x 6 replaces 11 (3, the lowest way of the tie).
    _count(keys, counts, [15] * 6)
    assert _table(keys, counts) == {10: 5, 15: 9, 14: 3, 13: 4}


def test_cache_count_uses_every_slot_when_size_is_not_a_multiple_of_32():
    keys = tf.Variable(tf.fill([45], tf.constant(-1, tf.int64)))
    counts = tf.Variable(tf.zeros([45], tf.int64))
    _count(keys, counts, np.arange(10_000))
    assert (keys.numpy() >= 0).all()


def test_cache_count_errors():
    keys = tf.Variable(tf.fill([4], tf.constant(-1, tf.int64)))
    small = tf.Variable(tf.zeros([3], tf.int64))
    floats = tf.Variable(tf.zeros([4], tf.float32))
    op = lib().tf_ttemb_tt_cache_count
    with pytest.raises(tf.errors.InvalidArgumentError, match="same size, got 4 and 3"):
        op(keys.handle, small.handle, tf.constant([1], tf.int64))
    with pytest.raises(tf.errors.InvalidArgumentError, match="counts must be an int64 vector"):
        op(keys.handle, floats.handle, tf.constant([1], tf.int64))
    with pytest.raises(tf.errors.InvalidArgumentError, match="different variables"):
        op(keys.handle, keys.handle, tf.constant([1], tf.int64))


# --------------------------------------------------------------------------------------
# GPU kernels (cc/kernels/tt_embedding_kernels_gpu.cc): registration, and on a machine
# with a GPU visible to TensorFlow, the same results as the CPU kernels.
# --------------------------------------------------------------------------------------

TT_OPS = ["TfTtemb>TTUniqueIds", "TfTtemb>TTRows", "TfTtemb>TTRowsGrad", "TfTtemb>TTCacheCount"]


def _registrations(op, device):
    """(type constraints, host-memory args) of each kernel of `op` on `device`."""
    from tensorflow.python.framework import kernels

    lib()  # registers the kernels
    found = []
    for k in kernels.get_registered_kernels_for_op(op).kernel:
        if k.device_type != device:
            continue
        constraints = tuple(
            (c.name, tuple(sorted(c.allowed_values.list.type))) for c in k.constraint
        )
        found.append((constraints, tuple(sorted(k.host_memory_arg))))
    return sorted(found)


@pytest.mark.parametrize("op", TT_OPS)
def test_gpu_kernels_registered_for_every_cpu_dtype(op):
    gpu = _registrations(op, "GPU")
    if not built_with_cuda():
        assert gpu == [], "a library built without CUDA must not register GPU kernels"
        return
    cpu = _registrations(op, "CPU")
    assert cpu, f"{op} has no CPU kernel"
    assert [c for c, _ in gpu] == [c for c, _ in cpu]
    host = {
        "TfTtemb>TTUniqueIds": ("table_splits",),
        "TfTtemb>TTCacheCount": ("counts", "keys"),
    }.get(op, ())
    assert all(h == host for _, h in gpu), gpu


def _on(device, fn, *args, **kwargs):
    with tf.device(device):
        return fn(*args, **kwargs)


def _assert_on_gpu(*tensors):
    for t in tensors:
        assert "GPU" in t.device, t.device


def _error_message(device, fn, *args, **kwargs):
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        with tf.device(device):
            fn(*args, **kwargs)
    # The op name and device differ between the kernels (TensorFlow may prefix the
    # message with "{{function_node ..._device_/job:.../device:GPU:0}} "); the message
    # is what stands between that prefix and " [Op:".
    return our_message(info.value.message)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"p{s[0]}q{s[1]}r{s[2]}t{s[3]}")
@pytest.mark.parametrize("order", ["sorted_unique", "random"])
@pytest.mark.parametrize("dtype", [tf.float64, tf.float32, tf.float16, tf.bfloat16])
def test_gpu_rows_match_cpu_and_reference(rng, shape, order, dtype):
    if not built_with_cuda():
        pytest.skip("op library built without CUDA")
    p, q, ranks, num_tables = shape
    cores = [tf.cast(c, dtype) for c in random_cores(rng, p, q, ranks, num_tables)]
    ids = tf.constant(pick_ids(rng, p, num_tables, 300, order))
    attrs = attrs_of(p, q, ranks, num_tables)
    gpu = _on("/GPU:0", lib().tf_ttemb_tt_rows, ids, cores, **attrs)
    cpu = _on("/CPU:0", lib().tf_ttemb_tt_rows, ids, cores, **attrs)
    _assert_on_gpu(gpu.rows)
    assert gpu.rows.dtype == dtype
    assert gpu.saved.shape == (0,)  # never saved: the gradient recomputes
    seen = [c.numpy().astype(np.float64) for c in cores]
    expected = reference_rows(seen, p, q, ranks, ids.numpy())
    scale = np.abs(expected).max() + 1
    for rows in (gpu.rows, cpu.rows):
        np.testing.assert_allclose(
            rows.numpy().astype(np.float64), expected, atol=TOLERANCE[dtype] * scale, rtol=0
        )


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"p{s[0]}q{s[1]}r{s[2]}t{s[3]}")
@pytest.mark.parametrize("dtype", [tf.float64, tf.float32, tf.float16, tf.bfloat16])
def test_gpu_rows_grad_matches_cpu_and_reference(rng, shape, dtype):
    if not built_with_cuda():
        pytest.skip("op library built without CUDA")
    p, q, ranks, num_tables = shape
    cores = [tf.cast(c, dtype) for c in random_cores(rng, p, q, ranks, num_tables)]
    # Random order with duplicates: shared prefixes and repeated core rows.
    ids = tf.constant(pick_ids(rng, p, num_tables, 200, "random"))
    grad = tf.cast(rng.standard_normal((ids.shape[0], int(np.prod(q)))), dtype)
    attrs = attrs_of(p, q, ranks, num_tables)
    empty = tf.zeros([0], dtype)
    gpu = _on("/GPU:0", lib().tf_ttemb_tt_rows_grad, ids, cores, grad, empty, **attrs)
    cpu = _on("/CPU:0", lib().tf_ttemb_tt_rows_grad, ids, cores, grad, empty, **attrs)
    _assert_on_gpu(*gpu.core_grad_indices, *gpu.core_grad_values)
    seen = [c.numpy().astype(np.float64) for c in cores]
    expected = reference_core_grads(seen, p, q, ranks, ids.numpy(), grad.numpy().astype(np.float64))
    tolerance = {tf.float64: 1e-10, tf.float32: 1e-4, tf.float16: 3e-2, tf.bfloat16: 3e-2}[dtype]
    for k in range(len(p)):
        np.testing.assert_array_equal(
            gpu.core_grad_indices[k].numpy(), cpu.core_grad_indices[k].numpy()
        )
        assert gpu.core_grad_values[k].dtype == dtype
        dense = np.zeros_like(seen[k])
        dense[gpu.core_grad_indices[k].numpy()] = gpu.core_grad_values[k].numpy().astype(np.float64)
        scale = np.abs(expected[k]).max() + 1
        np.testing.assert_allclose(dense, expected[k], atol=tolerance * scale, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
def test_gpu_rows_grad_is_bitwise_deterministic_and_ignores_saved(rng, dtype):
    if not built_with_cuda():
        pytest.skip("op library built without CUDA")
    p, q, ranks = [20, 30, 25], [4, 2, 4], [16, 16]
    cores = [tf.constant(c, dtype) for c in random_cores(rng, p, q, ranks, 1)]
    ids = tf.constant((rng.zipf(1.2, size=20000) - 1) % int(np.prod(p)), tf.int64)
    grad = tf.constant(rng.standard_normal((ids.shape[0], 32)), dtype)
    attrs = attrs_of(p, q, ranks, 1)
    # `saved` is not read: a vector of anything gives the same result.
    saved = tf.constant(rng.standard_normal(11), dtype)
    runs = [
        _on("/GPU:0", lib().tf_ttemb_tt_rows_grad, ids, cores, grad, s, **attrs)
        for s in (tf.zeros([0], dtype), saved, tf.zeros([0], dtype), saved)
    ]
    for again in runs[1:]:
        for a, b in zip(runs[0].core_grad_values, again.core_grad_values):
            assert np.array_equal(a.numpy(), b.numpy())
        for a, b in zip(runs[0].core_grad_indices, again.core_grad_indices):
            assert np.array_equal(a.numpy(), b.numpy())


@pytest.mark.gpu
def test_gpu_every_core_row_gets_its_gradient_for_large_p(rng):
    if not built_with_cuda():
        pytest.skip("op library built without CUDA")
    ids = rng.permutation(3000).astype(np.int64)
    _check_large_p_rows_grad(rng, ids, lambda f, *a, **k: _on("/GPU:0", f, *a, **k))


@pytest.mark.gpu
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("padding", [None, 77])
def test_gpu_unique_ids_match_cpu(rng, index_dtype, padding):
    if not built_with_cuda():
        pytest.skip("op library built without CUDA")
    ids = rng.integers(0, 50, size=1001).astype(index_dtype)
    if padding is not None:
        ids[rng.choice(1001, size=90, replace=False)] = padding
    splits = tf.constant([0, 300, 300, 1001], tf.int64)  # three tables, the second empty
    kwargs = dict(num_embeddings=50, stride=53)
    if padding is not None:
        kwargs.update(padding_id=padding, has_padding_id=True)
    gpu = _on("/GPU:0", lib().tf_ttemb_tt_unique_ids, ids, splits, **kwargs)
    cpu = _on("/CPU:0", lib().tf_ttemb_tt_unique_ids, ids, splits, **kwargs)
    _assert_on_gpu(gpu.unique_ids, gpu.slots)
    assert gpu.slots.dtype == tf.as_dtype(index_dtype)
    np.testing.assert_array_equal(gpu.unique_ids.numpy(), cpu.unique_ids.numpy())
    np.testing.assert_array_equal(gpu.slots.numpy(), cpu.slots.numpy())
    table = np.searchsorted(splits.numpy()[1:], np.arange(1001), side="right")
    real = ids != padding if padding is not None else np.ones(1001, bool)
    np.testing.assert_array_equal(
        gpu.unique_ids.numpy(), np.unique(table[real] * 53 + ids[real].astype(np.int64))
    )


@pytest.mark.gpu
def test_gpu_empty_inputs():
    if not built_with_cuda():
        pytest.skip("op library built without CUDA")
    p, q, ranks = [3, 4, 2], [2, 2, 1], [2, 3]
    cores = [tf.zeros([3, 4]), tf.zeros([4, 12]), tf.zeros([2, 3])]
    attrs = attrs_of(p, q, ranks, 1)
    ids = tf.zeros([0], tf.int64)
    with tf.device("/GPU:0"):
        rows = lib().tf_ttemb_tt_rows(ids, cores, **attrs).rows
        indices, values = lib().tf_ttemb_tt_rows_grad(
            ids, cores, tf.zeros([0, 4]), tf.zeros([0]), **attrs
        )
        unique, slots = lib().tf_ttemb_tt_unique_ids(
            tf.zeros([0], tf.int32), tf.constant([0, 0], tf.int64), num_embeddings=5, stride=5
        )
    assert rows.shape == (0, 4)
    assert [i.shape[0] for i in indices] == [0, 0, 0]
    assert [v.shape for v in values] == [(0, 4), (0, 12), (0, 3)]
    assert unique.shape == (0,) and slots.shape == (0,)


@pytest.mark.gpu
def test_gpu_errors_match_cpu(rng):
    if not built_with_cuda():
        pytest.skip("op library built without CUDA")
    p, q, ranks = [3, 4], [2, 2], [2]
    cores = [tf.constant(c) for c in random_cores(rng, p, q, ranks, 2)]
    attrs = attrs_of(p, q, ranks, 2)
    bad_ids = [
        tf.constant([0, 5, 24, 3, -1], tf.int64),  # first bad at position 2
        tf.constant([-7], tf.int64),
    ]
    cases = []
    for ids in bad_ids:
        grad = tf.constant(rng.standard_normal((ids.shape[0], 4)))
        cases.append((checked_tt_rows, (ids, cores), attrs))
        cases.append(
            (lib().tf_ttemb_tt_rows_grad, (ids, cores, grad, tf.zeros([0], tf.float64)), attrs)
        )
    cases.append((checked_tt_rows, (tf.constant([0], tf.int64), [cores[0], cores[1][:7]]), attrs))
    unique = lib().tf_ttemb_tt_unique_ids
    for ids, splits, kwargs in [
        ([1, 2, 9, 11], [0, 4], dict(num_embeddings=8, stride=8)),
        (
            [3, 8, 1],
            [0, 1, 3],
            dict(num_embeddings=8, stride=10, padding_id=-3, has_padding_id=True),
        ),
        ([1], [1, 1], dict(num_embeddings=8, stride=8)),
        ([1, 2], [0, 2, 1], dict(num_embeddings=8, stride=8)),
        ([1, 2], [0, 1], dict(num_embeddings=8, stride=8)),
    ]:
        for dtype in (tf.int32, tf.int64):
            cases.append((unique, (tf.constant(ids, dtype), tf.constant(splits, tf.int64)), kwargs))
    for fn, args, kwargs in cases:
        expected = _error_message("/CPU:0", fn, *args, **kwargs)
        assert _error_message("/GPU:0", fn, *args, **kwargs) == expected


@pytest.mark.gpu
def test_gpu_rows_return_without_raising_and_report_the_first_bad_id(rng):
    """The GPU TTRows does not wait for its check: with bad ids it returns, the rows of
    the good ids right; its report, checked on the GPU or on the CPU, gives the CPU
    kernel's message; a report without findings passes."""
    if not built_with_cuda():
        pytest.skip("op library built without CUDA")
    p, q, ranks = [3, 4], [2, 2], [2]
    cores_np = random_cores(rng, p, q, ranks, 2)
    cores = [tf.constant(c) for c in cores_np]
    attrs = attrs_of(p, q, ranks, 2)
    ids = np.array([5, 24, 0, 23, -3, 7], np.int64)
    out = _on("/GPU:0", lib().tf_ttemb_tt_rows, tf.constant(ids), cores, **attrs)
    _assert_on_gpu(out.rows, out.report)
    good = [0, 2, 3, 5]
    np.testing.assert_allclose(
        out.rows.numpy()[good], reference_rows(cores_np, p, q, ranks, ids[good]), rtol=1e-10
    )
    expected = _error_message("/CPU:0", lib().tf_ttemb_tt_rows, tf.constant(ids), cores, **attrs)
    assert expected == "ids[1] = 24 is not in [0, 24)"
    for device in ("/GPU:0", "/CPU:0"):
        assert (
            _error_message(device, lib().tf_ttemb_check_tt_rows_report, out.report, limit=24)
            == expected
        )
    fine = _on("/GPU:0", lib().tf_ttemb_tt_rows, tf.constant(ids[good]), cores, **attrs)
    assert fine.report.shape == (16,)
    with tf.device("/GPU:0"):
        lib().tf_ttemb_check_tt_rows_report(fine.report, limit=24)


@pytest.mark.gpu
@pytest.mark.parametrize("graph_kind", ["tf_function", "tf1_session"])
def test_gpu_tt_rows_wrapper_raises_bad_ids_from_the_report(rng, graph_kind):
    """Through tf_ttemb.tt_rows on the GPU, a bad id fails the call whose rows are
    fetched: a tf.function runs the report's check beside TTRows, a TF1 session because
    the rows wait for it there."""
    if not built_with_cuda():
        pytest.skip("op library built without CUDA")
    import tf_ttemb

    p, q, ranks = [3, 4], [2, 2], [2]
    cores_np = random_cores(rng, p, q, ranks, 1)
    ids = np.array([3, 12, 1], np.int64)
    message = r"ids\[1\] = 12 is not in \[0, 12\)"

    def rows(cores, ids):
        return tf_ttemb.tt_rows(
            cores, ids, p_shapes=p, q_shapes=q, ranks=ranks, implementation="custom_op"
        )

    if graph_kind == "tf_function":
        with tf.device("/GPU:0"):
            cores = [tf.Variable(c) for c in cores_np]
            lookup = tf.function(lambda ids: rows(cores, ids))
            with pytest.raises(tf.errors.InvalidArgumentError, match=message):
                lookup(tf.constant(ids)).numpy()
        return
    graph = tf.Graph()
    with graph.as_default(), tf.device("/GPU:0"):
        cores = [tf.Variable(c) for c in cores_np]
        output = rows(cores, tf.constant(ids))
        with tf.compat.v1.Session(graph=graph) as session:
            session.run([c.initializer for c in cores])
            with pytest.raises(tf.errors.InvalidArgumentError, match=message):
                session.run(output)


@pytest.mark.gpu
def test_gpu_cache_count_matches_cpu(rng):
    if not built_with_cuda():
        pytest.skip("op library built without CUDA")
    tables = {}
    for device in ("/CPU:0", "/GPU:0"):
        with tf.device(device):
            # 45 slots: one set of 32 ways and a remainder set of 13.
            tables[device] = (
                tf.Variable(tf.fill([45], tf.constant(-1, tf.int64))),
                tf.Variable(tf.zeros([45], tf.int64)),
            )
    _assert_on_gpu(*tables["/GPU:0"])  # the variables live on the GPU
    for step in range(6):
        # Zipf ids: hot ids stay, cold ones compete for ways and replace each other.
        ids = (rng.zipf(1.3, size=700) - 1) % 5000
        ids[rng.random(700) < 0.1] = -1  # skipped
        for device, (keys, counts) in tables.items():
            with tf.device(device):
                held = keys.read_value()  # shares the buffer: the update must copy it
                before = held.numpy()
                lib().tf_ttemb_tt_cache_count(
                    keys.handle, counts.handle, tf.constant(ids, tf.int64)
                )
                np.testing.assert_array_equal(held.numpy(), before)
        (ck, cc), (gk, gc) = tables["/CPU:0"], tables["/GPU:0"]
        np.testing.assert_array_equal(gk.numpy(), ck.numpy(), err_msg=f"step {step}")
        np.testing.assert_array_equal(gc.numpy(), cc.numpy(), err_msg=f"step {step}")
    assert (tables["/GPU:0"][0].numpy() >= 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
def test_gpu_tt_embedding_bag_matches_cpu(rng, dtype):
    """The whole custom-op path (unique ids, rows, bag reduction, rows gradient, counting)."""
    if not built_with_cuda():
        pytest.skip("op library built without CUDA")
    from tf_ttemb.ops.tt_embedding import tt_embedding_bag

    p, q, ranks, n = [5, 4, 3], [2, 3, 2], [4, 3], 57
    cores = [tf.constant(c, dtype) for c in random_cores(rng, p, q, ranks, 1)]
    lengths = rng.integers(0, 9, size=13)
    values = (rng.zipf(1.3, size=int(lengths.sum())) - 1) % n
    values[rng.random(values.size) < 0.1] = n + 2  # padding
    ids = tf.RaggedTensor.from_row_lengths(values.astype(np.int64), lengths)
    weights = tf.RaggedTensor.from_row_lengths(
        tf.constant(rng.uniform(0.5, 2.0, size=values.size), dtype), lengths
    )
    upstream = tf.constant(rng.standard_normal((13, 12)), dtype)
    results = {}
    for device in ("/CPU:0", "/GPU:0"):
        with tf.device(device):
            keys = tf.Variable(tf.fill([64], tf.constant(-1, tf.int64)))
            counts = tf.Variable(tf.zeros([64], tf.int64))
            with tf.GradientTape() as tape:
                tape.watch(cores)
                out = tt_embedding_bag(
                    cores,
                    ids,
                    weights,
                    num_embeddings=n,
                    p_shapes=p,
                    q_shapes=q,
                    ranks=ranks,
                    combiner="mean",
                    padding_id=n + 2,
                    frequency_table=(keys, counts),
                    implementation="custom_op",
                )
                loss = tf.reduce_sum(out * upstream)
            grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, cores)]
        results[device] = (out, grads, keys.numpy(), counts.numpy())
    (c_out, c_grads, c_keys, c_counts), (g_out, g_grads, g_keys, g_counts) = (
        results["/CPU:0"],
        results["/GPU:0"],
    )
    _assert_on_gpu(g_out)
    tolerance = 1e-10 if dtype == tf.float64 else 1e-5
    np.testing.assert_allclose(g_out.numpy(), c_out.numpy(), atol=tolerance, rtol=tolerance)
    for a, b in zip(g_grads, c_grads):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=tolerance, rtol=tolerance)
    np.testing.assert_array_equal(g_keys, c_keys)
    np.testing.assert_array_equal(g_counts, c_counts)
    assert (c_keys >= 0).any()
