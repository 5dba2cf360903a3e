"""The base of the row-sparse optimizers: what `LazyAdam` and `RowWiseAdagrad` share.

Keras 3 hands an optimizer's `update_step` whatever gradient `apply` received, a
`tf.IndexedSlices` included, but several of the standard options around it would densify
such a gradient or cannot take one at all. This base keeps the gradient sparse from
`apply` to `update_step` and gives the options a row-sparse meaning:

* `loss_scale_factor`: Keras divides each gradient by it with `/`, which `IndexedSlices`
  does not support; here the values are divided and the gradient stays sparse.
* `clipnorm`, `clipvalue`, `global_clipnorm`: a sparse gradient is first deduplicated
  (repeated rows summed), so the norms and clipped values are those of the dense gradient
  it stands for, then clipped without densifying (Keras' `global_clipnorm` would
  densify it).
* `weight_decay`: applied inside `update_step` (not by Keras to every variable before
  it): to every row for a dense gradient, exactly as Keras does, and only to the rows of
  a sparse gradient.
* `gradient_accumulation_steps`: Keras accumulates into a dense buffer, which would turn a
  sparse gradient into an update of every row, so a sparse gradient raises a
  `ValueError`; dense gradients accumulate as in Keras.
* `use_ema`: as in Keras (a dense moving average of every variable, updated every step).

Under `tf.distribute` (e.g. `MirroredStrategy`), Keras sums the replicas' gradients before
`update_step`: sparse ones are concatenated, so rows that several replicas touched repeat
and are summed here like any repeated row; clipping applies to each replica's gradients
before they are summed, as in Keras.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from tf_ttemb.ops import _common


def compute_dtype(variable: Any) -> tf.DType:
    """The dtype updates are computed (and optimizer state kept) in: float32 for halves."""
    return _common.accumulation_dtype(tf.as_dtype(variable.dtype))


def as_dtype(value: Any, dtype: tf.DType) -> tf.Tensor:
    """`value` in `dtype`: a Python number directly (`tf.cast` would round it to float32 first)."""
    if isinstance(value, numbers.Number):
        return tf.constant(value, dtype)
    return tf.cast(value, dtype)


def deduplicate(gradient: tf.IndexedSlices, dtype: tf.DType) -> tuple[tf.Tensor, tf.Tensor]:
    """Sums the rows of `gradient` that share an index.

    Indices that are already strictly increasing (as in the gradients of
    `tf_ttemb.gather_reduce_sum`) are used as they are, after an O(U) check.

    Returns:
      `(rows, values)`: the distinct indices [U] and their summed values [U, ...] in
      `dtype`.
    """
    indices = gradient.indices
    values = tf.cast(gradient.values, dtype)

    def summed() -> tuple[tf.Tensor, tf.Tensor]:
        rows, position = tf.unique(indices)
        return rows, tf.math.unsorted_segment_sum(values, position, tf.shape(rows)[0])

    strictly_increasing = tf.reduce_all(indices[1:] > indices[:-1])
    return tf.cond(strictly_increasing, lambda: (indices, values), summed)


def row_shaped(per_row: tf.Tensor, rank: int) -> tf.Tensor:
    """Reshapes [U] to [U, 1, ..., 1] so it broadcasts against rows of a rank-`rank` variable."""
    if rank <= 1:
        return per_row
    return tf.reshape(per_row, tf.concat([tf.shape(per_row), tf.ones([rank - 1], tf.int32)], 0))


class _DivisibleSlices:
    """Carries an `IndexedSlices` gradient through Keras' `gradient / loss_scale_factor`."""

    def __init__(self, slices: tf.IndexedSlices) -> None:
        self.slices = slices

    def __truediv__(self, scale: Any) -> tf.IndexedSlices:
        values = self.slices.values
        return tf.IndexedSlices(
            values / as_dtype(scale, values.dtype), self.slices.indices, self.slices.dense_shape
        )


def check_unit_interval(name: str, value: Any) -> float:
    """`value` as a float in [0, 1), else a ValueError quoting it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < 1:
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
    return float(value)


def check_non_negative(name: str, value: Any) -> float:
    """`value` as a float >= 0, else a ValueError quoting it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0:
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    return float(value)


