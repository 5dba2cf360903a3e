"""The Keras 3 EmbeddingBag layer: a table of embeddings combined per bag of ids."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from tf_ttemb import _args
from tf_ttemb import distribute as _distribute
from tf_ttemb.ops import _common
from tf_ttemb.ops import gather_reduce_sum as _grs


@keras.saving.register_keras_serializable(package="tf_ttemb")
class EmbeddingBag(keras.layers.Layer):
    """Looks up bags of ids in an embedding table and combines each bag into one vector.

    The fused equivalent of an `Embedding` lookup followed by a (weighted) sum, mean,
    root-n-normalised sum or max over each bag, without building the gathered
    [..., L, output_dim] tensor. Computed by `tf_ttemb.gather_reduce_sum`; see it for the
    exact semantics and gradients.

    Ids may be a dense integer tensor [..., L] (output [..., output_dim]), a
    `tf.RaggedTensor` [B, (L)] or a 2-D `tf.SparseTensor` [B, L] (output [B, output_dim]).
    Optional per-entry `weights` have the same structure as the ids.

    The params gradient is a `tf.IndexedSlices` over the distinct ids of the batch (a
    dense [input_dim, output_dim] tensor with `dense_grad=True`), so optimizers update
    only the rows used. Under mixed precision the table stays in the variable dtype
    (float32) and is read in place; rows and weights are combined in float32 and the
    result is cast to the compute dtype.

    Under `tf.distribute.ParameterServerStrategy` with a `variable_partitioner`, the
    table is a `ShardedVariable` spread over the parameter servers; each bag is then
    combined from per-shard partial results computed where the shards live
    (`tf_ttemb.distribute.sharded_gather_reduce_sum`), and each shard gets its own
    `tf.IndexedSlices` gradient. See `docs/distribute.md`.

    Requires the TensorFlow backend of Keras. With `implementation="auto"` or
    `"custom_op"` the layer reports `supports_jit = False`, so `Model.fit` does not
    XLA-compile it (the custom op has no XLA kernel); `implementation="composite"` is
    XLA-compatible.

    Args:
      input_dim: Number of rows of the table (ids lie in [0, input_dim)), >= 1.
      output_dim: Size of each embedding, >= 1.
      combiner: "sum", "mean", "sqrtn" or "max" (max takes no weights).
      padding_id: Optional id whose entries are ignored: they contribute nothing, are not
        counted by "mean"/"sqrtn" and get no gradient. -1 (an id that is never a row) or a
        row in [0, input_dim), whose embedding then stays untouched by training.
      embeddings_initializer: Initializer of the table.
      embeddings_regularizer: Optional regularizer of the table.
      embeddings_constraint: Optional constraint on the table.
      dense_grad: Whether the table's gradient is a dense tensor rather than
        `tf.IndexedSlices`.
      implementation: "auto", "custom_op" or "composite"; see
        `tf_ttemb.gather_reduce_sum`.
      **kwargs: Base `keras.layers.Layer` arguments (`name`, `dtype`, `trainable`, ...).

    Call arguments:
      indices: The ids, as above (int32 or int64).
      weights: Optional per-entry weights with the structure of `indices`.

    Example:

    >>> import keras
    >>> import tensorflow as tf
    >>> from tf_ttemb.layers import EmbeddingBag
    >>> layer = EmbeddingBag(10, 4, combiner="mean", padding_id=0)
    >>> layer(tf.constant([[1, 2, 0], [3, 0, 0]])).shape
    TensorShape([2, 4])
    >>> layer(tf.ragged.constant([[1, 2], [3, 4, 5], []])).shape
    TensorShape([3, 4])
    >>> inputs = keras.Input(shape=(None,), dtype="int64", ragged=True)
    >>> model = keras.Model(inputs, keras.layers.Dense(1)(EmbeddingBag(10, 4)(inputs)))
    >>> model.output_shape
    (None, 1)
    """

    def __init__(
        self,
        input_dim: int,
        output_dim: int,
        combiner: str = "sum",
        padding_id: int | None = None,
        embeddings_initializer: Any = "uniform",
        embeddings_regularizer: Any = None,
        embeddings_constraint: Any = None,
        dense_grad: bool = False,
        implementation: str = "auto",
        **kwargs: Any,
    ) -> None:
        input_dim = _args.positive_int("input_dim", input_dim)
        output_dim = _args.positive_int("output_dim", output_dim)
        _args.check_choice("combiner", combiner, _common.COMBINERS)
        _args.check_choice("implementation", implementation, _common.IMPLEMENTATIONS)
        padding_id = _args.layer_padding_id(padding_id, "input_dim", input_dim)
        _common.check_keras_backend("EmbeddingBag", keras.backend.backend())
        super().__init__(**kwargs)
        self.input_dim = input_dim
        self.output_dim = output_dim
        self.combiner = combiner
        self.padding_id = padding_id
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.embeddings_regularizer = keras.regularizers.get(embeddings_regularizer)
        self.embeddings_constraint = keras.constraints.get(embeddings_constraint)
        self.dense_grad = bool(dense_grad)
        self.implementation = implementation
        # The custom op has no XLA kernel: keep Keras from jit-compiling a model that
        # uses it. The composite implementation compiles.
        self.supports_jit = implementation == "composite"

    def build(self, input_shape: Any = None) -> None:
        """Creates the [input_dim, output_dim] `embeddings` table (input shape unused)."""
        self.embeddings = self.add_weight(
            name="embeddings",
            shape=(self.input_dim, self.output_dim),
            initializer=self.embeddings_initializer,
            regularizer=self.embeddings_regularizer,
            constraint=self.embeddings_constraint,
            trainable=True,
            # Read in place in the variable dtype, never as a cast copy; see call().
            autocast=False,
        )
        self.built = True

    def call(self, indices: Any, weights: Any = None) -> tf.Tensor:
        """Combines the embeddings of each bag of `indices`; see the class docstring."""
        served = _common.serving_lookup(self, indices, weights)
        if served is not None:  # tf_ttemb.export_for_serving is tracing the model
            return served
        # The table is passed as the variable itself, so the custom op reads it in place
        # (no per-step copy of the [input_dim, output_dim] table, which TensorFlow would
        # otherwise make once the table has been updated sparsely). Under mixed precision
        # the rows are combined in the variable dtype (weights cast to it) and only the
        # [..., output_dim] result is cast to the compute dtype: no float16 copy of the
        # table per step, and float32 accumulation.
        # A table sharded by ParameterServerStrategy's variable_partitioner is combined
        # shard by shard where each shard lives, never assembled.
        lookup = (
            _distribute.sharded_gather_reduce_sum
            if _distribute.is_sharded(self.embeddings)
            else _grs.gather_reduce_sum
        )
        output = lookup(
            self.embeddings,
            indices,
            weights,
            combiner=self.combiner,
            padding_id=self.padding_id,
            dense_grad=self.dense_grad,
            implementation=self.implementation,
        )
        return tf.cast(output, self.compute_dtype)

    def compute_output_shape(self, input_shape: Any) -> tuple:
        """[..., L] ids give [..., output_dim]; ragged and sparse [B, L] give [B, output_dim]."""
        return tuple(input_shape)[:-1] + (self.output_dim,)

    def get_config(self) -> dict:
        config = super().get_config()
        config.update(
            _common.constructor_config(
                self,
                EmbeddingBag,
                embeddings_initializer=keras.initializers.serialize(self.embeddings_initializer),
                embeddings_regularizer=keras.regularizers.serialize(self.embeddings_regularizer),
                embeddings_constraint=keras.constraints.serialize(self.embeddings_constraint),
            )
        )
        return config
