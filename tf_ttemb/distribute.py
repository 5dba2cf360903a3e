"""EmbeddingBag lookups on tables sharded by rows, as `ParameterServerStrategy` shards them.

Under `tf.distribute.ParameterServerStrategy` with a `variable_partitioner`, a large
table becomes a `ShardedVariable`: shard s holds the rows [offset_s, offset_s + rows_s)
on one parameter server. `sharded_gather_reduce_sum` never assembles the table: each
shard's rows are combined where the shard lives, into one [B, D] partial result per
shard, and only those partial results travel:

* `sum`: the partial weighted sums add up.
* `mean` / `sqrtn`: the partial weighted sums add up, and the sum is divided by the
  bag's weight sum (its entry count when unweighted) or by the square root of its sum of
  squared weights. Those depend on the ids and weights only, not on the table, so they
  are computed once, beside the ids.
* `max`: each shard gives the max over its own entries of a bag and whether the bag has
  any there; the result is, per column, the largest among the shards that have entries,
  NaN if any of them is NaN (a bag with no entries at all gives zeros).

Gradients flow back the same way: each shard receives a `tf.IndexedSlices` gradient over
its own touched rows (local row numbers), so an optimizer updates only those rows, on the
parameter server that holds them.

`sharded_grouped_gather_reduce_sum` does the same for many features' tables stacked by
rows in one sharded table (`grouped_gather_reduce_sum`'s layout): shard boundaries need
not fall between tables.

`tf_ttemb.layers.EmbeddingBag` and `tf_ttemb.layers.GroupedEmbeddingBag` use these
automatically when their tables are sharded. See `docs/distribute.md`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tf_ttemb.ops import _bags, _common
from tf_ttemb.ops import gather_reduce_sum as _grs
from tf_ttemb.ops import grouped as _grouped

__all__ = [
    "is_sharded",
    "shards_of",
    "sharded_gather_reduce_sum",
    "sharded_grouped_gather_reduce_sum",
]


def shards_of(params: Any) -> list | None:
    """The row shards of a sharded table, in row order, or None if `params` is not sharded.

    A sharded table is a `ShardedVariable` (what `ParameterServerStrategy` creates with a
    `variable_partitioner`; its `variables` are the shards), a Keras variable wrapping
    one, or a list or tuple of at least two [rows_s, D] variables or tensors.

    Args:
      params: A table, sharded or not.

    Returns:
      The list of shards, or None.
    """
    if isinstance(params, (list, tuple)):
        return list(params) if len(params) >= 2 else None
    if isinstance(params, (tf.Tensor, tf.Variable)):
        return None
    shards = getattr(params, "variables", None)
    if shards is None and hasattr(params, "value"):  # a Keras variable
        try:
            return shards_of(params.value)
        except (AttributeError, ValueError):
            return None
    if (
        isinstance(shards, (list, tuple))
        and shards
        and all(isinstance(shard, tf.Variable) for shard in shards)
    ):
        return list(shards)
    return None


def is_sharded(params: Any) -> bool:
    """Whether `params` is a table sharded by rows (see `shards_of`)."""
    return shards_of(params) is not None


def _check_shards(shards: list) -> tuple[list[int], int, tf.DType]:
    """Static row offsets of the shards, their common width and dtype."""
    offsets = [0]
    dim = None
    dtype = None
    for s, shard in enumerate(shards):
        shape = tf.TensorShape(shard.shape)
        if shape.rank != 2 or shape[0] is None or shape[1] is None:
            raise ValueError(
                f"shards must be matrices [rows, D] of static shape, got shape {shape} "
                f"for shard {s}"
            )
        if dim is None:
            dim, dtype = shape[1], tf.as_dtype(shard.dtype)
        elif shape[1] != dim or tf.as_dtype(shard.dtype) != dtype:
            raise ValueError(
                f"shards must share their width and dtype: shard 0 is [*, {dim}] "
                f"{dtype.name}, shard {s} is {shape} {tf.as_dtype(shard.dtype).name}"
            )
        offsets.append(offsets[-1] + shape[0])
    return offsets, dim, dtype


def _device_of(shard: Any) -> str:
    return getattr(shard, "device", "") or ""


def sharded_gather_reduce_sum(
    params: Any,
    indices: Any,
    weights: Any = None,
    combiner: str = "sum",
    padding_id: int | None = None,
    dense_grad: bool = False,
    implementation: str = "auto",
    name: str | None = None,
) -> tf.Tensor:
    """`tf_ttemb.gather_reduce_sum` on a table sharded by rows, combined per shard.

    Same arguments, result and gradients as `tf_ttemb.gather_reduce_sum`, except that
    `params` is sharded (see `shards_of`; an unsharded table is passed on to
    `gather_reduce_sum`) and the params gradient goes to each shard separately: a
    `tf.IndexedSlices` over that shard's touched rows, numbered within the shard. Each
    shard's lookup runs on the shard's device (`with tf.device(shard.device)`), from the
    entries whose ids fall in its rows; only [B, D] partial results leave it.

    Rounding differs slightly from the unsharded op (partial sums are added in another
    order). For `max`, a column whose maximum is reached in two shards by different
    rows sends its gradient to the lower shard (the unsharded op: to the earlier entry).

    Args:
      params: A `ShardedVariable`, a Keras variable wrapping one, or a list of [rows_s, D]
        variables or tensors holding consecutive rows.
      indices: Dense [..., L], ragged [B, (L)] or sparse [B, L] int32/int64 ids in [0, N),
        N the total row count.
      weights: Optional per-entry weights with the structure of `indices`.
      combiner: "sum", "mean", "sqrtn" or "max".
      padding_id: Entries with this id are ignored.
      dense_grad: Each shard's gradient as a dense [rows_s, D] tensor.
      implementation: Of each shard's lookup; see `tf_ttemb.gather_reduce_sum`.
      name: Optional name scope.

    Returns:
      The combined embeddings, as from `tf_ttemb.gather_reduce_sum`.

    Raises:
      ValueError: As `gather_reduce_sum`, and for shards of different widths or dtypes.
      tf.errors.InvalidArgumentError: For an id outside [0, N) that is not
        `padding_id` (`indices[3] = 40 is not in [0, 37)`).

    Example:

    >>> import numpy as np
    >>> import tensorflow as tf
    >>> from tf_ttemb.distribute import sharded_gather_reduce_sum
    >>> table = np.arange(10.0, dtype=np.float32).reshape(5, 2)
    >>> shards = [tf.Variable(table[:3]), tf.Variable(table[3:])]
    >>> ids = tf.ragged.constant([[0, 4], [], [3]])
    >>> sharded_gather_reduce_sum(shards, ids, combiner="mean").numpy()
    array([[4., 5.],
           [0., 0.],
           [6., 7.]], dtype=float32)
    """
    shards = shards_of(params)
    if shards is None:
        return _grs.gather_reduce_sum(
            params, indices, weights, combiner, padding_id, dense_grad, implementation, name
        )
    padding_id = _common.check_lookup_args(combiner, weights, padding_id, implementation)
    offsets, dim, dtype = _check_shards(shards)
    _common.check_table(tf.TensorShape([None, dim]), dtype)
    with tf.name_scope(name or "sharded_gather_reduce_sum"):
        bags = _bags.to_csr(indices, weights, dtype, xla=False)
        acc_dtype = _common.accumulation_dtype(dtype)
        ids = tf.cast(bags.ids, tf.int64)
        num_rows = offsets[-1]
        valid = (ids >= 0) & (ids < num_rows)
        if padding_id is not None:
            valid &= ids != padding_id
        with tf.control_dependencies(
            _bags.bounds_check(ids, tf.constant(num_rows, tf.int64), padding_id)
        ):
            valid = tf.identity(valid)
        inverse = None
        if combiner in ("mean", "sqrtn"):
            inverse = _inverse_denominator(bags, valid, combiner, acc_dtype)
            # A bag of zero denominator gives +0 and zero gradients whatever its rows
            # hold, as unsharded: its entries are left out like padding (0 * Inf is NaN,
            # in the output and in the weights gradient).
            valid &= tf.gather(inverse, bags.segment_ids()) != 0

        partials = []  # per shard: ([B, D] partial in acc_dtype, [B] bag has entries there)
        for shard, low, high in zip(shards, offsets[:-1], offsets[1:]):
            in_shard = valid & (ids >= low) & (ids < high)
            local_ids = tf.cast(tf.boolean_mask(ids, in_shard) - low, bags.ids.dtype)
            # Entries of bag b in this shard: [splits[b], splits[b + 1]) of the kept ones.
            kept_before = tf.concat(
                [tf.zeros([1], tf.int64), tf.cumsum(tf.cast(in_shard, tf.int64))], 0
            )
            local_splits = tf.gather(kept_before, bags.row_splits)
            local_bags = tf.RaggedTensor.from_row_splits(local_ids, local_splits, validate=False)
            local_weights = None
            if bags.weights is not None:
                local_weights = local_bags.with_flat_values(tf.boolean_mask(bags.weights, in_shard))
            with tf.device(_device_of(shard)):
                partial = _grs.gather_reduce_sum(
                    shard,
                    local_bags,
                    local_weights,
                    combiner="max" if combiner == "max" else "sum",
                    dense_grad=dense_grad,
                    implementation=implementation,
                )
            partials.append((tf.cast(partial, acc_dtype), local_splits[1:] > local_splits[:-1]))

        if combiner == "max":
            output = _combine_max(partials, acc_dtype)
        else:
            output = tf.add_n([partial for partial, _ in partials])
            if inverse is not None:
                output *= inverse[:, None]
        output = tf.cast(output, dtype)
        if bags.batch_shape is not None:
            output = tf.reshape(output, tf.concat([bags.batch_shape, [dim]], 0))
        output.set_shape(bags.static_batch_shape.concatenate([dim]))
        return output


def sharded_grouped_gather_reduce_sum(
    params: Any,
    indices: Sequence[Any],
    weights: Sequence[Any] | None = None,
    *,
    num_rows: Sequence[int],
    row_offsets: Sequence[int] | None = None,
    combiner: str = "sum",
    padding_ids: Sequence[int | None] | None = None,
    labels: Sequence[str] | None = None,
    dense_grad: bool = False,
    implementation: str = "auto",
    name: str | None = None,
) -> tf.Tensor:
    """`tf_ttemb.grouped_gather_reduce_sum` on a stacked table sharded by rows.

    Same arguments, result and gradients as `grouped_gather_reduce_sum`, except that
    `params` is sharded (see `shards_of`; an unsharded table is passed on to
    `grouped_gather_reduce_sum`) and each shard gets its own gradient, as in
    `sharded_gather_reduce_sum`. The shards split the stacked table anywhere, within a
    feature's table too: the ids are checked against their own feature's table and
    offset to rows of the stacked table on the worker (one `GroupBags`), then every
    feature's bags are looked up shard by shard by `sharded_gather_reduce_sum`, each
    shard's part where it lives.

    Returns:
      [B, T * D]: feature 0's embeddings, then feature 1's, ...

    Raises:
      As `grouped_gather_reduce_sum`, and for shards of different widths or dtypes.

    Example:

    >>> import numpy as np
    >>> import tensorflow as tf
    >>> from tf_ttemb.distribute import sharded_grouped_gather_reduce_sum
    >>> table = np.array([[1.0], [2.0], [10.0], [20.0], [30.0]])  # tables of 2 and 3 rows
    >>> shards = [tf.Variable(table[:3]), tf.Variable(table[3:])]  # split inside table 1
    >>> ids = [tf.constant([[0, 1], [1, 1]]), tf.ragged.constant([[2], [0, 1]])]
    >>> sharded_grouped_gather_reduce_sum(shards, ids, num_rows=[2, 3]).numpy()
    array([[ 3., 30.],
           [ 4., 30.]])
    """
    shards = shards_of(params)
    if shards is None:
        return _grouped.grouped_gather_reduce_sum(
            params,
            indices,
            weights,
            num_rows=num_rows,
            row_offsets=row_offsets,
            combiner=combiner,
            padding_ids=padding_ids,
            labels=labels,
            dense_grad=dense_grad,
            implementation=implementation,
            name=name,
        )
    weighted = weights is not None and any(w is not None for w in weights)
    _common.check_lookup_args(combiner, weights if weighted else None, None, implementation)
    offsets, dim, dtype = _check_shards(shards)
    with tf.name_scope(name or "sharded_grouped_gather_reduce_sum"):
        ids, flat_weights, batch = _grouped.grouped_bags(
            tf.TensorSpec([offsets[-1], dim], dtype),
            indices,
            weights,
            num_rows=num_rows,
            row_offsets=row_offsets,
            padding_ids=padding_ids,
            labels=labels,
        )
        output = sharded_gather_reduce_sum(
            shards,
            ids,
            flat_weights,
            combiner=combiner,
            padding_id=-1,
            dense_grad=dense_grad,
            implementation=implementation,
        )
        count = len(list(indices))
        output = tf.reshape(output, [-1, count * dim])  # [B * T, D] example by example
        output.set_shape([batch, count * dim])
        return output


def _inverse_denominator(bags, valid: tf.Tensor, combiner: str, acc_dtype: tf.DType):
    """[B] 1 / (weight sum) for mean, 1 / sqrt(sum of squared weights) for sqrtn; 0 if 0."""
    if bags.weights is None:
        terms = tf.cast(valid, acc_dtype)
    else:
        terms = tf.where(valid, tf.cast(bags.weights, acc_dtype), tf.zeros([], acc_dtype))
        if combiner == "sqrtn":
            terms = tf.square(terms)
    num_bags = tf.shape(bags.row_splits, out_type=tf.int64)[0] - 1
    denominator = tf.math.unsorted_segment_sum(terms, bags.segment_ids(), num_bags)
    if combiner == "sqrtn":
        denominator = tf.sqrt(denominator)
    return tf.math.divide_no_nan(tf.ones_like(denominator), denominator)


def _combine_max(partials: Sequence, acc_dtype: tf.DType) -> tf.Tensor:
    """Per column, the largest partial max among the shards holding entries of the bag,
    NaN if one of them is NaN (as unsharded: NaN wins, -inf is a value)."""
    stacked = tf.stack([partial for partial, _ in partials])  # [S, B, D]
    has = tf.stack(
        [tf.broadcast_to(has[:, None], tf.shape(partial)) for partial, has in partials]
    )  # [S, B, D]
    is_nan = has & tf.math.is_nan(stacked)
    numbers = has & ~is_nan
    best = tf.reduce_max(tf.where(numbers, stacked, -float("inf")), axis=0)  # [B, D]
    candidate = tf.where(tf.reduce_any(is_nan, axis=0), is_nan, numbers & tf.equal(stacked, best))
    # One shard per (bag, column) gets the gradient: the first candidate (tf.where, not a
    # product with a one-hot mask, routes it there without 0 * NaN or 0 * Inf elsewhere).
    chosen = candidate & tf.equal(tf.cumsum(tf.cast(candidate, tf.int32), axis=0), 1)
    output = tf.reduce_sum(tf.where(chosen, stacked, tf.zeros([], acc_dtype)), axis=0)
    any_entries = tf.reduce_any(has, axis=0)
    return tf.where(any_entries, output, tf.zeros([], acc_dtype))
