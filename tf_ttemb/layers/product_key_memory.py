"""The Keras 3 Product-Key Memory layer (Lample et al. 2019) on `gather_reduce_sum`.

A product-key memory holds `n_keys**2` value slots. Each token's query is split in two
halves; each half is scored against its own `n_keys` sub-keys, and the best pairs of
sub-keys (the sums of their two scores) name the slots the token reads. The exact best
`knn` pairs among all `n_keys**2` come from the best `knn` of each half alone (a pair in
the overall top-`knn` has both halves in their halves' top-`knn`), so a lookup scores
`2 * n_keys` sub-keys and `knn**2` candidate pairs instead of `n_keys**2` slots.

The output of a token is the softmax-weighted sum of its slots' values over all heads,
computed by one `tf_ttemb.gather_reduce_sum` call for the whole batch: the
[tokens, heads * knn, dim] tensor of gathered values, which would dwarf everything else
(8 GiB for 32 x 512 tokens, 4 heads x 32 slots, dim 1024), is never built, and the values
gradient is a deduplicated `tf.IndexedSlices`.

`memory_usage` and `ProductKeyMemory.memory_stats` report how well the memory is used:
the share of slots read at all and the KL divergence of the slots' total weight from
uniform, the two metrics of the paper.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterable
from typing import Any, Callable, Optional

import keras
import numpy as np
import tensorflow as tf

from tf_ttemb import _args, _serving_hook
from tf_ttemb.ops import _common
from tf_ttemb.ops import gather_reduce_sum as _grs
from tf_ttemb.ops import sparse_apply as _sparse_apply

# PyTorch's BatchNorm1d defaults (momentum 0.1 weighs the new batch) in Keras' convention
# (momentum weighs the moving statistic).
BATCHNORM_MOMENTUM = 0.9
BATCHNORM_EPSILON = 1e-5

# Slot id of a padded (masked) token's entries: gather_reduce_sum skips them.
_PADDING_SLOT = -1

# Optimizers the layer can apply to the values itself, inside the backward pass.
VALUES_OPTIMIZERS = ("sgd", "rowwise_adagrad", "adagrad")


def _rate(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
    if not 0.0 <= float(value) < 1.0:
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
    return float(value)


def _finite(name: str, value: Any, low: float, allow_low: bool = False) -> float:
    relation = ">=" if allow_low else ">"
    message = f"{name} must be a finite number {relation} {low:g}, got {value!r}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(message)
    number = float(value)
    if not math.isfinite(number) or number < low or (number == low and not allow_low):
        raise ValueError(message)
    return number


# ----------------------------------------------------------------------------------------
# Memory statistics.


@dataclasses.dataclass(frozen=True)
class MemoryStats:
    """How a product-key memory's slots are used over some data.

    Attributes:
      num_slots: Number of slots of the memory (`n_keys**2`).
      used_slots: Slots selected by at least one (unmasked) token and head.
      usage: `used_slots / num_slots`, in [0, 1] (the paper's "memory usage", in %
        there; see `usage_percent`).
      kl_from_uniform: KL divergence, in nats, of the distribution of the total weight
        per slot from the uniform distribution over all slots:
        `log(num_slots) + sum_s z_s log z_s` with `z_s` the total softmax weight given
        to slot `s` divided by the total over all slots (0 log 0 = 0). 0 when every slot
        gets the same weight, `log(num_slots)` when one slot gets it all.
      tokens: Unmasked tokens seen.
      selections: Slot reads counted (tokens x heads x knn).
    """

    num_slots: int
    used_slots: int
    usage: float
    kl_from_uniform: float
    tokens: int
    selections: int

    @property
    def usage_percent(self) -> float:
        """`usage` in percent, as the paper reports it."""
        return 100.0 * self.usage

    def as_dict(self) -> dict:
        """The statistics as a JSON-friendly dict (with `usage_percent`)."""
        return dict(dataclasses.asdict(self), usage_percent=self.usage_percent)


def _stats_from_totals(
    weight_totals: np.ndarray, selection_counts: np.ndarray, tokens: int
) -> MemoryStats:
    """MemoryStats from per-slot total weights and selection counts."""
    num_slots = int(weight_totals.shape[0])
    selections = int(selection_counts.sum())
    total = float(weight_totals.sum())
    if selections == 0 or total <= 0.0:
        raise ValueError(
            "memory statistics need at least one unmasked token with positive weights, got "
            f"{tokens} tokens and {selections} slot selections"
        )
    z = weight_totals[weight_totals > 0] / total
    kl = math.log(num_slots) + float(np.sum(z * np.log(z)))
    used = int(np.count_nonzero(selection_counts))
    return MemoryStats(
        num_slots=num_slots,
        used_slots=used,
        usage=used / num_slots,
        kl_from_uniform=max(kl, 0.0),
        tokens=int(tokens),
        selections=selections,
    )


def memory_usage(ids: Any, weights: Any, num_slots: int) -> MemoryStats:
    """Slot usage and KL from uniform of a batch of product-key memory reads.

    Args:
      ids: Slot ids of any shape (e.g. the [..., heads * knn] ids of
        `ProductKeyMemory.lookup`); negative ids (masked tokens) are ignored.
      weights: Their weights, same shape (the softmax weights of the lookup).
      num_slots: Number of slots of the memory (`n_keys**2`); ids must be below it.

    Returns:
      The `MemoryStats`. `tokens` is the number of rows of the last axis of `ids`
      with at least one id >= 0.

    Raises:
      ValueError: If the shapes differ, an id is >= `num_slots`, or no id is >= 0.

    Example:

    >>> from tf_ttemb.layers.product_key_memory import memory_usage
    >>> stats = memory_usage([[0, 1], [1, -1]], [[0.5, 0.5], [1.0, 0.0]], num_slots=4)
    >>> stats.used_slots, stats.usage_percent
    (2, 50.0)
    >>> round(stats.kl_from_uniform, 4)  # log 4 + 0.25 log 0.25 + 0.75 log 0.75
    0.824
    """
    num_slots = _args.positive_int("num_slots", num_slots)
    ids = np.asarray(ids)
    weights = np.asarray(weights, dtype=np.float64)
    if ids.shape != weights.shape:
        raise ValueError(f"ids {ids.shape} and weights {weights.shape} must have the same shape")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"ids must be integers, got dtype {ids.dtype}")
    if ids.size and ids.max() >= num_slots:
        raise ValueError(f"ids must be < num_slots = {num_slots}, got id {int(ids.max())}")
    live = ids >= 0
    totals = np.bincount(ids[live], weights=weights[live], minlength=num_slots)
    counts = np.bincount(ids[live], minlength=num_slots)
    tokens = int(np.count_nonzero(live.reshape(-1, ids.shape[-1]).any(axis=-1))) if ids.ndim else 0
    return _stats_from_totals(totals, counts, tokens)


# ----------------------------------------------------------------------------------------
# The layer.


@keras.saving.register_keras_serializable(package="tf_ttemb")
class ProductKeyMemory(keras.layers.Layer):
    """A product-key memory layer: `n_keys**2` trainable value slots read by exact k-NN.

    For each token `x` (the last axis of the input) and each of `heads` heads:

    1. query `q = BatchNorm(x @ W + b)` (batch norm optional), `heads * k_dim` features,
       `k_dim` per head; the head's query is split into halves `q1`, `q2` of `k_dim / 2`;
    2. each half is scored against the head's own `n_keys` sub-keys of that half
       (`s1 = K1 q1`, `s2 = K2 q2`) and the best `knn` of each are kept;
    3. the `knn * knn` sums `s1[a] + s2[b]` of the kept pairs are ranked and the best
       `knn` kept: exactly the best `knn` of all `n_keys**2` pairs;
    4. their scores go through a softmax (in float32, or float64 for a float64 layer),
       and pair `(a, b)` names slot `a * n_keys + b`.

    The output is the weighted sum of the selected slots' values, over all heads (the
    value table, `[n_keys**2, output_dim]`, is shared by the heads): one
    `tf_ttemb.gather_reduce_sum` over bags of `heads * knn` slots, one bag per token,
    for all tokens of the call. The values gradient is a deduplicated `tf.IndexedSlices`
    (a dense tensor with `dense_grad=True`), so Keras optimizers update only the slots
    read (SGD writes only them; optimizers with dense moments, such as Adam, still
    update their moments densely).

    Masking: with a Keras mask (from an upstream layer or the `mask=` argument, shape
    `inputs.shape[:-1]`, True for real tokens) padded tokens neither read nor update the
    memory: their entries carry the padding slot id -1, which `gather_reduce_sum` skips,
    and zero weights, so their output is zeros and nothing (values, keys, query network,
    inputs) gets a gradient through them; the query batch norm computes its batch
    statistics over real tokens only, and a batch without real tokens leaves the moving
    statistics unchanged. The mask is passed on to the next layer.

    Query batch norm: normalises each of the `heads * k_dim` query features, with the
    batch statistics in training (`training=True` and the layer trainable) and the
    moving statistics otherwise; PyTorch's `BatchNorm1d` defaults (momentum 0.1 there,
    0.9 in Keras' convention, epsilon 1e-5), with the moving variance updated from the
    unbiased batch variance as PyTorch does. Its weights are `query_bn_gamma`,
    `query_bn_beta` and the non-trainable `query_bn_moving_mean` /
    `query_bn_moving_variance`.

    Mixed precision: the query projection runs in the compute dtype; the query is cast
    to float32 for the batch norm, the scores and the softmax; keys and values are
    float32 variables read in place (values are never copied or cast), the memory read
    accumulates in float32 and only the [..., output_dim] result is cast to the compute
    dtype.

    Initialisation (as in the paper's reference code): query projection uniform in
    ±1/sqrt(d_in) (kernel and bias, like a PyTorch `Linear`), sub-keys uniform in
    ±1/sqrt(k_dim / 2), values normal with standard deviation output_dim**-0.5.

    Values optimizer (`values_optimizer="sgd"`, `"rowwise_adagrad"` or `"adagrad"`): the
    layer updates the values itself, inside the backward pass of the memory read, and the
    values gradient is never materialised (as FBGEMM's fused table-batched optimizers
    and FBTT's `sparse=True` do). The values are then a non-trainable variable (Keras'
    optimizer never sees them) and an empty trainable variable `values_update_trigger`
    (shape [0]) is how `Model.fit` or a `tf.GradientTape` over
    `model.trainable_variables` reaches the update: each gradient computation through a
    call with `training` not False (Model.fit's steps) applies, to every slot read in the
    batch, with `g` the slot's summed gradient, `lr = values_learning_rate` and
    `eps = values_epsilon`: sgd `w -= lr * g`; rowwise_adagrad `a += mean(g**2)` (one
    accumulator per slot, `values_accumulator [n_keys**2]`), `w -= lr * g / (sqrt(a) +
    eps)`; adagrad the same per element (`values_accumulator [n_keys**2, output_dim]`).
    Accumulators start at 0. The gradients of the keys, the query network and the inputs
    are unchanged (computed from the values before the update). On CPU and GPU the update
    is the fused op `GatherReduceSumSparseApply`; with `implementation="composite"` or
    under XLA (the op has no XLA kernel) the layer falls back to the unfused path: the
    values gradient of `gather_reduce_sum`, then the same update in TensorFlow ops (same
    numbers, the gradient materialised). Refused under the
    `mixed_float16` policy (the update would see loss-scaled gradients) and under
    `tf.distribute` strategies.

    XLA: with `implementation="composite"`, or `"auto"` inside an XLA-compiled function,
    the memory read uses the XLA-compatible composite of `gather_reduce_sum`; under XLA
    its values gradient is dense ([n_keys**2, output_dim]). The layer reports
    `supports_jit = False` unless `implementation="composite"`, like `EmbeddingBag`.

    Args:
      output_dim: Size of each value (the output's last axis); None for the input's.
      n_keys: Sub-keys per half and head; the memory has `n_keys**2` slots.
      k_dim: Query (and key) size per head; even, split in two halves.
      heads: Number of heads (own query part and sub-keys each, values shared).
      knn: Slots read per token and head, `<= n_keys`.
      query_batchnorm: Whether the query is batch-normalised (it raises slot usage).
      input_dropout: Dropout rate on the input of the query network, in [0, 1).
      query_dropout: Dropout rate on the (normalised) query, in [0, 1).
      value_dropout: Dropout rate on the memory's output, in [0, 1).
      keys_initializer: Initializer of the sub-keys `[heads, 2, n_keys, k_dim // 2]`;
        None for uniform in ±1/sqrt(k_dim / 2).
      values_initializer: Initializer of the values `[n_keys**2, output_dim]`; None for
        normal with standard deviation output_dim**-0.5.
      dense_grad: Whether the values gradient is a dense tensor instead of
        `tf.IndexedSlices`.
      implementation: "auto", "custom_op" or "composite": the implementation of
        `tf_ttemb.gather_reduce_sum` used for the memory read.
      values_optimizer: None (the values are trainable and get a gradient), or "sgd",
        "rowwise_adagrad" or "adagrad": the layer updates the values in the backward
        pass; see "Values optimizer" above.
      values_learning_rate: Learning rate of the values optimizer, > 0.
      values_epsilon: Epsilon of the two Adagrads, added to `sqrt(a)`, >= 0.
      **kwargs: Base `keras.layers.Layer` arguments (`name`, `dtype`, `trainable`, ...).

    Call arguments:
      inputs: Float tensor `[..., d_in]` with a known `d_in`.
      training: Whether to use batch statistics and dropout.
      mask: Optional boolean tensor `inputs.shape[:-1]`, False for padded tokens.

    Returns:
      `[..., output_dim]` (or `[..., d_in]`) in the compute dtype.

    Example:

    >>> import keras
    >>> import tensorflow as tf
    >>> from tf_ttemb.layers import ProductKeyMemory
    >>> layer = ProductKeyMemory(n_keys=16, k_dim=8, heads=2, knn=4)
    >>> layer(tf.random.normal([3, 5, 12])).shape
    TensorShape([3, 5, 12])
    >>> tuple(layer.values.shape)  # 16 * 16 slots
    (256, 12)
    >>> ids, weights = layer.lookup(tf.random.normal([3, 5, 12]))
    >>> ids.shape  # heads * knn slots per token
    TensorShape([3, 5, 8])
    >>> tokens = keras.Input(shape=(None,), dtype="int32")
    >>> hidden = keras.layers.Embedding(100, 12, mask_zero=True)(tokens)
    >>> model = keras.Model(tokens, ProductKeyMemory(n_keys=16, k_dim=8, knn=4)(hidden))
    >>> model.output_shape
    (None, None, 12)
    """

    def __init__(
        self,
        output_dim: int | None = None,
        n_keys: int = 512,
        k_dim: int = 256,
        heads: int = 4,
        knn: int = 32,
        query_batchnorm: bool = True,
        input_dropout: float = 0.0,
        query_dropout: float = 0.0,
        value_dropout: float = 0.0,
        keys_initializer: Any = None,
        values_initializer: Any = None,
        dense_grad: bool = False,
        implementation: str = "auto",
        values_optimizer: str | None = None,
        values_learning_rate: float = 0.01,
        values_epsilon: float = 1e-7,
        **kwargs: Any,
    ) -> None:
        if output_dim is not None:
            output_dim = _args.positive_int("output_dim", output_dim)
        n_keys = _args.positive_int("n_keys", n_keys)
        k_dim = _args.positive_int("k_dim", k_dim)
        if k_dim % 2:
            raise ValueError(f"k_dim must be even (it is split in two halves), got {k_dim}")
        heads = _args.positive_int("heads", heads)
        knn = _args.positive_int("knn", knn)
        if knn > n_keys:
            raise ValueError(f"knn must be <= n_keys = {n_keys}, got knn = {knn}")
        if not isinstance(query_batchnorm, bool):
            raise ValueError(f"query_batchnorm must be True or False, got {query_batchnorm!r}")
        if not isinstance(dense_grad, bool):
            raise ValueError(f"dense_grad must be True or False, got {dense_grad!r}")
        input_dropout = _rate("input_dropout", input_dropout)
        query_dropout = _rate("query_dropout", query_dropout)
        value_dropout = _rate("value_dropout", value_dropout)
        _args.check_choice("implementation", implementation, _common.IMPLEMENTATIONS)
        if values_optimizer is not None:
            _args.check_choice("values_optimizer", values_optimizer, VALUES_OPTIMIZERS)
            if dense_grad:
                raise ValueError(
                    "dense_grad=True has no effect with values_optimizer (the values get no "
                    f"gradient), got values_optimizer={values_optimizer!r}"
                )
        values_learning_rate = _finite("values_learning_rate", values_learning_rate, low=0.0)
        values_epsilon = _finite("values_epsilon", values_epsilon, low=0.0, allow_low=True)
        _common.check_keras_backend("ProductKeyMemory", keras.backend.backend())
        super().__init__(**kwargs)
        self.output_dim = output_dim
        self.n_keys = n_keys
        self.k_dim = k_dim
        self.heads = heads
        self.knn = knn
        self.query_batchnorm = query_batchnorm
        self.input_dropout = input_dropout
        self.query_dropout = query_dropout
        self.value_dropout = value_dropout
        self.keys_initializer = keras.initializers.get(keys_initializer)
        self.values_initializer = keras.initializers.get(values_initializer)
        self.dense_grad = dense_grad
        self.implementation = implementation
        self.values_optimizer = values_optimizer
        self.values_learning_rate = values_learning_rate
        self.values_epsilon = values_epsilon
        if values_optimizer is not None and self.dtype_policy.name == "mixed_float16":
            raise ValueError(
                "values_optimizer (the values update fused into the backward pass) cannot "
                "undo the loss scaling of the mixed_float16 policy; give this layer "
                "dtype='float32' or 'mixed_bfloat16', or use values_optimizer=None"
            )
        self.num_slots = n_keys * n_keys
        # int32 slot ids while n_keys**2 fits.
        self._ids_dtype = tf.int32 if self.num_slots < 2**31 else tf.int64
        self.supports_masking = True
        # The custom op has no XLA kernel: keep Keras from jit-compiling a model that
        # uses it (under XLA, "auto" would take the composite with a dense values
        # gradient of n_keys**2 rows). The composite implementation compiles.
        self.supports_jit = implementation == "composite"
        self._input_dropout_layer = self._dropout_layer("input_dropout", input_dropout)
        self._query_dropout_layer = self._dropout_layer("query_dropout", query_dropout)
        self._value_dropout_layer = self._dropout_layer("value_dropout", value_dropout)
        self._stats_fn = None

    @staticmethod
    def _dropout_layer(name: str, rate: float) -> Optional[keras.layers.Dropout]:
        return keras.layers.Dropout(rate, name=name) if rate > 0 else None

    # ------------------------------------------------------------------------------------
    # Weights.

    def build(self, input_shape: Any) -> None:
        """Creates the query network, the sub-keys and the values for inputs `[..., d_in]`."""
        input_shape = tuple(input_shape)
        d_in = input_shape[-1] if input_shape else None
        if d_in is None:
            raise ValueError(
                f"ProductKeyMemory needs inputs [..., d_in] with a known d_in, got shape "
                f"{input_shape}"
            )
        self.input_dim = int(d_in)
        self.value_dim = self.output_dim or self.input_dim
        query_size = self.heads * self.k_dim
        bound = 1.0 / math.sqrt(self.input_dim)
        self.query_kernel = self.add_weight(
            name="query_kernel",
            shape=(self.input_dim, query_size),
            initializer=keras.initializers.RandomUniform(-bound, bound),
        )
        self.query_bias = self.add_weight(
            name="query_bias",
            shape=(query_size,),
            initializer=keras.initializers.RandomUniform(-bound, bound),
        )
        if self.query_batchnorm:
            # Statistics and affine parameters in float32 under mixed precision.
            self.query_bn_gamma = self.add_weight(
                name="query_bn_gamma", shape=(query_size,), initializer="ones", autocast=False
            )
            self.query_bn_beta = self.add_weight(
                name="query_bn_beta", shape=(query_size,), initializer="zeros", autocast=False
            )
            for name, initializer in (("moving_mean", "zeros"), ("moving_variance", "ones")):
                weight = self.add_weight(
                    name=f"query_bn_{name}",
                    shape=(query_size,),
                    initializer=initializer,
                    trainable=False,
                    autocast=False,
                    # Under tf.distribute each replica's update is averaged into every copy,
                    # so the replicas' moving statistics never drift apart.
                    aggregation="mean",
                )
                setattr(self, f"query_bn_{name}", weight)
        half = self.k_dim // 2
        keys_initializer = self.keys_initializer or keras.initializers.RandomUniform(
            -1.0 / math.sqrt(half), 1.0 / math.sqrt(half)
        )
        self.keys = self.add_weight(
            name="keys",
            shape=(self.heads, 2, self.n_keys, half),
            initializer=keys_initializer,
            autocast=False,
        )
        values_initializer = self.values_initializer or keras.initializers.RandomNormal(
            0.0, self.value_dim**-0.5
        )
        fused = self.values_optimizer is not None
        self.values = self.add_weight(
            name="values",
            shape=(self.num_slots, self.value_dim),
            initializer=values_initializer,
            # Updated by the layer itself with values_optimizer (not by Keras).
            trainable=not fused,
            # Read in place in the variable dtype by gather_reduce_sum, never as a cast copy.
            autocast=False,
        )
        if fused:
            # See "Values optimizer" in the class docstring.
            self.values_update_trigger = _common.add_update_trigger(self, "values_update_trigger")
            if self.values_optimizer != "sgd":
                rowwise = self.values_optimizer == "rowwise_adagrad"
                self.values_accumulator = self.add_weight(
                    name="values_accumulator",
                    shape=(self.num_slots,) if rowwise else (self.num_slots, self.value_dim),
                    initializer="zeros",
                    trainable=False,
                    autocast=False,
                )
        for layer in (
            self._input_dropout_layer,
            self._query_dropout_layer,
            self._value_dropout_layer,
        ):
            if layer is not None:
                layer.build(None)
        self.built = True

    # ------------------------------------------------------------------------------------
    # Forward.

    def _score_dtype(self) -> tf.DType:
        """float32, or float64 for a float64 layer."""
        return tf.float64 if self.keys.dtype == "float64" else tf.float32

    def _flat_mask(self, inputs: tf.Tensor, mask: Any) -> Optional[tf.Tensor]:
        if mask is None:
            return None
        mask = tf.convert_to_tensor(mask)
        if mask.shape.rank is not None and inputs.shape.rank is not None:
            if mask.shape.rank != inputs.shape.rank - 1 or not mask.shape.is_compatible_with(
                inputs.shape[:-1]
            ):
                raise ValueError(
                    f"mask must have the shape of the inputs without their last axis, "
                    f"{inputs.shape[:-1]}, got {mask.shape}"
                )
            static = mask.shape.is_fully_defined() and inputs.shape[:-1].is_fully_defined()
        else:
            static = False
        mask = tf.cast(mask, tf.bool)
        if not static and not _common.in_xla_context():
            # Shapes unknown while tracing: a mask of the same size but another shape
            # would reshape silently. (XLA compiles assertions away.)
            with tf.control_dependencies(
                [
                    tf.debugging.assert_equal(
                        tf.shape(mask, out_type=tf.int64),
                        tf.shape(inputs, out_type=tf.int64)[:-1],
                        message="mask must have the shape of the inputs without their last axis",
                    )
                ]
            ):
                mask = tf.identity(mask)
        return tf.reshape(mask, [-1])

    def _batch_norm(self, query: tf.Tensor, live: Optional[tf.Tensor], training: bool):
        """Batch norm of the [T, heads * k_dim] query (score dtype), statistics over `live`."""
        dtype = query.dtype
        gamma = keras.ops.cast(self.query_bn_gamma, dtype)
        beta = keras.ops.cast(self.query_bn_beta, dtype)
        old_mean = keras.ops.cast(self.query_bn_moving_mean, dtype)
        old_variance = keras.ops.cast(self.query_bn_moving_variance, dtype)
        if not training:
            mean, variance = old_mean, old_variance
        else:
            if live is None:
                count = tf.cast(tf.shape(query)[0], dtype)
                mean = tf.reduce_sum(query, axis=0) / tf.maximum(count, 1.0)
                deviation = query - mean
            else:
                # tf.where, not a product with the mask: padded tokens' queries (whatever
                # their values) neither enter the statistics nor get a gradient from them.
                keep = live[:, None]
                count = tf.reduce_sum(tf.cast(live, dtype))
                kept = tf.where(keep, query, tf.zeros([], dtype))
                mean = tf.reduce_sum(kept, axis=0) / tf.maximum(count, 1.0)
                deviation = tf.where(keep, query - mean, tf.zeros([], dtype))
            variance = tf.reduce_sum(tf.square(deviation), axis=0) / tf.maximum(count, 1.0)
            # Moving statistics as PyTorch keeps them: the unbiased batch variance; a batch
            # without (live) tokens leaves them unchanged.
            unbiased = variance * count / tf.maximum(count - 1.0, 1.0)
            has_tokens = count > 0
            momentum = BATCHNORM_MOMENTUM
            new_mean = old_mean * momentum + tf.stop_gradient(mean) * (1.0 - momentum)
            new_variance = old_variance * momentum + tf.stop_gradient(unbiased) * (1.0 - momentum)
            moving_dtype = self.query_bn_moving_mean.dtype
            self.query_bn_moving_mean.assign(
                tf.cast(tf.where(has_tokens, new_mean, old_mean), moving_dtype)
            )
            self.query_bn_moving_variance.assign(
                tf.cast(tf.where(has_tokens, new_variance, old_variance), moving_dtype)
            )
        return (query - mean) * tf.math.rsqrt(variance + BATCHNORM_EPSILON) * gamma + beta

    def _lookup_flat(
        self, inputs: tf.Tensor, live: Optional[tf.Tensor], training: bool
    ) -> tuple[tf.Tensor, tf.Tensor]:
        """Slot ids and softmax weights, [T, heads * knn] each, of the flattened tokens."""
        compute_dtype = self.compute_dtype
        x = tf.reshape(tf.cast(inputs, compute_dtype), [-1, self.input_dim])
        if live is not None:
            # Masked tokens read nothing and update nothing: their inputs (whatever they
            # hold, NaN included) never reach the query network, whose gradients would
            # otherwise get 0 * NaN from them.
            x = tf.where(live[:, None], x, tf.zeros([], x.dtype))
        if training and self._input_dropout_layer is not None:
            x = self._input_dropout_layer(x, training=True)
        query = tf.matmul(x, keras.ops.cast(self.query_kernel, compute_dtype))
        query += keras.ops.cast(self.query_bias, compute_dtype)
        dtype = self._score_dtype()
        query = tf.cast(query, dtype)
        if self.query_batchnorm:
            query = self._batch_norm(query, live, bool(training and self.trainable))
        if training and self._query_dropout_layer is not None:
            query = self._query_dropout_layer(query, training=True)
        half = self.k_dim // 2
        knn, n_keys = self.knn, self.n_keys
        query = tf.reshape(query, [-1, self.heads, 2, half])  # [T, H, 2, half]
        keys = keras.ops.cast(self.keys, dtype)  # [H, 2, n_keys, half]
        # Both halves of all heads at once: [T, H, 2, n_keys], then their best knn.
        scores = tf.einsum("thsd,hsnd->thsn", query, keys)
        half_scores, half_ids = tf.math.top_k(scores, k=knn)  # [T, H, 2, knn]
        # The knn * knn candidate pairs (a, b) at position a * knn + b, and their best knn.
        pair_scores = half_scores[:, :, 0, :, None] + half_scores[:, :, 1, None, :]
        pair_scores = tf.reshape(pair_scores, [-1, self.heads, knn * knn])
        best_scores, best_pairs = tf.math.top_k(pair_scores, k=knn)  # [T, H, knn]
        first = tf.gather(half_ids[:, :, 0], best_pairs // knn, batch_dims=2)
        second = tf.gather(half_ids[:, :, 1], best_pairs % knn, batch_dims=2)
        ids = tf.cast(first, self._ids_dtype) * n_keys + tf.cast(second, self._ids_dtype)
        weights = tf.nn.softmax(best_scores, axis=-1)
        bag = self.heads * knn
        ids = tf.reshape(ids, [-1, bag])
        weights = tf.reshape(weights, [-1, bag])
        if live is not None:
            keep = live[:, None]
            ids = tf.where(keep, ids, tf.constant(_PADDING_SLOT, self._ids_dtype))
            weights = tf.where(keep, weights, tf.zeros([], weights.dtype))
        return ids, weights

    def _read_memory(
        self,
        ids: tf.Tensor,
        weights: tf.Tensor,
        padding_id: Optional[int],
        update_values: bool = False,
    ) -> tf.Tensor:
        """The [T, value_dim] weighted sums of the slots' values (one gather_reduce_sum).

        The values variable itself is passed, so the custom op reads it in place. With
        `update_values` (values_optimizer, not inference) a gradient through the read
        updates the slots read, by the fused op or by the unfused fallback.
        """
        substitute = _serving_hook.serving_table(self)
        if substitute is not None:  # tf_ttemb.export_for_serving is tracing the model
            return substitute.lookup(ids, tf.cast(weights, self.values.dtype), "sum", padding_id)
        if update_values:
            return self._read_and_update(ids, tf.cast(weights, self.values.dtype), padding_id)
        return _grs.gather_reduce_sum(
            self.values,
            ids,
            tf.cast(weights, self.values.dtype),
            combiner="sum",
            padding_id=padding_id,
            dense_grad=self.dense_grad,
            implementation=self.implementation,
        )

    def _fused_values_update(self) -> bool:
        """Whether the values update runs in the fused op (else the unfused fallback).

        The op has CPU and GPU kernels but no XLA kernel: the fallback serves the composite
        implementation, XLA compilation and values that are not a plain resource variable.
        """
        return (
            self.implementation != "composite"
            and not _common.in_xla_context()
            and _common.resource_variable(self.values) is not None
        )

    def _read_and_update(
        self, ids: tf.Tensor, weights: tf.Tensor, padding_id: Optional[int]
    ) -> tf.Tensor:
        """The memory read whose backward pass applies values_optimizer to the slots read."""
        if tf.distribute.has_strategy():
            # Each replica would update its own copy of the values with its own gradient.
            raise ValueError(
                "values_optimizer does not support tf.distribute strategies (replicas would "
                "update their copies of the values apart); use values_optimizer=None and a "
                "Keras optimizer"
            )
        trigger = tf.convert_to_tensor(_common.resource_variable(self.values_update_trigger))
        accumulator = getattr(self, "values_accumulator", None)
        if self._fused_values_update():
            return _sparse_apply.gather_reduce_sum_sparse_apply(
                self.values,
                ids,
                weights,
                trigger=trigger,
                optimizer=self.values_optimizer,
                learning_rate=self.values_learning_rate,
                accumulator=accumulator,
                epsilon=self.values_epsilon,
                combiner="sum",
                padding_id=padding_id,
            )
        # Unfused: the values gradient of gather_reduce_sum, then the same update in
        # TensorFlow ops, applied by the gradient of an identity on the values.
        variable = _common.resource_variable(self.values)
        variable = self.values if variable is None else variable
        if accumulator is not None:
            state = _common.resource_variable(accumulator)
            accumulator = accumulator if state is None else state
        optimizer = self.values_optimizer
        learning_rate, epsilon = self.values_learning_rate, self.values_epsilon

        @tf.custom_gradient
        def updating_identity(value, trigger):
            def grad(upstream, variables=None):
                updates = _apply_values_update(
                    variable, accumulator, upstream, optimizer, learning_rate, epsilon
                )
                # A data dependency of the trigger's gradient on the update (see
                # gather_reduce_sum_sparse_apply).
                with tf.control_dependencies(updates):
                    stamp = variable.sparse_read(tf.zeros([0], tf.int32))
                trigger_grad = tf.zeros_like(trigger) + tf.reduce_sum(tf.cast(stamp, trigger.dtype))
                return (None, trigger_grad), [None] * len(variables or [])

            return tf.identity(value), grad

        values = updating_identity(tf.convert_to_tensor(variable), trigger)
        return _grs.gather_reduce_sum(
            values,
            ids,
            weights,
            combiner="sum",
            padding_id=padding_id,
            implementation=self.implementation,
        )

    def lookup(
        self, inputs: Any, mask: Any = None, training: bool = False
    ) -> tuple[tf.Tensor, tf.Tensor]:
        """The slots each token reads and their weights, without reading the values.

        Args:
          inputs: `[..., d_in]`.
          mask: Optional boolean `inputs.shape[:-1]`, False for padded tokens.
          training: Whether the query uses batch statistics (and dropout); with
            `training=True` the batch norm's moving statistics are updated.

        Returns:
          `(ids, weights)`, each `[..., heads * knn]`: slot ids (int32 while
          `n_keys**2 < 2**31`, else int64; -1 for padded tokens), head-major (head h's
          slots at `h * knn ...`, each head's best first), and their softmax weights
          (float32, float64 for a float64 layer; 0 for padded tokens; each head's sum to 1).
        """
        inputs = tf.convert_to_tensor(inputs)
        if not self.built:
            self.build(inputs.shape)
        live = self._flat_mask(inputs, mask)
        ids, weights = self._lookup_flat(inputs, live, bool(training))
        lead = tf.shape(inputs)[:-1]
        shape = tf.concat([lead, [self.heads * self.knn]], axis=0)
        ids, weights = tf.reshape(ids, shape), tf.reshape(weights, shape)
        static = inputs.shape[:-1].concatenate([self.heads * self.knn])
        ids.set_shape(static)
        weights.set_shape(static)
        return ids, weights

    def call(self, inputs: tf.Tensor, training: Any = None, mask: Any = None) -> tf.Tensor:
        """Reads the memory for every token of `inputs`; see the class docstring."""
        update_values = self.values_optimizer is not None and training is not False
        training = bool(training)
        live = self._flat_mask(inputs, mask)
        ids, weights = self._lookup_flat(inputs, live, training)
        output = self._read_memory(
            ids, weights, None if live is None else _PADDING_SLOT, update_values
        )
        if training and self._value_dropout_layer is not None:
            output = self._value_dropout_layer(output, training=True)
        output = tf.cast(output, self.compute_dtype)
        shape = tf.concat([tf.shape(inputs)[:-1], [self.value_dim]], axis=0)
        output = tf.reshape(output, shape)
        output.set_shape(inputs.shape[:-1].concatenate([self.value_dim]))
        return output

    def compute_output_shape(self, input_shape: Any) -> tuple:
        """`[..., d_in]` gives `[..., output_dim or d_in]`."""
        input_shape = tuple(input_shape)
        return input_shape[:-1] + (self.output_dim or input_shape[-1],)

    # ------------------------------------------------------------------------------------
    # Statistics.

    def _slot_totals(self, inputs: tf.Tensor, mask: Optional[tf.Tensor]):
        """Per-slot total weight [num_slots] (float64), selections [num_slots], tokens."""
        live = self._flat_mask(inputs, mask)
        ids, weights = self._lookup_flat(inputs, live, training=False)
        ids = tf.reshape(ids, [-1])
        weights = tf.reshape(tf.cast(weights, tf.float64), [-1])
        used = ids >= 0
        safe_ids = tf.where(used, ids, tf.zeros_like(ids))
        totals = tf.math.unsorted_segment_sum(
            tf.where(used, weights, tf.zeros_like(weights)), safe_ids, self.num_slots
        )
        counts = tf.math.unsorted_segment_sum(tf.cast(used, tf.int64), safe_ids, self.num_slots)
        if live is None:
            tokens = tf.cast(tf.shape(ids)[0] // (self.heads * self.knn), tf.int64)
        else:
            tokens = tf.reduce_sum(tf.cast(live, tf.int64))
        return totals, counts, tokens

    def memory_stats(
        self,
        data: Any,
        steps: Optional[int] = None,
        inputs_fn: Optional[Callable[[Any], Any]] = None,
    ) -> MemoryStats:
        """Slot usage and KL from uniform of the memory over some data (inference mode).

        The paper's metrics: the share of the `n_keys**2` slots that any token reads,
        and the KL divergence from uniform of the total weight per slot (see
        `MemoryStats`). Queries use the batch norm's moving statistics and no dropout.

        Args:
          data: The layer's inputs: one batch (a tensor or array `[..., d_in]`) or an
            iterable of batches (a `tf.data.Dataset`, a list, a generator). A batch may
            be a tuple `(inputs, mask)` (mask as in `call`, or None); map datasets of
            `(x, y)` pairs with `inputs_fn=lambda batch: batch[0]`.
          steps: At most this many batches of an iterable.
          inputs_fn: Optional function applied to each batch first, returning the
            layer's inputs or an `(inputs, mask)` pair: e.g. a sub-model that computes
            the hidden states this layer receives inside a larger model.

        Returns:
          The `MemoryStats` over all (unmasked) tokens of the data.

        Raises:
          ValueError: If the data holds no unmasked token.

        Example:

        >>> import numpy as np
        >>> from tf_ttemb.layers import ProductKeyMemory
        >>> layer = ProductKeyMemory(n_keys=8, k_dim=4, heads=2, knn=2)
        >>> batches = [np.random.normal(size=(4, 16, 6)).astype("float32") for _ in range(3)]
        >>> stats = layer.memory_stats(batches)
        >>> stats.num_slots, stats.tokens
        (64, 192)
        >>> 0 < stats.usage <= 1 and stats.kl_from_uniform >= 0
        True
        """
        if steps is not None:
            steps = _args.positive_int("steps", steps)
        arrays = (tf.Tensor, np.ndarray)
        one_pair = isinstance(data, tuple) and len(data) == 2 and isinstance(data[0], arrays)
        if isinstance(data, arrays) or one_pair:
            batches: Iterable = [data]
        elif isinstance(data, Iterable):
            batches = data
        else:
            raise ValueError(
                "data must be a tensor or array [..., d_in], an (inputs, mask) pair or an "
                f"iterable of them, got {type(data).__name__}"
            )
        if self._stats_fn is None:
            self._stats_fn = tf.function(self._slot_totals, reduce_retracing=True)
        totals = np.zeros([self.num_slots], np.float64)
        counts = np.zeros([self.num_slots], np.int64)
        tokens = 0
        for step, batch in enumerate(batches):
            if steps is not None and step >= steps:
                break
            if inputs_fn is not None:
                batch = inputs_fn(batch)
            inputs, mask = batch if isinstance(batch, tuple) else (batch, None)
            inputs = tf.convert_to_tensor(inputs, dtype=self.compute_dtype)
            if not self.built:
                self.build(inputs.shape)
            if mask is not None:
                mask = tf.convert_to_tensor(mask, tf.bool)
            batch_totals, batch_counts, batch_tokens = self._stats_fn(inputs, mask)
            totals += batch_totals.numpy()
            counts += batch_counts.numpy()
            tokens += int(batch_tokens)
        return _stats_from_totals(totals, counts, tokens)

    # ------------------------------------------------------------------------------------
    # Serialization.

    def get_config(self) -> dict:
        config = super().get_config()

        def initializer(value):
            return None if value is None else keras.initializers.serialize(value)

        config.update(
            _common.constructor_config(
                self,
                ProductKeyMemory,
                keys_initializer=initializer(self.keys_initializer),
                values_initializer=initializer(self.values_initializer),
            )
        )
        return config


def _apply_values_update(
    variable, accumulator, grad, optimizer: str, learning_rate: float, epsilon: float
) -> list:
    """The values optimizer in TensorFlow ops (the unfused path), in place.

    Same rules as `gather_reduce_sum_sparse_apply`: with `g` a row's summed gradient,
    sgd `w -= lr g`; rowwise_adagrad `a += mean(g**2)`, `w -= lr g / (sqrt(a) + eps)`;
    adagrad the same per element; a zero denominator leaves the row unchanged. A
    `tf.IndexedSlices` gradient updates only its rows (duplicates summed first); a dense
    one (XLA) every row, where a zero gradient changes nothing.
    """
    dtype = variable.dtype
    rate = tf.constant(learning_rate, dtype)
    eps = tf.constant(epsilon, dtype)
    # Densified under XLA: the Adagrads need each row once.
    grad, indices, values = _common.deduplicated_rows(variable, grad)
    if isinstance(grad, tf.IndexedSlices):
        if optimizer == "sgd":
            return [variable.scatter_sub(tf.IndexedSlices(rate * values, indices))]
        if optimizer == "rowwise_adagrad":
            squares = tf.reduce_mean(tf.square(values), axis=1)
        else:
            squares = tf.square(values)
        denominator = tf.sqrt(_common.accumulated(accumulator, squares, indices)) + eps
        if optimizer == "rowwise_adagrad":
            denominator = denominator[:, None]
        step = tf.math.divide_no_nan(rate * values, denominator)
        return [variable.scatter_sub(tf.IndexedSlices(step, indices))]
    grad = tf.cast(tf.convert_to_tensor(grad), dtype)
    if optimizer == "sgd":
        return [variable.assign_sub(rate * grad)]
    if optimizer == "rowwise_adagrad":
        squares = tf.reduce_mean(tf.square(grad), axis=1)
    else:
        squares = tf.square(grad)
    denominator = tf.sqrt(_common.accumulated(accumulator, squares)) + eps
    if optimizer == "rowwise_adagrad":
        denominator = denominator[:, None]
    return [variable.assign_sub(tf.math.divide_no_nan(rate * grad, denominator))]
