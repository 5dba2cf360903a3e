"""Large batches of short bags (a recommendation batch: most bags hold 0 to 3 ids) against a
vectorised float64 numpy reference.

On the GPU these batches take the forward's short-bags kernel (ForwardShortBagsKernel: a
group walks the entries of several consecutive bags as one stream and writes each bag's row
when the stream leaves it), which the small batches of the other test files never reach: it
runs only when the batch has at least twice as many (bag, column chunk) items as the GPU
needs (2 x 16,384). On the CPU they are one more check of the plain kernel. Dims cover one
and two vectors per lane and several column chunks, and an odd dim (whose rows are not
16-byte aligned) the fallback to the per-bag kernel.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import tensorflow as tf
from bags import DTYPES, assert_close, quantize

import tf_ttemb

PADDING_ID = -1
NUM_ROWS = 3000


def short_bags(rng, num_bags):
    """Row splits of `num_bags` bags of 0 to 3 entries (a fifth empty, most of 1)."""
    lengths = rng.choice([0, 1, 1, 1, 2, 3], size=num_bags)
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def reference_forward(params64, ids, splits, weights64, combiner):
    """out [B, D] and the magnitude scale the tolerance uses, by reduceat over the entries."""
    keep = ids != PADDING_ID
    w = np.where(keep, 1.0 if weights64 is None else weights64, 0.0)
    rows = params64[np.where(keep, ids, 0)]
    starts, lengths = splits[:-1], np.diff(splits)
    full = lengths > 0

    def bag_sums(values):  # [nnz, ...] -> [B, ...]; reduceat gives a row for an empty bag
        out = np.zeros((len(lengths),) + values.shape[1:])
        out[full] = np.add.reduceat(values, starts[full], axis=0)
        return out

    sums = bag_sums(w[:, None] * rows)
    magnitude = bag_sums(np.abs(w)[:, None] * np.abs(rows))
    if combiner == "sum":
        den = np.ones(len(lengths))
    elif combiner == "mean":
        den = bag_sums(w)
    else:
        den = np.sqrt(bag_sums(w * w))
    scale = np.divide(1.0, den, out=np.zeros_like(den), where=den != 0)
    return sums * scale[:, None], magnitude * np.abs(scale)[:, None]


CASES = [
    # (dtype, combiner, weighted): every combiner and weighting in float32, three in each
    # other dtype.
    *[("float32", c, w) for c in ("sum", "mean", "sqrtn") for w in (False, True)],
    *[
        (d, c, w)
        for d in ("float16", "bfloat16", "float64")
        for c, w in (("sum", True), ("mean", False), ("sqrtn", True))
    ],
]


@pytest.mark.parametrize("dim", [8, 64, 512, 67])
@pytest.mark.parametrize(
    "dtype,combiner,weighted", CASES, ids=["-".join(map(str, c)) for c in CASES]
)
def test_many_short_bags_match_reference(rng, dtype, combiner, weighted, dim):
    num_bags = 70_000 if dim <= 64 else 36_000
    splits = short_bags(rng, num_bags)
    nnz = int(splits[-1])
    ids = rng.integers(0, NUM_ROWS, size=nnz)
    ids[rng.random(nnz) < 0.1] = PADDING_ID
    tf_dtype = DTYPES[dtype]
    params, params64 = quantize(rng.normal(size=(NUM_ROWS, dim)), tf_dtype)
    weights = weights64 = None
    if weighted:
        weights, weights64 = quantize(rng.uniform(0.25, 1.5, size=nnz), tf_dtype)
    ids_dtype = tf.int32 if dim % 2 else tf.int64
    ragged = tf.RaggedTensor.from_row_splits(tf.constant(ids, ids_dtype), splits)
    ragged_weights = None if weights is None else tf.RaggedTensor.from_row_splits(weights, splits)
    out = tf_ttemb.gather_reduce_sum(
        params, ragged, ragged_weights, combiner=combiner, padding_id=PADDING_ID
    )
    want, magnitude = reference_forward(params64, ids, splits, weights64, combiner)
    # Outputs below the dtype's smallest normal number are rounded to its subnormal grid.
    tiny = {"float16": np.finfo(np.float16).tiny, "bfloat16": np.finfo(np.float32).tiny}
    magnitude = np.maximum(magnitude, tiny.get(dtype, 0.0))
    assert out.dtype == tf_dtype
    assert_close(tf.cast(out, tf.float64).numpy(), want, magnitude, tf_dtype, "forward")


@pytest.mark.parametrize("ids_dtype", [tf.int32, tf.int64], ids=["int32", "int64"])
def test_first_bad_id_of_many_short_bags(rng, ids_dtype):
    """The first bad id is named, with later bad ids in other bags of the same and of later
    work items (each item of the GPU's short-bags kernel reports the first bad id it sees)."""
    splits = short_bags(rng, 70_000)
    nnz = int(splits[-1])
    ids = rng.integers(0, NUM_ROWS, size=nnz)
    first = nnz // 3
    ids[first] = NUM_ROWS + 4
    ids[first + 1 : first + 40 : 3] = -7
    ids[nnz - 2] = NUM_ROWS
    ragged = tf.RaggedTensor.from_row_splits(tf.constant(ids, ids_dtype), splits)
    params = tf.constant(rng.normal(size=(NUM_ROWS, 64)), tf.float32)
    message = f"indices[{first}] = {NUM_ROWS + 4} is not in [0, {NUM_ROWS})"
    with pytest.raises(tf.errors.InvalidArgumentError, match=re.escape(message)):
        tf_ttemb.gather_reduce_sum(params, ragged, combiner="mean")
