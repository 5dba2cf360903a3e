"""`grouped_gather_reduce_sum`: many features' embedding bags, each feature looking up its
own table, in one lookup of one flat table (tables stacked by rows).

The custom-op path runs `GroupBags` (each id checked against its own feature's table and
offset to the flat table's row; the bags reordered example by example) and then one
`gather_reduce_sum` forward, whose [B * T, D] output is the [B, T * D] concatenation
without a transpose. The composite path (XLA, TPU) offsets the ids in TensorFlow ops and
transposes the output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import tensorflow as tf

from tf_ttemb import _args
from tf_ttemb.ops import _bags, _common, _custom_op, _loader, composite, sparse_apply


def _feature_ints(name: str, values: Any, count: int, minimum: int) -> list:
    values = list(values)
    if len(values) != count:
        raise ValueError(f"{name} must have one entry per feature ({count}), got {len(values)}")
    return [_args.positive_int(f"{name}[{t}]", v, minimum) for t, v in enumerate(values)]


def _padding_ids(padding_ids: Any, count: int) -> list:
    if padding_ids is None:
        return [None] * count
    padding_ids = list(padding_ids)
    if len(padding_ids) != count:
        raise ValueError(
            f"padding_ids must have one entry per feature ({count}), got {len(padding_ids)}"
        )
    return [_common.check_lookup_args("sum", None, p) for p in padding_ids]


def group_attrs(num_rows: list, row_offsets: list, padding_ids: list, labels: list) -> dict:
    """The attrs of GroupBags and CheckGroupReport."""
    return dict(
        num_rows=num_rows,
        row_offsets=row_offsets,
        padding_ids=[-1 if p is None else p for p in padding_ids],
        has_padding_ids=[p is not None for p in padding_ids],
        labels=labels,
    )


@tf.RegisterGradient("TfTtemb>GroupBags")
def _group_bags_grad(op, unused_ids_grad, unused_splits_grad, weights_grad, *unused):
    """Gradient of GroupBags: the reordered weights' gradient, put back in input order
    (none for the N id parts and the row_splits)."""
    no_grads = [None] * (op.get_attr("N") + 1)
    if not op.get_attr("has_weights"):
        return [*no_grads, None]
    positions = op.outputs[3]
    return [*no_grads, tf.gather(weights_grad, positions)]


tf.no_gradient("TfTtemb>CheckGroupReport")


def grouped_gather_reduce_sum(
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
    """Embedding bags of T features in one lookup, each feature in its own table.

    The tables are stacked by rows in one flat table `params` [sum of rows, D]: feature
    t's table is rows `[row_offsets[t], row_offsets[t] + num_rows[t])` (features may share
    a table: give them the same offset). Feature t's ids are checked against its own
    table and its embedding is `gather_reduce_sum(table_t, indices[t], weights[t])`.

    Args:
      params: The flat [N, D] table: a tensor or a variable (its gradient is one
        deduplicated `tf.IndexedSlices`, or dense with `dense_grad`).
      indices: One entry per feature, each dense [B, L_t], a `tf.RaggedTensor` [B, (L)]
        or a 2-D `tf.SparseTensor` [B, L]; every feature has the same B.
      weights: None, or one entry per feature of the structure of its ids, or None for a
        feature whose entries weigh 1.
      num_rows: The rows of each feature's table.
      row_offsets: The first row of each feature's table in `params`; by default the
        tables follow each other in feature order.
      combiner: "sum", "mean", "sqrtn" or "max", for every feature.
      padding_ids: None, or one entry per feature: the feature's padding id or None.
      labels: The features' names, used in error messages (default: their positions).
      dense_grad: Return the params gradient as a dense tensor.
      implementation: "custom_op", "composite" or "auto" (as `gather_reduce_sum`).
      name: Optional name scope.

    Returns:
      [B, T * D]: feature 0's embeddings, then feature 1's, ...

    Raises:
      ValueError: For lists of the wrong length, bad sizes, or bad combiner arguments.
      tf.errors.InvalidArgumentError: For an id outside its feature's table that is not
        its padding id: `feature country: indices[5] = 9001 is not in [0, 4096)`,
        the position being the flat one among that feature's ids.

    Example:

    >>> import tensorflow as tf
    >>> import tf_ttemb
    >>> table = tf.constant([[1.0], [2.0], [10.0], [20.0], [30.0]])  # tables of 2 and 3 rows
    >>> ids = [tf.constant([[0, 1], [1, 1]]), tf.ragged.constant([[2], [0, 1]])]
    >>> tf_ttemb.grouped_gather_reduce_sum(table, ids, num_rows=[2, 3]).numpy()
    array([[ 3., 30.],
           [ 4., 30.]], dtype=float32)
    """
    g = _checked_args(
        indices, weights, num_rows, row_offsets, combiner, padding_ids, labels, implementation
    )
    with tf.name_scope(name or "grouped_gather_reduce_sum"):
        variable = _common.resource_variable(params)
        if variable is None:
            params = tf.convert_to_tensor(params)
        shape = _checked_table(params, g)
        xla = _common.in_xla_context() or _common.on_tpu(
            variable if variable is not None else params
        )
        if implementation == "auto":
            implementation = "composite" if xla else "custom_op"
        custom = implementation == "custom_op"
        joined = _bags.concat_bags(
            g.indices, g.weights, tf.as_dtype(params.dtype), xla, "feature", join_ids=not custom
        )
        if custom:
            bags = _grouped_bags(joined, g.attrs, tf.as_dtype(params.dtype))
            # GroupBags checked every id against its feature's table and built the
            # row_splits; with the table's rows known, _checked_table has checked that the
            # tables fit in it, so the forward's own report needs no check (one round trip
            # fewer on the GPU).
            checked = isinstance(shape[0], int)
            if variable is not None:
                output = _custom_op.custom_op_on_variable(
                    variable, bags, combiner, -1, dense_grad, checked
                )
            else:
                output = _custom_op.custom_op(params, bags, combiner, -1, dense_grad, checked)
        else:
            bags = _offset_bags(joined, g.attrs, xla)
            output = composite.composite_with_gradient(
                tf.convert_to_tensor(params), bags, combiner, -1, dense_grad, xla
            )
            # [T * B, D], feature after feature -> [B, T, D]
            output = tf.transpose(
                tf.reshape(output, tf.stack([g.count, joined.counts[0], -1])), [1, 0, 2]
            )
        return _concatenated(output, joined, g.count, shape)


def grouped_gather_reduce_sum_sparse_apply(
    params: Any,
    indices: Sequence[Any],
    weights: Sequence[Any] | None = None,
    *,
    num_rows: Sequence[int],
    trigger: Any,
    row_offsets: Sequence[int] | None = None,
    optimizer: str = "sgd",
    learning_rate: Any = 0.01,
    accumulator: Any = None,
    epsilon: float = 1e-7,
    combiner: str = "sum",
    padding_ids: Sequence[int | None] | None = None,
    labels: Sequence[str] | None = None,
    name: str | None = None,
) -> tf.Tensor:
    """`grouped_gather_reduce_sum` whose backward pass updates the rows read, in place.

    The forward result is `grouped_gather_reduce_sum(params, indices, weights, ...)`; the
    backward pass is `tf_ttemb.ops.sparse_apply.gather_reduce_sum_sparse_apply`'s: op
    `GatherReduceSumSparseApply` applies `optimizer` ("sgd", "rowwise_adagrad" or
    "adagrad", with `accumulator` of shape [N] or [N, D] for the two Adagrads) to each
    distinct row of the stacked table that any feature read, one update for every
    table in one call. See `gather_reduce_sum_sparse_apply` for `trigger` and the update
    rules, and `grouped_gather_reduce_sum` for the other arguments.

    Unlike `gather_reduce_sum_sparse_apply`, it runs under `tf.distribute.MirroredStrategy`
    (inside `strategy.run`, with `params` a mirrored variable): the backward pass gathers
    every replica's bags and upstream gradients (`ReplicaContext.all_gather`), and each
    replica applies the update of all of them to its own copy of the table. The copies
    take the same update, from the sum of the replicas' gradients (what a Keras optimizer
    applies), once per step. Other multi-replica strategies raise a ValueError naming them.

    Returns:
      [B, T * D], as `grouped_gather_reduce_sum`.

    Example:

    >>> import tensorflow as tf
    >>> import tf_ttemb
    >>> from tf_ttemb.ops.grouped import grouped_gather_reduce_sum_sparse_apply
    >>> table = tf.Variable(tf.ones([5, 1]))  # tables of 2 and 3 rows
    >>> trigger = tf.Variable(tf.zeros([0]))
    >>> with tf.GradientTape() as tape:
    ...     out = grouped_gather_reduce_sum_sparse_apply(
    ...         table, [tf.constant([[1]]), tf.constant([[0, 0]])], num_rows=[2, 3],
    ...         trigger=trigger, learning_rate=0.5)
    ...     loss = tf.reduce_sum(out)
    >>> tape.gradient(loss, trigger).shape  # runs the update
    TensorShape([0])
    >>> table[:, 0].numpy()  # row 1 of table 0 read once, row 0 of table 1 twice
    array([ 1. ,  0.5,  0. ,  1. ,  1. ], dtype=float32)
    """
    g = _checked_args(indices, weights, num_rows, row_offsets, combiner, padding_ids, labels, None)
    variable = _common.resource_variable(params)
    if variable is None:
        raise ValueError(
            "params must be a resource variable (tf.Variable or Keras variable) updated in "
            f"place, got {type(params).__name__}"
        )
    state, epsilon = sparse_apply.check_optimizer(
        optimizer, accumulator, epsilon, "grouped_gather_reduce_sum_sparse_apply", strategies=True
    )
    with tf.name_scope(name or "grouped_gather_reduce_sum_sparse_apply"):
        shape = _checked_table(variable, g)
        dtype = tf.as_dtype(variable.dtype)
        joined = _bags.concat_bags(g.indices, g.weights, dtype, False, "feature", join_ids=False)
        bags = _grouped_bags(joined, g.attrs, dtype)
        output = sparse_apply.apply_on_bags(
            variable, state, bags, trigger, optimizer, learning_rate, epsilon, combiner, -1
        )
        return _concatenated(output, joined, g.count, shape)


def grouped_bags(
    table: tf.TensorSpec,
    indices: Sequence[Any],
    weights: Sequence[Any] | None = None,
    *,
    num_rows: Sequence[int],
    row_offsets: Sequence[int] | None = None,
    padding_ids: Sequence[int | None] | None = None,
    labels: Sequence[str] | None = None,
) -> tuple:
    """The features' bags as one batch of bags of the stacked table, for lookups that
    cannot take the table whole (`tf_ttemb.distribute.sharded_grouped_gather_reduce_sum`).

    The ids are checked and offset as in `grouped_gather_reduce_sum` (same arguments;
    `table` gives the stacked table's shape and dtype) and reordered example by example:
    bag `b * T + t` is example b's bag of feature t, a padding entry's id is -1.

    Returns:
      (ids, weights, batch): ids a [B * T, (L)] int64 `tf.RaggedTensor` of rows of the
      stacked table, weights one like it or None, batch the static B or None.
    """
    g = _checked_args(indices, weights, num_rows, row_offsets, "sum", padding_ids, labels, None)
    _checked_table(table, g)
    joined = _bags.concat_bags(g.indices, g.weights, table.dtype, False, "feature", join_ids=False)
    bags = _grouped_bags(joined, g.attrs, table.dtype)
    ids = tf.RaggedTensor.from_row_splits(bags.ids, bags.row_splits, validate=False)
    weights = None if bags.weights is None else ids.with_flat_values(bags.weights)
    return ids, weights, joined.static_batch


class _Args(NamedTuple):
    indices: list
    weights: list | None
    count: int
    num_rows: list
    row_offsets: list
    attrs: dict


def _checked_args(
    indices, weights, num_rows, row_offsets, combiner, padding_ids, labels, implementation
) -> _Args:
    """The arguments of a grouped lookup but the table, checked (ValueError naming the
    argument); the table is checked once it is a tensor or variable (`_checked_table`)."""
    indices = list(indices)
    count = len(indices)
    if count == 0:
        raise ValueError("indices must hold at least one feature")
    if weights is not None:
        weights = list(weights)
        if len(weights) != count:
            raise ValueError(
                f"weights must have one entry per feature ({count}), got {len(weights)}"
            )
        if all(w is None for w in weights):
            weights = None
    _common.check_lookup_args(combiner, weights, None, implementation)
    num_rows = _feature_ints("num_rows", num_rows, count, 0)
    if row_offsets is None:
        row_offsets = [sum(num_rows[:t]) for t in range(count)]
    row_offsets = _feature_ints("row_offsets", row_offsets, count, 0)
    padding = _padding_ids(padding_ids, count)
    labels = [str(t) for t in range(count)] if labels is None else [str(x) for x in labels]
    if len(labels) != count:
        raise ValueError(f"labels must have one entry per feature ({count}), got {len(labels)}")
    attrs = group_attrs(num_rows, row_offsets, padding, labels)
    return _Args(indices, weights, count, num_rows, row_offsets, attrs)


def _checked_table(params, g: _Args) -> tf.TensorShape:
    shape = tf.TensorShape(params.shape)
    _common.check_table(shape, tf.as_dtype(params.dtype))
    if isinstance(shape[0], int):
        end = max(o + n for o, n in zip(g.row_offsets, g.num_rows))
        if end > shape[0]:
            raise ValueError(
                f"params has {shape[0]} rows but the features' tables need {end} "
                "(row_offsets[t] + num_rows[t])"
            )
    return shape


def _concatenated(output, joined: _bags.JoinedBags, count: int, shape) -> tf.Tensor:
    """[B * T, D] (example by example) as [B, T * D]."""
    output = tf.reshape(output, tf.stack([joined.counts[0], count * shape[1]]))
    output.set_shape([joined.static_batch, None if shape[1] is None else count * shape[1]])
    return output


def _grouped_bags(joined: _bags.JoinedBags, attrs: dict, dtype: tf.DType) -> _bags.Bags:
    """GroupBags on the features' bags (each feature's ids as they are, no join): the
    flat table's rows, example by example."""
    lib = _loader.load_op_library()
    bags = joined.bags
    has_weights = bags.weights is not None
    weights = bags.weights if has_weights else _common.empty(dtype, joined.part_ids[0].device)
    ids, splits, group_weights, _, report = lib.tf_ttemb_group_bags(
        joined.part_ids, bags.row_splits, weights, has_weights=has_weights, **attrs
    )
    if _common.gpus_visible():
        check = lib.tf_ttemb_check_group_report(report, **attrs)
        ids = _common.after_checks([check], ids)
    return _bags.Bags(
        ids,
        splits,
        group_weights if has_weights else None,
        lambda: _bags.csr_segment_ids(ids, splits),
        None,
        tf.TensorShape([None]),
    )


