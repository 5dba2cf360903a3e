"""Serving without the op library: a SavedModel that stock TensorFlow loads and runs.

`export_for_serving(model, path)` traces a Keras model holding tf_ttemb layers into an
inference-only SavedModel whose graph holds no `TfTtemb>` op, so TF Serving, managed
serving platforms, or a Python process that never imports tf_ttemb can serve it. While
it traces, each of our layers reads its table through a plain-TensorFlow substitute
(`serving_table`), chosen per layer:

* `EmbeddingBag` tables and `ProductKeyMemory` values: the layer's own variable, read
  by the composite implementation of `tf_ttemb.gather_reduce_sum` (or, with
  `quantize`, an int8 or float16 copy read by
  `tf_ttemb.ops.quantized.quantized_gather_reduce_sum`);
* `TTEmbeddingBag` and `TableBatchedTTEmbeddingBag`: the table decompressed to dense
  (`full_weight()`, cached rows included) when it is at most `tt_dense_max_mib`, read
  as above; otherwise the cores, whose rows the composite `tt_embedding_bag`
  decompresses per batch, with the cached rows kept beside them (only the filled cache
  slots; ids served from the cache exactly as the layer serves them).

Everything else in the model (Keras layers, the product-key memory's query network and
top-k) is traced as Keras traces it, with `training=False`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tf_ttemb import _args, _serving_hook, layers
from tf_ttemb._serving_hook import serving_table  # noqa: F401 (the layers call it; kept here too)
from tf_ttemb.ops import _bags
from tf_ttemb.ops import quantized as _quantized
from tf_ttemb.ops.gather_reduce_sum import gather_reduce_sum
from tf_ttemb.ops.tt_embedding import tt_embedding_bag

FORMS = ("dense", "ragged", "sparse")
QUANTIZE_MODES = (None,) + _quantized.MODES
DEFAULT_TT_DENSE_MAX_MIB = 64.0

_CUSTOM_OP_PREFIX = "TfTtemb>"
_MIB = float(1 << 20)


@dataclasses.dataclass(frozen=True)
class ExportedTable:
    """How one layer's table was exported.

    Attributes:
      layer: The layer's name.
      layer_class: Its class name.
      kind: "dense" (float rows, in the variables' dtype), "int8" or "float16" (row
        quantised), or "tt_rows" (TT cores; rows decompressed per batch).
      shape: The table's logical shape: [N, D], or [num_tables, N, D].
      nbytes: Bytes of the exported table's variables (codes, scales and biases; cores
        and cached rows for "tt_rows").
      dense_nbytes: Bytes of the same table dense in the layer's variable dtype.
    """

    layer: str
    layer_class: str
    kind: str
    shape: tuple
    nbytes: int
    dense_nbytes: int


@dataclasses.dataclass(frozen=True)
class ServingExport:
    """What `export_for_serving` wrote.

    Attributes:
      path: The SavedModel directory.
      signatures: Signature name -> its input keys, in order ("serving_default" first).
      outputs: The output keys every signature returns.
      tables: One `ExportedTable` per tf_ttemb layer of the model.
    """

    path: str
    signatures: dict
    outputs: tuple
    tables: tuple

    @property
    def table_nbytes(self) -> int:
        """Bytes of all exported tables."""
        return sum(t.nbytes for t in self.tables)


# ----------------------------------------------------------------------------------------
# The substitutes the layers read their tables through while the model is traced.


def _per_table(one: Callable, num_tables: int, indices: Any, weights: Any) -> tf.Tensor:
    """The lookup of table t by `one(t, ids, weights)`, stacked over the tables as the TT
    layers stack them (dense [num_tables, ..., L] or a list of num_tables ids)."""
    if num_tables == 1:
        return one(0, indices, weights)
    if isinstance(indices, (list, tuple)):
        _args.check_table_lists(indices, weights, num_tables)
        per_weights = [None] * num_tables if weights is None else list(weights)
        return tf.stack([one(t, indices[t], per_weights[t]) for t in range(num_tables)])
    if isinstance(indices, (tf.RaggedTensor, tf.SparseTensor)):
        # A structure mismatch, a ValueError like the TT layers' own.
        raise ValueError(  # noqa: TRY004
            f"with num_tables = {num_tables}, ragged or sparse indices must be a list of "
            f"{num_tables} tensors (one per table), got one {type(indices).__name__}"
        )
    per_ids = tf.unstack(tf.convert_to_tensor(indices), num=num_tables, axis=0)
    per_weights = (
        [None] * num_tables
        if weights is None
        else tf.unstack(tf.convert_to_tensor(weights), num=num_tables, axis=0)
    )
    return tf.stack([one(t, per_ids[t], per_weights[t]) for t in range(num_tables)])


class ServingTable:
    """A table as the exported graph reads it: plain TensorFlow ops only.

    `lookup(indices, weights, combiner, padding_id)` has the semantics of the layer's own
    lookup (id forms, weights, combiners, padding, an error for ids outside [0, N)) and
    returns the combined rows in float32 (the variables' dtype for "dense" and
    "tt_rows" tables); the layer casts them to its compute dtype.
    """

    def __init__(self, summary: ExportedTable, lookup: Callable) -> None:
        self.summary = summary
        self._lookup = lookup

    def lookup(self, indices: Any, weights: Any, combiner: str, padding_id: int | None):
        """Combines the rows of each bag of `indices`; see the class docstring."""
        return self._lookup(indices, weights, combiner, padding_id)


def _dense_lookup(tables: list) -> Callable:
    def lookup(indices, weights, combiner, padding_id):
        def one(t, ids, w):
            return gather_reduce_sum(
                tables[t],
                ids,
                w,
                combiner=combiner,
                padding_id=padding_id,
                implementation="composite",
            )

        return _per_table(one, len(tables), indices, weights)

    return lookup


def _quantized_lookup(tables: list) -> Callable:
    def lookup(indices, weights, combiner, padding_id):
        def one(t, ids, w):
            return _quantized.quantized_gather_reduce_sum(
                tables[t], ids, w, combiner=combiner, padding_id=padding_id
            )

        return _per_table(one, len(tables), indices, weights)

    return lookup


def _variable(value: Any, name: str) -> tf.Variable:
    return tf.Variable(value, trainable=False, name=name)


def _float_tables(
    layer: Any, values: list, quantize: str | None, shape: tuple, dense_nbytes: int
) -> ServingTable:
    """A dense table per entry of `values` (variables or arrays), quantised or not."""
    name = re.sub(r"[^A-Za-z0-9_.\-/]", "_", layer.name)
    if quantize is None:
        # A layer's own variable is read as it is; decompressed values get a variable.
        tables = [
            _variable(v, f"{name}_table_{t}") if isinstance(v, np.ndarray) else v
            for t, v in enumerate(values)
        ]
        nbytes = sum(int(np.prod(t.shape)) * tf.as_dtype(t.dtype).size for t in tables)
        summary = ExportedTable(
            layer.name, type(layer).__name__, "dense", shape, nbytes, dense_nbytes
        )
        return ServingTable(summary, _dense_lookup(tables))
    tables = []
    for t, value in enumerate(values):
        rows = _quantized.quantize_rows(value, quantize)
        tables.append(
            _quantized.QuantizedRows(
                _variable(rows.codes, f"{name}_{quantize}_codes_{t}"),
                None if rows.scale is None else _variable(rows.scale, f"{name}_int8_scale_{t}"),
                None if rows.bias is None else _variable(rows.bias, f"{name}_int8_bias_{t}"),
            )
        )
    nbytes = sum(t.nbytes for t in tables)
    summary = ExportedTable(layer.name, type(layer).__name__, quantize, shape, nbytes, dense_nbytes)
    return ServingTable(summary, _quantized_lookup(tables))


def _tt_rows_table(layer: Any, shape: tuple, dense_nbytes: int) -> ServingTable:
    """The TT cores, rows decompressed per batch; the filled cache slots beside them."""
    cores = [getattr(c, "value", c) for c in layer.cores]
    cache_ids = cache_rows = None
    nbytes = sum(int(np.prod(c.shape)) * tf.as_dtype(c.dtype).size for c in cores)
    if layer.use_cache:
        ids, rows = layer.cache_contents()  # sorted, without the empty slots
        if ids.size:
            name = re.sub(r"[^A-Za-z0-9_.\-/]", "_", layer.name)
            cache_ids = _variable(ids.astype(np.int64), f"{name}_cache_ids")
            cache_rows = _variable(rows, f"{name}_cache_rows")
            nbytes += ids.nbytes + rows.nbytes
    options = {
        "num_embeddings": layer.num_embeddings,
        "p_shapes": layer.tt_p_shapes,
        "q_shapes": layer.tt_q_shapes,
        "ranks": layer.tt_ranks,
        "num_tables": layer.num_tables,
        "cache_ids": cache_ids,
        "cache_rows": cache_rows,
        "implementation": "composite",
    }

    def lookup(indices, weights, combiner, padding_id):
        return tt_embedding_bag(
            cores, indices, weights, combiner=combiner, padding_id=padding_id, **options
        )

    summary = ExportedTable(
        layer.name, type(layer).__name__, "tt_rows", shape, nbytes, dense_nbytes
    )
    return ServingTable(summary, lookup)


def _make_table(layer: Any, quantize: str | None, tt_dense_max_bytes: float) -> ServingTable:
    if isinstance(layer, layers.EmbeddingBag):
        table = layer.embeddings
        shape = (layer.input_dim, layer.output_dim)
        nbytes = math.prod(shape) * tf.as_dtype(table.dtype).size
        return _float_tables(layer, [table], quantize, shape, nbytes)
    if isinstance(layer, layers.ProductKeyMemory):
        table = layer.values
        shape = tuple(int(d) for d in table.shape)
        nbytes = math.prod(shape) * tf.as_dtype(table.dtype).size
        return _float_tables(layer, [table], quantize, shape, nbytes)
    if isinstance(layer, (layers.TTEmbeddingBag, layers.TableBatchedTTEmbeddingBag)):
        rows = (layer.num_embeddings, layer.embedding_dim)
        shape = rows if isinstance(layer, layers.TTEmbeddingBag) else (layer.num_tables,) + rows
        itemsize = tf.as_dtype(layer.cores[0].dtype).size
        dense_nbytes = math.prod(shape) * itemsize
        if dense_nbytes > tt_dense_max_bytes:
            return _tt_rows_table(layer, shape, dense_nbytes)
        full = layer.full_weight().numpy()
        values = [full] if isinstance(layer, layers.TTEmbeddingBag) else list(full)
        return _float_tables(layer, values, quantize, shape, dense_nbytes)
    raise TypeError(f"no serving table for a {type(layer).__name__} layer")


class _ExportSession:
    """The substitutes of one export, made on a layer's first lookup (eagerly)."""

    def __init__(self, quantize: str | None, tt_dense_max_bytes: float) -> None:
        self.quantize = quantize
        self.tt_dense_max_bytes = tt_dense_max_bytes
        self.tables: dict = {}  # id(layer) -> (layer, ServingTable)

    def table_for(self, layer: Any) -> ServingTable:
        key = id(layer)
        if key not in self.tables:
            # Variables and the decompressed or quantised values are made eagerly, outside
            # the graph being traced, and then captured by it.
            with tf.init_scope():
                table = _make_table(layer, self.quantize, self.tt_dense_max_bytes)
            self.tables[key] = (layer, table)
        return self.tables[key][1]


