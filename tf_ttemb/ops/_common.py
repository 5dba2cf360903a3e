"""What every lookup of tf_ttemb shares: the choices, the dtype sets and the accumulation
dtype, the argument checks, the resource-variable probe and the XLA/TPU probes.

Also what the layers share: the checks of their constructors, their `get_config`, the start
of their lookups and the in-place row updates of their fused optimizers.

Private to the package (its names are used by `tf_ttemb.ops`, `tf_ttemb.distribute`,
`tf_ttemb.serving`, the layers and the optimizers); not an API.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import threading
from collections.abc import Callable, Sequence
from typing import Any, Optional

import tensorflow as tf

from tf_ttemb import _args, _serving_hook

COMBINERS = ("sum", "mean", "sqrtn", "max")


IMPLEMENTATIONS = ("auto", "custom_op", "composite")


HALF_TYPES = (tf.float16, tf.bfloat16)


def accumulation_dtype(dtype: tf.DType) -> tf.DType:
    """The dtype sums over a table of `dtype` accumulate in: float32 for the half types."""
    return tf.float32 if dtype in HALF_TYPES else dtype


VALUE_TYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)


IndicesLike = tf.Tensor | tf.RaggedTensor | tf.SparseTensor | Sequence


def int_ids(ids: tf.Tensor, what: str) -> tf.Tensor:
    if ids.dtype in (tf.int32, tf.int64):
        return ids
    if ids.dtype.is_integer:
        return tf.cast(ids, tf.int64)
    raise TypeError(f"{what} must be an integer tensor, got dtype {ids.dtype.name}")


_GPUS_VISIBLE: list = []


def gpus_visible() -> bool:
    """Whether TensorFlow sees a GPU (asked once per process: the answer cannot change
    after TensorFlow has initialised its devices)."""
    if not _GPUS_VISIBLE:
        _GPUS_VISIBLE.append(bool(tf.config.list_physical_devices("GPU")))
    return _GPUS_VISIBLE[0]


_EAGER_CACHE: collections.OrderedDict = collections.OrderedDict()
_EAGER_CACHE_LOCK = threading.Lock()
EAGER_CACHE_BYTES = 32 << 20  # kept in all, most recently used first


def eager_constant(key: tuple, device: str, make: Callable[[], tf.Tensor]) -> tf.Tensor:
    """`make()` on `device`, made once per (key, device) in eager mode and kept (the most
    recently used, up to 32 MiB in all): a small constant input (row_splits of a dense
    batch, an empty weights or index vector) costs more to create per call, 30-45 µs of
    Python, than the lookup's whole wrapper should. In a graph, `make()` itself (it
    becomes a constant node)."""
    if not tf.executing_eagerly():
        return make()
    full_key = (key, device)
    with _EAGER_CACHE_LOCK:
        hit = _EAGER_CACHE.get(full_key)
        if hit is not None:
            _EAGER_CACHE.move_to_end(full_key)
            return hit[0]
    with tf.device(device or None):
        value = make()
    size = value.shape.num_elements() * value.dtype.size
    if size > EAGER_CACHE_BYTES // 4:
        return value
    with _EAGER_CACHE_LOCK:
        _EAGER_CACHE[full_key] = (value, size)
        total = sum(entry[1] for entry in _EAGER_CACHE.values())
        while total > EAGER_CACHE_BYTES:
            total -= _EAGER_CACHE.popitem(last=False)[1][1]
    return value


def eager_cache_entries() -> list:
    """(key, bytes) of each kept constant, least recently used first."""
    with _EAGER_CACHE_LOCK:
        return [(key, size) for (key, _), (_, size) in _EAGER_CACHE.items()]


def empty(dtype: tf.DType, device: str = "") -> tf.Tensor:
    """A [0] tensor of `dtype` (cached in eager mode, see `eager_constant`)."""
    return eager_constant(("empty", dtype), device, lambda: tf.zeros([0], dtype))


def after_checks(checks: list, tensor: tf.Tensor) -> tf.Tensor:
    """`tensor`, made to wait for `checks` only where nothing else runs them.

    Eagerly the checks have already run, and inside a `tf.function` TensorFlow runs every
    stateful op (an assert, `CheckBagReport`) and fails the call with its error, so the
    lookup need not wait for them: on a GPU a check whose verdict must come back to the
    host then costs no latency. A TF1 graph (`tf.compat.v1` sessions) runs only what a
    fetch depends on, so there `tensor` depends on the checks.
    """
    if not checks or tf.compat.v1.executing_eagerly_outside_functions():
        return tensor
    with tf.control_dependencies(checks):
        return tf.identity(tensor)


def static_or_dynamic(static: int | None, dynamic: tf.Tensor):
    return static if static is not None else dynamic


def tape_may_record() -> bool:
    """Whether a `tf.GradientTape` (or forward accumulator) may be recording on this
    thread. TensorFlow answers this only under `tensorflow.python`; where that probe is
    missing, the answer is yes (the caller then does what a recording tape needs)."""
    try:
        from tensorflow.python.eager import record  # no public equivalent
    except ImportError:  # pragma: no cover -- a TensorFlow without the probe
        return True
    probe = getattr(record, "could_possibly_record", None)
    return True if probe is None else bool(probe())


def on_host(xla: bool = False):
    """A device scope for the few int64 values an op reads in host memory (row counts,
    table splits): the host CPU, or under XLA wherever the cluster runs.

    `Shape` and `VariableShape` leave a GPU tensor's shape in host memory. An int64
    `StridedSlice` or `Stack` of it placed on the GPU would copy it to the device (behind
    the kernels already queued, so it waits for them) and copy the result back to the
    op that reads it on the host: that op's launches would start only once the GPU had
    run everything before them, instead of beside it.
    """
    return contextlib.nullcontext() if xla else tf.device("/device:CPU:0")


def shape_dim_on_host(shape: tf.Tensor, axis: int = 0) -> tf.Tensor:
    """`shape[axis]` of a shape vector, sliced on the host (see `on_host`)."""
    with on_host():
        return shape[axis]


def in_xla_context() -> bool:
    """Whether ops built now will be compiled by XLA (e.g. in `tf.function(jit_compile=True)`).

    TensorFlow has no public API for this; `tf.__internal__.get_enclosing_xla_context` is the
    narrowest one it exports (TensorFlow's own losses use it), so it is isolated here.
    """
    if tf.executing_eagerly():
        return False
    get_context = getattr(tf.__internal__, "get_enclosing_xla_context", None)
    return get_context is not None and get_context() is not None


def on_tpu(params: tf.Tensor) -> bool:
    """Whether the computation runs on a TPU (TPUStrategy, or params placed on a TPU)."""
    if tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
        if isinstance(
            strategy, (tf.distribute.TPUStrategy, tf.distribute.experimental.TPUStrategy)
        ):
            return True
    device = getattr(params, "device", "") or ""
    return ":TPU:" in device


def check_lookup_args(
    combiner: str, weights: Any, padding_id: Any, implementation: str | None = None
) -> int | None:
    """Checks the arguments every lookup of the package shares; returns padding_id as an int.

    Raises ValueError naming the argument: a combiner not in COMBINERS, weights with
    "max", a padding_id that is not None or an integer in int64's range, or (when given)
    an implementation not in IMPLEMENTATIONS.
    """
    _args.check_choice("combiner", combiner, COMBINERS)
    if implementation is not None:
        _args.check_choice("implementation", implementation, IMPLEMENTATIONS)
    if combiner == "max" and weights is not None:
        raise ValueError("combiner 'max' does not take weights")
    if padding_id is None:
        return None
    value = _args.as_integer(padding_id)
    if value is None:
        raise ValueError(f"padding_id must be an integer or None, got {padding_id!r}")
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"padding_id must be in int64's range [-2**63, 2**63), got {value}")
    return value


def check_table(shape: tf.TensorShape, dtype: tf.DType, what: str = "params") -> None:
    """Raises a ValueError unless `shape` is that of a matrix [N, D] (or of unknown rank),
    and a TypeError unless `dtype` is one of VALUE_TYPES."""
    if shape.rank is not None and shape.rank != 2:
        raise ValueError(f"{what} must be a matrix [N, D], got shape {shape}")
    if dtype not in VALUE_TYPES:
        raise TypeError(f"{what} must be float16, bfloat16, float32 or float64, got {dtype.name}")


def resource_variable(params) -> Optional[tf.Variable]:
    """The resource variable behind `params` (a `tf.Variable` or a Keras variable), or None.

    Reading a variable as a tensor copies the whole table once the variable has been
    updated sparsely (TensorFlow then keeps it in copy-on-read mode), so the custom op
    reads such variables in place through their handle instead. A Keras variable that is
    being autocast (mixed precision) is read as a tensor in its compute dtype.
    """
    if not isinstance(params, tf.Variable):
        try:
            params = params.value  # a Keras variable wraps a tf.Variable
        except AttributeError:
            return None
        if not isinstance(params, tf.Variable):
            return None
    if isinstance(params, tf.distribute.DistributedValues):
        return replica_local_variable(params)
    try:
        handle = params.handle
    except (AttributeError, ValueError):
        return None
    if not isinstance(handle, tf.Tensor) or handle.dtype != tf.resource:
        return None
    return params


def replica_local_variable(variable) -> Optional[tf.Variable]:
    """The component of a distributed variable (MirroredVariable, ...) this replica reads.

    Inside `strategy.run` a distributed variable's `handle` is the handle of the replica's
    own copy; the copy itself is the one among `strategy.experimental_local_results` with
    that very handle. Reading through that copy's handle lets the custom op read the
    replica's table in place, and gradients w.r.t. the distributed variable (which tapes
    take w.r.t. that same handle) flow to it. Elsewhere (cross-replica context, packed
    variables) this gives None and the caller reads the variable as a tensor, which a
    distributed variable resolves to the right copy.
    """
    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return None
    try:
        handle = variable.handle
    except (AttributeError, ValueError):
        return None
    for component in tf.distribute.get_strategy().experimental_local_results(variable):
        if (
            isinstance(component, tf.Variable)
            and not isinstance(component, tf.distribute.DistributedValues)
            and getattr(component, "handle", None) is handle
        ):
            return component
    return None


# ----------------------------------------------------------------------------------------
# What the layers share.


def check_keras_backend(layer: str, backend: str) -> None:
    """Raises a ValueError naming `layer` unless `backend` (`keras.backend.backend()`) is
    TensorFlow's: the layers run the package's TensorFlow ops."""
    if backend != "tensorflow":
        raise ValueError(f"{layer} needs the TensorFlow backend of Keras, got {backend!r}")


def add_update_trigger(layer: Any, name: str) -> Any:
    """A layer's empty trainable weight (shape [0]) for a fused update. The backward pass of
    a lookup runs only when some trainable variable depends on it; this one does, and its
    (empty) gradient is what carries the update of the tables, applied in place."""
    return layer.add_weight(
        name=name, shape=(0,), initializer="zeros", trainable=True, autocast=False
    )


def constructor_config(layer: Any, owner: type, **special: Any) -> dict:
    """The `get_config` entries of `layer`'s class `owner`: each argument of `owner`'s
    constructor (but `*args` and `**kwargs`), the value given in `special` or else the
    layer's attribute of that name (a list copied)."""
    config = {}
    for name, parameter in inspect.signature(owner.__init__).parameters.items():
        if name == "self" or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        value = special[name] if name in special else getattr(layer, name)
        config[name] = list(value) if isinstance(value, list) else value
    return config


