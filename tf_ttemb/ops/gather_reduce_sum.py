"""`gather_reduce_sum`: a fused EmbeddingBag for TensorFlow.

Two implementations compute the same numbers and gradients:

* `custom_op`: the `TfTtemb>GatherReduceSum` op family from `tf_ttemb/_tf_ttemb_ops.so`
  (`tf_ttemb/ops/_custom_op.py`, which also registers its gradients; the op contract is
  `docs/gather_reduce_sum_contract.md`).
* `composite`: plain TensorFlow ops that also compile under XLA and run on TPU
  (`tf_ttemb/ops/composite.py`).

Both take bags in CSR form (`tf_ttemb/ops/_bags.py`): flat ids [nnz], int64 row_splits
[B + 1] and optional flat weights [nnz]. `gather_reduce_sum` converts dense, ragged and
sparse ids to that form and shapes the result back. The lookup whose backward pass
updates the table in place is `tf_ttemb.ops.sparse_apply.gather_reduce_sum_sparse_apply`
(also importable from here).
"""

from __future__ import annotations

import tensorflow as tf

from tf_ttemb.ops import _bags, _common, _custom_op, composite
from tf_ttemb.ops.sparse_apply import gather_reduce_sum_sparse_apply

__all__ = ["gather_reduce_sum", "gather_reduce_sum_sparse_apply"]


def gather_reduce_sum(
    params,
    indices: _common.IndicesLike,
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
    key = _eager_key(params, indices, weights, combiner, padding_id, dense_grad, implementation)
    forward = _EAGER_FORWARDS.get(key) if key is not None else None
    if forward is not None:
        return forward(params, indices, weights)
    padding_id = _common.check_lookup_args(combiner, weights, padding_id, implementation)
    with tf.name_scope(name or "gather_reduce_sum"):
        variable = _common.resource_variable(params)
        if variable is None:
            params = tf.convert_to_tensor(params)
        shape = tf.TensorShape(params.shape)
        dtype = tf.as_dtype(params.dtype)
        _common.check_table(shape, dtype)
        xla = _common.in_xla_context() or _common.on_tpu(
            variable if variable is not None else params
        )
        if implementation == "auto":
            implementation = "composite" if xla else "custom_op"
        # The ops read dense ids and weights flat: no reshape before them.
        bags = _bags.to_csr(indices, weights, dtype, xla, flat=implementation == "composite")
        if implementation == "custom_op" and variable is not None:
            output = _custom_op.custom_op_on_variable(
                variable, bags, combiner, padding_id, dense_grad
            )
        elif implementation == "custom_op":
            output = _custom_op.custom_op(params, bags, combiner, padding_id, dense_grad)
            if key is not None:
                _remember(key, params, indices, weights, bags, combiner, padding_id)
        else:
            params = tf.convert_to_tensor(params)
            output = composite.composite_with_gradient(
                params, bags, combiner, padding_id, dense_grad, xla
            )
        return _bags.shaped_output(output, bags, shape[1:])


# Eager lookups of a table tensor by dense [B, L] or ragged [B, (L)] ids: a call repeats the
# decisions of the call before it with the same arguments, dtypes and devices (the argument
# checks, the checks of the table and the ids, the CSR form, the op's attrs and, for dense
# ids of the same shape, row_splits). Each is worth a few microseconds of Python, 50 µs
# together on this package's 2-core machine, as much as the op's own work on a small
# batch; after a large lookup has flushed the caches, every line of Python costs more
# again. The first such call runs the whole path above, which validates; it leaves the
# forward it chose here, and later calls with the same key go straight to the op. What the
# key leaves out is checked per call by the op (the ids' values, ragged row_splits) or
# keeps a call off this path (variables, sparse ids, ragged weights on row_splits of their
# own, dense gradients, the composite, graphs). A dense forward holds its row_splits: at
# most 64 forwards are kept, dense ones of up to 65,536 bags (512 KiB); a larger batch's
# lookup is long enough for the Python to be no matter.
_EAGER_FORWARDS: dict = {}
_EAGER_FORWARDS_MAX = 64
_EAGER_FORWARD_MAX_BAGS = 1 << 16
# The type of eager tensors (creating one to ask would start TensorFlow's runtime at import,
# after which its thread pools can no longer be configured). Without it nothing is kept.
_EAGER_TENSOR = getattr(tf.__internal__, "EagerTensor", None)


def _eager_key(params, indices, weights, combiner, padding_id, dense_grad, implementation):
    """The memo key of an eager call with a table tensor and dense 2-D or ragged
    (ragged_rank 1) ids, weights of their structure or none, a sparse gradient and not
    the composite; None for any other call. The arguments are taken as given (the key of
    a call the full path rejects is never stored), so they must be of exact types whose
    equality is their meaning."""
    if (
        _EAGER_TENSOR is None
        or dense_grad is not False
        or type(combiner) is not str
        or type(implementation) is not str
        or implementation == "composite"
        or (padding_id is not None and type(padding_id) is not int)
        or type(params) is not _EAGER_TENSOR
        or not tf.executing_eagerly()
    ):
        return None
    table_key = (params.shape, params.dtype, params.device, combiner, padding_id, implementation)
    if type(indices) is _EAGER_TENSOR:
        if indices.shape.rank != 2 or (weights is not None and type(weights) is not _EAGER_TENSOR):
            return None
        weights_key = None if weights is None else (weights.shape, weights.dtype, weights.device)
        return (*table_key, "dense", indices.shape, indices.dtype, indices.device, weights_key)
    if type(indices) is not tf.RaggedTensor or indices.ragged_rank != 1:
        return None
    values, splits = indices.values, indices.row_splits
    if type(values) is not _EAGER_TENSOR or values.shape.rank != 1:
        return None
    ids_key = ("ragged", values.dtype, values.device, splits.dtype, splits.device)
    if weights is None:
        return (*table_key, *ids_key, None)
    if (
        type(weights) is not tf.RaggedTensor
        or weights.row_splits is not splits  # the one form whose lengths need no check
        or weights.ragged_rank != 1
        or type(weights.values) is not _EAGER_TENSOR
        or weights.values.shape.rank != 1
    ):
        return None
    return (*table_key, *ids_key, (weights.values.dtype, weights.values.device))


def eager_forward_keys() -> list:
    """The keys of the remembered eager forwards (for tests)."""
    return list(_EAGER_FORWARDS)


def _remember(key: tuple, params, indices, weights, bags: _bags.Bags, combiner, padding_id):
    """Keeps the forward of a call with memo key `key` that ran the custom op on `bags`,
    if the ops ran on the caller's tensors as they are (no cast, no reshape)."""
    ragged = isinstance(indices, tf.RaggedTensor)
    if ragged:
        as_given = (
            bags.ids is indices.values
            and bags.row_splits is indices.row_splits
            and (weights is None or bags.weights is weights.values)
        )
    else:
        as_given = (
            bags.ids is indices
            and bags.weights is weights
            and bags.batch_shape is None
            and bags.row_splits.shape[0] <= _EAGER_FORWARD_MAX_BAGS + 1
        )
    if not as_given:
        return
    forward = _custom_op.bound_forward(params, bags, combiner, padding_id)
    row_splits = bags.row_splits

    def kept(params, indices, weights):
        if not ragged:
            return forward(params, indices, row_splits, weights)
        flat_weights = None if weights is None else weights.values
        return forward(params, indices.values, indices.row_splits, flat_weights)

    if len(_EAGER_FORWARDS) >= _EAGER_FORWARDS_MAX:
        _EAGER_FORWARDS.clear()
    _EAGER_FORWARDS[key] = kept