# ----------------------------------------------------------------------------------------
# Inputs and signatures.


@dataclasses.dataclass
class _Input:
    name: str  # signature key stem
    dtype: tf.DType
    shape: tf.TensorShape
    declared: str  # "dense", "ragged" or "sparse"
    bag: bool = False

    def spec(self, form: str) -> Any:
        """The structured spec of this input in `form` (bag inputs) or as declared."""
        form = form if self.bag else self.declared
        if form == "ragged":
            return tf.RaggedTensorSpec(
                [self.shape[0], None],
                self.dtype,
                ragged_rank=1,
                row_splits_dtype=tf.int64,
            )
        if form == "sparse":
            return tf.SparseTensorSpec(self.shape, self.dtype)
        return tf.TensorSpec(self.shape, self.dtype)

    def flat_specs(self, form: str) -> list:
        """The signature's tensors of this input in `form`: TensorSpecs named by key."""
        form = form if self.bag else self.declared
        if form == "ragged":
            return [
                tf.TensorSpec([None], self.dtype, name=f"{self.name}_values"),
                tf.TensorSpec([None], tf.int64, name=f"{self.name}_row_splits"),
            ]
        if form == "sparse":
            return [
                tf.TensorSpec([None, 2], tf.int64, name=f"{self.name}_indices"),
                tf.TensorSpec([None], self.dtype, name=f"{self.name}_values"),
                tf.TensorSpec([2], tf.int64, name=f"{self.name}_dense_shape"),
            ]
        return [tf.TensorSpec(self.shape, self.dtype, name=self.name)]

    def to_model(self, form: str, value: Any) -> Any:
        """The value the model receives for this input in `form`.

        A sparse bag input the model does not declare sparse is handed over as the
        equivalent `tf.RaggedTensor` (each row's stored values, in column order): a Keras
        functional model densifies a SparseTensor for such an input (missing entries
        becoming id 0), which would change the bags.
        """
        if not (self.bag and form == "sparse" and self.declared != "sparse"):
            return value
        with tf.control_dependencies(_bags.sparse_bounds_check(value)):
            ordered = tf.sparse.reorder(value)
        return tf.RaggedTensor.from_value_rowids(
            ordered.values, ordered.indices[:, 0], nrows=value.dense_shape[0]
        )

    def rebuild(self, form: str, tensors: list) -> Any:
        """The structured input from this input's signature tensors (validated)."""
        form = form if self.bag else self.declared
        if form == "ragged":
            return tf.RaggedTensor.from_row_splits(tensors[0], tensors[1], validate=True)
        if form == "sparse":
            return tf.SparseTensor(tensors[0], tensors[1], tensors[2])
        return tensors[0]


