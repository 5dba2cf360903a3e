"""Row-quantised embedding tables and their lookup, in plain TensorFlow ops.

A table [N, D] is stored as `codes` (int8 with a float32 scale and bias per row, or
float16 with neither); a row is dequantised as `codes[i] * scale[i] + bias[i]` (int8)
or `float32(codes[i])` (float16). `quantized_gather_reduce_sum` dequantises each
distinct id of a batch once and combines the rows with the composite implementation of
`gather_reduce_sum` (chunked, never the [nnz, D] gathered rows), so it needs no op
library; `tf_ttemb.export_for_serving(..., quantize=...)` uses it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

from tf_ttemb import _args
from tf_ttemb.ops import _bags, _common, composite

MODES = ("int8", "float16")

# Rows quantised per numpy call, to bound the float64 temporaries of `quantize_rows`.
_QUANTIZE_CHUNK_ROWS = 65_536


class QuantizedRows(NamedTuple):
    """A row-quantised table: numpy arrays or tensors/variables of these shapes."""

    codes: Any  # [N, D] int8 or float16
    scale: Any  # [N] float32 (int8), else None
    bias: Any  # [N] float32 (int8), else None

    @property
    def nbytes(self) -> int:
        """Bytes of the codes, scales and biases."""
        parts = [p for p in self if p is not None]
        return int(sum(np.prod(p.shape) * tf.as_dtype(p.dtype).size for p in parts))


def quantize_rows(table: Any, mode: str) -> QuantizedRows:
    """Quantises each row of a [N, D] float table (numpy arrays in the result).

    * `"int8"`: codes `q` in [-128, 127] with `scale = (max - min) / 255` and
      `bias = min + 128 * scale` per row (float32), so that `q * scale + bias` spans
      [min, max] of the row in 256 steps: the error of an element is at most
      `scale / 2` plus float32 rounding. A constant row has scale 0 and is exact.
      Non-finite values are refused.
    * `"float16"`: the table cast to float16 (round to nearest); `scale` and `bias`
      are None.

    Args:
      table: [N, D] array, tensor or variable (float16, bfloat16, float32 or float64).
      mode: "int8" or "float16".

    Returns:
      The `QuantizedRows`, numpy arrays.

    Raises:
      ValueError: For an unknown mode, a table that is not a matrix, or (int8)
        non-finite values.

    Example:

    >>> import numpy as np
    >>> from tf_ttemb.ops.quantized import quantize_rows
    >>> q = quantize_rows(np.array([[0.0, 255.0, 100.0], [2.0, 2.0, 2.0]]), "int8")
    >>> q.codes
    array([[-128,  127,  -28],
           [   0,    0,    0]], dtype=int8)
    >>> q.scale, q.bias
    (array([1., 0.], dtype=float32), array([128.,   2.], dtype=float32))
    >>> (q.codes * q.scale[:, None] + q.bias[:, None]).tolist()
    [[0.0, 255.0, 100.0], [2.0, 2.0, 2.0]]
    """
    _args.check_choice("mode", mode, MODES)
    values = table.numpy() if hasattr(table, "numpy") else np.asarray(table)
    if values.ndim != 2:
        raise ValueError(f"table must be a matrix [N, D], got shape {list(values.shape)}")
    if mode == "float16":
        return QuantizedRows(values.astype(np.float16), None, None)
    rows = values.shape[0]
    codes = np.empty(values.shape, np.int8)
    scale = np.empty([rows], np.float32)
    bias = np.empty([rows], np.float32)
    for start in range(0, rows, _QUANTIZE_CHUNK_ROWS):
        part = values[start : start + _QUANTIZE_CHUNK_ROWS].astype(np.float64)
        if not np.all(np.isfinite(part)):
            bad = start + int(np.argwhere(~np.isfinite(part))[0, 0])
            raise ValueError(f"int8 quantisation needs finite values, row {bad} has another")
        low = part.min(axis=1) if part.shape[1] else np.zeros(part.shape[0])
        high = part.max(axis=1) if part.shape[1] else np.zeros(part.shape[0])
        step = ((high - low) / 255.0).astype(np.float32)
        offset = (low + 128.0 * step.astype(np.float64)).astype(np.float32)
        safe = np.where(step > 0, step, 1.0).astype(np.float64)
        q = np.rint((part - offset[:, None].astype(np.float64)) / safe[:, None])
        codes[start : start + part.shape[0]] = np.clip(q, -128, 127).astype(np.int8)
        scale[start : start + part.shape[0]] = step
        bias[start : start + part.shape[0]] = offset
    return QuantizedRows(codes, scale, bias)


def dequantize_rows(table: QuantizedRows, ids: tf.Tensor) -> tf.Tensor:
    """The float32 rows [n, D] of `ids` [n] (in [0, N); not checked here)."""
    rows = tf.cast(tf.gather(table.codes, ids), tf.float32)
    if table.scale is None:
        return rows
    return rows * tf.gather(table.scale, ids)[:, None] + tf.gather(table.bias, ids)[:, None]


def quantized_gather_reduce_sum(
    table: QuantizedRows,
    indices: _common.IndicesLike,
    weights: Any = None,
    combiner: str = "sum",
    padding_id: int | None = None,
    name: str | None = None,
) -> tf.Tensor:
    """`gather_reduce_sum` over a row-quantised table, in plain TensorFlow ops.

    The result equals `tf_ttemb.gather_reduce_sum(dequantised_table, indices, weights,
    combiner, padding_id)` computed in float32: each distinct id of the batch is
    dequantised once (`dequantize_rows`), and the rows are combined by the composite
    implementation. No gradient is defined for the codes (inference only).

    Args:
      table: A `QuantizedRows` of tensors or variables ([N, D] codes, [N] scale and
        bias for int8).
      indices: Row ids as for `gather_reduce_sum`: dense [..., L], a `tf.RaggedTensor`
        [B, (L)] or a 2-D `tf.SparseTensor`.
      weights: Optional per-entry weights with the structure of `indices`.
      combiner: "sum", "mean", "sqrtn" or "max" (max takes no weights).
      padding_id: Entries with this id contribute nothing and are not counted.
      name: Optional name scope.

    Returns:
      float32 [..., D] for dense ids, [B, D] for ragged and sparse ids.

    Raises:
      tf.errors.InvalidArgumentError: For an id outside [0, N) that is not
        `padding_id`, with `gather_reduce_sum`'s message (`indices[17] = 9001 is not in
        [0, 4096)`, the flat position); eagerly and in graphs (never clamped).

    Example:

    >>> import numpy as np
    >>> import tensorflow as tf
    >>> from tf_ttemb.ops.quantized import quantize_rows, quantized_gather_reduce_sum
    >>> # Rows spanning 255 (scale 1) and a constant row: exact in int8.
    >>> table = quantize_rows(np.array([[0.0, 255.0], [10.0, 10.0], [-100.0, 155.0]]), "int8")
    >>> ids = tf.ragged.constant([[0, 1], [], [2, -1]])
    >>> quantized_gather_reduce_sum(table, ids, combiner="mean", padding_id=-1).numpy()
    array([[   5. ,  132.5],
           [   0. ,    0. ],
           [-100. ,  155. ]], dtype=float32)
    """
    padding_id = _common.check_lookup_args(combiner, weights, padding_id)
    with tf.name_scope(name or "quantized_gather_reduce_sum"):
        codes = table.codes
        shape = tf.TensorShape(codes.shape)
        if shape.rank is not None and shape.rank != 2:
            raise ValueError(f"codes must be a matrix [N, D], got shape {shape}")
        bags = _bags.to_csr(indices, weights, tf.float32, xla=False)
        ids = tf.cast(bags.ids, tf.int64)
        num_rows = tf.shape(codes, out_type=tf.int64)[0]
        with tf.control_dependencies(_bags.bounds_check(ids, num_rows, padding_id)):
            ids = tf.identity(ids)
        valid = (ids >= 0) & (ids < num_rows)
        if padding_id is not None:
            valid &= tf.not_equal(ids, padding_id)
        unique_ids, slots = tf.unique(tf.where(valid, ids, tf.zeros_like(ids)), tf.int64)
        rows = dequantize_rows(table, unique_ids)  # [U, D], U = 0 when there are no entries
        slots = tf.where(valid, slots, tf.constant(-1, tf.int64))
        output = composite.composite_with_gradient(
            rows, bags._replace(ids=slots), combiner, -1, dense_grad=True, xla=False
        )
        if bags.batch_shape is not None:
            output = tf.reshape(
                output,
                tf.concat([bags.batch_shape, tf.shape(output, out_type=tf.int64)[1:]], 0),
            )
        output.set_shape(bags.static_batch_shape.concatenate(shape[1:]))
        return output
