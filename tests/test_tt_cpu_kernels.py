"""The CPU TT kernels' own paths (cc/kernels/tt_embedding_cpu.h, tt_embedding_cpu_math.h,
tt_embedding_forward_cpu.cc and tt_embedding_backward_cpu.cc) against float64 references.

test_tt_ops.py pins down the ops' contract on small shapes; here are the shapes that take
the kernels' register-blocked float32 products (ranks that are multiples of 8), in every
dtype (float16/bfloat16 compute in float32 and take them too; float64 takes the generic
loops), with ids that make groups larger than a worker's batch, leaves with several ids,
several chunks, and the tree that TTRowsGrad takes over from TTRows; and the gradients'
bits for 1, 2 and 3 threads. Every op here runs on the CPU, also where TensorFlow sees a
GPU (its TTRows saves no products).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from processes import digests_at_thread_counts
from test_tt_ops import (
    TOLERANCE,
    attrs_of,
    lib,
    pick_ids,
    random_cores,
    reference_core_grads,
    reference_rows,
)

# Ranks that are multiples of 8. Between them: column blocks of 32, 16 and 8 in the
# products (widths q_k r_{k+1} = 128, 72 = 32 + 32 + 8, 40 = 32 + 8, ...), row tiles
# and their remainders (rows per node q_0...q_{k-1} = 1, 2, 3, 4, 6, ...), the last
# core's widths q_{T-1} = 1, 3, 4, 5, 8, 9 (dot products and leaf gradients in blocks of
# 4), and two to five cores (the last level fused into level T-2 = 0, 1, 2, 3).
BLOCKED_SHAPES = [
    # (p_shapes, q_shapes, ranks, num_tables)
    ([6, 5, 7], [4, 4, 4], [32, 32], 1),  # FBTT's blocks: 4 x 32 times 32 x 128
    ([5, 4, 6], [2, 3, 8], [16, 24], 2),  # width 72, q_last 8, two tables
    ([7, 9], [3, 5], [8], 1),  # two cores: level 0 is the fused level, q_last 5
    ([3, 4, 2, 5], [2, 1, 2, 3], [8, 16, 8], 1),  # four cores, q_last 3
    ([2, 3, 2, 2, 3], [1, 2, 1, 2, 9], [8, 8, 16, 8], 1),  # five cores, q_last 9
    ([4, 5, 6], [3, 2, 1], [8, 40], 1),  # q_last 1, rank 40 = 32 + 8
]
DTYPES = [tf.float64, tf.float32, tf.float16, tf.bfloat16]
# Gradients sum many products: float32 within 1e-4 of the largest value (test_tt_ops.py).
GRAD_TOLERANCE = {tf.float64: 1e-10, tf.float32: 1e-4, tf.float16: 2e-2, tf.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def _on_the_cpu():
    with tf.device("/CPU:0"):
        yield


def shape_id(shape):
    p, q, ranks, tables = shape
    return f"p{p}q{q}r{ranks}t{tables}"


def rounded(values, dtype):
    """float64 copies of `values` as the op sees them (rounded to dtype)."""
    return [tf.cast(v, dtype).numpy().astype(np.float64) for v in values]


def grads_dense(indices, values, cores):
    out = []
    for k, core in enumerate(cores):
        dense = np.zeros(core.shape)
        dense[indices[k].numpy()] = values[k].numpy().astype(np.float64)
        out.append(dense)
    return out


def every_blocked_case(test):
    """Parametrizes `test` over BLOCKED_SHAPES x id orders x DTYPES."""
    test = pytest.mark.parametrize("dtype", DTYPES)(test)
    test = pytest.mark.parametrize("order", ["sorted_unique", "sorted", "random"])(test)
    return pytest.mark.parametrize("shape", BLOCKED_SHAPES, ids=shape_id)(test)


def blocked_problem(rng, shape, num_ids, order):
    """The factorisation of `shape`, random float64 cores and `num_ids` ids in `order`."""
    p, q, ranks, num_tables = shape
    cores = random_cores(rng, p, q, ranks, num_tables)
    return p, q, ranks, num_tables, cores, pick_ids(rng, p, num_tables, num_ids, order)


@every_blocked_case
def test_blocked_rows_match_reference(rng, shape, order, dtype):
    p, q, ranks, num_tables, cores, ids = blocked_problem(rng, shape, 150, order)
    rows = (
        lib()
        .tf_ttemb_tt_rows(
            ids, [tf.cast(c, dtype) for c in cores], **attrs_of(p, q, ranks, num_tables)
        )
        .rows
    )
    expected = reference_rows(rounded(cores, dtype), p, q, ranks, ids)
    scale = np.abs(expected).max() + 1
    np.testing.assert_allclose(
        rows.numpy().astype(np.float64), expected, atol=TOLERANCE[dtype] * scale, rtol=0
    )


@every_blocked_case
def test_blocked_rows_grad_matches_reference(rng, shape, order, dtype):
    p, q, ranks, num_tables, cores, ids = blocked_problem(rng, shape, 120, order)
    grad = rng.standard_normal((len(ids), int(np.prod(q))))
    cores_t = [tf.cast(c, dtype) for c in cores]
    attrs = attrs_of(p, q, ranks, num_tables)
    expected = reference_core_grads(
        rounded(cores, dtype), p, q, ranks, ids, rounded([grad], dtype)[0]
    )
    indices, values = lib().tf_ttemb_tt_rows_grad(
        ids, cores_t, tf.cast(grad, dtype), tf.zeros([0], dtype), **attrs
    )
    for k, dense in enumerate(grads_dense(indices, values, cores)):
        touched = np.unique(
            (ids // np.prod(p)) * p[k] + (ids % np.prod(p)) // np.prod(p[k + 1 :]) % p[k]
        )
        np.testing.assert_array_equal(indices[k].numpy(), touched)
        scale = np.abs(expected[k]).max() + 1
        np.testing.assert_allclose(dense, expected[k], atol=GRAD_TOLERANCE[dtype] * scale, rtol=0)


def test_large_groups_and_several_chunks(rng):
    # Rank 128 with q = 2: 1 KiB of temporaries per id, so 40,000 ids take three chunks
    # (kChunkBytes = 32 MiB); a level-1 group (one row of core 1) holds up to 40 nodes,
    # more than a worker's batch of 32 (kBatchElements / (4 x 128)).
    p, q, ranks = [40, 50, 60], [2, 2, 2], [128, 128]
    cores = random_cores(rng, p, q, ranks, 1)
    ids = np.sort(rng.choice(int(np.prod(p)), size=40_000, replace=False)).astype(np.int64)
    attrs = attrs_of(p, q, ranks, 1)
    grad = rng.standard_normal((len(ids), 8))
    sample = rng.choice(len(ids), size=50, replace=False)
    expected_rows = reference_rows(rounded(cores, tf.float32), p, q, ranks, ids[sample])

    results = {}
    for dtype in (tf.float64, tf.float32):
        cores_t = [tf.constant(c, dtype) for c in cores]
        rows, saved, _ = lib().tf_ttemb_tt_rows(ids, cores_t, **attrs)
        grads = lib().tf_ttemb_tt_rows_grad(ids, cores_t, tf.constant(grad, dtype), saved, **attrs)
        results[dtype] = (rows, grads)
    rows32 = results[tf.float32][0].numpy()[sample]
    np.testing.assert_allclose(rows32, expected_rows, atol=1e-5 * (np.abs(expected_rows).max() + 1))

    # float64: the gradient's inner product with random directions V_k against the
    # central difference of sum(rows * grad) along them (rows from the float64 forward,
    # itself checked against reference_rows).
    _, g64 = results[tf.float64]
    dense64 = grads_dense(g64.core_grad_indices, g64.core_grad_values, cores)

    def loss(values):
        out = lib().tf_ttemb_tt_rows(ids, [tf.constant(v) for v in values], **attrs).rows
        return float(np.sum(out.numpy() * grad))

    np.testing.assert_allclose(
        results[tf.float64][0].numpy()[sample],
        reference_rows(cores, p, q, ranks, ids[sample]),
        rtol=0,
        atol=1e-10 * (np.abs(expected_rows).max() + 1),
    )
    for _ in range(2):
        direction = [rng.standard_normal(c.shape) for c in cores]
        eps = 1e-5
        numeric = (
            loss([c + eps * v for c, v in zip(cores, direction)])
            - loss([c - eps * v for c, v in zip(cores, direction)])
        ) / (2 * eps)
        analytic = sum(float(np.sum(d * v)) for d, v in zip(dense64, direction))
        assert abs(numeric - analytic) <= 1e-6 * (abs(analytic) + 1)

    # float32 (register-blocked) against float64 (generic loops), every core.
    dense32 = grads_dense(
        results[tf.float32][1].core_grad_indices, results[tf.float32][1].core_grad_values, cores
    )
    for a, b in zip(dense32, dense64):
        np.testing.assert_allclose(a, b, atol=1e-4 * (np.abs(b).max() + 1), rtol=0)


def test_tree_is_taken_over_only_for_the_same_ids(rng):
    # TTRowsGrad takes the tree TTRows built for the same ids: interleaved calls on ids of
    # the same length but other values, and ids no TTRows saw, get their own.
    p, q, ranks = [6, 5, 7], [4, 4, 4], [32, 32]
    cores = random_cores(rng, p, q, ranks, 1)
    cores_t = [tf.constant(c, tf.float32) for c in cores]
    attrs = attrs_of(p, q, ranks, 1)
    batches = [pick_ids(rng, p, 1, 60, "random")[:50] for _ in range(3)]
    grad = rng.standard_normal((50, 64))
    for ids in batches[:2]:
        lib().tf_ttemb_tt_rows(ids, cores_t, **attrs)
    for ids in (batches[1], batches[0], batches[2]):
        indices, values = lib().tf_ttemb_tt_rows_grad(
            ids, cores_t, tf.constant(grad, tf.float32), tf.zeros([0]), **attrs
        )
        expected = reference_core_grads(
            rounded(cores, tf.float32), p, q, ranks, ids, rounded([grad], tf.float32)[0]
        )
        for k, dense in enumerate(grads_dense(indices, values, cores)):
            scale = np.abs(expected[k]).max() + 1
            np.testing.assert_allclose(dense, expected[k], atol=1e-4 * scale, rtol=0)


THREADS_SCRIPT = """
    import numpy as np
    from tf_ttemb.ops import _loader
    lib = _loader.load_op_library()
    rng = np.random.default_rng(7)
    p, q, ranks = [50, 60, 70], [4, 4, 4], [32, 32]
    r = [1, 32, 32, 1]
    cores = [
        tf.constant(rng.standard_normal((p[k], r[k] * q[k] * r[k + 1])), tf.float32)
        for k in range(3)
    ]
    # Zipf-like ids in random order: hot rows, duplicates and shared prefixes.
    ids = tf.constant((rng.zipf(1.2, size=20000) - 1) % int(np.prod(p)), tf.int64)
    grad = tf.constant(rng.standard_normal((20000, 64)), tf.float32)
    attrs = dict(p_shapes=p, q_shapes=q, ranks=ranks, num_tables=1)
    out = lib.tf_ttemb_tt_rows(ids, cores, **attrs)
    digest.update(out.rows.numpy().tobytes())
    g = lib.tf_ttemb_tt_rows_grad(ids, cores, grad, out.saved, **attrs)
    for values in g.core_grad_values:
        digest.update(values.numpy().tobytes())
"""


@pytest.mark.slow
def test_rows_and_grads_have_the_same_bits_for_any_thread_count():
    digests = digests_at_thread_counts(THREADS_SCRIPT)
    assert len(set(digests.values())) == 1, digests