def _key(name: Any, fallback: str, taken: set) -> str:
    """A signature key from `name`: letters, digits and underscores, unique in `taken`."""
    key = re.sub(r"[^A-Za-z0-9_]", "_", str(name or "")).strip("_") or fallback
    if key[0].isdigit():
        key = f"{fallback}_{key}"
    unique, n = key, 1
    while unique in taken:
        unique, n = f"{key}_{n}", n + 1
    taken.add(unique)
    return unique


def _describe_leaf(leaf: Any, index: int, taken: set) -> _Input:
    declared = "dense"
    if isinstance(leaf, tf.RaggedTensorSpec):
        declared = "ragged"
    elif isinstance(leaf, tf.SparseTensorSpec):
        declared = "sparse"
    elif isinstance(leaf, tf.TensorSpec):
        pass
    elif hasattr(leaf, "shape") and hasattr(leaf, "dtype"):  # a Keras symbolic input
        declared = (
            "ragged"
            if getattr(leaf, "ragged", False)
            else ("sparse" if getattr(leaf, "sparse", False) else "dense")
        )
    else:
        raise ValueError(
            "input_specs must hold tf.TensorSpec, tf.RaggedTensorSpec or tf.SparseTensorSpec "
            f"(nested lists, tuples or dicts of them allowed), got {leaf!r}"
        )
    name = _key(getattr(leaf, "name", None), f"input_{index}", taken)
    shape = tf.TensorShape(leaf.shape)
    if shape.rank is None:
        raise ValueError(f"input {name!r} needs a known rank, got shape {shape}")
    return _Input(name, tf.as_dtype(leaf.dtype), shape, declared)