def _offset_bags(joined: _bags.JoinedBags, attrs: dict, xla: bool) -> _bags.Bags:
    """The joined bags with each id offset to the flat table's row, in TensorFlow ops
    (-1 for padding and, under XLA, for bad ids; else bad ids raise)."""
    bags = joined.bags
    ids = tf.cast(bags.ids, tf.int64)
    count = len(attrs["num_rows"])
    entry_feature = tf.searchsorted(
        joined.part_splits[1:],
        tf.range(tf.shape(ids, out_type=tf.int64)[0]),
        side="right",
        out_type=tf.int64,
    )
    rows = tf.gather(tf.constant(attrs["num_rows"], tf.int64), entry_feature)
    offsets = tf.gather(tf.constant(attrs["row_offsets"], tf.int64), entry_feature)
    padding = tf.zeros_like(ids, tf.bool)
    for t in range(count):
        if attrs["has_padding_ids"][t]:
            padding |= tf.equal(entry_feature, t) & tf.equal(ids, attrs["padding_ids"][t])
    checks = []
    if not xla:
        for t in range(count):
            start, end = joined.part_splits[t], joined.part_splits[t + 1]
            prefix = f"feature {attrs['labels'][t]}: "
            pad = attrs["padding_ids"][t] if attrs["has_padding_ids"][t] else None
            limit = tf.constant(attrs["num_rows"][t], tf.int64)
            checks += _bags.bounds_check(ids[start:end], limit, pad, prefix)
    valid = ~padding & (ids >= 0) & (ids < rows)
    flat = tf.where(valid, ids + offsets, -tf.ones_like(ids))
    flat = _common.after_checks(checks, flat)
    return bags._replace(ids=flat)
