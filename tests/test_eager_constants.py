"""The wrapper's cached eager constants (row_splits of dense batches, empty vectors): a
cached tensor is reused only for the same shape, dtype and device, the cache stays within
its byte budget, and lookups of changing dense shapes in one process stay right."""

from __future__ import annotations

import numpy as np
import pytest
import reference
import tensorflow as tf
from bags import assert_close

import tf_ttemb
from tf_ttemb.ops import _common


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
