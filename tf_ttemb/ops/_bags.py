"""Bags in CSR form: dense, ragged and sparse ids (and their weights) converted to flat ids,
row_splits and flat weights, and the bounds checks of the plain-TensorFlow paths.

Private to the package; not an API.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import NamedTuple

import tensorflow as tf

from tf_ttemb.ops import _common


class Bags(NamedTuple):
    """A batch of bags in CSR form and how to shape the [B, D] result back."""

    # [nnz] int32 or int64; from `to_csr(..., flat=False)` dense ids stay as given
    # ([..., L]), for the ops that read them flat (the gather_reduce_sum family).
    ids: tf.Tensor
    row_splits: tf.Tensor  # [B + 1] int64
    weights: tf.Tensor | None  # [nnz] params dtype (shaped as `ids`), or None
    segment_ids: Callable[[], tf.Tensor]  # () -> [nnz] int64 bag of each entry
    batch_shape: tf.Tensor | None  # dense ids: the leading dims to restore
    static_batch_shape: tf.TensorShape
    # Dense ids as given ([..., L], `ids` before its reshape), for an op that reads any
    # shape flat (GroupBags); None where `ids` is all there is.
    dense_ids: tf.Tensor | None = None


def shaped_output(output: tf.Tensor, bags: Bags, row_shape: tf.TensorShape) -> tf.Tensor:
    """The [B, D] result of a lookup of `bags` in the caller's shape: [..., D] for dense
    ids of rank > 2 (the batch shape restored), with the static shape set.

    `row_shape` is the table's static shape past its first dimension ([D]).
    """
    if bags.batch_shape is not None:
        output = tf.reshape(
            output, tf.concat([bags.batch_shape, tf.shape(output, out_type=tf.int64)[1:]], 0)
        )
    if not tf.executing_eagerly():  # an eager tensor's shape is already the full one
        output.set_shape(bags.static_batch_shape.concatenate(row_shape))
    return output


def row_major(sparse: tf.SparseTensor, xla: bool):
    """(coordinates, values) of a 2-D SparseTensor in row-major order."""
    if not xla:
        ordered = tf.sparse.reorder(sparse)
        return ordered.indices, ordered.values
    # SparseReorder has no XLA kernel: a stable sort on the linearised coordinate.
    key = sparse.indices[:, 0] * sparse.dense_shape[1] + sparse.indices[:, 1]
    order = tf.argsort(key, stable=True)
    return tf.gather(sparse.indices, order), tf.gather(sparse.values, order)


def same_row_splits(weight_splits: tf.Tensor, id_splits: tf.Tensor) -> list:
    """The check that ragged weights have the ids' row lengths, as control dependencies:
    none where they share one row_splits tensor (`ids.with_values(w)`), and in eager mode
    none for host tensors, which are compared here (an eager assert costs ~0.1 ms of ops
    per lookup); else a runtime assert."""
    message = "weights must have the same row lengths as indices"
    if weight_splits is id_splits:
        return []
    if tf.executing_eagerly() and "CPU" in weight_splits.device and "CPU" in id_splits.device:
        a, b = weight_splits.numpy(), id_splits.numpy()
        if a.shape != b.shape or (a != b).any():
            raise tf.errors.InvalidArgumentError(None, None, message)
        return []
    same = tf.debugging.assert_equal(
        tf.cast(weight_splits, tf.int64), tf.cast(id_splits, tf.int64), message=message
    )
    return [same] if same is not None else []


def to_csr(
    indices: _common.IndicesLike, weights, dtype: tf.DType, xla: bool, flat: bool = True
) -> Bags:
    """Converts dense, ragged or sparse ids (and weights of the same structure) to CSR.

    `flat=False` leaves dense ids and weights in their own shapes, for an op that reads
    them flat: an eager lookup then runs no reshape before the op (on a small batch one
    eager op costs about as much as the lookup's own work)."""
    if isinstance(indices, tf.RaggedTensor):
        if indices.ragged_rank != 1 or indices.flat_values.shape.rank != 1:
            raise ValueError(
                "ragged indices must be [B, (L)] with ragged_rank 1, got "
                f"ragged_rank {indices.ragged_rank} and shape {indices.shape}"
            )
        ids = _common.int_ids(indices.values, "indices")
        row_splits = tf.cast(indices.row_splits, tf.int64)
        flat_weights = None
        if weights is not None:
            if not isinstance(weights, tf.RaggedTensor) or weights.ragged_rank != 1:
                raise ValueError(
                    "weights must be a RaggedTensor with ragged_rank 1 like the indices, "
                    f"got {type(weights).__name__}"
                )
            checks = same_row_splits(weights.row_splits, indices.row_splits)
            flat_weights = _common.after_checks(checks, tf.cast(weights.values, dtype))

        # Bag of entry j = number of bag ends <= j; stays static-shaped under XLA.
        return Bags(
            ids,
            row_splits,
            flat_weights,
            lambda: csr_segment_ids(ids, row_splits),
            None,
            indices.shape[:1],
        )

    if isinstance(indices, tf.SparseTensor):
        if indices.shape.rank != 2:
            raise ValueError(f"sparse indices must be 2-D [B, L], got shape {indices.shape}")
        num_bags = _common.static_or_dynamic(indices.shape[0], indices.dense_shape[0])
        checks = [] if xla else sparse_bounds_check(indices)
        with tf.control_dependencies(checks):
            coords, values = row_major(indices, xla)
        rows = coords[:, 0]
        # Bag b starts at the first entry whose row is >= b.
        row_splits = tf.searchsorted(
            rows, tf.range(tf.cast(num_bags, tf.int64) + 1), side="left", out_type=tf.int64
        )
        ids = _common.int_ids(values, "indices")
        flat_weights = None
        if weights is not None:
            if not isinstance(weights, tf.SparseTensor):
                raise ValueError(
                    f"weights must be a SparseTensor like the indices, got {type(weights).__name__}"
                )
            weight_coords, weight_values = row_major(weights, xla)
            same = None
            if not xla:
                same = tf.debugging.assert_equal(
                    weight_coords,
                    coords,
                    message="weights must have the same sparsity pattern as indices",
                )
            with tf.control_dependencies([same] if same is not None else []):
                flat_weights = tf.cast(tf.identity(weight_values), dtype)
        return Bags(ids, row_splits, flat_weights, lambda: rows, None, indices.shape[:1])

    if isinstance(weights, (tf.RaggedTensor, tf.SparseTensor)):
        # A structure mismatch, a ValueError like the ragged and sparse ones above.
        raise ValueError(  # noqa: TRY004
            f"weights must be dense like the indices, got {type(weights).__name__}"
        )
    dense_ids = _common.int_ids(tf.convert_to_tensor(indices), "indices")
    if dense_ids.shape.rank is None or dense_ids.shape.rank < 1:
        raise ValueError(
            f"dense indices must have a known rank >= 1 ([..., L]), got shape {dense_ids.shape}"
        )
    device = dense_ids.device if tf.executing_eagerly() else ""
    flat_shape = None
    if flat:
        flat_shape = _common.eager_constant(("flat",), device, lambda: tf.constant([-1]))
    ids = tf.reshape(dense_ids, flat_shape) if flat else dense_ids
    if dense_ids.shape.is_fully_defined():
        # Static shapes (every eager call): the bag count and size are Python ints, so the
        # lookup adds two or three ops to the kernel's (the row_splits range and the
        # reshapes) instead of a dozen, and a [B, L] batch needs no reshape of the output.
        dims = dense_ids.shape.as_list()
        bag_size = dims[-1]
        num_bags = math.prod(dims[:-1])
        batch_shape = None if len(dims) == 2 else tf.constant(dims[:-1], tf.int64)

        def make_splits() -> tf.Tensor:
            if bag_size == 0:
                return tf.zeros([num_bags + 1], tf.int64)
            return tf.range(0, (num_bags + 1) * bag_size, bag_size, dtype=tf.int64)

        row_splits = _common.eager_constant(("row_splits", num_bags, bag_size), device, make_splits)
    else:
        shape = tf.shape(dense_ids, out_type=tf.int64)
        batch_shape = shape[:-1]
        bag_size = shape[-1]
        num_bags = tf.reduce_prod(batch_shape)
        row_splits = tf.range(num_bags + 1, dtype=tf.int64) * bag_size
    flat_weights = None
    if weights is not None:
        dense_weights = tf.convert_to_tensor(weights)
        if not dense_weights.shape.is_compatible_with(dense_ids.shape):
            raise ValueError(
                f"weights must have the shape of indices {dense_ids.shape}, "
                f"got {dense_weights.shape}"
            )
        checks = []
        static_match = (
            dense_weights.shape.is_fully_defined() and dense_weights.shape == dense_ids.shape
        )
        if not static_match:  # only a runtime check can tell
            same = tf.debugging.assert_equal(
                tf.shape(dense_weights, out_type=tf.int64),
                tf.shape(dense_ids, out_type=tf.int64),
                message="weights must have the shape of indices",
            )
            checks = [same] if same is not None else []
        with tf.control_dependencies(checks):
            flat_weights = dense_weights
            if flat_weights.dtype != dtype:
                flat_weights = tf.cast(flat_weights, dtype)
            if flat:
                flat_weights = tf.reshape(flat_weights, flat_shape)
            elif checks:
                flat_weights = tf.identity(flat_weights)

    def dense_segment_ids() -> tf.Tensor:
        bags = tf.range(num_bags, dtype=tf.int64)[:, None]
        return tf.reshape(tf.broadcast_to(bags, tf.stack([num_bags, bag_size])), [-1])

    return Bags(
        ids,
        row_splits,
        flat_weights,
        dense_segment_ids,
        batch_shape,
        dense_ids.shape[:-1],
        dense_ids,
    )


class JoinedBags(NamedTuple):
    """Several batches of bags (one per table or feature) as one CSR, one after another."""

    bags: Bags  # every part's bags: part 0's B bags, then part 1's, ... (ids None
    # without join_ids)
    part_splits: tf.Tensor  # [parts + 1] int64: the entries of each part
    counts: list  # [parts] scalar int64 tensors: the bags of each part (all equal)
    static_batch: int | None  # the parts' common static bag count, if known
    part_ids: list  # each part's ids, of one dtype: dense ones as given, else flat


def csr_segment_ids(ids: tf.Tensor, row_splits: tf.Tensor) -> tf.Tensor:
    """[nnz] int64: the bag of each entry (the number of bag ends <= its position)."""
    positions = tf.range(tf.shape(ids, out_type=tf.int64)[0], dtype=tf.int64)
    return tf.searchsorted(row_splits[1:], positions, side="right", out_type=tf.int64)


def concat_bags(
    indices: list,
    weights: list | None,
    dtype: tf.DType,
    xla: bool,
    what: str,
    host=None,
    join_ids: bool = True,
) -> JoinedBags:
    """Each part's ids (dense [B, L], ragged or sparse) and weights in one CSR, part
    after part. Every part must have the same number of bags B (`what` names a part in
    the errors). With `weights`, a part whose weights are None weighs each entry 1.
    `host` is a context for the few shape-derived int64s (a device scope), or None.
    Without `join_ids` the joined ids are left out (`bags.ids` is None) for a consumer
    that reads `part_ids` as they are (GroupBags): no reshape or concat op for them.
    """
    parts = []
    for t, ids in enumerate(indices):
        part = to_csr(ids, None if weights is None else weights[t], dtype, xla)
        if part.batch_shape is not None and part.static_batch_shape.rank != 1:
            raise ValueError(
                f"dense indices of {what} {t} must be [B, L], got shape "
                f"{part.static_batch_shape.concatenate([None])}"
            )
        parts.append(part)
    ids_dtype = parts[0].ids.dtype
    if any(p.ids.dtype != ids_dtype for p in parts):
        ids_dtype = tf.int64
    part_ids = [
        tf.cast(p.ids if p.dense_ids is None or join_ids else p.dense_ids, ids_dtype) for p in parts
    ]
    ids = tf.concat(part_ids, 0) if join_ids else None
    with host if host is not None else contextlib.nullcontext():
        nnz_each = [tf.shape(p.ids, out_type=tf.int64)[0] for p in parts]
        part_splits = tf.concat([[0], tf.cumsum(tf.stack(nnz_each))], 0)
    row_splits = tf.concat(
        [parts[0].row_splits]
        + [p.row_splits[1:] + part_splits[t] for t, p in enumerate(parts) if t > 0],
        0,
    )
    flat_weights = None
    if weights is not None:
        flat_weights = tf.concat(
            [
                p.weights if p.weights is not None else tf.ones(tf.shape(p.ids), dtype)
                for p in parts
            ],
            0,
        )
    counts = [tf.shape(p.row_splits, out_type=tf.int64)[0] - 1 for p in parts]
    static_counts = {p.static_batch_shape[0] for p in parts}
    static_batch = static_counts.pop() if len(static_counts) == 1 else None
    checks = []
    if static_batch is None:
        for t in range(1, len(parts)):
            same = tf.debugging.assert_equal(
                counts[t],
                counts[0],
                message=f"every {what} must have the same number of bags ({what} {t} differs "
                f"from {what} 0)",
            )
            if same is not None:
                checks.append(same)
    row_splits = _common.after_checks(checks, row_splits)
    bags = Bags(
        ids,
        row_splits,
        flat_weights,
        (lambda: csr_segment_ids(ids, row_splits)) if join_ids else None,
        None,
        tf.TensorShape([None]),
    )
    return JoinedBags(bags, part_splits, counts, static_batch, part_ids)


def check_all(bad: tf.Tensor, message_parts: Callable[[tf.Tensor], list]) -> list:
    """Raises (eagerly) or returns an assert op (graphs) when any entry of `bad` is set.

    `message_parts(position)` gives the error message for the first bad position, as
    strings and scalar tensors (joined; eagerly each tensor as its Python value).
    """

    def first_bad():
        return tf.argmax(tf.cast(bad, tf.int32), output_type=tf.int64)

    if tf.executing_eagerly():
        if bool(tf.reduce_any(bad)):
            parts = message_parts(first_bad())
            text = "".join(p if isinstance(p, str) else str(p.numpy()) for p in parts)
            raise tf.errors.InvalidArgumentError(None, None, text)
        return []

    def fail():
        parts = message_parts(first_bad())
        message = tf.strings.join(
            [p if isinstance(p, str) else tf.strings.as_string(p) for p in parts]
        )
        with tf.control_dependencies([tf.debugging.Assert(False, [message])]):
            return tf.constant(False)

    return [tf.cond(tf.reduce_any(bad), fail, lambda: tf.constant(True))]


def bounds_check(
    ids: tf.Tensor, num_rows: tf.Tensor, padding_id: int | None, prefix: str = ""
) -> list:
    """Raises (eagerly) or returns an assert op (graphs) for ids outside [0, num_rows).

    The message matches the custom op's: `indices[17] = 9001 is not in [0, 4096)`, plus
    ` and is not padding_id (P)` when a padding id is set; the position is the flat one.
    `prefix` starts the message (the grouped lookup's `feature name: `).
    """
    bad = (ids < 0) | (ids >= num_rows)
    suffix = "" if padding_id is None else f" and is not padding_id ({padding_id})"
    if padding_id is not None:
        bad &= ids != padding_id
    return check_all(
        bad,
        lambda k: [
            prefix + "indices[",
            k,
            "] = ",
            ids[k],
            " is not in [0, ",
            num_rows,
            ")" + suffix,
        ],
    )


def sparse_bounds_check(sparse: tf.SparseTensor) -> list:
    """Raises (eagerly) or returns an assert op (graphs) for coordinates of a 2-D
    SparseTensor of ids outside its dense_shape: `indices[1] = [5, 0] is out of bounds
    for dense_shape [2, 2]` (the position in `sparse.indices`)."""
    coords, shape = sparse.indices, sparse.dense_shape
    bad = tf.reduce_any((coords < 0) | (coords >= shape[None, :]), axis=1)
    return check_all(
        bad,
        lambda k: [
            "sparse indices: indices[",
            k,
            "] = [",
            coords[k, 0],
            ", ",
            coords[k, 1],
            "] is out of bounds for dense_shape [",
            shape[0],
            ", ",
            shape[1],
            "]",
        ],
    )