def _model_inputs(model: Any, input_specs: Sequence[Any] | None) -> tuple:
    """(positional arguments as a structure of leaves, the flat leaves)."""
    if input_specs is None:
        structure = getattr(model, "inputs", None)
        if not structure:
            raise ValueError(
                f"{type(model).__name__} has no symbolic inputs (it is not a functional or "
                "Sequential model built on keras.Input): pass input_specs, the specs of the "
                "positional arguments of its call"
            )
        args = (model.input,)
    else:
        if isinstance(input_specs, (tf.TensorSpec, tf.RaggedTensorSpec, tf.SparseTensorSpec)):
            raise ValueError(
                "input_specs must be a sequence of specs, one per positional argument of the "
                f"model's call, got one {type(input_specs).__name__}: wrap it in a list"
            )
        args = tuple(input_specs)
    return args, tf.nest.flatten(args)


def saved_model_op_types(path: str | os.PathLike) -> set:
    """Every op type in a SavedModel's graphs and function libraries (read from its proto).

    Example:

    >>> import tempfile
    >>> import tensorflow as tf
    >>> from tf_ttemb.serving import saved_model_op_types
    >>> module = tf.Module()
    >>> module.f = tf.function(lambda x: x * 2.0, input_signature=[tf.TensorSpec([None])])
    >>> path = tempfile.mkdtemp()
    >>> tf.saved_model.save(module, path)
    >>> "Mul" in saved_model_op_types(path)
    True
    """
    from tensorflow.core.protobuf import saved_model_pb2

    proto = saved_model_pb2.SavedModel()
    with open(os.path.join(os.fspath(path), "saved_model.pb"), "rb") as handle:
        proto.ParseFromString(handle.read())
    types: set = set()
    for meta_graph in proto.meta_graphs:
        types |= _op_types(meta_graph.graph_def)
    return types