def serving_lookup(layer: Any, indices: Any, weights: Any) -> tf.Tensor | None:
    """The start of a bag layer's lookup (its `combiner`, `padding_id` and
    `compute_dtype`): raises for weights with combiner "max"; while
    `tf_ttemb.export_for_serving` traces the model, the lookup in the table it substitutes
    for the layer's (in the compute dtype), else None (the layer reads its own table)."""
    if layer.combiner == "max" and weights is not None:
        raise ValueError("combiner 'max' does not take weights")
    substitute = _serving_hook.serving_table(layer)
    if substitute is None:
        return None
    output = substitute.lookup(indices, weights, layer.combiner, layer.padding_id)
    return tf.cast(output, layer.compute_dtype)


def deduplicated_rows(variable: Any, grad: Any, densify_under_xla: bool = True) -> tuple:
    """`grad` of `variable` made ready for an in-place update of the rows it touches.

    Returns `(grad, indices, values)`. For a `tf.IndexedSlices` gradient: its indices
    (int64) and values (in the variable's dtype), duplicates summed first; under XLA,
    where `tf.unique` does not compile, as they are, or with `densify_under_xla` summed
    into a dense gradient of every row, returned as `grad`. A dense gradient comes back
    as it is.
    """
    if not isinstance(grad, tf.IndexedSlices):
        return grad, None, None
    indices = tf.cast(grad.indices, tf.int64)
    values = tf.cast(grad.values, variable.dtype)
    if not in_xla_context():
        indices, position = tf.unique(indices)
        values = tf.math.unsorted_segment_sum(values, position, tf.shape(indices)[0])
    elif densify_under_xla:
        rows = tf.shape(variable, out_type=tf.int64)[0]
        grad = tf.math.unsorted_segment_sum(values, indices, rows)
    return grad, indices, values


def accumulated(accumulator: Any, squares: tf.Tensor, indices: tf.Tensor | None = None):
    """Adds `squares` to the rows `indices` of `accumulator` (all of it when None) in
    place; returns those rows (all of it) once updated."""
    if indices is None:
        added = accumulator.assign_add(squares)
        with tf.control_dependencies([added]):
            return accumulator.read_value()
    added = accumulator.scatter_add(tf.IndexedSlices(squares, indices))
    with tf.control_dependencies([added]):
        return accumulator.sparse_read(indices)
