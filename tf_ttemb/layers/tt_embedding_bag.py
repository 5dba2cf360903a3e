"""Keras 3 layers over Tensor-Train (TT) compressed embedding tables.

`TTEmbeddingBag` is an EmbeddingBag whose [num_embeddings, embedding_dim] table is
stored as TT cores (often 100-1000x smaller) and decompressed only for the rows a batch
uses; `TableBatchedTTEmbeddingBag` holds several such tables of one shape and looks all
of them up in one op call. Both share `_TTEmbeddingBagBase`: the cores and their
initialisation, the optional row cache with its frequency table, the optional update
fused into the backward pass (`sparse=True`), `full_weight()` and the Keras plumbing.
The lookup itself is `tf_ttemb.ops.tt_embedding.tt_embedding_bag`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tf_ttemb import _args, tt
from tf_ttemb.ops import _common, composite
from tf_ttemb.ops import tt_embedding as _tte

OPTIMIZERS = ("sgd", "adagrad")


def _positive_float(name: str, value: Any, allow_zero: bool = False) -> float:
    bad = ValueError(
        f"{name} must be a {'non-negative' if allow_zero else 'positive'} number, got {value!r}"
    )
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise bad
    number = float(value)
    if not math.isfinite(number) or number < 0 or (number == 0 and not allow_zero):
        raise bad
    return number


def _is_training(training: Any) -> bool:
    """Whether `training` is a true Python/numpy boolean (Keras passes Python booleans)."""
    return isinstance(training, (bool, np.bool_)) and bool(training)


def _in_place(variable: Any) -> Any:
    """The resource variable to read in place, else `variable` itself.

    A distributed variable outside replica context (Keras calls a model once there under
    a strategy's scope) has no single resource to read; the ops then read its value.
    """
    resource = _common.resource_variable(variable)
    return variable if resource is None else resource


class _TTEmbeddingBagBase(keras.layers.Layer):
    """Shared implementation of `TTEmbeddingBag` and `TableBatchedTTEmbeddingBag`."""

    # Whether the constructor takes `num_tables` (TableBatchedTTEmbeddingBag: first).
    _takes_num_tables = False

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tt_ranks: int | Sequence[int],
        tt_p_shapes: Sequence[int] | None = None,
        tt_q_shapes: Sequence[int] | None = None,
        combiner: str = "sum",
        padding_id: int | None = None,
        sparse: bool = False,
        optimizer: str = "sgd",
        learning_rate: float = 0.1,
        eps: float = 1e-10,
        use_cache: bool = False,
        cache_size: int = 0,
        hashtbl_size: int = 0,
        weight_dist: str = "approx-uniform",
        seed: int | None = None,
        implementation: str = "auto",
        **kwargs: Any,
    ) -> None:
        num_tables = kwargs.pop("num_tables") if self._takes_num_tables else 1
        num_tables = _args.positive_int("num_tables", num_tables)
        num_embeddings = _args.positive_int("num_embeddings", num_embeddings)
        embedding_dim = _args.positive_int("embedding_dim", embedding_dim)
        p, q, ranks = tt.resolve_shapes(
            num_embeddings, embedding_dim, tt_ranks, tt_p_shapes, tt_q_shapes
        )
        self._shape = _tte.check_shapes(num_embeddings, p, q, ranks, num_tables)
        _args.check_choice("combiner", combiner, _common.COMBINERS)
        _args.check_choice("implementation", implementation, _common.IMPLEMENTATIONS)
        padding_id = _args.layer_padding_id(padding_id, "num_embeddings", num_embeddings)
        _args.check_choice(
            "optimizer", optimizer.lower() if isinstance(optimizer, str) else optimizer, OPTIMIZERS
        )
        if not isinstance(weight_dist, str) or weight_dist not in tt.WEIGHT_DISTS:
            raise ValueError(
                f"weight_dist must be one of {', '.join(repr(w) for w in tt.WEIGHT_DISTS)}, "
                f"got {weight_dist!r}"
            )
        cache_size = _args.positive_int("cache_size", cache_size, minimum=0)
        hashtbl_size = _args.positive_int("hashtbl_size", hashtbl_size, minimum=0)
        if use_cache and cache_size < 1:
            raise ValueError(f"use_cache=True needs cache_size >= 1, got {cache_size!r}")
        if use_cache and hashtbl_size < cache_size:
            raise ValueError(
                f"use_cache=True needs hashtbl_size >= cache_size = {cache_size} (the "
                f"frequency table ranks the candidates), got {hashtbl_size!r}"
            )
        if seed is not None:
            seed = _args.positive_int("seed", seed, minimum=0)
        _common.check_keras_backend(type(self).__name__, keras.backend.backend())
        super().__init__(**kwargs)
        self.num_tables = num_tables
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tt_p_shapes = list(p)
        self.tt_q_shapes = list(q)
        self.tt_ranks = list(ranks)
        self.combiner = combiner
        self.padding_id = padding_id
        self.sparse = bool(sparse)
        self.optimizer = optimizer.lower()
        self.learning_rate = _positive_float("learning_rate", learning_rate)
        self.eps = _positive_float("eps", eps, allow_zero=True)
        self.use_cache = bool(use_cache)
        self.cache_size = cache_size
        self.hashtbl_size = hashtbl_size
        self.weight_dist = weight_dist
        # Fixed at construction (from numpy's global generator, which
        # keras.utils.set_random_seed seeds) so that a layer and its config agree.
        self.seed = int(np.random.randint(0, 2**31 - 1)) if seed is None else seed
        self.implementation = implementation
        if self.sparse and self.dtype_policy.name == "mixed_float16":
            raise ValueError(
                "sparse=True (the update fused into the backward pass) cannot undo the loss "
                "scaling of the mixed_float16 policy; give this layer dtype='float32' or "
                "'mixed_bfloat16', or use sparse=False"
            )
        # The custom ops and the frequency counting have no XLA kernels: keep Keras from
        # jit-compiling a model that uses them. The composite lookup compiles.
        self.supports_jit = implementation == "composite" and not self.use_cache
        self._initial_cores: list | None = None
        self.cores: list = []

    # ------------------------------------------------------------------------------------
    # Variables.

    def build(self, input_shape: Any = None) -> None:
        """Creates the cores, and the cache, frequency table and optimizer state if used."""
        shape = self._shape
        initial = self._initial_cores
        if initial is None:
            initial = tt.initial_cores(
                self.num_embeddings,
                self.embedding_dim,
                self.tt_p_shapes,
                self.tt_q_shapes,
                self.tt_ranks,
                self.weight_dist,
                self.seed,
                self.num_tables,
                np.float64,
            )
        self._initial_cores = None
        trainable = not self.sparse
        self.cores = [
            self._float_state(f"core_{k}", shape.core_shape(k), _constant(initial[k]), trainable)
            for k in range(shape.num_cores)
        ]
        if self.sparse:
            # See the class docstring.
            self.update_trigger = _common.add_update_trigger(self, "fused_update_trigger")
        if self.sparse and self.optimizer == "adagrad":
            self.core_accumulators = [
                self._float_state(f"core_{k}_accumulator", shape.core_shape(k))
                for k in range(shape.num_cores)
            ]
        if self.use_cache:
            cache_shape = (self.cache_size, self.embedding_dim)
            self.cache_ids = self._int64_state(
                "cache_ids", self.cache_size, keras.initializers.Constant(_tte.EMPTY_CACHE_ID)
            )
            self.cache_rows = self._float_state("cache_rows", cache_shape, trainable=trainable)
            self.freq_keys = self._int64_state(
                "freq_keys", self.hashtbl_size, keras.initializers.Constant(-1)
            )
            self.freq_counts = self._int64_state("freq_counts", self.hashtbl_size, "zeros")
            if self.sparse and self.optimizer == "adagrad":
                self.cache_rows_accumulator = self._float_state(
                    "cache_rows_accumulator", cache_shape
                )
        self.built = True

    def _float_state(
        self, name: str, shape: tuple, initializer: Any = "zeros", trainable: bool = False
    ) -> Any:
        """A float weight (a core, the cache rows or their optimizer state), read in the
        variable dtype, never as an autocast copy; see call()."""
        return self.add_weight(
            name=name, shape=shape, initializer=initializer, trainable=trainable, autocast=False
        )

    def _int64_state(self, name: str, size: int, initializer: Any) -> Any:
        """A non-trainable int64 weight [size] of the cache or its frequency table."""
        return self.add_weight(
            name=name, shape=(size,), dtype="int64", initializer=initializer, trainable=False
        )

    # ------------------------------------------------------------------------------------
    # Lookup.

    def _lookup(self, indices: Any, weights: Any, training: Any) -> tf.Tensor:
        served = _common.serving_lookup(self, indices, weights)
        if served is not None:  # tf_ttemb.export_for_serving is tracing the model
            return served
        fused = self.sparse and training is not False
        cores = [_in_place(c) for c in self.cores]
        cache_ids = cache_rows = frequency_table = None
        if self.use_cache:
            cache_ids = tf.convert_to_tensor(self.cache_ids)
            cache_rows = _in_place(self.cache_rows)
            if _is_training(training):
                frequency_table = (self.freq_keys, self.freq_counts)
        if fused:
            trigger = tf.convert_to_tensor(_common.resource_variable(self.update_trigger))
            accumulators = getattr(self, "core_accumulators", [None] * len(cores))
            cores = [self._fused(c, a, trigger) for c, a in zip(cores, accumulators)]
            if self.use_cache:
                cache_rows = self._fused(
                    cache_rows, getattr(self, "cache_rows_accumulator", None), trigger
                )
        output = _tte.tt_embedding_bag(
            cores,
            indices,
            weights,
            num_embeddings=self.num_embeddings,
            **self._shape.op_attrs(),
            combiner=self.combiner,
            padding_id=self.padding_id,
            cache_ids=cache_ids,
            cache_rows=cache_rows,
            frequency_table=frequency_table,
            implementation=self.implementation,
        )
        # Combined in the variables' dtype (float32 under mixed precision); only the
        # result is cast to the compute dtype.
        return tf.cast(output, self.compute_dtype)

    def _fused(self, variable: Any, accumulator: Any, trigger: tf.Tensor) -> tf.Tensor:
        """The value of `variable`, whose gradient updates it in place (sparse=True).

        The value is read here (the variable is not trainable, so no tape watches it) and
        passed through an identity whose gradient applies SGD or Adagrad to the rows the
        gradient touches and returns an empty gradient for `trigger`, the empty trainable
        variable through which every tape reaches this backward pass.
        """
        variable = _common.resource_variable(variable)
        accumulator = None if accumulator is None else _common.resource_variable(accumulator)
        value = tf.convert_to_tensor(variable)
        learning_rate, eps = self.learning_rate, self.eps

        @tf.custom_gradient
        def fused_update(value, trigger):
            def grad(upstream, variables=None):
                # Under a multi-replica strategy each replica updates its own copy of the
                # variable: with the gradient summed over replicas, as an optimizer's
                # would be, every copy takes the same update.
                replica = tf.distribute.get_replica_context()
                if replica is not None and replica.num_replicas_in_sync > 1:
                    upstream = replica.all_reduce("sum", upstream)
                updates = _apply_update(variable, accumulator, upstream, learning_rate, eps)
                # The trigger's (empty) gradient is read from the updated variable: a data
                # dependency, so that the updates run wherever the gradient is used. A
                # control dependency alone is not enough: Grappler folds empty tensors to
                # constants and drops the updates in Model.fit with some optimizers (Adam).
                with tf.control_dependencies(updates):
                    stamp = variable.sparse_read(tf.zeros([0], tf.int32))  # [0, width]
                trigger_grad = tf.reshape(tf.cast(stamp, trigger.dtype), [0])
                return (None, trigger_grad), [None] * len(variables or [])

            return tf.identity(value), grad

        return fused_update(value, trigger)

    # ------------------------------------------------------------------------------------
    # Cache.

    def cache_populate(self) -> None:
        """Fills the cache with the `cache_size` most frequent ids counted so far.

        Ids are ranked by their count in the frequency table (`freq_keys`,
        `freq_counts`; ties go to the smaller global id), the chosen ones sorted into
        `cache_ids` (empty slots hold `2**63 - 1` at the end). A row that was cached and
        stays cached keeps its trained value (and Adagrad state); a newly cached row
        starts from its value in the cores (and a zero Adagrad accumulator). An evicted
        row's cached value is discarded: the row reverts to its value in the cores,
        which were not trained on it while it was cached. The counts are kept (they keep
        accumulating over the whole training). Runs eagerly or inside a `tf.function`.

        Raises:
          ValueError: When the layer has no cache (`use_cache=False`).
        """
        if not self.use_cache:
            raise ValueError("cache_populate() needs a layer built with use_cache=True")
        if not self.built:
            self.build()
        size = self.cache_size
        empty = tf.constant(_tte.EMPTY_CACHE_ID, tf.int64)
        keys = tf.convert_to_tensor(self.freq_keys)
        counts = tf.convert_to_tensor(self.freq_counts)
        live = (keys >= 0) & (counts > 0)
        keys, counts = tf.boolean_mask(keys, live), tf.boolean_mask(counts, live)
        by_id = tf.argsort(keys, stable=True)  # ascending ids, then descending counts:
        keys, counts = tf.gather(keys, by_id), tf.gather(counts, by_id)
        by_count = tf.argsort(counts, direction="DESCENDING", stable=True)
        chosen = tf.sort(tf.gather(keys, by_count)[:size])
        slack = size - tf.shape(chosen)[0]
        new_ids = tf.concat([chosen, tf.fill([slack], empty)], 0)

        old_ids = tf.convert_to_tensor(self.cache_ids)
        old_rows = tf.convert_to_tensor(self.cache_rows)
        position = tf.minimum(tf.searchsorted(old_ids, new_ids, side="left"), size - 1)
        real = tf.not_equal(new_ids, empty)
        stays = real & tf.equal(tf.gather(old_ids, position), new_ids)
        fresh_at = tf.cast(tf.where(real & ~stays)[:, 0], tf.int32)
        fresh_rows = self._rows(tf.gather(new_ids, fresh_at))
        fresh = tf.scatter_nd(fresh_at[:, None], fresh_rows, tf.shape(old_rows))
        new_rows = tf.where(stays[:, None], tf.gather(old_rows, position), fresh)
        self.cache_ids.assign(new_ids)
        self.cache_rows.assign(new_rows)
        if self.sparse and self.optimizer == "adagrad":
            old_state = tf.convert_to_tensor(self.cache_rows_accumulator)
            self.cache_rows_accumulator.assign(
                tf.where(stays[:, None], tf.gather(old_state, position), tf.zeros_like(old_state))
            )

    def cache_contents(self) -> tuple[np.ndarray, np.ndarray]:
        """The cached global ids (sorted, no empty slots) and their rows, as numpy arrays."""
        if not self.use_cache:
            raise ValueError("cache_contents() needs a layer built with use_cache=True")
        ids = self.cache_ids.numpy()
        held = ids != _tte.EMPTY_CACHE_ID
        return ids[held], self.cache_rows.numpy()[held]

    # ------------------------------------------------------------------------------------
    # Full table.

    def _rows(self, ids: tf.Tensor) -> tf.Tensor:
        """Rows of global ids from the cores only (ignoring the cache)."""
        return _tte.tt_rows(
            [_in_place(c) for c in self.cores],
            ids,
            **self._shape.op_attrs(),
            implementation=self.implementation,
        )

    def _full_weight(self) -> tf.Tensor:
        """[num_tables, num_embeddings, embedding_dim]; see `full_weight`."""
        if not self.built:
            self.build()
        shape = self._shape
        chunk = max(1, composite.COMPOSITE_CHUNK_BYTES // (4 * self.embedding_dim))
        cache_ids = cache_rows = None
        if self.use_cache:
            cache_ids = tf.convert_to_tensor(self.cache_ids)
            cache_rows = tf.convert_to_tensor(self.cache_rows)
        tables = []
        for t in range(self.num_tables):
            parts = []
            for start in range(0, self.num_embeddings, chunk):
                stop = min(self.num_embeddings, start + chunk)
                ids = tf.range(start, stop, dtype=tf.int64) + t * shape.rows_per_table
                parts.append(
                    _tte.rows_with_cache(ids, self._rows, cache_ids, cache_rows, xla=False)
                )
            tables.append(tf.concat(parts, 0))
        return tf.stack(tables)

    # ------------------------------------------------------------------------------------
    # Construction from given cores, and Keras plumbing.

    @classmethod
    def from_cores(
        cls,
        cores: Sequence[Any],
        num_embeddings: int,
        tt_p_shapes: Sequence[int],
        tt_q_shapes: Sequence[int],
        tt_ranks: Sequence[int],
        **kwargs: Any,
    ) -> _TTEmbeddingBagBase:
        """A built layer whose cores hold the given values (e.g. from `tt.from_dense`).

        Args:
          cores: T arrays (or tensors) `[num_tables * p_k, r_k * q_k * r_{k+1}]`.
          num_embeddings: Rows of each table.
          tt_p_shapes, tt_q_shapes, tt_ranks: The factorisation the cores follow.
          **kwargs: The layer's other constructor arguments (`combiner`, `sparse`,
            `num_tables` for the table-batched layer, ...).

        Raises:
          ValueError: When a core's shape does not match the factorisation (quoted).
        """
        q = list(tt_q_shapes)
        layer = cls(
            num_embeddings=num_embeddings,
            embedding_dim=math.prod(q),
            tt_ranks=list(tt_ranks),
            tt_p_shapes=list(tt_p_shapes),
            tt_q_shapes=q,
            **kwargs,
        )
        values = [np.asarray(c) for c in cores]
        shape = layer._shape
        if len(values) != shape.num_cores:
            raise ValueError(
                f"expected {shape.num_cores} cores for tt_p_shapes {list(shape.p)}, got "
                f"{len(values)}"
            )
        for k, value in enumerate(values):
            if value.shape != shape.core_shape(k):
                raise ValueError(
                    f"cores[{k}] must have shape {list(shape.core_shape(k))} "
                    f"([num_tables * p_{k}, r_{k} * q_{k} * r_{k + 1}]), got {list(value.shape)}"
                )
        layer._initial_cores = values
        layer.build()
        return layer

    def _output_shape(self, input_shape: Any) -> tuple:
        if (
            isinstance(input_shape, (list, tuple))
            and input_shape
            and isinstance(input_shape[0], (list, tuple))
        ):  # a list of per-table shapes [B, L]
            return (len(input_shape), input_shape[0][0], self.embedding_dim)
        return tuple(input_shape)[:-1] + (self.embedding_dim,)

    def get_config(self) -> dict:
        config = super().get_config()
        config.update(_common.constructor_config(self, _TTEmbeddingBagBase))
        return config


def _constant(value: np.ndarray):
    """An initializer returning `value` (cast to the variable dtype)."""

    def initializer(shape: Any, dtype: Any = None) -> tf.Tensor:
        return tf.cast(tf.constant(value), dtype or tf.float32)

    return initializer


def _apply_update(variable, accumulator, grad, learning_rate: float, eps: float) -> list:
    """SGD (`w -= lr g`) or Adagrad (`acc += g^2; w -= lr g / (sqrt(acc) + eps)`) in place.

    A `tf.IndexedSlices` gradient updates only its rows (duplicates summed first); a dense
    one updates every row (rows with a zero gradient are unchanged by both rules).
    """
    dtype = variable.dtype
    rate = tf.constant(learning_rate, dtype)
    # Densified under XLA for Adagrad, which needs each row once.
    grad, indices, values = _common.deduplicated_rows(variable, grad, accumulator is not None)
    if isinstance(grad, tf.IndexedSlices):
        if accumulator is None:
            return [variable.scatter_sub(tf.IndexedSlices(rate * values, indices))]
        state = _common.accumulated(accumulator, values * values, indices)
        step = rate * values / (tf.sqrt(state) + tf.constant(eps, dtype))
        return [variable.scatter_sub(tf.IndexedSlices(step, indices))]
    grad = tf.cast(tf.convert_to_tensor(grad), dtype)
    if accumulator is None:
        return [variable.assign_sub(rate * grad)]
    state = _common.accumulated(accumulator, grad * grad)
    return [variable.assign_sub(rate * grad / (tf.sqrt(state) + tf.constant(eps, dtype)))]


_COMMON_ARGS = """
      tt_ranks: Inner TT ranks [r_1, ..., r_{T-1}], or one int for all of them.
      tt_p_shapes: Row factors (prod >= num_embeddings), or None to choose them
        (`tf_ttemb.tt.resolve_shapes`).
      tt_q_shapes: Column factors (prod == embedding_dim), or None to choose them.
      combiner: "sum", "mean", "sqrtn" or "max" (max takes no weights).
      padding_id: Optional id whose entries are ignored (not counted by mean/sqrtn, no
        gradient): -1 or a row in [0, num_embeddings).
      sparse: Fuse the optimizer step into the backward pass: the cores (and cache rows)
        are not trainable and are updated in place by `optimizer` with `learning_rate`
        on the rows the batch touched whenever a gradient is taken through the lookup;
        see "Fused update" below.
      optimizer: "sgd" (`w -= lr * g`) or "adagrad" (`acc += g * g; w -= lr * g /
        (sqrt(acc) + eps)`, accumulators start at 0) for `sparse=True`.
      learning_rate: Learning rate of the fused update.
      eps: Adagrad's epsilon.
      use_cache: Keep a cache of `cache_size` decompressed rows (trainable `cache_rows`)
        for the most frequent ids; see "Cache" below.
      cache_size: Rows in the cache (>= 1 with `use_cache`).
      hashtbl_size: Slots of the frequency table (>= cache_size with `use_cache`).
      weight_dist: Initial distribution, one of `tf_ttemb.tt.WEIGHT_DISTS`; the default
        "approx-uniform" gives table entries U(-1/sqrt(N), 1/sqrt(N)) (see
        `tf_ttemb.tt.initial_cores`).
      seed: Seed of the initial cores (None: drawn from numpy's global generator, which
        `keras.utils.set_random_seed` seeds; the drawn seed is kept in the config).
      implementation: "auto", "custom_op" or "composite"; see
        `tf_ttemb.ops.tt_embedding.tt_embedding_bag`.
      **kwargs: Base `keras.layers.Layer` arguments (`name`, `dtype`, `trainable`, ...).

    Fused update (`sparse=True`): the cores are non-trainable variables, and an empty
    trainable variable `fused_update_trigger` (shape [0]) is the handle through which
    `Model.fit`, a `tf.GradientTape` loop over `model.trainable_variables` (eager or in a
    `tf.function`) reach the lookup's backward pass. That backward pass computes the
    core (and cache row) gradients, applies the update to the rows they touch, and
    returns an empty gradient for the trigger, on which the Keras optimizer's step is a
    no-op. So: each gradient computation through a training-mode lookup updates the
    layer once (a persistent tape asked twice updates twice); a gradient that does not
    ask for the trigger variable does not update; calls with `training=False` never do.
    The fused update sees the raw gradient: it cannot undo Keras's loss scaling, so a
    `mixed_float16` layer with `sparse=True` is refused (and a model trained with loss
    scaling must not contain one).

    Cache (`use_cache=True`): non-trainable `cache_ids` (sorted global ids, `2**63 - 1`
    for an empty slot), `cache_rows` (trainable unless `sparse`), and a bounded
    frequency table `freq_keys` / `freq_counts` (set-associative, space-saving; op
    `TTCacheCount`). Every training-mode call (`training=True`, as in `Model.fit`) counts
    the ids of its batch; inference, evaluation, serving and calls without
    `training=True` never change the counts. Lookups of cached ids read `cache_rows`
    (and train them) instead of the cores; nothing changes which ids are cached until
    `cache_populate()` is called (see it for what happens to staying, new and evicted
    rows). Counting has no XLA kernel, so a cache layer does not support
    `jit_compile` in training.

    Works in `Model.fit`, under `mixed_float16` / `mixed_bfloat16` (the variables stay
    float32; rows are combined in float32 and only the result is cast), through
    `get_config` / `.keras` files and in SavedModels served after `import tf_ttemb`.
    With `implementation="composite"` (and no cache) it compiles under XLA."""


@keras.saving.register_keras_serializable(package="tf_ttemb")
class TTEmbeddingBag(_TTEmbeddingBagBase):
    __doc__ = (
        """An EmbeddingBag whose [num_embeddings, embedding_dim] table is a TT decomposition.

    Row i of the table is the product of one block of each core (digits of i, most
    significant first; see `docs/tt_embedding_contract.md`). Only the distinct rows of a
    batch are decompressed; a bag is combined like `tf_ttemb.layers.EmbeddingBag` (same
    id forms, weights, combiners and padding). The cores are variables `core_k` of shape
    `[p_k, r_k * q_k * r_{k+1}]`.

    Args:
      num_embeddings: Rows of the table (ids lie in [0, num_embeddings)).
      embedding_dim: Size of each embedding."""
        + _COMMON_ARGS
        + """

    Call arguments:
      indices: Dense [..., L] (output [..., embedding_dim]), `tf.RaggedTensor` [B, (L)]
        or 2-D `tf.SparseTensor` (output [B, embedding_dim]) ids, int32 or int64.
      weights: Optional per-entry weights with the structure of `indices`.
      training: Whether this is a training step (counts ids for the cache).

    Example:

    >>> import numpy as np
    >>> import tensorflow as tf
    >>> from tf_ttemb import tt
    >>> from tf_ttemb.layers import TTEmbeddingBag
    >>> layer = TTEmbeddingBag(1000, 16, tt_ranks=[4, 4], combiner="mean", seed=1,
    ...                        implementation="composite")
    >>> layer(tf.ragged.constant([[1, 999, 5], []])).shape
    TensorShape([2, 16])
    >>> layer.tt_p_shapes, layer.tt_q_shapes, [tuple(c.shape) for c in layer.cores]
    ([10, 10, 10], [2, 2, 4], [(10, 8), (10, 32), (10, 16)])
    >>> layer.full_weight().shape
    TensorShape([1000, 16])
    >>> # From a dense table (TT-SVD): exact at full rank.
    >>> table = np.random.default_rng(0).normal(size=(12, 6))
    >>> decomposition = tt.from_dense(table, [6], [3, 4], [2, 3])
    >>> exact = TTEmbeddingBag.from_decomposition(decomposition, 12, dtype="float64",
    ...                                           implementation="composite")
    >>> bool(np.allclose(exact.full_weight().numpy(), table))
    True
    """
    )

    def call(self, indices: Any, weights: Any = None, training: bool | None = None) -> tf.Tensor:
        """Combines the rows of each bag of `indices`; see the class docstring."""
        return self._lookup(indices, weights, training)

    def full_weight(self) -> tf.Tensor:
        """The decompressed table [num_embeddings, embedding_dim] (variable dtype).

        Computed a chunk of rows at a time from the cores; rows held in the cache take
        their cached value (the one lookups use).
        """
        return self._full_weight()[0]

    @classmethod
    def from_decomposition(
        cls, decomposition: tt.TTDecomposition, num_embeddings: int, **kwargs: Any
    ) -> TTEmbeddingBag:
        """A built layer holding the cores of `tf_ttemb.tt.from_dense(...)`'s result.

        Args:
          decomposition: A `tt.TTDecomposition` (its cores, p, q and ranks).
          num_embeddings: Rows of the table that was decomposed.
          **kwargs: The layer's other constructor arguments.
        """
        return cls.from_cores(
            decomposition.cores,
            num_embeddings,
            decomposition.p_shapes,
            decomposition.q_shapes,
            decomposition.ranks,
            **kwargs,
        )

    def compute_output_shape(self, input_shape: Any) -> tuple:
        """[..., L] ids give [..., embedding_dim]; ragged and sparse [B, L] give [B, D]."""
        return self._output_shape(input_shape)


@keras.saving.register_keras_serializable(package="tf_ttemb")
class TableBatchedTTEmbeddingBag(_TTEmbeddingBagBase):
    __doc__ = (
        """`num_tables` TT tables of one shape, looked up together in one op call.

    Table t owns rows `t * p_k ... (t + 1) * p_k - 1` of every core (variables `core_k`
    of shape `[num_tables * p_k, r_k * q_k * r_{k+1}]`); the tables are independent
    (each initialised on its own) and share one cache and frequency table, which hold
    global ids `t * prod(p) + id`.

    Args:
      num_tables: Number of tables.
      num_embeddings: Rows of each table.
      embedding_dim: Size of each embedding."""
        + _COMMON_ARGS
        + """

    Call arguments:
      indices: Dense ids [num_tables, ..., L] (output [num_tables, ..., embedding_dim])
        or a list of num_tables ragged, sparse or dense [B, L] ids with the same B
        (output [num_tables, B, embedding_dim]).
      weights: Optional weights with the structure of `indices`.
      training: Whether this is a training step (counts ids for the cache).

    Example:

    >>> import tensorflow as tf
    >>> from tf_ttemb.layers import TableBatchedTTEmbeddingBag
    >>> layer = TableBatchedTTEmbeddingBag(3, 100, 8, tt_ranks=4, seed=0,
    ...                                    implementation="composite")
    >>> layer(tf.zeros([3, 5, 2], tf.int64)).shape
    TensorShape([3, 5, 8])
    >>> ids = [tf.ragged.constant([[1, 2], []])] * 3
    >>> layer(ids).shape
    TensorShape([3, 2, 8])
    >>> layer.full_weight().shape
    TensorShape([3, 100, 8])
    """
    )

    _takes_num_tables = True

    def __init__(self, num_tables: int, *args: Any, **kwargs: Any) -> None:
        """The arguments of the class docstring: `num_tables` first, then those of
        `TTEmbeddingBag`."""
        super().__init__(*args, num_tables=num_tables, **kwargs)

    def call(self, indices: Any, weights: Any = None, training: bool | None = None) -> tf.Tensor:
        """Combines the rows of each bag of each table; see the class docstring."""
        return self._lookup(indices, weights, training)

    def full_weight(self) -> tf.Tensor:
        """The decompressed tables [num_tables, num_embeddings, embedding_dim] (variable dtype).

        Computed a chunk of rows at a time; cached rows take their cached value.
        """
        return self._full_weight()

    def compute_output_shape(self, input_shape: Any) -> tuple:
        """[num_tables, ..., L] gives [num_tables, ..., D]; a list gives [num_tables, B, D]."""
        return self._output_shape(input_shape)

    def get_config(self) -> dict:
        config = super().get_config()
        config["num_tables"] = self.num_tables
        return config
