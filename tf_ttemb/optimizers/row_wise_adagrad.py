"""RowWiseAdagrad: Adagrad with one accumulator per row of a variable."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from tf_ttemb.optimizers import _sparse_optimizer as _base


def _row_mean_square(gradient: tf.Tensor, rank: int) -> tf.Tensor:
    """mean(g**2) over every axis but the first (elementwise for rank <= 1)."""
    square = tf.square(gradient)
    if rank <= 1:
        return square
    return tf.reduce_mean(square, axis=list(range(1, rank)))


@keras.saving.register_keras_serializable(package="tf_ttemb")
class RowWiseAdagrad(_base.SparseOptimizer):
    """Adagrad with one accumulator per row: N floats of state for an [N, D] table, not N·D.

    The row-wise Adagrad that FBGEMM trains embedding tables with. Each row `r` of a
    variable keeps one accumulator `a[r]`, the running sum of the row's mean squared
    gradient; for the row's (summed) gradient `g` [D]::

        a[r] = a[r] + mean(g**2)
        w[r] = w[r] - lr * g / (sqrt(a[r]) + epsilon)

    (the same form as the fused Adagrad of `TTEmbeddingBag(sparse=True)`: `epsilon` outside
    the square root). All elements of a row share one adaptive step size, which for
    embedding rows loses little against per-element Adagrad and saves a factor D of state.

    For a `tf.IndexedSlices` gradient, repeated rows are summed first and only the
    touched rows and their accumulators change (every other row is left bitwise as it
    was), at a cost proportional to the touched rows. A dense gradient updates every row
    by the same rule (a row with a zero gradient keeps its value and accumulator).

    Rows are slices along the first axis: for a rank-1 variable (a bias) each element is a
    row and this is ordinary per-element Adagrad (with `epsilon` outside the root); a
    scalar variable has one accumulator. For rank > 2 the mean runs over all the axes
    after the first. Accumulators are float32 for float16 and bfloat16 variables (where the
    update is also computed), else in the variable's dtype.

    The other standard Keras arguments behave as for `tf_ttemb.optimizers.LazyAdam`:
    `weight_decay` (decoupled, `w -= w * weight_decay * lr`) decays only the touched rows
    of a sparse gradient and every row of a dense one; clipping applies to the
    deduplicated gradient without densifying it; `loss_scale_factor`, `LossScaleOptimizer`
    and `use_ema` work as in Keras; `gradient_accumulation_steps` raises a `ValueError` for
    a sparse gradient.

    Args:
      learning_rate: A float, a `keras.optimizers.schedules.LearningRateSchedule` or a
        callable taking no arguments.
      initial_accumulator_value: Starting value of every accumulator, >= 0.
      epsilon: Added to `sqrt(a)` in the denominator, >= 0; `epsilon` and
        `initial_accumulator_value` cannot both be 0 (a row whose first gradient is all
        zeros would divide 0 by 0).
      **kwargs: The base `keras.optimizers.Optimizer` arguments (`name`, `weight_decay`,
        `clipnorm`, `clipvalue`, `global_clipnorm`, `use_ema`, `ema_momentum`,
        `ema_overwrite_frequency`, `loss_scale_factor`, `gradient_accumulation_steps`).

    Example:

    >>> import tensorflow as tf
    >>> import tf_ttemb
    >>> table = tf.Variable(tf.ones([1000, 8]))
    >>> optimizer = tf_ttemb.optimizers.RowWiseAdagrad(learning_rate=0.1)
    >>> with tf.GradientTape() as tape:
    ...     loss = tf.reduce_sum(tf_ttemb.gather_reduce_sum(table, tf.constant([[3, 7, 7]])))
    >>> optimizer.apply(tape.gradient(loss, [table]), [table])
    >>> [round(float(table[r, 0]), 4) for r in (0, 3, 7)]  # rows 3 and 7 moved
    [1.0, 0.9, 0.9]
    >>> [tuple(v.shape) for v in optimizer.variables[2:]]  # one accumulator per row
    [(1000,)]
    """

    def __init__(
        self,
        learning_rate: Any = 0.01,
        initial_accumulator_value: float = 0.0,
        epsilon: float = 1e-7,
        **kwargs: Any,
    ) -> None:
        initial_accumulator_value = _base.check_non_negative(
            "initial_accumulator_value", initial_accumulator_value
        )
        epsilon = _base.check_non_negative("epsilon", epsilon)
        if epsilon == 0 and initial_accumulator_value == 0:
            raise ValueError(
                "epsilon and initial_accumulator_value cannot both be 0 (a row whose first "
                "gradient is all zeros would divide 0 by 0), got epsilon=0.0 and "
                "initial_accumulator_value=0.0"
            )
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.initial_accumulator_value = initial_accumulator_value
        self.epsilon = epsilon

    def build(self, var_list: list[Any]) -> None:
        """Creates one `accumulator` of shape [N] per variable of shape [N, ...] ([] for a
        scalar)."""
        if self.built:
            return
        super().build(var_list)
        self._accumulators: list[keras.Variable | None] = []
        value = self.initial_accumulator_value

        def initializer(shape: Any, dtype: Any = None) -> tf.Tensor:
            # The value in the accumulator's dtype (Keras' Constant rounds it to float32).
            return tf.fill(shape, tf.constant(value, dtype))

        for variable in var_list:
            if getattr(variable, "overwrite_with_gradient", False):
                self._accumulators.append(None)
                continue
            self._accumulators.append(
                self._add_state(
                    variable,
                    "accumulator",
                    tuple(variable.shape)[:1],
                    _base.compute_dtype(variable),
                    initializer,
                )
            )

    def _sparse_update(self, rows, values, variable, lr, decay) -> None:
        accumulator = self._accumulators[self._get_variable_index(variable)]
        rank = len(variable.shape)
        sums = self._read_rows(accumulator, rows, values.dtype) + _row_mean_square(values, rank)
        scale = _base.row_shaped(lr / (tf.sqrt(sums) + self.epsilon), rank)
        self._write_rows(accumulator, rows, sums)
        self._step_rows(variable, rows, values * scale, lr, decay)

    def _dense_update(self, gradient, variable, lr, decay) -> None:
        accumulator = self._accumulators[self._get_variable_index(variable)]
        rank = len(variable.shape)
        self.assign_add(accumulator, _row_mean_square(gradient, rank))
        sums = tf.convert_to_tensor(accumulator)
        scale = _base.row_shaped(lr / (tf.sqrt(sums) + self.epsilon), rank)
        if decay is not None:
            self.assign_sub(variable, tf.cast(variable, gradient.dtype) * decay * lr)
        self.assign_sub(variable, gradient * scale)

    def get_config(self) -> dict:
        config = super().get_config()
        config.update(
            initial_accumulator_value=self.initial_accumulator_value, epsilon=self.epsilon
        )
        return config