def _op_types(graph_def: Any) -> set:
    """Every op type of a GraphDef: its nodes and the nodes of its function library."""
    types = {node.op for node in graph_def.node}
    for function in graph_def.library.function:
        types.update(node.op for node in function.node_def)
    return types


# ----------------------------------------------------------------------------------------
# Public API.


def export_for_serving(
    model: Any,
    path: str | os.PathLike,
    *,
    input_specs: Sequence[Any] | None = None,
    forms: Sequence[str] | None = None,
    bag_inputs: Sequence[str] | None = None,
    quantize: str | None = None,
    tt_dense_max_mib: float = DEFAULT_TT_DENSE_MAX_MIB,
) -> ServingExport:
    """Writes an inference-only SavedModel of `model` that needs no op library.

    The graph holds stock TensorFlow ops only (checked before writing): a process that
    never imports tf_ttemb, TF Serving or a managed platform loads and serves it. Each
    tf_ttemb layer reads its table through a plain-TensorFlow substitute (see the module
    docstring and `ServingExport.tables`); the rest of the model is traced as is, with
    `training=False`, so the served outputs are the model's inference outputs (equal to
    the custom-op model's up to float rounding, or to the quantisation error with
    `quantize`).

    Signatures, one per id form of `forms` (the first is also "serving_default"):

    * `serve_dense`: each bag input as a dense tensor `<name>` ([batch, L]);
    * `serve_ragged`: each bag input as `<name>_values` and `<name>_row_splits` (int64)
      of a `tf.RaggedTensor` [batch, (L)] (validated: bad splits raise);
    * `serve_sparse`: each bag input as `<name>_indices` ([nnz, 2] int64), `<name>_values`
      and `<name>_dense_shape` ([2] int64) of a `tf.SparseTensor` [batch, L], any order:
      row b's stored values are bag b, as the layers read sparse ids. A model input not
      declared sparse (`keras.Input(sparse=True)`) receives the equivalent
      `tf.RaggedTensor`, since a Keras functional model would densify a SparseTensor
      there (missing entries becoming id 0). Coordinates outside `dense_shape` raise.

    Other inputs (dense features, a product-key memory's float input) are tensors
    `<name>` in every signature. Names are the model's input names (Keras `Input(name=)`)
    or the specs' names, else `input_<i>`. Every signature returns a dict of the model's
    outputs (its output names, else `output_<i>`). The loaded SavedModel object also has
    functions `serve_dense`, `serve_ragged` and `serve_sparse` (those of `forms`) that
    take the inputs as the model does (a `tf.RaggedTensor` or `tf.SparseTensor` per bag input,
    same positional structure), for Python callers of `tf.saved_model.load`.

    Ids outside a table's rows that are not its layer's `padding_id` make every
    signature raise `InvalidArgumentError` (`indices[3] = 99 is not in [0, 50)`); they
    are never clamped or read out of bounds. Padding ids are skipped as in the layer.

    `TTEmbeddingBag` / `TableBatchedTTEmbeddingBag` size rule: a TT layer whose dense
    table (`num_tables * num_embeddings * embedding_dim` elements of its variable dtype)
    is at most `tt_dense_max_mib` MiB is exported decompressed (`full_weight()`: one
    gather per id when served, the fastest path); a larger one keeps its cores and
    decompresses the rows of each batch (T - 1 small matmuls per distinct id; the
    SavedModel stays as small as the cores). A row cache is folded in either way: its
    rows replace theirs in the dense table, or are kept beside the cores and served for
    their ids, as the layer does in inference.

    Args:
      model: A built Keras model (or layer) holding tf_ttemb layers.
      path: The SavedModel directory to write.
      input_specs: The specs of the positional arguments of the model's call
        (`tf.TensorSpec`, `tf.RaggedTensorSpec`, `tf.SparseTensorSpec`; nested lists,
        tuples or dicts allowed), with a `None` batch dimension; give them names for the
        signature keys. None for a functional or Sequential model: its symbolic inputs.
      forms: The id forms to write signatures for, from "dense", "ragged", "sparse".
        None: all three, or only "dense" when the model has no bag input.
      bag_inputs: Names of the inputs that take the signature's id form. None: every
        input of rank 2 ([batch, L]) with an integer dtype, and every input the model or
        `input_specs` declares ragged or sparse. Pass the names when a rank-2 integer
        input is not a bag of ids (e.g. token ids of a sequence model: `bag_inputs=()`).
      quantize: None (tables exported as they are), "int8" (8-bit rows with a float32
        scale and bias per row: `codes * scale + bias`, an error of at most half a step
        of the row's range / 255 per element) or "float16". Applies to every dense
        table exported: `EmbeddingBag` tables, `ProductKeyMemory` values and TT tables
        decompressed to dense; TT cores stay as they are. Outputs are then float32 from
        the dequantised rows.
      tt_dense_max_mib: The size rule above, in MiB (0: always keep the cores;
        `float("inf")`: always decompress).

    Returns:
      A `ServingExport`: the signatures' input keys, the output keys and how each
      table was exported, with its size.

    Raises:
      ValueError: For a model that is not built, missing `input_specs`, unknown forms,
        bag inputs or quantize mode, a bag input that is not [batch, L], a form the model
        cannot be traced with (the tracing error is chained), or a graph that still holds
        tf_ttemb custom ops (a `tf_ttemb.gather_reduce_sum` called directly in the model:
        pass `implementation="composite"` there).

    Example:

    >>> import tempfile
    >>> import keras
    >>> import tensorflow as tf
    >>> import tf_ttemb
    >>> ids = keras.Input(shape=(None,), dtype="int64", ragged=True, name="ids")
    >>> bag = tf_ttemb.layers.EmbeddingBag(1000, 8, combiner="mean", padding_id=-1)
    >>> model = keras.Model(ids, keras.layers.Dense(1, name="score")(bag(ids)))
    >>> path = tempfile.mkdtemp()
    >>> export = tf_ttemb.export_for_serving(model, path, quantize="int8")
    >>> export.signatures["serve_ragged"]
    ('ids_values', 'ids_row_splits')
    >>> export.tables[0].kind, export.tables[0].nbytes   # 1000 x (8 + 4 + 4) bytes
    ('int8', 16000)
    >>> served = tf.saved_model.load(path).signatures["serve_ragged"](
    ...     ids_values=tf.constant([3, 7, -1, 999], tf.int64),
    ...     ids_row_splits=tf.constant([0, 3, 4], tf.int64))
    >>> served["score"].shape
    TensorShape([2, 1])
    """
    _args.check_choice("quantize", quantize, QUANTIZE_MODES)
    if (
        isinstance(tt_dense_max_mib, bool)
        or not isinstance(tt_dense_max_mib, numbers.Real)
        or math.isnan(tt_dense_max_mib)
        or tt_dense_max_mib < 0
    ):
        raise ValueError(f"tt_dense_max_mib must be a number >= 0, got {tt_dense_max_mib!r}")
    if not getattr(model, "built", False):
        raise ValueError(
            f"the model must be built before it is exported (call it once, or build it), "
            f"got an unbuilt {type(model).__name__}"
        )
    args, leaves = _model_inputs(model, input_specs)
    taken: set = set()
    inputs = [_describe_leaf(leaf, i, taken) for i, leaf in enumerate(leaves)]
    if bag_inputs is None:
        for item in inputs:
            item.bag = item.declared != "dense" or (item.dtype.is_integer and item.shape.rank == 2)
    else:
        if isinstance(bag_inputs, str):
            bag_inputs = [bag_inputs]
        names = {item.name for item in inputs}
        unknown = [n for n in bag_inputs if n not in names]
        if unknown:
            raise ValueError(
                f"bag_inputs {unknown} are not inputs of the model; its inputs are {sorted(names)}"
            )
        for item in inputs:
            item.bag = item.name in set(bag_inputs)
    for item in inputs:
        if item.bag and item.shape.rank != 2:
            raise ValueError(
                f"bag input {item.name!r} must be [batch, L] (rank 2), got shape {item.shape}; "
                "name the bag inputs with bag_inputs="
            )
    has_bags = any(item.bag for item in inputs)
    if forms is None:
        forms = FORMS if has_bags else ("dense",)
    if isinstance(forms, str):
        forms = [forms]
    forms = tuple(forms)
    if not forms or len(set(forms)) != len(forms):
        raise ValueError(f"forms must be a non-empty list of distinct forms, got {list(forms)}")
    for form in forms:
        _args.check_choice("forms entry", form, FORMS)
    if not has_bags and forms != ("dense",):
        raise ValueError(
            f"forms {list(forms)} need bag inputs, but the model has none (inputs: "
            f"{[item.name for item in inputs]})"
        )

    session = _ExportSession(quantize, float(tt_dense_max_mib) * _MIB)
    module = tf.Module()
    signatures: dict = {}
    signature_keys: dict = {}
    output_keys: tuple = ()
    variables: dict = {}
    with _serving_hook.exporting(session):
        for form in forms:
            structured = tf.nest.pack_sequence_as(args, [item.spec(form) for item in inputs])

            serve_fn = tf.function(
                _serve_function(model, inputs, form), input_signature=list(structured)
            )
            try:
                concrete = serve_fn.get_concrete_function()
            except Exception as error:
                raise ValueError(
                    f"the model cannot be traced with {form} bag inputs "
                    f"({[i.name for i in inputs if i.bag]}): {type(error).__name__}: {error}. "
                    "Pass forms= without it, or bag_inputs= naming the bag inputs."
                ) from error
            output_keys = _output_keys(model, concrete.structured_outputs)
            flat_specs = [spec for item in inputs for spec in item.flat_specs(form)]
            sizes = [len(item.flat_specs(form)) for item in inputs]
            signature = _signature_function(
                serve_fn, args, inputs, form, flat_specs, sizes, output_keys
            )
            # The concrete function, not the tf.function: saving would trace that again.
            setattr(module, f"serve_{form}", concrete)
            signatures[f"serve_{form}"] = signature
            signature_keys[f"serve_{form}"] = tuple(s.name for s in flat_specs)
            for variable in list(concrete.variables) + list(signature.variables):
                variables[id(variable)] = variable
        custom = sorted(
            {
                op
                for f in signatures.values()
                for op in _op_types(f.graph.as_graph_def())
                if op.startswith(_CUSTOM_OP_PREFIX)
            }
        )
        if custom:
            raise ValueError(
                f"the traced model still holds tf_ttemb custom ops {custom}: something in it "
                "calls tf_ttemb ops directly (not through a tf_ttemb layer); pass "
                "implementation='composite' there"
            )
        module.serving_variables = list(variables.values())
        first = f"serve_{forms[0]}"
        path = os.fspath(path)
        # Still substituting, should saving trace anything again.
        tf.saved_model.save(
            module,
            path,
            signatures={"serving_default": signatures[first], **signatures},
            # Inference only: the composite lookups' gradient functions are not written.
            options=tf.saved_model.SaveOptions(experimental_custom_gradients=False),
        )
    custom = sorted(op for op in saved_model_op_types(path) if op.startswith(_CUSTOM_OP_PREFIX))
    if custom:
        raise ValueError(
            f"the SavedModel written to {path} holds tf_ttemb custom ops {custom}; it cannot "
            "be served without the op library"
        )
    keys = {"serving_default": signature_keys[first], **signature_keys}
    tables = tuple(table.summary for _, table in session.tables.values())
    return ServingExport(path, keys, output_keys, tables)