class SparseOptimizer(keras.optimizers.Optimizer):
    """A Keras 3 optimizer whose `update_step` receives `tf.IndexedSlices` gradients intact.

    Subclasses implement `build`, `_sparse_update(rows, values, variable, lr, decay)` and
    `_dense_update(gradient, variable, lr, decay)`; `decay` is `weight_decay` in the
    compute dtype, or None where no weight decay applies to the variable (a row `w` then
    decays by `w * decay * lr`, Keras' expression).
    """

    def __init__(self, **kwargs: Any) -> None:
        _common.check_keras_backend(type(self).__name__, keras.backend.backend())
        super().__init__(**kwargs)

    # ----------------------------------------------------------------------------------
    # State.

    def _add_state(
        self, reference: Any, suffix: str, shape: Sequence[int], dtype: Any, initializer: Any
    ) -> keras.Variable:
        """A state variable of any shape, named and placed after `reference`."""
        if hasattr(reference, "path"):
            base = reference.path.replace("/", "_")
        else:
            base = str(reference.name).replace("/", "_").replace(":", "_")
        colocate_with = reference.value if isinstance(reference, keras.Variable) else reference
        with tf.distribute.get_strategy().extended.colocate_vars_with(colocate_with):
            return self.add_variable(
                shape=tuple(shape),
                initializer=initializer,
                dtype=dtype,
                name=f"{base}_{suffix}",
            )

    # ----------------------------------------------------------------------------------
    # Keras hooks.

    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None):
        """Applies `grads` like `keras.optimizers.Optimizer.apply`, keeping sparse ones sparse."""
        grads = list(grads)
        if any(isinstance(g, tf.IndexedSlices) for g in grads):
            if self.gradient_accumulation_steps:
                variables = (
                    list(trainable_variables)
                    if trainable_variables is not None
                    else self._trainable_variables
                )
                names = [
                    getattr(v, "path", v.name)
                    for g, v in zip(grads, variables)
                    if isinstance(g, tf.IndexedSlices)
                ]
                raise ValueError(
                    f"{type(self).__name__} got tf.IndexedSlices gradients (for "
                    f"{', '.join(map(repr, names))}) with gradient_accumulation_steps="
                    f"{self.gradient_accumulation_steps}: Keras accumulates gradients in a "
                    "dense buffer of each variable's shape, which would update every row. "
                    "Use gradient_accumulation_steps=None (e.g. a larger batch) or dense "
                    "gradients (EmbeddingBag(dense_grad=True))."
                )
            if self.loss_scale_factor is not None:
                grads = [
                    _DivisibleSlices(g) if isinstance(g, tf.IndexedSlices) else g for g in grads
                ]
        return super().apply(grads, trainable_variables)

    def _clip_gradients(self, grads: list[Any]) -> list[Any]:
        clipping = any(
            value is not None and value > 0
            for value in (self.clipnorm, self.clipvalue, self.global_clipnorm)
        )
        if not clipping or not any(isinstance(g, tf.IndexedSlices) for g in grads):
            return super()._clip_gradients(grads)
        # Clip the dense gradient each sparse one stands for: sum repeated rows first.
        grads = [self._deduplicated(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        if self.clipnorm is not None and self.clipnorm > 0:
            return [None if g is None else tf.clip_by_norm(g, self.clipnorm) for g in grads]
        if self.clipvalue is not None and self.clipvalue > 0:
            return [None if g is None else _map_values(g, self._clip_value) for g in grads]
        present = [_values(g) for g in grads if g is not None]
        norm_dtype = tf.float64 if any(x.dtype == tf.float64 for x in present) else tf.float32
        norm = tf.sqrt(
            tf.add_n([tf.reduce_sum(tf.square(tf.cast(x, norm_dtype))) for x in present])
        )
        clip = tf.constant(self.global_clipnorm, norm_dtype)
        # clip / max(norm, clip); a non-finite norm gives NaN, as in Keras.
        scale = clip * tf.minimum(1.0 / norm, 1.0 / clip) + (norm - norm)
        return [
            None if g is None else _map_values(g, lambda x: x * tf.cast(scale, x.dtype))
            for g in grads
        ]

    def _clip_value(self, x: tf.Tensor) -> tf.Tensor:
        return tf.clip_by_value(x, -self.clipvalue, self.clipvalue)

    def _deduplicated(self, gradient: tf.IndexedSlices) -> tf.IndexedSlices:
        rows, values = deduplicate(gradient, gradient.values.dtype)
        return tf.IndexedSlices(values, rows, gradient.dense_shape)

    def _apply_weight_decay(self, variables: Any) -> None:
        # Applied in update_step instead, to the rows the gradient touches (all of them for
        # a dense gradient).
        return None

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        """Updates `variable` from `gradient`: only its rows for a `tf.IndexedSlices`."""
        dtype = compute_dtype(variable)
        lr = tf.cast(learning_rate, dtype)
        decay = None
        if self.weight_decay is not None and self._use_weight_decay(variable):
            decay = as_dtype(self.weight_decay, dtype)
        if isinstance(gradient, tf.IndexedSlices):
            rows, values = deduplicate(gradient, dtype)
            self._sparse_update(rows, values, variable, lr, decay)
        else:
            self._dense_update(tf.cast(gradient, dtype), variable, lr, decay)

    def _sparse_update(
        self,
        rows: tf.Tensor,
        values: tf.Tensor,
        variable: Any,
        lr: tf.Tensor,
        decay: tf.Tensor | None,
    ) -> None:
        raise NotImplementedError

    def _dense_update(
        self, gradient: tf.Tensor, variable: Any, lr: tf.Tensor, decay: tf.Tensor | None
    ) -> None:
        raise NotImplementedError

    # ----------------------------------------------------------------------------------
    # Helpers for subclasses.

    @staticmethod
    def _read_rows(state: Any, rows: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
        """Rows of a variable (Keras or TF), read in place (no copy of the whole variable).

        Through the handle: inside `tf.distribute` updates it is the local copy's, where
        `tf.gather` on a distributed variable would first read the whole of it.
        """
        variable = state.value if isinstance(state, keras.Variable) else state
        values = tf.raw_ops.ResourceGather(
            resource=variable.handle, indices=rows, dtype=variable.dtype
        )
        return tf.cast(values, dtype)

    def _write_rows(self, state: Any, rows: tf.Tensor, values: tf.Tensor) -> None:
        self.assign(state, tf.IndexedSlices(values, rows))

    def _step_rows(
        self,
        variable: Any,
        rows: tf.Tensor,
        delta: tf.Tensor,
        lr: tf.Tensor,
        decay: tf.Tensor | None,
    ) -> None:
        """w[rows] = w[rows] - w[rows] * decay * lr - delta (Keras' order: decay first).

        Read, computed and written back: faster on CPU than a ResourceScatterSub.
        """
        w = self._read_rows(variable, rows, delta.dtype)
        if decay is not None:
            w = w - w * decay * lr
        self._write_rows(variable, rows, w - delta)


def _values(gradient: Any) -> tf.Tensor:
    return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


def _map_values(gradient: Any, fn: Any) -> Any:
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(fn(gradient.values), gradient.indices, gradient.dense_shape)
    return fn(gradient)
