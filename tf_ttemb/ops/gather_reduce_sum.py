"""`gather_reduce_sum`: a fused EmbeddingBag for TensorFlow, its gradients and its XLA fallback.

Two implementations compute the same numbers and gradients:

* `custom_op`: the `TfTtemb>GatherReduceSum` op family from `tf_ttemb/_tf_ttemb_ops.so`
  (see `docs/gather_reduce_sum_contract.md`). Its gradients are registered below.
* `composite`: plain TensorFlow ops that also compile under XLA and run on TPU. Rows are
  gathered, weighted and segment-reduced a chunk of entries at a time, forward and
  backward, so the full gathered [nnz, D] tensor is never built; see
  `COMPOSITE_CHUNK_BYTES`.

Both take bags in CSR form: flat ids [nnz], int64 row_splits [B + 1] and optional flat
weights [nnz]. `gather_reduce_sum` converts dense, ragged and sparse ids to that form and
shapes the result back.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Optional

import tensorflow as tf

from tf_ttemb.ops import _loader

COMBINERS = ("sum", "mean", "sqrtn", "max")
IMPLEMENTATIONS = ("auto", "custom_op", "composite")

# Memory budget of the composite implementation, in bytes: a chunk of entries is sized so
# that one [chunk, D] temporary of the accumulation dtype (float32 for float16/bfloat16
# params) fits in it (int64 for the position bookkeeping of combiner "max"). A chunk step
# holds a few such temporaries at once, and chunks run one after another
# (parallel_iterations=1), so the extra memory is a small multiple of this budget plus
# the [B, D] accumulator (two for "max": values and NaN/-inf kinds) and O(nnz)
# integer/weight vectors, whatever nnz is. Gradients
# additionally hold their result: [U, D] (or [N, D] for dense gradients) in the
# accumulation dtype.
COMPOSITE_CHUNK_BYTES = 64 * 1024 * 1024

_HALF_TYPES = (tf.float16, tf.bfloat16)
_VALUE_TYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)

IndicesLike = tf.Tensor | tf.RaggedTensor | tf.SparseTensor | Sequence


class _Bags(NamedTuple):
    """A batch of bags in CSR form and how to shape the [B, D] result back."""

    ids: tf.Tensor  # [nnz] int32 or int64
    row_splits: tf.Tensor  # [B + 1] int64
    weights: tf.Tensor | None  # [nnz] params dtype, or None
    segment_ids: Callable[[], tf.Tensor]  # () -> [nnz] int64 bag of each entry
    batch_shape: tf.Tensor | None  # dense ids: the leading dims to restore
    static_batch_shape: tf.TensorShape


def _check_choice(what: str, value: object, allowed: Sequence[str]) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(
            f"{what} must be one of {', '.join(repr(a) for a in allowed)}, got {value!r}"
        )


def _int_ids(ids: tf.Tensor, what: str) -> tf.Tensor:
    if ids.dtype in (tf.int32, tf.int64):
        return ids
    if ids.dtype.is_integer:
        return tf.cast(ids, tf.int64)
    raise TypeError(f"{what} must be an integer tensor, got dtype {ids.dtype.name}")


def _static_or_dynamic(static: int | None, dynamic: tf.Tensor):
    return static if static is not None else dynamic


def _row_major(sparse: tf.SparseTensor, xla: bool):
    """(coordinates, values) of a 2-D SparseTensor in row-major order."""
    if not xla:
        ordered = tf.sparse.reorder(sparse)
        return ordered.indices, ordered.values
    # SparseReorder has no XLA kernel: a stable sort on the linearised coordinate.
    key = sparse.indices[:, 0] * sparse.dense_shape[1] + sparse.indices[:, 1]
    order = tf.argsort(key, stable=True)
    return tf.gather(sparse.indices, order), tf.gather(sparse.values, order)


def _to_csr(indices: IndicesLike, weights, dtype: tf.DType, xla: bool) -> _Bags:
    """Converts dense, ragged or sparse ids (and weights of the same structure) to CSR."""
    if isinstance(indices, tf.RaggedTensor):
        if indices.ragged_rank != 1 or indices.flat_values.shape.rank != 1:
            raise ValueError(
                "ragged indices must be [B, (L)] with ragged_rank 1, got "
                f"ragged_rank {indices.ragged_rank} and shape {indices.shape}"
            )
        ids = _int_ids(indices.values, "indices")
        row_splits = tf.cast(indices.row_splits, tf.int64)
        flat_weights = None
        if weights is not None:
            if not isinstance(weights, tf.RaggedTensor) or weights.ragged_rank != 1:
                raise ValueError(
                    "weights must be a RaggedTensor with ragged_rank 1 like the indices, "
                    f"got {type(weights).__name__}"
                )
            same = tf.debugging.assert_equal(
                tf.cast(weights.row_splits, tf.int64),
                row_splits,
                message="weights must have the same row lengths as indices",
            )
            with tf.control_dependencies([same] if same is not None else []):
                flat_weights = tf.cast(tf.identity(weights.values), dtype)

        def segment_ids() -> tf.Tensor:
            # Bag of entry j = number of bag ends <= j; stays static-shaped under XLA.
            positions = tf.range(tf.shape(ids, out_type=tf.int64)[0], dtype=tf.int64)
            return tf.searchsorted(row_splits[1:], positions, side="right", out_type=tf.int64)

        return _Bags(ids, row_splits, flat_weights, segment_ids, None, indices.shape[:1])

    if isinstance(indices, tf.SparseTensor):
        if indices.shape.rank != 2:
            raise ValueError(f"sparse indices must be 2-D [B, L], got shape {indices.shape}")
        num_bags = _static_or_dynamic(indices.shape[0], indices.dense_shape[0])
        checks = [] if xla else _sparse_bounds_check(indices)
        with tf.control_dependencies(checks):
            coords, values = _row_major(indices, xla)
        rows = coords[:, 0]
        # Bag b starts at the first entry whose row is >= b.
        row_splits = tf.searchsorted(
            rows, tf.range(tf.cast(num_bags, tf.int64) + 1), side="left", out_type=tf.int64
        )
        ids = _int_ids(values, "indices")
        flat_weights = None
        if weights is not None:
            if not isinstance(weights, tf.SparseTensor):
                raise ValueError(
                    f"weights must be a SparseTensor like the indices, got {type(weights).__name__}"
                )
            weight_coords, weight_values = _row_major(weights, xla)
            same = None
            if not xla:
                same = tf.debugging.assert_equal(
                    weight_coords,
                    coords,
                    message="weights must have the same sparsity pattern as indices",
                )
            with tf.control_dependencies([same] if same is not None else []):
                flat_weights = tf.cast(tf.identity(weight_values), dtype)
        return _Bags(ids, row_splits, flat_weights, lambda: rows, None, indices.shape[:1])

    if isinstance(weights, (tf.RaggedTensor, tf.SparseTensor)):
        # A structure mismatch, a ValueError like the ragged and sparse ones above.
        raise ValueError(  # noqa: TRY004
            f"weights must be dense like the indices, got {type(weights).__name__}"
        )
    dense_ids = _int_ids(tf.convert_to_tensor(indices), "indices")
    if dense_ids.shape.rank is None or dense_ids.shape.rank < 1:
        raise ValueError(
            f"dense indices must have a known rank >= 1 ([..., L]), got shape {dense_ids.shape}"
        )
    ids = tf.reshape(dense_ids, [-1])
    if dense_ids.shape.is_fully_defined():
        # Static shapes (every eager call): the bag count and size are Python ints, so the
        # lookup adds two or three ops to the kernel's (the row_splits range and the
        # reshapes) instead of a dozen, and a [B, L] batch needs no reshape of the output.
        dims = dense_ids.shape.as_list()
        bag_size = dims[-1]
        num_bags = math.prod(dims[:-1])
        batch_shape = None if len(dims) == 2 else tf.constant(dims[:-1], tf.int64)
        if bag_size == 0:
            row_splits = tf.zeros([num_bags + 1], tf.int64)
        else:
            row_splits = tf.range(0, (num_bags + 1) * bag_size, bag_size, dtype=tf.int64)
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
            flat_weights = tf.reshape(tf.cast(dense_weights, dtype), [-1])

    def dense_segment_ids() -> tf.Tensor:
        bags = tf.range(num_bags, dtype=tf.int64)[:, None]
        return tf.reshape(tf.broadcast_to(bags, tf.stack([num_bags, bag_size])), [-1])

    return _Bags(
        ids, row_splits, flat_weights, dense_segment_ids, batch_shape, dense_ids.shape[:-1]
    )


def _in_xla_context() -> bool:
    """Whether ops built now will be compiled by XLA (e.g. in `tf.function(jit_compile=True)`).

    TensorFlow has no public API for this; `tf.__internal__.get_enclosing_xla_context` is the
    narrowest one it exports (TensorFlow's own losses use it), so it is isolated here.
    """
    if tf.executing_eagerly():
        return False
    get_context = getattr(tf.__internal__, "get_enclosing_xla_context", None)
    return get_context is not None and get_context() is not None


def _on_tpu(params: tf.Tensor) -> bool:
    """Whether the computation runs on a TPU (TPUStrategy, or params placed on a TPU)."""
    if tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
        if isinstance(
            strategy, (tf.distribute.TPUStrategy, tf.distribute.experimental.TPUStrategy)
        ):
            return True
    device = getattr(params, "device", "") or ""
    return ":TPU:" in device


# ----------------------------------------------------------------------------------------
# Custom-op path and its registered gradients.


def check_lookup_args(combiner: str, weights: Any, padding_id: Any) -> int | None:
    """Checks the arguments every lookup of the package shares; returns padding_id as an int.

    Raises ValueError naming the argument: a combiner not in COMBINERS, weights with
    "max", or a padding_id that is not None or an integer in int64's range.
    """
    _check_choice("combiner", combiner, COMBINERS)
    if combiner == "max" and weights is not None:
        raise ValueError("combiner 'max' does not take weights")
    if padding_id is None:
        return None
    try:
        if isinstance(padding_id, bool):
            raise TypeError
        value = operator.index(padding_id)
    except TypeError:
        raise ValueError(f"padding_id must be an integer or None, got {padding_id!r}") from None
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"padding_id must be in int64's range [-2**63, 2**63), got {value}")
    return value


def _op_attrs(combiner, has_weights: bool, padding_id: int | None) -> dict:
    return {
        "combiner": combiner,
        "has_weights": has_weights,
        "padding_id": -1 if padding_id is None else padding_id,
        "has_padding_id": padding_id is not None,
    }


def _attrs_of(op) -> dict:
    return {
        key: op.get_attr(key) for key in ("combiner", "has_weights", "padding_id", "has_padding_id")
    }


def _params_grad_sparse(lib, params, ids, row_splits, weights, argmax, grad, attrs):
    params_shape = tf.shape(params, out_type=tf.int64)
    unique_ids, values = lib.tf_ttemb_gather_reduce_sum_grad(
        grad, ids, row_splits, weights, argmax, params_shape[0], **attrs
    )
    return tf.IndexedSlices(values, unique_ids, dense_shape=params_shape)


def _weights_grad(lib, params, ids, row_splits, weights, output, grad, attrs):
    if not attrs["has_weights"]:
        return None
    return lib.tf_ttemb_gather_reduce_sum_weights_grad(
        grad, params, ids, row_splits, weights, output, **attrs
    )


@tf.RegisterGradient("TfTtemb>GatherReduceSum")
def _gather_reduce_sum_grad(op, grad, unused_argmax_grad):
    """Gradients of GatherReduceSum: IndexedSlices over sorted unique ids, weights, None."""
    lib = _loader.load_op_library()
    attrs = _attrs_of(op)
    params, ids, row_splits, weights = op.inputs[:4]
    output, argmax = op.outputs[:2]
    if _use_fused_backward(attrs):
        unique_ids, values, weights_grad = lib.tf_ttemb_gather_reduce_sum_fused_grad(
            grad, params, ids, row_splits, weights, output, dense_grad=False, **attrs
        )
        params_shape = tf.shape(params, out_type=tf.int64)
        return tf.IndexedSlices(values, unique_ids, params_shape), None, None, weights_grad
    params_grad = _params_grad_sparse(lib, params, ids, row_splits, weights, argmax, grad, attrs)
    weights_grad = _weights_grad(lib, params, ids, row_splits, weights, output, grad, attrs)
    return params_grad, None, None, weights_grad


def _use_fused_backward(attrs: dict) -> bool:
    """Whether the weighted backward can use the one-pass fused gradient op.

    It computes the params and weights gradients together, reading each table row once
    in id order instead of gathering it again per entry (CPU and GPU kernels).
    """
    return attrs["has_weights"] and attrs["combiner"] != "max"


def _resource_variable(params) -> Optional[tf.Variable]:
    """The resource variable behind `params` (a `tf.Variable` or a Keras variable), or None.

    Reading a variable as a tensor copies the whole table once the variable has been
    updated sparsely (TensorFlow then keeps it in copy-on-read mode), so the custom op
    reads such variables in place through their handle instead. A Keras variable that is
    being autocast (mixed precision) is read as a tensor in its compute dtype.
    """
    if not isinstance(params, tf.Variable):
        try:
            params = params.value  # a Keras variable wraps a tf.Variable
        except AttributeError:
            return None
        if not isinstance(params, tf.Variable):
            return None
    if isinstance(params, tf.distribute.DistributedValues):
        return _replica_local_variable(params)
    try:
        handle = params.handle
    except (AttributeError, ValueError):
        return None
    if not isinstance(handle, tf.Tensor) or handle.dtype != tf.resource:
        return None
    return params


def _replica_local_variable(variable) -> Optional[tf.Variable]:
    """The component of a distributed variable (MirroredVariable, ...) this replica reads.

    Inside `strategy.run` a distributed variable's `handle` is the handle of the replica's
    own copy; the copy itself is the one among `strategy.experimental_local_results` with
    that very handle. Reading through that copy's handle lets the custom op read the
    replica's table in place, and gradients w.r.t. the distributed variable (which tapes
    take w.r.t. that same handle) flow to it. Elsewhere (cross-replica context, packed
    variables) this gives None and the caller reads the variable as a tensor, which a
    distributed variable resolves to the right copy.
    """
    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return None
    try:
        handle = variable.handle
    except (AttributeError, ValueError):
        return None
    for component in tf.distribute.get_strategy().experimental_local_results(variable):
        if (
            isinstance(component, tf.Variable)
            and not isinstance(component, tf.distribute.DistributedValues)
            and getattr(component, "handle", None) is handle
        ):
            return component
    return None


@tf.RegisterGradient("TfTtemb>ResourceGatherReduceSum")
def _resource_gather_reduce_sum_grad(op, grad, unused_argmax_grad):
    """Gradients of ResourceGatherReduceSum, as for GatherReduceSum, w.r.t. the handle."""
    lib = _loader.load_op_library()
    attrs = _attrs_of(op)
    handle, ids, row_splits, weights = op.inputs[:4]
    output, argmax = op.outputs[:2]
    params_shape = tf.raw_ops.VariableShape(input=handle, out_type=tf.int64)
    if _use_fused_backward(attrs):
        dense_grad = op.get_attr("dense_grad")
        unique_ids, values, weights_grad = lib.tf_ttemb_resource_gather_reduce_sum_fused_grad(
            grad, handle, ids, row_splits, weights, output, dense_grad=dense_grad, **attrs
        )
        if dense_grad:
            return values, None, None, weights_grad
        return tf.IndexedSlices(values, unique_ids, params_shape), None, None, weights_grad
    if op.get_attr("dense_grad"):
        params_grad = lib.tf_ttemb_gather_reduce_sum_dense_grad(
            grad, ids, row_splits, weights, argmax, params_shape[0], **attrs
        )
    else:
        unique_ids, values = lib.tf_ttemb_gather_reduce_sum_grad(
            grad, ids, row_splits, weights, argmax, params_shape[0], **attrs
        )
        params_grad = tf.IndexedSlices(values, unique_ids, dense_shape=params_shape)
    weights_grad = None
    if attrs["has_weights"]:
        weights_grad = lib.tf_ttemb_resource_gather_reduce_sum_weights_grad(
            grad, handle, ids, row_splits, weights, output, **attrs
        )
    return params_grad, None, None, weights_grad


def _custom_op_on_variable(
    variable: tf.Variable,
    bags: _Bags,
    combiner: str,
    padding_id: Optional[int],
    dense_grad: bool,
) -> tf.Tensor:
    lib = _loader.load_op_library()
    has_weights = bags.weights is not None
    attrs = _op_attrs(combiner, has_weights, padding_id)
    weights = bags.weights if has_weights else tf.zeros([0], variable.dtype)
    # A read of no rows, through the public API, tells every active GradientTape that
    # the variable was used (the op below reads it through its handle, which tapes do
    # not see as a variable access) and costs nothing.
    variable.sparse_read(tf.zeros([0], tf.int32))
    output, _ = lib.tf_ttemb_resource_gather_reduce_sum(
        variable.handle, bags.ids, bags.row_splits, weights, dense_grad=dense_grad, **attrs
    )
    return output


tf.no_gradient("TfTtemb>GatherReduceSumGrad")
tf.no_gradient("TfTtemb>GatherReduceSumFusedGrad")
tf.no_gradient("TfTtemb>ResourceGatherReduceSumFusedGrad")
tf.no_gradient("TfTtemb>ResourceGatherReduceSumWeightsGrad")
tf.no_gradient("TfTtemb>GatherReduceSumDenseGrad")
tf.no_gradient("TfTtemb>GatherReduceSumWeightsGrad")


def _custom_op(
    params: tf.Tensor, bags: _Bags, combiner: str, padding_id: int | None, dense_grad: bool
) -> tf.Tensor:
    lib = _loader.load_op_library()
    has_weights = bags.weights is not None
    attrs = _op_attrs(combiner, has_weights, padding_id)
    weights = bags.weights if has_weights else tf.zeros([0], params.dtype)
    ids, row_splits = bags.ids, bags.row_splits
    if not dense_grad:
        output, _ = lib.tf_ttemb_gather_reduce_sum(params, ids, row_splits, weights, **attrs)
        return output

    # The op has no attr for the gradient's form, so the dense-gradient variant replaces
    # the registered (sparse) gradient with one that calls GatherReduceSumDenseGrad.
    @tf.custom_gradient
    def forward(params, weights):
        # stop_gradient: the registered gradient is replaced, so an eager tape need not
        # record the inner op.
        output, argmax = lib.tf_ttemb_gather_reduce_sum(
            tf.stop_gradient(params), ids, row_splits, tf.stop_gradient(weights), **attrs
        )

        def grad(dy):
            if _use_fused_backward(attrs):
                _, params_grad, weights_grad = lib.tf_ttemb_gather_reduce_sum_fused_grad(
                    dy, params, ids, row_splits, weights, output, dense_grad=True, **attrs
                )
                return params_grad, weights_grad
            params_grad = lib.tf_ttemb_gather_reduce_sum_dense_grad(
                dy,
                ids,
                row_splits,
                weights,
                argmax,
                tf.shape(params, out_type=tf.int64)[0],
                **attrs,
            )
            weights_grad = _weights_grad(lib, params, ids, row_splits, weights, output, dy, attrs)
            return params_grad, weights_grad

        return output, grad

    return forward(params, weights)


# ----------------------------------------------------------------------------------------
# Composite path: plain TensorFlow ops, chunked.


def _check_all(bad: tf.Tensor, message_parts: Callable[[tf.Tensor], list]) -> list:
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


def _bounds_check(ids: tf.Tensor, num_rows: tf.Tensor, padding_id: int | None) -> list:
    """Raises (eagerly) or returns an assert op (graphs) for ids outside [0, num_rows).

    The message matches the custom op's: `indices[17] = 9001 is not in [0, 4096)`, plus
    ` and is not padding_id (P)` when a padding id is set; the position is the flat one.
    """
    bad = (ids < 0) | (ids >= num_rows)
    suffix = "" if padding_id is None else f" and is not padding_id ({padding_id})"
    if padding_id is not None:
        bad &= ids != padding_id
    return _check_all(
        bad,
        lambda k: ["indices[", k, "] = ", ids[k], " is not in [0, ", num_rows, ")" + suffix],
    )


def _sparse_bounds_check(sparse: tf.SparseTensor) -> list:
    """Raises (eagerly) or returns an assert op (graphs) for coordinates of a 2-D
    SparseTensor of ids outside its dense_shape: `indices[1] = [5, 0] is out of bounds
    for dense_shape [2, 2]` (the position in `sparse.indices`)."""
    coords, shape = sparse.indices, sparse.dense_shape
    bad = tf.reduce_any((coords < 0) | (coords >= shape[None, :]), axis=1)
    return _check_all(
        bad,
        lambda k: ["sparse indices: indices[", k, "] = [", coords[k, 0], ", ", coords[k, 1],
                   "] is out of bounds for dense_shape [", shape[0], ", ", shape[1], "]"],
    )


def _composite(
    params: tf.Tensor,
    bags: _Bags,
    combiner: str,
    padding_id: int | None,
    dense_grad: bool,
    xla: bool,
) -> tuple[tf.Tensor, Callable]:
    """gather_reduce_sum from plain TensorFlow ops, chunked forward and backward.

    Returns the [B, D] output and `backward(dy, weights_wanted) -> (params_grad,
    weights_grad)` for `tf.custom_gradient`. `xla`: ids outside [0, N) are treated like
    padding instead of raising (asserts do not survive XLA compilation), and the params
    gradient is dense (tf.unique does not compile).
    """
    # Runs inside tf.custom_gradient, which supplies the gradient; without these an eager
    # GradientTape would also record every chunk's ops and keep all their [chunk, D]
    # intermediates alive until the backward pass.
    params = tf.stop_gradient(params)
    if bags.weights is not None:
        bags = bags._replace(weights=tf.stop_gradient(bags.weights))
    dtype = params.dtype
    acc_dtype = tf.float32 if dtype in _HALF_TYPES else dtype
    ids_dtype = bags.ids.dtype
    ids = tf.cast(bags.ids, tf.int64)
    params_shape = tf.shape(params, out_type=tf.int64)
    num_rows = params_shape[0]
    dim = _static_or_dynamic(params.shape[1], tf.shape(params)[1])
    nnz = _static_or_dynamic(bags.ids.shape[0], tf.shape(ids, out_type=tf.int64)[0])
    static_bags = bags.row_splits.shape[0]
    num_bags = _static_or_dynamic(
        None if static_bags is None else static_bags - 1,
        tf.shape(bags.row_splits, out_type=tf.int64)[0] - 1,
    )
    # Segment num_bags is a dummy bag that absorbs padding, invalid ids and the slack
    # of the last chunk, so every chunk has the same static shape.
    dummy = num_bags

    not_padding = tf.ones_like(ids, tf.bool) if padding_id is None else ids != padding_id
    valid = not_padding & (ids >= 0) & (ids < num_rows)
    checks = [] if xla else _bounds_check(ids, num_rows, padding_id)
    with tf.control_dependencies(checks):
        safe_ids = tf.where(valid, ids, tf.zeros_like(ids))
    segments = bags.segment_ids()
    entry_bags = tf.where(valid, segments, tf.cast(dummy, tf.int64) * tf.ones_like(segments))

    # Per-entry weights with the combiner's per-bag scale folded in.
    if bags.weights is None:
        raw_weights = tf.cast(valid, acc_dtype)
    else:
        raw_weights = tf.where(valid, tf.cast(bags.weights, acc_dtype), tf.zeros([], acc_dtype))
    scale = None  # [B + 1], 1/denominator per bag, 0 for the dummy bag and zero denominators
    if combiner in ("mean", "sqrtn"):
        terms = raw_weights if combiner == "mean" else tf.square(raw_weights)
        denominator = tf.math.unsorted_segment_sum(terms, entry_bags, num_bags + 1)
        if combiner == "sqrtn":
            denominator = tf.sqrt(denominator)
        # The dummy bag only holds zero weights, so its scale is 0 too.
        scale = tf.math.divide_no_nan(tf.ones_like(denominator), denominator)
        entry_weights = raw_weights * tf.gather(scale, entry_bags)
    else:
        entry_weights = raw_weights

    # Chunks of `chunk` entries: vectors padded to num_chunks * chunk and viewed as rows.
    itemsize = 8 if combiner == "max" else acc_dtype.size
    if isinstance(dim, int):
        chunk = max(1, COMPOSITE_CHUNK_BYTES // (max(dim, 1) * itemsize))
    else:
        chunk = tf.maximum(
            tf.constant(1, tf.int64),
            COMPOSITE_CHUNK_BYTES // (tf.maximum(tf.cast(dim, tf.int64), 1) * itemsize),
        )
    if isinstance(nnz, int) and isinstance(chunk, int):
        chunk = min(chunk, max(nnz, 1))
        num_chunks = -(-nnz // chunk)
        stored_chunks = max(num_chunks, 1)
    else:
        chunk = tf.minimum(tf.cast(chunk, tf.int64), tf.maximum(tf.cast(nnz, tf.int64), 1))
        num_chunks = (nnz + chunk - 1) // chunk
        stored_chunks = tf.maximum(num_chunks, 1)
    # At least one chunk is stored (all slack when there are no entries): XLA compiles the
    # loop body's slice of a chunk even when the loop runs no iteration.
    slack = stored_chunks * chunk - nnz

    if isinstance(chunk, int) and isinstance(stored_chunks, int):
        chunked_shape = [stored_chunks, chunk]
    else:
        chunked_shape = tf.stack([stored_chunks, chunk])

    def chunked(vector, fill):
        padded = tf.concat([vector, tf.fill(tf.reshape(slack, [1]), fill)], axis=0)
        return tf.reshape(padded, chunked_shape)

    ids_c = chunked(safe_ids, tf.constant(0, tf.int64))
    bags_c = chunked(entry_bags, tf.cast(dummy, tf.int64))
    weights_c = chunked(entry_weights, tf.constant(0, acc_dtype))

    def positions_of(k):
        return tf.cast(k * chunk, tf.int64) + tf.range(tf.cast(chunk, tf.int64))  # [chunk]

    # Invalid and padding entries gather row 0 (with weight 0, into the dummy bag). A
    # table without rows has no row 0: gather from one zero row instead (every entry is
    # then padding, or an id the bounds check rejected). Under XLA gathers clamp.
    table = params
    if not xla and (params.shape[0] is None or params.shape[0] == 0):
        table = tf.cond(
            num_rows > 0, lambda: params, lambda: tf.zeros(tf.stack([1, dim]), params.dtype)
        )

    def rows_of(k):
        return tf.cast(tf.gather(table, ids_c[k]), acc_dtype)  # [chunk, D]

    def loop(body, state):
        def step(k, *state):
            new_state = tuple(body(k, *state))
            for old, new in zip(state, new_state):
                # `acc + segment_sum(...)` broadcasts a static dim of 1 with the unknown
                # one to unknown; the state keeps its shape (while_loop demands it).
                if isinstance(new, tf.Tensor):
                    new.set_shape(old.shape)
            return (k + 1,) + new_state

        result = tf.while_loop(
            lambda k, *_: k < num_chunks,
            step,
            (tf.constant(0, tf.int64),) + tuple(state),
            parallel_iterations=1,
        )
        return result[1:]

    acc_shape = tf.stack([tf.cast(num_bags, tf.int64) + 1, tf.cast(dim, tf.int64)])
    if combiner == "max":
        # NaN wins and -inf is a value, as in the custom op and tf.reduce_max, whatever
        # the order of the entries and however a backend's segment max treats NaN (XLA's
        # may drop it) and its start (the lowest finite value). Per (bag, column): the max
        # of the entries that are not NaN, and the highest kind among the entries: 2 NaN,
        # 1 a value above -inf, 0 -inf; -1 while the bag has none.
        lowest = tf.constant(acc_dtype.min, acc_dtype)

        def max_step(k, acc, kind):
            rows = rows_of(k)
            is_nan = tf.math.is_nan(rows)
            entry_kind = tf.where(
                is_nan,
                tf.constant(2, acc_dtype),
                tf.where(tf.equal(rows, -float("inf")), tf.constant(0, acc_dtype),
                         tf.constant(1, acc_dtype)),
            )
            values = tf.where(is_nan, lowest, rows)
            return (
                tf.maximum(acc, tf.math.unsorted_segment_max(values, bags_c[k], num_bags + 1)),
                tf.maximum(kind, tf.math.unsorted_segment_max(entry_kind, bags_c[k], num_bags + 1)),
            )

        acc, kind = loop(
            max_step, (tf.fill(acc_shape, lowest), tf.fill(acc_shape, tf.constant(-1, acc_dtype)))
        )
        acc = tf.where(tf.equal(kind, 2), tf.constant(float("nan"), acc_dtype), acc)
        acc = tf.where(tf.equal(kind, 0), tf.constant(-float("inf"), acc_dtype), acc)
        acc = tf.where(kind < 0, tf.zeros([], acc_dtype), acc)  # bags without entries
    else:

        def sum_step(k, acc):
            weighted = rows_of(k) * weights_c[k][:, None]
            return (acc + tf.math.unsorted_segment_sum(weighted, bags_c[k], num_bags + 1),)

        (acc,) = loop(sum_step, (tf.zeros(acc_shape, acc_dtype),))
        if scale is not None:
            # A bag of scale 0 (zero denominator) gives +0 whatever its rows hold (0 * Inf).
            acc = tf.where(tf.equal(scale, 0)[:, None], tf.zeros([], acc_dtype), acc)
    # acc: [B + 1, D] in acc_dtype; row B (the dummy bag) is garbage.

    sparse_params_grad = not (xla or dense_grad)

    def backward(dy: tf.Tensor, weights_wanted: bool):
        dy_pad = tf.concat([tf.cast(dy, acc_dtype), tf.zeros(tf.stack([1, dim]), acc_dtype)], 0)
        if sparse_params_grad:
            unique_ids = tf.sort(tf.unique(tf.boolean_mask(ids, valid)).y)
            num_slots = tf.shape(unique_ids, out_type=tf.int64)[0]
            slots_c = chunked(
                tf.searchsorted(unique_ids, safe_ids, side="left", out_type=tf.int64),
                tf.constant(0, tf.int64),
            )
            targets_c, num_targets = slots_c, num_slots + 1
        else:
            # Invalid and padding entries (zero contributions) target no row: a segment id
            # of -1 is dropped, also when the table has no rows.
            targets_c = chunked(tf.where(valid, ids, -tf.ones_like(ids)), tf.constant(-1, tf.int64))
            num_targets = num_rows
        grad_shape = tf.stack([num_targets, tf.cast(dim, tf.int64)])

        if combiner == "max":
            # Pass 1: per (bag, dim), the first position whose value equals the max (is
            # NaN, for a NaN max).
            never = tf.cast(num_chunks * chunk, tf.int64)

            def argmax_step(k, first):
                rows, best = rows_of(k), tf.gather(acc, bags_c[k])
                hit = tf.equal(rows, best) | (tf.math.is_nan(rows) & tf.math.is_nan(best))
                pos = tf.where(hit, positions_of(k)[:, None], never)
                return (
                    tf.minimum(first, tf.math.unsorted_segment_min(pos, bags_c[k], num_bags + 1)),
                )

            (first,) = loop(argmax_step, (tf.fill(acc_shape, never),))

            # Pass 2: that entry gets dy.
            def max_grad_step(k, grad_acc):
                bags_k = bags_c[k]
                won = tf.equal(tf.gather(first, bags_k), positions_of(k)[:, None])
                contrib = tf.where(won, tf.gather(dy_pad, bags_k), tf.zeros([], acc_dtype))
                return (
                    grad_acc + tf.math.unsorted_segment_sum(contrib, targets_c[k], num_targets),
                )

            (grad_acc,) = loop(max_grad_step, (tf.zeros(grad_shape, acc_dtype),))
            weights_grad = None
        else:
            if weights_wanted:
                # d out_b / d w_j = (e_j - out_b) / W_b (mean), (e_j - w_j out_b / Q_b) / Q_b
                # (sqrtn), e_j (sum): only a per-bag dot <dy_b, out_b> is needed besides
                # the per-entry dot <dy_b, e_j>.
                dy_dot_out = tf.reduce_sum(dy_pad * acc, axis=1)  # [B + 1]
                if combiner == "sqrtn":
                    raw_c = chunked(raw_weights, tf.constant(0, acc_dtype))

            def sum_grad_step(k, grad_acc, *weight_grads):
                dy_rows = tf.gather(dy_pad, bags_c[k])  # [chunk, D]
                contrib = dy_rows * weights_c[k][:, None]
                grad_acc = grad_acc + tf.math.unsorted_segment_sum(
                    contrib, targets_c[k], num_targets
                )
                if not weights_wanted:
                    return (grad_acc,)
                dot = tf.reduce_sum(rows_of(k) * dy_rows, axis=1)  # [chunk]
                if combiner in ("mean", "sqrtn"):
                    bag_scale = tf.gather(scale, bags_c[k])
                    bag_dot_out = tf.gather(dy_dot_out, bags_c[k])
                    if combiner == "sqrtn":
                        bag_dot_out = raw_c[k] * bag_scale * bag_dot_out
                    dot = (dot - bag_dot_out) * bag_scale
                    # Zero for a bag of scale 0, whatever its rows hold (0 * Inf).
                    dot = tf.where(tf.equal(bag_scale, 0), tf.zeros_like(dot), dot)
                dot = tf.where(tf.equal(bags_c[k], dummy), tf.zeros_like(dot), dot)
                # Row k of the [stored_chunks, chunk] buffer (no TensorArray: under XLA on
                # GPUs its concat came back with the wrong length for half types).
                return grad_acc, tf.tensor_scatter_nd_update(
                    weight_grads[0], tf.reshape(k, [1, 1]), tf.cast(dot, dtype)[None, :]
                )

            state = (tf.zeros(grad_shape, acc_dtype),)
            if weights_wanted:
                state += (tf.zeros(chunked_shape, dtype),)
            results = loop(sum_grad_step, state)
            grad_acc = results[0]
            weights_grad = tf.reshape(results[1], [-1])[:nnz] if weights_wanted else None

        if sparse_params_grad:
            params_grad = tf.IndexedSlices(
                tf.cast(grad_acc[:-1], dtype), tf.cast(unique_ids, ids_dtype), params_shape
            )
        else:
            params_grad = tf.cast(grad_acc, dtype)
        return params_grad, weights_grad

    output = tf.cast(acc[:-1], dtype)
    return output, backward


def _composite_with_gradient(
    params: tf.Tensor,
    bags: _Bags,
    combiner: str,
    padding_id: int | None,
    dense_grad: bool,
    xla: bool,
) -> tf.Tensor:
    if bags.weights is None:

        @tf.custom_gradient
        def forward(params):
            output, backward = _composite(params, bags, combiner, padding_id, dense_grad, xla)
            return output, lambda dy: backward(dy, False)[0]

        return forward(params)

    @tf.custom_gradient
    def forward_weighted(params, weights):
        output, backward = _composite(
            params, bags._replace(weights=weights), combiner, padding_id, dense_grad, xla
        )
        return output, lambda dy: backward(dy, True)

    return forward_weighted(params, bags.weights)


# ----------------------------------------------------------------------------------------
# Public API.


def gather_reduce_sum(
    params,
    indices: IndicesLike,
    weights=None,
    combiner: str = "sum",
    padding_id: int | None = None,
    dense_grad: bool = False,
    implementation: str = "auto",
    name: str | None = None,
) -> tf.Tensor:
    """Looks up rows of `params` and combines them per bag (a fused EmbeddingBag).

    For each bag b, with entries j whose id is not `padding_id`:

    * `sum`:   `sum_j w_j * params[ids_j]`
    * `mean`:  `sum_j w_j * params[ids_j] / sum_j w_j` (the entry count when unweighted)
    * `sqrtn`: `sum_j w_j * params[ids_j] / sqrt(sum_j w_j**2)`
    * `max`:   the elementwise max of `params[ids_j]` (no weights)

    A bag without entries, or with a zero denominator (mean, sqrtn), gives +0.0 and zero
    gradients, whatever its rows hold (Inf and NaN included). Under `max` NaN wins, as
    in `tf.reduce_max` (-Inf and +Inf are ordinary values); elsewhere NaN and Inf
    propagate as in IEEE arithmetic. The gathered [nnz, D] rows are never materialised.

    Gradients: w.r.t. `params` a `tf.IndexedSlices` over the sorted unique ids of the
    batch, each row summed once (a dense [N, D] tensor with `dense_grad=True`, and always
    for the composite implementation under XLA); w.r.t. `weights` a tensor of their shape
    (flat values for ragged and sparse weights); none w.r.t. ids. For `max`, the first
    entry of a bag reaching the max of a column (its first NaN entry, if the column
    holds NaN) receives that column's gradient.

    Accuracy: sums accumulate in float32 (float64 for float64 tables). The CPU kernel
    adds a bag's terms in blocks of 256 entries whose sums are combined pairwise, so a
    bag's error is at most about (256 + log2(L / 256)) units in the last place of the
    sum of its terms' magnitudes, for a bag of L entries (a sequential sum's grows like
    L). The GPU kernel sums long bags in up to 1,024 slices combined in order; the
    composite in chunks, sequentially within each segment (both grow with L / chunk).

    Args:
      params: The [N, D] table: a tensor or a variable (`tf.Variable`, a Keras variable,
        or a mixed-precision autocast variable, read in its autocast dtype). float16,
        bfloat16, float32 or float64; half types accumulate in float32.
      indices: Row ids, int32 or int64, as a dense tensor [..., L] (output [..., D]; a
        vector [L] gives [D]), a `tf.RaggedTensor` [B, (L)] with ragged_rank 1 (output
        [B, D]) or a 2-D `tf.SparseTensor` [B, L] in any order (output [B, D], B =
        dense_shape[0]).
      weights: Optional per-entry weights with the structure of `indices` (dense of the
        same shape, ragged with the same row lengths, sparse with the same indices), cast
        to the dtype of `params`.
      combiner: "sum", "mean", "sqrtn" or "max".
      padding_id: Entries with this id contribute nothing (and are not counted by mean and
        sqrtn) and get no gradient. It need not lie in [0, N).
      dense_grad: Return the params gradient as a dense [N, D] tensor instead of
        `tf.IndexedSlices`.
      implementation: "custom_op" (the fused op from the compiled library), "composite"
        (plain TensorFlow ops, chunked; compiles under XLA and runs on TPU) or "auto": the
        composite inside an XLA-compiled function (`tf.function(jit_compile=True)`) or
        under a TPUStrategy / on a TPU device, the custom op otherwise.
      name: Optional name scope.

    Returns:
      The combined embeddings, dtype of `params`, shape [..., D] for dense ids and
      [B, D] for ragged and sparse ids.

    Raises:
      ValueError: For an unknown `combiner` or `implementation`, weights with `max`, or
        malformed `indices`/`weights` structures.
      tf.errors.InvalidArgumentError: For an id outside [0, N) that is not `padding_id`
        (`indices[17] = 9001 is not in [0, 4096)`, the position being the flat one;
        for sparse ids, in row-major order). Under XLA, the composite implementation
        cannot raise: it treats such ids like padding (they contribute zero and never
        read out of bounds), so checking ids is then the caller's responsibility.
      ImportError: When the custom op is selected and the op library cannot be loaded.

    Example:

    >>> import tensorflow as tf
    >>> import tf_ttemb
    >>> table = tf.constant([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    >>> ids = tf.ragged.constant([[0, 2], [], [1, 2]])
    >>> tf_ttemb.gather_reduce_sum(table, ids, combiner="mean").numpy()
    array([[3., 4.],
           [0., 0.],
           [4., 5.]], dtype=float32)
    >>> weights = tf.constant([[2.0, 0.5], [1.0, 1.0]])
    >>> tf_ttemb.gather_reduce_sum(table, tf.constant([[0, 1], [2, 2]]), weights,
    ...                            implementation="composite").numpy()
    array([[ 3.5,  6. ],
           [10. , 12. ]], dtype=float32)
    """
    padding_id = check_lookup_args(combiner, weights, padding_id)
    _check_choice("implementation", implementation, IMPLEMENTATIONS)
    with tf.name_scope(name or "gather_reduce_sum"):
        variable = _resource_variable(params)
        if variable is None:
            params = tf.convert_to_tensor(params)
        shape = tf.TensorShape(params.shape)
        dtype = tf.as_dtype(params.dtype)
        if shape.rank is not None and shape.rank != 2:
            raise ValueError(f"params must be a matrix [N, D], got shape {shape}")
        if dtype not in _VALUE_TYPES:
            raise TypeError(
                f"params must be float16, bfloat16, float32 or float64, got {dtype.name}"
            )
        xla = _in_xla_context() or _on_tpu(variable if variable is not None else params)
        bags = _to_csr(indices, weights, dtype, xla)
        if implementation == "auto":
            implementation = "composite" if xla else "custom_op"
        if implementation == "custom_op" and variable is not None:
            output = _custom_op_on_variable(variable, bags, combiner, padding_id, dense_grad)
        elif implementation == "custom_op":
            output = _custom_op(params, bags, combiner, padding_id, dense_grad)
        else:
            params = tf.convert_to_tensor(params)
            output = _composite_with_gradient(params, bags, combiner, padding_id, dense_grad, xla)
        if bags.batch_shape is not None:
            output = tf.reshape(
                output, tf.concat([bags.batch_shape, tf.shape(output, out_type=tf.int64)[1:]], 0)
            )
        output.set_shape(bags.static_batch_shape.concatenate(shape[1:]))
        return output


# ----------------------------------------------------------------------------------------
# Lookup whose backward pass updates the table in place (optimizer fused in).


def gather_reduce_sum_sparse_apply(
    params,
    indices: IndicesLike,
    weights=None,
    *,
    trigger,
    optimizer: str = "sgd",
    learning_rate=0.01,
    accumulator=None,
    epsilon: float = 1e-7,
    combiner: str = "sum",
    padding_id: int | None = None,
    name: str | None = None,
) -> tf.Tensor:
    """`gather_reduce_sum` whose backward pass applies an optimizer to the rows it read.

    The forward result is `gather_reduce_sum(params, indices, weights, combiner,
    padding_id)`. When a gradient is taken through it, op `GatherReduceSumSparseApply`
    reduces the params gradient of each distinct row read (as `gather_reduce_sum`'s
    gradient would, duplicates summed) and applies `optimizer` to that row of the
    `params` variable in place, so the [U, D] params gradient is never materialised
    (FBGEMM's fused table-batched optimizers and FBTT's `sparse=True` do the same). With
    `g` a row's summed gradient, `lr = learning_rate`, `eps = epsilon`:

    * `"sgd"`: `w -= lr * g`
    * `"rowwise_adagrad"`: `a += mean(g**2)`; `w -= lr * g / (sqrt(a) + eps)`, with one
      accumulator per row (`accumulator` of shape [N]), as
      `tf_ttemb.optimizers.RowWiseAdagrad`
    * `"adagrad"`: `a += g**2`; `w -= lr * g / (sqrt(a) + eps)` per element
      (`accumulator` of shape [N, D])

    A row whose denominator is 0 has a zero gradient and is left unchanged. Rows not read
    (and padding entries) are untouched. The weights gradient is computed from the rows
    as they were before the update and returned as usual; `params` gets no gradient.

    The backward pass runs only if the tape reaches it through a differentiable input:
    the weights, or `trigger`, any float tensor (typically the value of an empty
    trainable variable, as `ProductKeyMemory(values_optimizer=...)` uses). `trigger`'s
    gradient is zeros of its shape, data-dependent on the update, so a step that applies
    that gradient also runs the update. Each gradient computation through the result
    updates the table once (a persistent tape asked twice updates twice).

    The op has CPU and GPU kernels, and runs where `params` lives (`accumulator` must live
    on the same device). Both give the same numbers up to the order of the sums within
    a row (each device's order is fixed: bitwise deterministic). It has no XLA kernel
    and raises under XLA compilation.

    Args:
      params: The [N, D] table as a resource variable (`tf.Variable` or Keras variable),
        float16, bfloat16, float32 or float64; updated in place.
      indices: Row ids as for `gather_reduce_sum` (dense [..., L], ragged or sparse).
      weights: Optional per-entry weights with the structure of `indices`.
      trigger: A float tensor through which tapes reach the update (see above).
      optimizer: "sgd", "rowwise_adagrad" or "adagrad".
      learning_rate: Python float or scalar tensor.
      accumulator: The optimizer state variable for the two Adagrads ([N] or [N, D],
        float32 for float16/bfloat16/float32 params, float64 for float64), else None.
      epsilon: Adagrad's epsilon, added to `sqrt(a)`, >= 0.
      combiner: "sum", "mean", "sqrtn" or "max" (max takes no weights).
      padding_id: Entries with this id are skipped (no contribution, no update).
      name: Optional name scope.

    Returns:
      The combined embeddings, as `gather_reduce_sum` returns them.

    Raises:
      ValueError: For an unknown choice, `params` or `accumulator` not a resource
        variable, an accumulator missing (Adagrads) or given (SGD), weights with max,
        use under XLA compilation or under a `tf.distribute` strategy.
      tf.errors.InvalidArgumentError: For bad ids (as `gather_reduce_sum`), an
        accumulator of the wrong shape or dtype, or a non-finite learning rate or a
        negative epsilon (raised by the backward pass).

    Example:

    >>> import tensorflow as tf
    >>> import tf_ttemb
    >>> from tf_ttemb.ops.gather_reduce_sum import gather_reduce_sum_sparse_apply
    >>> table = tf.Variable(tf.ones([5, 2]))
    >>> trigger = tf.Variable(tf.zeros([0]))
    >>> with tf.GradientTape() as tape:
    ...     out = gather_reduce_sum_sparse_apply(
    ...         table, tf.constant([[0, 3], [3, 3]]), trigger=trigger, learning_rate=0.5)
    ...     loss = tf.reduce_sum(out)
    >>> tape.gradient(loss, trigger).shape  # runs the update
    TensorShape([0])
    >>> table[:, 0].numpy()  # row 0 read once, row 3 three times
    array([ 0.5,  1. ,  1. , -0.5,  1. ], dtype=float32)
    """
    _check_choice("optimizer", optimizer, ("sgd", "rowwise_adagrad", "adagrad"))
    padding_id = check_lookup_args(combiner, weights, padding_id)
    variable = _resource_variable(params)
    if variable is None:
        raise ValueError(
            "params must be a resource variable (tf.Variable or Keras variable) updated in "
            f"place, got {type(params).__name__}"
        )
    state = None
    if optimizer == "sgd":
        if accumulator is not None:
            raise ValueError("optimizer 'sgd' takes no accumulator, got one")
    else:
        state = None if accumulator is None else _resource_variable(accumulator)
        if state is None:
            raise ValueError(
                f"optimizer {optimizer!r} needs an accumulator resource variable, got "
                f"{type(accumulator).__name__}"
            )
    epsilon = float(epsilon)
    if not epsilon >= 0.0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
    if tf.distribute.has_strategy():
        # A replica would update its own copy of a mirrored table with its own gradient.
        raise ValueError(
            "gather_reduce_sum_sparse_apply does not support tf.distribute strategies "
            "(replicas would update their copies of params apart)"
        )
    if _in_xla_context():
        raise ValueError(
            "gather_reduce_sum_sparse_apply has no XLA kernel; call it outside "
            "jit_compile (or update the table with an optimizer from gather_reduce_sum's "
            "gradient)"
        )
    dtype = tf.as_dtype(variable.dtype)
    shape = tf.TensorShape(variable.shape)
    if shape.rank is not None and shape.rank != 2:
        raise ValueError(f"params must be a matrix [N, D], got shape {shape}")
    if dtype not in _VALUE_TYPES:
        raise TypeError(f"params must be float16, bfloat16, float32 or float64, got {dtype.name}")
    acc_dtype = tf.float64 if dtype == tf.float64 else tf.float32
    lib = _loader.load_op_library()
    with tf.name_scope(name or "gather_reduce_sum_sparse_apply"):
        bags = _to_csr(indices, weights, dtype, xla=False)
        has_weights = bags.weights is not None
        attrs = _op_attrs(combiner, has_weights, padding_id)
        ids, row_splits = bags.ids, bags.row_splits
        rate = tf.cast(tf.convert_to_tensor(learning_rate, dtype_hint=acc_dtype), acc_dtype)
        eps = tf.constant(epsilon, acc_dtype)
        trigger = tf.convert_to_tensor(trigger)
        inputs = [bags.weights] if has_weights else []
        inputs.append(trigger)

        @tf.custom_gradient
        def lookup(*inputs):
            flat_weights = inputs[0] if has_weights else tf.zeros([0], dtype)
            output, argmax = lib.tf_ttemb_resource_gather_reduce_sum(
                variable.handle, ids, row_splits, tf.stop_gradient(flat_weights), **attrs
            )

            def grad(dy, variables=None):
                weights_grad = lib.tf_ttemb_gather_reduce_sum_sparse_apply(
                    grad=tf.cast(dy, dtype),
                    params=variable.handle,
                    indices=ids,
                    row_splits=row_splits,
                    weights=flat_weights,
                    output=output,
                    argmax=argmax,
                    learning_rate=rate,
                    epsilon=eps,
                    accumulators=[] if state is None else [state.handle],
                    optimizer=optimizer,
                    **attrs,
                )
                # The trigger's zero gradient is read from the updated variable: a data
                # dependency, so the update runs wherever that gradient is used (Grappler
                # may drop an update reached through control dependencies only).
                with tf.control_dependencies([weights_grad]):
                    stamp = variable.sparse_read(tf.zeros([0], tf.int32))  # [0, D]
                trigger_grad = tf.zeros_like(trigger) + tf.reduce_sum(
                    tf.cast(stamp, trigger.dtype)
                )
                grads = ([weights_grad] if has_weights else []) + [trigger_grad]
                return grads, [None] * len(variables or [])

            return output, grad

        output = lookup(*inputs)
        if bags.batch_shape is not None:
            output = tf.reshape(
                output, tf.concat([bags.batch_shape, tf.shape(output, out_type=tf.int64)[1:]], 0)
            )
        output.set_shape(bags.static_batch_shape.concatenate(shape[1:]))
        return output