def _output_keys(model: Any, outputs: Any) -> tuple:
    if isinstance(outputs, dict):
        names = [str(k) for k in outputs]
    else:
        flat = tf.nest.flatten(outputs)
        names = list(getattr(model, "output_names", None) or [])
        if len(names) != len(flat):
            names = [f"output_{i}" for i in range(len(flat))]
    taken: set = set()
    return tuple(_key(n, f"output_{i}", taken) for i, n in enumerate(names))


def _serve_function(model: Any, inputs: list, form: str) -> Callable:
    """The model's inference call on inputs of `form` (sparse bags made ragged if need be)."""

    def serve(*call_args):
        leaves = tf.nest.flatten(call_args)
        leaves = [item.to_model(form, value) for item, value in zip(inputs, leaves)]
        return model(*tf.nest.pack_sequence_as(call_args, leaves), training=False)

    return serve


def _signature_function(serve_fn, args, inputs, form, flat_specs, sizes, output_keys):
    """The signature of `form`: flat named tensors in, a dict of named outputs out."""

    def signature(*tensors):
        leaves, start = [], 0
        for item, size in zip(inputs, sizes):
            leaves.append(item.rebuild(form, list(tensors[start : start + size])))
            start += size
        outputs = serve_fn(*tf.nest.pack_sequence_as(args, leaves))
        values = list(outputs.values()) if isinstance(outputs, dict) else tf.nest.flatten(outputs)
        return dict(zip(output_keys, values))

    return tf.function(signature, input_signature=flat_specs).get_concrete_function()
