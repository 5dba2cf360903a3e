"""Keras 3 optimizers for embedding tables that update only the rows a batch touches.

* `LazyAdam`: Adam on the rows of a `tf.IndexedSlices` gradient only, with per-row step
  counts for the bias correction; Adam for dense gradients.
* `RowWiseAdagrad`: Adagrad with one accumulator per row (N floats of state for an
  [N, D] table), sparse for `tf.IndexedSlices` gradients.
* `LossScaleOptimizer`: Keras' dynamic loss scaling whose finiteness check does not
  densify `tf.IndexedSlices` gradients (use it under `mixed_float16`).
"""

from tf_ttemb.optimizers.lazy_adam import LazyAdam
from tf_ttemb.optimizers.loss_scale import LossScaleOptimizer
from tf_ttemb.optimizers.row_wise_adagrad import RowWiseAdagrad

__all__ = ["LazyAdam", "LossScaleOptimizer", "RowWiseAdagrad"]
