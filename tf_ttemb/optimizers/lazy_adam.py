"""LazyAdam: Adam that updates only the rows of a sparse (`tf.IndexedSlices`) gradient."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from tf_ttemb.optimizers import _sparse_optimizer as _base


@keras.saving.register_keras_serializable(package="tf_ttemb")
class LazyAdam(_base.SparseOptimizer):
    """Adam that moves only the rows a sparse gradient touches, with per-row step counts.

    For a `tf.IndexedSlices` gradient (what `tf_ttemb.gather_reduce_sum`, `EmbeddingBag` and
    `tf.gather` give for a table), repeated rows are summed first, then each distinct row
    `r` with summed gradient `g` takes one Adam step, and every other row of the variable
    and of its moments is left exactly as it was (bitwise)::

        k[r] = k[r] + 1                                  # the row's own step count
        m[r] = m[r] + (g - m[r]) * (1 - beta_1)
        v[r] = v[r] + (g**2 - v[r]) * (1 - beta_2)
        w[r] = w[r] - lr * sqrt(1 - beta_2**k[r]) / (1 - beta_1**k[r])
                        * m[r] / (sqrt(v[r]) + epsilon)

    The cost is proportional to the touched rows, not to the table: Keras' `Adam` would
    densify the gradient and decay and rewrite both moments and the weights of every row
    on every step.

    **Bias correction uses per-row step counts** `k[r]`: the number of updates that have
    touched row `r` (an extra int32 per row of state, 1/(2·D) of the moments). A row's
    moments are averages of only the `k[r]` gradients it has received, so this is the
    correction that makes them unbiased, and each row follows exactly Adam run on its own
    sequence of gradients: a row first seen at step 10,000 takes the same first step
    (`lr · sign(g)` for `epsilon → 0`) as a row seen at step 1. TF Addons' LazyAdam and
    PyTorch's SparseAdam correct with the global step instead, which for a rarely-touched
    row under-corrects its moments: with the default betas its first step is about
    3.2× larger (`(1 - beta_1) / sqrt(1 - beta_2)`) than Adam's.

    A dense gradient is an update of every row (every `k[r]` grows by one), so with dense
    gradients only this is Keras' `Adam` (same formulation: `epsilon` is added to `sqrt(v)`,
    not to the bias-corrected `sqrt(v_hat)`), and sparse and dense steps mix consistently.

    The other standard Keras arguments:

    * `weight_decay` (decoupled, as in Keras: `w -= w * weight_decay * lr`) decays every row
      for a dense gradient and only the touched rows for a sparse one (lazily, like the
      moments); `exclude_from_weight_decay` works as in Keras.
    * `clipnorm`, `clipvalue`, `global_clipnorm` clip the deduplicated gradient, i.e. the
      dense gradient a sparse one stands for, without densifying it.
    * `loss_scale_factor` and `keras.optimizers.LossScaleOptimizer` work with sparse
      gradients; under `mixed_float16` prefer `tf_ttemb.optimizers.LossScaleOptimizer`,
      whose finiteness check does not densify them.
    * `use_ema` behaves as in Keras: a dense moving average of every variable, updated on
      every step (state and time proportional to the whole variable).
    * `gradient_accumulation_steps` works for dense gradients; a sparse gradient raises a
      `ValueError` (Keras accumulates into a dense buffer, which would update every row).

    Under `tf.distribute.MirroredStrategy` the replicas' sparse gradients are summed (rows
    touched by several replicas once) and every replica applies the same sparse update.

    Variables of any rank: rows are slices along the first axis (an element of a rank-1
    variable; a scalar variable is one row). Optimizer state (both moments) is kept in
    the variable's dtype, and float32 for float16 and bfloat16 variables, in which the
    update is also computed.

    Args:
      learning_rate: A float, a `keras.optimizers.schedules.LearningRateSchedule` or a
        callable taking no arguments.
      beta_1: Decay rate of the first moment, in [0, 1).
      beta_2: Decay rate of the second moment, in [0, 1).
      epsilon: Added to `sqrt(v)` in the denominator, >= 0.
      **kwargs: The base `keras.optimizers.Optimizer` arguments (`name`, `weight_decay`,
        `clipnorm`, `clipvalue`, `global_clipnorm`, `use_ema`, `ema_momentum`,
        `ema_overwrite_frequency`, `loss_scale_factor`, `gradient_accumulation_steps`),
        with the meanings above.

    Example:

    >>> import tensorflow as tf
    >>> import tf_ttemb
    >>> table = tf.Variable(tf.ones([1000, 8]))
    >>> optimizer = tf_ttemb.optimizers.LazyAdam(learning_rate=0.01)
    >>> with tf.GradientTape() as tape:
    ...     bags = tf_ttemb.gather_reduce_sum(table, tf.constant([[3, 7], [7, 999]]))
    ...     loss = tf.reduce_sum(bags)
    >>> optimizer.apply(tape.gradient(loss, [table]), [table])  # an IndexedSlices
    >>> [round(float(table[r, 0]), 4) for r in (0, 3, 7, 999)]  # only rows 3, 7, 999 moved
    [1.0, 0.99, 0.99, 0.99]
    """

    def __init__(
        self,
        learning_rate: Any = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        **kwargs: Any,
    ) -> None:
        beta_1 = _base.check_unit_interval("beta_1", beta_1)
        beta_2 = _base.check_unit_interval("beta_2", beta_2)
        epsilon = _base.check_non_negative("epsilon", epsilon)
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta_1 = beta_1
        self.beta_2 = beta_2
        self.epsilon = epsilon

    def build(self, var_list: list[Any]) -> None:
        """Creates the moments and the per-row step counts of each variable.

        For a variable of shape [N, ...]: `momentum` and `velocity` [N, ...] (float32 for
        half-precision variables, else the variable's dtype) and `steps` [N] int32 (a
        scalar for a scalar variable).
        """
        if self.built:
            return
        super().build(var_list)
        self._momentums: list[keras.Variable | None] = []
        self._velocities: list[keras.Variable | None] = []
        self._row_steps: list[keras.Variable | None] = []
        for variable in var_list:
            if getattr(variable, "overwrite_with_gradient", False):
                for state in (self._momentums, self._velocities, self._row_steps):
                    state.append(None)
                continue
            shape = tuple(variable.shape)
            dtype = _base.compute_dtype(variable)
            self._momentums.append(self._add_state(variable, "momentum", shape, dtype, "zeros"))
            self._velocities.append(self._add_state(variable, "velocity", shape, dtype, "zeros"))
            self._row_steps.append(self._add_state(variable, "steps", shape[:1], "int32", "zeros"))

    def _state(self, variable: Any):
        index = self._get_variable_index(variable)
        return self._momentums[index], self._velocities[index], self._row_steps[index]

    def _step_sizes(self, steps: tf.Tensor, lr: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
        """lr · sqrt(1 - beta_2^k) / (1 - beta_1^k) for per-row step counts k (>= 1)."""
        k = tf.cast(steps, dtype)
        beta_1_power = tf.pow(_base.as_dtype(self.beta_1, dtype), k)
        beta_2_power = tf.pow(_base.as_dtype(self.beta_2, dtype), k)
        return lr * tf.sqrt(1 - beta_2_power) / (1 - beta_1_power)

    def _sparse_update(self, rows, values, variable, lr, decay) -> None:
        m, v, row_steps = self._state(variable)
        dtype = values.dtype
        rank = len(variable.shape)
        steps = self._read_rows(row_steps, rows, tf.int32) + 1
        m_rows = self._read_rows(m, rows, dtype)
        v_rows = self._read_rows(v, rows, dtype)
        m_rows = m_rows + (values - m_rows) * (1 - self.beta_1)
        v_rows = v_rows + (tf.square(values) - v_rows) * (1 - self.beta_2)
        alpha = _base.row_shaped(self._step_sizes(steps, lr, dtype), rank)
        self._write_rows(row_steps, rows, steps)
        self._write_rows(m, rows, m_rows)
        self._write_rows(v, rows, v_rows)
        self._step_rows(
            variable, rows, m_rows * alpha / (tf.sqrt(v_rows) + self.epsilon), lr, decay
        )

    def _dense_update(self, gradient, variable, lr, decay) -> None:
        m, v, row_steps = self._state(variable)
        dtype = gradient.dtype
        self.assign_add(row_steps, tf.ones(row_steps.shape, tf.int32))
        steps = tf.convert_to_tensor(row_steps)
        alpha = _base.row_shaped(self._step_sizes(steps, lr, dtype), len(variable.shape))
        if decay is not None:
            self.assign_sub(variable, tf.cast(variable, dtype) * decay * lr)
        self.assign_add(m, (gradient - m) * (1 - self.beta_1))
        self.assign_add(v, (tf.square(gradient) - v) * (1 - self.beta_2))
        self.assign_sub(variable, m * alpha / (tf.sqrt(v) + self.epsilon))

    def get_config(self) -> dict:
        config = super().get_config()
        config.update(beta_1=self.beta_1, beta_2=self.beta_2, epsilon=self.epsilon)
        return config
