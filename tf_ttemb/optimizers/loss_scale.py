"""A `keras.optimizers.LossScaleOptimizer` whose finiteness check keeps sparse gradients sparse."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf


@keras.saving.register_keras_serializable(package="tf_ttemb")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """Keras' dynamic loss scaling, checking a `tf.IndexedSlices` gradient by its values.

    `keras.optimizers.LossScaleOptimizer` checks that the gradients are finite with
    `isfinite` on each gradient, which converts a `tf.IndexedSlices` gradient of an
    [N, D] table into a dense [N, D] tensor on every step: the memory and time of a dense
    update, though the update itself (with `LazyAdam` or `RowWiseAdagrad` inside) stays
    sparse. This subclass checks only the values of such a gradient (the rows it
    touches); everything else, including its configuration, is Keras'.

    Under `mixed_float16`, `Model.compile` wraps an optimizer in Keras' class unless it is
    already a `LossScaleOptimizer`: pass this one explicitly to keep steps sparse.

    Args:
      inner_optimizer: The optimizer that applies the unscaled gradients.
      initial_scale: The initial loss scale.
      dynamic_growth_steps: How many steps with finite gradients double the scale.
      **kwargs: Other `keras.optimizers.LossScaleOptimizer` arguments (`name`).

    Example:

    >>> import keras
    >>> import tf_ttemb
    >>> optimizer = tf_ttemb.optimizers.LossScaleOptimizer(tf_ttemb.optimizers.LazyAdam())
    >>> isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    True
    """

    def check_finite(self, grads: Sequence[Any]) -> tf.Tensor:
        """Whether every gradient is finite; `IndexedSlices` are checked by their values."""
        checks = [
            tf.reduce_all(tf.math.is_finite(g.values if isinstance(g, tf.IndexedSlices) else g))
            for g in grads
            if g is not None
        ]
        return tf.reduce_all(tf.stack(checks)) if checks else tf.constant(True)
