"""The Keras 3 GroupedEmbeddingBag layer: every sparse feature of a model, each with its own
table, looked up together (one lookup per embedding width and combiner)."""

from __future__ import annotations

import copy
import math
import numbers
from typing import Any

import keras
import tensorflow as tf

from tf_ttemb import _args
from tf_ttemb import distribute as _distribute
from tf_ttemb.ops import _common
from tf_ttemb.ops import grouped as _grouped
from tf_ttemb.ops import sparse_apply as _sparse_apply

_KEYS = ("name", "input_dim", "output_dim", "combiner", "initializer", "padding_id", "table")
OPTIMIZERS = ("sgd", "rowwise_adagrad", "adagrad")
PLACEMENTS = ("stacked", "table")


def _non_negative(name: str, value: Any, positive: bool) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value < 0
        or (positive and value == 0)
    ):
        kind = "a positive" if positive else "a non-negative"
        raise ValueError(f"{name} must be {kind} finite number, got {value!r}")
    return float(value)


def _initializer_config(initializer: Any) -> dict:
    """The initializer's Keras config, as a dict of this layer's own.

    Inside Keras's object-sharing scope (all of `keras.models.load_model`),
    `keras.initializers.serialize` records the dict it returns by the `id()` of the
    object, and tags it (and the dict recorded before) with a `shared_object_id` when an
    id comes again. A temporary initializer's id can be reused by the next feature's, so
    the key would depend on the allocator: the config is copied and the key dropped.
    """
    config = copy.deepcopy(keras.initializers.serialize(keras.initializers.get(initializer)))
    if isinstance(config, dict):
        config.pop("shared_object_id", None)
    return config


def _feature(config: Any, position: int) -> dict:
    """One feature config, checked and completed with its defaults."""
    if not isinstance(config, dict):
        raise ValueError(f"features[{position}] must be a dict, got {type(config).__name__}")
    unknown = sorted(set(config) - set(_KEYS))
    if unknown:
        raise ValueError(
            f"features[{position}] has unknown keys {unknown}; the keys are {list(_KEYS)}"
        )
    if "name" not in config or not isinstance(config["name"], str) or not config["name"]:
        raise ValueError(f"features[{position}] needs a 'name' (a non-empty string)")
    name = config["name"]
    input_dim = _args.positive_int(
        f"features[{position}] ({name}): input_dim", config.get("input_dim")
    )
    output_dim = _args.positive_int(
        f"features[{position}] ({name}): output_dim", config.get("output_dim")
    )
    combiner = config.get("combiner", "sum")
    _args.check_choice(f"features[{position}] ({name}): combiner", combiner, _common.COMBINERS)
    padding_id = _args.layer_padding_id(config.get("padding_id"), "input_dim", input_dim)
    initializer = config.get("initializer", "uniform")
    return dict(
        name=name,
        input_dim=input_dim,
        output_dim=output_dim,
        combiner=combiner,
        initializer=_initializer_config(initializer),
        padding_id=padding_id,
        table=config.get("table") or name,
    )


@keras.saving.register_keras_serializable(package="tf_ttemb")
class GroupedEmbeddingBag(keras.layers.Layer):
    """Embedding bags of many sparse features, each feature with its own table, in one layer.

    The tables of one embedding width are stacked by rows in one variable
    (`embeddings_<width>`), and the features of one width and combiner are looked up
    together by `tf_ttemb.grouped_gather_reduce_sum`: one fused lookup, one
    deduplicated `tf.IndexedSlices` gradient over the stacked table, where separate
    `EmbeddingBag` layers would run one of each per feature. A DLRM-style model with 26
    sparse features of width 64 and sum bags makes one lookup.

    Each feature config is a dict:
      * `name` (required): the feature's name, the key of its ids in a dict input;
      * `input_dim`, `output_dim` (required): its table's rows and width;
      * `combiner`: "sum" (default), "mean", "sqrtn" or "max";
      * `initializer`: its table's initializer (default "uniform");
      * `padding_id`: None (default), -1 or a row in [0, input_dim), ignored in bags;
      * `table`: the name of its table (default: the feature's name). Features with
        the same table share it and must agree on input_dim, output_dim and initializer.

    With `placement="table"` each table is a variable of its own instead
    (`embeddings_<table>`, in `layer.table_variables`), looked up together with the
    other tables of its width as the pieces of one stack (row for row the stacked
    layout): for `ParameterServerStrategy`, which then places tables, not stacks, on the
    parameter servers. On one device "stacked" (the default) is faster: one lookup per
    width rather than one per table.

    Under `tf.distribute.ParameterServerStrategy` each variable (a stack, or a table with
    `placement="table"`) is placed whole on a parameter server, or, with a
    `variable_partitioner`, is a `ShardedVariable` split by rows (anywhere, inside a
    table too): the layer then looks it up with
    `tf_ttemb.distribute.sharded_grouped_gather_reduce_sum`, each shard's or table's part
    on the parameter server that holds it, and each shard gets its own
    `tf.IndexedSlices` gradient (differentiate w.r.t. the shards,
    `tf_ttemb.distribute.shards_of(v) or [v]` for each of `layer.trainable_variables`).
    See `docs/distribute.md`.

    Fused update (`sparse=True`): the stacks are non-trainable and the backward pass
    updates the rows it read in place, every table of a lookup in one
    `tf_ttemb.ops.grouped.grouped_gather_reduce_sum_sparse_apply` call (no [rows, D]
    gradient is materialised and the model's optimizer never sees the tables). With `g`
    a row's summed gradient and `lr = learning_rate`: "sgd": `w -= lr * g`;
    "rowwise_adagrad": `a += mean(g**2); w -= lr * g / (sqrt(a) + eps)`, one accumulator
    per row (`accumulators_<width>`, [rows]); "adagrad": the same per element
    ([rows, width]); accumulators start at 0. An empty trainable variable
    `fused_update_trigger` is the handle through which tapes (and `Model.fit`) reach the
    update; calls with `training=False` never update. Each row gets one update per step
    (features sharing a table must then share a combiner). The fused update runs the
    custom op only: not under XLA, and not with a `mixed_float16` policy (it cannot undo
    the loss scaling). Under `tf.distribute.MirroredStrategy` (`Model.fit` or
    `strategy.run`) every replica applies the update of all replicas' bags to its copy
    of the stacks, so the copies stay equal and a step equals one device's step on the
    whole batch (the replicas' gradients summed, as Keras sums them); outside replica
    context the stacks are only read. Other multi-replica strategies raise a ValueError
    naming them (see `docs/distribute.md`).

    Under mixed precision the tables stay in the variable dtype and the result is cast
    to the compute dtype. With `implementation="auto"` or `"custom_op"` the layer
    reports `supports_jit = False` (the custom op has no XLA kernel); "composite"
    compiles under XLA.

    Args:
      features: The feature configs, in output order (at least one).
      output_mode: "concat" (default): one [B, sum of widths] tensor, the features'
        embeddings in config order; "list": one [B, width] tensor per feature.
      dense_grad: Whether the tables' gradients are dense rather than IndexedSlices.
      implementation: "auto", "custom_op" or "composite"; see
        `tf_ttemb.gather_reduce_sum`.
      sparse: Fuse the optimizer step into the backward pass (see above).
      placement: "stacked" (default): one variable per embedding width; "table": one
        variable per table (see above; not with `sparse=True`).
      optimizer: With `sparse=True`: "sgd" (default), "rowwise_adagrad" or "adagrad".
      learning_rate: Of the fused update, a positive number (default 0.1).
      eps: The Adagrads' epsilon, >= 0 (default 1e-10).
      **kwargs: Base `keras.layers.Layer` arguments.

    Call arguments:
      inputs: The features' ids: a dict keyed by feature name, or a list in config
        order; each dense [B, L], a `tf.RaggedTensor` [B, (L)] or a 2-D
        `tf.SparseTensor`, all with the same B.
      weights: Optional per-entry weights: a dict (features left out weigh 1) or a list
        with None for unweighted features.

    Example:

    >>> import tensorflow as tf
    >>> from tf_ttemb.layers import GroupedEmbeddingBag
    >>> layer = GroupedEmbeddingBag([
    ...     {"name": "user", "input_dim": 100, "output_dim": 8},
    ...     {"name": "item", "input_dim": 50, "output_dim": 8, "combiner": "mean"},
    ...     {"name": "history", "input_dim": 50, "output_dim": 8, "table": "item"},
    ... ])
    >>> out = layer({"user": tf.constant([[3], [7]]),
    ...              "item": tf.constant([[1, 2], [4, 4]]),
    ...              "history": tf.ragged.constant([[1, 2, 3], []])})
    >>> out.shape
    TensorShape([2, 24])
    >>> sorted(v.name for v in layer.trainable_variables)
    ['embeddings_8']
    """

    def __init__(
        self,
        features: list,
        output_mode: str = "concat",
        dense_grad: bool = False,
        implementation: str = "auto",
        sparse: bool = False,
        optimizer: str = "sgd",
        learning_rate: float = 0.1,
        eps: float = 1e-10,
        placement: str = "stacked",
        **kwargs: Any,
    ) -> None:
        features = [_feature(f, t) for t, f in enumerate(list(features))]
        if not features:
            raise ValueError("features must hold at least one feature config")
        names = [f["name"] for f in features]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"feature names must be distinct, got {repeated} more than once")
        tables: dict = {}
        for f in features:
            shape = (f["input_dim"], f["output_dim"], repr(f["initializer"]))
            if tables.setdefault(f["table"], shape) != shape:
                raise ValueError(
                    f"features sharing table {f['table']!r} must agree on input_dim, "
                    f"output_dim and initializer; {f['name']!r} has {shape[:2]}, the table "
                    f"{tables[f['table']][:2]}"
                )
        _args.check_choice("output_mode", output_mode, ("concat", "list"))
        _args.check_choice("implementation", implementation, _common.IMPLEMENTATIONS)
        _args.check_choice("optimizer", optimizer, OPTIMIZERS)
        _args.check_choice("placement", placement, PLACEMENTS)
        if placement == "table":
            if sparse:
                raise ValueError(
                    "placement='table' does not take sparse=True (the fused update runs on "
                    "one variable per width); use placement='stacked'"
                )
            slashed = sorted({f["table"] for f in features if "/" in f["table"]})
            if slashed:
                raise ValueError(
                    f"with placement='table' the tables name variables, so table names "
                    f"cannot hold '/', got {slashed}"
                )
        learning_rate = _non_negative("learning_rate", learning_rate, positive=True)
        eps = _non_negative("eps", eps, positive=False)
        sparse = bool(sparse)
        if sparse:
            _check_fused(features, dense_grad, implementation)
            _sparse_apply.check_strategy("GroupedEmbeddingBag(sparse=True)")
        _common.check_keras_backend("GroupedEmbeddingBag", keras.backend.backend())
        super().__init__(**kwargs)
        self.features = features
        self.output_mode = output_mode
        self.dense_grad = bool(dense_grad)
        self.implementation = implementation
        self.sparse = sparse
        self.optimizer = optimizer
        self.learning_rate = learning_rate
        self.eps = eps
        self.placement = placement
        if sparse and self.dtype_policy.name == "mixed_float16":
            raise ValueError(
                "sparse=True (the update fused into the backward pass) cannot undo the loss "
                "scaling of the mixed_float16 policy; give this layer dtype='float32' or "
                "'mixed_bfloat16', or use sparse=False"
            )
        # Pieces of a stack are looked up with masks of dynamic shape: no XLA.
        self.supports_jit = implementation == "composite" and not sparse and placement == "stacked"
        # Tables per width, in first-use order, each with its first row in the stack.
        self._tables: dict = {}  # table name -> (width, row offset, rows, initializer)
        rows_of_width: dict = {}
        for f in features:
            if f["table"] in self._tables:
                continue
            width = f["output_dim"]
            offset = rows_of_width.get(width, 0)
            self._tables[f["table"]] = (width, offset, f["input_dim"], f["initializer"])
            rows_of_width[width] = offset + f["input_dim"]
        self._rows_of_width = rows_of_width
        # Lookups: features of one width and combiner, in config order.
        self._groups: dict = {}
        for t, f in enumerate(features):
            self._groups.setdefault((f["output_dim"], f["combiner"]), []).append(t)

    def build(self, input_shape: Any = None) -> None:
        """Creates one stacked table per embedding width, or one variable per table with
        `placement="table"` (input shape unused)."""
        self.stacked = {}
        self.table_variables = {}
        for name, (width, _, rows, init) in self._tables.items():
            if self.placement != "table":
                break
            self.table_variables[name] = self.add_weight(
                name=f"embeddings_{name}",
                shape=(rows, width),
                initializer=keras.initializers.deserialize(init),
                autocast=False,
            )
        for width, rows in self._rows_of_width.items():
            if self.placement == "table":
                break
            parts = [
                (offset, count, keras.initializers.deserialize(init))
                for (w, offset, count, init) in self._tables.values()
                if w == width
            ]

            def initializer(shape, dtype=None, parts=parts, width=width):
                return tf.concat([init((count, width), dtype=dtype) for _, count, init in parts], 0)

            self.stacked[width] = self.add_weight(
                name=f"embeddings_{width}",
                shape=(rows, width),
                initializer=initializer,
                trainable=not self.sparse,
                autocast=False,
            )
        self.accumulators = {}
        if self.sparse:
            self.update_trigger = _common.add_update_trigger(self, "fused_update_trigger")
            accumulator_dtype = "float64" if self.variable_dtype == "float64" else "float32"
            for width, rows in self._rows_of_width.items():
                if self.optimizer != "sgd":
                    self.accumulators[width] = self.add_weight(
                        name=f"accumulators_{width}",
                        shape=(rows,) if self.optimizer == "rowwise_adagrad" else (rows, width),
                        initializer="zeros",
                        dtype=accumulator_dtype,
                        trainable=False,
                        autocast=False,
                    )
        self.built = True

    def table(self, name: str) -> tf.Tensor:
        """The current value of one table, [input_dim, output_dim] (a slice of its stack)."""
        if name not in self._tables:
            raise ValueError(f"no table {name!r}; the tables are {list(self._tables)}")
        width, offset, rows, _ = self._tables[name]
        if self.placement == "table":
            return tf.convert_to_tensor(self.table_variables[name])
        return self.stacked[width][offset : offset + rows]

    def _pieces(self, width: int) -> Any:
        """The table of `width` to look up: its stack, or with placement="table" its
        tables' variables (or their shards) in row order, as the pieces of one stack."""
        if self.placement != "table":
            return self.stacked[width]
        pieces = []
        for name, (w, _, _, _) in self._tables.items():
            if w == width:
                variable = self.table_variables[name]
                pieces += _distribute.shards_of(variable) or [variable.value]
        return pieces if len(pieces) > 1 else pieces[0]

    def _by_feature(self, values: Any, what: str, required: bool) -> list:
        names = [f["name"] for f in self.features]
        if isinstance(values, dict):
            unknown = sorted(set(values) - set(names))
            if unknown:
                raise ValueError(f"{what} has unknown features {unknown}; the features are {names}")
            missing = [n for n in names if n not in values]
            if required and missing:
                raise ValueError(f"{what} is missing features {missing}")
            return [values.get(n) for n in names]
        values = list(values)
        if len(values) != len(names):
            raise ValueError(
                f"{what} must have one entry per feature ({len(names)}), got {len(values)}"
            )
        return values

    def call(self, inputs: Any, weights: Any = None, training: Any = None) -> Any:
        """The features' bags combined; see the class docstring."""
        ids = self._by_feature(inputs, "inputs", required=True)
        per_feature = (
            [None] * len(ids)
            if weights is None
            else self._by_feature(weights, "weights", required=False)
        )
        outputs: list = [None] * len(self.features)
        for (width, combiner), members in self._groups.items():
            group_weights = [per_feature[t] for t in members]
            if all(w is None for w in group_weights):
                group_weights = None
            group = dict(
                num_rows=[self.features[t]["input_dim"] for t in members],
                row_offsets=[self._tables[self.features[t]["table"]][1] for t in members],
                combiner=combiner,
                padding_ids=[self.features[t]["padding_id"] for t in members],
                labels=[self.features[t]["name"] for t in members],
            )
            # Outside replica context a mirrored stack has no one copy to update (Keras
            # calls the layer there to build a model under a strategy's scope): it is read.
            fused = self.sparse and training is not False
            if fused and tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context():
                fused = False
            if fused:
                out = _grouped.grouped_gather_reduce_sum_sparse_apply(
                    self.stacked[width],
                    [ids[t] for t in members],
                    group_weights,
                    trigger=tf.convert_to_tensor(_common.resource_variable(self.update_trigger)),
                    optimizer=self.optimizer,
                    learning_rate=self.learning_rate,
                    accumulator=self.accumulators.get(width),
                    epsilon=self.eps,
                    **group,
                )
            else:
                # A stack sharded by ParameterServerStrategy's variable_partitioner is
                # looked up shard by shard where each shard lives; an unsharded one in one
                # call.
                out = _distribute.sharded_grouped_gather_reduce_sum(
                    self._pieces(width),
                    [ids[t] for t in members],
                    group_weights,
                    dense_grad=self.dense_grad,
                    implementation=self.implementation,
                    **group,
                )
            out = tf.cast(out, self.compute_dtype)
            if len(self._groups) == 1 and self.output_mode == "concat":
                return out
            for i, part in enumerate(tf.split(out, len(members), axis=1)):
                outputs[members[i]] = part
        if self.output_mode == "list":
            return outputs
        return tf.concat(outputs, axis=1)

    def compute_output_shape(self, input_shape: Any) -> Any:
        widths = [f["output_dim"] for f in self.features]
        if self.output_mode == "list":
            return [(None, w) for w in widths]
        return (None, sum(widths))

    def get_config(self) -> dict:
        config = super().get_config()
        config.update(
            features=[dict(f) for f in self.features],
            output_mode=self.output_mode,
            dense_grad=self.dense_grad,
            implementation=self.implementation,
            sparse=self.sparse,
            optimizer=self.optimizer,
            learning_rate=self.learning_rate,
            eps=self.eps,
            placement=self.placement,
        )
        return config


def _check_fused(features: list, dense_grad: bool, implementation: str) -> None:
    """The layer arguments sparse=True cannot take (ValueError naming them)."""
    if dense_grad:
        raise ValueError("dense_grad=True does not apply with sparse=True (no table gradient)")
    if implementation == "composite":
        raise ValueError(
            "sparse=True runs the custom op (the fused update has no composite form); "
            "implementation must be 'auto' or 'custom_op', got 'composite'"
        )
    combiners: dict = {}
    for f in features:
        first = combiners.setdefault(f["table"], (f["name"], f["combiner"]))
        if first[1] != f["combiner"]:
            raise ValueError(
                f"with sparse=True the features sharing table {f['table']!r} must share a "
                f"combiner (one fused update per row and step); {first[0]!r} has "
                f"{first[1]!r}, {f['name']!r} has {f['combiner']!r}"
            )
